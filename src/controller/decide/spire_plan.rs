//! The SPIRE half of a decision: which entries to create, update and delete, and which of
//! ours to keep back, and why.
//!
//! ```text
//! desired accounts ─ serve_accounts ─▶ create / update / serving
//!                    track_moves ────▶ which entry each Deployment moved from
//! our other entries ─ classify_unserved ─▶ delete now | pending (transition, scope loss, held)
//!                    brake ──────────▶ mass scope loss held until confirmed
//!                    recheck, node aliases
//! ```

use super::input::{DecideSettings, Input, Observed};
use super::memory::Memory;
use super::node_alias;
use super::plan::{Brake, Pending, SpirePlan, Triple, Why, brake_token, triple};
use crate::controller::desired::{Desired, SaState};
use crate::keys::SaKey;
use crate::spire::Entry;
use crate::spire::node_alias::is_node_alias;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Decides the SPIRE writes of one sync.
pub fn spire_plan(input: &Input, memory: &mut Memory) -> SpirePlan {
    let Input {
        settings,
        desired,
        observed,
        now,
        confirmed,
        ownership: _,
    } = input;
    let mut plan = SpirePlan::default();
    // A scoped derive decides for its service accounts' entries only (an entry serving the
    // same triple has the same selectors, so it is among them).
    let coverage = desired.coverage();
    let covered: Vec<&Entry> = observed
        .values()
        .map(|e| &**e)
        .filter(|e| coverage.covers(e))
        .collect();
    serve_accounts(input, memory, &covered, &mut plan);
    track_moves(desired, &plan.serving, observed, memory);
    let unserved = classify_unserved(input, memory, &covered, &plan);
    plan.delete.extend(unserved.delete);
    plan.pending.extend(unserved.pending);
    if coverage.is_full() {
        forget_what_is_gone(memory, observed, &plan.serving, &unserved.out_of_scope);
    } else {
        // A scoped sync looked at its own entries only (all in SPIRE, so remembered as
        // present): of the rest, memory is left as it is.
        for entry in covered
            .iter()
            .filter(|e| !unserved.out_of_scope.contains(&e.id))
        {
            memory.out_of_scope_since.remove(&entry.id);
        }
    }
    brake(
        settings,
        observed.len(),
        unserved.scope_lost_due,
        *confirmed,
        &mut plan,
    );
    plan.recheck = recheck(&plan, *now);
    node_alias::plan_node_aliases(input, memory, &mut plan);
    plan
}

/// For every service account that needs an entry, finds the entry that serves it (ours
/// under its ID, ours under another ID with the same triple, or another writer's) or plans
/// its creation.
fn serve_accounts(input: &Input, memory: &mut Memory, covered: &[&Entry], plan: &mut SpirePlan) {
    // SPIRE keeps one entry per (SPIFFE ID, parent, selectors): an entry of ours under another
    // ID (adopted, or from a previous cluster name) serves the same identity.
    let by_triple: BTreeMap<Triple, &Entry> = covered.iter().map(|e| (triple(e), *e)).collect();
    for (sa, account) in &input.desired.service_accounts {
        let SaState::Needs { policy, entry } = &account.state else {
            continue;
        };
        memory.remember_policy(&entry.id, policy);
        // An entry under our ID whose SPIFFE ID, parent or selectors were edited behind our
        // back serves no one correctly: it is replaced (deleted first, see `stages`).
        let tampered = input
            .observed
            .get(&entry.id)
            .map(|e| &**e)
            .filter(|e| triple(e) != triple(entry));
        if let Some(tampered) = tampered {
            plan.delete.push(tampered.clone());
        }
        let existing = input
            .observed
            .get(&entry.id)
            .map(|e| &**e)
            .filter(|_| tampered.is_none())
            .or_else(|| by_triple.get(&triple(entry)).copied());
        if let Some(serving) = serve_account(input, memory, policy, entry, existing, plan) {
            plan.serving.insert(sa.clone(), serving);
        }
    }
}

