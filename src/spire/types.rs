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
    /// Without spare capacity: rendered strings (`format!`, templates) keep the slack of their
    /// growth, and an entry desired state renders is the one the view keeps for as long as the
    /// entry lives.
    pub fn shrunk(mut self) -> Self {
        for text in [
            &mut self.id,
            &mut self.spiffe_id,
            &mut self.parent_id,
            &mut self.hint,
        ] {
            text.shrink_to_fit();
        }
        for selector in &mut self.selectors {
            selector.kind.shrink_to_fit();
            selector.value.shrink_to_fit();
        }
        self.selectors.shrink_to_fit();
        for name in self.dns_names.iter_mut().chain(&mut self.federates_with) {
            name.shrink_to_fit();
        }
        self.dns_names.shrink_to_fit();
        self.federates_with.shrink_to_fit();
        self
    }

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

    /// Whether any `MutableField` differs: an update, not a new entry, fixes that.
    /// Whether this entry (as SPIRE holds it) is exactly what `rendered` asks for: same ID,
    /// key and mutable fields. Then it can stand in for the rendering, which is dropped (a
    /// full derive at 50,000 Deployments would otherwise hold a second copy of every entry).
    pub fn renders_as(&self, rendered: &Entry) -> bool {
        self.id == rendered.id
            && self.spiffe_id == rendered.spiffe_id
            && self.parent_id == rendered.parent_id
            && self.selectors == rendered.selectors
            && !self.mutable_fields_differ(rendered)
    }

    pub fn mutable_fields_differ(&self, other: &Entry) -> bool {
        MutableField::ALL
            .iter()
            .any(|field| field.differs(self, other))
    }

    /// Every field of `Entry`, sorted into what it is. Destructured without `..`, so a field
    /// added to `Entry` does not compile until it is placed: part of the key (a change is a
    /// different entry), a `MutableField` (updated in place), or observed only.
    #[cfg(test)]
    fn immutable_fields(&self) -> (&str, &str, &str, &[Selector], i64) {
        let Entry {
            id,
            spiffe_id,
            parent_id,
            selectors,
            x509_svid_ttl: _,
            jwt_svid_ttl: _,
            dns_names: _,
            federates_with: _,
            hint: _,
            revision_number,
        } = self;
        (id, spiffe_id, parent_id, selectors, *revision_number)
    }
}

/// The fields SPIRE lets us change in place: everything but the ID, the identity triple
/// (SPIFFE ID, parent ID, selectors: a change there is a different entry) and the observed
/// revision. The one list behind the diff (`Entry::mutable_fields_differ`), the update mask we
/// send (`convert::update_mask`) and the test SPIRE's update; each matches on it exhaustively.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MutableField {
    X509SvidTtl,
    JwtSvidTtl,
    DnsNames,
    FederatesWith,
    Hint,
}

impl MutableField {
    pub const ALL: [MutableField; 5] = [
        MutableField::X509SvidTtl,
        MutableField::JwtSvidTtl,
        MutableField::DnsNames,
        MutableField::FederatesWith,
        MutableField::Hint,
    ];

    /// Whether this field differs between `a` and `b`.
    pub fn differs(self, a: &Entry, b: &Entry) -> bool {
        match self {
            MutableField::X509SvidTtl => a.x509_svid_ttl != b.x509_svid_ttl,
            MutableField::JwtSvidTtl => a.jwt_svid_ttl != b.jwt_svid_ttl,
            MutableField::DnsNames => a.dns_names != b.dns_names,
            MutableField::FederatesWith => a.federates_with != b.federates_with,
            MutableField::Hint => a.hint != b.hint,
        }
    }

    /// Moves this field of `from` into `into` (what a server does on update).
    pub fn move_into(self, from: &mut Entry, into: &mut Entry) {
        match self {
            MutableField::X509SvidTtl => into.x509_svid_ttl = from.x509_svid_ttl,
            MutableField::JwtSvidTtl => into.jwt_svid_ttl = from.jwt_svid_ttl,
            MutableField::DnsNames => into.dns_names = std::mem::take(&mut from.dns_names),
            MutableField::FederatesWith => {
                into.federates_with = std::mem::take(&mut from.federates_with)
            }
            MutableField::Hint => into.hint = std::mem::take(&mut from.hint),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Entry {
        Entry {
            id: "id".into(),
            spiffe_id: "spiffe://td/w".into(),
            parent_id: "spiffe://td/agent".into(),
            selectors: vec![Selector::new("k8s", "ns:a")],
            x509_svid_ttl: 60,
            jwt_svid_ttl: 30,
            dns_names: vec!["a.example".into()],
            federates_with: vec!["other.org".into()],
            hint: "spiffe-registrar/c".into(),
            revision_number: 3,
        }
    }

    /// An entry whose every mutable field differs from `entry()`'s, and nothing else.
    fn edited() -> Entry {
        Entry {
            x509_svid_ttl: 61,
            jwt_svid_ttl: 31,
            dns_names: vec!["b.example".into()],
            federates_with: vec![],
            hint: "spiffe-registrar/d".into(),
            ..entry()
        }
    }

    #[test]
    fn each_mutable_field_is_seen_by_the_diff_and_moved_by_an_update() {
        let (base, changed) = (entry(), edited());
        assert_eq!(
            base.immutable_fields(),
            changed.immutable_fields(),
            "only mutable fields edited"
        );
        for field in MutableField::ALL {
            assert!(field.differs(&base, &changed), "{field:?} differs");
            let mut updated = base.clone();
            field.move_into(&mut changed.clone(), &mut updated);
            assert!(!field.differs(&updated, &changed), "{field:?} moved");
            assert!(
                updated.mutable_fields_differ(&changed),
                "the other four still differ"
            );
        }
        let mut updated = base.clone();
        for field in MutableField::ALL {
            field.move_into(&mut changed.clone(), &mut updated);
        }
        assert_eq!(updated, changed, "ALL moves every mutable field");
        assert!(!updated.mutable_fields_differ(&changed));
    }

    #[test]
    fn key_and_observed_fields_are_not_mutable() {
        let base = entry();
        let rekeyed = Entry {
            id: "other".into(),
            spiffe_id: "spiffe://td/x".into(),
            parent_id: "spiffe://td/y".into(),
            selectors: vec![],
            revision_number: 9,
            ..entry()
        };
        assert!(!base.mutable_fields_differ(&rekeyed));
    }
}
