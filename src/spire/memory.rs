//! An in-memory `EntryApi` for unit tests of the code above the client. It enforces the SPIRE
//! rules the controller relies on (similar-entry AlreadyExists, ID uniqueness, NotFound-tolerant
//! deletes, hint-filtered listing) and can simulate an outage. End-to-end claims use the real
//! server instead.

use super::api::{EntryApi, SpireError};
use super::ownership::Ownership;
use super::types::{DeleteResult, Entry, EntryResult, ItemError, MutableField};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

pub struct MemoryEntryApi {
    ownership: Ownership,
    entries: Mutex<BTreeMap<String, Entry>>,
    down: AtomicBool,
}

impl MemoryEntryApi {
    pub fn new(ownership: Ownership) -> Self {
        Self {
            ownership,
            entries: Mutex::new(BTreeMap::new()),
            down: AtomicBool::new(false),
        }
    }

    /// While down, every call fails as if the server were unreachable.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Every stored entry, ours or not.
    pub fn all(&self) -> Vec<Entry> {
        self.entries
            .lock()
            .expect("lock")
            .values()
            .cloned()
            .collect()
    }

    /// Stores an entry as another writer would (any ID, any hint), bypassing our rules.
    pub fn insert_raw(&self, entry: Entry) {
        self.entries
            .lock()
            .expect("lock")
            .insert(entry.id.clone(), entry.normalize());
    }

    /// Removes an entry behind our back (like `spire-server entry delete`).
    pub fn remove_raw(&self, id: &str) -> Option<Entry> {
        self.entries.lock().expect("lock").remove(id)
    }

    fn unavailable<T>(&self, id: &str) -> Result<T, ItemError> {
        Err(ItemError::Other {
            id: id.to_string(),
            code: tonic::Code::Unavailable,
            message: "memory SPIRE is down".into(),
        })
    }
}

fn similar(a: &Entry, b: &Entry) -> bool {
    a.spiffe_id == b.spiffe_id && a.parent_id == b.parent_id && a.selectors == b.selectors
}

impl EntryApi for MemoryEntryApi {
    async fn count_hinted(&self) -> Result<u64, SpireError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(SpireError::Exhausted {
                op: "count",
                attempts: 1,
                code: tonic::Code::Unavailable,
                message: "down".into(),
            });
        }
        let entries = self.entries.lock().expect("lock");
        let hints = self.ownership.hints();
        Ok(entries
            .values()
            .filter(|e| hints.contains(&e.hint.as_str()))
            .count() as u64)
    }

    async fn list_ours(&self) -> Result<Vec<Entry>, SpireError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(SpireError::Exhausted {
                op: "list",
                attempts: 1,
                code: tonic::Code::Unavailable,
                message: "down".into(),
            });
        }
        let entries = self.entries.lock().expect("lock");
        Ok(entries
            .values()
            .filter(|e| self.ownership.is_ours(e))
            .cloned()
            .collect())
    }

    async fn create(&self, entries: Vec<Entry>) -> Vec<EntryResult> {
        let down = self.down.load(Ordering::SeqCst);
        let mut stored = self.entries.lock().expect("lock");
        entries
            .into_iter()
            .map(|entry| {
                if down {
                    return self.unavailable(&entry.id);
                }
                let entry = entry.normalize();
                if entry.selectors.is_empty() || !entry.spiffe_id.starts_with("spiffe://") {
                    return Err(ItemError::Invalid {
                        id: entry.id.clone(),
                        message: "failed to convert entry: invalid".into(),
                    });
                }
                if let Some(existing) = stored.values().find(|e| similar(e, &entry)) {
                    return Ok(existing.clone());
                }
                if stored.contains_key(&entry.id) {
                    return Err(ItemError::IdCollision {
                        id: entry.id.clone(),
                        message: "UNIQUE constraint".into(),
                    });
                }
                stored.insert(entry.id.clone(), entry.clone());
                Ok(entry)
            })
            .collect()
    }

    async fn update(&self, entries: Vec<Entry>) -> Vec<EntryResult> {
        let down = self.down.load(Ordering::SeqCst);
        let mut stored = self.entries.lock().expect("lock");
        entries
            .into_iter()
            .map(|entry| {
                if down {
                    return self.unavailable(&entry.id);
                }
                let mut entry = entry.normalize();
                let Some(current) = stored.get_mut(&entry.id) else {
                    return Err(ItemError::NotFound {
                        id: entry.id.clone(),
                    });
                };
                for field in MutableField::ALL {
                    field.move_into(&mut entry, current);
                }
                current.revision_number += 1;
                Ok(current.clone())
            })
            .collect()
    }

    async fn delete(&self, entries: Vec<Entry>) -> Vec<DeleteResult> {
        let down = self.down.load(Ordering::SeqCst);
        let mut stored = self.entries.lock().expect("lock");
        entries
            .into_iter()
            .map(|entry| {
                let id = entry.id.clone();
                if !self.ownership.is_ours(&entry) {
                    return Err(ItemError::NotOurs { id });
                }
                if down {
                    return self.unavailable(&id);
                }
                stored.remove(&id);
                Ok(id)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spire::types::Selector;

    fn ours(o: &Ownership, path: &str) -> Entry {
        let selectors = vec![Selector::new("k8s", format!("ns:{path}"))];
        Entry {
            id: o.entry_id(
                &format!("spiffe://td/{path}"),
                "spiffe://td/agent",
                &selectors,
            ),
            spiffe_id: format!("spiffe://td/{path}"),
            parent_id: "spiffe://td/agent".into(),
            selectors,
            hint: o.hint().into(),
            ..Entry::default()
        }
    }

    #[tokio::test]
    async fn behaves_like_spire_for_the_rules_we_rely_on() {
        let o = Ownership::new("c").expect("valid");
        let api = MemoryEntryApi::new(o.clone());
        let a = ours(&o, "a");
        assert_eq!(api.create(vec![a.clone()]).await, vec![Ok(a.clone())]);
        assert_eq!(
            api.create(vec![a.clone()]).await,
            vec![Ok(a.clone())],
            "re-create is AlreadyExists → same entry"
        );
        let mut clash = ours(&o, "b");
        clash.id = a.id.clone();
        assert!(matches!(
            api.create(vec![clash]).await[0],
            Err(ItemError::IdCollision { .. })
        ));
        api.insert_raw(Entry {
            id: "foreign".into(),
            hint: String::new(),
            ..ours(&o, "f")
        });
        assert_eq!(
            api.list_ours().await.expect("up").len(),
            1,
            "foreign entries are not listed"
        );
        assert_eq!(
            api.delete(vec![Entry {
                id: "foreign".into(),
                hint: String::new(),
                ..ours(&o, "f")
            }])
            .await,
            vec![Err(ItemError::NotOurs {
                id: "foreign".into()
            })]
        );
        assert_eq!(api.all().len(), 2);
        api.set_down(true);
        assert!(api.list_ours().await.is_err());
        assert!(api.delete(vec![a.clone()]).await[0].is_err());
        api.set_down(false);
        assert_eq!(
            api.delete(vec![a.clone(), a.clone()]).await,
            vec![Ok(a.id.clone()), Ok(a.id.clone())]
        );
    }
}
