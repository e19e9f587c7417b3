//! Phases of the scale benchmark that each hold one claim against a figure of the same run:
//! deletion against the apiserver's own pace, drift repair against the drift-check interval,
//! and a restart over a registered cluster against zero writes.

use super::k8s::create_namespace;
use super::registrar::Registrar;
use super::sampler::spire_client;
use super::scale::{
    api_of, count, count_ours, kind_of, proc_field, progress, realistic, until, workloads_left,
};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::ReplicaSet;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use spiffe_registrar::keys::WorkloadKind;
use spiffe_registrar::spire::proto::entry::list_entries_request::Filter;
use spiffe_registrar::spire::proto::entry::{
    BatchDeleteEntryRequest, GetEntryRequest, ListEntriesRequest,
};
use std::path::Path;
use std::time::{Duration, Instant};

/// Deletes and finalizer removals in flight at once, in both halves of the comparison: the
/// registrar's own patch concurrency.
const CONCURRENCY: usize = 16;
const RAW_NAMESPACE: &str = "raw-delete";
const HOLD: &str = "bench.spiffe.io/hold";

/// The apiserver's own pace for deleting `count` workloads that carry a finalizer: workloads
/// shaped as the registrar's (same kinds, same size, ReplicaSets and Pods made) in a namespace
/// the registrar ignores, each deleted and its finalizer removed by this client, `CONCURRENCY`
/// at a time, until the apiserver has let go of every one.
pub async fn raw_delete_seconds(client: &Client, kinds: &[WorkloadKind], count_of: usize) -> f64 {
    create_namespace(client, RAW_NAMESPACE, false).await;
    let api = |i: usize| {
        Api::<DynamicObject>::namespaced_with(
            client.clone(),
            RAW_NAMESPACE,
            &kind_of(kinds, i).api_resource(),
        )
    };
    futures::stream::iter(0..count_of)
        .for_each_concurrent(32, |i| {
            let api = api(i);
            async move {
                let mut workload = realistic(kind_of(kinds, i), &format!("r{i}"), "raw");
                workload.metadata.finalizers = Some(vec![HOLD.to_string()]);
                api.create(&PostParams::default(), &workload)
                    .await
                    .expect("create");
            }
        })
        .await;
    // kube-controller-manager's ReplicaSets first, so that the timed part is the deletion.
    let replica_sets: Api<ReplicaSet> = Api::namespaced(client.clone(), RAW_NAMESPACE);
    let want = (0..count_of)
        .filter(|i| kind_of(kinds, *i) == WorkloadKind::Deployment)
        .count();
    until(
        "the raw workloads' ReplicaSets",
        Instant::now(),
        async || count(&replica_sets).await >= want,
    )
    .await;
    progress(&format!("raw deletion of {count_of} held workloads"));
    let started = Instant::now();
    futures::stream::iter(0..count_of)
        .for_each_concurrent(CONCURRENCY, |i| {
            let api = api(i);
            async move {
                let name = format!("r{i}");
                api.delete(&name, &DeleteParams::default())
                    .await
                    .expect("raw delete");
                let release = json!({ "metadata": { "finalizers": null } });
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&release))
                    .await
                    .expect("raw finalizer removal");
            }
        })
        .await;
    until("the raw workloads to go", started, async || {
        let mut left = 0;
        for kind in kinds {
            left += count(&Api::<DynamicObject>::namespaced_with(
                client.clone(),
                RAW_NAMESPACE,
                &kind.api_resource(),
            ))
            .await;
        }
        left == 0
    })
    .await
}

