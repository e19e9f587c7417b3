//! SPIRE registration entries in our own terms. The controller computes these, the client
//! converts them to and from the wire (`convert.rs`), and nothing else knows about protobuf.

use std::fmt;

/// A selector such as `k8s:ns:payments`: `kind` is the part before the first `:`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Selector {
    pub kind: String,
    pub value: String,
}

impl Selector {
    pub fn new(kind: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            kind: kind.into(),
            value: value.into(),
        }
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind, self.value)
    }
}

/// A registration entry, desired or observed.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Entry {
    /// Deterministic for entries we create (`Ownership::entry_id`); assigned by SPIRE otherwise.
    pub id: String,
    /// Full SPIFFE ID, `spiffe://<trust domain><path>`.
    pub spiffe_id: String,
    pub parent_id: String,
    /// Kept sorted and deduplicated (`Entry::normalize`), so equality means set equality.
    pub selectors: Vec<Selector>,
    /// Seconds; 0 lets the server pick its default.
    pub x509_svid_ttl: i32,
    /// Seconds; 0 lets the server pick its default.
    pub jwt_svid_ttl: i32,
    /// Sorted and deduplicated.
    pub dns_names: Vec<String>,
    /// Trust domain names, sorted and deduplicated.
    pub federates_with: Vec<String>,
    /// `spiffe-registrar/<cluster>` on ours.
    pub hint: String,
    /// Observed only: SPIRE's revision counter (incremented on every update).
    pub revision_number: i64,
}

/// Lets code take plain and shared entries alike.
impl AsRef<Entry> for Entry {
    fn as_ref(&self) -> &Entry {
        self
    }
}

impl Entry {
    /// Sorts and deduplicates the set-valued fields, so two entries that SPIRE treats as the
    /// same compare equal here.
    pub fn normalize(mut self) -> Self {
        self.selectors.sort();
        self.selectors.dedup();
        self.dns_names.sort();
        self.dns_names.dedup();
        self.federates_with.sort();
        self.federates_with.dedup();
        self
    }

    /// Whether the fields we may change in place (everything but the identity triple and the
    /// ID) differ. SPIFFE ID, parent ID and selectors are part of the entry's key: a change
    /// there is a different entry, not an update.
    pub fn mutable_fields_differ(&self, other: &Entry) -> bool {
        self.x509_svid_ttl != other.x509_svid_ttl
            || self.jwt_svid_ttl != other.jwt_svid_ttl
            || self.dns_names != other.dns_names
            || self.federates_with != other.federates_with
            || self.hint != other.hint
    }
}

/// Why one item of a batch failed. Request-level failures are `SpireError`s instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ItemError {
    /// SPIRE rejected the entry as invalid; retrying cannot help. Carries SPIRE's message.
    #[error("SPIRE rejected entry {id}: {message}")]
    Invalid { id: String, message: String },
    /// Our deterministic ID is taken by an entry that is not the same (SPIFFE ID, parent ID,
    /// selectors): a hash collision or someone else's entry with our ID.
    #[error("entry ID {id} is already used by a different entry: {message}")]
    IdCollision { id: String, message: String },
    /// Update of an entry that no longer exists.
    #[error("entry {id} not found")]
    NotFound { id: String },
    /// Refused client-side: the entry is not ours, so we never delete it.
    #[error("entry {id} is not owned by this registrar; refusing to delete it")]
    NotOurs { id: String },
    /// Any other per-item status; may succeed on a later attempt.
    #[error("SPIRE returned {code} for entry {id}: {message}")]
    Other {
        id: String,
        code: tonic::Code,
        message: String,
    },
}

impl ItemError {
    /// Whether a later sync may succeed without anyone changing the input.
    pub fn is_retryable(&self) -> bool {
        matches!(self, ItemError::Other { .. } | ItemError::NotFound { .. })
    }
}

/// Per-item outcome of a create or update: the entry as SPIRE stores it.
pub type EntryResult = Result<Entry, ItemError>;
/// Per-item outcome of a delete: the deleted (or already absent) ID.
pub type DeleteResult = Result<String, ItemError>;
