//! Table-style tests of the decisions, over a small world built with `World` helpers.

use super::*;
use crate::controller::desired::{ServiceAccount, Workload};
use crate::spire::Selector;

const GRACE: u64 = 60;
const SCOPE: u64 = 600;

struct World {
    o: Ownership,
    settings: DecideSettings,
    desired: Desired,
    observed: Observed,
    memory: Memory,
    t0: Instant,
    confirmed: Option<String>,
}

fn sa(ns: &str, name: &str) -> SaKey {
    SaKey {
        namespace: ns.into(),
        service_account: name.into(),
    }
}

fn dk(ns: &str, name: &str) -> DeploymentKey {
    DeploymentKey {
        namespace: ns.into(),
        name: name.into(),
    }
}

/// The entry a policy with `parent` renders for `ns/sa_name` under `o`.
fn rendered(o: &Ownership, ns: &str, sa_name: &str, parent: &str) -> Entry {
    let selectors = sa(ns, sa_name).selectors();
    let spiffe_id = format!("spiffe://td/ns/{ns}/sa/{sa_name}");
    Entry {
        id: o.entry_id(&spiffe_id, parent, &selectors),
        spiffe_id,
        parent_id: parent.into(),
        selectors,
        x509_svid_ttl: 3600,
        hint: o.hint().into(),
        ..Entry::default()
    }
    .normalize()
}

impl World {
    fn new() -> Self {
        Self {
            o: Ownership::new("c").expect("valid"),
            settings: DecideSettings {
                transition_grace: Duration::from_secs(GRACE),
                scope_loss_grace: Duration::from_secs(SCOPE),
                brake_count: 3,
                brake_fraction: 0.25,
                adopt: false,
            },
            desired: Desired::default(),
            observed: BTreeMap::new(),
            memory: Memory::default(),
            t0: Instant::now(),
            confirmed: None,
        }
    }

    /// `ns/sa_name` runs `deployments` (live, with our finalizer) in state `state`.
    fn account(&mut self, ns: &str, sa_name: &str, deployments: &[&str], state: SaState) {
        let key = sa(ns, sa_name);
        for name in deployments {
            self.desired.workloads.insert(
                dk(ns, name),
                Workload {
                    service_account: key.clone(),
                    deleting: false,
                    namespace_terminating: false,
                    has_finalizer: true,
                    spiffe_id: None,
                    entry_id: None,
                    created: None,
                },
            );
        }
        self.desired.service_accounts.insert(
            key,
            ServiceAccount {
                state,
                deployments: deployments.iter().map(|n| dk(ns, n)).collect(),
                losers: Vec::new(),
            },
        );
    }

    /// `ns/sa_name` needs the entry rendered under `parent`; returns it.
    fn needs(&mut self, ns: &str, sa_name: &str, deployments: &[&str], parent: &str) -> Entry {
        let entry = rendered(&self.o, ns, sa_name, parent);
        self.account(
            ns,
            sa_name,
            deployments,
            SaState::Needs {
                policy: "p".into(),
                entry: entry.clone().into(),
            },
        );
        entry
    }

    fn in_spire(&mut self, entry: &Entry) {
        self.observed
            .insert(entry.id.clone(), Arc::new(entry.clone()));
    }

    /// Deployment `ns/name` (running as `sa_name`) is being deleted; its service account has no
    /// other live Deployment unless declared separately.
    fn deleting(&mut self, ns: &str, name: &str, sa_name: &str) {
        self.desired.workloads.insert(
            dk(ns, name),
            Workload {
                service_account: sa(ns, sa_name),
                deleting: true,
                namespace_terminating: false,
                has_finalizer: true,
                spiffe_id: None,
                entry_id: None,
                created: None,
            },
        );
    }

    fn decide(&mut self, at: u64) -> SpirePlan {
        let desired = std::mem::take(&mut self.desired);
        let plan = self.decide_on(&desired, at);
        self.desired = desired;
        plan
    }

    fn decide_on(&mut self, desired: &Desired, at: u64) -> SpirePlan {
        let input = Input {
            ownership: &self.o,
            settings: &self.settings,
            desired,
            observed: &self.observed,
            now: self.t0 + Duration::from_secs(at),
            confirmed: self.confirmed.as_deref(),
        };
        spire_plan(&input, &mut self.memory)
    }

