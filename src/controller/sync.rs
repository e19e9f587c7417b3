//! The loop: when to sync, and one sync as snapshot → desired → decide → writers. Every
//! decision lives in `decide` (pure); this file only wires it to SPIRE and Kubernetes.
//!
//! ```text
//! Deployment events ──▶ changed sync: derive the changed service accounts only ─┐
//! timers, relists, policy/namespace events, retries, owed ──▶ full sync ─────────┴─▶ decide ─▶ writers
//! ```
//! A changed sync costs work in proportion to the change (at 50,000 Deployments a full
//! derive is ~0.5 KB and ~10 µs per Deployment); policy status and the gauges that count every
//! entry are written by full syncs, one of which is owed after changes.

use super::decide::{self, DecideSettings, Memory, SpirePlan};
use super::desired::{self, Desired, NamespaceInfo, SaKey, SaState};
use super::events::EventSink;
use super::metrics::ControllerMetrics;
use super::record::{self, event};
use super::status::{self, Outcome, confirm_command};
use super::view::{ApplyReport, Drift, SpireView};
use super::writer::WorkloadWriter;
use crate::index::{Changed, Index};
use crate::leader::{Leadership, Term};
use crate::names::{CONFIRM_DELETIONS_ANNOTATION, CRD_NAME};
use crate::policy::{OptIn, SpiffeRegistration};
use crate::spire::{Entry, EntryApi, Ownership};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, warn};

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

pub struct Controller<A: EntryApi> {
    api: Arc<A>,
    client: Client,
    index: Index,
    settings: ControllerSettings,
    events: EventSink,
    metrics: ControllerMetrics,
    view: SpireView,
    memory: Memory,
    /// The deletion-brake confirmation last read from the CRD.
    confirmed: Option<String>,
    /// Last note published per (object, reason), so an unchanged situation is announced once.
    policy_events: HashMap<(String, &'static str), String>,
    backoff: Duration,
    /// Since when SPIRE calls fail as a whole (unset once one succeeds).
    spire_failing_since: Option<Instant>,
    /// After syncs of changed service accounts only, a full sync is owed by then: it brings
    /// policy status and the pending-deletion counts up to date.
    full_owed: Option<Instant>,
    /// How long the last full sync took (paces the full syncs owed after changes).
    last_full: Duration,
    /// Until the next drift check: longer when SPIRE's count of our entries is slow.
    drift_every: Duration,
    /// The last full derive held service accounts whose SPIFFE IDs collide: until one shows
    /// none, every sync derives in full (a scoped derive cannot see every holder).
    collisions_known: bool,
    /// A sync left work to retry, and no full sync has succeeded since. When SPIRE answers
    /// again after an outage, only then is a sync due at once; an outage seen by a drift check
    /// alone needs a count, not a sync (at 50,000 entries a slow count used to cost a full
    /// sync each time).
    retry_owed: bool,
}

/// Why the leader woke.
enum Wake {
    /// Watch events: Deployments (or more) changed.
    Changed,
    /// A timer: resync, recheck, retry, or a full sync owed.
    Sync,
    DriftCheck,
    Probe,
}

/// At rest, SPIRE's count of our entries is compared with ours this often, or less often
/// when counting is expensive (`drift_check_interval`).
const DRIFT_CHECK_INTERVAL: Duration = Duration::from_secs(10);
/// A count costs SPIRE a walk over our entries in its datastore: the checks are spaced so
/// that they take at most 1/`DRIFT_COST_FACTOR` of the time (about 1% of a SPIRE core)...
const DRIFT_COST_FACTOR: u32 = 100;
/// ...but drift is still found within this long. The resync (a full list) stays the bound
/// for everything a count cannot see.
const DRIFT_CHECK_MAX: Duration = Duration::from_secs(300);

/// When the next drift check is due, given how long the last count took to answer.
fn drift_check_interval(count_took: Duration) -> Duration {
    (count_took * DRIFT_COST_FACTOR).clamp(DRIFT_CHECK_INTERVAL, DRIFT_CHECK_MAX)
}

/// While SPIRE does not answer, it is probed this often (a count), so work resumes within
/// about this long of its return whatever the backoff.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What a sync asks of the loop.
enum Next {
    Idle { recheck: Option<Instant> },
    RetryAfter(Duration),
}

const MIN_BACKOFF: Duration = Duration::from_secs(1);
/// Entries created before their Deployments are handed to the writer: a few SPIRE batches,
/// so annotating overlaps creating without recomputing the writes too often.
const CREATE_CHUNK: usize = 200;
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// After a sync of changed service accounts, a full one follows within this many times the
/// last full sync's duration, bounded below and above: status stays fresh within seconds
/// in a small cluster, while in a large one a burst of changes does not turn into a full
/// derive per debounce.
const FULL_OWED_FACTOR: u32 = 10;
const FULL_OWED_MIN: Duration = Duration::from_secs(5);
const FULL_OWED_MAX: Duration = Duration::from_secs(60);

impl<A: EntryApi> Controller<A> {
    pub fn new(
        api: Arc<A>,
        client: Client,
        index: Index,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
    ) -> Self {
        let events = EventSink::start(
            client.clone(),
            settings.replica_id.clone(),
            metrics.events_dropped.clone(),
        );
        Self {
            api,
            client,
            index,
            settings,
            events,
            metrics,
            view: SpireView::default(),
            memory: Memory::default(),
            confirmed: None,
            policy_events: HashMap::new(),
            backoff: MIN_BACKOFF,
            spire_failing_since: None,
            full_owed: None,
            last_full: Duration::ZERO,
            drift_every: DRIFT_CHECK_INTERVAL,
            collisions_known: false,
            retry_owed: false,
        }
    }

