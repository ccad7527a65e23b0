//! Log time as a leader stamps it (ARCHITECTURE.md, "Log time").
//!
//! Log time runs at the rate of the stamping leader's **monotonic** clock, anchored to the log
//! time already applied; the wall clock may pull it ahead by at most [`STAMP_WALL_LEAD_MS_MAX`].
//! So a leader whose wall clock is ahead or behind by any amount, or jumps, moves log time by at
//! most that lead: leases neither expire at once (clock ahead) nor freeze (clock behind).
//!
//! - `base = mono_ms + offset`, where `offset` only grows: to `applied - mono_ms - LEAD` (log
//!   time never far behind what the log already holds: a new leader continues from the previous
//!   leader's time), and, on a log that holds no time yet, to `wall - mono_ms` (a new cluster
//!   starts at the wall clock).
//! - `stamp = max(previous stamp, base, min(wall, base + LEAD))`.
//!
//! Subtracting the lead when anchoring to applied time is what keeps the lead from ratcheting:
//! the leader's own stamps, once applied, re-anchor `offset` to where it already is. Time no
//! leader stamps (an election, a whole-cluster outage) does not pass in log time.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::limits::STAMP_WALL_LEAD_MS_MAX;

/// Where a [`Clock`] reads time: a test or the fault suite's `clock` nemesis supplies its own.
pub trait TimeSource: Send + Sync {
    /// Milliseconds since the Unix epoch, as the machine's clock says (may jump).
    fn wall_ms(&self) -> u64;
    /// Milliseconds since an arbitrary fixed point; never goes back.
    fn mono_ms(&self) -> u64;
}

/// The machine's clocks; `wall_skew_ms`, if given, is added to the wall clock (the fault
/// suite's `clock` nemesis moves it at run time).
pub struct SystemTimeSource {
    start: Instant,
    wall_skew_ms: Option<Arc<AtomicI64>>,
}

impl SystemTimeSource {
    pub fn new(wall_skew_ms: Option<Arc<AtomicI64>>) -> Self {
        SystemTimeSource {
            start: Instant::now(),
            wall_skew_ms,
        }
    }
}

impl TimeSource for SystemTimeSource {
    fn wall_ms(&self) -> u64 {
        let wall = wall_ms();
        match &self.wall_skew_ms {
            Some(s) => wall.saturating_add_signed(s.load(Ordering::Relaxed)),
            None => wall,
        }
    }
    fn mono_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }
}

/// The machine's wall clock in ms since the Unix epoch.
pub fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A leader's stamping clock. No lock: the anchor and the last stamp are one word each, moved
/// by compare-and-max.
pub struct Clock {
    source: Arc<dyn TimeSource>,
    /// `log time - mono_ms`; `i64::MIN` until anchored.
    offset: AtomicI64,
    last_ms: AtomicU64,
    /// Planted bug `unbounded_clock` (fault builds): stamp with the wall clock as it is.
    trust_wall: bool,
}

impl Clock {
    pub fn new(source: Arc<dyn TimeSource>, trust_wall: bool) -> Self {
        Clock {
            source,
            offset: AtomicI64::new(i64::MIN),
            last_ms: AtomicU64::new(0),
            trust_wall,
        }
    }

    /// This node leads anew (a new term): its next stamp anchors to the log time applied then,
    /// not to where its clock stood when it led before. The anchor only grows, and while other
    /// leaders led, log time did not count their elections: kept, it stamped that much ahead of
    /// the log, expiring registrations, sessions and handoffs and pruning early.
    pub fn lead_anew(&self) {
        self.offset.store(i64::MIN, Ordering::Release);
    }

    /// Log time for the next entry, given the log time already applied: never below an
    /// earlier stamp of this clock.
    pub fn stamp(&self, applied_ms: u64) -> u64 {
        let wall = self.source.wall_ms();
        let t = if self.trust_wall {
            wall.max(applied_ms)
        } else {
            let base = self.base(applied_ms, wall, true);
            base.max(wall.min(base.saturating_add(STAMP_WALL_LEAD_MS_MAX)))
        };
        self.last_ms.fetch_max(t, Ordering::AcqRel).max(t)
    }

    /// Log time now as this node estimates it, without stamping: a follower's estimate runs
    /// from the log time it has applied. For hints (PendingWork), never for decisions.
    ///
    /// An estimate changes nothing: a node that has applied nothing yet (just started, its log
    /// not replayed) would otherwise anchor its clock to its wall clock, and, leading later,
    /// move log time by however far that wall clock is ahead (found by the simulation: a
    /// PendingWork on a restarted node whose wall clock was 3.9 s ahead; as leader it stamped
    /// 3.2 s ahead, and retention pruned a generation some 40 ms after it finished).
    pub fn now(&self, applied_ms: u64) -> u64 {
        let wall = self.source.wall_ms();
        if self.trust_wall {
            return wall.max(applied_ms);
        }
        self.base(applied_ms, wall, false).max(applied_ms)
    }

