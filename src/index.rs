//! In-memory caches of the cluster state we decide from, kept by kube-runtime reflectors:
//! opted-in Namespaces, SpiffeRegistrations, and Deployments trimmed to what identity depends
//! on. Every change pokes `trigger` (a `Notify`: coalescing, never dropped), the controller's
//! cue to re-derive desired state. The webhook reads the same caches; nothing here does I/O on
//! a request path.

use crate::policy::{OptIn, SpiffeRegistration, service_account_of};
use crate::spire::Ownership;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{Namespace, PodSpec, PodTemplateSpec};
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
    /// Labels of a namespace, `None` when it is not (yet) known, not opted in, or being
    /// deleted (nothing in it is stamped any more: that would undo the controller's release
    /// of its finalizers).
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
        self.namespace_info(namespace)
            .filter(|ns| !ns.terminating)
            .map(|ns| ns.labels)
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

/// Keeps only what decisions need, so a cluster of realistic Deployments (kubectl's
/// `last-applied-configuration` alone is several KB each) costs little memory: name,
/// namespace, UID, generation, resourceVersion (guarded patches), timestamps, labels,
/// finalizers, our own annotations, and of the pod template only its service account.
///
/// `annotations` stays `Some` (possibly empty) when the object has any: JSON Patch paths
/// depend on whether the map exists, and adding a map that exists would replace it.
fn trim_deployment(deployment: &mut Deployment) {
    let meta = &mut deployment.metadata;
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.generate_name = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.retain(|key, _| key.starts_with(OUR_ANNOTATION_PREFIX));
    }
    deployment.status = None;
    deployment.spec = deployment.spec.take().map(|spec| {
        let pod = spec.template.spec.unwrap_or_default();
        DeploymentSpec {
            template: PodTemplateSpec {
                metadata: None,
                spec: Some(PodSpec {
                    service_account_name: pod.service_account_name,
                    service_account: pod.service_account,
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }
    });
}

/// Whether two trimmed versions of a Deployment differ in anything a decision reads. Status
/// updates, rollouts (generation) and other writers' annotations change only what is ignored
/// here, so they cause no sync.
fn differs_for_decisions(old: &Deployment, new: &Deployment) -> bool {
    let mut new = new.clone();
    new.metadata.resource_version = old.metadata.resource_version.clone();
    new.metadata.generation = old.metadata.generation;
    *old != new
}

fn trim_metadata<K: Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

/// Every annotation we write starts with this; no other annotation is kept in the cache.
const OUR_ANNOTATION_PREFIX: &str = "registrar.spiffe.io/";

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

    // Only changes a decision reads wake the controller: the comparison runs against the
    // cached version before the reflector replaces it.
    let relevant = Arc::new(AtomicBool::new(true));
    let cached = deployments.clone();
    let flag = relevant.clone();
    let deployment_stream = watcher(Api::<Deployment>::all(client), watcher::Config::default())
        .default_backoff()
        .modify(trim_deployment)
        .map(move |event| {
            let changed = match &event {
                Ok(watcher::Event::Apply(new)) => cached
                    .get(&reflector::ObjectRef::from_obj(new))
                    .is_none_or(|old| differs_for_decisions(&old, new)),
                Ok(watcher::Event::InitApply(_) | watcher::Event::Init) => false,
                _ => true,
            };
            flag.store(changed, Ordering::SeqCst);
            event
        })
        .reflect(deployment_writer);
    tasks.push(spawn_filtered_drain(
        "deployments",
        deployment_stream,
        trigger,
        relevant,
    ));

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
    spawn_filtered_drain(kind, stream, trigger, Arc::new(AtomicBool::new(true)))
}

/// As `spawn_drain`, poking the trigger only when `relevant` (set by an earlier stage of the
/// same stream, for the event just yielded) says the event matters.
fn spawn_filtered_drain<S, K>(
    kind: &'static str,
    stream: S,
    trigger: Arc<Notify>,
    relevant: Arc<AtomicBool>,
) -> JoinHandle<()>
where
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    K: Send + 'static,
{
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) if relevant.load(Ordering::SeqCst) => trigger.notify_one(),
                Ok(_) => {}
                Err(error) => tracing::warn!(kind, %error, "watch failed; retrying with backoff"),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::mk_deployment;

    fn realistic() -> Deployment {
        let mut d = mk_deployment("a", "web", Some("api"), &[("app", "web")]);
        d.metadata.annotations = Some(BTreeMap::from([
            (
                "kubectl.kubernetes.io/last-applied-configuration".to_string(),
                "x".repeat(4096),
            ),
            (
                "registrar.spiffe.io/spiffe-id".to_string(),
                "spiffe://td/ns/a/sa/api".to_string(),
            ),
        ]));
        d.metadata.resource_version = Some("1".into());
        d.metadata.generation = Some(1);
        d
    }

    #[test]
    fn trimming_keeps_what_decisions_read_and_nothing_else() {
        let mut d = realistic();
        trim_deployment(&mut d);
        let annotations = d.metadata.annotations.as_ref().expect("still Some");
        assert_eq!(annotations.len(), 1, "only ours");
        assert_eq!(service_account_of(&d), "api");
        assert_eq!(d.metadata.labels.as_ref().map(BTreeMap::len), Some(1));
        let size = serde_json::to_vec(&d).expect("serializes").len();
        assert!(size < 600, "trimmed to {size} bytes");
        let mut bare = mk_deployment("a", "bare", None, &[]);
        bare.metadata.annotations = Some(BTreeMap::from([("other".into(), "x".into())]));
        trim_deployment(&mut bare);
        assert_eq!(
            bare.metadata.annotations,
            Some(BTreeMap::new()),
            "the map's existence is kept for JSON Patch paths"
        );
    }

    #[test]
    fn status_rollouts_and_foreign_annotations_are_not_changes() {
        let mut old = realistic();
        trim_deployment(&mut old);
        let mut status_only = realistic();
        status_only.metadata.resource_version = Some("2".into());
        status_only.status = Some(Default::default());
        trim_deployment(&mut status_only);
        assert!(!differs_for_decisions(&old, &status_only));

        let mut rollout = realistic();
        rollout.metadata.generation = Some(2);
        if let Some(spec) = rollout.spec.as_mut() {
            spec.replicas = Some(5);
        }
        rollout
            .metadata
            .annotations
            .as_mut()
            .expect("annotations")
            .insert("deployment.kubernetes.io/revision".into(), "2".into());
        trim_deployment(&mut rollout);
        assert!(!differs_for_decisions(&old, &rollout));

        for edit in [
            |d: &mut Deployment| {
                d.metadata
                    .labels
                    .as_mut()
                    .expect("labels")
                    .insert("tier".into(), "x".into());
            },
            |d: &mut Deployment| d.metadata.finalizers = Some(vec!["f".into()]),
            |d: &mut Deployment| {
                d.spec.as_mut().expect("spec").template.spec = Some(PodSpec {
                    service_account_name: Some("other".into()),
                    ..PodSpec::default()
                })
            },
            |d: &mut Deployment| {
                d.metadata
                    .annotations
                    .as_mut()
                    .expect("annotations")
                    .insert("registrar.spiffe.io/entry-id".into(), "x".into());
            },
        ] {
            let mut changed = realistic();
            edit(&mut changed);
            trim_deployment(&mut changed);
            assert!(differs_for_decisions(&old, &changed));
        }
    }
}
