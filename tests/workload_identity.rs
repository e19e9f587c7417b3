//! A Pod holds its SVID (invariant 12): Deployments run on the bed's real node, SPIRE's agent
//! runs there as a DaemonSet attested by k8s_psat, and each Pod's `svid-watch` reports what
//! the Workload API gives it, second by second. Every assertion about identity is made from
//! that report (the workload's side), next to SPIRE's and the apiserver's.
#![cfg(feature = "e2e")]

mod common;

use common::k8s::{annotation, create_namespace_with, eventually};
use common::node::apply;
use common::node_agent::{PSAT_CLUSTER, bare_pod, workload_deployment, workload_of_kind};
use common::registrar::Registrar;
use common::reports::{self, Line};
use common::stack::{Held, unique};
use common::world::{Scenario, TD, flags, lease_holder, options, prepare, spiffe_id};
use common::{Stack, paths::free_port};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use serde_json::{Value, json};
use spiffe_registrar::names::SPIFFE_ID_ANNOTATION;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// How long a test waits for a Pod's first SVID: scheduling, the sandbox, the agent's sync.
const SVID_WAIT: Duration = Duration::from_secs(90);
/// Seconds a Pod must report holding nothing before "no identity" is believed: longer than
/// the agent's sync (5 s), so an identity on its way would have arrived.
const NO_IDENTITY_SECONDS: usize = 12;

struct Bed {
    stack: &'static Stack,
    /// Two replicas, by name: one leads, the other waits (a failover test kills the leader
    /// and starts it again).
    registrars: Mutex<Vec<(String, Registrar)>>,
}

/// The flags of the bed's registrars: policies without parentID hang from the alias of the
/// bed's k8s_psat cluster.
fn replica(stack: &Stack, webhook_port: u16, name: &str) -> Registrar {
    let registrar = Registrar::start_on(
        stack,
        webhook_port,
        options(
            "wl",
            name,
            flags(
                &[],
                &[
                    &format!("--node-alias-cluster={PSAT_CLUSTER}"),
                    "--transition-grace=10s",
                ],
            ),
        ),
    );
    stack.track(registrar.process.pgid());
    registrar
}

/// The bed's first replica, which leads until the failover test kills it.
const LEADER: &str = "registrar-leader";

/// The node stack and two registrar replicas.
fn bed() -> Held<Bed> {
    static BED: OnceLock<Bed> = OnceLock::new();
    let bed = BED.get_or_init(|| {
        tokio::task::block_in_place(|| {
            let stack = Stack::shared_with_node();
            let webhook_port = free_port();
            prepare(&stack.kube, webhook_port);
            // The leader is started first and serves no webhook the apiserver calls, so that
            // killing it (the failover test) costs the other tests' admissions nothing.
            let leader = replica(stack, free_port(), LEADER);
            let kubeconfig = stack.kube.kubeconfig.clone();
            Stack::block_on_fresh(async move {
                let client = common::kube_plane::client_for(&kubeconfig).await;
                eventually("the first replica to lead", SVID_WAIT, || async {
                    lease_holder(&client).await.filter(|h| h == LEADER)
                })
                .await;
            });
            let follower = replica(stack, webhook_port, "registrar-webhook");
            Bed {
                stack,
                registrars: Mutex::new(vec![
                    (LEADER.into(), leader),
                    ("registrar-webhook".into(), follower),
                ]),
            }
        })
    });
    Held::new(bed, bed.stack)
}

/// A policy of this scenario with no parentID (the node alias) and a DNS name.
fn alias_spec(s: &Scenario) -> Value {
    json!({
        "trustDomain": TD,
        "ttl": "1h",
        "dnsNames": ["{serviceAccount}.{namespace}.svc"],
        "namespaceSelector": { "matchLabels": { "e2e/test": s.tag } }
    })
}

/// A test's world on the bed: its scenario, its policy (no parentID: the node alias) and an
/// opted-in namespace the policy selects.
async fn world(stack: &Stack) -> (Scenario, String, String) {
    let s = Scenario::new(&stack.kube).await;
    let policy = s.policy("p", alias_spec(&s)).await;
    let ns = s.namespace(true).await;
    (s, policy, ns)
}

