//! The checkers of a run. Each answers a [`Verdict`]: what it checked and the first problems.
//!
//! - `exactly-once`: each client's received events for a request name one generation and are
//!   seqs 0, 1, ..., n with no duplicate and no gap, the last event last, and every token (and
//!   its epoch) equal to the final committed record at that seq.
//! - `durability`: every token any client saw is in the final log at its seq, with its epoch.
//! - `fencing`: one grant per epoch per generation; epochs of the final records never decrease
//!   along a generation; every final record's epoch was granted to some decoder, or can be
//!   explained by an acquire whose answer was lost (one epoch per such acquire).
//! - `linearizability`: the decoders' acquires and appends, per generation, against the
//!   ownership/frontier model ([`crate::models::Ownership`]).
//! - `status`: a status read after the last event says terminal, with the same frontier,
//!   generation and finish reason.
//! - `liveness`: every request finished (after the healing phase) or was refused at submit while
//!   every decoder was down; none failed except where
//!   its unowned deadline ended it (every decoder gone that long: `decoders-down`); and every
//!   generation ends within its deadlines (one with records when all decoders went down for
//!   longer than lease + unowned deadline ended FAILED, not later).
//! - `convergence` (judged in `finish`, with the writers stopped): chain heads are equal on every
//!   node; every node reports the same whole-state digest at the same applied index (any two
//!   seen at one index with different digests fail at once); every node's chains verify.
//! - `processes`: no process ended on its own (a crash), except decoder 1's first incarnation
//!   with the failpoint exit code when a scenario armed a failpoint there, and an incarnation a
//!   nemesis made fail (`model-error`, `corrupt`, `disk-full`, `supervised`) with the exit it
//!   expected; no decoder outlived its failed model step; the supervisor gave up on no process
//!   (a crash loop).
//! - `lease-time`: no lease is cut short: a generation is granted at a newer epoch only after
//!   every accepted append of the older epoch had its lease's worth of real time (log time may
//!   not run ahead of real time, whatever a leader's wall clock does: the `clock` nemesis).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use super::decoder_ops::DecoderOp;

use super::workload::RequestRecord;
use crate::checker::{check, CheckResult};
use crate::history::Operation;
use crate::models::ownership::{Ownership, OwnershipInput, OwnershipOp, OwnershipOutput};

#[derive(Clone, Debug, serde::Serialize)]
pub struct Verdict {
    pub ok: bool,
    pub checked: usize,
    pub problems: Vec<String>,
}

const PROBLEMS_KEPT: usize = 20;

impl Verdict {
    pub(crate) fn new() -> Self {
        Verdict {
            ok: true,
            checked: 0,
            problems: vec![],
        }
    }
    pub(crate) fn fail(&mut self, p: String) {
        self.ok = false;
        if self.problems.len() < PROBLEMS_KEPT {
            self.problems.push(p);
        }
    }
}

/// Generations read right after their request's last event, by id (shared by the clients).
pub type AtFinish = std::sync::Arc<std::sync::Mutex<HashMap<u64, FinalGen>>>;

/// A generation's final committed records: (token, epoch) per seq, and whether it is terminal.
#[derive(Clone, Debug, Default)]
pub struct FinalGen {
    pub records: Vec<(u32, u64)>,
    pub terminal: bool,
    pub state: String,
}

