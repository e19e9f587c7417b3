//! Identity transitions against the real kube-apiserver and spire-server: no edit,
//! typo, forged annotation or cluster rename may revoke or double an identity. Each test
//! samples SPIRE through the Entry API for the whole change (`common::sampler`) and asserts on
//! that history, plus what the apiserver shows (status, Events) and the registrar's metrics.
//!
//! Most tests share one stack and one registrar (short graces); those that need their own
//! flags or a second cluster start their own.

mod common;

use common::k8s::{annotation, deployment, eventually, has_finalizer};
use common::kube_plane::KubePlane;
use common::paths::free_port;
use common::registrar::Registrar;
use common::sampler::{Sa, Sampler, sa, spire_client};
use common::stack::Stack;
use common::world::{
    InSuite, Scenario, Suite, TD, WAIT, entry_id_of, events, flags, options, prepare,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use spiffe_registrar::names::{CRD_NAME, ENTRY_ID_ANNOTATION, SPIFFE_ID_ANNOTATION};
use spiffe_registrar::spire::Entry;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const TRANSITION_GRACE: Duration = Duration::from_secs(3);
const SCOPE_LOSS_GRACE: Duration = Duration::from_secs(8);
/// How far apart two samples of SPIRE may be (each sample is a few list calls).
const SAMPLING_SLACK: Duration = Duration::from_millis(400);

/// The suite's flags; a test's own flags override them.
const FLAGS: &[&str] = &[
    // Long: a resync forgets what SPIRE refused and asks once more, which two tests count.
    "--resync-interval=10m",
    // Fast failover; the renew deadline leaves the longest write (4 s) before expiry.
    "--lease-duration=8s",
    "--renew-deadline=3s",
    "--lease-retry-period=1s",
    "--spire-rps=0",
    "--transition-grace=3s",
    "--scope-loss-grace=8s",
    "--deletion-brake-count=1000",
];

static SUITE: OnceLock<Suite> = OnceLock::new();

/// The shared stack with CRD, webhook configuration and one registrar.
fn suite() -> InSuite {
    Suite::get(&SUITE, || options("tr", "registrar", flags(FLAGS, &[])))
}

/// A stack of its own with CRD and webhook configuration, and a registrar with `extra` flags.
fn own_stack(cluster: &str, extra: &[&str]) -> (Stack, Registrar, u16) {
    tokio::task::block_in_place(|| {
        let stack = Stack::start();
        let port = free_port();
        prepare(&stack.kube, port);
        let registrar = Registrar::start_on(
            &stack,
            port,
            options(cluster, "registrar", flags(FLAGS, extra)),
        );
        stack.track(registrar.process.pgid());
        (stack, registrar, port)
    })
}

/// The entries SPIRE holds for `who` right now (any writer).
async fn entries(socket: &Path, who: &Sa) -> Vec<Entry> {
    let mut client = spire_client(socket).await;
    common::sampler::entries_of(&mut client, who)
        .await
        .expect("SPIRE must answer")
}

/// Waits until SPIRE's entries for `who` satisfy `pred`; returns them.
async fn spire_until(
    socket: &Path,
    who: &Sa,
    what: &str,
    pred: impl Fn(&[Entry]) -> bool,
) -> Vec<Entry> {
    let what = format!("SPIRE: {what} for {}/{}", who.0, who.1);
    eventually(&what, WAIT, || async {
        let found = entries(socket, who).await;
        pred(&found).then_some(found)
    })
    .await
}

/// A harmless label change: labels are read by decisions (selectors), so the leader syncs
/// again (annotations of others, status and rollouts are ignored on purpose).
async fn poke(api: &Api<Deployment>, name: &str) {
    static POKES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = POKES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let patch = json!({ "metadata": { "labels": { "e2e/poke": n.to_string() } } });
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("poke");
}

/// Several syncs happen (driven by pokes), so "not repeated every sync" is observed.
async fn several_syncs(registrar: &Registrar, api: &Api<Deployment>, name: &str) {
    let before = registrar.syncs();
    for _ in 0..3 {
        poke(api, name).await;
        registrar.wait_syncs(registrar.syncs(), 1.0).await;
    }
    assert!(registrar.syncs() >= before + 3.0);
}

/// One line for the closing note: SPIRE calls a transition cost (exact with --test-threads=1;
/// with parallel tests on the shared registrar, an upper bound).
fn report_calls(registrar: &Registrar, before: f64, what: &str) {
    eprintln!(
        "TRANSITION {what}: SPIRE calls +{}",
        registrar.spire_calls() - before
    );
}

fn cluster_of(entry_id: &str) -> &str {
    entry_id.split('.').nth(1).expect("sreg.<cluster>.<hash>")
}

// Make-before-break (DESIGN invariant 3) on a parent change, with its cost in SPIRE calls.
#[tokio::test(flavor = "multi_thread")]
async fn a_parent_change_creates_the_new_entry_before_deleting_the_old() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    let p = s.policy("p", s.spec("v1")).await;
    let ns = s.namespace(true).await;
    let first = s.registered(&ns, "web", "api").await;
    let who = sa(&ns, "api");
    let calls = bed.registrar.spire_calls();
    let sampler = Sampler::start(bed.socket(), std::slice::from_ref(&who)).await;

    s.patch_policy(&p, json!({ "spec": { "parentID": s.parent("v2") } }))
        .await;
    let new = spire_until(bed.socket(), &who, "only the new entry", |e| {
        e.len() == 1 && e[0].id != first
    })
    .await;
    let second = new[0].id.clone();
    assert_eq!(new[0].parent_id, s.parent("v2"));
    let recorded = entry_id_of(&s.deployments(&ns), "web").await;
    let samples = sampler.stop().await;

    samples.report("policy parentID change", &who);
    samples.assert_never_missing(&who);
    assert_eq!(samples.ids(&who), vec![first.clone(), second.clone()]);
    let (new_seen, _) = samples.seen(&who, &second).expect("new entry seen");
    let (_, old_last) = samples.seen(&who, &first).expect("old entry seen");
    assert!(
        old_last + SAMPLING_SLACK >= new_seen + TRANSITION_GRACE,
        "the old entry outlived the new one's appearance by the grace: new at {new_seen:?}, old until {old_last:?}"
    );
    assert!(samples.longest_doubled(&who) < TRANSITION_GRACE + Duration::from_secs(5));
    let annotated = eventually("entry-id to follow", WAIT, || async {
        let id = entry_id_of(&s.deployments(&ns), "web").await;
        (id == second).then_some(id)
    })
    .await;
    assert!(recorded == first || recorded == second);
    assert_eq!(annotated, second);
    report_calls(&bed.registrar, calls, "policy parentID change");
}