    /// Every write succeeds, as SPIRE would apply it.
    fn apply(&mut self, plan: &SpirePlan) {
        for entry in &plan.delete {
            self.observed.remove(&entry.id);
        }
        for entry in plan.create.iter().map(|e| &**e).chain(&plan.update) {
            let revision_number = self
                .observed
                .get(&entry.id)
                .map_or(0, |stored| stored.revision_number);
            let stored = Entry {
                revision_number,
                ..entry.clone()
            };
            self.observed.insert(entry.id.clone(), Arc::new(stored));
        }
    }

    fn writes(&mut self, plan: &SpirePlan, failures: &Failures) -> Vec<WorkloadWrite> {
        workload_writes(
            &self.desired,
            plan,
            &self.observed,
            failures,
            &mut self.memory,
            None,
            &|_| false,
        )
    }
}

fn ids<E: AsRef<Entry>>(entries: &[E]) -> Vec<&str> {
    entries.iter().map(|e| e.as_ref().id.as_str()).collect()
}

/// The plan's creates, as plain entries.
fn created(plan: &SpirePlan) -> Vec<Entry> {
    plan.create.iter().map(|e| Entry::clone(e)).collect()
}

fn whys(plan: &SpirePlan) -> Vec<(&str, &'static str)> {
    plan.pending
        .iter()
        .map(|p| (p.entry.id.as_str(), p.why.label()))
        .collect()
}

#[test]
fn converged_state_plans_nothing() {
    let mut w = World::new();
    let e = w.needs("a", "api", &["web"], "spiffe://td/p");
    w.in_spire(&e);
    let plan = w.decide(0);
    assert_eq!(plan.writes(), 0);
    assert!(plan.pending.is_empty());
    assert_eq!(plan.serving[&sa("a", "api")], e.id);
}

#[test]
fn a_missing_entry_is_created_and_serves_its_service_account() {
    let mut w = World::new();
    let e = w.needs("a", "api", &["web", "worker"], "spiffe://td/p");
    let plan = w.decide(0);
    assert_eq!(created(&plan), vec![e.clone()]);
    assert_eq!(plan.serving[&sa("a", "api")], e.id);
}

#[test]
fn mutable_fields_are_updated_in_place() {
    let mut w = World::new();
    let e = w.needs("a", "api", &["web"], "spiffe://td/p");
    w.in_spire(&Entry {
        x509_svid_ttl: 60,
        dns_names: vec!["old.example".into()],
        ..e.clone()
    });
    let plan = w.decide(0);
    assert_eq!(plan.update, vec![e]);
    assert!(plan.create.is_empty() && plan.delete.is_empty());
}

#[test]
fn a_parent_change_is_make_before_break() {
    let mut w = World::new();
    let old = rendered(&w.o, "a", "api", "spiffe://td/old");
    w.in_spire(&old);
    let new = w.needs("a", "api", &["web"], "spiffe://td/new");

    let plan = w.decide(0);
    assert_eq!(ids(&plan.create), vec![new.id.as_str()]);
    assert!(
        plan.delete.is_empty(),
        "nothing goes before its replacement exists"
    );
    assert_eq!(whys(&plan), vec![(old.id.as_str(), "transition")]);
    assert_eq!(plan.recheck, Some(w.t0 + Duration::from_secs(1)));
    w.apply(&plan);

    let plan = w.decide(1);
    assert!(
        plan.delete.is_empty(),
        "the replacement just appeared: grace starts"
    );
    assert_eq!(plan.recheck, Some(w.t0 + Duration::from_secs(1 + GRACE)));
    let plan = w.decide(GRACE);
    assert!(plan.delete.is_empty());
    let plan = w.decide(1 + GRACE);
    assert_eq!(ids(&plan.delete), vec![old.id.as_str()]);
}

