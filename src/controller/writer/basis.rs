//! What a queued write was decided on, checked again when it is sent: a write decided
//! before the Deployment moved to another service account or started deleting is stale.

use crate::controller::desired::Desired;
use crate::index::WorkloadRecord;
use crate::keys::WorkloadKey;
use std::sync::Arc;

/// The facts about a Deployment that a write was decided on.
#[derive(Debug, Default)]
pub(super) struct Basis {
    service_account: Option<Arc<str>>,
    deleting: bool,
}

impl Basis {
    pub(super) fn of(desired: &Desired, key: &WorkloadKey) -> Self {
        desired
            .workloads
            .get(key)
            .map(|workload| Basis {
                service_account: Some(workload.service_account.service_account.clone()),
                // Decided knowing it is being deleted (with its kind, as a loss of scope).
                deleting: workload.deleting || workload.going_with_its_kind,
            })
            .unwrap_or_default()
    }

    /// Whether `deployment` as now cached is still what the write was decided on.
    pub(super) fn holds_for(&self, deployment: &WorkloadRecord) -> bool {
        let same_account = self
            .service_account
            .as_ref()
            .is_none_or(|sa| *sa == deployment.service_account);
        same_account && (self.deleting || !deployment.deleting)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::mk_deployment;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn basis(service_account: &str, deleting: bool) -> Basis {
        Basis {
            service_account: Some(service_account.into()),
            deleting,
        }
    }

    #[test]
    fn a_write_is_stale_once_the_deployment_moved_account_or_started_deleting() {
        let plain = WorkloadRecord::from(&mk_deployment("ns", "web", Some("api"), &[]));
        let mut deleting = mk_deployment("ns", "web", Some("api"), &[]);
        deleting.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        let deleting = WorkloadRecord::from(&deleting);
        for (basis, record, holds) in [
            (basis("api", false), &plain, true),
            (basis("other", false), &plain, false),
            (basis("api", false), &deleting, false),
            (basis("api", true), &deleting, true),
            // A Deployment the sync did not know (no write is made for one): its account is
            // not checked.
            (Basis::default(), &plain, true),
        ] {
            assert_eq!(basis.holds_for(record), holds, "{basis:?}");
        }
    }
}
