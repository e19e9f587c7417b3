//! Our cached view of SPIRE: the entries we own, as last listed and then kept current from our
//! own write results. A trigger therefore costs no list call; the periodic resync re-lists (by
//! hint, paged) to catch what others changed: entries deleted or edited by hand.

use super::decide::{Observed, SpirePlan};
use crate::spire::{Entry, EntryApi, ItemError, Ownership, SpireError};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Default)]
pub struct SpireView {
    /// Shared with a derive of desired state while it runs (it reuses the entries it would
    /// render identically), and only then: writes find it unshared and change it in place.
    pub entries: Arc<Observed>,
    listed_at: Option<Instant>,
    /// Entries with our hint that are not ours (a foreign ID prefix), as of the last list:
    /// SPIRE's count by hint includes them.
    hinted_not_ours: u64,
}

/// What an at-rest drift check found.
#[derive(Debug, PartialEq, Eq)]
pub enum Drift {
    /// SPIRE holds as many entries under our hints as we expect.
    None,
    /// It does not: entries were deleted (or created) behind our back; re-list.
    Mismatch { expected: u64, found: u64 },
}

/// Outcome of one apply, by entry ID.
#[derive(Debug, Default)]
pub struct ApplyReport {
    pub failures: BTreeMap<String, ItemError>,
    /// Our desired ID → the equivalent entry another writer owns (SPIRE returned it).
    pub foreign: Vec<(String, Entry)>,
    /// Creates SPIRE refused as invalid: (what we sent, SPIRE's reason).
    pub rejected: Vec<(Entry, String)>,
    pub created: usize,
    pub updated: usize,
    pub deleted: usize,
}

/// The request carrying this item got no answer from SPIRE (unreachable, timed out, or not
/// sent after an earlier batch failed so).
fn unanswered(failure: &ItemError) -> bool {
    matches!(failure, ItemError::Other { code, .. } if crate::spire::retry::is_transient(*code))
}

impl ApplyReport {
    /// Folds the report of a later part of the same sync into this one.
    pub fn absorb(&mut self, other: ApplyReport) {
        self.failures.extend(other.failures);
        self.foreign.extend(other.foreign);
        self.rejected.extend(other.rejected);
        self.created += other.created;
        self.updated += other.updated;
        self.deleted += other.deleted;
    }

    /// Whether SPIRE answered this apply: `Some(false)` when every write failed as a whole
    /// (unreachable, timed out), `None` when nothing was sent.
    pub fn reached_spire(&self) -> Option<bool> {
        let answered = self.created
            + self.updated
            + self.deleted
            + self.rejected.len()
            + self.foreign.len()
            + self.failures.values().filter(|f| !unanswered(f)).count();
        if answered > 0 {
            Some(true)
        } else if self.failures.is_empty() {
            None
        } else {
            Some(false)
        }
    }

    pub fn has_retryable(&self) -> bool {
        self.failures.values().any(ItemError::is_retryable)
    }
}

impl SpireView {
    /// Whether a full list is due (never listed, or older than `resync`).
    pub fn stale(&self, resync: Duration) -> bool {
        self.listed_at.is_none_or(|at| at.elapsed() >= resync)
    }

    /// Forget everything: a replica that loses leadership must re-list before writing again.
    pub fn invalidate(&mut self) {
        self.entries = Arc::default();
        self.listed_at = None;
    }

    /// Compares SPIRE's count of entries under our hints with what this view expects: one
    /// small call instead of a list. Only meaningful between writes (the leader is the only
    /// writer of our hints).
    pub async fn check_drift(&self, api: &impl EntryApi) -> Result<Drift, SpireError> {
        let found = api.count_hinted().await?;
        let expected = self.entries.len() as u64 + self.hinted_not_ours;
        Ok(if found == expected {
            Drift::None
        } else {
            Drift::Mismatch { expected, found }
        })
    }

    pub async fn refresh(&mut self, api: &impl EntryApi) -> Result<(), SpireError> {
        let listed = api.list_ours().await?;
        self.entries = Arc::new(
            listed
                .into_iter()
                .map(|e| (e.id.clone(), Arc::new(e)))
                .collect(),
        );
        self.listed_at = Some(Instant::now());
        // Best effort: without it the first drift check re-lists once more.
        self.hinted_not_ours = api
            .count_hinted()
            .await
            .map_or(0, |count| count.saturating_sub(self.entries.len() as u64));
        Ok(())
    }

