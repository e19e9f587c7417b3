//! The controller's state: what the leader holds between syncs, each part owned by the
//! module that uses it.

use super::decide::{DecideSettings, Memory};
use super::metrics::ControllerMetrics;
use super::pace::Pace;
use super::policy_effects::PolicyEffects;
use super::spire_health::SpireHealth;
use super::view::SpireView;
use crate::index::Index;
use crate::policy::OptIn;
use crate::spire::{EntryApi, Ownership};
use kube::Client;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct ControllerSettings {
    pub ownership: Ownership,
    pub opt_in: OptIn,
    pub resync_interval: Duration,
    /// How long to let a burst of watch events accumulate before syncing.
    pub debounce: Duration,
    pub replica_id: String,
    pub decide: DecideSettings,
    /// A leader whose SPIRE calls all fail for this long steps down.
    pub spire_unusable_after: Duration,
}

/// The leader's controller. Every replica holds one; only a leadership term lets it write.
pub struct Controller<A: EntryApi> {
    pub(super) api: Arc<A>,
    pub(super) index: Index,
    pub(super) settings: ControllerSettings,
    pub(super) metrics: ControllerMetrics,
    /// Our entries in SPIRE, as last listed and kept current from our own writes.
    pub(super) view: SpireView,
    /// What decisions remember between syncs.
    pub(super) memory: Memory,
    /// The Kubernetes side: client, Events, the operator's confirmation.
    pub(super) effects: PolicyEffects,
    pub(super) health: SpireHealth,
    pub(super) pace: Pace,
}

impl<A: EntryApi> Controller<A> {
    pub fn new(
        api: Arc<A>,
        client: Client,
        index: Index,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
    ) -> Self {
        let effects = PolicyEffects::new(client, &settings.replica_id, &metrics);
        Self {
            api,
            index,
            settings,
            metrics,
            view: SpireView::default(),
            memory: Memory::default(),
            effects,
            health: SpireHealth::default(),
            pace: Pace::default(),
        }
    }
}
