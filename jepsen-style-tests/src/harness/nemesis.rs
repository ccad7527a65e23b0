//! Nemeses: faults injected one after another during the fault window, chosen and timed by one
//! seeded RNG, each recorded as an interval in the history. Every fault ends healed (processes
//! restarted or continued) before the next starts, so faults of different kinds combine over the
//! window; `RestartAll` takes every node down at once.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

mod handoff;

pub use handoff::{wait_takes_handoffs, DRAIN_HUNG};

use super::now_us;
use super::procs::Proc;
use super::supervisor::{self, Act, Supervisor, CRASH_LOOP};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// kill -9 a log node (the leader half the time), restart it.
    KillNode,
    /// SIGSTOP a log node (the leader half the time) for a while, then SIGCONT.
    PauseNode,
    /// kill -9 a decoder between sampling and commit, restart it (a new incarnation).
    KillDecoder,
    /// SIGSTOP a decoder past its lease, then SIGCONT: it must be fenced.
    PauseDecoder,
    /// kill -9 a gateway mid-stream, restart it.
    KillGateway,
    /// A node loses its data dir and rejoins (catches up by snapshot).
    WipeNode,
    /// Every node killed at once, then all restarted.
    RestartAll,
    /// A network partition between log nodes (leader isolated, a random node cut off from the
    /// other two, or a bridge where two nodes only see the third), then healed. Needs --netns.
    Partition,
    /// A log node's wall clock (the leader half the time) jumps forward or back by up to 5 s,
    /// or drifts, for a while, then returns (the node's test clock hook).
    Clock,
    /// A decoder's model step fails (an error or a panic, failpoint): the process must exit
    /// non-zero at once, its leases lapse and another decoder continues. Restarted after.
    ModelError,
    /// A stopped follower's data (its snapshot, a WAL, a table or the manifest of its Raft log)
    /// gets 1-4 flipped bytes; restarted, it must refuse to serve (then it is wiped and catches
    /// up from its peers) or come up with a state equal to the others' (convergence).
    Corrupt,
    /// A node's data dir (on a tmpfs of its own) is squeezed to what it uses plus 0-64 KiB for
    /// 2-5 s: its writes fail; it may exit cleanly (status 1; restarted) or wait; when the
    /// space is back it must catch up, with nothing corrupted (convergence). Needs root.
    DiskFull,
    /// A process (node, decoder or gateway) killed from outside, as an OOM killer would, and
    /// left to a supervisor that restarts whatever ended on its own with a doubling backoff and
    /// gives up on a crash loop (which the `processes` checker reports).
    Supervised,
    /// Every decoder killed at once, and restarted after a short while (the generations wait
    /// and continue) or, when the run's unowned deadline is short (stress configurations),
    /// after longer than lease + deadline (the generations with records must fail explicitly;
    /// liveness checks both).
    DecodersDown,
    /// kill -9 a stage that decoder 1's pipeline uses now, restart it after a while (it comes
    /// back a spare): the head splices a spare in (hot, or a cold one that loads the layers)
    /// and the generations stay with it. Pipeline runs only.
    KillStage,
    /// SIGSTOP a stage the pipeline uses for longer than its registration lives, then SIGCONT:
    /// the head splices it out by its lapsed registration, and the resumed stage must be fenced
    /// by the pipeline epoch. Pipeline runs only.
    PauseStage,
    /// kill -9 the pipeline head (decoder 1), restart it: its generations are taken over by a
    /// whole decoder or by the head's next incarnation, which composes its pipeline again.
    /// Pipeline runs only.
    KillHead,
    /// A decoder that takes handoffs is told to stop (SIGTERM): it drains, handing its
    /// generations to the others with their caches, and exits; restarted after. Needs
    /// `handoff_listeners`.
    Drain,
    /// A planned handoff that fails: a decoder that takes handoffs is restarted with a
    /// destination's failpoint (it exits before receiver-ready, after it, after the commit, or
    /// loses the commit's answer), then another one drains into it. Needs `handoff_listeners`.
    Handoff,
    /// kill -9 the owner of a generation that has a hot standby (any decoder when none has
    /// one yet), restart it after: the standby takes over from its followed state. Needs
    /// `standby`.
    StandbyKill,
}

impl Fault {
    /// The faults of a pipeline run's stages and head.
    pub const PIPELINE: [Fault; 3] = [Fault::KillStage, Fault::PauseStage, Fault::KillHead];

