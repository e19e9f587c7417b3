//! AdmissionReview in, AdmissionReview out. Decides from the in-memory view only (no API call
//! on the request path), so dry-run requests are answered exactly like real ones.

use super::patch::{EntryIdFix, guard_entry_id, stamp};
use crate::index::PolicyView;
use crate::index::workload::WatchedWorkload;
use crate::keys::WorkloadKind;
use crate::names::{ENTRY_ID_ANNOTATION, SPIFFE_ID_ANNOTATION};
use crate::policy::resolve;
use base64::Engine;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview, Operation};
use serde_json::{Value, json};
use std::sync::Arc;

/// A body we cannot answer with a review: the caller gets HTTP 400 and this message.
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("body is not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error(
        "expected apiVersion admission.k8s.io/v1, kind AdmissionReview; got {api_version:?}, {kind:?}"
    )]
    WrongType { api_version: String, kind: String },
    #[error("not a valid AdmissionReview request: {0}")]
    Malformed(String),
}

/// How a request was answered, for `admission_requests_total{result}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A patch was returned.
    Patched,
    /// In scope and already carrying both: nothing to change.
    Unchanged,
    /// Not ours to touch (other kind or operation, out of scope, being deleted, invalid policy).
    Skipped,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Patched => "patched",
            Outcome::Unchanged => "unchanged",
            Outcome::Skipped => "skipped",
        }
    }
}

/// The answer to one review.
pub struct Answer {
    pub review: Value,
    pub outcome: Outcome,
    pub operation: &'static str,
}

fn operation_label(operation: &Operation) -> &'static str {
    match operation {
        Operation::Create => "CREATE",
        Operation::Update => "UPDATE",
        Operation::Delete => "DELETE",
        Operation::Connect => "CONNECT",
    }
}

/// A review's request, with its objects decoded as the caches decode Deployments: only our
/// annotations, the finalizers, labels and the service account. A Deployment on the wire is
/// 10–20 KB (kubectl's `last-applied-configuration`, the pod template); the webhook reads a
/// few hundred bytes of it, and decodes nothing else.
type LeanRequest = AdmissionRequest<WatchedWorkload>;

/// The request, or why the body is not a review. Every real request takes the first, single
/// pass; a body that fails it is parsed again generically, only to tell the caller precisely
/// what is wrong (or that the object is not a Deployment we can read).
fn parse(body: &[u8]) -> Result<Result<LeanRequest, AdmissionRequest<DynamicObject>>, ReviewError> {
    if let Ok(review) = serde_json::from_slice::<AdmissionReview<WatchedWorkload>>(body)
        && review.types.api_version == "admission.k8s.io/v1"
        && review.types.kind == "AdmissionReview"
        && let Ok(request) = TryInto::<LeanRequest>::try_into(review)
    {
        return Ok(Ok(request));
    }
    let value: Value = serde_json::from_slice(body).map_err(ReviewError::NotJson)?;
    let api_version = value
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let kind = value
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if api_version != "admission.k8s.io/v1" || kind != "AdmissionReview" {
        return Err(ReviewError::WrongType {
            api_version: api_version.into(),
            kind: kind.into(),
        });
    }
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_value(value).map_err(|e| ReviewError::Malformed(e.to_string()))?;
    let request: AdmissionRequest<DynamicObject> =
        review
            .try_into()
            .map_err(|e: kube::core::admission::ConvertAdmissionReviewError| {
                ReviewError::Malformed(e.to_string())
            })?;
    Ok(Err(request))
}

