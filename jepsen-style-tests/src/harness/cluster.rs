//! Starting a run's cluster: the log nodes, decoders and gateways of a [`RunConfig`], each its
//! own `tokenlog` process, and the leader watcher.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokenlog_raftlog::client::LogClient;

use super::procs::{free_port, wait_for_port, Proc, Role};
use super::{nemesis, net, now_us, Cluster, Fault, Plant, RunConfig, DRAIN_MS, FAILPOINTS_ENV, FAILPOINT_EXIT};

/// Starts the processes of `cfg` (decoder 1 only when `cfg.standby_later`) and the leader
/// watcher; returns once the nodes and gateways listen and a decoder has registered.
pub async fn start_cluster(cfg: &RunConfig) -> Result<Cluster> {
    let started = Instant::now();
    if cfg.real_model {
        // On a fresh tree every decoder and stage would fetch the model at once, and a stage
        // must listen within 30 s: fetched once, here, first.
        use tokenlog_decoder::fetch;
        tokio::task::spawn_blocking(|| fetch::locate_model(&fetch::repo_models_dir()))
            .await?
            .context("fetching the model")?;
    }
    fresh_run_dir(&cfg.out)?;
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
    anyhow::ensure!(
        !cfg.pipeline || cfg.real_model,
        "a pipeline run needs the real model (stages run its layers)"
    );
    if !cfg.pipeline && faults.iter().any(|f| Fault::PIPELINE.contains(f)) {
        eprintln!("kill-stage, pause-stage and kill-head left out: they need a pipeline run");
        faults.retain(|f| !Fault::PIPELINE.contains(f));
    }
    if faults.contains(&Fault::DiskFull) && !super::smallfs::can_mount() {
        eprintln!("disk-full left out: it mounts a tmpfs, which needs root");
        faults.retain(|f| *f != Fault::DiskFull);
    }
    let peers = node_addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{}={a}", i + 1))
        .collect::<Vec<_>>()
        .join(",");
    let cluster = node_addrs.join(",");
    let (mut nodes, node_dirs) = node_procs(cfg, &dir, net.as_ref(), &node_addrs, &peers);
    let (mut stages, pipeline) = match cfg.pipeline {
        true => stage_procs(cfg, &dir, &cluster),
        false => (Vec::new(), Vec::new()),
    };
    let mut decoders = decoder_procs(cfg, &dir, &cluster, &pipeline);
    let (mut gateways, gateway_addrs) = gateway_procs(cfg, &dir, &cluster);
    let first_decoders = if cfg.standby_later { 1 } else { decoders.len() };
    for p in nodes.iter_mut().chain(gateways.iter_mut()).chain(stages.iter_mut()) {
        p.start()?;
    }
    // A pipeline head checks its stages when it starts: they listen first.
    for p in nodes.iter().chain(gateways.iter()).chain(stages.iter()) {
        wait_for_port(p.ready_addr.as_deref().expect("set"), Duration::from_secs(30))?;
    }
    for p in decoders.iter_mut().take(first_decoders) {
        p.start()?;
    }
    let log = LogClient::new(node_addrs.clone())?;
    wait_for_model(&log).await?;
    let procs = Arc::new(Mutex::new(nemesis::Procs {
        net,
        nodes,
        small_fs: node_dirs.iter().map(|_| None).collect(),
        handoff_listeners: cfg.handoff_listeners.min(cfg.decoders),
        lease_ms: cfg.lease_ms,
        unowned_ms: cfg.unowned_ms_in_force(),
        node_dirs,
        gateways,
        decoders,
        stages,
        log: Some(log.clone()),
        dir: dir.clone(),
    }));

    // --- leader watcher
    let leader = Arc::new(Mutex::new(None::<usize>));
    let leader_changes = Arc::new(Mutex::new(Vec::<Value>::new()));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let watcher = spawn_leader_watcher(&node_addrs, leader.clone(), leader_changes.clone(), stop_rx)?;
    Ok(Cluster {
        procs,
        node_addrs,
        gateway_addrs,
        log,
        leader,
        faults,
        leader_changes,
        at_finish: Default::default(),
        stop_watcher: stop_tx,
        watcher,
        started,
    })
}

