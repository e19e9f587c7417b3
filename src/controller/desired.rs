//! Desired state, derived from the caches on every sync and never stored: which SPIRE entries
//! must exist, and for each the set of live in-scope Deployments that need it (its ref-count).
//!
//! ```text
//! Deployment ──resolve──▶ Needs(entry id) ─┐
//!            ├─────────▶ Invalid(policy)  │    entries: id → { entry, needed_by: {Deployments} }
//!            ├─────────▶ OutOfScope        ├──▶ workloads: Deployment → state
//!            └─────────▶ Deleting          │
//! ```
//! Being derived, the ref-count cannot drift across restarts or missed events.

use crate::names::ENTRY_ID_ANNOTATION;
use crate::policy::{Identity, OptIn, Resolution, SpiffeRegistration, resolve};
use crate::spire::{Entry, Ownership};
use k8s_openapi::api::apps::v1::Deployment;
use kube::ResourceExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// `namespace/name` of a Deployment.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeploymentKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for DeploymentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What one Deployment needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkloadState {
    /// In scope: needs entry `entry_id`, with this SPIFFE ID, under `policy`.
    Needs {
        entry_id: String,
        spiffe_id: String,
        policy: String,
    },
    /// Its winning policy cannot render an identity. Its current entry (if any) is held, not
    /// deleted: a typo in a policy must not take identities away.
    Invalid {
        policy: String,
        reason: &'static str,
        message: String,
    },
    /// Not selected (namespace not opted in, no policy).
    OutOfScope,
    /// Has a deletionTimestamp: needs nothing any more. `would_need` is the entry it would
    /// have under current policy, so its finalizer also waits for an entry that was created but
    /// never recorded (a crash between the two).
    Deleting { would_need: Option<String> },
}

#[derive(Clone, Debug)]
pub struct DesiredEntry {
    pub entry: Entry,
    /// The ref-count: live, in-scope Deployments needing this entry. Never empty.
    pub needed_by: BTreeSet<DeploymentKey>,
    /// Policy that rendered it (the winner of the first Deployment needing it).
    pub policy: String,
}

#[derive(Clone, Debug, Default)]
pub struct Desired {
    pub entries: BTreeMap<String, DesiredEntry>,
    pub workloads: BTreeMap<DeploymentKey, WorkloadState>,
    /// Entry IDs that must not be deleted although nothing needs them (held by Invalid
    /// workloads through their recorded entry-id annotation).
    pub held: BTreeSet<String>,
    /// Policy name → Deployments it selects but an older policy wins.
    pub conflicts: BTreeMap<String, BTreeSet<DeploymentKey>>,
}

pub fn key_of(deployment: &Deployment) -> DeploymentKey {
    DeploymentKey {
        namespace: deployment.namespace().unwrap_or_default(),
        name: deployment.name_any(),
    }
}

/// The entry ID a Deployment was last registered with (`registrar.spiffe.io/entry-id`).
pub fn recorded_entry_id(deployment: &Deployment) -> Option<&str> {
    deployment
        .metadata
        .annotations
        .as_ref()?
        .get(ENTRY_ID_ANNOTATION)
        .map(String::as_str)
}

/// The deterministic ID of the entry `identity` needs.
fn id_for(ownership: &Ownership, identity: &Identity) -> String {
    ownership.entry_id(
        &identity.spiffe_id,
        &identity.parent_id,
        &identity.selectors,
    )
}

/// The SPIRE entry for a rendered identity: the one place policy output becomes an entry.
fn entry_for(ownership: &Ownership, identity: &Identity) -> Entry {
    Entry {
        id: id_for(ownership, identity),
        spiffe_id: identity.spiffe_id.clone(),
        parent_id: identity.parent_id.clone(),
        selectors: identity.selectors.clone(),
        x509_svid_ttl: identity.x509_svid_ttl,
        jwt_svid_ttl: identity.jwt_svid_ttl,
        dns_names: identity.dns_names.clone(),
        federates_with: identity.federates_with.clone(),
        hint: ownership.hint().to_string(),
        revision_number: 0,
    }
}

