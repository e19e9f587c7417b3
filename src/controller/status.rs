//! Policy status: `Ready` condition and counts, computed purely from the sync's outcome and
//! written only when it changed (so an idle cluster makes no writes).

use super::decide::{Brake, Failures, Memory, SpirePlan};
use super::desired::{Desired, SaState};
use super::policy_notes::confirm_command;
use crate::policy::{SpiffeRegistration, SpiffeRegistrationStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;

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
        entries: counts.entries,
        failures: counts.failed,
        pending_deletions: counts.pending,
    }
}

/// What one policy governs after a sync.
struct Counts {
    /// Deployments running as the service accounts it governs.
    selected: u32,
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
mod tests {
    use super::*;
    use crate::controller::decide::{Input, spire_plan};
    use crate::controller::desired::compute as desired;
    use crate::index::NamespaceInfo;
    use crate::policy::OptIn;
    use crate::policy::testing::{mk_deployment, mk_policy, recorded};
    use crate::spire::Ownership;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    fn enabled(_: &str) -> Option<NamespaceInfo> {
        Some(NamespaceInfo {
            labels: BTreeMap::from([("spiffe.io/registrar".to_string(), "enabled".to_string())]),
            terminating: false,
        })
    }

    fn find<'a>(status: &'a SpiffeRegistrationStatus, type_: &str) -> &'a Condition {
        status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .expect("condition present")
    }

    fn status_of(
        policies: &[Arc<SpiffeRegistration>],
        deployments: Vec<Arc<crate::index::DeploymentRecord>>,
        which: usize,
    ) -> SpiffeRegistrationStatus {
        let o = Ownership::new("c").expect("valid");
        let d = desired(&o, &OptIn::default(), &deployments, &enabled, policies);
        let mut memory = Memory::default();
        let settings = Default::default();
        let observed = BTreeMap::new();
        let plan = spire_plan(
            &Input {
                ownership: &o,
                settings: &settings,
                desired: &d,
                observed: &observed,
                now: std::time::Instant::now(),
                confirmed: None,
            },
            &mut memory,
        );
        compute(
            &policies[which],
            &Outcome {
                desired: &d,
                plan: &plan,
                failures: &Failures::new(),
                memory: &memory,
            },
        )
    }

    #[test]
    fn counts_conditions_and_stable_transition_times() {
        let old = Arc::new(mk_policy("old", 1, |_| {}));
        let new = Arc::new(mk_policy("new", 2, |_| {}));
        let deployments = vec![
            recorded(mk_deployment("a", "web", Some("api"), &[])),
            recorded(mk_deployment("a", "worker", Some("api"), &[])),
        ];
        let policies = [old.clone(), new.clone()];
        let winner = status_of(&policies, deployments.clone(), 0);
        assert_eq!(
            (winner.selected_workloads, winner.entries, winner.failures),
            (2, 1, 0)
        );
        assert_eq!(find(&winner, "Ready").status, "True");
        assert_eq!(find(&winner, "Conflict").status, "False");
        assert_eq!(find(&winner, "DeletionBrake").status, "False");

        let loser = status_of(&policies, deployments.clone(), 1);
        assert_eq!((loser.selected_workloads, loser.entries), (0, 0));
        assert_eq!(find(&loser, "Conflict").status, "True");
        assert!(
            find(&loser, "Conflict")
                .message
                .starts_with("2 Deployments")
        );

        let mut again = (*old).clone();
        again.status = Some(winner.clone());
        let later = status_of(&[Arc::new(again), new], deployments, 0);
        assert_eq!(
            find(&later, "Ready").last_transition_time,
            find(&winner, "Ready").last_transition_time
        );
    }

    #[test]
    fn a_dns_name_left_out_keeps_the_policy_ready_and_is_named_in_its_own_condition() {
        let policy = Arc::new(mk_policy("p", 1, |s| {
            s.dns_names = vec!["{serviceAccount}.svc".into()]
        }));
        let status = status_of(
            &[policy],
            vec![
                recorded(mk_deployment("a", "ok", Some("fine"), &[])),
                recorded(mk_deployment("a", "odd", Some("has.dots"), &[])),
            ],
            0,
        );
        assert_eq!(find(&status, "Ready").status, "True");
        assert_eq!((status.entries, status.failures), (2, 0));
        let dns = find(&status, "DNSNames");
        assert_eq!(
            (dns.status.as_str(), dns.reason.as_str()),
            ("False", "DNSNameOmitted")
        );
        assert!(
            dns.message.starts_with("1 service accounts") && dns.message.contains("a/has.dots"),
            "{}",
            dns.message
        );
    }

    #[test]
    fn a_policy_is_not_ready_while_a_service_account_fails_to_render() {
        // Valid for every name Kubernetes accepts; `..` stands for a name that cannot become
        // a SPIFFE ID path segment.
        let policy = Arc::new(mk_policy("p", 1, |_| {}));
        let status = status_of(
            &[policy],
            vec![
                recorded(mk_deployment("a", "ok", Some("fine"), &[])),
                recorded(mk_deployment("a", "odd", Some(".."), &[])),
            ],
            0,
        );
        let ready = find(&status, "Ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "RegistrationFailed")
        );
        assert!(ready.message.starts_with("1 of 2"), "{}", ready.message);
        assert_eq!((status.entries, status.failures), (1, 1));
    }

    #[test]
    fn an_invalid_policy_is_not_ready_with_the_field_to_fix() {
        let broken = Arc::new(mk_policy("p", 1, |s| s.ttl = Some("5s".into())));
        let status = status_of(&[broken], vec![], 0);
        let ready = find(&status, "Ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "InvalidTTL")
        );
        assert!(ready.message.contains("ttl"), "{}", ready.message);
    }
}
