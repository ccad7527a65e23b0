//! The fault harness: a real tokenlog cluster from the built binary (3 log nodes, gateways,
//! fake-model decoders, each its own process on loopback), a concurrent client workload, seeded
//! nemeses, a healing phase, and the checkers of [`checks`] over the recorded history. One run
//! writes `history.jsonl`, `verdicts.json` and `timeline.html` into its output directory.
//!
//! With `netns`, each log node runs in its own network namespace (see [`net`]) and the
//! `partition` nemesis cuts node-to-node traffic with iptables; without it everything shares
//! loopback and partitions are left out. `real_model` runs the decoders on SmolLM2 instead of
//! the fake model. [`scenario`] drives the same cluster through one scripted fault per failure
//! point of CONTRACT §8 instead of the seeded nemesis. Not yet here: the handoff failure points
//! 1-6 (no handoff protocol yet).

pub mod checks;
mod cluster;
pub mod decoder_ops;
mod finish;
pub mod nemesis;
pub mod net;
pub mod procs;
pub mod report;
pub mod scenario;
mod smallfs;
pub mod supervisor;
pub mod workload;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde_json::Value;
use tokenlog_raftlog::client::LogClient;

use checks::Verdict;
pub use cluster::start_cluster;
pub use finish::conclude;
pub use nemesis::Fault;

pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The decoder's failpoint variable (read by the `tokenlog` binary, built with the `faults` feature; this crate does not
/// link the model code).
pub const FAILPOINTS_ENV: &str = "TOKENLOG_FAILPOINTS";
/// How a decoder's failpoint ends it (`tokenlog_decoder::worker::HALT_EXIT_CODE`, as a kill).
pub const FAILPOINT_EXIT: i32 = 137;

