//! The Deployment writer: applies `decide::workload_writes` output (patches and Events) in a
//! background task, at most `PATCH_CONCURRENCY` at once, so annotations for one SPIRE batch
//! go out while the next batch is still in flight. Writes wait in a queue as plain data; only those
//! in flight are futures (a kube request future is kilobytes: a first sync of 10,000
//! Deployments spawned as tasks at once took tens of MiB).

use super::decide::WorkloadWrite;
use super::desired::{DeploymentKey, Desired};
use super::events::EventSink;
use super::metrics::ControllerMetrics;
use super::record::write_workload;
use crate::index::DeploymentRecord;
use futures::StreamExt;
use kube::Client;
use prometheus::IntCounter;
use std::collections::HashSet;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{Instrument, info};

/// Deployment patches in flight at once. (Fewer while SPIRE entries are being created did not
/// bring the entries sooner: at 10,000 Deployments SPIRE's own create rate bounds them, and
/// the annotations only came later.)
const PATCH_CONCURRENCY: usize = 16;

pub struct WorkloadWriter {
    metrics: ControllerMetrics,
    /// The cached objects the writes are computed against (patches test what they rely on),
    /// sorted by namespace and name: the sync's snapshot itself, not a map of it (a map
    /// cost ~50 bytes per Deployment for the whole sync).
    deployments: Arc<[Arc<DeploymentRecord>]>,
    /// Deployments already handed a write this sync: a later, wider pass computed from the
    /// same cache would only repeat it.
    written: HashSet<DeploymentKey>,
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
    deployment: Arc<DeploymentRecord>,
    write: WorkloadWrite,
    /// `spiffe_registration_total{namespace}`, counted once the entry-id is on the object.
    registrations: IntCounter,
}

impl WorkloadWriter {
    pub fn new(
        client: Client,
        events: EventSink,
        metrics: ControllerMetrics,
        deployments: Arc<[Arc<DeploymentRecord>]>,
    ) -> Self {
        debug_assert!(deployments.is_sorted_by(|a, b| by_key(a, b).is_le()));
        let (queue, jobs) = mpsc::unbounded_channel();
        let driver = tokio::spawn(
            drive(client, events, jobs).instrument(tracing::info_span!("workload_writer")),
        );
        Self {
            metrics,
            deployments,
            written: HashSet::new(),
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
            let Some(deployment) = self.deployment(&write.key) else {
                continue;
            };
            self.count(desired, &write);
            let registrations = self
                .metrics
                .registrations
                .with_label_values(&[&*write.key.namespace]);
            // The driver lives until `finish` drops the queue, so this cannot fail.
            let _ = self.queue.send(Job {
                deployment,
                write,
                registrations,
            });
        }
    }

    fn deployment(&self, key: &DeploymentKey) -> Option<Arc<DeploymentRecord>> {
        find(&self.deployments, key)
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

/// A write whose patch failed. Its outcome can still be that it landed: an overloaded
/// apiserver gives up on a request after committing it, and reading it back at once can come
/// too early. A later sync settles it (`decide::Memory::settle_failed_writes`).
#[derive(Debug)]
pub struct FailedWrite {
    pub key: DeploymentKey,
    /// The entry ID a first registration carried (counted if it turns out to have landed).
    pub registered: Option<Arc<str>>,
    /// Its Events, not published.
    pub announce: Vec<super::decide::Announce>,
}

impl Finished {
    fn absorb(mut self, other: Finished) -> Finished {
        self.patch_failed |= other.patch_failed;
        self.failed.extend(other.failed);
        self
    }
}

/// `key`'s record in a snapshot sorted `by_key`.
pub fn find(
    snapshot: &[Arc<DeploymentRecord>],
    key: &DeploymentKey,
) -> Option<Arc<DeploymentRecord>> {
    let at = snapshot
        .binary_search_by(|d| (&*d.namespace, &*d.name).cmp(&(&*key.namespace, &*key.name)))
        .ok()?;
    Some(snapshot[at].clone())
}

/// The order `WorkloadWriter::new` expects its snapshot in.
pub fn by_key(a: &Arc<DeploymentRecord>, b: &Arc<DeploymentRecord>) -> std::cmp::Ordering {
    (&*a.namespace, &*a.name).cmp(&(&*b.namespace, &*b.name))
}

/// Runs queued writes, at most `PATCH_CONCURRENCY` at once.
async fn drive(client: Client, events: EventSink, jobs: mpsc::UnboundedReceiver<Job>) -> Finished {
    let mut jobs = jobs;
    futures::stream::poll_fn(move |cx| jobs.poll_recv(cx))
        .map(|job| {
            let (client, events) = (&client, &events);
            async move {
                let Job {
                    deployment,
                    write,
                    registrations,
                } = job;
                let span = tracing::debug_span!(
                    "write",
                    deployment = %deployment.name,
                    namespace = %deployment.namespace
                );
                let entry_id = write.change.entry_id.clone().flatten();
                let written =
                    write_workload(client, events, deployment, write.change, write.announce)
                        .instrument(span)
                        .await;
                match written {
                    Ok(()) => {
                        if write.registered {
                            registrations.inc();
                        }
                        Finished::default()
                    }
                    Err(announce) => Finished {
                        patch_failed: true,
                        failed: vec![FailedWrite {
                            key: write.key,
                            registered: entry_id.filter(|_| write.registered),
                            announce,
                        }],
                    },
                }
            }
        })
        .buffer_unordered(PATCH_CONCURRENCY)
        .fold(
            Finished::default(),
            |all, this| async move { all.absorb(this) },
        )
        .await
}
