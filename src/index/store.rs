//! The workload cache: one table per kind, records by namespace, then name. Our own store
//! rather than kube-runtime's reflector, so it holds compact records, can tell whether an
//! event changed anything a decision reads, and answers "the other workloads of this service
//! account" (of every kind: one identity, one ref-count) from one namespace rather than from
//! the whole cluster. A table per kind because each kind is listed and relisted by its own
//! watch: a relist swaps in one kind's table whole.

use super::changes::Changes;
use super::workload::{WatchedWorkload, WorkloadRecord};
use crate::keys::{WorkloadKey, WorkloadKind};
use kube::runtime::watcher;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use tokio::sync::watch;

type Namespaces = HashMap<Arc<str>, Namespace>;

/// One namespace's records, by name and by service account.
#[derive(Default)]
struct Namespace {
    records: HashMap<Arc<str>, Arc<WorkloadRecord>>,
    /// The names running as each service account. The webhook resolves a policy per service
    /// account, so every admission reads a Deployment's siblings: a lookup here, not a scan of
    /// the namespace (a thousand records each at 50,000 Deployments).
    by_account: HashMap<Arc<str>, Box<[Arc<str>]>>,
}

impl Namespace {
    fn insert(&mut self, record: Arc<WorkloadRecord>) -> Option<Arc<WorkloadRecord>> {
        let previous = self.records.insert(record.name.clone(), record.clone());
        match &previous {
            Some(old) if old.service_account == record.service_account => {}
            _ => {
                if let Some(old) = &previous {
                    self.unlink(old);
                }
                let names = self
                    .by_account
                    .remove(&record.service_account)
                    .unwrap_or_default();
                let names = names.iter().cloned().chain([record.name.clone()]).collect();
                self.by_account
                    .insert(record.service_account.clone(), names);
            }
        }
        previous
    }

    fn remove(&mut self, name: &str) -> Option<Arc<WorkloadRecord>> {
        let removed = self.records.remove(name)?;
        self.unlink(&removed);
        Some(removed)
    }

    fn unlink(&mut self, record: &WorkloadRecord) {
        let Some(names) = self.by_account.remove(&record.service_account) else {
            return;
        };
        let rest: Box<[Arc<str>]> = names
            .iter()
            .filter(|name| **name != record.name)
            .cloned()
            .collect();
        if !rest.is_empty() {
            self.by_account.insert(record.service_account.clone(), rest);
        }
    }

    fn len(&self) -> usize {
        self.records.len()
    }
}

#[derive(Default)]
struct Contents {
    by_namespace: Namespaces,
    /// A relist in progress: filled by `InitApply`, swapped in at `InitDone`.
    relisting: Option<Namespaces>,
    shared: Shared,
}

/// One copy of each value that many records repeat: the namespace, the service account
/// (two or more Deployments per account), our annotations (one value per account), the
/// finalizer list (ours alone, nearly always). At 50,000 Deployments a copy per record is
/// several MiB of identical strings.
#[derive(Default)]
struct Shared {
    strings: HashSet<Arc<str>>,
    finalizer_lists: HashSet<Arc<[Box<str>]>>,
    /// Records replaced or removed since values nobody uses any more were dropped.
    released: usize,
}

/// Values are dropped from `Shared` once this many records were released, or as many as
/// it holds, whichever is more: the sweep is O(values), so it stays amortised O(1).
const SWEEP_AFTER: usize = 4096;

impl Shared {
    fn string(&mut self, value: &Arc<str>) -> Arc<str> {
        if let Some(shared) = self.strings.get(value) {
            return shared.clone();
        }
        self.strings.insert(value.clone());
        value.clone()
    }

