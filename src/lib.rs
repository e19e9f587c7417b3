//! spiffe-registrar: gives every in-scope Kubernetes Deployment a SPIFFE identity by keeping
//! SPIRE registration entries in step with the cluster.
//!
//! Layers, lowest first; a module imports only from its own layer or those below, never from
//! a sibling at its layer in another module, and no two modules import each other
//! (`tests/structure.rs` holds the code to this, with the table of layers):
//!
//! ```text
//! 0  names, version, metadata_patch, supervise, telemetry   vocabulary and process plumbing
//! 1  spire                                                    Entry API types, IDs, client
//! 2  keys, then policy                                        workload kinds and grouping keys; CRD, selection, rendering (pure)
//! 3  index, certs, leader                                     caches; webhook certificates; the Lease
//! 4  controller | webhook                                     the two halves, neither importing the other
//!      controller: desired → decide → status, policy_notes, pace (pure)
//!                  → view, events → record → writer → policy_effects (I/O)
//!                  → state → health, sync, apply → leading, preview (wiring)
//! 5  config                                                   flags, validated once
//! 6  run, then uninstall                                      wiring; `main.rs` is the CLI
//! ```
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
