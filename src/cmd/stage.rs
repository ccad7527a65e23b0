//! `tokenlog stage`: one stage of a pipeline (issue 16). Loads a layer range of a llama GGUF
//! model on the CPU and serves `decoder.v1.Stage` for pipeline heads (`tokenlog decoder
//! --pipeline ...`), until SIGINT/SIGTERM.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use tokenlog_decoder::stage::{parse_layers, StageModel, StageService};
use tokenlog_decoder::{fetch, threads};

#[derive(clap::Args, Clone)]
pub struct StageArgs {
    /// The model: a llama GGUF file. Default: the bundled SmolLM2-135M-Instruct (Q4_1, 30
    /// layers), fetched into ./models on first use. Every stage of a pipeline and its head use
    /// the same file.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The layers this stage holds, `A..B` (B exclusive). The stage holding layer 0 also holds
    /// the embeddings and takes token ids; the one ending the model also holds the final norm
    /// and output head and gives logits; the others take and give the rows between layers.
    #[arg(long, value_parser = parse_layers, required_unless_present = "cold", conflicts_with = "cold")]
    pub layers: Option<std::ops::Range<usize>>,
    /// Start as a cold spare: load no layers now, only the model file's header; register in the
    /// log (--cluster) as a spare of the model, and load the layer range the first head that
    /// splices it in asks for (`Load`). From then on it is a stage of those layers.
    #[arg(long, requires = "cluster")]
    pub cold: bool,
    /// Serve the stage on ADDR (port 0 picks a free port; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:7301")]
    pub listen: std::net::SocketAddr,
    /// Name of this stage process, as a head's composition in the log names it (default:
    /// stage-A-B-pid; unique among the stages of one pipeline).
    #[arg(long)]
    pub stage_id: Option<String>,
    /// Addresses of log nodes (comma-separated). With them the stage serves a head's work only
    /// at the pipeline epoch of the head's current composition in the log, and only if that
    /// composition names this stage (--stage-id) for its layers: a stage spliced out while it
    /// was paused or cut off is refused when it comes back. Without them, it refuses only epochs
    /// older than the newest it saw from each head (benches, single-machine tests).
    /// With them the stage also registers in the log (renewed every 250 ms, lapsing after 1 s):
    /// heads splice out a stage whose registration lapsed, and find spares there.
    #[arg(long, value_delimiter = ',')]
    pub cluster: Vec<String>,
    /// The address heads reach this stage at, as its registration in the log says (default:
    /// the bound address; required when --listen is a wildcard address). Only with --cluster.
    #[arg(long, requires = "cluster")]
    pub advertise: Option<String>,
    /// Model threads.
    #[arg(long, default_value_t = 1, value_parser = crate::cmd::at_least_one)]
    pub threads: usize,
    /// Over mutual TLS when given: the stage serves with its decoder certificate and only
    /// decoders (pipeline heads) may call it.
    #[command(flatten)]
    pub tls: crate::process::TlsArgs,
    /// Serve plain text beyond loopback (anyone who reaches the port could read the rows of
    /// every generation and feed the stage). Without TLS a stage listens on loopback only,
    /// unless this is given.
    #[arg(long, conflicts_with = "tls_ca")]
    pub insecure: bool,
}