/// Runs Deployment `ns/name` (one replica, as `sa`) and returns its Running Pod.
async fn one_pod(stack: &Stack, s: &Scenario, ns: &str, name: &str, sa: &str) -> String {
    run_workload(stack, ns, name, sa, 1);
    running_pods(s, ns, name, 1).await.remove(0)
}

/// Applies a Deployment of the bed's workload.
fn run_workload(stack: &Stack, ns: &str, name: &str, sa: &str, replicas: u32) {
    let (node, agent) = stack.node();
    let sockets = node.dir.join("agent-sockets");
    apply(
        &stack.kube,
        &workload_deployment(ns, name, sa, replicas, &agent.reports, &sockets),
    );
}

/// Names of the Running Pods of Deployment `app` in `ns`, once there are `count`.
async fn running_pods(s: &Scenario, ns: &str, app: &str, count: usize) -> Vec<String> {
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), ns);
    eventually(
        &format!("{count} running Pods of {ns}/{app}"),
        SVID_WAIT,
        || async {
            let list = pods
                .list(&ListParams::default().labels(&format!("app={app}")))
                .await
                .ok()?;
            let running: Vec<String> = list
                .items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            (running.len() == count).then_some(running)
        },
    )
    .await
}

/// Waits until Pod `pod`'s report satisfies `done`; returns the report.
async fn report_until(
    stack: &Stack,
    pod: &str,
    what: &str,
    done: impl Fn(&[Line]) -> bool,
) -> Vec<Line> {
    let reports_dir = stack.node().1.reports.clone();
    eventually(&format!("{pod}: {what}"), SVID_WAIT, || {
        let lines = reports::read(&reports_dir, pod);
        let done = done(&lines);
        async move { done.then_some(lines) }
    })
    .await
}

/// Waits until `pod` holds exactly `ids` (its last second's sample).
async fn holding(stack: &Stack, pod: &str, ids: &[&str]) -> Vec<Line> {
    let wanted: Vec<String> = ids.iter().map(ToString::to_string).collect();
    report_until(stack, pod, &format!("holding {ids:?}"), |lines| {
        reports::holding_now(lines) == wanted
    })
    .await
}

/// Waits until `pod` has reported `NO_IDENTITY_SECONDS` seconds, and asserts it never held an
/// SVID and the agent said it has no identity.
async fn never_identified(stack: &Stack, pod: &str) {
    let lines = report_until(stack, pod, "reported for long enough", |lines| {
        reports::seconds(lines).len() >= NO_IDENTITY_SECONDS
    })
    .await;
    assert!(
        reports::svid_sets(&lines).iter().all(|set| set.is_empty()),
        "{pod} must get no SVID: {lines:?}"
    );
    assert!(reports::seconds(&lines).iter().all(|held| held.is_empty()));
    assert!(
        lines.iter().any(is_refusal),
        "the agent must have refused {pod}: {lines:?}"
    );
}

/// Waits until the agent has refused `pod` and `pod` then held nothing for
/// `NO_IDENTITY_SECONDS` seconds; asserts nothing was issued after the first refusal. An SVID
/// before it is the agent's sync lag (it learns of deleted entries every 5 s), not an identity
/// SPIRE still grants.
async fn identity_withdrawn(stack: &Stack, pod: &str) {
    let after_refusal = |lines: &[Line]| -> Vec<Line> {
        lines
            .iter()
            .skip_while(|line| !is_refusal(line))
            .cloned()
            .collect()
    };
    let lines = report_until(stack, pod, "refused, then long enough without", |lines| {
        reports::seconds(&after_refusal(lines)).len() >= NO_IDENTITY_SECONDS
    })
    .await;
    let after = after_refusal(&lines);
    assert!(
        reports::svid_sets(&after).iter().all(|set| set.is_empty())
            && reports::seconds(&after).iter().all(|held| held.is_empty()),
        "{pod} must get nothing once the agent refused it: {lines:?}"
    );
}

fn is_refusal(line: &Line) -> bool {
    matches!(line, Line::Error { error, .. }
        if error.contains("PermissionDenied") || error.contains("no identity issued"))
}

