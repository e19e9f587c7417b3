//! The Lease itself: reading, acquiring, renewing and releasing it, as client-go's algorithm
//! does, with every write conditional on the resourceVersion read. The election loop
//! (`Election::run`) decides when; this decides what the Lease says.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{info, warn};

/// The Lease every replica competes for, in the registrar's namespace.
pub const LEASE_NAME: &str = "spiffe-registrar-leader";

/// What we last saw of the Lease, and when (our clock) it last changed.
struct Observed {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    duration: Duration,
    at: Instant,
}

/// What one attempt found.
pub(super) enum Attempt {
    /// We hold the Lease, renewed as of the attempt's start.
    Holding,
    /// Another replica holds it and it has not expired.
    HeldElsewhere(String),
}

/// This replica's view of the Lease and its writes to it.
pub(super) struct LeaseRecord {
    api: Api<Lease>,
    identity: String,
    /// What we write as `leaseDurationSeconds`.
    duration: Duration,
    observed: Option<Observed>,
    /// The Lease as our last write left it, while we lead: the next renewal writes over it
    /// directly, one request instead of a read and a write (at rest the renewals are most of
    /// what the process does). Its resourceVersion makes the write conditional, so a Lease
    /// changed since is never overwritten: the conflict sends the round back to reading it.
    renewable: Option<Lease>,
}

impl LeaseRecord {
    pub(super) fn new(api: Api<Lease>, identity: String, duration: Duration) -> Self {
        Self {
            api,
            identity,
            duration,
            observed: None,
            renewable: None,
        }
    }

    /// Our last write is no longer a basis for the next: the term it belonged to ended.
    pub(super) fn forget_renewal(&mut self) {
        self.renewable = None;
    }

    /// One round of client-go's algorithm: create the Lease if missing; renew it if ours;
    /// take it if it expired; otherwise report its holder. Writes are conditional on the
    /// resourceVersion read, so two replicas never both win.
    /// `leading`: whether this replica's term is still running (only then is our last write
    /// renewed directly).
    pub(super) async fn try_acquire_or_renew(
        &mut self,
        leading: bool,
    ) -> Result<Attempt, kube::Error> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let me = self.identity.clone();
        if let Some(mut ours) = self.renewable.take().filter(|_| leading) {
            if let Some(spec) = ours.spec.as_mut() {
                spec.renew_time = Some(now.clone());
                spec.lease_duration_seconds = Some(self.lease_seconds());
            }
            let params = PostParams::default();
            let replace = self.api.replace(LEASE_NAME, &params, &ours);
            match crate::telemetry::kube_write("update", "leases", replace).await {
                Ok(written) => return Ok(self.holding(written)),
                // Changed since our write: read it and decide as from scratch.
                Err(kube::Error::Api(status)) if status.code == 409 => {}
                Err(error) => return Err(error),
            }
        }
        let Some(lease) = self.api.get_opt(LEASE_NAME).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(LEASE_NAME.into()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(me.clone()),
                    lease_duration_seconds: Some(self.lease_seconds()),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            let params = PostParams::default();
            let create = self.api.create(&params, &lease);
            return match crate::telemetry::kube_write("create", "leases", create).await {
                Ok(written) => Ok(self.holding(written)),
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    Ok(Attempt::HeldElsewhere("(created concurrently)".into()))
                }
                Err(error) => Err(error),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        self.observe(&spec);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let ours = holder.as_deref() == Some(me.as_str());
        if let Some(other) = &holder
            && !ours
            && !self.observed_expired()
        {
            return Ok(Attempt::HeldElsewhere(other.clone()));
        }
        let mut next = lease.clone();
        next.spec = Some(LeaseSpec {
            holder_identity: Some(me),
            lease_duration_seconds: Some(self.lease_seconds()),
            acquire_time: if ours {
                spec.acquire_time.clone()
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(
                spec.lease_transitions.unwrap_or(0) + i32::from(!ours && holder.is_some()),
            ),
            ..spec
        });
        let params = PostParams::default();
        let replace = self.api.replace(LEASE_NAME, &params, &next);
        match crate::telemetry::kube_write("update", "leases", replace).await {
            Ok(written) => Ok(self.holding(written)),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(Attempt::HeldElsewhere(
                holder.unwrap_or_else(|| "(taken concurrently)".into()),
            )),
            Err(error) => Err(error),
        }
    }

    /// We hold `written`, as the apiserver returned it: what the next renewal writes over.
    fn holding(&mut self, written: Lease) -> Attempt {
        if let Some(spec) = &written.spec {
            self.observe(spec);
        }
        self.renewable = Some(written);
        Attempt::Holding
    }

    /// Notes the Lease as read; its expiry clock restarts whenever its content changes.
    fn observe(&mut self, spec: &LeaseSpec) {
        let holder = spec.holder_identity.clone();
        let renew_time = spec.renew_time.clone();
        let duration = Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
        );
        let unchanged = self.observed.as_ref().is_some_and(|o| {
            o.holder == holder && o.renew_time == renew_time && o.duration == duration
        });
        if !unchanged {
            self.observed = Some(Observed {
                holder,
                renew_time,
                duration,
                at: Instant::now(),
            });
        }
    }

    fn observed_expired(&self) -> bool {
        self.observed
            .as_ref()
            .is_none_or(|o| o.at + o.duration <= Instant::now())
    }

    /// Gives the Lease up if we still hold it, so the next leader need not wait for expiry.
    /// Best effort and bounded: on failure the Lease simply expires.
    pub(super) async fn release(&mut self) {
        let me = self.identity.clone();
        self.renewable = None;
        let attempt = async {
            let Some(mut lease) = self.api.get_opt(LEASE_NAME).await? else {
                return Ok::<bool, kube::Error>(false);
            };
            let Some(spec) = lease.spec.as_mut() else {
                return Ok(false);
            };
            if spec.holder_identity.as_deref() != Some(me.as_str()) {
                return Ok(false);
            }
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
            self.api
                .replace(LEASE_NAME, &PostParams::default(), &lease)
                .await?;
            Ok(true)
        };
        match tokio::time::timeout(Duration::from_secs(1), attempt).await {
            Ok(Ok(true)) => info!("released the leader Lease"),
            Ok(Ok(false)) => {}
            Ok(Err(error)) => warn!(%error, "releasing the Lease failed; it expires on its own"),
            Err(_) => warn!("releasing the Lease timed out; it expires on its own"),
        }
        self.observed = None;
    }

    pub(super) fn holds_per_observation(&self) -> bool {
        self.observed
            .as_ref()
            .is_some_and(|o| o.holder.as_deref() == Some(self.identity.as_str()))
    }

    pub(super) fn lease_seconds(&self) -> i32 {
        i32::try_from(self.duration.as_secs().max(1)).unwrap_or(i32::MAX)
    }
}
