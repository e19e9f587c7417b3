//! When the leader syncs next and how much it derives: retry backoff, the full sync owed
//! after syncs of changed service accounts, and the pacing of drift checks by what a count
//! costs SPIRE. Pure: the loop asks, this answers.

use crate::index::Changed;
use crate::keys::SaKey;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const MIN_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// After a sync of changed service accounts, a full one follows within this many times the
/// last full sync's duration, bounded below and above: status stays fresh within seconds
/// in a small cluster, while in a large one a burst of changes does not turn into a full
/// derive per debounce.
const FULL_OWED_FACTOR: u32 = 10;
const FULL_OWED_MIN: Duration = Duration::from_secs(5);
const FULL_OWED_MAX: Duration = Duration::from_secs(60);
/// Once this many writes since the last full sync have settled (a changed sync finds nothing
/// more to write), the owed full sync runs at once: policy status shows the settled state
/// within a sync, and no full derive falls in the quiet minutes after convergence. After
/// fewer, it keeps its distance: a trickle of single creates does not turn into a full derive
/// per create, and a full derive is small next to this many apiserver patches.
const SETTLED_AFTER_WRITES: usize = 100;

/// At rest, SPIRE's count of our entries is compared with ours this often, or less often
/// when counting is expensive (`drift_check_interval`).
pub const DRIFT_CHECK_INTERVAL: Duration = Duration::from_secs(10);
/// A count costs SPIRE a walk over our entries in its datastore (SPIRE 1.13 pages through
/// every matching entry to count them; no call of the Entry API sees every entry for less):
/// the checks are spaced so that they take at most 1/`DRIFT_COST_FACTOR` of the time (about 2%
/// of a SPIRE core). At 10,000 entries on SQLite a count takes ~190 ms: checked every 10 s,
/// so drift there is repaired within 15 s...
const DRIFT_COST_FACTOR: u32 = 50;
/// ...but drift is still found within this long. The resync (a full list) stays the bound
/// for everything a count cannot see.
const DRIFT_CHECK_MAX: Duration = Duration::from_secs(300);

/// While SPIRE does not answer, it is probed this often (a count), so work resumes within
/// about this long of its return whatever the backoff.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// When the next drift check is due, given how long the last count took to answer.
pub fn drift_check_interval(count_took: Duration) -> Duration {
    (count_took * DRIFT_COST_FACTOR).clamp(DRIFT_CHECK_INTERVAL, DRIFT_CHECK_MAX)
}

/// What a sync asks of the loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    Idle { recheck: Option<Instant> },
    RetryAfter(Duration),
}

/// What a sync derived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Derived {
    /// Every service account.
    Full,
    /// Only those whose Deployments changed since the last sync.
    Changed,
    /// Those whose Deployments changed in our marks alone (the echoes of our patches): SPIRE's
    /// entries and policy status cannot have changed, so no full sync is owed for it.
    Marks,
    /// Nothing: the change was already covered.
    Nothing,
}

impl Derived {
    pub fn label(self) -> &'static str {
        match self {
            Derived::Full => "full",
            Derived::Changed | Derived::Marks | Derived::Nothing => "changed",
        }
    }
}

/// The loop's memory of its own rhythm (leader only).
#[derive(Debug)]
pub struct Pace {
    backoff: Duration,
    /// After syncs of changed service accounts only, a full sync is owed by then: it brings
    /// policy status and the pending-deletion counts up to date.
    full_owed: Option<Instant>,
    /// How long the last full sync took (paces the full syncs owed after changes).
    last_full: Duration,
    /// A sync left work to retry, and no full sync has succeeded since. When SPIRE answers
    /// again after an outage, only then is a sync due at once; an outage seen by a drift check
    /// alone needs a count, not a sync (at 50,000 entries a slow count used to cost a full
    /// sync each time).
    pub retry_owed: bool,
    /// The last full derive held service accounts whose SPIFFE IDs collide: until one shows
    /// none, every sync derives in full (a scoped derive cannot see every holder).
    pub collisions_known: bool,
    /// Writes (to SPIRE and to workloads) since the last full sync. After many, the first
    /// changed sync that writes nothing marks the work as settled (`SETTLED_AFTER_WRITES`).
    writes_since_full: usize,
}

impl Default for Pace {
    fn default() -> Self {
        Self {
            backoff: MIN_BACKOFF,
            full_owed: None,
            last_full: Duration::ZERO,
            retry_owed: false,
            collisions_known: false,
            writes_since_full: 0,
        }
    }
}

impl Pace {
    /// The next retry delay: doubling up to `MAX_BACKOFF`, with "equal jitter" (half fixed,
    /// half random) so replicas and restarts do not retry in step. While SPIRE is down the
    /// probe (`PROBE_INTERVAL`) wakes the loop sooner anyway.
    pub fn next_backoff(&mut self) -> Duration {
        let delay = self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        delay / 2 + delay.mul_f64(rand::random_range(0.0..0.5))
    }

