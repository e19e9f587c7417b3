//! One sync: snapshot → desired → decide → writers. Every decision lives in `decide` (pure);
//! this file only wires it to SPIRE and Kubernetes.
//!
//! ```text
//! Deployment events ──▶ changed sync: derive the changed service accounts only ─┐
//! timers, relists, policy/namespace events, retries, owed ──▶ full sync ─────────┴─▶ decide ─▶ writers
//! ```
//! A changed sync costs work in proportion to the change (at 50,000 Deployments a full
//! derive is ~0.5 KB and ~10 µs per Deployment); policy status and the gauges that count every
//! entry are written by full syncs, one of which is owed after changes.

use super::decide::{self, Memory, Observed, SpirePlan};
use super::desired::{self, Desired, SaState};
use super::failpoint::failpoint;
use super::pace::{Derived, Next};
use super::policy_notes::policy_events;
use super::record;
use super::state::{Controller, ControllerSettings};
use super::status::{self, Outcome};
use super::view::ApplyReport;
use crate::index::{Changed, Index, NamespaceInfo};
use crate::keys::SaKey;
use crate::leader::Term;
use crate::policy::SpiffeRegistration;
use crate::spire::EntryApi;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// Desired state and the policies it was derived from. The Deployment records it was derived
/// from are not kept: writes read the cache as it is when they are sent.
pub(super) type Snapshot = (Desired, Vec<Arc<SpiffeRegistration>>);

impl<A: EntryApi> Controller<A> {
    /// One sync, woken by Deployment events alone (`changes_only`) or by anything else: what
    /// it asks of the loop, what it derived, and how many writes it made to SPIRE and to workloads.
    pub(super) async fn sync_once(
        &mut self,
        term: &Term,
        changes_only: bool,
    ) -> (Next, Derived, usize) {
        let started = Instant::now();
        // Taken before the caches are read: a change after this point wakes the next sync.
        let changed = self.index.changes.take();
        let marks_only = matches!(changed, Changed::Marks(_));
        let relisted = self.view.stale(self.settings.resync_interval);
        let failed_writes = self.memory.has_failed_writes();
        let scope = self
            .pace
            .scope(changes_only, changed, relisted, failed_writes);
        if scope.as_ref().is_some_and(BTreeSet::is_empty) {
            // Woken by an event whose change an earlier sync already covered.
            return (Next::Idle { recheck: None }, Derived::Nothing, 0);
        }
        let mut next = self.sync_derived(term, scope).await;
        if marks_only && next.1 == Derived::Changed {
            next.1 = Derived::Marks;
        }
        let derived = next.1;
        self.metrics
            .syncs
            .with_label_values(&[derived.label()])
            .inc();
        self.metrics
            .reconcile
            .observe(started.elapsed().as_secs_f64());
        if derived == Derived::Full {
            self.pace.full_sync_took(started.elapsed());
        }
        next
    }

    /// One sync over `scope`'s service accounts (every one when `None`); says which it did
    /// and how many writes it made.
    async fn sync_derived(
        &mut self,
        term: &Term,
        scope: Option<BTreeSet<SaKey>>,
    ) -> (Next, Derived, usize) {
        if let Err(delay) = self.refresh_view_if_stale().await {
            return (Next::RetryAfter(delay), Derived::Full, 0);
        }
        let (desired, policies, derived) = self.derive(scope).await;
        self.settle_failed_writes(&desired);
        let plan = self.plan(&desired).await;
        let mut writer = self
            .effects
            .workload_writer(&self.metrics, &self.index.workloads);
        let report = if plan.writes() == 0 {
            ApplyReport::default()
        } else {
            self.apply(term, &plan, &desired, &mut writer).await
        };
        let learned_foreign = self.learn_from(&report);
        self.metrics.entries.set(self.view.entries.len() as i64);
        if derived == Derived::Full {
            // Counts over every entry: a scoped plan holds only its own.
            self.record_plan_metrics(&plan);
        }
        let writes = decide::workload_writes(
            &desired,
            &plan,
            &self.view.entries,
            &report.failures,
            &mut self.memory,
            None,
            &|key| writer.wrote(key),
        );
        writer.spawn(&desired, writes);
        if derived == Derived::Full {
            // Policy status does not depend on how the patches fare: written while they drain.
            self.record_policies(&desired, &plan, &report, policies)
                .await;
        }
        let recheck = plan.recheck;
        // Desired state and the plan are dropped before the wait (a first sync's patches take
        // minutes at 50,000 Deployments).
        let writes = plan.writes() + writer.handed();
        drop((desired, plan));
        let finished = writer.finish().await;
        self.memory.failed_writes(finished.failed);
        let next = if report.has_retryable() || finished.patch_failed {
            Next::RetryAfter(self.pace.next_backoff())
        } else if learned_foreign && self.settings.decide.adopt {
            Next::RetryAfter(Duration::ZERO)
        } else {
            Next::Idle { recheck }
        };
        (next, derived, writes)
    }

