//! Which policy governs a service account. Several may match its workloads; the winner is
//! the highest `priority`, then the oldest policy, then the smallest name: deterministic on
//! every replica. The others are reported as losers.

use super::crd::{PolicySelector, SelectorRequirement, SpiffeRegistration, SpiffeRegistrationSpec};
use super::labels::LabelSource;
use crate::keys::WorkloadKind;
use kube::ResourceExt;
use std::collections::BTreeMap;

/// The outcome of selection for one service account.
#[derive(Debug)]
pub struct Selection<'p> {
    pub winner: &'p SpiffeRegistration,
    /// Other matching policies, in precedence order; they do not apply.
    pub losers: Vec<&'p SpiffeRegistration>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SelectorError {
    pub field: &'static str,
    pub message: String,
}

/// Whether one requirement holds, with Kubernetes' label-selector semantics (`NotIn` and
/// `DoesNotExist` hold for an absent label). Evaluated in place: selection runs once per
/// service account and policy on every sync, so nothing is parsed or allocated here.
fn requirement_holds(
    field: &'static str,
    requirement: &SelectorRequirement,
    labels: &impl LabelSource,
) -> Result<bool, SelectorError> {
    let value = labels.label(&requirement.key);
    let listed = || value.is_some_and(|v| requirement.values.iter().any(|w| w == v));
    let needs_values = || {
        if requirement.values.is_empty() {
            Err(SelectorError {
                field,
                message: format!(
                    "operator {} on key {:?} needs at least one value",
                    requirement.operator, requirement.key
                ),
            })
        } else {
            Ok(())
        }
    };
    match requirement.operator.as_str() {
        "In" => needs_values().map(|()| listed()),
        "NotIn" => needs_values().map(|()| !listed()),
        "Exists" => Ok(value.is_some()),
        "DoesNotExist" => Ok(value.is_none()),
        other => Err(SelectorError {
            field,
            message: format!(
                "unknown operator {other:?} on key {:?} (In, NotIn, Exists, DoesNotExist)",
                requirement.key
            ),
        }),
    }
}

/// Whether `selector` (unset = everything) matches `labels`. Every requirement is checked
/// for validity, even after one fails to match, so a bad selector is an error whatever the
/// labels.
pub fn selector_matches(
    field: &'static str,
    selector: Option<&PolicySelector>,
    labels: &impl LabelSource,
) -> Result<bool, SelectorError> {
    let Some(selector) = selector else {
        return Ok(true);
    };
    let mut matches = selector
        .match_labels
        .iter()
        .all(|(key, value)| labels.label(key) == Some(value.as_str()));
    for requirement in &selector.match_expressions {
        matches &= requirement_holds(field, requirement, labels)?;
    }
    Ok(matches)
}

/// The selector a policy picks workloads by, with its field's name: `workloadSelector`, or
/// its older name `deploymentSelector` (the same meaning; the apiserver refuses both at once).
pub fn workload_selector(spec: &SpiffeRegistrationSpec) -> (&'static str, Option<&PolicySelector>) {
    match (&spec.workload_selector, &spec.deployment_selector) {
        (None, Some(older)) => ("deploymentSelector", Some(older)),
        (selector, _) => ("workloadSelector", selector.as_ref()),
    }
}

/// Whether the policy applies to workloads of `kind` (`kinds` unset or empty: every kind).
pub fn selects_kind(spec: &SpiffeRegistrationSpec, kind: WorkloadKind) -> bool {
    spec.kinds.is_empty()
        || spec
            .kinds
            .iter()
            .any(|name| WorkloadKind::parse(name) == Some(kind))
}