#[test]
fn a_rejected_replacement_keeps_the_old_entry_and_is_not_resent() {
    let mut w = World::new();
    let old = rendered(&w.o, "a", "api", "spiffe://td/old");
    w.in_spire(&old);
    let new = w.needs("a", "api", &["web"], "spiffe://other.td/new");
    let plan = w.decide(0);
    assert_eq!(plan.create.len(), 1);
    // SPIRE refused it (the writer records that in memory).
    w.memory.rejected.insert(
        new.id.clone(),
        (new.clone(), "trust domain mismatch".into()),
    );
    for at in [1, 1000, 100_000] {
        let plan = w.decide(at);
        assert!(plan.create.is_empty(), "not resent");
        assert!(plan.delete.is_empty(), "the old entry stays");
        assert_eq!(
            plan.pending[0].why,
            Why::Transition {
                by: new.id.clone(),
                due: None
            }
        );
    }
    let plan = w.decide(2);
    let writes = w.writes(&plan, &Failures::new());
    let announce = writes[0].announce.first().expect("announced");
    assert_eq!(announce.reason, "RegistrationFailed");
    assert!(announce.note.contains("trust domain mismatch"));
}

#[test]
fn fixing_a_rejected_policy_creates_the_fixed_entry() {
    let mut w = World::new();
    let bad = w.needs("a", "api", &["web"], "spiffe://other.td/new");
    w.memory
        .rejected
        .insert(bad.id.clone(), (bad.clone(), "refused".into()));
    assert!(w.decide(0).create.is_empty());
    let good = w.needs("a", "api", &["web"], "spiffe://td/new");
    assert_eq!(created(&w.decide(1)), vec![good]);
}

#[test]
fn an_unrenderable_policy_holds_the_entries_it_had() {
    let mut w = World::new();
    let e = rendered(&w.o, "a", "api", "spiffe://td/p");
    w.in_spire(&e);
    w.account(
        "a",
        "api",
        &["web"],
        SaState::Invalid {
            policy: "p".into(),
            reason: "InvalidParentID",
            message: "bad".into(),
        },
    );
    let plan = w.decide(1_000_000);
    assert!(plan.delete.is_empty());
    assert_eq!(whys(&plan), vec![(e.id.as_str(), "held")]);
    assert_eq!(plan.recheck, None);
}

#[test]
fn selectors_in_doubt_hold_everything_but_orphans() {
    let mut w = World::new();
    let lost = rendered(&w.o, "a", "lost", "spiffe://td/p");
    let orphan = rendered(&w.o, "a", "gone", "spiffe://td/p");
    w.in_spire(&lost);
    w.in_spire(&orphan);
    w.account("a", "lost", &["web"], SaState::OutOfScope);
    w.desired.doubt.insert("typo".into());
    let plan = w.decide(SCOPE * 10);
    assert_eq!(ids(&plan.delete), vec![orphan.id.as_str()]);
    assert_eq!(whys(&plan), vec![(lost.id.as_str(), "held")]);
}

#[test]
fn scope_loss_waits_for_its_grace() {
    let mut w = World::new();
    let e = rendered(&w.o, "a", "api", "spiffe://td/p");
    w.in_spire(&e);
    w.account("a", "api", &["web"], SaState::OutOfScope);
    let plan = w.decide(0);
    assert_eq!(whys(&plan), vec![(e.id.as_str(), "scope_loss")]);
    assert_eq!(plan.recheck, Some(w.t0 + Duration::from_secs(SCOPE)));
    assert!(w.decide(SCOPE - 1).delete.is_empty());
    assert_eq!(ids(&w.decide(SCOPE).delete), vec![e.id.as_str()]);
}

#[test]
fn coming_back_in_scope_during_the_grace_costs_nothing_and_resets_the_clock() {
    let mut w = World::new();
    let e = rendered(&w.o, "a", "api", "spiffe://td/p");
    w.in_spire(&e);
    w.account("a", "api", &["web"], SaState::OutOfScope);
    w.decide(0);
    w.needs("a", "api", &["web"], "spiffe://td/p");
    let plan = w.decide(SCOPE / 2);
    assert_eq!(plan.writes(), 0, "no churn");
    assert!(plan.pending.is_empty());
    w.account("a", "api", &["web"], SaState::OutOfScope);
    assert!(
        w.decide(SCOPE + 1).delete.is_empty(),
        "a new scope loss starts a new grace"
    );
}

#[test]
fn an_entry_nothing_runs_as_any_more_is_deleted_at_once() {
    let mut w = World::new();
    let e = rendered(&w.o, "a", "api", "spiffe://td/p");
    w.in_spire(&e);
    w.deleting("a", "web", "api");
    assert_eq!(ids(&w.decide(0).delete), vec![e.id.as_str()]);
}

