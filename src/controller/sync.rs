//! One sync, and the loop that decides when to run it.

use super::desired::{self, DeploymentKey, Desired, WorkloadState, key_of, recorded_entry_id};
use super::diff::{self, Plan};
use super::metrics::ControllerMetrics;
use super::record::{MetadataChange, event, write_workload};
use super::status;
use super::view::{ApplyReport, SpireView};
use crate::index::Index;
use crate::names::{ENTRY_ID_ANNOTATION, FINALIZER, SPIFFE_ID_ANNOTATION};
use crate::policy::{OptIn, SpiffeRegistration};
use crate::spire::{EntryApi, Ownership};
use crate::webhook::PolicyView;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client, ResourceExt};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

#[derive(Clone, Debug)]
pub struct ControllerSettings {
    pub ownership: Ownership,
    pub opt_in: OptIn,
    pub resync_interval: Duration,
    /// How long to let a burst of watch events accumulate before syncing.
    pub debounce: Duration,
    pub replica_id: String,
}

pub struct Controller<A: EntryApi> {
    api: Arc<A>,
    client: Client,
    index: Index,
    settings: ControllerSettings,
    recorder: Recorder,
    metrics: ControllerMetrics,
    view: SpireView,
    /// Last failure reported per Deployment, so an unchanged failure is not re-announced on
    /// every sync.
    reported: HashMap<DeploymentKey, String>,
    /// Last (generation, reason) announced per policy.
    policy_events: HashMap<String, (i64, String)>,
    backoff: Duration,
}

/// What a sync asks of the loop.
enum Next {
    Idle,
    RetryAfter(Duration),
}

const MIN_BACKOFF: Duration = Duration::from_secs(1);
/// Deployment patches and Events in flight at once during a sync.
const PATCH_CONCURRENCY: usize = 16;
const MAX_BACKOFF: Duration = Duration::from_secs(30);

impl<A: EntryApi> Controller<A> {
    pub fn new(
        api: Arc<A>,
        client: Client,
        index: Index,
        settings: ControllerSettings,
        metrics: ControllerMetrics,
    ) -> Self {
        let reporter = Reporter {
            controller: "spiffe-registrar".into(),
            instance: Some(settings.replica_id.clone()),
        };
        let recorder = Recorder::new(client.clone(), reporter);
        Self {
            api,
            client,
            index,
            settings,
            recorder,
            metrics,
            view: SpireView::default(),
            reported: HashMap::new(),
            policy_events: HashMap::new(),
            backoff: MIN_BACKOFF,
        }
    }

