//! The mutating admission webhook: runs on every replica, decides from the caches alone.
//!
//! ```text
//! kube-apiserver ─TLS (tls.rs, rotating cert)─▶ router.rs (limits, timeout, metrics)
//!                                                  └▶ review.rs: parse, resolve policy
//!                                                       └▶ patch.rs: finalizer + spiffe-id
//! ```
pub mod metrics;
pub mod patch;
pub mod review;
pub mod router;
pub mod tls;

pub use router::{WebhookState, router};

/// The manifests' `matchConditions` entry that sends an UPDATE to the webhook only when it
/// changes something the webhook reads: the labels, the finalizers, our two annotations or
/// the pod template's service account. Any other UPDATE (a rollout, a scale, an image
/// bump) leaves those as they were admitted: the webhook would answer it as it answered
/// before, and what a policy change since then implies is the controller's to write. So a
/// rollout costs no admission round trip, and under `failurePolicy: Fail` an unreachable
/// webhook blocks only the edits it must see. Kept in step with `manifests/` by tests.
pub const RELEVANT_UPDATE_CONDITION: &str = "request.operation != 'UPDATE'
|| object.metadata.?labels != oldObject.metadata.?labels
|| object.metadata.?finalizers != oldObject.metadata.?finalizers
|| object.metadata.?annotations[?'registrar.spiffe.io/spiffe-id'] != oldObject.metadata.?annotations[?'registrar.spiffe.io/spiffe-id']
|| object.metadata.?annotations[?'registrar.spiffe.io/entry-id'] != oldObject.metadata.?annotations[?'registrar.spiffe.io/entry-id']
|| object.?spec.?template.?spec.?serviceAccountName != oldObject.?spec.?template.?spec.?serviceAccountName
|| object.?spec.?template.?spec.?serviceAccount != oldObject.?spec.?template.?spec.?serviceAccount
|| object.?spec.?jobTemplate.?spec.?template.?spec.?serviceAccountName != oldObject.?spec.?jobTemplate.?spec.?template.?spec.?serviceAccountName
|| object.?spec.?jobTemplate.?spec.?template.?spec.?serviceAccount != oldObject.?spec.?jobTemplate.?spec.?template.?spec.?serviceAccount";

/// The name of that condition in the manifests.
pub const RELEVANT_UPDATE_CONDITION_NAME: &str = "changes-what-the-webhook-reads";
