//! tokenlog's per-generation ownership and frontier model.
//!
//! Per generation: `acquire(decoder) -> ok(epoch, frontier) | rejected(terminal?)`,
//! `append(epoch, start_seq, n_tokens, finish) -> ok(new_frontier) | rejected(current_epoch,
//! frontier, terminal?)`, `release(epoch)` and `finish(epoch) -> ok | rejected(...)`, and
//! `read -> (epoch, frontier, terminal)` (the final state read at the end of a run).
//! State: (epoch, owner, frontier, terminal), initially (0, none, 0, no). Generations are
//! independent: the history is partitioned per generation id.
//!
//! - An acquire grants `epoch + 1` to the decoder (or a higher epoch: the client's own retries
//!   of a lost acquire may have been granted first, see `acquire`), with the frontier as it is;
//!   the current owner asking again gets its own epoch back. A terminal generation is never
//!   granted.
//! - An append is acceptable when its epoch is the current one (and some decoder holds it), the
//!   generation is not terminal and `start_seq <= frontier`: the frontier becomes
//!   `max(frontier, start_seq + n_tokens)`, and an append that carries the finish makes it
//!   terminal. A start below the frontier is a re-send overlapping committed records (after an
//!   append whose answer was lost); the log accepts it only when the overlap is identical, which
//!   this model cannot see (tokens are not modelled) and the exactly-once checker does. A re-send
//!   wholly inside the committed records (`start_seq + n_tokens <= frontier`, and no finish
//!   unless the generation is terminal already) is acknowledged at any epoch: it changes
//!   nothing, so it cannot break the fence. `ok` reports the frontier after the append.
//! - A planned handoff's ownership commit (`commit(decoder, source_epoch, handoff_epoch)`)
//!   grants `handoff_epoch = source_epoch + 1` to the destination when the source still holds
//!   the generation at `source_epoch` and it is not terminal, with the frontier as it is (the
//!   cache covers every committed record); a retried commit after it applied gets the same
//!   grant. A commit may be refused at any time (the attempt may have been aborted: not
//!   modelled), and changes nothing then.
//! - A release at the current epoch of a generation that is not terminal leaves it unowned (an
//!   append at that epoch is no longer acceptable); a finish at the current epoch makes it
//!   terminal.
//! - Terminal is for ever: no grant, no record, no release after it, and every later answer
//!   and the final read say terminal.
//!
//! Not modelled, so allowed at any point: a generation becoming terminal by something outside
//! the decoders' histories (a client's cancel, a deadline of the log's `Tick`), seen as an
//! answer or read that says terminal while the model does not yet; and leases (a timing
//! precondition the checker cannot see): an acquire may succeed whenever it is invoked (taking
//! the generation over from a live owner is not flagged), an acquire may be rejected whenever
//! some decoder holds the generation, and an otherwise acceptable append, release or finish may
//! be rejected (its lease expired), as long as the rejection reports the current epoch and
//! frontier. What the model does enforce: epochs are granted once each, in order, with the
//! committed frontier; no append with a stale epoch, a gap, or after the end is accepted;
//! frontiers and epochs only move as described; the final read is where the histories leave it.

use crate::model::Model;

/// The ownership model.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ownership;

