//! Desired state: one identity per service account, ref-counted by its live Deployments.

use super::*;
use crate::keys::WorkloadKind;
use crate::policy::testing::{mk_deployment, mk_policy, mk_selector, recorded};

fn enabled(ns: &str) -> Option<NamespaceInfo> {
    (ns != "off").then(|| NamespaceInfo {
        labels: BTreeMap::from([("spiffe.io/registrar".to_string(), "enabled".to_string())]),
        terminating: ns == "dying",
    })
}

fn sa(ns: &str, name: &str) -> SaKey {
    SaKey {
        namespace: ns.into(),
        service_account: name.into(),
    }
}

#[test]
fn shared_service_accounts_share_one_refcounted_entry() {
    let o = Ownership::new("c").expect("valid");
    let deployments: Vec<Arc<WorkloadRecord>> = vec![
        recorded(mk_deployment("a", "web", Some("api"), &[])),
        recorded(mk_deployment("a", "worker", Some("api"), &[])),
        recorded(mk_deployment("a", "db", None, &[])),
        recorded(mk_deployment("off", "x", None, &[])),
    ];
    let policies = vec![Arc::new(mk_policy("p", 1, |_| {}))];
    let desired = compute(&o, &OptIn::default(), &deployments, &enabled, &policies);
    let api = &desired.service_accounts[&sa("a", "api")];
    assert_eq!(api.deployments.len(), 2);
    let entry = desired.needs(&sa("a", "api")).expect("needs an entry");
    assert_eq!(entry.x509_svid_ttl, 3600);
    assert!(o.is_ours(entry));
    assert_eq!(SaKey::of_entry(entry), Some(sa("a", "api")));
    assert!(desired.needs(&sa("a", "default")).is_some());
    assert_eq!(
        desired.service_accounts[&sa("off", "default")].state,
        SaState::OutOfScope
    );
}

/// `deployment`'s record as a workload of `kind` (the record reads nothing kind-specific).
fn as_kind(
    kind: WorkloadKind,
    deployment: k8s_openapi::api::apps::v1::Deployment,
) -> Arc<WorkloadRecord> {
    let mut record = WorkloadRecord::clone(&recorded(deployment));
    record.kind = kind;
    Arc::new(record)
}

/// Every kind counts toward its service account's one entry; a name may repeat across kinds.
#[test]
fn workloads_of_every_kind_share_their_service_account_s_entry() {
    use WorkloadKind::{CronJob, Job, StatefulSet};
    let o = Ownership::new("c").expect("valid");
    let mut leaving = mk_deployment("a", "old", Some("api"), &[]);
    leaving.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
    let workloads = vec![
        recorded(mk_deployment("a", "web", Some("api"), &[])),
        as_kind(StatefulSet, mk_deployment("a", "web", Some("api"), &[])),
        as_kind(CronJob, mk_deployment("a", "tick", Some("api"), &[])),
        as_kind(Job, leaving),
    ];
    let policies = vec![Arc::new(mk_policy("p", 1, |_| {}))];
    let desired = compute(&o, &OptIn::default(), &workloads, &enabled, &policies);
    let api = &desired.service_accounts[&sa("a", "api")];
    let mut kinds: Vec<WorkloadKind> = api.deployments.iter().map(|k| k.kind).collect();
    kinds.sort();
    assert_eq!(kinds, [WorkloadKind::Deployment, StatefulSet, CronJob]);
    assert_eq!(
        desired.workloads.len(),
        4,
        "the deleting Job is still tracked"
    );
    assert_eq!(desired.service_accounts.len(), 1, "one identity");
    assert!(desired.needs(&sa("a", "api")).is_some());
}

/// A workload deleted because its kind's CRD is being removed is a loss of scope when
/// nothing else runs as its account (kept, so that its entry has the grace and it keeps the
/// finalizer), and an ordinary release when something does.
#[test]
fn a_kind_going_away_with_its_crd_is_a_loss_of_scope_not_a_release() {
    let o = Ownership::new("c").expect("valid");
    let gadget =
        WorkloadKind::register_custom("e2e.example.test/v1/Gadget/gadgets").expect("valid");
    let fading = |name: &str, account: &str| {
        let mut d = mk_deployment("a", name, Some(account), &[]);
        d.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
        let mut record = WorkloadRecord::clone(&as_kind(gadget, d));
        record.kind_removing = true;
        Arc::new(record)
    };
    let workloads = vec![
        fading("alone", "lonely"),
        fading("beside", "api"),
        recorded(mk_deployment("a", "web", Some("api"), &[])),
    ];
    let policies = vec![Arc::new(mk_policy("p", 1, |_| {}))];
    let desired = compute(&o, &OptIn::default(), &workloads, &enabled, &policies);
    let lonely = &desired.service_accounts[&sa("a", "lonely")];
    assert_eq!(lonely.state, SaState::OutOfScope);
    assert_eq!(lonely.deployments.len(), 1);
    let key = |name: &str| WorkloadKey {
        kind: gadget,
        namespace: "a".into(),
        name: name.into(),
    };
    let alone = &desired.workloads[&key("alone")];
    assert!(
        !alone.deleting && alone.going_with_its_kind,
        "held like a live workload out of scope"
    );
    let beside = &desired.workloads[&key("beside")];
    assert!(
        beside.deleting && !beside.going_with_its_kind,
        "released: the Deployment keeps the entry"
    );
    let api = &desired.service_accounts[&sa("a", "api")];
    assert_eq!(api.deployments.len(), 1, "the Deployment alone counts");
    assert!(desired.needs(&sa("a", "api")).is_some());
}

