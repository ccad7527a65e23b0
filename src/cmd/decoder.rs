//! `tokenlog decoder`: a decoder process. Loads a model (the bundled SmolLM2 by default, or the
//! deterministic fake model), registers with the log, and runs the lease worker until
//! SIGINT/SIGTERM, then releases what it holds so another decoder takes over at once.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokenlog_decoder::prefix_cache::PrefixCache;
use tokenlog_decoder::worker::{SharedPrefixCache, Worker, WorkerConfig, WorkerError};
use tokenlog_decoder::{fetch, threads, DeviceSpec, FakeConfig, FakeModel, Model};
use tokenlog_raftlog::client::LogClient;
use tokenlog_raftlog::health::{Health, Readiness};

#[derive(clap::Args, Clone)]
pub struct DecoderArgs {
    /// Addresses of log nodes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1:7001")]
    pub cluster: Vec<String>,
    #[command(flatten)]
    pub tls: crate::process::TlsArgs,
    /// The model: a GGUF file, or a Hugging Face llama model folder (config.json,
    /// *.safetensors, tokenizer.json). Default: the bundled SmolLM2-135M-Instruct (Q4_1),
    /// fetched into ./models on first use.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Use the deterministic fake model instead (instant; for tests).
    #[arg(long, conflicts_with = "model")]
    pub fake: bool,
    /// Run as a pipeline head: the model's layers run in these stage processes (`tokenlog
    /// stage`), in pipeline order (comma-separated ADDRs; the first holds layer 0, the last
    /// ends the model). This process loads only --model's header (tokenizer, identity), drives
    /// the stages, samples and appends; its output equals a whole decoder's, bit for bit. The
    /// composition is recorded in the log under this decoder's id, at a pipeline epoch that
    /// every splice moves on; stages started with --cluster serve only the current one. A
    /// stage that fails and has no spare (see --pipeline-spares) fails the step: the decoder
    /// exits and its generations are taken over.
    #[arg(long, value_delimiter = ',', conflicts_with = "fake")]
    pub pipeline: Vec<String>,
    /// Hot spare stages of a pipeline head (comma-separated ADDRs of idle `tokenlog stage`
    /// processes): when a stage fails, the first spare of its layer range takes its place (one
    /// write to the log: a new pipeline epoch, which fences the failed stage) and rebuilds its
    /// layers from the rows this head kept of every generation, without leaving this decoder.
    /// After these, the head tries the stages registered in the log (`tokenlog stage
    /// --cluster`) for the same weights that no pipeline uses: hot ones of those layers, then
    /// cold ones (`--cold`), which load the layers first. A stage whose registration lapses (a
    /// paused or cut-off one) fails too. Without any spare, a failed stage fails the step.
    #[arg(long, value_delimiter = ',', requires = "pipeline")]
    pub pipeline_spares: Vec<String>,
    /// What a pipeline head keeps of the rows it relays between stages, in MiB in all (at most
    /// 1024): a spare rebuilds its layers from them. A generation past the bound (or every one,
    /// with 0) is fed through the whole pipeline again after a splice.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(0..=1024), requires = "pipeline")]
    pub pipeline_keep_mib: u64,
    /// Per-step delay of the fake model (ms), to make a slow decoder.
    #[arg(long, default_value_t = 0)]
    pub fake_step_ms: u64,
    /// Name clients use for this model (default: `smollm2-135m-instruct` for the bundled
    /// model, else the model file's stem or folder's name, lowercase).
    #[arg(long)]
    pub model_name: Option<String>,
    /// `cpu` or `cuda:N` (needs a build with `--features cuda`). Not with --fake.
    #[arg(long, default_value = "cpu", conflicts_with = "fake")]
    pub device: String,
    /// Generations decoded at once (at most 1024: one step's tokens of all of them go to the log
    /// as one append, of at most that many items).
    #[arg(long, default_value_t = 4,
          value_parser = crate::cmd::count_up_to::<{ tokenlog_raftlog::limits::ITEMS_PER_APPEND_MAX }>)]
    pub capacity: usize,
    /// Lease length (ms); renewed by every append and by a timer when a step is slow.
    #[arg(long, default_value_t = tokenlog_raftlog::limits::LEASE_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(tokenlog_raftlog::limits::LEASE_MS_MIN..=tokenlog_raftlog::limits::LEASE_MS_MAX))]
    pub lease_ms: u64,
    /// Model threads. One per decoder when several share a host (candle's pool collapses
    /// under shared cores).
    #[arg(long, default_value_t = 1, value_parser = crate::cmd::at_least_one)]
    pub threads: usize,
    /// Unique id of this process (default: host-pid-random). Under TLS the log takes only the
    /// id the decoder certificate names (the default then), or, with a pool certificate
    /// (`tokenlog certs --decoder-pool PREFIX`), ids PREFIX-anything (default PREFIX-host-pid-random).
    #[arg(long)]
    pub decoder_id: Option<String>,
    /// Serve plain HTTP on ADDR for probes and scrapers: /metrics (tokens committed, takeovers,
    /// fence rejections, finished and failed generations), /livez, /readyz (model loaded and
    /// registered with the log) and grpc.health.v1.
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Append a JSON line per acquire and append (times, epochs, answers) to this file, for
    /// the fault suite's checkers.
    #[arg(long)]
    pub history: Option<PathBuf>,
    /// A worker whose step loop makes no progress this long (ms) is stuck: the decoder exits
    /// with an error, its leases lapse and another decoder takes over (slow is not dead: keep
    /// it well above the slowest step or re-prefill).
    #[arg(long, default_value_t = tokenlog_decoder::limits::STALL_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(tokenlog_decoder::limits::STALL_MS_MIN..))]
    pub stall_ms: u64,
    /// Serve planned handoffs (decoder.v1.Handoff) on ADDR: other decoders of the same model
    /// hand generations to this one with their KV cache, and this one hands its generations to
    /// them when it drains (SIGTERM/SIGINT). Over mutual TLS when --tls-* are given. Port 0
    /// picks a free port.
    #[arg(long)]
    pub handoff_listen: Option<std::net::SocketAddr>,
    /// The address other decoders use to reach --handoff-listen (default: the bound address;
    /// required when it listens on 0.0.0.0 or [::]).
    #[arg(long, requires = "handoff_listen")]
    pub handoff_advertise: Option<String>,
    /// Serve --handoff-listen in plain text beyond loopback (anyone who reaches the port could
    /// send this decoder caches and read the rows of its generations). Without TLS it listens on
    /// loopback only, unless this is given.
    #[arg(long, requires = "handoff_listen", conflicts_with = "tls_ca")]
    pub insecure: bool,
    /// On SIGTERM/SIGINT with --handoff-listen: hand every generation to other decoders for at
    /// most this long (ms), then release the rest and exit. 0: release at once.
    #[arg(long, default_value_t = tokenlog_decoder::limits::DRAIN_MS_DEFAULT, requires = "handoff_listen")]
    pub drain_ms: u64,
    /// With --handoff-listen: every 2 s, when this decoder holds 2 or more generations more
    /// than the least loaded other decoder of its model that takes handoffs (as the log counts
    /// leases), hand its youngest generation there with its KV cache. The client's stream only
    /// pauses for the transfer.
    #[arg(long, requires = "handoff_listen")]
    pub rebalance: bool,
    /// Hot standby: follow up to N running generations of other decoders (the log assigns at
    /// most one standby per generation), feeding their committed records to the model as they
    /// commit, so that if an owner dies this decoder continues with one decode step instead of
    /// a re-prefill. Costs a decode step per followed token and a KV cache per generation.
    #[arg(long, default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=tokenlog_decoder::limits::STANDBY_MAX as u64))]
    pub standby: u64,
    /// Keep a KV prefix cache in memory (keyed by token ids; at most 512 MiB): a generation whose
    /// prompt and committed records begin with an entry's ids loads it and prefills only the
    /// rest (a takeover, a new generation with a shared prompt). Every prompt prefilled here is
    /// stored. An entry restored twice in a row for one generation at one frontier without
    /// progress is discarded (the reload-loop guard).
    #[arg(long)]
    pub prefix_cache: bool,
    /// The prefix cache (implies --prefix-cache) also on disk in DIR, one checksummed file per
    /// entry plus the guard's restore records, so that a restarted decoder finds them.
    #[arg(long, value_name = "DIR")]
    pub prefix_cache_dir: Option<PathBuf>,
}

