//! What to do, as a pure function of (desired state, SPIRE view, memory, clock). No I/O: the
//! writers apply what this returns, and table tests cover it (`decide/tests.rs`).
//!
//! ```text
//! desired (per ns/SA) ─┐                     ┌─ SPIRE: create, update (incl. adopt), delete
//! SPIRE view (ours) ───┼─ spire_plan ────────┼─ pending deletions (why, until when), brake
//! memory + now ────────┘                     └─ serving: which entry gives each SA its identity
//!                         workload_writes ──── per Deployment: finalizer, annotations, Event
//! ```
//! Every entry of ours that no service account is served by is classified by what SPIRE says
//! it is for (its `k8s:ns`/`k8s:sa` selectors), never by what a Deployment's annotations say:
//! - its service account needs another entry → **transition**: deleted once the replacement
//!   has been in SPIRE for the transition grace (make-before-break);
//! - its service account's policy cannot render → **held**;
//! - its service account is out of scope but still runs → **scope loss**: deleted after the
//!   scope-loss grace, and only with the operator's confirmation when too many go at once;
//! - nothing runs as it any more (Deployments or namespace deleted) → **orphan**: deleted now,
//!   unless a Deployment moved from it to another entry (a service-account change), which is a
//!   transition.
//!
//! While any policy's selectors cannot be evaluated, only orphans are deleted.

use super::desired::{Coverage, DeploymentKey, Desired, SaKey, SaState};
use super::record::MetadataChange;
use super::view::Observed;
use super::writer::FailedWrite;
use crate::spire::node_alias::is_node_alias;
use crate::spire::{Entry, ItemError, Ownership};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod node_alias;
#[cfg(test)]
mod tests;

/// Knobs of the decisions (flags).
#[derive(Clone, Debug)]
pub struct DecideSettings {
    /// How long a replaced entry outlives its replacement's appearance in SPIRE.
    pub transition_grace: Duration,
    /// How long an entry outlives its service account falling out of scope.
    pub scope_loss_grace: Duration,
    /// The brake holds scope-loss deletions of one sync when there are more than this many…
    pub brake_count: usize,
    /// …and they are more than this fraction of our entries.
    pub brake_fraction: f64,
    /// Take over equivalent entries written by other tools instead of reporting them.
    pub adopt: bool,
}

impl Default for DecideSettings {
    fn default() -> Self {
        Self {
            transition_grace: Duration::from_secs(60),
            scope_loss_grace: Duration::from_secs(600),
            brake_count: 10,
            brake_fraction: 0.1,
            adopt: false,
        }
    }
}

/// What decisions remember between syncs (leader only, in memory). Losing it (a restart, a
/// new leader) only ever delays a deletion: graces start again from the first sync that sees
/// the situation.
#[derive(Debug, Default)]
pub struct Memory {
    /// When an entry serving a service account was first seen in SPIRE.
    present_since: BTreeMap<String, Instant>,
    /// When an entry's service account was first seen out of scope.
    out_of_scope_since: BTreeMap<String, Instant>,
    /// The entry each live Deployment was served by at the last sync (one shared copy of each
    /// ID: this holds a slot per Deployment).
    last_served: BTreeMap<DeploymentKey, Arc<str>>,
    /// Old entry → the entry that replaced it for some Deployment.
    superseded: BTreeMap<String, String>,
    /// Creates SPIRE refused as invalid: not sent again until the entry changes or a resync.
    pub rejected: BTreeMap<String, (Entry, String)>,
    /// Our entry ID → the equivalent entry another writer owns (SPIRE allows only one).
    pub foreign: BTreeMap<String, Entry>,
    /// Entry → policy that last rendered it (status counts, after the policy is gone too).
    policy_of: BTreeMap<String, String>,
    /// A hash of the last note announced per (Deployment, reason), so an unchanged situation
    /// is not re-announced, and the full pass that last made it. A hash, not the note; and a
    /// slot lives only while its situation does (see `workload_writes`), so a cluster at rest,
    /// where nothing is announced, holds none.
    announced: BTreeMap<(DeploymentKey, &'static str), (u64, u64)>,
    /// Full `workload_writes` passes so far.
    passes: u64,
    /// Writes whose patch failed, until the next sync settles them.
    failed_writes: Vec<FailedWrite>,
}

impl Memory {
    /// Forget what SPIRE told us (rejections, foreign entries): after a fresh list, try again.
    pub fn forget_spire_answers(&mut self) {
        self.rejected.clear();
        self.foreign.clear();
    }

