//! An optional JSONL record of a decoder's ownership operations (acquire, append), with
//! invocation and completion times, for the fault suite's checkers (linearizability of
//! ownership and frontier, fencing). One typed [`HistoryLine`] per line, shared by this writer and
//! the harness that reads it: an [`HistoryLine::Invoke`] before a call (with its input) and a
//! [`HistoryLine::Complete`] after it (with the answer; `ok: None` when the answer was lost),
//! joined by `(decoder, id)`. Each line is one `write`, so a decoder killed with SIGKILL leaves
//! whole lines; an operation with no completion line is indeterminate: it may have taken effect.
//! [`HistoryLine::Event`] lines record instants: a generation resumed (with its four frontiers),
//! a failpoint fired.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// One line of a decoder's history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum HistoryLine {
    /// A call is about to be sent.
    Invoke {
        decoder: String,
        id: u64,
        invoke_us: u64,
        #[serde(flatten)]
        call: Call,
    },
    /// The answer of call `id` (or that it was lost).
    Complete {
        decoder: String,
        id: u64,
        complete_us: u64,
        #[serde(flatten)]
        answer: Answer,
    },
    /// Something that happened at one instant.
    Event {
        decoder: String,
        at_us: u64,
        #[serde(flatten)]
        event: DecoderEvent,
    },
}

/// An ownership call of the decoder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Call {
    Acquire {
        gen: u64,
    },
    /// One item of an append: `n` records from `start_seq` (and a finish when `finish`).
    Append {
        gen: u64,
        epoch: u64,
        start_seq: u32,
        n: u32,
        finish: bool,
    },
    /// A release of a generation held at `epoch` (the worker gives it back).
    Release {
        gen: u64,
        epoch: u64,
    },
    /// An explicit finish at `epoch` with `reason` (`raftlog.v1.FinishReason`), outside an
    /// append (a binding this decoder cannot serve).
    Finish {
        gen: u64,
        epoch: u64,
        reason: i32,
    },
    /// A planned handoff's ownership commit (CONTRACT §7), sent by the destination: attempt
    /// `attempt` grants `handoff_epoch` (= `source_epoch + 1`) to this decoder if the generation
    /// is still the source's at `source_epoch`, at the manifest's frontier.
    HandoffCommit {
        gen: u64,
        attempt: u64,
        source_epoch: u64,
        handoff_epoch: u64,
    },
}

/// The answer to a [`Call`]; `ok: None` = no answer (the call failed in transit: indeterminate).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Answer {
    Acquire {
        ok: Option<bool>,
        /// The granted (or current) epoch and the frontier the answer named.
        epoch: u64,
        frontier: u32,
        /// The generation was terminal (finished, failed, cancelled, or pruned: not found) as
        /// the answer saw it.
        #[serde(default)]
        terminal: bool,
    },
    Append {
        ok: Option<bool>,
        /// The frontier after the append, or the one the rejection named.
        frontier: u32,
        /// The epoch in force (on a rejection: the current one).
        current_epoch: u64,
        /// `raftlog.v1.RejectReason` of a rejection.
        reason: Option<i32>,
        /// A rejection saw the generation terminal.
        #[serde(default)]
        terminal: bool,
    },
    Release {
        ok: Option<bool>,
        current_epoch: u64,
        frontier: u32,
        #[serde(default)]
        terminal: bool,
    },
    Finish {
        ok: Option<bool>,
        current_epoch: u64,
        frontier: u32,
        #[serde(default)]
        terminal: bool,
    },
    /// The log's answer to a [`Call::HandoffCommit`]: the epoch in force and the frontier
    /// after it (granted: the handoff epoch), whether the generation was terminal.
    HandoffCommit {
        ok: Option<bool>,
        epoch: u64,
        frontier: u32,
        #[serde(default)]
        terminal: bool,
    },
}

