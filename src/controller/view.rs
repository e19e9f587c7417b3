//! Our cached view of SPIRE: the entries we own, as last listed and then kept current from our
//! own write results. A trigger therefore costs no list call; the periodic resync re-lists (by
//! hint, paged) to catch what others changed: entries deleted or edited by hand.

use super::diff::Plan;
use crate::spire::{Entry, EntryApi, ItemError, Ownership, SpireError};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[derive(Default)]
pub struct SpireView {
    pub entries: BTreeMap<String, Entry>,
    listed_at: Option<Instant>,
}

/// Per-entry failures of one apply, by entry ID.
#[derive(Debug, Default)]
pub struct ApplyReport {
    pub failures: BTreeMap<String, ItemError>,
    pub created: usize,
    pub updated: usize,
    pub deleted: usize,
}

impl ApplyReport {
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
        self.entries.clear();
        self.listed_at = None;
    }

    pub async fn refresh(&mut self, api: &impl EntryApi) -> Result<(), SpireError> {
        let listed = api.list_ours().await?;
        self.entries = listed.into_iter().map(|e| (e.id.clone(), e)).collect();
        self.listed_at = Some(Instant::now());
        Ok(())
    }

    /// Applies `plan` (deletes first, so a recreate under the same ID works) and folds the
    /// results into the view.
    pub async fn apply(
        &mut self,
        api: &impl EntryApi,
        ownership: &Ownership,
        plan: Plan,
    ) -> ApplyReport {
        let mut report = ApplyReport::default();
        if !plan.delete.is_empty() {
            for result in api.delete(plan.delete).await {
                match result {
                    Ok(id) => {
                        self.entries.remove(&id);
                        report.deleted += 1;
                    }
                    Err(error) => {
                        report.failures.insert(item_id(&error), error);
                    }
                }
            }
        }
        if !plan.create.is_empty() {
            let wanted: Vec<String> = plan.create.iter().map(|e| e.id.clone()).collect();
            for (id, result) in wanted.into_iter().zip(api.create(plan.create).await) {
                match result {
                    Ok(entry) if entry.id == id && ownership.is_ours(&entry) => {
                        self.entries.insert(id, entry);
                        report.created += 1;
                    }
                    // SPIRE already has a similar entry written by someone else. It serves the
                    // workload, but it is not ours: never adopted, never deleted.
                    Ok(entry) => {
                        let message = format!(
                            "SPIRE already has an equivalent entry {} owned by another writer",
                            entry.id
                        );
                        report
                            .failures
                            .insert(id.clone(), ItemError::IdCollision { id, message });
                    }
                    Err(error) => {
                        report.failures.insert(id, error);
                    }
                }
            }
        }
        if !plan.update.is_empty() {
            let wanted: Vec<String> = plan.update.iter().map(|e| e.id.clone()).collect();
            for (id, result) in wanted.into_iter().zip(api.update(plan.update).await) {
                match result {
                    Ok(entry) => {
                        self.entries.insert(id, entry);
                        report.updated += 1;
                    }
                    Err(error) => {
                        if matches!(error, ItemError::NotFound { .. }) {
                            // Deleted behind our back: the next sync creates it again.
                            self.entries.remove(&id);
                        }
                        report.failures.insert(id, error);
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

    #[tokio::test]
    async fn write_results_fold_into_the_view() {
        let o = Ownership::new("c").expect("valid");
        let api = MemoryEntryApi::new(o.clone());
        let mut view = SpireView::default();
        assert!(view.stale(Duration::from_secs(60)), "never listed");
        view.refresh(&api).await.expect("list");
        assert!(!view.stale(Duration::from_secs(60)));

        let (a, b) = (entry(&o, "a", 60), entry(&o, "b", 60));
        let plan = Plan {
            create: vec![a.clone(), b.clone()],
            ..Plan::default()
        };
        let report = view.apply(&api, &o, plan).await;
        assert_eq!((report.created, report.failures.len()), (2, 0));
        assert_eq!(view.entries.len(), 2);

        // Deleted behind our back: the update fails NotFound and the view forgets it, so the
        // next diff creates it again.
        api.remove_raw(&b.id);
        let plan = Plan {
            update: vec![Entry {
                x509_svid_ttl: 90,
                ..b.clone()
            }],
            ..Plan::default()
        };
        let report = view.apply(&api, &o, plan).await;
        assert!(report.has_retryable());
        assert!(!view.entries.contains_key(&b.id));

        // Deletes run before creates, so a recreate under the same ID goes through.
        let plan = Plan {
            delete: vec![a.id.clone()],
            create: vec![a.clone()],
            ..Plan::default()
        };
        let report = view.apply(&api, &o, plan).await;
        assert_eq!((report.deleted, report.created), (1, 1));
        assert!(view.entries.contains_key(&a.id));
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
            .apply(
                &api,
                &o,
                Plan {
                    create: vec![ours.clone()],
                    ..Plan::default()
                },
            )
            .await;
        assert!(matches!(
            report.failures.get(&ours.id),
            Some(ItemError::IdCollision { .. })
        ));
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
        view.apply(
            &api,
            &o,
            Plan {
                create: vec![a.clone()],
                ..Plan::default()
            },
        )
        .await;
        api.set_down(true);
        assert!(view.refresh(&api).await.is_err());
        let report = view
            .apply(
                &api,
                &o,
                Plan {
                    delete: vec![a.id.clone()],
                    ..Plan::default()
                },
            )
            .await;
        assert!(report.has_retryable());
        assert!(
            view.entries.contains_key(&a.id),
            "a failed delete keeps the entry in view"
        );
    }
}