/// Checks the selectors can be evaluated and the kinds are known. A policy failing this is
/// in doubt: it might match anything, so the controller deletes nothing while it exists (see
/// `Desired::doubt`).
pub fn validate_selectors(policy: &SpiffeRegistration) -> Result<(), SelectorError> {
    let nothing = BTreeMap::new();
    selector_matches(
        "namespaceSelector",
        policy.spec.namespace_selector.as_ref(),
        &nothing,
    )?;
    if policy.spec.workload_selector.is_some() && policy.spec.deployment_selector.is_some() {
        return Err(SelectorError {
            field: "workloadSelector",
            message: "set workloadSelector or its older name deploymentSelector, not both".into(),
        });
    }
    let (field, selector) = workload_selector(&policy.spec);
    selector_matches(field, selector, &nothing)?;
    if let Some(unknown) = policy
        .spec
        .kinds
        .iter()
        .find(|name| WorkloadKind::parse(name).is_none())
    {
        return Err(SelectorError {
            field: "kinds",
            message: format!(
                "unknown kind {unknown:?} (Deployment, StatefulSet, DaemonSet, Job, CronJob, Pod, or a kind configured with --custom-kind)"
            ),
        });
    }
    Ok(())
}

/// Precedence: highest priority first, then oldest, then name (creation times have second
/// precision, so the name breaks ties).
fn precedence(
    policy: &SpiffeRegistration,
) -> (
    std::cmp::Reverse<i32>,
    Option<k8s_openapi::jiff::Timestamp>,
    String,
) {
    (
        std::cmp::Reverse(policy.spec.priority.unwrap_or(0)),
        policy.metadata.creation_timestamp.as_ref().map(|t| t.0),
        policy.name_any(),
    )
}

