//! Deployment writes: finalizers, annotations and Events (DESIGN invariants 1 and 5: what we
//! wrote is never read back as truth; a finalizer goes only once nothing of ours waits on it).

use super::*;
use crate::spire::ItemError;

#[test]
fn a_held_entry_never_stalls_an_unrelated_deleting_deployment() {
    let mut w = World::new();
    let held = rendered(&w.o, "a", "held", "spiffe://td/p");
    w.in_spire(&held);
    w.account(
        "a",
        "held",
        &["h"],
        SaState::Invalid {
            policy: "p".into(),
            reason: "InvalidTTL",
            message: "bad".into(),
        },
    );
    w.deleting("a", "leaving", "other");
    let plan = w.decide(0);
    w.apply(&plan);
    let writes = w.writes(&plan, &Failures::new());
    let leaving = writes
        .iter()
        .find(|x| x.key == dk("a", "leaving"))
        .expect("a write for the deleting Deployment");
    assert!(leaving.change.remove_finalizer);
}

#[test]
fn a_deleting_deployment_waits_for_its_entry_and_says_why_when_spire_fails() {
    let mut w = World::new();
    let e = rendered(&w.o, "a", "api", "spiffe://td/p");
    w.in_spire(&e);
    w.deleting("a", "web", "api");
    let plan = w.decide(0);
    let failures = Failures::from([(
        e.id.clone(),
        ItemError::Other {
            id: e.id.clone(),
            code: tonic::Code::Unavailable,
            message: "down".into(),
        },
    )]);
    let writes = w.writes(&plan, &failures);
    assert!(!writes[0].change.remove_finalizer);
    assert_eq!(
        writes[0].announce.first().map(|a| a.reason),
        Some("DeregistrationFailed")
    );
    w.apply(&plan);
    let writes = w.writes(&plan, &Failures::new());
    assert!(writes[0].change.remove_finalizer);
}

#[test]
fn a_deleting_deployment_with_a_live_sibling_is_released_and_the_entry_stays() {
    let mut w = World::new();
    let e = w.needs("a", "api", &["worker"], "spiffe://td/p");
    w.in_spire(&e);
    w.deleting("a", "web", "api");
    let plan = w.decide(0);
    assert!(plan.delete.is_empty());
    let writes = w.writes(&plan, &Failures::new());
    let web = writes
        .iter()
        .find(|x| x.key == dk("a", "web"))
        .expect("web");
    assert!(web.change.remove_finalizer);
}

#[test]
fn an_out_of_scope_deployment_keeps_its_finalizer_until_the_entry_is_gone() {
    let mut w = World::new();
    let e = rendered(&w.o, "a", "api", "spiffe://td/p");
    w.in_spire(&e);
    w.account("a", "api", &["web"], SaState::OutOfScope);
    w.desired
        .workloads
        .get_mut(&dk("a", "web"))
        .expect("web")
        .entry_id = Some(e.id.as_str().into());
    let plan = w.decide(0);
    let writes = w.writes(&plan, &Failures::new());
    assert!(writes[0].change.is_empty());
    assert_eq!(
        writes[0].announce.first().map(|a| a.reason),
        Some("DeregistrationPending")
    );
    let plan = w.decide(SCOPE);
    w.apply(&plan);
    let writes = w.writes(&plan, &Failures::new());
    assert!(writes[0].change.remove_finalizer);
    assert_eq!(
        writes[0].change.entry_id,
        Some(None),
        "annotations stripped"
    );
}

#[test]
fn a_forged_entry_id_is_corrected_and_pins_nothing() {
    let mut w = World::new();
    let victim = rendered(&w.o, "b", "theirs", "spiffe://td/p");
    w.in_spire(&victim);
    let e = w.needs("a", "api", &["web"], "spiffe://td/p");
    w.in_spire(&e);
    w.desired
        .workloads
        .get_mut(&dk("a", "web"))
        .expect("web")
        .entry_id = Some(victim.id.as_str().into());
    let plan = w.decide(0);
    assert_eq!(
        ids(&plan.delete),
        vec![victim.id.as_str()],
        "nothing runs as b/theirs: the annotation does not keep it"
    );
    let writes = w.writes(&plan, &Failures::new());
    assert_eq!(writes[0].change.entry_id, Some(Some(e.id.as_str().into())));
}

