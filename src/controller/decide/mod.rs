//! What to do, as a pure function of (desired state, SPIRE view, memory, clock). No I/O: the
//! writers apply what this returns, and table tests cover it (`decide/tests.rs`).
//!
//! ```text
//! desired (per ns/SA) ─┐                     ┌─ SPIRE: create, update (incl. adopt), delete
//! SPIRE view (ours) ───┼─ spire_plan ────────┼─ pending deletions (why, until when), brake
//! memory + now ────────┘                     └─ serving: which entry gives each SA its identity
//!                         workload_writes ──── per Deployment: finalizer, annotations, Event
//! ```
//! Every entry of ours that no service account is served by is classified by what SPIRE says
//! it is for (its `k8s:ns`/`k8s:sa` selectors), never by what a Deployment's annotations say:
//! - its service account needs another entry → **transition**: deleted once the replacement
//!   has been in SPIRE for the transition grace (make-before-break);
//! - its service account's policy cannot render → **held**;
//! - its service account is out of scope but still runs → **scope loss**: deleted after the
//!   scope-loss grace, and only with the operator's confirmation when too many go at once;
//! - nothing runs as it any more (Deployments or namespace deleted) → **orphan**: deleted now,
//!   unless a Deployment moved from it to another entry (a service-account change), which is a
//!   transition.
//!
//! While any policy's selectors cannot be evaluated, only orphans are deleted.

mod input;
mod memory;
mod node_alias;
mod plan;
mod spire_plan;
#[cfg(test)]
mod tests;
mod workload_writes;

pub use input::{DecideSettings, Failures, Input, Observed};
pub use memory::Memory;
pub use plan::{
    Announce, Brake, FailedWrite, MetadataChange, Pending, SpirePlan, Stage, StageKind, Why,
    WorkloadWrite, brake_token,
};
pub use spire_plan::spire_plan;
pub use workload_writes::workload_writes;
