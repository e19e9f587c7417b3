//! The keys everything is grouped by: a Deployment (`namespace/name`) and the identity it
//! runs as (`namespace/service account`). Below both the index and the controller, so that
//! neither has to reach into the other for them.

use crate::spire::{Entry, Selector};
use std::sync::Arc;

/// `namespace/name` of a Deployment. Shared strings: keys are cloned into every per-sync
/// map and into `decide::Memory`, and at 50,000 Deployments a copy each time would be most
/// of a sync's allocations.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeploymentKey {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl std::fmt::Display for DeploymentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// `namespace/service account`: what one identity is for.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SaKey {
    pub namespace: Arc<str>,
    pub service_account: Arc<str>,
}

impl std::fmt::Display for SaKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.service_account)
    }
}

impl SaKey {
    /// The service account an entry of ours is for, read from its selectors (what SPIRE says,
    /// not what anyone wrote on a Deployment). `None` for any other selector shape.
    pub fn of_entry(entry: &Entry) -> Option<SaKey> {
        let (namespace, service_account) = Self::parts_of_entry(entry)?;
        Some(SaKey {
            namespace: namespace.into(),
            service_account: service_account.into(),
        })
    }

    /// `of_entry` without allocating: (namespace, service account).
    pub fn parts_of_entry(entry: &Entry) -> Option<(&str, &str)> {
        let [a, b] = entry.selectors.as_slice() else {
            return None;
        };
        let namespace = a.value.strip_prefix("ns:").filter(|_| a.kind == "k8s")?;
        let service_account = b.value.strip_prefix("sa:").filter(|_| b.kind == "k8s")?;
        Some((namespace, service_account))
    }

    pub fn selectors(&self) -> Vec<Selector> {
        vec![
            Selector::new("k8s", format!("ns:{}", self.namespace)),
            Selector::new("k8s", format!("sa:{}", self.service_account)),
        ]
    }
}

/// The built-in kinds of workload: objects with a Pod template whose Pods run as one service
/// account. Every kind shares one index and one ref-count per (namespace, service account).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
    DaemonSet,
    Job,
    CronJob,
}

impl WorkloadKind {
    pub const ALL: [WorkloadKind; 5] = [
        WorkloadKind::Deployment,
        WorkloadKind::StatefulSet,
        WorkloadKind::DaemonSet,
        WorkloadKind::Job,
        WorkloadKind::CronJob,
    ];

    /// The kind's name, as in an object's `kind`.
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "Deployment",
            WorkloadKind::StatefulSet => "StatefulSet",
            WorkloadKind::DaemonSet => "DaemonSet",
            WorkloadKind::Job => "Job",
            WorkloadKind::CronJob => "CronJob",
        }
    }

    /// The list's `kind`.
    pub fn list_name(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "DeploymentList",
            WorkloadKind::StatefulSet => "StatefulSetList",
            WorkloadKind::DaemonSet => "DaemonSetList",
            WorkloadKind::Job => "JobList",
            WorkloadKind::CronJob => "CronJobList",
        }
    }

    /// `group/version`.
    pub fn api_version(self) -> &'static str {
        match self {
            WorkloadKind::Deployment | WorkloadKind::StatefulSet | WorkloadKind::DaemonSet => {
                "apps/v1"
            }
            WorkloadKind::Job | WorkloadKind::CronJob => "batch/v1",
        }
    }

    /// The resource's plural, as in RBAC rules and URLs.
    pub fn plural(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "deployments",
            WorkloadKind::StatefulSet => "statefulsets",
            WorkloadKind::DaemonSet => "daemonsets",
            WorkloadKind::Job => "jobs",
            WorkloadKind::CronJob => "cronjobs",
        }
    }

    /// The cluster-wide collection's path on the apiserver.
    pub fn api_path(self) -> String {
        format!("/apis/{}/{}", self.api_version(), self.plural())
    }
}