    /// Keeps writes whose patch failed until the next sync (`settle_failed_writes`). Their
    /// announcements were never published: forgotten, so a retried write makes them again.
    pub fn failed_writes(&mut self, failed: Vec<FailedWrite>) {
        for write in &failed {
            for announce in &write.announce {
                self.announced.remove(&(write.key.clone(), announce.reason));
            }
        }
        self.failed_writes.extend(failed);
    }

    /// Whether writes whose patch failed wait to be settled (by a full derive: a scoped one
    /// would not see them all).
    pub fn has_failed_writes(&self) -> bool {
        !self.failed_writes.is_empty()
    }

    /// Settles the writes whose patch failed, against a snapshot taken since. A first
    /// registration that `desired` shows with the entry ID it carried did land: returned, to
    /// be counted and its Events published once (no later write repeats them, as nothing is
    /// left to change). The rest are forgotten: the Deployment still lacks the change, so this
    /// sync writes it again, announced and counted when that patch succeeds.
    pub fn settle_failed_writes(&mut self, desired: &Desired) -> Vec<FailedWrite> {
        std::mem::take(&mut self.failed_writes)
            .into_iter()
            .filter(|write| {
                write.registered.as_ref().is_some_and(|entry_id| {
                    desired
                        .workloads
                        .get(&write.key)
                        .is_some_and(|w| w.entry_id.as_deref() == Some(&**entry_id))
                })
            })
            .inspect(|write| {
                // Published now: not to be made again while the note is unchanged.
                for announce in &write.announce {
                    self.first_time(&write.key, announce);
                }
            })
            .collect()
    }

    /// Notes that `policy` renders `entry_id` (every sync, for every entry: written only when
    /// it changes, so a sync allocates nothing here at rest).
    fn remember_policy(&mut self, entry_id: &str, policy: &str) {
        if self.policy_of.get(entry_id).map(String::as_str) != Some(policy) {
            self.policy_of
                .insert(entry_id.to_string(), policy.to_string());
        }
    }

    /// The policy that last rendered `entry_id`, if known.
    pub fn policy_of(&self, entry_id: &str) -> Option<&str> {
        self.policy_of.get(entry_id).map(String::as_str)
    }

    /// True the first time `announce` is made for `key` (until its note changes).
    fn first_time(&mut self, key: &DeploymentKey, announce: &Announce) -> bool {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        announce.note.hash(&mut hasher);
        let note = hasher.finish();
        let slot = (key.clone(), announce.reason);
        let pass = self.passes;
        match self.announced.insert(slot, (note, pass)) {
            Some((before, _)) => before != note,
            None => true,
        }
    }
}

/// Why an entry of ours is kept although nothing it serves needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// Replaced by `by`; deleted at `due` (None: the replacement is not in SPIRE yet).
    Transition { by: String, due: Option<Instant> },
    /// Its service account fell out of scope; deleted at `due`.
    ScopeLoss { due: Instant },
    /// Due, but the deletion brake holds it until an operator confirms.
    Brake,
    /// Never deleted while the reason lasts (invalid policy, selectors in doubt).
    Held(String),
}

impl Why {
    pub fn label(&self) -> &'static str {
        match self {
            Why::Transition { .. } => "transition",
            Why::ScopeLoss { .. } => "scope_loss",
            Why::Brake => "brake",
            Why::Held(_) => "held",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    pub entry: Entry,
    pub why: Why,
}

/// The deletion brake: too many scope-loss deletions at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Brake {
    /// Confirms exactly this set of deletions (a hash of their IDs).
    pub token: String,
    pub count: usize,
    pub total: usize,
}

/// SPIRE writes and what is kept back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpirePlan {
    /// Shared with desired state.
    pub create: Vec<Arc<Entry>>,
    /// Mutable fields and hints (adoption, rename), by ID.
    pub update: Vec<Entry>,
    /// Entries of ours, as observed.
    pub delete: Vec<Entry>,
    /// The entry giving each service account its identity (in SPIRE, or being created).
    pub serving: BTreeMap<SaKey, String>,
    pub pending: Vec<Pending>,
    pub brake: Option<Brake>,
    /// When to decide again although nothing changes: the next grace expiry, a replacement
    /// being created, or a brake waiting for confirmation.
    pub recheck: Option<Instant>,
}