#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct OwnershipState {
    /// The latest granted epoch (0: never granted).
    pub epoch: u64,
    /// The decoder holding `epoch` (none before the first grant and after a release).
    pub owner: Option<String>,
    /// Number of committed records.
    pub frontier: u64,
    /// Finished, failed or cancelled.
    pub terminal: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OwnershipInput {
    pub generation: u64,
    pub op: OwnershipOp,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum OwnershipOp {
    Acquire {
        decoder: String,
    },
    Append {
        epoch: u64,
        start_seq: u64,
        n_tokens: u64,
        finish: bool,
    },
    Release {
        epoch: u64,
    },
    Finish {
        epoch: u64,
    },
    /// A planned handoff's ownership commit, by its destination `decoder`.
    HandoffCommit {
        decoder: String,
        source_epoch: u64,
        handoff_epoch: u64,
    },
    Read,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnershipOutput {
    Acquired {
        epoch: u64,
        frontier: u64,
    },
    AcquireRejected {
        terminal: bool,
    },
    Appended {
        frontier: u64,
    },
    /// An append, release or finish refused: the epoch and frontier in force, and whether the
    /// generation was terminal.
    Rejected {
        current_epoch: u64,
        frontier: u64,
        terminal: bool,
    },
    /// A release or finish done.
    Done,
    Read {
        epoch: u64,
        frontier: u64,
        terminal: bool,
    },
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
                finish,
            } => append(s, *epoch, *start_seq, *n_tokens, *finish, out),
            OwnershipOp::Release { epoch } => end_of_hold(s, *epoch, false, out),
            OwnershipOp::Finish { epoch } => end_of_hold(s, *epoch, true, out),
            OwnershipOp::HandoffCommit {
                decoder,
                source_epoch,
                handoff_epoch,
            } => handoff_commit(s, decoder, *source_epoch, *handoff_epoch, out),
            OwnershipOp::Read => match out {
                None => Some(s.clone()),
                Some(&OwnershipOutput::Read {
                    epoch,
                    frontier,
                    terminal,
                }) => (epoch == s.epoch && frontier == s.frontier)
                    .then(|| seen_terminal(s, terminal))
                    .flatten(),
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
                finish,
            } => {
                let fin = if *finish { ", finish" } else { "" };
                format!("gen {g}: append(epoch {epoch}, start {start_seq}, n {n_tokens}{fin}) -> {out}")
            }
            OwnershipOp::Release { epoch } => format!("gen {g}: release(epoch {epoch}) -> {out}"),
            OwnershipOp::Finish { epoch } => format!("gen {g}: finish(epoch {epoch}) -> {out}"),
            OwnershipOp::HandoffCommit {
                decoder,
                source_epoch,
                handoff_epoch,
            } => format!("gen {g}: commit({decoder}, epoch {source_epoch} -> {handoff_epoch}) -> {out}"),
            OwnershipOp::Read => format!("gen {g}: read() -> {out}"),
        }
    }

    fn describe_state(&self, s: &S) -> String {
        let owner = s.owner.as_deref().unwrap_or("-");
        let end = if s.terminal { ", terminal" } else { "" };
        format!("(epoch {}, owner {owner}, frontier {}{end})", s.epoch, s.frontier)
    }
}

/// The state after an answer that says whether the generation is terminal: terminal is for
/// ever (`None` when the answer says otherwise), and may begin unseen (a cancel, a deadline).
fn seen_terminal(s: &S, terminal: bool) -> Option<S> {
    if s.terminal && !terminal {
        return None;
    }
    Some(S {
        terminal: s.terminal || terminal,
        ..s.clone()
    })
}

/// A rejection names the epoch and frontier in force; one for a generation retention pruned
/// (NotFound: terminal, epoch 0, frontier 0) names neither, only that it ended.
fn rejected(s: &S, current_epoch: u64, frontier: u64, terminal: bool) -> Option<S> {
    let pruned = terminal && current_epoch == 0 && frontier == 0;
    (pruned || (current_epoch == s.epoch && frontier == s.frontier))
        .then(|| seen_terminal(s, terminal))
        .flatten()
}

fn acquire(s: &S, decoder: &str, out: Option<&OwnershipOutput>) -> Option<S> {
    let granted = |epoch| S {
        epoch,
        owner: Some(decoder.to_string()),
        ..s.clone()
    };
    match out {
        None if s.terminal => Some(s.clone()),
        None => Some(granted(s.epoch + 1)),
        // A client retries an acquire whose answer was lost (`LogClient` does, inside one call),
        // and when the lease granted by the lost try has expired by the time the retry applies,
        // the log grants the next epoch again, to the same decoder. One recorded invocation can
        // therefore return an epoch above `epoch + 1`; the skipped epochs went to the same
        // decoder and were never used. The current owner asking again gets its epoch back.
        // Granting an epoch twice to two decoders, or one below the current one, is a violation.
        Some(&OwnershipOutput::Acquired { epoch, frontier }) => {
            let again = epoch == s.epoch && s.owner.as_deref() == Some(decoder);
            (!s.terminal && frontier == s.frontier && (epoch > s.epoch || again)).then(|| granted(epoch))
        }
        Some(&OwnershipOutput::AcquireRejected { terminal: true }) => seen_terminal(s, true),
        Some(&OwnershipOutput::AcquireRejected { terminal: false }) => {
            (s.owner.is_some() && !s.terminal).then(|| s.clone())
        }
        Some(_) => None,
    }
}