/// The ID of the entry that serves an account needing `entry`, given the equivalent entry of
/// ours SPIRE holds (`existing`); `None` while SPIRE refuses exactly this entry.
fn serve_account(
    input: &Input,
    memory: &mut Memory,
    policy: &str,
    entry: &Arc<Entry>,
    existing: Option<&Entry>,
    plan: &mut SpirePlan,
) -> Option<String> {
    let (ownership, now) = (input.ownership, input.now);
    if let Some(existing) = existing {
        let wanted = Entry {
            id: existing.id.clone(),
            hint: ownership.hint_for(&existing.id).to_string(),
            ..(**entry).clone()
        };
        if existing.mutable_fields_differ(&wanted) {
            plan.update.push(wanted);
        }
        memory.remember_policy(&existing.id, policy);
        memory
            .present_since
            .entry(existing.id.clone())
            .or_insert(now);
        return Some(existing.id.clone());
    }
    if let Some(theirs) = memory.foreign.get(&entry.id).map(|e| e.id.clone()) {
        // The workload has an identity (theirs). Adopt it in place, or leave it alone.
        memory.present_since.entry(theirs.clone()).or_insert(now);
        if input.settings.adopt {
            plan.update.push(Entry {
                id: theirs.clone(),
                hint: ownership.hint_for(&theirs).to_string(),
                ..(**entry).clone()
            });
            memory.remember_policy(&theirs, policy);
        }
        return Some(theirs);
    }
    if memory
        .rejected
        .get(&entry.id)
        .is_some_and(|(refused, _)| refused == &**entry)
    {
        // SPIRE said no to exactly this; asking again cannot help.
        return None;
    }
    memory.rejected.remove(&entry.id);
    plan.create.push(entry.clone());
    Some(entry.id.clone())
}

/// What becomes of our entries that serve no service account.
#[derive(Default)]
struct Unserved {
    /// Deleted now: orphans and transitions whose grace is over.
    delete: Vec<Entry>,
    pending: Vec<Pending>,
    /// Due scope-loss deletions, which the brake may still hold.
    scope_lost_due: Vec<Entry>,
    /// Entries whose service account is out of scope (their clocks keep running).
    out_of_scope: BTreeSet<String>,
}

/// Classifies every covered entry of ours that serves no service account by what SPIRE says
/// it is for (its `k8s:ns`/`k8s:sa` selectors), never by what a Deployment's annotations say.
fn classify_unserved(
    input: &Input,
    memory: &mut Memory,
    covered: &[&Entry],
    plan: &SpirePlan,
) -> Unserved {
    let serving: BTreeSet<&String> = plan.serving.values().collect();
    let replaced: BTreeSet<&String> = plan.delete.iter().map(|e| &e.id).collect();
    let mut unserved = Unserved::default();
    // Node aliases serve agents, not service accounts: `node_alias` decides them.
    let candidates = covered
        .iter()
        .filter(|e| !serving.contains(&e.id) && !replaced.contains(&e.id) && !is_node_alias(e));
    for entry in candidates {
        let Some(why) = why_kept(input, memory, entry, plan, &serving, &mut unserved) else {
            // Nothing runs as it: the finalizer path, immediate.
            unserved.delete.push((*entry).clone());
            continue;
        };
        let why = match (&why, input.desired.doubt.first()) {
            (Why::Held(_), _) | (_, None) => why,
            (_, Some(policy)) => Why::Held(format!(
                "the selectors of policy {policy} cannot be evaluated; nothing is deleted until it is fixed"
            )),
        };
        match why {
            Why::Transition { due: Some(due), .. } if input.now >= due => {
                unserved.delete.push((*entry).clone());
            }
            Why::ScopeLoss { due } if input.now >= due => {
                unserved.scope_lost_due.push((*entry).clone());
            }
            why => unserved.pending.push(Pending {
                entry: (*entry).clone(),
                why,
            }),
        }
    }
    unserved
}

/// Why `entry` (serving no one) is kept, or `None` when nothing runs as it any more.
fn why_kept(
    input: &Input,
    memory: &mut Memory,
    entry: &Entry,
    plan: &SpirePlan,
    serving: &BTreeSet<&String>,
    unserved: &mut Unserved,
) -> Option<Why> {
    let sa = SaKey::of_entry(entry);
    let account = sa
        .as_ref()
        .and_then(|sa| input.desired.service_accounts.get(sa));
    let transition = |by: &String| {
        let due = memory
            .present_since
            .get(by)
            .filter(|_| input.observed.contains_key(by) || is_foreign(memory, by))
            .map(|since| *since + input.settings.transition_grace);
        Why::Transition {
            by: by.clone(),
            due,
        }
    };
    Some(match account.map(|a| &a.state) {
        // Its service account needs another entry: kept until that one has been in SPIRE
        // for the grace. If SPIRE refused it, nothing serves the account, and this stays.
        Some(SaState::Needs { entry: wanted, .. }) => {
            let by = sa
                .as_ref()
                .and_then(|sa| plan.serving.get(sa))
                .unwrap_or(&wanted.id);
            transition(by)
        }
        Some(SaState::Invalid {
            policy, message, ..
        }) => Why::Held(format!("policy {policy} cannot render it: {message}")),
        Some(SaState::OutOfScope) => {
            unserved.out_of_scope.insert(entry.id.clone());
            let since = *memory
                .out_of_scope_since
                .entry(entry.id.clone())
                .or_insert(input.now);
            Why::ScopeLoss {
                due: since + input.settings.scope_loss_grace,
            }
        }
        // A Deployment moved from it to another entry (service account change).
        None => transition(
            memory
                .superseded
                .get(&entry.id)
                .filter(|by| serving.contains(by))?,
        ),
    })
}

