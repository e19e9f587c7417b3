//! The Entry API client over tonic: batching, per-call deadlines, retries with back-off, a
//! client-side rate limit and metrics. Connection set-up lives in `transport.rs`.

use super::api::{EntryApi, SpireError};
use super::convert::{entry_to_proto, output_mask, update_mask};
use super::metrics::SpireMetrics;
use super::ownership::Ownership;
use super::proto::entry as pb;
use super::proto::entry::entry_client::EntryClient;
use super::rate_limit::TokenBucket;
use super::results::{create_result, delete_result, result_label, update_result};
use super::retry::{RetryPolicy, is_transient};
use super::types::{DeleteResult, Entry, EntryResult, ItemError};
use std::future::Future;
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tracing::Instrument;
use tracing::{debug, warn};

/// Sizes and limits. Defaults follow the throughput benchmark (docs/benchmarks.md).
#[derive(Clone, Debug)]
pub struct ClientSettings {
    pub create_batch: usize,
    pub update_batch: usize,
    pub delete_batch: usize,
    pub page_size: i32,
    pub retry: RetryPolicy,
    /// Requests per second to SPIRE; 0 disables the limit.
    pub requests_per_second: f64,
    pub burst: u32,
}

impl Default for ClientSettings {
    fn default() -> Self {
        Self {
            create_batch: 100,
            update_batch: 100,
            delete_batch: 200,
            page_size: 500,
            retry: RetryPolicy::default(),
            requests_per_second: 50.0,
            burst: 20,
        }
    }
}

pub struct GrpcEntryClient {
    client: EntryClient<Channel>,
    ownership: Ownership,
    settings: ClientSettings,
    limiter: TokenBucket,
    metrics: SpireMetrics,
    batch: BatchSize,
    /// See `EntryApi::unanswered_since`.
    unanswered_since: std::sync::Mutex<Option<Instant>>,
}

/// The write batch size in use. A batch must finish well within the call deadline, which
/// leadership fencing bounds (4 s by default), but SPIRE's own speed varies by a factor of
/// twenty: on SQLite it created ~270 entries/s into an empty table and ~12/s at 20,000
/// entries (measured by the scale benchmark). So the size halves when a batch takes more
/// than half the deadline, and grows back toward the configured size when batches take less
/// than an eighth. (A quarter was too eager: on PostgreSQL a batch of 100 takes ~0.9 s, and
/// halving it only added round trips.)
struct BatchSize {
    current: std::sync::atomic::AtomicUsize,
}

impl BatchSize {
    const MIN: usize = 5;

    fn new() -> Self {
        Self {
            current: std::sync::atomic::AtomicUsize::new(usize::MAX),
        }
    }

    fn get(&self, configured: usize) -> usize {
        self.current
            .load(std::sync::atomic::Ordering::Relaxed)
            .min(configured)
            .max(1)
    }

    /// Adjusts after a batch of `sent` items took `took` under `deadline`.
    fn observe(&self, sent: usize, took: Duration, deadline: Duration, configured: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = self.get(configured);
        let next = if took * 2 > deadline {
            (sent.min(now) / 2).max(Self::MIN)
        } else if took * 8 < deadline && sent >= now {
            now.saturating_mul(2).min(configured)
        } else {
            return;
        };
        if next != now {
            debug!(
                from = now,
                to = next,
                took_ms = took.as_millis() as u64,
                "SPIRE batch size adjusted"
            );
            self.current.store(next, Relaxed);
        }
    }
}

impl GrpcEntryClient {
    pub fn new(
        channel: Channel,
        ownership: Ownership,
        settings: ClientSettings,
        metrics: SpireMetrics,
    ) -> Self {
        let limiter = TokenBucket::new(settings.requests_per_second, settings.burst);
        Self {
            client: EntryClient::new(channel),
            ownership,
            settings,
            limiter,
            metrics,
            batch: BatchSize::new(),
            unanswered_since: std::sync::Mutex::new(None),
        }
    }

    pub fn ownership(&self) -> &Ownership {
        &self.ownership
    }

    /// An answer (`None`), or a call begun at `unanswered` that got none: the oldest such
    /// start since the last answer is kept.
    fn answered(&self, unanswered: Option<Instant>) {
        let mut since = self
            .unanswered_since
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *since = match (unanswered, *since) {
            (None, _) => None,
            (Some(at), Some(earlier)) => Some(at.min(earlier)),
            (Some(at), None) => Some(at),
        };
    }

