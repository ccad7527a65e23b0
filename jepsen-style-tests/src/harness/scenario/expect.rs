//! The expectations the contract states for each scenario, judged over the request's record,
//! the decoders' joined history, the retrier's log and what the driver saw.

use std::collections::BTreeSet;

use tokenlog_decoder::history::DecoderEvent;

use super::super::decoder_ops::{DecoderOp, OpKind};
use super::super::workload::RequestRecord;
use super::{Expectation, Facts, RetrierLog, Scenario, FAULT_SEQ, MAX_TOKENS, OWNER};

mod handoff;

fn expect(out: &mut Vec<Expectation>, what: &str, ok: bool, detail: String) {
    out.push(Expectation {
        what: what.into(),
        ok,
        detail,
    });
}

fn gen_ops<'a>(ops: &'a [DecoderOp], gen: u64, op: &'a str) -> impl Iterator<Item = &'a DecoderOp> + 'a {
    ops.iter().filter(move |o| o.op() == op && o.gen() == gen)
}

/// An owner's frontiers at its resume: `(epoch, committed, sampled, fed, kv, prompt_len)`. A
/// deferred prefill counts as fed: it is what the owner feeds before its first draw.
fn resumed_frontiers(o: &DecoderOp) -> Option<(u64, u64, u64, u64, u64, u64)> {
    match &o.kind {
        OpKind::Event(DecoderEvent::Resumed {
            epoch,
            prompt_len,
            sampled,
            fed,
            kv,
            committed,
            deferred,
            ..
        }) => {
            let (fed, kv) = match *deferred {
                0 => (*fed, *kv),
                // Nothing of it is fed yet, and all of it is prompt + committed prefix.
                d if *fed == 0 && *kv == 0 && d == prompt_len + committed => (*committed, d),
                // Inconsistent: reported as it is, so the expectation fails.
                _ => (*fed, *kv),
            };
            Some((*epoch, *committed, *sampled, fed, kv, *prompt_len))
        }
        _ => None,
    }
}

/// Every expectation of `sc`: those common to all scenarios, then its own.
pub(super) fn expectations(
    sc: Scenario,
    rec: &RequestRecord,
    ops: &[DecoderOp],
    retrier: &RetrierLog,
    facts: &Facts,
) -> Vec<Expectation> {
    let Facts {
        generations,
        killed_gateway,
        terms,
        spliced,
        ..
    } = *facts;
    let mut out = Vec::new();
    let gen = rec.generation;
    let tokens: Vec<(u32, u32, u64)> = rec.events.iter().filter(|e| !e.3).map(|e| (e.0, e.1, e.2)).collect();
    request_ran(&mut out, rec, &tokens);
    one_generation(&mut out, retrier, gen, generations);
    unambiguous_owner(&mut out, ops, gen, &tokens);
    resume_frontiers(&mut out, sc, ops, gen);
    no_stale_append(&mut out, ops, gen);
    exact(&mut out, &tokens, &facts.reference);
    if sc.is_handoff() {
        handoff::expectations(&mut out, sc, ops, gen, facts.handoff.as_ref());
    }
    per_scenario(&mut out, sc, rec, ops, &tokens, killed_gateway, terms, spliced);
    out
}

/// The client's tokens are the uninterrupted run's (same prompt, seed and sampling; exact
/// resume through every fault).
fn exact(out: &mut Vec<Expectation>, tokens: &[(u32, u32, u64)], reference: &[u32]) {
    let seen: Vec<u32> = tokens.iter().map(|t| t.1).collect();
    let first_difference = seen.iter().zip(reference).position(|(a, b)| a != b);
    expect(
        out,
        "the client's tokens are those of an uninterrupted run of the same request",
        seen == reference,
        format!(
            "{} tokens seen, {} in the uninterrupted run, first difference at seq {first_difference:?}",
            seen.len(),
            reference.len()
        ),
    );
}

