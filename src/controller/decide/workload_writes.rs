//! The Kubernetes half of a decision: per Deployment, the finalizer and annotations it
//! should carry and the Events it should get, from what SPIRE now holds.
//!
//! ```text
//! each Deployment to visit ─▶ deleting?   ─▶ release, or wait for its entry (say why)
//!                            needs entry ─▶ finalizer, spiffe-id, entry-id once served
//!                            invalid     ─▶ say so; keep what it has
//!                            out of scope ─▶ release once its entry is gone (say when)
//!                          ─▶ conflict note, Events filtered to news, strings shared
//! ```

use super::input::{Failures, Observed};
use super::memory::Memory;
use super::plan::{Announce, MetadataChange, SpirePlan, Why, WorkloadWrite};
use crate::controller::desired::{Coverage, Desired, SaState, ServiceAccount, Workload};
use crate::keys::{SaKey, WorkloadKey};
use crate::spire::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

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
    written: &dyn Fn(&WorkloadKey) -> bool,
) -> Vec<WorkloadWrite> {
    let in_scope = |sa: &SaKey| scope.is_none_or(|scope| scope.contains(sa));
    // A scoped derive's Deployments are all of its service accounts: the entries of no other
    // matter to them.
    let remaining = entries_by_account(observed, &Coverage::of(scope.or(desired.scope.as_ref())));
    let facts = Facts {
        plan,
        observed,
        failures,
        pending: plan
            .pending
            .iter()
            .map(|p| (p.entry.id.as_str(), &p.why))
            .collect(),
    };
    let mut writes = Vec::new();
    let mut strings = SharedStrings::default();
    for (key, workload) in workloads_to_visit(desired, scope) {
        let sa = &workload.service_account;
        if !in_scope(sa) || written(key) {
            continue;
        }
        let account = desired.service_accounts.get(sa);
        let ours_left = remaining
            .get(&(&*sa.namespace, &*sa.service_account))
            .map(Vec::as_slice)
            .unwrap_or_default();
        let Some(mut outcome) = decide_workload(workload, account, ours_left, &facts, memory)
        else {
            continue;
        };
        // A bare Pod's deletion is never held: it gets our annotations, not our finalizer.
        outcome.change.add_finalizer &= key.kind.takes_finalizer();
        let mut announce: Vec<Announce> = outcome.announce.into_iter().collect();
        announce.extend(conflict_note(workload, account));
        announce.extend(dns_note(workload, account));
        if workload.namespace_terminating {
            // The apiserver refuses new Events in a namespace being deleted.
            announce.clear();
        }
        announce.retain(|a| memory.first_time(key, a));
        if let Some(write) = strings.write(key, outcome.change, announce, outcome.registered) {
            writes.push(write);
        }
    }
    if scope.is_none() && desired.scope.is_none() {
        end_full_pass(memory);
    }
    writes
}

/// What one Deployment's decision is taken against, besides the Deployment itself.
struct Facts<'a> {
    plan: &'a SpirePlan,
    observed: &'a Observed,
    failures: &'a Failures,
    /// Why each of our pending entries is kept, by ID.
    pending: BTreeMap<&'a str, &'a Why>,
}

/// One Deployment's decision before Events are filtered to news.
struct Outcome {
    change: MetadataChange,
    announce: Option<Announce>,
    /// The Deployment gets its entry-id for the first time.
    registered: bool,
}

impl Outcome {
    fn new(change: MetadataChange, announce: Option<Announce>) -> Self {
        Self {
            change,
            announce,
            registered: false,
        }
    }
}

/// Entries of ours per service account, as SPIRE has them now, keyed by strings the entries
/// hold (no key allocated per entry; a scoped pass keeps only its own).
fn entries_by_account<'e>(
    observed: &'e Observed,
    coverage: &Coverage,
) -> HashMap<(&'e str, &'e str), Vec<&'e Entry>> {
    let mut remaining: HashMap<(&str, &str), Vec<&Entry>> = HashMap::new();
    for entry in observed.values() {
        let Some(parts) = SaKey::parts_of_entry(entry) else {
            continue;
        };
        if coverage.covers_account(parts) {
            remaining.entry(parts).or_default().push(entry);
        }
    }
    remaining
}

