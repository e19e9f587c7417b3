//! The keys everything is grouped by: a workload (kind, `namespace/name`) and the identity it
//! runs as (`namespace/service account`). Below both the index and the controller, so that
//! neither has to reach into the other for them.

use crate::spire::{Entry, Selector};
use std::sync::Arc;

/// A workload: its kind and `namespace/name` (a StatefulSet and a Deployment may share a
/// name). Shared strings: keys are cloned into every per-sync map and into
/// `decide::Memory`, and at 50,000 workloads a copy each time would be most of a sync's
/// allocations.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkloadKey {
    pub kind: WorkloadKind,
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

/// `namespace/name` for a Deployment (what every log and Event has always said), `Kind
/// namespace/name` for the other kinds.
impl std::fmt::Display for WorkloadKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            WorkloadKind::Deployment => write!(f, "{}/{}", self.namespace, self.name),
            kind => write!(f, "{} {}/{}", kind.name(), self.namespace, self.name),
        }
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
/// account, and bare Pods (no controller owns them, `--bare-pods`). Every kind shares one
/// index and one ref-count per (namespace, service account).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
    DaemonSet,
    Job,
    CronJob,
    /// A Pod no controller owns. Registered without a finalizer (a Pod's deletion is never
    /// held) and not stamped by the webhook: the controller writes its annotations.
    Pod,
}

impl WorkloadKind {
    /// The kinds with a Pod template: stamped by the webhook and held by our finalizer.
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
            WorkloadKind::Pod => "Pod",
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
            WorkloadKind::Pod => "PodList",
        }
    }

    /// `group/version`.
    pub fn api_version(self) -> &'static str {
        match self {
            WorkloadKind::Deployment | WorkloadKind::StatefulSet | WorkloadKind::DaemonSet => {
                "apps/v1"
            }
            WorkloadKind::Job | WorkloadKind::CronJob => "batch/v1",
            WorkloadKind::Pod => "v1",
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
            WorkloadKind::Pod => "pods",
        }
    }

    /// The API group (the part of `api_version` before the slash).
    pub fn group(self) -> &'static str {
        self.api_version()
            .split_once('/')
            .map_or("", |(group, _)| group)
    }

    /// The version (the part of `api_version` after the slash, all of it in the core group).
    pub fn version(self) -> &'static str {
        let api_version = self.api_version();
        api_version
            .split_once('/')
            .map_or(api_version, |(_, version)| version)
    }

    /// The cluster-wide collection's path on the apiserver.
    pub fn api_path(self) -> String {
        match self.group() {
            "" => format!("/api/{}/{}", self.version(), self.plural()),
            _ => format!("/apis/{}/{}", self.api_version(), self.plural()),
        }
    }

    /// Whether our finalizer holds its deletion until its entry's fate is settled (every kind
    /// but bare Pods, whose deletion is the kubelet's business and must never wait on us).
    pub fn takes_finalizer(self) -> bool {
        self != WorkloadKind::Pod
    }

    /// What kube's dynamic API needs to reach the kind.
    pub fn api_resource(self) -> kube::api::ApiResource {
        let gvk = kube::api::GroupVersionKind::gvk(self.group(), self.version(), self.name());
        kube::api::ApiResource::from_gvk_with_plural(&gvk, self.plural())
    }

    /// The kind an admission request or a flag names, by group, version and kind.
    pub fn from_gvk(group: &str, version: &str, kind: &str) -> Option<WorkloadKind> {
        Self::ALL
            .into_iter()
            .find(|k| k.group() == group && k.version() == version && k.name() == kind)
    }

    /// The kind a flag or a policy names (`Deployment`, `statefulset`, `jobs`, `Pod`: kind
    /// or plural, any case).
    pub fn parse(name: &str) -> Option<WorkloadKind> {
        Self::ALL
            .into_iter()
            .chain([WorkloadKind::Pod])
            .find(|k| k.name().eq_ignore_ascii_case(name) || k.plural().eq_ignore_ascii_case(name))
    }
}

impl std::fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_found_by_group_version_kind_and_by_name() {
        for kind in WorkloadKind::ALL {
            assert_eq!(
                WorkloadKind::from_gvk(kind.group(), kind.version(), kind.name()),
                Some(kind)
            );
            assert_eq!(WorkloadKind::parse(kind.plural()), Some(kind));
            assert_eq!(
                kind.api_resource().api_version,
                kind.api_version(),
                "{kind}"
            );
        }
        assert_eq!(
            WorkloadKind::from_gvk("apps", "v1beta1", "Deployment"),
            None
        );
        assert_eq!(WorkloadKind::from_gvk("batch", "v1", "Deployment"), None);
        assert_eq!(WorkloadKind::from_gvk("apps", "v1", "ReplicaSet"), None);
        assert_eq!(WorkloadKind::Job.api_path(), "/apis/batch/v1/jobs");
        let pod = WorkloadKind::Pod;
        assert_eq!((pod.group(), pod.version()), ("", "v1"));
        assert_eq!(pod.api_path(), "/api/v1/pods");
        assert_eq!(pod.api_resource().api_version, "v1");
        assert_eq!(WorkloadKind::parse("pods"), Some(pod));
        assert_eq!(
            WorkloadKind::from_gvk("", "v1", "Pod"),
            None,
            "the webhook never stamps a Pod"
        );
        assert!(!pod.takes_finalizer() && WorkloadKind::ALL.iter().all(|k| k.takes_finalizer()));
    }

    #[test]
    fn a_deployment_reads_as_before_and_other_kinds_name_themselves() {
        let key = |kind| WorkloadKey {
            kind,
            namespace: "shop".into(),
            name: "web".into(),
        };
        assert_eq!(key(WorkloadKind::Deployment).to_string(), "shop/web");
        assert_eq!(key(WorkloadKind::CronJob).to_string(), "CronJob shop/web");
    }
}