#[test]
fn a_service_account_change_is_a_transition_not_an_orphan() {
    let mut w = World::new();
    let old = w.needs("a", "old-sa", &["web"], "spiffe://td/p");
    w.in_spire(&old);
    w.decide(0);
    // The Deployment now runs as new-sa; nothing runs as old-sa.
    w.desired.service_accounts.clear();
    let new = w.needs("a", "new-sa", &["web"], "spiffe://td/p");
    let plan = w.decide(1);
    assert_eq!(created(&plan), vec![new.clone()]);
    assert!(plan.delete.is_empty());
    w.apply(&plan);
    assert!(w.decide(2).delete.is_empty());
    assert_eq!(ids(&w.decide(2 + GRACE).delete), vec![old.id.as_str()]);
}

fn mass_scope_loss(w: &mut World, lost: usize, kept: usize) -> Vec<Entry> {
    let mut lost_entries = Vec::new();
    for i in 0..lost {
        let e = rendered(&w.o, "a", &format!("lost{i}"), "spiffe://td/p");
        w.in_spire(&e);
        w.account(
            "a",
            &format!("lost{i}"),
            &[&format!("d{i}")],
            SaState::OutOfScope,
        );
        lost_entries.push(e);
    }
    for i in 0..kept {
        let e = w.needs(
            "b",
            &format!("kept{i}"),
            &[&format!("k{i}")],
            "spiffe://td/p",
        );
        w.in_spire(&e);
    }
    lost_entries
}

#[test]
fn the_brake_holds_mass_scope_loss_until_confirmed() {
    let mut w = World::new();
    let lost = mass_scope_loss(&mut w, 5, 5);
    w.decide(0);
    let plan = w.decide(SCOPE);
    assert!(plan.delete.is_empty());
    let brake = plan.brake.clone().expect("brake engaged");
    assert_eq!((brake.count, brake.total), (5, 10));
    assert!(plan.pending.iter().all(|p| p.why == Why::Brake));
    assert_eq!(brake.token, brake_token(lost.iter().map(|e| e.id.as_str())));
    let writes = w.writes(&plan, &Failures::new());
    let lost_writes: Vec<_> = writes.iter().filter(|x| &*x.key.namespace == "a").collect();
    assert_eq!(lost_writes.len(), 5);
    assert!(lost_writes.iter().all(|x| {
        x.change.is_empty() && x.announce.iter().any(|a| a.note.contains("confirmation"))
    }));

    w.confirmed = Some(brake.token);
    let plan = w.decide(SCOPE + 5);
    assert_eq!(plan.delete.len(), 5);
    assert!(plan.brake.is_none());
}

#[test]
fn a_confirmation_covers_only_the_set_it_was_given_for() {
    let mut w = World::new();
    mass_scope_loss(&mut w, 5, 5);
    w.decide(0);
    let token = w.decide(SCOPE).brake.expect("engaged").token;
    w.confirmed = Some(token.clone());
    // One more service account falls out of scope before the operator's confirmation lands.
    let extra = rendered(&w.o, "a", "late", "spiffe://td/p");
    w.in_spire(&extra);
    w.account("a", "late", &["late"], SaState::OutOfScope);
    w.decide(1);
    let plan = w.decide(SCOPE + 1);
    let brake = plan.brake.expect("still engaged");
    assert_ne!(brake.token, token);
    assert!(plan.delete.is_empty());
}

#[test]
fn few_scope_loss_deletions_pass_the_brake() {
    let mut w = World::new();
    mass_scope_loss(&mut w, 3, 1);
    w.decide(0);
    let plan = w.decide(SCOPE);
    assert_eq!(plan.delete.len(), 3, "3 is not more than --brake-count");
    assert!(plan.brake.is_none());
    let mut w = World::new();
    mass_scope_loss(&mut w, 4, 20);
    w.decide(0);
    assert_eq!(
        w.decide(SCOPE).delete.len(),
        4,
        "4 of 24 is under --brake-fraction"
    );
}

