//! The controller end to end: the real registrar binary (webhook and controller) against the
//! real kube-apiserver and spire-server. SPIRE's state is read with the spire-server CLI, not
//! with our client; the helpers live in `common::world`.
//!
//! Most scenarios share one stack and one registrar; each uses its own namespaces and its own
//! policy (selecting only namespaces labelled `e2e/test=<tag>`). Scenarios that stop SPIRE,
//! run two replicas or crash the registrar get a stack of their own.

mod common;

use common::k8s::{annotation, deployment, eventually, has_finalizer};
use common::registrar::Registrar;
use common::stack::Stack;
use common::world::{
    InSuite, Scenario, Suite, TD, WAIT, entry_id, entry_id_of, flags, launch, lease_holder,
    options, own_plane, spiffe_id,
};
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use spiffe_registrar::names::{ENTRY_ID_ANNOTATION, SPIFFE_ID_ANNOTATION};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Short resync and graces, fast failover.
const FLAGS: &[&str] = &[
    "--resync-interval=10s",
    "--lease-duration=8s",
    "--renew-deadline=3s",
    "--lease-retry-period=1s",
    "--spire-rps=0",
    "--scope-loss-grace=2s",
    "--transition-grace=2s",
];

static SUITE: OnceLock<Suite> = OnceLock::new();

/// The shared stack with CRD, webhook configuration and one registrar (cluster `e2e`).
fn suite() -> InSuite {
    Suite::get(&SUITE, || options("e2e", "registrar", flags(FLAGS, &[])))
}

/// A registrar of cluster `cluster` on `stack` with the suite's flags and `env`.
fn replica(
    stack: &Stack,
    port: Option<u16>,
    cluster: &'static str,
    name: &'static str,
    env: &[(&str, &str)],
) -> Registrar {
    let mut options = options(cluster, name, flags(FLAGS, &[]));
    options.extra_env = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    launch(stack, port, options)
}

/// A scenario with its default policy, on `stack`.
async fn scenario(stack: &Stack) -> (Scenario, String) {
    let s = Scenario::new(&stack.kube).await;
    let policy = s.default_policy().await;
    (s, policy)
}

