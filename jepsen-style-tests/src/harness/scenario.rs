//! Deterministic scenarios: one scripted fault per failure point of CONTRACT §8 that exists in
//! the code (7-12; 1-6 belong to the handoff protocol, not built yet), on the same real cluster
//! as the seeded runs, with the same checkers, plus the expectations the contract states for each
//! point: the surviving owner is unambiguous, the new owner's committed and cache frontiers are
//! as expected, the client's observed prefix is preserved, and no stale epoch wrote anything.
//!
//! Each scenario runs one request (80 tokens; fake model at 15 ms a step, or with
//! `real_model` SmolLM2 in exact mode) that decoder 1 owns
//! (decoder 2 is started, warm, once the first token is visible). The fault strikes at seq 20:
//! through a decoder failpoint (`TOKENLOG_FAILPOINTS`, see `tokenlog_decoder::failpoint`) for
//! points 7 and 10, by the harness once the client has seen 20 events (seqs 0-19) for the
//! others. All along
//! (failure point 11) a second client polls the request's status on alternating gateways,
//! re-submits the same request id, and asks for an id nobody submitted: every answer must name
//! the one generation (or not-found for the unknown id), and the cluster must end with exactly
//! one generation.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokenlog_proto::tokenlog as tpb;
use tokenlog_proto::tokenlog::generation_client::GenerationClient;
use tonic::transport::Channel;

use super::workload::{self, transient, Progress, RequestRecord, Routing};
use super::{conclude, now_us, start_cluster, Plant, RunConfig, RunSummary};

/// Tokens of the scenario's request.
pub const MAX_TOKENS: u32 = 80;
/// The seq at which the fault strikes.
pub const FAULT_SEQ: u32 = 20;
/// How long a scenario's request may take, fault included.
pub const SCENARIO_TIMEOUT: Duration = Duration::from_secs(90);
/// How long the delayed append of failure point 10 is held (several leases).
pub const DELAY_MS: u64 = 2_500;
/// How long the harness-made faults last.
const FAULT_HOLD: Duration = Duration::from_millis(2_000);
/// Bound on each of the retrier's calls.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// The retrier's period.
const RETRY_EVERY: Duration = Duration::from_millis(40);
/// Decoder ids are `d<i>-<incarnation>`.
const OWNER: &str = "d1-1";

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// 7: the owner exits right after sampling seq 20, before sending it (failpoint).
    DecoderDiesAfterSample,
    /// 8: the gateway streaming to the client is killed (SIGKILL) once the client received
    /// seqs 0-19 (the gateway may have sent more).
    GatewayDiesAfterSend,
    /// 9: the owner is paused (SIGSTOP) past its lease once the client received seqs 0-19,
    /// then continued: its next write must be rejected.
    PausedOwnerWritesAfterTakeover,
    /// 10: the owner's append carrying seq 20 is held 2.5 s (renewals stop), then arrives after
    /// another decoder took over (failpoint).
    DelayedAppendFromOldOwner,
    /// 12: the Raft leader is killed (SIGKILL) and restarted.
    LeaderCrash,
    /// 12: the Raft leader is paused (SIGSTOP) for 2 s.
    LeaderPause,
    /// 12: a follower is cut off from both other nodes for 2 s (network namespaces).
    MinorityPartition,
    /// 12: the leader is cut off from both followers, who elect another (network namespaces).
    LeaderInMinorityPartition,
    /// 12: a follower loses its data dir and rejoins.
    NodeLosesDisk,
    /// 12: every node is killed at once, then all restarted.
    RestartAll,
}

