//! What the controller tells operators about policies and the CRD, as Events: the texts,
//! and which of them are news. Pure; `policy_effects` publishes what this returns.

use super::decide::{Brake, Memory};
use super::desired::Desired;
use crate::names::{CONFIRM_DELETIONS_ANNOTATION, CRD_NAME};
use std::collections::HashMap;

/// How an operator confirms the deletions the brake holds (docs/policy.md, "Deletion brake").
pub fn confirm_command(token: &str) -> String {
    format!("kubectl annotate crd {CRD_NAME} {CONFIRM_DELETIONS_ANNOTATION}={token} --overwrite")
}

/// The Event on the CRD while the brake waits for `token` to be confirmed.
pub fn brake_waiting(token: &str) -> String {
    format!(
        "scope loss would delete many entries at once; confirm with: {}",
        confirm_command(token)
    )
}

/// One policy's Events after a sync: (reason, note), warnings all.
pub fn policy_events(
    name: &str,
    generation: i64,
    desired: &Desired,
    memory: &Memory,
    brake: Option<&Brake>,
) -> Vec<(&'static str, String)> {
    let mut events: Vec<(&'static str, String)> = Vec::new();
    if let Some((reason, message)) = desired.invalid_policies.get(name) {
        events.push((reason, format!("{message} (generation {generation})")));
    }
    let rejected: Vec<String> = memory
        .rejected
        .iter()
        .filter(|(id, _)| memory.policy_of(id) == Some(name))
        .map(|(_, (entry, reason))| format!("{}: {reason}", entry.spiffe_id))
        .collect();
    if let Some(first) = rejected.first() {
        events.push((
            "RegistrationRejected",
            format!(
                "SPIRE rejected {} entries of this policy (previous entries are kept); first: {first}",
                rejected.len()
            ),
        ));
    }
    if let Some(matched) = desired.conflicts.get(name) {
        events.push((
            "Overridden",
            format!(
                "{} Deployments match this policy, but another policy governs their service accounts (higher priority, or older)",
                matched.len()
            ),
        ));
    }
    if let Some(brake) = brake {
        events.push((
            "DeletionBrakeEngaged",
            format!(
                "{} entries lost their scope at once; confirm with: {}",
                brake.count,
                confirm_command(&brake.token)
            ),
        ));
    }
    events
}

/// The last note published per (object, reason), so an unchanged situation is announced
/// once (leader only, in memory: a new leader announces each situation once more).
#[derive(Debug, Default)]
pub struct Announced(HashMap<(String, &'static str), String>);

impl Announced {
    /// True the first time `note` is published for (`object`, `reason`).
    pub fn first(&mut self, object: &str, reason: &'static str, note: &str) -> bool {
        let key = (object.to_string(), reason);
        if self.0.get(&key).map(String::as_str) == Some(note) {
            return false;
        }
        self.0.insert(key, note.to_string());
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_hears_of_each_problem_once_until_it_changes() {
        let mut desired = Desired::default();
        desired.invalid_policies.insert(
            "p".into(),
            ("InvalidTemplate", "spec.spiffeIDTemplate: bad".into()),
        );
        let key = |name: &str| crate::keys::WorkloadKey {
            kind: crate::keys::WorkloadKind::Deployment,
            namespace: "ns".into(),
            name: name.into(),
        };
        desired
            .conflicts
            .insert("p".into(), [key("a"), key("b")].into());
        let brake = Brake {
            token: "abc123".into(),
            count: 12,
            total: 40,
        };
        let events = policy_events("p", 3, &desired, &Memory::default(), Some(&brake));
        let reasons: Vec<&str> = events.iter().map(|(r, _)| *r).collect();
        assert_eq!(
            reasons,
            ["InvalidTemplate", "Overridden", "DeletionBrakeEngaged"]
        );
        assert_eq!(events[0].1, "spec.spiffeIDTemplate: bad (generation 3)");
        assert!(events[1].1.starts_with("2 Deployments match this policy"));
        assert!(
            events[2].1.ends_with(&confirm_command("abc123")),
            "{}",
            events[2].1
        );
        assert!(policy_events("other", 1, &desired, &Memory::default(), None).is_empty());

        let mut announced = Announced::default();
        assert!(announced.first("p", "Overridden", &events[1].1));
        assert!(!announced.first("p", "Overridden", &events[1].1));
        assert!(announced.first("q", "Overridden", &events[1].1));
        assert!(announced.first("p", "Overridden", "3 Deployments match this policy"));
    }

    #[test]
    fn the_confirmation_command_names_the_crd_annotation() {
        assert_eq!(
            confirm_command("t0k3n"),
            "kubectl annotate crd spifferegistrations.registrar.spiffe.io registrar.spiffe.io/confirm-deletions=t0k3n --overwrite"
        );
        assert!(
            brake_waiting("t0k3n")
                .ends_with("registrar.spiffe.io/confirm-deletions=t0k3n --overwrite")
        );
    }
}