#[test]
fn an_equivalent_foreign_entry_is_reported_once_and_not_recreated() {
    let mut w = World::new();
    let e = w.needs("a", "api", &["web"], "spiffe://td/p");
    let theirs = Entry {
        id: "their-uuid".into(),
        hint: String::new(),
        ..e.clone()
    };
    w.memory.foreign.insert(e.id.clone(), theirs.clone());
    let plan = w.decide(0);
    assert_eq!(plan.writes(), 0, "not sent again every sync");
    assert_eq!(plan.serving[&sa("a", "api")], theirs.id);
    let first = w.writes(&plan, &Failures::new());
    assert_eq!(
        first[0].announce.first().map(|a| a.reason),
        Some("EquivalentEntryExists")
    );
    let plan = w.decide(1);
    let again = w.writes(&plan, &Failures::new());
    assert!(again.iter().all(|w| w.announce.is_empty()), "once");
}

#[test]
fn adoption_takes_the_foreign_entry_over_in_place() {
    let mut w = World::new();
    w.settings.adopt = true;
    let e = w.needs("a", "api", &["web"], "spiffe://td/p");
    let theirs = Entry {
        id: "their-uuid".into(),
        hint: String::new(),
        x509_svid_ttl: 60,
        ..e.clone()
    };
    w.memory.foreign.insert(e.id.clone(), theirs.clone());
    let plan = w.decide(0);
    assert!(plan.create.is_empty() && plan.delete.is_empty());
    assert_eq!(plan.update.len(), 1);
    let adopted = &plan.update[0];
    assert_eq!(adopted.id, theirs.id, "SPIRE IDs are immutable: kept");
    assert_eq!(adopted.hint, "spiffe-registrar/c/adopted");
    assert_eq!(adopted.x509_svid_ttl, 3600, "and brought to policy");
    assert!(w.o.is_ours(adopted));
    w.apply(&plan);
    let plan = w.decide(1);
    assert_eq!(
        plan.writes(),
        0,
        "now ours, matched by (SPIFFE ID, parent, selectors)"
    );
    assert_eq!(plan.serving[&sa("a", "api")], theirs.id);
}

#[test]
fn a_renamed_cluster_re_hints_its_old_entries_in_place_and_drops_unneeded_ones() {
    let mut w = World::new();
    let old_owner = Ownership::new("old").expect("valid");
    let kept = rendered(&old_owner, "a", "api", "spiffe://td/p");
    let unneeded = rendered(&old_owner, "a", "gone", "spiffe://td/p");
    w.o = Ownership::new("new")
        .expect("valid")
        .with_previous(&["old".to_string()])
        .expect("valid");
    w.in_spire(&kept);
    w.in_spire(&unneeded);
    w.needs("a", "api", &["web"], "spiffe://td/p");
    let plan = w.decide(0);
    assert!(
        plan.create.is_empty(),
        "SPIRE would refuse a second equivalent entry"
    );
    assert_eq!(ids(&plan.update), vec![kept.id.as_str()]);
    assert_eq!(plan.update[0].hint, "spiffe-registrar/new/adopted");
    assert_eq!(ids(&plan.delete), vec![unneeded.id.as_str()]);
}

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
fn brake_tokens_ignore_order() {
    assert_eq!(
        brake_token(["a", "b"].into_iter()),
        brake_token(["b", "a"].into_iter())
    );
    assert_ne!(
        brake_token(["a", "b"].into_iter()),
        brake_token(["a"].into_iter())
    );
}

