//! A term of leadership as the writers see it: valid until its renew deadline on this
//! replica's own clock, and a guard that cancels work in flight when it ends (fencing).

use std::future::Future;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Returned by [`Term::guard`] when the term ended before the work did.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("leadership ended (renew deadline passed, stepped down, or shutting down)")]
pub struct Fenced;

/// One uninterrupted period of leadership. Cheap to clone; every clone sees the end.
#[derive(Clone, Debug)]
pub struct Term {
    pub(super) ended: CancellationToken,
    /// The instant after which this replica is no longer sure it leads; moved forward by
    /// each successful renewal.
    pub(super) deadline: watch::Receiver<Instant>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
