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
        gateway_addrs,
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
    // --- every process serving, not only alive
    let mut probe = probe(&procs, &node_addrs, &gateway_addrs, &reqs).await;
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
    let log_gens = log_generations(&log, &node_addrs).await;
    let (decoder_ops, unread) = decoder_ops::read(&dir, cfg.decoders);
    self_exits.extend(procs.lock().expect("lock").stop_all());
    probe.problems.extend(panics(&procs.lock().expect("lock")));
    // A history the checkers could not read whole: they would pass on less than the run did.
    probe.problems.extend(unread);
    // Stop the processes before checking (and before the report).
    drop(procs);

    let verdicts = verdicts(
        cfg,
        &reqs,
        &finals,
        &log_gens,
        &decoder_ops,
        convergence,
        &self_exits,
        &nemesis_records,
        &probe,
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
    log_gens: &[(u64, String)],
    decoder_ops: &[DecoderOp],
    convergence: Verdict,
    self_exits: &[SelfExit],
    nemesis_records: &[Value],
    probe: &checks::Probe,
) -> BTreeMap<String, Verdict> {
    let mut verdicts = BTreeMap::new();
    verdicts.insert("exactly-once".to_string(), checks::exactly_once(reqs, finals, log_gens));
    verdicts.insert("durability".to_string(), checks::durability(reqs, decoder_ops, finals));
    verdicts.insert("fencing".to_string(), checks::fencing(decoder_ops, finals));
    let (lin, _) = checks::linearizability(decoder_ops, finals, Duration::from_secs(20));
    verdicts.insert("linearizability".to_string(), lin);
    verdicts.insert("status".to_string(), checks::status(reqs));
    // The harness detokenizes with the fake model's tokenizer only.
    let fake_tokenizer = (!cfg.real_model)
        .then(|| tokenlog_decoder::fake::fake_tokenizer().ok())
        .flatten();
    verdicts.insert(
        "completion".to_string(),
        checks::completion(reqs, finals, fake_tokenizer.as_ref()),
    );
    verdicts.insert(
        "liveness".to_string(),
        checks::liveness(reqs, nemesis_records, cfg.lease_ms, cfg.unowned_ms_in_force()),
    );
    verdicts.insert("convergence".to_string(), convergence);
    verdicts.insert("lease-time".to_string(), checks::lease_time(decoder_ops, cfg.lease_ms));
    verdicts.insert(
        "processes".to_string(),
        checks::processes(self_exits, cfg.decoder1_failpoints.is_some(), nemesis_records, probe),
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
        hard_paths: super::HardPaths::count(reqs, decoder_ops),
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

/// Whether `e` is the log's not-found answer: from a call (wrapped in the client's error) or from
/// a watch stream that was open when retention pruned the generation (a bare status).
fn is_not_found(e: &anyhow::Error) -> bool {
    let status = match e.downcast_ref::<tokenlog_raftlog::client::ClientError>() {
        Some(tokenlog_raftlog::client::ClientError::Status(s)) => Some(s),
        Some(_) => None,
        None => e.downcast_ref::<tonic::Status>(),
    };
    status.is_some_and(|s| s.code() == tonic::Code::NotFound)
}

/// The committed records of a generation (up to its frontier now), read linearizably.
pub(super) async fn final_gen(log: &LogClient, id: u64) -> Result<FinalGen> {
    let sent = super::now_us();
    let info = log.generation(id).await?;
    let mut out = FinalGen {
        epoch: info.lease.as_ref().map_or(0, |l| l.epoch),
        read_us: (sent, super::now_us()),
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

/// Every generation the final log holds (a node's, once they agree), with its request id.
async fn log_generations(log: &LogClient, addrs: &[String]) -> Vec<(u64, String)> {
    for a in addrs {
        let Ok(r) = log.node(a).chain_heads(pb::ChainHeadsRequest {}).await else {
            continue;
        };
        let mut out = Vec::new();
        for h in r.into_inner().heads {
            if let Ok(info) = log.generation(h.generation_id).await {
                out.push((h.generation_id, info.request_id));
            }
        }
        return out;
    }
    Vec::new()
}

/// How long, after healing, a process may take to answer its probe.
const PROBE_WITHIN: Duration = Duration::from_secs(10);

/// After healing, every process must be serving, not only alive (a process whose server task
/// died would pass for live): each node answers `ClusterStatus` itself and names a leader; each
/// decoder's running incarnation is registered with the log; each gateway answers `Status` of a
/// finished request (found, or pruned by retention: a definite answer either way). Polled for up to [`PROBE_WITHIN`] each.
async fn probe(
    procs: &std::sync::Mutex<super::nemesis::Procs>,
    node_addrs: &[String],
    gateway_addrs: &[String],
    reqs: &[RequestRecord],
) -> checks::Probe {
    let mut p = checks::Probe::default();
    for (i, addr) in node_addrs.iter().enumerate() {
        p.checked += 1;
        let answered = poll(|| async {
            let c = LogClient::new(vec![addr.clone()]).map_err(|e| e.to_string())?;
            let st = c.cluster_status(false).await.map_err(|e| e.to_string())?;
            if st.leader_id == 0 {
                return Err(format!("no leader known ({})", st.state));
            }
            Ok(())
        })
        .await;
        if let Err(e) = answered {
            p.problems.push(format!("node{} ({addr}) does not serve: {e}", i + 1));
        }
    }
    let decoder_ids: Vec<String> = procs
        .lock()
        .expect("lock")
        .decoders
        .iter()
        .enumerate()
        .map(|(i, d)| format!("d{}-{}", i + 1, d.incarnation))
        .collect();
    for id in &decoder_ids {
        p.checked += 1;
        let registered = poll(|| async {
            let c = LogClient::new(node_addrs.to_vec()).map_err(|e| e.to_string())?;
            let models = c.list_models().await.map_err(|e| e.to_string())?;
            if models.models.iter().any(|m| m.decoders.iter().any(|d| d == id)) {
                Ok(())
            } else {
                Err("not registered with the log".to_string())
            }
        })
        .await;
        if let Err(e) = registered {
            p.problems.push(format!("decoder {id} does not serve: {e}"));
        }
    }
    // A pipeline run's stages: each registered with the log again (it serves, and renews).
    let stage_ids: Vec<String> = procs
        .lock()
        .expect("lock")
        .stages
        .iter()
        .map(|s| s.name.clone())
        .collect();
    for id in &stage_ids {
        p.checked += 1;
        let registered = poll(|| async {
            let c = LogClient::new(node_addrs.to_vec()).map_err(|e| e.to_string())?;
            let r = c.list_stages(true).await.map_err(|e| e.to_string())?;
            match r.stages.iter().any(|s| s.stage_id == *id && s.expiry_log_ms > r.log_ms) {
                true => Ok(()),
                false => Err("not registered with the log".to_string()),
            }
        })
        .await;
        if let Err(e) = registered {
            p.problems.push(format!("stage {id} does not serve: {e}"));
        }
    }
    if let Some(r) = reqs.iter().find(|r| r.finished) {
        for (i, addr) in gateway_addrs.iter().enumerate() {
            p.checked += 1;
            let answered = poll(|| async {
                let mut c = tokenlog_proto::tokenlog::generation_client::GenerationClient::new(workload::channel(
                    addr,
                    Some(Duration::from_secs(2)),
                ));
                // A definite answer from the log through the gateway: the request, or that
                // retention pruned it.
                match c
                    .status(tokenlog_proto::tokenlog::StatusRequest {
                        request_id: r.request_id.clone(),
                    })
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(e) if e.code() == tonic::Code::NotFound => Ok(()),
                    Err(e) => Err(e.to_string()),
                }
            })
            .await;
            if let Err(e) = answered {
                p.problems
                    .push(format!("gateway{} ({addr}) does not serve: {e}", i + 1));
            }
        }
    }
    p
}

/// Runs `f` until it succeeds or [`PROBE_WITHIN`] passes; the last error.
async fn poll<F, Fut>(f: F) -> Result<(), String>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let start = Instant::now();
    loop {
        match tokio::time::timeout(Duration::from_secs(3), f()).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) if start.elapsed() >= PROBE_WITHIN => return Err(e),
            Err(_) if start.elapsed() >= PROBE_WITHIN => return Err("no answer within 3 s".into()),
            _ => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// Every panic any process logged (a panicked task may leave its process alive; the binary
/// aborts on a panic, and this catches one that a hook let through).
fn panics(procs: &super::nemesis::Procs) -> Vec<String> {
    let mut out = Vec::new();
    for p in procs
        .nodes
        .iter()
        .chain(&procs.gateways)
        .chain(&procs.decoders)
        .chain(&procs.stages)
    {
        for line in p.log_text().lines().filter(|l| l.contains("panicked at")) {
            out.push(format!(
                "{} panicked: {}",
                p.name,
                line.chars().take(300).collect::<String>()
            ));
        }
    }
    out
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

/// The state digests nodes reported, by applied index: the first node's at each index, which
/// every later report at that index must equal.
#[derive(Default)]
struct Digests(BTreeMap<u64, (String, Vec<u8>)>);

impl Digests {
    /// Records `node`'s `digest` at applied `index`; the problem when another node reported a
    /// different one at the same index.
    fn observe(&mut self, node: &str, index: u64, digest: Vec<u8>) -> Option<String> {
        match self.0.get(&index) {
            Some((other, d)) if *d != digest => Some(format!(
                "{node} and {other} applied the same {index} entries but hold different states (state digests differ)"
            )),
            Some(_) => None,
            None => {
                self.0.insert(index, (node.to_string(), digest));
                None
            }
        }
    }
}

/// Asks every node for its state digest (all at once, again and again) until all report one
/// applied index; every pair seen at one index must agree.
async fn digests_agree(log: &LogClient, addrs: &[String], deadline: Instant, v: &mut Verdict) {
    let mut seen = Digests::default();
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
            if let Some(p) = seen.observe(&a, d.applied_index, d.digest) {
                if !flagged {
                    flagged = true;
                    v.fail(p);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Convergence's core: two nodes at one applied index with different digests diverge;
    /// different indexes are not compared (one is behind).
    #[test]
    fn digests_at_one_applied_index_must_agree() {
        let mut d = Digests::default();
        assert!(d.observe("n1", 10, vec![1]).is_none());
        assert!(d.observe("n2", 10, vec![1]).is_none());
        assert!(d.observe("n3", 9, vec![2]).is_none(), "behind: not compared");
        let p = d.observe("n3", 10, vec![2]).expect("a diverging node");
        assert!(p.contains("n3 and n1") && p.contains("state digests differ"), "{p}");
    }

    use tokenlog_raftlog::client::ClientError;

    #[test]
    fn not_found_is_recognised_from_a_call_and_from_a_watch_stream() {
        let pruned = || tonic::Status::not_found("generation 46 was pruned");
        assert!(is_not_found(&anyhow::Error::from(ClientError::Status(pruned()))));
        // A watch stream opened before retention pruned the generation ends with a bare status.
        assert!(is_not_found(&anyhow::Error::from(pruned())));
        assert!(!is_not_found(&anyhow::Error::from(tonic::Status::unavailable(
            "no leader"
        ))));
        assert!(!is_not_found(&anyhow::Error::from(ClientError::BadAddress(
            "x".into(),
            "y".into()
        ))));
        assert!(!is_not_found(&anyhow::anyhow!("not found")));
    }
}
