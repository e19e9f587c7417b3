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
    let previous = policy
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
    let transition = match previous {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Time(k8s_openapi::jiff::Timestamp::now()),
    };
    SpiffeRegistrationStatus {
        conditions: vec![Condition {
            type_: "Ready".into(),
            status: status.into(),
            reason,
            message,
            last_transition_time: transition,
            observed_generation: policy.metadata.generation,
        }],
        observed_generation: policy.metadata.generation,
        selected_workloads: selected,
        entries: entries.len() as u32,
        failures,
    }
}