    /// Re-lists our SPIRE entries when the view is stale; the retry delay when that failed.
    async fn refresh_view_if_stale(&mut self) -> Result<(), Duration> {
        if !self.view.stale(self.settings.resync_interval) {
            return Ok(());
        }
        if let Err(error) = self.view.refresh(self.api.as_ref()).await {
            warn!(%error, "listing our SPIRE entries failed; nothing is written until it succeeds");
            self.spire_answered(!error.is_transient());
            return Err(self.pace.next_backoff());
        }
        self.spire_answered(true);
        self.memory.forget_spire_answers();
        debug!(entries = self.view.entries.len(), "refreshed SPIRE view");
        Ok(())
    }

    /// Desired state for `scope`, or for every service account when a changed one would
    /// share a SPIFFE ID with another (a scoped derive cannot see every holder).
    async fn derive(
        &mut self,
        scope: Option<BTreeSet<SaKey>>,
    ) -> (Desired, Vec<Arc<SpiffeRegistration>>, Derived) {
        let accounts = scope.as_ref().map(BTreeSet::len);
        let (mut desired, mut policies) = self.desired(scope).await;
        let taken = self
            .view
            .entries
            .values()
            .map(|e| &**e)
            .chain(self.memory.rejected.values().map(|(e, _)| e));
        if let Some(spiffe_id) = desired.collides_outside(taken) {
            info!(%spiffe_id, "a changed service account would share a SPIFFE ID with another; deriving in full");
            (desired, policies) = self.desired(None).await;
        }
        let derived = if desired.scope.is_some() {
            Derived::Changed
        } else {
            self.pace.collisions_known = desired.service_accounts.values().any(|a| {
                matches!(
                    a.state,
                    SaState::Invalid {
                        reason: "SpiffeIDCollision",
                        ..
                    }
                )
            });
            Derived::Full
        };
        debug!(derive = derived.label(), accounts, "derived desired state");
        (desired, policies, derived)
    }

    /// Derives desired state (for `scope`'s service accounts, or all) on the blocking pool: at
    /// 50,000 Deployments a full derive is hundreds of milliseconds of CPU, which must not
    /// stall the webhook or the watches.
    async fn desired(&self, scope: Option<BTreeSet<SaKey>>) -> Snapshot {
        let (settings, index) = (self.settings.clone(), self.index.clone());
        // Shared while the derive runs; dropped with the closure before any write.
        let known = self.view.entries.clone();
        let timer = scope.is_none().then(|| self.metrics.derive.start_timer());
        let snapshot =
            tokio::task::spawn_blocking(move || snapshot(&settings, &index, scope, &known))
                .await
                .expect("deriving desired state does not panic");
        if let Some(timer) = timer {
            timer.observe_duration();
        }
        snapshot
    }

    /// Counts and announces the failed writes of earlier syncs that turn out to have landed.
    fn settle_failed_writes(&mut self, desired: &Desired) {
        for landed in self.memory.settle_failed_writes(desired) {
            self.metrics
                .registrations
                .with_label_values(&[&*landed.key.namespace])
                .inc();
            let key = &landed.key;
            if let Some(deployment) = self.index.workloads.get(key) {
                record::publish(self.effects.events(), &deployment, landed.announce);
            }
        }
    }

    /// Decides the SPIRE writes, once more when the operator has just confirmed the deletions
    /// the brake holds.
    async fn plan(&mut self, desired: &Desired) -> SpirePlan {
        let plan = self.decide(desired);
        match &plan.brake {
            Some(brake) if self.effects.refresh_confirmation(&brake.token).await => {
                self.decide(desired)
            }
            _ => plan,
        }
    }

