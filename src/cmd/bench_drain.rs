//! `tokenlog bench drain`: a decoder with several running generations is told to stop (SIGTERM)
//! and hands every one to a second decoder with its KV cache (planned handoff); the longest gap
//! between two visible tokens at any client during the drain, against the normal gap between
//! tokens measured on the same generations just before it (the ratio is the goal's measure:
//! at most 2x).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

use crate::cmd::bench::{cpu_ticks, start_tokenlog, wait_for_leader, TICKS_PER_S};
use crate::cmd::bench_decoder::{binding, dargs, prompt_ids, Dec};
use crate::cmd::decoder::load_model;

/// How long the destination runs before the drain (its start is not the drain's cost).
const DESTINATION_WARM_UP: Duration = Duration::from_secs(1);

#[derive(clap::Args, Clone)]
pub struct DrainArgs {
    /// Drains to run, each with fresh decoders.
    #[arg(long, default_value_t = 2, value_parser = crate::cmd::at_least_one)]
    pub rounds: usize,
    /// Generations running on the drained decoder (its capacity; the other has the same).
    #[arg(long, default_value_t = 4, value_parser = crate::cmd::at_least_one)]
    pub generations: usize,
    /// Records every generation commits before the drain; the normal gap is measured over the
    /// last half of them.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(2..))]
    pub after: u32,
    /// Records every generation commits at the destination before the round ends.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub then: u32,
    /// Use the fake model (with --fake-step-ms per step) instead of SmolLM2.
    #[arg(long)]
    pub fake: bool,
    #[arg(long, default_value_t = 20)]
    pub fake_step_ms: u64,
    /// First loopback port for the 3 log nodes.
    #[arg(long, default_value_t = 27_500, value_parser = crate::cmd::base_port)]
    pub base_port: u16,
}

fn spawn(a: &DrainArgs, cluster: &str, id: &str, dir: &std::path::Path) -> anyhow::Result<Dec> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["decoder", "--cluster", cluster, "--decoder-id", id])
        .args(["--capacity", &a.generations.to_string(), "--threads", "1"])
        .args(["--handoff-listen", "127.0.0.1:0"]);
    if a.fake {
        cmd.args(["--fake", "--fake-step-ms", &a.fake_step_ms.to_string()]);
    }
    let child = cmd
        // TOKENLOG_BENCH_DECODER_LOG: another filter for the decoders' logs (with
        // TOKENLOG_BENCH_KEEP to keep them), e.g. `info,tokenlog_decoder::steps=debug`.
        .env(
            "RUST_LOG",
            std::env::var("TOKENLOG_BENCH_DECODER_LOG").unwrap_or_else(|_| "info,openraft=warn".into()),
        )
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("{id}.log")))?)
        .spawn()
        .context("start decoder")?;
    Ok(Dec {
        child: Some(child),
        id: id.to_string(),
    })
}

async fn takes_handoffs(client: &LogClient, id: &str) -> bool {
    client
        .list_models()
        .await
        .is_ok_and(|m| m.models.iter().any(|x| x.handoff_addrs.contains_key(id)))
}

