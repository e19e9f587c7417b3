//! SPIRE API metrics: one histogram of call latency by operation and gRPC code, one counter of
//! entries by operation and per-item result.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

#[derive(Clone)]
pub struct SpireMetrics {
    /// `spire_api_call_duration_seconds{op,code}`
    pub call_duration: HistogramVec,
    /// `spire_api_entries_total{op,result}`
    pub entries: IntCounterVec,
}

impl SpireMetrics {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let call_duration = HistogramVec::new(
            HistogramOpts::new(
                "spire_api_call_duration_seconds",
                "Duration of one SPIRE Entry API call attempt",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["op", "code"],
        )?;
        let entries = IntCounterVec::new(
            Opts::new(
                "spire_api_entries_total",
                "Entries sent to SPIRE, by operation and per-item result",
            ),
            &["op", "result"],
        )?;
        registry.register(Box::new(call_duration.clone()))?;
        registry.register(Box::new(entries.clone()))?;
        Ok(Self {
            call_duration,
            entries,
        })
    }

    /// Metrics registered nowhere, for tools and tests that do not scrape.
    pub fn unregistered() -> Self {
        Self::register(&Registry::new()).expect("a fresh registry must accept our metrics")
    }
}