/// Derives desired state from a snapshot of the caches.
pub fn compute(
    ownership: &Ownership,
    opt_in: &OptIn,
    deployments: &[Arc<Deployment>],
    namespace_labels: &dyn Fn(&str) -> Option<BTreeMap<String, String>>,
    policies: &[Arc<SpiffeRegistration>],
) -> Desired {
    let mut desired = Desired::default();
    for deployment in deployments {
        let key = key_of(deployment);
        let labels = namespace_labels(&key.namespace);
        let resolution = resolve(
            opt_in,
            &key.namespace,
            labels.as_ref(),
            deployment,
            policies.iter().map(Arc::as_ref),
        );
        if deployment.metadata.deletion_timestamp.is_some() {
            let would_need = resolution.identity().map(|i| id_for(ownership, i));
            desired
                .workloads
                .insert(key, WorkloadState::Deleting { would_need });
            continue;
        }
        let state = match resolution {
            Resolution::OutOfScope => WorkloadState::OutOfScope,
            Resolution::Invalid { policy, error } => {
                if let Some(id) =
                    recorded_entry_id(deployment).filter(|id| ownership.id_is_ours(id))
                {
                    desired.held.insert(id.to_string());
                }
                WorkloadState::Invalid {
                    policy: policy.name_any(),
                    reason: error.reason(),
                    message: error.to_string(),
                }
            }
            Resolution::InScope {
                policy,
                identity,
                losers,
            } => {
                for loser in losers {
                    desired
                        .conflicts
                        .entry(loser.name_any())
                        .or_default()
                        .insert(key.clone());
                }
                let entry_id = id_for(ownership, &identity);
                let desired_entry =
                    desired
                        .entries
                        .entry(entry_id.clone())
                        .or_insert_with(|| DesiredEntry {
                            entry: entry_for(ownership, &identity),
                            needed_by: BTreeSet::new(),
                            policy: policy.name_any(),
                        });
                desired_entry.needed_by.insert(key.clone());
                WorkloadState::Needs {
                    entry_id,
                    spiffe_id: identity.spiffe_id,
                    policy: policy.name_any(),
                }
            }
        };
        desired.workloads.insert(key, state);
    }
    desired
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{mk_deployment, mk_policy};

    fn enabled(ns: &str) -> Option<BTreeMap<String, String>> {
        (ns != "off")
            .then(|| BTreeMap::from([("spiffe.io/registrar".to_string(), "enabled".to_string())]))
    }

    #[test]
    fn shared_service_accounts_share_one_refcounted_entry() {
        let o = Ownership::new("c").expect("valid");
        let deployments: Vec<Arc<Deployment>> = vec![
            Arc::new(mk_deployment("a", "web", Some("api"), &[])),
            Arc::new(mk_deployment("a", "worker", Some("api"), &[])),
            Arc::new(mk_deployment("a", "db", None, &[])),
            Arc::new(mk_deployment("off", "x", None, &[])),
        ];
        let policies = vec![Arc::new(mk_policy("p", 1, |_| {}))];
        let desired = compute(&o, &OptIn::default(), &deployments, &enabled, &policies);
        assert_eq!(desired.entries.len(), 2);
        let shared = desired
            .entries
            .values()
            .find(|e| e.entry.spiffe_id.ends_with("/sa/api"))
            .expect("api entry");
        assert_eq!(shared.needed_by.len(), 2);
        assert_eq!(shared.entry.x509_svid_ttl, 3600);
        assert!(o.is_ours(&shared.entry));
        assert_eq!(
            desired.workloads[&DeploymentKey {
                namespace: "off".into(),
                name: "x".into()
            }],
            WorkloadState::OutOfScope
        );
    }

    #[test]
    fn deleting_deployments_drop_out_of_the_refcount() {
        let o = Ownership::new("c").expect("valid");
        let mut leaving = mk_deployment("a", "web", Some("api"), &[]);
        leaving.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let deployments = vec![
            Arc::new(leaving),
            Arc::new(mk_deployment("a", "worker", Some("api"), &[])),
        ];
        let policies = vec![Arc::new(mk_policy("p", 1, |_| {}))];
        let desired = compute(&o, &OptIn::default(), &deployments, &enabled, &policies);
        assert_eq!(desired.entries.len(), 1);
        assert_eq!(
            desired
                .entries
                .values()
                .next()
                .expect("one")
                .needed_by
                .len(),
            1
        );
    }

    #[test]
    fn invalid_policies_hold_recorded_entries_and_conflicts_are_reported() {
        let o = Ownership::new("c").expect("valid");
        let mut registered = mk_deployment("a", "web", None, &[]);
        let id = o.entry_id(
            "spiffe://example.org/ns/a/sa/default",
            "spiffe://example.org/k8s/nodes",
            &[],
        );
        registered.metadata.annotations = Some(BTreeMap::from([(
            ENTRY_ID_ANNOTATION.to_string(),
            id.clone(),
        )]));
        let broken = vec![Arc::new(mk_policy("p", 1, |s| {
            s.parent_id = "spiffe://example.org/..".into()
        }))];
        let desired = compute(
            &o,
            &OptIn::default(),
            &[Arc::new(registered.clone())],
            &enabled,
            &broken,
        );
        assert!(desired.entries.is_empty());
        assert!(desired.held.contains(&id));
        assert!(matches!(
            desired.workloads.values().next(),
            Some(WorkloadState::Invalid {
                reason: "InvalidParentID",
                ..
            })
        ));

        let two = vec![
            Arc::new(mk_policy("old", 1, |_| {})),
            Arc::new(mk_policy("new", 2, |_| {})),
        ];
        let desired = compute(
            &o,
            &OptIn::default(),
            &[Arc::new(registered)],
            &enabled,
            &two,
        );
        assert_eq!(desired.conflicts["new"].len(), 1);
    }
}