pub fn exactly_once(reqs: &[RequestRecord], finals: &HashMap<u64, FinalGen>) -> Verdict {
    let mut v = Verdict::new();
    for r in reqs {
        v.checked += 1;
        if r.generations.len() > 1 {
            v.fail(format!(
                "{}: its events named {} generations {:?}: one request, one generation",
                r.request_id,
                r.generations.len(),
                r.generations
            ));
        }
        let Some(f) = finals.get(&r.generation) else {
            if !r.events.is_empty() {
                v.fail(format!(
                    "{}: generation {} missing from the final log",
                    r.request_id, r.generation
                ));
            }
            continue;
        };
        for (i, &(seq, token, epoch, last)) in r.events.iter().enumerate() {
            if seq as usize != i {
                v.fail(format!(
                    "{}: event #{i} has seq {seq} ({})",
                    r.request_id,
                    if (seq as usize) < i { "duplicate" } else { "gap" }
                ));
                break;
            }
            if last {
                if seq as usize != f.records.len() {
                    v.fail(format!(
                        "{}: last event at seq {seq} but the log has {} records",
                        r.request_id,
                        f.records.len()
                    ));
                }
                if i + 1 != r.events.len() {
                    v.fail(format!("{}: events after the last one", r.request_id));
                }
                continue;
            }
            match f.records.get(seq as usize) {
                Some(&(t, e)) if t == token && e == epoch => {}
                Some(&(t, e)) => {
                    v.fail(format!(
                        "{}: seq {seq}: client saw token {token} epoch {epoch}, the log has {t} epoch {e}",
                        r.request_id
                    ));
                    break;
                }
                None => {}
            }
        }
    }
    v
}

pub fn durability(reqs: &[RequestRecord], finals: &HashMap<u64, FinalGen>) -> Verdict {
    let mut v = Verdict::new();
    for r in reqs {
        for &(seq, token, epoch, last) in &r.events {
            if last {
                continue;
            }
            v.checked += 1;
            let have = finals
                .get(&r.generation)
                .and_then(|f| f.records.get(seq as usize))
                .copied();
            if have != Some((token, epoch)) {
                v.fail(format!(
                    "{}: token {token} (epoch {epoch}) at seq {seq} was shown to a client but the final log has {have:?}",
                    r.request_id
                ));
            }
        }
    }
    v
}

/// A status read after the last event says terminal, with the stream's frontier, generation
/// and finish reason.
pub fn status(reqs: &[RequestRecord]) -> Verdict {
    let mut v = Verdict::new();
    for r in reqs.iter().filter(|r| r.finished) {
        v.checked += 1;
        let n = r.events.last().map_or(0, |e| e.0);
        match &r.status_after {
            Some(st)
                if matches!(st.state.as_str(), "finished" | "failed" | "cancelled")
                    && st.frontier == n
                    && st.generation == r.generation
                    && st.finish_reason == r.finish_reason => {}
            other => v.fail(format!(
                "{}: after the last event (seq {n}, generation {}, {:?}) status said {other:?}",
                r.request_id, r.generation, r.finish_reason
            )),
        }
    }
    v
}

pub fn processes(exits: &[super::procs::SelfExit], decoder1_failpoint: bool, nemesis: &[serde_json::Value]) -> Verdict {
    let mut v = Verdict::new();
    for n in nemesis.iter().filter(|n| n["fault"] == "model-error") {
        v.checked += 1;
        let target = n["target"].as_str().unwrap_or("");
        if target.ends_with(super::nemesis::LINGERED) {
            v.fail(format!(
                "a decoder outlived its failed model step (it holds its leases): {target}"
            ));
        }
    }
    for n in nemesis.iter().filter(|n| n["fault"] == "supervised") {
        v.checked += 1;
        let target = n["target"].as_str().unwrap_or("");
        if target.contains(super::supervisor::CRASH_LOOP) {
            v.fail(format!("a process crash-looped under the supervisor: {target}"));
        }
    }
    for e in exits {
        v.checked += 1;
        let meant = e.meant
            || (decoder1_failpoint && e.name == "decoder1" && e.incarnation == 1 && e.code == Some(FAILPOINT_EXIT));
        if !meant {
            v.fail(format!(
                "{} (incarnation {}) ended on its own: {}",
                e.name, e.incarnation, e.status
            ));
        }
    }
    v
}

/// `tokenlog_decoder::worker::HALT_EXIT_CODE`.
const FAILPOINT_EXIT: i32 = 137;

/// Slack for the unowned deadline in real time: the `Tick` that fails a generation runs every
/// 500 ms, and the news reaches a client through a gateway.
const UNOWNED_SLACK_US: u64 = 2_000_000;