#[test]
fn registration_is_announced_once() {
    let mut w = World::new();
    let e = w.needs("a", "api", &["web"], "spiffe://td/p");
    let plan = w.decide(0);
    w.apply(&plan);
    let writes = w.writes(&plan, &Failures::new());
    assert!(writes[0].registered);
    assert_eq!(writes[0].change.entry_id, Some(Some(e.id.as_str().into())));
    assert_eq!(
        writes[0].announce.first().map(|a| a.reason),
        Some("Registered")
    );
    // The patch landed.
    let web = w.desired.workloads.get_mut(&dk("a", "web")).expect("web");
    web.entry_id = Some(e.id.as_str().into());
    web.spiffe_id = Some(e.spiffe_id.as_str().into());
    let plan = w.decide(1);
    assert!(w.writes(&plan, &Failures::new()).is_empty());
}

#[test]
fn deployments_are_told_which_policy_governs_their_service_account() {
    let mut w = World::new();
    let e = w.needs("a", "api", &["web"], "spiffe://td/p");
    w.in_spire(&e);
    w.desired
        .service_accounts
        .get_mut(&sa("a", "api"))
        .expect("api")
        .losers = vec!["other".into()];
    let plan = w.decide(0);
    let writes = w.writes(&plan, &Failures::new());
    let reasons: Vec<&str> = writes[0].announce.iter().map(|a| a.reason).collect();
    assert_eq!(reasons, vec!["Registered", "PolicyConflict"]);
    let plan = w.decide(1);
    assert!(
        w.writes(&plan, &Failures::new())
            .iter()
            .all(|x| x.announce.iter().all(|a| a.reason != "PolicyConflict")),
        "told once"
    );
}

#[test]
fn a_terminating_namespace_releases_its_deployments_without_events() {
    let mut w = World::new();
    let e = rendered(&w.o, "a", "api", "spiffe://td/p");
    w.in_spire(&e);
    w.deleting("a", "web", "api");
    let web = w.desired.workloads.get_mut(&dk("a", "web")).expect("web");
    web.namespace_terminating = true;
    web.entry_id = Some(e.id.as_str().into());
    let plan = w.decide(0);
    assert_eq!(ids(&plan.delete), vec![e.id.as_str()]);
    w.apply(&plan);
    let writes = w.writes(&plan, &Failures::new());
    assert!(writes[0].change.remove_finalizer);
    assert!(writes[0].announce.is_empty(), "Events are refused there");
}

#[test]
fn a_failed_write_is_counted_and_announced_once_if_a_later_sync_sees_it_landed() {
    let mut w = World::new();
    let e = w.needs("a", "api", &["landed", "lost", "other"], "spiffe://td/p");
    for (name, shown) in [
        ("landed", Some(e.id.as_str())),
        ("lost", None),
        ("other", Some("sreg.c.someone-else")),
    ] {
        let workload = w.desired.workloads.get_mut(&dk("a", name)).expect("built");
        workload.entry_id = shown.map(Into::into);
    }
    let registered = Announce::normal("Registered", format!("entry {}", e.id));
    let failed = |name: &str| FailedWrite {
        key: dk("a", name),
        registered: Some(e.id.as_str().into()),
        announce: vec![registered.clone()],
    };
    // The announcements were made (remembered) when the writes were computed.
    for name in ["landed", "lost"] {
        assert!(w.memory.first_time(&dk("a", name), &registered));
    }
    w.memory
        .failed_writes(["landed", "lost", "other", "gone"].map(failed).into());
    assert!(
        w.memory.first_time(&dk("a", "lost"), &registered),
        "an unpublished announcement is made again by the retried write"
    );
    let landed = w.memory.settle_failed_writes(&w.desired);
    let keys: Vec<_> = landed.iter().map(|f| f.key.clone()).collect();
    assert_eq!(keys, vec![dk("a", "landed")], "only the one that landed");
    assert_eq!(landed[0].announce, vec![registered.clone()]);
    assert!(
        !w.memory.first_time(&dk("a", "landed"), &registered),
        "published with the settlement: not again"
    );
    assert!(
        w.memory.settle_failed_writes(&w.desired).is_empty(),
        "settled once"
    );
}

