//! The Deployment cache: records by namespace, then name. Our own store rather than
//! kube-runtime's reflector, so it holds compact records, can tell whether an event changed
//! anything a decision reads, and answers "the other Deployments of this service account"
//! from one namespace rather than from the whole cluster.

use super::deployment::{DeploymentRecord, WatchedDeployment};
use kube::runtime::watcher;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use tokio::sync::watch;

type Namespace = HashMap<Arc<str>, Arc<DeploymentRecord>>;
type Namespaces = HashMap<Arc<str>, Namespace>;

#[derive(Default)]
struct Contents {
    by_namespace: Namespaces,
    /// A relist in progress: filled by `InitApply`, swapped in at `InitDone`.
    relisting: Option<Namespaces>,
}

/// Stores `record`, sharing its namespace string with the namespace's other records and its
/// name with the map key.
fn insert(into: &mut Namespaces, mut record: DeploymentRecord) -> Option<Arc<DeploymentRecord>> {
    if let Some((namespace, _)) = into.get_key_value(&*record.namespace) {
        record.namespace = namespace.clone();
    }
    into.entry(record.namespace.clone())
        .or_default()
        .insert(record.name.clone(), Arc::new(record))
}

/// Read side, cheap to clone; shared by the webhook and the controller.
#[derive(Clone)]
pub struct DeploymentStore {
    contents: Arc<RwLock<Contents>>,
    ready: watch::Receiver<bool>,
}

/// Write side, owned by the watch task.
pub struct DeploymentStoreWriter {
    contents: Arc<RwLock<Contents>>,
    ready: watch::Sender<bool>,
}

pub fn store() -> (DeploymentStore, DeploymentStoreWriter) {
    let contents = Arc::new(RwLock::new(Contents::default()));
    let (tx, rx) = watch::channel(false);
    (
        DeploymentStore {
            contents: contents.clone(),
            ready: rx,
        },
        DeploymentStoreWriter {
            contents,
            ready: tx,
        },
    )
}

impl DeploymentStore {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Contents> {
        // A panic while holding the lock leaves whole records behind (each write is one
        // insert or remove), so the data is still usable.
        self.contents.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Every record: a vector of pointers, taken under a short read lock.
    pub fn state(&self) -> Vec<Arc<DeploymentRecord>> {
        let contents = self.read();
        let mut all = Vec::with_capacity(contents.by_namespace.values().map(HashMap::len).sum());
        for namespace in contents.by_namespace.values() {
            all.extend(namespace.values().cloned());
        }
        all
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<DeploymentRecord>> {
        self.read().by_namespace.get(namespace)?.get(name).cloned()
    }

    pub fn len(&self) -> usize {
        self.read().by_namespace.values().map(HashMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The records in `namespace` matching `keep`: work proportional to that namespace.
    pub fn in_namespace(
        &self,
        namespace: &str,
        keep: impl Fn(&DeploymentRecord) -> bool,
    ) -> Vec<Arc<DeploymentRecord>> {
        self.read()
            .by_namespace
            .get(namespace)
            .map(|records| records.values().filter(|r| keep(r)).cloned().collect())
            .unwrap_or_default()
    }

    /// Resolves once the first complete list has been stored.
    pub async fn wait_until_ready(&self) {
        let mut ready = self.ready.clone();
        // The sender lives as long as the watch task; if it is gone, nothing will ever list.
        let _ = ready.wait_for(|ready| *ready).await;
    }
}

impl DeploymentStoreWriter {
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Contents> {
        self.contents.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies one watch event; true when it changed something a decision reads (status
    /// updates, rollouts and other writers' annotations do not).
    pub fn apply(&self, event: watcher::Event<WatchedDeployment>) -> bool {
        match event {
            watcher::Event::Apply(object) => {
                let record = object.record();
                let mut contents = self.write();
                let previous = insert(&mut contents.by_namespace, record.clone());
                previous.is_none_or(|old| old.differs_for_decisions(&record))
            }
            watcher::Event::Delete(object) => {
                let record = object.record();
                let mut contents = self.write();
                let namespace = contents.by_namespace.get_mut(&*record.namespace);
                let removed = namespace.and_then(|n| n.remove(&*record.name)).is_some();
                if contents
                    .by_namespace
                    .get(&*record.namespace)
                    .is_some_and(HashMap::is_empty)
                {
                    contents.by_namespace.remove(&*record.namespace);
                }
                removed
            }
            watcher::Event::Init => {
                self.write().relisting = Some(HashMap::new());
                false
            }
            watcher::Event::InitApply(object) => {
                let mut contents = self.write();
                let relisting = contents.relisting.get_or_insert_with(HashMap::new);
                insert(relisting, object.record());
                false
            }
            watcher::Event::InitDone => {
                {
                    let mut contents = self.write();
                    contents.by_namespace = contents.relisting.take().unwrap_or_default();
                }
                self.ready.send_replace(true);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::mk_deployment;

    fn watched(namespace: &str, name: &str, sa: &str, version: &str) -> WatchedDeployment {
        let mut d = mk_deployment(namespace, name, Some(sa), &[("app", name)]);
        d.metadata.resource_version = Some(version.into());
        serde_json::from_value(serde_json::to_value(d).expect("serializes")).expect("decodes")
    }

    #[tokio::test]
    async fn relists_swap_in_whole_and_changes_are_told_apart() {
        let (store, writer) = store();
        assert!(!writer.apply(watcher::Event::Init));
        assert!(!writer.apply(watcher::Event::InitApply(watched("a", "web", "api", "1"))));
        assert!(
            store.is_empty(),
            "nothing is visible before the list completes"
        );
        assert!(writer.apply(watcher::Event::InitDone));
        store.wait_until_ready().await;
        assert_eq!(store.len(), 1);

        assert!(
            !writer.apply(watcher::Event::Apply(watched("a", "web", "api", "2"))),
            "a new resourceVersion alone is no change"
        );
        assert_eq!(
            store
                .get("a", "web")
                .map(|r| r.resource_version.to_string()),
            Some("2".into()),
            "but the record is refreshed for patch guards"
        );
        assert!(writer.apply(watcher::Event::Apply(watched("a", "web", "other", "3"))));
        assert!(writer.apply(watcher::Event::Apply(watched("a", "db", "api", "4"))));
        assert!(writer.apply(watcher::Event::Apply(watched("b", "x", "api", "5"))));
        let api_in_a = store.in_namespace("a", |r| &*r.service_account == "api");
        assert_eq!(api_in_a.len(), 1);
        assert_eq!(&*api_in_a[0].name, "db");

        assert!(writer.apply(watcher::Event::Delete(watched("b", "x", "api", "6"))));
        assert!(!writer.apply(watcher::Event::Delete(watched("b", "x", "api", "6"))));
        assert_eq!(store.len(), 2);

        // A relist replaces everything: what it does not list is gone.
        writer.apply(watcher::Event::Init);
        writer.apply(watcher::Event::InitApply(watched("c", "new", "api", "7")));
        assert_eq!(
            store.len(),
            2,
            "the old contents serve until the relist completes"
        );
        writer.apply(watcher::Event::InitDone);
        assert_eq!(store.len(), 1);
        assert!(store.get("c", "new").is_some());
    }
}