/// How long after every decoder came back a gateway may still refuse a submit for want of one
/// (a registration, then the gateway's model cache of 2 s).
const REGISTERED_AGAIN_WITHIN_US: u64 = 5_000_000;

/// A submit refused, explicitly, because no decoder was registered, while every decoder was
/// down: the contract's explicit failure, not a lost request.
fn refused_while_decoders_down(r: &RequestRecord, windows: &[(u64, u64, bool)]) -> bool {
    r.events.is_empty()
        && r.error
            .as_deref()
            .is_some_and(|e| e.contains("no decoder is registered"))
        && windows
            .iter()
            .any(|&(down, up, _)| r.complete_us >= down && r.complete_us <= up + REGISTERED_AGAIN_WITHIN_US)
}

/// Every request finished, or was refused at submit while every decoder was down ("no decoder
/// is registered"). It ended "error" only where its generation's unowned deadline
/// allows it (every decoder was down at least that long before it failed); and a generation
/// that had records when every decoder went down for longer than lease + unowned deadline
/// ended explicitly failed, not later (a generation must end within its deadlines).
pub fn liveness(reqs: &[RequestRecord], nemesis: &[serde_json::Value], lease_ms: u64, unowned_ms: u64) -> Verdict {
    let mut v = Verdict::new();
    // (decoders down at, back at, long enough that generations with records must fail)
    let windows: Vec<(u64, u64, bool)> = nemesis
        .iter()
        .filter(|n| n["fault"] == "decoders-down")
        .map(|n| {
            let t = n["target"].as_str().unwrap_or("");
            (
                n["start_us"].as_u64().unwrap_or(0),
                n["end_us"].as_u64().unwrap_or(0),
                t.contains("must fail"),
            )
        })
        .collect();
    let unowned_us = unowned_ms * 1_000;
    let must_end_within_us = (lease_ms + unowned_ms) * 1_000 + UNOWNED_SLACK_US;
    for r in reqs {
        v.checked += 1;
        if !r.finished && refused_while_decoders_down(r, &windows) {
            continue;
        }
        if !r.finished {
            v.fail(format!(
                "{}: never finished ({} events, last error {:?})",
                r.request_id,
                r.events.len(),
                r.error
            ));
            continue;
        }
        let failed = r.finish_reason == "error";
        if failed {
            // The unowned deadline may end it: every decoder was gone that long before.
            let allowed = windows.iter().any(|&(down, up, _)| {
                r.complete_us + UNOWNED_SLACK_US >= down + unowned_us && r.complete_us <= up + UNOWNED_SLACK_US
            });
            if !allowed {
                v.fail(format!("{}: failed explicitly", r.request_id));
            }
            continue;
        }
        let had_records_at = |down: u64| r.first_event_us.is_some_and(|t| t + 500_000 < down);
        if let Some(&(down, up, _)) = windows.iter().find(|&&(down, _, must_fail)| {
            must_fail && had_records_at(down) && r.complete_us > down + must_end_within_us
        }) {
            v.fail(format!(
                "{}: outlived its unowned deadline: it had records when every decoder went down for {} ms, and ended {:?} {} ms after that, past lease {lease_ms} ms + deadline {unowned_ms} ms",
                r.request_id,
                (up - down) / 1_000,
                r.finish_reason,
                (r.complete_us - down) / 1_000
            ));
        }
    }
    v
}

