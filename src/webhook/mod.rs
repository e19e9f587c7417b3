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
