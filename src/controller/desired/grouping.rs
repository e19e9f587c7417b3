//! Workloads grouped by the service account they run as, for the derive: the live ones
//! (the ref-count), and those whose kind is going away with its CRD.

use crate::index::{NamespaceInfo, WorkloadRecord};
use crate::keys::{SaKey, WorkloadKey};
use std::collections::BTreeMap;
use std::sync::Arc;

/// One Deployment as the decisions see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub service_account: SaKey,
    /// Has a deletionTimestamp, or its namespace has.
    pub deleting: bool,
    /// Has a deletionTimestamp because its kind's CRD is being removed, and nothing else runs
    /// as its account: decided as a live workload out of scope (`deleting` is false), so
    /// that its entry has the scope-loss grace.
    pub going_with_its_kind: bool,
    /// Its namespace is being deleted: no Event can be written there any more.
    pub namespace_terminating: bool,
    pub has_finalizer: bool,
    /// Our annotations as currently written (to know what to patch, never as truth). Shared
    /// with the cached record: a sync copies no string per Deployment.
    pub spiffe_id: Option<Arc<str>>,
    pub entry_id: Option<Arc<str>>,
    pub created: Option<k8s_openapi::jiff::Timestamp>,
}

/// Deployments grouped for the decisions.
pub(super) struct Grouped<'d> {
    /// Every Deployment, in cache order.
    pub workloads: Vec<(WorkloadKey, Workload)>,
    /// The live ones, by the service account they run as.
    pub live: BTreeMap<SaKey, Vec<(WorkloadKey, &'d WorkloadRecord)>>,
    /// Those deleted because their kind's CRD is (`kind_removing`), by service account.
    pub fading: BTreeMap<SaKey, Vec<WorkloadKey>>,
    /// What each namespace seen is (looked up once each).
    pub namespaces: BTreeMap<Arc<str>, Option<NamespaceInfo>>,
}

pub(super) fn group<'d>(
    deployments: &'d [Arc<WorkloadRecord>],
    namespaces: &dyn Fn(&str) -> Option<NamespaceInfo>,
) -> Grouped<'d> {
    let mut live: BTreeMap<SaKey, Vec<(WorkloadKey, &WorkloadRecord)>> = BTreeMap::new();
    let mut fading: BTreeMap<SaKey, Vec<WorkloadKey>> = BTreeMap::new();
    let mut namespace_cache: BTreeMap<Arc<str>, Option<NamespaceInfo>> = BTreeMap::new();
    // Collected, then built in one go: a map built from sorted input has full nodes, one
    // filled by inserts in cache order about two-thirds full (a third more memory per
    // Deployment for the whole sync).
    let mut workloads = Vec::with_capacity(deployments.len());
    for deployment in deployments {
        let key = deployment.key();
        let namespace = namespace_cache
            .entry(key.namespace.clone())
            .or_insert_with(|| namespaces(&key.namespace));
        let sa = deployment.service_account_key();
        let namespace_terminating = namespace.as_ref().is_some_and(|ns| ns.terminating);
        let deleting = deployment.deleting || namespace_terminating;
        if !deleting {
            live.entry(sa.clone())
                .or_default()
                .push((key.clone(), deployment.as_ref()));
        } else if deployment.kind_removing && !namespace_terminating {
            fading.entry(sa.clone()).or_default().push(key.clone());
        }
        workloads.push((
            key,
            Workload {
                service_account: sa,
                deleting,
                going_with_its_kind: false,
                namespace_terminating,
                has_finalizer: deployment.has_finalizer(),
                spiffe_id: deployment
                    .annotations
                    .as_ref()
                    .and_then(|a| a.spiffe_id.clone()),
                entry_id: deployment
                    .annotations
                    .as_ref()
                    .and_then(|a| a.entry_id.clone()),
                created: deployment.created,
            },
        ));
    }
    Grouped {
        workloads,
        live,
        fading,
        namespaces: namespace_cache,
    }
}

/// The accounts that only workloads going away with their kind's CRD run as (where live
/// workloads share the account, the removed ones are released like any deletion).
pub(super) fn fading_only(
    fading: BTreeMap<SaKey, Vec<WorkloadKey>>,
    live: &BTreeMap<SaKey, Vec<(WorkloadKey, &WorkloadRecord)>>,
) -> impl Iterator<Item = (SaKey, Vec<WorkloadKey>)> {
    fading
        .into_iter()
        .filter(move |(sa, _)| !live.contains_key(sa))
}
