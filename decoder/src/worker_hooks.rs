//! Hooks into the worker's step loop ([`StepHooks`]): how the fault suite's failpoints
//! (`crate::failpoint`, feature `faults`) stop a worker as a crash would, without the worker
//! knowing about failpoints or exiting the process itself.

use std::time::Duration;

/// Exit status of a decoder process halted by a hook (137 = 128 + SIGKILL, what a kill -9 shows).
pub const HALT_EXIT_CODE: i32 = 137;

/// A generation as [`StepHooks`] see it after a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepView {
    pub generation: u64,
    pub epoch: u64,
    /// Records the log has acknowledged.
    pub committed: u32,
    /// Records sent on the current append stream (acknowledged or not): `committed <= sent`.
    pub sent: u32,
    /// Tokens sampled (committed + not yet acknowledged).
    pub sampled: u32,
}

/// How a hook stops the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Halt {
    /// At once, as a kill would: this step's tokens are never sent, nothing is released.
    Now,
    /// Go silent (no renewal, no decoding), hold this step's append for the duration (a message
    /// stuck in the network), send it and record the answer, then stop.
    AfterLateAppend(Duration),
    /// The model step fails: the worker ends with a model error, as a real one would (the
    /// process exits non-zero, its leases lapse).
    ModelError,
    /// The model step panics, on the blocking thread the step runs on.
    Panic,
}

/// A hook that fired: which, at which token, and how the worker stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fired {
    pub name: &'static str,
    pub generation: u64,
    pub seq: u32,
    pub halt: Halt,
}

/// Hooks into the step loop, called at two points of every step. The fault suite's failpoints implement it
/// (`crate::failpoint`, cargo feature `faults`); a production worker has none.
pub trait StepHooks: Send + Sync {
    /// Right after a step sampled, before the answers that arrived are absorbed (a kill here
    /// may also lose the answers of the appends in flight).
    fn after_sample(&self, _gens: &[StepView]) -> Option<Fired> {
        None
    }

    /// After the answers that arrived are absorbed, before this step's append is sent.
    fn before_send(&self, _gens: &[StepView]) -> Option<Fired> {
        None
    }

    /// Before a taken generation's committed prefix is read: `true` makes this read fail as an
    /// unreachable log would (a transient error).
    fn prefix_read_fails(&self, _generation: u64) -> bool {
        false
    }

    /// At a point of a planned handoff (CONTRACT §8, failure points 1-6): `true` ends the
    /// process there, as a kill would.
    fn handoff_exit(&self, _point: HandoffPoint) -> bool {
        false
    }

    /// Whether the answer to the destination's ownership commit is lost (it applied; the
    /// destination must ask the log: failure point 4).
    fn commit_answer_lost(&self) -> bool {
        false
    }

    /// How long the worker waits between finding generations to take from the log and taking
    /// them (a slow log): a transfer arriving meanwhile must find their slots taken.
    fn take_delay(&self) -> Option<std::time::Duration> {
        None
    }

    /// How long a handoff source cannot reach the log once a transfer ended without a
    /// "committed" answer (a partition between it and the log, right when it must learn what
    /// became of the attempt): its log calls about the attempt fail meanwhile.
    fn source_blind(&self) -> Option<std::time::Duration> {
        None
    }

    /// Whether the destination's read of the records committed between its last follow and its
    /// ownership commit fails (after the commit applied: the generation is the destination's,
    /// without a state to continue it, and goes back to the log for a takeover).
    fn catch_up_read_fails(&self) -> bool {
        false
    }

    /// Right after the worker chose a prefix cache entry to restore a generation from (and
    /// recorded it): `true` ends the process there, as a crash inside the restore would (seed
    /// 004's poisoned entry).
    fn prefix_restore_exit(&self) -> bool {
        false
    }

    /// `true`: the worker does not act on renewals the log rejected, as if their answers always
    /// arrived after its next append. A paused owner that continues then writes at its old
    /// epoch, and only the log's fence stops it (failure point 9); without this, which of the
    /// two the continued process does first (renew or append) is a race.
    fn deaf_to_lost_renewals(&self) -> bool {
        false
    }

    /// The least time a step of the loop takes (it waits out the rest): a slower device, so
    /// that a scenario's generation outlasts the start of the decoders it hands over to.
    fn min_step(&self) -> Option<std::time::Duration> {
        None
    }

    /// How long a handoff destination waits before it says receiver_ready (a slow destination:
    /// its transfer is still in flight when the source's drain time runs out).
    fn ready_delay(&self) -> Option<std::time::Duration> {
        None
    }

    /// How long a handoff destination waits after its last check that it is not stopping,
    /// before it sends its ownership commit (a stop arriving meanwhile finds the commit under
    /// way).
    fn commit_delay(&self) -> Option<std::time::Duration> {
        None
    }

    /// How long a handoff source waits, once the destination said committed, before it
    /// records its release (a slow source: the new owner may hand the generation on
    /// meanwhile, and the log's attempt is then no longer this source's).
    fn release_delay(&self) -> Option<std::time::Duration> {
        None
    }

    /// Whether the answer of this registration refresh is lost after the log applied it (the
    /// leader stepped down, a deadline): the decoder learns nothing from it.
    fn register_answer_lost(&self) -> bool {
        false
    }

    /// The sampler version this decoder claims instead of [`crate::RNG_VERSION`]: a decoder of
    /// a release whose sampler draws differently (a rolling upgrade's old or new half).
    fn rng_version(&self) -> Option<u32> {
        None
    }
}

/// The sampler version a decoder with `hooks` draws with: [`crate::RNG_VERSION`] unless a
/// fault build's failpoint says otherwise.
pub fn rng_version(hooks: &Option<std::sync::Arc<dyn StepHooks>>) -> u32 {
    hooks
        .as_ref()
        .and_then(|h| h.rng_version())
        .unwrap_or(crate::RNG_VERSION)
}

/// The points of a planned handoff where a failpoint can end a decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandoffPoint {
    /// The source, after `copying` is recorded, before it sends the cache (failure point 1).
    SourceCopying,
    /// The destination, with the cache received and loaded, before `receiver_ready` (point 2).
    DestinationBeforeReady,
    /// The destination, after `receiver_ready`, before its commit (point 3).
    DestinationAfterReady,
    /// The destination, after its commit applied, before it answers the source (point 5).
    DestinationAfterCommit,
    /// The source, told the generation moved, before `source_released` (point 6).
    SourceBeforeRelease,
}

impl HandoffPoint {
    pub const ALL: [HandoffPoint; 5] = [
        HandoffPoint::SourceCopying,
        HandoffPoint::DestinationBeforeReady,
        HandoffPoint::DestinationAfterReady,
        HandoffPoint::DestinationAfterCommit,
        HandoffPoint::SourceBeforeRelease,
    ];

    pub fn name(self) -> &'static str {
        match self {
            HandoffPoint::SourceCopying => "source-copying",
            HandoffPoint::DestinationBeforeReady => "destination-before-ready",
            HandoffPoint::DestinationAfterReady => "destination-after-ready",
            HandoffPoint::DestinationAfterCommit => "destination-after-commit",
            HandoffPoint::SourceBeforeRelease => "source-before-release",
        }
    }
}