    /// One logical call: rate-limited attempts, each with a deadline, retried on transient
    /// codes with back-off until the retry budget is spent.
    async fn call<Req, Resp, F, Fut>(
        &self,
        op: &'static str,
        request: Req,
        send: F,
    ) -> Result<Resp, SpireError>
    where
        Req: Clone,
        F: Fn(EntryClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        self.call_with(&self.settings.retry, op, request, send)
            .await
    }

    /// `call` under another retry policy (a probe wants one short attempt).
    async fn call_with<Req, Resp, F, Fut>(
        &self,
        policy: &RetryPolicy,
        op: &'static str,
        request: Req,
        send: F,
    ) -> Result<Resp, SpireError>
    where
        Req: Clone,
        F: Fn(EntryClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let started = Instant::now();
        let mut attempt = 0u32;
        loop {
            self.limiter.acquire().await;
            let mut req = tonic::Request::new(request.clone());
            req.set_timeout(policy.call_timeout);
            let attempt_started = Instant::now();
            let outcome = tokio::time::timeout(policy.call_timeout, send(self.client.clone(), req))
                .instrument(tracing::debug_span!("spire_call", op, attempt))
                .await
                .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("client-side deadline")));
            let code = match &outcome {
                Ok(_) => tonic::Code::Ok,
                Err(status) => status.code(),
            };
            self.metrics
                .call_duration
                .with_label_values(&[op, &format!("{code:?}")])
                .observe(attempt_started.elapsed().as_secs_f64());
            let status = match outcome {
                Ok(response) => {
                    self.answered(None);
                    return Ok(response.into_inner());
                }
                Err(status) if !is_transient(status.code()) => {
                    // SPIRE answered, with a refusal.
                    self.answered(None);
                    status
                }
                Err(status) => {
                    self.answered(Some(started));
                    status
                }
            };
            if !is_transient(status.code()) {
                return Err(SpireError::Rpc {
                    op,
                    code: status.code(),
                    message: status.message().to_string(),
                });
            }
            attempt += 1;
            let delay = policy.delay(attempt - 1);
            if started.elapsed() + delay > policy.budget {
                return Err(SpireError::Exhausted {
                    op,
                    attempts: attempt,
                    code: status.code(),
                    message: status.message().to_string(),
                });
            }
            warn!(op, attempt, code = ?status.code(), message = status.message(), delay_ms = delay.as_millis() as u64, "SPIRE call failed; retrying");
            tokio::time::sleep(delay).await;
        }
    }

    fn count<T>(&self, op: &str, results: &[Result<T, ItemError>]) {
        for result in results {
            self.metrics
                .entries
                .with_label_values(&[op, result_label(result)])
                .inc();
        }
    }

    /// One batch; the flag is true when the request failed as a whole.
    async fn create_chunk(&self, chunk: &[Entry]) -> (Vec<EntryResult>, bool) {
        let request = pb::BatchCreateEntryRequest {
            entries: chunk.iter().map(entry_to_proto).collect(),
            output_mask: Some(output_mask()),
        };
        let response = self
            .call("batch_create", request, |mut c, r| async move {
                c.batch_create_entry(r).await
            })
            .await
            .map(|r| r.results);
        let failed_whole = response.is_err();
        let results = per_item("batch_create", ids(chunk), response, |id, r| {
            create_result(id, r.status.as_ref(), r.entry)
        });
        (results, failed_whole)
    }

    async fn update_chunk(&self, chunk: &[Entry]) -> (Vec<EntryResult>, bool) {
        let request = pb::BatchUpdateEntryRequest {
            entries: chunk.iter().map(entry_to_proto).collect(),
            input_mask: Some(update_mask()),
            output_mask: Some(output_mask()),
        };
        let response = self
            .call("batch_update", request, |mut c, r| async move {
                c.batch_update_entry(r).await
            })
            .await
            .map(|r| r.results);
        let failed_whole = response.is_err();
        let results = per_item("batch_update", ids(chunk), response, |id, r| {
            update_result(id, r.status.as_ref(), r.entry)
        });
        (results, failed_whole)
    }

    async fn delete_chunk(&self, chunk: &[String]) -> (Vec<DeleteResult>, bool) {
        let request = pb::BatchDeleteEntryRequest {
            ids: chunk.to_vec(),
        };
        let response = self
            .call("batch_delete", request, |mut c, r| async move {
                c.batch_delete_entry(r).await
            })
            .await
            .map(|r| r.results);
        let failed_whole = response.is_err();
        let results = per_item("batch_delete", chunk.to_vec(), response, |id, r| {
            delete_result(id, r.status.as_ref())
        });
        (results, failed_whole)
    }
}

fn ids(entries: &[Entry]) -> Vec<String> {
    entries.iter().map(|e| e.id.clone()).collect()
}

