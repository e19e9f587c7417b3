//! A workload (a Deployment, StatefulSet, DaemonSet, Job or CronJob) as the caches hold it:
//! only what a decision reads. At 50,000 realistic Deployments the full object (kubectl's `last-applied-configuration`, the pod template,
//! managed fields, status) would be gigabytes; k8s-openapi's `Deployment` alone is 2.4 KB
//! before any string. The watch (protobuf, `wire`) and the webhook (JSON, here) decode straight
//! into this shape: unknown fields are skipped without being allocated, and of the annotations
//! only ours are kept.

use super::token::Token;
use crate::keys::{SaKey, WorkloadKey, WorkloadKind};
use crate::names::{ENTRY_ID_ANNOTATION, FINALIZER, SPIFFE_ID_ANNOTATION};
use crate::policy::Labels;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Every annotation we write starts with this; no other annotation is kept.
pub(super) const OUR_ANNOTATION_PREFIX: &str = "registrar.spiffe.io/";

/// Our annotations as they are on the object (never trusted as truth: see `decide`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OurAnnotations {
    /// Both values are the same for every Deployment of a service account; the store shares
    /// one copy among them (`store::Shared`).
    pub spiffe_id: Option<Arc<str>>,
    pub entry_id: Option<Arc<str>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadRecord {
    pub kind: WorkloadKind,
    /// Shared with every other record of the namespace (the store interns it) and with
    /// every key made from this record.
    pub namespace: Arc<str>,
    pub name: Arc<str>,
    pub uid: Token,
    /// For patches that must not race a change they cannot express as a `test`.
    pub resource_version: Token,
    pub created: Option<Timestamp>,
    /// Has a deletionTimestamp.
    pub deleting: bool,
    /// Its kind's CRD is being deleted (custom kinds): a deletion then is the kind going
    /// away, which `desired` treats as a loss of scope (graces, deletion brake), not as a
    /// release.
    pub kind_removing: bool,
    /// The pod template's service account, `default` when unset (as the kubelet runs it).
    pub service_account: Arc<str>,
    pub labels: Labels,
    /// `None` when the object has no finalizer list (JSON Patch paths depend on it). Shared:
    /// nearly every Deployment carries the same list (ours alone).
    pub finalizers: Option<Arc<[Box<str>]>>,
    /// `None` when the object has no annotation map at all (likewise).
    pub annotations: Option<OurAnnotations>,
}

impl WorkloadRecord {
    /// Builds the record from metadata already stripped or not (only ours is kept) and the
    /// pod template's service account fields.
    fn from_parts(
        kind: WorkloadKind,
        meta: &ObjectMeta,
        service_account_name: Option<&str>,
        service_account: Option<&str>,
    ) -> Self {
        let annotations = meta.annotations.as_ref().map(|all| OurAnnotations {
            spiffe_id: all.get(SPIFFE_ID_ANNOTATION).map(|v| Arc::from(v.as_str())),
            entry_id: all.get(ENTRY_ID_ANNOTATION).map(|v| Arc::from(v.as_str())),
        });
        let service_account = service_account_name
            .or(service_account)
            .filter(|sa| !sa.is_empty())
            .unwrap_or("default");
        Self {
            kind,
            namespace: meta.namespace.as_deref().unwrap_or_default().into(),
            name: meta.name.as_deref().unwrap_or_default().into(),
            uid: Token::from(meta.uid.as_deref().unwrap_or_default()),
            resource_version: Token::from(meta.resource_version.as_deref().unwrap_or_default()),
            created: meta.creation_timestamp.as_ref().map(|t| t.0),
            deleting: meta.deletion_timestamp.is_some(),
            kind_removing: false,
            service_account: service_account.into(),
            labels: meta.labels.as_ref().map(Labels::from).unwrap_or_default(),
            finalizers: meta
                .finalizers
                .as_ref()
                .map(|list| list.iter().map(|f| Box::from(f.as_str())).collect()),
            annotations,
        }
    }

    /// A record from a workload's metadata alone (the service account is then `default`):
    /// enough to patch our metadata off it.
    pub fn from_metadata(kind: WorkloadKind, meta: &ObjectMeta) -> Self {
        Self::from_parts(kind, meta, None, None)
    }

