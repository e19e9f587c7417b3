//! The loop: leadership terms, and what each wake-up leads to.
//!
//! ```text
//! term starts ─▶ wait for a wake: watch events (debounced) · a due sync · a drift check
//!                · a probe while SPIRE fails
//!             ─▶ sync (`sync`) ─▶ next sync time (`pace`) ─▶ step down if SPIRE is unusable
//! ```

use super::decide::Memory;
use super::health::Probed;
use super::pace::{Next, PROBE_INTERVAL};
use super::state::Controller;
use crate::leader::{Leadership, Term};
use crate::spire::EntryApi;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, warn};

/// Why the leader woke.
enum Wake {
    /// Watch events: Deployments (or more) changed.
    Changed,
    /// A timer: resync, recheck, retry, or a full sync owed.
    Sync,
    DriftCheck,
    Probe,
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl<A: EntryApi> Controller<A> {
    /// Runs until `shutdown`. Syncs only within a leadership term, and every sync runs under
    /// the term's guard: when the term ends (renew deadline, step-down, shutdown), whatever is
    /// in flight is cancelled and nothing more is written.
    pub async fn run(
        mut self,
        trigger: Arc<Notify>,
        leadership: Leadership,
        shutdown: CancellationToken,
    ) {
        let Leadership { mut term, useful } = leadership;
        loop {
            let current = term.borrow_and_update().clone();
            // A term seen after it ended (its deadline passed before the election noticed)
            // is not a new one: wait for the election's next word, never loop on it.
            let (current, lapsed) = match current {
                Some(current) if current.is_valid() => (Some(current), false),
                Some(_) => (None, true),
                None => (None, false),
            };
            if let Some(current) = current {
                self.metrics.leader.set(1);
                self.metrics
                    .transitions
                    .with_label_values(&["leader"])
                    .inc();
                info!("became leader; syncing");
                let led = current.guard(self.lead(&current, &trigger, &useful, &shutdown));
                match led.await {
                    Err(_) => warn!("leadership ended mid-work; in-flight writes were cancelled"),
                    // Stepped down: nothing more until the election has ended the term.
                    Ok(()) if !shutdown.is_cancelled() => current.ended().await,
                    Ok(()) => {}
                }
                self.metrics.leader.set(0);
                self.metrics
                    .transitions
                    .with_label_values(&["follower"])
                    .inc();
                // A later term starts from a fresh list and fresh graces.
                self.view.invalidate();
                self.memory = Memory::default();
                if shutdown.is_cancelled() {
                    return;
                }
                continue;
            }
            let stepped_down = !*useful.borrow();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = term.changed() => if changed.is_err() {
                    // The election is gone: never write again (another replica may lead).
                    error!("leader election ended; this replica stops writing");
                    shutdown.cancelled().await;
                    return;
                },
                // A lapsed term may still be renewed in place (a renewal that lands just
                // after the deadline): looked at again, at a calm pace.
                _ = tokio::time::sleep(PROBE_INTERVAL), if lapsed && !stepped_down => {}
                _ = tokio::time::sleep(PROBE_INTERVAL), if stepped_down => {
                    if self.probe_spire().await {
                        info!("SPIRE is usable again; competing for the Lease");
                        useful.send_replace(true);
                    }
                }
            }
        }
    }

    /// One leadership term: sync on triggers, on retries and on the resync interval; at rest,
    /// check for drift every `drift_every`. Returns on shutdown or after stepping down
    /// because SPIRE is unusable.
    async fn lead(
        &mut self,
        term: &Term,
        trigger: &Notify,
        useful: &watch::Sender<bool>,
        shutdown: &CancellationToken,
    ) {
        let index = self.index.clone();
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = index.synced() => {}
        }
        let mut next_sync = Instant::now();
        let mut next_drift_check = Instant::now() + self.health.drift_every;
        loop {
            let Some(wake) = self
                .wait(trigger, next_sync, next_drift_check, shutdown)
                .await
            else {
                return;
            };
            match wake {
                Wake::Changed | Wake::Sync => {}
                Wake::DriftCheck => {
                    let drifted = self.drifted().await;
                    next_drift_check = Instant::now() + self.health.drift_every;
                    if !drifted {
                        continue;
                    }
                }
                Wake::Probe => match self.probe_wake().await {
                    Probed::Down if self.should_step_down(useful) => return,
                    Probed::Down | Probed::Unchanged => continue,
                    Probed::Sync => {}
                },
            }
            // The drift check keeps its own schedule: in a busy cluster syncs never stop, and
            // a sync that did not re-list has not looked at SPIRE.
            let changes_only = matches!(wake, Wake::Changed);
            let (next, derived, writes) = self
                .sync_once(term, changes_only)
                .instrument(tracing::info_span!("sync"))
                .await;
            if let Next::Idle { .. } = next {
                self.metrics.last_success.set(unix_now());
            }
            let resync = self.settings.resync_interval;
            next_sync =
                self.pace
                    .next_sync(Instant::now(), next_sync, next, (derived, writes), resync);
            if self.should_step_down(useful) {
                return;
            }
        }
    }

    /// Waits for the next reason to act; `None` on shutdown.
    async fn wait(
        &self,
        trigger: &Notify,
        next_sync: Instant,
        next_drift_check: Instant,
        shutdown: &CancellationToken,
    ) -> Option<Wake> {
        // While SPIRE fails, only probes run: a sync would wait out a stalled connection's
        // timeouts again and hold the Lease past the step-down. Changes wait (the trigger
        // keeps its permit) and syncs resume once a probe is answered.
        let failing = self.health.failing();
        // Changes that piled up while the last sync ran are a batch already: waiting the
        // debounce on top would leave the apiserver idle between the syncs of a burst (a
        // mass deletion went at half the apiserver's pace). The debounce gathers the start
        // of a burst that finds the loop idle.
        let backlog = self.index.changes.pending();
        Some(tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = trigger.notified(), if !failing => {
                if !backlog {
                    tokio::time::sleep(self.settings.debounce).await;
                }
                Wake::Changed
            }
            _ = tokio::time::sleep_until(next_sync.into()), if !failing => Wake::Sync,
            _ = tokio::time::sleep_until(next_drift_check.into()), if !failing => Wake::DriftCheck,
            _ = tokio::time::sleep(PROBE_INTERVAL), if failing => Wake::Probe,
        })
    }

    /// True (and the Lease released) when SPIRE has been unusable for the configured time.
    fn should_step_down(&self, useful: &watch::Sender<bool>) -> bool {
        let Some(failing_for) = self.health.failing_for() else {
            return false;
        };
        if failing_for < self.settings.spire_unusable_after {
            return false;
        }
        warn!(
            failing_for_s = failing_for.as_secs(),
            "SPIRE unusable; stepping down so a replica that can reach it leads"
        );
        useful.send_replace(false);
        true
    }
}
