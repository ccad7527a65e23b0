//! Planted bugs for the fault suite, as a value: the binary decides them once at start-up and
//! hands them to the state machine, the log store, the database options and the Watch service.
//! Nothing in this crate reads the environment or a global for them.
//!
//! The switches exist only with the cargo feature `faults` (the fault suite's build). Without it
//! [`Faults`] has no fields and every query is the constant `false`, so a production build
//! contains none of the planted code paths. Each plant must be caught by the fault suite:
//! - `no_fence`: appends skip the epoch fence, and a superseded owner's renewal is acknowledged
//!   without effect (fencing, linearizability);
//! - `ack_before_fsync`: appends are acknowledged before the WAL fsync (written WAL data is
//!   kept in the process until the flush, as always, so kill -9 acts as a power cut:
//!   durability);
//! - `early_visibility`: Watch shows records of proposed, uncommitted appends (exactly-once);
//! - `no_unowned_deadline`: `Tick` never fails a generation with records that nobody owns (issue
//!   11 bug 3: its clients wait forever once every compatible decoder is gone);
//! - `unbounded_clock`: the leader stamps log time with its wall clock as it is (issue 11 bug 5:
//!   a clock that jumps ahead expires every lease; the `clock` nemesis);
//! - `diverge`: this node's apply records a decoder registration's expiry 1 ms later than every
//!   other replica does (set on one node only): a replica whose state differs from the others'
//!   while every hash chain agrees, which only the whole-state digest (convergence) sees.

/// Which planted bugs are on. `Faults::default()` is none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    #[cfg(feature = "faults")]
    pub no_fence: bool,
    #[cfg(feature = "faults")]
    pub ack_before_fsync: bool,
    #[cfg(feature = "faults")]
    pub early_visibility: bool,
    #[cfg(feature = "faults")]
    pub unbounded_clock: bool,
    #[cfg(feature = "faults")]
    pub no_unowned_deadline: bool,
    #[cfg(feature = "faults")]
    pub diverge: bool,
}

impl Faults {
    /// Whether this build can plant bugs at all (cargo feature `faults`).
    pub const COMPILED: bool = cfg!(feature = "faults");

    #[inline]
    pub fn no_fence(self) -> bool {
        #[cfg(feature = "faults")]
        return self.no_fence;
        #[cfg(not(feature = "faults"))]
        false
    }

    #[inline]
    pub fn ack_before_fsync(self) -> bool {
        #[cfg(feature = "faults")]
        return self.ack_before_fsync;
        #[cfg(not(feature = "faults"))]
        false
    }

    #[inline]
    pub fn early_visibility(self) -> bool {
        #[cfg(feature = "faults")]
        return self.early_visibility;
        #[cfg(not(feature = "faults"))]
        false
    }

    #[inline]
    pub fn unbounded_clock(self) -> bool {
        #[cfg(feature = "faults")]
        return self.unbounded_clock;
        #[cfg(not(feature = "faults"))]
        false
    }

    #[inline]
    pub fn no_unowned_deadline(self) -> bool {
        #[cfg(feature = "faults")]
        return self.no_unowned_deadline;
        #[cfg(not(feature = "faults"))]
        false
    }

    #[inline]
    pub fn diverge(self) -> bool {
        #[cfg(feature = "faults")]
        return self.diverge;
        #[cfg(not(feature = "faults"))]
        false
    }

    /// Only `no_fence` on (the simulation's plant); `None` in a build without the feature.
    pub fn planted_no_fence() -> Option<Faults> {
        #[cfg(feature = "faults")]
        return Some(Faults {
            no_fence: true,
            ..Faults::default()
        });
        #[cfg(not(feature = "faults"))]
        None
    }

    /// The names of the planted bugs that are on (for the start-up warning).
    pub fn names(self) -> Vec<&'static str> {
        [
            (self.no_fence(), "no-fence"),
            (self.ack_before_fsync(), "ack-before-fsync"),
            (self.early_visibility(), "early-visibility"),
            (self.unbounded_clock(), "unbounded-clock"),
            (self.no_unowned_deadline(), "no-unowned-deadline"),
            (self.diverge(), "diverge"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }
}