/// Decoder history lines (`op` = acquire | append).
pub fn fencing(decoder_ops: &[DecoderOp], finals: &HashMap<u64, FinalGen>) -> Verdict {
    let mut v = Verdict::new();
    let mut grants: BTreeMap<(u64, u64), BTreeSet<String>> = BTreeMap::new();
    for op in decoder_ops
        .iter()
        .filter(|o| o.op() == "acquire" && o.ok() == Some(true))
    {
        grants
            .entry((op.gen(), op.epoch()))
            .or_default()
            .insert(op.decoder.clone());
    }
    for ((g, e), who) in &grants {
        v.checked += 1;
        if who.len() > 1 {
            v.fail(format!(
                "generation {g}: epoch {e} granted to {} decoders: {who:?}",
                who.len()
            ));
        }
    }
    // Acquires whose outcome is unknown, per generation.
    let mut in_doubt: BTreeMap<u64, usize> = BTreeMap::new();
    for op in decoder_ops.iter().filter(|o| o.op() == "acquire" && o.ok().is_none()) {
        *in_doubt.entry(op.gen()).or_default() += 1;
    }
    let mut ungranted: BTreeSet<(u64, u64)> = BTreeSet::new();
    for (g, f) in finals {
        let mut prev = 0;
        for (seq, &(_, e)) in f.records.iter().enumerate() {
            v.checked += 1;
            if e < prev {
                v.fail(format!("generation {g}: record {seq} has epoch {e} after epoch {prev}"));
                break;
            }
            prev = e;
            if !grants.contains_key(&(*g, e)) && ungranted.insert((*g, e)) {
                // An acquire whose answer was lost (the decoder killed with it in flight) may
                // have granted this epoch; each such acquire can explain one epoch, no more.
                let explained = in_doubt.get(g).copied().unwrap_or(0);
                let unexplained = ungranted.iter().filter(|(gg, _)| gg == g).count();
                if unexplained > explained {
                    v.fail(format!(
                        "generation {g}: record {seq} has epoch {e}, never granted ({explained} acquire(s) in doubt on it)"
                    ));
                    break;
                }
            }
        }
    }
    v
}

/// Real time a grant may come before a lease's end as measured from the harness: each leader
/// change may move log time ahead by `STAMP_WALL_LEAD_MS_MAX` (25 ms), plus scheduling.
pub const LEASE_TIME_SLACK_US: u64 = 250_000;

/// `lease-time`: an append accepted at epoch `e` was applied after it was sent (`invoke_us`),
/// and extended the lease to at least `lease_ms` of log time past its entry. A grant at a newer
/// epoch that completed before `invoke_us + lease_ms - slack` of real time means log time ran
/// ahead of real time: a live owner's lease was cut short.
pub fn lease_time(decoder_ops: &[DecoderOp], lease_ms: u64) -> Verdict {
    let mut v = Verdict::new();
    // Per generation: the latest accepted append's send time per epoch.
    let mut last_append: HashMap<(u64, u64), u64> = HashMap::new();
    for o in decoder_ops
        .iter()
        .filter(|o| o.op() == "append" && o.ok() == Some(true))
    {
        let t = last_append.entry((o.gen(), o.epoch())).or_insert(0);
        *t = (*t).max(o.invoke_us);
    }
    for g in decoder_ops
        .iter()
        .filter(|o| o.op() == "acquire" && o.ok() == Some(true))
    {
        let (gen, epoch) = (g.gen(), g.epoch());
        let Some(granted_us) = g.complete_us else { continue };
        if epoch < 2 {
            continue;
        }
        v.checked += 1;
        if let Some(&sent_us) = last_append.get(&(gen, epoch - 1)) {
            let lease_end_us = sent_us + lease_ms * 1_000;
            if granted_us + LEASE_TIME_SLACK_US < lease_end_us {
                v.fail(format!(
                    "generation {gen}: epoch {epoch} granted to {} {} ms before the lease of epoch {} \
                     could end (its last accepted append was sent {} ms before the grant; lease {lease_ms} ms)",
                    g.decoder,
                    (lease_end_us - granted_us) / 1_000,
                    epoch - 1,
                    granted_us.saturating_sub(sent_us) / 1_000
                ));
            }
        }
    }
    v
}