// Make-before-break (invariant 3): a replacement SPIRE rejects never costs the old entry, and is
// not resent.
#[tokio::test(flavor = "multi_thread")]
async fn a_rejected_replacement_keeps_the_old_entry_and_says_why() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    let p = s.policy("p", s.spec("v1")).await;
    let ns = s.namespace(true).await;
    let first = s.registered(&ns, "web", "api").await;
    let who = sa(&ns, "api");
    let rejected = bed.registrar.metric("spire_entries_rejected_total", &[]);
    let calls = bed.registrar.spire_calls();
    let sampler = Sampler::start(bed.socket(), std::slice::from_ref(&who)).await;

    // A trust domain that is not the server's: the apiserver accepts it, SPIRE refuses.
    let patch = json!({ "spec": {
        "trustDomain": "elsewhere.org", "parentID": "spiffe://elsewhere.org/k8s/x"
    }});
    s.patch_policy(&p, patch).await;
    let ready = s
        .condition(&p, "Ready", |c| {
            c.status == "False" && c.reason == "RegistrationFailed"
        })
        .await;
    assert!(
        ready.message.contains("SPIRE rejected"),
        "{}",
        ready.message
    );
    s.event("default", &p, "RegistrationRejected").await;
    s.event(&ns, "web", "RegistrationFailed").await;
    let after = bed.registrar.metric("spire_entries_rejected_total", &[]);
    assert!(after > rejected, "the metric counts the rejection");
    // Each refusal is counted, so an unchanged count means the create was not sent again
    // (other tests share this registrar, so its create counter is not ours alone).
    several_syncs(&bed.registrar, &s.deployments(&ns), "web").await;
    assert_eq!(
        bed.registrar.metric("spire_entries_rejected_total", &[]),
        after,
        "not resent on every sync"
    );
    let samples = sampler.stop().await;
    samples.report("rejected replacement", &who);
    report_calls(
        &bed.registrar,
        calls,
        "rejected replacement (incl. 3 poked syncs)",
    );
    samples.assert_never_missing(&who);
    assert_eq!(samples.ids(&who), vec![first]);
}