#[test]
fn a_dns_name_left_out_is_told_once_to_each_deployment_of_the_account() {
    let mut w = World::new();
    w.needs("a", "dotted.sa", &["one", "two"], "spiffe://td/p");
    let note = "dnsNames template \"{serviceAccount}.svc\" left out";
    w.desired
        .service_accounts
        .get_mut(&sa("a", "dotted.sa"))
        .expect("the account")
        .dns_omitted = Some(note.into());
    let plan = w.decide(0);
    w.apply(&plan);
    let writes = w.writes(&plan, &Failures::new());
    for name in ["one", "two"] {
        let write = writes
            .iter()
            .find(|x| x.key == dk("a", name))
            .expect("a write per Deployment");
        let warning = write
            .announce
            .iter()
            .find(|a| a.reason == "DNSNameOmitted")
            .expect("the DNS warning");
        assert!(
            warning.warning && warning.note.contains(note),
            "{warning:?}"
        );
        assert!(
            write.change.entry_id.is_some(),
            "the entry is recorded all the same"
        );
    }
    let again = w.writes(&plan, &Failures::new());
    assert!(
        again
            .iter()
            .all(|x| x.announce.iter().all(|a| a.reason != "DNSNameOmitted")),
        "told once: {again:?}"
    );
}

/// One entry per service account whatever kind runs as it (DESIGN invariant 3): a StatefulSet
/// being deleted beside a live Deployment of the same name and account is released at once
/// and the entry stays; when the last of them, a finished Job, is deleted, the entry goes
/// first and its finalizer after.
#[test]
fn the_ref_count_spans_kinds_and_a_finished_job_holds_until_deleted() {
    let mut w = World::new();
    let (web, db, job) = (
        dk("a", "web"),
        wk(WorkloadKind::StatefulSet, "a", "web"),
        wk(WorkloadKind::Job, "a", "nightly"),
    );
    let e = rendered(&w.o, "a", "api", "spiffe://td/p");
    w.in_spire(&e);
    // A Job that has finished is still a live workload: nothing in its record says done.
    w.account_of(
        "a",
        "api",
        &[web.clone(), job.clone()],
        SaState::Needs {
            policy: "p".into(),
            entry: e.clone().into(),
        },
    );
    w.deleting_workload(db.clone(), "api");
    let plan = w.decide(0);
    assert!(plan.delete.is_empty(), "the Deployment and the Job need it");
    let writes = w.writes(&plan, &Failures::new());
    let released = writes.iter().find(|x| x.key == db).expect("a write for db");
    assert!(released.change.remove_finalizer);
    assert!(
        writes
            .iter()
            .all(|x| x.key == db || !x.change.remove_finalizer),
        "{writes:?}"
    );

    // The Deployment and the StatefulSet are gone; the Job is deleted (its TTL).
    w.desired = Desired::default();
    w.deleting_workload(job.clone(), "api");
    let plan = w.decide(1);
    assert_eq!(ids(&plan.delete), vec![e.id.as_str()], "the last reference");
    let unsure = Failures::from([(
        e.id.clone(),
        ItemError::Other {
            id: e.id.clone(),
            code: tonic::Code::Unavailable,
            message: "down".into(),
        },
    )]);
    let writes = w.writes(&plan, &unsure);
    let job_write = writes.iter().find(|x| x.key == job).expect("the Job");
    assert!(!job_write.change.remove_finalizer, "entry first");
    w.apply(&plan);
    let writes = w.writes(&plan, &Failures::new());
    let job_write = writes.iter().find(|x| x.key == job).expect("the Job");
    assert!(job_write.change.remove_finalizer, "then the finalizer");
}

/// A bare Pod gets its annotations and Events like any workload, never our finalizer.
#[test]
fn a_bare_pod_is_annotated_and_never_given_the_finalizer() {
    let mut w = World::new();
    let (pod, web) = (wk(WorkloadKind::Pod, "a", "solo"), dk("a", "web"));
    let e = rendered(&w.o, "a", "api", "spiffe://td/p");
    w.account_of(
        "a",
        "api",
        &[pod.clone(), web.clone()],
        SaState::Needs {
            policy: "p".into(),
            entry: e.clone().into(),
        },
    );
    for key in [&pod, &web] {
        w.desired
            .workloads
            .get_mut(key)
            .expect("added")
            .has_finalizer = false;
    }
    let plan = w.decide(0);
    w.apply(&plan);
    let writes = w.writes(&plan, &Failures::new());
    let of = |key: &WorkloadKey| writes.iter().find(|x| &x.key == key).expect("a write");
    assert!(of(&web).change.add_finalizer, "a Deployment is held");
    assert!(!of(&pod).change.add_finalizer, "a Pod never is");
    assert_eq!(of(&pod).change.entry_id, Some(Some(e.id.as_str().into())));
    assert_eq!(of(&pod).announce[0].reason, "Registered");
}