pub fn linearizability(decoder_ops: &[DecoderOp], budget: Duration) -> (Verdict, usize) {
    let mut v = Verdict::new();
    let mut clients: HashMap<String, u64> = HashMap::new();
    let mut ops = Vec::new();
    for o in decoder_ops {
        let dec = o.decoder.clone();
        let n = clients.len() as u64;
        let client = *clients.entry(dec.clone()).or_insert(n);
        let generation = o.gen();
        let call = o.invoke_us;
        let ret = o.complete_us.unwrap_or(call);
        let (op, out) = match o.op() {
            "acquire" => (
                OwnershipOp::Acquire { decoder: dec },
                match o.ok() {
                    Some(true) => Some(OwnershipOutput::Acquired { epoch: o.epoch() }),
                    Some(false) => Some(OwnershipOutput::AcquireRejected),
                    None => None,
                },
            ),
            "append" => {
                let (start_seq, n_tokens) = o.records().unwrap_or_default();
                (
                    OwnershipOp::Append {
                        epoch: o.epoch(),
                        start_seq,
                        n_tokens,
                    },
                    match o.ok() {
                        Some(true) => Some(OwnershipOutput::Appended { frontier: o.frontier() }),
                        Some(false) => Some(OwnershipOutput::AppendRejected {
                            current_epoch: o.rejection().map_or(0, |r| r.0),
                            frontier: o.frontier(),
                        }),
                        None => None,
                    },
                )
            }
            _ => continue,
        };
        let input = OwnershipInput { generation, op };
        ops.push(match out {
            Some(out) => Operation::returned(client, input, call, out, ret.max(call)),
            None => Operation::indeterminate(client, input, call),
        });
    }
    ops.sort_by_key(|o| o.call_time);
    v.checked = ops.len();
    match check(&Ownership, &ops, budget) {
        CheckResult::Linearizable => {}
        CheckResult::Unknown => v.fail(format!("unknown: the checker's budget ({budget:?}) ran out")),
        CheckResult::NotLinearizable(x) => {
            let stuck = x
                .stuck
                .as_ref()
                .map(|o| format!("{:?} -> {:?}", o.input, o.output()))
                .unwrap_or_default();
            v.fail(format!(
                "generation {} ({} ops) is not linearizable; stuck at {stuck} after {} linearized ops",
                x.partition,
                x.partition_size,
                x.linearized.len()
            ));
        }
    }
    let n = ops.len();
    (v, n)
}

#[cfg(test)]
mod tests {
    use super::super::procs::SelfExit;
    use super::super::workload::StatusSeen;
    use super::*;
    use tokenlog_decoder::history::{Answer, Call};

    fn exit(name: &str, incarnation: u32, code: Option<i32>) -> SelfExit {
        SelfExit {
            name: name.into(),
            incarnation,
            code,
            status: format!("{code:?}"),
            meant: false,
        }
    }

    fn op(decoder: &str, invoke_ms: u64, complete_ms: u64, call: Call, answer: Answer) -> DecoderOp {
        DecoderOp {
            decoder: decoder.into(),
            invoke_us: invoke_ms * 1_000,
            complete_us: Some(complete_ms * 1_000),
            kind: super::super::decoder_ops::OpKind::Call {
                call,
                answer: Some(answer),
            },
        }
    }

    /// The checker flags a grant at epoch 2 that lands before epoch 1's lease could have ended,
    /// and accepts one after it.
    #[test]
    fn lease_time_flags_a_lease_cut_short() {
        let append = |ms| {
            op(
                "d1",
                ms,
                ms + 5,
                Call::Append {
                    gen: 7,
                    epoch: 1,
                    start_seq: 0,
                    n: 1,
                    finish: false,
                },
                Answer::Append {
                    ok: Some(true),
                    frontier: 1,
                    current_epoch: 1,
                    reason: None,
                },
            )
        };
        let grant = |ms| {
            op(
                "d2",
                ms - 5,
                ms,
                Call::Acquire { gen: 7 },
                Answer::Acquire {
                    ok: Some(true),
                    epoch: 2,
                    frontier: 1,
                },
            )
        };
        let early = [append(1_000), grant(1_100)];
        let v = lease_time(&early, 800);
        assert!(!v.ok && v.problems[0].contains("before the lease of epoch 1"), "{v:?}");
        assert!(lease_time(&[append(1_000), grant(1_800)], 800).ok, "within the slack");
        assert!(lease_time(&[append(1_000), grant(2_000)], 800).ok);
    }

