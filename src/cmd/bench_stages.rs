//! `tokenlog bench stages`: decode through a pipeline of `tokenlog stage` processes against the
//! whole model in this process (issue 16's goal: a 3-stage pipeline decodes at >= 0.8x the
//! whole model's rate on the same machine). Same prompt, greedy, the same batching; the two
//! runs alternate per round and must give the same tokens.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokenlog_decoder::pipeline::{ChannelFor, PipelineConfig, PipelineModel};
use tokenlog_decoder::stage::parse_layers;
use tokenlog_decoder::{fetch, Model};

use crate::cmd::bench_decoder::{dargs, prompt_ids, raw_batched};
use crate::cmd::decoder::load_model;

#[derive(clap::Args, Clone)]
pub struct StagesArgs {
    /// Tokens generated per run.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    pub tokens: u32,
    /// GGUF model (default: the bundled SmolLM2, 30 layers).
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
    /// The stages' layer ranges, in order (default: 3 stages of about equal size).
    #[arg(long, value_delimiter = ',', value_parser = parse_layers)]
    pub split: Vec<std::ops::Range<usize>>,
    /// Generations decoded at once (comma-separated): one batched pass per step, in the whole
    /// model and in every stage.
    #[arg(long, value_delimiter = ',', default_value = "1,4", value_parser = crate::cmd::at_least_one)]
    pub concurrency: Vec<usize>,
    /// Rounds per concurrency (the whole model first in even rounds, the pipeline in odd ones).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    pub rounds: u64,
    /// Instead of the decode rates: kill -9 the middle stage of a pipeline head that decodes
    /// through a 3-node log this many times, with a hot spare each time, once with the rows
    /// kept (only the dead stage's layers rebuilt) and once with nothing kept (every generation
    /// fed through the whole pipeline again); kill -> next visible token, split into
    /// detection, splice, rebuild and first step.
    #[arg(long, default_value_t = 0, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1000))]
    pub kills: usize,
    /// Records committed before each kill (with --kills).
    #[arg(long, default_value_t = 20)]
    pub after: u32,
    /// First loopback port for the 3 log nodes (with --kills; spares listen from +100).
    #[arg(long, default_value_t = 27_500, value_parser = crate::cmd::base_port)]
    pub base_port: u16,
}

/// Kills the stage processes when the bench ends, however it ends.
pub(crate) struct Stages(pub(crate) Vec<Child>);

