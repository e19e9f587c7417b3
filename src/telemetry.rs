//! Logging set-up and the plain-HTTP admin port: `/healthz` (the process is alive),
//! `/readyz` (every cache synced and a serving certificate loaded), `/metrics` (Prometheus).

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus::{Encoder, Registry, TextEncoder};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// JSON logs when `json` (in-cluster), human-readable otherwise; filter from `RUST_LOG`.
pub fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,kube=warn,tower=warn,hyper=warn,h2=warn")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

/// Readiness is the conjunction of named gates, each flipped once by its owner.
#[derive(Default)]
pub struct Readiness {
    gates: std::sync::Mutex<Vec<(&'static str, Arc<AtomicBool>)>>,
}

impl Readiness {
    /// A new gate, initially not ready.
    pub fn gate(&self, name: &'static str) -> Arc<AtomicBool> {
        let flag = Arc::new(AtomicBool::new(false));
        self.gates
            .lock()
            .expect("gates lock")
            .push((name, flag.clone()));
        flag
    }

    /// Names of the gates still closed.
    pub fn pending(&self) -> Vec<&'static str> {
        let gates = self.gates.lock().expect("gates lock");
        gates
            .iter()
            .filter(|(_, flag)| !flag.load(Ordering::SeqCst))
            .map(|(name, _)| *name)
            .collect()
    }
}

#[derive(Clone)]
struct AdminState {
    registry: Registry,
    readiness: Arc<Readiness>,
}

pub fn admin_router(registry: Registry, readiness: Arc<Readiness>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(AdminState {
            registry,
            readiness,
        })
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    let pending = state.readiness.pending();
    if pending.is_empty() {
        (StatusCode::OK, "ok\n".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("waiting for: {}\n", pending.join(", ")),
        )
    }
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    let mut buffer = Vec::new();
    let encoder = TextEncoder::new();
    if let Err(error) = encoder.encode(&state.registry.gather(), &mut buffer) {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics failed: {error}\n"),
        )
            .into_response();
    }
    (
        [("content-type", encoder.format_type().to_string())],
        buffer,
    )
        .into_response()
}