    /// Runs until `shutdown`. Syncs only while `leader` is true and `synced` has flipped.
    pub async fn run(
        mut self,
        trigger: Arc<Notify>,
        mut leader: watch::Receiver<bool>,
        synced: Arc<AtomicBool>,
        shutdown: CancellationToken,
    ) {
        let mut wait = Duration::ZERO;
        let mut leading = false;
        let mut election_alive = true;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = trigger.notified() => tokio::time::sleep(self.settings.debounce).await,
                changed = leader.changed(), if election_alive => {
                    if changed.is_err() {
                        // The election task is gone: never write again (another replica may
                        // lead), and do not spin on a closed channel.
                        error!("leader election ended; this replica stops writing");
                        election_alive = false;
                    }
                }
                _ = tokio::time::sleep(wait) => {}
            }
            let now_leading = election_alive && *leader.borrow();
            if now_leading != leading {
                leading = now_leading;
                if leading {
                    info!("became leader; syncing");
                } else {
                    info!("not the leader; pausing writes");
                    // A later leadership starts from a fresh list, not from a stale view.
                    self.view.invalidate();
                }
            }
            if !leading {
                wait = Duration::from_secs(3600);
                continue;
            }
            if !synced.load(Ordering::SeqCst) {
                wait = Duration::from_millis(200);
                continue;
            }
            wait = match self.sync_once().await {
                Next::Idle => {
                    self.backoff = MIN_BACKOFF;
                    self.settings.resync_interval
                }
                Next::RetryAfter(delay) => delay,
            };
        }
    }

    fn next_backoff(&mut self) -> Duration {
        let delay = self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        delay
    }

    async fn sync_once(&mut self) -> Next {
        let started = Instant::now();
        if self.view.stale(self.settings.resync_interval) {
            if let Err(error) = self.view.refresh(self.api.as_ref()).await {
                warn!(%error, "listing our SPIRE entries failed; nothing is written until it succeeds");
                return Next::RetryAfter(self.next_backoff());
            }
            debug!(entries = self.view.entries.len(), "refreshed SPIRE view");
        }
        let deployments = self.index.deployments.state();
        let policies = self.index.policies.state();
        let index = self.index.clone();
        let labels = move |ns: &str| index.namespace_labels(ns);
        let desired = desired::compute(
            &self.settings.ownership,
            &self.settings.opt_in,
            &deployments,
            &labels,
            &policies,
        );
        let plan = diff::plan(&self.settings.ownership, &desired, &self.view.entries);
        let report = if plan.is_empty() {
            ApplyReport::default()
        } else {
            self.apply(plan).await
        };
        self.metrics.entries.set(self.view.entries.len() as i64);
        let patch_failed = self.record_workloads(&deployments, &desired, &report).await;
        self.record_policies(&policies, &desired, &report).await;
        self.metrics
            .reconcile
            .observe(started.elapsed().as_secs_f64());
        if report.has_retryable() || patch_failed {
            Next::RetryAfter(self.next_backoff())
        } else {
            Next::Idle
        }
    }

    async fn apply(&mut self, plan: Plan) -> ApplyReport {
        let (creates, updates, deletes) = (plan.create.len(), plan.update.len(), plan.delete.len());
        let report = self
            .view
            .apply(self.api.as_ref(), &self.settings.ownership, plan)
            .await;
        if creates > 0 && failpoint("pause-after-create") {
            // Crash tests: stop between writing entries and recording them; the test SIGKILLs
            // the process here.
            warn!(
                created = report.created,
                "failpoint pause-after-create: pausing forever"
            );
            std::future::pending::<()>().await;
        }
        info!(
            creates,
            updates,
            deletes,
            created = report.created,
            updated = report.updated,
            deleted = report.deleted,
            failed = report.failures.len(),
            "applied SPIRE changes"
        );
        for (entry_id, error) in &report.failures {
            warn!(%entry_id, %error, "SPIRE write failed");
        }
        report
    }

    /// Annotations, finalizers and Events for every Deployment. Returns true when a patch
    /// failed (the sync is then retried).
    async fn record_workloads(
        &mut self,
        deployments: &[Arc<Deployment>],
        desired: &Desired,
        report: &ApplyReport,
    ) -> bool {
        // Decide first (cheap, in memory), then write concurrently: a sync touching 1,000
        // Deployments should not wait for 1,000 sequential round trips.
        let decisions: Vec<_> = deployments
            .iter()
            .filter_map(|deployment| {
                let state = desired.workloads.get(&key_of(deployment))?;
                let (change, announce) = self.decide(deployment, state, desired, report);
                (!change.is_empty() || announce.is_some())
                    .then(|| (deployment.clone(), change, announce))
            })
            .collect();
        let writes: Vec<_> = decisions
            .into_iter()
            .map(|(deployment, change, announce)| {
                write_workload(&self.client, &self.recorder, deployment, change, announce)
            })
            .collect();
        let failed = futures::stream::iter(writes)
            .buffer_unordered(PATCH_CONCURRENCY)
            .fold(false, |any, failed| async move { any || failed })
            .await;
        // Forget Deployments that are gone.
        self.reported
            .retain(|key, _| desired.workloads.contains_key(key));
        failed
    }

    /// What to change on one Deployment and which Event (warning, reason, note) to publish.
    fn decide(
        &mut self,
        deployment: &Deployment,
        state: &WorkloadState,
        desired: &Desired,
        report: &ApplyReport,
    ) -> (MetadataChange, Option<(bool, &'static str, String)>) {
        let key = key_of(deployment);
        let has_finalizer = deployment
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == FINALIZER);
        let annotations = deployment.metadata.annotations.clone().unwrap_or_default();
        let recorded = recorded_entry_id(deployment).map(str::to_string);
        match state {
            WorkloadState::Needs {
                entry_id,
                spiffe_id,
                ..
            } => {
                // Finalizer and intended ID always (backfill when the webhook missed it).
                let mut change = MetadataChange {
                    add_finalizer: !has_finalizer,
                    ..Default::default()
                };
                if annotations.get(SPIFFE_ID_ANNOTATION) != Some(spiffe_id) {
                    change.spiffe_id = Some(Some(spiffe_id.clone()));
                }
                if let Some(error) = report.failures.get(entry_id) {
                    self.metrics
                        .errors
                        .with_label_values(&[&key.namespace])
                        .inc();
                    let note = format!("entry {entry_id} for {spiffe_id}: {error}");
                    let announce =
                        self.first_time(&key, &note)
                            .then_some((true, "RegistrationFailed", note));
                    return (change, announce);
                }
                if !self.view.entries.contains_key(entry_id) {
                    return (change, None);
                }
                self.reported.remove(&key);
                if recorded.as_deref() == Some(entry_id.as_str()) {
                    return (change, None);
                }
                change.entry_id = Some(Some(entry_id.clone()));
                self.metrics
                    .registrations
                    .with_label_values(&[&key.namespace])
                    .inc();
                if recorded.is_none()
                    && let Some(created) = &deployment.metadata.creation_timestamp
                {
                    let age = k8s_openapi::jiff::Timestamp::now().duration_since(created.0);
                    self.metrics
                        .admission_to_registered
                        .observe(age.as_secs_f64().max(0.0));
                }
                info!(deployment = %key.name, namespace = %key.namespace, %spiffe_id, %entry_id, "registered");
                (
                    change,
                    Some((
                        false,
                        "Registered",
                        format!("SPIFFE ID {spiffe_id}, SPIRE entry {entry_id}"),
                    )),
                )
            }
            WorkloadState::Invalid {
                policy, message, ..
            } => {
                let note = format!("policy {policy}: {message}");
                let announce =
                    self.first_time(&key, &note)
                        .then_some((true, "RegistrationFailed", note));
                (MetadataChange::default(), announce)
            }
            WorkloadState::Deleting { .. } | WorkloadState::OutOfScope => {
                let ours = has_finalizer
                    || annotations.contains_key(SPIFFE_ID_ANNOTATION)
                    || annotations.contains_key(ENTRY_ID_ANNOTATION);
                if !ours {
                    return (MetadataChange::default(), None);
                }
                // Released only once each entry it had (recorded) or would have (current policy)
                // is gone from SPIRE or needed by someone else.
                let would_need = match state {
                    WorkloadState::Deleting { would_need } => would_need.clone(),
                    _ => None,
                };
                let pending = recorded.iter().chain(would_need.iter()).find(|id| {
                    self.view.entries.contains_key(*id) && !desired.entries.contains_key(*id)
                });
                if let Some(pending) = pending {
                    if let Some(error) = report.failures.get(pending) {
                        let note = format!("waiting to delete entry {pending}: {error}");
                        let announce = self.first_time(&key, &note).then_some((
                            true,
                            "DeregistrationFailed",
                            note,
                        ));
                        return (MetadataChange::default(), announce);
                    }
                    return (MetadataChange::default(), None);
                }
                let change = MetadataChange {
                    remove_finalizer: has_finalizer,
                    // Out of scope: the annotations would be stale. Deleting: irrelevant.
                    spiffe_id: matches!(state, WorkloadState::OutOfScope).then_some(None),
                    entry_id: matches!(state, WorkloadState::OutOfScope).then_some(None),
                    ..Default::default()
                };
                let announce = recorded.map(|id| {
                    info!(deployment = %key.name, namespace = %key.namespace, entry_id = %id, "deregistered");
                    let shared = desired.entries.contains_key(&id);
                    let note = if shared { format!("entry {id} is still used by other Deployments") } else { format!("entry {id} deleted") };
                    (false, "Deregistered", note)
                });
                (change, announce)
            }
        }
    }

    /// True the first time `note` is reported for `key` (until it changes or clears).
    fn first_time(&mut self, key: &DeploymentKey, note: &str) -> bool {
        if self.reported.get(key).map(String::as_str) == Some(note) {
            return false;
        }
        self.reported.insert(key.clone(), note.to_string());
        true
    }

    async fn record_policies(
        &mut self,
        policies: &[Arc<SpiffeRegistration>],
        desired: &Desired,
        report: &ApplyReport,
    ) {
        let api: Api<SpiffeRegistration> = Api::all(self.client.clone());
        for policy in policies {
            let name = policy.name_any();
            let wanted = status::compute(policy, desired, report);
            let unchanged = policy
                .status
                .as_ref()
                .is_some_and(|current| status::same_status(current, &wanted));
            if !unchanged {
                let patch = serde_json::json!({ "status": wanted });
                if let Err(error) = api
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    debug!(policy = %name, %error, "status update failed; will retry on the next sync");
                }
            }
            if let Some((reason, message)) = status::policy_problem(policy) {
                let generation = policy.metadata.generation.unwrap_or_default();
                let marker = (generation, reason.to_string());
                if self.policy_events.get(&name) != Some(&marker) {
                    self.policy_events.insert(name.clone(), marker);
                    warn!(policy = %name, reason, %message, "invalid policy");
                    event(&self.recorder, policy.as_ref(), true, reason, message).await;
                }
            } else {
                self.policy_events.remove(&name);
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

/// Desired-state view for `spiffe-registrar plan`.
pub fn plan_against(
    ownership: &Ownership,
    opt_in: &OptIn,
    index: &Index,
    observed: &BTreeMap<String, crate::spire::Entry>,
) -> (Desired, Plan) {
    let deployments = index.deployments.state();
    let policies = index.policies.state();
    let labels = |ns: &str| index.namespace_labels(ns);
    let desired = desired::compute(ownership, opt_in, &deployments, &labels, &policies);
    let plan = diff::plan(ownership, &desired, observed);
    (desired, plan)
}
