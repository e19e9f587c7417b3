//! Policy status: `Ready` condition and counts, computed purely from the sync's outcome and
//! written only when it changed (so an idle cluster makes no writes).

use super::decide::{Brake, Failures, Memory, SpirePlan};
use super::desired::{Desired, SaState};
use super::policy_notes::confirm_command;
use crate::keys::WorkloadKind;
use crate::policy::{SpiffeRegistration, SpiffeRegistrationStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;
use std::collections::BTreeMap;

/// A condition that keeps its lastTransitionTime while its status stays the same.
fn condition(
    policy: &SpiffeRegistration,
    type_: &str,
    status: &str,
    reason: String,
    message: String,
) -> Condition {
    let previous = policy
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_));
    let last_transition_time = match previous {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Time(k8s_openapi::jiff::Timestamp::now()),
    };
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason,
        message,
        last_transition_time,
        observed_generation: policy.metadata.generation,
    }
}

/// What one sync knows that status is computed from.
pub struct Outcome<'a> {
    pub desired: &'a Desired,
    pub plan: &'a SpirePlan,
    pub failures: &'a Failures,
    pub memory: &'a Memory,
}

/// The status `policy` should have after this sync.
pub fn compute(policy: &SpiffeRegistration, outcome: &Outcome) -> SpiffeRegistrationStatus {
    let name = policy.name_any();
    let counts = Counts::of(&name, outcome);
    let (status, reason, message) = ready(&name, outcome.desired, &counts);
    let (conflict, conflict_reason, conflict_message) = conflict(counts.conflicts);
    let (braked, brake_reason, brake_message) = deletion_brake(outcome.plan.brake.as_ref());
    let (dns, dns_reason, dns_message) = dns_names(&counts);
    SpiffeRegistrationStatus {
        conditions: vec![
            condition(policy, "Ready", status, reason, message),
            condition(
                policy,
                "Conflict",
                conflict,
                conflict_reason.to_string(),
                conflict_message,
            ),
            condition(
                policy,
                "DeletionBrake",
                braked,
                brake_reason.to_string(),
                brake_message,
            ),
            condition(policy, "DNSNames", dns, dns_reason.to_string(), dns_message),
        ],
        observed_generation: policy.metadata.generation,
        selected_workloads: counts.selected,
        workloads_by_kind: counts
            .by_kind
            .iter()
            .map(|(kind, count)| (kind.name().to_string(), *count))
            .collect(),
        entries: counts.entries,
        failures: counts.failed,
        pending_deletions: counts.pending,
    }
}

/// What one policy governs after a sync.
struct Counts {
    /// Workloads running as the service accounts it governs.
    selected: u32,
    /// The same, by kind.
    by_kind: BTreeMap<WorkloadKind, u32>,
    /// Its service accounts served by an entry.
    entries: u32,
    /// Its service accounts without one, and why the first is.
    failed: u32,
    first_failure: Option<String>,
    /// Its entries pending deletion.
    pending: u32,
    /// Deployments it matches that another policy governs.
    conflicts: usize,
    /// Its service accounts whose entry is made without some DNS names, and the first's note.
    dns_omitted: u32,
    first_dns_omitted: Option<String>,
}

