//! Webhook metrics: requests by operation and result, and handling latency.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

#[derive(Clone)]
pub struct WebhookMetrics {
    /// `admission_requests_total{operation,result}`; result is patched, unchanged, skipped or
    /// bad_request.
    pub requests: IntCounterVec,
    /// `admission_duration_seconds{operation}`
    pub duration: HistogramVec,
}

impl WebhookMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "admission_requests_total",
                "AdmissionReview requests answered",
            ),
            &["operation", "result"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "admission_duration_seconds",
                "Time to answer one AdmissionReview",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
            ]),
            &["operation"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        Ok(Self { requests, duration })
    }
}