/// Decoders an epoch of `gen` was granted to: by an accepted acquire, or by a handoff commit
/// accepted or in doubt (its answer lost: the destination then asked the log).
fn granted_to(ops: &[DecoderOp], gen: u64, epoch: u64) -> BTreeSet<String> {
    ops.iter()
        .filter(|o| o.gen() == gen && o.epoch() == epoch)
        .filter(|o| match o.op() {
            "acquire" => o.ok() == Some(true),
            "commit" => o.ok() != Some(false),
            _ => false,
        })
        .map(|o| o.decoder.clone())
        .collect()
}

/// The request ran to its end.
fn request_ran(out: &mut Vec<Expectation>, rec: &RequestRecord, tokens: &[(u32, u32, u64)]) {
    expect(
        out,
        "the request ran to its end (every token, finish reason length)",
        rec.finished && rec.finish_reason == "length" && tokens.len() == MAX_TOKENS as usize,
        format!(
            "finished {}, reason {:?}, {} tokens, error {:?}",
            rec.finished,
            rec.finish_reason,
            tokens.len(),
            rec.error
        ),
    );
}

/// Failure point 11: every answer named the one generation, and the cluster holds exactly one.
fn one_generation(out: &mut Vec<Expectation>, retrier: &RetrierLog, gen: u64, generations: u64) {
    expect(
        out,
        "status reads and re-submits named one generation; the cluster holds exactly one",
        retrier.wrong.is_empty()
            && retrier.generations.iter().all(|&g| g == gen)
            && generations == 1
            && retrier.status_ok > 0
            && retrier.submits_ok > 0
            && retrier.unknown_queries > 0,
        format!(
            "generations named {:?} (the request's: {gen}), {generations} in the cluster, wrong answers {:?}, {} status, {} re-submits, {} unknown-id reads, {} transient errors",
            retrier.generations, retrier.wrong, retrier.status_ok, retrier.submits_ok, retrier.unknown_queries, retrier.transient_errors
        ),
    );
}

/// The surviving owner is unambiguous: the last record's epoch was granted to one decoder,
/// and every record from the first one written at that epoch on carries it.
fn unambiguous_owner(out: &mut Vec<Expectation>, ops: &[DecoderOp], gen: u64, tokens: &[(u32, u32, u64)]) {
    let last_epoch = tokens.last().map_or(0, |t| t.2);
    let grants = granted_to(ops, gen, last_epoch);
    let first_at = tokens.iter().position(|t| t.2 == last_epoch).unwrap_or(0);
    expect(
        out,
        "the surviving owner is unambiguous",
        grants.len() == 1 && tokens[first_at..].iter().all(|t| t.2 == last_epoch),
        format!("final epoch {last_epoch} granted to {grants:?}, written from seq {first_at}"),
    );
}

/// Frontiers of every owner at its resume. Committed = the acquire's frontier, and that is no
/// less than any frontier acknowledged to an earlier owner before the acquire was invoked
/// (nothing acknowledged is lost) and exactly where the owner's first append starts; exact
/// mode replayed all of it (sampled = fed = committed; KV = prompt + committed).
fn resume_frontiers(out: &mut Vec<Expectation>, sc: Scenario, ops: &[DecoderOp], gen: u64) {
    let mut frontier_problems = Vec::new();
    let resumed: Vec<&DecoderOp> = gen_ops(ops, gen, "resumed").collect();
    for r in &resumed {
        let Some((epoch, c, s, f, kv, p)) = resumed_frontiers(r) else {
            continue;
        };
        let acquire =
            gen_ops(ops, gen, "acquire").find(|a| a.ok() == Some(true) && a.decoder == r.decoder && a.epoch() == epoch);
        let acknowledged = acquire.map_or(0, |a| {
            gen_ops(ops, gen, "append")
                .filter(|x| x.ok() == Some(true) && x.epoch() < epoch)
                .filter(|x| x.complete_us.unwrap_or(0) < a.invoke_us)
                .map(DecoderOp::frontier)
                .max()
                .unwrap_or(0)
        });
        let first_append = gen_ops(ops, gen, "append")
            .find(|x| x.decoder == r.decoder && x.epoch() == epoch)
            .and_then(|x| x.records().map(|r| r.0));
        let acquired = acquire.map(DecoderOp::frontier);
        let ok = acquired == Some(c)
            && c >= acknowledged
            && first_append.is_none_or(|st| st == c)
            && s == c
            && f == c
            && kv == p + c;
        if !ok {
            frontier_problems.push(format!(
                "{} epoch {epoch}: acquire frontier {acquired:?}, acknowledged before it {acknowledged}, first append at {first_append:?}, committed {c}, sampled {s}, fed {f}, kv {kv}, prompt {p}",
                r.decoder
            ));
        }
    }
    let takeovers = resumed.iter().filter(|r| r.epoch() > 1).count();
    expect(
        out,
        "each owner resumed at the committed frontier (nothing acknowledged lost), KV = prompt + committed",
        frontier_problems.is_empty() && !resumed.is_empty() && (!sc.takes_over() || takeovers >= 1),
        format!(
            "{} resumes ({takeovers} takeovers){}",
            resumed.len(),
            if frontier_problems.is_empty() {
                String::new()
            } else {
                format!(": {frontier_problems:?}")
            }
        ),
    );
}