    /// Applies the SPIRE half of `plan` (creates first, then updates, then deletes: a
    /// replacement is always in SPIRE before anything is deleted) and folds the results into
    /// the view.
    pub async fn apply(
        &mut self,
        api: &impl EntryApi,
        ownership: &Ownership,
        plan: &SpirePlan,
    ) -> ApplyReport {
        let mut report = ApplyReport::default();
        let entries = Arc::make_mut(&mut self.entries);
        if !plan.create.is_empty() {
            let results = api
                .create(plan.create.iter().map(|e| Entry::clone(e)).collect())
                .await;
            for (sent, result) in plan.create.iter().zip(results) {
                let id = sent.id.clone();
                match result {
                    Ok(entry) if entry.id == id && ownership.is_ours(&entry) => {
                        let entry = if entry == **sent {
                            Arc::clone(sent)
                        } else {
                            Arc::new(entry)
                        };
                        entries.insert(id, entry);
                        report.created += 1;
                    }
                    // SPIRE already has an equivalent entry. Ours under another ID (adopted,
                    // or a previous cluster name) joins the view; anyone else's is reported
                    // and never touched unless adoption is on.
                    Ok(entry) if ownership.is_ours(&entry) => {
                        entries.insert(entry.id.clone(), Arc::new(entry));
                    }
                    Ok(entry) => report.foreign.push((id, entry)),
                    Err(ItemError::Invalid { id, message }) => {
                        report.rejected.push((Entry::clone(sent), message.clone()));
                        report
                            .failures
                            .insert(id.clone(), ItemError::Invalid { id, message });
                    }
                    Err(error) => {
                        report.failures.insert(id, error);
                    }
                }
            }
        }
        if !plan.update.is_empty() {
            let results = api.update(plan.update.clone()).await;
            for (sent, result) in plan.update.iter().zip(results) {
                let id = sent.id.clone();
                match result {
                    Ok(entry) if ownership.is_ours(&entry) => {
                        entries.insert(id, Arc::new(entry));
                        report.updated += 1;
                    }
                    Ok(_) => {}
                    Err(error) => {
                        if matches!(error, ItemError::NotFound { .. }) {
                            // Deleted behind our back: the next sync creates it again.
                            entries.remove(&id);
                        }
                        report.failures.insert(id, error);
                    }
                }
            }
        }
        if !plan.delete.is_empty() {
            for result in api.delete(plan.delete.clone()).await {
                match result {
                    Ok(id) => {
                        entries.remove(&id);
                        report.deleted += 1;
                    }
                    Err(error) => {
                        report.failures.insert(item_id(&error), error);
                    }
                }
            }
        }
        report
    }
}

fn item_id(error: &ItemError) -> String {
    match error {
        ItemError::IdCollision { id, .. }
        | ItemError::NotFound { id }
        | ItemError::NotOurs { id }
        | ItemError::Other { id, .. }
        | ItemError::Invalid { id, .. } => id.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::mk_entry as entry;
    use crate::spire::memory::MemoryEntryApi;

    fn plan(create: Vec<Entry>, update: Vec<Entry>, delete: Vec<Entry>) -> SpirePlan {
        SpirePlan {
            create: create.into_iter().map(std::sync::Arc::new).collect(),
            update,
            delete,
            ..SpirePlan::default()
        }
    }

    #[tokio::test]
    async fn write_results_fold_into_the_view() {
        let o = Ownership::new("c").expect("valid");
        let api = MemoryEntryApi::new(o.clone());
        let mut view = SpireView::default();
        assert!(view.stale(Duration::from_secs(60)), "never listed");
        view.refresh(&api).await.expect("list");
        assert!(!view.stale(Duration::from_secs(60)));

        let (a, b) = (entry(&o, "a", 60), entry(&o, "b", 60));
        let report = view
            .apply(&api, &o, &plan(vec![a.clone(), b.clone()], vec![], vec![]))
            .await;
        assert_eq!((report.created, report.failures.len()), (2, 0));
        assert_eq!(view.entries.len(), 2);

        // Deleted behind our back: the update fails NotFound and the view forgets it, so the
        // next decision creates it again.
        api.remove_raw(&b.id);
        let changed = Entry {
            x509_svid_ttl: 90,
            ..b.clone()
        };
        let report = view
            .apply(&api, &o, &plan(vec![], vec![changed], vec![]))
            .await;
        assert!(report.has_retryable());
        assert!(!view.entries.contains_key(&b.id));

        // Creates run before deletes: make-before-break within one apply.
        let c = entry(&o, "c", 60);
        let report = view
            .apply(&api, &o, &plan(vec![c.clone()], vec![], vec![a.clone()]))
            .await;
        assert_eq!((report.created, report.deleted), (1, 1));
        assert!(view.entries.contains_key(&c.id) && !view.entries.contains_key(&a.id));
    }

    #[tokio::test]
    async fn an_equivalent_foreign_entry_is_reported_not_adopted() {
        let o = Ownership::new("c").expect("valid");
        let api = MemoryEntryApi::new(o.clone());
        let ours = entry(&o, "x", 60);
        api.insert_raw(Entry {
            id: "someone-elses".into(),
            hint: String::new(),
            ..ours.clone()
        });
        let mut view = SpireView::default();
        let report = view
            .apply(&api, &o, &plan(vec![ours.clone()], vec![], vec![]))
            .await;
        assert_eq!(report.foreign.len(), 1);
        assert_eq!(report.foreign[0].1.id, "someone-elses");
        assert!(
            view.entries.is_empty(),
            "never in our view, so never deleted by us"
        );
    }

    #[tokio::test]
    async fn with_spire_down_nothing_changes_and_the_failures_are_retryable() {
        let o = Ownership::new("c").expect("valid");
        let api = MemoryEntryApi::new(o.clone());
        let mut view = SpireView::default();
        let a = entry(&o, "a", 60);
        view.apply(&api, &o, &plan(vec![a.clone()], vec![], vec![]))
            .await;
        api.set_down(true);
        assert!(view.refresh(&api).await.is_err());
        let report = view
            .apply(&api, &o, &plan(vec![], vec![], vec![a.clone()]))
            .await;
        assert!(report.has_retryable());
        assert!(
            view.entries.contains_key(&a.id),
            "a failed delete keeps the entry in view"
        );
    }
}