#[test]
fn deleting_deployments_and_terminating_namespaces_drop_out_of_the_refcount() {
    let o = Ownership::new("c").expect("valid");
    let mut leaving = mk_deployment("a", "web", Some("api"), &[]);
    leaving.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
    let deployments = vec![
        recorded(leaving),
        recorded(mk_deployment("a", "worker", Some("api"), &[])),
        recorded(mk_deployment("dying", "x", None, &[])),
    ];
    let policies = vec![Arc::new(mk_policy("p", 1, |_| {}))];
    let desired = compute(&o, &OptIn::default(), &deployments, &enabled, &policies);
    assert_eq!(
        desired.service_accounts[&sa("a", "api")].deployments.len(),
        1
    );
    assert!(
        !desired
            .service_accounts
            .contains_key(&sa("dying", "default"))
    );
    assert!(desired.workloads.values().filter(|w| w.deleting).count() == 2);
}

#[test]
fn one_policy_per_service_account_even_when_deployments_match_different_ones() {
    let o = Ownership::new("c").expect("valid");
    let deployments = vec![
        recorded(mk_deployment("a", "web", Some("api"), &[("app", "web")])),
        recorded(mk_deployment("a", "cron", Some("api"), &[("app", "cron")])),
    ];
    let policies = vec![
        Arc::new(mk_policy("for-web", 1, |s| {
            s.deployment_selector = Some(mk_selector(&[("app", "web")]))
        })),
        Arc::new(mk_policy("for-cron", 2, |s| {
            s.deployment_selector = Some(mk_selector(&[("app", "cron")]));
            s.parent_id = Some("spiffe://example.org/other".into());
        })),
    ];
    let desired = compute(&o, &OptIn::default(), &deployments, &enabled, &policies);
    assert!(matches!(
        &desired.service_accounts[&sa("a", "api")].state,
        SaState::Needs { policy, .. } if policy == "for-web"
    ));
    assert_eq!(desired.conflicts["for-cron"].len(), 2);
}

#[test]
fn unevaluable_selectors_put_the_cluster_in_doubt_and_collisions_are_held() {
    let o = Ownership::new("c").expect("valid");
    let mut typo = mk_policy("typo", 1, |_| {});
    typo.spec.deployment_selector = Some(crate::policy::crd::PolicySelector {
        match_expressions: vec![crate::policy::crd::SelectorRequirement {
            key: "app".into(),
            operator: "Equals".into(),
            values: vec!["x".into()],
        }],
        ..Default::default()
    });
    let swapped = mk_policy("swapped", 2, |s| {
        s.spiffe_id_template = Some("spiffe://{trustDomain}/{namespace}/{serviceAccount}".into());
        s.namespace_selector = Some(mk_selector(&[("team", "b")]));
    });
    let desired = compute(
        &o,
        &OptIn::default(),
        &[recorded(mk_deployment("a", "web", None, &[]))],
        &enabled,
        &[Arc::new(typo), Arc::new(swapped)],
    );
    assert!(desired.doubt.contains("typo"));
    assert_eq!(desired.invalid_policies["typo"].0, "InvalidSelector");
    assert_eq!(
        desired.service_accounts[&sa("a", "default")].state,
        SaState::OutOfScope,
        "the broken policy matches nothing; the other selects team b only"
    );

    let mut d = Desired::default();
    for (ns, name) in [("a", "x"), ("b", "y")] {
        d.service_accounts.insert(
            sa(ns, name),
            ServiceAccount {
                state: SaState::Needs {
                    policy: "p".into(),
                    entry: Entry {
                        spiffe_id: "spiffe://td/same".into(),
                        ..Entry::default()
                    }
                    .into(),
                },
                deployments: Vec::new(),
                losers: Vec::new(),
                dns_omitted: None,
            },
        );
    }
    refuse_shared_ids(&mut d);
    assert!(d.service_accounts.values().all(|a| matches!(
        a.state,
        SaState::Invalid {
            reason: "SpiffeIDCollision",
            ..
        }
    )));
}

#[test]
fn a_scoped_derive_sees_collisions_with_entries_of_other_service_accounts() {
    let o = Ownership::new("c").expect("valid");
    // Under this template b/api is `.../a/b/api`, which another policy's
    // `spiffe://{trustDomain}/{namespace}/b/{serviceAccount}` renders for a/api.
    let shared = Arc::new(mk_policy("shared", 1, |s| {
        s.spiffe_id_template = Some("spiffe://{trustDomain}/a/{namespace}/{serviceAccount}".into());
    }));
    let deployments = vec![recorded(mk_deployment("b", "web", Some("api"), &[]))];
    let scoped = compute_for(
        &o,
        &OptIn::default(),
        &deployments,
        &enabled,
        std::slice::from_ref(&shared),
        Some(BTreeSet::from([sa("b", "api")])),
        &BTreeMap::new(),
    );
    let mine = scoped.needs(&sa("b", "api")).expect("needs one").clone();
    assert!(
        scoped.collides_outside([&mine].into_iter()).is_none(),
        "its own entry is no collision"
    );
    let theirs = Entry {
        id: "sreg.c.other".into(),
        selectors: sa("a", "api").selectors(),
        ..mine.clone()
    };
    assert_eq!(
        scoped.collides_outside([&mine, &theirs].into_iter()),
        Some(mine.spiffe_id.clone())
    );
    let full = compute(&o, &OptIn::default(), &deployments, &enabled, &[shared]);
    assert!(
        full.collides_outside([&theirs].into_iter()).is_none(),
        "a full derive compares every service account itself"
    );
}