/// No stale epoch wrote anything: no append accepted from a decoder after a higher epoch was
/// granted (the fencing and linearizability checkers judge the whole history; this names it).
fn no_stale_append(out: &mut Vec<Expectation>, ops: &[DecoderOp], gen: u64) {
    let mut stale_accepted = Vec::new();
    for a in gen_ops(ops, gen, "append").filter(|a| a.ok() == Some(true)) {
        let newer = ops
            .iter()
            .filter(|g| g.gen() == gen && matches!(g.op(), "acquire" | "commit"))
            .filter(|g| g.ok() == Some(true) && g.epoch() > a.epoch())
            .any(|g| g.complete_us.unwrap_or(0) < a.invoke_us);
        if newer {
            stale_accepted.push(format!(
                "{} epoch {} start {:?}",
                a.decoder,
                a.epoch(),
                a.records().map(|r| r.0)
            ));
        }
    }
    expect(
        out,
        "no append at a superseded epoch was accepted",
        stale_accepted.is_empty(),
        format!("{stale_accepted:?}"),
    );
}

/// The first owner's (decoder 1's first incarnation's) appends of `gen`.
fn owner_appends(ops: &[DecoderOp], gen: u64) -> impl Iterator<Item = &DecoderOp> + '_ {
    gen_ops(ops, gen, "append").filter(|a| a.decoder == OWNER)
}

/// Whether append `a` carries the record at `seq`.
fn carries(a: &DecoderOp, seq: u64) -> bool {
    a.records().is_some_and(|(start, n)| start <= seq && seq < start + n)
}

