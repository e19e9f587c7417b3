//! HTTP in front of `review::answer`: `POST /mutate`, with a body limit and a per-request
//! timeout; malformed bodies get a 400 with the reason, oversized ones a 413 every client can
//! read, never a panic or a hang.

use super::metrics::WebhookMetrics;
use super::review::answer;
use crate::index::PolicyView;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Deployments are at most ~1.5 MiB in etcd; an UPDATE review carries two of them.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// A body over the limit is read on and dropped, up to this many bytes in all, before the 413
/// is sent: a client that writes its whole request before it reads (kube-apiserver's HTTP/1.1
/// client, curl, most others) would otherwise have its connection closed under it and see a
/// reset instead of the status. Anything longer is cut off (connection closed) at this point:
/// never unbounded reading. The request timeout bounds the time it takes.
pub const DRAIN_CAP_BYTES: usize = 16 * MAX_BODY_BYTES;
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
        // Our own limit (`read_limited`) reads past it to answer; axum's would close early.
        .layer(DefaultBodyLimit::disable())
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .with_state(state)
}

/// Why a body was not read whole.
enum BodyError {
    /// Over `MAX_BODY_BYTES`; `drained` when the rest was read and dropped (the connection
    /// stays usable), not when it ran past `DRAIN_CAP_BYTES`.
    TooLarge {
        drained: bool,
    },
    Unreadable(axum::Error),
}

/// The body, up to `MAX_BODY_BYTES`; past it, the rest is read and dropped (up to
/// `DRAIN_CAP_BYTES` in all) so that the 413 can be read by the client.
async fn read_limited(body: axum::body::Body) -> Result<Bytes, BodyError> {
    use http_body_util::BodyExt;
    let mut body = body;
    let mut kept = bytes::BytesMut::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(BodyError::Unreadable)?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen > DRAIN_CAP_BYTES {
            return Err(BodyError::TooLarge { drained: false });
        }
        if seen <= MAX_BODY_BYTES {
            kept.extend_from_slice(&data);
        } else if !kept.is_empty() {
            // Over the limit: what was kept is freed; the rest is only counted.
            kept = bytes::BytesMut::new();
        }
    }
    if seen > MAX_BODY_BYTES {
        return Err(BodyError::TooLarge { drained: true });
    }
    Ok(kept.freeze())
}

fn too_large(drained: bool) -> Response {
    let mut response = (
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("request body exceeds the length limit of {MAX_BODY_BYTES} bytes\n"),
    )
        .into_response();
    if !drained {
        // The rest of the body was not read: the connection cannot carry another request.
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    response
}

async fn mutate(State(state): State<WebhookState>, request: Request) -> Response {
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let read = match declared {
        // Announced past the cap: not worth reading at all.
        Some(length) if length > DRAIN_CAP_BYTES => Err(BodyError::TooLarge { drained: false }),
        _ => read_limited(request.into_body()).await,
    };
    let body = match read {
        Ok(body) => body,
        Err(BodyError::TooLarge { drained }) => {
            state
                .metrics
                .requests
                .with_label_values(&["unknown", "bad_request"])
                .inc();
            tracing::warn!(
                limit = MAX_BODY_BYTES,
                declared,
                "refused an admission request over the body limit"
            );
            return too_large(drained);
        }
        Err(BodyError::Unreadable(error)) => {
            tracing::warn!(%error, "an admission request's body could not be read");
            return (StatusCode::BAD_REQUEST, format!("{error}\n")).into_response();
        }
    };
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
