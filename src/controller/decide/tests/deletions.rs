//! Deletions: orphans at once, transitions after their grace (make-before-break), scope loss
//! after its grace and behind the brake, nothing while in doubt (DESIGN invariants 2, 3, 4).

use super::*;

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