impl SpirePlan {
    pub fn writes(&self) -> usize {
        self.create.len() + self.update.len() + self.delete.len()
    }
}

/// The inputs of one decision.
pub struct Input<'a> {
    pub ownership: &'a Ownership,
    pub settings: &'a DecideSettings,
    pub desired: &'a Desired,
    /// Our entries in SPIRE, by ID.
    pub observed: &'a Observed,
    pub now: Instant,
    /// The confirmation token an operator has set (see `Brake`).
    pub confirmed: Option<&'a str>,
}

type Triple<'e> = (&'e str, &'e str, &'e [crate::spire::Selector]);

fn triple(entry: &Entry) -> Triple<'_> {
    (&entry.spiffe_id, &entry.parent_id, &entry.selectors)
}

/// Decides the SPIRE writes of one sync.
pub fn spire_plan(input: &Input, memory: &mut Memory) -> SpirePlan {
    let Input {
        ownership,
        settings,
        desired,
        observed,
        now,
        confirmed,
    } = input;
    let now = *now;
    let mut plan = SpirePlan::default();
    // A scoped derive decides for its service accounts' entries only (an entry serving the
    // same triple has the same selectors, so it is among them).
    let coverage = desired.coverage();
    let covered = || {
        observed
            .values()
            .map(|e| &**e)
            .filter(|e| coverage.covers(e))
    };
    // SPIRE keeps one entry per (SPIFFE ID, parent, selectors): an entry of ours under another
    // ID (adopted, or from a previous cluster name) serves the same identity.
    let by_triple: BTreeMap<Triple, &Entry> = covered().map(|e| (triple(e), e)).collect();

    for (sa, account) in &desired.service_accounts {
        let SaState::Needs { policy, entry } = &account.state else {
            continue;
        };
        memory.remember_policy(&entry.id, policy);
        // An entry under our ID whose SPIFFE ID, parent or selectors were edited behind our
        // back serves no one correctly: it is replaced (the writer deletes it first).
        let tampered = observed
            .get(&entry.id)
            .map(|e| &**e)
            .filter(|e| triple(e) != triple(entry));
        if let Some(tampered) = tampered {
            plan.delete.push(tampered.clone());
        }
        let existing = observed
            .get(&entry.id)
            .map(|e| &**e)
            .filter(|_| tampered.is_none())
            .or_else(|| by_triple.get(&triple(entry)).copied());
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
            plan.serving.insert(sa.clone(), existing.id.clone());
        } else if let Some(theirs) = memory.foreign.get(&entry.id).map(|e| e.id.clone()) {
            // The workload has an identity (theirs). Adopt it in place, or leave it alone.
            memory.present_since.entry(theirs.clone()).or_insert(now);
            if settings.adopt {
                plan.update.push(Entry {
                    id: theirs.clone(),
                    hint: ownership.hint_for(&theirs).to_string(),
                    ..(**entry).clone()
                });
                memory.remember_policy(&theirs, policy);
            }
            plan.serving.insert(sa.clone(), theirs);
        } else if memory
            .rejected
            .get(&entry.id)
            .is_some_and(|(refused, _)| refused == &**entry)
        {
            // SPIRE said no to exactly this; asking again cannot help.
        } else {
            memory.rejected.remove(&entry.id);
            plan.create.push(entry.clone());
            plan.serving.insert(sa.clone(), entry.id.clone());
        }
    }
    track_moves(desired, &plan.serving, observed, memory);

    let serving: BTreeSet<&String> = plan.serving.values().collect();
    let replaced: BTreeSet<String> = plan.delete.iter().map(|e| e.id.clone()).collect();
    let mut scope_lost_due = Vec::new();
    let mut out_of_scope = BTreeSet::new();
    // Node aliases serve agents, not service accounts: `node_alias` decides them.
    let unserved = covered()
        .filter(|e| !serving.contains(&e.id) && !replaced.contains(&e.id) && !is_node_alias(e));
    for entry in unserved {
        let sa = SaKey::of_entry(entry);
        let account = sa.as_ref().and_then(|sa| desired.service_accounts.get(sa));
        let transition = |by: &String| {
            let due = memory
                .present_since
                .get(by)
                .filter(|_| observed.contains_key(by) || is_foreign(memory, by))
                .map(|since| *since + settings.transition_grace);
            Why::Transition {
                by: by.clone(),
                due,
            }
        };
        let why = match account.map(|a| &a.state) {
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
                out_of_scope.insert(entry.id.clone());
                let since = *memory
                    .out_of_scope_since
                    .entry(entry.id.clone())
                    .or_insert(now);
                Why::ScopeLoss {
                    due: since + settings.scope_loss_grace,
                }
            }
            None => match memory
                .superseded
                .get(&entry.id)
                .filter(|by| serving.contains(by))
            {
                // A Deployment moved from it to another entry (service account change).
                Some(by) => transition(by),
                // Nothing runs as it: the finalizer path, immediate.
                None => {
                    plan.delete.push(entry.clone());
                    continue;
                }
            },
        };
        let why = match (&why, desired.doubt.first()) {
            (Why::Held(_), _) | (_, None) => why,
            (_, Some(policy)) => Why::Held(format!(
                "the selectors of policy {policy} cannot be evaluated; nothing is deleted until it is fixed"
            )),
        };
        match why {
            Why::Transition { due: Some(due), .. } if now >= due => plan.delete.push(entry.clone()),
            Why::ScopeLoss { due } if now >= due => scope_lost_due.push(entry.clone()),
            why => plan.pending.push(Pending {
                entry: entry.clone(),
                why,
            }),
        }
    }
    if coverage.is_full() {
        forget_what_is_gone(memory, observed, &serving, &out_of_scope);
    } else {
        // A scoped sync looked at its own entries only (all in SPIRE, so remembered as
        // present): of the rest, memory is left as it is.
        for entry in covered().filter(|e| !out_of_scope.contains(&e.id)) {
            memory.out_of_scope_since.remove(&entry.id);
        }
    }
    brake(
        settings,
        observed.len(),
        scope_lost_due,
        *confirmed,
        &mut plan,
    );
    plan.recheck = recheck(&plan, now);
    node_alias::plan_node_aliases(input, memory, &mut plan);
    plan
}