    pub fn key(&self) -> WorkloadKey {
        WorkloadKey {
            kind: self.kind,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    pub fn service_account_key(&self) -> SaKey {
        SaKey {
            namespace: self.namespace.clone(),
            service_account: self.service_account.clone(),
        }
    }

    pub fn has_finalizer(&self) -> bool {
        self.finalizers
            .iter()
            .flat_map(|list| list.iter())
            .any(|f| f.as_ref() == FINALIZER)
    }

    pub fn spiffe_id(&self) -> Option<&str> {
        self.annotations.as_ref()?.spiffe_id.as_deref()
    }

    pub fn entry_id(&self) -> Option<&str> {
        self.annotations.as_ref()?.entry_id.as_deref()
    }

    /// Whether `other` differs in anything a decision reads: a new resourceVersion alone
    /// (status, rollouts, other writers' annotations) does not count.
    pub fn differs_for_decisions(&self, other: &WorkloadRecord) -> bool {
        self.differs_beyond_marks(other) || self.marks_differ(other)
    }

    /// Whether `other` differs in more than our marks: in what decides its entry and what
    /// policy status counts.
    pub fn differs_beyond_marks(&self, other: &WorkloadRecord) -> bool {
        let Self {
            kind,
            namespace,
            name,
            uid,
            resource_version: _,
            created,
            deleting,
            kind_removing,
            service_account,
            labels,
            finalizers: _,
            annotations: _,
        } = self;
        *kind != other.kind
            || *namespace != other.namespace
            || *name != other.name
            || *uid != other.uid
            || *created != other.created
            || *deleting != other.deleting
            || *kind_removing != other.kind_removing
            || *service_account != other.service_account
            || *labels != other.labels
    }

    /// Whether our marks differ: our annotations, or the finalizer list (its positions are
    /// what a patch of ours addresses). Only what is written to the workload reads them.
    pub fn marks_differ(&self, other: &WorkloadRecord) -> bool {
        self.finalizers != other.finalizers || self.annotations != other.annotations
    }

    /// What an Event about this workload refers to.
    pub fn object_ref(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some(self.kind.api_version().into()),
            kind: Some(self.kind.name().into()),
            name: Some(self.name.to_string()),
            namespace: Some(self.namespace.to_string()),
            uid: Some(self.uid.to_string()),
            resource_version: Some(self.resource_version.to_string()),
            field_path: None,
        }
    }
}

impl From<&Deployment> for WorkloadRecord {
    fn from(deployment: &Deployment) -> Self {
        let pod = deployment
            .spec
            .as_ref()
            .and_then(|spec| spec.template.spec.as_ref());
        Self::from_parts(
            WorkloadKind::Deployment,
            &deployment.metadata,
            pod.and_then(|p| p.service_account_name.as_deref()),
            pod.and_then(|p| p.service_account.as_deref()),
        )
    }
}

/// What the workload watches and the webhook decode: only the fields a record is built from,
/// so decoding a 10 KB Deployment allocates a few short strings. Every kind decodes into
/// this one shape: the Pod template is `spec.template`, or a CronJob's
/// `spec.jobTemplate.spec.template`. A `Resource` with an `ObjectMeta`, so kube's watch and
/// admission types carry it (as a Deployment: the kind a record gets is the one its decoder
/// was told, see `record`).
#[derive(Clone, Debug, Deserialize)]
pub struct WatchedWorkload {
    #[serde(deserialize_with = "lean_metadata")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<WatchedSpec>,
    /// Set by a custom kind's watch while the kind's CRD is being deleted.
    #[serde(skip)]
    pub kind_removing: bool,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchedSpec {
    #[serde(default)]
    template: Option<WatchedTemplate>,
    /// A CronJob's: the Job spec its Jobs are made from.
    #[serde(default)]
    job_template: Option<Box<WatchedJobTemplate>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
struct WatchedJobTemplate {
    #[serde(default)]
    spec: Option<WatchedSpec>,
}

#[derive(Clone, Debug, Default, Deserialize)]
struct WatchedTemplate {
    #[serde(default)]
    spec: Option<WatchedPodSpec>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchedPodSpec {
    #[serde(default)]
    service_account_name: Option<String>,
    #[serde(default)]
    service_account: Option<String>,
}

impl WatchedWorkload {
    /// From metadata already trimmed to what a record reads (the protobuf watch's decoder).
    pub(super) fn from_parts(
        metadata: ObjectMeta,
        service_account_name: Option<String>,
        service_account: Option<String>,
    ) -> Self {
        Self {
            metadata,
            spec: Some(WatchedSpec {
                template: Some(WatchedTemplate {
                    spec: Some(WatchedPodSpec {
                        service_account_name,
                        service_account,
                    }),
                }),
                job_template: None,
            }),
            kind_removing: false,
        }
    }

    /// From a whole object of a custom kind (decoded as JSON by kube's dynamic API): its
    /// metadata trimmed as the lean decoder trims it, the service account read at the kind's
    /// template path.
    pub fn from_dynamic(object: kube::api::DynamicObject, template: &[&str]) -> Self {
        let (service_account_name, service_account) =
            crate::keys::custom::template_service_account(&object.data, template);
        let meta = object.metadata;
        let controlled = meta
            .owner_references
            .iter()
            .flatten()
            .any(|owner| owner.controller == Some(true));
        let annotations = meta.annotations.map(|all| {
            all.into_iter()
                .filter(|(key, _)| key.starts_with(OUR_ANNOTATION_PREFIX))
                .collect()
        });
        let metadata = ObjectMeta {
            name: meta.name,
            namespace: meta.namespace,
            uid: meta.uid,
            resource_version: meta.resource_version,
            creation_timestamp: meta.creation_timestamp,
            deletion_timestamp: meta.deletion_timestamp,
            labels: meta.labels,
            annotations,
            finalizers: meta.finalizers,
            owner_references: controlled.then(controller_reference),
            ..ObjectMeta::default()
        };
        Self::from_parts(metadata, service_account_name, service_account)
    }

    /// Whether a controller owns it (a Pod of a ReplicaSet, a Job of a CronJob): a Pod that
    /// is not bare.
    pub fn controlled(&self) -> bool {
        self.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|reference| reference.controller == Some(true))
    }

    /// The record of this object as a `kind` (the watch it came from, or the admission
    /// request's kind).
    pub fn record(&self, kind: WorkloadKind) -> WorkloadRecord {
        let spec = self.spec.as_ref();
        let template = spec.and_then(|s| s.template.as_ref()).or_else(|| {
            let job = spec?.job_template.as_ref()?.spec.as_ref()?;
            job.template.as_ref()
        });
        let pod = template.and_then(|t| t.spec.as_ref());
        let mut record = WorkloadRecord::from_parts(
            kind,
            &self.metadata,
            pod.and_then(|p| p.service_account_name.as_deref()),
            pod.and_then(|p| p.service_account.as_deref()),
        );
        record.kind_removing = self.kind_removing;
        record
    }
}

impl kube::Resource for WatchedWorkload {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Deployment".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "apps".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "deployments".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The metadata fields a record needs; managed fields, owner references and the rest are
/// skipped by the parser.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeanMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    creation_timestamp: Option<Time>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default, deserialize_with = "our_annotations")]
    annotations: Option<BTreeMap<String, String>>,
    #[serde(default)]
    finalizers: Option<Vec<String>>,
    #[serde(default)]
    owner_references: Option<Vec<LeanOwner>>,
}

/// An owner reference, for whether it names a controller.
#[derive(Deserialize)]
struct LeanOwner {
    #[serde(default)]
    controller: Option<bool>,
}

/// What the decoders keep of an object's owner references when one names a controller: the
/// flag alone (`WatchedWorkload::controlled`).
pub(super) fn controller_reference() -> Vec<OwnerReference> {
    vec![OwnerReference {
        controller: Some(true),
        ..OwnerReference::default()
    }]
}

fn lean_metadata<'de, D: Deserializer<'de>>(deserializer: D) -> Result<ObjectMeta, D::Error> {
    let LeanMeta {
        name,
        namespace,
        uid,
        resource_version,
        creation_timestamp,
        deletion_timestamp,
        labels,
        annotations,
        finalizers,
        owner_references,
    } = LeanMeta::deserialize(deserializer)?;
    let controlled = owner_references
        .iter()
        .flatten()
        .any(|owner| owner.controller == Some(true));
    Ok(ObjectMeta {
        name,
        namespace,
        uid,
        resource_version,
        creation_timestamp,
        deletion_timestamp,
        labels,
        annotations,
        finalizers,
        owner_references: controlled.then(controller_reference),
        ..ObjectMeta::default()
    })
}

/// The annotation map with only our keys: other values (several KB of
/// `last-applied-configuration`) are skipped unread. An existing map stays `Some`, even empty.
fn our_annotations<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    struct Ours;
    impl<'de> Visitor<'de> for Ours {
        type Value = Option<BTreeMap<String, String>>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an annotation map")
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, inner: D) -> Result<Self::Value, D::Error> {
            inner.deserialize_map(Ours)
        }
        fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
            let mut ours = BTreeMap::new();
            while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                if key.starts_with(OUR_ANNOTATION_PREFIX) {
                    ours.insert(key.into_owned(), map.next_value::<String>()?);
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(Some(ours))
        }
    }
    deserializer.deserialize_option(Ours)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::LabelSource;
    use crate::policy::testing::mk_deployment;
    use serde_json::json;

