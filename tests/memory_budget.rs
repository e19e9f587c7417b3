//! Memory per Deployment, measured where it is held: the Deployment cache, the SPIRE view, the
//! decisions' memory, and what one full sync allocates on top. The heap is counted by a
//! wrapper around the system allocator (the binary's `heap_live_bytes` counts the same way),
//! so the figures are the data itself, not allocator pages.
//!
//! The scale benchmark measures the whole process at 50,000 Deployments in an hour; this
//! measures each structure in seconds, so a change that makes one of them grow fails here,
//! in the fast tier, and the budgets below are what docs/benchmarks.md's memory sizing rests on.
//! One test in this binary: the counter is process-wide.

#[path = "common/realistic.rs"]
mod realistic;

use kube::runtime::watcher::Event;
use realistic::deployment_json;
use serde_json::json;
use spiffe_registrar::controller::decide::Observed;
use spiffe_registrar::controller::decide::{self, DecideSettings, Memory};
use spiffe_registrar::controller::desired;
use spiffe_registrar::controller::view::SpireView;
use spiffe_registrar::index::NamespaceInfo;
use spiffe_registrar::index::store;
use spiffe_registrar::index::workload::WatchedWorkload;
use spiffe_registrar::keys::SaKey;
use spiffe_registrar::policy::{OptIn, SpiffeRegistration};
use spiffe_registrar::spire::types::{DeleteResult, EntryResult};
use spiffe_registrar::spire::{Entry, EntryApi, Ownership, SpireError};
use spiffe_registrar::telemetry::heap;
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

struct Counted;

// SAFETY: every call is forwarded unchanged to the system allocator; counting has no effect
// on the memory handed out.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counted {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on.
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            heap::allocated(layout.size());
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        heap::freed(layout.size());
        // SAFETY: as above.
        unsafe { System.dealloc(pointer, layout) }
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let moved = unsafe { System.realloc(pointer, layout, new_size) };
        if !moved.is_null() {
            heap::freed(layout.size());
            heap::allocated(new_size);
        }
        moved
    }
}

#[global_allocator]
static ALLOCATOR: Counted = Counted;

const DEPLOYMENTS: usize = 4_000;
const NAMESPACES: usize = 50;
const CLUSTER: &str = "scale";

/// Budgets in bytes, each per Deployment (two Deployments per service account, as in the
/// scale benchmark), a few percent above what this measures today (2026-12: cache 485, view
/// 267, memory 238, first sync 1,089; the view shares each entry it created with the desired
/// state). At rest the process holds cache + view + memory; a
/// cold start peaks at cache + first sync. docs/benchmarks.md's memory sizing is these times N.
/// The first sync was 1,006 and memory 230 before a key named its workload's kind: a key is
/// 40 bytes rather than 32, and a first sync holds one in about seven places per workload
/// (desired state and its ref-counts, the grouping, the writes, decide's memory).
const CACHE_PER_DEPLOYMENT: usize = 500;
const VIEW_PER_DEPLOYMENT: usize = 280;
const MEMORY_PER_DEPLOYMENT: usize = 245;
const SYNC_PER_DEPLOYMENT: usize = 1_140;
/// A full sync at rest (nothing to write) on top of that: what every resync and every full
/// sync owed after changes adds, so what sets the peak once the cold start is over (497;
/// 726 before desired state reused the view's entries it renders identically).
const REST_SYNC_PER_DEPLOYMENT: usize = 520;

/// A SPIRE that accepts every create and returns it as stored (with a fresh allocation per
/// field, as decoding a response does).
struct Accepting;

impl EntryApi for Accepting {
    async fn list_ours(&self) -> Result<Vec<Entry>, SpireError> {
        Ok(Vec::new())
    }
    async fn count_hinted(&self) -> Result<u64, SpireError> {
        Ok(0)
    }
    async fn create(&self, entries: Vec<Entry>) -> Vec<EntryResult> {
        entries.into_iter().map(|e| Ok(e.clone())).collect()
    }
    async fn update(&self, entries: Vec<Entry>) -> Vec<EntryResult> {
        entries.into_iter().map(Ok).collect()
    }
    async fn delete(&self, entries: Vec<Entry>) -> Vec<DeleteResult> {
        entries.into_iter().map(|e| Ok(e.id)).collect()
    }
}

fn opted_in(_: &str) -> Option<NamespaceInfo> {
    Some(NamespaceInfo {
        labels: BTreeMap::from([("spiffe.io/registrar".into(), "enabled".into())]),
        terminating: false,
    })
}

/// Bytes allocated and still held by what `f` returns (its transients freed).
fn held_by<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = heap::live();
    let value = f();
    (value, heap::live().saturating_sub(before))
}

