//! The controller: one level-triggered loop, leader only.
//!
//! ```text
//! watch events ─▶ Notify (coalescing) ─┐
//! resync / grace expiry / backoff ─────┼─▶ sync: refresh view if stale → desired (pure)
//! leadership (Lease) ──────────────────┘   → decide (pure) → SPIRE writer → decide workloads
//!                                          → Deployment/Event/status writers
//! ```
//! Kubernetes events only trigger; every sync recomputes everything from the caches, so a
//! missed or duplicated event cannot leave anything behind.

pub mod decide;
pub mod desired;
pub mod events;
pub mod metrics;
pub mod record;
pub mod status;
pub mod sync;
pub mod view;
pub mod writer;

pub use sync::{Controller, ControllerSettings};
