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
pub mod nemesis;
pub mod net;
pub mod procs;
pub mod report;
pub mod scenario;
pub mod workload;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

use checks::{FinalGen, Verdict};
pub use nemesis::Fault;
use procs::{free_port, wait_for_port, Proc, Role};

pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The decoder's failpoint variable (`tokenlog_decoder::failpoint::ENV`; this crate does not
/// link the model code).
pub const FAILPOINTS_ENV: &str = "TOKENLOG_FAILPOINTS";

/// A test-only bug switched on in the processes, which the checkers must catch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum Plant {
    /// Log nodes accept appends without the epoch fence (TOKENLOG_PLANT_NO_FENCE=1).
    NoFence,
    /// Log nodes acknowledge appends before the WAL is synced, and keep unsynced WAL data in
    /// the process, so kill -9 acts as a power cut (TOKENLOG_PLANT_ACK_BEFORE_FSYNC=1).
    AckBeforeFsync,
    /// Log nodes' Watch shows records of proposed, uncommitted appends
    /// (TOKENLOG_PLANT_EARLY_VISIBILITY=1).
    EarlyVisibility,
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
    /// `TOKENLOG_FAILPOINTS` for decoder 1's first incarnation (scenarios).
    pub decoder1_failpoints: Option<String>,
    /// Start only decoder 1 with the cluster; the scenario starts the others (so that decoder 1
    /// owns the first generation).
    pub standby_later: bool,
}

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
            lease_ms: 800,
            step_ms: 10,
            netns: false,
            real_model: false,
            decoder1_failpoints: None,
            standby_later: false,
        }
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
    pub faults: BTreeMap<String, u64>,
    pub decoder_ops: usize,
    pub seconds: f64,
}

/// Parses `all`, `none`, or a comma-separated list of fault names.
pub fn parse_faults(s: &str) -> Result<Vec<Fault>> {
    match s {
        "all" => Ok(Fault::ALL.to_vec()),
        "none" | "" => Ok(vec![]),
        _ => s
            .split(',')
            .map(|n| {
                Fault::ALL.into_iter().find(|f| f.name() == n.trim()).with_context(|| {
                    format!(
                        "unknown fault {n:?}; known: {}",
                        Fault::ALL.map(|f| f.name()).join(", ")
                    )
                })
            })
            .collect(),
    }
}

