//! The keys everything is grouped by: a workload (kind, `namespace/name`) and the identity it
//! runs as (`namespace/service account`). Below both the index and the controller, so that
//! neither has to reach into the other for them.

use crate::spire::{Entry, Selector};
use std::sync::Arc;

pub mod custom;
pub use custom::{CustomKind, CustomKindError, CustomKindId};

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

/// The kinds of workload: objects with a Pod template whose Pods run as one service account,
/// bare Pods (no controller owns them, `--bare-pods`) and kinds an operator configures
/// (`--custom-kind`). Every kind shares one index and one ref-count per (namespace, service
/// account).
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
    /// A CRD's kind with a Pod template, configured at start-up (`custom`).
    Custom(CustomKindId),
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
            WorkloadKind::Custom(id) => custom::get(id).kind,
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
            WorkloadKind::Custom(id) => custom::get(id).list_kind,
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
            WorkloadKind::Custom(id) => custom::get(id).api_version,
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
            WorkloadKind::Custom(id) => custom::get(id).plural,
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

    /// A kind configured with `--custom-kind` (a CRD's).
    pub fn is_custom(self) -> bool {
        matches!(self, WorkloadKind::Custom(_))
    }

    /// What was configured for a custom kind.
    pub fn custom(self) -> Option<&'static CustomKind> {
        match self {
            WorkloadKind::Custom(id) => Some(custom::get(id)),
            _ => None,
        }
    }

    /// Parses and registers one `--custom-kind` value (see `custom::parse`).
    pub fn register_custom(text: &str) -> Result<WorkloadKind, CustomKindError> {
        let kind = custom::parse(text)?;
        if Self::parse_builtin(kind.kind).is_some() {
            return Err(CustomKindError::Invalid {
                text: text.trim().to_owned(),
                what: "the kind is a built-in kind's name",
            });
        }
        custom::register(kind, text).map(WorkloadKind::Custom)
    }

    /// Every kind configured with `--custom-kind`.
    pub fn customs() -> impl Iterator<Item = WorkloadKind> {
        custom::all().into_iter().map(WorkloadKind::Custom)
    }

    /// The kind an admission request names, by group, version and kind (a built-in kind
    /// with a Pod template, or a configured one).
    pub fn from_gvk(group: &str, version: &str, kind: &str) -> Option<WorkloadKind> {
        Self::ALL
            .into_iter()
            .chain(Self::customs())
            .find(|k| k.group() == group && k.version() == version && k.name() == kind)
    }

    /// The kind a flag or a policy names (`Deployment`, `statefulset`, `jobs`, `Pod`,
    /// `Rollout`: kind or plural, any case), built in or configured.
    pub fn parse(name: &str) -> Option<WorkloadKind> {
        Self::parse_builtin(name).or_else(|| {
            Self::customs().find(|k| {
                k.name().eq_ignore_ascii_case(name) || k.plural().eq_ignore_ascii_case(name)
            })
        })
    }

    /// `parse` among the built-in kinds only.
    pub fn parse_builtin(name: &str) -> Option<WorkloadKind> {
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

    #[test]
    fn a_custom_kind_is_registered_once_and_answers_like_a_built_in_one() {
        let rollout =
            WorkloadKind::register_custom("argoproj.io/v1alpha1/Rollout/rollouts").expect("valid");
        assert_eq!(
            WorkloadKind::register_custom(" argoproj.io/v1alpha1/Rollout/rollouts:spec.template"),
            Ok(rollout),
            "the same kind, the default path"
        );
        assert_eq!(rollout.name(), "Rollout");
        assert_eq!(rollout.api_version(), "argoproj.io/v1alpha1");
        assert_eq!(
            (rollout.group(), rollout.version()),
            ("argoproj.io", "v1alpha1")
        );
        assert_eq!(rollout.plural(), "rollouts");
        assert_eq!(rollout.list_name(), "RolloutList");
        assert_eq!(rollout.api_path(), "/apis/argoproj.io/v1alpha1/rollouts");
        assert!(rollout.takes_finalizer() && rollout.is_custom());
        assert_eq!(
            WorkloadKind::from_gvk("argoproj.io", "v1alpha1", "Rollout"),
            Some(rollout)
        );
        assert_eq!(WorkloadKind::parse("rollouts"), Some(rollout));
        assert_eq!(WorkloadKind::parse("Rollout"), Some(rollout));
        let custom = rollout.custom().expect("custom");
        assert_eq!(custom.crd_name(), "rollouts.argoproj.io");
        assert_eq!(custom.template, ["spec", "template"]);
        assert!(WorkloadKind::customs().any(|k| k == rollout));
        let key = WorkloadKey {
            kind: rollout,
            namespace: "shop".into(),
            name: "web".into(),
        };
        assert_eq!(key.to_string(), "Rollout shop/web");
        assert_eq!(std::mem::size_of::<WorkloadKind>(), 2, "a key stays small");
    }

    #[test]
    fn malformed_custom_kinds_are_refused_with_what_to_fix() {
        for (text, says) in [
            ("argoproj.io/Rollout/rollouts", "expected <group>"),
            ("argoproj/v1/Rollout/rollouts", "API group"),
            ("apps/v1/Thing/things", "API group"),
            ("x.io/V1/Thing/things", "version"),
            ("x.io/v1/thing/things", "CamelCase"),
            ("x.io/v1/Thing/Things", "plural"),
            ("x.io/v1/Thing/things:spec..template", "template path"),
            ("x.io/v1/Thing/things:spec.tem-plate", "template path"),
            ("x.io/v1/Deployment/deployments", "built-in"),
        ] {
            let error = WorkloadKind::register_custom(text)
                .expect_err(text)
                .to_string();
            assert!(error.contains(says), "{text}: {error}");
            assert!(error.contains("--custom-kind"), "{error}");
        }
    }
}