// Make-before-break (invariant 3): a service account change moves the Deployment to a new entry.
#[tokio::test(flavor = "multi_thread")]
async fn a_service_account_change_is_make_before_break() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    s.policy("p", s.spec("v1")).await;
    let ns = s.namespace(true).await;
    let first = s.registered(&ns, "web", "one").await;
    let (one, two) = (sa(&ns, "one"), sa(&ns, "two"));
    let calls = bed.registrar.spire_calls();
    let sampler = Sampler::start(bed.socket(), &[one.clone(), two.clone()]).await;

    let patch = json!({ "spec": { "template": { "spec": { "serviceAccountName": "two" } } } });
    s.deployments(&ns)
        .patch("web", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("patch");
    let new = spire_until(bed.socket(), &two, "the new entry", |e| e.len() == 1).await;
    spire_until(
        bed.socket(),
        &one,
        "the old entry gone",
        <[Entry]>::is_empty,
    )
    .await;
    let samples = sampler.stop().await;

    samples.report("service account change (old service account)", &one);
    samples.report("service account change (new service account)", &two);
    report_calls(&bed.registrar, calls, "service account change");
    samples.assert_always_one_of(&[one.clone(), two.clone()]);
    let (new_seen, _) = samples.seen(&two, &new[0].id).expect("new entry seen");
    let (_, old_last) = samples.seen(&one, &first).expect("old entry seen");
    assert!(
        old_last + SAMPLING_SLACK >= new_seen + TRANSITION_GRACE,
        "new at {new_seen:?}, old until {old_last:?}"
    );
}

// Doubt holds (invariant 4): a typo fails at apply; an unrenderable policy holds what it had.
#[tokio::test(flavor = "multi_thread")]
async fn selector_typos_fail_at_apply_and_an_invalid_policy_holds_its_entries() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    for (expression, expect) in [
        (
            json!({ "key": "app", "operator": "Equal", "values": ["web"] }),
            "operator",
        ),
        (
            json!({ "key": "app", "operator": "In" }),
            "need at least one value",
        ),
        (
            json!({ "key": "app", "operator": "Exists", "values": ["x"] }),
            "take none",
        ),
    ] {
        let mut spec = s.spec("x");
        spec["deploymentSelector"] = json!({ "matchExpressions": [expression] });
        let error = s
            .try_policy("typo", spec)
            .await
            .expect_err("the apiserver must refuse the selector");
        assert!(error.to_string().contains(expect), "{error}");
    }

    let p = s.policy("p", s.spec("v1")).await;
    let ns = s.namespace(true).await;
    let first = s.registered(&ns, "web", "api").await;
    let who = sa(&ns, "api");
    let calls = bed.registrar.spire_calls();
    let sampler = Sampler::start(bed.socket(), std::slice::from_ref(&who)).await;
    // Passes the CRD's pattern, fails SPIFFE ID rules ('..' segment).
    let broken = format!("spiffe://{TD}/k8s/{}/..", s.tag);
    s.patch_policy(&p, json!({ "spec": { "parentID": broken } }))
        .await;
    let ready = s
        .condition(&p, "Ready", |c| {
            c.status == "False" && c.reason == "InvalidParentID"
        })
        .await;
    assert!(ready.message.contains("parentID"), "{}", ready.message);
    s.event("default", &p, "InvalidParentID").await;
    s.event(&ns, "web", "RegistrationFailed").await;
    several_syncs(&bed.registrar, &s.deployments(&ns), "web").await;
    let samples = sampler.stop().await;
    samples.report("invalid policy (held)", &who);
    report_calls(
        &bed.registrar,
        calls,
        "invalid policy (incl. 3 poked syncs)",
    );
    samples.assert_never_missing(&who);
    assert_eq!(samples.revisions(&who).len(), 1, "held untouched");
    assert_eq!(samples.ids(&who), vec![first]);
}