/// Waits until Deployment `ns/name` satisfies `pred`.
async fn deployment_until(
    s: &Scenario,
    ns: &str,
    name: &str,
    what: &str,
    pred: impl Fn(&k8s_openapi::api::apps::v1::Deployment) -> bool,
) {
    let api = s.deployments(ns);
    eventually(what, WAIT, || async {
        let d = api.get_opt(name).await.ok()??;
        pred(&d).then_some(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn deployment_is_registered_with_policy_selectors_parent_and_ttl() {
    let bed = suite();
    let (s, policy) = scenario(bed.stack).await;
    let ns = s.namespace(true).await;
    let recorded = s.registered(&ns, "web", "api").await;

    let entries = bed.stack.spire_server.entries_for(&spiffe_id(&ns, "api"));
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = &entries[0];
    assert_eq!(entry_id(entry), recorded);
    assert!(recorded.starts_with("sreg.e2e."));
    assert_eq!(entry["parent_id"]["path"], format!("/k8s/{}/p", s.tag));
    assert_eq!(entry["x509_svid_ttl"], 3600);
    assert_eq!(entry["hint"], "spiffe-registrar/e2e");
    let mut selectors: Vec<String> = entry["selectors"]
        .as_array()
        .expect("selectors")
        .iter()
        .map(|s| {
            format!(
                "{}:{}",
                s["type"].as_str().unwrap_or(""),
                s["value"].as_str().unwrap_or("")
            )
        })
        .collect();
    selectors.sort();
    assert_eq!(
        selectors,
        [format!("k8s:ns:{ns}"), "k8s:sa:api".to_string()]
    );

    let stored = s.deployments(&ns).get("web").await.expect("get");
    assert!(has_finalizer(&stored));
    assert_eq!(
        annotation(&stored, SPIFFE_ID_ANNOTATION),
        Some(spiffe_id(&ns, "api").as_str())
    );
    s.event(&ns, "web", "Registered").await;
    let status = eventually("policy status", WAIT, || async {
        let p = s.policies().get(&policy).await.ok()?;
        p.status
            .filter(|st| st.selected_workloads == 1 && st.entries == 1)
    })
    .await;
    assert_eq!(status.conditions[0].status, "True");
}

// Any name Kubernetes accepts gets an identity (DESIGN invariant 1: the ID comes from
// policy): a dotted service account cannot fill a one-label DNS name template, so its entry is
// made without that name, with a Warning on the Deployment and a condition on the policy.
#[tokio::test(flavor = "multi_thread")]
async fn a_dotted_service_account_gets_its_identity_without_the_dns_name_it_cannot_fill() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    let mut spec = s.spec("p");
    spec["dnsNames"] = json!(["{serviceAccount}.{namespace}.svc", "{namespace}.svc"]);
    let policy = s.policy("p", spec).await;
    let ns = s.namespace(true).await;
    let recorded = s.registered(&ns, "web", "a.b-c").await;

    let entries = bed.stack.spire_server.entries_for(&spiffe_id(&ns, "a.b-c"));
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entry_id(&entries[0]), recorded);
    assert_eq!(entries[0]["dns_names"], json!([format!("{ns}.svc")]));
    let stored = s.deployments(&ns).get("web").await.expect("get");
    assert_eq!(
        annotation(&stored, SPIFFE_ID_ANNOTATION),
        Some(spiffe_id(&ns, "a.b-c").as_str())
    );
    let warning = s.event(&ns, "web", "DNSNameOmitted").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    assert!(
        warning
            .message
            .as_deref()
            .is_some_and(|m| m.contains("a.b-c")),
        "{warning:?}"
    );
    let dns = s
        .condition(&policy, "DNSNames", |c| c.status == "False")
        .await;
    assert_eq!(dns.reason, "DNSNameOmitted");
    s.condition(&policy, "Ready", |c| c.status == "True").await;
}

/// Bare Pods are registered only with `--bare-pods` (off here, as by default): a Pod of an
/// opted-in namespace that no controller owns gets no entry and no annotation.
#[tokio::test(flavor = "multi_thread")]
async fn a_bare_pod_gets_no_identity_without_the_flag() {
    let bed = suite();
    let (s, _) = scenario(bed.stack).await;
    let ns = s.namespace(true).await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(s.client.clone(), &ns);
    let pod = serde_json::from_value(json!({
        "metadata": { "name": "solo" },
        "spec": { "serviceAccountName": "solo", "containers": [{ "name": "app", "image": "registry.invalid/app:1" }] }
    }))
    .expect("Pod JSON");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create");
    // A Deployment created after it is registered: the controller has seen the namespace.
    s.registered(&ns, "web", "other").await;
    bed.registrar.wait_syncs(bed.registrar.syncs(), 2.0).await;
    assert!(
        bed.stack
            .spire_server
            .entries_for(&spiffe_id(&ns, "solo"))
            .is_empty()
    );
    let pod = pods.get("solo").await.expect("get");
    let ours = pod
        .metadata
        .annotations
        .unwrap_or_default()
        .into_keys()
        .filter(|k| k.starts_with("registrar.spiffe.io/"))
        .collect::<Vec<_>>();
    assert!(ours.is_empty(), "{ours:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn shared_service_account_shares_one_refcounted_entry() {
    let bed = suite();
    let (s, _) = scenario(bed.stack).await;
    let ns = s.namespace(true).await;
    let one = s.registered(&ns, "one", "shared").await;
    let two = s.registered(&ns, "two", "shared").await;
    assert_eq!(one, two, "one entry for one service account");
    let id = spiffe_id(&ns, "shared");
    assert_eq!(bed.stack.spire_server.entries_for(&id).len(), 1);

    s.delete_deployment(&ns, "one").await;
    let left = bed.stack.spire_server.entries_for(&id);
    assert_eq!(left.len(), 1, "the sibling still needs the entry");
    assert_eq!(entry_id(&left[0]), one);

    s.delete_deployment(&ns, "two").await;
    assert!(
        bed.stack.spire_server.entries_for(&id).is_empty(),
        "the entry went with the last Deployment"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn policy_ttl_change_updates_the_entry_in_place() {
    let bed = suite();
    let (s, policy) = scenario(bed.stack).await;
    let ns = s.namespace(true).await;
    let before = s.registered(&ns, "web", "default").await;
    s.patch_policy(&policy, json!({ "spec": { "ttl": "15m", "jwtTtl": "5m" } }))
        .await;
    let id = spiffe_id(&ns, "default");
    let entry = eventually("the TTL update", WAIT, || async {
        let entries = bed.stack.spire_server.entries_for(&id);
        assert_eq!(
            entries.len(),
            1,
            "never two entries, never none: {entries:?}"
        );
        entries.into_iter().find(|e| e["x509_svid_ttl"] == 900)
    })
    .await;
    assert_eq!(entry_id(&entry), before, "updated in place, same ID");
    assert_eq!(entry["jwt_svid_ttl"], 300);
}

#[tokio::test(flavor = "multi_thread")]
async fn entry_deleted_by_hand_is_recreated_within_a_resync() {
    let bed = suite();
    let (s, _) = scenario(bed.stack).await;
    let ns = s.namespace(true).await;
    let recorded = s.registered(&ns, "web", "default").await;
    let spire = &bed.stack.spire_server;
    spire.cli_ok(&["entry", "delete"], &["-entryID", &recorded]);
    let id = spiffe_id(&ns, "default");
    assert!(spire.entries_for(&id).is_empty());
    // Resync is 10 s; allow two.
    let entry = eventually(
        "the entry to come back",
        Duration::from_secs(25),
        || async { spire.entries_for(&id).into_iter().next() },
    )
    .await;
    assert_eq!(entry_id(&entry), recorded, "same deterministic ID");
}

#[tokio::test(flavor = "multi_thread")]
async fn namespace_label_removed_deletes_entries_and_releases_finalizers() {
    let bed = suite();
    let (s, _) = scenario(bed.stack).await;
    let ns = s.namespace(true).await;
    s.registered(&ns, "web", "default").await;
    let unlabel = json!({ "metadata": { "labels": { "spiffe.io/registrar": null } } });
    Api::<Namespace>::all(s.client.clone())
        .patch(&ns, &PatchParams::default(), &Patch::Merge(&unlabel))
        .await
        .expect("unlabel");
    bed.stack
        .spire_server
        .wait_none_for(&spiffe_id(&ns, "default"))
        .await;
    deployment_until(
        &s,
        &ns,
        "web",
        "our finalizer and annotations removed",
        |d| {
            !has_finalizer(d)
                && annotation(d, ENTRY_ID_ANNOTATION).is_none()
                && annotation(d, SPIFFE_ID_ANNOTATION).is_none()
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn policy_deleted_deletes_entries_and_releases_finalizers() {
    let bed = suite();
    let (s, policy) = scenario(bed.stack).await;
    let ns = s.namespace(true).await;
    s.registered(&ns, "web", "default").await;
    s.policies()
        .delete(&policy, &DeleteParams::default())
        .await
        .expect("policy delete");
    bed.stack
        .spire_server
        .wait_none_for(&spiffe_id(&ns, "default"))
        .await;
    deployment_until(&s, &ns, "web", "finalizer removed", |d| !has_finalizer(d)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn without_the_webhook_the_controller_backfills_then_registers() {
    let bed = suite();
    let (s, _) = scenario(bed.stack).await;
    let ns = s.namespace(false).await;
    let api = s.deployments(&ns);
    let created = api
        .create(&PostParams::default(), &deployment("web", Some("api")))
        .await
        .expect("create");
    assert!(
        !has_finalizer(&created),
        "the webhook is not called for this namespace"
    );
    let recorded = entry_id_of(&api, "web").await;
    let stored = api.get("web").await.expect("get");
    assert!(has_finalizer(&stored), "finalizer backfilled");
    assert_eq!(
        annotation(&stored, SPIFFE_ID_ANNOTATION),
        Some(spiffe_id(&ns, "api").as_str())
    );
    let entries = bed.stack.spire_server.entries_for(&spiffe_id(&ns, "api"));
    assert_eq!(entry_id(&entries[0]), recorded);
}

#[tokio::test(flavor = "multi_thread")]
async fn another_writers_entries_survive_every_gc() {
    let bed = suite();
    let (s, _) = scenario(bed.stack).await;
    let ns = s.namespace(true).await;
    let spire = &bed.stack.spire_server;
    // Same parent and namespace as ours, no hint: one for another service account, and one
    // exactly equal to what our Deployment `clashing` needs, written first by someone else.
    let (theirs, clash) = (spiffe_id(&ns, "theirs"), spiffe_id(&ns, "clash"));
    for (id, sa) in [(&theirs, "theirs"), (&clash, "clash")] {
        let (parent, ns_selector) = (s.parent("p"), format!("k8s:ns:{ns}"));
        let sa_selector = format!("k8s:sa:{sa}");
        spire.cli_ok(
            &["entry", "create"],
            &[
                "-parentID",
                &parent,
                "-spiffeID",
                id,
                "-selector",
                &ns_selector,
                "-selector",
                &sa_selector,
            ],
        );
    }
    s.registered(&ns, "web", "default").await;
    s.deployments(&ns)
        .create(
            &PostParams::default(),
            &deployment("clashing", Some("clash")),
        )
        .await
        .expect("create");
    s.event(&ns, "clashing", "EquivalentEntryExists").await;
    s.delete_deployment(&ns, "web").await;
    s.delete_deployment(&ns, "clashing").await;

    // Through two full resyncs (each a SPIRE list, then a completed sync), theirs never go.
    let registrar = &bed.registrar;
    for round in 1..=2 {
        let lists = registrar.spire_list_calls();
        let listed_at_sync = std::cell::Cell::new(None);
        eventually(&format!("resync {round} to complete"), WAIT, || async {
            assert_eq!(spire.entries_for(&theirs).len(), 1, "their entry survives");
            assert_eq!(
                spire.entries_for(&clash).len(),
                1,
                "their equivalent entry is neither adopted nor deleted"
            );
            match listed_at_sync.get() {
                None if registrar.spire_list_calls() > lists => {
                    listed_at_sync.set(Some(registrar.syncs()))
                }
                Some(started) if registrar.syncs() > started => return Some(()),
                _ => {}
            }
            None
        })
        .await;
    }
    assert!(spire.entries_for(&spiffe_id(&ns, "default")).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_policy_reports_a_condition_and_an_event_and_registers_nothing() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    // Passes the CRD's pattern, fails SPIFFE ID rules ('..' segment).
    let mut spec = s.spec("p");
    spec["parentID"] = format!("spiffe://{TD}/k8s/..").into();
    let policy = s.policy("p", spec).await;
    let ns = s.namespace(true).await;
    let api = s.deployments(&ns);
    api.create(&PostParams::default(), &deployment("web", None))
        .await
        .expect("create");
    let condition = s.condition(&policy, "Ready", |c| c.status == "False").await;
    assert_eq!(condition.reason, "InvalidParentID");
    assert!(
        condition.message.contains("parentID"),
        "{}",
        condition.message
    );
    s.event("default", &policy, "InvalidParentID").await;
    s.event(&ns, "web", "RegistrationFailed").await;
    assert!(
        bed.stack
            .spire_server
            .entries_for(&spiffe_id(&ns, "default"))
            .is_empty()
    );
    let stored = api.get("web").await.expect("get");
    assert_eq!(annotation(&stored, ENTRY_ID_ANNOTATION), None);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_spire_down_deletion_waits_then_completes() {
    let (mut stack, port) = own_plane();
    let registrar = replica(&stack, Some(port), "down", "registrar", &[]);
    let (s, _) = scenario(&stack).await;
    let ns = s.namespace(true).await;
    s.registered(&ns, "web", "default").await;

    stack.spire_server.stop();
    let api = s.deployments(&ns);
    api.delete("web", &DeleteParams::default())
        .await
        .expect("delete");
    // Several failed attempts while SPIRE is down; the Deployment waits, Terminating, all along.
    let failed = registrar.failed_spire_calls();
    eventually("three failed SPIRE calls", WAIT, || async {
        let held = api.get("web").await.expect("still there");
        assert!(
            held.metadata.deletion_timestamp.is_some() && has_finalizer(&held),
            "Terminating while SPIRE is down"
        );
        (registrar.failed_spire_calls() >= failed + 3.0).then_some(())
    })
    .await;

    tokio::task::block_in_place(|| stack.spire_server.restart());
    stack.record_groups();
    common::world::gone(&api, "web").await;
    assert!(
        stack
            .spire_server
            .entries_for(&spiffe_id(&ns, "default"))
            .is_empty()
    );
    drop(registrar);
    tokio::task::block_in_place(|| stack.stop());
}

#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_one_writer_and_failover() {
    let (mut stack, port) = own_plane();
    let a = replica(&stack, Some(port), "ha", "replica-a", &[]);
    let b = replica(&stack, None, "ha", "replica-b", &[]);
    let (s, _) = scenario(&stack).await;
    // The webhook configuration points at replica-a, which may be killed: use a namespace the
    // webhook skips, so only the controllers act.
    let ns = s.namespace(false).await;
    let api = s.deployments(&ns);
    api.create(&PostParams::default(), &deployment("before", None))
        .await
        .expect("create");
    entry_id_of(&api, "before").await;
    let leader = lease_holder(&s.client).await.expect("a holder");
    // SPIRE writes, from each replica's metrics (creates, updates, deletes; not lists).
    let writes = |r: &Registrar| {
        ["create", "update", "delete"]
            .iter()
            .map(|op| r.metric("spire_api_entries_total", &[("op", op)]))
            .sum::<f64>()
    };
    let (writes_a, writes_b) = (writes(&a), writes(&b));
    assert!(
        (writes_a > 0.0) != (writes_b > 0.0),
        "exactly one replica writes (a: {writes_a}, b: {writes_b}, lease holder: {leader})"
    );
    let (mut old_leader, survivor) = if writes_a > 0.0 { (a, b) } else { (b, a) };
    assert_eq!(leader, old_leader.process.name);
    old_leader.process.kill();
    api.create(&PostParams::default(), &deployment("after", Some("late")))
        .await
        .expect("create");
    entry_id_of(&api, "after").await;
    assert_eq!(
        lease_holder(&s.client).await,
        Some(survivor.process.name.clone()),
        "the other replica took the Lease"
    );
    assert!(writes(&survivor) > 0.0, "and wrote");
    drop(survivor);
    tokio::task::block_in_place(|| stack.stop());
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_between_create_and_annotate_leaves_no_duplicate() {
    let (mut stack, port) = own_plane();
    let failpoint = [("SPIFFE_REGISTRAR_FAILPOINT", "pause-after-create")];
    let mut crashing = replica(&stack, Some(port), "crash", "registrar", &failpoint);
    let (s, _) = scenario(&stack).await;
    let ns = s.namespace(true).await;
    let api = s.deployments(&ns);
    api.create(&PostParams::default(), &deployment("web", None))
        .await
        .expect("create");
    let id = spiffe_id(&ns, "default");
    eventually("the entry to be created", WAIT, || async {
        (!stack.spire_server.entries_for(&id).is_empty()).then_some(())
    })
    .await;
    crashing.process.kill();
    let stored = api.get("web").await.expect("get");
    assert_eq!(
        annotation(&stored, ENTRY_ID_ANNOTATION),
        None,
        "killed before annotating"
    );

    let restarted = replica(&stack, Some(port), "crash", "restarted", &[]);
    let recorded = entry_id_of(&api, "web").await;
    let entries = stack.spire_server.entries_for(&id);
    assert_eq!(
        entries.len(),
        1,
        "no duplicate after the crash: {entries:?}"
    );
    assert_eq!(entry_id(&entries[0]), recorded);
    drop(restarted);
    drop(crashing);
    tokio::task::block_in_place(|| stack.stop());
}

// Break-glass: a finalizer removed by hand (the registrar never sees the Deployment go through
// its finalizer); the orphaned entry is garbage-collected.
#[tokio::test(flavor = "multi_thread")]
async fn forcibly_removed_finalizer_orphans_are_garbage_collected() {
    let bed = suite();
    let (s, _) = scenario(bed.stack).await;
    let ns = s.namespace(true).await;
    let recorded = s.registered(&ns, "web", "default").await;
    let remove = json!([{ "op": "remove", "path": "/metadata/finalizers" }]);
    let remove = Patch::<()>::Json(serde_json::from_value(remove).expect("patch"));
    s.deployments(&ns)
        .patch("web", &PatchParams::default(), &remove)
        .await
        .expect("finalizer removal");
    s.delete_deployment(&ns, "web").await;
    let spire = &bed.stack.spire_server;
    spire.wait_none_for(&spiffe_id(&ns, "default")).await;
    assert!(spire.entries(&["-entryID", &recorded]).is_empty());
}

// `spiffe-registrar plan` shows what a sync would do and changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn plan_prints_the_changes_and_writes_nothing() {
    let bed = suite();
    let (s, _) = scenario(bed.stack).await;
    let ns = s.namespace(true).await;
    s.registered(&ns, "web", "default").await;
    // A cluster name with no entries yet: everything in scope is a create.
    let socket = format!("--spire-socket={}", bed.stack.spire_server.socket.display());
    let (ok, stdout, stderr) = tokio::task::block_in_place(|| {
        common::process::run(
            std::process::Command::new(common::registrar::binary())
                .env("KUBECONFIG", &bed.stack.kube.kubeconfig)
                .args(["plan", "--cluster-name=e2e-plan", &socket]),
        )
    });
    assert!(ok, "plan failed: {stderr}");
    let wanted = format!("{} (for {ns}/web)", spiffe_id(&ns, "default"));
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("create sreg.e2e-plan.") && l.ends_with(&wanted)),
        "{stdout}"
    );
    let hinted = bed
        .stack
        .spire_server
        .entries(&["-hint", "spiffe-registrar/e2e-plan"]);
    assert!(hinted.is_empty(), "plan wrote to SPIRE");
}

// A replica stopped with SIGTERM (a rollout, a drain) releases the Lease before exiting, and
// the other replica takes it within one lease duration. (kube-lease-manager's followers only
// look again when the lease they last saw would expire, so the handover is not instant.)
#[tokio::test(flavor = "multi_thread")]
async fn graceful_shutdown_releases_the_lease_for_the_other_replica() {
    let (mut stack, port) = own_plane();
    let handover = || flags(FLAGS, &["--lease-duration=10s", "--renew-deadline=5s"]);
    let mut first = launch(&stack, Some(port), options("handover", "first", handover()));
    let client = stack.kube.client().await;
    eventually("first to lead", WAIT, || async {
        (lease_holder(&client).await.as_deref() == Some("first")).then_some(())
    })
    .await;
    let second = launch(&stack, None, options("handover", "second", handover()));

    let stopped = Instant::now();
    tokio::task::block_in_place(|| first.process.stop(Duration::from_secs(15)));
    let after_exit = lease_holder(&client).await;
    assert!(
        matches!(after_exit.as_deref(), None | Some("second")),
        "the Lease is released on exit, not left to expire: held by {after_exit:?}"
    );
    eventually("second to take over", Duration::from_secs(20), || async {
        (lease_holder(&client).await.as_deref() == Some("second")).then_some(())
    })
    .await;
    // A Lease left to expire would keep `second` out for its whole 10 s after the last renewal.
    assert!(
        stopped.elapsed() < Duration::from_secs(8),
        "took over after {:?}",
        stopped.elapsed()
    );
    drop(second);
    tokio::task::block_in_place(|| stack.stop());
}