    /// Runs until `shutdown`. Syncs only within a leadership term, and every sync runs under
    /// the term's guard: when the term ends (renew deadline, step-down, shutdown), whatever is
    /// in flight is cancelled and nothing more is written.
    pub async fn run(
        mut self,
        trigger: Arc<Notify>,
        leadership: Leadership,
        shutdown: CancellationToken,
    ) {
        let Leadership { mut term, useful } = leadership;
        loop {
            let current = term.borrow_and_update().clone();
            if let Some(current) = current {
                self.metrics.leader.set(1);
                info!("became leader; syncing");
                let led = current.guard(self.lead(&current, &trigger, &useful, &shutdown));
                match led.await {
                    Err(_) => warn!("leadership ended mid-work; in-flight writes were cancelled"),
                    // Stepped down: nothing more until the election has ended the term.
                    Ok(()) if !shutdown.is_cancelled() => current.ended().await,
                    Ok(()) => {}
                }
                self.metrics.leader.set(0);
                // A later term starts from a fresh list and fresh graces.
                self.view.invalidate();
                self.memory = Memory::default();
                if shutdown.is_cancelled() {
                    return;
                }
                continue;
            }
            let stepped_down = !*useful.borrow();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = term.changed() => if changed.is_err() {
                    // The election is gone: never write again (another replica may lead).
                    error!("leader election ended; this replica stops writing");
                    shutdown.cancelled().await;
                    return;
                },
                _ = tokio::time::sleep(PROBE_INTERVAL), if stepped_down => {
                    if self.probe_spire().await {
                        info!("SPIRE is usable again; competing for the Lease");
                        useful.send_replace(true);
                    }
                }
            }
        }
    }