impl Scenario {
    pub const ALL: [Scenario; 10] = [
        Scenario::DecoderDiesAfterSample,
        Scenario::GatewayDiesAfterSend,
        Scenario::PausedOwnerWritesAfterTakeover,
        Scenario::DelayedAppendFromOldOwner,
        Scenario::LeaderCrash,
        Scenario::LeaderPause,
        Scenario::MinorityPartition,
        Scenario::LeaderInMinorityPartition,
        Scenario::NodeLosesDisk,
        Scenario::RestartAll,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::DecoderDiesAfterSample => "decoder-dies-after-sample",
            Scenario::GatewayDiesAfterSend => "gateway-dies-after-send",
            Scenario::PausedOwnerWritesAfterTakeover => "paused-owner-writes-after-takeover",
            Scenario::DelayedAppendFromOldOwner => "delayed-append-from-old-owner",
            Scenario::LeaderCrash => "leader-crash",
            Scenario::LeaderPause => "leader-pause",
            Scenario::MinorityPartition => "minority-partition",
            Scenario::LeaderInMinorityPartition => "leader-in-minority-partition",
            Scenario::NodeLosesDisk => "node-loses-disk",
            Scenario::RestartAll => "restart-all",
        }
    }

    /// The failure point of CONTRACT §8 it covers (11 is covered by every scenario).
    pub fn point(self) -> u8 {
        match self {
            Scenario::DecoderDiesAfterSample => 7,
            Scenario::GatewayDiesAfterSend => 8,
            Scenario::PausedOwnerWritesAfterTakeover => 9,
            Scenario::DelayedAppendFromOldOwner => 10,
            _ => 12,
        }
    }

    pub fn needs_netns(self) -> bool {
        matches!(self, Scenario::MinorityPartition | Scenario::LeaderInMinorityPartition)
    }

    fn failpoints(self) -> Option<String> {
        match self {
            Scenario::DecoderDiesAfterSample => Some(format!("exit-after-sample={FAULT_SEQ}")),
            Scenario::DelayedAppendFromOldOwner => Some(format!("delay-append={FAULT_SEQ}:{DELAY_MS}")),
            _ => None,
        }
    }

    /// Whether an owner change must happen.
    fn takes_over(self) -> bool {
        matches!(
            self,
            Scenario::DecoderDiesAfterSample
                | Scenario::PausedOwnerWritesAfterTakeover
                | Scenario::DelayedAppendFromOldOwner
        )
    }
}

/// How to run a scenario.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// A planted bug (to show that the scenario catches it).
    pub plant: Option<Plant>,
    /// Decoders on the real SmolLM2 model (exact resume) instead of the fake one.
    pub real_model: bool,
}

/// One expectation of a scenario and whether it held.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Expectation {
    pub what: String,
    pub ok: bool,
    pub detail: String,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ScenarioReport {
    pub scenario: Scenario,
    pub point: u8,
    pub ok: bool,
    pub summary: RunSummary,
    pub expectations: Vec<Expectation>,
    pub retrier: RetrierLog,
}

impl ScenarioReport {
    /// One line: verdicts, expectations, what bit.
    pub fn line(&self) -> String {
        let failed: Vec<&str> = self
            .expectations
            .iter()
            .filter(|e| !e.ok)
            .map(|e| e.what.as_str())
            .chain(
                self.summary
                    .verdicts
                    .iter()
                    .filter(|(_, v)| !v.ok)
                    .map(|(k, _)| k.as_str()),
            )
            .collect();
        format!(
            "point {} {}: {} | {} expectations, {} checkers{} | {} resumes, {} takeovers, {} fence rejections, {} leader changes | retrier: {} status, {} re-submits, {} unknown-id reads, {:.0} s",
            self.point,
            self.scenario.name(),
            if self.ok { "ok" } else { "FAIL" },
            self.expectations.len(),
            self.summary.verdicts.len(),
            if failed.is_empty() { String::new() } else { format!(", failed: {}", failed.join(", ")) },
            self.summary.resumes,
            self.summary.takeovers,
            self.summary.fence_rejections,
            self.summary.leader_changes,
            self.retrier.status_ok,
            self.retrier.submits_ok,
            self.retrier.unknown_queries,
            self.summary.seconds
        )
    }
}

/// What the retrier (failure point 11) did and saw.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RetrierLog {
    pub status_ok: u64,
    pub submits_ok: u64,
    /// Calls that failed with a transient error (a node or gateway down): allowed.
    pub transient_errors: u64,
    /// Every generation id an answer named.
    pub generations: BTreeSet<u64>,
    /// Answers that are wrong: the request not found, refused, or an unknown id found.
    pub wrong: Vec<String>,
    pub unknown_queries: u64,
}