    /// The faults of planned handoff and hot standby (issue 15): runs whose decoders take
    /// handoffs and stand by for each other. Not in [`Fault::ALL`], so that the schedules of
    /// the seeds of runs without them stay what they were.
    pub const HANDOFF: [Fault; 3] = [Fault::Drain, Fault::Handoff, Fault::StandbyKill];

    pub const ALL: [Fault; 14] = [
        Fault::KillNode,
        Fault::PauseNode,
        Fault::KillDecoder,
        Fault::PauseDecoder,
        Fault::KillGateway,
        Fault::WipeNode,
        Fault::RestartAll,
        Fault::Partition,
        Fault::Clock,
        Fault::ModelError,
        Fault::Corrupt,
        Fault::DiskFull,
        Fault::Supervised,
        Fault::DecodersDown,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::KillNode => "kill-node",
            Fault::PauseNode => "pause-node",
            Fault::KillDecoder => "kill-decoder",
            Fault::PauseDecoder => "pause-decoder",
            Fault::KillGateway => "kill-gateway",
            Fault::WipeNode => "wipe-node",
            Fault::RestartAll => "restart-all",
            Fault::Partition => "partition",
            Fault::Clock => "clock",
            Fault::ModelError => "model-error",
            Fault::Corrupt => "corrupt",
            Fault::DiskFull => "disk-full",
            Fault::Supervised => "supervised",
            Fault::DecodersDown => "decoders-down",
            Fault::KillStage => "kill-stage",
            Fault::PauseStage => "pause-stage",
            Fault::KillHead => "kill-head",
            Fault::Drain => "drain",
            Fault::Handoff => "handoff",
            Fault::StandbyKill => "standby-kill",
        }
    }
}

pub struct Procs {
    pub nodes: Vec<Proc>,
    pub node_dirs: Vec<PathBuf>,
    pub gateways: Vec<Proc>,
    pub decoders: Vec<Proc>,
    /// A pipeline run's stage processes (named by their stage ids): the first composition's,
    /// then the cold spares.
    pub stages: Vec<Proc>,
    /// The log's client (the stage nemeses read which stages the pipeline uses now).
    pub log: Option<tokenlog_raftlog::client::LogClient>,
    /// The run's directory (the `clock` nemesis's skew files).
    pub dir: PathBuf,
    /// Each node's data dir on a tmpfs of its own, once the `disk-full` nemesis moved it there
    /// (unmounted on drop, after the processes are gone).
    pub small_fs: Vec<Option<super::smallfs::SmallFs>>,
    /// The first this many decoders take handoffs (`drain`, `handoff`).
    pub handoff_listeners: usize,
    /// The run's decoder lease and unowned deadline (ms), for `decoders-down`.
    pub lease_ms: u64,
    pub unowned_ms: u64,
    /// Last, so that it is torn down after the processes are gone.
    pub net: Option<super::net::Netns>,
}

impl Procs {
    /// Continues every paused process and starts every stopped one.
    pub fn heal(&mut self) -> anyhow::Result<()> {
        if let Some(n) = &self.net {
            n.heal()?;
        }
        for p in self.all_mut() {
            p.resume();
            p.start()?;
        }
        Ok(())
    }

    /// Every process slot: nodes, gateways, decoders, stages.
    pub fn all_mut(&mut self) -> impl Iterator<Item = &mut Proc> {
        self.nodes
            .iter_mut()
            .chain(self.gateways.iter_mut())
            .chain(self.decoders.iter_mut())
            .chain(self.stages.iter_mut())
    }

    /// Stops the decoders, gateways and stages (the log's writers: stages renew their
    /// registrations), so that the nodes come to rest; returns the exits that had happened on
    /// their own, as [`Procs::stop_all`] does.
    pub fn stop_writers(&mut self) -> Vec<super::procs::SelfExit> {
        let mut out = Vec::new();
        for p in self
            .gateways
            .iter_mut()
            .chain(self.decoders.iter_mut())
            .chain(self.stages.iter_mut())
        {
            p.kill9();
            out.append(&mut p.self_exits);
        }
        out
    }

