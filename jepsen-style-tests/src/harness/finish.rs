//! Ending a run: the final state read from the cluster, the checkers' verdicts, the summary, and
//! the report (`history.jsonl`, `verdicts.json`, `timeline.html`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::Value;
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

use super::checks::{self, FinalGen, Verdict};
use super::decoder_ops::{self, DecoderOp};
use super::procs::SelfExit;
use super::workload::{self, RequestRecord};
use super::{report, Cluster, RunConfig, RunSummary};

/// Stops the leader watcher, reads the final state, stops every process, runs the checkers
/// over `reqs` and the decoders' histories, and writes the report into `cfg.out`. Call it once
/// the cluster is healed and the clients are done. Also returns the decoders' joined history.
pub async fn conclude(
    cfg: &RunConfig,
    cluster: Cluster,
    reqs: Vec<workload::RequestRecord>,
    nemesis_records: Vec<Value>,
) -> Result<(RunSummary, Vec<DecoderOp>)> {
    let Cluster {
        procs,
        node_addrs,
        log,
        leader_changes,
        at_finish,
        stop_watcher,
        watcher,
        started,
        ..
    } = cluster;
    let dir = cfg.out.clone();
    let _ = stop_watcher.send(true);
    let _ = watcher.await;
    // --- final state
    let (finals, pruned) = final_gens(&log, &reqs, &at_finish).await?;
    // The writers stop first, so that the nodes come to rest at one applied index.
    let mut self_exits = procs.lock().expect("lock").stop_writers();
    let snapshots_installed = procs
        .lock()
        .expect("lock")
        .nodes
        .iter()
        .map(|n| n.log_text().matches("snapshot installed").count() as u64)
        .sum();
    let convergence = convergence(&node_addrs).await;
    let decoder_ops = decoder_ops::read(&dir, cfg.decoders);
    self_exits.extend(procs.lock().expect("lock").stop_all());
    // Stop the processes before checking (and before the report).
    drop(procs);

    let verdicts = verdicts(
        cfg,
        &reqs,
        &finals,
        &decoder_ops,
        convergence,
        &self_exits,
        &nemesis_records,
    );
    let faults = fault_counts(&nemesis_records);
    let leader_changes = leader_changes.lock().expect("lock").clone();
    let mut summary = summarize(cfg, verdicts, faults, &reqs, &leader_changes, &decoder_ops, started);
    summary.pruned = pruned;
    summary.snapshots_installed = snapshots_installed;
    summary.corruptions_detected = nemesis_records
        .iter()
        .filter(|n| {
            n["target"]
                .as_str()
                .is_some_and(|t| t.contains(super::nemesis::DETECTED))
        })
        .count() as u64;
    summary.supervisor_restarts = nemesis_records
        .iter()
        .filter(|n| n["fault"] == "supervised")
        .map(|n| n["target"].as_str().unwrap_or("").matches(" restarted after ").count() as u64)
        .sum();

    // --- report
    write_report(&dir, &summary, &reqs, &nemesis_records, &leader_changes, &decoder_ops)?;
    Ok((summary, decoder_ops))
}

