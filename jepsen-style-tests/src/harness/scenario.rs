//! Deterministic scenarios: one scripted fault per failure point of CONTRACT §8 (1-6, a planned
//! handoff; 7-12; 15, stages), on the same real cluster
//! as the seeded runs, with the same checkers, plus the expectations the contract states for each
//! point: the surviving owner is unambiguous, the new owner's committed and cache frontiers are
//! as expected, the client's observed prefix is preserved, no stale epoch wrote anything, and
//! the client's tokens are those of an uninterrupted run of the same request (a second request
//! with the same prompt and seed, run after the fault on the healed cluster: exact resume).
//!
//! Each scenario runs one request (80 tokens; fake model at 15 ms a step, or with
//! `real_model` SmolLM2 in exact mode) that decoder 1 owns
//! (decoder 2 is started, warm, once the first token is visible). The fault strikes at seq 20:
//! through a decoder failpoint (`TOKENLOG_FAILPOINTS`, see `tokenlog_decoder::failpoint`) for
//! points 7 and 10, by the harness once the client has seen 20 events (seqs 0-19) for the
//! others. In the handoff scenarios (1-6) decoders 1 and 2 take handoffs and decoder 3 does
//! not: the harness drains decoder 1 (SIGTERM) into decoder 2, and a failpoint of one side
//! ends it (or drops the commit's answer) at the point's phase; decoder 3 takes over whatever
//! nobody holds any more. All along
//! (failure point 11) a second client polls the request's status on alternating gateways,
//! re-submits the same request id, and asks for an id nobody submitted: every answer must name
//! the one generation (or not-found for the unknown id), and the cluster must end with exactly
//! one generation.

mod expect;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokenlog_proto::raftlog as tpb_log;
use tokenlog_proto::tokenlog as tpb;
use tokenlog_proto::tokenlog::generation_client::GenerationClient;
use tonic::transport::Channel;

use super::workload::{self, transient, Progress, RequestRecord, Routing};
use super::{conclude, now_us, start_cluster, Cluster, Plant, RunConfig, RunSummary, DRAIN_MS};
use expect::expectations;