/// The Deployments a pass visits. A scoped pass (after a create chunk) visits only the live
/// Deployments of its service accounts: at 50,000 Deployments a pass over all of them per
/// chunk made the first sync quadratic. The unscoped pass that ends every sync visits
/// everything.
fn workloads_to_visit<'d>(
    desired: &'d Desired,
    scope: Option<&'d BTreeSet<SaKey>>,
) -> Box<dyn Iterator<Item = (&'d WorkloadKey, &'d Workload)> + 'd> {
    match scope {
        None => Box::new(desired.workloads.iter()),
        Some(scope) => Box::new(
            scope
                .iter()
                .filter_map(|sa| desired.service_accounts.get(sa))
                .flat_map(|account| account.deployments.iter())
                .filter_map(|key| desired.workloads.get_key_value(key)),
        ),
    }
}

/// What one Deployment should carry, given its service account's state and the entries of
/// ours left for that account; `None` when nothing of ours concerns it.
fn decide_workload(
    workload: &Workload,
    account: Option<&ServiceAccount>,
    ours_left: &[&Entry],
    facts: &Facts,
    memory: &Memory,
) -> Option<Outcome> {
    Some(match (workload.deleting, account.map(|a| &a.state)) {
        // Siblings still run as its service account: nothing of ours waits on it.
        (true, _) if !workload.has_finalizer => return None,
        (true, Some(_)) => Outcome::new(release(workload, false), None),
        (true, None) => deleting_alone(workload, ours_left, facts.failures),
        (false, Some(SaState::Needs { entry, .. })) => {
            needs(workload, &workload.service_account, entry, facts, memory)
        }
        (
            false,
            Some(SaState::Invalid {
                policy, message, ..
            }),
        ) => Outcome::new(
            MetadataChange::default(),
            Some(Announce::warning(
                "RegistrationFailed",
                format!("policy {policy}: {message}; its current entry is kept"),
            )),
        ),
        (false, _) => out_of_scope(workload, ours_left, &facts.pending),
    })
}

/// The last Deployment of its service account is being deleted: its finalizer goes once no
/// entry of ours is left for the account.
fn deleting_alone(workload: &Workload, ours_left: &[&Entry], failures: &Failures) -> Outcome {
    if let Some(waiting) = ours_left.first() {
        let announce = failures.get(&waiting.id).map(|error| {
            Announce::warning(
                "DeregistrationFailed",
                format!("waiting to delete entry {}: {error}", waiting.id),
            )
        });
        return Outcome::new(MetadataChange::default(), announce);
    }
    let announce = workload
        .entry_id
        .as_ref()
        .map(|id| Announce::normal("Deregistered", format!("entry {id} deleted")));
    Outcome::new(release(workload, false), announce)
}

/// A live Deployment whose service account is out of scope: released (finalizer and our
/// annotations removed) once its entry is gone; until then told when that will be.
fn out_of_scope(
    workload: &Workload,
    ours_left: &[&Entry],
    pending: &BTreeMap<&str, &Why>,
) -> Outcome {
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
        return Outcome::new(
            MetadataChange::default(),
            Some(Announce::warning("DeregistrationPending", note)),
        );
    }
    let announce = workload
        .entry_id
        .as_ref()
        .map(|id| Announce::normal("Deregistered", format!("out of scope; entry {id} deleted")));
    Outcome::new(release(workload, true), announce)
}

/// Tells a live Deployment which policy governs its service account when others match too.
fn conflict_note(workload: &Workload, account: Option<&ServiceAccount>) -> Option<Announce> {
    if workload.deleting {
        return None;
    }
    let account = account.filter(|a| !a.losers.is_empty())?;
    let SaState::Needs { policy, .. } = &account.state else {
        return None;
    };
    Some(Announce::normal(
        "PolicyConflict",
        format!(
            "policies {} also match; {policy} governs service account {} (priority, then age, then name)",
            account.losers.join(", "),
            workload.service_account.service_account
        ),
    ))
}

