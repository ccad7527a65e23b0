//! The decoders' side of a run: each decoder's history file (typed `HistoryLine`s, written by
//! `tokenlog_decoder::history`) joined into one [`DecoderOp`] per call (invoke + complete, or
//! invoke alone when the decoder died with the call in flight) or per event.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;
use tokenlog_decoder::history::{Answer, Call, DecoderEvent, HistoryLine};

/// One operation or event of one decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderOp {
    pub decoder: String,
    /// When the call was sent, or when the event happened.
    pub invoke_us: u64,
    /// When the answer arrived; `None` for events and for calls whose answer was never recorded.
    pub complete_us: Option<u64>,
    pub kind: OpKind,
}

#[derive(Clone, Debug, PartialEq)]
pub enum OpKind {
    Call { call: Call, answer: Option<Answer> },
    Event(DecoderEvent),
}

impl DecoderOp {
    /// `acquire`, `append`, `release`, `finish`, `commit` (a planned handoff's ownership
    /// commit, by its destination), `resumed`, `failpoint`, `session`, `handoff-out` or
    /// `handoff-received`.
    pub fn op(&self) -> &'static str {
        match &self.kind {
            OpKind::Call {
                call: Call::Acquire { .. },
                ..
            } => "acquire",
            OpKind::Call {
                call: Call::Append { .. },
                ..
            } => "append",
            OpKind::Call {
                call: Call::Release { .. },
                ..
            } => "release",
            OpKind::Call {
                call: Call::Finish { .. },
                ..
            } => "finish",
            OpKind::Call {
                call: Call::HandoffCommit { .. },
                ..
            } => "commit",
            OpKind::Event(DecoderEvent::Resumed { .. }) => "resumed",
            OpKind::Event(DecoderEvent::Failpoint { .. }) => "failpoint",
            OpKind::Event(DecoderEvent::SessionOpened { .. }) => "session",
            OpKind::Event(DecoderEvent::HandoffOut { .. }) => "handoff-out",
            OpKind::Event(DecoderEvent::HandoffReceived { .. }) => "handoff-received",
            OpKind::Event(DecoderEvent::HandoffKept { .. }) => "handoff-kept",
        }
    }

    pub fn gen(&self) -> u64 {
        match &self.kind {
            OpKind::Call {
                call: Call::Acquire { gen },
                ..
            }
            | OpKind::Call {
                call:
                    Call::Append { gen, .. }
                    | Call::Release { gen, .. }
                    | Call::Finish { gen, .. }
                    | Call::HandoffCommit { gen, .. },
                ..
            } => *gen,
            OpKind::Event(
                DecoderEvent::Resumed { gen, .. }
                | DecoderEvent::Failpoint { gen, .. }
                | DecoderEvent::HandoffOut { gen, .. }
                | DecoderEvent::HandoffReceived { gen, .. }
                | DecoderEvent::HandoffKept { gen, .. },
            ) => *gen,
            // About no generation.
            OpKind::Event(DecoderEvent::SessionOpened { .. }) => 0,
        }
    }

    /// The call's answer: `Some(true)` accepted, `Some(false)` rejected, `None` unknown (or an
    /// event).
    pub fn ok(&self) -> Option<bool> {
        match &self.kind {
            OpKind::Call {
                answer:
                    Some(
                        Answer::Acquire { ok, .. }
                        | Answer::Append { ok, .. }
                        | Answer::Release { ok, .. }
                        | Answer::Finish { ok, .. }
                        | Answer::HandoffCommit { ok, .. },
                    ),
                ..
            } => *ok,
            _ => None,
        }
    }

    /// The epoch the operation is about: granted (acquire), written at (append), handed over
    /// (commit: the handoff epoch, whatever the answer), or the event's.
    pub fn epoch(&self) -> u64 {
        match &self.kind {
            OpKind::Call {
                call: Call::Acquire { .. },
                answer,
            } => match answer {
                Some(Answer::Acquire { epoch, .. }) => *epoch,
                _ => 0,
            },
            OpKind::Call {
                call: Call::Append { epoch, .. } | Call::Release { epoch, .. } | Call::Finish { epoch, .. },
                ..
            } => *epoch,
            OpKind::Call {
                call: Call::HandoffCommit { handoff_epoch, .. },
                ..
            } => *handoff_epoch,
            OpKind::Event(
                DecoderEvent::Resumed { epoch, .. }
                | DecoderEvent::Failpoint { epoch, .. }
                | DecoderEvent::HandoffOut { epoch, .. }
                | DecoderEvent::HandoffReceived { epoch, .. }
                | DecoderEvent::HandoffKept { epoch, .. },
            ) => *epoch,
            OpKind::Event(DecoderEvent::SessionOpened { .. }) => 0,
        }
    }

    /// The frontier the answer named (0 without one).
    pub fn frontier(&self) -> u64 {
        match &self.kind {
            OpKind::Call {
                answer:
                    Some(
                        Answer::Acquire { frontier, .. }
                        | Answer::Append { frontier, .. }
                        | Answer::Release { frontier, .. }
                        | Answer::Finish { frontier, .. }
                        | Answer::HandoffCommit { frontier, .. },
                    ),
                ..
            } => u64::from(*frontier),
            _ => 0,
        }
    }

    /// Whether the answer saw the generation terminal.
    pub fn terminal(&self) -> bool {
        matches!(
            &self.kind,
            OpKind::Call {
                answer: Some(
                    Answer::Acquire { terminal: true, .. }
                        | Answer::Append { terminal: true, .. }
                        | Answer::Release { terminal: true, .. }
                        | Answer::Finish { terminal: true, .. }
                        | Answer::HandoffCommit { terminal: true, .. }
                ),
                ..
            }
        )
    }

    /// The epoch in force an answer named: a rejection's current one, or the grant's.
    pub fn current_epoch(&self) -> u64 {
        match &self.kind {
            OpKind::Call {
                answer:
                    Some(
                        Answer::Append { current_epoch, .. }
                        | Answer::Release { current_epoch, .. }
                        | Answer::Finish { current_epoch, .. },
                    ),
                ..
            } => *current_epoch,
            OpKind::Call {
                answer: Some(Answer::Acquire { epoch, .. } | Answer::HandoffCommit { epoch, .. }),
                ..
            } => *epoch,
            _ => 0,
        }
    }

    /// Whether an append carried its generation's finish.
    pub fn finishes(&self) -> bool {
        matches!(
            &self.kind,
            OpKind::Call {
                call: Call::Append { finish: true, .. },
                ..
            }
        )
    }

    /// An append's `(start_seq, n)`.
    pub fn records(&self) -> Option<(u64, u64)> {
        match &self.kind {
            OpKind::Call {
                call: Call::Append { start_seq, n, .. },
                ..
            } => Some((u64::from(*start_seq), u64::from(*n))),
            _ => None,
        }
    }

    /// A commit's `(attempt, source_epoch)`.
    pub fn handed_over(&self) -> Option<(u64, u64)> {
        match &self.kind {
            OpKind::Call {
                call: Call::HandoffCommit {
                    attempt, source_epoch, ..
                },
                ..
            } => Some((*attempt, *source_epoch)),
            _ => None,
        }
    }

    /// A rejected append's current epoch and reason (`raftlog.v1.RejectReason`).
    pub fn rejection(&self) -> Option<(u64, Option<i32>)> {
        match &self.kind {
            OpKind::Call {
                answer:
                    Some(Answer::Append {
                        ok: Some(false),
                        current_epoch,
                        reason,
                        ..
                    }),
                ..
            } => Some((*current_epoch, *reason)),
            _ => None,
        }
    }

    /// One flat JSON object (the call's, the answer's and the times' fields), as the run's
    /// `history.jsonl` and timeline show it.
    pub fn to_json(&self) -> Value {
        let mut v = match &self.kind {
            OpKind::Call { call, answer } => {
                let mut v = serde_json::to_value(call).unwrap_or_default();
                match answer.as_ref().map(serde_json::to_value) {
                    Some(Ok(Value::Object(a))) => {
                        if let Some(o) = v.as_object_mut() {
                            o.extend(a);
                        }
                    }
                    _ => v["ok"] = Value::Null,
                }
                v
            }
            OpKind::Event(e) => serde_json::to_value(e).unwrap_or_default(),
        };
        v["decoder"] = self.decoder.clone().into();
        v["invoke_us"] = self.invoke_us.into();
        if let Some(c) = self.complete_us {
            v["complete_us"] = c.into();
        }
        v
    }
}

