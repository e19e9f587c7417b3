//! Leader election over a coordination.k8s.io Lease, with fencing. Every replica serves the
//! webhook; only a replica *sure* it holds the Lease writes to SPIRE and to the cluster.
//!
//! Our own loop rather than a crate's, for three things a lease library does not give:
//! - **Fencing.** A term ends on this replica's own clock, `renew_deadline` after the start of
//!   its last successful renewal, whether or not the apiserver can be reached to learn it.
//!   Writers run under a [`Term`] and are cancelled when it ends. `renew_deadline` is shorter
//!   than `lease_duration` by more than the longest single write, so no replica writes once
//!   another can have taken the Lease.
//! - **Leadership follows usefulness.** The controller says when this replica cannot do the
//!   job (its SPIRE is unusable); the loop then releases the Lease and does not compete until
//!   it can again, so a replica that can reach SPIRE takes over.
//! - **A prompt release** on shutdown, bounded in time.
//!
//! Expiry is judged as client-go does: a Lease held by another replica is expired when it has
//! not changed for `leaseDurationSeconds` of *our* time since we first saw it, so clock skew
//! between replicas does not matter.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, PostParams};
use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub const LEASE_NAME: &str = "spiffe-registrar-leader";

#[derive(Clone, Debug)]
pub struct ElectionSettings {
    pub namespace: String,
    pub identity: String,
    /// How long a Lease stays its holder's without renewal: others wait this long.
    pub lease_duration: Duration,
    /// How long after the start of its last successful renewal a leader keeps writing.
    pub renew_deadline: Duration,
    /// Between attempts to acquire or renew.
    pub retry_period: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ElectionSettingsError {
    #[error(
        "the renew deadline ({renew_deadline:?}) must be shorter than the lease duration ({lease_duration:?}) by more than the longest single write ({longest_write:?})"
    )]
    DeadlineTooLong {
        renew_deadline: Duration,
        lease_duration: Duration,
        longest_write: Duration,
    },
    #[error(
        "the retry period ({retry_period:?}) must be shorter than the renew deadline ({renew_deadline:?})"
    )]
    RetryTooLong {
        retry_period: Duration,
        renew_deadline: Duration,
    },
}

impl ElectionSettings {
    /// Checks the fencing rule against the longest single write (a SPIRE call's deadline or
    /// a Kubernetes request's timeout, whichever is longer).
    pub fn check(&self, longest_write: Duration) -> Result<(), ElectionSettingsError> {
        if self.renew_deadline + longest_write >= self.lease_duration {
            return Err(ElectionSettingsError::DeadlineTooLong {
                renew_deadline: self.renew_deadline,
                lease_duration: self.lease_duration,
                longest_write,
            });
        }
        if self.retry_period >= self.renew_deadline {
            return Err(ElectionSettingsError::RetryTooLong {
                retry_period: self.retry_period,
                renew_deadline: self.renew_deadline,
            });
        }
        Ok(())
    }
}

/// Returned by [`Term::guard`] when the term ended before the work did.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("leadership ended (renew deadline passed, stepped down, or shutting down)")]
pub struct Fenced;

/// One uninterrupted period of leadership. Cheap to clone; every clone sees the end.
#[derive(Clone, Debug)]
pub struct Term {
    ended: CancellationToken,
    /// The instant after which this replica is no longer sure it leads; moved forward by
    /// each successful renewal.
    deadline: watch::Receiver<Instant>,
}

impl Term {
    /// True while the term lasts: not ended, and the renew deadline not passed.
    pub fn is_valid(&self) -> bool {
        !self.ended.is_cancelled()
            && self.deadline.has_changed().is_ok()
            && Instant::now() < *self.deadline.borrow()
    }

    /// Resolves when the term ends, on this replica's clock: exactly at the renew deadline if
    /// no renewal moved it, even while the apiserver cannot be reached.
    pub async fn ended(&self) {
        let mut deadline = self.deadline.clone();
        loop {
            let at = *deadline.borrow_and_update();
            if Instant::now() >= at {
                return;
            }
            tokio::select! {
                _ = self.ended.cancelled() => return,
                _ = tokio::time::sleep_until(at) => {}
                changed = deadline.changed() => if changed.is_err() {
                    // The election loop is gone: nothing will renew.
                    return;
                }
            }
        }
    }

    /// Runs `work` unless the term ends first; then `work` is dropped (cancelling whatever
    /// request it has in flight) and `Fenced` is returned.
    pub async fn guard<F: Future>(&self, work: F) -> Result<F::Output, Fenced> {
        if !self.is_valid() {
            return Err(Fenced);
        }
        tokio::select! {
            biased;
            _ = self.ended() => Err(Fenced),
            output = work => Ok(output),
        }
    }
}