/// A planned handoff's ownership commit: `Acquired` at the handoff epoch, or refused (state
/// unchanged; the attempt's abort is not modelled).
fn handoff_commit(
    s: &S,
    decoder: &str,
    source_epoch: u64,
    handoff_epoch: u64,
    out: Option<&OwnershipOutput>,
) -> Option<S> {
    let again = s.epoch == handoff_epoch && s.owner.as_deref() == Some(decoder);
    let fresh = s.epoch == source_epoch && handoff_epoch == source_epoch + 1 && s.owner.is_some();
    let granted = (!s.terminal && (fresh || again)).then(|| S {
        epoch: handoff_epoch,
        owner: Some(decoder.to_string()),
        ..s.clone()
    });
    match out {
        None => Some(granted.unwrap_or_else(|| s.clone())),
        Some(&OwnershipOutput::Acquired { epoch, frontier }) => {
            granted.filter(|_| epoch == handoff_epoch && frontier == s.frontier)
        }
        Some(&OwnershipOutput::AcquireRejected { terminal }) => seen_terminal(s, terminal),
        Some(_) => None,
    }
}

/// The state after an acceptable append, `None` if the append is not acceptable.
fn accepted(s: &S, epoch: u64, start: u64, n: u64, finish: bool) -> Option<S> {
    let end = start.checked_add(n)?;
    // A re-send that lies wholly inside the committed records changes nothing and is
    // acknowledged at any epoch (the log checks it is identical); anything else needs the fence.
    if end <= s.frontier && (!finish || s.terminal) {
        return Some(s.clone());
    }
    // A finish must end at or past the frontier (one behind it is refused: SeqMismatch).
    let fenced = s.owner.is_some() && epoch == s.epoch && !s.terminal && start <= s.frontier && s.frontier <= end;
    fenced.then(|| S {
        frontier: s.frontier.max(end),
        terminal: finish,
        ..s.clone()
    })
}

fn append(s: &S, epoch: u64, start: u64, n: u64, finish: bool, out: Option<&OwnershipOutput>) -> Option<S> {
    let next = accepted(s, epoch, start, n, finish);
    match out {
        None => Some(next.unwrap_or_else(|| s.clone())),
        Some(&OwnershipOutput::Appended { frontier }) => next.filter(|n| n.frontier == frontier),
        Some(&OwnershipOutput::Rejected {
            current_epoch,
            frontier,
            terminal,
        }) => rejected(s, current_epoch, frontier, terminal),
        Some(_) => None,
    }
}

/// A release (`finish` false) or a finish at `epoch`: fenced like an append, retried ones
/// acknowledged. The fence needs a live lease: an owner (a release ends the hold, and an
/// epoch is never granted twice).
fn end_of_hold(s: &S, epoch: u64, finish: bool, out: Option<&OwnershipOutput>) -> Option<S> {
    let done = if finish {
        // A retried finish of a terminal generation at its epoch is acknowledged.
        (epoch == s.epoch && (s.terminal || s.owner.is_some())).then(|| S {
            terminal: true,
            ..s.clone()
        })
    } else {
        (epoch == s.epoch && !s.terminal).then(|| S {
            owner: None,
            ..s.clone()
        })
    };
    match out {
        None => Some(done.unwrap_or_else(|| s.clone())),
        Some(OwnershipOutput::Done) => done,
        Some(&OwnershipOutput::Rejected {
            current_epoch,
            frontier,
            terminal,
        }) => rejected(s, current_epoch, frontier, terminal),
        Some(_) => None,
    }
}