/// Tells a live Deployment which DNS names its entry is made without, and why.
fn dns_note(workload: &Workload, account: Option<&ServiceAccount>) -> Option<Announce> {
    if workload.deleting {
        return None;
    }
    let account = account?;
    let SaState::Needs { .. } = &account.state else {
        return None;
    };
    let note = account.dns_omitted.as_deref()?;
    Some(Announce::warning(
        "DNSNameOmitted",
        format!("its entry is made without a DNS name: {note}"),
    ))
}

/// What no pass of this sync announced again is over (a registration that landed, a failure
/// that cleared): its slot goes, and the same note later is news again.
fn end_full_pass(memory: &mut Memory) {
    let pass = memory.passes;
    memory.announced.retain(|_, (_, made)| *made == pass);
    memory.passes += 1;
}

/// One copy of each string value among a pass's writes.
#[derive(Default)]
struct SharedStrings(std::collections::HashSet<Arc<str>>);

impl SharedStrings {
    /// The write for `key`, if it changes or announces anything. Writes wait in the writer's
    /// queue (a first sync queues one per Deployment): values repeated per service account
    /// are kept once.
    fn write(
        &mut self,
        key: &WorkloadKey,
        mut change: MetadataChange,
        mut announce: Vec<Announce>,
        registered: bool,
    ) -> Option<WorkloadWrite> {
        if change.is_empty() && announce.is_empty() {
            return None;
        }
        for note in announce.iter_mut().map(|a| &mut a.note) {
            self.share(note);
        }
        for value in [&mut change.spiffe_id, &mut change.entry_id]
            .into_iter()
            .flatten()
            .flatten()
        {
            self.share(value);
        }
        Some(WorkloadWrite {
            key: key.clone(),
            change,
            announce,
            registered,
        })
    }

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
fn release(workload: &Workload, strip: bool) -> MetadataChange {
    MetadataChange {
        remove_finalizer: workload.has_finalizer,
        spiffe_id: (strip && workload.spiffe_id.is_some()).then_some(None),
        entry_id: (strip && workload.entry_id.is_some()).then_some(None),
        ..Default::default()
    }
}

/// A live Deployment whose service account needs `entry`.
fn needs(
    workload: &Workload,
    sa: &SaKey,
    entry: &Entry,
    facts: &Facts,
    memory: &Memory,
) -> Outcome {
    let mut change = MetadataChange {
        add_finalizer: !workload.has_finalizer,
        ..Default::default()
    };
    if workload.spiffe_id.as_deref() != Some(entry.spiffe_id.as_str()) {
        change.spiffe_id = Some(Some(entry.spiffe_id.as_str().into()));
    }
    if let Some(error) = facts.failures.get(&entry.id) {
        let note = format!("entry {} for {}: {error}", entry.id, entry.spiffe_id);
        return Outcome::new(change, Some(Announce::warning("RegistrationFailed", note)));
    }
    if let Some((_, reason)) = memory.rejected.get(&entry.id) {
        let note = format!(
            "SPIRE rejected entry {} for {}: {reason}; the previous entry, if any, is kept",
            entry.id, entry.spiffe_id
        );
        return Outcome::new(change, Some(Announce::warning("RegistrationFailed", note)));
    }
    let serving = facts
        .plan
        .serving
        .get(sa)
        .filter(|id| facts.observed.contains_key(*id));
    let Some(serving) = serving else {
        let announce = memory.foreign.get(&entry.id).map(|theirs| {
            let note = format!(
                "SPIRE already has the equivalent entry {} written by another tool; it serves this workload but is not managed here (see --adopt-equivalent-entries)",
                theirs.id
            );
            Announce::warning("EquivalentEntryExists", note)
        });
        return Outcome::new(change, announce);
    };
    if workload.entry_id.as_deref() == Some(serving.as_str()) {
        return Outcome::new(change, None);
    }
    let registered = workload.entry_id.is_none();
    change.entry_id = Some(Some(serving.as_str().into()));
    let note = format!("SPIFFE ID {}, SPIRE entry {serving}", entry.spiffe_id);
    Outcome {
        change,
        announce: Some(Announce::normal("Registered", note)),
        registered,
    }
}
