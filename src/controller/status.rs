//! Policy status: `Ready` condition and counts, computed purely from the sync's outcome and
//! written only when it changed (so an idle cluster makes no writes).

use super::desired::{Desired, WorkloadState};
use super::view::ApplyReport;
use crate::policy::render::validate;
use crate::policy::select::validate_selectors;
use crate::policy::{SpiffeRegistration, SpiffeRegistrationStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;

/// Why a policy is not usable at all, if it is not: (reason, message).
pub fn policy_problem(policy: &SpiffeRegistration) -> Option<(&'static str, String)> {
    if let Err(error) = validate(&policy.spec) {
        return Some((error.reason(), error.to_string()));
    }
    validate_selectors(policy)
        .err()
        .map(|e| ("InvalidSelector", e.to_string()))
}

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

/// The status `policy` should have after this sync.
pub fn compute(
    policy: &SpiffeRegistration,
    desired: &Desired,
    report: &ApplyReport,
) -> SpiffeRegistrationStatus {
    let name = policy.name_any();
    let selected = desired
        .workloads
        .values()
        .filter(|w| matches!(w, WorkloadState::Needs { policy, .. } | WorkloadState::Invalid { policy, .. } if *policy == name))
        .count() as u32;
    let entries: Vec<&String> = desired
        .entries
        .iter()
        .filter(|(_, e)| e.policy == name)
        .map(|(id, _)| id)
        .collect();
    let failures = entries
        .iter()
        .filter(|id| report.failures.contains_key(**id))
        .count() as u32;
    let conflicts = desired.conflicts.get(&name).map(|c| c.len()).unwrap_or(0);
    let (status, reason, message) = if let Some((reason, message)) = policy_problem(policy) {
        ("False", reason.to_string(), message)
    } else if failures > 0 {
        let first = entries
            .iter()
            .find_map(|id| report.failures.get(*id))
            .map(ToString::to_string)
            .unwrap_or_default();
        (
            "False",
            "RegistrationFailed".to_string(),
            format!(
                "{failures} of {} entries failed; first: {first}",
                entries.len()
            ),
        )
    } else {
        let mut message = format!(
            "{selected} workloads registered under {} entries",
            entries.len()
        );
        if conflicts > 0 {
            message.push_str(&format!(
                "; {conflicts} more match but an older policy applies to them"
            ));
        }
        ("True", "Registered".to_string(), message)
    };
    let (conflict, conflict_reason, conflict_message) = if conflicts > 0 {
        (
            "True",
            "OlderPolicyApplies",
            format!("{conflicts} Deployments match this policy but an older one applies to them"),
        )
    } else {
        (
            "False",
            "NoConflict",
            "no Deployment matched by this policy is claimed by an older one".to_string(),
        )
    };
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
        ],
        observed_generation: policy.metadata.generation,
        selected_workloads: selected,
        entries: entries.len() as u32,
        failures,
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
    use crate::controller::desired::compute as desired;
    use crate::policy::OptIn;
    use crate::policy::testing::{mk_deployment, mk_policy};
    use crate::spire::Ownership;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    fn enabled(_: &str) -> Option<BTreeMap<String, String>> {
        Some(BTreeMap::from([(
            "spiffe.io/registrar".to_string(),
            "enabled".to_string(),
        )]))
    }

    fn find<'a>(status: &'a SpiffeRegistrationStatus, type_: &str) -> &'a Condition {
        status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .expect("condition present")
    }

    #[test]
    fn counts_conditions_and_stable_transition_times() {
        let o = Ownership::new("c").expect("valid");
        let old = Arc::new(mk_policy("old", 1, |_| {}));
        let new = Arc::new(mk_policy("new", 2, |_| {}));
        let deployments = vec![
            Arc::new(mk_deployment("a", "web", Some("api"), &[])),
            Arc::new(mk_deployment("a", "worker", Some("api"), &[])),
        ];
        let d = desired(
            &o,
            &OptIn::default(),
            &deployments,
            &enabled,
            &[old.clone(), new.clone()],
        );
        let report = ApplyReport::default();

        let winner = compute(&old, &d, &report);
        assert_eq!(
            (winner.selected_workloads, winner.entries, winner.failures),
            (2, 1, 0)
        );
        assert_eq!(find(&winner, "Ready").status, "True");
        assert_eq!(find(&winner, "Conflict").status, "False");

        let loser = compute(&new, &d, &report);
        assert_eq!((loser.selected_workloads, loser.entries), (0, 0));
        assert_eq!(find(&loser, "Conflict").status, "True");
        assert!(
            find(&loser, "Conflict")
                .message
                .starts_with("2 Deployments")
        );

        let mut again = (*old).clone();
        again.status = Some(winner.clone());
        let later = compute(&again, &d, &report);
        assert_eq!(
            find(&later, "Ready").last_transition_time,
            find(&winner, "Ready").last_transition_time
        );
    }

    #[test]
    fn an_invalid_policy_is_not_ready_with_the_field_to_fix() {
        let broken = mk_policy("p", 1, |s| s.ttl = Some("5s".into()));
        let status = compute(
            &broken,
            &crate::controller::desired::Desired::default(),
            &ApplyReport::default(),
        );
        let ready = find(&status, "Ready");
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "InvalidTTL")
        );
        assert!(ready.message.contains("ttl"), "{}", ready.message);
    }
}