/// A test-only bug switched on in the processes, which the checkers must catch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum Plant {
    /// Log nodes accept appends and renewals without the epoch fence (TOKENLOG_PLANT_NO_FENCE=1).
    NoFence,
    /// Log nodes acknowledge appends before the WAL is synced, and keep unsynced WAL data in
    /// the process, so kill -9 acts as a power cut (TOKENLOG_PLANT_ACK_BEFORE_FSYNC=1).
    AckBeforeFsync,
    /// Log nodes' Watch shows records of proposed, uncommitted appends
    /// (TOKENLOG_PLANT_EARLY_VISIBILITY=1).
    EarlyVisibility,
    /// The leader stamps log time with its wall clock as it is, unbounded
    /// (TOKENLOG_PLANT_UNBOUNDED_CLOCK=1; issue 11 bug 5). Caught with the `clock` nemesis.
    UnboundedClock,
    /// A decoder whose model step fails keeps renewing its leases and keeps running
    /// (TOKENLOG_PLANT_ZOMBIE_DECODER=1; issue 11 bug 1). Caught with the `model-error` nemesis.
    Zombie,
    /// Node 3's apply records decoder registrations 1 ms later than the other replicas do
    /// (TOKENLOG_PLANT_DIVERGE=1 on node 3 only): every hash chain agrees, the states differ.
    /// Caught by convergence (the whole-state digest).
    Diverge,
    /// Tick never fails a generation with records that nobody owns
    /// (TOKENLOG_PLANT_NO_UNOWNED_DEADLINE=1; issue 11 bug 3): once every decoder is gone its
    /// clients wait, and it continues when decoders return, past its deadline. Caught by
    /// liveness with the `decoders-down` nemesis.
    NoUnownedDeadline,
    /// Decoder 1's step loop stops for ever after a few appends while its leases are renewed
    /// (TOKENLOG_PLANT_STALLED_WORKER=1 on decoder 1): a live process with a dead worker. The
    /// decoder's stall watchdog ends it (`processes`: it ended on its own); without the
    /// watchdog, the probes (it is no longer registered) and liveness would.
    StalledWorker,
    /// A handoff source (decoder 1) frees its KV cache once exported, before the log released
    /// the generation (TOKENLOG_PLANT_SOURCE_FREES_EARLY=1 on decoder 1): an attempt that does
    /// not move it leaves the source without its cache. Caught by the handoff scenarios whose
    /// attempt aborts (`destination-dies-before-ready`, `destination-dies-after-ready`): the
    /// source's kept cache and the output against the uninterrupted run.
    SourceFreesEarly,
    /// A handoff destination decodes before the log committed its ownership
    /// (TOKENLOG_PLANT_EARLY_HANDOFF_WRITE=1 on every decoder): its appends at the handoff epoch
    /// come before its grant. Caught by `fencing` (an append at an epoch before its grant) in
    /// the handoff scenarios that reach receiver-ready.
    EarlyHandoffWrite,
    /// A hot standby whose generation's owner died appends at the epoch it last saw, without
    /// acquiring (TOKENLOG_PLANT_STANDBY_EARLY_WRITE=1 on every decoder). Caught by `fencing`
    /// (an append at an epoch never granted to it) in `standby-takes-over`.
    StandbyEarlyWrite,
}

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub bin: PathBuf,
    pub out: PathBuf,
    pub seed: u64,
    /// The fault window; the workload runs through it, then the healing phase.
    pub time: Duration,
    pub faults: Vec<Fault>,
    pub clients: usize,
    pub decoders: usize,
    pub gateways: usize,
    pub max_tokens: (u32, u32),
    pub plant: Option<Plant>,
    /// Decoder lease (ms) and fake-model step delay (ms).
    pub lease_ms: u64,
    pub step_ms: u64,
    /// Log nodes in network namespaces (partitions possible); needs root.
    pub netns: bool,
    /// Decoders run the real SmolLM2 model (and gateways its tokenizer) instead of the fake.
    pub real_model: bool,
    /// Decoder 1 is a pipeline head over 3 stage processes (layers 0..10, 10..20, 20..30, each
    /// registered in the log) with 3 cold spares; the other decoders run the whole model. Needs
    /// `real_model`; the stage nemeses (`Fault::PIPELINE`) need it.
    pub pipeline: bool,
    /// `TOKENLOG_FAILPOINTS` for decoder 1's first incarnation (scenarios).
    pub decoder1_failpoints: Option<String>,
    /// Nodes build a snapshot (and purge the log behind it) every this many entries: small
    /// values put snapshot install, restart from a snapshot and catch-up under the nemeses.
    pub snapshot_every: u64,
    /// Start only decoder 1 with the cluster; the scenario starts the others (so that decoder 1
    /// owns the first generation).
    pub standby_later: bool,
    /// How long nodes keep finished generations (`--retention-ms`).
    pub retention_ms: u64,
    /// What gateways bind as a generation's unowned deadline (`--unowned-ms`; 0: the log's
    /// default).
    pub unowned_ms: u64,
    /// Log entries a node keeps behind its snapshot (`--keep-after-snapshot`; `None`: the
    /// node's default, 1,000): small values make a node that lags or lost its data catch up by
    /// snapshot install rather than from the log.
    pub keep_after_snapshot: Option<u64>,
    /// The decoders' stall limit (`--stall-ms`): well above the longest a log call may take
    /// under the nemeses (a retry budget of 15 s), below the default of 120 s so that a stuck
    /// worker ends within a run.
    pub stall_ms: u64,
    /// The shares of requests that may end at EOS and that their client cancels
    /// (`workload::EOS_SHARE`, `workload::CANCEL_SHARE` by default).
    pub eos_share: f64,
    pub cancel_share: f64,
    /// Hot standby: each decoder follows up to this many generations of the others
    /// (`--standby`); 0: none.
    pub standby: usize,
    /// The first this many decoders take planned handoffs (`--handoff-listen`, and
    /// `--drain-ms` [`DRAIN_MS`]: SIGTERM drains them into each other); 0: none.
    pub handoff_listeners: usize,
    /// `TOKENLOG_FAILPOINTS` for decoder 2's first incarnation (a handoff destination's
    /// failpoint), whose failpoint exit is then no crash.
    pub decoder2_failpoints: Option<String>,
}

/// How long a decoder that takes handoffs drains on SIGTERM in a run (`--drain-ms`).
pub const DRAIN_MS: u64 = 3_000;