#[derive(clap::Args, Clone)]
pub struct ExportArgs {
    /// The GGUF file (default: the bundled SmolLM2 model, fetched into ./models if missing).
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// The folder to write (created).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn export(a: ExportArgs) -> anyhow::Result<()> {
    let gguf = match a.gguf {
        Some(p) => p,
        None => fetch::ensure_default_model(&fetch::working_models_dir()).context("fetching the default model")?,
    };
    let n = tokenlog_decoder::export::export_gguf_as_safetensors(&gguf, &a.out)
        .with_context(|| format!("exporting {}", gguf.display()))?;
    say!(
        "wrote {n} tensors and the tokenizer of {} to {}",
        gguf.display(),
        a.out.display()
    );
    Ok(())
}

/// A decoder's counters in the Prometheus text format.
pub fn render_stats(stats: &std::sync::Mutex<tokenlog_decoder::worker::WorkerStats>) -> String {
    use crate::process::counter_text;
    let s = stats.lock().expect("lock").clone();
    [
        counter_text(
            "tokenlog_decoder_acquired",
            "Generations acquired (first grants and takeovers)",
            s.acquired,
        ),
        counter_text(
            "tokenlog_decoder_takeovers",
            "Generations acquired at an epoch above 1 (continued after another owner)",
            s.takeovers,
        ),
        counter_text(
            "tokenlog_decoder_tokens_committed",
            "Token records this decoder committed",
            s.tokens_committed,
        ),
        counter_text(
            "tokenlog_decoder_fence_rejections",
            "Appends refused because this decoder's epoch or lease was no longer current",
            s.fence_rejections,
        ),
        counter_text(
            "tokenlog_decoder_finished",
            "Generations this decoder finished",
            s.finished,
        ),
        counter_text(
            "tokenlog_decoder_failed",
            "Generations this decoder failed explicitly",
            s.failed,
        ),
        counter_text(
            "tokenlog_decoder_released_unreadable",
            "Generations taken and released again because the log could not be read for now",
            s.released,
        ),
        counter_text(
            "tokenlog_decoder_handed_out",
            "Generations handed to another decoder with their KV cache (planned handoff)",
            s.handed_out,
        ),
        counter_text(
            "tokenlog_decoder_handoffs_received",
            "Generations received from another decoder with their KV cache",
            s.received,
        ),
        counter_text(
            "tokenlog_decoder_handoffs_kept",
            "Planned handoffs that did not move the generation (it was decoded here)",
            s.handoffs_kept,
        ),
        counter_text(
            "tokenlog_decoder_prefix_restores",
            "Generations restored from the prefix cache (only the rest prefilled)",
            s.prefix_restores,
        ),
        counter_text(
            "tokenlog_decoder_standby_takeovers",
            "Generations taken over from this decoder's hot standby state (no re-prefill)",
            s.standby_takeovers,
        ),
        format!(
            "# HELP tokenlog_decoder_standing_by Generations this decoder follows as a hot standby now\n\
             # TYPE tokenlog_decoder_standing_by gauge\ntokenlog_decoder_standing_by {}\n",
            s.standing_by
        ),
        "# EOF\n".to_string(),
    ]
    .concat()
}

