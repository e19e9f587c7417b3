//! Is SPIRE there, and does it hold what we think? One count call answers both: a probe while
//! SPIRE fails, a drift check at rest (paced by what the count costs, `pace`). A mismatch
//! forces a re-list; failures start the clock after which the leader steps down.

use super::pace::drift_check_interval;
use super::state::Controller;
use super::view::Drift;
use crate::spire::EntryApi;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// What a probe while SPIRE failed found.
pub enum Probed {
    /// SPIRE still does not answer.
    Down,
    /// It answers and holds what we expect, and no retry is owed: nothing to redo.
    Unchanged,
    /// It answers and something is owed: sync now.
    Sync,
}

impl<A: EntryApi> Controller<A> {
    /// Notes whether a SPIRE call succeeded; failures start the step-down clock.
    pub(super) fn spire_answered(&mut self, ok: bool) {
        let health = &mut self.health;
        if ok {
            if health.failing_since.take().is_some() {
                info!("SPIRE reachable again");
            }
        } else if health.failing_since.is_none() {
            // The clock starts when the first unanswered call began (a stalled connection
            // costs a call timeout or two before anything fails), not when it gave up.
            let now = Instant::now();
            let began = self.api.unanswered_since().map_or(now, |at| at.min(now));
            health.failing_since = Some(began);
        }
        self.metrics.spire_reachable.set(i64::from(ok));
    }

    /// One cheap call (a count): does SPIRE answer?
    pub(super) async fn probe_spire(&mut self) -> bool {
        let ok = self.api.count_hinted().await.is_ok();
        self.spire_answered(ok);
        ok
    }

    /// A leader's probe while SPIRE fails: given up when the step-down is due, so that a
    /// stalled probe cannot hold the Lease past `--spire-unusable-after`.
    async fn leader_probe(&mut self) -> bool {
        let due = self
            .health
            .failing_for()
            .map(|failing| self.settings.spire_unusable_after.saturating_sub(failing));
        let probe = self.api.count_hinted();
        let ok = match due {
            Some(left) => matches!(
                tokio::time::timeout(left.max(Duration::from_millis(100)), probe).await,
                Ok(Ok(_))
            ),
            None => probe.await.is_ok(),
        };
        self.spire_answered(ok);
        ok
    }

    /// A probe while SPIRE fails: is a sync due now that it answers?
    pub(super) async fn probe_wake(&mut self) -> Probed {
        if !self.leader_probe().await {
            return Probed::Down;
        }
        if !self.pace.retry_owed && !self.drifted().await {
            info!("SPIRE answers again and holds what we expect; nothing to redo");
            return Probed::Unchanged;
        }
        info!("SPIRE answers again; syncing now");
        Probed::Sync
    }

    /// At rest: does SPIRE hold what we think? One count call; a mismatch forces a re-list.
    pub(super) async fn drifted(&mut self) -> bool {
        if self.view.stale(self.settings.resync_interval) {
            return true;
        }
        let counting = Instant::now();
        let checked = self.view.check_drift(self.api.as_ref()).await;
        if checked.is_ok() {
            self.pace_drift_checks(counting.elapsed());
        }
        let result = match &checked {
            Ok(Drift::None) => "match",
            Ok(Drift::Mismatch { .. }) => "mismatch",
            Err(_) => "error",
        };
        self.metrics.drift_checks.with_label_values(&[result]).inc();
        self.spire_answered(checked.is_ok());
        match checked {
            Ok(Drift::None) => false,
            Ok(Drift::Mismatch { expected, found }) => {
                warn!(
                    expected,
                    found, "SPIRE's count of our entries changed behind our back; re-listing"
                );
                self.view.invalidate();
                true
            }
            Err(error) => {
                warn!(%error, "drift check: SPIRE did not answer");
                false
            }
        }
    }

    fn pace_drift_checks(&mut self, count_took: Duration) {
        let every = drift_check_interval(count_took);
        if every != self.health.drift_every {
            debug!(
                count_ms = count_took.as_millis(),
                every_s = every.as_secs(),
                "drift checks paced by the cost of SPIRE's count"
            );
        }
        self.health.drift_every = every;
    }
}