/// The expectation of `sc` itself (none for some).
#[allow(clippy::too_many_arguments)]
fn per_scenario(
    out: &mut Vec<Expectation>,
    sc: Scenario,
    rec: &RequestRecord,
    ops: &[DecoderOp],
    tokens: &[(u32, u32, u64)],
    killed_gateway: Option<usize>,
    terms: (Option<u64>, Option<u64>),
    spliced: usize,
) {
    let gen = rec.generation;
    let event_at = |seq: u32| tokens.iter().find(|t| t.0 == seq).copied();
    let fired = ops.iter().find_map(|o| match &o.kind {
        OpKind::Event(DecoderEvent::Failpoint { gen: g, seq, token, .. }) if o.decoder == OWNER && *g == gen => {
            Some((u64::from(*seq), token.map(u64::from)))
        }
        _ => None,
    });
    let seq = u64::from(FAULT_SEQ);
    match sc {
        Scenario::DecoderDiesAfterSample => {
            let sampled = fired;
            let sent = owner_appends(ops, gen).filter(|a| carries(a, seq)).count();
            let shown = event_at(FAULT_SEQ);
            expect(
                out,
                "the owner died after sampling seq 20 and never sent it; the new owner re-sampled the same token at a higher epoch",
                sampled.map(|s| s.0) == Some(seq)
                    && sent == 0
                    && shown.is_some_and(|(_, t, e)| e > 1 && sampled.and_then(|s| s.1) == Some(u64::from(t))),
                format!("failpoint {sampled:?}, appends carrying it {sent}, seen (seq, token, epoch) {shown:?}"),
            );
        }
        Scenario::GatewayDiesAfterSend => {
            expect(
                out,
                "the client's gateway was killed mid-stream and the client resumed on the other",
                killed_gateway.is_some() && rec.connections >= 2,
                format!("killed {killed_gateway:?}, {} connections", rec.connections),
            );
        }
        Scenario::PausedOwnerWritesAfterTakeover | Scenario::DelayedAppendFromOldOwner => {
            old_owner_rejected(out, sc, ops, gen, fired);
        }
        Scenario::RestartAll => {
            // A node restarting with its own committed vote resumes leadership at its old term
            // (openraft), so a new term is not required here; a serving leader is.
            expect(
                out,
                "a leader serves after every node restarted",
                terms.1.is_some(),
                format!("term before the fault {:?}, after {:?}", terms.0, terms.1),
            );
        }
        Scenario::LeaderCrash | Scenario::LeaderPause | Scenario::LeaderInMinorityPartition => {
            expect(
                out,
                "the cluster elected a leader at a new term",
                matches!(terms, (Some(a), Some(b)) if b > a),
                format!("term before the fault {:?}, after {:?}", terms.0, terms.1),
            );
        }
        Scenario::StageDies | Scenario::StagePaused => {
            let epochs: BTreeSet<u64> = tokens.iter().map(|t| t.2).collect();
            expect(
                out,
                "a spare was spliced in for the failed stage and the generation stayed with its head (every record at epoch 1)",
                spliced >= 1 && epochs.iter().all(|&e| e == 1),
                format!("{spliced} splices; epochs seen {epochs:?}"),
            );
        }
        Scenario::PipelineLeaderCrash | Scenario::PipelineLeaderPause => {
            expect(
                out,
                "the cluster elected a leader at a new term",
                matches!(terms, (Some(a), Some(b)) if b > a),
                format!("term before the fault {:?}, after {:?}", terms.0, terms.1),
            );
            // A paused leader holds the calls sent to it (renewals of the head's leases and of
            // the stages' registrations) while the new leader's log time runs: a splice or a
            // takeover may follow, and the checkers and the uninterrupted run judge it. A
            // crashed one refuses them at once: neither may happen.
            if sc == Scenario::PipelineLeaderPause {
                return;
            }
            let epochs: BTreeSet<u64> = tokens.iter().map(|t| t.2).collect();
            expect(
                out,
                "no stage was spliced out while the log elected a leader after a crash, and the generation stayed with its head (every record at epoch 1)",
                spliced == 0 && epochs.iter().all(|&e| e == 1),
                format!("{spliced} splices; epochs seen {epochs:?}"),
            );
        }
        Scenario::HeadDies => {
            let (ok, detail) = continued_after_head(tokens);
            expect(
                out,
                "the head died and another decoder continued the generation at a higher epoch",
                ok,
                detail,
            );
        }
        Scenario::MinorityPartition | Scenario::NodeLosesDisk => {}
        // Judged in `handoff`.
        Scenario::SourceDiesCopying
        | Scenario::DestinationDiesBeforeReady
        | Scenario::DestinationDiesAfterReady
        | Scenario::CommitAnswerLost
        | Scenario::DestinationDiesAfterCommit
        | Scenario::SourceDiesBeforeRelease => {}
    }
}

