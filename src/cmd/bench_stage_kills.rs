//! `tokenlog bench stages --kills N`: kill -9 of a pipeline's middle stage -> the next visible
//! token (issue 16's goal: p99 <= 500 ms with a hot spare and only the dead stage's layers
//! rebuilt, on CPU, SmolLM2 in 3 stages).
//!
//! A 3-node log, the stages (`tokenlog stage --cluster ...`, fenced by and registered in the
//! log), and a pipeline head (`tokenlog decoder --pipeline ...`); one greedy generation at a
//! time. After `--after` records the bench kills the current middle stage; the head splices a
//! spare in (one write to the log) and rebuilds. Four ways: a hot spare (given to the head)
//! with the rows kept (the spare rebuilds its own layers); with nothing kept (every position
//! is fed through every stage again); a cold spare found in the log, which loads the layers
//! when spliced in; and SIGSTOP instead of kill -9 (the stage's stream stays open: detected by
//! its registration in the log lapsing). The head logs when it noticed, how long the splice and the rebuild took,
//! and the positions of the pass that failed; the bench waits for the token that pass gives (the
//! first one the dead stage could not have computed) and splits kill -> visible into detection
//! (kill -> noticed), splice, rebuild and first step (the rest: the pass again, sampling, the
//! append's commit, the Watch). All times on this machine's wall clock.

use std::ops::Range;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use tokenlog_decoder::Model;
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;

use crate::cmd::bench::{start_tokenlog, wait_for_leader};
use crate::cmd::bench_decoder::{binding, prompt_ids};
use crate::cmd::bench_stages::{start_stage_at, Stages, StagesArgs};

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// What the head logged of one splice.
#[derive(Debug)]
struct Splice {
    noticed_us: u64,
    splice_us: u64,
    load_us: u64,
    rebuild_us: u64,
    resumes_at: u64,
    in_full: u64,
}

/// A `key=value` field of a log line (plain text: the head's stderr is a file).
fn field(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    line[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// The head's splices so far, in order.
fn splices(log: &Path) -> Vec<Splice> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("the spare rebuilt its layers"))
        .filter_map(|l| {
            Some(Splice {
                noticed_us: field(l, "noticed_unix_us")?,
                splice_us: field(l, "splice_us")?,
                load_us: field(l, "load_us")?,
                rebuild_us: field(l, "rebuild_us")?,
                resumes_at: field(l, "resumes_at")?,
                in_full: field(l, "in_full")?,
            })
        })
        .collect()
}

/// The last lines of a log.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// One way of failing the middle stage and replacing it.
struct Mode {
    label: &'static str,
    keep_mib: u64,
    /// The spare is a cold one, registered in the log (not given to the head).
    cold: bool,
    /// SIGSTOP instead of kill -9.
    pause: bool,
}

/// One kill: kill -> visible, and its parts (µs).
struct Timing {
    total: u64,
    detect: u64,
    splice: u64,
    /// The part of the splice a cold spare spent loading its layers.
    load: u64,
    rebuild: u64,
    first_step: u64,
    /// Generations fed again in full (not rebuilt from kept rows).
    in_full: u64,
}

