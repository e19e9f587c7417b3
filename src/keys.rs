//! The keys everything is grouped by: a Deployment (`namespace/name`) and the identity it
//! runs as (`namespace/service account`). Below both the index and the controller, so that
//! neither has to reach into the other for them.

use crate::spire::{Entry, Selector};
use std::sync::Arc;

/// `namespace/name` of a Deployment. Shared strings: keys are cloned into every per-sync
/// map and into `decide::Memory`, and at 50,000 Deployments a copy each time would be most
/// of a sync's allocations.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeploymentKey {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl std::fmt::Display for DeploymentKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// `namespace/service account`: what one identity is for.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SaKey {
    pub namespace: Arc<str>,
    pub service_account: Arc<str>,
}

impl std::fmt::Display for SaKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.service_account)
    }
}

impl SaKey {
    /// The service account an entry of ours is for, read from its selectors (what SPIRE says,
    /// not what anyone wrote on a Deployment). `None` for any other selector shape.
    pub fn of_entry(entry: &Entry) -> Option<SaKey> {
        let (namespace, service_account) = Self::parts_of_entry(entry)?;
        Some(SaKey {
            namespace: namespace.into(),
            service_account: service_account.into(),
        })
    }

    /// `of_entry` without allocating: (namespace, service account).
    pub fn parts_of_entry(entry: &Entry) -> Option<(&str, &str)> {
        let [a, b] = entry.selectors.as_slice() else {
            return None;
        };
        let namespace = a.value.strip_prefix("ns:").filter(|_| a.kind == "k8s")?;
        let service_account = b.value.strip_prefix("sa:").filter(|_| b.kind == "k8s")?;
        Some((namespace, service_account))
    }

    pub fn selectors(&self) -> Vec<Selector> {
        vec![
            Selector::new("k8s", format!("ns:{}", self.namespace)),
            Selector::new("k8s", format!("sa:{}", self.service_account)),
        ]
    }
}
