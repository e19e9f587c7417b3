//! What the bed's workload (`svid-watch`, in a Pod on the node) reports about the identity it
//! holds: the workload's side of every identity claim (invariant 12).

use serde::Deserialize;
use std::path::Path;

#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Svid {
    pub spiffe_id: String,
    /// Go's nil slice is `null`.
    pub dns_names: Option<Vec<String>>,
    pub not_after_ms: i64,
    pub serial: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Line {
    /// The X.509-SVIDs the Workload API delivered (a new set replaces the old).
    Svids { at_ms: i64, svids: Vec<Svid> },
    /// A JWT-SVID fetched after a new X.509 set.
    Jwt {
        at_ms: i64,
        spiffe_id: String,
        audience: Vec<String>,
        expiry_ms: i64,
    },
    /// Once a second: the SPIFFE IDs of the valid X.509-SVIDs held.
    Second { at_ms: i64, spiffe_ids: Vec<String> },
    /// The stream failed; the workload retries.
    Error { at_ms: i64, error: String },
}

/// The report of Pod `pod`, as far as it is written (a line being written is left out).
pub fn read(reports: &Path, pod: &str) -> Vec<Line> {
    let text = std::fs::read_to_string(reports.join(format!("{pod}.jsonl"))).unwrap_or_default();
    text.lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

/// The SVID sets delivered, in order.
pub fn svid_sets(lines: &[Line]) -> Vec<&Vec<Svid>> {
    lines
        .iter()
        .filter_map(|line| match line {
            Line::Svids { svids, .. } => Some(svids),
            _ => None,
        })
        .collect()
}

/// The once-a-second samples: what the workload held each second.
pub fn seconds(lines: &[Line]) -> Vec<&Vec<String>> {
    lines
        .iter()
        .filter_map(|line| match line {
            Line::Second { spiffe_ids, .. } => Some(spiffe_ids),
            _ => None,
        })
        .collect()
}

/// Seconds without any valid SVID after the first one arrived: the gaps a workload saw.
pub fn seconds_without_identity_after_first(lines: &[Line]) -> usize {
    seconds(lines)
        .into_iter()
        .skip_while(|held| held.is_empty())
        .filter(|held| held.is_empty())
        .count()
}

/// The SPIFFE IDs the workload holds now (its last sample).
pub fn holding_now(lines: &[Line]) -> Vec<String> {
    seconds(lines)
        .last()
        .map(|held| held.to_vec())
        .unwrap_or_default()
}
