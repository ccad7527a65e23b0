//! Test-only failpoints of the lease worker, for the fault suite's deterministic scenarios
//! (CONTRACT §8), as [`StepHooks`]. Compiled only with the cargo feature `faults`; the binary
//! parses `TOKENLOG_FAILPOINTS` once at start-up and installs them with
//! [`crate::worker::Worker::with_hooks`].
//!
//! Syntax: comma-separated `name=arg` items.
//! - `exit-after-sample=SEQ`: the process exits (as if killed) right after it sampled the token
//!   at `SEQ` of a generation, before that token was sent to the log (failure point 7).
//! - `delay-append=SEQ:MS`: when the append carrying `SEQ` is due, the worker stops renewing
//!   every lease and decoding, holds that append for `MS` milliseconds (a message stuck in the
//!   network), then sends it, records the answer, and exits: the late message of an incarnation
//!   that is gone (failure point 10).
//! - `model-error=SEQ`: the model step that samples `SEQ` fails; the worker ends with that
//!   error, the process exits non-zero and its leases lapse (issue 11 bug 1).
//! - `model-panic=SEQ`: the same step panics instead.
//! - `prefix-read-errors=N`: the first `N` reads of a taken generation's committed prefix fail
//!   as an unreachable log would: a transient error, after which the generation is released,
//!   never failed (issue 11 bug 2).
//!
//! - `handoff-exit=POINT`: the process exits (as if killed) at that point of a planned handoff:
//!   `source-copying` (point 1), `destination-before-ready` (2), `destination-after-ready` (3),
//!   `destination-after-commit` (5), `source-before-release` (6).
//! - `commit-answer-lost=1`: a destination's ownership commit applies but its answer is dropped;
//!   the destination asks the log (point 4).
//! - `take-delay-ms=MS`: the worker waits `MS` milliseconds between finding generations to
//!   take from the log and taking them (their slots are claimed meanwhile).
//! - `source-blind-ms=MS`: once a transfer ended without a "committed" answer, the source's
//!   log calls about the attempt fail for `MS` milliseconds (it cannot learn the outcome at
//!   once; it asks again until the log answers, and never takes an unanswered question for an
//!   abort).
//! - `catch-up-read-fails=1`: after its ownership commit applied, a destination's read of the
//!   records the source committed since its last follow fails; it releases the generation.
//! - `prefix-restore-exit=1`: the process exits (as if killed) every time it is about to restore
//!   a generation from a prefix cache entry: a poisoned entry (seed 004).
//!
//! - `min-step-ms=MS`: every step of the loop takes at least `MS` milliseconds (a slower
//!   device; the real model on a fast machine finishes a scenario's request before the other
//!   decoders have started).
//! - `deaf-to-lost-renewals=1`: the worker does not drop a generation whose renewal the log
//!   rejected (as if that answer always came late): after a pause the old owner's next append
//!   meets the log's fence, deterministically (failure point 9).
//! - `register-answers-lost=N`: of every `N + 1` registration refreshes (after the first
//!   registration), the answers of the first `N` are lost after the log applied them.
//! - `ready-delay-ms=MS`: a handoff destination waits `MS` milliseconds before it says
//!   receiver_ready (a slow destination).
//! - `commit-delay-ms=MS`: a handoff destination waits `MS` milliseconds after its last check
//!   that it is not stopping, before it sends its ownership commit (a stop arriving meanwhile
//!   finds the commit under way).
//! - `release-delay-ms=MS`: a handoff source waits `MS` milliseconds after the destination
//!   said committed, before it records its release (the new owner may hand the generation on
//!   meanwhile).
//! - `rng-version=N`: the decoder claims sampler version `N` (acquires with it, and takes
//!   handoffs of generations bound to it): a decoder of a release whose sampler draws
//!   differently, during a rolling upgrade.
//!
//! Each fired failpoint writes an `"op": "failpoint"` line to the decoder's history first.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::worker::{Fired, Halt, HandoffPoint, StepHooks, StepView};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Failpoints {
    pub exit_after_sample: Option<u32>,
    pub delay_append: Option<(u32, Duration)>,
    pub model_error: Option<u32>,
    pub model_panic: Option<u32>,
    pub prefix_read_errors: u32,
    pub handoff_exit: Option<String>,
    pub commit_answer_lost: bool,
    pub catch_up_read_fails: bool,
    pub source_blind: Option<Duration>,
    pub take_delay: Option<Duration>,
    pub prefix_restore_exit: bool,
    pub deaf_to_lost_renewals: bool,
    pub min_step: Option<Duration>,
    pub rng_version: Option<u32>,
    pub ready_delay: Option<Duration>,
    pub release_delay: Option<Duration>,
    pub commit_delay: Option<Duration>,
    pub register_answers_lost: u32,
    /// Registration refreshes so far.
    register_refreshes: Fires,
    /// Prefix reads failed so far (shared by the clones of one process's failpoints).
    prefix_reads_failed: Fires,
}