/// Reads `decoder1.jsonl` .. `decoder{n}.jsonl` in `dir` and joins each decoder's invoke and
/// complete lines; sorted by invocation time. Also returns what could not be read: a missing
/// file, a line that does not parse, an answer with no call before it. Each line is one `write`
/// (`tokenlog_decoder::history`), so a kill leaves whole lines, and a line that does not parse
/// is a writer and reader that disagree: skipped in silence, it took that decoder's operations
/// out of every check, which then passed on less than the run did.
pub fn read(dir: &Path, n: usize) -> (Vec<DecoderOp>, Vec<String>) {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for i in 0..n {
        let name = format!("decoder{}.jsonl", i + 1);
        let text = match std::fs::read_to_string(dir.join(&name)) {
            Ok(t) => t,
            Err(e) => {
                problems.push(format!("decoder history {name} could not be read: {e}"));
                continue;
            }
        };
        let mut lines = Vec::new();
        for (no, l) in text.lines().enumerate() {
            match serde_json::from_str::<HistoryLine>(l) {
                Ok(h) => lines.push(h),
                Err(e) => problems.push(format!("decoder history {name} line {}: {e}: {l:.200}", no + 1)),
            }
        }
        let (ops, orphans) = join_counted(lines);
        if orphans > 0 {
            problems.push(format!(
                "decoder history {name}: {orphans} answer(s) of calls with no invoke line"
            ));
        }
        out.extend(ops);
    }
    out.sort_by_key(|o| o.invoke_us);
    (out, problems)
}