/// The prefix cache `--prefix-cache` / `--prefix-cache-dir` ask for, if the model can export its
/// cache.
fn prefix_cache(a: &DecoderArgs, model: &dyn Model) -> anyhow::Result<Option<SharedPrefixCache>> {
    if !a.prefix_cache && a.prefix_cache_dir.is_none() {
        return Ok(None);
    }
    let Some(format) = model.new_sequence()?.cache_format() else {
        eprintln!("this model cannot export its cache: no prefix cache");
        return Ok(None);
    };
    let dir = a.prefix_cache_dir.as_deref();
    let pc = PrefixCache::open(&format, dir).with_context(|| {
        format!(
            "opening the prefix cache in {}",
            dir.map_or("memory".into(), |d| d.display().to_string())
        )
    })?;
    eprintln!(
        "prefix cache: {} entries{}",
        pc.len(),
        dir.map(|d| format!(" in {}", d.display())).unwrap_or_default()
    );
    Ok(Some(Arc::new(std::sync::Mutex::new(pc))))
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
    let stage_sequences = tokenlog_decoder::limits::STAGE_SEQUENCES_MAX;
    if !a.pipeline.is_empty() && a.capacity > stage_sequences {
        // Its stages would refuse the sequences past that, one generation at a time.
        anyhow::bail!(
            "--capacity {} with --pipeline: a stage keeps at most {stage_sequences} sequences of one head, \
             so a pipeline head decodes at most {stage_sequences} generations at once",
            a.capacity
        );
    }
    let path = match &a.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model(&fetch::working_models_dir()).context("fetching the default model")?,
    };
    if !a.pipeline.is_empty() {
        if a.device != "cpu" {
            anyhow::bail!(
                "a pipeline's stages run on the CPU (--device {} with --pipeline)",
                a.device
            );
        }
        eprintln!("connecting to the pipeline's stages {} ...", a.pipeline.join(", "));
        let client = LogClient::with_tls(a.cluster.clone(), a.tls.load()?)?;
        // The head's composition is recorded in the log under its decoder id.
        let head = a.decoder_id.clone().context("a pipeline head needs its decoder id")?;
        let log = client.clone();
        let channel_for: tokenlog_decoder::pipeline::ChannelFor =
            Box::new(move |addr: &str| client.peer_channel(addr).map_err(|e| e.to_string()));
        let mut cfg =
            tokenlog_decoder::pipeline::PipelineConfig::new(&a.pipeline, &a.pipeline_spares, channel_for, &head);
        cfg.log = Some(log);
        cfg.keep_bytes = (a.pipeline_keep_mib as usize).saturating_mul(1 << 20);
        let model = tokenlog_decoder::pipeline::PipelineModel::connect(&path, cfg)
            .with_context(|| format!("connecting to the pipeline {}", a.pipeline.join(",")))?;
        eprintln!(
            "pipeline of head {head} recorded in the log at pipeline epoch {}",
            model.first_epoch()
        );
        for (i, s) in model.stages().iter().enumerate() {
            eprintln!(
                "pipeline stage {}: {} ({}) layers {}..{}",
                i + 1,
                s.stage_id,
                s.addr,
                s.layers.start,
                s.layers.end
            );
        }
        let name = a.model_name.clone().unwrap_or_else(|| model_name_of(&path));
        return Ok((Arc::new(model), name));
    }
    eprintln!("loading {} on {} ...", path.display(), a.device);
    let model = tokenlog_decoder::load_model(&path, device(&a.device)?)
        .with_context(|| format!("loading {}", path.display()))?;
    let name = a.model_name.clone().unwrap_or_else(|| model_name_of(&path));
    Ok((model, name))
}

