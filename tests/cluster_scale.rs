//! A realistic cluster at test scale: 2,000 Deployments under kube-controller-manager, whose
//! deployment and replicaset controllers rewrite their status on every rollout step, and whose
//! namespace controller deletes them. The registrar must do no work for status churn and must
//! let a namespace go with every entry of it deleted.

mod common;

use common::k8s::{deployment, eventually};
use common::registrar::Registrar;
use common::world::{InSuite, Scenario, Suite, flags, options};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use spiffe_registrar::names::ENTRY_ID_ANNOTATION;
use std::sync::OnceLock;
use std::time::Duration;

const DEPLOYMENTS: usize = 2_000;
const SETTLE: Duration = Duration::from_secs(300);

static SUITE: OnceLock<Suite> = OnceLock::new();
/// One scenario at a time: each puts 2,000 Deployments (and kube-controller-manager's 4,000
/// ReplicaSets and Pods) on two cores.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn suite() -> InSuite {
    Suite::get(&SUITE, || {
        let mut options = options(
            "scale",
            "registrar",
            flags(&["--spire-rps=0", "--resync-interval=10m"], &[]),
        );
        // A writer queue far below the fleet, so registering it takes the hand-over a cold
        // start of 50,000 takes (writes handed to the writer as it drains).
        options.extra_env = vec![
            ("RUST_LOG".into(), "info".into()),
            ("SPIFFE_REGISTRAR_WRITE_QUEUE_BOUND".into(), "16".into()),
        ];
        options
    })
}

/// Creates `count` Deployments `<prefix><i>` across `namespaces`, two per service account
/// (`<prefix>-sa<i/2>`).
async fn create_pairs(s: &Scenario, namespaces: &[String], prefix: &str, count: usize) {
    futures::stream::iter(0..count)
        .for_each_concurrent(16, |i| {
            let api = s.deployments(&namespaces[(i / 2) % namespaces.len()]);
            async move {
                let d = deployment(
                    &format!("{prefix}{i}"),
                    Some(&format!("{prefix}-sa{}", i / 2)),
                );
                api.create(&PostParams::default(), &d)
                    .await
                    .expect("create");
            }
        })
        .await;
}

/// `DEPLOYMENTS` Deployments in `namespaces`, two per service account, all registered.
async fn registered_fleet(s: &Scenario, namespaces: &[String]) {
    create_pairs(s, namespaces, "d", DEPLOYMENTS).await;
    let all = namespaces.to_vec();
    eventually("every Deployment registered", SETTLE, || {
        let all = all.clone();
        async move {
            let mut done = 0;
            for ns in &all {
                let list = s.deployments(ns).list(&ListParams::default()).await.ok()?;
                done += list
                    .items
                    .iter()
                    .filter(|d| {
                        d.metadata
                            .annotations
                            .as_ref()
                            .is_some_and(|a| a.contains_key(ENTRY_ID_ANNOTATION))
                    })
                    .count();
            }
            (done == DEPLOYMENTS).then_some(())
        }
    })
    .await;
}

