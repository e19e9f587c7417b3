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

/// Readiness: ready once every handle given out has been released (a cache synced, a
/// certificate loaded), and never again once a long-lived task has failed.
#[derive(Default)]
pub struct Readiness {
    handles: std::sync::Mutex<Vec<(&'static str, Arc<AtomicBool>)>>,
    failed: std::sync::Mutex<Option<String>>,
}

/// Held by whatever readiness waits for; `release` says it is done. A handle can only be
/// released, never taken back, so readiness cannot flap with a polled flag.
#[must_use = "readiness waits until this handle is released"]
pub struct ReadyHandle {
    released: Arc<AtomicBool>,
}

impl ReadyHandle {
    pub fn release(self) {
        self.released.store(true, Ordering::SeqCst);
    }
}

impl Readiness {
    /// A new handle named `name`; readiness waits until it is released.
    pub fn handle(&self, name: &'static str) -> ReadyHandle {
        let released = Arc::new(AtomicBool::new(false));
        self.handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((name, released.clone()));
        ReadyHandle { released }
    }

    /// Not ready from now on, with `why` shown by `/readyz` (the process is about to exit).
    pub fn fail(&self, why: String) {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
    }

    /// Why the process is not ready, if it is not.
    pub fn not_ready(&self) -> Option<String> {
        if let Some(why) = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Some(format!("failed: {why}"));
        }
        let handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        let pending: Vec<&str> = handles
            .iter()
            .filter(|(_, released)| !released.load(Ordering::SeqCst))
            .map(|(name, _)| *name)
            .collect();
        (!pending.is_empty()).then(|| format!("waiting for: {}", pending.join(", ")))
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
    match state.readiness.not_ready() {
        None => (StatusCode::OK, "ok\n".to_string()),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
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

/// Every metric we export is named `spiffe_registrar_<name>`: the dashboard and alerts in
/// `manifests/monitoring` select on these names alone, with no job label to configure.
pub const METRIC_NAMESPACE: &str = "spiffe_registrar";

/// The registry `/metrics` serves, with our namespace on every name.
pub fn new_registry() -> Registry {
    Registry::new_custom(Some(METRIC_NAMESPACE.to_string()), None)
        .expect("a constant, valid metric namespace")
}

/// `webhook_certificate_expiry_timestamp_seconds`: when the serving certificate now loaded
/// expires (Unix seconds), set on every load. Alerted on well before it matters (renewal
/// happens after 2/3 of the lifetime).
pub fn serving_cert_expiry() -> &'static prometheus::Gauge {
    static EXPIRY: std::sync::LazyLock<prometheus::Gauge> = std::sync::LazyLock::new(|| {
        prometheus::Gauge::new(
            "webhook_certificate_expiry_timestamp_seconds",
            "Unix time at which the webhook serving certificate being served expires",
        )
        .expect("valid metric")
    });
    &EXPIRY
}

/// Registers everything `/metrics` serves that is not owned by one component: heap, Kubernetes
/// writes, the serving certificate's expiry.
pub fn register_process_metrics(registry: &Registry) -> Result<(), prometheus::Error> {
    registry.register(Box::new(heap::HeapCollector::new()?))?;
    registry.register(Box::new(kube_writes().clone()))?;
    registry.register(Box::new(serving_cert_expiry().clone()))?;
    Ok(())
}

/// `kube_write_duration_seconds{verb,resource,result}`: every write we make to the apiserver
/// (patches, status, Events, the Lease), so latency and errors show by kind of write.
pub fn kube_writes() -> &'static prometheus::HistogramVec {
    static WRITES: std::sync::LazyLock<prometheus::HistogramVec> = std::sync::LazyLock::new(|| {
        prometheus::HistogramVec::new(
            prometheus::HistogramOpts::new(
                "kube_write_duration_seconds",
                "Kubernetes writes by verb, resource and result",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            &["verb", "resource", "result"],
        )
        .expect("valid metric")
    });
    &WRITES
}

/// Runs one Kubernetes write and records it in `kube_writes`.
pub async fn kube_write<T>(
    verb: &'static str,
    resource: &'static str,
    write: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, kube::Error> {
    let started = std::time::Instant::now();
    let result = write.await;
    let outcome = match &result {
        Ok(_) => "ok",
        Err(kube::Error::Api(status)) => match status.code {
            401 | 403 => "forbidden",
            404 => "not_found",
            409 => "conflict",
            500.. => "server_error",
            _ => "rejected",
        },
        Err(_) => "unreachable",
    };
    kube_writes()
        .with_label_values(&[verb, resource, outcome])
        .observe(started.elapsed().as_secs_f64());
    result
}

/// Heap bytes in use, as counted by the binary's allocator wrapper (`main.rs`). RSS alone
/// cannot tell data we hold from pages the allocator keeps; these two gauges can, which is
/// what memory sizing and a suspected leak both need. Both read 0 where nothing counts
/// (unit tests, the library used elsewhere).
pub mod heap {
    use prometheus::core::{Collector, Desc};
    use prometheus::proto::MetricFamily;
    use prometheus::{IntGauge, Opts};
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    static LIVE: AtomicUsize = AtomicUsize::new(0);
    static PEAK: AtomicUsize = AtomicUsize::new(0);

    /// Called by the allocator on every allocation: two relaxed atomics, and a third only
    /// when a new peak is reached.
    #[inline]
    pub fn allocated(bytes: usize) {
        let now = LIVE.fetch_add(bytes, Relaxed).wrapping_add(bytes);
        if now > PEAK.load(Relaxed) {
            PEAK.fetch_max(now, Relaxed);
        }
    }

    #[inline]
    pub fn freed(bytes: usize) {
        LIVE.fetch_sub(bytes, Relaxed);
    }

    pub fn live() -> usize {
        LIVE.load(Relaxed)
    }

    pub fn peak() -> usize {
        PEAK.load(Relaxed)
    }

    /// Starts a new peak from what is live now (to measure one phase's high-water mark).
    pub fn reset_peak() {
        PEAK.store(LIVE.load(Relaxed), Relaxed);
    }

    /// `heap_live_bytes` and `heap_peak_bytes`, read when scraped.
    pub struct HeapCollector {
        live: IntGauge,
        peak: IntGauge,
    }

    impl HeapCollector {
        pub fn new() -> Result<Self, prometheus::Error> {
            Ok(Self {
                live: IntGauge::with_opts(Opts::new(
                    "heap_live_bytes",
                    "Heap bytes allocated and not yet freed (data held, not allocator slack)",
                ))?,
                peak: IntGauge::with_opts(Opts::new(
                    "heap_peak_bytes",
                    "Highest heap_live_bytes since the process started",
                ))?,
            })
        }
    }

    impl Collector for HeapCollector {
        fn desc(&self) -> Vec<&Desc> {
            self.live
                .desc()
                .into_iter()
                .chain(self.peak.desc())
                .collect()
        }

        fn collect(&self) -> Vec<MetricFamily> {
            self.live.set(i64::try_from(live()).unwrap_or(i64::MAX));
            self.peak.set(i64::try_from(peak()).unwrap_or(i64::MAX));
            self.live
                .collect()
                .into_iter()
                .chain(self.peak.collect())
                .collect()
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn counts_follow_allocations_and_the_peak_stays() {
            let before = (live(), peak());
            allocated(1 << 20);
            assert_eq!(live(), before.0 + (1 << 20));
            assert!(peak() >= before.0 + (1 << 20));
            freed(1 << 20);
            assert_eq!(live(), before.0);
            assert!(
                peak() >= before.0 + (1 << 20),
                "the peak is not lowered by a free"
            );
            let registry = prometheus::Registry::new();
            registry
                .register(Box::new(HeapCollector::new().unwrap()))
                .unwrap();
            let names: Vec<String> = registry
                .gather()
                .iter()
                .map(|f| f.name().to_string())
                .collect();
            assert_eq!(names, ["heap_live_bytes", "heap_peak_bytes"]);
        }
    }
}