/// Deletes workloads `range` (whole service accounts) `CONCURRENCY` at a time; the time until
/// the apiserver holds none of them (the registrar removed every finalizer) and SPIRE holds
/// `entries_after` of our entries.
pub async fn delete_registered(
    client: &Client,
    kinds: &[WorkloadKind],
    range: std::ops::Range<usize>,
    socket: &Path,
    entries_after: usize,
) -> f64 {
    let left_after = range.start;
    progress(&format!("deleting {} registered workloads", range.len()));
    let started = Instant::now();
    futures::stream::iter(range)
        .for_each_concurrent(CONCURRENCY, |i| {
            let api = api_of(client, kinds, i);
            async move {
                api.delete(&format!("d{i}"), &DeleteParams::default())
                    .await
                    .expect("delete");
            }
        })
        .await;
    until(
        "the deleted workloads and their entries to go",
        started,
        async || {
            workloads_left(client, kinds).await == left_after
                && count_ours(socket).await == entries_after as i32
        },
    )
    .await
}

/// Deletes one of our entries behind the registrar's back; the time until it is back.
pub async fn drift_repair_seconds(socket: &Path, hint: &str) -> f64 {
    let mut spire = spire_client(socket).await;
    let listed = spire
        .list_entries(ListEntriesRequest {
            filter: Some(Filter {
                by_hint: Some(hint.to_string()),
                ..Default::default()
            }),
            page_size: 1,
            ..Default::default()
        })
        .await
        .expect("list one entry")
        .into_inner();
    let id = listed.entries.first().expect("an entry of ours").id.clone();
    spire
        .batch_delete_entry(BatchDeleteEntryRequest {
            ids: vec![id.clone()],
        })
        .await
        .expect("delete behind the registrar's back");
    progress(&format!("deleted entry {id} behind the registrar's back"));
    let started = Instant::now();
    // Its ID is deterministic: the registrar recreates the same one. A get is cheap for SPIRE;
    // polling a count would cost it a walk over every entry ten times a second.
    until("the deleted entry to be recreated", started, async || {
        spire
            .get_entry(GetEntryRequest {
                id: id.clone(),
                ..Default::default()
            })
            .await
            .is_ok()
    })
    .await
}

/// A restart over a registered cluster (entries and annotations in place).
pub struct Restart {
    /// From the new process's start to its first sync that completed.
    pub first_sync_s: f64,
    /// SPIRE creates, updates and deletes until then.
    pub spire_writes: f64,
    /// Workload patches and Events until then (Lease writes are not counted).
    pub kube_writes: f64,
    pub peak_rss_mib: f64,
    /// The old process's peak, read before it was stopped.
    pub previous_peak_rss_mib: f64,
}

/// Stops `old` (it releases the Lease) and starts its successor with `start`.
pub async fn restart(
    old: Registrar,
    start: impl FnOnce() -> Registrar + Send + 'static,
) -> (Registrar, Restart) {
    let mut old = old;
    let previous_peak_rss_mib = proc_field(old.process.pgid(), "VmHWM:");
    old.process.stop(Duration::from_secs(30));
    progress("restarting the registrar over the registered cluster");
    let started = Instant::now();
    let registrar = tokio::task::spawn_blocking(start).await.expect("registrar");
    let first_sync_s = until(
        "the restarted registrar's first sync",
        started,
        async || registrar.metric("last_successful_sync_timestamp_seconds", &[]) > 0.0,
    )
    .await;
    let spire_writes = ["batch_create", "batch_update", "batch_delete"]
        .iter()
        .map(|op| registrar.metric("spire_api_call_duration_seconds_count", &[("op", op)]))
        .sum();
    let kube_writes = registrar.metric("kube_write_duration_seconds_count", &[])
        - registrar.metric(
            "kube_write_duration_seconds_count",
            &[("resource", "leases")],
        );
    let restart = Restart {
        first_sync_s,
        spire_writes,
        kube_writes,
        peak_rss_mib: proc_field(registrar.process.pgid(), "VmHWM:"),
        previous_peak_rss_mib,
    };
    progress(&format!(
        "restarted: first sync after {first_sync_s:.1} s, {spire_writes} SPIRE writes, {kube_writes} Kubernetes writes"
    ));
    (registrar, restart)
}