    /// A Deployment as the apiserver sends it after `kubectl apply`, a rollout and our patch.
    fn realistic_json() -> serde_json::Value {
        let mut d = serde_json::to_value(mk_deployment("a", "web", Some("api"), &[("app", "web")]))
            .expect("serializes");
        d["metadata"]["annotations"] = json!({
            "kubectl.kubernetes.io/last-applied-configuration": "{\"x\":\"".to_string() + &"y".repeat(4096) + "\"}",
            "deployment.kubernetes.io/revision": "3",
            SPIFFE_ID_ANNOTATION: "spiffe://td/ns/a/sa/api",
        });
        d["metadata"]["managedFields"] = json!([{ "manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1", "fieldsV1": { "f:spec": { "f:replicas": {} } } }]);
        d["metadata"]["finalizers"] = json!([FINALIZER]);
        d["metadata"]["resourceVersion"] = json!("42");
        d["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        d["status"] = json!({ "replicas": 1, "observedGeneration": 3 });
        d
    }

    #[test]
    fn the_watch_keeps_what_decisions_read_and_nothing_else() {
        let watched: WatchedWorkload = serde_json::from_value(realistic_json()).expect("decodes");
        let annotations = watched.metadata.annotations.as_ref().expect("still Some");
        assert_eq!(annotations.len(), 1, "only ours: {annotations:?}");
        assert!(watched.metadata.managed_fields.is_none());
        let record = watched.record(WorkloadKind::Deployment);
        assert_eq!(&*record.service_account, "api");
        assert_eq!(record.labels.label("app"), Some("web"));
        assert_eq!(record.spiffe_id(), Some("spiffe://td/ns/a/sa/api"));
        assert_eq!(record.entry_id(), None);
        assert!(record.has_finalizer());
        assert_eq!(record.resource_version.to_string(), "42");
        assert!(record.created.is_some());
        assert!(!record.deleting);

        let full: Deployment = serde_json::from_value(realistic_json()).expect("decodes");
        assert_eq!(
            WorkloadRecord::from(&full),
            record,
            "the webhook's conversion of a full object and the watch's agree"
        );
    }

    #[test]
    fn absent_and_foreign_only_annotation_maps_stay_distinct() {
        let mut bare = realistic_json();
        bare["metadata"]
            .as_object_mut()
            .expect("object")
            .remove("annotations");
        let bare: WatchedWorkload = serde_json::from_value(bare).expect("decodes");
        assert_eq!(bare.record(WorkloadKind::Deployment).annotations, None);

        let mut foreign = realistic_json();
        foreign["metadata"]["annotations"] = json!({ "other": "x" });
        let foreign: WatchedWorkload = serde_json::from_value(foreign).expect("decodes");
        assert_eq!(
            foreign.record(WorkloadKind::Deployment).annotations,
            Some(OurAnnotations::default()),
            "the map's existence is kept for JSON Patch paths"
        );

        let mut null = realistic_json();
        null["metadata"]["annotations"] = serde_json::Value::Null;
        let null: WatchedWorkload = serde_json::from_value(null).expect("decodes");
        assert_eq!(null.record(WorkloadKind::Deployment).annotations, None);
    }

    /// Each kind's Pod template, where the kind keeps it (a CronJob's inside its Job
    /// template), in the JSON the webhook decodes.
    #[test]
    fn every_kind_s_service_account_is_found_in_json() {
        let pod = json!({ "serviceAccountName": "runner", "containers": [] });
        let template = json!({ "metadata": { "labels": { "app": "x" } }, "spec": pod });
        let cases = [
            (
                WorkloadKind::StatefulSet,
                json!({ "serviceName": "x", "template": template }),
            ),
            (WorkloadKind::DaemonSet, json!({ "template": template })),
            (
                WorkloadKind::Job,
                json!({ "backoffLimit": 1, "template": template }),
            ),
            (
                WorkloadKind::CronJob,
                json!({ "schedule": "* * * * *", "jobTemplate": { "spec": { "template": template } } }),
            ),
        ];
        for (kind, spec) in cases {
            let object = json!({ "metadata": { "name": "x", "namespace": "a" }, "spec": spec });
            let watched: WatchedWorkload = serde_json::from_value(object).expect("decodes");
            let record = watched.record(kind);
            assert_eq!(&*record.service_account, "runner", "{kind}");
            assert_eq!(record.kind, kind);
            assert_eq!(record.object_ref().kind.as_deref(), Some(kind.name()));
            assert_eq!(
                record.object_ref().api_version.as_deref(),
                Some(kind.api_version())
            );
        }
    }

    #[test]
    fn unset_service_account_is_default() {
        let d = mk_deployment("a", "web", None, &[]);
        assert_eq!(&*WorkloadRecord::from(&d).service_account, "default");
    }

    #[test]
    fn status_rollouts_and_foreign_annotations_are_not_changes() {
        let base: WatchedWorkload = serde_json::from_value(realistic_json()).expect("decodes");
        let old = base.record(WorkloadKind::Deployment);
        let mut rollout = realistic_json();
        rollout["metadata"]["resourceVersion"] = json!("43");
        rollout["metadata"]["generation"] = json!(4);
        rollout["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = json!("4");
        rollout["spec"]["replicas"] = json!(5);
        rollout["status"] = json!({ "replicas": 5 });
        let rollout: WatchedWorkload = serde_json::from_value(rollout).expect("decodes");
        assert!(!old.differs_for_decisions(&rollout.record(WorkloadKind::Deployment)));

        // What changed, and whether it is our marks alone (policy status and SPIRE's
        // entries cannot depend on it).
        type Edit = fn(&mut serde_json::Value);
        let edits: [(&str, Edit, bool); 5] = [
            (
                "label",
                |d| d["metadata"]["labels"]["tier"] = json!("x"),
                false,
            ),
            (
                "finalizer",
                |d| d["metadata"]["finalizers"] = json!([]),
                true,
            ),
            (
                "service account",
                |d| d["spec"]["template"]["spec"]["serviceAccountName"] = json!("other"),
                false,
            ),
            (
                "entry-id",
                |d| d["metadata"]["annotations"][ENTRY_ID_ANNOTATION] = json!("x"),
                true,
            ),
            (
                "deletion",
                |d| d["metadata"]["deletionTimestamp"] = json!("2026-01-02T00:00:00Z"),
                false,
            ),
        ];
        for (what, edit, marks_only) in edits {
            let mut changed = realistic_json();
            edit(&mut changed);
            let changed: WatchedWorkload = serde_json::from_value(changed).expect("decodes");
            let changed = changed.record(WorkloadKind::Deployment);
            assert!(old.differs_for_decisions(&changed), "{what}");
            assert_eq!(old.marks_differ(&changed), marks_only, "{what}");
            assert_eq!(old.differs_beyond_marks(&changed), !marks_only, "{what}");
        }
    }
}
