//! What the leader knows of SPIRE's health: since when its calls fail as a whole (the clock
//! the step-down runs on) and how often a drift check is due. Kept by `health`, read by the
//! loop.

use super::pace::DRIFT_CHECK_INTERVAL;
use std::time::{Duration, Instant};

/// What the leader knows of SPIRE's health.
#[derive(Debug)]
pub struct SpireHealth {
    /// Since when SPIRE calls fail as a whole (unset once one succeeds).
    pub(super) failing_since: Option<Instant>,
    /// Until the next drift check: longer when SPIRE's count of our entries is slow.
    pub drift_every: Duration,
}

impl Default for SpireHealth {
    fn default() -> Self {
        Self {
            failing_since: None,
            drift_every: DRIFT_CHECK_INTERVAL,
        }
    }
}

impl SpireHealth {
    pub fn failing(&self) -> bool {
        self.failing_since.is_some()
    }

    /// How long SPIRE calls have failed as a whole, if they do.
    pub fn failing_for(&self) -> Option<Duration> {
        self.failing_since.map(|since| since.elapsed())
    }
}
