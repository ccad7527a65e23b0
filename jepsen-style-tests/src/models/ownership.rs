//! tokenlog's per-generation ownership and frontier model.
//!
//! Per generation: `acquire(decoder) -> ok(epoch) | rejected`,
//! `append(epoch, start_seq, n_tokens) -> ok(new_frontier) | rejected(current_epoch, frontier)`,
//! `read -> (epoch, frontier)`. State: (epoch, owner, frontier), initially (0, none, 0).
//! Generations are independent: the history is partitioned per generation id.
//!
//! - An acquire grants `epoch + 1` to the decoder (or a higher epoch: the client's own retries
//!   of a lost acquire may have been granted first, see `acquire`).
//! - An append is acceptable when its epoch is the current one (and some decoder holds it) and
//!   `start_seq <= frontier`: the frontier becomes `max(frontier, start_seq + n_tokens)`. A start
//!   below the frontier is a re-send overlapping committed records (after an append whose answer
//!   was lost); the log accepts it only when the overlap is identical, which this model cannot
//!   see (tokens are not modelled) and the exactly-once checker does. A re-send wholly inside
//!   the committed records (`start_seq + n_tokens <= frontier`) is acknowledged at any epoch: it
//!   changes nothing, so it cannot break the fence.
//!   `ok` reports the frontier after the append.
//!
//! Simplification: leases are not modelled. Lease expiry is a timing precondition the checker
//! cannot see, so as far as this model is concerned an acquire may succeed whenever it is
//! invoked (taking the generation over from a live owner is not flagged), an acquire may be
//! rejected whenever some decoder holds the generation, and an otherwise acceptable append may
//! be rejected (its lease expired), as long as the rejection reports the current epoch and
//! frontier. What the model does enforce: epochs are granted once each, in order; no append
//! with a stale epoch or a gap is accepted; frontiers and epochs only move as described.

use crate::model::Model;

/// The ownership model.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ownership;