impl Answer {
    /// The answer to an ownership call (`Acquire`, `Release` or `Finish`, as `call` is) from the
    /// log's response; `None`: the call failed in transit.
    pub fn of_ownership(call: &Call, resp: Option<&tokenlog_proto::raftlog::OwnershipResponse>) -> Answer {
        let ok = resp.map(|r| r.ok);
        let (current_epoch, frontier, terminal) = named(
            resp.and_then(|r| r.generation.as_ref()),
            resp.and_then(|r| r.rejection.as_ref()),
        );
        match call {
            Call::Acquire { .. } | Call::Append { .. } => Answer::Acquire {
                ok,
                epoch: current_epoch,
                frontier,
                terminal,
            },
            Call::Release { .. } => Answer::Release {
                ok,
                current_epoch,
                frontier,
                terminal,
            },
            Call::Finish { .. } => Answer::Finish {
                ok,
                current_epoch,
                frontier,
                terminal,
            },
            Call::HandoffCommit { .. } => Answer::HandoffCommit {
                ok,
                epoch: current_epoch,
                frontier,
                terminal,
            },
        }
    }

    /// The answer to a [`Call::HandoffCommit`] from the log's response; `None`: the call failed
    /// in transit, or its answer was lost.
    pub fn of_handoff_commit(resp: Option<&tokenlog_proto::raftlog::HandoffResponse>) -> Answer {
        let (epoch, frontier, terminal) = named(
            resp.and_then(|r| r.generation.as_ref()),
            resp.and_then(|r| r.rejection.as_ref()),
        );
        Answer::HandoffCommit {
            ok: resp.map(|r| r.ok),
            epoch,
            frontier,
            terminal,
        }
    }
}

/// What an answer names: the epoch in force, the frontier, and whether the generation was
/// terminal (a rejection's, else the generation's; a generation not found is terminal: pruned).
fn named(
    info: Option<&tokenlog_proto::raftlog::GenerationInfo>,
    rej: Option<&tokenlog_proto::raftlog::Rejection>,
) -> (u64, u32, bool) {
    use tokenlog_proto::raftlog as pb;
    let epoch = rej.map_or_else(
        || info.and_then(|g| g.lease.as_ref()).map_or(0, |l| l.epoch),
        |x| x.current_epoch,
    );
    let frontier = rej.map_or_else(|| info.map_or(0, |g| g.frontier), |x| x.frontier);
    let state = rej.map_or_else(|| info.map_or(0, |g| g.state), |x| x.state);
    let terminal = terminal_state(state) || rej.is_some_and(|x| x.reason == pb::RejectReason::NotFound as i32);
    (epoch, frontier, terminal)
}

/// Whether a `raftlog.v1.GenerationState` is terminal.
pub fn terminal_state(state: i32) -> bool {
    use tokenlog_proto::raftlog::GenerationState as S;
    matches!(S::try_from(state), Ok(S::Finished | S::Failed | S::Cancelled))
}

/// An instant in a decoder's life.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum DecoderEvent {
    /// A generation was taken and re-prefilled: its four frontiers (see `crate::Frontiers`).
    /// A deferred prefill (fed in chunks by the batched steps that follow) counts as
    /// `deferred` positions not yet in the KV cache: then `fed` and `kv` are 0.
    Resumed {
        gen: u64,
        epoch: u64,
        prompt_len: u64,
        sampled: u64,
        fed: u64,
        kv: u64,
        committed: u64,
        #[serde(default)]
        deferred: u64,
    },
    /// A test failpoint fired at `seq` (the token it had sampled there, if any).
    Failpoint {
        name: String,
        gen: u64,
        epoch: u64,
        seq: u32,
        token: Option<u32>,
    },
    /// A session with the leader opened (`raftlog.v1.Log/Session`): from now on, this
    /// incarnation's death ends its leases at once.
    SessionOpened { session: u64 },
    /// A planned handoff of a generation this decoder owned at `epoch` reached `phase`
    /// (`prepared`, `aborted`, `released`; `unknown`: the log did not say, after an unanswered
    /// transfer, whether ownership moved, and the source kept it, fenced if it had) towards `to`. Written as `handoff_phase`: a line's
    /// own `phase` says what kind of line it is.
    HandoffOut {
        gen: u64,
        attempt: u64,
        epoch: u64,
        to: String,
        #[serde(rename = "handoff_phase")]
        phase: String,
        detail: String,
    },
    /// An attempt to hand `gen` (ours at `epoch`) out did not move it (`detail`: why): this
    /// decoder keeps it with `committed` records, its model's KV cache holding `kv` positions
    /// (the source keeps every block until the log releases it: prompt + committed).
    HandoffKept {
        gen: u64,
        epoch: u64,
        committed: u32,
        kv: u32,
        detail: String,
    },
    /// This decoder received `gen` with its cache from `from` and the log committed it to us at
    /// `epoch` (the handoff epoch) with `frontier` records; the cache held `kv` positions.
    HandoffReceived {
        gen: u64,
        attempt: u64,
        epoch: u64,
        from: String,
        frontier: u32,
        kv: u32,
    },
}

