//! The scale benchmark, shared by `cargo run --release --example scale` (the
//! numbers in docs/benchmarks.md) and a small-N test (so it cannot rot).
//!
//! Realistic workloads (kubectl's `last-applied-configuration`, ~4 KB each, two per service
//! account, 50 namespaces; Deployments, or every kind in turn) exist first, under
//! kube-controller-manager; then the registrar starts, so convergence is a cold start with no
//! load generator in the figure.

use super::k8s::{
    create_namespace, create_webhook_configuration_skipping, install_crd, policy, token_kubeconfig,
};
use super::paths::free_port;
pub use super::postgres::Datastore;
use super::registrar::{Options, Registrar};
use super::sampler::spire_client;
use super::scale_phases::{delete_registered, drift_repair_seconds, raw_delete_seconds, restart};
use super::stack::{Stack, kubectl_ok};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{
    DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchEvent,
    WatchParams,
};
use kube::{Api, Client};
use serde_json::{Value, json};
use spiffe_registrar::keys::WorkloadKind;
use spiffe_registrar::policy::SpiffeRegistration;
use spiffe_registrar::spire::client::{ClientSettings, GrpcEntryClient};
use spiffe_registrar::spire::metrics::SpireMetrics;
use spiffe_registrar::spire::proto::entry::CountEntriesRequest;
use spiffe_registrar::spire::proto::entry::count_entries_request::Filter;
use spiffe_registrar::spire::{Entry, EntryApi, Ownership, Selector, SpireEndpoint, connect};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const NAMESPACES: usize = 50;
/// The rollout that measures CPU per status update runs on at most this many Deployments: at
/// 50,000 a full rollout alone takes kube-controller-manager most of an hour on 2 cores, and
/// the rate does not change with the count.
const SAMPLE: usize = 5_000;
const CLUSTER: &str = "scale";
const MIB: f64 = 1024.0 * 1024.0;
const WAIT: Duration = Duration::from_secs(3600);

#[derive(Clone, Debug)]
pub struct Config {
    /// How many workloads (Deployments unless `kinds` says otherwise).
    pub deployments: usize,
    /// Workload `i` is of kind `kinds[i % kinds.len()]`; the two workloads of a service account
    /// are then of different kinds (one entry ref-counted across kinds).
    pub kinds: &'static [WorkloadKind],
    /// How long to count SPIRE calls at rest (docs/benchmarks.md's figures use 300 s).
    pub rest: Duration,
    pub datastore: Datastore,
    /// The registrar's writer queue bound (`SPIFFE_REGISTRAR_WRITE_QUEUE_BOUND`); `None` keeps
    /// the built-in one. A small N sets it small, so it takes the hand-over 50,000 take.
    pub write_queue_bound: Option<usize>,
    /// How many workloads the deletion phase deletes (whole service accounts, at most half).
    pub delete: usize,
    /// Whether to roll out `SAMPLE` workloads for the CPU per status update (at 50,000 the
    /// rollout takes kube-controller-manager a quarter of an hour).
    pub rollout: bool,
}

const REGISTRAR_NAMESPACE: &str = "registrar-system";
const REGISTRAR_ACCOUNT: &str = "registrar";

/// The registrar's own credentials (a ServiceAccount token), so the webhook configuration's
/// `matchConditions` skip its patches exactly as the manifests do; the load generator stays
/// the admin and goes through the webhook. Returns the kubeconfig and the username.
fn registrar_identity(stack: &Stack) -> (std::path::PathBuf, String) {
    kubectl_ok(
        stack,
        &[
            "-n",
            REGISTRAR_NAMESPACE,
            "create",
            "serviceaccount",
            REGISTRAR_ACCOUNT,
        ],
    );
    let subject = format!("{REGISTRAR_NAMESPACE}:{REGISTRAR_ACCOUNT}");
    kubectl_ok(
        stack,
        &[
            "create",
            "clusterrolebinding",
            "scale-registrar",
            "--clusterrole=cluster-admin",
            &format!("--serviceaccount={subject}"),
        ],
    );
    let token = kubectl_ok(
        stack,
        &[
            "-n",
            REGISTRAR_NAMESPACE,
            "create",
            "token",
            REGISTRAR_ACCOUNT,
            "--duration=24h",
        ],
    );
    let kubeconfig = stack.dir().join("registrar.kubeconfig");
    std::fs::write(
        &kubeconfig,
        token_kubeconfig(&stack.kube.url, &stack.kube.ca_pem, token.trim()),
    )
    .expect("kubeconfig");
    (kubeconfig, format!("system:serviceaccount:{subject}"))
}

pub(super) fn progress(what: &str) {
    eprintln!("[scale] {what}");
}