/// The policies governing a service account whose live workloads are `workloads` (each one's
/// kind and labels), in a namespace with `namespace_labels`. Policies being deleted and
/// policies whose selectors cannot be evaluated never match.
pub fn select<'p, 'l, L: LabelSource + 'l>(
    policies: impl IntoIterator<Item = &'p SpiffeRegistration>,
    namespace_labels: &impl LabelSource,
    workloads: impl IntoIterator<Item = (WorkloadKind, &'l L)> + Clone,
) -> Option<Selection<'p>> {
    let mut matching: Vec<&SpiffeRegistration> = policies
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| {
            let namespace = selector_matches(
                "namespaceSelector",
                p.spec.namespace_selector.as_ref(),
                namespace_labels,
            );
            let (field, selector) = workload_selector(&p.spec);
            namespace == Ok(true)
                && workloads.clone().into_iter().any(|(kind, labels)| {
                    selects_kind(&p.spec, kind)
                        && selector_matches(field, selector, labels) == Ok(true)
                })
        })
        .collect();
    matching.sort_by_key(|p| precedence(p));
    let mut iter = matching.into_iter();
    let winner = iter.next()?;
    Some(Selection {
        winner,
        losers: iter.collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Labels;

    fn requirement(key: &str, operator: &str, values: &[&str]) -> SelectorRequirement {
        SelectorRequirement {
            key: key.into(),
            operator: operator.into(),
            values: values.iter().map(|v| v.to_string()).collect(),
        }
    }

    fn selector(labels: &[(&str, &str)], expressions: Vec<SelectorRequirement>) -> PolicySelector {
        PolicySelector {
            match_labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            match_expressions: expressions,
        }
    }

    /// Kubernetes' semantics, on both label representations the code uses.
    #[test]
    fn table_of_selector_semantics() {
        let map: BTreeMap<String, String> = [("app", "web"), ("tier", "front")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let compact = Labels::from(&map);
        let cases: Vec<(&str, PolicySelector, Result<bool, ()>)> = vec![
            ("empty matches all", selector(&[], vec![]), Ok(true)),
            (
                "matchLabels hit",
                selector(&[("app", "web")], vec![]),
                Ok(true),
            ),
            (
                "matchLabels miss",
                selector(&[("app", "db")], vec![]),
                Ok(false),
            ),
            (
                "In hit",
                selector(&[], vec![requirement("tier", "In", &["back", "front"])]),
                Ok(true),
            ),
            (
                "In absent",
                selector(&[], vec![requirement("zone", "In", &["a"])]),
                Ok(false),
            ),
            (
                "NotIn absent holds",
                selector(&[], vec![requirement("zone", "NotIn", &["a"])]),
                Ok(true),
            ),
            (
                "NotIn listed",
                selector(&[], vec![requirement("app", "NotIn", &["web"])]),
                Ok(false),
            ),
            (
                "Exists",
                selector(&[], vec![requirement("app", "Exists", &[])]),
                Ok(true),
            ),
            (
                "DoesNotExist",
                selector(&[], vec![requirement("app", "DoesNotExist", &[])]),
                Ok(false),
            ),
            (
                "all must hold",
                selector(
                    &[("app", "web")],
                    vec![requirement("tier", "In", &["back"])],
                ),
                Ok(false),
            ),
            (
                "In without values",
                selector(&[], vec![requirement("app", "In", &[])]),
                Err(()),
            ),
            (
                "unknown operator",
                selector(&[], vec![requirement("app", "Gt", &["1"])]),
                Err(()),
            ),
            (
                "invalid even after a miss",
                selector(&[("app", "db")], vec![requirement("app", "Gt", &["1"])]),
                Err(()),
            ),
        ];
        for (what, selector, expected) in cases {
            let on_map = selector_matches("s", Some(&selector), &map).map_err(|_| ());
            let on_compact = selector_matches("s", Some(&selector), &compact).map_err(|_| ());
            assert_eq!(on_map, expected, "{what}");
            assert_eq!(on_compact, expected, "{what} (compact labels)");
        }
    }

    /// Kinds and the workload selector under either name, on one service account whose
    /// workloads are a Deployment `app=web` and a CronJob `app=tick`.
    #[test]
    fn table_of_kinds_and_workload_selectors() {
        use crate::policy::testing::mk_policy;
        let web: BTreeMap<String, String> = [("app".to_string(), "web".to_string())].into();
        let tick: BTreeMap<String, String> = [("app".to_string(), "tick".to_string())].into();
        let workloads = [
            (WorkloadKind::Deployment, &web),
            (WorkloadKind::CronJob, &tick),
        ];
        fn tick_only() -> Option<PolicySelector> {
            Some(selector(&[("app", "tick")], vec![]))
        }
        type Case = (&'static str, fn(&mut SpiffeRegistrationSpec), bool);
        let cases: [Case; 7] = [
            ("no selector, no kinds", |_| {}, true),
            (
                "kinds: the CronJob's",
                |s| s.kinds = vec!["CronJob".into()],
                true,
            ),
            (
                "kinds: none of theirs",
                |s| s.kinds = vec!["StatefulSet".into(), "Job".into()],
                false,
            ),
            (
                "workloadSelector: the CronJob's labels",
                |s| s.workload_selector = tick_only(),
                true,
            ),
            (
                "deploymentSelector means the same",
                |s| s.deployment_selector = tick_only(),
                true,
            ),
            (
                "the labels and the kind on different workloads",
                |s| {
                    s.workload_selector = tick_only();
                    s.kinds = vec!["Deployment".into()];
                },
                false,
            ),
            (
                "kinds by plural, any case",
                |s| {
                    s.workload_selector = tick_only();
                    s.kinds = vec!["cronjobs".into()];
                },
                true,
            ),
        ];
        let nothing = BTreeMap::<String, String>::new();
        for (what, edit, expected) in cases {
            let policy = mk_policy("p", 1, edit);
            assert_eq!(validate_selectors(&policy), Ok(()), "{what}");
            let selected = select([&policy], &nothing, workloads.iter().map(|(k, l)| (*k, *l)));
            assert_eq!(selected.is_some(), expected, "{what}");
        }

        let both = mk_policy("both", 1, |s| {
            s.workload_selector = tick_only();
            s.deployment_selector = tick_only();
        });
        assert_eq!(
            validate_selectors(&both).map_err(|e| e.field),
            Err("workloadSelector")
        );
        let unknown = mk_policy("unknown", 1, |s| s.kinds = vec!["ReplicaSet".into()]);
        assert_eq!(
            validate_selectors(&unknown).map_err(|e| e.field),
            Err("kinds")
        );
    }
}