/// Status reads, re-submits and unknown-id reads until `stop`, alternating gateways.
async fn retrier(
    channels: Vec<Channel>,
    req: tpb::GenerateRequest,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> RetrierLog {
    let mut log = RetrierLog::default();
    let mut i = 0usize;
    while !*stop.borrow() {
        i += 1;
        let mut c = GenerationClient::new(channels[i % channels.len()].clone());
        match c
            .status(tpb::StatusRequest {
                request_id: req.request_id.clone(),
            })
            .await
        {
            Ok(st) => {
                log.status_ok += 1;
                log.generations.insert(st.into_inner().generation);
            }
            Err(e) if transient(e.code()) => log.transient_errors += 1,
            Err(e) => log.wrong.push(format!("status: {e}")),
        }
        if i % 3 == 0 {
            match c.generate(req.clone()).await {
                Ok(s) => {
                    let mut s = s.into_inner();
                    match tokio::time::timeout(CALL_TIMEOUT, s.message()).await {
                        Ok(Ok(Some(ev))) => {
                            log.submits_ok += 1;
                            log.generations.insert(ev.generation);
                        }
                        Ok(Err(e)) if transient(e.code()) => log.transient_errors += 1,
                        Err(_) => log.transient_errors += 1,
                        Ok(Err(e)) => log.wrong.push(format!("re-submit stream: {e}")),
                        Ok(Ok(None)) => log.wrong.push("re-submit: the stream ended without an event".into()),
                    }
                }
                Err(e) if transient(e.code()) => log.transient_errors += 1,
                Err(e) => log.wrong.push(format!("re-submit: {e}")),
            }
        }
        if i % 5 == 0 {
            log.unknown_queries += 1;
            match c
                .status(tpb::StatusRequest {
                    request_id: "never-submitted".into(),
                })
                .await
            {
                Err(e) if e.code() == tonic::Code::NotFound => {}
                Err(e) if transient(e.code()) => log.transient_errors += 1,
                Ok(st) => log.wrong.push(format!(
                    "an id nobody submitted has generation {}",
                    st.into_inner().generation
                )),
                Err(e) => log.wrong.push(format!("unknown id: {e}")),
            }
        }
        tokio::select! {
            r = stop.changed() => if r.is_err() { break },
            _ = tokio::time::sleep(RETRY_EVERY) => {}
        }
    }
    log
}

async fn wait_progress(
    rx: &mut tokio::sync::watch::Receiver<Progress>,
    events: usize,
    within: Duration,
) -> Result<Progress> {
    let p = tokio::time::timeout(within, rx.wait_for(|p| p.events >= events))
        .await
        .with_context(|| format!("the client did not see {events} events within {within:?}"))?
        .context("client gone")?;
    Ok(*p)
}

/// Runs one scenario; its report (history, verdicts, timeline, scenario.json) goes to `out`.
pub async fn run(bin: PathBuf, out: PathBuf, sc: Scenario, opts: Options) -> Result<ScenarioReport> {
    let mut cfg = RunConfig::new(bin, out, u64::from(sc.point()));
    cfg.plant = opts.plant;
    cfg.real_model = opts.real_model;
    cfg.faults = vec![];
    cfg.clients = 0;
    cfg.step_ms = 15;
    cfg.netns = sc.needs_netns();
    cfg.standby_later = true;
    cfg.decoder1_failpoints = sc.failpoints();
    eprintln!("scenario {} (failure point {})", sc.name(), sc.point());
    let cluster = start_cluster(&cfg).await?;
    let channel_of = |t| -> Vec<Channel> { cluster.gateway_addrs.iter().map(|a| workload::channel(a, t)).collect() };
    let channels = channel_of(None);
    let req = workload::request("scenario-1", MAX_TOKENS, 0x5eed);

    let (progress_tx, mut progress) = tokio::sync::watch::channel(Progress::default());
    let client = {
        let (channels, req) = (channels.clone(), req.clone());
        tokio::spawn(async move {
            workload::one_request(0, req, &channels, &mut Routing::RoundRobin, Some(&progress_tx)).await
        })
    };
    // Decoder 1 owns the request; then the warm standby and the retrier start.
    wait_progress(&mut progress, 1, Duration::from_secs(30)).await?;
    for d in cluster.procs.lock().expect("lock").decoders.iter_mut().skip(1) {
        d.start()?;
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let retrier = tokio::spawn(retrier(channel_of(Some(CALL_TIMEOUT)), req.clone(), stop_rx));

    let mut nemesis = Vec::new();
    let mut killed_gateway = None;
    let mut term_before = None;
    if sc.failpoints().is_none() {
        let at = wait_progress(&mut progress, FAULT_SEQ as usize, Duration::from_secs(30)).await?;
        let t0 = now_us();
        term_before = cluster.log.cluster_status(true).await.map(|s| s.term).ok();
        let leader = cluster.leader.lock().expect("lock").unwrap_or(0);
        let follower = (1..3).find(|&i| i != leader).expect("two followers");
        let target = {
            let procs = &cluster.procs;
            match sc {
                Scenario::GatewayDiesAfterSend => {
                    procs.lock().expect("lock").gateways[at.gateway].kill9();
                    killed_gateway = Some(at.gateway);
                    format!("gateway{} (streaming to the client)", at.gateway + 1)
                }
                Scenario::PausedOwnerWritesAfterTakeover => {
                    procs.lock().expect("lock").decoders[0].pause();
                    tokio::time::sleep(Duration::from_millis(cfg.lease_ms * 3)).await;
                    procs.lock().expect("lock").decoders[0].resume();
                    "decoder1 (the owner)".into()
                }
                Scenario::LeaderCrash => {
                    procs.lock().expect("lock").nodes[leader].kill9();
                    tokio::time::sleep(FAULT_HOLD).await;
                    procs.lock().expect("lock").nodes[leader].start()?;
                    format!("node{} (leader)", leader + 1)
                }
                Scenario::LeaderPause => {
                    procs.lock().expect("lock").nodes[leader].pause();
                    tokio::time::sleep(FAULT_HOLD).await;
                    procs.lock().expect("lock").nodes[leader].resume();
                    format!("node{} (leader)", leader + 1)
                }
                Scenario::MinorityPartition | Scenario::LeaderInMinorityPartition => {
                    let lone = if sc == Scenario::MinorityPartition {
                        follower
                    } else {
                        leader
                    };
                    {
                        let p = procs.lock().expect("lock");
                        let net = p.net.as_ref().context("partitions need network namespaces")?;
                        for o in (0..3).filter(|&o| o != lone) {
                            net.cut(lone, o)?;
                        }
                    }
                    tokio::time::sleep(FAULT_HOLD).await;
                    if let Some(net) = &procs.lock().expect("lock").net {
                        net.heal()?;
                    }
                    format!("node{} | the other two", lone + 1)
                }
                Scenario::NodeLosesDisk => {
                    {
                        let mut p = procs.lock().expect("lock");
                        p.nodes[follower].kill9();
                        let _ = std::fs::remove_dir_all(&p.node_dirs[follower]);
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    procs.lock().expect("lock").nodes[follower].start()?;
                    format!("node{} (a follower)", follower + 1)
                }
                Scenario::RestartAll => {
                    procs.lock().expect("lock").nodes.iter_mut().for_each(|n| n.kill9());
                    tokio::time::sleep(Duration::from_millis(800)).await;
                    let mut p = procs.lock().expect("lock");
                    for n in p.nodes.iter_mut() {
                        n.start()?;
                    }
                    "all nodes".into()
                }
                Scenario::DecoderDiesAfterSample | Scenario::DelayedAppendFromOldOwner => unreachable!("failpoints"),
            }
        };
        nemesis
            .push(json!({"op": "nemesis", "fault": sc.name(), "target": target, "start_us": t0, "end_us": now_us()}));
    }

    let started = Instant::now();
    let rec: RequestRecord = tokio::time::timeout(SCENARIO_TIMEOUT, client)
        .await
        .context("the scenario's request did not end in time")??;
    eprintln!(
        "request ended after {:.1} s more: {} events, {} connections",
        started.elapsed().as_secs_f64(),
        rec.events.len(),
        rec.connections
    );
    if sc.failpoints().is_some() {
        // The old owner ends its script itself (its delayed message may still be due).
        let deadline = Instant::now() + Duration::from_millis(DELAY_MS) + Duration::from_secs(20);
        while cluster.procs.lock().expect("lock").decoders[0].exited().is_none() {
            anyhow::ensure!(Instant::now() < deadline, "decoder 1's failpoint never ended it");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let term_after = cluster.log.cluster_status(true).await.map(|s| s.term).ok();
    cluster.procs.lock().expect("lock").heal()?;
    let _ = stop_tx.send(true);
    let retrier_log = retrier.await?;
    let generations: u64 = match cluster.log.cluster_status(true).await {
        Ok(st) => st.generations_by_state.values().sum(),
        Err(_) => u64::MAX,
    };
    let (summary, ops) = conclude(&cfg, cluster, vec![rec.clone()], nemesis).await?;
    let facts = Facts {
        generations,
        killed_gateway,
        terms: (term_before, term_after),
    };
    let expectations = expectations(sc, &rec, &ops, &retrier_log, &facts);
    let report = ScenarioReport {
        scenario: sc,
        point: sc.point(),
        ok: summary.ok && expectations.iter().all(|e| e.ok),
        summary,
        expectations,
        retrier: retrier_log,
    };
    std::fs::write(cfg.out.join("scenario.json"), serde_json::to_string_pretty(&report)?)?;
    Ok(report)
}

fn expect(out: &mut Vec<Expectation>, what: &str, ok: bool, detail: String) {
    out.push(Expectation {
        what: what.into(),
        ok,
        detail,
    });
}

fn gen_ops<'a>(ops: &'a [Value], gen: u64, op: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    ops.iter()
        .filter(move |o| o["op"] == op && o["gen"].as_u64() == Some(gen))
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// What the driver saw besides the histories.
#[derive(Clone, Copy)]
struct Facts {
    /// Generations in the cluster at the end.
    generations: u64,
    killed_gateway: Option<usize>,
    /// The Raft term just before the fault and after the request ended.
    terms: (Option<u64>, Option<u64>),
}

fn expectations(
    sc: Scenario,
    rec: &RequestRecord,
    ops: &[Value],
    retrier: &RetrierLog,
    facts: &Facts,
) -> Vec<Expectation> {
    let Facts {
        generations,
        killed_gateway,
        terms,
    } = *facts;
    let mut out = Vec::new();
    let gen = rec.generation;
    let tokens: Vec<(u32, u32, u64)> = rec.events.iter().filter(|e| !e.3).map(|e| (e.0, e.1, e.2)).collect();
    expect(
        &mut out,
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

    // Failure point 11.
    expect(
        &mut out,
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

    // The surviving owner is unambiguous: the last record's epoch was granted to one decoder,
    // and every record from the first one written at that epoch on carries it.
    let last_epoch = tokens.last().map_or(0, |t| t.2);
    let grants: BTreeSet<String> = gen_ops(ops, gen, "acquire")
        .filter(|o| o["ok"] == true && u(&o["epoch"]) == last_epoch)
        .map(|o| o["decoder"].as_str().unwrap_or("?").to_string())
        .collect();
    let first_at = tokens.iter().position(|t| t.2 == last_epoch).unwrap_or(0);
    expect(
        &mut out,
        "the surviving owner is unambiguous",
        grants.len() == 1 && tokens[first_at..].iter().all(|t| t.2 == last_epoch),
        format!("final epoch {last_epoch} granted to {grants:?}, written from seq {first_at}"),
    );

    // Frontiers of every owner at its resume. Committed = the acquire's frontier, and that is no
    // less than any frontier acknowledged to an earlier owner before the acquire was invoked
    // (nothing acknowledged is lost) and exactly where the owner's first append starts; exact
    // mode replayed all of it (sampled = fed = committed; KV = prompt + committed).
    let mut frontier_problems = Vec::new();
    let resumed: Vec<&Value> = gen_ops(ops, gen, "resumed").collect();
    for r in &resumed {
        let acquire = gen_ops(ops, gen, "acquire")
            .find(|a| a["ok"] == true && a["decoder"] == r["decoder"] && a["epoch"] == r["epoch"]);
        let acknowledged = acquire.map_or(0, |a| {
            gen_ops(ops, gen, "append")
                .filter(|x| x["ok"] == true && u(&x["epoch"]) < u(&r["epoch"]))
                .filter(|x| u(&x["complete_us"]) < u(&a["invoke_us"]))
                .map(|x| u(&x["frontier"]))
                .max()
                .unwrap_or(0)
        });
        let first_append = gen_ops(ops, gen, "append")
            .find(|x| x["decoder"] == r["decoder"] && x["epoch"] == r["epoch"])
            .map(|x| u(&x["start_seq"]));
        let (c, s, f, kv, p) = (
            u(&r["committed"]),
            u(&r["sampled"]),
            u(&r["fed"]),
            u(&r["kv"]),
            u(&r["prompt_len"]),
        );
        let acquired = acquire.map(|a| u(&a["frontier"]));
        let ok = acquired == Some(c)
            && c >= acknowledged
            && first_append.is_none_or(|st| st == c)
            && s == c
            && f == c
            && kv == p + c;
        if !ok {
            frontier_problems.push(format!(
                "{} epoch {}: acquire frontier {acquired:?}, acknowledged before it {acknowledged}, first append at {first_append:?}, committed {c}, sampled {s}, fed {f}, kv {kv}, prompt {p}",
                r["decoder"], r["epoch"]
            ));
        }
    }
    let takeovers = resumed.iter().filter(|r| u(&r["epoch"]) > 1).count();
    expect(
        &mut out,
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

    // No stale epoch wrote anything: no append accepted from a decoder after a higher epoch was
    // granted (the fencing and linearizability checkers judge the whole history; this names it).
    let mut stale_accepted = Vec::new();
    for a in gen_ops(ops, gen, "append").filter(|a| a["ok"] == true) {
        let newer = gen_ops(ops, gen, "acquire")
            .filter(|g| g["ok"] == true && u(&g["epoch"]) > u(&a["epoch"]))
            .any(|g| u(&g["complete_us"]) < u(&a["invoke_us"]));
        if newer {
            stale_accepted.push(format!(
                "{} epoch {} start {}",
                a["decoder"], a["epoch"], a["start_seq"]
            ));
        }
    }
    expect(
        &mut out,
        "no append at a superseded epoch was accepted",
        stale_accepted.is_empty(),
        format!("{stale_accepted:?}"),
    );

    let event_at = |seq: u32| tokens.iter().find(|t| t.0 == seq).copied();
    let fired = ops
        .iter()
        .find(|o| o["op"] == "failpoint" && o["decoder"] == OWNER && u(&o["gen"]) == gen);
    let owner_appends = || gen_ops(ops, gen, "append").filter(|a| a["decoder"] == OWNER);
    let carries = |a: &Value, seq: u64| u(&a["start_seq"]) <= seq && seq < u(&a["start_seq"]) + u(&a["n"]);
    let seq = u64::from(FAULT_SEQ);
    match sc {
        Scenario::DecoderDiesAfterSample => {
            let sampled = fired.map(|f| (u(&f["seq"]), f["token"].as_u64()));
            let sent = owner_appends().filter(|a| carries(a, seq)).count();
            let shown = event_at(FAULT_SEQ);
            expect(
                &mut out,
                "the owner died after sampling seq 20 and never sent it; the new owner re-sampled the same token at a higher epoch",
                sampled.map(|s| s.0) == Some(seq)
                    && sent == 0
                    && shown.is_some_and(|(_, t, e)| e > 1 && sampled.and_then(|s| s.1) == Some(u64::from(t))),
                format!("failpoint {sampled:?}, appends carrying it {sent}, seen (seq, token, epoch) {shown:?}"),
            );
        }
        Scenario::GatewayDiesAfterSend => {
            expect(
                &mut out,
                "the client's gateway was killed mid-stream and the client resumed on the other",
                killed_gateway.is_some() && rec.connections >= 2,
                format!("killed {killed_gateway:?}, {} connections", rec.connections),
            );
        }
        Scenario::PausedOwnerWritesAfterTakeover | Scenario::DelayedAppendFromOldOwner => {
            let granted = gen_ops(ops, gen, "acquire")
                .filter(|g| g["ok"] == true && u(&g["epoch"]) > 1)
                .map(|g| u(&g["complete_us"]))
                .min();
            let late: Vec<String> = owner_appends()
                .filter(|a| granted.is_some_and(|t| u(&a["invoke_us"]) > t))
                .map(|a| {
                    format!(
                        "epoch {} start {} ok {} current {}",
                        a["epoch"], a["start_seq"], a["ok"], a["current_epoch"]
                    )
                })
                .collect();
            let rejected = owner_appends()
                .filter(|a| granted.is_some_and(|t| u(&a["invoke_us"]) > t))
                .filter(|a| a["ok"] == false && u(&a["current_epoch"]) > u(&a["epoch"]))
                .filter(|a| sc != Scenario::DelayedAppendFromOldOwner || carries(a, seq))
                .count();
            expect(
                &mut out,
                if sc == Scenario::PausedOwnerWritesAfterTakeover {
                    "the continued old owner wrote after the takeover and was rejected"
                } else {
                    "the held append arrived after the takeover and was rejected"
                },
                rejected >= 1 && (sc != Scenario::DelayedAppendFromOldOwner || fired.is_some()),
                format!("takeover at {granted:?}; the old owner's later appends: {late:?}"),
            );
        }
        Scenario::RestartAll => {
            // A node restarting with its own committed vote resumes leadership at its old term
            // (openraft), so a new term is not required here; a serving leader is.
            expect(
                &mut out,
                "a leader serves after every node restarted",
                terms.1.is_some(),
                format!("term before the fault {:?}, after {:?}", terms.0, terms.1),
            );
        }
        Scenario::LeaderCrash | Scenario::LeaderPause | Scenario::LeaderInMinorityPartition => {
            expect(
                &mut out,
                "the cluster elected a leader at a new term",
                matches!(terms, (Some(a), Some(b)) if b > a),
                format!("term before the fault {:?}, after {:?}", terms.0, terms.1),
            );
        }
        Scenario::MinorityPartition | Scenario::NodeLosesDisk => {}
    }
    out
}
