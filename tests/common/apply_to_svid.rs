//! The apply-to-SVID benchmark: Deployments applied one after another (each its own service
//! account, so each needs a new entry), and for each, when its entry appeared in SPIRE, when
//! its workload started, and when the workload first held its SVID (the workload's own
//! report). Run by `cargo run --release --example apply-to-svid` for the figures and, with a
//! few Deployments, by the test suite so that it cannot rot.

use super::node::apply;
use super::node_agent::workload_deployment;
use super::reports::{self, Line};
use super::sampler::spire_client;
use super::spire::TRUST_DOMAIN;
use super::stack::Stack;
use spiffe_registrar::spire::convert::entry_from_proto;
use spiffe_registrar::spire::proto::entry::ListEntriesRequest;
use spiffe_registrar::spire::proto::entry::list_entries_request::Filter;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One Deployment's times, in ms since its `kubectl apply` returned.
#[derive(Clone, Debug)]
pub struct Timing {
    pub entry_ms: i64,
    pub workload_started_ms: i64,
    pub svid_ms: i64,
}

impl Timing {
    /// The part of apply-to-SVID spent after both the entry and the workload existed: the
    /// agent's sync (it learns of new entries on its sync interval) and the SVID's signing.
    pub fn agent_ms(&self) -> i64 {
        self.svid_ms - self.entry_ms.max(self.workload_started_ms)
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// Applies `count` Deployments in namespace `ns` (opted in, under a policy whose entries reach
/// the node's agent), `interval` apart, and waits for each Pod's SVID.
pub async fn measure(
    stack: &Stack,
    ns: &str,
    hint: &str,
    count: usize,
    interval: Duration,
) -> Vec<Timing> {
    let (node, agent) = stack.node();
    let sockets = node.dir.join("agent-sockets");
    let socket = stack.spire_server.socket.clone();
    let hint = hint.to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // SPIFFE ID → when SPIRE first listed it.
    let sampler = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut seen: BTreeMap<String, i64> = BTreeMap::new();
            let mut client = spire_client(&socket).await;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let request = ListEntriesRequest {
                    filter: Some(Filter {
                        by_hint: Some(hint.clone()),
                        ..Default::default()
                    }),
                    page_size: 1000,
                    ..Default::default()
                };
                if let Ok(response) = client.list_entries(request).await {
                    let at = now_ms();
                    for entry in response
                        .into_inner()
                        .entries
                        .into_iter()
                        .map(entry_from_proto)
                    {
                        seen.entry(entry.spiffe_id).or_insert(at);
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            seen
        })
    };
    let mut applied = Vec::with_capacity(count);
    for i in 0..count {
        let name = format!("w{i}");
        let yaml = workload_deployment(ns, &name, &name, 1, &agent.reports, &sockets);
        tokio::task::block_in_place(|| apply(&stack.kube, &yaml));
        applied.push((name, now_ms()));
        tokio::time::sleep(interval).await;
    }
    let client = stack.kube.client().await;
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(client, ns);
    let mut svids: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(120 + count as u64 * 2);
    while svids.len() < count {
        assert!(
            std::time::Instant::now() < deadline,
            "only {} of {count} Pods held their SVID: {svids:?}",
            svids.len()
        );
        let list = pods.list(&Default::default()).await.expect("the Pods list");
        for pod in list.items {
            let (Some(pod_name), Some(app)) = (
                pod.metadata.name.clone(),
                pod.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("app").cloned()),
            ) else {
                continue;
            };
            if svids.contains_key(&app) {
                continue;
            }
            let lines = reports::read(&agent.reports, &pod_name);
            let started = lines.first().map(at_ms);
            let svid = lines.iter().find_map(|line| match line {
                Line::Svids { at_ms, svids } if !svids.is_empty() => Some(*at_ms),
                _ => None,
            });
            if let (Some(started), Some(svid)) = (started, svid) {
                svids.insert(app, (started, svid));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = sampler.await.expect("the sampler does not panic");
    applied
        .into_iter()
        .map(|(name, at)| {
            let id = format!("spiffe://{TRUST_DOMAIN}/ns/{ns}/sa/{name}");
            let entry = *seen
                .get(&id)
                .unwrap_or_else(|| panic!("SPIRE never listed {id}"));
            let (started, svid) = svids[&name];
            Timing {
                entry_ms: entry - at,
                workload_started_ms: started - at,
                svid_ms: svid - at,
            }
        })
        .collect()
}

/// A report line's time. The first line is the workload's first second, or an earlier event:
/// the workload started no later than that.
fn at_ms(line: &Line) -> i64 {
    match line {
        Line::Svids { at_ms, .. }
        | Line::Jwt { at_ms, .. }
        | Line::Second { at_ms, .. }
        | Line::Error { at_ms, .. } => *at_ms,
    }
}

/// The `q` quantile (nearest rank) of `values`.
pub fn quantile(values: &[i64], q: f64) -> i64 {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// p50 and p99 of each part, as one JSON object.
pub fn summary(timings: &[Timing]) -> serde_json::Value {
    let part = |f: &dyn Fn(&Timing) -> i64| {
        let values: Vec<i64> = timings.iter().map(f).collect();
        serde_json::json!({ "p50_ms": quantile(&values, 0.5), "p99_ms": quantile(&values, 0.99) })
    };
    serde_json::json!({
        "deployments": timings.len(),
        "apply_to_svid": part(&|t| t.svid_ms),
        "apply_to_entry": part(&|t| t.entry_ms),
        "apply_to_workload_started": part(&|t| t.workload_started_ms),
        "agent_sync_and_signing": part(&|t| t.agent_ms()),
    })
}