/// Waits until kube-controller-manager has acted on every Deployment's latest generation.
async fn observed(s: &Scenario, namespaces: &[String]) {
    eventually(
        "kube-controller-manager to observe every Deployment",
        SETTLE,
        || async {
            for ns in namespaces {
                let list = s.deployments(ns).list(&ListParams::default()).await.ok()?;
                let behind = list.items.iter().any(|d| {
                    d.status.as_ref().and_then(|st| st.observed_generation) != d.metadata.generation
                        || d.status
                            .as_ref()
                            .and_then(|st| st.updated_replicas)
                            .is_none()
                });
                if behind {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
}

fn spire_writes(registrar: &Registrar) -> f64 {
    ["create", "update", "delete"]
        .iter()
        .map(|op| registrar.metric("spire_api_entries_total", &[("op", op)]))
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rollout_of_2000_deployments_costs_no_spire_write_and_almost_no_sync() {
    let bed = suite();
    let _turn = TURN.lock().await;
    let s = Scenario::new(&bed.stack.kube).await;
    let policy = s.policy("p", s.spec("p")).await;
    let mut namespaces = Vec::new();
    for _ in 0..10 {
        namespaces.push(s.namespace(true).await);
    }
    registered_fleet(&s, &namespaces).await;
    observed(&s, &namespaces).await;
    let (syncs, writes) = (bed.registrar.syncs(), spire_writes(&bed.registrar));

    // A rollout: a new pod template for every Deployment. kube-controller-manager creates a
    // ReplicaSet each and rewrites every status several times.
    futures::stream::iter(0..DEPLOYMENTS)
        .for_each_concurrent(16, |i| {
            let api = s.deployments(&namespaces[(i / 2) % namespaces.len()]);
            async move {
                let patch = json!({ "spec": { "template": { "spec": { "containers": [
                    { "name": "app", "image": "registry.invalid/app:2" }
                ] } } } });
                api.patch(
                    &format!("d{i}"),
                    &PatchParams::default(),
                    &Patch::Strategic(&patch),
                )
                .await
                .expect("rollout");
            }
        })
        .await;
    observed(&s, &namespaces).await;
    let churn_syncs = bed.registrar.syncs() - syncs;
    eprintln!(
        "SCALE rollout of {DEPLOYMENTS}: {churn_syncs} syncs, SPIRE writes +{}",
        spire_writes(&bed.registrar) - writes
    );
    assert!(churn_syncs < 5.0, "{churn_syncs} syncs from status churn");
    assert_eq!(spire_writes(&bed.registrar), writes, "no SPIRE write");

    new_deployments_derive_only_their_service_accounts(&bed, &s, &policy, &namespaces).await;
}

/// Syncs by what they derived (`full` or `changed`).
fn syncs_deriving(registrar: &Registrar, derive: &str) -> f64 {
    registrar.metric("syncs_total", &[("derive", derive)])
}

/// 100 new Deployments join the registered fleet: they are registered by syncs that derive
/// their 50 service accounts alone, no existing entry disappears meanwhile (sampled from
/// SPIRE), and the full sync owed afterwards brings the policy's counts up to date.
async fn new_deployments_derive_only_their_service_accounts(
    bed: &Suite,
    s: &Scenario,
    policy: &str,
    namespaces: &[String],
) {
    const NEW: usize = 100;
    let parent = s.parent("p");
    let entries = || {
        bed.stack
            .spire_server
            .entries(&["-parentID", &parent])
            .len()
    };
    assert_eq!(entries(), DEPLOYMENTS / 2);
    let (full, changed) = (
        syncs_deriving(&bed.registrar, "full"),
        syncs_deriving(&bed.registrar, "changed"),
    );
    create_pairs(s, namespaces, "new", NEW).await;
    eventually("the new Deployments registered", SETTLE, || async {
        let now = entries();
        assert!(now >= DEPLOYMENTS / 2, "an entry vanished: {now} left");
        if now < DEPLOYMENTS / 2 + NEW / 2 {
            return None;
        }
        for ns in namespaces {
            let list = s.deployments(ns).list(&ListParams::default()).await.ok()?;
            let waiting = list.items.iter().any(|d| {
                d.metadata
                    .annotations
                    .as_ref()
                    .is_none_or(|a| !a.contains_key(ENTRY_ID_ANNOTATION))
            });
            if waiting {
                return None;
            }
        }
        Some(())
    })
    .await;
    eventually("the policy to count the new ones", SETTLE, || async {
        let status = s.policies().get(policy).await.ok()?.status?;
        (status.entries as usize == DEPLOYMENTS / 2 + NEW / 2
            && status.selected_workloads as usize == DEPLOYMENTS + NEW)
            .then_some(())
    })
    .await;
    let full = syncs_deriving(&bed.registrar, "full") - full;
    let changed = syncs_deriving(&bed.registrar, "changed") - changed;
    eprintln!("SCALE {NEW} new Deployments: {changed} syncs of changed accounts, {full} full");
    assert!(changed >= 1.0, "no sync derived the changed accounts alone");
    assert!(
        full <= changed,
        "{full} full derives for {changed} syncs of changed accounts"
    );
    assert_eq!(
        entries(),
        DEPLOYMENTS / 2 + NEW / 2,
        "exactly one entry each"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_a_namespace_of_2000_deployments_leaves_no_entry_and_nothing_stuck() {
    let bed = suite();
    let _turn = TURN.lock().await;
    let s = Scenario::new(&bed.stack.kube).await;
    s.policy("p", s.spec("p")).await;
    let ns = s.namespace(true).await;
    registered_fleet(&s, std::slice::from_ref(&ns)).await;
    let selector = format!("k8s:ns:{ns}");
    assert_eq!(
        bed.stack
            .spire_server
            .entries(&["-selector", &selector])
            .len(),
        DEPLOYMENTS / 2
    );

    let started = std::time::Instant::now();
    let namespaces: Api<Namespace> = Api::all(s.client.clone());
    namespaces
        .delete(&ns, &DeleteParams::default())
        .await
        .expect("delete namespace");
    let left: Api<Deployment> = Api::namespaced(s.client.clone(), &ns);
    eventually("every Deployment gone", SETTLE, || async {
        let list = left.list(&ListParams::default()).await.ok()?;
        if std::env::var_os("SCALE_DEBUG").is_some() {
            let deleting = list.items.iter().filter(|d| d.metadata.deletion_timestamp.is_some()).count();
            let finalized = list.items.iter().filter(|d| common::k8s::has_finalizer(d)).count();
            let entries = bed.stack.spire_server.entries(&["-selector", &selector]).len();
            eprintln!("t={:.1}s deployments={} deleting={deleting} with-finalizer={finalized} entries={entries}", started.elapsed().as_secs_f64(), list.items.len());
        }
        list.items.is_empty().then_some(())
    })
    .await;
    let deployments_gone = started.elapsed();
    eventually("the namespace to be gone", SETTLE, || async {
        namespaces.get_opt(&ns).await.ok()?.is_none().then_some(())
    })
    .await;
    eprintln!(
        "SCALE namespace of {DEPLOYMENTS} Deployments: Deployments gone after {:.1} s, namespace after {:.1} s",
        deployments_gone.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    if std::env::var_os("SCALE_DEBUG").is_some() {
        let log = bed.registrar.process.log_tail(100_000);
        for line in log
            .lines()
            .filter(|l| l.contains("applied SPIRE") || l.contains("patch failed"))
        {
            eprintln!("{line}");
        }
    }
    let entries = bed.stack.spire_server.entries(&["-selector", &selector]);
    assert!(entries.is_empty(), "{} entries left", entries.len());
}

/// The service accounts (`sa:` selector values) SPIRE holds entries for in `ns`.
fn accounts_with_entries(bed: &InSuite, ns: &str) -> std::collections::BTreeSet<String> {
    let selector = format!("k8s:ns:{ns}");
    bed.stack
        .spire_server
        .entries(&["-selector", &selector])
        .iter()
        .flat_map(|entry| entry["selectors"].as_array().cloned().unwrap_or_default())
        .filter_map(|s| Some(s["value"].as_str()?.strip_prefix("sa:")?.to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn deleting_1000_deployments_releases_their_entries_and_keeps_what_survivors_need() {
    let bed = suite();
    let _turn = TURN.lock().await;
    let s = Scenario::new(&bed.stack.kube).await;
    s.policy("p", s.spec("p")).await;
    let ns = s.namespace(true).await;
    registered_fleet(&s, std::slice::from_ref(&ns)).await;
    // Gone whole: d1000…d1999 (service accounts 500…999). Half gone: one Deployment of each
    // of the service accounts 0…99, whose entries the other one still needs.
    let doomed: Vec<usize> = (1_000..DEPLOYMENTS).chain((0..200).step_by(2)).collect();
    let needed: std::collections::BTreeSet<String> =
        (0..500).map(|sa| format!("d-sa{sa}")).collect();
    let api = s.deployments(&ns);
    futures::stream::iter(doomed.iter().copied())
        .for_each_concurrent(16, |i| {
            let api = api.clone();
            async move {
                api.delete(&format!("d{i}"), &DeleteParams::default())
                    .await
                    .expect("delete");
            }
        })
        .await;
    // Sampled through the deletion: no entry a surviving Deployment needs ever goes.
    let survivors = DEPLOYMENTS - doomed.len();
    let bed = &bed;
    let left = eventually(
        "the deleted Deployments and their entries gone",
        SETTLE,
        || {
            let (api, needed, ns) = (api.clone(), needed.clone(), ns.clone());
            async move {
                let held = accounts_with_entries(bed, &ns);
                let lost: Vec<_> = needed.difference(&held).collect();
                assert!(
                    lost.is_empty(),
                    "entries still needed were deleted: {lost:?}"
                );
                let list = api.list(&ListParams::default()).await.ok()?;
                (list.items.len() == survivors && held == needed).then_some(list)
            }
        },
    )
    .await;
    for d in &left.items {
        assert!(
            d.metadata.deletion_timestamp.is_none() && common::k8s::has_finalizer(d),
            "a survivor keeps its finalizer: {:?}",
            d.metadata.name
        );
    }
}
