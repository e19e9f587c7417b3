//! Which policy applies to a Deployment. Several may match; the oldest (by creation time, then
//! name) wins, deterministically on every replica, and the others are reported as losers.

use super::crd::SpiffeRegistration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};
use std::collections::BTreeMap;

/// The outcome of selection for one Deployment.
#[derive(Debug)]
pub struct Selection<'p> {
    pub winner: &'p SpiffeRegistration,
    /// Other matching policies, oldest first; they do not apply.
    pub losers: Vec<&'p SpiffeRegistration>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SelectorError {
    pub field: &'static str,
    pub message: String,
}

/// Whether `selector` (unset = everything) matches `labels`.
pub fn selector_matches(
    field: &'static str,
    selector: Option<&LabelSelector>,
    labels: &BTreeMap<String, String>,
) -> Result<bool, SelectorError> {
    let Some(selector) = selector else {
        return Ok(true);
    };
    let parsed = Selector::try_from(selector.clone()).map_err(|e| SelectorError {
        field,
        message: e.to_string(),
    })?;
    Ok(parsed.matches(labels))
}

/// Checks both selectors parse (for the policy's status).
pub fn validate_selectors(policy: &SpiffeRegistration) -> Result<(), SelectorError> {
    let empty = BTreeMap::new();
    selector_matches(
        "namespaceSelector",
        policy.spec.namespace_selector.as_ref(),
        &empty,
    )?;
    selector_matches(
        "deploymentSelector",
        policy.spec.deployment_selector.as_ref(),
        &empty,
    )?;
    Ok(())
}

/// Sort key: oldest first, name as the tie-breaker (creation times have second precision).
fn age_key(policy: &SpiffeRegistration) -> (Option<k8s_openapi::jiff::Timestamp>, String) {
    (
        policy.metadata.creation_timestamp.as_ref().map(|t| t.0),
        policy.name_any(),
    )
}

/// The policies matching a Deployment with `deployment_labels` in a namespace with
/// `namespace_labels`, ignoring policies being deleted and policies whose selectors do not
/// parse (those never match; their status says why).
pub fn select<'p>(
    policies: impl IntoIterator<Item = &'p SpiffeRegistration>,
    namespace_labels: &BTreeMap<String, String>,
    deployment_labels: &BTreeMap<String, String>,
) -> Option<Selection<'p>> {
    let mut matching: Vec<&SpiffeRegistration> = policies
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| {
            selector_matches(
                "namespaceSelector",
                p.spec.namespace_selector.as_ref(),
                namespace_labels,
            )
            .unwrap_or(false)
                && selector_matches(
                    "deploymentSelector",
                    p.spec.deployment_selector.as_ref(),
                    deployment_labels,
                )
                .unwrap_or(false)
        })
        .collect();
    matching.sort_by_key(|p| age_key(p));
    let mut iter = matching.into_iter();
    let winner = iter.next()?;
    Some(Selection {
        winner,
        losers: iter.collect(),
    })
}
