//! SPIRE as the workloads see it, sampled continuously through the Entry API while a test
//! changes something: for each watched (namespace, service account), the entries whose
//! selectors are exactly `k8s:ns:<ns>`, `k8s:sa:<sa>`. A test then asserts on the whole
//! history (never missing, doubled only within the grace), not only on the end state.

use spiffe_registrar::spire::convert::entry_from_proto;
use spiffe_registrar::spire::proto::entry::ListEntriesRequest;
use spiffe_registrar::spire::proto::entry::entry_client::EntryClient;
use spiffe_registrar::spire::proto::entry::list_entries_request::Filter;
use spiffe_registrar::spire::proto::types::{Selector, SelectorMatch, selector_match};
use spiffe_registrar::spire::{Entry, SpireEndpoint, connect};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// `namespace/service account`.
pub type Sa = (String, String);

pub fn sa(namespace: &str, service_account: &str) -> Sa {
    (namespace.to_string(), service_account.to_string())
}

/// A client of the admin socket, for one-shot reads in tests.
pub async fn spire_client(socket: &Path) -> EntryClient<Channel> {
    let endpoint = SpireEndpoint::Unix {
        socket: socket.to_path_buf(),
    };
    let connection = connect(&endpoint, Duration::from_secs(5))
        .await
        .expect("the admin socket must accept connections");
    EntryClient::new(connection.channel)
}

/// Entries whose selector set is exactly this service account's, any writer, any hint.
pub async fn entries_of(client: &mut EntryClient<Channel>, (ns, sa): &Sa) -> Option<Vec<Entry>> {
    let selectors = vec![
        Selector {
            r#type: "k8s".into(),
            value: format!("ns:{ns}"),
        },
        Selector {
            r#type: "k8s".into(),
            value: format!("sa:{sa}"),
        },
    ];
    let request = ListEntriesRequest {
        filter: Some(Filter {
            by_selectors: Some(SelectorMatch {
                selectors,
                r#match: selector_match::MatchBehavior::MatchExact as i32,
            }),
            ..Default::default()
        }),
        page_size: 100,
        ..Default::default()
    };
    let response = client.list_entries(request).await.ok()?.into_inner();
    Some(response.entries.into_iter().map(entry_from_proto).collect())
}

/// One look at SPIRE: entries per watched service account.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Since the sampler started.
    pub at: Duration,
    pub entries: BTreeMap<Sa, Vec<Entry>>,
}

pub struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<Sample>>,
}

impl Sampler {
    /// Starts sampling `watched` every ~20 ms (plus the calls' own time).
    pub async fn start(socket: &Path, watched: &[Sa]) -> Self {
        let mut client = spire_client(socket).await;
        let watched = watched.to_vec();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let first = Arc::new(tokio::sync::Notify::new());
        let first_seen = first.clone();
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let mut samples = Vec::new();
            while !stopping.load(Ordering::SeqCst) {
                let mut entries = BTreeMap::new();
                for sa in &watched {
                    // A failed read (server restarting) is no observation, not an absence.
                    if let Some(found) = entries_of(&mut client, sa).await {
                        entries.insert(sa.clone(), found);
                    }
                }
                if entries.len() == watched.len() {
                    samples.push(Sample {
                        at: started.elapsed(),
                        entries,
                    });
                    if samples.len() == 1 {
                        first_seen.notify_one();
                    }
                }
                // The sampling period, not a wait for an outcome.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            samples
        });
        // The history starts with a first complete look, before the test changes anything.
        tokio::time::timeout(Duration::from_secs(30), first.notified())
            .await
            .expect("SPIRE must answer the sampler");
        Self { stop, task }
    }

    pub async fn stop(self) -> Samples {
        self.stop.store(true, Ordering::SeqCst);
        let samples = self.task.await.expect("the sampler must not panic");
        assert!(samples.len() >= 2, "the sampler saw SPIRE fewer than twice");
        Samples(samples)
    }
}

pub struct Samples(pub Vec<Sample>);

impl Samples {
    fn count(sample: &Sample, sa: &Sa) -> usize {
        sample.entries.get(sa).map_or(0, Vec::len)
    }