/// Pairs each sent ID with its result (SPIRE answers one per item, in order). A request that
/// failed as a whole, or an answer of the wrong length, fails every item of the chunk.
fn per_item<R, T>(
    op: &'static str,
    ids: Vec<String>,
    response: Result<Vec<R>, SpireError>,
    map: impl Fn(&str, R) -> Result<T, ItemError>,
) -> Vec<Result<T, ItemError>> {
    match response {
        Ok(results) if results.len() == ids.len() => {
            ids.iter().zip(results).map(|(id, r)| map(id, r)).collect()
        }
        Ok(results) => {
            let error = SpireError::ResultCount {
                op,
                sent: ids.len(),
                got: results.len(),
            };
            failed_items(ids.iter(), error)
        }
        Err(error) => failed_items(ids.iter(), error),
    }
}

impl GrpcEntryClient {
    /// Sends `entries` in batches sized by `BatchSize`; once a batch fails as a whole, the
    /// rest is not sent (SPIRE is taken to be down) and fails as retryable.
    async fn in_batches<'a, F, Fut>(
        &self,
        op: &'static str,
        counted_as: &str,
        entries: &'a [Entry],
        configured: usize,
        send: F,
    ) -> Vec<EntryResult>
    where
        F: Fn(&'a [Entry]) -> Fut,
        Fut: Future<Output = (Vec<EntryResult>, bool)>,
    {
        let configured = configured.max(1);
        let mut results = Vec::with_capacity(entries.len());
        let mut down = false;
        let mut rest = entries;
        while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(self.batch.get(configured).min(rest.len()));
            rest = tail;
            let chunk_results = if down {
                not_sent(op, &ids(chunk))
            } else {
                let started = Instant::now();
                let (chunk_results, failed_whole) = send(chunk).await;
                let deadline = self.settings.retry.call_timeout;
                self.batch
                    .observe(chunk.len(), started.elapsed(), deadline, configured);
                down = failed_whole;
                chunk_results
            };
            self.count(counted_as, &chunk_results);
            results.extend(chunk_results);
        }
        results
    }
}

/// A count is a probe: one attempt, no retries (its caller polls). It gets the same
/// deadline as any other call: SPIRE answers a filtered count by walking the matching
/// entries in its datastore, and at 25,000 entries under load that took over 2 s, which a
/// shorter probe deadline read as an outage.
fn probe_policy(call_timeout: Duration) -> RetryPolicy {
    RetryPolicy {
        initial_delay: Duration::ZERO,
        max_delay: Duration::ZERO,
        budget: Duration::ZERO,
        call_timeout,
    }
}

/// Results for a batch skipped because an earlier one failed as a whole: retryable.
fn not_sent<T>(op: &'static str, ids: &[String]) -> Vec<Result<T, ItemError>> {
    failed_items(ids.iter(), SpireError::NotSent { op })
}

/// IDs with their position in the caller's input.
type IndexedIds = Vec<(usize, String)>;

/// Every item of a chunk that failed as a whole gets the request's error.
fn failed_items<'a, T>(
    ids: impl Iterator<Item = &'a String>,
    error: SpireError,
) -> Vec<Result<T, ItemError>> {
    let code = match &error {
        SpireError::Rpc { code, .. } | SpireError::Exhausted { code, .. } => *code,
        SpireError::NotSent { .. } => tonic::Code::Unavailable,
        _ => tonic::Code::Unknown,
    };
    ids.map(|id| {
        Err(ItemError::Other {
            id: id.clone(),
            code,
            message: error.to_string(),
        })
    })
    .collect()
}

