//! What one decision is taken from: the flags, desired state, SPIRE as we see it, the clock
//! and the operator's confirmation.

use crate::controller::desired::Desired;
use crate::spire::{Entry, ItemError, Ownership};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Knobs of the decisions (flags).
#[derive(Clone, Debug)]
pub struct DecideSettings {
    /// How long a replaced entry outlives its replacement's appearance in SPIRE.
    pub transition_grace: Duration,
    /// How long an entry outlives its service account falling out of scope.
    pub scope_loss_grace: Duration,
    /// The brake holds scope-loss deletions of one sync when there are more than this many…
    pub brake_count: usize,
    /// …and they are more than this fraction of our entries.
    pub brake_fraction: f64,
    /// Take over equivalent entries written by other tools instead of reporting them.
    pub adopt: bool,
}

impl Default for DecideSettings {
    fn default() -> Self {
        Self {
            transition_grace: Duration::from_secs(60),
            scope_loss_grace: Duration::from_secs(600),
            brake_count: 10,
            brake_fraction: 0.1,
            adopt: false,
        }
    }
}

/// Our entries in SPIRE, by ID. Shared: an entry we created is the very one desired state
/// rendered, so a cold start holds each entry once, not once for desired state and once for
/// the view (at 50,000 Deployments that was ~12 MiB of the first sync's peak).
pub type Observed = BTreeMap<String, Arc<Entry>>;

/// What happened to SPIRE writes, by entry ID (after the writer applied the plan).
pub type Failures = BTreeMap<String, ItemError>;

/// The inputs of one decision.
pub struct Input<'a> {
    pub ownership: &'a Ownership,
    pub settings: &'a DecideSettings,
    pub desired: &'a Desired,
    /// Our entries in SPIRE, by ID.
    pub observed: &'a Observed,
    pub now: Instant,
    /// The confirmation token an operator has set (see `Brake`).
    pub confirmed: Option<&'a str>,
}