    /// Total time during which `pred` held for the entries of `sa` (each sample stands for
    /// the interval until the next one).
    pub fn time_where(&self, pred: impl Fn(&[Entry]) -> bool, sa: &Sa) -> Duration {
        self.0
            .windows(2)
            .filter(|w| pred(w[0].entries.get(sa).map(Vec::as_slice).unwrap_or_default()))
            .map(|w| w[1].at - w[0].at)
            .sum()
    }

    pub fn missing(&self, sa: &Sa) -> Duration {
        self.time_where(<[Entry]>::is_empty, sa)
    }

    pub fn doubled(&self, sa: &Sa) -> Duration {
        self.time_where(|e| e.len() > 1, sa)
    }

    /// Every sample shows at least one entry for `sa`.
    pub fn assert_never_missing(&self, sa: &Sa) {
        if let Some(gap) = self.0.iter().find(|s| Self::count(s, sa) == 0) {
            panic!(
                "{}/{} had no entry at {:?} ({} samples over {:?})",
                sa.0,
                sa.1,
                gap.at,
                self.0.len(),
                self.span()
            );
        }
    }

    /// Every sample shows at least one entry for one of `sas` (a workload moving between
    /// service accounts).
    pub fn assert_always_one_of(&self, sas: &[Sa]) {
        if let Some(gap) = self
            .0
            .iter()
            .find(|s| sas.iter().all(|sa| Self::count(s, sa) == 0))
        {
            panic!("none of {sas:?} had an entry at {:?}", gap.at);
        }
    }

    /// The longest stretch during which `sa` had more than one entry.
    pub fn longest_doubled(&self, sa: &Sa) -> Duration {
        let mut longest = Duration::ZERO;
        let mut since = None;
        for sample in &self.0 {
            match (Self::count(sample, sa) > 1, since) {
                (true, None) => since = Some(sample.at),
                (false, Some(start)) => {
                    longest = longest.max(sample.at - start);
                    since = None;
                }
                _ => {}
            }
        }
        if let (Some(start), Some(last)) = (since, self.0.last()) {
            longest = longest.max(last.at - start);
        }
        longest
    }

    /// Entry IDs seen for `sa`, in order of first appearance.
    pub fn ids(&self, sa: &Sa) -> Vec<String> {
        let mut ids: Vec<String> = Vec::new();
        for sample in &self.0 {
            for entry in sample.entries.get(sa).into_iter().flatten() {
                if !ids.contains(&entry.id) {
                    ids.push(entry.id.clone());
                }
            }
        }
        ids
    }

    /// (first, last) time an entry with `id` was seen for `sa`.
    pub fn seen(&self, sa: &Sa, id: &str) -> Option<(Duration, Duration)> {
        let times: Vec<Duration> = self
            .0
            .iter()
            .filter(|s| s.entries.get(sa).into_iter().flatten().any(|e| e.id == id))
            .map(|s| s.at)
            .collect();
        Some((*times.first()?, *times.last()?))
    }

    /// Distinct (id, revision) pairs seen for `sa`: one means no churn at all.
    pub fn revisions(&self, sa: &Sa) -> Vec<(String, i64)> {
        let mut seen: Vec<(String, i64)> = Vec::new();
        for sample in &self.0 {
            for entry in sample.entries.get(sa).into_iter().flatten() {
                let key = (entry.id.clone(), entry.revision_number);
                if !seen.contains(&key) {
                    seen.push(key);
                }
            }
        }
        seen
    }

    pub fn span(&self) -> Duration {
        self.0.last().map(|s| s.at).unwrap_or_default()
    }

    /// One line for the closing note: how long the identity was missing and doubled.
    pub fn report(&self, what: &str, sa: &Sa) {
        eprintln!(
            "TRANSITION {what}: {} samples over {:?}; missing {:?}; doubled {:?} in total, longest {:?}",
            self.0.len(),
            self.span(),
            self.missing(sa),
            self.doubled(sa),
            self.longest_doubled(sa)
        );
    }
}
