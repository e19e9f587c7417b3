//! spiffe-registrar: gives every in-scope Kubernetes Deployment a SPIFFE identity by keeping
//! SPIRE registration entries in step with the cluster.
//!
//! Layers, each depending only on those above it:
//! `names`, `metadata_patch`, `spire::types` → `policy` (pure) → `index` (caches) → `webhook`, `spire` client,
//! `certs` → `run` (wiring) → `main.rs`.
#![forbid(unsafe_code)]

pub mod certs;
pub mod config;
pub mod controller;
pub mod index;
pub mod keys;
pub mod leader;
pub mod metadata_patch;
pub mod names;
pub mod policy;
pub mod run;
pub mod spire;
pub mod supervise;
pub mod telemetry;
pub mod uninstall;
pub mod version;
pub mod webhook;