/// The log nodes' process slots (in their namespaces when `net` is set) and data dirs.
fn node_procs(
    cfg: &RunConfig,
    dir: &Path,
    net: Option<&net::Netns>,
    node_addrs: &[String],
    peers: &str,
) -> (Vec<Proc>, Vec<PathBuf>) {
    let bin = &cfg.bin;
    let mut nodes = Vec::new();
    let mut node_dirs = Vec::new();
    for (i, a) in node_addrs.iter().enumerate() {
        let d = dir.join(format!("node{}-data", i + 1));
        // A fresh cluster: data left by an earlier run in the same directory is not ours.
        let _ = std::fs::remove_dir_all(&d);
        let mut args: Vec<String> = vec![
            "node".into(),
            "--id".into(),
            (i + 1).to_string(),
            "--listen".into(),
            a.clone(),
            "--data-dir".into(),
            d.display().to_string(),
            "--peers".into(),
            peers.to_string(),
            "--heartbeat-ms".into(),
            "50".into(),
            "--election-min-ms".into(),
            "300".into(),
            "--election-max-ms".into(),
            "600".into(),
            "--snapshot-every".into(),
            cfg.snapshot_every.to_string(),
            "--retention-ms".into(),
            cfg.retention_ms.to_string(),
        ];
        if let Some(keep) = cfg.keep_after_snapshot {
            args.extend(["--keep-after-snapshot".into(), keep.to_string()]);
        }
        if net.is_some() {
            // Nodes in network namespaces listen on their own (non-loopback) addresses; the
            // suite runs them without TLS, which a node refuses there unless told.
            args.push("--insecure".into());
        }
        let mut p = match net {
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
                    dir,
                )
            }
            None => Proc::new(&format!("node{}", i + 1), Role::Node, bin, args, dir),
        };
        match cfg.plant {
            Some(Plant::NoFence) => p = p.env("TOKENLOG_PLANT_NO_FENCE", "1"),
            Some(Plant::AckBeforeFsync) => p = p.env("TOKENLOG_PLANT_ACK_BEFORE_FSYNC", "1"),
            Some(Plant::EarlyVisibility) => p = p.env("TOKENLOG_PLANT_EARLY_VISIBILITY", "1"),
            Some(Plant::UnboundedClock) => p = p.env("TOKENLOG_PLANT_UNBOUNDED_CLOCK", "1"),
            Some(Plant::NoUnownedDeadline) => p = p.env("TOKENLOG_PLANT_NO_UNOWNED_DEADLINE", "1"),
            Some(Plant::Diverge) if i == 2 => p = p.env("TOKENLOG_PLANT_DIVERGE", "1"),
            Some(
                Plant::Zombie
                | Plant::Diverge
                | Plant::StalledWorker
                | Plant::SourceFreesEarly
                | Plant::EarlyHandoffWrite
                | Plant::StandbyEarlyWrite,
            )
            | None => {}
        }
        if cfg.faults.contains(&Fault::Clock) {
            // The `clock` nemesis writes this node's wall clock skew (ms) here.
            let skew = skew_file(dir, i);
            let _ = std::fs::write(&skew, "0");
            p = p.env("TOKENLOG_CLOCK_SKEW_FILE", &skew.display().to_string());
        }
        p.ready_addr = Some(a.clone());
        nodes.push(p);
        node_dirs.push(d);
    }
    (nodes, node_dirs)
}

/// The file the `clock` nemesis writes node `i`'s wall clock skew to.
pub fn skew_file(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("node{}.clock-skew", i + 1))
}