    /// Stops every process; returns the exits that had happened on their own (crashes, or an
    /// armed failpoint), `kill9` recording one before it kills.
    pub fn stop_all(&mut self) -> Vec<super::procs::SelfExit> {
        let mut out = Vec::new();
        for p in self.all_mut() {
            p.kill9();
            out.append(&mut p.self_exits);
        }
        out
    }
}

/// Runs faults until `window` has passed. `leader` answers the current leader's index (0-based)
/// when known. Returns the nemesis records.
pub async fn run(
    procs: Arc<Mutex<Procs>>,
    faults: Vec<Fault>,
    seed: u64,
    window: Duration,
    leader: Arc<Mutex<Option<usize>>>,
) -> anyhow::Result<Vec<Value>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let start = Instant::now();
    if faults.is_empty() {
        tokio::time::sleep(window).await;
        return Ok(out);
    }
    // Let the workload get going first.
    tokio::time::sleep(Duration::from_millis(rng.random_range(500..1500))).await;
    while start.elapsed() < window {
        let fault = faults[rng.random_range(0..faults.len())];
        let t0 = now_us();
        let target = inject(fault, &procs, &leader, &mut rng).await?;
        out.push(json!({"op": "nemesis", "fault": fault.name(), "target": target, "start_us": t0, "end_us": now_us()}));
        tokio::time::sleep(ms(&mut rng, 300, 1500)).await;
    }
    Ok(out)
}

/// A duration drawn from `lo..hi` milliseconds.
fn ms(rng: &mut StdRng, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(rng.random_range(lo..hi))
}

/// Injects `fault` and heals it; returns its target's description.
async fn inject(
    fault: Fault,
    procs: &Mutex<Procs>,
    leader: &Mutex<Option<usize>>,
    rng: &mut StdRng,
) -> anyhow::Result<String> {
    match fault {
        Fault::KillNode | Fault::PauseNode => node_fault(fault, procs, leader, rng).await,
        Fault::KillDecoder | Fault::PauseDecoder => decoder_fault(fault, procs, rng).await,
        Fault::KillGateway => kill_gateway(procs, rng).await,
        Fault::WipeNode => wipe_node(procs, rng).await,
        Fault::Partition => partition(procs, leader, rng).await,
        Fault::RestartAll => restart_all(procs, rng).await,
        Fault::Clock => clock(procs, leader, rng).await,
        Fault::ModelError => model_error(procs, rng).await,
        Fault::Corrupt => corrupt(procs, leader, rng).await,
        Fault::DiskFull => disk_full(procs, rng).await,
        Fault::Supervised => supervised(procs, rng).await,
        Fault::DecodersDown => decoders_down(procs, rng).await,
        Fault::KillStage | Fault::PauseStage => stage_fault(fault, procs, rng).await,
        Fault::KillHead => kill_head(procs, rng).await,
        Fault::Drain => handoff::drain(procs, rng).await,
        Fault::Handoff => handoff::failing_handoff(procs, rng).await,
        Fault::StandbyKill => handoff::standby_kill(procs, rng).await,
    }
}

/// The stages decoder 1's pipeline uses now (the log's record of its head's composition), as
/// indexes into `Procs::stages`; all of them when the log cannot say.
async fn stages_in_use(procs: &Mutex<Procs>) -> Vec<usize> {
    let (log, names) = {
        let p = procs.lock().expect("lock");
        (
            p.log.clone(),
            p.stages.iter().map(|s| s.name.clone()).collect::<Vec<_>>(),
        )
    };
    let used: Option<Vec<String>> = match log {
        Some(log) => log.list_stages(true).await.ok().map(|r| {
            r.pipelines
                .iter()
                .filter(|p| p.head.starts_with("d1-"))
                .max_by_key(|p| p.epoch)
                .map(|p| p.stages.iter().map(|s| s.stage_id.clone()).collect())
                .unwrap_or_default()
        }),
        None => None,
    };
    let all: Vec<usize> = (0..names.len()).collect();
    match used {
        Some(u) if !u.is_empty() => all.into_iter().filter(|&i| u.contains(&names[i])).collect(),
        _ => all,
    }
}

