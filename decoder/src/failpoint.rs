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
//!
//! Each fired failpoint writes an `"op": "failpoint"` line to the decoder's history first.

use std::time::Duration;

use crate::worker::{Fired, Halt, StepHooks, StepView};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Failpoints {
    pub exit_after_sample: Option<u32>,
    pub delay_append: Option<(u32, Duration)>,
}

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
                "delay-append" => {
                    let (seq, ms) = arg
                        .split_once(':')
                        .ok_or_else(|| bad("expected delay-append=SEQ:MS".into()))?;
                    fp.delay_append = Some((num(seq)? as u32, Duration::from_millis(num(ms)?)));
                }
                _ => {
                    return Err(bad(format!(
                        "unknown failpoint {name:?} (known: exit-after-sample, delay-append)"
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
    fn after_sample(&self, gens: &[StepView]) -> Option<Fired> {
        let seq = self.exit_after_sample?;
        // Sampled seq, not yet acknowledged: it is about to be sent.
        let g = gens.iter().find(|g| g.sampled == seq + 1 && g.sent <= seq)?;
        Some(Fired {
            name: "exit-after-sample",
            generation: g.generation,
            seq,
            halt: Halt::Now,
        })
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
        assert!(Failpoints::parse("exit-after-sample").is_err());
        assert!(Failpoints::parse("exit-after-sample=x").is_err());
        assert!(Failpoints::parse("delay-append=3").is_err());
        assert!(Failpoints::parse("nope=1")
            .unwrap_err()
            .to_string()
            .contains("unknown failpoint"));
    }
}