    /// What this sync derives: the service accounts whose Deployments changed, when it was
    /// woken by Deployment events alone and nothing calls for more; otherwise every one.
    pub fn scope(
        &self,
        changes_only: bool,
        changed: Changed,
        relisted: bool,
        failed_writes: bool,
    ) -> Option<BTreeSet<SaKey>> {
        match changed {
            Changed::Accounts(accounts) | Changed::Marks(accounts)
                if changes_only && !relisted && !failed_writes && !self.collisions_known =>
            {
                Some(accounts)
            }
            _ => None,
        }
    }

    /// A full sync finished after `took`: nothing is owed any more.
    pub fn full_sync_took(&mut self, took: Duration) {
        self.last_full = took;
        self.full_owed = None;
        self.writes_since_full = 0;
    }

    /// When the next sync is due, after a sync that `derived`, made `writes` (to SPIRE and
    /// to workloads) and asked for `next`, given the time already scheduled (`scheduled`) and
    /// the resync interval.
    pub fn next_sync(
        &mut self,
        now: Instant,
        scheduled: Instant,
        next: Next,
        (derived, writes): (Derived, usize),
        resync: Duration,
    ) -> Instant {
        let settled = matches!(derived, Derived::Changed | Derived::Marks)
            && writes == 0
            && self.writes_since_full >= SETTLED_AFTER_WRITES
            && matches!(next, Next::Idle { .. });
        self.writes_since_full += writes;
        match (next, derived) {
            (Next::RetryAfter(_), _) => self.retry_owed = true,
            (Next::Idle { .. }, Derived::Full) => self.retry_owed = false,
            (Next::Idle { .. }, _) => {}
        }
        let after = now
            + match next {
                Next::Idle { recheck } => {
                    self.backoff = MIN_BACKOFF;
                    recheck
                        .map(|at| at.saturating_duration_since(now))
                        .map_or(resync, |d| d.min(resync))
                        .max(Duration::from_millis(50))
                }
                Next::RetryAfter(delay) => delay,
            };
        match derived {
            Derived::Full => after,
            Derived::Changed | Derived::Marks if settled => {
                self.full_owed = Some(now);
                now
            }
            // A scoped sync only looked at its accounts' rechecks: it never postpones what is
            // scheduled. Our marks alone (the late echoes of our patches) owe no full sync.
            Derived::Marks => scheduled.min(after),
            Derived::Changed => {
                let owed = *self.full_owed.get_or_insert_with(|| {
                    now + (self.last_full * FULL_OWED_FACTOR).clamp(FULL_OWED_MIN, FULL_OWED_MAX)
                });
                scheduled.min(after).min(owed)
            }
            Derived::Nothing => scheduled,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RESYNC: Duration = Duration::from_secs(300);

    #[test]
    fn drift_checks_are_paced_by_what_a_count_costs_spire() {
        for (count_ms, every_ms) in [
            (0, 10_000),   // an idle, small SPIRE: the base interval
            (200, 10_000), // 10,000 entries on SQLite: 2% of 10 s
            (470, 23_500), // 25,000 entries on SQLite: checks spread out
            (3_000, 150_000),
            (6_000, 300_000), // a count past the call deadline: still every 5 minutes
            (60_000, 300_000),
        ] {
            assert_eq!(
                drift_check_interval(Duration::from_millis(count_ms)),
                Duration::from_millis(every_ms),
                "a count that took {count_ms} ms"
            );
        }
    }

    #[test]
    fn an_idle_full_sync_comes_back_at_its_recheck_or_the_resync() {
        let (mut pace, now) = (Pace::default(), Instant::now());
        let idle = |recheck| Next::Idle { recheck };
        let far = now + Duration::from_secs(3_600);
        for (recheck, due) in [
            (None, now + RESYNC),
            (
                Some(now + Duration::from_secs(7)),
                now + Duration::from_secs(7),
            ),
            (Some(far), now + RESYNC),
            // A recheck already past still leaves the loop a breath.
            (Some(now), now + Duration::from_millis(50)),
        ] {
            assert_eq!(
                pace.next_sync(now, far, idle(recheck), (Derived::Full, 0), RESYNC),
                due
            );
        }
    }

    #[test]
    fn a_changed_sync_never_postpones_what_is_scheduled_and_owes_a_full_one() {
        let (mut pace, now) = (Pace::default(), Instant::now());
        pace.full_sync_took(Duration::from_secs(2));
        let idle = Next::Idle { recheck: None };
        let soon = now + Duration::from_secs(3);
        assert_eq!(
            pace.next_sync(now, soon, idle, (Derived::Changed, 0), RESYNC),
            soon
        );
        // Owed within 10× the last full sync (20 s), kept by later changed syncs.
        let later = now + Duration::from_secs(100);
        let owed = now + Duration::from_secs(20);
        assert_eq!(
            pace.next_sync(now, later, idle, (Derived::Changed, 0), RESYNC),
            owed
        );
        let after = now + Duration::from_secs(5);
        assert_eq!(
            pace.next_sync(after, later, idle, (Derived::Changed, 0), RESYNC),
            owed
        );
        // A change an earlier sync covered schedules nothing new.
        assert_eq!(
            pace.next_sync(now, later, idle, (Derived::Nothing, 0), RESYNC),
            later
        );
        pace.full_sync_took(Duration::from_millis(100));
        // The owed time is bounded below: 5 s.
        assert_eq!(
            pace.next_sync(now, later, idle, (Derived::Changed, 0), RESYNC),
            now + Duration::from_secs(5)
        );
    }

    #[test]
    fn once_the_work_settles_the_owed_full_sync_runs_at_once() {
        let (mut pace, now) = (Pace::default(), Instant::now());
        pace.full_sync_took(Duration::from_secs(60));
        let idle = Next::Idle { recheck: None };
        let later = now + Duration::from_secs(300);
        let owed = now + FULL_OWED_MAX;
        // Syncs that write owe a full sync, at the usual distance.
        assert_eq!(
            pace.next_sync(
                now,
                later,
                idle,
                (Derived::Changed, SETTLED_AFTER_WRITES),
                RESYNC
            ),
            owed
        );
        // The first one that writes nothing: the work settled, the full sync is due now.
        let settled = now + Duration::from_secs(2);
        assert_eq!(
            pace.next_sync(settled, later, idle, (Derived::Changed, 0), RESYNC),
            settled
        );
        pace.full_sync_took(Duration::from_secs(1));
        // A few writes settling (a trickle of creates): owed as usual.
        let quiet = now + Duration::from_secs(30);
        pace.next_sync(quiet, later, idle, (Derived::Changed, 3), RESYNC);
        assert_eq!(
            pace.next_sync(quiet, later, idle, (Derived::Changed, 0), RESYNC),
            quiet + Duration::from_secs(10)
        );
        // The late echoes of the last patches, after the settled full sync: nothing owed.
        pace.full_sync_took(Duration::from_secs(1));
        let echo = quiet + Duration::from_secs(12);
        assert_eq!(
            pace.next_sync(echo, later, idle, (Derived::Marks, 0), RESYNC),
            later
        );
        // A change beyond our marks still owes one.
        assert_eq!(
            pace.next_sync(echo, later, idle, (Derived::Changed, 0), RESYNC),
            echo + Duration::from_secs(10)
        );
        // A covered change never counts as settling.
        let mut busy = Pace::default();
        busy.next_sync(
            now,
            later,
            idle,
            (Derived::Changed, SETTLED_AFTER_WRITES),
            RESYNC,
        );
        assert_eq!(
            busy.next_sync(now, later, idle, (Derived::Nothing, 0), RESYNC),
            later
        );
    }

    #[test]
    fn retries_back_off_with_jitter_and_a_success_resets_them() {
        let mut pace = Pace::default();
        let mut ceilings = Vec::new();
        for _ in 0..7 {
            let delay = pace.next_backoff();
            let ceiling = pace.backoff.min(MAX_BACKOFF);
            ceilings.push(ceiling);
            assert!(delay <= MAX_BACKOFF, "{delay:?}");
        }
        assert_eq!(ceilings.last(), Some(&MAX_BACKOFF));
        let (now, idle) = (Instant::now(), Next::Idle { recheck: None });
        pace.next_sync(now, now, idle, (Derived::Full, 0), RESYNC);
        let first = pace.next_backoff();
        assert!(
            first >= MIN_BACKOFF / 2 && first <= MIN_BACKOFF,
            "after a success the backoff starts again at 1 s: {first:?}"
        );
    }

    #[test]
    fn a_retry_is_owed_until_a_full_sync_succeeds() {
        let (mut pace, now) = (Pace::default(), Instant::now());
        let retry = Next::RetryAfter(Duration::from_secs(1));
        let idle = Next::Idle { recheck: None };
        pace.next_sync(now, now, retry, (Derived::Full, 0), RESYNC);
        assert!(pace.retry_owed);
        pace.next_sync(now, now, idle, (Derived::Changed, 0), RESYNC);
        assert!(pace.retry_owed, "a changed sync saw only some accounts");
        pace.next_sync(now, now, idle, (Derived::Full, 0), RESYNC);
        assert!(!pace.retry_owed);
    }

    #[test]
    fn only_a_change_alone_derives_a_scope() {
        let accounts: BTreeSet<SaKey> = [SaKey {
            namespace: "ns".into(),
            service_account: "sa".into(),
        }]
        .into();
        let changed = || Changed::Accounts(accounts.clone());
        let mut pace = Pace::default();
        assert_eq!(
            pace.scope(true, changed(), false, false),
            Some(accounts.clone())
        );
        for (changes_only, relisted, failed_writes) in [
            (false, false, false),
            (true, true, false),
            (true, false, true),
        ] {
            assert_eq!(
                pace.scope(changes_only, changed(), relisted, failed_writes),
                None
            );
        }
        pace.collisions_known = true;
        assert_eq!(pace.scope(true, changed(), false, false), None);
    }
}