/// A pipeline run's stages: `s1`..`s3` (layers 0..10, 10..20, 20..30 of the bundled model) and
/// the cold spares `cold1`..`cold3`, each on a port of its own (kept across restarts), all
/// registered in the log; and the addresses of `s1`..`s3`, in pipeline order.
fn stage_procs(cfg: &RunConfig, dir: &Path, cluster: &str) -> (Vec<Proc>, Vec<String>) {
    let mut procs = Vec::new();
    let mut pipeline = Vec::new();
    let held = [Some("0..10"), Some("10..20"), Some("20..30"), None, None, None];
    for (i, layers) in held.iter().enumerate() {
        let name = match layers {
            Some(_) => format!("s{}", i + 1),
            None => format!("cold{}", i - 2),
        };
        let addr = format!("127.0.0.1:{}", free_port());
        let mut args: Vec<String> = vec!["stage".into()];
        match layers {
            Some(l) => args.extend(["--layers".into(), l.to_string()]),
            None => args.push("--cold".into()),
        }
        args.extend([
            "--listen".into(),
            addr.clone(),
            "--stage-id".into(),
            name.clone(),
            "--threads".into(),
            "1".into(),
            "--cluster".into(),
            cluster.to_string(),
        ]);
        let mut p = Proc::new(&name, Role::Stage, &cfg.bin, args, dir);
        p.ready_addr = Some(addr.clone());
        if layers.is_some() {
            pipeline.push(addr);
        }
        procs.push(p);
    }
    (procs, pipeline)
}

/// The decoders' process slots (decoder 1 with `cfg.decoder1_failpoints` on its first start;
/// decoder 1 a head over `pipeline` when it is not empty).
fn decoder_procs(cfg: &RunConfig, dir: &Path, cluster: &str, pipeline: &[String]) -> Vec<Proc> {
    let bin = &cfg.bin;
    let mut decoders = Vec::new();
    for i in 0..cfg.decoders {
        let model: Vec<String> = if cfg.real_model && i == 0 && !pipeline.is_empty() {
            vec!["--threads".into(), "1".into(), "--pipeline".into(), pipeline.join(",")]
        } else if cfg.real_model {
            vec!["--threads".into(), "1".into()]
        } else {
            vec!["--fake".into(), "--fake-step-ms".into(), cfg.step_ms.to_string()]
        };
        // With a short unowned deadline (stress configurations), each decoder can hold every
        // client's generation: an owner's death leaves work for the others, never a generation
        // waiting for a free slot long enough for its deadline to end it.
        let capacity = if cfg.unowned_ms != 0 { cfg.clients.max(4) } else { 4 };
        let standby = if cfg.standby > 0 {
            vec!["--standby".to_string(), cfg.standby.to_string()]
        } else {
            vec![]
        };
        let handoff = if i < cfg.handoff_listeners {
            ["--handoff-listen", "127.0.0.1:0", "--drain-ms", &DRAIN_MS.to_string()]
                .map(String::from)
                .to_vec()
        } else {
            vec![]
        };
        let args = [
            vec!["decoder".to_string()],
            model,
            standby,
            handoff,
            vec![
                "--lease-ms".into(),
                cfg.lease_ms.to_string(),
                "--capacity".into(),
                capacity.to_string(),
                "--stall-ms".into(),
                cfg.stall_ms.to_string(),
                "--decoder-id".into(),
                format!("d{}-{{inc}}", i + 1),
                "--history".into(),
                dir.join(format!("decoder{}.jsonl", i + 1)).display().to_string(),
                "--cluster".into(),
                cluster.to_string(),
            ],
        ]
        .concat();
        let mut p = Proc::new(&format!("decoder{}", i + 1), Role::Decoder, bin, args, dir);
        if cfg.plant == Some(Plant::Zombie) {
            p = p.env("TOKENLOG_PLANT_ZOMBIE_DECODER", "1");
        }
        match cfg.plant {
            Some(Plant::StalledWorker) if i == 0 => p = p.first_env("TOKENLOG_PLANT_STALLED_WORKER", "1"),
            Some(Plant::SourceFreesEarly) if i == 0 => p = p.env("TOKENLOG_PLANT_SOURCE_FREES_EARLY", "1"),
            Some(Plant::EarlyHandoffWrite) => p = p.env("TOKENLOG_PLANT_EARLY_HANDOFF_WRITE", "1"),
            Some(Plant::StandbyEarlyWrite) => p = p.env("TOKENLOG_PLANT_STANDBY_EARLY_WRITE", "1"),
            _ => {}
        }
        match i {
            0 => {
                if let Some(fp) = &cfg.decoder1_failpoints {
                    p = p.first_env(FAILPOINTS_ENV, fp);
                }
            }
            1 => {
                if let Some(fp) = &cfg.decoder2_failpoints {
                    // Its failpoint exit is meant, not a crash.
                    p = p.first_env(FAILPOINTS_ENV, fp).first_exit_may_be(FAILPOINT_EXIT);
                }
            }
            _ => {}
        }
        decoders.push(p);
    }
    decoders
}

