//! The Deployment writer: applies `decide::workload_writes` output (patches and Events) in a
//! background task, at most `PATCH_CONCURRENCY` at once, while the sync goes on to decide
//! policy status. Writes wait in a queue as plain data; only those
//! in flight are futures (a kube request future is kilobytes: a first sync of 10,000
//! Deployments spawned as tasks at once took tens of MiB).

use super::decide::{FailedWrite, WorkloadWrite};
use super::desired::Desired;
use super::events::EventSink;
use super::metrics::ControllerMetrics;
use super::record::write_workload;
use crate::index::WorkloadStore;
use crate::keys::WorkloadKey;
use basis::Basis;
use futures::StreamExt;
use kube::Client;
use prometheus::IntCounter;
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinHandle;
use tracing::{Instrument, info};

mod basis;

/// Deployment patches in flight at once: enough to keep the apiserver busy (the scale
/// benchmark's raw patch rate is measured at this concurrency).
const PATCH_CONCURRENCY: usize = 16;

/// Writes queued or in flight beyond which a sync hands the writer no more until it drains
/// (`has_room`, `room`). SPIRE creates several times faster than the apiserver patches, so a
/// cold start would otherwise queue a write per Deployment: ~500 bytes each, the largest part
/// of the first sync's memory at 50,000 Deployments.
const QUEUE_BOUND: usize = 2_048;

/// `QUEUE_BOUND`, or `SPIFFE_REGISTRAR_WRITE_QUEUE_BOUND` where set: cluster tests make it
/// small, so a few thousand Deployments take the path that 50,000 take. Read once.
fn queue_bound() -> usize {
    static BOUND: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BOUND.get_or_init(|| {
        std::env::var("SPIFFE_REGISTRAR_WRITE_QUEUE_BOUND")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|bound| *bound > 0)
            .unwrap_or(QUEUE_BOUND)
    })
}

pub struct WorkloadWriter {
    metrics: ControllerMetrics,
    /// Deployments already handed a write this sync: a later, wider pass computed from the
    /// same cache would only repeat it.
    written: HashSet<WorkloadKey>,
    /// Writes queued or in flight, shared with the driver.
    progress: Arc<Progress>,
    /// A permit per write in flight: `behind_spire` holds them all while SPIRE writes.
    turns: Arc<Semaphore>,
    queue: mpsc::UnboundedSender<Job>,
    /// Runs the queue. Aborted if the writer is dropped before
    /// `finish` (a sync cancelled because leadership ended: nothing more may be written).
    driver: Option<JoinHandle<Finished>>,
}

impl Drop for WorkloadWriter {
    fn drop(&mut self) {
        if let Some(driver) = self.driver.take() {
            driver.abort();
        }
    }
}

/// One queued write.
struct Job {
    write: WorkloadWrite,
    /// What the decision assumed of the Deployment. The patch is computed against the cache
    /// as it is when sent; if the Deployment moved to another service account or started
    /// deleting since, the write is stale and handled like a failed `test`: retried by a
    /// sync that sees the change.
    basis: Basis,
    /// `registrations_total{namespace}`, counted once the entry-id is on the object.
    registrations: IntCounter,
}

impl WorkloadWriter {
    pub fn new(
        client: Client,
        events: EventSink,
        metrics: ControllerMetrics,
        deployments: WorkloadStore,
    ) -> Self {
        let (queue, jobs) = mpsc::unbounded_channel();
        let progress = Arc::new(Progress::new(events.yield_to()));
        let turns = Arc::new(Semaphore::new(PATCH_CONCURRENCY));
        let driver = tokio::spawn(
            drive(
                client,
                events,
                deployments,
                jobs,
                progress.clone(),
                turns.clone(),
            )
            .instrument(tracing::info_span!("workload_writer")),
        );
        Self {
            metrics,
            written: HashSet::new(),
            progress,
            turns,
            queue,
            driver: Some(driver),
        }
    }