fn describe_output(out: &OwnershipOutput) -> String {
    let end = |t: bool| if t { ", terminal" } else { "" };
    match out {
        OwnershipOutput::Acquired { epoch, frontier } => format!("ok(epoch {epoch}, frontier {frontier})"),
        OwnershipOutput::AcquireRejected { terminal } => {
            format!("rejected({})", if *terminal { "terminal" } else { "held" })
        }
        OwnershipOutput::Appended { frontier } => format!("ok(frontier {frontier})"),
        OwnershipOutput::Rejected {
            current_epoch,
            frontier,
            terminal,
        } => format!("rejected(epoch {current_epoch}, frontier {frontier}{})", end(*terminal)),
        OwnershipOutput::Done => "ok".to_string(),
        OwnershipOutput::Read {
            epoch,
            frontier,
            terminal,
        } => format!("(epoch {epoch}, frontier {frontier}{})", end(*terminal)),
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
                finish: false,
            },
        };
        finish(client, input, call, out, ret)
    }

    fn read(client: u64, gen: u64, call: u64, (epoch, frontier): (u64, u64), ret: u64) -> Op {
        let input = OwnershipInput {
            generation: gen,
            op: OwnershipOp::Read,
        };
        Operation::returned(
            client,
            input,
            call,
            O::Read {
                epoch,
                frontier,
                terminal: false,
            },
            ret,
        )
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
    fn an_append_answered_after_pruning_says_only_that_it_ended() {
        let pruned = || {
            Some(O::Rejected {
                current_epoch: 0,
                frontier: 0,
                terminal: true,
            })
        };
        let ok = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 2), 2, Some(O::Appended { frontier: 2 }), 3),
            app(0, (1, 2, 2), 4, pruned(), 5),
        ];
        assert_eq!(verdict(&ok), "linearizable");
        // A live generation's rejection must still name its epoch and frontier.
        let live = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 2), 2, Some(O::Appended { frontier: 2 }), 3),
            app(
                0,
                (2, 2, 2),
                4,
                Some(O::Rejected {
                    current_epoch: 0,
                    frontier: 0,
                    terminal: false,
                }),
                5,
            ),
        ];
        assert_eq!(verdict(&live), "not-linearizable");
    }

    fn commit(
        client: u64,
        d: &str,
        (source_epoch, handoff_epoch): (u64, u64),
        call: u64,
        out: Option<O>,
        ret: u64,
    ) -> Op {
        let input = OwnershipInput {
            generation: 1,
            op: OwnershipOp::HandoffCommit {
                decoder: d.into(),
                source_epoch,
                handoff_epoch,
            },
        };
        finish(client, input, call, out, ret)
    }

    #[test]
    fn a_handoff_commit_grants_the_next_epoch_once_and_fences_the_source() {
        let granted = || Some(O::Acquired { epoch: 2, frontier: 2 });
        let stale = || {
            Some(O::Rejected {
                current_epoch: 2,
                frontier: 2,
                terminal: false,
            })
        };
        let moved = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 2), 2, Some(O::Appended { frontier: 2 }), 3),
            commit(1, "b", (1, 2), 4, granted(), 5),
            // The source's late append is fenced; the destination writes at the handoff epoch.
            app(0, (1, 2, 1), 6, stale(), 7),
            app(1, (2, 2, 1), 8, Some(O::Appended { frontier: 3 }), 9),
            read(2, 1, 10, (2, 3), 11),
        ];
        assert_eq!(verdict(&moved), "linearizable");
        // A lost answer (in doubt) explains the destination's writes; a retried commit gets the
        // same grant.
        let lost = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 2), 2, Some(O::Appended { frontier: 2 }), 3),
            commit(1, "b", (1, 2), 4, None, 5),
            commit(1, "b", (1, 2), 6, granted(), 7),
            app(1, (2, 2, 1), 8, Some(O::Appended { frontier: 3 }), 9),
        ];
        assert_eq!(verdict(&lost), "linearizable");
        // A commit after a takeover moved the epoch on would make two owners.
        let after_takeover = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            acq(2, "c", 2, Some(O::Acquired { epoch: 2, frontier: 0 }), 3),
            commit(1, "b", (1, 2), 4, Some(O::Acquired { epoch: 2, frontier: 0 }), 5),
        ];
        assert_eq!(verdict(&after_takeover), "not-linearizable");
        // A commit must keep the frontier: the cache covers every committed record.
        let lost_records = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 2), 2, Some(O::Appended { frontier: 2 }), 3),
            commit(1, "b", (1, 2), 4, Some(O::Acquired { epoch: 2, frontier: 1 }), 5),
        ];
        assert_eq!(verdict(&lost_records), "not-linearizable");
        // The source writing at its epoch after the commit was acknowledged is a stale write.
        let stale_write = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            commit(1, "b", (1, 2), 2, Some(O::Acquired { epoch: 2, frontier: 0 }), 3),
            app(0, (1, 0, 1), 4, Some(O::Appended { frontier: 1 }), 5),
        ];
        assert_eq!(verdict(&stale_write), "not-linearizable");
        // A refused commit changes nothing.
        let refused = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            commit(1, "b", (1, 2), 2, Some(O::AcquireRejected { terminal: false }), 3),
            app(0, (1, 0, 1), 4, Some(O::Appended { frontier: 1 }), 5),
        ];
        assert_eq!(verdict(&refused), "linearizable");
    }

    #[test]
    fn concurrent_acquires_get_distinct_epochs() {
        let ok = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 2, frontier: 0 }), 3),
            acq(1, "b", 1, Some(O::Acquired { epoch: 1, frontier: 0 }), 2),
        ];
        assert_eq!(verdict(&ok), "linearizable");
        let dup = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 3),
            acq(1, "b", 1, Some(O::Acquired { epoch: 1, frontier: 0 }), 2),
        ];
        assert_eq!(verdict(&dup), "not-linearizable");
    }

    #[test]
    fn appends_move_the_frontier_and_resends_are_idempotent() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 3), 2, Some(O::Appended { frontier: 3 }), 3),
            app(0, (1, 0, 3), 4, Some(O::Appended { frontier: 3 }), 5),
            app(
                0,
                (1, 5, 1),
                6,
                Some(O::Rejected {
                    current_epoch: 1,
                    frontier: 3,
                    terminal: false,
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
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 3), 2, Some(O::Appended { frontier: 3 }), 3),
            // A re-send after a lost answer: 1..3 committed already, 3..5 new.
            app(0, (1, 1, 4), 4, Some(O::Appended { frontier: 5 }), 5),
            acq(1, "b", 6, Some(O::Acquired { epoch: 2, frontier: 5 }), 7),
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
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            acq(1, "b", 2, Some(O::Acquired { epoch: 3, frontier: 0 }), 3),
        ];
        assert_eq!(verdict(&skipped), "linearizable");
        let repeated = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 2, frontier: 0 }), 1),
            acq(1, "b", 2, Some(O::Acquired { epoch: 2, frontier: 0 }), 3),
        ];
        assert_eq!(verdict(&repeated), "not-linearizable");
        let backwards = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 2, frontier: 0 }), 1),
            acq(1, "b", 2, Some(O::Acquired { epoch: 1, frontier: 0 }), 3),
        ];
        assert_eq!(verdict(&backwards), "not-linearizable");
    }

    #[test]
    fn stale_epoch_append_must_not_be_accepted() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            acq(1, "b", 2, Some(O::Acquired { epoch: 2, frontier: 0 }), 3),
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
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
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

    fn op(client: u64, op: OwnershipOp, call: u64, out: Option<O>, ret: u64) -> Op {
        finish(client, OwnershipInput { generation: 1, op }, call, out, ret)
    }

    fn final_read(call: u64, epoch: u64, frontier: u64, terminal: bool) -> Op {
        let out = O::Read {
            epoch,
            frontier,
            terminal,
        };
        op(9, OwnershipOp::Read, call, Some(out), call + 1)
    }

    fn app_fin(client: u64, (epoch, start_seq, n_tokens): (u64, u64, u64), call: u64, out: Option<O>, ret: u64) -> Op {
        let append = OwnershipOp::Append {
            epoch,
            start_seq,
            n_tokens,
            finish: true,
        };
        op(client, append, call, out, ret)
    }

    #[test]
    fn an_acquire_names_the_committed_frontier() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 3), 2, Some(O::Appended { frontier: 3 }), 3),
            acq(1, "b", 4, Some(O::Acquired { epoch: 2, frontier: 3 }), 5),
        ];
        assert_eq!(verdict(&ops), "linearizable");
        let mut stale = ops.clone();
        stale[2] = acq(1, "b", 4, Some(O::Acquired { epoch: 2, frontier: 2 }), 5);
        assert_eq!(
            verdict(&stale),
            "not-linearizable",
            "acknowledged records missing at the takeover"
        );
    }

    #[test]
    fn a_finished_generation_takes_no_records_and_no_owner() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app_fin(0, (1, 0, 2), 2, Some(O::Appended { frontier: 2 }), 3),
            // A re-send of the finished append: acknowledged, no effect.
            app_fin(0, (1, 0, 2), 4, Some(O::Appended { frontier: 2 }), 5),
            acq(1, "b", 6, Some(O::AcquireRejected { terminal: true }), 7),
            final_read(8, 1, 2, true),
        ];
        assert_eq!(verdict(&ops), "linearizable");
        let mut extended = ops.clone();
        extended[2] = app(0, (1, 2, 1), 4, Some(O::Appended { frontier: 3 }), 5);
        assert_eq!(verdict(&extended), "not-linearizable", "a record after the finish");
        let mut granted = ops.clone();
        granted[3] = acq(1, "b", 6, Some(O::Acquired { epoch: 2, frontier: 2 }), 7);
        assert_eq!(verdict(&granted), "not-linearizable", "a grant after the finish");
        let mut revived = ops.clone();
        revived[4] = final_read(8, 1, 2, false);
        assert_eq!(verdict(&revived), "not-linearizable", "terminal is for ever");
    }

    /// A finish that ends behind the committed frontier is refused (`SeqMismatch`, the log's
    /// rule since the apply panic it caused): acknowledged, it is not linearizable.
    #[test]
    fn a_finish_behind_the_frontier_is_refused() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 3), 2, Some(O::Appended { frontier: 3 }), 3),
            app_fin(
                0,
                (1, 0, 1),
                4,
                Some(O::Rejected {
                    current_epoch: 1,
                    frontier: 3,
                    terminal: false,
                }),
                5,
            ),
            final_read(6, 1, 3, false),
        ];
        assert_eq!(verdict(&ops), "linearizable");
        let mut accepted = ops.clone();
        accepted[2] = app_fin(0, (1, 0, 1), 4, Some(O::Appended { frontier: 3 }), 5);
        accepted[3] = final_read(6, 1, 3, true);
        assert_eq!(
            verdict(&accepted),
            "not-linearizable",
            "a finish behind the frontier taken"
        );
    }

    #[test]
    fn a_cancel_outside_the_histories_may_end_a_generation_at_any_point() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 2), 2, Some(O::Appended { frontier: 2 }), 3),
            app(
                0,
                (1, 2, 1),
                4,
                Some(O::Rejected {
                    current_epoch: 1,
                    frontier: 2,
                    terminal: true,
                }),
                5,
            ),
            final_read(8, 1, 2, true),
        ];
        assert_eq!(verdict(&ops), "linearizable");
        // Cancelled, then an append accepted past the end.
        let mut after = ops.to_vec();
        after.push(app(0, (1, 2, 1), 6, Some(O::Appended { frontier: 3 }), 7));
        after[3] = final_read(8, 1, 3, true);
        assert_eq!(verdict(&after), "not-linearizable");
    }

    #[test]
    fn a_release_ends_the_hold_of_its_epoch() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 2), 2, Some(O::Appended { frontier: 2 }), 3),
            op(0, OwnershipOp::Release { epoch: 1 }, 4, Some(O::Done), 5),
            acq(1, "b", 6, Some(O::Acquired { epoch: 2, frontier: 2 }), 7),
            final_read(8, 2, 2, false),
        ];
        assert_eq!(verdict(&ops), "linearizable");
        let mut written_after = ops[..3].to_vec();
        written_after.push(app(0, (1, 2, 1), 6, Some(O::Appended { frontier: 3 }), 7));
        assert_eq!(
            verdict(&written_after),
            "not-linearizable",
            "an append after its release"
        );
        let mut refused = ops[..3].to_vec();
        refused.push(acq(1, "b", 6, Some(O::AcquireRejected { terminal: false }), 7));
        assert_eq!(verdict(&refused), "not-linearizable", "held by nobody, yet refused");
        // The log fences a finish as an append: a released epoch's finish is refused (the
        // lease is no one's). The model took it.
        let mut finished_after = ops[..3].to_vec();
        finished_after.push(op(0, OwnershipOp::Finish { epoch: 1 }, 6, Some(O::Done), 7));
        finished_after.push(final_read(8, 1, 2, true));
        assert_eq!(
            verdict(&finished_after),
            "not-linearizable",
            "a finish after its release"
        );
    }

    #[test]
    fn the_final_read_must_be_where_the_histories_leave_the_generation() {
        let ops = [
            acq(0, "a", 0, Some(O::Acquired { epoch: 1, frontier: 0 }), 1),
            app(0, (1, 0, 3), 2, Some(O::Appended { frontier: 3 }), 3),
            final_read(8, 1, 3, false),
        ];
        assert_eq!(verdict(&ops), "linearizable");
        for (epoch, frontier) in [(1, 2), (2, 3), (1, 4)] {
            let mut v = ops.clone();
            v[2] = final_read(8, epoch, frontier, false);
            assert_eq!(verdict(&v), "not-linearizable", "read ({epoch}, {frontier})");
        }
        // An append in doubt may have landed: both frontiers are explained.
        let mut doubt = ops.to_vec();
        doubt.insert(2, app(0, (1, 3, 2), 4, None, 0));
        assert_eq!(verdict(&doubt), "linearizable");
        doubt[3] = final_read(8, 1, 5, false);
        assert_eq!(verdict(&doubt), "linearizable");
    }
}
