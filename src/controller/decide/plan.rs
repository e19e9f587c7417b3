//! What a decision returns: the SPIRE writes, what is kept back and why, the order in which
//! the writes go out, and the writes to Deployments.

use crate::keys::{SaKey, WorkloadKey};
use crate::spire::{Entry, Selector};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

/// Why an entry of ours is kept although nothing it serves needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// Replaced by `by`; deleted at `due` (None: the replacement is not in SPIRE yet).
    Transition { by: String, due: Option<Instant> },
    /// Its service account fell out of scope; deleted at `due`.
    ScopeLoss { due: Instant },
    /// Due, but the deletion brake holds it until an operator confirms.
    Brake,
    /// Never deleted while the reason lasts (invalid policy, selectors in doubt).
    Held(String),
}

impl Why {
    pub fn label(&self) -> &'static str {
        match self {
            Why::Transition { .. } => "transition",
            Why::ScopeLoss { .. } => "scope_loss",
            Why::Brake => "brake",
            Why::Held(_) => "held",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    pub entry: Entry,
    pub why: Why,
}

/// The deletion brake: too many scope-loss deletions at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Brake {
    /// Confirms exactly this set of deletions (a hash of their IDs).
    pub token: String,
    pub count: usize,
    pub total: usize,
}

/// SPIRE writes and what is kept back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpirePlan {
    /// Shared with desired state.
    pub create: Vec<Arc<Entry>>,
    /// Mutable fields and hints (adoption, rename), by ID.
    pub update: Vec<Entry>,
    /// Entries of ours, as observed.
    pub delete: Vec<Entry>,
    /// The entry giving each service account its identity (in SPIRE, or being created).
    pub serving: BTreeMap<SaKey, String>,
    pub pending: Vec<Pending>,
    pub brake: Option<Brake>,
    /// When to decide again although nothing changes: the next grace expiry, a replacement
    /// being created, or a brake waiting for confirmation.
    pub recheck: Option<Instant>,
}

impl SpirePlan {
    pub fn writes(&self) -> usize {
        self.create.len() + self.update.len() + self.delete.len()
    }
}

pub(super) type Triple<'e> = (&'e str, &'e str, &'e [Selector]);

pub(super) fn triple(entry: &Entry) -> Triple<'_> {
    (&entry.spiffe_id, &entry.parent_id, &entry.selectors)
}

/// A short hash of a set of entry IDs: confirming one set never confirms another.
pub fn brake_token<'a>(ids: impl Iterator<Item = &'a str>) -> String {
    let mut ids: Vec<&str> = ids.collect();
    ids.sort_unstable();
    let mut hasher = Sha256::new();
    for id in ids {
        hasher.update(id.as_bytes());
        hasher.update(b"\n");
    }
    hasher.finalize()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Which part of a plan a stage carries (see `SpirePlan::stages`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageKind {
    /// Entries under our IDs that were edited behind our back: deleted first, so that their
    /// replacements can take the ID.
    DeleteReplaced,
    /// A chunk of creates: its Deployments can be annotated as soon as it lands.
    Create,
    /// Updates and every other delete, after all creates: make-before-break within one sync.
    UpdateAndDelete,
}

/// One step of applying a plan: SPIRE writes that go out together.
#[derive(Clone, Debug, PartialEq)]
pub struct Stage {
    pub kind: StageKind,
    pub writes: SpirePlan,
}

impl SpirePlan {
    /// The order in which this plan's writes go out: replaced entries deleted, then creates
    /// in chunks of `create_chunk` (node aliases, first in `create`, land before any entry
    /// that hangs from them), then updates and the remaining deletes. Empty stages are left
    /// out.
    pub fn stages(&self, create_chunk: usize) -> Vec<Stage> {
        let creating: BTreeSet<&String> = self.create.iter().map(|e| &e.id).collect();
        let (replaced, later): (Vec<Entry>, Vec<Entry>) = self
            .delete
            .iter()
            .cloned()
            .partition(|e| creating.contains(&e.id));
        let mut stages = Vec::new();
        if !replaced.is_empty() {
            stages.push(Stage {
                kind: StageKind::DeleteReplaced,
                writes: SpirePlan {
                    delete: replaced,
                    ..SpirePlan::default()
                },
            });
        }
        for chunk in self.create.chunks(create_chunk.max(1)) {
            stages.push(Stage {
                kind: StageKind::Create,
                writes: SpirePlan {
                    create: chunk.to_vec(),
                    ..SpirePlan::default()
                },
            });
        }
        if !self.update.is_empty() || !later.is_empty() {
            stages.push(Stage {
                kind: StageKind::UpdateAndDelete,
                writes: SpirePlan {
                    update: self.update.clone(),
                    delete: later,
                    ..SpirePlan::default()
                },
            });
        }
        stages
    }
}

/// An Event to publish on a Deployment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announce {
    pub warning: bool,
    pub reason: &'static str,
    /// Shared among the Deployments of a service account that get the same note.
    pub note: Arc<str>,
}

impl Announce {
    pub(super) fn normal(reason: &'static str, note: String) -> Self {
        Self {
            warning: false,
            reason,
            note: note.into(),
        }
    }
    pub(super) fn warning(reason: &'static str, note: String) -> Self {
        Self {
            warning: true,
            reason,
            note: note.into(),
        }
    }
}

/// One Deployment's write: metadata to change and/or an Event.
#[derive(Debug, PartialEq, Eq)]
pub struct WorkloadWrite {
    pub key: WorkloadKey,
    pub change: MetadataChange,
    pub announce: Vec<Announce>,
    /// The Deployment gets its entry-id for the first time (metrics).
    pub registered: bool,
}

/// What a Deployment's metadata should become.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct MetadataChange {
    pub add_finalizer: bool,
    pub remove_finalizer: bool,
    /// `Some(None)` removes the annotation. Values are shared among the writes of a sync.
    pub spiffe_id: Option<Option<Arc<str>>>,
    pub entry_id: Option<Option<Arc<str>>>,
}

impl MetadataChange {
    pub fn is_empty(&self) -> bool {
        *self == MetadataChange::default()
    }
}

/// A write whose patch failed. Its outcome can still be that it landed: an overloaded
/// apiserver gives up on a request after committing it, and reading it back at once can come
/// too early. A later sync settles it (`Memory::settle_failed_writes`).
#[derive(Debug)]
pub struct FailedWrite {
    pub key: WorkloadKey,
    /// The entry ID a first registration carried (counted if it turns out to have landed).
    pub registered: Option<Arc<str>>,
    /// Its Events, not published.
    pub announce: Vec<Announce>,
}