    /// Starts `writes` (skipping Deployments already written this sync).
    pub fn spawn(&mut self, desired: &Desired, writes: Vec<WorkloadWrite>) {
        for write in writes {
            if !self.written.insert(write.key.clone()) {
                continue;
            }
            self.count(desired, &write);
            let registrations = self
                .metrics
                .registrations
                .with_label_values(&[&*write.key.namespace]);
            // The driver lives until `finish` drops the queue, so this cannot fail.
            let basis = Basis::of(desired, &write.key);
            self.progress.started();
            let _ = self.queue.send(Job {
                write,
                basis,
                registrations,
            });
        }
    }

    /// Holds every write back (they queue) until the returned permit is dropped: entries
    /// before annotations. Even two patches in flight ran at most of the apiserver's pace
    /// (each is quick on an idle apiserver) and slowed SPIRE's creates by half at 10,000
    /// Deployments, so the writes wait rather than trickle.
    pub async fn behind_spire(&self) -> Option<OwnedSemaphorePermit> {
        let all = u32::try_from(PATCH_CONCURRENCY).unwrap_or(u32::MAX);
        self.turns.clone().acquire_many_owned(all).await.ok()
    }

    /// How many workloads were handed a write this sync.
    pub fn handed(&self) -> usize {
        self.written.len()
    }

    /// Whether `key` was handed a write this sync.
    pub fn wrote(&self, key: &WorkloadKey) -> bool {
        self.written.contains(key)
    }

    /// Whether the queue is below its bound (`queue_bound`).
    pub fn has_room(&self) -> bool {
        self.progress.pending.load(Ordering::Relaxed) < queue_bound()
    }

    /// Waits until the queue is below its bound, or the driver is gone (then `finish` reports
    /// the failure and the sync is retried; waiting would hang it).
    pub async fn room(&self) {
        while !self.has_room() && self.driver.as_ref().is_some_and(|d| !d.is_finished()) {
            // The driver wakes this after every write (a stored permit at worst costs one
            // more look); the timeout only notices a driver that died.
            let _ = tokio::time::timeout(Duration::from_secs(1), self.progress.drained.notified())
                .await;
        }
    }

    fn count(&self, desired: &Desired, write: &WorkloadWrite) {
        let namespace = &*write.key.namespace;
        if let Some(Some(entry_id)) = &write.change.entry_id {
            info!(deployment = %write.key.name, %namespace, %entry_id, "registered");
        }
        if write.registered
            && let Some(created) = desired.workloads.get(&write.key).and_then(|w| w.created)
        {
            let age = k8s_openapi::jiff::Timestamp::now().duration_since(created);
            self.metrics
                .admission_to_registered
                .observe(age.as_secs_f64().max(0.0));
        }
        if write
            .announce
            .iter()
            .any(|a| a.reason == "RegistrationFailed")
        {
            self.metrics.errors.with_label_values(&[namespace]).inc();
        }
    }

    /// Waits for every write.
    pub async fn finish(mut self) -> Finished {
        let (closed, _) = mpsc::unbounded_channel();
        // Closing the queue lets the driver finish once what is queued is written. The
        // handle stays in `self`, so a cancelled `finish` still aborts the driver on drop.
        drop(std::mem::replace(&mut self.queue, closed));
        let failed = Finished {
            patch_failed: true,
            failed: Vec::new(),
        };
        match self.driver.as_mut() {
            Some(driver) => driver.await.unwrap_or(failed),
            None => failed,
        }
    }
}

/// What a sync's writes came to.
#[derive(Debug, Default)]
pub struct Finished {
    /// A patch failed: the sync is retried.
    pub patch_failed: bool,
    /// The writes whose patch failed, with what they carried.
    pub failed: Vec<FailedWrite>,
}

impl Finished {
    fn absorb(mut self, other: Finished) -> Finished {
        self.patch_failed |= other.patch_failed;
        self.failed.extend(other.failed);
        self
    }