/// A workload of `kind` as `kubectl apply` leaves it: ~4 KB of last-applied-configuration.
/// Jobs never finish (no node runs their Pods) and CronJobs are never due.
pub(super) fn realistic(kind: WorkloadKind, name: &str, service_account: &str) -> DynamicObject {
    let env: Vec<Value> = (0..40)
        .map(|i| json!({ "name": format!("SETTING_{i:02}"), "value": format!("value-{i:02}-{}", "x".repeat(48)) }))
        .collect();
    let restart = if matches!(kind, WorkloadKind::Job | WorkloadKind::CronJob) {
        "Never"
    } else {
        "Always"
    };
    let template = json!({
        "metadata": { "labels": { "app": name, "tier": "backend" } },
        "spec": {
            "serviceAccountName": service_account,
            "restartPolicy": restart,
            "containers": [{ "name": "app", "image": "registry.invalid/app:1", "env": env }]
        }
    });
    let selector = json!({ "matchLabels": { "app": name } });
    let spec = match kind {
        // No node runs the Pods: with the default 10-minute progress deadline,
        // kube-controller-manager would mark every Deployment failed ten minutes after it was
        // made, a wave of status writes that falls in whatever phase runs then.
        WorkloadKind::Deployment => json!({
            "replicas": 1, "selector": selector, "template": template,
            "progressDeadlineSeconds": i32::MAX,
        }),
        WorkloadKind::StatefulSet => {
            json!({ "replicas": 1, "serviceName": name, "selector": selector, "template": template })
        }
        WorkloadKind::DaemonSet => json!({ "selector": selector, "template": template }),
        WorkloadKind::Job => json!({ "backoffLimit": 0, "template": template }),
        WorkloadKind::CronJob => {
            json!({ "schedule": "0 0 1 1 *", "jobTemplate": { "spec": { "template": template } } })
        }
        WorkloadKind::Pod => template["spec"].clone(),
        WorkloadKind::Custom(_) => unreachable!("the benchmark makes built-in kinds"),
    };
    let mut object = json!({
        "apiVersion": kind.api_version(),
        "kind": kind.name(),
        "metadata": { "name": name, "labels": { "app": name, "tier": "backend" } },
        "spec": spec,
    });
    let applied = serde_json::to_string(&object).expect("serializes");
    object["metadata"]["annotations"] =
        json!({ "kubectl.kubernetes.io/last-applied-configuration": applied });
    serde_json::from_value(object).expect("a workload")
}

fn namespace_of(i: usize) -> String {
    format!("scale-{}", (i / 2) % NAMESPACES)
}

pub(super) fn kind_of(kinds: &[WorkloadKind], i: usize) -> WorkloadKind {
    kinds[i % kinds.len()]
}

/// Workload `i`'s API.
pub(super) fn api_of(client: &Client, kinds: &[WorkloadKind], i: usize) -> Api<DynamicObject> {
    let kind = kind_of(kinds, i);
    Api::namespaced_with(client.clone(), &namespace_of(i), &kind.api_resource())
}

async fn create_all(client: &Client, kinds: &[WorkloadKind], range: std::ops::Range<usize>) {
    futures::stream::iter(range)
        .for_each_concurrent(32, |i| {
            let api = api_of(client, kinds, i);
            async move {
                let name = format!("d{i}");
                let workload = realistic(kind_of(kinds, i), &name, &format!("sa{}", i / 2));
                api.create(&PostParams::default(), &workload)
                    .await
                    .expect("create");
            }
        })
        .await;
}

/// How many of workloads `0..count` are of a kind in `of`.
fn how_many(kinds: &[WorkloadKind], count: usize, of: &[WorkloadKind]) -> usize {
    (0..count)
        .filter(|i| of.contains(&kind_of(kinds, *i)))
        .count()
}

pub(super) fn proc_field(pid: i32, key: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kib| kib / 1024.0)
        .unwrap_or(f64::NAN)
}

/// User + system CPU seconds of `pid`.
fn cpu_seconds(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // After the command: state is field 0, utime 11, stime 12 (clock ticks, 100 per second).
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU nanoseconds of each thread of `pid` (by thread id, with the thread's name), from the
/// scheduler's own accounting. The rest window's few dozen milliseconds are a handful of the
/// clock ticks `/proc/<pid>/stat` counts in, and ticks are samples; this is exact.
fn thread_cpu_ns(pid: i32) -> std::collections::HashMap<String, (String, u64)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Default::default();
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
            let ns = stat.split_whitespace().next()?.parse().ok()?;
            let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            let tid = task.file_name().to_string_lossy().into_owned();
            Some((tid, (name.trim().to_owned(), ns)))
        })
        .collect()
}