/// Tokens of the scenario's request.
pub const MAX_TOKENS: u32 = 80;
/// The seq at which the fault strikes.
pub const FAULT_SEQ: u32 = 20;
/// How long a scenario's request may take, fault included (then it is judged unfinished).
pub const SCENARIO_TIMEOUT: Duration = Duration::from_secs(90);
/// What a request's client may take past its time: its last stream read's own timeout.
const CLIENT_SLACK: Duration = Duration::from_secs(30);
/// How long the delayed append of failure point 10 is held (several leases).
pub const DELAY_MS: u64 = 2_500;
/// With the real model, decoder 1's least time per step (failpoint `min-step-ms`): 80 tokens
/// take at least 4.8 s, time for the decoders started after it to load SmolLM2 and register.
const REAL_MODEL_STEP_MS_MIN: u64 = 60;
/// How long the harness-made faults last.
const FAULT_HOLD: Duration = Duration::from_millis(2_000);
/// How long the leader is cut off from both followers. The owner's calls hang on the cut-off
/// leader until the partition heals or a call's own timeout (`CALL_TIMEOUT` of the log client,
/// 5 s) sends them elsewhere: held past that, the owner's lease lapses at the new leader and the
/// other decoder takes the generation over while the old leader still takes appends. With 2 s
/// the heal came first on a fast machine, the owner kept its lease, and the planted early
/// visibility went unnoticed (what the old leader showed was later written the same).
const MINORITY_LEADER_HOLD: Duration = Duration::from_millis(7_000);
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
    /// then continued: its next write must be rejected (failpoint deaf-to-lost-renewals: its
    /// append, not its renewer, is what meets the fence first).
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
    /// 12: the leader is cut off from both followers for 7 s, who elect another (network
    /// namespaces).
    LeaderInMinorityPartition,
    /// 12: a follower loses its data dir and rejoins.
    NodeLosesDisk,
    /// 12: every node is killed at once, then all restarted.
    RestartAll,
    /// 15: decoder 1 is a pipeline head over 3 stages (real model); its middle stage is killed
    /// (SIGKILL): a cold spare registered in the log is spliced in, the generation stays with
    /// its head.
    StageDies,
    /// 15: the head's middle stage is paused (SIGSTOP) for 2 s, past its registration: it is
    /// spliced out by the lapsed registration, the generation stays with its head.
    StagePaused,
    /// 15: the pipeline head itself is killed (SIGKILL): the whole decoder takes the
    /// generation over and continues it exactly.
    HeadDies,
    /// 15 with 12: the log's Raft leader is killed (SIGKILL) under a pipeline head and its
    /// stages (whose fences and registrations need the log), then restarted: the stages wait
    /// for the new leader; no stage is spliced out and the generation stays with its head.
    PipelineLeaderCrash,
    /// 15 with 12: the log's Raft leader is paused (SIGSTOP) for 2 s under a pipeline (calls
    /// to it hang instead of being refused, renewals among them): a splice or a takeover may
    /// follow; the checkers and the uninterrupted run judge the generation.
    PipelineLeaderPause,
    /// 1: decoder 1, drained into decoder 2, exits while copying (failpoint): the attempt is
    /// aborted, another decoder takes the generation over.
    SourceDiesCopying,
    /// 2: decoder 2, the destination, exits before receiver-ready (failpoint): the attempt is
    /// aborted, the source keeps its cache and releases it at the drain's end.
    DestinationDiesBeforeReady,
    /// 3: the destination exits after receiver-ready, before the ownership commit (failpoint).
    DestinationDiesAfterReady,
    /// 4: the ownership commit's answer to the destination is lost (failpoint): it asks the log,
    /// which says it owns the generation, and continues it at the handoff epoch.
    CommitAnswerLost,
    /// 5: the destination exits after the ownership commit, before its answer reaches the
    /// source (failpoint): the source learns the outcome from the log; another decoder takes
    /// the generation over from the destination.
    DestinationDiesAfterCommit,
    /// 6: the source exits during its release, after the commit (failpoint): the destination
    /// owns the generation; the attempt stays `ownership_committed`.
    SourceDiesBeforeRelease,
}

