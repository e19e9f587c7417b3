//! The controller: one level-triggered loop, leader only.
//!
//! ```text
//! watch events ─▶ Notify (coalescing) ─┐
//! resync timer / retry backoff ────────┼─▶ sync: refresh view if stale → desired (pure)
//! leadership (Lease) ──────────────────┘        → diff (pure) → batched writes → record
//! ```
//! Kubernetes events only trigger; every sync recomputes everything from the caches, so a
//! missed or duplicated event cannot leave anything behind.

pub mod desired;
pub mod diff;
pub mod metrics;
pub mod record;
pub mod status;
pub mod sync;
pub mod view;

pub use sync::{Controller, ControllerSettings};
