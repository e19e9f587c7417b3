//! Test bed shared by every integration test: real etcd + kube-apiserver and a real
//! spire-server + spire-agent, built by `tests/testenv/build.sh` and started here.
//!
//! ```text
//!  Stack ── KubePlane ── etcd (loopback, temp data dir)
//!        │           └── kube-apiserver (rcgen certs, RBAC, admin client cert → kubeconfig)
//!        └── Spire ───── spire-server (SQLite, analyzed SQLite or PostgreSQL on request; join_token, admin UDS + TCP)
//!                    └── spire-agent (join token, unix workload attestor, Workload API UDS)
//!  on request (Stack::start_with_node):
//!        └── Node ────── containerd + kubelet + kube-scheduler (node.rs)
//!                    └── spire-agent DaemonSet Pod (k8s_psat, k8s workload attestor; node_agent.rs)
//! ```
//! Every child runs in its own process group, is stopped by `Stack::stop` (or `Drop`), and is
//! also watched by a sentinel that kills it when the test binary exits for any reason.
#![allow(dead_code, unused_imports)]

pub mod apply_to_svid;
pub mod args;
pub mod certs;
pub mod k8s;
pub mod kube_plane;
pub mod node;
pub mod node_agent;
pub mod paths;
pub mod postgres;
pub mod process;
pub mod proxy;
pub mod realistic;
pub mod registrar;
pub mod reports;
pub mod sampler;
pub mod scale;
pub mod scale_phases;
pub mod spire;
pub mod sqlite;
pub mod stack;
pub mod views;
pub mod world;

pub use stack::Stack;