impl EntryApi for GrpcEntryClient {
    fn unanswered_since(&self) -> Option<Instant> {
        *self
            .unanswered_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    async fn list_ours(&self) -> Result<Vec<Entry>, SpireError> {
        let mut entries = Vec::new();
        for hint in self.ownership.hints() {
            let mut page_token = String::new();
            loop {
                let request = pb::ListEntriesRequest {
                    filter: Some(pb::list_entries_request::Filter {
                        by_hint: Some(hint.to_string()),
                        ..Default::default()
                    }),
                    output_mask: Some(output_mask()),
                    page_size: self.settings.page_size.max(1),
                    page_token: page_token.clone(),
                };
                let page = self
                    .call("list", request, |mut c, r| async move {
                        c.list_entries(r).await
                    })
                    .await?;
                entries.extend(
                    page.entries
                        .into_iter()
                        .map(super::convert::entry_from_proto),
                );
                if page.next_page_token.is_empty() {
                    break;
                }
                page_token = page.next_page_token;
            }
        }
        let listed = entries.len();
        // The hint filter is the server's word; the ID prefix is ours. Both must agree.
        entries.retain(|entry| self.ownership.is_ours(entry));
        if entries.len() != listed {
            warn!(
                listed,
                ours = entries.len(),
                hint = self.ownership.hint(),
                "entries with our hint but a foreign ID prefix were ignored"
            );
        }
        debug!(count = entries.len(), "listed our SPIRE entries");
        Ok(entries)
    }

    async fn count_hinted(&self) -> Result<u64, SpireError> {
        let mut total = 0;
        let policy = probe_policy(self.settings.retry.call_timeout);
        for hint in self.ownership.hints() {
            let request = pb::CountEntriesRequest {
                filter: Some(pb::count_entries_request::Filter {
                    by_hint: Some(hint.to_string()),
                    ..Default::default()
                }),
            };
            let response = self
                .call_with(&policy, "count", request, |mut c, r| async move {
                    c.count_entries(r).await
                })
                .await?;
            total += u64::try_from(response.count).unwrap_or(0);
        }
        Ok(total)
    }

    async fn create(&self, entries: Vec<Entry>) -> Vec<EntryResult> {
        let configured = self.settings.create_batch;
        self.in_batches("batch_create", "create", &entries, configured, |chunk| {
            self.create_chunk(chunk)
        })
        .await
    }

    async fn update(&self, entries: Vec<Entry>) -> Vec<EntryResult> {
        let configured = self.settings.update_batch;
        self.in_batches("batch_update", "update", &entries, configured, |chunk| {
            self.update_chunk(chunk)
        })
        .await
    }

    async fn delete(&self, entries: Vec<Entry>) -> Vec<DeleteResult> {
        // Never send a delete for an entry that is not ours, whatever the caller computed.
        let (mut ours, mut foreign): (IndexedIds, IndexedIds) = (Vec::new(), Vec::new());
        for (index, entry) in entries.into_iter().enumerate() {
            let side = if self.ownership.is_ours(&entry) {
                &mut ours
            } else {
                &mut foreign
            };
            side.push((index, entry.id));
        }
        let mut results: Vec<Option<DeleteResult>> = vec![None; ours.len() + foreign.len()];
        for (index, id) in foreign {
            warn!(entry_id = %id, "refusing to delete an entry that is not ours");
            results[index] = Some(Err(ItemError::NotOurs { id }));
        }
        let (indexes, ours): (Vec<usize>, Vec<String>) = ours.into_iter().unzip();
        let mut deleted = Vec::with_capacity(ours.len());
        let mut down = false;
        for chunk in ours.chunks(self.settings.delete_batch.max(1)) {
            if down {
                deleted.extend(not_sent("batch_delete", chunk));
                continue;
            }
            let (chunk_results, failed_whole) = self.delete_chunk(chunk).await;
            down = failed_whole;
            deleted.extend(chunk_results);
        }
        for (index, result) in indexes.into_iter().zip(deleted) {
            results[index] = Some(result);
        }
        let results: Vec<DeleteResult> = results
            .into_iter()
            .map(|r| r.expect("every delete input must get a result"))
            .collect();
        self.count("delete", &results);
        results
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_shrink_when_slow_and_grow_back_when_quick() {
        let deadline = Duration::from_secs(4);
        let size = BatchSize::new();
        assert_eq!(size.get(100), 100, "starts at the configured size");
        size.observe(100, Duration::from_millis(900), deadline, 100);
        assert_eq!(
            size.get(100),
            100,
            "a batch well within the deadline keeps its size"
        );
        size.observe(100, Duration::from_secs(3), deadline, 100);
        assert_eq!(size.get(100), 50);
        size.observe(50, Duration::from_secs(5), deadline, 100);
        assert_eq!(size.get(100), 25, "a timeout halves too");
        for _ in 0..10 {
            size.observe(25, Duration::from_secs(4), deadline, 100);
        }
        assert_eq!(size.get(100), BatchSize::MIN, "never below the floor");
        size.observe(BatchSize::MIN, Duration::from_millis(500), deadline, 100);
        assert_eq!(
            size.get(100),
            BatchSize::MIN,
            "a middling batch keeps the size"
        );
        size.observe(BatchSize::MIN, Duration::from_millis(100), deadline, 100);
        assert_eq!(size.get(100), 2 * BatchSize::MIN);
        size.observe(3, Duration::from_millis(100), deadline, 100);
        assert_eq!(
            size.get(100),
            2 * BatchSize::MIN,
            "a short tail says nothing of the size"
        );
        for _ in 0..10 {
            size.observe(100, Duration::from_millis(10), deadline, 100);
        }
        assert_eq!(
            size.get(100),
            100,
            "back to the configured size, never above"
        );
    }
}