impl RunConfig {
    pub fn new(bin: PathBuf, out: PathBuf, seed: u64) -> Self {
        RunConfig {
            bin,
            out,
            seed,
            time: Duration::from_secs(20),
            faults: Fault::ALL.to_vec(),
            clients: 4,
            decoders: 2,
            gateways: 2,
            max_tokens: (20, 80),
            plant: None,
            lease_ms: tokenlog_raftlog::limits::LEASE_MS_DEFAULT,
            step_ms: 10,
            netns: false,
            real_model: false,
            pipeline: false,
            decoder1_failpoints: None,
            snapshot_every: 500,
            standby_later: false,
            retention_ms: tokenlog_raftlog::limits::RETENTION_MS_DEFAULT,
            unowned_ms: 0,
            keep_after_snapshot: None,
            stall_ms: 30_000,
            eos_share: workload::EOS_SHARE,
            cancel_share: workload::CANCEL_SHARE,
            standby: 0,
            handoff_listeners: 0,
            decoder2_failpoints: None,
        }
    }

    /// The unowned deadline generations of this run carry (ms).
    pub fn unowned_ms_in_force(&self) -> u64 {
        if self.unowned_ms == 0 {
            tokenlog_raftlog::limits::UNOWNED_MS_DEFAULT
        } else {
            self.unowned_ms
        }
    }

    /// A stress configuration drawn from the seed (issue 11): snapshots every 20-500 entries
    /// with 0-50 entries kept behind them (a node that lags or lost its data installs one),
    /// retention 2-5 s (finished generations pruned while the run goes on), leases of
    /// 300-2,000 ms, an unowned deadline of 3-6 s, a model step of 1-10 ms, so snapshot build and install, pruning, lease
    /// edges and ownerless generations ending happen many times per run; in half the seeds the
    /// decoders are hot standbys of each other's generations (`--standby 4`), so a killed or
    /// paused owner is taken over from a followed state under the same nemeses. Returns what it
    /// drew, for the run's summary.
    pub fn stress(&mut self) -> String {
        use rand::{Rng, SeedableRng};
        // A stream of its own (the seed mixed by splitmix64), so the nemesis schedule of a seed
        // does not change with it.
        let mut z = self.seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let mut rng = rand::rngs::StdRng::seed_from_u64(z ^ (z >> 31));
        self.snapshot_every = rng.random_range(20..=500);
        self.retention_ms = rng.random_range(2_000..=5_000);
        self.lease_ms = rng.random_range(300..=2_000);
        self.unowned_ms = rng.random_range(3_000..=6_000);
        let keep = rng.random_range(0..=50);
        self.keep_after_snapshot = Some(keep);
        // A model step from 1 ms (faster than an append's round trip: the decoder's window of
        // appends fills, and appends carry several tokens) to 10 ms.
        self.step_ms = [1, 2, 3, 5, 10][rng.random_range(0..5)];
        // Drawn last: the draws above stay what they were for every seed.
        self.standby = [0, 4][rng.random_range(0..2)];
        format!(
            "snapshot every {} entries (keeping {keep} behind it), retention {} ms, lease {} ms, unowned deadline {} ms, step {} ms, standby {}",
            self.snapshot_every, self.retention_ms, self.lease_ms, self.unowned_ms, self.step_ms, self.standby
        )
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct RunSummary {
    pub seed: u64,
    pub ok: bool,
    pub verdicts: BTreeMap<String, Verdict>,
    pub requests: usize,
    pub tokens_seen: usize,
    pub resumes: u64,
    pub takeovers: u64,
    pub fence_rejections: u64,
    pub leader_changes: u64,
    /// Generations retention pruned before the end of the run (checked against the log as read
    /// right after their last event).
    pub pruned: u64,
    /// Snapshots followers installed from a leader (counted in the nodes' logs).
    pub snapshots_installed: u64,
    /// `corrupt` faults after which the node refused to start (the rest hit nothing it reads).
    pub corruptions_detected: u64,
    /// Restarts the `supervised` nemesis's supervisor made.
    pub supervisor_restarts: u64,
    pub faults: BTreeMap<String, u64>,
    pub decoder_ops: usize,
    /// How often the run reached the paths that are hard to get right.
    pub hard_paths: HardPaths,
    pub seconds: f64,
}

/// Counts of the hard paths a run reached (issue 12 item 6): a run where they are zero proves
/// little about them.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HardPaths {
    /// Decoder calls whose answer never came (the decoder killed or cut off with it in flight).
    pub indeterminate_ops: u64,
    /// Accepted appends that carried more than one record.
    pub multi_token_appends: u64,
    /// Appends that re-sent records an earlier append of the same decoder had sent.
    pub overlapping_resends: u64,
    /// Requests their client cancelled that ended "cancelled".
    pub cancels: u64,
    /// Requests that ended at EOS ("stop").
    pub eos_endings: u64,
}

impl HardPaths {
    pub fn count(reqs: &[workload::RequestRecord], decoder_ops: &[decoder_ops::DecoderOp]) -> HardPaths {
        let mut h = HardPaths::default();
        // Per (decoder incarnation, generation): the end of the records sent so far.
        let mut sent_to: std::collections::HashMap<(&str, u64), u64> = std::collections::HashMap::new();
        for o in decoder_ops {
            if matches!(o.op(), "acquire" | "append" | "release" | "finish") && o.ok().is_none() {
                h.indeterminate_ops += 1;
            }
            let Some((start, n)) = o.records() else { continue };
            if o.ok() == Some(true) && n > 1 {
                h.multi_token_appends += 1;
            }
            let end = sent_to.entry((o.decoder.as_str(), o.gen())).or_insert(0);
            if start < *end && n > 0 {
                h.overlapping_resends += 1;
            }
            *end = (*end).max(start + n);
        }
        for r in reqs.iter().filter(|r| r.finished) {
            h.cancels += u64::from(r.finish_reason == "cancelled" && r.cancel_sent_us.is_some());
            h.eos_endings += u64::from(r.finish_reason == "stop");
        }
        h
    }