/// The controller's side of the election.
pub struct Leadership {
    /// `Some` while this replica leads.
    pub term: watch::Receiver<Option<Term>>,
    /// Set to false when this replica cannot do the job (its SPIRE is unusable): the Lease is
    /// released and not sought again until it is set back to true.
    pub useful: watch::Sender<bool>,
}

/// Starts competing for the Lease. The task releases the Lease and ends on `shutdown`.
pub fn elect(
    client: Client,
    settings: ElectionSettings,
    shutdown: CancellationToken,
) -> (Leadership, tokio::task::JoinHandle<()>) {
    let (term_tx, term_rx) = watch::channel(None);
    let (useful_tx, useful_rx) = watch::channel(true);
    let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
    let task = tokio::spawn(async move {
        Election::new(api, settings, term_tx, useful_rx)
            .run(shutdown)
            .await;
    });
    (
        Leadership {
            term: term_rx,
            useful: useful_tx,
        },
        task,
    )
}

/// What we last saw of the Lease, and when (our clock) it last changed.
struct Observed {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    duration: Duration,
    at: Instant,
}

struct Election {
    api: Api<Lease>,
    settings: ElectionSettings,
    publish: watch::Sender<Option<Term>>,
    useful: watch::Receiver<bool>,
    observed: Option<Observed>,
    /// The current term's end switch and deadline, while leading.
    current: Option<(CancellationToken, watch::Sender<Instant>)>,
    /// The Lease as our last write left it, while we lead: the next renewal writes over it
    /// directly, one request instead of a read and a write (at rest the renewals are most of
    /// what the process does). Its resourceVersion makes the write conditional, so a Lease
    /// changed since is never overwritten: the conflict sends the round back to reading it.
    renewable: Option<Lease>,
}

/// What one attempt found.
enum Attempt {
    /// We hold the Lease, renewed as of the attempt's start.
    Holding,
    /// Another replica holds it and it has not expired.
    HeldElsewhere(String),
}

impl Election {
    fn new(
        api: Api<Lease>,
        settings: ElectionSettings,
        publish: watch::Sender<Option<Term>>,
        useful: watch::Receiver<bool>,
    ) -> Self {
        Self {
            api,
            settings,
            publish,
            useful,
            observed: None,
            current: None,
            renewable: None,
        }
    }

    async fn run(mut self, shutdown: CancellationToken) {
        let mut announced_elsewhere: Option<String> = None;
        loop {
            let started = Instant::now();
            let useful = *self.useful.borrow_and_update();
            if useful {
                // Bounded so the loop is back before the deadline passes unnoticed.
                let budget = self.attempt_budget(started);
                match tokio::time::timeout(budget, self.try_acquire_or_renew()).await {
                    Ok(Ok(Attempt::Holding)) => {
                        announced_elsewhere = None;
                        self.renewed(started + self.settings.renew_deadline);
                    }
                    Ok(Ok(Attempt::HeldElsewhere(holder))) => {
                        self.end_term("another replica holds the Lease");
                        if announced_elsewhere.as_ref() != Some(&holder) {
                            info!(%holder, "another replica leads");
                            announced_elsewhere = Some(holder);
                        }
                    }
                    Ok(Err(error)) => {
                        warn!(%error, leading = self.current.is_some(), "Lease renewal failed")
                    }
                    Err(_) => {
                        warn!(
                            leading = self.current.is_some(),
                            ?budget,
                            "Lease renewal timed out"
                        )
                    }
                }
            } else if self.current.is_some() || self.holds_per_observation() {
                self.end_term("stepping down: this replica cannot reach SPIRE");
                self.release().await;
            }
            let deadline = self.current.as_ref().map(|(_, d)| *d.borrow());
            let next = started + jittered(self.settings.retry_period);
            tokio::select! {
                _ = shutdown.cancelled() => {
                    let held = self.current.is_some();
                    self.end_term("shutting down");
                    if held {
                        self.release().await;
                    }
                    return;
                }
                _ = tokio::time::sleep_until(deadline.unwrap_or(next)), if deadline.is_some_and(|d| d < next) => {
                    self.end_term("renew deadline passed without a successful renewal");
                }
                _ = tokio::time::sleep_until(next) => {}
                _ = self.useful.changed() => {}
            }
        }
    }

    /// Time for one attempt: until the renew deadline while leading, a retry period otherwise.
    fn attempt_budget(&self, now: Instant) -> Duration {
        match &self.current {
            Some((_, deadline)) => deadline
                .borrow()
                .saturating_duration_since(now)
                .max(Duration::from_millis(100)),
            None => self.settings.retry_period,
        }
    }