pub struct History {
    decoder: String,
    out: Sink,
    next: AtomicU64,
}

/// Where a history's lines go.
enum Sink {
    File(Mutex<std::fs::File>),
    /// Kept as typed lines (the simulation reads them back without a file).
    Memory(Lines),
}

/// A history's lines kept in memory ([`History::in_memory`]).
pub type Lines = std::sync::Arc<Mutex<Vec<HistoryLine>>>;

/// Wall-clock microseconds; every process of a single-machine run shares the clock. Under the
/// simulation ([`crate::simulation`]), microseconds of simulated time.
pub fn now_us() -> u64 {
    if let Some(us) = crate::simulation::now_us() {
        return us;
    }
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl History {
    /// Appends to `path` the lines of decoder `decoder`.
    pub fn open(path: &Path, decoder: &str) -> std::io::Result<History> {
        let f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(History {
            decoder: decoder.to_string(),
            out: Sink::File(Mutex::new(f)),
            next: AtomicU64::new(0),
        })
    }

    /// A history of decoder `decoder` kept in memory: the lines, as recorded, are in the
    /// returned [`Lines`].
    pub fn in_memory(decoder: &str) -> (History, Lines) {
        let lines = Lines::default();
        let h = History {
            decoder: decoder.to_string(),
            out: Sink::Memory(lines.clone()),
            next: AtomicU64::new(0),
        };
        (h, lines)
    }

    /// Records a call's invocation; returns its id.
    pub fn invoke(&self, call: Call) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.record(&HistoryLine::Invoke {
            decoder: self.decoder.clone(),
            id,
            invoke_us: now_us(),
            call,
        });
        id
    }

    /// Records the answer of call `id`.
    pub fn complete(&self, id: u64, answer: Answer) {
        self.record(&HistoryLine::Complete {
            decoder: self.decoder.clone(),
            id,
            complete_us: now_us(),
            answer,
        });
    }

    /// Records something that happened now.
    pub fn event(&self, event: DecoderEvent) {
        self.record(&HistoryLine::Event {
            decoder: self.decoder.clone(),
            at_us: now_us(),
            event,
        });
    }

    fn record(&self, line: &HistoryLine) {
        let f = match &self.out {
            Sink::File(f) => f,
            Sink::Memory(lines) => return lines.lock().expect("lock").push(line.clone()),
        };
        let mut text = match serde_json::to_string(line) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("history line not encoded: {e}");
                return;
            }
        };
        text.push('\n');
        let mut f = f.lock().expect("lock");
        if let Err(e) = f.write_all(text.as_bytes()) {
            tracing::warn!("history write failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every event and the handoff commit survive a history line's round trip: no field of
    /// theirs may share a name with the line's own tags (`phase`, `op`), or the line does not
    /// parse back and the checkers never see it (`handoff_out` once had a `phase` of its own).
    #[test]
    fn every_event_and_the_handoff_commit_round_trip() {
        let events = [
            DecoderEvent::HandoffOut {
                gen: 4,
                attempt: 2,
                epoch: 1,
                to: "d2".into(),
                phase: "prepared".into(),
                detail: String::new(),
            },
            DecoderEvent::HandoffKept {
                gen: 4,
                epoch: 1,
                committed: 21,
                kv: 39,
                detail: "refused".into(),
            },
            DecoderEvent::HandoffReceived {
                gen: 4,
                attempt: 2,
                epoch: 2,
                from: "d1".into(),
                frontier: 21,
                kv: 39,
            },
            DecoderEvent::SessionOpened { session: 9 },
            DecoderEvent::Failpoint {
                name: "handoff-exit=source-copying".into(),
                gen: 4,
                epoch: 0,
                seq: 0,
                token: None,
            },
        ];
        let mut lines: Vec<HistoryLine> = events
            .into_iter()
            .map(|event| HistoryLine::Event {
                decoder: "d1".into(),
                at_us: 7,
                event,
            })
            .collect();
        lines.push(HistoryLine::Invoke {
            decoder: "d2".into(),
            id: 5,
            invoke_us: 8,
            call: Call::HandoffCommit {
                gen: 4,
                attempt: 2,
                source_epoch: 1,
                handoff_epoch: 2,
            },
        });
        lines.push(HistoryLine::Complete {
            decoder: "d2".into(),
            id: 5,
            complete_us: 9,
            answer: Answer::HandoffCommit {
                ok: None,
                epoch: 0,
                frontier: 0,
                terminal: false,
            },
        });
        for l in lines {
            let text = serde_json::to_string(&l).unwrap();
            let back: HistoryLine = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(back, l, "{text}");
        }
    }

    #[test]
    fn lines_round_trip_in_the_documented_shape() {
        let lines = [
            HistoryLine::Invoke {
                decoder: "d1".into(),
                id: 3,
                invoke_us: 10,
                call: Call::Append {
                    gen: 7,
                    epoch: 2,
                    start_seq: 4,
                    n: 1,
                    finish: false,
                },
            },
            HistoryLine::Complete {
                decoder: "d1".into(),
                id: 3,
                complete_us: 12,
                answer: Answer::Append {
                    ok: None,
                    frontier: 0,
                    current_epoch: 0,
                    reason: None,
                    terminal: false,
                },
            },
            HistoryLine::Invoke {
                decoder: "d1".into(),
                id: 4,
                invoke_us: 14,
                call: Call::Release { gen: 7, epoch: 2 },
            },
            HistoryLine::Complete {
                decoder: "d1".into(),
                id: 4,
                complete_us: 15,
                answer: Answer::Release {
                    ok: Some(false),
                    current_epoch: 3,
                    frontier: 5,
                    terminal: true,
                },
            },
            HistoryLine::Event {
                decoder: "d1".into(),
                at_us: 13,
                event: DecoderEvent::Failpoint {
                    name: "exit-after-sample".into(),
                    gen: 7,
                    epoch: 2,
                    seq: 5,
                    token: Some(9),
                },
            },
        ];
        for l in &lines {
            let text = serde_json::to_string(l).unwrap();
            assert_eq!(&serde_json::from_str::<HistoryLine>(&text).unwrap(), l, "{text}");
        }
        let v: serde_json::Value = serde_json::to_value(&lines[0]).unwrap();
        assert_eq!(
            (v["phase"].as_str(), v["op"].as_str(), v["gen"].as_u64()),
            (Some("invoke"), Some("append"), Some(7))
        );
        // Lines written before `terminal` existed still read.
        let old = r#"{"phase":"complete","decoder":"d1","id":0,"complete_us":9,"op":"acquire","ok":true,"epoch":1,"frontier":0}"#;
        assert!(matches!(
            serde_json::from_str::<HistoryLine>(old).unwrap(),
            HistoryLine::Complete {
                answer: Answer::Acquire { terminal: false, .. },
                ..
            }
        ));
    }

    #[test]
    fn an_ownership_answer_names_the_current_epoch_frontier_and_terminal_state() {
        use tokenlog_proto::raftlog as pb;
        let granted = pb::OwnershipResponse {
            ok: true,
            generation: Some(pb::GenerationInfo {
                lease: Some(pb::Lease {
                    epoch: 3,
                    ..Default::default()
                }),
                frontier: 9,
                state: pb::GenerationState::Running as i32,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            Answer::of_ownership(&Call::Acquire { gen: 1 }, Some(&granted)),
            Answer::Acquire {
                ok: Some(true),
                epoch: 3,
                frontier: 9,
                terminal: false
            }
        );
        let pruned = pb::OwnershipResponse {
            rejection: Some(pb::Rejection {
                reason: pb::RejectReason::NotFound as i32,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(matches!(
            Answer::of_ownership(&Call::Release { gen: 1, epoch: 2 }, Some(&pruned)),
            Answer::Release {
                ok: Some(false),
                terminal: true,
                ..
            }
        ));
        assert!(matches!(
            Answer::of_ownership(
                &Call::Finish {
                    gen: 1,
                    epoch: 2,
                    reason: 3
                },
                None
            ),
            Answer::Finish { ok: None, .. }
        ));
    }
}
