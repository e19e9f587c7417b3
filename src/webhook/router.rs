//! HTTP in front of `review::answer`: `POST /mutate`, with a body limit and a per-request
//! timeout; malformed bodies get a 400 with the reason, never a panic or a hang.

use super::metrics::WebhookMetrics;
use super::review::answer;
use crate::index::PolicyView;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Deployments are at most ~1.5 MiB in etcd; an UPDATE review carries two of them.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// kube-apiserver gives up after the configuration's timeoutSeconds (5 s in our manifests).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct WebhookState {
    pub view: Arc<dyn PolicyView>,
    pub metrics: WebhookMetrics,
    /// The registrar's own Kubernetes username (from a SelfSubjectReview at start-up): its
    /// `entry-id` writes pass the webhook unchanged.
    pub registrar_user: Option<Arc<str>>,
}

pub fn router(state: WebhookState) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .with_state(state)
}

async fn mutate(State(state): State<WebhookState>, body: Bytes) -> Response {
    let started = Instant::now();
    match answer(&body, state.view.as_ref(), state.registrar_user.as_deref()) {
        Ok(answer) => {
            state
                .metrics
                .requests
                .with_label_values(&[answer.operation, answer.outcome.label()])
                .inc();
            state
                .metrics
                .duration
                .with_label_values(&[answer.operation])
                .observe(started.elapsed().as_secs_f64());
            axum::Json(answer.review).into_response()
        }
        Err(error) => {
            state
                .metrics
                .requests
                .with_label_values(&["unknown", "bad_request"])
                .inc();
            tracing::warn!(%error, bytes = body.len(), "rejected a malformed admission request");
            (StatusCode::BAD_REQUEST, format!("{error}\n")).into_response()
        }
    }
}
