//! In-memory caches of the cluster state we decide from: opted-in Namespaces and
//! SpiffeRegistrations (kube-runtime reflectors), and workloads of every registered kind as
//! compact records (our own store, see `workload`, fed by our own protobuf list and watch per
//! kind, see `workload_watch`; JSON for a configured CRD's kind, see `custom_watch`).
//! Every change a decision reads pokes `trigger` (a `Notify`: coalescing, never dropped), the
//! controller's cue to re-derive desired state. The webhook reads the same caches; nothing
//! here does I/O on a request path.

mod batches;
pub mod changes;
mod custom_watch;
pub mod store;
pub mod token;
pub mod wire;
pub mod workload;
mod workload_watch;

pub use batches::Hurry;
pub use changes::{Changed, Changes};
pub use store::WorkloadStore;
pub use workload::WorkloadRecord;

use crate::keys::WorkloadKind;
use crate::policy::{Labels, OptIn, SpiffeRegistration};
use crate::spire::Ownership;
use crate::telemetry::ReadyHandle;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::Instrument;

/// What a namespace contributes to decisions: its labels and whether it is being deleted.
#[derive(Clone, Debug, Default)]
pub struct NamespaceInfo {
    pub labels: BTreeMap<String, String>,
    pub terminating: bool,
}

/// What the webhook reads: the caches, never the network.
pub trait PolicyView: Send + Sync {
    fn opt_in(&self) -> &OptIn;
    /// Names entries, so the webhook knows the only `entry-id` value the controller writes.
    fn ownership(&self) -> &Ownership;
    /// Labels of a namespace, `None` when it is not (yet) known, not opted in, or being
    /// deleted (nothing in it is stamped any more: that would undo the controller's release
    /// of its finalizers).
    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>>;
    fn policies(&self) -> Vec<Arc<SpiffeRegistration>>;
    /// Whether workloads of `kind` are registered: only those are stamped (the controller
    /// releases the finalizers of the kinds it watches, and no others).
    fn registers(&self, kind: WorkloadKind) -> bool;
    /// Kinds and labels of the other live workloads (of every kind) running as
    /// `namespace/service_account`: the policy is resolved per service account, so they
    /// count too. `except` is the admitted workload itself.
    fn sibling_labels(
        &self,
        namespace: &str,
        service_account: &str,
        except: (WorkloadKind, &str),
    ) -> Vec<(WorkloadKind, Labels)>;
    /// A workload of `kind` is being admitted: its watch stops idling, so the controller sees
    /// the object as soon as the apiserver stores it.
    fn admitted(&self, _kind: WorkloadKind) {}
}

#[derive(Clone)]
pub struct Index {
    pub opt_in: OptIn,
    pub ownership: Ownership,
    pub namespaces: Store<Namespace>,
    pub policies: Store<SpiffeRegistration>,
    pub workloads: WorkloadStore,
    /// What changed since the controller last derived desired state.
    pub changes: Changes,
    /// Cues from the webhook to the workload watches.
    pub hurry: Hurry,
    /// True once every cache has listed. kube-runtime's `Store::wait_until_ready` wakes only
    /// one waiter (a oneshot inside), so one task waits on the stores and tells everyone else.
    synced: tokio::sync::watch::Receiver<bool>,
}

impl Index {
    /// Resolves once all three caches have completed their first list.
    pub async fn synced(&self) {
        let mut synced = self.synced.clone();
        // The sender lives in a task that only ends once it has sent true.
        let _ = synced.wait_for(|synced| *synced).await;
    }

    /// An opted-in namespace's labels and whether it is being deleted.
    pub fn namespace_info(&self, namespace: &str) -> Option<NamespaceInfo> {
        let ns = self.namespaces.get(&reflector::ObjectRef::new(namespace))?;
        Some(NamespaceInfo {
            labels: ns.metadata.labels.clone().unwrap_or_default(),
            terminating: ns.metadata.deletion_timestamp.is_some(),
        })
    }
}

impl PolicyView for Index {
    fn opt_in(&self) -> &OptIn {
        &self.opt_in
    }

    fn ownership(&self) -> &Ownership {
        &self.ownership
    }

    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>> {
        self.namespace_info(namespace)
            .filter(|ns| !ns.terminating)
            .map(|ns| ns.labels)
    }

    fn policies(&self) -> Vec<Arc<SpiffeRegistration>> {
        self.policies.state()
    }

    fn registers(&self, kind: WorkloadKind) -> bool {
        self.workloads.holds(kind)
    }

