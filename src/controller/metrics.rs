//! Controller metrics.

use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

#[derive(Clone)]
pub struct ControllerMetrics {
    /// `registrations_total{namespace}`: Deployments registered (first entry-id recorded).
    pub registrations: IntCounterVec,
    /// `registration_errors_total{namespace}`: failed registrations, per sync and Deployment.
    pub errors: IntCounterVec,
    /// `reconcile_duration_seconds`: one sync, list to status.
    pub reconcile: Histogram,
    /// `spire_entries_managed`: entries we own in SPIRE, as of the last sync.
    pub entries: IntGauge,
    /// `admission_to_registered_seconds`: Deployment creation to its entry recorded.
    pub admission_to_registered: Histogram,
    /// `entry_deletions_pending{reason}`: entries kept past need (transition, scope_loss,
    /// brake, held), as of the last sync.
    pub pending_deletions: IntGaugeVec,
    /// `deletion_brake_engaged`: 1 while mass scope-loss deletions wait for confirmation.
    pub deletion_brake: IntGauge,
    /// `spire_entries_rejected_total`: creates SPIRE refused as invalid (each reported once).
    pub rejected: IntCounter,
    /// `spire_equivalent_foreign_entries_total`: equivalent entries found owned by another
    /// writer (each reported once per resync).
    pub foreign: IntCounter,
    /// `desired_state_seconds`: deriving desired state from the caches (the full recompute,
    /// O(Deployments), on the blocking pool).
    pub derive: Histogram,
    /// `syncs_total{derive}`: syncs by what they derived: `full` (every service account) or
    /// `changed` (only those whose Deployments changed since the last sync).
    pub syncs: IntCounterVec,
    /// `events_dropped_total`: Events not written because the queue was full (advisory, as
    /// in Kubernetes' own event broadcaster).
    pub events_dropped: IntCounter,
    /// `leader`: 1 while this replica holds a valid leadership term.
    pub leader: IntGauge,
    /// `leadership_transitions_total{to}`: each start (`leader`) and end (`follower`) of a
    /// term this replica worked in, counted once.
    pub transitions: IntCounterVec,
    /// `spire_reachable`: 0 once a SPIRE call failed as a whole, 1 again after one succeeds.
    pub spire_reachable: IntGauge,
    /// `last_successful_sync_timestamp_seconds`: Unix time of the last sync that completed
    /// with nothing left to retry.
    pub last_success: prometheus::Gauge,
    /// `drift_checks_total{result}`: at-rest comparisons of SPIRE's count with ours (match,
    /// mismatch, error); a mismatch re-lists.
    pub drift_checks: IntCounterVec,
}

impl ControllerMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let registrations = IntCounterVec::new(
            Opts::new("registrations_total", "Deployments registered in SPIRE"),
            &["namespace"],
        )?;
        let errors = IntCounterVec::new(
            Opts::new(
                "registration_errors_total",
                "Deployments whose registration failed in a sync",
            ),
            &["namespace"],
        )?;
        let reconcile = Histogram::with_opts(
            HistogramOpts::new("reconcile_duration_seconds", "Duration of one sync").buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ]),
        )?;
        let entries = IntGauge::new(
            "spire_entries_managed",
            "SPIRE entries owned by this registrar",
        )?;
        let admission_to_registered = Histogram::with_opts(
            HistogramOpts::new(
                "admission_to_registered_seconds",
                "From Deployment creation to its SPIRE entry recorded",
            )
            .buckets(vec![
                0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
            ]),
        )?;
        let pending_deletions = IntGaugeVec::new(
            Opts::new(
                "entry_deletions_pending",
                "Entries of ours kept past need, by why (transition, scope_loss, brake, held)",
            ),
            &["reason"],
        )?;
        let deletion_brake = IntGauge::new(
            "deletion_brake_engaged",
            "1 while mass scope-loss deletions wait for an operator's confirmation",
        )?;
        let rejected = IntCounter::new(
            "spire_entries_rejected_total",
            "Entry creates SPIRE refused as invalid",
        )?;
        let foreign = IntCounter::new(
            "spire_equivalent_foreign_entries_total",
            "Equivalent entries found owned by another writer",
        )?;
        let derive = Histogram::with_opts(
            HistogramOpts::new(
                "desired_state_seconds",
                "Deriving desired state from the caches (one full recompute)",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ]),
        )?;
        registry.register(Box::new(derive.clone()))?;
        let syncs = IntCounterVec::new(
            Opts::new(
                "syncs_total",
                "Syncs by what they derived: every service account (full) or the changed ones",
            ),
            &["derive"],
        )?;
        for derive in ["full", "changed"] {
            syncs.with_label_values(&[derive]);
        }
        registry.register(Box::new(syncs.clone()))?;
        let events_dropped = IntCounter::new(
            "events_dropped_total",
            "Events not written because the event queue was full",
        )?;
        registry.register(Box::new(events_dropped.clone()))?;
        let leader = IntGauge::new("leader", "1 while this replica leads (holds a valid term)")?;
        let transitions = IntCounterVec::new(
            Opts::new(
                "leadership_transitions_total",
                "Leadership terms this replica started (to=leader) and ended (to=follower)",
            ),
            &["to"],
        )?;
        registry.register(Box::new(transitions.clone()))?;
        let spire_reachable = IntGauge::new(
            "spire_reachable",
            "0 after a SPIRE call failed as a whole, until one succeeds",
        )?;
        spire_reachable.set(1);
        let last_success = prometheus::Gauge::new(
            "last_successful_sync_timestamp_seconds",
            "Unix time of the last sync that left nothing to retry",
        )?;
        let drift_checks = IntCounterVec::new(
            Opts::new(
                "drift_checks_total",
                "At-rest comparisons of SPIRE's entry count with ours, by result",
            ),
            &["result"],
        )?;
        for collector in [leader.clone(), spire_reachable.clone()] {
            registry.register(Box::new(collector))?;
        }
        registry.register(Box::new(last_success.clone()))?;
        registry.register(Box::new(drift_checks.clone()))?;
        registry.register(Box::new(pending_deletions.clone()))?;
        registry.register(Box::new(deletion_brake.clone()))?;
        registry.register(Box::new(rejected.clone()))?;
        registry.register(Box::new(foreign.clone()))?;
        registry.register(Box::new(registrations.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(reconcile.clone()))?;
        registry.register(Box::new(entries.clone()))?;
        registry.register(Box::new(admission_to_registered.clone()))?;
        Ok(Self {
            registrations,
            errors,
            reconcile,
            entries,
            admission_to_registered,
            pending_deletions,
            deletion_brake,
            rejected,
            foreign,
            events_dropped,
            derive,
            syncs,
            leader,
            transitions,
            spire_reachable,
            last_success,
            drift_checks,
        })
    }
}
