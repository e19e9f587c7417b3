//! The SPIRE plan: what is created, updated, deleted and kept back (DESIGN invariants 2, 3,
//! 4 and 7), and the order its writes go out in.

use super::*;

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
fn writes_go_out_replaced_first_then_creates_in_chunks_then_updates_and_deletes() {
    let mut w = World::new();
    let a = w.needs("a", "api", &["api"], "spiffe://td/parent");
    let b = w.needs("a", "web", &["web"], "spiffe://td/parent");
    let c = w.needs("a", "db", &["db"], "spiffe://td/parent");
    let gone = rendered(&w.o, "gone", "old", "spiffe://td/parent");
    let tampered_a = Entry {
        spiffe_id: "spiffe://td/edited-by-hand".into(),
        ..a.clone()
    };
    let renewed_b = Entry {
        x509_svid_ttl: 60,
        ..b.clone()
    };
    for entry in [&tampered_a, &renewed_b, &gone] {
        w.in_spire(entry);
    }
    let plan = w.decide(0);
    // (kind, created, updated, deleted IDs)
    type Written = (StageKind, Vec<String>, Vec<String>, Vec<String>);
    let stages: Vec<Written> = plan
        .stages(1)
        .into_iter()
        .map(|stage| {
            let writes = stage.writes;
            let id = |e: &Entry| e.id.clone();
            (
                stage.kind,
                writes.create.iter().map(|e| id(e)).collect(),
                writes.update.iter().map(id).collect(),
                writes.delete.iter().map(id).collect(),
            )
        })
        .collect();
    // In service-account order: a/api, then a/db.
    let creates = [a.id.clone(), c.id.clone()];
    let none = Vec::<String>::new;
    assert_eq!(
        stages,
        vec![
            (
                StageKind::DeleteReplaced,
                none(),
                none(),
                vec![a.id.clone()]
            ),
            (StageKind::Create, vec![creates[0].clone()], none(), none()),
            (StageKind::Create, vec![creates[1].clone()], none(), none()),
            (
                StageKind::UpdateAndDelete,
                none(),
                vec![b.id.clone()],
                vec![gone.id.clone()]
            ),
        ],
        "the tampered entry makes room for its replacement; the orphan goes after every create"
    );
    assert!(SpirePlan::default().stages(200).is_empty());
}