    fn sibling_labels(
        &self,
        namespace: &str,
        service_account: &str,
        except: (WorkloadKind, &str),
    ) -> Vec<(WorkloadKind, Labels)> {
        self.workloads
            .running_as(namespace, service_account)
            .iter()
            .filter(|d| (d.kind, &*d.name) != except && !d.deleting)
            .map(|d| (d.kind, d.labels.clone()))
            .collect()
    }

    fn admitted(&self, kind: WorkloadKind) {
        self.hurry.admitted(kind);
    }
}

fn trim_metadata<K: Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

/// Workloads per list page. A page is held twice while it is read (the body's chunks, then
/// the body in one piece), and a Deployment as `kubectl apply` leaves it is ~10 KB of protobuf
/// (last-applied-configuration, managed fields, status): kube's default of 500 made the first
/// list the process's heap peak (18.5 MiB live of JSON pages at 3,000 Deployments, profiled
/// with `--features heap-profile`). 100 costs a list request per 100 objects, a few hundred at
/// 50,000, once per relist.
const WORKLOAD_LIST_PAGE: u32 = 100;

/// Starts the caches: namespaces, policies, then one watch per kind in `kinds`. `synced` flips
/// once all have listed; `trigger` is notified on every change after that. The tasks are
/// returned in that order, each with the name the supervisor reports it by.
pub fn start(
    client: Client,
    opt_in: OptIn,
    ownership: Ownership,
    kinds: &[WorkloadKind],
    trigger: Arc<Notify>,
    synced: ReadyHandle,
) -> (Index, Vec<(String, JoinHandle<()>)>) {
    let (namespaces, ns_writer) = reflector::store();
    let (policies, policy_writer) = reflector::store();
    let changes = Changes::default();
    let mut tasks = Vec::new();

    // Only opted-in namespaces are cached; losing the label reads as a delete.
    let ns_config = watcher::Config::default().labels(&format!("{}={}", opt_in.key, opt_in.value));
    let ns_stream = watcher(Api::<Namespace>::all(client.clone()), ns_config)
        .default_backoff()
        .modify(trim_metadata)
        .reflect(ns_writer);
    tasks.push((
        "namespace watch".to_owned(),
        spawn_drain("namespaces", ns_stream, trigger.clone(), changes.clone()),
    ));

    let policy_stream = watcher(
        Api::<SpiffeRegistration>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(trim_metadata)
    .reflect(policy_writer);
    tasks.push((
        "policy watch".to_owned(),
        spawn_drain(
            "spiffe_registrations",
            policy_stream,
            trigger.clone(),
            changes.clone(),
        ),
    ));

    // Only changes a decision reads wake the controller: the store tells them apart as it
    // applies each event.
    let (workloads, writers) = store::store_telling(kinds, changes.clone());
    let hurry = Hurry::new(kinds.iter().copied());
    for writer in writers {
        let kind = writer.kind();
        let span = tracing::info_span!("watch", %kind);
        let drain = if kind.is_custom() {
            let stream = custom_watch::workloads(client.clone(), kind, WORKLOAD_LIST_PAGE);
            batches::drain_workloads(stream, writer, trigger.clone(), hurry.clone()).boxed()
        } else {
            let stream = workload_watch::workloads(client.clone(), kind, WORKLOAD_LIST_PAGE);
            batches::drain_workloads(stream, writer, trigger.clone(), hurry.clone()).boxed()
        };
        tasks.push((
            format!("{} watch", kind.name()),
            tokio::spawn(drain.instrument(span)),
        ));
    }

    let (synced_tx, synced_rx) = tokio::sync::watch::channel(false);
    let index = Index {
        opt_in,
        ownership,
        namespaces,
        policies,
        workloads,
        changes,
        hurry,
        synced: synced_rx,
    };
    let waiting = index.clone();
    tokio::spawn(async move {
        let _ = waiting.namespaces.wait_until_ready().await;
        let _ = waiting.policies.wait_until_ready().await;
        waiting.workloads.wait_until_ready().await;
        synced_tx.send_replace(true);
        synced.release();
        tracing::info!("caches synced");
        // Keep the sender: a dropped one would end every wait with "never synced".
        std::future::pending::<()>().await;
    });
    (index, tasks)
}

/// Drives a reflector stream, poking the trigger on every event (a namespace or a policy
/// can change any service account's identity: each event calls for a full derive); watch
/// errors are logged (the backoff retries them) and never end the stream.
fn spawn_drain<S, K>(
    kind: &'static str,
    stream: S,
    trigger: Arc<Notify>,
    changes: Changes,
) -> JoinHandle<()>
where
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    K: Send + 'static,
{
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => {
                    changes.everything();
                    trigger.notify_one();
                }
                Err(error) => tracing::warn!(kind, %error, "watch failed; retrying with backoff"),
            }
        }
    })
}