/// The gateways' process slots and their gRPC addresses.
fn gateway_procs(cfg: &RunConfig, dir: &Path, cluster: &str) -> (Vec<Proc>, Vec<String>) {
    let bin = &cfg.bin;
    let mut gateways = Vec::new();
    let mut gateway_addrs = Vec::new();
    for i in 0..cfg.gateways {
        let grpc = format!("127.0.0.1:{}", free_port());
        let http = format!("127.0.0.1:{}", free_port());
        // No model files: the gateway reads the tokenizer its decoders published in the log.
        let mut args: Vec<String> = vec!["gateway".into()];
        args.extend([
            "--cluster".into(),
            cluster.to_string(),
            "--grpc-listen".into(),
            grpc.clone(),
            "--http-listen".into(),
            http,
        ]);
        if cfg.unowned_ms != 0 {
            args.extend(["--unowned-ms".into(), cfg.unowned_ms.to_string()]);
        }
        let mut p = Proc::new(&format!("gateway{}", i + 1), Role::Gateway, bin, args, dir);
        p.ready_addr = Some(grpc.clone());
        gateways.push(p);
        gateway_addrs.push(grpc);
    }
    (gateways, gateway_addrs)
}

/// Spawns the task that asks every node for the leader until `stop`, recording each change.
fn spawn_leader_watcher(
    node_addrs: &[String],
    leader: Arc<Mutex<Option<usize>>>,
    changes: Arc<Mutex<Vec<Value>>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>> {
    // One client per node (each asks only its own node), made once.
    let clients = node_addrs
        .iter()
        .map(|a| LogClient::with_budget(vec![a.clone()], Duration::from_millis(200)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(tokio::spawn(async move {
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
    }))
}

/// Waits (up to 60 s) until a decoder has registered its model.
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

/// Files every run writes at the top of its directory; a directory holding one of them is an
/// earlier run's output.
const RUN_FILES: [&str; 5] = [
    "verdicts.json",
    "history.jsonl",
    "decoder1.jsonl",
    "node1.log",
    "scenario.json",
];

/// Makes `dir` an empty directory for a new run. Decoders append to their history files, so a
/// run into an earlier run's directory would mix two histories (and report false violations):
/// an earlier run's output is removed, with a line saying so; a non-empty directory that is not
/// one is refused.
pub fn fresh_run_dir(dir: &std::path::Path) -> Result<()> {
    if let Ok(mut entries) = std::fs::read_dir(dir) {
        if entries.next().is_some() {
            anyhow::ensure!(
                RUN_FILES.iter().any(|f| dir.join(f).exists()),
                "{} is not empty and holds no earlier run's output; choose another --out",
                dir.display()
            );
            eprintln!("{}: removing the earlier run's output", dir.display());
            std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_earlier_runs_output_is_replaced_and_a_foreign_directory_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("seed-1");
        fresh_run_dir(&run).unwrap();
        std::fs::write(run.join("decoder1.jsonl"), "{\"phase\":\"invoke\"}\n").unwrap();
        std::fs::write(run.join("node1.log"), "old\n").unwrap();
        fresh_run_dir(&run).unwrap();
        assert_eq!(
            std::fs::read_dir(&run).unwrap().count(),
            0,
            "the earlier run's files are gone"
        );
        let foreign = tmp.path().join("mine");
        std::fs::create_dir_all(&foreign).unwrap();
        std::fs::write(foreign.join("notes.txt"), "keep me").unwrap();
        let e = fresh_run_dir(&foreign).unwrap_err().to_string();
        assert!(e.contains("holds no earlier run's output"), "{e}");
        assert!(foreign.join("notes.txt").exists());
    }
}