/// `KillStage` / `PauseStage`: one stage the pipeline uses now, killed (restarted after
/// 0.5-2 s: a spare again) or paused for 1.5-3 s (past its registration's 1 s).
async fn stage_fault(fault: Fault, procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let used = stages_in_use(procs).await;
    anyhow::ensure!(!used.is_empty(), "a stage fault in a run without stages");
    let i = used[rng.random_range(0..used.len())];
    let target = procs.lock().expect("lock").stages[i].name.clone();
    if fault == Fault::KillStage {
        procs.lock().expect("lock").stages[i].kill9();
        tokio::time::sleep(ms(rng, 500, 2000)).await;
        procs.lock().expect("lock").stages[i].start()?;
    } else {
        procs.lock().expect("lock").stages[i].pause();
        tokio::time::sleep(ms(rng, 1500, 3000)).await;
        procs.lock().expect("lock").stages[i].resume();
    }
    Ok(target)
}

/// `KillHead`: the pipeline head (decoder 1) killed and restarted after 0.2-1.5 s. It is killed
/// with an append in flight when one comes within 3 s, so that it holds a generation another
/// decoder must take over (a head killed idle costs nothing to judge: CI once found it so at
/// both of a run's kills).
async fn kill_head(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let target = kill_decoder_aimed(procs, 0, Duration::from_secs(3), rng).await?;
    Ok(format!("{target}, the pipeline head"))
}