async fn wait_registered(client: &LogClient, id: &str, dir: &std::path::Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !takes_handoffs(client, id).await {
        if Instant::now() > deadline {
            bail!("decoder {id} did not register within 120 s (logs in {})", dir.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Arrival times of one generation's records at a watching client, with their epochs.
type Arrivals = Vec<(Instant, u64)>;

/// Watches `gid` from seq 0 until `stop` records at an epoch above 1 have arrived.
async fn watch(client: LogClient, gid: u64, stop: u32) -> anyhow::Result<Arrivals> {
    let mut w = client.watch(gid, 0).await?;
    let mut out = Arrivals::new();
    let mut after = 0;
    while after < stop {
        let ev = w.message().await?.context("watch ended")?;
        let now = Instant::now();
        for r in &ev.records {
            out.push((now, r.epoch));
            after += u32::from(r.epoch > 1);
        }
        if ev.terminal.is_some() {
            bail!("generation {gid} ended during the round");
        }
    }
    Ok(out)
}

/// The machine's CPU time so far, from `/proc/stat` (Linux): busy, stolen by the hypervisor,
/// and all, in clock ticks over every CPU.
#[derive(Clone, Copy)]
struct CpuTimes {
    busy: u64,
    steal: u64,
    total: u64,
}

fn cpu_times() -> Option<CpuTimes> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let f: Vec<u64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let (idle, iowait, steal) = (*f.get(3)?, *f.get(4)?, f.get(7).copied().unwrap_or(0));
    let total: u64 = f.iter().take(8).sum();
    Some(CpuTimes {
        busy: total - idle - iowait - steal,
        steal,
        total,
    })
}

/// How many CPUs were busy (and stolen) on average between two readings: `"1.93 of 2 (steal
/// 0.01)"`.
fn cores_busy(from: Option<CpuTimes>, to: Option<CpuTimes>) -> String {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    match (from, to) {
        (Some(a), Some(b)) if b.total > a.total => {
            let t = (b.total - a.total) as f64;
            format!(
                "{:.2} of {cpus} (steal {:.2})",
                (b.busy - a.busy) as f64 / t * cpus,
                (b.steal - a.steal) as f64 / t * cpus
            )
        }
        _ => "unknown".into(),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub async fn drain(a: DrainArgs) -> anyhow::Result<()> {
    let (model, name) = load_model(&dargs(a.fake, None, 1))?;
    let mut prompt = prompt_ids(model.as_ref())?;
    if a.fake {
        prompt.truncate(16);
    }
    let dir = tempfile::tempdir()?;
    say!("process logs in {} (removed at the end)", dir.path().display());
    let done = rounds(&a, dir.path(), model.as_ref(), &name, &prompt).await;
    // TOKENLOG_BENCH_KEEP: the process logs stay, whether the rounds ended well or not.
    if std::env::var_os("TOKENLOG_BENCH_KEEP").is_some() {
        say!("kept {}", dir.keep().display());
    }
    let mut ratios = done?;
    ratios.sort_by(f64::total_cmp);
    say!(
        "longest gap / normal gap over {} drains: best {:.2}x, worst {:.2}x (goal: at most 2x)",
        ratios.len(),
        ratios.first().copied().unwrap_or_default(),
        ratios.last().copied().unwrap_or_default()
    );
    Ok(())
}

/// Runs the rounds with process logs in `dir`: each round's longest / normal gap.
async fn rounds(
    a: &DrainArgs,
    dir: &std::path::Path,
    model: &dyn tokenlog_decoder::Model,
    name: &str,
    prompt: &[u32],
) -> anyhow::Result<Vec<f64>> {
    let nodes = start_tokenlog(dir, a.base_port)?;
    let node_pids: Vec<u32> = nodes.0.iter().map(|c| c.id()).collect();
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", a.base_port + i)).collect();
    let cluster = addrs.join(",");
    let client = LogClient::new(addrs)?;
    wait_for_leader(&client).await?;
    say!(
        "bench drain: model {name}, {} generations on one decoder, SIGTERM after {} records each, handed to a second decoder",
        a.generations, a.after
    );
    let mut ratios = Vec::new();
    for round in 0..a.rounds {
        let src = spawn(a, &cluster, &format!("drain-src-{round}"), dir)?;
        wait_registered(&client, &src.id, dir).await?;
        let mut gids = Vec::new();
        for g in 0..a.generations {
            // Distinct prompts: a shared prefix would not matter, but distinct is the usual case.
            let mut p = prompt.to_vec();
            p.push(p[g % p.len()]);
            let sub = client
                .submit(pb::SubmitRequest {
                    tenant: "bench".into(),
                    request_id: format!("drain-{round}-{g}"),
                    binding: Some(binding(model, &p, a.after + a.then + 2_000)),
                })
                .await?;
            gids.push(sub.generation.context("no generation")?.generation_id);
        }
        let watchers: Vec<_> = gids
            .iter()
            .map(|&gid| tokio::spawn(watch(client.clone(), gid, a.then)))
            .collect();
        // All of them on the source before the destination starts: a destination that is up
        // at once (the fake model loads in no time) would otherwise take some of them first.
        let deadline = Instant::now() + Duration::from_secs(120);
        for &gid in &gids {
            while client.generation(gid).await?.lease.is_none_or(|l| l.owner != src.id) {
                if Instant::now() > deadline {
                    bail!("generation {gid} was not taken by the source within 120 s");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let dst = spawn(a, &cluster, &format!("drain-dst-{round}"), dir)?;
        wait_registered(&client, &dst.id, dir).await?;
        // A decoder that just started pages its model in and allocates for a while; a rolling
        // restart drains into decoders that have been up for longer than that.
        tokio::time::sleep(DESTINATION_WARM_UP).await;
        let dst_pid = dst.child.as_ref().map_or(0, |c| c.id());
        // CPU time of the destination and of the log nodes, in clock ticks.
        let others = {
            let node_pids = node_pids.clone();
            move || (cpu_ticks(dst_pid), node_pids.iter().map(|&p| cpu_ticks(p)).sum::<u64>())
        };
        let (calm_from, others_calm, calm_at) = (cpu_times(), others(), Instant::now());
        // Every generation past `after` records, all on the source.
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let mut ready = true;
            for &gid in &gids {
                let g = client.generation(gid).await?;
                ready &= g.frontier >= a.after && g.lease.is_some_and(|l| l.owner == src.id);
            }
            if ready {
                break;
            }
            if Instant::now() > deadline {
                bail!("generations did not reach {} records on the source", a.after);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut src = src;
        let mut child = src.child.take().context("source running")?;
        let pid = child.id();
        let drained = Instant::now();
        let (drain_from, others_from) = (cpu_times(), others());
        Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
        let exited = tokio::task::spawn_blocking({
            let others = others.clone();
            move || {
                let status = child.wait();
                (status, Instant::now(), cpu_times(), others())
            }
        });
        let mut normal = Vec::new();
        let mut longest = Duration::ZERO;
        let mut worst_gaps = Vec::new();
        for (w, gid) in watchers.into_iter().zip(&gids) {
            let arrivals = w.await??;
            // Normal: gaps between records before the drain, over the last half of them.
            let before: Vec<Instant> = arrivals.iter().filter(|(t, _)| *t < drained).map(|(t, _)| *t).collect();
            let from = before.len() / 2;
            normal.extend(before[from..].windows(2).map(|p| p[1] - p[0]));
            // During the drain: from the last record before it to the end of the round.
            let start = before.len().saturating_sub(1);
            let (worst, at) = arrivals[start..]
                .windows(2)
                .map(|p| (p[1].0 - p[0].0, p[0].0))
                .max()
                .unwrap_or((Duration::ZERO, drained));
            longest = longest.max(worst);
            // Where it was: ms after SIGTERM; before the move (the source's records, epoch 1),
            // across it, or after it (the destination's).
            let moved_at = arrivals.iter().find(|(_, e)| *e > 1).map(|(t, _)| *t);
            worst_gaps.push(format!(
                "g{gid} {:.0} ms at +{:.0} ms ({})",
                ms(worst),
                ms(at.saturating_duration_since(drained)),
                match moved_at {
                    Some(m) if m > at && m <= at + worst => "across the move",
                    Some(m) if m <= at => "at the destination",
                    _ => "at the source",
                }
            ));
            let g = client
                .get(pb::GetRequest {
                    generation_id: *gid,
                    linearizable: true,
                    ..Default::default()
                })
                .await?;
            let phase = g.handoff.map_or(0, |h| h.phase);
            if phase != pb::HandoffPhase::SourceReleased as i32 {
                bail!("generation {gid} was not handed over (phase {phase})");
            }
        }
        normal.sort();
        let median = normal.get(normal.len() / 2).copied().unwrap_or_default();
        // The same measure before the drain: how long a gap gets without one (noise).
        let calm = normal.last().copied().unwrap_or_default();
        let (exit, drain_to, others_to) = {
            let (status, at, cpu, others) = exited.await?;
            let status = status?;
            if !status.success() {
                bail!("the drained decoder exited with {status}");
            }
            (at - drained, cpu, others)
        };
        drop(src);
        let ratio = longest.as_secs_f64() / median.as_secs_f64().max(1e-6);
        ratios.push(ratio);
        say!(
            "round {}: normal gap (median) {:>6.1} ms, longest gap during the drain {:>6.1} ms = {:.2}x; source exited {:>6.1} ms after SIGTERM",
            round + 1,
            ms(median),
            ms(longest),
            ratio,
            ms(exit)
        );
        say!(
            "  longest gap of each generation: {}; before the drain the longest was {:.0} ms",
            worst_gaps.join(", "),
            ms(calm)
        );
        // Whether the machine had room: the source decoding alone (the destination idle)
        // against the drain (both decoders, the handoffs, the log nodes).
        // Of them: the destination, the log nodes (the rest is the source and this bench), in
        // CPUs on average.
        let share = |from: (u64, u64), to: (u64, u64), over: Duration| {
            let cpus = |t: u64| t as f64 / TICKS_PER_S / over.as_secs_f64().max(1e-6);
            format!(
                "the destination {:.2}, the log nodes {:.2}",
                cpus(to.0.saturating_sub(from.0)),
                cpus(to.1.saturating_sub(from.1))
            )
        };
        // Clock ticks are 10 ms: a short window says nothing.
        let before = if drained - calm_at >= Duration::from_millis(500) {
            format!(
                "{} ({})",
                cores_busy(calm_from, drain_from),
                share(others_calm, others_from, drained - calm_at)
            )
        } else {
            "not measured (the source reached --after during the destination's warm-up)".into()
        };
        say!(
            "  CPUs busy: before the drain {before}; during it {} ({})",
            cores_busy(drain_from, drain_to),
            share(others_from, others_to, exit)
        );
        // Per generation received: the positions the destination took as rows the source
        // streamed, instead of computing them (its log's `rows=`).
        let log = std::fs::read_to_string(dir.join(format!("{}.log", dst.id))).unwrap_or_default();
        let rows: Vec<String> = log
            .lines()
            .filter(|l| l.contains("generation received with its cache"))
            .filter_map(|l| {
                l.split_once(" rows=")
                    .map(|(_, r)| r.chars().take_while(char::is_ascii_digit).collect())
            })
            .collect();
        say!(
            "  positions the destination appended from the source's rows: {}",
            if rows.is_empty() {
                "none".into()
            } else {
                rows.join(", ")
            }
        );
        for g in 0..gids.len() {
            let _ = client
                .cancel(pb::CancelRequest {
                    tenant: "bench".into(),
                    request_id: format!("drain-{round}-{g}"),
                })
                .await;
        }
        drop(dst);
    }
    Ok(ratios)
}