    /// The names of the counts that are zero.
    pub fn zero(&self) -> Vec<&'static str> {
        [
            ("indeterminate ops", self.indeterminate_ops),
            ("multi-token appends", self.multi_token_appends),
            ("overlapping re-sends", self.overlapping_resends),
            ("cancels", self.cancels),
            ("EOS endings", self.eos_endings),
        ]
        .into_iter()
        .filter(|&(_, n)| n == 0)
        .map(|(k, _)| k)
        .collect()
    }
}

/// Parses `all`, `none`, or a comma-separated list of fault names.
pub fn parse_faults(s: &str) -> Result<Vec<Fault>> {
    match s {
        "all" => Ok(Fault::ALL.to_vec()),
        "none" | "" => Ok(vec![]),
        _ => s
            .split(',')
            .map(|n| {
                Fault::ALL
                    .into_iter()
                    .chain(Fault::PIPELINE)
                    .chain(Fault::HANDOFF)
                    .find(|f| f.name() == n.trim())
                    .with_context(|| {
                        format!(
                            "unknown fault {n:?}; known: {}; in a pipeline run {}; with handoffs and standbys {}",
                            Fault::ALL.map(|f| f.name()).join(", "),
                            Fault::PIPELINE.map(|f| f.name()).join(", "),
                            Fault::HANDOFF.map(|f| f.name()).join(", ")
                        )
                    })
            })
            .collect(),
    }
}

/// One line per run: verdicts (with how many items each checked) and how much the faults bit.
pub fn summary_line(s: &RunSummary) -> String {
    let verdicts: Vec<String> = s
        .verdicts
        .iter()
        .map(|(k, v)| format!("{k} {} ({})", if v.ok { "ok" } else { "FAIL" }, v.checked))
        .collect();
    let faults: Vec<String> = s.faults.iter().map(|(k, n)| format!("{k}x{n}")).collect();
    format!(
        "seed {}: {} | {} requests, {} tokens seen, {} resumes, {} takeovers, {} fence rejections, {} leader changes, {} pruned, {} snapshots installed, {} corruptions detected, {} supervisor restarts, faults [{}], {} decoder ops ({} indeterminate, {} multi-token appends, {} overlapping re-sends), {} cancels, {} EOS endings, {:.0} s",
        s.seed,
        verdicts.join(", "),
        s.requests,
        s.tokens_seen,
        s.resumes,
        s.takeovers,
        s.fence_rejections,
        s.leader_changes,
        s.pruned,
        s.snapshots_installed,
        s.corruptions_detected,
        s.supervisor_restarts,
        faults.join(" "),
        s.decoder_ops,
        s.hard_paths.indeterminate_ops,
        s.hard_paths.multi_token_appends,
        s.hard_paths.overlapping_resends,
        s.hard_paths.cancels,
        s.hard_paths.eos_endings,
        s.seconds
    )
}