/// What `pid`'s threads ran between two `thread_cpu_ns` readings.
struct ThreadCpu {
    /// CPU seconds of every thread (a thread started meanwhile counts from zero).
    seconds: f64,
    /// Threads that ended meanwhile: their share is not counted.
    ended: usize,
    /// CPU seconds by thread name (tokio's workers share one name), to tell the runtime's
    /// work from the allocator's background thread and blocking pools.
    by_name: std::collections::BTreeMap<String, f64>,
}

fn cpu_between(
    before: &std::collections::HashMap<String, (String, u64)>,
    after: &std::collections::HashMap<String, (String, u64)>,
) -> ThreadCpu {
    let mut by_name = std::collections::BTreeMap::<String, f64>::new();
    for (tid, (name, ns)) in after {
        let earlier = before.get(tid).map_or(0, |(_, ns)| *ns);
        *by_name.entry(name.clone()).or_default() += ns.saturating_sub(earlier) as f64 / 1e9;
    }
    ThreadCpu {
        seconds: by_name.values().sum(),
        ended: before
            .keys()
            .filter(|tid| !after.contains_key(*tid))
            .count(),
        by_name,
    }
}

pub(super) async fn count_ours(socket: &std::path::Path) -> i32 {
    let mut client = spire_client(socket).await;
    client
        .count_entries(CountEntriesRequest {
            filter: Some(Filter {
                by_hint: Some(format!("spiffe-registrar/{CLUSTER}")),
                ..Default::default()
            }),
        })
        .await
        .map(|r| r.into_inner().count)
        .unwrap_or(-1)
}