#[tokio::test]
async fn each_structure_stays_within_its_budget_per_deployment() {
    let ownership = Ownership::new(CLUSTER).expect("valid");
    let policy: SpiffeRegistration = serde_json::from_value(json!({
        "apiVersion": "registrar.spiffe.io/v1alpha1",
        "kind": "SpiffeRegistration",
        "metadata": { "name": "scale" },
        "spec": { "trustDomain": "example.org", "parentID": "spiffe://example.org/k8s/scale", "ttl": "1h" }
    }))
    .expect("policy");
    let policies = vec![Arc::new(policy)];

    // The cache, filled the way the watch fills it: decoded from the apiserver's JSON. A
    // cold start: nothing is registered yet.
    let (deployments, writer) = store::store();
    let decoded = |i: usize, registered: bool| -> WatchedWorkload {
        serde_json::from_slice(&deployment_json(i, NAMESPACES, &ownership, registered))
            .expect("decodes")
    };
    writer.apply(Event::Init);
    for i in 0..DEPLOYMENTS {
        writer.apply(Event::InitApply(decoded(i, false)));
    }
    writer.apply(Event::InitDone);
    assert_eq!(deployments.len(), DEPLOYMENTS);

    // The first sync: desired state, the plan, the view filled from SPIRE's answers, every
    // Deployment's write decided (what the writer queues).
    let mut memory = Memory::default();
    let mut view = SpireView::default();
    let before_sync = heap::live();
    heap::reset_peak();
    let started = Instant::now();
    let writes = sync(&deployments, &policies, &ownership, &mut view, &mut memory).await;
    assert_eq!(writes, DEPLOYMENTS, "a cold start writes every Deployment");
    let first_sync_ms = started.elapsed().as_millis() as u64;
    let first_sync_peak = heap::peak() - before_sync;

    // The patches land: every Deployment comes back registered. Then a sync at rest.
    for i in 0..DEPLOYMENTS {
        writer.apply(Event::Apply(decoded(i, true)));
    }
    let before_rest_sync = heap::live();
    heap::reset_peak();
    let writes = sync(&deployments, &policies, &ownership, &mut view, &mut memory).await;
    assert_eq!(writes, 0, "nothing to write at rest");
    let rest_sync_peak = heap::peak() - before_rest_sync;
    let at_rest = heap::live() - before_sync;

    let view_held: usize = {
        // What the view holds: measured by building an equal one (entries and all: they are
        // shared with nothing once the sync that created them is over).
        let (copy, held) = held_by(|| -> Observed {
            view.entries
                .iter()
                .map(|(id, entry)| (id.clone(), Arc::new(Entry::clone(entry))))
                .collect()
        });
        drop(copy);
        held
    };
    // The cache: the same Deployments into a fresh store, registered and not.
    let cache_held = |registered: bool| {
        let (copy, copy_writer) = store::store();
        let ((), held) = held_by(|| {
            copy_writer.apply(Event::Init);
            for i in 0..DEPLOYMENTS {
                copy_writer.apply(Event::InitApply(decoded(i, registered)));
            }
            copy_writer.apply(Event::InitDone);
        });
        drop((copy, copy_writer));
        held
    };
    let (cold_cache, cache) = (cache_held(false), cache_held(true));
    // What the syncs left behind besides the view and the cache's growth (our annotations on
    // every record) is the decisions' memory.
    let memory_held = at_rest
        .saturating_sub(view_held)
        .saturating_sub(cache.saturating_sub(cold_cache));

    let per = |bytes: usize| bytes / DEPLOYMENTS;
    let figures = json!({
        "deployments": DEPLOYMENTS,
        "cache_bytes_per_deployment": per(cache),
        "view_bytes_per_deployment": per(view_held),
        "memory_bytes_per_deployment": per(memory_held),
        "first_sync_peak_bytes_per_deployment": per(first_sync_peak),
        "rest_sync_peak_bytes_per_deployment": per(rest_sync_peak),
        "first_sync_ms": first_sync_ms,
    });
    eprintln!("{figures}");
    assert!(per(cache) <= CACHE_PER_DEPLOYMENT, "{figures}");
    assert!(per(view_held) <= VIEW_PER_DEPLOYMENT, "{figures}");
    assert!(per(memory_held) <= MEMORY_PER_DEPLOYMENT, "{figures}");
    assert!(per(first_sync_peak) <= SYNC_PER_DEPLOYMENT, "{figures}");
    assert!(per(rest_sync_peak) <= REST_SYNC_PER_DEPLOYMENT, "{figures}");
}

/// One sync as the controller runs it, against a SPIRE that accepts everything and a writer
/// that drains each hand-over at once (the real one holds at most its queue's bound); how
/// many Deployments it would write.
async fn sync(
    deployments: &store::WorkloadStore,
    policies: &[Arc<SpiffeRegistration>],
    ownership: &Ownership,
    view: &mut SpireView,
    memory: &mut Memory,
) -> usize {
    let settings = DecideSettings::default();
    let records = deployments.state();
    let desired = desired::compute_for(
        ownership,
        &OptIn::default(),
        &records,
        &opted_in,
        policies,
        None,
        &view.entries,
    );
    drop(records);
    let input = decide::Input {
        ownership,
        settings: &settings,
        desired: &desired,
        observed: &view.entries,
        now: Instant::now(),
        confirmed: None,
    };
    let plan = decide::spire_plan(&input, memory);
    let mut written = std::collections::HashSet::new();
    let mut failures = BTreeMap::new();
    for chunk in plan.create.chunks(200) {
        let part = decide::SpirePlan {
            create: chunk.to_vec(),
            ..decide::SpirePlan::default()
        };
        failures.extend(view.apply(&Accepting, ownership, &part).await.failures);
        let scope: BTreeSet<SaKey> = chunk.iter().filter_map(|e| SaKey::of_entry(e)).collect();
        let handed = decide::workload_writes(
            &desired,
            &plan,
            &view.entries,
            &failures,
            memory,
            Some(&scope),
            &|key| written.contains(key),
        );
        written.extend(handed.into_iter().map(|write| write.key));
    }
    let rest = decide::workload_writes(
        &desired,
        &plan,
        &view.entries,
        &failures,
        memory,
        None,
        &|key| written.contains(key),
    );
    written.len() + rest.len()
}