/// `head-dies`: the head is killed once the client saw seq 20, so it may have committed a few
/// more records at epoch 1 by then. What must hold: the head (epoch 1) wrote everything before
/// seq 20, and after its last record another decoder wrote at a higher epoch, to the end.
/// `tokens`: (seq, token, epoch) as the client saw them.
fn continued_after_head(tokens: &[(u32, u32, u64)]) -> (bool, String) {
    let before: BTreeSet<u64> = tokens.iter().filter(|t| t.0 < FAULT_SEQ).map(|t| t.2).collect();
    let head_until = tokens.iter().filter(|t| t.2 == 1).map(|t| t.0).max();
    let later: BTreeSet<u64> = tokens
        .iter()
        .filter(|t| head_until.is_some_and(|h| t.0 > h))
        .map(|t| t.2)
        .collect();
    let ok = before.iter().all(|&e| e == 1)
        && head_until.is_some_and(|h| h + 1 >= FAULT_SEQ)
        && !later.is_empty()
        && later.iter().all(|&e| e > 1);
    let detail = format!(
        "epochs before seq {FAULT_SEQ}: {before:?}; the head's last seq {head_until:?}; epochs after it {later:?}"
    );
    (ok, detail)
}

/// Points 9 and 10: the old owner's write after the takeover (for 10, the held append carrying
/// seq 20, its failpoint `fired`) was rejected by the fence: for its stale epoch or lapsed
/// lease. A rejection because the generation had ended meanwhile says nothing of the fence (a
/// log without one refuses a finish of an ended generation too).
fn old_owner_rejected(
    out: &mut Vec<Expectation>,
    sc: Scenario,
    ops: &[DecoderOp],
    gen: u64,
    fired: Option<(u64, Option<u64>)>,
) {
    let seq = u64::from(FAULT_SEQ);
    let granted = gen_ops(ops, gen, "acquire")
        .filter(|g| g.ok() == Some(true) && g.epoch() > 1)
        .map(|g| g.complete_us.unwrap_or(0))
        .min();
    let late: Vec<String> = owner_appends(ops, gen)
        .filter(|a| granted.is_some_and(|t| a.invoke_us > t))
        .map(|a| {
            format!(
                "epoch {} records {:?} ok {:?} rejection {:?}",
                a.epoch(),
                a.records(),
                a.ok(),
                a.rejection()
            )
        })
        .collect();
    let rejected = owner_appends(ops, gen)
        .filter(|a| granted.is_some_and(|t| a.invoke_us > t))
        .filter(|a| {
            a.rejection().is_some_and(|(current, reason)| {
                use tokenlog_proto::raftlog::RejectReason;
                current > a.epoch()
                    && matches!(reason, Some(r) if r == RejectReason::StaleEpoch as i32 || r == RejectReason::LeaseExpired as i32)
            })
        })
        .filter(|a| sc != Scenario::DelayedAppendFromOldOwner || carries(a, seq))
        .count();
    expect(
        out,
        if sc == Scenario::PausedOwnerWritesAfterTakeover {
            "the continued old owner wrote after the takeover and was rejected"
        } else {
            "the held append arrived after the takeover and was rejected"
        },
        rejected >= 1 && (sc != Scenario::DelayedAppendFromOldOwner || fired.is_some()),
        format!("takeover at {granted:?}; the old owner's later appends: {late:?}"),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (seq, token, epoch) for 64 records, the head (epoch 1) writing up to `head_until`.
    fn seen(head_until: u32, next_epoch: u64) -> Vec<(u32, u32, u64)> {
        (0..64)
            .map(|s| (s, s, if s <= head_until { 1 } else { next_epoch }))
            .collect()
    }

    #[test]
    fn a_head_that_committed_past_seq_20_before_its_kill_landed_still_hands_on() {
        // CI's case: the client saw seq 20 at the kill, the head had committed up to 22.
        assert!(continued_after_head(&seen(22, 2)).0);
        assert!(continued_after_head(&seen(FAULT_SEQ - 1, 2)).0);
    }

    #[test]
    fn no_takeover_or_an_early_one_is_caught() {
        // Nobody took over.
        assert!(!continued_after_head(&seen(63, 2)).0);
        // Another epoch before seq 20: the head was not the one writing there.
        assert!(!continued_after_head(&seen(10, 2)).0);
        // A record after the head's last one at an epoch no higher than the head's.
        let mut back = seen(22, 2);
        back[30].2 = 0;
        assert!(!continued_after_head(&back).0);
    }
}