/// Joins history lines into operations.
pub fn join(lines: impl IntoIterator<Item = HistoryLine>) -> Vec<DecoderOp> {
    join_counted(lines).0
}

/// [`join`], and how many answers had no invoke line to join.
fn join_counted(lines: impl IntoIterator<Item = HistoryLine>) -> (Vec<DecoderOp>, usize) {
    let mut orphans = 0;
    let mut ops: Vec<DecoderOp> = Vec::new();
    let mut index: HashMap<(String, u64), usize> = HashMap::new();
    for line in lines {
        match line {
            HistoryLine::Event { decoder, at_us, event } => ops.push(DecoderOp {
                decoder,
                invoke_us: at_us,
                complete_us: None,
                kind: OpKind::Event(event),
            }),
            HistoryLine::Invoke {
                decoder,
                id,
                invoke_us,
                call,
            } => {
                index.insert((decoder.clone(), id), ops.len());
                ops.push(DecoderOp {
                    decoder,
                    invoke_us,
                    complete_us: None,
                    kind: OpKind::Call { call, answer: None },
                });
            }
            HistoryLine::Complete {
                decoder,
                id,
                complete_us,
                answer: a,
            } => {
                let Some(&k) = index.get(&(decoder, id)) else {
                    orphans += 1;
                    continue;
                };
                let op = &mut ops[k];
                if let OpKind::Call { answer, .. } = &mut op.kind {
                    *answer = Some(a);
                    op.complete_us = Some(complete_us);
                }
            }
        }
    }
    (ops, orphans)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invoke_and_complete_join_and_a_lost_answer_stays_open() {
        let lines = vec![
            HistoryLine::Invoke {
                decoder: "d1".into(),
                id: 0,
                invoke_us: 5,
                call: Call::Acquire { gen: 1 },
            },
            HistoryLine::Invoke {
                decoder: "d1".into(),
                id: 1,
                invoke_us: 6,
                call: Call::Append {
                    gen: 1,
                    epoch: 1,
                    start_seq: 0,
                    n: 2,
                    finish: false,
                },
            },
            HistoryLine::Complete {
                decoder: "d1".into(),
                id: 0,
                complete_us: 9,
                answer: Answer::Acquire {
                    ok: Some(true),
                    epoch: 1,
                    frontier: 0,
                    terminal: false,
                },
            },
        ];
        let ops = join(lines);
        assert_eq!(ops.len(), 2);
        assert_eq!(
            (ops[0].op(), ops[0].ok(), ops[0].epoch(), ops[0].complete_us),
            ("acquire", Some(true), 1, Some(9))
        );
        assert_eq!(
            (ops[1].op(), ops[1].ok(), ops[1].records()),
            ("append", None, Some((0, 2)))
        );
        assert_eq!(ops[1].to_json()["ok"], Value::Null);
        assert_eq!(ops[0].to_json()["frontier"], 0);
    }

    /// A history line the reader cannot parse (a field the writer renamed), an answer whose
    /// call is missing and a decoder's missing file are each reported. They were skipped in
    /// silence: the checkers then judged the run without those operations.
    #[test]
    fn what_a_history_does_not_say_whole_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let invoke = serde_json::to_string(&HistoryLine::Invoke {
            decoder: "d1".into(),
            id: 0,
            invoke_us: 5,
            call: Call::Acquire { gen: 1 },
        })
        .unwrap();
        let orphan = serde_json::to_string(&HistoryLine::Complete {
            decoder: "d1".into(),
            id: 7,
            complete_us: 9,
            answer: Answer::Acquire {
                ok: Some(true),
                epoch: 1,
                frontier: 0,
                terminal: false,
            },
        })
        .unwrap();
        let renamed = invoke.replace("\"gen\"", "\"generation\"");
        std::fs::write(
            dir.path().join("decoder1.jsonl"),
            format!("{invoke}\n{renamed}\n{orphan}\n"),
        )
        .unwrap();
        let (ops, problems) = read(dir.path(), 2);
        assert_eq!(ops.len(), 1, "{ops:?}");
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems[0].contains("decoder1.jsonl line 2"), "{problems:?}");
        assert!(
            problems[1].contains("1 answer(s) of calls with no invoke line"),
            "{problems:?}"
        );
        assert!(problems[2].contains("decoder2.jsonl could not be read"), "{problems:?}");
        // A whole history reads without a word.
        std::fs::write(dir.path().join("decoder2.jsonl"), format!("{invoke}\n")).unwrap();
        std::fs::write(dir.path().join("decoder1.jsonl"), format!("{invoke}\n")).unwrap();
        let (ops, problems) = read(dir.path(), 2);
        assert_eq!((ops.len(), problems.len()), (2, 0), "{problems:?}");
    }
}