/// Answers one review. `registrar_user` is the registrar's own Kubernetes username: only it
/// may set `entry-id` to anything but the ID policy computes.
pub fn answer(
    body: &[u8],
    view: &dyn PolicyView,
    registrar_user: Option<&str>,
) -> Result<Answer, ReviewError> {
    let (uid, operation, (outcome, patch, warnings)) = match parse(body)? {
        Ok(request) => (
            request.uid.clone(),
            operation_label(&request.operation),
            decide(&request, body, view, registrar_user),
        ),
        Err(unreadable) => {
            if let Some(kind) = registered_kind(&unreadable.kind, view) {
                tracing::warn!(namespace = ?unreadable.namespace, name = %unreadable.name, kind = kind.name(), api_version = kind.api_version(), "admitted object is not a valid workload of its kind; leaving it unchanged");
            }
            (
                unreadable.uid.clone(),
                operation_label(&unreadable.operation),
                (Outcome::Skipped, Vec::new(), Vec::new()),
            )
        }
    };
    let mut response = json!({ "uid": uid, "allowed": true });
    if !patch.is_empty() {
        let encoded = serde_json::to_vec(&patch).expect("JSON Patch operations must serialize");
        response["patchType"] = "JSONPatch".into();
        response["patch"] = base64::engine::general_purpose::STANDARD
            .encode(encoded)
            .into();
    }
    if !warnings.is_empty() {
        response["warnings"] = warnings.into();
    }
    Ok(Answer {
        review: json!({ "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response }),
        outcome,
        operation,
    })
}

/// The request's kind, when it is one the registrar registers (`--workload-kinds`).
fn registered_kind(
    kind: &kube::core::GroupVersionKind,
    view: &dyn PolicyView,
) -> Option<WorkloadKind> {
    WorkloadKind::from_gvk(&kind.group, &kind.version, &kind.kind).filter(|k| view.registers(*k))
}

/// A custom kind's Pod template is where its configuration says (`--custom-kind`), which the
/// lean decoder cannot know: the object is read again, generically. Custom kinds are rare
/// next to Deployments, and this costs one more parse of their requests only.
fn custom_service_account(body: &[u8], template: &[&str]) -> Arc<str> {
    let value: Value = serde_json::from_slice(body).unwrap_or_default();
    let object = value.pointer("/request/object").unwrap_or(&Value::Null);
    let (name, legacy) = crate::keys::custom::template_service_account(object, template);
    let account = name.or(legacy).filter(|sa| !sa.is_empty());
    account.as_deref().unwrap_or("default").into()
}

fn decide(
    request: &LeanRequest,
    body: &[u8],
    view: &dyn PolicyView,
    registrar_user: Option<&str>,
) -> (Outcome, Vec<json_patch::PatchOperation>, Vec<String>) {
    let skipped = (Outcome::Skipped, Vec::new(), Vec::new());
    let Some(kind) = registered_kind(&request.kind, view) else {
        return skipped;
    };
    if !matches!(request.operation, Operation::Create | Operation::Update) {
        return skipped;
    }
    // Its watch event follows as soon as the apiserver has stored it.
    view.admitted(kind);
    let Some(deployment) = &request.object else {
        return skipped;
    };
    // Never stamp an object on its way out: that would undo the controller's finalizer removal.
    if deployment.metadata.deletion_timestamp.is_some() {
        return skipped;
    }
    let namespace = request
        .namespace
        .clone()
        .or_else(|| deployment.metadata.namespace.clone())
        .unwrap_or_default();
    let labels = view.namespace_labels(&namespace);
    let policies = view.policies();
    let mut record = deployment.record(kind);
    if let Some(custom) = kind.custom() {
        record.service_account = custom_service_account(body, custom.template);
    }
    let service_account = &*record.service_account;
    let siblings = view.sibling_labels(&namespace, service_account, (kind, &request.name));
    let resolution = resolve(
        view.opt_in(),
        &namespace,
        labels.as_ref(),
        service_account,
        std::iter::once((kind, &record.labels)).chain(siblings.iter().map(|(k, l)| (*k, l))),
        policies.iter().map(Arc::as_ref),
        view.ownership(),
    );
    let entry = resolution.entry();
    let mut warnings = Vec::new();
    let mut ops = Vec::new();
    if let Some(fix) = entry_id_fix(
        request,
        deployment,
        entry.map(|e| e.id.as_str()),
        registrar_user,
    ) {
        warnings.push(fix.warning);
        ops.push(fix.operation);
    }
    let Some(entry) = entry else {
        return if ops.is_empty() {
            skipped
        } else {
            (Outcome::Patched, ops, warnings)
        };
    };
    ops.extend(stamp(&deployment.metadata, &entry.spiffe_id));
    if ops.is_empty() {
        return (Outcome::Unchanged, ops, Vec::new());
    }
    warnings.extend(replaced_spiffe_id(deployment, &entry.spiffe_id));
    tracing::debug!(namespace = %namespace, deployment = %request.name, spiffe_id = %entry.spiffe_id, dry_run = request.dry_run, "stamping Deployment");
    (Outcome::Patched, ops, warnings)
}

/// `entry-id` is ours to write: a user may remove it, or set the one value policy computes,
/// but never point it at another entry (it pins nothing anyway: see controller::decide). The
/// registrar's own writes pass.
fn entry_id_fix(
    request: &LeanRequest,
    deployment: &WatchedWorkload,
    computed: Option<&str>,
    registrar_user: Option<&str>,
) -> Option<EntryIdFix> {
    let by_registrar =
        registrar_user.is_some_and(|me| request.user_info.username.as_deref() == Some(me));
    if by_registrar {
        return None;
    }
    let old_entry_id = request
        .old_object
        .as_ref()
        .and_then(|old| old.metadata.annotations.as_ref()?.get(ENTRY_ID_ANNOTATION));
    guard_entry_id(
        &deployment.metadata,
        old_entry_id.map(String::as_str),
        computed,
    )
}

/// The warning for a user-written `spiffe-id` that policy overrides.
fn replaced_spiffe_id(deployment: &WatchedWorkload, spiffe_id: &str) -> Option<String> {
    let user_value = deployment
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SPIFFE_ID_ANNOTATION))
        .filter(|v| **v != spiffe_id)?;
    Some(format!(
        "{SPIFFE_ID_ANNOTATION} is set from policy; replaced {user_value:?} with {spiffe_id:?}"
    ))
}