/// After a full sync: forgets what no longer exists or applies.
fn forget_what_is_gone(
    memory: &mut Memory,
    observed: &Observed,
    serving: &BTreeSet<&String>,
    out_of_scope: &BTreeSet<String>,
) {
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

/// A short hash of a set of entry IDs: confirming one set never confirms another.
pub fn brake_token<'a>(ids: impl Iterator<Item = &'a str>) -> String {
    let mut ids: Vec<&str> = ids.collect();
    ids.sort_unstable();
    let mut hasher = Sha256::new();
    for id in ids {
        hasher.update(id.as_bytes());
        hasher.update(b"\n");
    }
    hasher.finalize()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// An Event to publish on a Deployment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announce {
    pub warning: bool,
    pub reason: &'static str,
    /// Shared among the Deployments of a service account that get the same note.
    pub note: Arc<str>,
}

impl Announce {
    fn normal(reason: &'static str, note: String) -> Self {
        Self {
            warning: false,
            reason,
            note: note.into(),
        }
    }
    fn warning(reason: &'static str, note: String) -> Self {
        Self {
            warning: true,
            reason,
            note: note.into(),
        }
    }
}

/// One Deployment's write: metadata to change and/or an Event.
#[derive(Debug, PartialEq, Eq)]
pub struct WorkloadWrite {
    pub key: DeploymentKey,
    pub change: MetadataChange,
    pub announce: Vec<Announce>,
    /// The Deployment gets its entry-id for the first time (metrics).
    pub registered: bool,
}

/// What happened to SPIRE writes, by entry ID (after the writer applied the plan).
pub type Failures = BTreeMap<String, ItemError>;