    /// A write that did not land: the sync is retried, the Events kept for the retry.
    fn failed(failed: FailedWrite) -> Finished {
        Finished {
            patch_failed: true,
            failed: vec![failed],
        }
    }
}

/// The queue's fill, shared by the writer and its driver: writes queued or in flight, and a
/// wake-up each time one completes. `events_yield_to` is the Event writer's view of the same
/// count: Events are written slowly while workload writes wait, at once otherwise.
struct Progress {
    pending: AtomicUsize,
    drained: Notify,
    events_yield_to: Arc<AtomicUsize>,
}

impl Progress {
    fn new(events_yield_to: Arc<AtomicUsize>) -> Self {
        Self {
            pending: AtomicUsize::new(0),
            drained: Notify::new(),
            events_yield_to,
        }
    }

    fn started(&self) {
        self.pending.fetch_add(1, Ordering::Relaxed);
        self.events_yield_to.fetch_add(1, Ordering::Relaxed);
    }

    fn done(&self) {
        self.pending.fetch_sub(1, Ordering::Relaxed);
        self.events_yield_to.fetch_sub(1, Ordering::Relaxed);
        self.drained.notify_one();
    }
}

impl Drop for Progress {
    /// Writes that never finished (the writer dropped mid-sync, its driver aborted) no longer
    /// hold Events back.
    fn drop(&mut self) {
        let left = self.pending.load(Ordering::Relaxed);
        self.events_yield_to.fetch_sub(left, Ordering::Relaxed);
    }
}

/// Runs queued writes, at most `PATCH_CONCURRENCY` at once. Each patch is computed against
/// the Deployment as cached when it is sent (its guards test what it relies on), not against
/// the sync's snapshot: holding the snapshot for the minutes a first sync's patches take kept
/// every record twice, the snapshot's and the one each patch's own watch event replaced it with.
async fn drive(
    client: Client,
    events: EventSink,
    deployments: WorkloadStore,
    jobs: mpsc::UnboundedReceiver<Job>,
    progress: Arc<Progress>,
    turns: Arc<Semaphore>,
) -> Finished {
    let mut jobs = jobs;
    futures::stream::poll_fn(move |cx| jobs.poll_recv(cx))
        .map(|job| {
            let (client, events, deployments) = (&client, &events, &deployments);
            let (progress, turns) = (&progress, &turns);
            async move {
                // Never closed: the writer owns the semaphore for the driver's whole life.
                let _turn = turns.acquire().await;
                let finished = write_one(client, events, deployments, job).await;
                progress.done();
                finished
            }
        })
        .buffer_unordered(PATCH_CONCURRENCY)
        .fold(
            Finished::default(),
            |all, this| async move { all.absorb(this) },
        )
        .await
}

/// One queued write, against the Deployment as cached now.
async fn write_one(
    client: &Client,
    events: &EventSink,
    deployments: &WorkloadStore,
    job: Job,
) -> Finished {
    let Job {
        write,
        basis,
        registrations,
    } = job;
    // Gone from the cache: deleted, nothing left to write.
    let Some(deployment) = deployments.get(&write.key) else {
        return Finished::default();
    };
    let entry_id = write.change.entry_id.clone().flatten();
    if !basis.holds_for(&deployment) {
        tracing::debug!(deployment = %deployment.name, namespace = %deployment.namespace, "changed since the sync decided; will retry");
        return Finished::failed(FailedWrite {
            registered: entry_id.filter(|_| write.registered),
            key: write.key,
            announce: write.announce,
        });
    }
    let span = tracing::debug_span!(
        "write",
        deployment = %deployment.name,
        namespace = %deployment.namespace
    );
    let written = write_workload(client, events, deployment, write.change, write.announce)
        .instrument(span)
        .await;
    match written {
        Ok(()) => {
            if write.registered {
                registrations.inc();
            }
            Finished::default()
        }
        Err(announce) => Finished::failed(FailedWrite {
            key: write.key,
            registered: entry_id.filter(|_| write.registered),
            announce,
        }),
    }
}
