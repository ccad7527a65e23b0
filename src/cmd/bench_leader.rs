//! `tokenlog bench leader-kill` (issue 11 bug 9): what a leader election costs a running
//! generation. 3 log nodes and one fake-model decoder are separate processes on loopback; a
//! watcher follows one long generation's committed records (reconnecting to any node, as a
//! gateway does). The current leader is kill -9'd `--kills` times (restarted a second later);
//! for each kill the longest gap between two records the watcher saw is measured, against the
//! longest gap in a stretch of the same length without a kill (the baseline, same run). At the
//! end the generation's grants tell whether any election turned into a takeover (it must not:
//! log time does not pass while no leader stamps it).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

use crate::cmd::bench::{check_node_ports_free, node_command, wait_for_leader, Procs};
use crate::cmd::bench_decoder::{binding, dargs, prompt_ids};
use crate::cmd::decoder::load_model;

#[derive(clap::Args, Clone)]
pub struct LeaderKillArgs {
    /// Leader kills.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub kills: u32,
    /// The fake model's time per token (ms).
    #[arg(long, default_value_t = 20)]
    pub step_ms: u64,
    /// The decoder's lease (ms). One shorter than an election shows whether the election
    /// counts against leases (it must not).
    #[arg(long, default_value_t = tokenlog_raftlog::limits::LEASE_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(tokenlog_raftlog::limits::LEASE_MS_MIN..=tokenlog_raftlog::limits::LEASE_MS_MAX))]
    pub lease_ms: u64,
    /// Seconds between kills (and the length of each measured stretch).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(2..=60))]
    pub every_s: u64,
    /// First loopback port (3 log nodes).
    #[arg(long, default_value_t = 27_700, value_parser = crate::cmd::base_port)]
    pub base_port: u16,
}

/// The goal of issue 11 bug 9: p99 of the longest gap after a leader kill.
const GOAL_GAP: Duration = Duration::from_millis(1500);

fn spawn_node(exe: &Path, dir: &Path, base: u16, i: u16) -> anyhow::Result<Child> {
    node_command(exe, dir, base, i)
        .stderr(std::fs::File::create(dir.join(format!("node-{}.log", i + 1)))?)
        .spawn()
        .context("start tokenlog node")
}

/// The longest gap between two consecutive arrivals within `from..to` (an arrival before `from`
/// opens the stretch; `to` closes it, so a stall that outlasts the stretch counts in full).
fn longest_gap(arrivals: &[Instant], from: Instant, to: Instant) -> Duration {
    let mut prev = arrivals.iter().rev().find(|&&t| t <= from).copied().unwrap_or(from);
    let mut longest = Duration::ZERO;
    for &t in arrivals.iter().filter(|&&t| t > from && t <= to) {
        longest = longest.max(t - prev);
        prev = t;
    }
    longest.max(to.saturating_duration_since(prev))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let k = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[k]
}