    fn share(&mut self, record: &mut WorkloadRecord) {
        record.namespace = self.string(&record.namespace);
        record.service_account = self.string(&record.service_account);
        if let Some(annotations) = &mut record.annotations {
            for value in [&mut annotations.spiffe_id, &mut annotations.entry_id]
                .into_iter()
                .flatten()
            {
                *value = self.string(value);
            }
        }
        if let Some(list) = &mut record.finalizers {
            *list = match self.finalizer_lists.get(list) {
                Some(shared) => shared.clone(),
                None => {
                    self.finalizer_lists.insert(list.clone());
                    list.clone()
                }
            };
        }
    }

    /// Notes that a record was replaced or removed; drops unused values now and then.
    fn released(&mut self) {
        self.released += 1;
        if self.released >= SWEEP_AFTER.max(self.strings.len()) {
            self.sweep();
        }
    }

    /// Drops the values only this table still holds.
    fn sweep(&mut self) {
        self.strings.retain(|s| Arc::strong_count(s) > 1);
        self.finalizer_lists.retain(|l| Arc::strong_count(l) > 1);
        self.released = 0;
    }
}

/// Stores `record` with its repeated values shared (see `Shared`) and its name shared with
/// the map key.
fn insert(
    into: &mut Namespaces,
    shared: &mut Shared,
    mut record: WorkloadRecord,
) -> Option<Arc<WorkloadRecord>> {
    shared.share(&mut record);
    let previous = into
        .entry(record.namespace.clone())
        .or_default()
        .insert(Arc::new(record));
    if previous.is_some() {
        shared.released();
    }
    previous
}

/// Read side, cheap to clone; shared by the webhook and the controller. Answers across
/// every kind it was made for.
#[derive(Clone)]
pub struct WorkloadStore {
    kinds: Arc<[KindTable]>,
}

/// One kind's records.
#[derive(Clone)]
struct KindTable {
    kind: WorkloadKind,
    contents: Arc<RwLock<Contents>>,
    ready: watch::Receiver<bool>,
}

/// Write side of one kind's table, owned by that kind's watch task.
pub struct WorkloadStoreWriter {
    kind: WorkloadKind,
    contents: Arc<RwLock<Contents>>,
    ready: watch::Sender<bool>,
    /// Told which service accounts each event touched.
    changes: Changes,
}

/// A store of Deployments alone (tests of one kind).
pub fn store() -> (WorkloadStore, WorkloadStoreWriter) {
    let (store, mut writers) = store_telling(&[WorkloadKind::Deployment], Changes::default());
    (store, writers.remove(0))
}

/// A store of `kinds`, with a writer per kind (in the same order) that tells `changes` what
/// each event touched.
pub fn store_telling(
    kinds: &[WorkloadKind],
    changes: Changes,
) -> (WorkloadStore, Vec<WorkloadStoreWriter>) {
    let mut tables = Vec::with_capacity(kinds.len());
    let mut writers = Vec::with_capacity(kinds.len());
    for &kind in kinds {
        let contents = Arc::new(RwLock::new(Contents::default()));
        let (tx, rx) = watch::channel(false);
        tables.push(KindTable {
            kind,
            contents: contents.clone(),
            ready: rx,
        });
        writers.push(WorkloadStoreWriter {
            kind,
            contents,
            ready: tx,
            changes: changes.clone(),
        });
    }
    (
        WorkloadStore {
            kinds: tables.into(),
        },
        writers,
    )
}