/// A started cluster: its processes, addresses, and the leader watcher.
pub struct Cluster {
    pub procs: Arc<Mutex<nemesis::Procs>>,
    pub node_addrs: Vec<String>,
    pub gateway_addrs: Vec<String>,
    pub log: LogClient,
    /// The current leader's index (0-based), when known.
    pub leader: Arc<Mutex<Option<usize>>>,
    /// The faults the run may use (partition left out without network namespaces).
    pub faults: Vec<Fault>,
    leader_changes: Arc<Mutex<Vec<Value>>>,
    /// Each finished request's generation as read from the log right after its last event: what
    /// the checkers use for a generation that retention pruned before the end of the run.
    pub at_finish: checks::AtFinish,
    stop_watcher: tokio::sync::watch::Sender<bool>,
    watcher: tokio::task::JoinHandle<()>,
    started: Instant,
}

/// Runs one seeded test and writes its report into `cfg.out`.
pub async fn run(cfg: &RunConfig) -> Result<RunSummary> {
    let cluster = start_cluster(cfg).await?;
    let records = Arc::new(Mutex::new(Vec::new()));
    let (stop_new_tx, stop_new_rx) = tokio::sync::watch::channel(false);
    let mut clients = Vec::new();
    for i in 0..cfg.clients {
        clients.push(tokio::spawn(workload::client_loop(
            i,
            cluster.gateway_addrs.clone(),
            cfg.seed,
            cfg.max_tokens,
            (cfg.eos_share, cfg.cancel_share),
            stop_new_rx.clone(),
            records.clone(),
            // Only a retention shorter than the default can prune a generation before the end.
            (cfg.retention_ms < tokenlog_raftlog::limits::RETENTION_MS_DEFAULT)
                .then(|| (cluster.log.clone(), cluster.at_finish.clone())),
        )));
    }
    eprintln!(
        "run seed {}: {} s of faults {:?}",
        cfg.seed,
        cfg.time.as_secs(),
        cluster.faults.iter().map(|f| f.name()).collect::<Vec<_>>()
    );
    let nemesis_records = nemesis::run(
        cluster.procs.clone(),
        cluster.faults.clone(),
        cfg.seed,
        cfg.time,
        cluster.leader.clone(),
    )
    .await?;

    // --- heal, then every started request must finish
    eprintln!("healing: every process up; waiting for the clients' last requests");
    cluster.procs.lock().expect("lock").heal()?;
    let _ = stop_new_tx.send(true);
    for c in clients {
        let _ = c.await;
    }
    let reqs: Vec<workload::RequestRecord> = records.lock().expect("lock").clone();
    let (summary, _) = conclude(cfg, cluster, reqs, nemesis_records).await?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::decoder_ops::{DecoderOp, OpKind};
    use super::*;
    use tokenlog_decoder::history::{Answer, Call};

    fn append(d: &str, start_seq: u32, n: u32, ok: Option<bool>) -> DecoderOp {
        DecoderOp {
            decoder: d.into(),
            invoke_us: 0,
            complete_us: ok.map(|_| 1),
            kind: OpKind::Call {
                call: Call::Append {
                    gen: 1,
                    epoch: 1,
                    start_seq,
                    n,
                    finish: false,
                },
                answer: ok.map(|ok| Answer::Append {
                    ok: Some(ok),
                    frontier: start_seq + n,
                    current_epoch: 1,
                    reason: None,
                    terminal: false,
                }),
            },
        }
    }

    #[test]
    fn hard_paths_are_counted() {
        let ops = [
            append("d1", 0, 1, Some(true)),
            append("d1", 1, 2, None),
            // The stream broke: re-sent from the acknowledged frontier, overlapping.
            append("d1", 1, 3, Some(true)),
            // Another decoder's first append of the generation is no re-send.
            append("d2", 2, 1, Some(true)),
        ];
        let h = HardPaths::count(&[], &ops);
        assert_eq!(
            (h.indeterminate_ops, h.multi_token_appends, h.overlapping_resends),
            (1, 1, 1),
            "{h:?}"
        );
        assert_eq!(h.zero(), vec!["cancels", "EOS endings"]);
    }
}
