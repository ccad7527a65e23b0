//! The checkers of a run. Each answers a [`Verdict`]: what it checked and the first problems.
//!
//! - `exactly-once`: every generation of the final log is the one of its request; each
//!   client's received events for a request name one generation and are
//!   seqs 0, 1, ..., n with no duplicate and no gap, the last event last, and every token (and
//!   its epoch) equal to the final committed record at that seq.
//! - `durability`: every token any client saw is in the final log at its seq, with its epoch;
//!   every append a decoder saw acknowledged is within the final frontier, its records at its
//!   epoch unless they were there before it.
//! - `fencing`: one grant per epoch per generation (by an acquire, or by a planned handoff's
//!   ownership commit); epochs of the final records never decrease along a generation; every
//!   final record's epoch was granted to some decoder, or can be explained by an acquire or a
//!   commit whose answer was lost (one epoch per such call); and no decoder sent an append at
//!   an epoch before it was granted that epoch (a standby writing at its owner's epoch, a
//!   handoff's destination writing before the log committed its ownership), whatever the log
//!   answered.
//! - `linearizability`: the decoders' acquires, appends, releases, finishes and handoff commits, per generation,
//!   against the ownership/frontier model ([`crate::models::Ownership`]), each generation's
//!   history ended by a read of its final state (epoch, frontier, terminal).
//! - `status`: a status read after the last event says terminal, with the same frontier,
//!   generation and finish reason.
//! - `completion`: a finished request ended "length" with exactly `max_tokens` tokens, at EOS
//!   only where EOS was not ignored, "cancelled" only after its client cancelled; its text deltas
//!   equal its final tokens detokenized (fake model).
//! - `liveness`: every request finished (after the healing phase) or was refused at submit while
//!   every decoder was down; none failed except where
//!   its unowned deadline ended it (every decoder gone that long: `decoders-down`); and every
//!   generation ends within its deadlines (one with records when all decoders went down for
//!   longer than lease + unowned deadline ended FAILED, not later).
//! - `convergence` (judged in `finish`, with the writers stopped): chain heads are equal on every
//!   node; every node reports the same whole-state digest at the same applied index (any two
//!   seen at one index with different digests fail at once); every node's chains verify.
//! - `processes`: after healing every process serves (each node answers and names a leader,
//!   each decoder is registered, each gateway answers `Status`); no process logged a panic; no
//!   process ended on its own (a crash), except decoder 1's first incarnation
//!   with the failpoint exit code when a scenario armed a failpoint there, and an incarnation a
//!   nemesis made fail (`model-error`, `corrupt`, `disk-full`, `supervised`) with the exit it
//!   expected; no decoder outlived its failed model step; a drained decoder exited (`drain`,
//!   `handoff`); the supervisor gave up on no process
//!   (a crash loop).
//! - `lease-time`: no lease is cut short: a generation is granted at a newer epoch only after
//!   every accepted append of the older epoch had its lease's worth of real time (log time may
//!   not run ahead of real time, whatever a leader's wall clock does: the `clock` nemesis).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use super::decoder_ops::DecoderOp;
use super::FAILPOINT_EXIT;

use super::workload::RequestRecord;
use crate::checker::{check, CheckResult};
use crate::history::Operation;
use crate::model::Model;
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
    /// The epoch in force (the latest grant; 0: never granted).
    pub epoch: u64,
    /// When the read of the generation's state was sent and answered (us): linearizability
    /// ends each generation's history with it.
    pub read_us: (u64, u64),
}

