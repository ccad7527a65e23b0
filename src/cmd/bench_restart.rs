//! `tokenlog bench restart`: a node's cost per committed token (resident memory, disk) and the
//! time a node with that many records takes to serve again after kill -9.
//!
//! One node (`--peers` of itself), default retention, a snapshot every `--snapshot-every` entries. Writers append
//! `--records` tokens spread over `--generations` generations; the node's RSS (`/proc`) and data
//! dir size are read before and after, and the bytes it wrote (`/proc/PID/io`). Then the node is killed with SIGKILL and started again,
//! and the time until it answers a linearizable status with everything applied is reported.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokenlog_raftlog::client::LogClient;

use crate::cmd::bench::{append_step_then, setup_writers_tagged, wait_for_leader, Procs};

#[derive(clap::Args, Clone)]
pub struct RestartArgs {
    /// Token records to commit before the restart.
    #[arg(long, default_value_t = 1_000_000)]
    pub records: u64,
    /// Generations they are spread over (each gets records / generations).
    #[arg(long, default_value_t = 1_000)]
    pub generations: usize,
    /// Concurrent writers.
    #[arg(long, default_value_t = 16)]
    pub writers: usize,
    /// Tokens per generation per append.
    #[arg(long, default_value_t = 32)]
    pub tokens_per_append: u32,
    /// The node's `--snapshot-every`: small enough that the restart loads a snapshot holding
    /// most records and replays the log after it.
    #[arg(long, default_value_t = 500)]
    pub snapshot_every: u64,
    #[arg(long, default_value_t = 27_300)]
    pub port: u16,
    /// Every generation finishes with its last append. Finished generations are sealed
    /// `SEAL_AFTER_MS` (10 s) of log time later, and the next snapshot moves their records out
    /// of memory: with `--rounds` spanning more than that, RSS levels off.
    #[arg(long)]
    pub finish: bool,
    /// Rounds of `--records` each, every round on fresh generations; RSS and disk are printed
    /// after each.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
}

fn start_node(dir: &Path, port: u16, snapshot_every: u64) -> anyhow::Result<Procs> {
    let exe = std::env::current_exe()?;
    let addr = format!("127.0.0.1:{port}");
    let child = Command::new(exe)
        .args(["node", "--id", "1", "--listen", &addr, "--peers", &format!("1={addr}")])
        .arg("--data-dir")
        .arg(dir)
        .args(["--snapshot-every", &snapshot_every.to_string()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .context("start tokenlog node")?;
    Ok(Procs(vec![child]))
}

fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("no VmRSS")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kb * 1024)
}

/// Bytes the process has passed to `write` and its kind (`wchar` of `/proc/PID/io`): the Raft
/// log, snapshots and cold segments, whatever the file system does with them.
fn written_bytes(pid: u32) -> anyhow::Result<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io"))?;
    Ok(io
        .lines()
        .find_map(|l| l.strip_prefix("wchar:"))
        .context("no wchar")?
        .trim()
        .parse()?)
}

fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => total += dir_bytes(&e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

pub async fn restart(a: RestartArgs) -> anyhow::Result<()> {
    if a.generations == 0 || a.writers == 0 || a.generations < a.writers || a.tokens_per_append == 0 {
        bail!("need generations >= writers >= 1 and tokens-per-append >= 1");
    }
    let per_gen = a.records / a.generations as u64;
    if per_gen == 0 || per_gen > tokenlog_raftlog::limits::GENERATION_TOKENS_MAX as u64 {
        bail!(
            "records / generations = {per_gen} tokens per generation: must be 1..={}",
            tokenlog_raftlog::limits::GENERATION_TOKENS_MAX
        );
    }
    let tmp = tempfile::tempdir()?;
    let data = tmp.path().join("node1");
    let addr = format!("127.0.0.1:{}", a.port);
    let mut procs = start_node(&data, a.port, a.snapshot_every)?;
    let client = LogClient::new(vec![addr.clone()])?;
    wait_for_leader(&client).await?;
    let pid = procs.0[0].id();
    let (rss0, disk0, io0) = (rss_bytes(pid)?, dir_bytes(&data), written_bytes(pid)?);
    let started = Instant::now();
    let mut written = 0;
    let mut oldest = None;
    for round in 0..a.rounds.max(1) {
        let tag = format!("r{round}-");
        let owned = setup_writers_tagged(&client, a.writers, a.generations / a.writers, &tag).await?;
        oldest = oldest.or(owned.first().and_then(|g| g.first()).map(|g| g.0));
        let mut tasks = Vec::new();
        for (w, gens) in owned.into_iter().enumerate() {
            let client = client.clone();
            let step = a.tokens_per_append;
            let finish = a.finish;
            tasks.push(tokio::spawn(async move {
                let mut seq = 0u32;
                let mut written = 0u64;
                while (seq as u64) < per_gen {
                    let n = step.min((per_gen - seq as u64) as u32);
                    let tokens: Vec<u32> = (seq..seq + n).collect();
                    let last = seq as u64 + n as u64 == per_gen;
                    append_step_then(&client, w, &gens, seq, &tokens, finish && last).await?;
                    seq += n;
                    written += n as u64 * gens.len() as u64;
                }
                anyhow::Ok(written)
            }));
        }
        for t in tasks {
            written += t.await??;
        }
        if a.rounds > 1 {
            let (rss, disk, io) = (rss_bytes(pid)?, dir_bytes(&data), written_bytes(pid)?);
            say!(
                "round {:>3}: {written:>10} records, {:6.1} s, RSS {:7.1} MiB, disk {:7.1} MiB, written {:8.1} MiB",
                round + 1,
                started.elapsed().as_secs_f64(),
                mib(rss),
                mib(disk),
                mib(io - io0)
            );
        }
    }
    let took = started.elapsed();
    // Let a snapshot that is being written finish before measuring.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss1, disk1, io1) = (rss_bytes(pid)?, dir_bytes(&data), written_bytes(pid)?);
    let status = client.cluster_status(true).await?;
    let per_m = |b: u64| mib(b) / (written as f64 / 1e6);
    if let Some(id) = oldest {
        // The oldest generation, read late: from disk when it was sealed before a snapshot.
        let t = Instant::now();
        let mut stream = client.watch(id, 0).await?;
        let mut got = 0u64;
        let mut terminal = false;
        while let Some(ev) = stream.message().await? {
            got += ev.records.len() as u64;
            if ev.terminal.is_some() {
                terminal = true;
                break;
            }
            if !a.finish && got >= per_gen {
                break;
            }
        }
        if got != per_gen {
            bail!("a late watch of generation {id} gave {got} records, {per_gen} were committed");
        }
        say!(
            "late watch of the oldest generation ({id}): {got} records{} in {:.1} ms",
            if terminal { " and its finish" } else { "" },
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    say!(
        "bench restart: {written} records in {} generations, {:.1} s ({:.0} tokens/s, {} writers)",
        a.generations * a.rounds.max(1) as usize,
        took.as_secs_f64(),
        written as f64 / took.as_secs_f64(),
        a.writers
    );
    say!(
        "memory    RSS {:.1} MiB -> {:.1} MiB: {:.1} MiB per million records",
        mib(rss0),
        mib(rss1),
        per_m(rss1.saturating_sub(rss0))
    );
    say!(
        "disk      {:.1} MiB -> {:.1} MiB: {:.1} MiB per million records (snapshot at entry {}, log to {})",
        mib(disk0),
        mib(disk1),
        per_m(disk1.saturating_sub(disk0)),
        status.snapshot_index,
        status.last_log_index
    );
    say!(
        "written   {:.1} MiB in all (log, snapshots, cold segments; /proc wchar): {:.1} MiB per million records",
        mib(io1 - io0),
        per_m(io1 - io0)
    );
    let applied = status.applied_index;
    let pid = procs.0[0].id();
    drop(procs); // SIGKILL
    let restarted = Instant::now();
    procs = start_node(&data, a.port, a.snapshot_every)?;
    let deadline = restarted + Duration::from_secs(120);
    loop {
        if let Ok(s) = client.cluster_status(true).await {
            if s.leader_id != 0 && s.applied_index >= applied {
                break;
            }
        }
        if Instant::now() > deadline {
            bail!("the node did not serve within 120 s of its restart");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    say!(
        "restart   kill -9 (pid {pid}) -> serving linearizable reads with all {applied} entries applied: {:.2} s",
        restarted.elapsed().as_secs_f64()
    );
    drop(procs);
    Ok(())
}