/// Every built-in kind, from the workload's side: a StatefulSet's, a DaemonSet's, a Job's and
/// a CronJob's Pod (its Job made from it by `kubectl create job --from`) each hold the SVID
/// their workload was annotated with at admission.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_of_every_kind_holds_the_svid_its_workload_was_annotated_with() {
    use spiffe_registrar::keys::WorkloadKind::{self, CronJob, DaemonSet, Job, StatefulSet};
    let bed = bed();
    let stack = bed.stack;
    let (s, _, ns) = world(stack).await;
    let (node, agent) = stack.node();
    let sockets = node.dir.join("agent-sockets");
    let kinds = [StatefulSet, DaemonSet, Job, CronJob];
    let name = |kind: WorkloadKind| kind.name().to_lowercase();
    for kind in kinds {
        let sa = format!("{}-sa", name(kind));
        let yaml = workload_of_kind(kind, &ns, &name(kind), &sa, &agent.reports, &sockets);
        apply(&stack.kube, &yaml);
    }
    let (ok, _, stderr) = s.kubectl(&[
        "-n",
        &ns,
        "create",
        "job",
        "--from=cronjob/cronjob",
        "cronjob",
    ]);
    assert!(ok, "kubectl create job --from: {stderr}");
    for kind in kinds {
        let sa = format!("{}-sa", name(kind));
        let api: Api<kube::api::DynamicObject> =
            Api::namespaced_with(s.client.clone(), &ns, &kind.api_resource());
        let stamped = eventually(&format!("the {kind}'s spiffe-id"), SVID_WAIT, || async {
            let object = api.get(&name(kind)).await.ok()?;
            object
                .metadata
                .annotations?
                .get(SPIFFE_ID_ANNOTATION)
                .cloned()
        })
        .await;
        assert_eq!(stamped, spiffe_id(&ns, &sa), "{kind}");
        // A CronJob's Pods carry its name as their app label (its Job's template is its own).
        let pod = running_pods(&s, &ns, &name(kind), 1).await.remove(0);
        let lines = holding(stack, &pod, &[&stamped]).await;
        let svids = reports::svid_sets(&lines);
        assert_eq!(
            svids.last().expect("an SVID set")[0].spiffe_id,
            stamped,
            "{kind}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn each_pod_holds_the_svid_its_deployment_was_annotated_with() {
    let bed = bed();
    let stack = bed.stack;
    let (s, _, ns) = world(stack).await;
    run_workload(stack, &ns, "web", "api", 2);

    // Stamped at admission (or backfilled, while a failover test restarts the webhook).
    let stamped = eventually("the spiffe-id annotation", SVID_WAIT, || async {
        let d = s.deployments(&ns).get("web").await.ok()?;
        annotation(&d, SPIFFE_ID_ANNOTATION).map(str::to_string)
    })
    .await;
    assert_eq!(stamped, spiffe_id(&ns, "api"));
    for pod in running_pods(&s, &ns, "web", 2).await {
        let lines = holding(stack, &pod, &[&stamped]).await;
        let svids = reports::svid_sets(&lines);
        let svid = &svids.last().expect("an SVID set")[0];
        assert_eq!(svid.spiffe_id, stamped);
        assert_eq!(
            svid.dns_names.as_deref(),
            Some(&[format!("api.{ns}.svc")][..]),
            "the policy's DNS names"
        );
        let jwt = report_until(stack, &pod, "a JWT-SVID", |lines| {
            lines.iter().any(|l| matches!(l, Line::Jwt { .. }))
        })
        .await;
        let (jwt_id, audience) = jwt
            .iter()
            .find_map(|l| match l {
                Line::Jwt {
                    spiffe_id,
                    audience,
                    ..
                } => Some((spiffe_id.clone(), audience.clone())),
                _ => None,
            })
            .expect("found above");
        assert_eq!(jwt_id, stamped);
        assert_eq!(audience, ["registrar-bed"]);
    }

    // From SPIRE's side: the entry hangs from our node alias, which the agent's k8s_psat
    // attestation matches.
    let alias_id = format!("spiffe://{TD}/spiffe-registrar/k8s-psat/{PSAT_CLUSTER}");
    let entries = stack.spire_server.entries_for(&stamped);
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(
        entries[0]["parent_id"]["path"],
        format!("/spiffe-registrar/k8s-psat/{PSAT_CLUSTER}")
    );
    let alias = stack.spire_server.entries_for(&alias_id);
    assert_eq!(alias.len(), 1, "{alias:?}");
    assert_eq!(alias[0]["selectors"][0]["type"], "k8s_psat");
    assert_eq!(
        alias[0]["selectors"][0]["value"],
        format!("cluster:{PSAT_CLUSTER}")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_outside_every_policy_gets_no_identity() {
    let bed = bed();
    let stack = bed.stack;
    let (s, _, _) = world(stack).await;
    // Not opted in, though its labels match the policy.
    let off = unique(&s.tag);
    create_namespace_with(&s.client, &off, false, &[("e2e/test", &s.tag)]).await;
    run_workload(stack, &off, "web", "api", 1);
    // Opted in, but no policy selects it.
    let uncovered = unique(&s.tag);
    create_namespace_with(&s.client, &uncovered, true, &[("e2e/test", "nobody")]).await;
    run_workload(stack, &uncovered, "web", "api", 1);

    for ns in [&off, &uncovered] {
        let pod = running_pods(&s, ns, "web", 1).await.remove(0);
        never_identified(stack, &pod).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_running_pod_keeps_an_identity_through_ttl_and_template_edits() {
    let bed = bed();
    let stack = bed.stack;
    let (s, policy, ns) = world(stack).await;
    let pod = one_pod(stack, &s, &ns, "web", "api").await;
    let first = spiffe_id(&ns, "api");
    holding(stack, &pod, &[&first]).await;

    // A TTL edit updates the entry in place: the next SVID carries the new lifetime.
    let before = reports::svid_sets(&reports::read(&stack.node().1.reports, &pod)).len();
    s.patch_policy(&policy, json!({ "spec": { "ttl": "2h" } }))
        .await;
    report_until(stack, &pod, "an SVID with the new TTL", |lines| {
        let sets = reports::svid_sets(lines);
        sets.len() > before
            && sets.last().is_some_and(|set| {
                set.iter().any(|svid| {
                    svid.spiffe_id == first
                        && svid.not_after_ms - at_ms_of_last_set(lines) > 90 * 60 * 1000
                })
            })
    })
    .await;

    // A template edit is a new identity: made before the old one is broken.
    let second = format!("spiffe://{TD}/v2/ns/{ns}/sa/api");
    s.patch_policy(
        &policy,
        json!({ "spec": { "spiffeIDTemplate": "spiffe://{trustDomain}/v2/ns/{namespace}/sa/{serviceAccount}" } }),
    )
    .await;
    let lines = holding(stack, &pod, &[&second]).await;
    assert_eq!(
        reports::seconds_without_identity_after_first(&lines),
        0,
        "the workload was never without an SVID: {lines:?}"
    );
    let d = s.deployments(&ns).get("web").await.expect("the Deployment");
    assert_eq!(annotation(&d, SPIFFE_ID_ANNOTATION), Some(second.as_str()));
}

/// When the last SVID set in `lines` arrived.
fn at_ms_of_last_set(lines: &[Line]) -> i64 {
    lines
        .iter()
        .rev()
        .find_map(|line| match line {
            Line::Svids { at_ms, .. } => Some(*at_ms),
            _ => None,
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_service_account_change_moves_new_pods_to_the_new_identity_without_a_gap() {
    let bed = bed();
    let stack = bed.stack;
    let (s, _, ns) = world(stack).await;
    let old_pod = one_pod(stack, &s, &ns, "web", "api").await;
    holding(stack, &old_pod, &[&spiffe_id(&ns, "api")]).await;

    s.deployments(&ns)
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "spec": { "template": { "spec": { "serviceAccountName": "api-v2" } } } }),
            ),
        )
        .await
        .expect("service account change");
    let new_pod = eventually("the rolled-out Pod", SVID_WAIT, || async {
        let pods = running_pods(&s, &ns, "web", 1).await;
        (pods[0] != old_pod).then(|| pods[0].clone())
    })
    .await;
    let lines = holding(stack, &new_pod, &[&spiffe_id(&ns, "api-v2")]).await;
    assert_eq!(reports::seconds_without_identity_after_first(&lines), 0);
    let old = reports::read(&stack.node().1.reports, &old_pod);
    assert_eq!(
        reports::seconds_without_identity_after_first(&old),
        0,
        "the old Pod held its identity until it stopped: {old:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_last_deployment_of_a_service_account_takes_its_identity_with_it() {
    let bed = bed();
    let stack = bed.stack;
    let (s, _, ns) = world(stack).await;
    let id = spiffe_id(&ns, "shared");
    run_workload(stack, &ns, "one", "shared", 1);
    run_workload(stack, &ns, "two", "shared", 1);
    let survivor = running_pods(&s, &ns, "two", 1).await.remove(0);
    holding(stack, &survivor, &[&id]).await;

    s.delete_deployment(&ns, "one").await;
    // The entry outlives the first Deployment: the other still needs it.
    let seen = reports::seconds(&reports::read(&stack.node().1.reports, &survivor)).len();
    let lines = report_until(stack, &survivor, "five more seconds", |lines| {
        reports::seconds(lines).len() >= seen + 5
    })
    .await;
    assert_eq!(reports::seconds_without_identity_after_first(&lines), 0);
    assert_eq!(reports::holding_now(&lines), std::slice::from_ref(&id));
    assert_eq!(stack.spire_server.entries_for(&id).len(), 1);

    s.delete_deployment(&ns, "two").await;
    stack.spire_server.wait_none_for(&id).await;
    // A new Pod of that service account finds no identity.
    let (node, agent) = stack.node();
    let bare = bare_pod(
        &ns,
        "late",
        "shared",
        &agent.reports,
        &node.dir.join("agent-sockets"),
    );
    apply(&stack.kube, &bare);
    identity_withdrawn(stack, "late").await;
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &ns);
    let _ = pods.delete("late", &DeleteParams::default()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_leader_failover_costs_a_running_pod_nothing_and_the_new_leader_registers() {
    let bed = bed();
    let stack = bed.stack;
    let (s, _, ns) = world(stack).await;
    let pod = one_pod(stack, &s, &ns, "before", "api").await;
    let id = spiffe_id(&ns, "api");
    holding(stack, &pod, &[&id]).await;

    let leader = eventually("a leader", SVID_WAIT, || lease_holder(&s.client)).await;
    assert_eq!(leader, LEADER, "the replica without the webhook leads");
    let (name, mut killed) = {
        let mut registrars = bed.registrars.lock().expect("not poisoned");
        let index = registrars
            .iter()
            .position(|(name, _)| *name == leader)
            .expect("the leader is one of the bed's replicas");
        registrars.remove(index)
    };
    killed.process.kill();
    eventually("the other replica to lead", SVID_WAIT, || async {
        lease_holder(&s.client)
            .await
            .filter(|holder| *holder != leader)
    })
    .await;

    // The new leader registers what arrives after the failover.
    let late = one_pod(stack, &s, &ns, "after", "api-v2").await;
    holding(stack, &late, &[&spiffe_id(&ns, "api-v2")]).await;
    let lines = reports::read(&stack.node().1.reports, &pod);
    assert_eq!(
        reports::seconds_without_identity_after_first(&lines),
        0,
        "the running Pod never noticed the failover: {lines:?}"
    );
    assert_eq!(reports::holding_now(&lines), [id]);

    // Back to two replicas.
    let restarted = tokio::task::block_in_place(|| replica(stack, free_port(), &name));
    bed.registrars
        .lock()
        .expect("not poisoned")
        .push((name, restarted));
}

/// The apply-to-SVID benchmark (`--example apply-to-svid`) at a few Deployments, so it cannot
/// rot: every Deployment's Pod holds its SVID, after its entry exists and its workload runs.
#[tokio::test(flavor = "multi_thread")]
async fn the_apply_to_svid_benchmark_measures_every_deployment() {
    let bed = bed();
    let stack = bed.stack;
    let (_, _, ns) = world(stack).await;
    let timings = common::apply_to_svid::measure(
        stack,
        &ns,
        "spiffe-registrar/wl",
        3,
        Duration::from_millis(200),
    )
    .await;
    assert_eq!(timings.len(), 3);
    for timing in &timings {
        assert!(
            timing.svid_ms >= timing.entry_ms && timing.svid_ms >= timing.workload_started_ms,
            "an SVID cannot precede its entry or its workload: {timing:?}"
        );
        assert!(timing.agent_ms() >= 0);
    }
    let summary = common::apply_to_svid::summary(&timings);
    assert_eq!(summary["deployments"], 3);
}