async fn set_opt_in(s: &Scenario, ns: &str, on: bool) {
    let value = if on { json!("enabled") } else { json!(null) };
    let patch = json!({ "metadata": { "labels": { "spiffe.io/registrar": value } } });
    Api::<Namespace>::all(s.client.clone())
        .patch(ns, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("namespace label");
}

async fn pending_deletions(s: &Scenario, policy: &str, want: u32) {
    eventually(
        &format!("{policy} to report {want} pending deletions"),
        WAIT,
        || async {
            let p = s.policies().get(policy).await.ok()?;
            (p.status?.pending_deletions == want).then_some(())
        },
    )
    .await
}

// Bounded, visible graces (invariant 2): scope loss waits for its grace; coming back costs nothing; deletion stays immediate.
#[tokio::test(flavor = "multi_thread")]
async fn scope_loss_waits_for_its_grace_and_coming_back_costs_nothing() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    let p = s.policy("p", s.spec("v1")).await;
    let ns = s.namespace(true).await;
    let first = s.registered(&ns, "web", "api").await;
    let who = sa(&ns, "api");
    let calls = bed.registrar.spire_calls();
    let sampler = Sampler::start(bed.socket(), std::slice::from_ref(&who)).await;

    set_opt_in(&s, &ns, false).await;
    pending_deletions(&s, &p, 1).await;
    s.event(&ns, "web", "DeregistrationPending").await;
    assert!(
        bed.registrar
            .metric("entry_deletions_pending", &[("reason", "scope_loss")])
            >= 1.0
    );
    set_opt_in(&s, &ns, true).await;
    pending_deletions(&s, &p, 0).await;
    let samples = sampler.stop().await;
    samples.report(
        "namespace label removed and restored within the grace",
        &who,
    );
    samples.assert_never_missing(&who);
    assert_eq!(samples.revisions(&who).len(), 1, "no churn at all");
    assert_eq!(samples.ids(&who), vec![first.clone()]);
    report_calls(
        &bed.registrar,
        calls,
        "namespace label removed and restored",
    );

    let lost_at = Instant::now();
    set_opt_in(&s, &ns, false).await;
    spire_until(bed.socket(), &who, "the entry deleted", <[Entry]>::is_empty).await;
    assert!(
        lost_at.elapsed() + Duration::from_millis(500) >= SCOPE_LOSS_GRACE,
        "deleted after {:?}, before the grace",
        lost_at.elapsed()
    );
    let released = eventually("finalizer and annotations removed", WAIT, || async {
        let d = s.deployments(&ns).get("web").await.ok()?;
        (!has_finalizer(&d) && annotation(&d, ENTRY_ID_ANNOTATION).is_none()).then_some(d)
    })
    .await;
    assert_eq!(annotation(&released, SPIFFE_ID_ANNOTATION), None);

    // Deleting a Deployment is not a scope loss: its entry goes at once.
    let other = s.namespace(true).await;
    s.registered(&other, "web", "api").await;
    let deleted_at = Instant::now();
    s.delete_deployment(&other, "web").await;
    assert!(entries(bed.socket(), &sa(&other, "api")).await.is_empty());
    assert!(
        deleted_at.elapsed() < SCOPE_LOSS_GRACE,
        "took {:?}",
        deleted_at.elapsed()
    );
}

