//! What decisions remember between syncs.

use super::plan::{Announce, FailedWrite};
use crate::controller::desired::Desired;
use crate::keys::WorkloadKey;
use crate::spire::Entry;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// What decisions remember between syncs (leader only, in memory). Losing it (a restart, a
/// new leader) only ever delays a deletion: graces start again from the first sync that sees
/// the situation.
#[derive(Debug, Default)]
pub struct Memory {
    /// When an entry serving a service account was first seen in SPIRE.
    pub(super) present_since: BTreeMap<String, Instant>,
    /// When an entry's service account was first seen out of scope.
    pub(super) out_of_scope_since: BTreeMap<String, Instant>,
    /// The entry each live Deployment was served by at the last sync (one shared copy of each
    /// ID: this holds a slot per Deployment).
    pub(super) last_served: BTreeMap<WorkloadKey, Arc<str>>,
    /// Old entry → the entry that replaced it for some Deployment.
    pub(super) superseded: BTreeMap<String, String>,
    /// Creates SPIRE refused as invalid: not sent again until the entry changes or a resync.
    pub rejected: BTreeMap<String, (Entry, String)>,
    /// Our entry ID → the equivalent entry another writer owns (SPIRE allows only one).
    pub foreign: BTreeMap<String, Entry>,
    /// Entry → policy that last rendered it (status counts, after the policy is gone too).
    pub(super) policy_of: BTreeMap<String, String>,
    /// A hash of the last note announced per (Deployment, reason), so an unchanged situation
    /// is not re-announced, and the full pass that last made it. A hash, not the note; and a
    /// slot lives only while its situation does (see `workload_writes`), so a cluster at rest,
    /// where nothing is announced, holds none.
    pub(super) announced: BTreeMap<(WorkloadKey, &'static str), (u64, u64)>,
    /// Full `workload_writes` passes so far.
    pub(super) passes: u64,
    /// Writes whose patch failed, until the next sync settles them.
    pub(super) failed_writes: Vec<FailedWrite>,
}

impl Memory {
    /// Forget what SPIRE told us (rejections, foreign entries): after a fresh list, try again.
    pub fn forget_spire_answers(&mut self) {
        self.rejected.clear();
        self.foreign.clear();
    }

    /// Takes in what SPIRE said of this sync's writes: equivalent entries another writer owns
    /// (our ID → theirs), and creates it refused (what we sent, its reason). Both shape the
    /// next decisions until a fresh list (`forget_spire_answers`).
    pub fn learn(&mut self, foreign: &[(String, Entry)], rejected: &[(Entry, String)]) {
        for (ours, theirs) in foreign {
            self.foreign.insert(ours.clone(), theirs.clone());
        }
        for (entry, reason) in rejected {
            self.rejected
                .insert(entry.id.clone(), (entry.clone(), reason.clone()));
        }
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
    pub(super) fn remember_policy(&mut self, entry_id: &str, policy: &str) {
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
    pub(super) fn first_time(&mut self, key: &WorkloadKey, announce: &Announce) -> bool {
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