pub async fn leader_kill(a: LeaderKillArgs) -> anyhow::Result<()> {
    let (model, _) = load_model(&dargs(true, None, 1))?;
    let mut prompt = prompt_ids(model.as_ref())?;
    prompt.truncate(16);
    let dir = tempfile::tempdir()?;
    let exe = std::env::current_exe()?;
    check_node_ports_free(a.base_port)?;
    let mut nodes = Procs(Vec::new());
    for i in 0..3 {
        nodes.0.push(spawn_node(&exe, dir.path(), a.base_port, i)?);
    }
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", a.base_port + i)).collect();
    let client = LogClient::new(addrs.clone())?;
    wait_for_leader(&client).await?;
    let _decoder = Procs(vec![Command::new(&exe)
        .args(["decoder", "--fake", "--fake-step-ms", &a.step_ms.to_string()])
        .args(["--lease-ms", &a.lease_ms.to_string()])
        .args(["--cluster", &addrs.join(","), "--decoder-id", "bench-leader-kill"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("decoder.log"))?)
        .spawn()
        .context("start decoder")?]);
    let stretch = Duration::from_secs(a.every_s);
    // Enough tokens for the whole run, twice over.
    let tokens_needed = (u64::from(a.kills) + 2) * stretch.as_millis() as u64 / a.step_ms.max(1) * 2;
    let tokens = tokens_needed.clamp(1_000, u64::from(tokenlog_raftlog::limits::GENERATION_TOKENS_MAX)) as u32;
    let id = client
        .submit(pb::SubmitRequest {
            tenant: "bench".into(),
            request_id: "bench-leader-kill".into(),
            binding: Some(binding(model.as_ref(), &prompt, tokens)),
        })
        .await?
        .generation
        .context("no generation")?
        .generation_id;
    say!(
        "bench leader-kill: 3 log nodes, 1 fake-model decoder ({} ms/token, lease {} ms), one generation of up to {tokens} tokens; the leader kill -9'd {} times, {} s apart",
        a.step_ms, a.lease_ms, a.kills, a.every_s
    );
    let arrivals = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let watcher = tokio::spawn(follow(client.clone(), id, arrivals.clone()));
    // Wait for the first token, then the baseline stretch.
    let started = Instant::now();
    while arrivals.lock().expect("lock").is_empty() {
        if started.elapsed() > Duration::from_secs(30) {
            bail!(
                "no token within 30 s; the decoder's log: {}",
                dir.path().join("decoder.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let base_from = Instant::now();
    tokio::time::sleep(stretch).await;
    let baseline = longest_gap(&arrivals.lock().expect("lock"), base_from, Instant::now());
    let mut gaps = Vec::new();
    for k in 0..a.kills {
        let leader = client.cluster_status(true).await?.leader_id;
        if !(1..=3).contains(&leader) {
            bail!("no leader known before kill {}", k + 1);
        }
        let i = (leader - 1) as usize;
        let killed_at = Instant::now();
        let _ = nodes.0[i].kill();
        let _ = nodes.0[i].wait();
        tokio::time::sleep(Duration::from_secs(1)).await;
        nodes.0[i] = spawn_node(&exe, dir.path(), a.base_port, i as u16)?;
        tokio::time::sleep(stretch.saturating_sub(Duration::from_secs(1))).await;
        let gap = longest_gap(&arrivals.lock().expect("lock"), killed_at, Instant::now());
        say!(
            "  kill {}: node {leader} (the leader); longest gap between two tokens: {} ms",
            k + 1,
            gap.as_millis()
        );
        gaps.push(gap);
    }
    watcher.abort();
    let g = client.generation(id).await?;
    let _ = client
        .cancel(pb::CancelRequest {
            tenant: "bench".into(),
            request_id: "bench-leader-kill".into(),
        })
        .await;
    gaps.sort();
    let (p50, p99) = (percentile(&gaps, 0.5), percentile(&gaps, 0.99));
    say!(
        "longest gap after a leader kill: p50 {} ms, p99 {} ms; without a kill (baseline, {} s): {} ms; ratio p99/baseline {:.1}x",
        p50.as_millis(),
        p99.as_millis(),
        a.every_s,
        baseline.as_millis(),
        p99.as_secs_f64() / baseline.as_secs_f64().max(1e-3)
    );
    say!(
        "takeovers of the generation: {} ({} records committed)",
        g.takeovers,
        g.frontier
    );
    let met = p99 <= GOAL_GAP && g.takeovers == 0;
    say!(
        "goal (issue 11 bug 9: p99 <= {} ms, 0 takeovers caused by an election): {}",
        GOAL_GAP.as_millis(),
        if met { "met" } else { "NOT met" }
    );
    Ok(())
}

/// Follows generation `id`'s committed records from any node, reconnecting from the next seq
/// after an error; records each record's arrival time.
async fn follow(client: LogClient, id: u64, arrivals: Arc<Mutex<Vec<Instant>>>) {
    let mut next = 0u32;
    loop {
        if let Ok(mut s) = client.watch(id, next).await {
            while let Ok(Some(ev)) = s.message().await {
                let now = Instant::now();
                let mut a = arrivals.lock().expect("lock");
                for r in ev.records {
                    if r.seq == next {
                        a.push(now);
                        next += 1;
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_gap_counts_a_stall_that_outlasts_the_stretch() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let arrivals = [at(0), at(20), at(40), at(900), at(920)];
        assert_eq!(longest_gap(&arrivals, at(30), at(1000)), Duration::from_millis(860));
        assert_eq!(longest_gap(&arrivals, at(30), at(2000)), Duration::from_millis(1080));
        assert_eq!(longest_gap(&arrivals[..3], at(30), at(100)), Duration::from_millis(60));
    }
}