    /// `mono + offset`, the offset raised to what `applied_ms` (or, on a log with no time yet,
    /// the wall clock) asks for; kept raised only when `remember` (a stamp).
    fn base(&self, applied_ms: u64, wall: u64, remember: bool) -> u64 {
        let mono = self.source.mono_ms() as i64;
        let floor = if applied_ms == 0 {
            wall as i64 - mono
        } else {
            applied_ms as i64 - STAMP_WALL_LEAD_MS_MAX as i64 - mono
        };
        let offset = if remember {
            self.offset.fetch_max(floor, Ordering::AcqRel).max(floor)
        } else {
            self.offset.load(Ordering::Acquire).max(floor)
        };
        (mono + offset).max(0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-moved time source.
    #[derive(Default)]
    struct Manual {
        wall: AtomicU64,
        mono: AtomicU64,
    }

    impl TimeSource for Manual {
        fn wall_ms(&self) -> u64 {
            self.wall.load(Ordering::Relaxed)
        }
        fn mono_ms(&self) -> u64 {
            self.mono.load(Ordering::Relaxed)
        }
    }

    impl Manual {
        fn at(wall: u64, mono: u64) -> Arc<Self> {
            let m = Manual::default();
            m.wall.store(wall, Ordering::Relaxed);
            m.mono.store(mono, Ordering::Relaxed);
            Arc::new(m)
        }
        fn pass(&self, ms: u64) {
            self.wall.fetch_add(ms, Ordering::Relaxed);
            self.mono.fetch_add(ms, Ordering::Relaxed);
        }
        fn jump_wall(&self, ms: i64) {
            let w = self.wall.load(Ordering::Relaxed);
            self.wall.store(w.saturating_add_signed(ms), Ordering::Relaxed);
        }
    }

    const LEAD: u64 = STAMP_WALL_LEAD_MS_MAX;

    /// Issue 11 bug 5: a leader whose wall clock jumps ahead by 10 s moves log time by at most
    /// the lead; time keeps running at the monotonic rate.
    #[test]
    fn a_wall_clock_ahead_moves_log_time_by_at_most_the_lead() {
        let src = Manual::at(1_000_000, 0);
        let c = Clock::new(src.clone(), false);
        let t0 = c.stamp(0);
        assert_eq!(t0, 1_000_000, "a new log starts at the wall clock");
        src.jump_wall(10_000);
        let t1 = c.stamp(t0);
        assert!(t1 - t0 <= LEAD, "jumped {} ms", t1 - t0);
        src.pass(300);
        let t2 = c.stamp(t1);
        assert!(t2 - t0 <= 300 + LEAD && t2 - t1 >= 300 - LEAD, "{t0} {t1} {t2}");
    }

    /// A node that led, lost the lead while others led through elections that log time does
    /// not count, and leads again stamps within the lead of the log time applied then.
    #[test]
    fn a_node_leading_again_stamps_from_the_applied_time() {
        let src = Manual::at(1_000_000, 0);
        let c = Clock::new(src.clone(), false);
        let t0 = c.stamp(0);
        // 10 s later; the other leaders' stamps moved log time by 4 s of them (6 s of elections).
        src.pass(10_000);
        let applied = t0 + 4_000;
        c.lead_anew();
        let t = c.stamp(applied);
        assert!(
            t >= applied && t <= applied + LEAD,
            "stamped {} ms past the applied time",
            t - applied
        );
        src.pass(300);
        let t2 = c.stamp(t);
        assert!(t2 >= t + 300 - LEAD && t2 <= t + 300 + LEAD, "{t} {t2}");
    }

    /// A node's estimate of log time before it applied anything (a restart, its log not yet
    /// replayed) does not anchor its clock to its wall clock: leading later, it stamps within
    /// the lead of the applied time however far its wall clock is ahead.
    #[test]
    fn an_estimate_before_anything_is_applied_does_not_move_later_stamps() {
        let src = Manual::at(1_003_900, 0);
        let c = Clock::new(src.clone(), false);
        assert_eq!(c.now(0), 1_003_900, "an estimate on an empty log is the wall clock");
        src.pass(100);
        let applied = 1_000_000;
        let t = c.stamp(applied);
        assert!(t <= applied + LEAD, "stamped {} ms past the applied time", t - applied);
    }

    /// A leader whose wall clock is behind (or jumps back) keeps log time running at the
    /// monotonic rate: leases of dead owners still end.
    #[test]
    fn a_wall_clock_behind_does_not_freeze_log_time() {
        let src = Manual::at(1_000_000, 50);
        let c = Clock::new(src.clone(), false);
        let t0 = c.stamp(0);
        src.jump_wall(-60_000);
        let mut applied = t0;
        for _ in 0..10 {
            src.pass(100);
            let t = c.stamp(applied);
            assert!(t > applied, "log time froze at {t}");
            applied = t;
        }
        assert!(applied - t0 >= 1_000 - LEAD, "ran {} ms in 1,000 ms", applied - t0);
    }

    /// A new leader continues from the log time already applied, whatever its wall clock says,
    /// and its own stamps fed back as applied time do not ratchet log time ahead.
    #[test]
    fn a_new_leader_continues_from_applied_time_without_ratcheting() {
        let applied = 5_000_000;
        // Wall clock an hour ahead of the log; another hour behind for the second node.
        for wall in [applied + 3_600_000, applied - 3_600_000] {
            let src = Manual::at(wall, 7);
            let c = Clock::new(src.clone(), false);
            let first = c.stamp(applied);
            assert!(
                first.abs_diff(applied) <= LEAD,
                "first stamp {first} from applied {applied}"
            );
            let mut last = first;
            for _ in 0..100 {
                src.pass(10);
                last = c.stamp(last);
            }
            let ran = last - first;
            assert!((1_000 - LEAD..=1_000 + LEAD).contains(&ran), "ran {ran} ms in 1,000 ms");
        }
    }

    /// The planted bug: the wall clock as it is (the old behaviour), which the `clock` nemesis
    /// must catch.
    #[test]
    fn the_planted_clock_trusts_the_wall() {
        let src = Manual::at(1_000_000, 0);
        let c = Clock::new(src.clone(), true);
        let t0 = c.stamp(0);
        src.jump_wall(10_000);
        assert_eq!(c.stamp(t0) - t0, 10_000);
    }
}