/// One line per run: verdicts and how much the faults bit.
pub fn summary_line(s: &RunSummary) -> String {
    let verdicts: Vec<String> = s
        .verdicts
        .iter()
        .map(|(k, v)| format!("{k} {}", if v.ok { "ok" } else { "FAIL" }))
        .collect();
    let faults: Vec<String> = s.faults.iter().map(|(k, n)| format!("{k}x{n}")).collect();
    format!(
        "seed {}: {} | {} requests, {} tokens seen, {} resumes, {} takeovers, {} fence rejections, {} leader changes, faults [{}], {} decoder ops, {:.0} s",
        s.seed,
        verdicts.join(", "),
        s.requests,
        s.tokens_seen,
        s.resumes,
        s.takeovers,
        s.fence_rejections,
        s.leader_changes,
        faults.join(" "),
        s.decoder_ops,
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
            stop_new_rx.clone(),
            records.clone(),
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

/// Starts the processes of `cfg` (decoder 1 only when `cfg.standby_later`) and the leader
/// watcher; returns once the nodes and gateways listen and a decoder has registered.
pub async fn start_cluster(cfg: &RunConfig) -> Result<Cluster> {
    let started = Instant::now();
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("{}", cfg.out.display()))?;
    let dir = cfg.out.clone();
    let bin = &cfg.bin;
    anyhow::ensure!(
        bin.exists(),
        "no tokenlog binary at {} (cargo build --workspace)",
        bin.display()
    );
    // --- the cluster
    let net = if cfg.netns {
        Some(net::Netns::create(3).context("making network namespaces")?)
    } else {
        None
    };
    let node_addrs: Vec<String> = match &net {
        Some(n) => n.ips.iter().map(|ip| format!("{ip}:7001")).collect(),
        None => (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect(),
    };
    let mut faults = cfg.faults.clone();
    if net.is_none() && faults.contains(&Fault::Partition) {
        eprintln!("partition left out: it needs --netns");
        faults.retain(|f| *f != Fault::Partition);
    }
    let peers = node_addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let cluster = node_addrs.join(",");
    let mut nodes = Vec::new();
    let mut node_dirs = Vec::new();
    for (i, a) in node_addrs.iter().enumerate() {
        let d = dir.join(format!("node{}-data", i + 1));
        // A fresh cluster: data left by an earlier run in the same directory is not ours.
        let _ = std::fs::remove_dir_all(&d);
        let args = vec![
            "node".into(),
            "--id".into(),
            (i + 1).to_string(),
            "--listen".into(),
            a.clone(),
            "--data-dir".into(),
            d.display().to_string(),
            "--peers".into(),
            peers.clone(),
            "--heartbeat-ms".into(),
            "50".into(),
            "--election-min-ms".into(),
            "300".into(),
            "--election-max-ms".into(),
            "600".into(),
            "--snapshot-every".into(),
            "500".into(),
        ];
        let mut p = match &net {
            // `ip netns exec NS tokenlog ...` execs tokenlog in place: the pid is the node's.
            Some(n) => {
                let mut full = n.exec_prefix(i);
                full.push(bin.display().to_string());
                full.extend(args);
                Proc::new(
                    &format!("node{}", i + 1),
                    Role::Node,
                    std::path::Path::new("ip"),
                    full,
                    &dir,
                )
            }
            None => Proc::new(&format!("node{}", i + 1), Role::Node, bin, args, &dir),
        };
        match cfg.plant {
            Some(Plant::NoFence) => p = p.env("TOKENLOG_PLANT_NO_FENCE", "1"),
            Some(Plant::AckBeforeFsync) => p = p.env("TOKENLOG_PLANT_ACK_BEFORE_FSYNC", "1"),
            Some(Plant::EarlyVisibility) => p = p.env("TOKENLOG_PLANT_EARLY_VISIBILITY", "1"),
            None => {}
        }
        p.ready_addr = Some(a.clone());
        nodes.push(p);
        node_dirs.push(d);
    }
    let mut decoders = Vec::new();
    for i in 0..cfg.decoders {
        let model: Vec<String> = if cfg.real_model {
            vec!["--threads".into(), "1".into()]
        } else {
            vec!["--fake".into(), "--fake-step-ms".into(), cfg.step_ms.to_string()]
        };
        let args = [
            vec!["decoder".to_string()],
            model,
            vec![
                "--lease-ms".into(),
                cfg.lease_ms.to_string(),
                "--capacity".into(),
                "4".into(),
                "--decoder-id".into(),
                format!("d{}-{{inc}}", i + 1),
                "--history".into(),
                dir.join(format!("decoder{}.jsonl", i + 1)).display().to_string(),
                "--cluster".into(),
                cluster.clone(),
            ],
        ]
        .concat();
        let mut p = Proc::new(&format!("decoder{}", i + 1), Role::Decoder, bin, args, &dir);
        if i == 0 {
            if let Some(fp) = &cfg.decoder1_failpoints {
                p = p.first_env(FAILPOINTS_ENV, fp);
            }
        }
        decoders.push(p);
    }
    let mut gateways = Vec::new();
    let mut gateway_addrs = Vec::new();
    for i in 0..cfg.gateways {
        let grpc = format!("127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{}", free_port());
        let mut args: Vec<String> = vec!["gateway".into()];
        if !cfg.real_model {
            args.push("--fake".into());
        }
        args.extend([
            "--cluster".into(),
            cluster.clone(),
            "--grpc-listen".into(),
            grpc.clone(),
            "--http-listen".into(),
            http,
        ]);
        let mut p = Proc::new(&format!("gateway{}", i + 1), Role::Gateway, bin, args, &dir);
        p.ready_addr = Some(grpc.clone());
        gateways.push(p);
        gateway_addrs.push(grpc);
    }
    let first_decoders = if cfg.standby_later { 1 } else { decoders.len() };
    for p in nodes
        .iter_mut()
        .chain(gateways.iter_mut())
        .chain(decoders.iter_mut().take(first_decoders))
    {
        p.start()?;
    }
    for p in nodes.iter().chain(gateways.iter()) {
        wait_for_port(p.ready_addr.as_deref().expect("set"), Duration::from_secs(30))?;
    }
    let log = LogClient::new(node_addrs.clone())?;
    wait_for_model(&log).await?;
    let procs = Arc::new(Mutex::new(nemesis::Procs {
        net,
        nodes,
        node_dirs,
        gateways,
        decoders,
    }));

    // --- leader watcher
    let leader = Arc::new(Mutex::new(None::<usize>));
    let leader_changes = Arc::new(Mutex::new(Vec::<Value>::new()));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let watcher = {
        let (leader, changes, mut stop) = (leader.clone(), leader_changes.clone(), stop_rx.clone());
        // One client per node (each asks only its own node), made once.
        let clients = node_addrs
            .iter()
            .map(|a| LogClient::with_budget(vec![a.clone()], Duration::from_millis(200)))
            .collect::<Result<Vec<_>, _>>()?;
        tokio::spawn(async move {
            // A leader is counted when it is the first seen at a higher term (a deposed leader
            // that has not noticed yet still answers as leader of its old term).
            let mut last = (0u64, 0u64);
            loop {
                for (i, c) in clients.iter().enumerate() {
                    if let Ok(Ok(st)) =
                        tokio::time::timeout(Duration::from_millis(300), async { c.cluster_status(false).await }).await
                    {
                        if st.leader_id != 0 && st.node_id == st.leader_id && st.term >= last.0 {
                            *leader.lock().expect("lock") = Some(i);
                            if (st.term, st.leader_id) != last {
                                changes.lock().expect("lock").push(
                                    json!({"op": "leader", "node": st.leader_id, "term": st.term, "at_us": now_us()}),
                                );
                                last = (st.term, st.leader_id);
                            }
                        }
                    }
                }
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => return,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
        })
    };
    Ok(Cluster {
        procs,
        node_addrs,
        gateway_addrs,
        log,
        leader,
        faults,
        leader_changes,
        stop_watcher: stop_tx,
        watcher,
        started,
    })
}

/// Stops the leader watcher, reads the final state, stops every process, runs the checkers
/// over `reqs` and the decoders' histories, and writes the report into `cfg.out`. Call it once
/// the cluster is healed and the clients are done. Also returns the decoders' joined history.
pub async fn conclude(
    cfg: &RunConfig,
    cluster: Cluster,
    reqs: Vec<workload::RequestRecord>,
    nemesis_records: Vec<Value>,
) -> Result<(RunSummary, Vec<Value>)> {
    let Cluster {
        procs,
        node_addrs,
        log,
        leader_changes,
        stop_watcher,
        watcher,
        started,
        ..
    } = cluster;
    let dir = cfg.out.clone();
    let _ = stop_watcher.send(true);
    let _ = watcher.await;
    // --- final state
    let mut finals = HashMap::new();
    for r in &reqs {
        if r.generation != 0 && !finals.contains_key(&r.generation) {
            match final_gen(&log, r.generation).await {
                Ok(f) => {
                    finals.insert(r.generation, f);
                }
                // A generation a client saw is gone from the log: the checkers report it.
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(e),
            }
        }
    }
    let convergence = convergence(&node_addrs).await;
    let decoder_ops = read_decoder_histories(&dir, cfg.decoders)?;
    let self_exits = procs.lock().expect("lock").stop_all();
    // Stop the processes before checking (and before the report).
    drop(procs);

    let mut verdicts = BTreeMap::new();
    verdicts.insert("exactly-once".to_string(), checks::exactly_once(&reqs, &finals));
    verdicts.insert("durability".to_string(), checks::durability(&reqs, &finals));
    verdicts.insert("fencing".to_string(), checks::fencing(&decoder_ops, &finals));
    let (lin, _) = checks::linearizability(&decoder_ops, Duration::from_secs(20));
    verdicts.insert("linearizability".to_string(), lin);
    verdicts.insert("status".to_string(), checks::status(&reqs));
    verdicts.insert("liveness".to_string(), checks::liveness(&reqs));
    verdicts.insert("convergence".to_string(), convergence);
    verdicts.insert(
        "processes".to_string(),
        checks::processes(&self_exits, cfg.decoder1_failpoints.is_some()),
    );

    let mut faults = BTreeMap::new();
    for n in &nemesis_records {
        *faults
            .entry(n["fault"].as_str().unwrap_or("?").to_string())
            .or_insert(0) += 1;
    }
    let leader_changes = leader_changes.lock().expect("lock").clone();
    let summary = RunSummary {
        seed: cfg.seed,
        ok: verdicts.values().all(|v| v.ok),
        requests: reqs.len(),
        tokens_seen: reqs.iter().map(|r| r.events.len()).sum(),
        resumes: reqs.iter().map(|r| u64::from(r.connections.saturating_sub(1))).sum(),
        takeovers: decoder_ops
            .iter()
            .filter(|o| o["op"] == "acquire" && o["ok"] == true && o["epoch"].as_u64().unwrap_or(0) > 1)
            .count() as u64,
        fence_rejections: decoder_ops
            .iter()
            .filter(|o| o["op"] == "append" && o["ok"] == false && matches!(o["reason"].as_i64(), Some(1) | Some(2)))
            .count() as u64,
        leader_changes: leader_changes.len().saturating_sub(1) as u64,
        faults,
        decoder_ops: decoder_ops.len(),
        verdicts,
        seconds: started.elapsed().as_secs_f64(),
    };

    // --- report
    let mut history: Vec<Value> = reqs.iter().map(workload::to_json).collect();
    history.extend(nemesis_records.iter().cloned());
    history.extend(leader_changes.iter().cloned());
    history.extend(decoder_ops.iter().cloned());
    let mut lines = String::new();
    for h in &history {
        lines.push_str(&h.to_string());
        lines.push('\n');
    }
    std::fs::write(dir.join("history.jsonl"), lines)?;
    std::fs::write(dir.join("verdicts.json"), serde_json::to_string_pretty(&summary)?)?;
    std::fs::write(
        dir.join("timeline.html"),
        report::timeline(&summary, &reqs, &nemesis_records, &leader_changes, &decoder_ops),
    )?;
    // Node data dirs are large and not part of the report.
    for i in 0..3 {
        let _ = std::fs::remove_dir_all(dir.join(format!("node{}-data", i + 1)));
    }
    Ok((summary, decoder_ops))
}

fn is_not_found(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<tokenlog_raftlog::client::ClientError>(),
        Some(tokenlog_raftlog::client::ClientError::Status(s)) if s.code() == tonic::Code::NotFound
    )
}

async fn wait_for_model(log: &LogClient) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = log.list_models().await {
            if !r.models.is_empty() {
                return Ok(());
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "no decoder registered within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The committed records of a generation (up to its frontier now), read linearizably.
async fn final_gen(log: &LogClient, id: u64) -> Result<FinalGen> {
    let info = log
        .get(pb::GetRequest {
            generation_id: id,
            linearizable: true,
            ..Default::default()
        })
        .await?
        .generation
        .context("no generation")?;
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

/// Waits (up to 30 s) until every node reports the same applied chain heads; then verifies each.
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
    let deadline = Instant::now() + Duration::from_secs(30);
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
            v.problems
                .push(format!("chain heads differ between nodes after 30 s ({last})"));
            return v;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for a in addrs {
        match log.node(a).verify(pb::VerifyRequest {}).await {
            Ok(r) => {
                for p in r.into_inner().problems {
                    v.ok = false;
                    v.problems.push(format!("{a}: {p}"));
                }
            }
            Err(e) => {
                v.ok = false;
                v.problems.push(format!("{a}: verify failed: {e}"));
            }
        }
    }
    v
}

/// Joins each decoder's invoke and complete lines into one operation each (`ok: null` when the
/// completion is missing: the decoder died with the call in flight); event lines (`resumed`,
/// `failpoint`) stay as they are, with `invoke_us` = their time.
fn read_decoder_histories(dir: &std::path::Path, n: usize) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for i in 0..n {
        let p = dir.join(format!("decoder{}.jsonl", i + 1));
        let Ok(text) = std::fs::read_to_string(&p) else {
            continue;
        };
        let mut ops: Vec<Value> = Vec::new();
        let mut index: HashMap<(String, u64), usize> = HashMap::new();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            let key = (
                v["decoder"].as_str().unwrap_or("").to_string(),
                v["id"].as_u64().unwrap_or(0),
            );
            match v["phase"].as_str() {
                Some("event") => {
                    let mut ev = v.clone();
                    ev["invoke_us"] = v["at_us"].clone();
                    ops.push(ev);
                }
                Some("invoke") => {
                    let mut op = v.clone();
                    op["ok"] = Value::Null;
                    index.insert(key, ops.len());
                    ops.push(op);
                }
                Some("complete") => {
                    if let Some(&k) = index.get(&key) {
                        if let (Some(op), Some(fields)) = (ops.get_mut(k), v.as_object()) {
                            for (f, x) in fields {
                                if f != "phase" && f != "id" && f != "decoder" {
                                    op[f] = x.clone();
                                }
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        out.extend(ops);
    }
    out.sort_by_key(|v| v["invoke_us"].as_u64().unwrap_or(0));
    Ok(out)
}