impl WorkloadStore {
    /// The kinds this store holds.
    pub fn kinds(&self) -> impl Iterator<Item = WorkloadKind> + '_ {
        self.kinds.iter().map(|table| table.kind)
    }

    /// Whether `kind` is held (watched, registered, stamped by the webhook).
    pub fn holds(&self, kind: WorkloadKind) -> bool {
        self.kinds().any(|k| k == kind)
    }

    fn table(&self, kind: WorkloadKind) -> Option<&KindTable> {
        self.kinds.iter().find(|table| table.kind == kind)
    }

    /// Every record of every kind: a vector of pointers, each table read under a short lock.
    pub fn state(&self) -> Vec<Arc<WorkloadRecord>> {
        let mut all = Vec::with_capacity(self.len());
        for table in self.kinds.iter() {
            table.extend_with_all(&mut all);
        }
        all
    }

    pub fn get(&self, key: &WorkloadKey) -> Option<Arc<WorkloadRecord>> {
        self.table(key.kind)?.get(&key.namespace, &key.name)
    }

    /// A Deployment's record (tests, and callers that only know Deployments).
    pub fn deployment(&self, namespace: &str, name: &str) -> Option<Arc<WorkloadRecord>> {
        self.table(WorkloadKind::Deployment)?.get(namespace, name)
    }

    pub fn len(&self) -> usize {
        self.kinds.iter().map(KindTable::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The records of every kind running as `namespace/service_account`: work proportional
    /// to them alone.
    pub fn running_as(&self, namespace: &str, service_account: &str) -> Vec<Arc<WorkloadRecord>> {
        let mut all = Vec::new();
        for table in self.kinds.iter() {
            table.extend_running_as(namespace, service_account, &mut all);
        }
        all
    }

    /// Resolves once every kind's first complete list has been stored.
    pub async fn wait_until_ready(&self) {
        for table in self.kinds.iter() {
            let mut ready = table.ready.clone();
            // The sender lives as long as the watch task; if it is gone, nothing will ever
            // list.
            let _ = ready.wait_for(|ready| *ready).await;
        }
    }
}

impl KindTable {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Contents> {
        // A panic while holding the lock leaves whole records behind (each write is one
        // insert or remove), so the data is still usable.
        self.contents.read().unwrap_or_else(|p| p.into_inner())
    }

    fn extend_with_all(&self, all: &mut Vec<Arc<WorkloadRecord>>) {
        let contents = self.read();
        for namespace in contents.by_namespace.values() {
            all.extend(namespace.records.values().cloned());
        }
    }

    fn get(&self, namespace: &str, name: &str) -> Option<Arc<WorkloadRecord>> {
        self.read()
            .by_namespace
            .get(namespace)?
            .records
            .get(name)
            .cloned()
    }

    fn len(&self) -> usize {
        self.read().by_namespace.values().map(Namespace::len).sum()
    }

    fn extend_running_as(
        &self,
        namespace: &str,
        service_account: &str,
        all: &mut Vec<Arc<WorkloadRecord>>,
    ) {
        let contents = self.read();
        let Some(namespace) = contents.by_namespace.get(namespace) else {
            return;
        };
        all.extend(
            namespace
                .by_account
                .get(service_account)
                .into_iter()
                .flat_map(|names| names.iter())
                .filter_map(|name| namespace.records.get(name).cloned()),
        );
    }
}

impl WorkloadStoreWriter {
    /// The kind whose table this writes.
    pub fn kind(&self) -> WorkloadKind {
        self.kind
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Contents> {
        self.contents.write().unwrap_or_else(|p| p.into_inner())
    }

    /// An object added or changed; true when a decision reads what changed.
    fn applied(&self, object: &WatchedWorkload) -> bool {
        let mut contents = self.write();
        let Contents {
            by_namespace,
            shared,
            ..
        } = &mut *contents;
        let record = object.record(self.kind);
        let key = (record.namespace.clone(), record.name.clone());
        let previous = insert(by_namespace, shared, record);
        let stored = &by_namespace[&key.0].records[&key.1];
        let (beyond_marks, marks) = previous.as_ref().map_or((true, false), |old| {
            (old.differs_beyond_marks(stored), old.marks_differ(stored))
        });
        if beyond_marks {
            self.changes.account(stored.service_account_key());
            if let Some(old) = previous.filter(|old| old.service_account != stored.service_account)
            {
                // Moved to another service account: the old one lost a workload.
                self.changes.account(old.service_account_key());
            }
        } else if marks {
            self.changes.marks(stored.service_account_key());
        }
        beyond_marks || marks
    }

    /// An object gone; true when it was held.
    fn deleted(&self, object: &WatchedWorkload) -> bool {
        let record = object.record(self.kind);
        let mut contents = self.write();
        let namespace = contents.by_namespace.get_mut(&*record.namespace);
        let removed = namespace.and_then(|n| n.remove(&record.name));
        if let Some(removed) = &removed {
            contents.shared.released();
            self.changes.account(removed.service_account_key());
        }
        if contents
            .by_namespace
            .get(&*record.namespace)
            .is_some_and(|n| n.len() == 0)
        {
            contents.by_namespace.remove(&*record.namespace);
        }
        removed.is_some()
    }

    /// Applies one watch event; true when it changed something a decision reads (status
    /// updates, rollouts and other writers' annotations do not). Of Pods, only bare ones are
    /// kept: a Pod a controller owns (or comes to own, by adoption) is as good as deleted.
    pub fn apply(&self, event: watcher::Event<WatchedWorkload>) -> bool {
        let owned =
            |object: &WatchedWorkload| self.kind == WorkloadKind::Pod && object.controlled();
        let event = match event {
            watcher::Event::Apply(pod) if owned(&pod) => watcher::Event::Delete(pod),
            // Not listed: the relist's table is swapped in whole.
            watcher::Event::InitApply(pod) if owned(&pod) => return false,
            event => event,
        };
        match event {
            watcher::Event::Apply(object) => self.applied(&object),
            watcher::Event::Delete(object) => self.deleted(&object),
            watcher::Event::Init => {
                self.write().relisting = Some(HashMap::new());
                false
            }
            watcher::Event::InitApply(object) => {
                let mut contents = self.write();
                let Contents {
                    relisting, shared, ..
                } = &mut *contents;
                insert(
                    relisting.get_or_insert_with(HashMap::new),
                    shared,
                    object.record(self.kind),
                );
                false
            }
            watcher::Event::InitDone => {
                {
                    let mut contents = self.write();
                    contents.by_namespace = contents.relisting.take().unwrap_or_default();
                    contents.shared.sweep();
                }
                // A relist may have missed deletions and edits: only a full derive is sure.
                self.changes.everything();
                self.ready.send_replace(true);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{mk_deployment, mk_watched as watched};

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
                .deployment("a", "web")
                .map(|r| r.resource_version.to_string()),
            Some("2".into()),
            "but the record is refreshed for patch guards"
        );
        assert!(writer.apply(watcher::Event::Apply(watched("a", "web", "other", "3"))));
        assert!(writer.apply(watcher::Event::Apply(watched("a", "db", "api", "4"))));
        assert!(writer.apply(watcher::Event::Apply(watched("b", "x", "api", "5"))));
        let api_in_a = store.running_as("a", "api");
        assert_eq!(api_in_a.len(), 1);
        assert_eq!(&*api_in_a[0].name, "db");
        assert_eq!(store.running_as("a", "other").len(), 1, "web moved there");
        writer.apply(watcher::Event::Apply(watched("a", "cron", "api", "4")));
        let mut names: Vec<_> = store
            .running_as("a", "api")
            .iter()
            .map(|r| r.name.to_string())
            .collect();
        names.sort();
        assert_eq!(names, ["cron", "db"]);
        writer.apply(watcher::Event::Delete(watched("a", "cron", "api", "4")));
        writer.apply(watcher::Event::Apply(watched("a", "web", "api", "4")));
        assert!(store.running_as("a", "other").is_empty(), "web moved back");
        assert_eq!(store.running_as("a", "api").len(), 2);
        assert!(store.running_as("nowhere", "api").is_empty());
        writer.apply(watcher::Event::Apply(watched("a", "web", "other", "4")));

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
        assert!(store.deployment("c", "new").is_some());
    }

    /// One identity per service account whatever runs as it: siblings and the whole state
    /// span kinds, a name may repeat across kinds, and a relist of one kind replaces that
    /// kind's records alone.
    #[tokio::test]
    async fn kinds_share_service_accounts_and_relist_alone() {
        use WorkloadKind::{CronJob, Deployment, StatefulSet};
        let (store, writers) =
            store_telling(&[Deployment, StatefulSet, CronJob], Changes::default());
        let [deployments, stateful_sets, cron_jobs] = <[_; 3]>::try_from(writers).ok().unwrap();
        for writer in [&deployments, &stateful_sets, &cron_jobs] {
            writer.apply(watcher::Event::Init);
            writer.apply(watcher::Event::InitApply(watched("a", "web", "api", "1")));
            writer.apply(watcher::Event::InitDone);
        }
        store.wait_until_ready().await;
        assert_eq!(store.len(), 3, "one name, three kinds, three records");
        let mut kinds: Vec<_> = store
            .running_as("a", "api")
            .iter()
            .map(|r| r.kind)
            .collect();
        kinds.sort();
        assert_eq!(kinds, [Deployment, StatefulSet, CronJob]);
        let key = |kind| WorkloadKey {
            kind,
            namespace: "a".into(),
            name: "web".into(),
        };
        assert_eq!(
            store.get(&key(StatefulSet)).map(|r| r.kind),
            Some(StatefulSet)
        );
        assert!(store.get(&key(WorkloadKind::Job)).is_none(), "not held");
        assert!(store.holds(CronJob) && !store.holds(WorkloadKind::DaemonSet));

        stateful_sets.apply(watcher::Event::Init);
        stateful_sets.apply(watcher::Event::InitApply(watched("a", "db", "api", "2")));
        stateful_sets.apply(watcher::Event::InitDone);
        let mut names: Vec<_> = store
            .state()
            .iter()
            .map(|r| format!("{} {}", r.kind, r.name))
            .collect();
        names.sort();
        assert_eq!(names, ["CronJob web", "Deployment web", "StatefulSet db"]);
        cron_jobs.apply(watcher::Event::Delete(watched("a", "web", "api", "3")));
        assert_eq!(store.running_as("a", "api").len(), 2);
    }

    /// Of Pods, only bare ones are held: an owned Pod is never listed, and a bare Pod that a
    /// controller adopts is dropped.
    #[tokio::test]
    async fn only_bare_pods_are_held() {
        let (store, mut writers) = store_telling(&[WorkloadKind::Pod], Changes::default());
        let writer = writers.remove(0);
        let owned = |name: &str, version: &str| {
            let mut pod = watched("a", name, "api", version);
            pod.metadata.owner_references = Some(super::super::workload::controller_reference());
            pod
        };
        writer.apply(watcher::Event::Init);
        writer.apply(watcher::Event::InitApply(watched("a", "solo", "api", "1")));
        writer.apply(watcher::Event::InitApply(owned("web-x1", "2")));
        writer.apply(watcher::Event::InitDone);
        store.wait_until_ready().await;
        let names = |store: &WorkloadStore| -> Vec<String> {
            store.state().iter().map(|r| r.name.to_string()).collect()
        };
        assert_eq!(names(&store), ["solo"]);
        assert!(
            !writer.apply(watcher::Event::Apply(owned("web-x2", "3"))),
            "never held"
        );
        assert!(
            writer.apply(watcher::Event::Apply(owned("solo", "4"))),
            "adopted"
        );
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn each_event_tells_which_service_accounts_it_touched() {
        use crate::index::{Changed, Changes};
        use crate::keys::SaKey;
        let sa = |ns: &str, name: &str| SaKey {
            namespace: ns.into(),
            service_account: name.into(),
        };
        let accounts = |keys: &[SaKey]| Changed::Accounts(keys.iter().cloned().collect());
        let changes = Changes::default();
        let (_store, mut writers) = store_telling(&[WorkloadKind::Deployment], changes.clone());
        let writer = writers.remove(0);
        writer.apply(watcher::Event::Init);
        writer.apply(watcher::Event::InitApply(watched("a", "web", "api", "1")));
        writer.apply(watcher::Event::InitDone);
        assert_eq!(changes.take(), Changed::Everything, "a (re)list: full");

        writer.apply(watcher::Event::Apply(watched("a", "web", "api", "2")));
        assert_eq!(
            changes.take(),
            Changed::none(),
            "no change a decision reads"
        );
        writer.apply(watcher::Event::Apply(watched("a", "db", "api", "3")));
        writer.apply(watcher::Event::Apply(watched("b", "x", "ops", "4")));
        assert_eq!(changes.take(), accounts(&[sa("a", "api"), sa("b", "ops")]));
        writer.apply(watcher::Event::Apply(watched("a", "web", "other", "5")));
        assert_eq!(
            changes.take(),
            accounts(&[sa("a", "api"), sa("a", "other")]),
            "a move touches the account it left too"
        );
        writer.apply(watcher::Event::Delete(watched("b", "x", "ops", "6")));
        writer.apply(watcher::Event::Delete(watched("b", "x", "ops", "6")));
        assert_eq!(changes.take(), accounts(&[sa("b", "ops")]));
        let mut marked = watched("a", "db", "api", "7");
        marked.metadata.annotations =
            Some([(crate::names::ENTRY_ID_ANNOTATION.to_string(), "e1".into())].into());
        writer.apply(watcher::Event::Apply(marked));
        assert_eq!(
            changes.take(),
            Changed::Marks([sa("a", "api")].into()),
            "the echo of our own patch: our marks alone"
        );
    }

    #[tokio::test]
    async fn repeated_values_are_stored_once_and_dropped_when_unused() {
        use crate::names::{ENTRY_ID_ANNOTATION, FINALIZER};
        let ours = |name: &str, version: &str| {
            let mut d = mk_deployment("a", name, Some("api"), &[("app", name)]);
            d.metadata.resource_version = Some(version.into());
            d.metadata.finalizers = Some(vec![FINALIZER.into()]);
            d.metadata.annotations = Some([(ENTRY_ID_ANNOTATION.into(), "sreg.c.1".into())].into());
            serde_json::from_value::<WatchedWorkload>(serde_json::to_value(d).expect("serializes"))
                .expect("decodes")
        };
        let (store, writer) = store();
        writer.apply(watcher::Event::Init);
        writer.apply(watcher::Event::InitApply(ours("web", "1")));
        writer.apply(watcher::Event::InitApply(ours("db", "2")));
        writer.apply(watcher::Event::InitDone);
        let (web, db) = (
            store.deployment("a", "web").unwrap(),
            store.deployment("a", "db").unwrap(),
        );
        assert!(Arc::ptr_eq(&web.namespace, &db.namespace));
        assert!(Arc::ptr_eq(&web.service_account, &db.service_account));
        let entry_id =
            |r: &WorkloadRecord| r.annotations.as_ref().unwrap().entry_id.clone().unwrap();
        assert!(Arc::ptr_eq(&entry_id(&web), &entry_id(&db)));
        assert!(Arc::ptr_eq(
            web.finalizers.as_ref().unwrap(),
            db.finalizers.as_ref().unwrap()
        ));
        assert!(!writer.apply(watcher::Event::Apply(ours("web", "3"))));
        assert!(
            web.differs_for_decisions(&db),
            "different names still differ"
        );
        drop((web, db));

        // A relist that finds nothing leaves nothing shared behind.
        writer.apply(watcher::Event::Init);
        writer.apply(watcher::Event::InitDone);
        let contents = writer.contents.read().unwrap();
        assert!(
            contents.shared.strings.is_empty(),
            "{:?}",
            contents.shared.strings
        );
        assert!(contents.shared.finalizer_lists.is_empty());
    }
}