impl Scenario {
    pub const ALL: [Scenario; 21] = [
        Scenario::SourceDiesCopying,
        Scenario::DestinationDiesBeforeReady,
        Scenario::DestinationDiesAfterReady,
        Scenario::CommitAnswerLost,
        Scenario::DestinationDiesAfterCommit,
        Scenario::SourceDiesBeforeRelease,
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
        Scenario::StageDies,
        Scenario::StagePaused,
        Scenario::HeadDies,
        Scenario::PipelineLeaderCrash,
        Scenario::PipelineLeaderPause,
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
            Scenario::StageDies => "stage-dies",
            Scenario::StagePaused => "stage-paused",
            Scenario::HeadDies => "head-dies",
            Scenario::PipelineLeaderCrash => "pipeline-leader-crash",
            Scenario::PipelineLeaderPause => "pipeline-leader-pause",
            Scenario::SourceDiesCopying => "source-dies-copying",
            Scenario::DestinationDiesBeforeReady => "destination-dies-before-ready",
            Scenario::DestinationDiesAfterReady => "destination-dies-after-ready",
            Scenario::CommitAnswerLost => "commit-answer-lost",
            Scenario::DestinationDiesAfterCommit => "destination-dies-after-commit",
            Scenario::SourceDiesBeforeRelease => "source-dies-before-release",
        }
    }

    /// The failure point of CONTRACT §8 it covers (11 is covered by every scenario).
    pub fn point(self) -> u8 {
        match self {
            Scenario::DecoderDiesAfterSample => 7,
            Scenario::GatewayDiesAfterSend => 8,
            Scenario::PausedOwnerWritesAfterTakeover => 9,
            Scenario::DelayedAppendFromOldOwner => 10,
            Scenario::StageDies
            | Scenario::StagePaused
            | Scenario::HeadDies
            | Scenario::PipelineLeaderCrash
            | Scenario::PipelineLeaderPause => 15,
            Scenario::SourceDiesCopying => 1,
            Scenario::DestinationDiesBeforeReady => 2,
            Scenario::DestinationDiesAfterReady => 3,
            Scenario::CommitAnswerLost => 4,
            Scenario::DestinationDiesAfterCommit => 5,
            Scenario::SourceDiesBeforeRelease => 6,
            _ => 12,
        }
    }

    /// Whether the scenario is a planned handoff's (points 1-6).
    pub fn is_handoff(self) -> bool {
        self.point() <= 6
    }

    /// Whether decoder 1 runs as a pipeline head over stage processes (the real model).
    pub fn needs_pipeline(self) -> bool {
        self.point() == 15
    }

    pub fn needs_netns(self) -> bool {
        matches!(self, Scenario::MinorityPartition | Scenario::LeaderInMinorityPartition)
    }

    /// Decoder 1's failpoints (its first incarnation).
    fn failpoints(self) -> Option<String> {
        match self {
            Scenario::DecoderDiesAfterSample => Some(format!("exit-after-sample={FAULT_SEQ}")),
            Scenario::DelayedAppendFromOldOwner => Some(format!("delay-append={FAULT_SEQ}:{DELAY_MS}")),
            Scenario::SourceDiesCopying => Some("handoff-exit=source-copying".into()),
            Scenario::SourceDiesBeforeRelease => Some("handoff-exit=source-before-release".into()),
            // The continued owner's append, not its renewer, is what must meet the fence.
            Scenario::PausedOwnerWritesAfterTakeover => Some("deaf-to-lost-renewals=1".into()),
            _ => None,
        }
    }

    /// Decoder 2's failpoints (its first incarnation: the handoff's destination).
    fn destination_failpoints(self) -> Option<String> {
        match self {
            Scenario::DestinationDiesBeforeReady => Some("handoff-exit=destination-before-ready".into()),
            Scenario::DestinationDiesAfterReady => Some("handoff-exit=destination-after-ready".into()),
            Scenario::CommitAnswerLost => Some("commit-answer-lost=1".into()),
            Scenario::DestinationDiesAfterCommit => Some("handoff-exit=destination-after-commit".into()),
            _ => None,
        }
    }

    /// Whether decoder 1's own failpoint strikes (at seq 20) rather than the harness.
    fn strikes_itself(self) -> bool {
        matches!(
            self,
            Scenario::DecoderDiesAfterSample | Scenario::DelayedAppendFromOldOwner
        )
    }

    /// The handoff attempt's last phase in the log (handoff scenarios).
    fn handoff_phase(self) -> Option<tokenlog_proto::raftlog::HandoffPhase> {
        use tokenlog_proto::raftlog::HandoffPhase as P;
        Some(match self.point() {
            1..=3 => P::Aborted,
            4 | 5 => P::SourceReleased,
            6 => P::OwnershipCommitted,
            _ => return None,
        })
    }

    /// Whether an owner change must happen.
    fn takes_over(self) -> bool {
        matches!(
            self,
            Scenario::DecoderDiesAfterSample
                | Scenario::PausedOwnerWritesAfterTakeover
                | Scenario::DelayedAppendFromOldOwner
                | Scenario::HeadDies
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
        if i.is_multiple_of(3) {
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
        if i.is_multiple_of(5) {
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

/// The cluster of a scenario: no seeded faults or clients, decoder 1 alone at first.
fn scenario_config(bin: PathBuf, out: PathBuf, sc: Scenario, opts: Options) -> RunConfig {
    let mut cfg = RunConfig::new(bin, out, u64::from(sc.point()));
    cfg.plant = opts.plant;
    cfg.real_model = opts.real_model || sc.needs_pipeline();
    cfg.pipeline = sc.needs_pipeline();
    cfg.faults = vec![];
    cfg.clients = 0;
    cfg.step_ms = 15;
    cfg.netns = sc.needs_netns();
    cfg.standby_later = true;
    cfg.decoder1_failpoints = sc.failpoints();
    if cfg.real_model && !sc.needs_pipeline() {
        // On a fast machine SmolLM2 finishes the request (~10 ms a token) before the decoders
        // started after decoder 1 took it have loaded the model: decoder 1 steps no faster
        // than a slow machine's model does (the tokens are the same).
        let slow = format!("min-step-ms={REAL_MODEL_STEP_MS_MIN}");
        cfg.decoder1_failpoints = Some(match cfg.decoder1_failpoints.take() {
            Some(fp) => format!("{fp},{slow}"),
            None => slow,
        });
    }
    if sc.is_handoff() {
        // Decoder 1 is the source, decoder 2 the destination; decoder 3 takes no handoffs and
        // takes over what nobody holds any more.
        cfg.decoders = 3;
        cfg.handoff_listeners = 2;
        cfg.decoder2_failpoints = sc.destination_failpoints();
    }
    // Snapshots every 50 entries: every scenario also runs across snapshot builds and purges.
    cfg.snapshot_every = 50;
    cfg
}

/// Runs one scenario; its report (history, verdicts, timeline, scenario.json) goes to `out`.
pub async fn run(bin: PathBuf, out: PathBuf, sc: Scenario, opts: Options) -> Result<ScenarioReport> {
    let cfg = scenario_config(bin, out, sc, opts);
    eprintln!("scenario {} (failure point {})", sc.name(), sc.point());
    let cluster = start_cluster(&cfg).await?;
    let channel_of = |t| -> Vec<Channel> { cluster.gateway_addrs.iter().map(|a| workload::channel(a, t)).collect() };
    let channels = channel_of(None);
    let req = workload::request("scenario-1", MAX_TOKENS, 0x5eed);

    let (progress_tx, mut progress) = tokio::sync::watch::channel(Progress::default());
    let client = {
        let (channels, req) = (channels.clone(), req.clone());
        tokio::spawn(async move {
            let progress = Some(&progress_tx);
            workload::one_request_within(
                0,
                req,
                &channels,
                &mut Routing::RoundRobin,
                progress,
                None,
                SCENARIO_TIMEOUT,
            )
            .await
        })
    };
    // Decoder 1 owns the request; then the warm standby and the retrier start.
    wait_progress(&mut progress, 1, Duration::from_secs(30)).await?;
    for d in cluster.procs.lock().expect("lock").decoders.iter_mut().skip(1) {
        d.start()?;
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let retrier = tokio::spawn(retrier(channel_of(Some(CALL_TIMEOUT)), req.clone(), stop_rx));

    let (nemesis, killed_gateway, term_before) = harness_fault(sc, &cfg, &cluster, &mut progress).await?;

    let started = Instant::now();
    let rec: RequestRecord = tokio::time::timeout(SCENARIO_TIMEOUT + CLIENT_SLACK, client)
        .await
        .context("the scenario's client did not return")??;
    eprintln!(
        "request ended after {:.1} s more: {} events, {} connections",
        started.elapsed().as_secs_f64(),
        rec.events.len(),
        rec.connections
    );
    if sc.strikes_itself() || sc.is_handoff() {
        wait_old_owner_exit(&cluster).await?;
    }
    let term_after = cluster.log.cluster_status(true).await.map(|s| s.term).ok();
    let handoff = last_handoff(&cluster, rec.generation).await;
    cluster.procs.lock().expect("lock").heal()?;
    let _ = stop_tx.send(true);
    let retrier_log = retrier.await?;
    let generations: u64 = match cluster.log.cluster_status(true).await {
        Ok(st) => st.generations_by_state.values().sum(),
        Err(_) => u64::MAX,
    };
    let reference = uninterrupted(&channels, &req).await?;
    let spliced = std::fs::read_to_string(cfg.out.join("decoder1.log"))
        .unwrap_or_default()
        .matches("spliced a spare in its place")
        .count();
    let reference_tokens = tokens_of(&reference);
    let (summary, ops) = conclude(&cfg, cluster, vec![rec.clone(), reference], nemesis).await?;
    let facts = Facts {
        generations,
        killed_gateway,
        terms: (term_before, term_after),
        spliced,
        handoff,
        reference: reference_tokens,
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

/// The old owner ends its script itself (its delayed message may still be due, or it drains):
/// waits for decoder 1 to exit.
async fn wait_old_owner_exit(cluster: &Cluster) -> Result<()> {
    let deadline = Instant::now() + Duration::from_millis(DELAY_MS.max(DRAIN_MS)) + Duration::from_secs(20);
    while cluster.procs.lock().expect("lock").decoders[0].exited().is_none() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "decoder 1's failpoint or drain never ended it"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The generation's latest handoff attempt as the log has it.
async fn last_handoff(cluster: &Cluster, gen: u64) -> Option<tpb_log::HandoffInfo> {
    cluster
        .log
        .get(tpb_log::GetRequest {
            generation_id: gen,
            linearizable: true,
            ..Default::default()
        })
        .await
        .ok()
        .and_then(|r| r.handoff)
}

/// Runs the scenario's request again under another id (same prompt, seed and sampling) on the
/// healed cluster, without a fault: what the uninterrupted run writes (the checkers judge it
/// as any request; unfinished, its tokens differ from the scenario's).
async fn uninterrupted(channels: &[Channel], req: &tpb::GenerateRequest) -> Result<RequestRecord> {
    let mut again = req.clone();
    again.request_id = format!("{}-uninterrupted", req.request_id);
    let mut routing = Routing::RoundRobin;
    let run = workload::one_request_within(1, again, channels, &mut routing, None, None, SCENARIO_TIMEOUT);
    tokio::time::timeout(SCENARIO_TIMEOUT + CLIENT_SLACK, run)
        .await
        .context("the uninterrupted run's client did not return")
}

/// A request's tokens in seq order (one per seq: the checkers judge duplicates).
fn tokens_of(rec: &RequestRecord) -> Vec<u32> {
    let by_seq: std::collections::BTreeMap<u32, u32> = rec.events.iter().filter(|e| !e.3).map(|e| (e.0, e.1)).collect();
    by_seq.into_values().collect()
}

/// Waits (at most 10 s) until the decoder history at `path` shows an append invoked and answered
/// after `since_us`: the continued old owner's write has met the log (rejected, or accepted if
/// fencing is broken; the expectations judge which). Without this wait the request may already
/// have ended and the run stop before that answer is recorded.
async fn wait_continued_write(path: &std::path::Path, since_us: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        let sent_after: BTreeSet<u64> = lines
            .iter()
            .filter(|v| {
                v["phase"] == "invoke" && v["op"] == "append" && v["invoke_us"].as_u64().is_some_and(|t| t >= since_us)
            })
            .filter_map(|v| v["id"].as_u64())
            .collect();
        let answered = lines
            .iter()
            .any(|v| v["phase"] == "complete" && v["id"].as_u64().is_some_and(|id| sent_after.contains(&id)));
        if answered {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// For the scenarios without a failpoint, strikes the fault once the client has seen seqs
/// 0-19; returns the nemesis records, the killed gateway, and the Raft term just before.
async fn harness_fault(
    sc: Scenario,
    cfg: &RunConfig,
    cluster: &Cluster,
    progress: &mut tokio::sync::watch::Receiver<Progress>,
) -> Result<(Vec<Value>, Option<usize>, Option<u64>)> {
    let mut nemesis = Vec::new();
    let mut killed_gateway = None;
    let mut term_before = None;
    if !sc.strikes_itself() {
        let at = wait_progress(progress, FAULT_SEQ as usize, Duration::from_secs(30)).await?;
        let t0 = now_us();
        term_before = cluster.log.cluster_status(true).await.map(|s| s.term).ok();
        let leader = cluster.leader.lock().expect("lock").unwrap_or(0);
        let follower = (1..3).find(|&i| i != leader).expect("two followers");
        let target = strike(sc, cfg, cluster, at, leader, follower, &mut killed_gateway).await?;
        nemesis
            .push(json!({"op": "nemesis", "fault": sc.name(), "target": target, "start_us": t0, "end_us": now_us()}));
    }
    Ok((nemesis, killed_gateway, term_before))
}

/// Injects and heals the fault of `sc` (`at`: the client's progress at the fault); returns
/// its target's description.
async fn strike(
    sc: Scenario,
    cfg: &RunConfig,
    cluster: &Cluster,
    at: Progress,
    leader: usize,
    follower: usize,
    killed_gateway: &mut Option<usize>,
) -> Result<String> {
    let procs = &cluster.procs;
    Ok(match sc {
        Scenario::GatewayDiesAfterSend => {
            procs.lock().expect("lock").gateways[at.gateway].kill9();
            *killed_gateway = Some(at.gateway);
            format!("gateway{} (streaming to the client)", at.gateway + 1)
        }
        Scenario::PausedOwnerWritesAfterTakeover => {
            procs.lock().expect("lock").decoders[0].pause();
            tokio::time::sleep(Duration::from_millis(cfg.lease_ms * 3)).await;
            // Taken before SIGCONT: the continued process may send its write at once.
            let continued = now_us();
            procs.lock().expect("lock").decoders[0].resume();
            wait_continued_write(&cfg.out.join("decoder1.jsonl"), continued).await;
            "decoder1 (the owner)".into()
        }
        Scenario::LeaderCrash | Scenario::PipelineLeaderCrash => {
            procs.lock().expect("lock").nodes[leader].kill9();
            tokio::time::sleep(FAULT_HOLD).await;
            procs.lock().expect("lock").nodes[leader].start()?;
            format!("node{} (leader)", leader + 1)
        }
        Scenario::LeaderPause | Scenario::PipelineLeaderPause => {
            procs.lock().expect("lock").nodes[leader].pause();
            tokio::time::sleep(FAULT_HOLD).await;
            procs.lock().expect("lock").nodes[leader].resume();
            format!("node{} (leader)", leader + 1)
        }
        Scenario::MinorityPartition | Scenario::LeaderInMinorityPartition => {
            let (lone, hold) = if sc == Scenario::MinorityPartition {
                (follower, FAULT_HOLD)
            } else {
                (leader, MINORITY_LEADER_HOLD)
            };
            {
                let p = procs.lock().expect("lock");
                let net = p.net.as_ref().context("partitions need network namespaces")?;
                for o in (0..3).filter(|&o| o != lone) {
                    net.cut(lone, o)?;
                }
            }
            tokio::time::sleep(hold).await;
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
        Scenario::StageDies => {
            procs.lock().expect("lock").stages[1].kill9();
            tokio::time::sleep(FAULT_HOLD).await;
            procs.lock().expect("lock").stages[1].start()?;
            "s2 (the head's middle stage)".into()
        }
        Scenario::StagePaused => {
            procs.lock().expect("lock").stages[1].pause();
            tokio::time::sleep(FAULT_HOLD).await;
            procs.lock().expect("lock").stages[1].resume();
            "s2 (the head's middle stage)".into()
        }
        Scenario::HeadDies => {
            procs.lock().expect("lock").decoders[0].kill9();
            "decoder1 (the pipeline head)".into()
        }
        Scenario::SourceDiesCopying
        | Scenario::DestinationDiesBeforeReady
        | Scenario::DestinationDiesAfterReady
        | Scenario::CommitAnswerLost
        | Scenario::DestinationDiesAfterCommit
        | Scenario::SourceDiesBeforeRelease => {
            let listed = super::nemesis::wait_takes_handoffs(&cluster.log, "d2-1", Duration::from_secs(30)).await;
            anyhow::ensure!(listed, "d2-1 never registered a handoff listener");
            procs.lock().expect("lock").decoders[0].terminate();
            "decoder1 (drained into decoder2)".into()
        }
        Scenario::DecoderDiesAfterSample | Scenario::DelayedAppendFromOldOwner => unreachable!("failpoints"),
    })
}

/// What the driver saw besides the histories.
#[derive(Clone)]
struct Facts {
    /// Generations in the cluster at the end.
    generations: u64,
    killed_gateway: Option<usize>,
    /// The Raft term just before the fault and after the request ended.
    terms: (Option<u64>, Option<u64>),
    /// Splices the pipeline head logged (a pipeline scenario).
    spliced: usize,
    /// The generation's latest handoff attempt in the log, at the end.
    handoff: Option<tpb_log::HandoffInfo>,
    /// The tokens of the uninterrupted run of the same request.
    reference: Vec<u32>,
}