#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct OwnershipState {
    /// The latest granted epoch (0: never granted).
    pub epoch: u64,
    /// The decoder holding `epoch`.
    pub owner: Option<String>,
    /// Number of committed records.
    pub frontier: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OwnershipInput {
    pub generation: u64,
    pub op: OwnershipOp,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum OwnershipOp {
    Acquire { decoder: String },
    Append { epoch: u64, start_seq: u64, n_tokens: u64 },
    Read,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnershipOutput {
    Acquired { epoch: u64 },
    AcquireRejected,
    Appended { frontier: u64 },
    AppendRejected { current_epoch: u64, frontier: u64 },
    Read { epoch: u64, frontier: u64 },
}

type S = OwnershipState;

impl Model for Ownership {
    type State = OwnershipState;
    type Input = OwnershipInput;
    type Output = OwnershipOutput;

    fn init(&self) -> S {
        S::default()
    }

    fn step(&self, s: &S, input: &OwnershipInput, out: Option<&OwnershipOutput>) -> Option<S> {
        match &input.op {
            OwnershipOp::Acquire { decoder } => acquire(s, decoder, out),
            OwnershipOp::Append {
                epoch,
                start_seq,
                n_tokens,
            } => append(s, *epoch, *start_seq, *n_tokens, out),
            OwnershipOp::Read => match out {
                None => Some(s.clone()),
                Some(OwnershipOutput::Read { epoch, frontier }) => {
                    (*epoch == s.epoch && *frontier == s.frontier).then(|| s.clone())
                }
                Some(_) => None,
            },
        }
    }

    fn partition(&self, input: &OwnershipInput) -> String {
        input.generation.to_string()
    }

    fn describe_op(&self, input: &OwnershipInput, out: Option<&OwnershipOutput>) -> String {
        let out = out.map_or("?".to_string(), describe_output);
        let g = input.generation;
        match &input.op {
            OwnershipOp::Acquire { decoder } => format!("gen {g}: acquire({decoder}) -> {out}"),
            OwnershipOp::Append {
                epoch,
                start_seq,
                n_tokens,
            } => {
                format!("gen {g}: append(epoch {epoch}, start {start_seq}, n {n_tokens}) -> {out}")
            }
            OwnershipOp::Read => format!("gen {g}: read() -> {out}"),
        }
    }

    fn describe_state(&self, s: &S) -> String {
        let owner = s.owner.as_deref().unwrap_or("-");
        format!("(epoch {}, owner {owner}, frontier {})", s.epoch, s.frontier)
    }
}

fn acquire(s: &S, decoder: &str, out: Option<&OwnershipOutput>) -> Option<S> {
    let granted = || S {
        epoch: s.epoch + 1,
        owner: Some(decoder.to_string()),
        frontier: s.frontier,
    };
    match out {
        None => Some(granted()),
        // A client retries an acquire whose answer was lost (`LogClient` does, inside one call),
        // and when the lease granted by the lost try has expired by the time the retry applies,
        // the log grants the next epoch again, to the same decoder. One recorded invocation can
        // therefore return an epoch above `epoch + 1`; the skipped epochs went to the same
        // decoder and were never used. Granting an epoch twice, or one at or below the current
        // one, is still a violation.
        Some(OwnershipOutput::Acquired { epoch }) => (*epoch > s.epoch).then(|| S {
            epoch: *epoch,
            owner: Some(decoder.to_string()),
            frontier: s.frontier,
        }),
        Some(OwnershipOutput::AcquireRejected) => s.owner.is_some().then(|| s.clone()),
        Some(_) => None,
    }
}

/// The frontier after an acceptable append, `None` if the append is not acceptable.
fn accepted_frontier(s: &S, epoch: u64, start: u64, n: u64) -> Option<u64> {
    let end = start.checked_add(n)?;
    // A re-send that lies wholly inside the committed records changes nothing and is
    // acknowledged at any epoch (the log checks it is identical); anything else needs the fence.
    let resend = end <= s.frontier;
    let acceptable = resend || (s.owner.is_some() && epoch == s.epoch && start <= s.frontier);
    acceptable.then_some(s.frontier.max(end))
}

fn append(s: &S, epoch: u64, start: u64, n: u64, out: Option<&OwnershipOutput>) -> Option<S> {
    let accepted = accepted_frontier(s, epoch, start, n);
    let with_frontier = |frontier| S { frontier, ..s.clone() };
    match out {
        None => Some(accepted.map_or_else(|| s.clone(), with_frontier)),
        Some(OwnershipOutput::Appended { frontier }) => (accepted == Some(*frontier)).then(|| with_frontier(*frontier)),
        Some(OwnershipOutput::AppendRejected {
            current_epoch,
            frontier,
        }) => (*current_epoch == s.epoch && *frontier == s.frontier).then(|| s.clone()),
        Some(_) => None,
    }
}

fn describe_output(out: &OwnershipOutput) -> String {
    match out {
        OwnershipOutput::Acquired { epoch } => format!("ok(epoch {epoch})"),
        OwnershipOutput::AcquireRejected => "rejected".to_string(),
        OwnershipOutput::Appended { frontier } => format!("ok(frontier {frontier})"),
        OwnershipOutput::AppendRejected {
            current_epoch,
            frontier,
        } => {
            format!("rejected(epoch {current_epoch}, frontier {frontier})")
        }
        OwnershipOutput::Read { epoch, frontier } => {
            format!("(epoch {epoch}, frontier {frontier})")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::check;
    use crate::history::Operation;
    use std::time::Duration;
    use OwnershipOutput as O;

    const BUDGET: Duration = Duration::from_secs(5);
    type Op = Operation<OwnershipInput, OwnershipOutput>;

    fn acq(client: u64, d: &str, call: u64, out: Option<O>, ret: u64) -> Op {
        let input = OwnershipInput {
            generation: 1,
            op: OwnershipOp::Acquire { decoder: d.into() },
        };
        finish(client, input, call, out, ret)
    }

    fn app(client: u64, (epoch, start_seq, n_tokens): (u64, u64, u64), call: u64, out: Option<O>, ret: u64) -> Op {
        let input = OwnershipInput {
            generation: 1,
            op: OwnershipOp::Append {
                epoch,
                start_seq,
                n_tokens,
            },
        };
        finish(client, input, call, out, ret)
    }

    fn read(client: u64, gen: u64, call: u64, (epoch, frontier): (u64, u64), ret: u64) -> Op {
        let input = OwnershipInput {
            generation: gen,
            op: OwnershipOp::Read,
        };
        Operation::returned(client, input, call, O::Read { epoch, frontier }, ret)
    }

    fn finish(client: u64, input: OwnershipInput, call: u64, out: Option<O>, ret: u64) -> Op {
        match out {
            Some(o) => Operation::returned(client, input, call, o, ret),
            None => Operation::indeterminate(client, input, call),
        }
    }

    fn verdict(ops: &[Op]) -> &'static str {
        check(&Ownership, ops, BUDGET).verdict()
    }

    #[test]
    fn concurrent_acquires_get_distinct_epochs() {
        let ok = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 2 }), 3),
            acq(1, "b", 1, Some(O::Acquired { epoch: 1 }), 2),
        ];
        assert_eq!(verdict(&ok), "linearizable");
        let dup = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1 }), 3),
            acq(1, "b", 1, Some(O::Acquired { epoch: 1 }), 2),
        ];
        assert_eq!(verdict(&dup), "not-linearizable");
    }

    #[test]
    fn appends_move_the_frontier_and_resends_are_idempotent() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1 }), 1),
            app(0, (1, 0, 3), 2, Some(O::Appended { frontier: 3 }), 3),
            app(0, (1, 0, 3), 4, Some(O::Appended { frontier: 3 }), 5),
            app(
                0,
                (1, 5, 1),
                6,
                Some(O::AppendRejected {
                    current_epoch: 1,
                    frontier: 3,
                }),
                7,
            ),
            read(1, 1, 8, (1, 3), 9),
        ];
        assert_eq!(verdict(&ops), "linearizable");
        let mut gap = ops.clone();
        gap[3] = app(0, (1, 5, 1), 6, Some(O::Appended { frontier: 6 }), 7);
        assert_eq!(verdict(&gap), "not-linearizable");
    }

    #[test]
    fn overlapping_resends_extend_and_stale_resends_inside_the_prefix_are_acknowledged() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1 }), 1),
            app(0, (1, 0, 3), 2, Some(O::Appended { frontier: 3 }), 3),
            // A re-send after a lost answer: 1..3 committed already, 3..5 new.
            app(0, (1, 1, 4), 4, Some(O::Appended { frontier: 5 }), 5),
            acq(1, "b", 6, Some(O::Acquired { epoch: 2 }), 7),
            // a's stale re-send lies inside the committed prefix: acknowledged, no effect.
            app(0, (1, 2, 3), 8, Some(O::Appended { frontier: 5 }), 9),
        ];
        assert_eq!(verdict(&ops), "linearizable");
        let mut extends = ops.clone();
        extends[4] = app(0, (1, 4, 3), 8, Some(O::Appended { frontier: 7 }), 9);
        assert_eq!(
            verdict(&extends),
            "not-linearizable",
            "a stale epoch extended the prefix"
        );
    }

    #[test]
    fn a_retried_acquire_may_skip_epochs_but_never_repeat_one() {
        let skipped = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1 }), 1),
            acq(1, "b", 2, Some(O::Acquired { epoch: 3 }), 3),
        ];
        assert_eq!(verdict(&skipped), "linearizable");
        let repeated = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 2 }), 1),
            acq(1, "b", 2, Some(O::Acquired { epoch: 2 }), 3),
        ];
        assert_eq!(verdict(&repeated), "not-linearizable");
        let backwards = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 2 }), 1),
            acq(1, "b", 2, Some(O::Acquired { epoch: 1 }), 3),
        ];
        assert_eq!(verdict(&backwards), "not-linearizable");
    }

    #[test]
    fn stale_epoch_append_must_not_be_accepted() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1 }), 1),
            acq(1, "b", 2, Some(O::Acquired { epoch: 2 }), 3),
            app(0, (1, 0, 2), 4, Some(O::Appended { frontier: 2 }), 5),
        ];
        assert_eq!(verdict(&ops), "not-linearizable");
    }

    #[test]
    fn indeterminate_acquire_that_must_have_happened() {
        let ops = [
            acq(0, "a", 0, None, 0),
            app(0, (1, 0, 2), 4, Some(O::Appended { frontier: 2 }), 5),
        ];
        assert_eq!(verdict(&ops), "linearizable");
        assert_eq!(verdict(&ops[1..]), "not-linearizable");
    }

    #[test]
    fn indeterminate_acquire_that_must_not_have_happened() {
        // b's acquire times out; a keeps appending with epoch 1 and a later read sees epoch 1:
        // b's acquire cannot have taken effect (before the read).
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1 }), 1),
            acq(1, "b", 2, None, 0),
            app(0, (1, 0, 2), 3, Some(O::Appended { frontier: 2 }), 4),
            read(2, 1, 5, (1, 2), 6),
            app(0, (1, 2, 2), 7, Some(O::Appended { frontier: 4 }), 8),
        ];
        assert_eq!(verdict(&ops), "linearizable");
    }

    #[test]
    fn generations_are_checked_independently() {
        let ops = [read(0, 1, 0, (0, 0), 1), read(1, 2, 0, (1, 0), 1)];
        match check(&Ownership, &ops, BUDGET) {
            crate::checker::CheckResult::NotLinearizable(v) => assert_eq!(v.partition, "2"),
            other => panic!("expected a violation, got {other:?}"),
        }
    }
}