    fn renewed(&mut self, deadline: Instant) {
        if let Some((_, current)) = &self.current {
            current.send_replace(deadline);
            return;
        }
        let ended = CancellationToken::new();
        let (tx, rx) = watch::channel(deadline);
        info!(
            identity = %self.settings.identity,
            "acquired the leader Lease"
        );
        self.publish.send_replace(Some(Term {
            ended: ended.clone(),
            deadline: rx,
        }));
        self.current = Some((ended, tx));
    }

    fn end_term(&mut self, why: &str) {
        self.renewable = None;
        if let Some((ended, _)) = self.current.take() {
            // Unpublished first: whoever wakes on the cancellation must find no term.
            self.publish.send_replace(None);
            ended.cancel();
            warn!(why, "leadership ended; writes stop");
        }
    }

    fn holds_per_observation(&self) -> bool {
        self.observed
            .as_ref()
            .is_some_and(|o| o.holder.as_deref() == Some(self.settings.identity.as_str()))
    }

    fn lease_seconds(&self) -> i32 {
        i32::try_from(self.settings.lease_duration.as_secs().max(1)).unwrap_or(i32::MAX)
    }

    /// One round of client-go's algorithm: create the Lease if missing; renew it if ours;
    /// take it if it expired; otherwise report its holder. Writes are conditional on the
    /// resourceVersion read, so two replicas never both win.
    async fn try_acquire_or_renew(&mut self) -> Result<Attempt, kube::Error> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let me = self.settings.identity.clone();
        if let Some(mut ours) = self.renewable.take().filter(|_| self.current.is_some()) {
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
    async fn release(&mut self) {
        let me = self.settings.identity.clone();
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
}

/// `period` spread by up to ±10%, so replicas started together do not poll in step.
fn jittered(period: Duration) -> Duration {
    let spread = rand::random_range(0.9..1.1);
    period.mul_f64(spread)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(lease: u64, deadline: u64, retry: u64) -> ElectionSettings {
        ElectionSettings {
            namespace: "ns".into(),
            identity: "me".into(),
            lease_duration: Duration::from_secs(lease),
            renew_deadline: Duration::from_secs(deadline),
            retry_period: Duration::from_secs(retry),
        }
    }

    #[test]
    fn the_deadline_leaves_room_for_the_longest_write() {
        let write = Duration::from_secs(4);
        assert!(settings(15, 10, 2).check(write).is_ok());
        assert!(matches!(
            settings(15, 11, 2).check(write),
            Err(ElectionSettingsError::DeadlineTooLong { .. })
        ));
        assert!(matches!(
            settings(15, 10, 10).check(write),
            Err(ElectionSettingsError::RetryTooLong { .. })
        ));
    }

    fn term(deadline: Instant) -> (Term, CancellationToken, watch::Sender<Instant>) {
        let ended = CancellationToken::new();
        let (tx, rx) = watch::channel(deadline);
        (
            Term {
                ended: ended.clone(),
                deadline: rx,
            },
            ended,
            tx,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_term_ends_at_its_deadline_on_the_local_clock() {
        let start = Instant::now();
        let (term, _ended, deadline) = term(start + Duration::from_secs(10));
        assert!(term.is_valid());
        // A renewal at 5 s moves the deadline to 15 s.
        tokio::time::advance(Duration::from_secs(5)).await;
        deadline.send_replace(start + Duration::from_secs(15));
        let work = term.guard(tokio::time::sleep(Duration::from_secs(60)));
        assert_eq!(work.await, Err(Fenced));
        assert_eq!(Instant::now() - start, Duration::from_secs(15));
        assert!(!term.is_valid());
        assert_eq!(
            term.guard(async { 1 }).await,
            Err(Fenced),
            "nothing starts after the end"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ending_a_term_cancels_work_in_flight_and_work_within_it_completes() {
        let (term, ended, _deadline) = term(Instant::now() + Duration::from_secs(10));
        assert_eq!(term.guard(async { 7 }).await, Ok(7));
        let guarded = term.clone();
        let work = tokio::spawn(async move {
            guarded
                .guard(tokio::time::sleep(Duration::from_secs(5)))
                .await
        });
        tokio::time::advance(Duration::from_secs(1)).await;
        ended.cancel();
        assert_eq!(work.await.unwrap(), Err(Fenced));
    }

    #[tokio::test(start_paused = true)]
    async fn a_term_whose_election_is_gone_ends() {
        let (term, _ended, deadline) = term(Instant::now() + Duration::from_secs(10));
        drop(deadline);
        tokio::time::timeout(Duration::from_secs(1), term.ended())
            .await
            .expect("ends at once when nothing can renew it");
    }
}