/// Decides the metadata and Events of the Deployments running as the service accounts in
/// `scope` (every Deployment when `None`), from what SPIRE now holds (`observed`, updated by
/// the writer). A scope lets the writer annotate Deployments while later SPIRE batches are
/// still in flight. Deployments `written` already this sync are passed over: the full pass
/// that ends a first sync would otherwise repeat a write for every Deployment.
pub fn workload_writes(
    desired: &Desired,
    plan: &SpirePlan,
    observed: &Observed,
    failures: &Failures,
    memory: &mut Memory,
    scope: Option<&BTreeSet<SaKey>>,
    written: &dyn Fn(&DeploymentKey) -> bool,
) -> Vec<WorkloadWrite> {
    let in_scope = |sa: &SaKey| scope.is_none_or(|scope| scope.contains(sa));
    // A scoped derive's Deployments are all of its service accounts: the entries of no other
    // matter to them.
    let entries_of = Coverage::of(scope.or(desired.scope.as_ref()));
    // Entries of ours per service account, as SPIRE has them now, keyed by strings the
    // entries hold (no key allocated per entry; a scoped pass keeps only its own).
    let mut remaining: std::collections::HashMap<(&str, &str), Vec<&Entry>> = Default::default();
    for entry in observed.values() {
        let Some(parts) = SaKey::parts_of_entry(entry) else {
            continue;
        };
        if entries_of.covers_account(parts) {
            remaining.entry(parts).or_default().push(entry);
        }
    }
    let pending: BTreeMap<&str, &Why> = plan
        .pending
        .iter()
        .map(|p| (p.entry.id.as_str(), &p.why))
        .collect();
    let mut writes = Vec::new();
    let mut strings = SharedStrings::default();
    // A scoped pass (after a create chunk) visits only the live Deployments of its service
    // accounts: at 50,000 Deployments a pass over all of them per chunk made the first sync
    // quadratic. The unscoped pass that ends every sync visits everything.
    let workloads: Box<dyn Iterator<Item = (&DeploymentKey, &super::desired::Workload)>> =
        match scope {
            None => Box::new(desired.workloads.iter()),
            Some(scope) => Box::new(
                scope
                    .iter()
                    .filter_map(|sa| desired.service_accounts.get(sa))
                    .flat_map(|account| account.deployments.iter())
                    .filter_map(|key| desired.workloads.get_key_value(key)),
            ),
        };
    for (key, workload) in workloads {
        let sa = &workload.service_account;
        if !in_scope(sa) || written(key) {
            continue;
        }
        let account = desired.service_accounts.get(sa);
        let ours_left = remaining
            .get(&(&*sa.namespace, &*sa.service_account))
            .map(Vec::as_slice)
            .unwrap_or_default();
        let (mut change, announce, registered) = match (
            workload.deleting,
            account.map(|a| &a.state),
        ) {
            // Siblings still run as its service account: nothing of ours waits on it.
            (true, Some(_)) | (true, None) if !workload.has_finalizer => continue,
            (true, Some(_)) => (release(workload, false), None, false),
            (true, None) => {
                if let Some(waiting) = ours_left.first() {
                    let announce = failures.get(&waiting.id).map(|error| {
                        Announce::warning(
                            "DeregistrationFailed",
                            format!("waiting to delete entry {}: {error}", waiting.id),
                        )
                    });
                    (MetadataChange::default(), announce, false)
                } else {
                    let announce = workload
                        .entry_id
                        .as_ref()
                        .map(|id| Announce::normal("Deregistered", format!("entry {id} deleted")));
                    (release(workload, false), announce, false)
                }
            }
            (false, Some(SaState::Needs { entry, .. })) => {
                needs(workload, sa, entry, plan, observed, failures, memory)
            }
            (
                false,
                Some(SaState::Invalid {
                    policy, message, ..
                }),
            ) => (
                MetadataChange::default(),
                Some(Announce::warning(
                    "RegistrationFailed",
                    format!("policy {policy}: {message}; its current entry is kept"),
                )),
                false,
            ),
            (false, _) => {
                if let Some(kept) = ours_left.first() {
                    let note = match pending.get(kept.id.as_str()) {
                        Some(Why::Brake) => format!(
                            "out of scope; deleting entry {} waits for an operator's confirmation (deletion brake)",
                            kept.id
                        ),
                        Some(Why::Held(reason)) => {
                            format!("out of scope; entry {} is held: {reason}", kept.id)
                        }
                        _ => format!(
                            "out of scope; entry {} is deleted after the scope-loss grace unless it comes back in scope",
                            kept.id
                        ),
                    };
                    (
                        MetadataChange::default(),
                        Some(Announce::warning("DeregistrationPending", note)),
                        false,
                    )
                } else {
                    let announce = workload.entry_id.as_ref().map(|id| {
                        Announce::normal(
                            "Deregistered",
                            format!("out of scope; entry {id} deleted"),
                        )
                    });
                    (release(workload, true), announce, false)
                }
            }
        };
        let mut announce: Vec<Announce> = announce.into_iter().collect();
        if !workload.deleting
            && let Some(account) = account.filter(|a| !a.losers.is_empty())
            && let SaState::Needs { policy, .. } = &account.state
        {
            announce.push(Announce::normal(
                "PolicyConflict",
                format!(
                    "policies {} also match; {policy} governs service account {} (priority, then age, then name)",
                    account.losers.join(", "),
                    sa.service_account
                ),
            ));
        }
        if workload.namespace_terminating {
            // The apiserver refuses new Events in a namespace being deleted.
            announce.clear();
        }
        announce.retain(|a| memory.first_time(key, a));
        if !change.is_empty() || !announce.is_empty() {
            // Writes wait in the writer's queue (a first sync queues one per Deployment):
            // values repeated per service account are kept once.
            for note in announce.iter_mut().map(|a| &mut a.note) {
                strings.share(note);
            }
            for value in [&mut change.spiffe_id, &mut change.entry_id]
                .into_iter()
                .flatten()
                .flatten()
            {
                strings.share(value);
            }
            writes.push(WorkloadWrite {
                key: key.clone(),
                change,
                announce,
                registered,
            });
        }
    }
    if scope.is_none() && desired.scope.is_none() {
        // What no pass of this sync announced again is over (a registration that landed, a
        // failure that cleared): its slot goes, and the same note later is news again.
        let pass = memory.passes;
        memory.announced.retain(|_, (_, made)| *made == pass);
        memory.passes += 1;
    }
    writes
}

