//! What changed since the controller last looked: the service accounts whose Deployments
//! changed in a way a decision reads, or "everything" (a relist, a namespace or policy event,
//! a fresh start). The controller takes it at the start of a sync and derives desired state
//! for those service accounts alone, so a burst of new Deployments costs work and memory in
//! proportion to the burst, not to the cluster.
//!
//! Changes to our own marks alone (our annotations, the finalizer list) are told apart: they
//! are mostly the echoes of our own patches, and while they decide what to write to those
//! workloads, they cannot change what SPIRE should hold or what policy status counts.
//!
//! ```text
//! Deployment watch ─ account(ns/SA) · marks(ns/SA) ─┐
//! Namespace / policy watch, relist ─ everything() ──┼─▶ Changes ─ take() ─▶ controller
//! ```

use crate::keys::SaKey;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// The changes accumulated since the last `take`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Changed {
    /// Anything may have changed: only a full derive is correct.
    Everything,
    /// Only Deployments running as these service accounts changed.
    Accounts(BTreeSet<SaKey>),
    /// Only our marks (annotations, finalizers) on Deployments running as these service
    /// accounts changed; empty when nothing changed at all.
    Marks(BTreeSet<SaKey>),
}

impl Changed {
    /// Nothing changed.
    pub fn none() -> Self {
        Changed::Marks(BTreeSet::new())
    }
}

/// Shared between the watch tasks (writers) and the controller (taker). Starts as
/// `Everything`: nothing has been derived yet.
#[derive(Clone, Debug)]
pub struct Changes(Arc<Mutex<Changed>>);

impl Default for Changes {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Changed::Everything)))
    }
}

impl Changes {
    fn lock(&self) -> std::sync::MutexGuard<'_, Changed> {
        // Every critical section is one assignment or insert: a poisoned value is whole.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Something other than a Deployment changed (or the Deployment cache was relisted).
    pub fn everything(&self) {
        *self.lock() = Changed::Everything;
    }

    /// A Deployment running as `sa` changed (was added, edited beyond our marks, or removed).
    pub fn account(&self, sa: SaKey) {
        let mut changed = self.lock();
        match &mut *changed {
            Changed::Everything => {}
            Changed::Accounts(accounts) => {
                accounts.insert(sa);
            }
            Changed::Marks(accounts) => {
                let mut accounts = std::mem::take(accounts);
                accounts.insert(sa);
                *changed = Changed::Accounts(accounts);
            }
        }
    }

    /// Only our marks changed on a Deployment running as `sa`.
    pub fn marks(&self, sa: SaKey) {
        match &mut *self.lock() {
            Changed::Everything => {}
            Changed::Accounts(accounts) | Changed::Marks(accounts) => {
                accounts.insert(sa);
            }
        }
    }

    /// Whether anything changed since the last `take` (read without taking it).
    pub fn pending(&self) -> bool {
        match &*self.lock() {
            Changed::Everything => true,
            Changed::Accounts(accounts) | Changed::Marks(accounts) => !accounts.is_empty(),
        }
    }

    /// What changed since the last call; resets to "nothing".
    pub fn take(&self) -> Changed {
        std::mem::replace(&mut *self.lock(), Changed::none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(name: &str) -> SaKey {
        SaKey {
            namespace: "ns".into(),
            service_account: name.into(),
        }
    }

    #[test]
    fn accounts_accumulate_until_taken_and_everything_absorbs_them() {
        let changes = Changes::default();
        assert!(changes.pending());
        assert_eq!(changes.take(), Changed::Everything, "a fresh start is full");
        assert!(!changes.pending());
        assert_eq!(changes.take(), Changed::none());
        changes.account(sa("a"));
        assert!(changes.pending());
        changes.account(sa("b"));
        changes.account(sa("a"));
        assert_eq!(
            changes.take(),
            Changed::Accounts(BTreeSet::from([sa("a"), sa("b")]))
        );
        changes.account(sa("a"));
        changes.everything();
        changes.account(sa("c"));
        assert_eq!(changes.take(), Changed::Everything);
        assert_eq!(changes.take(), Changed::none());
    }

    #[test]
    fn marks_alone_stay_apart_until_a_change_goes_beyond_them() {
        let changes = Changes::default();
        changes.take();
        changes.marks(sa("a"));
        assert!(changes.pending());
        changes.marks(sa("b"));
        assert_eq!(
            changes.take(),
            Changed::Marks(BTreeSet::from([sa("a"), sa("b")]))
        );
        changes.marks(sa("a"));
        changes.account(sa("b"));
        changes.marks(sa("c"));
        assert_eq!(
            changes.take(),
            Changed::Accounts(BTreeSet::from([sa("a"), sa("b"), sa("c")])),
            "one change beyond the marks: the whole scope may change status"
        );
        changes.everything();
        changes.marks(sa("a"));
        assert_eq!(changes.take(), Changed::Everything);
    }
}
