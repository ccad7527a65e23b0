//! The expectations of the planned-handoff scenarios (CONTRACT §8, failure points 1-6): the
//! attempt ends in the log in the phase the point implies, between the decoders the harness
//! chose; the failure struck where the point puts it; every acknowledgment (the source's
//! phases, the destination's commit) names the attempt and the epochs the log recorded; and
//! the cache frontiers are the committed ones (the manifest covers the records the source had
//! acknowledged when it copied its cache; the destination's cache holds prompt + the frontier
//! the log granted it at, the source's kept cache at least prompt + its committed records).

use tokenlog_decoder::history::DecoderEvent;
use tokenlog_proto::raftlog::{HandoffInfo, HandoffPhase};

use super::super::super::decoder_ops::{DecoderOp, OpKind};
use super::{expect, gen_ops, Expectation, Scenario, OWNER};

/// The destination's decoder id (decoder 2's first incarnation).
const DESTINATION: &str = "d2-1";

/// `decoder`'s operations `op` of `gen`.
fn by<'a>(ops: &'a [DecoderOp], gen: u64, decoder: &'a str, op: &'a str) -> impl Iterator<Item = &'a DecoderOp> + 'a {
    gen_ops(ops, gen, op).filter(move |o| o.decoder == decoder)
}

pub(super) fn expectations(
    out: &mut Vec<Expectation>,
    sc: Scenario,
    ops: &[DecoderOp],
    gen: u64,
    log: Option<&HandoffInfo>,
) {
    let Some(h) = log else {
        expect(
            out,
            "the log records the handoff attempt",
            false,
            "no attempt in the log".into(),
        );
        return;
    };
    let manifest = h.manifest.clone().unwrap_or_default();
    attempt_in_log(out, sc, h);
    struck(out, sc, ops, gen);
    acknowledgments(out, sc, ops, gen, h);
    frontiers(out, sc, ops, gen, &manifest);
}

/// The attempt's last phase, sides and epochs in the log.
fn attempt_in_log(out: &mut Vec<Expectation>, sc: Scenario, h: &HandoffInfo) {
    let want = sc.handoff_phase().expect("a handoff scenario");
    let phase = HandoffPhase::try_from(h.phase).unwrap_or(HandoffPhase::Unspecified);
    expect(
        out,
        "the attempt ended in the log in the phase the failure point implies, from d1-1 (epoch 1) to d2-1 (epoch 2)",
        phase == want
            && h.source == OWNER
            && h.destination == DESTINATION
            && (h.source_epoch, h.handoff_epoch) == (1, 2)
            && (want != HandoffPhase::Aborted || !h.detail.is_empty()),
        format!(
            "attempt {}: phase {} (expected {}), {} -> {}, epochs {} -> {}, detail {:?}",
            h.attempt,
            phase.as_str_name(),
            want.as_str_name(),
            h.source,
            h.destination,
            h.source_epoch,
            h.handoff_epoch,
            h.detail
        ),
    );
}

/// The failure struck where the point puts it: the armed side's failpoint fired (point 4: the
/// destination's commit is in doubt in its history: its answer was dropped).
fn struck(out: &mut Vec<Expectation>, sc: Scenario, ops: &[DecoderOp], gen: u64) {
    let (side, armed) = match (sc.failpoints(), sc.destination_failpoints()) {
        (Some(f), _) => (OWNER, f),
        (None, Some(f)) => (DESTINATION, f),
        (None, None) => unreachable!("every handoff scenario arms a failpoint"),
    };
    let (ok, detail) = if sc == Scenario::CommitAnswerLost {
        let commits: Vec<Option<bool>> = by(ops, gen, DESTINATION, "commit").map(DecoderOp::ok).collect();
        (
            commits.first() == Some(&None),
            format!("the destination's commits (None: in doubt): {commits:?}"),
        )
    } else {
        let fired: Vec<String> = by(ops, gen, side, "failpoint")
            .filter_map(|o| match &o.kind {
                OpKind::Event(DecoderEvent::Failpoint { name, .. }) => Some(name.clone()),
                _ => None,
            })
            .collect();
        (
            fired.contains(&armed),
            format!("{side} armed {armed:?}; fired {fired:?}"),
        )
    };
    expect(out, "the failure struck at the point's phase", ok, detail);
}

