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

use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::Api;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

mod lease;
mod term;

pub use lease::LEASE_NAME;
use lease::{Attempt, LeaseRecord};
pub use term::{Fenced, Term};

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

struct Election {
    lease: LeaseRecord,
    settings: ElectionSettings,
    publish: watch::Sender<Option<Term>>,
    useful: watch::Receiver<bool>,
    /// The current term's end switch and deadline, while leading.
    current: Option<(CancellationToken, watch::Sender<Instant>)>,
}

impl Election {
    fn new(
        api: Api<Lease>,
        settings: ElectionSettings,
        publish: watch::Sender<Option<Term>>,
        useful: watch::Receiver<bool>,
    ) -> Self {
        let lease = LeaseRecord::new(api, settings.identity.clone(), settings.lease_duration);
        Self {
            lease,
            settings,
            publish,
            useful,
            current: None,
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
                match tokio::time::timeout(
                    budget,
                    self.lease.try_acquire_or_renew(self.current.is_some()),
                )
                .await
                {
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
            } else if self.current.is_some() || self.lease.holds_per_observation() {
                self.end_term("stepping down: this replica cannot reach SPIRE");
                self.lease.release().await;
            }
            let deadline = self.current.as_ref().map(|(_, d)| *d.borrow());
            let next = started + jittered(self.settings.retry_period);
            tokio::select! {
                _ = shutdown.cancelled() => {
                    let held = self.current.is_some();
                    self.end_term("shutting down");
                    if held {
                        self.lease.release().await;
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
        self.lease.forget_renewal();
        if let Some((ended, _)) = self.current.take() {
            // Unpublished first: whoever wakes on the cancellation must find no term.
            self.publish.send_replace(None);
            ended.cancel();
            warn!(why, "leadership ended; writes stop");
        }
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
}