#[test]
fn unknown_selector_shapes_of_ours_are_orphans() {
    let mut w = World::new();
    let odd = Entry {
        selectors: vec![Selector::new("unix", "uid:0")],
        ..rendered(&w.o, "a", "x", "spiffe://td/p")
    };
    w.in_spire(&odd);
    assert_eq!(ids(&w.decide(0).delete), vec![odd.id.as_str()]);
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
fn an_entry_of_ours_edited_behind_our_back_is_replaced() {
    let mut w = World::new();
    let e = w.needs("a", "api", &["web"], "spiffe://td/p");
    let tampered = Entry {
        selectors: vec![Selector::new("k8s", "ns:other")],
        ..e.clone()
    };
    w.in_spire(&tampered);
    let plan = w.decide(0);
    assert_eq!(plan.delete, vec![tampered]);
    assert_eq!(created(&plan), vec![e]);
}

#[test]
fn a_failed_write_is_counted_and_announced_once_if_a_later_sync_sees_it_landed() {
    use crate::controller::writer::FailedWrite;
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

impl World {
    /// Decides as a sync of `accounts` alone would: desired state derived for them only.
    fn decide_scoped(&mut self, at: u64, accounts: &[(&str, &str)]) -> SpirePlan {
        let scope: BTreeSet<SaKey> = accounts.iter().map(|(ns, name)| sa(ns, name)).collect();
        let mut desired = self.desired.clone();
        desired
            .service_accounts
            .retain(|key, _| scope.contains(key));
        desired
            .workloads
            .retain(|_, w| scope.contains(&w.service_account));
        desired.scope = Some(scope);
        self.decide_on(&desired, at)
    }
}

#[test]
fn a_scoped_sync_decides_for_its_service_accounts_alone() {
    let mut w = World::new();
    let served = w.needs("a", "x", &["web"], "spiffe://td/p");
    w.in_spire(&served);
    // Nothing runs as a/y or a/z any more: a full sync deletes both entries.
    let elsewhere = rendered(&w.o, "a", "y", "spiffe://td/p");
    let orphan = rendered(&w.o, "a", "z", "spiffe://td/p");
    w.in_spire(&elsewhere);
    w.in_spire(&orphan);
    let fresh = w.needs("b", "new", &["api"], "spiffe://td/p");

    let plan = w.decide_scoped(0, &[("a", "x"), ("a", "z"), ("b", "new")]);
    assert_eq!(created(&plan), vec![fresh], "its missing entry is created");
    assert_eq!(
        ids(&plan.delete),
        vec![orphan.id.as_str()],
        "only its own orphan goes: a/y was not looked at"
    );
    assert!(plan.pending.is_empty());
    assert_eq!(plan.serving.len(), 2);
    let full = w.decide(0);
    assert_eq!(
        ids(&full.delete),
        {
            let mut both = vec![orphan.id.as_str(), elsewhere.id.as_str()];
            both.sort_unstable();
            both
        },
        "the full sync that follows sees a/y too"
    );
}

#[test]
fn a_scoped_sync_keeps_the_clocks_of_what_it_did_not_look_at() {
    let mut w = World::new();
    let lost = rendered(&w.o, "a", "lost", "spiffe://td/p");
    w.in_spire(&lost);
    w.account("a", "lost", &["web"], SaState::OutOfScope);
    let other = w.needs("a", "other", &["api"], "spiffe://td/p");
    w.in_spire(&other);
    assert_eq!(whys(&w.decide(0)), vec![(lost.id.as_str(), "scope_loss")]);

    let scoped = w.decide_scoped(SCOPE / 2, &[("a", "other")]);
    assert_eq!(scoped.writes(), 0);
    assert!(
        scoped.pending.is_empty(),
        "a scoped plan holds only its own pending deletions"
    );
    assert_eq!(
        ids(&w.decide(SCOPE).delete),
        vec![lost.id.as_str()],
        "the grace that started at 0 is not restarted by a sync that did not look at it"
    );
}

#[test]
fn a_service_account_change_seen_by_a_scoped_sync_is_a_transition() {
    let mut w = World::new();
    let old = w.needs("a", "old-sa", &["web"], "spiffe://td/p");
    let bystander = w.needs("b", "api", &["api"], "spiffe://td/p");
    w.in_spire(&old);
    w.in_spire(&bystander);
    w.decide(0);
    // web now runs as new-sa: its watch event marks both accounts changed.
    w.desired.service_accounts.remove(&sa("a", "old-sa"));
    let new = w.needs("a", "new-sa", &["web"], "spiffe://td/p");
    let plan = w.decide_scoped(1, &[("a", "old-sa"), ("a", "new-sa")]);
    assert_eq!(created(&plan), vec![new.clone()]);
    assert!(plan.delete.is_empty(), "make-before-break");
    w.apply(&plan);
    assert!(w.decide_scoped(2, &[("a", "new-sa")]).delete.is_empty());
    let later = w.decide(2 + GRACE);
    assert_eq!(ids(&later.delete), vec![old.id.as_str()]);
    assert_eq!(
        later.serving[&sa("b", "api")],
        bystander.id,
        "the bystander's slot survived the scoped syncs"
    );
}

mod node_alias;