/// Every acknowledgment names the attempt and epochs of the log's record: the source's phases
/// (towards d2-1, at epoch 1) and the destination's commits (epoch 1 -> 2). A commit happened
/// exactly where the point says it did; an accepted one granted the handoff epoch at the
/// frontier then, at or past the manifest's (the source decodes on until the commit).
fn acknowledgments(out: &mut Vec<Expectation>, sc: Scenario, ops: &[DecoderOp], gen: u64, h: &HandoffInfo) {
    let mut wrong = Vec::new();
    let mut source_phases = Vec::new();
    for o in by(ops, gen, OWNER, "handoff-out") {
        if let OpKind::Event(DecoderEvent::HandoffOut {
            attempt,
            epoch,
            to,
            phase,
            ..
        }) = &o.kind
        {
            source_phases.push(phase.clone());
            if (*attempt, *epoch, to.as_str()) != (h.attempt, h.source_epoch, DESTINATION) {
                wrong.push(format!("source {phase}: attempt {attempt}, epoch {epoch}, to {to}"));
            }
        }
    }
    let commits: Vec<&DecoderOp> = by(ops, gen, DESTINATION, "commit").collect();
    for c in &commits {
        let (attempt, source_epoch) = c.handed_over().unwrap_or_default();
        if (attempt, source_epoch, c.epoch()) != (h.attempt, h.source_epoch, h.handoff_epoch) {
            wrong.push(format!(
                "commit: attempt {attempt}, epoch {source_epoch} -> {}",
                c.epoch()
            ));
        }
        let frontier = h.manifest.as_ref().map_or(0, |m| u64::from(m.frontier));
        if c.ok() == Some(true) && (c.current_epoch() != h.handoff_epoch || c.frontier() < frontier) {
            wrong.push(format!(
                "commit granted epoch {} at frontier {} (manifest {frontier})",
                c.current_epoch(),
                c.frontier()
            ));
        }
    }
    // The source's phases as the point leaves them: it dies while copying (1) or before its
    // release (6), learns of an abort (2, 3), or of the commit from the answer or the log (4, 5).
    let source_expected: &[&str] = match sc.point() {
        1 | 6 => &["prepared"],
        2 | 3 => &["prepared", "aborted"],
        _ => &["prepared", "released"],
    };
    let commit_expected = matches!(sc.point(), 4..=6);
    expect(
        out,
        "every acknowledgment names the log's attempt and epochs; a commit happened exactly where the point says",
        wrong.is_empty() && source_phases == source_expected && commit_expected != commits.is_empty(),
        format!(
            "source phases {source_phases:?} (expected {source_expected:?}); destination commits {:?}; mismatches {wrong:?}",
            commits.iter().map(|c| c.ok()).collect::<Vec<_>>()
        ),
    );
}

/// Cache frontiers: the manifest covers the records the source had acknowledged at some point
/// before it prepared (when it copied its cache, every token it had sampled was committed);
/// the destination received the generation at a frontier at or past the manifest's, its cache
/// held prompt + that frontier, and its first write is there; a source that kept the
/// generation (the attempt aborted) kept its whole cache.
fn frontiers(
    out: &mut Vec<Expectation>,
    sc: Scenario,
    ops: &[DecoderOp],
    gen: u64,
    manifest: &tokenlog_proto::raftlog::CacheManifest,
) {
    let f = u64::from(manifest.frontier);
    let mut problems = Vec::new();
    let prompt_len = by(ops, gen, OWNER, "resumed").find_map(|o| match &o.kind {
        OpKind::Event(DecoderEvent::Resumed {
            epoch: 1, prompt_len, ..
        }) => Some(*prompt_len),
        _ => None,
    });
    let Some(p) = prompt_len else {
        expect(
            out,
            "the cache frontiers are the committed ones",
            false,
            "no resume of d1-1 at epoch 1".into(),
        );
        return;
    };
    // A copy taken while the source decodes leaves out the last committed position (the
    // destination prefills it); one taken with every sampled token fed holds them all.
    let kv = u64::from(manifest.kv_positions);
    if kv != p + f && kv + 1 != p + f {
        problems.push(format!(
            "manifest: {} KV positions for prompt {p} + {f} records",
            manifest.kv_positions
        ));
    }
    let prepared_at = by(ops, gen, OWNER, "handoff-out")
        .map(|o| o.invoke_us)
        .min()
        .unwrap_or(u64::MAX);
    let acknowledged: std::collections::BTreeSet<u64> = by(ops, gen, OWNER, "append")
        .filter(|a| a.ok() == Some(true) && a.epoch() == 1 && a.complete_us.unwrap_or(u64::MAX) < prepared_at)
        .map(DecoderOp::frontier)
        .collect();
    if !acknowledged.contains(&f) {
        problems.push(format!(
            "the manifest covers {f} records; the source had these frontiers acknowledged before it prepared: {acknowledged:?}"
        ));
    }
    let mut received = None;
    for o in by(ops, gen, DESTINATION, "handoff-received") {
        if let OpKind::Event(DecoderEvent::HandoffReceived { frontier, kv, .. }) = &o.kind {
            let r = u64::from(*frontier);
            received = Some(r);
            if r < f || u64::from(*kv) != p + r {
                problems.push(format!(
                    "the destination received {frontier} records with {kv} KV positions"
                ));
            }
        }
    }
    if let (Some(first), Some(r)) = (
        by(ops, gen, DESTINATION, "append")
            .find(|a| a.epoch() == 2)
            .and_then(DecoderOp::records),
        received,
    ) {
        if first.0 != r {
            problems.push(format!("the destination's first write starts at {}, not {r}", first.0));
        }
    }
    let kept: Vec<(u32, u32)> = by(ops, gen, OWNER, "handoff-kept")
        .filter_map(|o| match &o.kind {
            OpKind::Event(DecoderEvent::HandoffKept { committed, kv, .. }) => Some((*committed, *kv)),
            _ => None,
        })
        .collect();
    for &(c, kv) in &kept {
        if u64::from(kv) < p + u64::from(c) || u64::from(c) < f {
            problems.push(format!(
                "the source kept {c} records with {kv} KV positions (at least prompt {p} + {c}, and {c} >= {f}, expected)"
            ));
        }
    }
    // Where the attempt aborted with both sides' source alive, the source says what it kept.
    if matches!(sc.point(), 2 | 3) && kept.is_empty() {
        problems.push("the source did not report the cache it kept".into());
    }
    if matches!(sc.point(), 4 | 6) && by(ops, gen, DESTINATION, "handoff-received").next().is_none() {
        problems.push("the destination did not report what it received".into());
    }
    expect(
        out,
        "the cache frontiers are the committed ones (manifest, destination, the source's kept cache)",
        problems.is_empty(),
        format!(
            "prompt {p}, manifest frontier {f}, {} KV positions: {problems:?}",
            manifest.kv_positions
        ),
    );
}