// Bounded, visible graces (invariant 2): mass scope loss waits for the documented confirmation.
#[tokio::test(flavor = "multi_thread")]
async fn the_deletion_brake_holds_mass_scope_loss_until_an_operator_confirms() {
    let (mut stack, registrar, _) = own_stack(
        "brake",
        &[
            "--scope-loss-grace=1s",
            "--deletion-brake-count=2",
            "--deletion-brake-fraction=0.5",
        ],
    );
    let socket = stack.spire_server.socket.clone();
    let s = Scenario::new(&stack.kube).await;
    let with_role = |role: &str| {
        let mut spec = s.spec(role);
        spec["namespaceSelector"]["matchLabels"]["e2e/role"] = role.into();
        spec
    };
    let keep = s.policy("keep", with_role("keep")).await;
    let lose = s.policy("lose", with_role("lose")).await;
    let mut lost = Vec::new();
    for role in ["keep", "lose", "lose", "lose", "lose"] {
        let ns = s.namespace(true).await;
        let patch = json!({ "metadata": { "labels": { "e2e/role": role } } });
        Api::<Namespace>::all(s.client.clone())
            .patch(&ns, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("label");
        s.registered(&ns, "web", "api").await;
        if role == "lose" {
            lost.push(sa(&ns, "api"));
        }
    }
    let calls = registrar.spire_calls();
    let sampler = Sampler::start(&socket, &lost).await;

    s.policies()
        .delete(&lose, &DeleteParams::default())
        .await
        .expect("delete policy");
    let brake = s
        .condition(&keep, "DeletionBrake", |c| c.status == "True")
        .await;
    eventually("deletion_brake_engaged = 1", WAIT, || async {
        (registrar.metric("deletion_brake_engaged", &[]) == 1.0).then_some(())
    })
    .await;
    s.event("default", CRD_NAME, "DeletionBrakeEngaged").await;
    for who in &lost {
        assert_eq!(entries(&socket, who).await.len(), 1, "held: {who:?}");
    }
    let samples = sampler.stop().await;
    for who in &lost {
        samples.assert_never_missing(who);
    }
    samples.report("mass scope loss held by the brake", &lost[0]);
    report_calls(&registrar, calls, "mass scope loss held by the brake");

    let (_, command) = brake
        .message
        .rsplit_once("with: ")
        .expect("the condition gives the command");
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(words[0], "kubectl");
    let (ok, out, err) = s.kubectl(&words[1..]);
    assert!(ok, "{out}{err}");
    for who in &lost {
        spire_until(
            &socket,
            who,
            "deleted after confirmation",
            <[Entry]>::is_empty,
        )
        .await;
    }
    eventually("the brake released", WAIT, || async {
        (registrar.metric("deletion_brake_engaged", &[]) == 0.0).then_some(())
    })
    .await;
    for who in &lost {
        eventually("finalizer released", WAIT, || async {
            let d = s.deployments(&who.0).get("web").await.ok()?;
            (!has_finalizer(&d)).then_some(())
        })
        .await;
    }
    drop(registrar);
    tokio::task::block_in_place(|| stack.stop());
}

// One service account, one identity, whichever policies match its Deployments.
#[tokio::test(flavor = "multi_thread")]
async fn one_service_account_gets_one_entry_under_competing_policies() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    let mut for_web = s.spec("a");
    for_web["deploymentSelector"] = json!({ "matchLabels": { "app": "web" } });
    let mut for_cron = s.spec("b");
    for_cron["deploymentSelector"] = json!({ "matchLabels": { "app": "cron" } });
    for_cron["priority"] = 10.into();
    let a = s.policy("a", for_web).await;
    s.policy("b", for_cron).await;
    let ns = s.namespace(true).await;
    let first = s.registered(&ns, "web", "api").await;
    let who = sa(&ns, "api");
    let calls = bed.registrar.spire_calls();
    let sampler = Sampler::start(bed.socket(), std::slice::from_ref(&who)).await;

    s.registered(&ns, "cron", "api").await;
    let winner = spire_until(
        bed.socket(),
        &who,
        "one entry under the priority policy",
        |e| e.len() == 1 && e[0].parent_id == s.parent("b"),
    )
    .await;
    s.condition(&a, "Conflict", |c| c.status == "True").await;
    s.event("default", &a, "Overridden").await;
    s.event(&ns, "web", "PolicyConflict").await;
    s.event(&ns, "cron", "PolicyConflict").await;
    let samples = sampler.stop().await;
    samples.report("a second policy takes the service account over", &who);
    report_calls(
        &bed.registrar,
        calls,
        "a second policy takes the service account over",
    );
    samples.assert_never_missing(&who);
    assert_eq!(samples.ids(&who), vec![first, winner[0].id.clone()]);

    // Settled: one entry, and nothing flaps between syncs.
    let sampler = Sampler::start(bed.socket(), std::slice::from_ref(&who)).await;
    several_syncs(&bed.registrar, &s.deployments(&ns), "web").await;
    let samples = sampler.stop().await;
    assert_eq!(samples.doubled(&who), Duration::ZERO);
    assert_eq!(
        samples.revisions(&who),
        vec![(winner[0].id.clone(), winner[0].revision_number)]
    );
}

// The SPIFFE ID comes from policy alone (invariant 1): templates where a tenant's name could reach into another's are refused.
#[tokio::test(flavor = "multi_thread")]
async fn templates_that_could_collide_or_inject_are_refused_at_apply() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    for template in [
        "spiffe://{trustDomain}/{namespace}-{serviceAccount}",
        "spiffe://{trustDomain}/ns/{namespace}",
        "spiffe://{trustDomain}/{serviceAccount}/{namespace}",
        "spiffe://{trustDomain}/{namespace}/{serviceAccount}/{namespace}",
    ] {
        let mut spec = s.spec("x");
        spec["spiffeIDTemplate"] = template.into();
        let error = s.try_policy("t", spec).await.expect_err(template);
        assert!(error.to_string().contains("spiffeIDTemplate"), "{error}");
    }
    for name in [
        "api-{namespace}.svc",
        "{serviceAccount}x.svc",
        "{namespace}.Example.com",
    ] {
        let mut spec = s.spec("x");
        spec["dnsNames"] = json!([name]);
        s.try_policy("d", spec).await.expect_err(name);
    }
    let mut fine = s.spec("x");
    fine["spiffeIDTemplate"] = "spiffe://{trustDomain}/k8s/{namespace}/sa/{serviceAccount}".into();
    fine["dnsNames"] = json!(["{serviceAccount}.{namespace}.svc"]);
    s.try_policy("ok", fine)
        .await
        .expect("whole segments and labels are fine");
}