/// See the module doc; `log_gens` is every generation the final log holds, with its request
/// id: each must be the one generation its request's events named (or its request saw none).
pub fn exactly_once(reqs: &[RequestRecord], finals: &HashMap<u64, FinalGen>, log_gens: &[(u64, String)]) -> Verdict {
    let mut v = Verdict::new();
    let mut by_id: HashMap<&str, Vec<u64>> = HashMap::new();
    for r in reqs {
        by_id.entry(r.request_id.as_str()).or_default().push(r.generation);
    }
    // One generation per request id in the log, whatever its client saw (a request that saw
    // no event names generation 0, which matches any one of them).
    let mut in_log: HashMap<&str, Vec<u64>> = HashMap::new();
    for (g, rid) in log_gens {
        in_log.entry(rid.as_str()).or_default().push(*g);
    }
    let mut several: Vec<_> = in_log.iter().filter(|(_, gens)| gens.len() > 1).collect();
    several.sort();
    for (rid, gens) in several {
        v.fail(format!(
            "{rid}: the log holds generations {gens:?} for it (one request, one generation)"
        ));
    }
    for (g, rid) in log_gens {
        v.checked += 1;
        match by_id.get(rid.as_str()) {
            Some(seen) if seen.iter().any(|s| s == g || *s == 0) => {}
            Some(seen) => v.fail(format!(
                "{rid}: the log holds generation {g} for it besides {seen:?} (one request, one generation)"
            )),
            None => v.fail(format!(
                "generation {g} belongs to request {rid:?}, which no client made"
            )),
        }
    }
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

/// Every token a client saw is in the final log at its seq with its epoch; every append a
/// decoder saw acknowledged is too: its frontier within the final log, and its records at its
/// epoch, unless they were there before it (an older epoch's, or a newer owner's that the
/// acknowledged append, a re-send, was sent after: [`acknowledged_appends`]).
pub fn durability(reqs: &[RequestRecord], decoder_ops: &[DecoderOp], finals: &HashMap<u64, FinalGen>) -> Verdict {
    let mut v = acknowledged_appends(decoder_ops, finals);
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

/// The part of [`durability`] about the decoders' acknowledged appends.
fn acknowledged_appends(decoder_ops: &[DecoderOp], finals: &HashMap<u64, FinalGen>) -> Verdict {
    let mut v = Verdict::new();
    let appends = || decoder_ops.iter().filter(|o| o.op() == "append");
    // The appends of each (generation, epoch), to find who wrote a record.
    let mut by_epoch: HashMap<(u64, u64), Vec<&DecoderOp>> = HashMap::new();
    for o in appends() {
        by_epoch.entry((o.gen(), o.epoch())).or_default().push(o);
    }
    for o in appends().filter(|o| o.ok() == Some(true)) {
        let (g, epoch) = (o.gen(), o.epoch());
        let Some(f) = finals.get(&g) else { continue };
        v.checked += 1;
        let have = f.records.len() as u64;
        if o.frontier() > have {
            v.fail(format!(
                "generation {g}: {} saw an append at epoch {epoch} acknowledged with frontier {}, the final log has {have} records",
                o.decoder,
                o.frontier()
            ));
            continue;
        }
        let (start, n) = o.records().unwrap_or_default();
        let acked_us = o.complete_us.unwrap_or(u64::MAX);
        for seq in start..(start + n).min(have) {
            let e = f.records[seq as usize].1;
            if e <= epoch {
                // Its own, or an older owner's written before this epoch was granted.
                continue;
            }
            // A newer owner's: only if they were there before this re-send, i.e. an append of
            // that epoch covering the seq was sent before this one was acknowledged.
            let there_before = by_epoch.get(&(g, e)).is_some_and(|ws| {
                ws.iter().any(|w| {
                    let (s, n) = w.records().unwrap_or_default();
                    (s..s + n).contains(&seq) && w.invoke_us <= acked_us
                })
            });
            if !there_before {
                v.fail(format!(
                    "generation {g}: {} saw records {start}..{} acknowledged at epoch {epoch}; the final log has seq {seq} at epoch {e}, written after the acknowledgement",
                    o.decoder,
                    start + n
                ));
                break;
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

/// `completion`: every finished request ended as it asked. "length" with exactly `max_tokens`
/// tokens; "stop" (EOS) only where EOS was not ignored, before `max_tokens`... or at it;
/// "cancelled" only after its client sent a cancel; "error" is liveness's to judge. And, given
/// the tokenizer of the model (the fake one's; the harness has no other), its text deltas,
/// concatenated as received, equal its final tokens detokenized.
pub fn completion(
    reqs: &[RequestRecord],
    finals: &HashMap<u64, FinalGen>,
    tokenizer: Option<&tokenlog_decoder::Tokenizer>,
) -> Verdict {
    let mut v = Verdict::new();
    for r in reqs.iter().filter(|r| r.finished) {
        v.checked += 1;
        let n = r.events.last().map_or(0, |e| e.0);
        let id = &r.request_id;
        match r.finish_reason.as_str() {
            "length" if n != r.max_tokens => v.fail(format!(
                "{id}: ended \"length\" after {n} tokens; it asked for {}",
                r.max_tokens
            )),
            "stop" if r.ignore_eos => v.fail(format!(
                "{id}: ended at EOS after {n} tokens, but it asked to ignore EOS"
            )),
            "stop" if n > r.max_tokens => v.fail(format!("{id}: {n} tokens, past max_tokens {}", r.max_tokens)),
            "cancelled" if r.cancel_sent_us.is_none() => {
                v.fail(format!("{id}: ended \"cancelled\", but its client never cancelled it"))
            }
            "length" | "stop" | "cancelled" | "error" => {}
            other => v.fail(format!("{id}: unknown finish reason {other:?}")),
        }
        let (Some(tok), Some(f)) = (tokenizer, finals.get(&r.generation)) else {
            continue;
        };
        let mut detok = tok.detokenizer(true);
        let mut want: String = f.records.iter().map(|&(t, _)| detok.push(t)).collect();
        want.push_str(&detok.finish());
        if r.text != want {
            let at = r.text.chars().zip(want.chars()).take_while(|(a, b)| a == b).count();
            v.fail(format!(
                "{id}: its text deltas differ from its final tokens detokenized at char {at}: got {:?}, want {:?}",
                r.text.chars().skip(at).take(20).collect::<String>(),
                want.chars().skip(at).take(20).collect::<String>()
            ));
        }
    }
    v
}

/// What probing the processes after healing found (see `finish::probe`), and every panic any
/// process logged.
#[derive(Clone, Debug, Default)]
pub struct Probe {
    pub checked: usize,
    pub problems: Vec<String>,
}

pub fn processes(
    exits: &[super::procs::SelfExit],
    decoder1_failpoint: bool,
    nemesis: &[serde_json::Value],
    probe: &Probe,
) -> Verdict {
    let mut v = Verdict::new();
    v.checked += probe.checked;
    for p in &probe.problems {
        v.fail(p.clone());
    }
    for n in nemesis.iter().filter(|n| n["fault"] == "model-error") {
        v.checked += 1;
        let target = n["target"].as_str().unwrap_or("");
        if target.ends_with(super::nemesis::LINGERED) {
            v.fail(format!(
                "a decoder outlived its failed model step (it holds its leases): {target}"
            ));
        }
    }
    for n in nemesis
        .iter()
        .filter(|n| n["fault"] == "drain" || n["fault"] == "handoff")
    {
        v.checked += 1;
        let target = n["target"].as_str().unwrap_or("");
        if target.contains(super::nemesis::DRAIN_HUNG) {
            v.fail(format!("a drained decoder did not exit: {target}"));
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
                "{} (incarnation {}) ended on its own: {}; its last error lines: {:?}",
                e.name, e.incarnation, e.status, e.last_words
            ));
        }
    }
    v
}

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
    // An epoch is granted by an acquire or by a planned handoff's ownership commit.
    let grant = |o: &DecoderOp| matches!(o.op(), "acquire" | "commit");
    for op in decoder_ops.iter().filter(|o| grant(o) && o.ok() == Some(true)) {
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
    // Acquires and commits whose outcome is unknown, per generation.
    let mut in_doubt: BTreeMap<u64, usize> = BTreeMap::new();
    for op in decoder_ops.iter().filter(|o| grant(o) && o.ok().is_none()) {
        *in_doubt.entry(op.gen()).or_default() += 1;
    }
    for p in appends_before_their_grant(decoder_ops) {
        v.fail(p);
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

/// Appends a decoder sent at an epoch of a generation before it knew it held that epoch: from an
/// acquire's answer, a handoff commit's answer, or (the commit's answer lost) the log's word,
/// which the `handoff_received` event records.
fn appends_before_their_grant(decoder_ops: &[DecoderOp]) -> Vec<String> {
    let me = |o: &DecoderOp| {
        o.decoder
            .strip_suffix(DUPLICATE_SUFFIX)
            .unwrap_or(&o.decoder)
            .to_string()
    };
    let mut known: HashMap<(String, u64, u64), u64> = HashMap::new();
    for o in decoder_ops {
        let at = match o.op() {
            "acquire" | "commit" if o.ok() == Some(true) => o.complete_us,
            "handoff-received" => Some(o.invoke_us),
            _ => None,
        };
        if let Some(t) = at {
            let e = known.entry((me(o), o.gen(), o.epoch())).or_insert(t);
            *e = (*e).min(t);
        }
    }
    decoder_ops
        .iter()
        .filter(|o| o.op() == "append")
        .filter(|o| known.get(&(me(o), o.gen(), o.epoch())).is_none_or(|&t| t > o.invoke_us))
        .map(|o| {
            format!(
                "generation {}: {} appended at epoch {} (records {:?}, answered {:?}) before it was granted that epoch",
                o.gen(),
                o.decoder,
                o.epoch(),
                o.records(),
                o.ok()
            )
        })
        .collect()
}

/// Real time a grant may come before a lease's end as measured from the harness: each leader
/// change may move log time ahead by `STAMP_WALL_LEAD_MS_MAX` (25 ms), plus scheduling.
pub const LEASE_TIME_SLACK_US: u64 = 250_000;

/// `lease-time`: an append accepted at epoch `e` was applied after it was sent (`invoke_us`),
/// and extended the lease to at least `lease_ms` of log time past its entry (unless its owner
/// released the generation: a release ends the lease at once). A grant at a newer
/// epoch that completed before `invoke_us + lease_ms - slack` of real time means log time ran
/// ahead of real time: a live owner's lease was cut short.
///
/// A dead owner's lease may end early: a decoder holds a session with the leader, and when its
/// process dies the leader ends its leases at once (`Command::SessionLost`). So a grant is not
/// judged when the previous epoch's owner had opened a session (a `session` event) and recorded
/// nothing from the grant on (that incarnation was gone). A live owner whose lease was cut
/// short goes on recording (its appends, refused), and is judged. A planned handoff's commit is
/// not judged (its source handed the generation over: it paused, every record acknowledged,
/// before it prepared); the epoch it granted is judged like an acquired one when it is taken
/// over in its turn.
pub fn lease_time(decoder_ops: &[DecoderOp], lease_ms: u64) -> Verdict {
    lease_time_with_sessions_lost(decoder_ops, lease_ms, &[])
}

/// [`lease_time`], knowing when the log ended a decoder's session (`(decoder, µs)`: when its
/// `SessionLost` applied). A live decoder whose connection broke loses its leases then, by
/// design (CONTRACT: a broken connection of a live process only costs a takeover; fencing keeps
/// it safe), so a grant after such a loss of the previous owner's session is not judged. The
/// simulation, which breaks connections and sees the log's side, passes them.
pub fn lease_time_with_sessions_lost(decoder_ops: &[DecoderOp], lease_ms: u64, lost: &[(String, u64)]) -> Verdict {
    let mut v = Verdict::new();
    let mut last_seen: HashMap<&str, u64> = HashMap::new();
    let mut with_session: HashSet<&str> = HashSet::new();
    let mut owner: HashMap<(u64, u64), &str> = HashMap::new();
    // When the acquire that granted an epoch was sent.
    let mut granted_at: HashMap<(u64, u64), u64> = HashMap::new();
    for o in decoder_ops {
        let t = last_seen.entry(o.decoder.as_str()).or_insert(0);
        *t = (*t).max(o.invoke_us).max(o.complete_us.unwrap_or(0));
        match o.op() {
            "session" => {
                with_session.insert(o.decoder.as_str());
            }
            // A commit whose answer was lost is known to have applied by the destination's
            // `handoff_received` (it asked the log).
            "acquire" | "commit" if o.ok() == Some(true) => {
                owner.insert((o.gen(), o.epoch()), o.decoder.as_str());
                granted_at.insert((o.gen(), o.epoch()), o.invoke_us);
            }
            "handoff-received" => {
                owner.insert((o.gen(), o.epoch()), o.decoder.as_str());
            }
            _ => {}
        }
    }
    let gone_before = |gen: u64, epoch: u64, t: u64| {
        owner
            .get(&(gen, epoch))
            .is_some_and(|d| with_session.contains(d) && last_seen.get(d).is_some_and(|&s| s < t))
    };
    // Per generation and epoch: the send time of the latest accepted append that extended the
    // lease. Only an append that wrote records does: the log acknowledges a re-send of records
    // it holds without effect, lease included. One counts when it ends past every append of
    // that epoch sent before it that was accepted or is in doubt (an append in doubt may have
    // written the records first; not counting the re-send then can only miss a violation).
    let mut last_append: HashMap<(u64, u64), u64> = HashMap::new();
    let mut sent_to: HashMap<(u64, u64), u64> = HashMap::new();
    let mut appends: Vec<&DecoderOp> = decoder_ops
        .iter()
        .filter(|o| o.op() == "append" && o.ok() != Some(false))
        .collect();
    appends.sort_by_key(|o| o.invoke_us);
    for o in appends {
        let key = (o.gen(), o.epoch());
        let (start, n) = o.records().unwrap_or_default();
        let before = sent_to.get(&key).copied().unwrap_or(0);
        if o.ok() == Some(true) && start + n > before {
            let t = last_append.entry(key).or_insert(0);
            *t = (*t).max(o.invoke_us);
        }
        sent_to.insert(key, before.max(start + n));
    }
    // A release ends its epoch's lease at once: (generation, epoch) -> the earliest send of a
    // release that was accepted or is in doubt.
    let mut released: HashMap<(u64, u64), u64> = HashMap::new();
    for o in decoder_ops
        .iter()
        .filter(|o| o.op() == "release" && o.ok() != Some(false))
    {
        let t = released.entry((o.gen(), o.epoch())).or_insert(u64::MAX);
        *t = (*t).min(o.invoke_us);
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
        if released.get(&(gen, epoch - 1)).is_some_and(|&t| t <= granted_us) {
            continue;
        }
        if gone_before(gen, epoch - 1, granted_us) {
            continue;
        }
        // The previous owner's session was lost while it held the epoch.
        let held_from = granted_at.get(&(gen, epoch - 1)).copied().unwrap_or(0);
        if owner
            .get(&(gen, epoch - 1))
            .is_some_and(|d| lost.iter().any(|(l, t)| l == d && (held_from..=granted_us).contains(t)))
        {
            continue;
        }
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

/// The decoders' acquires, appends, releases and finishes, per generation, against the
/// ownership model, each generation's history ended by the read of its final state (so the
/// committed state must be where the histories leave it). Returns the verdict and the number of
/// operations checked.
pub fn linearizability(
    decoder_ops: &[DecoderOp],
    finals: &HashMap<u64, FinalGen>,
    budget: Duration,
) -> (Verdict, usize) {
    let mut v = Verdict::new();
    let mut ops = ownership_ops(decoder_ops);
    let reader = ops.iter().map(|o| o.client_id).max().map_or(0, |c| c + 1);
    for (&generation, f) in finals {
        let out = OwnershipOutput::Read {
            epoch: f.epoch,
            frontier: f.records.len() as u64,
            terminal: f.terminal,
        };
        let input = OwnershipInput {
            generation,
            op: OwnershipOp::Read,
        };
        let (call, ret) = f.read_us;
        ops.push(Operation::returned(reader, input, call, out, ret.max(call)));
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
                .map(|o| Ownership.describe_op(&o.input, o.output()))
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

/// A decoder name ending in this is a second delivery of that decoder's request (the
/// simulation's duplicated messages): its own client in the history, the same decoder as owner.
pub const DUPLICATE_SUFFIX: &str = "~dup";

/// The model's operations of the decoders' calls (one client per decoder incarnation).
fn ownership_ops(decoder_ops: &[DecoderOp]) -> Vec<Operation<OwnershipInput, OwnershipOutput>> {
    let mut clients: HashMap<String, u64> = HashMap::new();
    let mut ops = Vec::new();
    for o in decoder_ops {
        let dec = o.decoder.clone();
        let n = clients.len() as u64;
        let client = *clients.entry(dec.clone()).or_insert(n);
        let call = o.invoke_us;
        let ret = o.complete_us.unwrap_or(call);
        let refused = || OwnershipOutput::Rejected {
            current_epoch: o.current_epoch(),
            frontier: o.frontier(),
            terminal: o.terminal(),
        };
        let (op, ok) = match o.op() {
            "acquire" => (
                OwnershipOp::Acquire {
                    decoder: dec.strip_suffix(DUPLICATE_SUFFIX).unwrap_or(&dec).to_string(),
                },
                OwnershipOutput::Acquired {
                    epoch: o.epoch(),
                    frontier: o.frontier(),
                },
            ),
            "append" => {
                let (start_seq, n_tokens) = o.records().unwrap_or_default();
                let op = OwnershipOp::Append {
                    epoch: o.epoch(),
                    start_seq,
                    n_tokens,
                    finish: o.finishes(),
                };
                (op, OwnershipOutput::Appended { frontier: o.frontier() })
            }
            "release" => (OwnershipOp::Release { epoch: o.epoch() }, OwnershipOutput::Done),
            "finish" => (OwnershipOp::Finish { epoch: o.epoch() }, OwnershipOutput::Done),
            "commit" => {
                let (_, source_epoch) = o.handed_over().unwrap_or_default();
                let op = OwnershipOp::HandoffCommit {
                    decoder: dec.strip_suffix(DUPLICATE_SUFFIX).unwrap_or(&dec).to_string(),
                    source_epoch,
                    handoff_epoch: o.epoch(),
                };
                let ok = OwnershipOutput::Acquired {
                    epoch: o.current_epoch(),
                    frontier: o.frontier(),
                };
                (op, ok)
            }
            _ => continue,
        };
        let out = match (o.ok(), &op) {
            (None, _) => None,
            (Some(true), _) => Some(ok),
            (Some(false), OwnershipOp::Acquire { .. } | OwnershipOp::HandoffCommit { .. }) => {
                Some(OwnershipOutput::AcquireRejected { terminal: o.terminal() })
            }
            (Some(false), _) => Some(refused()),
        };
        let input = OwnershipInput {
            generation: o.gen(),
            op,
        };
        ops.push(match out {
            Some(out) => Operation::returned(client, input, call, out, ret.max(call)),
            None => Operation::indeterminate(client, input, call),
        });
    }
    ops
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
            last_words: vec![],
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
                    terminal: false,
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
                    terminal: false,
                },
            )
        };
        let early = [append(1_000), grant(1_100)];
        let v = lease_time(&early, 800);
        assert!(!v.ok && v.problems[0].contains("before the lease of epoch 1"), "{v:?}");
        assert!(lease_time(&[append(1_000), grant(1_800)], 800).ok, "within the slack");
        assert!(lease_time(&[append(1_000), grant(2_000)], 800).ok);
        // A re-send of records the log holds is acknowledged without extending the lease
        // (found by the simulation: the checker flagged a correct grant after one).
        assert!(lease_time(&[append(500), append(1_000), grant(1_400)], 800).ok);
        assert!(!lease_time(&[append(500), append(1_000), grant(1_000)], 800).ok);
        // Released by its owner: the lease ended then (found by the simulation too).
        let release = op(
            "d1",
            1_020,
            1_030,
            Call::Release { gen: 7, epoch: 1 },
            Answer::Release {
                ok: Some(true),
                current_epoch: 1,
                frontier: 1,
                terminal: false,
            },
        );
        assert!(lease_time(&[append(1_000), release, grant(1_100)], 800).ok);
        // A session: the owner's death ends its lease at once. Judged only while the owner
        // goes on recording (it was alive); one that recorded nothing from the grant on is not.
        let owner_grant = op(
            "d1",
            10,
            20,
            Call::Acquire { gen: 7 },
            Answer::Acquire {
                ok: Some(true),
                epoch: 1,
                frontier: 0,
                terminal: false,
            },
        );
        let session = DecoderOp {
            decoder: "d1".into(),
            invoke_us: 5_000,
            complete_us: None,
            kind: super::super::decoder_ops::OpKind::Event(tokenlog_decoder::history::DecoderEvent::SessionOpened {
                session: 3,
            }),
        };
        let dead = [session.clone(), owner_grant.clone(), append(1_000), grant(1_100)];
        assert!(lease_time(&dead, 800).ok, "a dead owner's lease ended with its session");
        let alive = [session, owner_grant.clone(), append(1_000), grant(1_100), append(1_200)];
        assert!(!lease_time(&alive, 800).ok, "a live owner's lease was cut short");
        // Without a session, silence proves nothing.
        assert!(!lease_time(&[owner_grant.clone(), append(1_000), grant(1_100)], 800).ok);
        // A live owner whose session the log lost (its connection broke) loses its lease then:
        // judged only when the loss was not between its grant and the next.
        let live = [owner_grant, append(1_000), grant(1_100), append(1_200)];
        let lost_at = |ms: u64| vec![("d1".to_string(), ms * 1_000)];
        assert!(lease_time_with_sessions_lost(&live, 800, &lost_at(1_050)).ok);
        assert!(
            !lease_time_with_sessions_lost(&live, 800, &lost_at(1_150)).ok,
            "lost after the grant"
        );
        assert!(
            !lease_time_with_sessions_lost(&live, 800, &lost_at(5)).ok,
            "lost before it held the epoch"
        );
        assert!(
            !lease_time_with_sessions_lost(&live, 800, &[("d2".into(), 1_050_000)]).ok,
            "another's session"
        );
        // An owner by a handoff commit whose answer was lost (in doubt; its `handoff_received`
        // says it owns the epoch) that died with a session: its lease ended with the session
        // too (found by the `standby-kill` nemesis after a `handoff` one).
        let received = DecoderOp {
            decoder: "d1".into(),
            invoke_us: 30,
            complete_us: None,
            kind: super::super::decoder_ops::OpKind::Event(tokenlog_decoder::history::DecoderEvent::HandoffReceived {
                gen: 7,
                attempt: 1,
                epoch: 1,
                from: "d0".into(),
                frontier: 0,
                kv: 3,
            }),
        };
        let session = DecoderOp {
            decoder: "d1".into(),
            invoke_us: 5,
            complete_us: None,
            kind: super::super::decoder_ops::OpKind::Event(tokenlog_decoder::history::DecoderEvent::SessionOpened {
                session: 4,
            }),
        };
        assert!(lease_time(&[session, received, append(1_000), grant(1_100)], 800).ok);
    }

    #[test]
    fn only_the_armed_failpoint_exit_is_not_a_crash() {
        assert!(processes(&[], false, &[], &Probe::default()).ok);
        let failpoint = [exit("decoder1", 1, Some(FAILPOINT_EXIT))];
        assert!(processes(&failpoint, true, &[], &Probe::default()).ok);
        assert!(
            !processes(&failpoint, false, &[], &Probe::default()).ok,
            "no failpoint armed: a crash"
        );
        assert!(
            !processes(
                &[exit("decoder1", 2, Some(FAILPOINT_EXIT))],
                true,
                &[],
                &Probe::default()
            )
            .ok
        );
        assert!(
            !processes(&[exit("node2", 1, Some(101))], true, &[], &Probe::default()).ok,
            "a panic"
        );
        assert!(
            !processes(&[exit("decoder1", 1, None)], true, &[], &Probe::default()).ok,
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
            max_tokens: 3,
            ignore_eos: true,
            text: String::new(),
            cancel_sent_us: None,
        }
    }

    fn gen1(records: &[(u32, u64)]) -> HashMap<u64, FinalGen> {
        [(
            1,
            FinalGen {
                records: records.to_vec(),
                terminal: true,
                ..Default::default()
            },
        )]
        .into()
    }

    /// A duplicate, a gap, and a token or epoch that differs from the final log are each flagged.
    #[test]
    fn exactly_once_flags_duplicates_gaps_and_mismatches() {
        let log = gen1(&[(5, 1), (6, 1), (7, 2)]);
        let with = |events: Vec<(u32, u32, u64, bool)>| {
            let mut r = req("r", Some(1), 2, "length");
            r.events = events;
            exactly_once(&[r], &log, &[])
        };
        assert!(
            with(vec![
                (0, 5, 1, false),
                (1, 6, 1, false),
                (2, 7, 2, false),
                (3, 0, 2, true)
            ])
            .ok
        );
        let v = with(vec![(0, 5, 1, false), (0, 5, 1, false)]);
        assert!(!v.ok && v.problems[0].contains("duplicate"), "{v:?}");
        let v = with(vec![(0, 5, 1, false), (2, 7, 2, false)]);
        assert!(!v.ok && v.problems[0].contains("gap"), "{v:?}");
        let v = with(vec![(0, 5, 1, false), (1, 6, 2, false)]);
        assert!(
            !v.ok && v.problems[0].contains("epoch 2, the log has 6 epoch 1"),
            "{v:?}"
        );
        let v = with(vec![(0, 5, 1, false), (1, 9, 1, false)]);
        assert!(!v.ok && v.problems[0].contains("token 9"), "{v:?}");
        let v = with(vec![(0, 5, 1, false), (1, 0, 1, true)]);
        assert!(!v.ok && v.problems[0].contains("the log has 3 records"), "{v:?}");
        // The final log's generations: each the one of its request.
        let r = req("r", Some(1), 2, "length");
        assert!(exactly_once(std::slice::from_ref(&r), &HashMap::new(), &[(1, "r".into())]).ok);
        let v = exactly_once(
            std::slice::from_ref(&r),
            &HashMap::new(),
            &[(1, "r".into()), (2, "r".into())],
        );
        assert!(!v.ok && v.problems[0].contains("one request, one generation"), "{v:?}");
        let v = exactly_once(std::slice::from_ref(&r), &HashMap::new(), &[(3, "q".into())]);
        assert!(!v.ok && v.problems[0].contains("no client made"), "{v:?}");
        // A request whose client saw no event (refused, or given up on before its first) may
        // have one generation in the log, not two: a retried submit made the second (failure
        // point 11). Its generation 0 passed every generation of its request id.
        let unseen = RequestRecord {
            generation: 0,
            generations: vec![],
            first_event_us: None,
            ..req("u", None, 2, "")
        };
        assert!(exactly_once(std::slice::from_ref(&unseen), &HashMap::new(), &[(5, "u".into())]).ok);
        let v = exactly_once(
            std::slice::from_ref(&unseen),
            &HashMap::new(),
            &[(5, "u".into()), (6, "u".into())],
        );
        assert!(!v.ok && v.problems[0].contains("one request, one generation"), "{v:?}");
    }

    /// A request must end as it asked: a short "length", EOS it asked to ignore, a cancel
    /// nobody sent, text that differs from its tokens detokenized.
    #[test]
    fn completion_flags_a_request_that_ended_otherwise_than_it_asked() {
        let tok = tokenlog_decoder::fake::fake_tokenizer().unwrap();
        let byte = |c: u8| u32::from(c) + tokenlog_decoder::fake::FAKE_BYTE_OFFSET;
        let log = gen1(&[(byte(b'h'), 1), (byte(b'i'), 1), (byte(b'!'), 1)]);
        let done = |n: u32, reason: &str| {
            let mut r = req("r", Some(1), 2, reason);
            r.events = (0..n).map(|s| (s, 0, 1, false)).chain([(n, 0, 1, true)]).collect();
            r.text = "hi!".into();
            r
        };
        let check = |r: RequestRecord| completion(&[r], &log, Some(&tok));
        assert!(check(done(3, "length")).ok);
        let v = check(done(2, "length"));
        assert!(!v.ok && v.problems[0].contains("asked for 3"), "{v:?}");
        let v = check(done(3, "stop"));
        assert!(!v.ok && v.problems[0].contains("asked to ignore EOS"), "{v:?}");
        let mut eos = done(3, "stop");
        eos.ignore_eos = false;
        assert!(check(eos).ok);
        let v = check(done(3, "cancelled"));
        assert!(!v.ok && v.problems[0].contains("never cancelled"), "{v:?}");
        let mut cancelled = done(3, "cancelled");
        cancelled.cancel_sent_us = Some(1);
        assert!(check(cancelled).ok);
        let mut garbled = done(3, "length");
        garbled.text = "hx!".into();
        let v = check(garbled);
        assert!(!v.ok && v.problems[0].contains("at char 1"), "{v:?}");
        let mut doubled = done(3, "length");
        doubled.text = "hii!".into();
        assert!(!check(doubled).ok, "a delta shown twice");
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
    fn processes_flags_a_process_that_does_not_serve_or_panicked() {
        let fine = Probe {
            checked: 7,
            problems: vec![],
        };
        let v = processes(&[], false, &[], &fine);
        assert!(v.ok && v.checked == 7, "{v:?}");
        let dead = Probe {
            checked: 7,
            problems: vec!["decoder d1-2 does not serve: not registered with the log".into()],
        };
        let v = processes(&[], false, &[], &dead);
        assert!(!v.ok && v.problems[0].contains("does not serve"), "{v:?}");
    }

    #[test]
    fn processes_flags_a_crash_loop_under_the_supervisor() {
        let rec = |t: &str| serde_json::json!({"fault": "supervised", "target": t});
        let fine = [rec(
            "decoder1 killed (SIGKILL); supervisor: decoder1 restarted after 100 ms",
        )];
        assert!(processes(&[], false, &fine, &Probe::default()).ok);
        let looped = [rec(&format!(
            "node2 killed (SIGKILL); supervisor: {} node2: gave up after 3 exits within 1000 ms of their start: boom",
            crate::harness::supervisor::CRASH_LOOP
        ))];
        let v = processes(&[], false, &looped, &Probe::default());
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
                ..Default::default()
            },
        )]
        .into();
        assert!(exactly_once(std::slice::from_ref(&r), &finals, &[]).ok);
        let mut two = r.clone();
        two.generations = vec![1, 2];
        let v = exactly_once(&[two], &finals, &[]);
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
                    terminal: false,
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
                    ..Default::default()
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
        // A planned handoff's commit grants its epoch; one whose answer was lost explains it.
        let commit = |ok: Option<bool>| DecoderOp {
            decoder: "d2".into(),
            invoke_us: 30_000,
            complete_us: ok.map(|_| 31_000),
            kind: super::super::decoder_ops::OpKind::Call {
                call: Call::HandoffCommit {
                    gen: 7,
                    attempt: 1,
                    source_epoch: 1,
                    handoff_epoch: 2,
                },
                answer: ok.map(|ok| Answer::HandoffCommit {
                    ok: Some(ok),
                    epoch: if ok { 2 } else { 1 },
                    frontier: 2,
                    terminal: false,
                }),
            },
        };
        assert!(fencing(&[grant("d1", 1), commit(Some(true))], &finals(&[1, 1, 2])).ok);
        assert!(fencing(&[grant("d1", 1), commit(None)], &finals(&[1, 1, 2])).ok);
        assert!(!fencing(&[grant("d1", 1), commit(Some(false))], &finals(&[1, 1, 2])).ok);
        // The same epoch granted by an acquire and by a commit to another decoder: two owners.
        assert!(!fencing(&[grant("d1", 1), grant("d3", 2), commit(Some(true))], &finals(&[1, 2])).ok);
        // An append sent at an epoch before its grant arrived (refused or not) is flagged.
        let append = |d: &str, at_ms: u64, epoch: u64| {
            op(
                d,
                at_ms,
                at_ms + 1,
                Call::Append {
                    gen: 7,
                    epoch,
                    start_seq: 2,
                    n: 1,
                    finish: false,
                },
                Answer::Append {
                    ok: Some(false),
                    frontier: 2,
                    current_epoch: 1,
                    reason: None,
                    terminal: false,
                },
            )
        };
        let early = fencing(
            &[grant("d1", 1), commit(Some(true)), append("d2", 25, 2)],
            &finals(&[1, 1, 2]),
        );
        assert!(
            !early.ok
                && early.problems[0].contains(
                    "d2 appended at epoch 2 (records Some((2, 1)), answered Some(false)) before it was granted"
                ),
            "{early:?}"
        );
        assert!(
            fencing(
                &[grant("d1", 1), commit(Some(true)), append("d2", 40, 2)],
                &finals(&[1, 1, 2])
            )
            .ok
        );
        // A standby writing at its owner's epoch: never granted to it.
        assert!(!fencing(&[grant("d1", 1), append("d2", 40, 1)], &finals(&[1, 1])).ok);
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
                    ..Default::default()
                },
            )]
            .into()
        };
        assert!(durability(std::slice::from_ref(&r), &[], &at(1)).ok);
        assert!(!durability(std::slice::from_ref(&r), &[], &at(2)).ok);
    }

    fn append(
        d: &str,
        (invoke_ms, complete_ms): (u64, u64),
        (epoch, start_seq, n): (u64, u32, u32),
        ok: Option<bool>,
    ) -> DecoderOp {
        let mut o = op(
            d,
            invoke_ms,
            complete_ms,
            Call::Append {
                gen: 7,
                epoch,
                start_seq,
                n,
                finish: false,
            },
            Answer::Append {
                ok,
                frontier: start_seq + n,
                current_epoch: epoch,
                reason: None,
                terminal: false,
            },
        );
        if ok.is_none() {
            o.complete_us = None;
        }
        o
    }

    fn acquired(d: &str, (invoke_ms, complete_ms): (u64, u64), epoch: u64, frontier: u32) -> DecoderOp {
        op(
            d,
            invoke_ms,
            complete_ms,
            Call::Acquire { gen: 7 },
            Answer::Acquire {
                ok: Some(true),
                epoch,
                frontier,
                terminal: false,
            },
        )
    }

    fn final7(records: &[(u32, u64)], epoch: u64, terminal: bool) -> HashMap<u64, FinalGen> {
        [(
            7,
            FinalGen {
                records: records.to_vec(),
                terminal,
                state: String::new(),
                epoch,
                read_us: (1_000_000, 1_000_100),
            },
        )]
        .into()
    }

    /// An acknowledged append lost from the final log (its tail, or its records replaced by a
    /// later owner's) is flagged; a re-send inside records a later owner wrote before it is not.
    #[test]
    fn durability_ties_acknowledged_appends_to_the_final_log() {
        let ops = [
            acquired("d1", (0, 1), 1, 0),
            append("d1", (10, 20), (1, 0, 2), Some(true)),
        ];
        assert!(durability(&[], &ops, &final7(&[(5, 1), (6, 1)], 1, true)).ok);
        let v = durability(&[], &ops, &final7(&[(5, 1)], 1, true));
        assert!(!v.ok && v.problems[0].contains("the final log has 1 records"), "{v:?}");
        // Seq 1 rewritten at epoch 2 by an owner that began after the acknowledgement.
        let mut later = ops.to_vec();
        later.push(acquired("d2", (30, 31), 2, 1));
        later.push(append("d2", (40, 45), (2, 1, 1), Some(true)));
        let v = durability(&[], &later, &final7(&[(5, 1), (6, 2)], 2, true));
        assert!(
            !v.ok && v.problems[0].contains("written after the acknowledgement"),
            "{v:?}"
        );
        // d1's append was a re-send of records d2 had written already (a deterministic model
        // writes the same tokens): fine.
        let resend = [
            acquired("d1", (0, 1), 1, 0),
            acquired("d2", (30, 31), 2, 0),
            append("d2", (40, 45), (2, 0, 2), Some(true)),
            append("d1", (42, 50), (1, 0, 2), Some(true)),
        ];
        assert!(durability(&[], &resend, &final7(&[(5, 2), (6, 2)], 2, true)).ok);
    }

    /// The final read ends each generation's history: a log that dropped an acknowledged append,
    /// or a stale owner's write accepted between a grant and the new owner's first write, is
    /// not linearizable.
    #[test]
    fn linearizability_covers_the_final_state_and_stale_writes() {
        let ops = [
            acquired("d1", (0, 1), 1, 0),
            append("d1", (10, 20), (1, 0, 2), Some(true)),
        ];
        let check = |ops: &[DecoderOp], f: HashMap<u64, FinalGen>| linearizability(ops, &f, Duration::from_secs(5)).0;
        assert!(check(&ops, final7(&[(5, 1), (6, 1)], 1, false)).ok);
        let v = check(&ops, final7(&[(5, 1)], 1, false));
        assert!(!v.ok && v.problems[0].contains("read()"), "{v:?}");
        // An append in doubt may or may not have landed.
        let mut doubt = ops.to_vec();
        doubt.push(append("d1", (30, 0), (1, 2, 1), None));
        assert!(check(&doubt, final7(&[(5, 1), (6, 1)], 1, false)).ok);
        assert!(check(&doubt, final7(&[(5, 1), (6, 1), (7, 1)], 1, false)).ok);
        // d2 granted epoch 2 at frontier 2; then d1's stale write is accepted.
        let stale = [
            acquired("d1", (0, 1), 1, 0),
            append("d1", (10, 20), (1, 0, 2), Some(true)),
            acquired("d2", (30, 40), 2, 2),
            append("d1", (50, 60), (1, 2, 1), Some(true)),
            append("d2", (70, 80), (2, 3, 1), Some(true)),
        ];
        let v = check(&stale, final7(&[(5, 1), (6, 1), (7, 1), (8, 2)], 2, false));
        assert!(!v.ok, "{v:?}");
    }
}
