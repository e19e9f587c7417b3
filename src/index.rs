//! In-memory caches of the cluster state we decide from, kept by kube-runtime reflectors:
//! opted-in Namespaces, SpiffeRegistrations, and Deployments trimmed to what identity depends
//! on. Every change pokes `trigger` (a `Notify`: coalescing, never dropped), the controller's
//! cue to re-derive desired state. The webhook reads the same caches; nothing here does I/O on
//! a request path.

use crate::policy::{OptIn, SpiffeRegistration, service_account_of};
use crate::spire::Ownership;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, PodSpec};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

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
    /// Labels of a namespace, `None` when it is not (yet) known or not opted in.
    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>>;
    fn policies(&self) -> Vec<Arc<SpiffeRegistration>>;
    /// Labels of the other live Deployments running as `namespace/service_account`: the
    /// policy is resolved per service account, so they count too.
    fn sibling_labels(
        &self,
        namespace: &str,
        service_account: &str,
        except: &str,
    ) -> Vec<BTreeMap<String, String>>;
}

#[derive(Clone)]
pub struct Index {
    pub opt_in: OptIn,
    pub ownership: Ownership,
    pub namespaces: Store<Namespace>,
    pub policies: Store<SpiffeRegistration>,
    pub deployments: Store<Deployment>,
}

impl Index {
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
        self.namespace_info(namespace).map(|ns| ns.labels)
    }

    fn policies(&self) -> Vec<Arc<SpiffeRegistration>> {
        self.policies.state()
    }

    fn sibling_labels(
        &self,
        namespace: &str,
        service_account: &str,
        except: &str,
    ) -> Vec<BTreeMap<String, String>> {
        // A scan of the Deployment cache; a per-namespace index is issue 11's compact store.
        self.deployments
            .state()
            .iter()
            .filter(|d| {
                d.metadata.namespace.as_deref() == Some(namespace)
                    && d.metadata.name.as_deref() != Some(except)
                    && d.metadata.deletion_timestamp.is_none()
                    && service_account_of(d) == service_account
            })
            .map(|d| d.metadata.labels.clone().unwrap_or_default())
            .collect()
    }
}

/// Keeps only what decisions need, so 10,000 Deployments cost little memory: metadata without
/// managedFields, and of the pod template only its service account.
fn trim_deployment(deployment: &mut Deployment) {
    deployment.metadata.managed_fields = None;
    deployment.status = None;
    if let Some(spec) = deployment.spec.as_mut() {
        let pod = spec.template.spec.take().unwrap_or_default();
        spec.template.spec = Some(PodSpec {
            service_account_name: pod.service_account_name,
            service_account: pod.service_account,
            containers: Vec::new(),
            ..PodSpec::default()
        });
        spec.template.metadata = None;
    }
}

fn trim_metadata<K: Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

/// Starts the three reflectors. `synced` flips once all three have listed; `trigger` is
/// notified on every change after that.
pub fn start(
    client: Client,
    opt_in: OptIn,
    ownership: Ownership,
    trigger: Arc<Notify>,
    synced: Arc<AtomicBool>,
) -> (Index, Vec<JoinHandle<()>>) {
    let (namespaces, ns_writer) = reflector::store();
    let (policies, policy_writer) = reflector::store();
    let (deployments, deployment_writer) = reflector::store();
    let mut tasks = Vec::new();

    // Only opted-in namespaces are cached; losing the label reads as a delete.
    let ns_config = watcher::Config::default().labels(&format!("{}={}", opt_in.key, opt_in.value));
    let ns_stream = watcher(Api::<Namespace>::all(client.clone()), ns_config)
        .default_backoff()
        .modify(trim_metadata)
        .reflect(ns_writer);
    tasks.push(spawn_drain("namespaces", ns_stream, trigger.clone()));

    let policy_stream = watcher(
        Api::<SpiffeRegistration>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(trim_metadata)
    .reflect(policy_writer);
    tasks.push(spawn_drain(
        "spiffe_registrations",
        policy_stream,
        trigger.clone(),
    ));

    let deployment_stream = watcher(Api::<Deployment>::all(client), watcher::Config::default())
        .default_backoff()
        .modify(trim_deployment)
        .reflect(deployment_writer);
    tasks.push(spawn_drain("deployments", deployment_stream, trigger));

    let index = Index {
        opt_in,
        ownership,
        namespaces,
        policies,
        deployments,
    };
    let waiting = index.clone();
    tasks.push(tokio::spawn(async move {
        let _ = waiting.namespaces.wait_until_ready().await;
        let _ = waiting.policies.wait_until_ready().await;
        let _ = waiting.deployments.wait_until_ready().await;
        synced.store(true, Ordering::SeqCst);
        tracing::info!("caches synced");
    }));
    (index, tasks)
}

/// Drives a reflector stream, poking the trigger on every event; watch errors are logged
/// (the backoff retries them) and never end the stream.
fn spawn_drain<S, K>(kind: &'static str, stream: S, trigger: Arc<Notify>) -> JoinHandle<()>
where
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    K: Send + 'static,
{
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => trigger.notify_one(),
                Err(error) => tracing::warn!(kind, %error, "watch failed; retrying with backoff"),
            }
        }
    })
}