/// A count that takes no part in comparing failpoints.
#[derive(Clone, Debug, Default)]
struct Fires(Arc<AtomicU32>);

impl PartialEq for Fires {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for Fires {}

/// A failpoint item that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("{item:?}: {problem}")]
pub struct FailpointError {
    pub item: String,
    pub problem: String,
}

impl Failpoints {
    pub fn parse(s: &str) -> Result<Self, FailpointError> {
        let mut fp = Failpoints::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let bad = |problem: String| FailpointError {
                item: item.to_string(),
                problem,
            };
            let (name, arg) = item.split_once('=').ok_or_else(|| bad("expected name=arg".into()))?;
            let num = |x: &str| x.parse::<u64>().map_err(|_| bad(format!("{x:?} is not a number")));
            match name {
                "exit-after-sample" => fp.exit_after_sample = Some(num(arg)? as u32),
                "model-error" => fp.model_error = Some(num(arg)? as u32),
                "model-panic" => fp.model_panic = Some(num(arg)? as u32),
                "prefix-read-errors" => fp.prefix_read_errors = num(arg)? as u32,
                "handoff-exit" => {
                    if !HandoffPoint::ALL.iter().any(|p| p.name() == arg) {
                        let known: Vec<&str> = HandoffPoint::ALL.iter().map(|p| p.name()).collect();
                        return Err(bad(format!("unknown handoff point (known: {})", known.join(", "))));
                    }
                    fp.handoff_exit = Some(arg.to_string());
                }
                "commit-answer-lost" => fp.commit_answer_lost = num(arg)? != 0,
                "catch-up-read-fails" => fp.catch_up_read_fails = num(arg)? != 0,
                "source-blind-ms" => fp.source_blind = Some(Duration::from_millis(num(arg)?)),
                "take-delay-ms" => fp.take_delay = Some(Duration::from_millis(num(arg)?)),
                "prefix-restore-exit" => fp.prefix_restore_exit = num(arg)? != 0,
                "deaf-to-lost-renewals" => fp.deaf_to_lost_renewals = num(arg)? != 0,
                "min-step-ms" => fp.min_step = Some(Duration::from_millis(num(arg)?)),
                "register-answers-lost" => fp.register_answers_lost = num(arg)? as u32,
                "ready-delay-ms" => fp.ready_delay = Some(Duration::from_millis(num(arg)?)),
                "release-delay-ms" => fp.release_delay = Some(Duration::from_millis(num(arg)?)),
                "commit-delay-ms" => fp.commit_delay = Some(Duration::from_millis(num(arg)?)),
                "rng-version" => {
                    let v = u32::try_from(num(arg)?).map_err(|_| bad(format!("{arg} is over u32")))?;
                    fp.rng_version = Some(v);
                }
                "delay-append" => {
                    let (seq, ms) = arg
                        .split_once(':')
                        .ok_or_else(|| bad("expected delay-append=SEQ:MS".into()))?;
                    fp.delay_append = Some((num(seq)? as u32, Duration::from_millis(num(ms)?)));
                }
                _ => {
                    return Err(bad(format!(
                        "unknown failpoint {name:?} (known: exit-after-sample, delay-append, model-error, \
                         model-panic, prefix-read-errors, handoff-exit, commit-answer-lost, catch-up-read-fails, source-blind-ms, take-delay-ms, prefix-restore-exit, \
                         deaf-to-lost-renewals, min-step-ms, register-answers-lost, ready-delay-ms, commit-delay-ms, release-delay-ms, rng-version)"
                    )))
                }
            }
        }
        Ok(fp)
    }

    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

impl StepHooks for Failpoints {
    fn handoff_exit(&self, point: HandoffPoint) -> bool {
        self.handoff_exit.as_deref() == Some(point.name())
    }

    fn commit_answer_lost(&self) -> bool {
        self.commit_answer_lost
    }