// Nothing we write is read back as truth (invariant 1): a forged entry-id is undone by the webhook, corrected by the controller, pins nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_entry_id_never_sticks_and_never_pins_another_teams_entry() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    s.policy("p", s.spec("v1")).await;
    let (team_a, team_b) = (s.namespace(true).await, s.namespace(true).await);
    let theirs = s.registered(&team_a, "web", "api").await;
    let mine = s.registered(&team_b, "app", "api").await;

    // Another user copies team A's entry ID onto team B's Deployment: restored.
    let as_mallory = ["--as=mallory", "--as-group=system:masters"];
    let value = format!("{ENTRY_ID_ANNOTATION}={theirs}");
    let mut args = as_mallory.to_vec();
    args.extend([
        "-n",
        &team_b,
        "annotate",
        "deployment",
        "app",
        &value,
        "--overwrite",
    ]);
    let (ok, out, err) = s.kubectl(&args);
    assert!(ok, "{out}{err}");
    assert!(
        err.contains("is written by the registrar"),
        "the webhook warns: {err}"
    );
    let stored = s.deployments(&team_b).get("app").await.expect("get");
    assert_eq!(
        annotation(&stored, ENTRY_ID_ANNOTATION),
        Some(mine.as_str())
    );

    // Created with it: stripped.
    let mut forged = deployment("forged", Some("other"));
    forged.metadata.annotations = Some([(ENTRY_ID_ANNOTATION.to_string(), theirs.clone())].into());
    let file = bed.stack.dir().join(format!("{}.json", s.tag));
    std::fs::write(&file, serde_json::to_string(&forged).expect("json")).expect("write");
    let mut args = as_mallory.to_vec();
    let path = file.display().to_string();
    args.extend(["-n", &team_b, "create", "-f", &path, "-o", "json"]);
    let (ok, out, err) = s.kubectl(&args);
    assert!(ok, "{out}{err}");
    let created: Deployment = serde_json::from_str(&out).expect("created object");
    assert_ne!(
        annotation(&created, ENTRY_ID_ANNOTATION),
        Some(theirs.as_str())
    );

    // Without the webhook, the controller corrects it; it never keeps the other entry alive.
    let quiet = s.namespace(false).await;
    let mut copied = deployment("copied", Some("api"));
    copied.metadata.annotations = Some([(ENTRY_ID_ANNOTATION.to_string(), theirs.clone())].into());
    s.deployments(&quiet)
        .create(&PostParams::default(), &copied)
        .await
        .expect("create");
    let own = spire_until(bed.socket(), &sa(&quiet, "api"), "its own entry", |e| {
        e.len() == 1
    })
    .await;
    eventually("the controller to correct entry-id", WAIT, || async {
        let d = s.deployments(&quiet).get("copied").await.ok()?;
        (annotation(&d, ENTRY_ID_ANNOTATION) == Some(own[0].id.as_str())).then_some(())
    })
    .await;
    s.delete_deployment(&team_a, "web").await;
    assert!(entries(bed.socket(), &sa(&team_a, "api")).await.is_empty());
}