/// One copy of each string value among a pass's writes.
#[derive(Default)]
struct SharedStrings(std::collections::HashSet<Arc<str>>);

impl SharedStrings {
    fn share(&mut self, value: &mut Arc<str>) {
        match self.0.get(value) {
            Some(shared) => *value = shared.clone(),
            None => {
                self.0.insert(value.clone());
            }
        }
    }
}

/// Removes our finalizer, and our annotations when the Deployment stays (out of scope).
fn release(workload: &super::desired::Workload, strip: bool) -> MetadataChange {
    MetadataChange {
        remove_finalizer: workload.has_finalizer,
        spiffe_id: (strip && workload.spiffe_id.is_some()).then_some(None),
        entry_id: (strip && workload.entry_id.is_some()).then_some(None),
        ..Default::default()
    }
}

/// A live Deployment whose service account needs `entry`.
fn needs(
    workload: &super::desired::Workload,
    sa: &SaKey,
    entry: &Entry,
    plan: &SpirePlan,
    observed: &Observed,
    failures: &Failures,
    memory: &Memory,
) -> (MetadataChange, Option<Announce>, bool) {
    let mut change = MetadataChange {
        add_finalizer: !workload.has_finalizer,
        ..Default::default()
    };
    if workload.spiffe_id.as_deref() != Some(entry.spiffe_id.as_str()) {
        change.spiffe_id = Some(Some(entry.spiffe_id.as_str().into()));
    }
    if let Some(error) = failures.get(&entry.id) {
        let note = format!("entry {} for {}: {error}", entry.id, entry.spiffe_id);
        return (
            change,
            Some(Announce::warning("RegistrationFailed", note)),
            false,
        );
    }
    if let Some((_, reason)) = memory.rejected.get(&entry.id) {
        let note = format!(
            "SPIRE rejected entry {} for {}: {reason}; the previous entry, if any, is kept",
            entry.id, entry.spiffe_id
        );
        return (
            change,
            Some(Announce::warning("RegistrationFailed", note)),
            false,
        );
    }
    let serving = plan.serving.get(sa).filter(|id| observed.contains_key(*id));
    let Some(serving) = serving else {
        if let Some(theirs) = memory.foreign.get(&entry.id) {
            let note = format!(
                "SPIRE already has the equivalent entry {} written by another tool; it serves this workload but is not managed here (see --adopt-equivalent-entries)",
                theirs.id
            );
            return (
                change,
                Some(Announce::warning("EquivalentEntryExists", note)),
                false,
            );
        }
        return (change, None, false);
    };
    if workload.entry_id.as_deref() == Some(serving.as_str()) {
        return (change, None, false);
    }
    let first = workload.entry_id.is_none();
    change.entry_id = Some(Some(serving.as_str().into()));
    let note = format!("SPIFFE ID {}, SPIRE entry {serving}", entry.spiffe_id);
    (change, Some(Announce::normal("Registered", note)), first)
}