pub async fn kills(
    a: &StagesArgs,
    path: &Path,
    model: &dyn Model,
    name: &str,
    split: &[Range<usize>],
) -> anyhow::Result<()> {
    if split.len() < 3 {
        bail!(
            "--kills needs at least 3 stages (a middle one to kill); --split gave {}",
            split.len()
        );
    }
    let mid = split.len() / 2;
    let prompt = prompt_ids(model)?;
    let dir = tempfile::tempdir()?;
    let _nodes = start_tokenlog(dir.path(), a.base_port)?;
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", a.base_port + i)).collect();
    let cluster = addrs.join(",");
    let client = LogClient::new(addrs)?;
    wait_for_leader(&client).await?;
    let with_log = ["--cluster", cluster.as_str()];
    // The stages around the middle serve both heads.
    let mut fixed = Stages(Vec::new());
    let mut around = Vec::new();
    for (i, r) in split.iter().enumerate() {
        if i != mid {
            around.push(start_stage_at(
                dir.path(),
                path,
                Some(r),
                &format!("s{i}"),
                "127.0.0.1:0",
                &with_log,
                &mut fixed,
            )?);
        }
    }
    let ranges: Vec<String> = split.iter().map(|r| format!("{}..{}", r.start, r.end)).collect();
    say!(
        "bench stages --kills {}: model {name}, stages {} (processes on loopback, 1 thread each, fenced by a 3-node log), \
         the middle stage ({}) fails after {} records, a new spare each time; greedy, prompt {} tokens",
        a.kills,
        ranges.join(" "),
        ranges[mid],
        a.after,
        prompt.len()
    );
    let modes = [
        Mode {
            label: "kill -9, hot spare, rows kept: the spare rebuilds its own layers",
            keep_mib: 1024,
            cold: false,
            pause: false,
        },
        Mode {
            label: "kill -9, hot spare, nothing kept: every position through every stage again",
            keep_mib: 0,
            cold: false,
            pause: false,
        },
        Mode {
            label: "kill -9, cold spare registered in the log (loads the layers when spliced in), rows kept",
            keep_mib: 1024,
            cold: true,
            pause: false,
        },
        Mode {
            label: "SIGSTOP (the stream stays open; detected by its registration lapsing), hot spare, rows kept",
            keep_mib: 1024,
            cold: false,
            pause: true,
        },
    ];
    for (m, mode) in modes.iter().enumerate() {
        let keep_mib = mode.keep_mib;
        say!("\n{} (--pipeline-keep-mib {keep_mib})", mode.label);
        let spare_addr = |i: usize| format!("127.0.0.1:{}", a.base_port as usize + 100 + m * a.kills + i);
        // chain.0[0]: the middle stage; chain.0[i + 1]: spare i (started before kill i).
        let mut chain = Stages(Vec::new());
        let mid_addr = start_stage_at(
            dir.path(),
            path,
            Some(&split[mid]),
            &format!("mid-{m}"),
            "127.0.0.1:0",
            &with_log,
            &mut chain,
        )?;
        let mut stages = around.clone();
        stages.insert(mid, mid_addr);
        // Cold spares are found in the log, hot ones are given to the head.
        let spares: Vec<String> = match mode.cold {
            true => Vec::new(),
            false => (0..a.kills).map(spare_addr).collect(),
        };
        let head_id = format!("bench-head-{m}");
        let head_log = dir.path().join(format!("{head_id}.log"));
        let mut head = Stages(vec![Command::new(std::env::current_exe()?)
            .args(["decoder", "--cluster", &cluster, "--decoder-id", &head_id])
            .args(["--model", &path.to_string_lossy()])
            .args(["--pipeline", &stages.join(",")])
            .args(match spares.is_empty() {
                true => vec![],
                false => vec!["--pipeline-spares".to_string(), spares.join(",")],
            })
            .args(["--pipeline-keep-mib", &keep_mib.to_string()])
            .args(["--capacity", "1", "--lease-ms", "5000", "--threads", "1"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&head_log)?)
            .spawn()
            .context("starting the pipeline head")?]);
        let deadline = Instant::now() + Duration::from_secs(120);
        while !client
            .list_models()
            .await
            .is_ok_and(|ms| ms.models.iter().any(|x| x.decoders.contains(&head_id)))
        {
            if let Some(st) = head.0[0].try_wait()? {
                bail!(
                    "the head exited ({st}):\n{}",
                    std::fs::read_to_string(&head_log).unwrap_or_default()
                );
            }
            if Instant::now() > deadline {
                bail!("the head did not register within 120 s (log: {})", head_log.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut hist: Vec<Histogram<u64>> = (0..6).map(|_| Histogram::new(3)).collect::<Result<_, _>>()?;
        let mut left_head = 0;
        for k in 0..a.kills {
            let spare = format!("spare-{m}-{k}");
            start_stage_at(
                dir.path(),
                path,
                (!mode.cold).then_some(&split[mid]),
                &spare,
                &spare_addr(k),
                &with_log,
                &mut chain,
            )?;
            // A spare the head finds in the log must be there before the kill.
            let deadline = Instant::now() + Duration::from_secs(30);
            while !client
                .list_stages(true)
                .await
                .is_ok_and(|r| r.stages.iter().any(|s| s.stage_id == spare))
            {
                if Instant::now() > deadline {
                    bail!("spare {spare} did not register in the log within 30 s");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let t = kill_round(
                &client,
                model,
                &prompt,
                a,
                &format!("kill-{m}-{k}"),
                &mut chain,
                k,
                &head_log,
                &mut left_head,
                mode.pause,
            )
            .await?;
            say!(
                "kill {:>2}: next token visible after {:>7.1} ms = detection {:>6.1} + splice {:>6.1} (load {:>6.1}) + rebuild {:>6.1} + first step {:>6.1} (fed again in full: {})",
                k + 1,
                t.total as f64 / 1e3,
                t.detect as f64 / 1e3,
                t.splice as f64 / 1e3,
                t.load as f64 / 1e3,
                t.rebuild as f64 / 1e3,
                t.first_step as f64 / 1e3,
                t.in_full
            );
            for (h, v) in hist
                .iter_mut()
                .zip([t.total, t.detect, t.splice, t.load, t.rebuild, t.first_step])
            {
                h.record(v.max(1))?;
            }
        }
        let q = |h: &Histogram<u64>, p: f64| h.value_at_quantile(p) as f64 / 1e3;
        say!("over {} kills (ms):        p50      p99", a.kills);
        for (h, what) in hist.iter().zip([
            "kill -> next token",
            "detection",
            "splice",
            "  of it: load",
            "rebuild",
            "first step",
        ]) {
            say!("  {what:<20} {:>8.1} {:>8.1}", q(h, 0.5), q(h, 0.99));
        }
        say!("generations that left their head (a new epoch): {left_head}");
    }
    Ok(())
}

/// One generation: `a.after` records, kill -9 of the current middle stage (`chain.0[k]`), then
/// the token of the pass that failed.
#[allow(clippy::too_many_arguments)]
async fn kill_round(
    client: &LogClient,
    model: &dyn Model,
    prompt: &[u32],
    a: &StagesArgs,
    rid: &str,
    chain: &mut Stages,
    k: usize,
    head_log: &Path,
    left_head: &mut usize,
    pause: bool,
) -> anyhow::Result<Timing> {
    let sub = client
        .submit(pb::SubmitRequest {
            tenant: "bench".into(),
            request_id: rid.into(),
            binding: Some(binding(model, prompt, a.after + 400)),
        })
        .await?;
    let gid = sub.generation.context("no generation")?.generation_id;
    let mut w = client.watch(gid, 0).await?;
    let mut seen = 0u64;
    while seen < a.after as u64 {
        let ev = w.message().await?.context("watch ended")?;
        seen += ev.records.len() as u64;
    }
    let before = splices(head_log).len();
    let killed = unix_us();
    match pause {
        false => {
            chain.0[k].kill().context("kill -9 of the middle stage")?;
            let _ = chain.0[k].wait();
        }
        // Stopped, not dead: its connections stay open and its registration lapses. It is
        // killed when the round is over.
        true => {
            let st = Command::new("kill")
                .args(["-STOP", &chain.0[k].id().to_string()])
                .status()?;
            if !st.success() {
                bail!("kill -STOP of the middle stage failed");
            }
        }
    }
    // The records as they become visible, until the head logged this splice and the token of
    // the pass that failed arrived.
    let mut arrivals: Vec<(u64, u64)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (splice, visible) = loop {
        if Instant::now() > deadline {
            bail!(
                "no splice and next token within 60 s (head log: {})",
                head_log.display()
            );
        }
        tokio::select! {
            ev = w.message() => {
                let ev = ev?.context("watch ended")?;
                let at = unix_us();
                arrivals.extend(ev.records.iter().map(|r| (r.seq as u64, at)));
                if let Some(t) = ev.terminal {
                    bail!(
                        "generation {gid} ended before its next token after the kill ({}); the head's log:\n{}",
                        t.finish_detail,
                        tail(head_log)
                    );
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
        if let Some(s) = splices(head_log).into_iter().nth(before) {
            let target = s.resumes_at.saturating_sub(prompt.len() as u64);
            if let Some(&(_, at)) = arrivals.iter().find(|(seq, _)| *seq == target) {
                break (s, at);
            }
        }
    };
    if pause {
        let _ = chain.0[k].kill();
        let _ = chain.0[k].wait();
    }
    let _ = client
        .cancel(pb::CancelRequest {
            tenant: "bench".into(),
            request_id: rid.into(),
        })
        .await;
    let g = client
        .get(pb::GetRequest {
            generation_id: gid,
            linearizable: true,
            ..Default::default()
        })
        .await?
        .generation
        .context("generation gone")?;
    if g.takeovers > 0 {
        *left_head += 1;
    }
    let rebuilt = splice.noticed_us + splice.splice_us + splice.rebuild_us;
    Ok(Timing {
        total: visible.saturating_sub(killed),
        detect: splice.noticed_us.saturating_sub(killed),
        splice: splice.splice_us,
        load: splice.load_us,
        rebuild: splice.rebuild_us,
        first_step: visible.saturating_sub(rebuilt),
        in_full: splice.in_full,
    })
}