// We only delete what we own (invariant 6): two clusters with default names on one SPIRE server; then a rename migrates.
#[tokio::test(flavor = "multi_thread")]
async fn clusters_sharing_spire_keep_apart_and_a_rename_migrates_in_place() {
    let (mut stack, port_a) = tokio::task::block_in_place(|| {
        let stack = Stack::start();
        let port = free_port();
        prepare(&stack.kube, port);
        (stack, port)
    });
    let socket = stack.spire_server.socket.clone();
    let (mut kube_b, port_b) = tokio::task::block_in_place(|| {
        let kube = KubePlane::start(&stack.dir().join("b"));
        stack.track(kube.etcd.pgid());
        stack.track(kube.apiserver.pgid());
        let port = free_port();
        prepare(&kube, port);
        (kube, port)
    });
    let start = |kubeconfig: &Path,
                 port: u16,
                 cluster: &'static str,
                 name: &'static str,
                 extra: &[&str]| {
        let registrar = tokio::task::block_in_place(|| {
            Registrar::start_full(
                &stack,
                port,
                kubeconfig,
                options(cluster, name, flags(FLAGS, extra)),
            )
        });
        stack.track(registrar.process.pgid());
        registrar
    };
    let kubeconfig_a = stack.kube.kubeconfig.clone();
    let mut registrar_a = start(&kubeconfig_a, port_a, "", "registrar-a", &[]);
    let registrar_b = start(&kube_b.kubeconfig, port_b, "", "registrar-b", &[]);
    let (a, b) = (
        Scenario::new(&stack.kube).await,
        Scenario::new(&kube_b).await,
    );
    a.policy("p", a.spec("a")).await;
    b.policy("p", b.spec("b")).await;
    let (ns_a, ns_b) = (a.namespace(true).await, b.namespace(true).await);
    let id_a = a.registered(&ns_a, "web", "api").await;
    let id_b = b.registered(&ns_b, "web", "api").await;
    let (name_a, name_b) = (cluster_of(&id_a).to_string(), cluster_of(&id_b).to_string());
    assert!(
        name_a.starts_with("k-") && name_b.starts_with("k-"),
        "{name_a} {name_b}"
    );
    assert_ne!(
        name_a, name_b,
        "each cluster names itself from its kube-system UID"
    );

    let theirs = sa(&ns_b, "api");
    let sampler = Sampler::start(&socket, std::slice::from_ref(&theirs)).await;
    a.delete_deployment(&ns_a, "web").await;
    assert!(entries(&socket, &sa(&ns_a, "api")).await.is_empty());
    let samples = sampler.stop().await;
    samples.assert_never_missing(&theirs);
    assert_eq!(
        samples.revisions(&theirs).len(),
        1,
        "cluster A never touched B's entry"
    );

    // Rename A: its entries are taken over in place, never recreated.
    let kept = a.registered(&ns_a, "kept", "kept").await;
    let who = sa(&ns_a, "kept");
    let sampler = Sampler::start(&socket, std::slice::from_ref(&who)).await;
    tokio::task::block_in_place(|| registrar_a.process.stop(Duration::from_secs(10)));
    let previous = format!("--previous-cluster-name={name_a}");
    registrar_a = start(
        &kubeconfig_a,
        port_a,
        "renamed",
        "registrar-a2",
        &[&previous],
    );
    let migrated = spire_until(&socket, &who, "re-hinted under the new name", |e| {
        e.len() == 1 && e[0].hint == "spiffe-registrar/renamed/adopted"
    })
    .await;
    assert_eq!(migrated[0].id, kept, "the same entry, not a new one");
    let fresh = a.registered(&ns_a, "fresh", "fresh").await;
    assert!(fresh.starts_with("sreg.renamed."), "{fresh}");
    let samples = sampler.stop().await;
    samples.report("cluster rename", &who);
    report_calls(
        &registrar_a,
        0.0,
        "cluster rename (new process: start-up list + re-hint + one create)",
    );
    samples.assert_never_missing(&who);
    assert_eq!(samples.ids(&who), vec![kept]);
    a.delete_deployment(&ns_a, "kept").await;
    assert!(
        entries(&socket, &who).await.is_empty(),
        "still ours to delete"
    );
    assert_eq!(entries(&socket, &theirs).await.len(), 1);

    drop((registrar_a, registrar_b));
    tokio::task::block_in_place(|| {
        kube_b.stop();
        stack.stop();
    });
}

