//! `tokenlog decoder`: a decoder process. Loads a model (the bundled SmolLM2 by default, or the
//! deterministic fake model), registers with the log, and runs the lease worker until
//! SIGINT/SIGTERM, then releases what it holds so another decoder takes over at once.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokenlog_decoder::worker::{Worker, WorkerConfig};
use tokenlog_decoder::{fetch, threads, DeviceSpec, FakeConfig, FakeModel, GgufModel, Model};
use tokenlog_raftlog::client::LogClient;

#[derive(clap::Args, Clone)]
pub struct DecoderArgs {
    /// Addresses of log nodes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1:7001")]
    pub cluster: Vec<String>,
    /// GGUF model file. Default: the bundled SmolLM2-135M-Instruct (Q4_1), fetched into
    /// ./models on first use.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Use the deterministic fake model instead (instant; for tests).
    #[arg(long, conflicts_with = "model")]
    pub fake: bool,
    /// Per-step delay of the fake model (ms), to make a slow decoder.
    #[arg(long, default_value_t = 0)]
    pub fake_step_ms: u64,
    /// Name clients use for this model (default: derived from the model).
    #[arg(long)]
    pub model_name: Option<String>,
    /// `cpu` or `cuda:N` (needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Generations decoded at once.
    #[arg(long, default_value_t = 4)]
    pub capacity: usize,
    /// Lease length (ms); renewed by every append and by a timer when a step is slow.
    #[arg(long, default_value_t = 1_000)]
    pub lease_ms: u64,
    /// Model threads. One per decoder when several share a host (candle's pool collapses
    /// under shared cores).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Unique id of this process (default: host-pid-random).
    #[arg(long)]
    pub decoder_id: Option<String>,
}

fn device(s: &str) -> anyhow::Result<DeviceSpec> {
    match s {
        "cpu" => Ok(DeviceSpec::Cpu),
        _ => {
            let n = s.strip_prefix("cuda:").context("--device is cpu or cuda:N")?;
            Ok(DeviceSpec::Cuda(n.parse().context("cuda:N needs a number")?))
        }
    }
}

/// Loads the model the arguments name; returns it and its client-facing name.
pub fn load_model(a: &DecoderArgs) -> anyhow::Result<(Arc<dyn Model>, String)> {
    threads::init_cpu_threads(a.threads);
    if a.fake {
        let cfg = FakeConfig {
            step_delay: Duration::from_millis(a.fake_step_ms),
            eos_one_in: 64,
            ..Default::default()
        };
        return Ok((
            Arc::new(FakeModel::new(cfg)?),
            a.model_name.clone().unwrap_or_else(|| "fake".into()),
        ));
    }
    let path = match &a.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model(&fetch::repo_models_dir()).context("fetching the default model")?,
    };
    eprintln!("loading {} on {} ...", path.display(), a.device);
    let model = GgufModel::load(&path, device(&a.device)?).with_context(|| format!("loading {}", path.display()))?;
    let name = a.model_name.clone().unwrap_or_else(|| "smollm2-135m-instruct".into());
    Ok((Arc::new(model), name))
}

pub async fn run(a: DecoderArgs) -> anyhow::Result<()> {
    let (model, name) = load_model(&a)?;
    let id = a.decoder_id.clone().unwrap_or_else(default_id);
    eprintln!("decoder {id} serves {name} ({:?})", model.identity());
    let mut cfg = WorkerConfig::new(id, name);
    cfg.capacity = a.capacity;
    cfg.lease_ms = a.lease_ms;
    let client = LogClient::new(a.cluster.clone())?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let worker = tokio::spawn(Worker::new(cfg, client, model).run(stop_rx));
    crate::node::shutdown_signal().await;
    eprintln!("decoder stopping: releasing held generations");
    let _ = stop_tx.send(true);
    worker.await??;
    Ok(())
}

pub fn default_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .unwrap_or_default()
        .trim()
        .to_string();
    format!(
        "{}-{}-{:08x}",
        if host.is_empty() { "decoder" } else { &host },
        std::process::id(),
        rand::random::<u32>()
    )
}