    #[test]
    fn only_the_armed_failpoint_exit_is_not_a_crash() {
        assert!(processes(&[], false, &[]).ok);
        let failpoint = [exit("decoder1", 1, Some(FAILPOINT_EXIT))];
        assert!(processes(&failpoint, true, &[]).ok);
        assert!(!processes(&failpoint, false, &[]).ok, "no failpoint armed: a crash");
        assert!(!processes(&[exit("decoder1", 2, Some(FAILPOINT_EXIT))], true, &[]).ok);
        assert!(!processes(&[exit("node2", 1, Some(101))], true, &[]).ok, "a panic");
        assert!(
            !processes(&[exit("decoder1", 1, None)], true, &[]).ok,
            "killed by a signal"
        );
    }

    fn req(id: &str, first_event_s: Option<u64>, complete_s: u64, reason: &str) -> RequestRecord {
        RequestRecord {
            client: 0,
            request_id: id.into(),
            invoke_us: 0,
            complete_us: complete_s * 1_000_000,
            generation: 1,
            first_event_us: first_event_s.map(|s| s * 1_000_000),
            events: vec![],
            connections: 1,
            finished: true,
            finish_reason: reason.into(),
            error: None,
            status_after: None,
            generations: vec![1],
        }
    }

    /// Every decoder down from 10 s to 20 s (long), with lease 1 s and unowned deadline 3 s:
    /// a generation with records must have failed by 10 + 1 + 3 (+ slack) s.
    #[test]
    fn liveness_holds_generations_to_their_unowned_deadline() {
        let down = [
            serde_json::json!({"fault": "decoders-down", "start_us": 10_000_000u64, "end_us": 20_000_000u64,
            "target": "all decoders down for 10000 ms (past lease + unowned deadline: generations with records must fail)"}),
        ];
        let check = |r: RequestRecord| liveness(&[r], &down, 1_000, 3_000);
        // Failed within its deadline: fine; ended normally before the decoders went: fine.
        assert!(check(req("failed-in-time", Some(5), 14, "error")).ok);
        assert!(check(req("done-before", Some(5), 9, "length")).ok);
        // Submitted with no records yet when the decoders went: it may wait (frontier 0).
        assert!(check(req("no-records", None, 22, "length")).ok);
        // Had records, waited, and went on when the decoders came back: past its deadline.
        let v = check(req("outlived", Some(5), 22, "length"));
        assert!(
            !v.ok && v.problems[0].contains("outlived its unowned deadline"),
            "{v:?}"
        );
        // Failed although its decoders were gone for less than the deadline.
        let v = check(req("failed-early", Some(5), 10, "error"));
        assert!(!v.ok && v.problems[0].contains("failed explicitly"), "{v:?}");
        // Refused at submit while every decoder was down: explicit, not lost.
        let mut refused = req("refused", None, 12, "");
        refused.finished = false;
        refused.error = Some("no decoder is registered with the log: start one".into());
        assert!(check(refused.clone()).ok);
        refused.complete_us = 40_000_000;
        assert!(!check(refused).ok, "long after the decoders came back");
        // A failure with no decoders-down at all.
        let v = liveness(&[req("failed", Some(5), 14, "error")], &[], 1_000, 3_000);
        assert!(!v.ok, "{v:?}");
    }
    #[test]
    fn processes_flags_a_crash_loop_under_the_supervisor() {
        let rec = |t: &str| serde_json::json!({"fault": "supervised", "target": t});
        let fine = [rec(
            "decoder1 killed (SIGKILL); supervisor: decoder1 restarted after 100 ms",
        )];
        assert!(processes(&[], false, &fine).ok);
        let looped = [rec(&format!(
            "node2 killed (SIGKILL); supervisor: {} node2: gave up after 3 exits within 1000 ms of their start: boom",
            crate::harness::supervisor::CRASH_LOOP
        ))];
        let v = processes(&[], false, &looped);
        assert!(!v.ok && v.problems[0].contains("crash-looped"), "{v:?}");
    }
    #[test]
    fn one_request_sees_one_generation_and_its_status_agrees() {
        let mut r = req("r", Some(1), 2, "length");
        r.events = vec![(0, 5, 1, false), (1, 0, 1, true)];
        let finals: HashMap<u64, FinalGen> = [(
            1,
            FinalGen {
                records: vec![(5, 1)],
                terminal: true,
                state: "Finished".into(),
            },
        )]
        .into();
        assert!(exactly_once(std::slice::from_ref(&r), &finals).ok);
        let mut two = r.clone();
        two.generations = vec![1, 2];
        let v = exactly_once(&[two], &finals);
        assert!(!v.ok && v.problems[0].contains("one request, one generation"), "{v:?}");

        let seen = StatusSeen {
            state: "finished".into(),
            frontier: 1,
            generation: 1,
            finish_reason: "length".into(),
        };
        r.status_after = Some(seen.clone());
        assert!(status(std::slice::from_ref(&r)).ok);
        for bad in [
            StatusSeen {
                generation: 2,
                ..seen.clone()
            },
            StatusSeen {
                finish_reason: "error".into(),
                ..seen.clone()
            },
            StatusSeen {
                state: "running".into(),
                ..seen.clone()
            },
            StatusSeen {
                frontier: 0,
                ..seen.clone()
            },
        ] {
            r.status_after = Some(bad.clone());
            assert!(!status(std::slice::from_ref(&r)).ok, "{bad:?}");
        }
    }
    /// A record at an epoch no decoder was granted is flagged, below the highest grant too, and
    /// with no decoder history at all; an acquire whose answer was lost explains one epoch.
    #[test]
    fn fencing_flags_a_record_at_any_ungranted_epoch() {
        let grant = |d: &str, epoch: u64| {
            op(
                d,
                10,
                20,
                Call::Acquire { gen: 7 },
                Answer::Acquire {
                    ok: Some(true),
                    epoch,
                    frontier: 0,
                },
            )
        };
        let in_doubt = DecoderOp {
            decoder: "d3".into(),
            invoke_us: 30_000,
            complete_us: None,
            kind: super::super::decoder_ops::OpKind::Call {
                call: Call::Acquire { gen: 7 },
                answer: None,
            },
        };
        let finals = |epochs: &[u64]| -> HashMap<u64, FinalGen> {
            [(
                7,
                FinalGen {
                    records: epochs.iter().map(|&e| (1, e)).collect(),
                    terminal: true,
                    state: "Finished".into(),
                },
            )]
            .into()
        };
        let granted = [grant("d1", 1), grant("d2", 3)];
        assert!(fencing(&granted, &finals(&[1, 1, 3])).ok);
        // Epoch 2 was never granted, though it lies below the highest grant.
        let v = fencing(&granted, &finals(&[1, 2, 3]));
        assert!(!v.ok && v.problems[0].contains("epoch 2, never granted"), "{v:?}");
        // No decoder history at all: nothing was granted.
        assert!(!fencing(&[], &finals(&[1])).ok);
        // An acquire in doubt may have granted epoch 2; it cannot explain a second epoch.
        let with_doubt = [grant("d1", 1), grant("d2", 3), in_doubt];
        assert!(fencing(&with_doubt, &finals(&[1, 2, 3])).ok);
        assert!(!fencing(&with_doubt, &finals(&[1, 2, 3, 4])).ok);
    }

    #[test]
    fn durability_compares_the_epoch_too() {
        let mut r = req("r", Some(1), 2, "length");
        r.events = vec![(0, 5, 1, false), (1, 0, 1, true)];
        let at = |epoch: u64| -> HashMap<u64, FinalGen> {
            [(
                1,
                FinalGen {
                    records: vec![(5, epoch)],
                    terminal: true,
                    state: "Finished".into(),
                },
            )]
            .into()
        };
        assert!(durability(std::slice::from_ref(&r), &at(1)).ok);
        assert!(!durability(std::slice::from_ref(&r), &at(2)).ok);
    }
}