/// After a full sync: forgets what no longer exists or applies.
fn forget_what_is_gone(
    memory: &mut Memory,
    observed: &Observed,
    serving: &BTreeMap<SaKey, String>,
    out_of_scope: &BTreeSet<String>,
) {
    let serving: BTreeSet<&String> = serving.values().collect();
    memory
        .out_of_scope_since
        .retain(|id, _| out_of_scope.contains(id));
    memory
        .present_since
        .retain(|id, _| observed.contains_key(id) || serving.contains(id));
    let Memory {
        policy_of,
        rejected,
        foreign,
        ..
    } = memory;
    policy_of.retain(|id, _| {
        observed.contains_key(id)
            || serving.contains(id)
            || rejected.contains_key(id)
            || foreign.contains_key(id)
    });
}

/// Graces expire without any event, and a replacement being created shows up in SPIRE only
/// after the writes: the loop must come back by itself.
fn recheck(plan: &SpirePlan, now: Instant) -> Option<Instant> {
    let creating: BTreeSet<&String> = plan.create.iter().map(|e| &e.id).collect();
    plan.pending
        .iter()
        .filter_map(|p| match &p.why {
            Why::Transition { due: Some(due), .. } | Why::ScopeLoss { due } => Some(*due),
            Why::Transition { by, due: None } if creating.contains(by) => {
                Some(now + Duration::from_secs(1))
            }
            Why::Brake => Some(now + Duration::from_secs(5)),
            _ => None,
        })
        .min()
}

fn is_foreign(memory: &Memory, id: &str) -> bool {
    memory.foreign.values().any(|e| e.id == id)
}

/// Remembers, per live Deployment, the entry serving it, so that a Deployment moving to
/// another entry (service account change) turns its old entry into a transition, not an
/// orphan.
fn track_moves(
    desired: &Desired,
    serving: &BTreeMap<SaKey, String>,
    observed: &Observed,
    memory: &mut Memory,
) {
    // In key order, collected into a map at the end: full nodes (see `desired::compute`).
    let mut now_serving = Vec::new();
    let mut shared: std::collections::HashMap<&str, Arc<str>> = Default::default();
    for (key, workload) in &desired.workloads {
        if workload.deleting {
            continue;
        }
        let Some(id) = serving.get(&workload.service_account) else {
            continue;
        };
        let before = memory.last_served.get(key);
        if let Some(before) = before
            && **before != **id
            && observed.contains_key(&**before)
        {
            memory.superseded.insert(before.to_string(), id.clone());
        }
        let id = match before {
            Some(before) if **before == **id => before.clone(),
            _ => shared
                .entry(id.as_str())
                .or_insert_with(|| Arc::from(id.as_str()))
                .clone(),
        };
        now_serving.push((key.clone(), id));
    }
    if desired.scope.is_some() {
        // A scoped derive saw only its own Deployments: the others keep their slots (a
        // removed Deployment's slot goes at the next full derive).
        memory.last_served.extend(now_serving);
    } else {
        memory.last_served = now_serving.into_iter().collect();
    }
    memory
        .superseded
        .retain(|old, _| observed.contains_key(old));
}

/// Holds every due scope-loss deletion of this sync when there are too many, unless the
/// operator confirmed exactly this set.
fn brake(
    settings: &DecideSettings,
    total: usize,
    due: Vec<Entry>,
    confirmed: Option<&str>,
    plan: &mut SpirePlan,
) {
    let too_many = due.len() > settings.brake_count
        && due.len() as f64 > settings.brake_fraction * total as f64;
    if !too_many {
        plan.delete.extend(due);
        return;
    }
    let token = brake_token(due.iter().map(|e| e.id.as_str()));
    if confirmed == Some(token.as_str()) {
        plan.delete.extend(due);
        return;
    }
    plan.brake = Some(Brake {
        token,
        count: due.len(),
        total,
    });
    plan.pending.extend(due.into_iter().map(|entry| Pending {
        entry,
        why: Why::Brake,
    }));
}