/// Decoder `i` killed (SIGKILL) with an append in flight when its history shows one within
/// `within`, and restarted after 0.2-1.5 s; its name, and whether the kill was aimed.
async fn kill_decoder_aimed(
    procs: &Mutex<Procs>,
    i: usize,
    within: Duration,
    rng: &mut StdRng,
) -> anyhow::Result<String> {
    let (mut target, history) = {
        let p = procs.lock().expect("lock");
        (
            p.decoders[i].name.clone(),
            p.dir.join(format!("decoder{}.jsonl", i + 1)),
        )
    };
    let aim = Instant::now();
    while aim.elapsed() < within {
        if append_in_flight(&history) {
            target.push_str(" (an append in flight)");
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    procs.lock().expect("lock").decoders[i].kill9();
    tokio::time::sleep(ms(rng, 200, 1500)).await;
    procs.lock().expect("lock").decoders[i].start()?;
    Ok(target)
}

/// `Clock`: a node's wall clock (the leader half the time) jumps by up to ±5 s, or drifts by up
/// to ±2 s per second, for 1-3 s; then it is set right again (a jump back).
async fn clock(procs: &Mutex<Procs>, leader: &Mutex<Option<usize>>, rng: &mut StdRng) -> anyhow::Result<String> {
    let (n, dir) = {
        let p = procs.lock().expect("lock");
        (p.nodes.len(), p.dir.clone())
    };
    let i = match *leader.lock().expect("lock") {
        Some(l) if rng.random_bool(0.5) => l,
        _ => rng.random_range(0..n),
    };
    let file = super::cluster::skew_file(&dir, i);
    let hold = ms(rng, 1000, 3000);
    let target = if rng.random_bool(0.5) {
        let jump: i64 = rng.random_range(1_000..=5_000) * if rng.random_bool(0.5) { 1 } else { -1 };
        std::fs::write(&file, jump.to_string())?;
        tokio::time::sleep(hold).await;
        format!("node{}: jump {jump:+} ms for {} ms", i + 1, hold.as_millis())
    } else {
        let per_s: i64 = rng.random_range(200..=2_000) * if rng.random_bool(0.5) { 1 } else { -1 };
        let started = Instant::now();
        while started.elapsed() < hold {
            let skew = per_s * started.elapsed().as_millis() as i64 / 1_000;
            std::fs::write(&file, skew.to_string())?;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        format!("node{}: drift {per_s:+} ms/s for {} ms", i + 1, hold.as_millis())
    };
    std::fs::write(&file, "0")?;
    Ok(target)
}

/// `ModelError`: a decoder restarted with a failpoint that makes its model step fail (an error
/// or a panic) at a token soon; it must exit with status 1 (the exit is expected, not a crash);
/// then it is started again without the failpoint.
async fn model_error(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let n = procs.lock().expect("lock").decoders.len();
    let i = rng.random_range(0..n);
    let seq: u32 = rng.random_range(1..8);
    let failpoint = if rng.random_bool(0.5) {
        "model-error"
    } else {
        "model-panic"
    };
    let spec = format!("{failpoint}={seq}");
    let fired_before = |p: &Proc| p.log_text().matches("failpoint fired").count();
    let (name, before) = {
        let mut p = procs.lock().expect("lock");
        let before = fired_before(&p.decoders[i]);
        p.decoders[i].start_failing(&[(super::FAILPOINTS_ENV, &spec)], 1)?;
        (p.decoders[i].name.clone(), before)
    };
    // Wait for the failure (a new generation reaches the token soon), then restart.
    let started = Instant::now();
    let (mut exited, mut fired) = (false, false);
    while started.elapsed() < MODEL_ERROR_EXIT_WITHIN {
        {
            let mut p = procs.lock().expect("lock");
            fired = fired_before(&p.decoders[i]) > before;
            exited = p.decoders[i].exited().is_some();
        }
        if exited {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let target = format!(
        "{name}: {spec}, {}",
        match (fired, exited) {
            (_, true) => "exited",
            (true, false) => "KEPT RUNNING after its model step failed",
            (false, false) => "did not reach the token",
        }
    );
    let mut p = procs.lock().expect("lock");
    if fired && !exited {
        // A process that outlives its failed worker holds its leases forever: a violation the
        // `processes` checker reports from this record. Killed, so the run can still end.
        p.decoders[i].kill9();
        p.decoders[i].start()?;
        return Ok(format!("{target} {LINGERED}"));
    }
    p.decoders[i].start()?;
    Ok(target)
}

/// How long a decoder whose model step failed may take to exit.
const MODEL_ERROR_EXIT_WITHIN: Duration = Duration::from_secs(8);

/// Marks a `model-error` record whose decoder did not exit after its model step failed.
pub const LINGERED: &str = "[lingered]";

/// `Corrupt`: a follower other than node 1 (node 1 initializes a cluster on an empty data dir)
/// is killed, 1-4 bytes of one of its data files flipped, and it is started again. Either it
/// refuses to start (the corruption detected: exit 1, then its data dir is wiped and it catches
/// up from its peers, as an operator would do), or it starts and serves; the convergence
/// checker then compares its whole state with the other replicas'.
async fn corrupt(procs: &Mutex<Procs>, leader: &Mutex<Option<usize>>, rng: &mut StdRng) -> anyhow::Result<String> {
    let n = procs.lock().expect("lock").nodes.len();
    let known = *leader.lock().expect("lock");
    let followers: Vec<usize> = (1..n).filter(|&i| Some(i) != known).collect();
    let i = followers[rng.random_range(0..followers.len())];
    let (dir, log_len) = {
        let mut p = procs.lock().expect("lock");
        p.nodes[i].kill9();
        (p.node_dirs[i].clone(), p.nodes[i].log_text().len())
    };
    let files = data_files(&dir);
    let Some(file) = (!files.is_empty()).then(|| files[rng.random_range(0..files.len())].clone()) else {
        procs.lock().expect("lock").nodes[i].start()?;
        return Ok(format!("node{}: no data files yet, nothing flipped", i + 1));
    };
    let flips = rng.random_range(1..=4);
    flip_bytes(&file, flips, rng)?;
    let what = format!(
        "node{}: {flips} byte(s) flipped in {}",
        i + 1,
        file.strip_prefix(&dir).unwrap_or(&file).display()
    );
    procs.lock().expect("lock").nodes[i].start_failing(&[], 1)?;
    // A node checks its whole data dir before it listens: an exit comes within seconds.
    let started = Instant::now();
    let mut exited = false;
    while started.elapsed() < CORRUPT_DETECT_WITHIN {
        if procs.lock().expect("lock").nodes[i].exited().is_some() {
            exited = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if !exited {
        return Ok(format!("{what}: started (nothing it reads was hit)"));
    }
    let said = said(&log_since(&procs.lock().expect("lock").nodes[i], log_len));
    {
        let mut p = procs.lock().expect("lock");
        p.nodes[i].kill9();
        let _ = std::fs::remove_dir_all(&dir);
    }
    tokio::time::sleep(ms(rng, 200, 800)).await;
    procs.lock().expect("lock").nodes[i].start()?;
    Ok(format!("{what}: {DETECTED} ({said}); wiped, rejoined"))
}

/// How long a node with a corrupted data dir may take to refuse to start.
const CORRUPT_DETECT_WITHIN: Duration = Duration::from_secs(6);

/// Marks a `corrupt` record whose node refused to start.
pub const DETECTED: &str = "refused to start";

/// The files of a node's data dir that hold data: snapshots, cold segments, and the Raft log's
/// WALs, tables and manifest (not RocksDB's info log or options, nor a snapshot's export for a
/// follower, which a restart removes).
fn data_files(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for sub in ["snapshots", "snapshots/cold", "log"] {
        let Ok(rd) = std::fs::read_dir(dir.join(sub)) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let data = (name.ends_with(".snap") && name.starts_with("snapshot-"))
                || name.ends_with(".seg")
                || name.ends_with(".log")
                || name.ends_with(".sst")
                || name.starts_with("MANIFEST-");
            if data && e.metadata().is_ok_and(|m| m.len() > 0) {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

/// XORs `n` bytes at random offsets of `file` with random non-zero values.
fn flip_bytes(file: &std::path::Path, n: usize, rng: &mut StdRng) -> anyhow::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(file)?;
    let len = f.metadata()?.len();
    for _ in 0..n {
        let at = rng.random_range(0..len);
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at)?;
        b[0] ^= rng.random_range(1..=255u8);
        f.write_all_at(&b, at)?;
    }
    f.sync_all()?;
    Ok(())
}

/// `DiskFull`: a random node's data dir (moved onto a tmpfs of its own the first time, with a
/// restart) is squeezed to what it uses plus 0-64 KiB for 2-5 s, then given its room back. The
/// node may exit cleanly (status 1) while it is full; it is then restarted.
async fn disk_full(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let n = procs.lock().expect("lock").nodes.len();
    let i = rng.random_range(0..n);
    let moved = procs.lock().expect("lock").small_fs[i].is_none();
    if moved {
        {
            let mut p = procs.lock().expect("lock");
            p.nodes[i].kill9();
            let fs = super::smallfs::SmallFs::take_over(&p.node_dirs[i].clone())?;
            p.small_fs[i] = Some(fs);
            p.nodes[i].start()?;
        }
        tokio::time::sleep(ms(rng, 1000, 2000)).await;
    }
    let spare: u64 = rng.random_range(0..DISK_FULL_SPARE_MAX);
    let hold = ms(rng, 2000, 5000);
    let (size, log_len) = {
        let mut p = procs.lock().expect("lock");
        let size = p.small_fs[i].as_ref().expect("moved").squeeze(spare)?;
        p.nodes[i].allow_exit(1);
        (size, p.nodes[i].log_text().len())
    };
    tokio::time::sleep(hold).await;
    procs.lock().expect("lock").small_fs[i]
        .as_ref()
        .expect("moved")
        .release()?;
    // A node that failed a write at the last moment may be exiting right now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut p = procs.lock().expect("lock");
    let new = log_since(&p.nodes[i], log_len);
    let full_errors = new.matches("No space left").count();
    let outcome = match p.nodes[i].exited() {
        Some(st) => {
            p.nodes[i].start()?;
            format!("exited ({st}: {}); restarted", said(&new))
        }
        None => "kept running".to_string(),
    };
    Ok(format!(
        "node{}: full at {} KiB for {} ms{}; {full_errors} 'No space left' errors logged; {outcome}",
        i + 1,
        size >> 10,
        hold.as_millis(),
        if moved { " (moved onto a tmpfs first)" } else { "" }
    ))
}

/// `Supervised`: a random process is killed from outside and left down; a [`Supervisor`]
/// restarts whatever ended on its own, until every process has been up a while (or it gave up
/// on one: a crash loop, marked [`CRASH_LOOP`]).
async fn supervised(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let victim = {
        let mut p = procs.lock().expect("lock");
        let mut all: Vec<&mut Proc> = p.all_mut().collect();
        let k = rng.random_range(0..all.len());
        let v = &mut all[k];
        if !v.crash() {
            return Ok(format!("{}: not running, nothing crashed", v.name));
        }
        v.name.clone()
    };
    let mut sup = Supervisor::default();
    let mut notes = Vec::new();
    let started = Instant::now();
    loop {
        let mut settled = true;
        {
            let mut p = procs.lock().expect("lock");
            for proc in p.all_mut() {
                match sup.step(proc)? {
                    Act::Nothing => {}
                    Act::Restarted { after } => {
                        notes.push(format!("{} restarted after {} ms", proc.name, after.as_millis()))
                    }
                    Act::GaveUp { quick_failures } => notes.push(format!(
                        "{CRASH_LOOP} {}: gave up after {quick_failures} exits within {} ms of their start: {}",
                        proc.name,
                        supervisor::QUICK_FAILURE.as_millis(),
                        said(&proc.log_text())
                    )),
                }
                let up = proc.exited().is_none() && proc.uptime().is_some_and(|u| u >= supervisor::QUICK_FAILURE);
                settled &= up || sup.gave_up(&proc.name);
            }
        }
        if settled || started.elapsed() > SUPERVISED_FOR {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(format!("{victim} killed (SIGKILL); supervisor: {}", notes.join("; ")))
}

/// How long the `supervised` nemesis watches before it hands back.
const SUPERVISED_FOR: Duration = Duration::from_secs(15);

/// `DecodersDown`: every decoder killed; restarted after 0.5-2 s, or (half the time, when the
/// unowned deadline is at most [`UNOWNED_LONG_MAX`]) after lease + deadline + 2.5-4 s.
async fn decoders_down(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let (lease, unowned) = {
        let mut p = procs.lock().expect("lock");
        for d in p.decoders.iter_mut() {
            d.kill9();
        }
        (p.lease_ms, p.unowned_ms)
    };
    let long = unowned <= UNOWNED_LONG_MAX.as_millis() as u64 && rng.random_bool(0.5);
    let hold = if long {
        Duration::from_millis(lease + unowned) + ms(rng, 2500, 4000)
    } else {
        ms(rng, 500, 2000)
    };
    tokio::time::sleep(hold).await;
    let mut p = procs.lock().expect("lock");
    for d in p.decoders.iter_mut() {
        d.start()?;
    }
    Ok(format!(
        "all decoders down for {} ms ({})",
        hold.as_millis(),
        if long {
            "past lease + unowned deadline: generations with records must fail"
        } else {
            "shorter than the unowned deadline"
        }
    ))
}

/// The longest unowned deadline for which `decoders-down` outlasts it.
pub const UNOWNED_LONG_MAX: Duration = Duration::from_secs(10);

/// The most room a `disk-full` squeeze leaves (a few seconds of a node's writes fill it).
const DISK_FULL_SPARE_MAX: u64 = 64 << 10;

/// What a process printed since byte `from` of its log.
fn log_since(p: &Proc, from: usize) -> String {
    p.log_text().get(from..).unwrap_or("").to_string()
}

/// The last error in `text` (the `Error:` line of a clean exit), else its last line; at most
/// 300 characters.
fn said(text: &str) -> String {
    let pick = text
        .lines()
        .rev()
        .find(|l| l.starts_with("Error:"))
        .or_else(|| text.lines().rev().find(|l| !l.trim().is_empty()))
        .unwrap_or("");
    pick.trim().chars().take(300).collect()
}

/// `KillNode` or `PauseNode`: a log node (the leader half the time) killed and restarted, or
/// paused and continued.
async fn node_fault(
    fault: Fault,
    procs: &Mutex<Procs>,
    leader: &Mutex<Option<usize>>,
    rng: &mut StdRng,
) -> anyhow::Result<String> {
    let n = procs.lock().expect("lock").nodes.len();
    let known = *leader.lock().expect("lock");
    let i = match known {
        Some(l) if rng.random_bool(0.5) => l,
        _ => rng.random_range(0..n),
    };
    let target = format!("node{}", i + 1);
    let hold = ms(rng, 500, 2500);
    if fault == Fault::KillNode {
        procs.lock().expect("lock").nodes[i].kill9();
        tokio::time::sleep(hold).await;
        procs.lock().expect("lock").nodes[i].start()?;
    } else {
        procs.lock().expect("lock").nodes[i].pause();
        tokio::time::sleep(hold).await;
        procs.lock().expect("lock").nodes[i].resume();
    }
    Ok(target)
}

/// `KillDecoder` or `PauseDecoder`: a random decoder killed and restarted, or paused past its
/// lease and continued.
async fn decoder_fault(fault: Fault, procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let n = procs.lock().expect("lock").decoders.len();
    let i = rng.random_range(0..n);
    if fault == Fault::KillDecoder {
        // Aim at an append in flight, so that its answer is lost (an indeterminate operation
        // for the checkers), when one comes within a second.
        return kill_decoder_aimed(procs, i, Duration::from_secs(1), rng).await;
    }
    let target = procs.lock().expect("lock").decoders[i].name.clone();
    procs.lock().expect("lock").decoders[i].pause();
    tokio::time::sleep(ms(rng, 1500, 3500)).await;
    procs.lock().expect("lock").decoders[i].resume();
    Ok(target)
}

/// Whether the last line of a decoder's history is the invocation of an append (sent, not yet
/// answered). Reads the file's tail only.
fn append_in_flight(history: &std::path::Path) -> bool {
    let Some(tail) = history_tail(history, 2_048) else {
        return false;
    };
    tail.lines().last().is_some_and(|l| {
        matches!(
            serde_json::from_str::<tokenlog_decoder::history::HistoryLine>(l),
            Ok(tokenlog_decoder::history::HistoryLine::Invoke {
                call: tokenlog_decoder::history::Call::Append { .. },
                ..
            })
        )
    })
}

/// The last `bytes` bytes of a decoder's history file, while it is being written (`None` when
/// it cannot be read, or the cut falls inside a character).
fn history_tail(history: &std::path::Path, bytes: u64) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(history).ok()?;
    let len = f.metadata().map_or(0, |m| m.len());
    f.seek(SeekFrom::Start(len.saturating_sub(bytes))).ok()?;
    let mut tail = String::new();
    f.read_to_string(&mut tail).ok()?;
    Some(tail)
}

/// `KillGateway`: a random gateway killed and restarted.
async fn kill_gateway(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let n = procs.lock().expect("lock").gateways.len();
    let i = rng.random_range(0..n);
    let target = procs.lock().expect("lock").gateways[i].name.clone();
    procs.lock().expect("lock").gateways[i].kill9();
    tokio::time::sleep(ms(rng, 200, 1000)).await;
    procs.lock().expect("lock").gateways[i].start()?;
    Ok(target)
}

/// `WipeNode`: a node other than node 1 killed, its data dir removed, and restarted.
async fn wipe_node(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    // Not node 1: the lowest id initializes a cluster when its data dir is empty.
    let n = procs.lock().expect("lock").nodes.len();
    let i = rng.random_range(1..n);
    let target = format!("node{}", i + 1);
    {
        let mut p = procs.lock().expect("lock");
        p.nodes[i].kill9();
        let dir = p.node_dirs[i].clone();
        let _ = std::fs::remove_dir_all(&dir);
    }
    tokio::time::sleep(ms(rng, 200, 1000)).await;
    procs.lock().expect("lock").nodes[i].start()?;
    Ok(target)
}

/// `Partition`: the leader isolated, a random node cut off, or a bridge; then healed.
async fn partition(procs: &Mutex<Procs>, leader: &Mutex<Option<usize>>, rng: &mut StdRng) -> anyhow::Result<String> {
    let known = *leader.lock().expect("lock");
    let kind = rng.random_range(0..3);
    let (lone, others, label) = match (kind, known) {
        (0, Some(l)) => (l, vec![(l + 1) % 3, (l + 2) % 3], "leader isolated"),
        (2, _) => {
            let mid = rng.random_range(0..3);
            // The two nodes other than `mid` cannot see each other; both see `mid`.
            ((mid + 1) % 3, vec![(mid + 2) % 3], "bridge")
        }
        _ => {
            let l = rng.random_range(0..3);
            (l, vec![(l + 1) % 3, (l + 2) % 3], "minority | majority")
        }
    };
    let target = format!(
        "{label}: node{} | {:?}",
        lone + 1,
        others.iter().map(|o| o + 1).collect::<Vec<_>>()
    );
    {
        let p = procs.lock().expect("lock");
        let net = p
            .net
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the partition nemesis needs --netns"))?;
        for o in &others {
            net.cut(lone, *o)?;
        }
    }
    tokio::time::sleep(ms(rng, 1000, 3000)).await;
    if let Some(net) = &procs.lock().expect("lock").net {
        net.heal()?;
    }
    Ok(target)
}

/// `RestartAll`: every node killed at once, then all restarted.
async fn restart_all(procs: &Mutex<Procs>, rng: &mut StdRng) -> anyhow::Result<String> {
    let target: String = "all nodes".into();
    {
        let mut p = procs.lock().expect("lock");
        for n in p.nodes.iter_mut() {
            n.kill9();
        }
    }
    tokio::time::sleep(ms(rng, 300, 1200)).await;
    let mut p = procs.lock().expect("lock");
    for n in p.nodes.iter_mut() {
        n.start()?;
    }
    Ok(target)
}
