//! `tokenlog dev`: the embedded single-machine default. One process runs a single-node log
//! (RocksDB under `--data-dir`), a CPU decoder with the bundled SmolLM2-135M-Instruct (fetched into
//! ./models on first use, sha256-checked) and a gateway (gRPC + OpenAI-compatible HTTP). It prints
//! the endpoints and an example, and stops cleanly on Ctrl-C (the decoder releases its
//! generations, the node flushes).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use tokenlog_decoder::worker::{Worker, WorkerConfig};
use tokenlog_gateway::tenants::Tenants;
use tokenlog_gateway::Gateway;
use tokenlog_raftlog::client::LogClient;
use tokenlog_raftlog::node::{start, NodeConfig};

use crate::cmd::decoder::DecoderArgs;

#[derive(clap::Args)]
pub struct DevArgs {
    /// Where the single node keeps its data (kept across runs).
    #[arg(long, default_value = "data/dev")]
    pub data_dir: PathBuf,
    /// Log API address (raftlog.v1).
    #[arg(long, default_value = "127.0.0.1:7001")]
    pub listen: SocketAddr,
    /// Gateway gRPC address (tokenlog.v1).
    #[arg(long, default_value = "127.0.0.1:7100")]
    pub grpc_listen: SocketAddr,
    /// Gateway HTTP address (OpenAI-compatible API, /metrics).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub http_listen: SocketAddr,
    /// The model: a GGUF file or a Hugging Face llama folder (default: the bundled
    /// SmolLM2-135M-Instruct Q4_1).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Use the deterministic fake model instead of a real one.
    #[arg(long, conflicts_with = "model")]
    pub fake: bool,
    /// Model threads (default: all cores).
    #[arg(long, value_parser = crate::cmd::at_least_one)]
    pub threads: Option<usize>,
    /// Generations decoded at once (at most 1024: one append's items).
    #[arg(long, default_value_t = 4,
          value_parser = crate::cmd::count_up_to::<{ tokenlog_raftlog::limits::ITEMS_PER_APPEND_MAX }>)]
    pub capacity: usize,
    /// API keys file (`sha256:<hex> <tenant>` per line, from `tokenlog keys new`); default: open,
    /// tenant `default`.
    #[arg(long)]
    pub keys: Option<PathBuf>,
    /// Serve the log API (--listen) on an address other machines can reach. It has no TLS and
    /// no authentication here: whoever reaches it can append to any generation and change the
    /// membership. Without this, --listen must be a loopback address.
    #[arg(long)]
    pub insecure: bool,
}

