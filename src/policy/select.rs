//! Which policy governs a service account. Several may match its Deployments; the winner is
//! the highest `priority`, then the oldest policy, then the smallest name: deterministic on
//! every replica. The others are reported as losers.

use super::crd::{PolicySelector, SpiffeRegistration};
use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};
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

fn parse(field: &'static str, selector: &PolicySelector) -> Result<Selector, SelectorError> {
    Selector::try_from(selector.to_label_selector()).map_err(|e| SelectorError {
        field,
        message: e.to_string(),
    })
}

/// Whether `selector` (unset = everything) matches `labels`.
pub fn selector_matches(
    field: &'static str,
    selector: Option<&PolicySelector>,
    labels: &BTreeMap<String, String>,
) -> Result<bool, SelectorError> {
    let Some(selector) = selector else {
        return Ok(true);
    };
    Ok(parse(field, selector)?.matches(labels))
}

/// Checks both selectors can be evaluated. A policy failing this is in doubt: it might match
/// anything, so the controller deletes nothing while it exists (see `Desired::doubt`).
pub fn validate_selectors(policy: &SpiffeRegistration) -> Result<(), SelectorError> {
    if let Some(s) = &policy.spec.namespace_selector {
        parse("namespaceSelector", s)?;
    }
    if let Some(s) = &policy.spec.deployment_selector {
        parse("deploymentSelector", s)?;
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

/// The policies governing a service account whose Deployments carry `deployment_labels`
/// (one map per live Deployment), in a namespace with `namespace_labels`. Policies being
/// deleted and policies whose selectors cannot be evaluated never match.
pub fn select<'p, 'l>(
    policies: impl IntoIterator<Item = &'p SpiffeRegistration>,
    namespace_labels: &BTreeMap<String, String>,
    deployment_labels: impl IntoIterator<Item = &'l BTreeMap<String, String>> + Clone,
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
            namespace == Ok(true)
                && deployment_labels.clone().into_iter().any(|labels| {
                    selector_matches(
                        "deploymentSelector",
                        p.spec.deployment_selector.as_ref(),
                        labels,
                    ) == Ok(true)
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