/// Polls `probe` every 100 ms until it is true; the elapsed time since `from`.
pub(super) async fn until(what: &str, from: Instant, mut probe: impl AsyncFnMut() -> bool) -> f64 {
    let mut last = Instant::now();
    loop {
        if probe().await {
            return from.elapsed().as_secs_f64();
        }
        assert!(from.elapsed() < WAIT, "timed out waiting for {what}");
        if last.elapsed() > Duration::from_secs(10) {
            progress(&format!(
                "waiting for {what} ({:.0} s)",
                from.elapsed().as_secs_f64()
            ));
            last = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn apiserver_metrics(stack: &Stack) -> String {
    super::process::run(stack.kube.kubectl().args(["get", "--raw", "/metrics"])).1
}

/// How many objects `api` lists, from a one-item page (`remainingItemCount`), so counting
/// 50,000 Pods costs one small response.
pub(super) async fn count<K>(api: &Api<K>) -> usize
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.list_metadata(&ListParams::default().limit(1)).await {
        Ok(page) => page.items.len() + page.metadata.remaining_item_count.unwrap_or(0) as usize,
        Err(_) => 0,
    }
}

/// Workload status writes the apiserver has served (its `apiserver_request_total`).
fn status_writes(stack: &Stack) -> f64 {
    apiserver_metrics(stack)
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && WorkloadKind::ALL
                    .iter()
                    .any(|k| l.contains(&format!("resource=\"{}\"", k.plural())))
                && l.contains("subresource=\"status\"")
                && ["PUT", "PATCH", "UPDATE"]
                    .iter()
                    .any(|verb| l.contains(&format!("verb=\"{verb}\"")))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// The raw SPIRE limit: batch-creating `count` entries with our client, no registrar involved.
async fn raw_create_seconds(socket: &std::path::Path, count: usize) -> f64 {
    let endpoint = SpireEndpoint::Unix {
        socket: socket.to_path_buf(),
    };
    let connection = connect(&endpoint, Duration::from_secs(10))
        .await
        .expect("connect");
    let ownership = Ownership::new("raw").expect("valid");
    // SPIRE's own speed is the figure: deadlines long enough for a slow datastore (SQLite
    // created ~10 entries/s at 25,000), so a slow batch is waited for, not failed.
    let settings = ClientSettings {
        requests_per_second: 0.0,
        retry: spiffe_registrar::spire::retry::RetryPolicy {
            call_timeout: Duration::from_secs(60),
            budget: Duration::from_secs(300),
            ..Default::default()
        },
        ..ClientSettings::default()
    };
    let client = GrpcEntryClient::new(
        connection.channel.clone(),
        ownership.clone(),
        settings,
        SpireMetrics::unregistered(),
    );
    let entries: Vec<Entry> = (0..count)
        .map(|i| {
            // The registrar's shape: one parent, entries spread over the namespaces (SPIRE's
            // duplicate check intersects the entries of each selector).
            let namespace = format!("raw-{}", i % NAMESPACES);
            let selectors = vec![
                Selector::new("k8s", format!("ns:{namespace}")),
                Selector::new("k8s", format!("sa:raw{i}")),
            ];
            let spiffe_id = format!("spiffe://example.org/ns/{namespace}/sa/raw{i}");
            Entry {
                id: ownership.entry_id(&spiffe_id, "spiffe://example.org/k8s/raw", &selectors),
                spiffe_id,
                parent_id: "spiffe://example.org/k8s/raw".into(),
                selectors,
                x509_svid_ttl: 3600,
                hint: ownership.hint().into(),
                ..Entry::default()
            }
        })
        .collect();
    let started = Instant::now();
    let created = client.create(entries.clone()).await;
    let seconds = started.elapsed().as_secs_f64();
    assert!(created.iter().all(Result::is_ok), "raw creates failed");
    client.delete(entries).await;
    seconds
}

/// What the registrar did in a window with nothing changing.
struct RestWindow {
    cpu_s_per_min: f64,
    /// The same by thread name.
    cpu_s_per_min_by_thread: std::collections::BTreeMap<String, f64>,
    /// Threads of the registrar that ended within the window (their share is not counted).
    threads_ended: usize,
    spire_calls_per_min: f64,
    syncs: f64,
    /// Of those, full derives (each costs the cluster's size in CPU; the rest, the change's).
    full_syncs: f64,
    kube_writes_per_min: f64,
    /// Of those, Events (the rest are Lease renewals).
    event_writes_per_min: f64,
    event_write_ms: f64,
    /// Workload status writes the apiserver served meanwhile: what kube-controller-manager
    /// changed in a window meant to have no change.
    status_updates: f64,
}

async fn rest_window(stack: &Stack, registrar: &Registrar, pid: i32, rest: Duration) -> RestWindow {
    let syncs = || registrar.metric("reconcile_duration_seconds_count", &[]);
    let full_syncs = || registrar.metric("syncs_total", &[("derive", "full")]);
    let writes = || registrar.metric("kube_write_duration_seconds_count", &[]);
    let events = || {
        let of = [("resource", "events")];
        (
            registrar.metric("kube_write_duration_seconds_count", &of),
            registrar.metric("kube_write_duration_seconds_sum", &of),
        )
    };
    let statuses = status_writes(stack);
    let (cpu, calls, synced, full_synced, written, evented) = (
        thread_cpu_ns(pid),
        registrar.spire_calls(),
        syncs(),
        full_syncs(),
        writes(),
        events(),
    );
    progress(&format!("quiet after convergence for {} s", rest.as_secs()));
    tokio::time::sleep(rest).await;
    let ran = cpu_between(&cpu, &thread_cpu_ns(pid));
    let per_min = 60.0 / rest.as_secs_f64().max(1.0);
    let window = RestWindow {
        cpu_s_per_min: ran.seconds * per_min,
        cpu_s_per_min_by_thread: ran
            .by_name
            .into_iter()
            .map(|(name, s)| (name, s * per_min))
            .collect(),
        threads_ended: ran.ended,
        spire_calls_per_min: (registrar.spire_calls() - calls) * per_min,
        syncs: syncs() - synced,
        full_syncs: full_syncs() - full_synced,
        kube_writes_per_min: (writes() - written) * per_min,
        event_writes_per_min: (events().0 - evented.0) * per_min,
        event_write_ms: (events().1 - evented.1) * 1000.0 / (events().0 - evented.0).max(1.0),
        status_updates: status_writes(stack) - statuses,
    };
    progress(&format!(
        "quiet: {:.3} CPU s/min, {:.1} SPIRE calls/min, {} syncs ({} full), {:.1} Kubernetes writes/min ({:.1} Events, {:.1} ms each), {} status updates",
        window.cpu_s_per_min,
        window.spire_calls_per_min,
        window.syncs,
        window.full_syncs,
        window.kube_writes_per_min,
        window.event_writes_per_min,
        window.event_write_ms,
        window.status_updates
    ));
    progress(&format!(
        "quiet, by thread: {:?}",
        window.cpu_s_per_min_by_thread
    ));
    window
}

/// Entries the registrar has sent SPIRE to create, whatever came of them. It says when to ask
/// SPIRE, which has the last word: a count walks every entry in SPIRE's datastore, and asking
/// ten times a second throughout a cold start took a share of the cores SPIRE creates with.
fn sent_creates(registrar: &Registrar) -> f64 {
    registrar.metric("spire_api_entries_total", &[("op", "create")])
}

/// Workloads of the benchmark's kinds left in the cluster.
pub(super) async fn workloads_left(client: &Client, kinds: &[WorkloadKind]) -> usize {
    let mut left = 0;
    for kind in kinds {
        left += count(&Api::<DynamicObject>::all_with(
            client.clone(),
            &kind.api_resource(),
        ))
        .await;
    }
    left
}

/// Starts the registrar as the benchmark runs it; `name` names its log.
fn start_registrar(
    stack: &Stack,
    port: u16,
    kubeconfig: &std::path::Path,
    name: &str,
    write_queue_bound: Option<usize>,
) -> Registrar {
    let registrar = Registrar::start_full(
        stack,
        port,
        kubeconfig,
        Options {
            namespace: REGISTRAR_NAMESPACE,
            webhook_configuration: "scale",
            cluster_name: CLUSTER,
            name,
            extra_args: vec!["--spire-rps=0".into(), "--resync-interval=1h".into()],
            extra_env: [("RUST_LOG".to_string(), "info".to_string())]
                .into_iter()
                .chain(write_queue_bound.map(|bound| {
                    (
                        "SPIFFE_REGISTRAR_WRITE_QUEUE_BOUND".to_string(),
                        bound.to_string(),
                    )
                }))
                .collect(),
        },
    );
    stack.track(registrar.process.pgid());
    registrar
}

/// A rollout of the first `SAMPLE` workloads: kube-controller-manager rewrites each status
/// several times. The apiserver's own request counter counts those writes; /proc counts our
/// CPU. Returns the status updates, the CPU per 1,000 of them and the rollout's duration.
async fn rollout(
    stack: &Arc<Stack>,
    client: &Client,
    kinds: &[WorkloadKind],
    total: usize,
    pid: i32,
) -> (usize, f64, f64) {
    use WorkloadKind::{DaemonSet, Deployment, Job, StatefulSet};
    let rolled = total.min(SAMPLE);
    progress(&format!("rolling out {rolled} Deployments"));
    let status_writes_before = status_writes(stack);
    let cpu_before = cpu_seconds(pid);
    let rolling = Instant::now();
    // A Job's template cannot change; a CronJob's change writes no status.
    let status_writers = how_many(kinds, rolled, &[Deployment, StatefulSet, DaemonSet]);
    futures::stream::iter((0..rolled).filter(|i| kind_of(kinds, *i) != Job))
        .for_each_concurrent(32, |i| {
            let api = api_of(client, kinds, i);
            let annotated = json!({ "metadata": { "annotations": { "rollout": "2" } } });
            let patch = match kind_of(kinds, i) {
                WorkloadKind::CronJob => {
                    json!({ "spec": { "jobTemplate": { "spec": { "template": annotated } } } })
                }
                _ => json!({ "spec": { "template": annotated } }),
            };
            async move {
                api.patch(
                    &format!("d{i}"),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
                .expect("rollout");
            }
        })
        .await;
    // Done when kube-controller-manager has written at least one status per rolled
    // Deployment and then nothing for 5 s (the apiserver's counter; listing 50,000
    // Deployments to check their observedGeneration would load the apiserver more than the
    // rollout does).
    status_quiet(
        stack,
        "kube-controller-manager to finish the rollout",
        status_writes_before + status_writers as f64,
    )
    .await;
    let updates = (status_writes(stack) - status_writes_before) as usize;
    let cpu = cpu_seconds(pid) - cpu_before;
    let rollout_s = rolling.elapsed().as_secs_f64();
    // CronJobs alone write no status in a rollout: no figure (null) rather than a quotient of
    // nothing.
    let cpu_s_per_1000_status_updates = if updates == 0 {
        f64::NAN
    } else {
        cpu * 1000.0 / updates as f64
    };
    progress(&format!("rollout: {updates} updates, {cpu:.2} CPU s"));
    (updates, cpu_s_per_1000_status_updates, rollout_s)
}

/// Waits until the apiserver has served at least `at_least` workload status writes and then
/// none for 5 s: kube-controller-manager is done with what the last phase caused.
async fn status_quiet(stack: &Arc<Stack>, what: &str, at_least: f64) {
    let mut last = (status_writes(stack), Instant::now());
    until(what, Instant::now(), async || {
        let stack = stack.clone();
        let now = tokio::task::spawn_blocking(move || status_writes(&stack))
            .await
            .unwrap_or(f64::NAN);
        if now != last.0 {
            last = (now, Instant::now());
        }
        now >= at_least && last.1.elapsed() >= Duration::from_secs(5)
    })
    .await;
}

/// Runs the benchmark; returns the JSON object the example prints.
pub async fn run(config: Config) -> Value {
    let Config {
        deployments,
        kinds,
        rest,
        datastore,
        write_queue_bound,
        delete,
        rollout: rollout_phase,
    } = config;
    let service_accounts = deployments.div_ceil(2);
    let stack = Arc::new(
        tokio::task::spawn_blocking(move || Stack::start_with(datastore))
            .await
            .expect("stack"),
    );
    let socket = stack.spire_server.socket.clone();
    let client = stack.kube.client().await;
    install_crd(&client).await;
    create_namespace(&client, REGISTRAR_NAMESPACE, false).await;
    let (kubeconfig, username) = {
        let stack = stack.clone();
        tokio::task::spawn_blocking(move || registrar_identity(&stack))
            .await
            .expect("identity")
    };
    let spec = json!({ "trustDomain": "example.org", "parentID": "spiffe://example.org/k8s/scale", "ttl": "1h" });
    Api::<SpiffeRegistration>::all(client.clone())
        .create(&PostParams::default(), &policy("scale", spec))
        .await
        .expect("policy");
    for n in 0..NAMESPACES {
        create_namespace(&client, &format!("scale-{n}"), true).await;
    }

    progress(&format!(
        "creating {deployments} Deployments (no registrar yet)"
    ));
    let created = Instant::now();
    create_all(&client, kinds, 0..deployments).await;
    progress(&format!(
        "created in {:.1} s",
        created.elapsed().as_secs_f64()
    ));
    // kube-controller-manager makes a ReplicaSet per Deployment and a Pod per Deployment,
    // StatefulSet and Job (a DaemonSet's need a node, a CronJob's Jobs are never due): that
    // is the load generator's aftermath, and it must be over before the registrar's clock
    // starts.
    use WorkloadKind::{DaemonSet, Deployment, Job, StatefulSet};
    let settling = Instant::now();
    let replica_sets: Api<ReplicaSet> = Api::all(client.clone());
    let pods: Api<Pod> = Api::all(client.clone());
    let want_replica_sets = how_many(kinds, deployments, &[Deployment]);
    let want_pods = how_many(kinds, deployments, &[Deployment, StatefulSet, Job]);
    until("kube-controller-manager to settle", settling, async || {
        // It exits when it loses its Lease to an overloaded apiserver; nothing would settle.
        stack.kube.controller_manager.assert_alive();
        count(&replica_sets).await >= want_replica_sets && count(&pods).await >= want_pods
    })
    .await;
    progress(&format!(
        "kube-controller-manager settled after {:.1} s",
        settling.elapsed().as_secs_f64()
    ));
    // The Kubernetes-side limit: the same metadata patch on every Deployment, as many in
    // flight as the registrar allows itself, with kube-controller-manager copying it to the
    // ReplicaSets as it does ours. All of them, not a sample: at 50,000 a sample of 5,000
    // ran at 231/s, ahead of kube-controller-manager's reaction to it, which the registrar's
    // patches meet in full.
    progress(&format!("raw metadata patch of {deployments} Deployments"));
    let raw_patch = Instant::now();
    futures::stream::iter(0..deployments)
        .for_each_concurrent(16, |i| {
            let api = api_of(&client, kinds, i);
            async move {
                let patch =
                    json!({ "metadata": { "annotations": { "bench.spiffe.io/raw-patch": "1" } } });
                // Answered with the object's metadata, as the registrar's patches are.
                api.patch_metadata(
                    &format!("d{i}"),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
                .expect("raw patch");
            }
        })
        .await;
    let raw_patch_s = raw_patch.elapsed().as_secs_f64();
    let raw_patches_per_s = deployments as f64 / raw_patch_s;
    progress(&format!("raw patches: {raw_patches_per_s:.0}/s"));
    // kube-controller-manager copies each patch to the ReplicaSet and writes the Deployment's
    // status, behind the patches and at its own pace: that must be over before the
    // registrar's clock starts, or the cold start shares the cores with it.
    status_quiet(
        &stack,
        "kube-controller-manager to absorb the raw patches",
        0.0,
    )
    .await;
    // The SPIRE-side limit, taken last so that SPIRE creates under the conditions the
    // registrar's cold start meets (the workloads and their controllers in place): at 10,000
    // Deployments the same create took 15.9 s here and 10.4 s on the idle cluster.
    progress(&format!(
        "raw SPIRE batch create of {service_accounts} entries"
    ));
    let raw_create_s = raw_create_seconds(&socket, service_accounts).await;

    // Cold start: the webhook configuration and the registrar arrive now.
    let port = free_port();
    create_webhook_configuration_skipping(&client, "scale", port, &username).await;
    let started = Instant::now();
    let registrar = {
        let (stack, kubeconfig) = (stack.clone(), kubeconfig.clone());
        tokio::task::spawn_blocking(move || {
            start_registrar(&stack, port, &kubeconfig, "registrar", write_queue_bound)
        })
        .await
        .expect("registrar")
    };
    let pid = registrar.process.pgid();
    let registered = |n: usize| {
        let registrar = &registrar;
        async move || registrar.metric("registrations_total", &[]) >= n as f64
    };
    let entries_s = until("every entry", started, async || {
        sent_creates(&registrar) >= service_accounts as f64
            && count_ours(&socket).await == service_accounts as i32
    })
    .await;
    progress(&format!("entries after {entries_s:.1} s"));
    let annotations_s = until("every entry-id", started, registered(deployments)).await;
    // The registrar's own share of the cores while it converged (SPIRE, the apiserver, etcd
    // and kube-controller-manager had the rest).
    let converge_cpu_s = cpu_seconds(pid);
    progress(&format!(
        "annotations after {annotations_s:.1} s ({converge_cpu_s:.1} CPU s)"
    ));

    // Quiet at rest: from 5 s after the last entry-id, for `rest`, with nothing changing:
    // what keeps running after convergence (follow-up syncs, timers, lease renewals, drift
    // checks, allocator purges) and what it costs.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let quiet = rest_window(&stack, &registrar, pid, rest).await;

    let extra = (deployments / 10).max(1);
    let live = Instant::now();
    create_all(&client, kinds, deployments..deployments + extra).await;
    // A burst through the webhook: how long the client took, and when the last entry existed.
    let live_create_s = live.elapsed().as_secs_f64();
    let live_entries = (deployments + extra).div_ceil(2) as i32;
    let live_entries_s = until("the live Deployments' entries", live, async || {
        sent_creates(&registrar) >= live_entries as f64 && count_ours(&socket).await == live_entries
    })
    .await;
    let live_annotations_s = until(
        "the live Deployments' entry-ids",
        live,
        registered(deployments + extra),
    )
    .await;
    let total = deployments + extra;

    let (updates, cpu_s_per_1000_status_updates, rollout_s) = if rollout_phase {
        rollout(&stack, &client, kinds, total, pid).await
    } else {
        (0, f64::NAN, f64::NAN)
    };

    tokio::time::sleep(Duration::from_secs(2)).await;
    let steady_rss_mib = proc_field(pid, "VmRSS:");
    let steady_heap_mib = registrar.metric("heap_live_bytes", &[]) / MIB;
    let calls = registrar.spire_calls();
    let list_calls =
        || registrar.metric("spire_api_call_duration_seconds_count", &[("op", "list")]);
    let lists = list_calls();
    let counts = || {
        (
            registrar.metric("spire_api_call_duration_seconds_count", &[("op", "count")]),
            registrar.metric("spire_api_call_duration_seconds_sum", &[("op", "count")]),
        )
    };
    let counts_before = counts();
    let spire_pid = stack.spire_server.process.pgid();
    let spire_cpu_before = cpu_seconds(spire_pid);
    let cpu_at_rest_before = cpu_seconds(pid);
    progress(&format!("at rest for {} s", rest.as_secs()));
    tokio::time::sleep(rest).await;
    // What the registrar spends doing nothing (leases, drift checks, resyncs): on a slow
    // machine the rollout lasts many minutes, and this share of its CPU is not per update.
    let cpu_s_per_min_at_rest =
        (cpu_seconds(pid) - cpu_at_rest_before) * 60.0 / rest.as_secs_f64().max(1.0);
    let spire_calls_per_min_at_rest = (registrar.spire_calls() - calls) * 60.0 / rest.as_secs_f64();
    // At rest only drift checks (a count per hint, every 10 s or less often when counting is
    // slow) are expected: never a list.
    let spire_lists_at_rest = list_calls() - lists;
    // A count is small on the wire but SPIRE walks our entries to answer it: what the drift
    // checks cost the server, and how long one takes at this size.
    let spire_cpu_s_per_min_at_rest =
        (cpu_seconds(spire_pid) - spire_cpu_before) * 60.0 / rest.as_secs_f64().max(1.0);
    let (count_calls, count_seconds) = counts();
    let count_ms_at_rest =
        (count_seconds - counts_before.1) * 1000.0 / (count_calls - counts_before.0).max(1.0);

    // Drift: an entry deleted behind the registrar's back, found by the next drift check.
    let hint = format!("spiffe-registrar/{CLUSTER}");
    let drift_repair_s = drift_repair_seconds(&socket, &hint).await;
    progress(&format!("drift repaired after {drift_repair_s:.1} s"));

    // A restart over the registered cluster: its first sync must write nothing.
    let (registrar, restarted) = {
        let (stack, kubeconfig) = (stack.clone(), kubeconfig.clone());
        restart(registrar, move || {
            start_registrar(&stack, port, &kubeconfig, "registrar-2", write_queue_bound)
        })
        .await
    };
    let pid = registrar.process.pgid();

    // Deletion at the apiserver's pace: the last `delete` workloads (whole service accounts)
    // against the same number of held workloads released by hand.
    let deleted = (delete.min(total / 2) / 2) * 2;
    let kept = total - deleted;
    let raw_delete_s = raw_delete_seconds(&client, kinds, deleted).await;
    let delete_s = delete_registered(&client, kinds, kept..total, &socket, kept.div_ceil(2)).await;
    progress(&format!(
        "deleted {deleted} in {delete_s:.1} s (raw {raw_delete_s:.1} s)"
    ));

    // Namespace deletion: whole namespaces until 5,000 Deployments (or all) are covered.
    let per_namespace = kept.div_ceil(NAMESPACES).max(1);
    let doomed = (5_000.min(kept)).div_ceil(per_namespace).min(NAMESPACES);
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let deleting = Instant::now();
    for n in 0..doomed {
        namespaces
            .delete(&format!("scale-{n}"), &DeleteParams::default())
            .await
            .expect("delete namespace");
    }
    let namespace_delete_s = until("the namespaces to go", deleting, async || {
        for n in 0..doomed {
            if namespaces
                .get_opt(&format!("scale-{n}"))
                .await
                .ok()
                .flatten()
                .is_some()
            {
                return false;
            }
        }
        true
    })
    .await;
    let peak_rss_mib = proc_field(pid, "VmHWM:").max(restarted.previous_peak_rss_mib);
    let peak_heap_mib = registrar.metric("heap_peak_bytes", &[]) / MIB;
    let syncs = registrar.metric("reconcile_duration_seconds_count", &[]);
    let sync_ms_mean =
        registrar.metric("reconcile_duration_seconds_sum", &[]) * 1000.0 / syncs.max(1.0);
    let derive_ms_mean = registrar.metric("desired_state_seconds_sum", &[]) * 1000.0
        / registrar
            .metric("desired_state_seconds_count", &[])
            .max(1.0);
    let mut report = json!({
        "deployments": deployments,
        "kinds": kinds.iter().map(|k| k.name()).collect::<Vec<_>>(),
        "entries": service_accounts,
        "entries_s": entries_s,
        "annotations_s": annotations_s,
        "converge_cpu_s": converge_cpu_s,
        "live_create_s": live_create_s,
        "live_entries_s": live_entries_s,
        "live_annotations_s": live_annotations_s,
        "raw_create_s": raw_create_s,
        "ratio_to_raw": annotations_s / raw_create_s,
        "entries_ratio_to_raw_create": entries_s / raw_create_s,
        "entry_ids_ratio_to_raw": annotations_s / raw_create_s.max(raw_patch_s),
        "raw_patches_per_s": raw_patches_per_s,
        "raw_patch_s": raw_patch_s,
        "ratio_to_raw_patch": annotations_s / raw_patch_s,
        "syncs": syncs,
        "full_syncs": registrar.metric("syncs_total", &[("derive", "full")]),
        "changed_syncs": registrar.metric("syncs_total", &[("derive", "changed")]),
        "sync_ms_mean": sync_ms_mean,
        "derive_ms_mean": derive_ms_mean,
        "peak_rss_mib": peak_rss_mib,
        "steady_rss_mib": steady_rss_mib,
        "peak_heap_mib": peak_heap_mib,
        "steady_heap_mib": steady_heap_mib,
        "cpu_s_per_1000_status_updates": cpu_s_per_1000_status_updates,
        "status_updates": updates,
        "rollout_s": rollout_s,
    });
    // Two objects: one `json!` of every key passes the macro's recursion limit.
    let later = json!({
        "rest_cpu_s_per_min": quiet.cpu_s_per_min,
        "rest_cpu_s_per_min_by_thread": quiet.cpu_s_per_min_by_thread,
        "rest_threads_ended": quiet.threads_ended,
        "rest_spire_calls_per_min": quiet.spire_calls_per_min,
        "rest_syncs": quiet.syncs,
        "rest_full_syncs": quiet.full_syncs,
        "rest_kube_writes_per_min": quiet.kube_writes_per_min,
        "rest_event_writes_per_min": quiet.event_writes_per_min,
        "rest_status_updates": quiet.status_updates,
        "cpu_s_per_min_at_rest": cpu_s_per_min_at_rest,
        "spire_calls_per_min_at_rest": spire_calls_per_min_at_rest,
        "spire_lists_at_rest": spire_lists_at_rest,
        "spire_cpu_s_per_min_at_rest": spire_cpu_s_per_min_at_rest,
        "count_ms_at_rest": count_ms_at_rest,
        "drift_repair_s": drift_repair_s,
        "restart_first_sync_s": restarted.first_sync_s,
        "restart_spire_writes": restarted.spire_writes,
        "restart_kube_writes": restarted.kube_writes,
        "restart_peak_rss_mib": restarted.peak_rss_mib,
        "deleted": deleted,
        "delete_s": delete_s,
        "raw_delete_s": raw_delete_s,
        "delete_ratio_to_raw_patch": delete_s / raw_delete_s,
        "namespace_delete_s": namespace_delete_s,
        "namespaces_deleted": doomed,
        "datastore": datastore.name(),
    });
    if let (Some(report), Value::Object(later)) = (report.as_object_mut(), later) {
        report.extend(later);
    }
    drop(registrar);
    report
}