impl Counts {
    fn of(name: &str, outcome: &Outcome) -> Self {
        let Outcome {
            desired,
            plan,
            failures,
            memory,
        } = outcome;
        let mut counts = Counts {
            selected: 0,
            by_kind: BTreeMap::new(),
            entries: 0,
            failed: 0,
            first_failure: None,
            pending: plan
                .pending
                .iter()
                .filter(|p| memory.policy_of(&p.entry.id) == Some(name))
                .count() as u32,
            conflicts: desired.conflicts.get(name).map(|c| c.len()).unwrap_or(0),
            dns_omitted: 0,
            first_dns_omitted: None,
        };
        for (sa, account) in &desired.service_accounts {
            let (governs, problem) = match &account.state {
                SaState::Needs { policy, entry } => {
                    let problem = failures
                        .get(&entry.id)
                        .map(ToString::to_string)
                        .or_else(|| {
                            memory.rejected.get(&entry.id).map(|(_, reason)| {
                                format!("SPIRE rejected {}: {reason}", entry.spiffe_id)
                            })
                        });
                    (policy == name, problem)
                }
                SaState::Invalid {
                    policy, message, ..
                } => (policy == name, Some(message.clone())),
                SaState::OutOfScope => (false, None),
            };
            if !governs {
                continue;
            }
            counts.selected += account.deployments.len() as u32;
            for key in &account.deployments {
                *counts.by_kind.entry(key.kind).or_default() += 1;
            }
            if let Some(note) = &account.dns_omitted {
                counts.dns_omitted += 1;
                counts
                    .first_dns_omitted
                    .get_or_insert_with(|| format!("{sa}: {note}"));
            }
            if let Some(problem) = problem {
                counts.failed += 1;
                counts.first_failure.get_or_insert(problem);
            } else {
                counts.entries += 1;
            }
        }
        counts
    }
}

/// The `Ready` condition: (status, reason, message).
fn ready(name: &str, desired: &Desired, counts: &Counts) -> (&'static str, String, String) {
    if let Some((reason, message)) = desired.invalid_policies.get(name) {
        return ("False", reason.to_string(), message.clone());
    }
    if let Some(first) = &counts.first_failure {
        let message = format!(
            "{} of {} service accounts have no entry; first: {first}",
            counts.failed,
            counts.failed + counts.entries
        );
        return ("False", "RegistrationFailed".to_string(), message);
    }
    let mut message = format!(
        "{} workloads registered under {} entries",
        counts.selected, counts.entries
    );
    if counts.conflicts > 0 {
        message.push_str(&format!(
            "; {} more match but another policy governs their service accounts",
            counts.conflicts
        ));
    }
    if counts.pending > 0 {
        message.push_str(&format!("; {} entries pending deletion", counts.pending));
    }
    ("True", "Registered".to_string(), message)
}

/// The `Conflict` condition.
fn conflict(conflicts: usize) -> (&'static str, &'static str, String) {
    if conflicts > 0 {
        (
            "True",
            "AnotherPolicyGoverns",
            format!(
                "{conflicts} Deployments match this policy but another policy governs their service accounts (higher priority, or older)"
            ),
        )
    } else {
        (
            "False",
            "NoConflict",
            "every Deployment matched by this policy is governed by it".to_string(),
        )
    }
}

/// The `DNSNames` condition: whether every DNS name template renders for every service
/// account the policy governs (one that cannot is left out of that entry, never the entry).
fn dns_names(counts: &Counts) -> (&'static str, &'static str, String) {
    match &counts.first_dns_omitted {
        Some(first) => (
            "False",
            "DNSNameOmitted",
            format!(
                "{} service accounts get their entry without some DNS names; first: {first}",
                counts.dns_omitted
            ),
        ),
        None => (
            "True",
            "AllRendered",
            "every DNS name template renders for every service account".to_string(),
        ),
    }
}

/// The `DeletionBrake` condition.
fn deletion_brake(brake: Option<&Brake>) -> (&'static str, &'static str, String) {
    match brake {
        Some(Brake {
            token,
            count,
            total,
        }) => (
            "True",
            "MassDeletionHeld",
            format!(
                "{count} of {total} entries lost their scope at once; nothing is deleted until an operator confirms with: {}",
                confirm_command(token)
            ),
        ),
        None => (
            "False",
            "NotEngaged",
            "no mass deletion is waiting".to_string(),
        ),
    }
}

/// Equal but for condition timestamps.
pub fn same_status(
    a: &crate::policy::SpiffeRegistrationStatus,
    b: &crate::policy::SpiffeRegistrationStatus,
) -> bool {
    let strip = |s: &crate::policy::SpiffeRegistrationStatus| {
        let mut s = s.clone();
        for c in &mut s.conditions {
            c.last_transition_time = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            );
        }
        s
    };
    strip(a) == strip(b)
}

#[cfg(test)]
mod tests;