    fn decide(&mut self, desired: &Desired) -> SpirePlan {
        let input = decide::Input {
            ownership: &self.settings.ownership,
            settings: &self.settings.decide,
            desired,
            observed: &self.view.entries,
            now: Instant::now(),
            confirmed: self.effects.confirmed(),
        };
        decide::spire_plan(&input, &mut self.memory)
    }

    /// Takes in what SPIRE said of our writes: reachability, foreign equivalents, rejections.
    /// True when it named an equivalent entry another writer owns.
    fn learn_from(&mut self, report: &ApplyReport) -> bool {
        if let Some(reached) = report.reached_spire() {
            self.spire_answered(reached);
        }
        // Supervision tests: a controller that dies once it has created an entry.
        assert!(
            !(report.created > 0 && failpoint("panic-after-create")),
            "failpoint panic-after-create"
        );
        for (ours, theirs) in &report.foreign {
            self.metrics.foreign.inc();
            info!(entry_id = %ours, foreign_entry_id = %theirs.id, spiffe_id = %theirs.spiffe_id, adopt = self.settings.decide.adopt, "SPIRE holds an equivalent entry written by another tool");
        }
        for (entry, reason) in &report.rejected {
            self.metrics.rejected.inc();
            warn!(entry_id = %entry.id, spiffe_id = %entry.spiffe_id, %reason, "SPIRE rejected an entry; the entry it replaces, if any, is kept");
        }
        self.memory.learn(&report.foreign, &report.rejected);
        !report.foreign.is_empty()
    }

    fn record_plan_metrics(&self, plan: &SpirePlan) {
        let mut by_reason: BTreeMap<&str, i64> = ["transition", "scope_loss", "brake", "held"]
            .into_iter()
            .map(|r| (r, 0))
            .collect();
        for pending in &plan.pending {
            *by_reason.entry(pending.why.label()).or_default() += 1;
        }
        for (reason, count) in by_reason {
            self.metrics
                .pending_deletions
                .with_label_values(&[reason])
                .set(count);
        }
        self.metrics
            .deletion_brake
            .set(i64::from(plan.brake.is_some()));
    }

    /// Status and Events of every policy (full syncs only: status counts every service
    /// account).
    async fn record_policies(
        &mut self,
        desired: &Desired,
        plan: &SpirePlan,
        report: &ApplyReport,
        policies: Vec<Arc<SpiffeRegistration>>,
    ) {
        let outcome = Outcome {
            desired,
            plan,
            failures: &report.failures,
            memory: &self.memory,
        };
        let effects: Vec<_> = policies
            .into_iter()
            .map(|policy| {
                let status = status::compute(&policy, &outcome);
                let generation = policy.metadata.generation.unwrap_or_default();
                let name = kube::ResourceExt::name_any(policy.as_ref());
                let events = policy_events(
                    &name,
                    generation,
                    desired,
                    &self.memory,
                    plan.brake.as_ref(),
                );
                (policy, status, events)
            })
            .collect();
        self.effects.record_policies(effects).await;
    }
}

/// Desired state for `scope`'s service accounts (every one when `None`), from the caches'
/// current contents: a scoped derive reads only the Deployments running as them.
pub(super) fn snapshot(
    settings: &ControllerSettings,
    index: &Index,
    scope: Option<BTreeSet<SaKey>>,
    known: &Observed,
) -> Snapshot {
    let workloads = match &scope {
        None => index.workloads.state(),
        Some(accounts) => accounts
            .iter()
            .flat_map(|sa| {
                index
                    .workloads
                    .running_as(&sa.namespace, &sa.service_account)
            })
            .collect(),
    };
    let policies = index.policies.state();
    let namespaces = |ns: &str| -> Option<NamespaceInfo> { index.namespace_info(ns) };
    let desired = desired::compute_for(
        &settings.ownership,
        &settings.opt_in,
        &workloads,
        &namespaces,
        &policies,
        scope,
        known,
    );
    (desired, policies)
}

/// The decision a fresh leader would take now (no memory, no confirmation).
pub(super) fn fresh_plan(
    settings: &ControllerSettings,
    index: &Index,
    observed: &Observed,
) -> (Desired, SpirePlan) {
    let (desired, _) = snapshot(settings, index, None, observed);
    let input = decide::Input {
        ownership: &settings.ownership,
        settings: &settings.decide,
        desired: &desired,
        observed,
        now: Instant::now(),
        confirmed: None,
    };
    let plan = decide::spire_plan(&input, &mut Memory::default());
    (desired, plan)
}