/// The name clients use for a model when `--model-name` is not given: `smollm2-135m-instruct`
/// for the bundled model, else the file's stem or the folder's name, lowercase.
fn model_name_of(path: &std::path::Path) -> String {
    if path.file_name().is_some_and(|n| n == fetch::DEFAULT_MODEL_FILE) {
        return "smollm2-135m-instruct".into();
    }
    let base = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    base.map_or_else(|| "model".into(), |n| n.to_string_lossy().to_lowercase())
}

pub async fn run(mut a: DecoderArgs) -> anyhow::Result<()> {
    // Known before the model: a pipeline head records its composition under it.
    let id = crate::process::id_for_certificate(a.decoder_id.take(), &a.tls.load()?, default_id, "--decoder-id")?;
    a.decoder_id = Some(id.clone());
    let (model, name) = load_model(&a)?;
    eprintln!("decoder {id} serves {name} ({:?})", model.identity());
    let mut cfg = WorkerConfig::new(id, name);
    cfg.capacity = a.capacity;
    cfg.lease_ms = a.lease_ms;
    cfg.stall_ms = a.stall_ms;
    let zombie = crate::process::plant_zombie()?;
    let stall = crate::process::plant_stall()?;
    let early_write = crate::process::plant_early_handoff_write()?;
    let standby_write = crate::process::plant_standby_early_write()?;
    let frees_early = crate::process::plant_source_frees_early()?;
    let false_commit = crate::process::plant_false_commit()?;
    #[cfg(feature = "faults")]
    {
        cfg.plant_zombie = zombie;
        cfg.plant_stall = stall;
        cfg.plant_early_handoff_write = early_write;
        cfg.plant_standby_early_write = standby_write;
        cfg.plant_source_frees_early = frees_early;
        cfg.plant_false_commit = false_commit;
    }
    #[cfg(not(feature = "faults"))]
    let _ = (stall, early_write, standby_write, frees_early, false_commit);
    cfg.drain_ms = a.drain_ms;
    cfg.standby = a.standby as usize;
    cfg.rebalance = a.rebalance;
    let tls = a.tls.load()?;
    let handoff_listener = match a.handoff_listen {
        Some(addr) if tls.is_none() && !a.insecure && !addr.ip().is_loopback() => {
            anyhow::bail!(
                "refusing to serve handoffs in plain text on {addr}: anyone who reaches it could send this decoder caches and read its generations' rows. \
                 Give --tls-ca, --tls-cert and --tls-key (a decoder certificate from `tokenlog certs`), or --insecure"
            )
        }
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding --handoff-listen {addr}"))?;
            let bound = l.local_addr()?;
            cfg.handoff_addr = match &a.handoff_advertise {
                Some(adv) => adv.clone(),
                None if bound.ip().is_unspecified() => {
                    anyhow::bail!("--handoff-listen {bound} listens on every address: say with --handoff-advertise where other decoders reach it")
                }
                None => bound.to_string(),
            };
            Some(l)
        }
        None => None,
    };
    let client = LogClient::with_tls(a.cluster.clone(), tls.clone())?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let history = match &a.history {
        Some(p) => Some(
            tokenlog_decoder::history::History::open(p, &cfg.decoder_id)
                .with_context(|| format!("opening {}", p.display()))?,
        ),
        None => None,
    };
    let prefix_cache = prefix_cache(&a, model.as_ref())?;
    let mut worker = Worker::new(cfg, client, model);
    if let Some(h) = history {
        worker = worker.with_history(h);
    }
    if let Some(pc) = prefix_cache {
        worker = worker.with_prefix_cache(pc);
    }
    if let Some(hooks) = crate::process::failpoint_hooks()? {
        worker = worker.with_hooks(hooks);
    }
    if let Some(l) = handoff_listener {
        let port = worker.handoff_port();
        let advertised = cfg_handoff_addr(&worker);
        serve_handoff(l, port, tls.clone()).await?;
        eprintln!("handoffs on {advertised}");
    }
    if let Some(m) = a.metrics_listen {
        let stats = worker.stats();
        let render = {
            let stats = stats.clone();
            Arc::new(move || render_stats(&stats))
        };
        // The model is loaded by now; ready once the log has accepted the registration.
        let ready: Readiness = Arc::new(move || match stats.lock().expect("lock").registered {
            true => Ok(()),
            false => Err("the log has not accepted this decoder's registration (yet)".into()),
        });
        let health = Health::follow(ready, std::future::pending()).await;
        let (addr, _) = crate::process::serve_status(m, render, health)
            .await
            .context("binding --metrics-listen")?;
        eprintln!("status on http://{addr}: /metrics /livez /readyz, grpc.health.v1");
    }
    let mut worker = tokio::spawn(worker.run(stop_rx));
    // The process lives as long as its worker: a worker that ends on its own (an error, a panic)
    // ends the process with a non-zero status, so a supervisor restarts it, and its leases lapse.
    let ended = tokio::select! {
        _ = crate::process::shutdown_signal() => None,
        r = &mut worker => Some(r),
    };
    let failed = match &ended {
        Some(Ok(Err(WorkerError::Halted(_)))) | Some(Ok(Ok(()))) | None => false,
        Some(Ok(Err(_))) | Some(Err(_)) => true,
    };
    if zombie && failed {
        eprintln!("PLANTED BUG: the worker failed; the process stays, renewing its leases");
        crate::process::shutdown_signal().await;
        std::process::exit(1);
    }
    let result = match ended {
        Some(r) => r,
        None => {
            eprintln!("decoder stopping: handing over or releasing held generations");
            let _ = stop_tx.send(true);
            worker.await
        }
    };
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(WorkerError::Halted(name))) => {
            eprintln!("decoder halted by failpoint {name}");
            std::process::exit(tokenlog_decoder::worker::HALT_EXIT_CODE)
        }
        Ok(Err(e)) => Err(anyhow::Error::new(e).context("the decoder's worker failed")),
        Err(e) => Err(anyhow::anyhow!("the decoder's worker panicked: {e}")),
    }
}

fn cfg_handoff_addr(w: &Worker) -> String {
    w.config().handoff_addr.clone()
}

/// Serves `port` (decoder.v1.Handoff) on `listener` until the process ends: over mutual TLS
/// with the callers' roles checked when `tls` is set (only decoders may hand over).
async fn serve_handoff(
    listener: tokio::net::TcpListener,
    port: tokenlog_decoder::handoff::HandoffPort,
    tls: tokenlog_raftlog::tls::ClientTls,
) -> anyhow::Result<()> {
    let mut b = crate::process::decoder_peer_server(&tls)?;
    let svc = tokenlog_raftlog::auth::Guarded::new(port.service(), tls.is_some());
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(async move {
        if let Err(e) = b.add_service(svc).serve_with_incoming(incoming).await {
            tracing::error!(error = %e, "the handoff listener failed");
        }
    });
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