    /// One leadership term: sync on triggers, on retries and on the resync interval; at rest,
    /// check for drift every `drift_every`. Returns on shutdown or after stepping
    /// down because SPIRE is unusable.
    async fn lead(
        &mut self,
        term: &Term,
        trigger: &Notify,
        useful: &watch::Sender<bool>,
        shutdown: &CancellationToken,
    ) {
        let index = self.index.clone();
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = index.synced() => {}
        }
        let mut next_sync = Instant::now();
        let mut next_drift_check = Instant::now() + self.drift_every;
        loop {
            let wake = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = trigger.notified() => {
                    tokio::time::sleep(self.settings.debounce).await;
                    Wake::Changed
                }
                _ = tokio::time::sleep_until(next_sync.into()) => Wake::Sync,
                _ = tokio::time::sleep_until(next_drift_check.into()), if self.spire_failing_since.is_none() => Wake::DriftCheck,
                _ = tokio::time::sleep(PROBE_INTERVAL), if self.spire_failing_since.is_some() => Wake::Probe,
            };
            let changes_only = matches!(wake, Wake::Changed);
            match wake {
                Wake::Changed | Wake::Sync => {}
                Wake::DriftCheck => {
                    let drifted = self.drifted().await;
                    next_drift_check = Instant::now() + self.drift_every;
                    if !drifted {
                        continue;
                    }
                }
                Wake::Probe => {
                    if !self.probe_spire().await {
                        if self.should_step_down(useful) {
                            return;
                        }
                        continue;
                    }
                    if !self.retry_owed && !self.drifted().await {
                        info!("SPIRE answers again and holds what we expect; nothing to redo");
                        continue;
                    }
                    info!("SPIRE answers again; syncing now");
                }
            }
            // The drift check keeps its own schedule: in a busy cluster syncs never stop, and
            // a sync that did not re-list has not looked at SPIRE.
            let (outcome, derived) = self
                .sync_once(term, changes_only)
                .instrument(tracing::info_span!("sync"))
                .await;
            match (&outcome, derived) {
                (Next::RetryAfter(_), _) => self.retry_owed = true,
                (Next::Idle { .. }, Derived::Full) => self.retry_owed = false,
                (Next::Idle { .. }, _) => {}
            }
            let after = Instant::now()
                + match outcome {
                    Next::Idle { recheck } => {
                        self.backoff = MIN_BACKOFF;
                        self.metrics.last_success.set(unix_now());
                        let until_recheck =
                            recheck.map(|at| at.saturating_duration_since(Instant::now()));
                        until_recheck
                            .map_or(self.settings.resync_interval, |d| {
                                d.min(self.settings.resync_interval)
                            })
                            .max(Duration::from_millis(50))
                    }
                    Next::RetryAfter(delay) => delay,
                };
            next_sync = match derived {
                Derived::Full => after,
                // A sync of some service accounts only looked at their rechecks: it never
                // postpones what is already scheduled, and a full sync is owed.
                Derived::Changed => {
                    let owed = *self.full_owed.get_or_insert_with(|| {
                        Instant::now()
                            + (self.last_full * FULL_OWED_FACTOR)
                                .clamp(FULL_OWED_MIN, FULL_OWED_MAX)
                    });
                    next_sync.min(after).min(owed)
                }
                Derived::Nothing => next_sync,
            };
            if self.should_step_down(useful) {
                return;
            }
        }
    }

    /// True (and the Lease released) when SPIRE has been unusable for the configured time.
    fn should_step_down(&self, useful: &watch::Sender<bool>) -> bool {
        let Some(since) = self.spire_failing_since else {
            return false;
        };
        if since.elapsed() < self.settings.spire_unusable_after {
            return false;
        }
        warn!(
            failing_for_s = since.elapsed().as_secs(),
            "SPIRE unusable; stepping down so a replica that can reach it leads"
        );
        useful.send_replace(false);
        true
    }

    /// Notes whether a SPIRE call succeeded; failures start the step-down clock.
    fn spire_answered(&mut self, ok: bool) {
        if ok {
            if self.spire_failing_since.take().is_some() {
                info!("SPIRE reachable again");
            }
        } else if self.spire_failing_since.is_none() {
            self.spire_failing_since = Some(Instant::now());
        }
        self.metrics.spire_reachable.set(i64::from(ok));
    }

    /// One cheap call (a count): does SPIRE answer?
    async fn probe_spire(&mut self) -> bool {
        let ok = self.api.count_hinted().await.is_ok();
        self.spire_answered(ok);
        ok
    }

    /// At rest: does SPIRE hold what we think? One count call; a mismatch forces a re-list.
    async fn drifted(&mut self) -> bool {
        if self.view.stale(self.settings.resync_interval) {
            return true;
        }
        let counting = Instant::now();
        let checked = self.view.check_drift(self.api.as_ref()).await;
        if checked.is_ok() {
            let took = counting.elapsed();
            let every = drift_check_interval(took);
            if every != self.drift_every {
                debug!(
                    count_ms = took.as_millis(),
                    every_s = every.as_secs(),
                    "drift checks paced by the cost of SPIRE's count"
                );
            }
            self.drift_every = every;
        }
        match checked {
            Ok(Drift::None) => {
                self.spire_answered(true);
                self.metrics
                    .drift_checks
                    .with_label_values(&["match"])
                    .inc();
                false
            }
            Ok(Drift::Mismatch { expected, found }) => {
                self.spire_answered(true);
                self.metrics
                    .drift_checks
                    .with_label_values(&["mismatch"])
                    .inc();
                warn!(
                    expected,
                    found, "SPIRE's count of our entries changed behind our back; re-listing"
                );
                self.view.invalidate();
                true
            }
            Err(error) => {
                self.spire_answered(false);
                self.metrics
                    .drift_checks
                    .with_label_values(&["error"])
                    .inc();
                warn!(%error, "drift check: SPIRE did not answer");
                false
            }
        }
    }

    /// The next retry delay: doubling up to `MAX_BACKOFF`, with "equal jitter" (half fixed,
    /// half random) so replicas and restarts do not retry in step. While SPIRE is down the
    /// probe (`PROBE_INTERVAL`) wakes the loop sooner anyway.
    fn next_backoff(&mut self) -> Duration {
        let delay = self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        delay / 2 + delay.mul_f64(rand::random_range(0.0..0.5))
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

    /// What this sync derives: the service accounts whose Deployments changed, when it was
    /// woken by Deployment events alone and nothing calls for more; otherwise every one.
    fn scope(
        &self,
        changes_only: bool,
        changed: Changed,
        relisted: bool,
    ) -> Option<BTreeSet<SaKey>> {
        match changed {
            Changed::Accounts(accounts)
                if changes_only
                    && !relisted
                    && !self.memory.has_failed_writes()
                    && !self.collisions_known =>
            {
                Some(accounts)
            }
            _ => None,
        }
    }

    fn decide(&mut self, desired: &Desired) -> SpirePlan {
        let input = decide::Input {
            ownership: &self.settings.ownership,
            settings: &self.settings.decide,
            desired,
            observed: &self.view.entries,
            now: Instant::now(),
            confirmed: self.confirmed.as_deref(),
        };
        decide::spire_plan(&input, &mut self.memory)
    }

    async fn sync_once(&mut self, term: &Term, changes_only: bool) -> (Next, Derived) {
        let started = Instant::now();
        // Taken before the caches are read: a change after this point wakes the next sync.
        let changed = self.index.changes.take();
        let relisted = self.view.stale(self.settings.resync_interval);
        let scope = self.scope(changes_only, changed, relisted);
        if scope.as_ref().is_some_and(BTreeSet::is_empty) {
            // Woken by an event whose change an earlier sync already covered.
            return (Next::Idle { recheck: None }, Derived::Nothing);
        }
        let next = self.sync_derived(term, scope).await;
        let derived = next.1;
        self.metrics
            .syncs
            .with_label_values(&[derived.label()])
            .inc();
        self.metrics
            .reconcile
            .observe(started.elapsed().as_secs_f64());
        if derived == Derived::Full {
            self.last_full = started.elapsed();
            self.full_owed = None;
        }
        next
    }

    /// One sync over `scope`'s service accounts (every one when `None`); says which it did.
    async fn sync_derived(
        &mut self,
        term: &Term,
        scope: Option<BTreeSet<SaKey>>,
    ) -> (Next, Derived) {
        if self.view.stale(self.settings.resync_interval) {
            if let Err(error) = self.view.refresh(self.api.as_ref()).await {
                warn!(%error, "listing our SPIRE entries failed; nothing is written until it succeeds");
                self.spire_answered(!error.is_transient());
                return (Next::RetryAfter(self.next_backoff()), Derived::Full);
            }
            self.spire_answered(true);
            self.memory.forget_spire_answers();
            debug!(entries = self.view.entries.len(), "refreshed SPIRE view");
        }
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
            self.collisions_known = desired.service_accounts.values().any(|a| {
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
        for landed in self.memory.settle_failed_writes(&desired) {
            self.metrics
                .registrations
                .with_label_values(&[&*landed.key.namespace])
                .inc();
            let key = &landed.key;
            if let Some(deployment) = self.index.deployments.get(&key.namespace, &key.name) {
                record::publish(&self.events, &deployment, landed.announce);
            }
        }
        let mut plan = self.decide(&desired);
        if let Some(brake) = &plan.brake
            && self.refresh_confirmation(&brake.token).await
        {
            plan = self.decide(&desired);
        }
        let mut writer = WorkloadWriter::new(
            self.client.clone(),
            self.events.clone(),
            self.metrics.clone(),
            self.index.deployments.clone(),
        );
        let report = if plan.writes() == 0 {
            ApplyReport::default()
        } else {
            self.apply(term, &plan, &desired, &mut writer).await
        };
        if let Some(reached) = report.reached_spire() {
            self.spire_answered(reached);
        }
        // Supervision tests: a controller that dies once it has created an entry.
        assert!(
            !(report.created > 0 && failpoint("panic-after-create")),
            "failpoint panic-after-create"
        );
        let learned_foreign = !report.foreign.is_empty();
        for (ours, theirs) in &report.foreign {
            self.metrics.foreign.inc();
            info!(entry_id = %ours, foreign_entry_id = %theirs.id, spiffe_id = %theirs.spiffe_id, adopt = self.settings.decide.adopt, "SPIRE holds an equivalent entry written by another tool");
            self.memory.foreign.insert(ours.clone(), theirs.clone());
        }
        for (entry, reason) in &report.rejected {
            self.metrics.rejected.inc();
            warn!(entry_id = %entry.id, spiffe_id = %entry.spiffe_id, %reason, "SPIRE rejected an entry; the entry it replaces, if any, is kept");
            self.memory
                .rejected
                .insert(entry.id.clone(), (entry.clone(), reason.clone()));
        }
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
        // Policy status does not depend on how the patches fare: written while they drain,
        // and desired state and the plan are dropped before the wait (a first sync's patches
        // take minutes at 50,000 Deployments).
        let outcome = Outcome {
            desired: &desired,
            plan: &plan,
            failures: &report.failures,
            memory: &self.memory,
        };
        if derived == Derived::Full {
            // Status counts every service account: written by full syncs only.
            let statuses: Vec<_> = policies
                .iter()
                .map(|p| (p.clone(), status::compute(p, &outcome)))
                .collect();
            self.record_policies(&desired, &plan, statuses).await;
        }
        let recheck = plan.recheck;
        drop((desired, plan));
        let finished = writer.finish().await;
        self.memory.failed_writes(finished.failed);
        let patch_failed = finished.patch_failed;
        let next = if report.has_retryable() || patch_failed {
            Next::RetryAfter(self.next_backoff())
        } else if learned_foreign && self.settings.decide.adopt {
            Next::RetryAfter(Duration::ZERO)
        } else {
            Next::Idle { recheck }
        };
        (next, derived)
    }

    /// Reads the operator's confirmation from the CRD; true when it now confirms `token`.
    async fn refresh_confirmation(&mut self, token: &str) -> bool {
        if self.confirmed.as_deref() == Some(token) {
            return false;
        }
        let api: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        match api.get(CRD_NAME).await {
            Ok(crd) => {
                self.confirmed = crd.annotations().get(CONFIRM_DELETIONS_ANNOTATION).cloned();
                if self.confirmed.as_deref() == Some(token) {
                    info!(token, "the operator confirmed the held deletions");
                    return true;
                }
                let note = format!(
                    "scope loss would delete many entries at once; confirm with: {}",
                    confirm_command(token)
                );
                if self.first_policy_event(CRD_NAME, "DeletionBrakeEngaged", &note) {
                    warn!(token, command = %confirm_command(token), "deletion brake engaged");
                    event(&self.events, &crd, true, "DeletionBrakeEngaged", note);
                }
            }
            Err(error) => warn!(%error, "reading the deletion confirmation failed"),
        }
        false
    }

    /// Applies the SPIRE writes: creates in chunks, each chunk's Deployments handed to the
    /// writer as soon as their entries exist (so annotating overlaps the next chunk), then
    /// updates and deletes (after every create: make-before-break within one sync). SPIRE
    /// is never kept waiting for the apiserver: while the writer's queue is full, a chunk's
    /// Deployments are handed over after the last SPIRE write, as the queue drains.
    async fn apply(
        &mut self,
        term: &Term,
        plan: &SpirePlan,
        desired: &Desired,
        writer: &mut WorkloadWriter,
    ) -> ApplyReport {
        let mut report = ApplyReport::default();
        // Created, but their Deployments not yet handed to the writer (its queue was full).
        let mut waiting: Vec<BTreeSet<SaKey>> = Vec::new();
        // Our IDs whose entries were edited behind our back: deleted first, so their
        // replacement can take the ID.
        let creating: BTreeSet<&String> = plan.create.iter().map(|e| &e.id).collect();
        let (first, later): (Vec<Entry>, Vec<Entry>) = plan
            .delete
            .iter()
            .cloned()
            .partition(|e| creating.contains(&e.id));
        if !first.is_empty() {
            let part = SpirePlan {
                delete: first,
                ..SpirePlan::default()
            };
            let done = self
                .view
                .apply(self.api.as_ref(), &self.settings.ownership, &part)
                .await;
            report.absorb(done);
        }
        for chunk in plan.create.chunks(CREATE_CHUNK) {
            // Leadership is re-checked between batches (the term's guard also cancels
            // anything in flight when it ends).
            if !term.is_valid() {
                return report;
            }
            let part = SpirePlan {
                create: chunk.to_vec(),
                ..SpirePlan::default()
            };
            let done = self
                .view
                .apply(self.api.as_ref(), &self.settings.ownership, &part)
                .await;
            let scope: BTreeSet<SaKey> = chunk.iter().filter_map(|e| SaKey::of_entry(e)).collect();
            report.absorb(done);
            if failpoint("pause-after-create") {
                continue;
            }
            if writer.has_room() {
                self.hand_over(desired, plan, &report, writer, &scope);
            } else {
                waiting.push(scope);
            }
        }
        let rest = SpirePlan {
            update: plan.update.clone(),
            delete: later,
            ..SpirePlan::default()
        };
        if rest.writes() > 0 && term.is_valid() {
            let done = self
                .view
                .apply(self.api.as_ref(), &self.settings.ownership, &rest)
                .await;
            report.absorb(done);
        }
        for scope in waiting {
            writer.room().await;
            self.hand_over(desired, plan, &report, writer, &scope);
        }
        if !plan.create.is_empty() && failpoint("pause-after-create") {
            // Crash tests: stop between writing entries and recording them; the test SIGKILLs
            // the process here.
            warn!(
                created = report.created,
                "failpoint pause-after-create: pausing forever"
            );
            std::future::pending::<()>().await;
        }
        info!(
            creates = plan.create.len(),
            updates = plan.update.len(),
            deletes = plan.delete.len(),
            created = report.created,
            updated = report.updated,
            deleted = report.deleted,
            failed = report.failures.len(),
            "applied SPIRE changes"
        );
        for entry in &plan.delete {
            if !report.failures.contains_key(&entry.id) {
                info!(entry_id = %entry.id, spiffe_id = %entry.spiffe_id, "deleted entry");
            }
        }
        for (entry_id, error) in &report.failures {
            warn!(%entry_id, %error, "SPIRE write failed");
        }
        report
    }

    /// Hands the writer the Deployments of `scope`'s service accounts, decided against SPIRE
    /// as it is now.
    fn hand_over(
        &mut self,
        desired: &Desired,
        plan: &SpirePlan,
        report: &ApplyReport,
        writer: &mut WorkloadWriter,
        scope: &BTreeSet<SaKey>,
    ) {
        let writes = decide::workload_writes(
            desired,
            plan,
            &self.view.entries,
            &report.failures,
            &mut self.memory,
            Some(scope),
            &|key| writer.wrote(key),
        );
        writer.spawn(desired, writes);
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

    /// True the first time `note` is published for (`object`, `reason`).
    fn first_policy_event(&mut self, object: &str, reason: &'static str, note: &str) -> bool {
        let key = (object.to_string(), reason);
        if self.policy_events.get(&key).map(String::as_str) == Some(note) {
            return false;
        }
        self.policy_events.insert(key, note.to_string());
        true
    }

    async fn record_policies(
        &mut self,
        desired: &Desired,
        plan: &SpirePlan,
        statuses: Vec<(
            Arc<SpiffeRegistration>,
            crate::policy::SpiffeRegistrationStatus,
        )>,
    ) {
        let api: Api<SpiffeRegistration> = Api::all(self.client.clone());
        for (policy, wanted) in statuses {
            let name = policy.name_any();
            let unchanged = policy
                .status
                .as_ref()
                .is_some_and(|current| status::same_status(current, &wanted));
            if !unchanged {
                let patch = serde_json::json!({ "status": wanted });
                let params = PatchParams::default();
                let patch = Patch::Merge(&patch);
                if let Err(error) = crate::telemetry::kube_write(
                    "patch",
                    "spiffe_registrations/status",
                    api.patch_status(&name, &params, &patch),
                )
                .await
                {
                    warn!(policy = %name, %error, "status update failed; will retry on the next sync");
                }
            }
            let mut events: Vec<(&'static str, String)> = Vec::new();
            if let Some((reason, message)) = desired.invalid_policies.get(&name) {
                let generation = policy.metadata.generation.unwrap_or_default();
                events.push((reason, format!("{message} (generation {generation})")));
            }
            let rejected: Vec<String> = self
                .memory
                .rejected
                .iter()
                .filter(|(id, _)| self.memory.policy_of(id) == Some(name.as_str()))
                .map(|(_, (entry, reason))| format!("{}: {reason}", entry.spiffe_id))
                .collect();
            if let Some(first) = rejected.first() {
                events.push((
                    "RegistrationRejected",
                    format!(
                        "SPIRE rejected {} entries of this policy (previous entries are kept); first: {first}",
                        rejected.len()
                    ),
                ));
            }
            if let Some(matched) = desired.conflicts.get(&name) {
                events.push((
                    "Overridden",
                    format!(
                        "{} Deployments match this policy, but another policy governs their service accounts (higher priority, or older)",
                        matched.len()
                    ),
                ));
            }
            if let Some(brake) = &plan.brake {
                events.push((
                    "DeletionBrakeEngaged",
                    format!(
                        "{} entries lost their scope at once; confirm with: {}",
                        brake.count,
                        confirm_command(&brake.token)
                    ),
                ));
            }
            for (reason, note) in events {
                if self.first_policy_event(&name, reason, &note) {
                    warn!(policy = %name, reason, %note, "policy problem");
                    event(&self.events, policy.as_ref(), true, reason, note);
                }
            }
        }
    }
}

/// `SPIFFE_REGISTRAR_FAILPOINT=<name>`: a named crash point for crash-consistency tests. Unset
/// in production; read once.
fn failpoint(name: &str) -> bool {
    static FAILPOINT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    FAILPOINT
        .get_or_init(|| std::env::var("SPIFFE_REGISTRAR_FAILPOINT").ok())
        .as_deref()
        == Some(name)
}

/// What a sync derived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Derived {
    /// Every service account.
    Full,
    /// Only those whose Deployments changed since the last sync.
    Changed,
    /// Nothing: the change was already covered.
    Nothing,
}

impl Derived {
    fn label(self) -> &'static str {
        match self {
            Derived::Full => "full",
            Derived::Changed | Derived::Nothing => "changed",
        }
    }
}

/// Desired state and the policies it was derived from. The Deployment records it was derived
/// from are not kept: writes read the cache as it is when they are sent.
type Snapshot = (Desired, Vec<Arc<SpiffeRegistration>>);

/// Desired state for `scope`'s service accounts (every one when `None`), from the caches'
/// current contents: a scoped derive reads only the Deployments running as them.
fn snapshot(
    settings: &ControllerSettings,
    index: &Index,
    scope: Option<BTreeSet<SaKey>>,
    known: &super::view::Observed,
) -> Snapshot {
    let deployments = match &scope {
        None => index.deployments.state(),
        Some(accounts) => accounts
            .iter()
            .flat_map(|sa| {
                index
                    .deployments
                    .running_as(&sa.namespace, &sa.service_account)
            })
            .collect(),
    };
    let policies = index.policies.state();
    let namespaces = |ns: &str| -> Option<NamespaceInfo> { index.namespace_info(ns) };
    let desired = desired::compute_for(
        &settings.ownership,
        &settings.opt_in,
        &deployments,
        &namespaces,
        &policies,
        scope,
        known,
    );
    (desired, policies)
}

/// Desired state and the decision a fresh leader would take now, for `spiffe-registrar plan`.
pub fn plan_against(
    settings: &ControllerSettings,
    index: &Index,
    observed: &super::view::Observed,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_checks_are_paced_by_what_a_count_costs_spire() {
        for (count_ms, every_s) in [
            (0, 10),   // an idle, small SPIRE: the base interval
            (100, 10), // 1% of 10 s
            (250, 25), // 25,000 entries on SQLite: checks spread out
            (1_500, 150),
            (4_000, 300), // a count at the call deadline: still checked every 5 minutes
            (60_000, 300),
        ] {
            assert_eq!(
                drift_check_interval(Duration::from_millis(count_ms)),
                Duration::from_secs(every_s),
                "a count that took {count_ms} ms"
            );
        }
    }
}