impl Drop for Stages {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts a `tokenlog stage` of `layers` on a free loopback port; its address.
fn start_stage(
    dir: &Path,
    model: &Path,
    layers: &std::ops::Range<usize>,
    stages: &mut Stages,
) -> anyhow::Result<String> {
    let name = format!("bench-stage-{}-{}", layers.start, layers.end);
    start_stage_at(dir, model, Some(layers), &name, "127.0.0.1:0", &[], stages)
}

/// Starts a `tokenlog stage` named `name` of `layers` (`None`: a cold spare) listening on
/// `listen`, with `extra` arguments; waits until it serves and returns its address.
pub(crate) fn start_stage_at(
    dir: &Path,
    model: &Path,
    layers: Option<&std::ops::Range<usize>>,
    name: &str,
    listen: &str,
    extra: &[&str],
    stages: &mut Stages,
) -> anyhow::Result<String> {
    let log = dir.join(format!("{name}.log"));
    let held = match layers {
        Some(l) => vec!["--layers".to_string(), format!("{}..{}", l.start, l.end)],
        None => vec!["--cold".to_string()],
    };
    let child = Command::new(std::env::current_exe()?)
        .args(["stage", "--model", &model.to_string_lossy()])
        .args(&held)
        .args(["--listen", listen, "--stage-id", name, "--threads", "1"])
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .context("starting a stage process")?;
    stages.0.push(child);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(addr) = text
            .lines()
            .find(|l| {
                l.starts_with(&format!("stage {name} serves"))
                    || l.starts_with(&format!("stage {name} is a cold spare"))
            })
            .and_then(|l| l.rsplit(" on ").next())
        {
            return Ok(addr.trim().to_string());
        }
        if let Some(status) = stages.0.last_mut().expect("pushed").try_wait()? {
            anyhow::bail!("stage {name} exited ({status}):\n{text}");
        }
        if Instant::now() > deadline {
            anyhow::bail!("stage {name} did not start within 120 s:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub async fn stages(a: StagesArgs) -> anyhow::Result<()> {
    let path = match &a.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model(&fetch::working_models_dir())?,
    };
    let (whole, name) = load_model(&dargs(false, Some(path.clone()), 1))?;
    let split = match a.split.is_empty() {
        false => a.split.clone(),
        true => {
            let n = tokenlog_decoder::stage::StageModel::layer_count(&path)?;
            let k = 3.min(n);
            (0..k).map(|i| i * n / k..(i + 1) * n / k).collect()
        }
    };
    if a.kills > 0 {
        return crate::cmd::bench_stage_kills::kills(&a, &path, whole.as_ref(), &name, &split).await;
    }
    let dir = tempfile::tempdir()?;
    let mut procs = Stages(Vec::new());
    let mut addrs = Vec::new();
    for r in &split {
        addrs.push(start_stage(dir.path(), &path, r, &mut procs)?);
    }
    let channel_for: ChannelFor = Box::new(|addr: &str| {
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map(|e| tokenlog_raftlog::client::with_keepalive(e).connect_lazy())
            .map_err(|e| e.to_string())
    });
    let pipeline: std::sync::Arc<dyn Model> = {
        let (p, a) = (path.clone(), addrs.clone());
        std::sync::Arc::new(
            tokio::task::spawn_blocking(move || {
                PipelineModel::connect(&p, PipelineConfig::new(&a, &[], channel_for, "bench-head"))
            })
            .await??,
        )
    };
    let prompt = prompt_ids(whole.as_ref())?;
    let ranges: Vec<String> = split.iter().map(|r| format!("{}..{}", r.start, r.end)).collect();
    say!(
        "bench stages: model {name}, stages {} (processes on loopback, 1 thread each), whole model in this process (1 thread); prompt {} tokens, {} tokens per run, {} rounds",
        ranges.join(" "),
        prompt.len(),
        a.tokens,
        a.rounds
    );
    say!("concurrency  whole tok/s  pipeline tok/s  pipeline/whole  same tokens");
    for &c in &a.concurrency {
        let (mut whole_n, mut whole_s, mut pipe_n, mut pipe_s) = (0usize, 0f64, 0usize, 0f64);
        let mut same = true;
        for round in 0..a.rounds {
            let order: [&std::sync::Arc<dyn Model>; 2] = match round % 2 {
                0 => [&whole, &pipeline],
                _ => [&pipeline, &whole],
            };
            let mut runs = Vec::new();
            for m in order {
                runs.push(raw_batched(m, &prompt, a.tokens, c.max(1)).await?);
            }
            if round % 2 == 1 {
                runs.reverse();
            }
            let [(wt, ws), (pt, ps)] = <[_; 2]>::try_from(runs).map_err(|_| anyhow::anyhow!("two runs"))?;
            same &= wt == pt;
            whole_n += wt.iter().map(Vec::len).sum::<usize>();
            pipe_n += pt.iter().map(Vec::len).sum::<usize>();
            whole_s += ws;
            pipe_s += ps;
        }
        let (w, p) = (whole_n as f64 / whole_s, pipe_n as f64 / pipe_s);
        say!(
            "{c:>11}  {w:>11.1}  {p:>14.1}  {:>14.3}  {}",
            p / w,
            if same { "yes" } else { "NO" }
        );
        if !same {
            eprintln!("warning: the pipeline's tokens differ from the whole model's");
        }
    }
    Ok(())
}