    fn catch_up_read_fails(&self) -> bool {
        self.catch_up_read_fails
    }

    fn source_blind(&self) -> Option<Duration> {
        self.source_blind
    }

    fn take_delay(&self) -> Option<Duration> {
        self.take_delay
    }

    fn prefix_restore_exit(&self) -> bool {
        self.prefix_restore_exit
    }

    fn deaf_to_lost_renewals(&self) -> bool {
        self.deaf_to_lost_renewals
    }

    fn min_step(&self) -> Option<Duration> {
        self.min_step
    }

    fn rng_version(&self) -> Option<u32> {
        self.rng_version
    }

    fn ready_delay(&self) -> Option<Duration> {
        self.ready_delay
    }

    fn release_delay(&self) -> Option<Duration> {
        self.release_delay
    }

    fn commit_delay(&self) -> Option<Duration> {
        self.commit_delay
    }

    fn register_answer_lost(&self) -> bool {
        let n = self.register_refreshes.0.fetch_add(1, Ordering::AcqRel);
        self.register_answers_lost > 0 && n % (self.register_answers_lost + 1) < self.register_answers_lost
    }

    fn after_sample(&self, gens: &[StepView]) -> Option<Fired> {
        let armed = [
            (self.exit_after_sample, "exit-after-sample", Halt::Now),
            (self.model_error, "model-error", Halt::ModelError),
            (self.model_panic, "model-panic", Halt::Panic),
        ];
        armed.into_iter().find_map(|(seq, name, halt)| {
            let seq = seq?;
            // Sampled seq, not yet sent: it is about to be.
            let g = gens.iter().find(|g| g.sampled == seq + 1 && g.sent <= seq)?;
            Some(Fired {
                name,
                generation: g.generation,
                seq,
                halt,
            })
        })
    }

    fn prefix_read_fails(&self, _generation: u64) -> bool {
        let fired = &self.prefix_reads_failed.0;
        fired
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.prefix_read_errors).then_some(n + 1)
            })
            .is_ok()
    }

    fn before_send(&self, gens: &[StepView]) -> Option<Fired> {
        let (seq, delay) = self.delay_append?;
        // Due: sampled, not yet sent.
        let g = gens.iter().find(|g| g.sent <= seq && seq < g.sampled)?;
        Some(Fired {
            name: "delay-append",
            generation: g.generation,
            seq,
            halt: Halt::AfterLateAppend(delay),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_failpoint_and_refuses_garbage() {
        assert_eq!(Failpoints::parse("").unwrap(), Failpoints::default());
        let fp = Failpoints::parse("exit-after-sample=20, delay-append=7:3000").unwrap();
        assert_eq!(fp.exit_after_sample, Some(20));
        assert_eq!(fp.delay_append, Some((7, Duration::from_millis(3000))));
        assert!(fp.any());
        let fp = Failpoints::parse("model-error=3,model-panic=4,prefix-read-errors=2").unwrap();
        assert_eq!(
            (fp.model_error, fp.model_panic, fp.prefix_read_errors),
            (Some(3), Some(4), 2)
        );
        assert!(fp.prefix_read_fails(1) && fp.prefix_read_fails(1) && !fp.prefix_read_fails(1));
        assert!(Failpoints::parse("exit-after-sample").is_err());
        assert!(Failpoints::parse("exit-after-sample=x").is_err());
        assert!(Failpoints::parse("delay-append=3").is_err());
        let fp = Failpoints::parse("handoff-exit=destination-after-ready,commit-answer-lost=1").unwrap();
        assert!(fp.handoff_exit(HandoffPoint::DestinationAfterReady));
        assert!(!fp.handoff_exit(HandoffPoint::SourceCopying));
        assert!(fp.commit_answer_lost());
        assert!(!fp.catch_up_read_fails());
        assert!(Failpoints::parse("catch-up-read-fails=1")
            .unwrap()
            .catch_up_read_fails());
        assert!(Failpoints::parse("handoff-exit=nowhere").is_err());
        assert!(Failpoints::parse("deaf-to-lost-renewals=1")
            .unwrap()
            .deaf_to_lost_renewals());
        assert_eq!(
            Failpoints::parse("min-step-ms=40").unwrap().min_step(),
            Some(Duration::from_millis(40))
        );
        assert!(Failpoints::parse("nope=1")
            .unwrap_err()
            .to_string()
            .contains("unknown failpoint"));
    }
}
