//! The node aliases of one SPIRE plan: the alias every entry hanging from it needs is created
//! before them (first in the plan's creates), and an alias no longer wanted is deleted only
//! once no entry of ours hangs from it (invariant 11: it outlives the last one).
//!
//! ```text
//! desired entries ─parent is our alias?─▶ wanted aliases ─▶ create first | update | present
//! our aliases in SPIRE, not wanted ──────▶ children left? ─▶ held (recheck) | delete
//! ```

use super::input::Input;
use super::memory::Memory;
use super::plan::{Pending, SpirePlan, Why, triple};
use crate::controller::desired::SaState;
use crate::spire::Entry;
use crate::spire::node_alias::is_node_alias;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How soon to look again at an alias whose last children this plan deletes.
const AFTER_CHILDREN: Duration = Duration::from_secs(1);

/// Adds the node-alias writes to `plan` (after the workload entries are decided): the wanted
/// aliases kept or created first, then, in a full sync, the others let go once bare.
pub(super) fn plan_node_aliases(input: &Input, memory: &Memory, plan: &mut SpirePlan) {
    let ours: Vec<&Entry> = input
        .observed
        .values()
        .map(|e| &**e)
        .filter(|e| is_node_alias(e))
        .collect();
    let kept = keep_or_create(input, memory, &ours, plan);
    if !input.desired.coverage().is_full() {
        // A scoped derive does not know every entry's parent: no alias is let go.
        return;
    }
    let unwanted: Vec<&Entry> = ours
        .into_iter()
        .filter(|e| !kept.contains(e.id.as_str()))
        .collect();
    let_go_when_bare(input, &unwanted, plan);
}

/// Keeps (updating its mutable fields) or creates, first in the plan, each alias the desired
/// entries hang from; returns the IDs of the aliases kept in SPIRE.
fn keep_or_create<'o>(
    input: &Input,
    memory: &Memory,
    ours: &[&'o Entry],
    plan: &mut SpirePlan,
) -> BTreeSet<&'o str> {
    let mut kept = BTreeSet::new();
    let mut creates = Vec::new();
    for alias in wanted_aliases(input).values() {
        let tampered = input
            .observed
            .get(&alias.id)
            .filter(|e| triple(e) != triple(alias));
        // (No longer alias-shaped, a full sync may already delete it as an orphan.)
        if let Some(tampered) = tampered.filter(|t| !plan.delete.iter().any(|d| d.id == t.id)) {
            plan.delete.push(Entry::clone(tampered));
        }
        // Under our ID, or an alias of ours with the same triple under another ID (a previous
        // cluster name): SPIRE holds one entry per triple.
        let existing = ours
            .iter()
            .copied()
            .find(|e| (e.id == alias.id && tampered.is_none()) || triple(e) == triple(alias));
        if let Some(existing) = existing {
            kept.insert(existing.id.as_str());
            let wanted = Entry {
                id: existing.id.clone(),
                hint: input.ownership.hint_for(&existing.id).to_string(),
                ..alias.clone()
            };
            if existing.mutable_fields_differ(&wanted) {
                plan.update.push(wanted);
            }
        } else if memory.foreign.contains_key(&alias.id) {
            // Another writer's equivalent alias serves the agents; it is not ours to touch.
        } else if !memory
            .rejected
            .get(&alias.id)
            .is_some_and(|(refused, _)| refused == alias)
        {
            creates.push(Arc::new(alias.clone()));
        }
    }
    // Aliases first: no entry of ours is ever in SPIRE before the parent it hangs from.
    plan.create.splice(0..0, creates);
    kept
}

/// Deletes each unwanted alias from which no entry of ours hangs; holds the others, and comes
/// back soon for one whose last children this plan deletes.
fn let_go_when_bare(input: &Input, unwanted: &[&Entry], plan: &mut SpirePlan) {
    let deleting: BTreeSet<&str> = plan.delete.iter().map(|e| e.id.as_str()).collect();
    let creating_under: BTreeSet<&str> = plan.create.iter().map(|e| e.parent_id.as_str()).collect();
    let mut delete = Vec::new();
    let mut held_for_children = false;
    for alias in unwanted.iter().copied() {
        if deleting.contains(alias.id.as_str()) {
            continue;
        }
        let parent = alias.spiffe_id.as_str();
        let children: Vec<&Entry> = input
            .observed
            .values()
            .map(|e| &**e)
            .filter(|e| !is_node_alias(e) && e.parent_id == parent)
            .collect();
        if children.is_empty() && !creating_under.contains(parent) {
            delete.push(alias.clone());
            continue;
        }
        // Children this plan deletes still count: the alias goes in a later sync, after them.
        held_for_children |= children
            .iter()
            .all(|child| deleting.contains(child.id.as_str()))
            && !creating_under.contains(parent);
        plan.pending.push(Pending {
            entry: alias.clone(),
            why: Why::Held(format!(
                "node alias: {} entries of ours still hang from it",
                children.len()
            )),
        });
    }
    plan.delete.extend(delete);
    if held_for_children {
        let soon = input.now + AFTER_CHILDREN;
        plan.recheck = Some(plan.recheck.map_or(soon, |at: Instant| at.min(soon)));
    }
}

/// Our node alias for each trust domain whose entries this derive wants parented to it.
fn wanted_aliases(input: &Input) -> BTreeMap<String, Entry> {
    let mut wanted = BTreeMap::new();
    let mut parents_seen = BTreeSet::new();
    for account in input.desired.service_accounts.values() {
        let SaState::Needs { entry, .. } = &account.state else {
            continue;
        };
        if !parents_seen.insert(entry.parent_id.as_str()) {
            continue;
        }
        if let Some(alias) = input.ownership.node_alias_for(&entry.parent_id) {
            wanted.insert(alias.id.clone(), alias.normalize());
        }
    }
    wanted
}
