//! Leadership and bounded failure against the real kube-apiserver and spire-server:
//! a replica that is not sure it leads never writes, a leader that cannot use SPIRE hands
//! over, SIGTERM is prompt, an outage ends within seconds of SPIRE's return, drift is
//! repaired at rest, and a dead task takes the process down. Partitions are made with proxies
//! the test cuts (`common::proxy`); outcomes are read from SPIRE, the Lease and the metrics.

mod common;

use common::k8s::{
    create_namespace_with, create_webhook_configuration_excluding, deployment, eventually,
    install_crd,
};
use common::paths::free_port;
use common::process::http_get_status;
use common::proxy::Proxy;
use common::registrar::{Options, Registrar};
use common::sampler::{Sa, Sampler, entries_of, sa, spire_client};
use common::stack::{Stack, unique};
use common::world::{NO_WEBHOOK, Scenario, entry_id_of};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::PostParams;
use kube::{Api, Client};
use spiffe_registrar::leader::LEASE_NAME;
use spiffe_registrar::spire::proto::entry::BatchDeleteEntryRequest;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The shipped --renew-deadline and --lease-retry-period.
const RENEW_DEADLINE: Duration = Duration::from_secs(10);
const RETRY: Duration = Duration::from_secs(2);
const WAIT: Duration = Duration::from_secs(60);

/// Quick failover, valid by the fencing rule: 8 s lease > 3 s deadline + 4 s longest write.
/// Short leases and no SPIRE rate limit: most tests here observe an order of events, not
/// the shipped timings (those are `AT_DEFAULTS`' tests).
const FAST: &[&str] = &[
    "--lease-duration=8s",
    "--renew-deadline=3s",
    "--lease-retry-period=1s",
    "--spire-rps=0",
];

/// Every flag at its shipped default.
const AT_DEFAULTS: &[&str] = &[];

/// One test's deployment of the registrar: its namespace (Lease, Secret), its webhook
/// configuration and its cluster name, all named `name`.
struct Home {
    name: String,
    port: u16,
    client: Client,
}

async fn home(stack: &Stack) -> Home {
    let client = stack.kube.client().await;
    install_crd(&client).await;
    let name = unique("lead");
    create_namespace_with(&client, &name, false, &[]).await;
    let port = free_port();
    create_webhook_configuration_excluding(&client, &name, port, Some(NO_WEBHOOK)).await;
    Home { name, port, client }
}

impl Home {
    /// A replica named `replica` with the `FAST` settings, talking to the apiserver through
    /// `kubeconfig`.
    fn replica(
        &self,
        stack: &Stack,
        replica: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        kubeconfig: Option<&Path>,
    ) -> Registrar {
        self.replica_with(stack, replica, FAST, extra, env, kubeconfig)
    }

    /// A replica with `base` settings and `extra` flags.
    fn replica_with(
        &self,
        stack: &Stack,
        replica: &str,
        base: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
        kubeconfig: Option<&Path>,
    ) -> Registrar {
        let mut extra: Vec<&str> = base.iter().chain(extra).copied().collect();
        let opt_in = format!("--namespace-label={HOME_LABEL}={}", self.name);
        extra.push(&opt_in);
        let options = Options {
            namespace: &self.name,
            webhook_configuration: &self.name,
            cluster_name: &self.name,
            name: replica,
            extra_args: extra.iter().map(ToString::to_string).collect(),
            extra_env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let kubeconfig = kubeconfig.unwrap_or(&stack.kube.kubeconfig);
        // The first replica serves on the port the webhook configuration names.
        let port = if ["a", "only"].contains(&replica) {
            self.port
        } else {
            free_port()
        };
        let registrar =
            tokio::task::block_in_place(|| Registrar::start_full(stack, port, kubeconfig, options));
        stack.track(registrar.process.pgid());
        registrar
    }

    async fn holder(&self) -> Option<String> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.name);
        leases
            .get_opt(LEASE_NAME)
            .await
            .ok()
            .flatten()
            .and_then(|l| l.spec?.holder_identity)
            .filter(|h| !h.is_empty())
    }

    async fn wait_holder(&self, who: &str, within: Duration) {
        eventually(&format!("{who} to hold the Lease"), within, || async {
            (self.holder().await.as_deref() == Some(who)).then_some(())
        })
        .await
    }
}