/// The final state of every generation a client saw. One that retention pruned is taken as read
/// right after its last event (`at_finish`; counted in the second value); one gone from the log
/// without such a read is left out, and the checkers report it.
async fn final_gens(
    log: &LogClient,
    reqs: &[RequestRecord],
    at_finish: &checks::AtFinish,
) -> Result<(HashMap<u64, FinalGen>, u64)> {
    let mut finals = HashMap::new();
    let mut pruned = 0;
    for r in reqs {
        if r.generation != 0 && !finals.contains_key(&r.generation) {
            match final_gen(log, r.generation).await {
                Ok(f) => {
                    finals.insert(r.generation, f);
                }
                Err(e) if is_not_found(&e) => {
                    if let Some(f) = at_finish.lock().expect("lock").get(&r.generation) {
                        finals.insert(r.generation, f.clone());
                        pruned += 1;
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok((finals, pruned))
}

/// Runs every checker; `convergence` was judged while the nodes ran.
fn verdicts(
    cfg: &RunConfig,
    reqs: &[RequestRecord],
    finals: &HashMap<u64, FinalGen>,
    decoder_ops: &[DecoderOp],
    convergence: Verdict,
    self_exits: &[SelfExit],
    nemesis_records: &[Value],
) -> BTreeMap<String, Verdict> {
    let mut verdicts = BTreeMap::new();
    verdicts.insert("exactly-once".to_string(), checks::exactly_once(reqs, finals));
    verdicts.insert("durability".to_string(), checks::durability(reqs, finals));
    verdicts.insert("fencing".to_string(), checks::fencing(decoder_ops, finals));
    let (lin, _) = checks::linearizability(decoder_ops, Duration::from_secs(20));
    verdicts.insert("linearizability".to_string(), lin);
    verdicts.insert("status".to_string(), checks::status(reqs));
    verdicts.insert(
        "liveness".to_string(),
        checks::liveness(reqs, nemesis_records, cfg.lease_ms, cfg.unowned_ms_in_force()),
    );
    verdicts.insert("convergence".to_string(), convergence);
    verdicts.insert("lease-time".to_string(), checks::lease_time(decoder_ops, cfg.lease_ms));
    verdicts.insert(
        "processes".to_string(),
        checks::processes(self_exits, cfg.decoder1_failpoints.is_some(), nemesis_records),
    );
    verdicts
}

/// How many times each fault struck.
fn fault_counts(nemesis_records: &[Value]) -> BTreeMap<String, u64> {
    let mut faults = BTreeMap::new();
    for n in nemesis_records {
        *faults
            .entry(n["fault"].as_str().unwrap_or("?").to_string())
            .or_insert(0) += 1;
    }
    faults
}

/// The run's summary from its verdicts and histories.
fn summarize(
    cfg: &RunConfig,
    verdicts: BTreeMap<String, Verdict>,
    faults: BTreeMap<String, u64>,
    reqs: &[RequestRecord],
    leader_changes: &[Value],
    decoder_ops: &[DecoderOp],
    started: Instant,
) -> RunSummary {
    RunSummary {
        seed: cfg.seed,
        ok: verdicts.values().all(|v| v.ok),
        requests: reqs.len(),
        tokens_seen: reqs.iter().map(|r| r.events.len()).sum(),
        resumes: reqs.iter().map(|r| u64::from(r.connections.saturating_sub(1))).sum(),
        takeovers: decoder_ops
            .iter()
            .filter(|o| o.op() == "acquire" && o.ok() == Some(true) && o.epoch() > 1)
            .count() as u64,
        fence_rejections: decoder_ops
            .iter()
            .filter(|o| matches!(o.rejection(), Some((_, Some(1) | Some(2)))))
            .count() as u64,
        leader_changes: leader_changes.len().saturating_sub(1) as u64,
        pruned: 0,
        snapshots_installed: 0,
        corruptions_detected: 0,
        supervisor_restarts: 0,
        faults,
        decoder_ops: decoder_ops.len(),
        verdicts,
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// Writes `history.jsonl`, `verdicts.json` and `timeline.html` into `dir`; removes the node data dirs.
fn write_report(
    dir: &Path,
    summary: &RunSummary,
    reqs: &[RequestRecord],
    nemesis_records: &[Value],
    leader_changes: &[Value],
    decoder_ops: &[DecoderOp],
) -> Result<()> {
    let mut history: Vec<Value> = reqs.iter().map(workload::to_json).collect();
    history.extend(nemesis_records.iter().cloned());
    history.extend(leader_changes.iter().cloned());
    history.extend(decoder_ops.iter().map(DecoderOp::to_json));
    let mut lines = String::new();
    for h in &history {
        lines.push_str(&h.to_string());
        lines.push('\n');
    }
    std::fs::write(dir.join("history.jsonl"), lines)?;
    std::fs::write(dir.join("verdicts.json"), serde_json::to_string_pretty(summary)?)?;
    std::fs::write(
        dir.join("timeline.html"),
        report::timeline(summary, reqs, nemesis_records, leader_changes, decoder_ops),
    )?;
    // Node data dirs are large and not part of the report.
    for i in 0..3 {
        let _ = std::fs::remove_dir_all(dir.join(format!("node{}-data", i + 1)));
    }
    Ok(())
}

/// Whether `e` is the log's not-found answer.
fn is_not_found(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<tokenlog_raftlog::client::ClientError>(),
        Some(tokenlog_raftlog::client::ClientError::Status(s)) if s.code() == tonic::Code::NotFound
    )
}

/// The committed records of a generation (up to its frontier now), read linearizably.
pub(super) async fn final_gen(log: &LogClient, id: u64) -> Result<FinalGen> {
    let info = log.generation(id).await?;
    let mut out = FinalGen {
        terminal: matches!(
            pb::GenerationState::try_from(info.state),
            Ok(pb::GenerationState::Finished | pb::GenerationState::Failed | pb::GenerationState::Cancelled)
        ),
        state: format!("{:?}", pb::GenerationState::try_from(info.state).unwrap_or_default()),
        records: vec![],
    };
    if info.frontier == 0 {
        return Ok(out);
    }
    let mut s = log.watch(id, 0).await?;
    while let Some(ev) = s.message().await? {
        for r in ev.records {
            out.records.push((r.token_id, r.epoch));
        }
        if ev.terminal.is_some() || out.records.len() >= info.frontier as usize {
            break;
        }
    }
    out.records.truncate(info.frontier as usize);
    Ok(out)
}

/// How long the nodes may take to agree once the writers are stopped.
const CONVERGE_WITHIN: Duration = Duration::from_secs(30);

/// Convergence: every node reports the same chain heads, then the same whole-state digest at
/// the same applied index (any two nodes seen at one index with different digests is a
/// violation at once), then each node's own chain verification.
async fn convergence(addrs: &[String]) -> Verdict {
    let mut v = Verdict {
        ok: true,
        checked: 0,
        problems: vec![],
    };
    let log = match LogClient::new(addrs.to_vec()) {
        Ok(l) => l,
        Err(e) => {
            v.ok = false;
            v.problems.push(e.to_string());
            return v;
        }
    };
    let deadline = Instant::now() + CONVERGE_WITHIN;
    let mut last = String::new();
    loop {
        let mut heads = Vec::new();
        for a in addrs {
            match log.node(a).chain_heads(pb::ChainHeadsRequest {}).await {
                Ok(r) => heads.push(
                    r.into_inner()
                        .heads
                        .into_iter()
                        .map(|h| (h.generation_id, h.frontier, h.head))
                        .collect::<Vec<_>>(),
                ),
                Err(e) => last = format!("{a}: {e}"),
            }
        }
        if heads.len() == addrs.len() && heads.windows(2).all(|w| w[0] == w[1]) {
            v.checked = heads[0].len();
            break;
        }
        if Instant::now() > deadline {
            v.ok = false;
            v.problems.push(format!(
                "chain heads differ between nodes after {CONVERGE_WITHIN:?} ({last})"
            ));
            return v;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    digests_agree(&log, addrs, deadline, &mut v).await;
    for a in addrs {
        match log.node(a).verify(pb::VerifyRequest {}).await {
            Ok(r) => {
                for p in r.into_inner().problems {
                    v.fail(format!("{a}: {p}"));
                }
            }
            Err(e) => v.fail(format!("{a}: verify failed: {e}")),
        }
    }
    v
}

/// Asks every node for its state digest (all at once, again and again) until all report one
/// applied index; every pair seen at one index must agree.
async fn digests_agree(log: &LogClient, addrs: &[String], deadline: Instant, v: &mut Verdict) {
    // applied index -> (node, digest) first seen there
    let mut seen: BTreeMap<u64, (String, Vec<u8>)> = BTreeMap::new();
    let mut flagged = false;
    loop {
        let answers = futures::future::join_all(addrs.iter().map(|a| {
            let mut c = log.node(a);
            async move { (a.clone(), c.state_digest(pb::StateDigestRequest {}).await) }
        }))
        .await;
        let mut indexes = Vec::new();
        for (a, r) in answers {
            let Ok(r) = r else { continue };
            let d = r.into_inner();
            indexes.push(d.applied_index);
            match seen.get(&d.applied_index) {
                Some((other, digest)) if *digest != d.digest && !flagged => {
                    flagged = true;
                    v.fail(format!(
                        "{a} and {other} applied the same {} entries but hold different states (state digests differ)",
                        d.applied_index
                    ));
                }
                Some(_) => {}
                None => {
                    seen.insert(d.applied_index, (a, d.digest));
                }
            }
        }
        if indexes.len() == addrs.len() && indexes.windows(2).all(|w| w[0] == w[1]) {
            v.checked += addrs.len();
            return;
        }
        if Instant::now() > deadline {
            v.fail(format!(
                "the nodes never reported one applied index within {CONVERGE_WITHIN:?} (last: {indexes:?}); their states could not be compared"
            ));
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
