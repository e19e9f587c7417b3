//! The diff: desired entries vs SPIRE's view of ours → creates, updates, deletes. Pure.
//!
//! - missing → create;
//! - present with other TTLs / DNS names / federatesWith / hint → update in place (same ID);
//! - present with a different SPIFFE ID, parent or selectors under our ID (edited behind our
//!   back) → delete, then create;
//! - ours, needed by nobody and not held → delete. Entries that are not ours never appear in
//!   the view, and `Ownership::is_ours` is checked again here.

use super::desired::Desired;
use crate::spire::{Entry, Ownership};
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub create: Vec<Entry>,
    pub update: Vec<Entry>,
    /// Applied before `create`.
    pub delete: Vec<String>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.create.is_empty() && self.update.is_empty() && self.delete.is_empty()
    }
}

fn same_identity(a: &Entry, b: &Entry) -> bool {
    a.spiffe_id == b.spiffe_id && a.parent_id == b.parent_id && a.selectors == b.selectors
}

pub fn plan(ownership: &Ownership, desired: &Desired, observed: &BTreeMap<String, Entry>) -> Plan {
    let mut plan = Plan::default();
    for (id, wanted) in &desired.entries {
        match observed.get(id) {
            None => plan.create.push(wanted.entry.clone()),
            Some(current) if !same_identity(current, &wanted.entry) => {
                plan.delete.push(id.clone());
                plan.create.push(wanted.entry.clone());
            }
            Some(current) if current.mutable_fields_differ(&wanted.entry) => {
                plan.update.push(wanted.entry.clone())
            }
            Some(_) => {}
        }
    }
    for (id, current) in observed {
        let unneeded = !desired.entries.contains_key(id) && !desired.held.contains(id);
        if unneeded && ownership.is_ours(current) {
            plan.delete.push(id.clone());
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::desired::{DeploymentKey, DesiredEntry};
    use crate::policy::testing::mk_entry as entry;
    use crate::spire::Selector;
    use std::collections::BTreeSet;

    fn ownership() -> Ownership {
        Ownership::new("c").expect("valid")
    }

    fn desired(entries: &[Entry]) -> Desired {
        let mut d = Desired::default();
        for e in entries {
            let needed_by = BTreeSet::from([DeploymentKey {
                namespace: "a".into(),
                name: e.spiffe_id.clone(),
            }]);
            d.entries.insert(
                e.id.clone(),
                DesiredEntry {
                    entry: e.clone(),
                    needed_by,
                    policy: "p".into(),
                },
            );
        }
        d
    }

    fn observed(entries: &[Entry]) -> BTreeMap<String, Entry> {
        entries.iter().map(|e| (e.id.clone(), e.clone())).collect()
    }

    #[test]
    fn converged_state_plans_nothing() {
        let o = ownership();
        let e = entry(&o, "x", 60);
        assert!(plan(&o, &desired(std::slice::from_ref(&e)), &observed(&[e])).is_empty());
    }

    #[test]
    fn missing_is_created_drift_updated_unneeded_deleted() {
        let o = ownership();
        let (keep, drift, gone, fresh) = (
            entry(&o, "k", 60),
            entry(&o, "d", 60),
            entry(&o, "g", 60),
            entry(&o, "f", 60),
        );
        let drifted = Entry {
            x509_svid_ttl: 999,
            ..drift.clone()
        };
        let p = plan(
            &o,
            &desired(&[keep.clone(), drift.clone(), fresh.clone()]),
            &observed(&[keep, drifted, gone.clone()]),
        );
        assert_eq!(p.create, vec![fresh]);
        assert_eq!(p.update, vec![drift]);
        assert_eq!(p.delete, vec![gone.id]);
    }

    #[test]
    fn held_and_foreign_entries_are_never_deleted() {
        let o = ownership();
        let held = entry(&o, "h", 60);
        let foreign = Entry {
            hint: "someone-else".into(),
            ..entry(&o, "f", 60)
        };
        let mut d = desired(&[]);
        d.held.insert(held.id.clone());
        assert!(plan(&o, &d, &observed(&[held, foreign])).is_empty());
    }

    #[test]
    fn identity_edited_behind_our_back_is_recreated() {
        let o = ownership();
        let e = entry(&o, "x", 60);
        let tampered = Entry {
            selectors: vec![Selector::new("k8s", "ns:other")],
            ..e.clone()
        };
        let p = plan(
            &o,
            &desired(std::slice::from_ref(&e)),
            &observed(&[tampered]),
        );
        assert_eq!(p.delete, vec![e.id.clone()]);
        assert_eq!(p.create, vec![e]);
    }
}