/// Waits until `registrar`'s `leader` gauge reads `value`.
async fn leader_gauge(registrar: &Registrar, value: f64, within: Duration) {
    eventually(&format!("leader gauge {value}"), within, || async {
        (registrar.metric("leader", &[]) == value).then_some(())
    })
    .await
}

/// SPIRE's entries for `who` right now.
/// How many terms `registrar` started and ended, by `leadership_transitions_total`.
fn assert_transitions(registrar: &Registrar, started: f64, ended: f64) {
    let count = |to| registrar.metric("leadership_transitions_total", &[("to", to)]);
    assert_eq!(
        (count("leader"), count("follower")),
        (started, ended),
        "terms started and ended"
    );
}

async fn spire_entries(socket: &Path, who: &Sa) -> Vec<spiffe_registrar::spire::Entry> {
    let mut client = spire_client(socket).await;
    entries_of(&mut client, who).await.unwrap_or_default()
}

/// Polls SPIRE every 50 ms until `who` has an entry; how long that took.
async fn until_registered(socket: &Path, who: &Sa, within: Duration) -> Duration {
    let started = Instant::now();
    let mut client = spire_client(socket).await;
    loop {
        if entries_of(&mut client, who)
            .await
            .is_some_and(|e| !e.is_empty())
        {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "{who:?} not registered within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A proxy to the stack's SPIRE socket that the test can cut, and the flag that points a
/// replica at it.
async fn spire_proxy(stack: &Stack) -> (Proxy, String) {
    let socket = stack.dir().join(format!("{}.sock", unique("spire-proxy")));
    let proxy = Proxy::unix(socket.clone(), stack.spire_server.socket.clone()).await;
    (proxy, format!("--spire-socket={}", socket.display()))
}

/// The admin kubeconfig, pointed at `proxy` instead of the apiserver.
fn kubeconfig_via(stack: &Stack, proxy: &Proxy) -> PathBuf {
    let text = std::fs::read_to_string(&stack.kube.kubeconfig).expect("kubeconfig");
    let rewritten = text.replace(&stack.kube.url, &format!("https://{}", proxy.listen));
    assert_ne!(text, rewritten, "the kubeconfig names {}", stack.kube.url);
    let path = stack
        .dir()
        .join(format!("{}.kubeconfig", unique("via-proxy")));
    std::fs::write(&path, rewritten).expect("write kubeconfig");
    path
}

/// Each test's registrars opt in only the namespaces labelled with their home: every
/// registrar on the shared apiserver sees every policy, and another test's registrar must
/// not register (or hold off for) this test's Deployments.
const HOME_LABEL: &str = "e2e/home";

/// A policy and a namespace opted in for `home`'s registrars only (not sent to the webhook:
/// the controller alone acts).
async fn workloads(stack: &Stack, home: &Home) -> (Scenario, String) {
    let scenario = Scenario::new(&stack.kube).await;
    scenario.policy("p", scenario.spec("nodes")).await;
    let ns = scenario.namespace(false).await;
    let label = serde_json::json!({ "metadata": { "labels": { HOME_LABEL: home.name } } });
    Api::<k8s_openapi::api::core::v1::Namespace>::all(home.client.clone())
        .patch(
            &ns,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&label),
        )
        .await
        .expect("label the namespace");
    (scenario, ns)
}

/// A single replica with `failpoint` set, leading, and a Deployment "web" created for it to
/// register; returns it and the Deployment's namespace.
async fn leading_with_failpoint(
    stack: &Stack,
    home: &Home,
    failpoint: &str,
) -> (Registrar, String) {
    let only = home.replica(
        stack,
        "only",
        &[],
        &[("SPIFFE_REGISTRAR_FAILPOINT", failpoint)],
        None,
    );
    home.wait_holder("only", WAIT).await;
    let (scenario, ns) = workloads(stack, home).await;
    scenario
        .deployments(&ns)
        .create(&PostParams::default(), &deployment("web", Some("web")))
        .await
        .expect("create");
    (only, ns)
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_when_idle_exits_within_2s_and_releases_the_lease() {
    let stack = Stack::shared();
    let home = home(stack).await;
    let mut only = home.replica(stack, "only", &[], &[], None);
    home.wait_holder("only", WAIT).await;
    leader_gauge(&only, 1.0, WAIT).await;

    let (took, status) =
        tokio::task::block_in_place(|| only.process.terminate(Duration::from_secs(10)));
    let status = status.expect("exited");
    assert!(status.success(), "{status}\n{}", only.process.log_tail(30));
    assert!(took < Duration::from_secs(2), "SIGTERM to exit: {took:?}");
    assert_eq!(home.holder().await, None, "the Lease is released on exit");
    eprintln!("idle SIGTERM: exited in {took:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_mid_sync_exits_within_5s_and_releases_the_lease() {
    let stack = Stack::shared();
    let home = home(stack).await;
    // The failpoint holds the sync forever right after SPIRE created the entries: a sync that
    // never finishes by itself.
    let (mut only, ns) = leading_with_failpoint(stack, &home, "pause-after-create").await;
    until_registered(&stack.spire_server.socket, &sa(&ns, "web"), WAIT).await;

    let (took, status) =
        tokio::task::block_in_place(|| only.process.terminate(Duration::from_secs(15)));
    let status = status.expect("exited");
    assert!(status.success(), "{status}\n{}", only.process.log_tail(30));
    assert!(
        took < Duration::from_secs(5),
        "SIGTERM mid-sync to exit: {took:?}"
    );
    assert_eq!(home.holder().await, None, "the Lease is released on exit");
    eprintln!("mid-sync SIGTERM: exited in {took:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leader_that_cannot_use_spire_steps_down_and_the_other_replica_takes_over() {
    let stack = Stack::shared();
    let home = home(stack).await;
    let (proxy, via_proxy) = spire_proxy(stack).await;
    let a = home.replica(
        stack,
        "a",
        &[&via_proxy, "--spire-unusable-after=3s"],
        &[],
        None,
    );
    home.wait_holder("a", WAIT).await;
    let b = home.replica(stack, "b", &["--spire-unusable-after=3s"], &[], None);
    let (scenario, ns) = workloads(stack, &home).await;
    scenario.registered(&ns, "before", "before").await;

    proxy.cut();
    let cut = Instant::now();
    scenario
        .deployments(&ns)
        .create(&PostParams::default(), &deployment("after", Some("after")))
        .await
        .expect("create");
    home.wait_holder("b", Duration::from_secs(30)).await;
    let failover = cut.elapsed();
    entry_id_of(&scenario.deployments(&ns), "after").await;
    let converged = cut.elapsed();
    assert!(
        !spire_entries(&stack.spire_server.socket, &sa(&ns, "after"))
            .await
            .is_empty()
    );
    assert_eq!(a.metric("leader", &[]), 0.0);
    assert_eq!(a.metric("spire_reachable", &[]), 0.0);
    assert_eq!(b.metric("leader", &[]), 1.0);
    // One term, started and ended once each: no loop on the ending term's signal.
    assert_transitions(&a, 1.0, 1.0);
    assert_transitions(&b, 1.0, 0.0);
    eprintln!(
        "SPIRE lost: Lease with the healthy replica after {failover:?}, new Deployment registered after {converged:?}"
    );
}

/// At the shipped defaults, a leader whose SPIRE connection stalls (open and silent, the
/// usual shape of a partition) releases the Lease within 15 s of the stall, and the replica
/// that can reach SPIRE registers a new workload within 20 s: read from the Lease and from
/// SPIRE. Each replica starts and ends a term once (by metric).
#[tokio::test(flavor = "multi_thread")]
async fn at_defaults_a_stalled_spire_costs_the_lease_within_15s_and_a_write_within_20s() {
    let stack = Stack::shared();
    let home = home(stack).await;
    let (proxy, via_proxy) = spire_proxy(stack).await;
    let a = home.replica_with(stack, "a", AT_DEFAULTS, &[&via_proxy], &[], None);
    home.wait_holder("a", WAIT).await;
    let b = home.replica_with(stack, "b", AT_DEFAULTS, &[], &[], None);
    let (scenario, ns) = workloads(stack, &home).await;
    scenario.registered(&ns, "before", "before").await;

    proxy.stall();
    let stalled = Instant::now();
    scenario
        .deployments(&ns)
        .create(&PostParams::default(), &deployment("after", Some("after")))
        .await
        .expect("create");
    eventually("A to let the Lease go", Duration::from_secs(30), || async {
        (home.holder().await.as_deref() != Some("a")).then_some(())
    })
    .await;
    let released = stalled.elapsed();
    let registered = until_registered(
        &stack.spire_server.socket,
        &sa(&ns, "after"),
        Duration::from_secs(30),
    )
    .await;
    let written = stalled.elapsed();
    eprintln!(
        "stalled SPIRE at defaults: Lease released after {released:?}, entry written after {written:?} (waited {registered:?})"
    );
    assert!(
        released <= Duration::from_secs(15),
        "released after {released:?}"
    );
    assert!(
        written <= Duration::from_secs(20),
        "written after {written:?}"
    );
    assert_eq!(home.holder().await.as_deref(), Some("b"));
    assert_transitions(&a, 1.0, 1.0);
    assert_transitions(&b, 1.0, 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn registration_resumes_within_2s_of_spire_returning_after_a_long_outage() {
    let stack = Stack::shared();
    let home = home(stack).await;
    let (proxy, via_proxy) = spire_proxy(stack).await;
    let only = home.replica(stack, "only", &[&via_proxy], &[], None);
    home.wait_holder("only", WAIT).await;
    let (scenario, ns) = workloads(stack, &home).await;
    scenario.registered(&ns, "before", "before").await;

    proxy.cut();
    scenario
        .deployments(&ns)
        .create(
            &PostParams::default(),
            &deployment("during", Some("during")),
        )
        .await
        .expect("create");
    eventually("the registrar to see SPIRE down", WAIT, || async {
        (only.metric("spire_reachable", &[]) == 0.0).then_some(())
    })
    .await;
    // The outage itself: longer than every backoff ceiling the registrar had (30 s).
    tokio::time::sleep(Duration::from_secs(35)).await;
    proxy.restore();
    let resumed = until_registered(&stack.spire_server.socket, &sa(&ns, "during"), WAIT).await;
    assert!(
        resumed <= Duration::from_secs(2),
        "registration resumed {resumed:?} after SPIRE returned"
    );
    entry_id_of(&scenario.deployments(&ns), "during").await;
    eprintln!("SPIRE back: registration resumed after {resumed:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wiped_datastore_is_repaired_within_15s_with_default_flags() {
    let stack = Stack::shared();
    let home = home(stack).await;
    // Default resync (5 min) and drift checks: only the lease flags are the test's.
    let only = home.replica(stack, "only", &[], &[], None);
    home.wait_holder("only", WAIT).await;
    let (scenario, ns) = workloads(stack, &home).await;
    scenario.registered(&ns, "one", "one").await;
    scenario.registered(&ns, "two", "two").await;
    let watched = [sa(&ns, "one"), sa(&ns, "two")];
    let calls_at_rest = only.spire_calls();

    let mut client = spire_client(&stack.spire_server.socket).await;
    let mut ids = Vec::new();
    for who in &watched {
        ids.extend(
            entries_of(&mut client, who)
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|e| e.id),
        );
    }
    assert_eq!(ids.len(), 2);
    client
        .batch_delete_entry(BatchDeleteEntryRequest { ids })
        .await
        .expect("delete by hand");
    let wiped = Instant::now();
    for who in &watched {
        until_registered(&stack.spire_server.socket, who, Duration::from_secs(20)).await;
    }
    let repaired = wiped.elapsed();
    assert!(
        repaired <= Duration::from_secs(15),
        "repaired after {repaired:?}"
    );
    assert!(
        only.metric("drift_checks_total", &[("result", "mismatch")]) >= 1.0,
        "found by a drift check"
    );
    eprintln!(
        "wiped entries repaired after {repaired:?} ({} SPIRE calls at rest before)",
        calls_at_rest
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_that_panics_turns_readyz_red_and_the_process_exits_non_zero() {
    let stack = Stack::shared();
    let home = home(stack).await;
    // The failpoint panics the controller task once a sync has created an entry.
    let (mut only, _) = leading_with_failpoint(stack, &home, "panic-after-create").await;
    let port = only.admin_port;
    let why = eventually("/readyz to go red", WAIT, || async {
        let answer = tokio::task::spawn_blocking(move || http_get_status(port, "/readyz"))
            .await
            .ok()
            .flatten();
        answer.and_then(|(status, body)| (status == 503).then_some(body))
    })
    .await;
    assert!(
        why.contains("controller") && why.contains("panicked"),
        "/readyz says which task died and how: {why:?}"
    );
    let status = tokio::task::block_in_place(|| only.process.wait_exit(Duration::from_secs(15)))
        .expect("the process exits");
    assert!(!status.success(), "exit status {status}");
}

/// At the shipped defaults: the cut-off leader's own clock ends its term by its renew deadline.
#[tokio::test(flavor = "multi_thread")]
async fn a_leader_cut_off_from_the_apiserver_stops_writing_at_its_renew_deadline() {
    let stack = Stack::shared();
    let home = home(stack).await;
    let apiserver = stack.kube.url.trim_start_matches("https://").to_string();
    let proxy = Proxy::tcp(apiserver).await;
    let kubeconfig = kubeconfig_via(stack, &proxy);
    let a = home.replica_with(stack, "a", AT_DEFAULTS, &[], &[], Some(&kubeconfig));
    home.wait_holder("a", WAIT).await;
    leader_gauge(&a, 1.0, WAIT).await;
    let b = home.replica_with(stack, "b", AT_DEFAULTS, &[], &[], None);
    let (scenario, ns) = workloads(stack, &home).await;
    scenario.registered(&ns, "before", "before").await;

    proxy.cut();
    let cut = Instant::now();
    // A's own clock ends its term: at most the renew deadline after its last renewal, which
    // was at most one retry period before the cut.
    leader_gauge(&a, 0.0, RENEW_DEADLINE + RETRY + Duration::from_secs(2)).await;
    let fenced = cut.elapsed();
    home.wait_holder("b", Duration::from_secs(40)).await;
    let took_over = cut.elapsed();

    // A keeps running with frozen caches: it has never seen "after". Were it still writing,
    // its drift check or resync would delete the entry B made for it. SPIRE is watched for
    // longer than A's drift interval (10 s); the window's length is the observation.
    scenario.registered(&ns, "after", "after").await;
    let sampler = Sampler::start(&stack.spire_server.socket, &[sa(&ns, "after")]).await;
    tokio::time::sleep(Duration::from_secs(15)).await;
    let samples = sampler.stop().await;
    samples.assert_never_missing(&sa(&ns, "after"));
    assert_eq!(
        a.metric("leader", &[]),
        0.0,
        "the cut-off replica never leads again"
    );
    assert_eq!(b.metric("leader", &[]), 1.0);
    assert_transitions(&a, 1.0, 1.0);
    assert_transitions(&b, 1.0, 0.0);
    eprintln!("apiserver cut: old leader fenced after {fenced:?}, new leader after {took_over:?}");
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_outage_seen_only_by_a_drift_check_costs_no_sync() {
    // A stack of its own: every registrar sees every policy, and on the shared apiserver the
    // other tests' policy writes would wake this one for full syncs the test does not cause.
    let own = tokio::task::block_in_place(Stack::start);
    let stack = &own;
    let home = home(stack).await;
    let (proxy, via_proxy) = spire_proxy(stack).await;
    let only = home.replica(
        stack,
        "only",
        &[&via_proxy, "--spire-unusable-after=60s"],
        &[],
        None,
    );
    home.wait_holder("only", WAIT).await;
    let (scenario, ns) = workloads(stack, &home).await;
    scenario.registered(&ns, "one", "one").await;
    let syncs = || {
        (
            only.metric("syncs_total", &[("derive", "full")]),
            only.metric("syncs_total", &[("derive", "changed")]),
        )
    };
    let checks = |result: &str| only.metric("drift_checks_total", &[("result", result)]);
    // At rest: no sync between two drift checks.
    let mut last = (syncs(), checks("match"));
    eventually("the registrar to rest", WAIT, || {
        let now = (syncs(), checks("match"));
        let rested = now.1 > last.1 && now.0 == last.0;
        if now.1 > last.1 {
            last = now;
        }
        async move { rested.then_some(()) }
    })
    .await;
    let at_rest = syncs();

    proxy.cut();
    eventually("a drift check to fail", WAIT, || async {
        (only.metric("spire_reachable", &[]) == 0.0).then_some(())
    })
    .await;
    proxy.restore();
    let matched = checks("match");
    eventually("SPIRE back and the count matching", WAIT, || async {
        (only.metric("spire_reachable", &[]) == 1.0 && checks("match") > matched).then_some(())
    })
    .await;
    assert!(checks("error") >= 1.0);
    assert_eq!(
        syncs(),
        at_rest,
        "SPIRE holds what the registrar expects: nothing to sync"
    );
    // And the registrar still works.
    scenario.registered(&ns, "two", "two").await;
}