pub async fn run(a: StageArgs) -> anyhow::Result<()> {
    let tls = a.tls.load()?;
    if tls.is_none() && !a.insecure && !a.listen.ip().is_loopback() {
        anyhow::bail!(
            "refusing to serve a stage in plain text on {}: anyone who reaches it could read the rows of every generation and feed it. \
             Give --tls-ca, --tls-cert and --tls-key (a decoder certificate from `tokenlog certs`), or --insecure",
            a.listen
        );
    }
    if crate::process::plant_short_stage_rows()? {
        #[cfg(feature = "faults")]
        tokenlog_decoder::stage::plant_short_rows();
    }
    if let Some(_always) = crate::process::plant_stage_forgets()? {
        #[cfg(feature = "faults")]
        tokenlog_decoder::stage::plant_forget(_always);
    }
    threads::init_cpu_threads(a.threads);
    let path = match &a.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model(&fetch::working_models_dir()).context("fetching the default model")?,
    };
    let id = crate::process::id_for_certificate(
        a.stage_id.clone(),
        &tls,
        || match &a.layers {
            Some(l) => format!("stage-{}-{}-{}", l.start, l.end, std::process::id()),
            None => format!("stage-cold-{}", std::process::id()),
        },
        "--stage-id",
    )?;
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("binding --listen {}", a.listen))?;
    let bound = listener.local_addr()?;
    let advertise = match (&a.advertise, bound.ip().is_unspecified()) {
        (Some(x), _) => x.clone(),
        (None, false) => bound.to_string(),
        (None, true) if a.cluster.is_empty() => bound.to_string(),
        (None, true) => anyhow::bail!(
            "--listen {} is a wildcard address: give --advertise HOST:PORT, where heads reach this stage (its registration in the log says it)",
            a.listen
        ),
    };
    let log = match a.cluster.is_empty() {
        true => {
            eprintln!("no --cluster: fencing by the newest pipeline epoch seen from each head only");
            None
        }
        false => Some(tokenlog_raftlog::client::LogClient::with_tls(
            a.cluster.clone(),
            tls.clone(),
        )?),
    };
    let svc = match a.layers.clone() {
        Some(layers) => {
            eprintln!(
                "loading layers {}..{} of {} ...",
                layers.start,
                layers.end,
                path.display()
            );
            let model = tokio::task::spawn_blocking({
                let path = path.clone();
                let layers = layers.clone();
                move || StageModel::load(&path, layers)
            })
            .await?
            .with_context(|| format!("loading layers {}..{} of {}", layers.start, layers.end, path.display()))?;
            let what = match (model.is_first(), model.is_last()) {
                (true, true) => "token ids -> logits",
                (true, false) => "token ids -> rows",
                (false, true) => "rows -> logits",
                (false, false) => "rows -> rows",
            };
            eprintln!(
                "stage {id} serves layers {}..{} of {} ({what}) on {bound}",
                layers.start,
                layers.end,
                model.total_layers()
            );
            StageService::new(Arc::new(model), id.clone(), log.clone())
        }
        None => {
            let svc = StageService::cold(&path, id.clone(), log.clone())
                .with_context(|| format!("reading the header of {}", path.display()))?;
            eprintln!(
                "stage {id} is a cold spare of {} (it loads the layers the first head asks for) on {bound}",
                path.display()
            );
            svc
        }
    };
    if let Some(log) = &log {
        eprintln!("registering in the log as {advertise}");
        tokio::spawn(svc.clone().keep_registered(log.clone(), advertise));
    }
    let mut b = crate::process::decoder_peer_server(&tls)?;
    let svc = tokenlog_raftlog::auth::Guarded::new(svc.server(), tls.is_some());
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut server = tokio::spawn(b.add_service(svc).serve_with_incoming_shutdown(incoming, async {
        let _ = stop_rx.await;
    }));
    tokio::select! {
        r = &mut server => {
            r.context("the stage's server task")?.context("serving the stage")?;
            return Ok(());
        }
        () = crate::process::shutdown_signal() => {}
    }
    // A head holds its stream to the stage for as long as it runs: waiting for it to end (what
    // a graceful shutdown does) never ended. Open streams get a grace; the head then finds its
    // stream broken and splices a spare in, as for a dead stage.
    let _ = stop_tx.send(());
    let grace = tokenlog_raftlog::limits::SHUTDOWN_GRACE;
    if tokio::time::timeout(grace, &mut server).await.is_err() {
        eprintln!("stage: the heads' streams still open after {grace:?} are cut");
        server.abort();
    }
    eprintln!("stage stopped");
    Ok(())
}
