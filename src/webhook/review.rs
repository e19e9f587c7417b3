//! AdmissionReview in, AdmissionReview out. Decides from the in-memory view only (no API call
//! on the request path), so dry-run requests are answered exactly like real ones.

use super::patch::stamp;
use crate::names::SPIFFE_ID_ANNOTATION;
use crate::policy::{OptIn, Resolution, SpiffeRegistration, resolve};
use base64::Engine;
use k8s_openapi::api::apps::v1::Deployment;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview, Operation};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;

/// What the webhook reads: the caches of Namespaces and policies.
pub trait PolicyView: Send + Sync {
    fn opt_in(&self) -> &OptIn;
    /// Labels of a namespace, `None` when it is not (yet) known.
    fn namespace_labels(&self, namespace: &str) -> Option<BTreeMap<String, String>>;
    fn policies(&self) -> Vec<Arc<SpiffeRegistration>>;
}

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

pub fn answer(body: &[u8], view: &dyn PolicyView) -> Result<Answer, ReviewError> {
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
    let operation = operation_label(&request.operation);
    let (outcome, patch, warnings) = decide(&request, view);
    let mut response = json!({ "uid": request.uid, "allowed": true });
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

fn decide(
    request: &AdmissionRequest<DynamicObject>,
    view: &dyn PolicyView,
) -> (Outcome, Vec<json_patch::PatchOperation>, Vec<String>) {
    let skipped = (Outcome::Skipped, Vec::new(), Vec::new());
    let is_deployment = request.kind.group == "apps"
        && request.kind.version == "v1"
        && request.kind.kind == "Deployment";
    if !is_deployment || !matches!(request.operation, Operation::Create | Operation::Update) {
        return skipped;
    }
    let Some(object) = &request.object else {
        return skipped;
    };
    let Ok(deployment) =
        serde_json::to_value(object).and_then(serde_json::from_value::<Deployment>)
    else {
        tracing::warn!(namespace = ?request.namespace, name = %request.name, "admitted object is not a valid apps/v1 Deployment; leaving it unchanged");
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
    let resolution = resolve(
        view.opt_in(),
        &namespace,
        labels.as_ref(),
        &deployment,
        policies.iter().map(Arc::as_ref),
    );
    let Resolution::InScope { identity, .. } = resolution else {
        return skipped;
    };
    let ops = stamp(&deployment.metadata, &identity.spiffe_id);
    if ops.is_empty() {
        return (Outcome::Unchanged, ops, Vec::new());
    }
    let mut warnings = Vec::new();
    let user_value = deployment
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SPIFFE_ID_ANNOTATION));
    if let Some(user_value) = user_value.filter(|v| **v != identity.spiffe_id) {
        warnings.push(format!(
            "{SPIFFE_ID_ANNOTATION} is set from policy; replaced {user_value:?} with {:?}",
            identity.spiffe_id
        ));
    }
    tracing::debug!(namespace = %namespace, deployment = %request.name, spiffe_id = %identity.spiffe_id, dry_run = request.dry_run, "stamping Deployment");
    (Outcome::Patched, ops, warnings)
}
