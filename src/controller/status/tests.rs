//! Policy status: counts, conditions and their transition times.

use super::*;
use crate::controller::decide::{Input, spire_plan};
use crate::controller::desired::compute as desired;
use crate::index::NamespaceInfo;
use crate::policy::OptIn;
use crate::policy::testing::{mk_deployment, mk_policy, recorded};
use crate::spire::Ownership;
use std::collections::BTreeMap;
use std::sync::Arc;

fn enabled(_: &str) -> Option<NamespaceInfo> {
    Some(NamespaceInfo {
        labels: BTreeMap::from([("spiffe.io/registrar".to_string(), "enabled".to_string())]),
        terminating: false,
    })
}

fn find<'a>(status: &'a SpiffeRegistrationStatus, type_: &str) -> &'a Condition {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .expect("condition present")
}

fn status_of(
    policies: &[Arc<SpiffeRegistration>],
    deployments: Vec<Arc<crate::index::WorkloadRecord>>,
    which: usize,
) -> SpiffeRegistrationStatus {
    let o = Ownership::new("c").expect("valid");
    let d = desired(&o, &OptIn::default(), &deployments, &enabled, policies);
    let mut memory = Memory::default();
    let settings = Default::default();
    let observed = BTreeMap::new();
    let plan = spire_plan(
        &Input {
            ownership: &o,
            settings: &settings,
            desired: &d,
            observed: &observed,
            now: std::time::Instant::now(),
            confirmed: None,
        },
        &mut memory,
    );
    compute(
        &policies[which],
        &Outcome {
            desired: &d,
            plan: &plan,
            failures: &Failures::new(),
            memory: &memory,
        },
    )
}

#[test]
fn counts_conditions_and_stable_transition_times() {
    let old = Arc::new(mk_policy("old", 1, |_| {}));
    let new = Arc::new(mk_policy("new", 2, |_| {}));
    let deployments = vec![
        recorded(mk_deployment("a", "web", Some("api"), &[])),
        recorded(mk_deployment("a", "worker", Some("api"), &[])),
    ];
    let policies = [old.clone(), new.clone()];
    let winner = status_of(&policies, deployments.clone(), 0);
    assert_eq!(
        (winner.selected_workloads, winner.entries, winner.failures),
        (2, 1, 0)
    );
    assert_eq!(find(&winner, "Ready").status, "True");
    assert_eq!(find(&winner, "Conflict").status, "False");
    assert_eq!(find(&winner, "DeletionBrake").status, "False");

    let loser = status_of(&policies, deployments.clone(), 1);
    assert_eq!((loser.selected_workloads, loser.entries), (0, 0));
    assert_eq!(find(&loser, "Conflict").status, "True");
    assert!(
        find(&loser, "Conflict")
            .message
            .starts_with("2 Deployments")
    );

    let mut again = (*old).clone();
    again.status = Some(winner.clone());
    let later = status_of(&[Arc::new(again), new], deployments, 0);
    assert_eq!(
        find(&later, "Ready").last_transition_time,
        find(&winner, "Ready").last_transition_time
    );
}

#[test]
fn a_dns_name_left_out_keeps_the_policy_ready_and_is_named_in_its_own_condition() {
    let policy = Arc::new(mk_policy("p", 1, |s| {
        s.dns_names = vec!["{serviceAccount}.svc".into()]
    }));
    let status = status_of(
        &[policy],
        vec![
            recorded(mk_deployment("a", "ok", Some("fine"), &[])),
            recorded(mk_deployment("a", "odd", Some("has.dots"), &[])),
        ],
        0,
    );
    assert_eq!(find(&status, "Ready").status, "True");
    assert_eq!((status.entries, status.failures), (2, 0));
    let dns = find(&status, "DNSNames");
    assert_eq!(
        (dns.status.as_str(), dns.reason.as_str()),
        ("False", "DNSNameOmitted")
    );
    assert!(
        dns.message.starts_with("1 service accounts") && dns.message.contains("a/has.dots"),
        "{}",
        dns.message
    );
}

#[test]
fn a_policy_is_not_ready_while_a_service_account_fails_to_render() {
    // Valid for every name Kubernetes accepts; `..` stands for a name that cannot become
    // a SPIFFE ID path segment.
    let policy = Arc::new(mk_policy("p", 1, |_| {}));
    let status = status_of(
        &[policy],
        vec![
            recorded(mk_deployment("a", "ok", Some("fine"), &[])),
            recorded(mk_deployment("a", "odd", Some(".."), &[])),
        ],
        0,
    );
    let ready = find(&status, "Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "RegistrationFailed")
    );
    assert!(ready.message.starts_with("1 of 2"), "{}", ready.message);
    assert_eq!((status.entries, status.failures), (1, 1));
}

#[test]
fn an_invalid_policy_is_not_ready_with_the_field_to_fix() {
    let broken = Arc::new(mk_policy("p", 1, |s| s.ttl = Some("5s".into())));
    let status = status_of(&[broken], vec![], 0);
    let ready = find(&status, "Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "InvalidTTL")
    );
    assert!(ready.message.contains("ttl"), "{}", ready.message);
}

/// `kubectl get sreg` keeps its total; the status also counts by kind. A policy limited to
/// CronJobs governs the service account one of them runs as, and with it the Deployment of
/// that account (one identity per account); an account with no CronJob is not its.
#[test]
fn workloads_are_counted_by_kind() {
    use crate::keys::WorkloadKind::{CronJob, Deployment};
    let cron_only = Arc::new(mk_policy("cron", 1, |s| s.kinds = vec!["CronJob".into()]));
    let mut tick = crate::index::WorkloadRecord::clone(&recorded(mk_deployment(
        "a",
        "tick",
        Some("api"),
        &[],
    )));
    tick.kind = CronJob;
    let workloads = vec![
        recorded(mk_deployment("a", "web", Some("api"), &[])),
        Arc::new(tick),
        recorded(mk_deployment("a", "alone", Some("other"), &[])),
    ];
    let status = status_of(&[cron_only], workloads, 0);
    assert_eq!(status.selected_workloads, 2);
    assert_eq!(status.entries, 1);
    assert_eq!(
        status.workloads_by_kind,
        BTreeMap::from([
            (Deployment.name().to_string(), 1),
            (CronJob.name().to_string(), 1)
        ])
    );
}
