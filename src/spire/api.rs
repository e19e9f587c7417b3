//! The five things the controller needs from SPIRE, over our own types. The gRPC client
//! implements it for real; `memory::MemoryEntryApi` (test builds only) for unit tests of the
//! controller's SPIRE view.

use super::types::{DeleteResult, Entry, EntryResult};
use std::future::Future;

/// A request-level failure: nothing (or nothing more) of the request is known to have happened.
#[derive(Clone, Debug, thiserror::Error)]
pub enum SpireError {
    /// A non-transient gRPC status (e.g. PermissionDenied: the registrar is not an admin).
    #[error("SPIRE {op} failed: {code}: {message}")]
    Rpc {
        op: &'static str,
        code: tonic::Code,
        message: String,
    },
    /// Transient failures kept happening for the whole retry budget.
    #[error("SPIRE {op} unavailable after {attempts} attempts: {code}: {message}")]
    Exhausted {
        op: &'static str,
        attempts: u32,
        code: tonic::Code,
        message: String,
    },
    /// The server answered a batch with the wrong number of results (a protocol bug).
    #[error("SPIRE {op} returned {got} results for {sent} items")]
    ResultCount {
        op: &'static str,
        sent: usize,
        got: usize,
    },
    /// Could not set up the connection (bad endpoint, no SVID from the Workload API).
    #[error("SPIRE connection: {0}")]
    Connect(String),
    /// Not sent: an earlier batch of the same call failed as a whole, so SPIRE is taken to
    /// be unreachable and the rest waits for the next sync instead of each batch retrying.
    #[error("SPIRE {op} not sent: an earlier batch of this call failed as a whole")]
    NotSent { op: &'static str },
}

impl SpireError {
    /// Whether waiting and trying again may help (as opposed to fixing configuration).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            SpireError::Exhausted { .. } | SpireError::Connect(_) | SpireError::NotSent { .. }
        )
    }

    /// A short, stable label for metrics and Events.
    pub fn reason(&self) -> &'static str {
        match self {
            SpireError::Rpc { .. } => "SpireRejected",
            SpireError::Exhausted { .. } => "SpireUnavailable",
            SpireError::ResultCount { .. } => "SpireProtocol",
            SpireError::Connect(_) => "SpireConnect",
            SpireError::NotSent { .. } => "SpireUnavailable",
        }
    }
}

/// What the controller needs from SPIRE. Writes take any number of items (the implementation
/// batches) and return one result per input item, in order; a batch that failed at the request
/// level yields `ItemError::Other` for each of its items, so partial progress is never lost.
pub trait EntryApi: Send + Sync + 'static {
    /// Every entry this registrar owns (hint filter, paged, ownership re-checked).
    fn list_ours(&self) -> impl Future<Output = Result<Vec<Entry>, SpireError>> + Send;
    /// How many entries carry one of our hints: one small call per hint (no entries
    /// transferred), for drift detection at rest and for probing whether SPIRE is usable.
    /// Small on the wire only: SPIRE (1.13) counts by paging through the matching entries
    /// in its datastore, so a count costs it about what a list of our entries does.
    fn count_hinted(&self) -> impl Future<Output = Result<u64, SpireError>> + Send;
    /// Creates entries. AlreadyExists with an entry is a success carrying the stored entry,
    /// which the caller must check with `Ownership::is_ours` before treating it as ours.
    fn create(&self, entries: Vec<Entry>) -> impl Future<Output = Vec<EntryResult>> + Send;
    /// Updates the mutable fields (TTLs, DNS names, federatesWith, hint) of entries by ID.
    fn update(&self, entries: Vec<Entry>) -> impl Future<Output = Vec<EntryResult>> + Send;
    /// Deletes entries (by ID) as last listed. Absent entries count as deleted; entries that
    /// are not ours (`Ownership::is_ours`: ID prefix and hint, as SPIRE reported them) are
    /// refused without a call.
    fn delete(&self, entries: Vec<Entry>) -> impl Future<Output = Vec<DeleteResult>> + Send;
    /// When the oldest call that SPIRE has not answered since its last answer began: where a
    /// stall started, which is earlier than the moment a call gives up on it. `None` when
    /// the last call was answered (or nothing tracks it).
    fn unanswered_since(&self) -> Option<std::time::Instant> {
        None
    }
}
