//! The controller: one level-triggered loop, leader only.
//!
//! ```text
//! watch events ─▶ Notify (coalescing) ─┐
//! resync / grace expiry / backoff ─────┼─▶ leading: wake ─▶ sync: refresh view if stale
//! leadership (Lease) ──────────────────┘   → desired (pure) → decide (pure) → apply (SPIRE)
//!                                          → workload writer, policy effects (Kubernetes)
//! ```
//! Kubernetes events only trigger; every sync recomputes everything from the caches, so a
//! missed or duplicated event cannot leave anything behind.
//!
//! Pure: `desired`, `decide`, `status`, `policy_notes`, `pace`. Carrying plans out: `view`
//! (SPIRE), `record`, `writer`, `events`, `policy_effects` (Kubernetes). Wiring, one job a
//! file: `state` (what the leader holds), `leading` (the loop), `health` (probes, drift), `sync` (one sync), `apply` (a plan's
//! SPIRE writes), `preview` (`spiffe-registrar plan`).

mod apply;
pub mod decide;
pub mod desired;
pub mod events;
mod failpoint;
mod health;
mod leading;
pub mod metrics;
mod pace;
mod policy_effects;
pub mod policy_notes;
mod preview;
pub mod record;
mod spire_health;
mod state;
pub mod status;
mod sync;
pub mod view;
pub mod writer;

pub use preview::preview;
pub use state::{Controller, ControllerSettings};