// We only delete what we own (invariant 6): another writer's equivalent entry: reported once, adopted in place on opt-in.
#[tokio::test(flavor = "multi_thread")]
async fn an_equivalent_foreign_entry_is_reported_once_then_adopted_on_opt_in() {
    let (mut stack, registrar, port) = own_stack("adopt", &[]);
    let socket = stack.spire_server.socket.clone();
    let s = Scenario::new(&stack.kube).await;
    s.policy("p", s.spec("p")).await;
    let ns = s.namespace(true).await;
    let who = sa(&ns, "api");
    stack.spire_server.cli_ok(
        &["entry", "create"],
        &[
            "-parentID",
            &s.parent("p"),
            "-spiffeID",
            &format!("spiffe://{TD}/ns/{ns}/sa/api"),
            "-selector",
            &format!("k8s:ns:{ns}"),
            "-selector",
            "k8s:sa:api",
        ],
    );
    let foreign = entries(&socket, &who).await;
    assert_eq!(foreign.len(), 1);
    let sampler = Sampler::start(&socket, std::slice::from_ref(&who)).await;

    s.deployments(&ns)
        .create(&PostParams::default(), &deployment("web", Some("api")))
        .await
        .expect("create");
    s.event(&ns, "web", "EquivalentEntryExists").await;
    let reported = registrar.metric("spire_equivalent_foreign_entries_total", &[]);
    assert_eq!(reported, 1.0);
    let creates = registrar.metric("spire_api_entries_total", &[("op", "create")]);
    several_syncs(&registrar, &s.deployments(&ns), "web").await;
    assert_eq!(
        registrar.metric("spire_equivalent_foreign_entries_total", &[]),
        reported
    );
    assert_eq!(
        registrar.metric("spire_api_entries_total", &[("op", "create")]),
        creates
    );
    assert_eq!(
        events(&s.client, &ns, "web", "EquivalentEntryExists")
            .await
            .len(),
        1
    );

    drop(registrar);
    let registrar = tokio::task::block_in_place(|| {
        Registrar::start_on(
            &stack,
            port,
            options(
                "adopt",
                "adopter",
                flags(FLAGS, &["--adopt-equivalent-entries=true"]),
            ),
        )
    });
    stack.track(registrar.process.pgid());
    let adopted = spire_until(&socket, &who, "adopted in place", |e| {
        e.len() == 1 && e[0].hint == "spiffe-registrar/adopt/adopted"
    })
    .await;
    assert_eq!(
        adopted[0].id, foreign[0].id,
        "SPIRE IDs never change: taken over in place"
    );
    assert_eq!(entry_id_of(&s.deployments(&ns), "web").await, foreign[0].id);
    let samples = sampler.stop().await;
    samples.report("adoption", &who);
    report_calls(
        &registrar,
        0.0,
        "adoption (new process: start-up list + re-hint)",
    );
    samples.assert_never_missing(&who);
    assert_eq!(samples.ids(&who), vec![foreign[0].id.clone()]);

    s.delete_deployment(&ns, "web").await;
    assert!(
        entries(&socket, &who).await.is_empty(),
        "now ours to delete"
    );
    drop(registrar);
    tokio::task::block_in_place(|| stack.stop());
}

// A policy is not Ready while one of its service accounts cannot be registered (DESIGN
// invariant 4: doubt holds). Here two policies' templates would give service accounts of two
// namespaces one SPIFFE ID: neither is picked, the entry one of them had is held.
#[tokio::test(flavor = "multi_thread")]
async fn a_policy_is_not_ready_while_one_of_its_service_accounts_fails() {
    let bed = suite();
    let s = Scenario::new(&bed.stack.kube).await;
    let (one, two) = (s.namespace(true).await, s.namespace(true).await);
    let only = |ns: &str| json!({ "matchLabels": { "kubernetes.io/metadata.name": ns } });
    let mut a = s.spec("a");
    a["namespaceSelector"] = only(&one);
    a["spiffeIDTemplate"] = json!(format!(
        "spiffe://{{trustDomain}}/{two}/{{namespace}}/{{serviceAccount}}"
    ));
    let mut b = s.spec("b");
    b["namespaceSelector"] = only(&two);
    b["spiffeIDTemplate"] = json!(format!(
        "spiffe://{{trustDomain}}/{{namespace}}/{one}/{{serviceAccount}}"
    ));
    let p = s.policy("a", a).await;
    s.policy("b", b).await;
    s.registered(&one, "fine", "fine").await;
    // spiffe://<td>/<two>/<one>/x: registered for `one`, then wanted by `two` as well.
    s.registered(&one, "clash", "x").await;
    s.deployments(&two)
        .create(&PostParams::default(), &deployment("clash", Some("x")))
        .await
        .expect("create");
    let ready = s
        .condition(&p, "Ready", |c| {
            c.status == "False" && c.reason == "RegistrationFailed"
        })
        .await;
    assert!(ready.message.starts_with("1 of 2"), "{}", ready.message);
    let status = s
        .policies()
        .get(&p)
        .await
        .expect("policy")
        .status
        .expect("status");
    assert_eq!((status.entries, status.failures), (1, 1));
    s.event(&one, "clash", "RegistrationFailed").await;
    s.event(&two, "clash", "RegistrationFailed").await;
    // Neither is picked: the newcomer gets no entry, and the entry `one` had is held.
    assert!(entries(bed.socket(), &sa(&two, "x")).await.is_empty());
    assert_eq!(entries(bed.socket(), &sa(&one, "x")).await.len(), 1);
}