pub async fn run(a: DevArgs) -> anyhow::Result<()> {
    if !a.listen.ip().is_loopback() && !a.insecure {
        anyhow::bail!(
            "refusing to serve the log API in plain text on {}: anyone who reaches it could append to any generation and change the membership. \
             Keep --listen on a loopback address (the gateway's --grpc-listen and --http-listen may face the network), \
             run `tokenlog node` with TLS for a reachable log, or give --insecure",
            a.listen
        );
    }
    if a.insecure {
        eprintln!(
            "WARNING: --insecure: the log API on {} has no TLS and no authentication",
            a.listen
        );
    }
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let dargs = DecoderArgs {
        cluster: vec![a.listen.to_string()],
        model: a.model.clone(),
        fake: a.fake,
        pipeline: vec![],
        pipeline_spares: vec![],
        pipeline_keep_mib: 1024,
        fake_step_ms: 0,
        model_name: None,
        device: "cpu".into(),
        capacity: a.capacity,
        lease_ms: tokenlog_raftlog::limits::LEASE_MS_DEFAULT,
        threads,
        decoder_id: Some("dev-decoder".into()),
        metrics_listen: None,
        history: None,
        stall_ms: tokenlog_decoder::limits::STALL_MS_DEFAULT,
        handoff_listen: None,
        handoff_advertise: None,
        insecure: false,
        drain_ms: 0,
        rebalance: false,
        standby: 0,
        prefix_cache: false,
        prefix_cache_dir: None,
        tls: Default::default(),
    };
    // Model first: the slow part (download on first use, with progress) before anything listens.
    let (model, name) = crate::cmd::decoder::load_model(&dargs)?;
    let tenants = match &a.keys {
        Some(p) => Tenants::load(p)?,
        None => Tenants::Open,
    };

    let mut cfg = NodeConfig::new(1, a.listen, a.data_dir.clone());
    cfg.initial_members = vec![(1, a.listen.to_string().into())];
    eprintln!("starting a single-node log in {} ...", a.data_dir.display());
    let node = start(cfg).await?;
    let log_addr = node.local_addr;

    let mut wcfg = WorkerConfig::new("dev-decoder".into(), name.clone());
    wcfg.capacity = a.capacity;
    wcfg.lease_ms = dargs.lease_ms;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut worker = Worker::new(wcfg, LogClient::new(vec![log_addr.to_string()])?, model.clone());
    if let Some(hooks) = crate::process::failpoint_hooks()? {
        worker = worker.with_hooks(hooks);
    }
    let stats = worker.stats();
    let mut worker = tokio::spawn(worker.run(stop_rx));

    let gw = Gateway::new(
        LogClient::new(vec![log_addr.to_string()])?,
        tenants,
        vec![tokenlog_decoder::fake::fake_tokenizer()?, model.tokenizer().clone()],
        Default::default(),
        Default::default(),
    )?;
    // One /metrics for the whole process: gateway, node and decoder.
    let ctx = node.ctx.clone();
    gw.metrics.add_source(std::sync::Arc::new(move || ctx.render_metrics()));
    gw.metrics
        .add_source(std::sync::Arc::new(move || crate::cmd::decoder::render_stats(&stats)));
    let serving = tokenlog_gateway::server::serve(gw, a.grpc_listen, a.http_listen)
        .await
        .with_context(|| {
            format!(
                "binding the gateway's listeners (--grpc-listen {}, --http-listen {})",
                a.grpc_listen, a.http_listen
            )
        })?;
    let (grpc, http) = (serving.grpc_addr, serving.http_addr);

    say!("tokenlog dev is up: model {name}, {threads} CPU thread(s)");
    say!("  gateway gRPC (tokenlog.v1)      {grpc}");
    say!("  OpenAI-compatible HTTP          http://{http}/v1   (metrics: http://{http}/metrics)");
    say!(
        "  log API (raftlog.v1)            {log_addr}   data: {}",
        a.data_dir.display()
    );
    say!("try, in another shell:");
    say!("  tokenlog generate --gateway {grpc} \"Write a haiku about logs.\"");
    say!(
        "  curl -N http://{http}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{name}\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"Hi!\"}}]}}'"
    );
    say!("  tokenlog status --cluster {log_addr}");
    say!("Ctrl-C stops it cleanly.");
    // The process lives as long as its decoder: a worker that ends on its own (a model error, a
    // panic) stops the whole process with a non-zero status rather than leave a gateway whose
    // generations no decoder will ever continue.
    let mut log_failed = None;
    let ended = tokio::select! {
        _ = crate::process::shutdown_signal() => None,
        r = &mut worker => Some(r),
        reason = node.failed() => {
            log_failed = Some(reason);
            None
        }
    };
    if let Some(reason) = &log_failed {
        eprintln!("the log stopped on its own ({reason}): stopping gateway and decoder ...");
    } else if ended.is_none() {
        eprintln!("stopping: gateway, decoder (releasing its generations), log ...");
    } else {
        eprintln!("the decoder stopped on its own: stopping gateway and log ...");
    }
    serving.shutdown().await;
    let _ = stop_tx.send(true);
    let result = match ended {
        Some(r) => r,
        None => worker.await,
    };
    node.shutdown().await;
    if let Some(reason) = log_failed {
        anyhow::bail!("the log stopped on its own: {reason} (a full disk: free space, then start again)");
    }
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(anyhow::Error::new(e).context("the decoder failed")),
        Err(e) => Err(anyhow::anyhow!("the decoder panicked: {e}")),
    }
}
