//! Node aliases in the SPIRE plan (invariant 11: entries reach agents; the alias exists before
//! any entry that hangs from it and outlives the last one).

use super::*;
use crate::spire::node_alias::is_node_alias;

/// A world whose ownership names the node alias after the k8s_psat cluster `psat`.
fn world(psat: &str) -> World {
    let mut w = World::new();
    w.o = w.o.with_node_alias_cluster(psat).expect("valid psat name");
    w
}

fn alias_of(w: &World) -> Entry {
    let id = w.o.node_alias_id("td");
    w.o.node_alias_for(&id).expect("our alias").normalize()
}

#[test]
fn an_entry_under_the_alias_is_created_after_the_alias_in_one_plan() {
    let mut w = world("bed");
    let parent = w.o.node_alias_id("td");
    let e = w.needs("a", "api", &["web"], &parent);
    let plan = w.decide(0);
    assert_eq!(created(&plan), vec![alias_of(&w), e.clone()], "alias first");
    assert_eq!(plan.serving[&sa("a", "api")], e.id);
    w.apply(&plan);
    let again = w.decide(1);
    assert_eq!(again.writes(), 0, "converged: {again:?}");
    assert!(again.pending.is_empty());
}

#[test]
fn an_explicit_parent_needs_no_alias() {
    let mut w = world("bed");
    w.needs("a", "api", &["web"], "spiffe://td/p");
    let plan = w.decide(0);
    assert!(!created(&plan).iter().any(is_node_alias));
}

#[test]
fn a_wiped_alias_is_created_again_under_its_entries() {
    let mut w = world("bed");
    let parent = w.o.node_alias_id("td");
    let e = w.needs("a", "api", &["web"], &parent);
    w.in_spire(&e);
    let plan = w.decide(0);
    assert_eq!(created(&plan), vec![alias_of(&w)]);
    assert!(plan.delete.is_empty());
}

#[test]
fn an_alias_edited_behind_our_back_is_restored_in_place() {
    let mut w = world("bed");
    let parent = w.o.node_alias_id("td");
    let e = w.needs("a", "api", &["web"], &parent);
    w.in_spire(&e);
    let alias = alias_of(&w);
    w.in_spire(&Entry {
        x509_svid_ttl: 60,
        ..alias.clone()
    });
    let plan = w.decide(0);
    assert_eq!(plan.update, vec![alias.clone()]);
    assert!(plan.create.is_empty() && plan.delete.is_empty());
    w.in_spire(&Entry {
        selectors: vec![Selector::new("k8s_psat", "cluster:intruder")],
        ..alias.clone()
    });
    let plan = w.decide(1);
    assert_eq!(ids(&plan.delete), vec![alias.id.as_str()], "replaced");
    assert_eq!(created(&plan), vec![alias]);
}

#[test]
fn a_new_psat_name_moves_entries_make_before_break_and_the_old_alias_goes_last() {
    let mut w = world("old");
    let old_parent = w.o.node_alias_id("td");
    let old = w.needs("a", "api", &["web"], &old_parent);
    let old_alias = alias_of(&w);
    w.in_spire(&old_alias);
    w.in_spire(&old);

    w.o = w.o.clone().with_node_alias_cluster("new").expect("valid");
    let new_parent = w.o.node_alias_id("td");
    let new = w.needs("a", "api", &["web"], &new_parent);
    let new_alias = alias_of(&w);
    let plan = w.decide(0);
    assert_eq!(created(&plan), vec![new_alias.clone(), new.clone()]);
    assert!(plan.delete.is_empty(), "nothing goes yet: {plan:?}");
    let mut pending = whys(&plan);
    pending.sort_unstable();
    let mut expected = vec![
        (old_alias.id.as_str(), "held"),
        (old.id.as_str(), "transition"),
    ];
    expected.sort_unstable();
    assert_eq!(
        pending, expected,
        "the old alias is held, the old entry in transition"
    );
    w.apply(&plan);

    // The grace runs from the replacement's appearance in SPIRE.
    let plan = w.decide(1);
    assert!(plan.delete.is_empty() && plan.create.is_empty(), "{plan:?}");
    // After the grace the old entry goes; its alias is held until SPIRE no longer has it.
    let plan = w.decide(GRACE + 1);
    assert_eq!(ids(&plan.delete), vec![old.id.as_str()]);
    assert_eq!(whys(&plan), vec![(old_alias.id.as_str(), "held")]);
    let soon = w.t0 + Duration::from_secs(GRACE + 2);
    assert_eq!(plan.recheck, Some(soon), "comes back for the alias");
    w.apply(&plan);

    let plan = w.decide(GRACE + 2);
    assert_eq!(ids(&plan.delete), vec![old_alias.id.as_str()]);
    assert!(plan.pending.is_empty());
    w.apply(&plan);
    assert_eq!(
        w.observed.keys().collect::<BTreeSet<_>>(),
        [&new_alias.id, &new.id].into_iter().collect()
    );
}

#[test]
fn an_alias_is_never_deleted_while_an_entry_hangs_from_it() {
    // The policy moved to an explicit parent, but the workload's old entry is held (its
    // policy cannot render now): the alias stays with it.
    let mut w = world("bed");
    let parent = w.o.node_alias_id("td");
    let held = rendered(&w.o, "a", "api", &parent);
    w.in_spire(&held);
    let alias = alias_of(&w);
    w.in_spire(&alias);
    w.account(
        "a",
        "api",
        &["web"],
        SaState::Invalid {
            policy: "p".into(),
            reason: "InvalidSpiffeIDTemplate",
            message: "bad".into(),
        },
    );
    for at in [0, GRACE * 100] {
        let plan = w.decide(at);
        assert!(plan.delete.is_empty(), "{plan:?}");
        assert!(whys(&plan).contains(&(alias.id.as_str(), "held")));
    }
}

#[test]
fn an_alias_nothing_needs_is_deleted_by_a_full_sync_only() {
    let mut w = world("bed");
    let alias = alias_of(&w);
    w.in_spire(&alias);
    let e = w.needs("a", "api", &["web"], "spiffe://td/p");
    w.in_spire(&e);
    let scoped = w.decide_scoped(0, &[("a", "api")]);
    assert!(scoped.delete.is_empty(), "a scoped sync lets no alias go");
    let full = w.decide(0);
    assert_eq!(ids(&full.delete), vec![alias.id.as_str()]);
}
