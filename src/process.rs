//! Process plumbing shared by every subcommand: tracing set-up, the shutdown signal, and the
//! status listener (metrics, liveness, readiness, grpc.health.v1) of every long-running process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use tokenlog_raftlog::health::Health;
use tokenlog_raftlog::tls::{ClientTls, Tls, TlsFiles};

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Renders one Prometheus/OpenMetrics text exposition.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// A panic anywhere in the process is a bug: print it and abort (SIGABRT), so that the process
/// ends, and a supervisor restarts it whole, instead of going on with a dead task behind a live
/// process (a server that no longer answers, a worker that no longer steps while its leases
/// are renewed). The binaries run with `panic = "unwind"` (tests need it); this hook is the
/// equivalent of `panic = "abort"`, except for a panic the decoder expects and turns into an
/// error (`tokenlog_decoder::panics::catch_expected`).
pub fn abort_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        // An expected panic is the caller's error to report (with the panic's message).
        if tokenlog_decoder::panics::expected() {
            return;
        }
        report(info);
        eprintln!("tokenlog: aborting on the panic above: it is a bug, please report it");
        std::process::abort();
    }));
}

/// Logs to stderr, in colour only on a terminal (a log file or a pipe gets plain text, which
/// `grep` and the tests read as written); `RUST_LOG` overrides the default filter.
pub fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    const DEFAULT: &str = "info,openraft=warn";
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => EnvFilter::try_new(&v).unwrap_or_else(|e| {
            // Refused whole for one bad directive: say so rather than log at the default
            // level as if asked to.
            eprintln!("RUST_LOG={v:?} is not a log filter ({e}); logging with {DEFAULT:?}");
            EnvFilter::new(DEFAULT)
        }),
        _ => EnvFilter::new(DEFAULT),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

/// Set once stdout could not be written (closed pipe): nothing more is written there.
static STDOUT_CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static STDOUT_CLOSED_NOTIFY: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Writes one line to stdout (the `say!` macro); a failed write marks stdout closed and wakes
/// [`stdout_closed`].
pub fn say(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    use std::sync::atomic::Ordering;
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{args}").and_then(|()| out.flush()).is_err() && !STDOUT_CLOSED.swap(true, Ordering::Relaxed) {
        STDOUT_CLOSED_NOTIFY.notify_one();
    }
}

/// Whether a [`say`] found stdout closed.
pub fn stdout_was_closed() -> bool {
    STDOUT_CLOSED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Resolves once a [`say`] found stdout closed.
pub async fn stdout_closed() {
    if !STDOUT_CLOSED.load(std::sync::atomic::Ordering::Relaxed) {
        STDOUT_CLOSED_NOTIFY.notified().await;
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM: the signal to shut down cleanly.
pub async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cannot install a SIGTERM handler ({e}); only Ctrl-C stops this process cleanly");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// The status listener of a process (`--metrics-listen`), plain HTTP for probes and scrapers
/// inside the cluster's network: `GET /metrics` from `render`; `GET /livez` (and `/healthz`):
/// 200 while the process runs; `GET /readyz`: 200 when `health`'s check passes, else 503 with
/// the reason; and `grpc.health.v1` (HTTP/2 without TLS, as Kubernetes' gRPC probes speak it).
pub async fn serve_status(
    addr: SocketAddr,
    render: Render,
    health: Health,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    use axum::http::StatusCode;
    let l = TcpListener::bind(addr).await?;
    let local = l.local_addr()?;
    let grpc = tonic::service::Routes::new(health.service()).into_axum_router();
    let live = || async { "ok\n" };
    let app = axum::Router::new()
        .route("/livez", axum::routing::get(live))
        .route("/healthz", axum::routing::get(live))
        .route(
            "/readyz",
            axum::routing::get(move || {
                let health = health.clone();
                async move {
                    match health.check() {
                        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
                        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")),
                    }
                }
            }),
        )
        .route(
            "/metrics",
            axum::routing::get(move || {
                let render = render.clone();
                async move {
                    (
                        [(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        render(),
                    )
                }
            }),
        )
        .merge(grpc);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(l, app).await {
            tracing::error!("status server: {e}");
        }
    });
    Ok((local, task))
}

/// One counter in the text format (for components that keep plain numbers).
pub fn counter_text(name: &str, help: &str, value: u64) -> String {
    format!("# HELP {name} {help}\n# TYPE {name} counter\n{name}_total {value}\n")
}

/// The planted bugs the environment asks for (`TOKENLOG_PLANT_NO_FENCE`,
/// `TOKENLOG_PLANT_ACK_BEFORE_FSYNC`, `TOKENLOG_PLANT_EARLY_VISIBILITY`,
/// `TOKENLOG_PLANT_UNBOUNDED_CLOCK`, `TOKENLOG_PLANT_NO_UNOWNED_DEADLINE`,
/// `TOKENLOG_PLANT_DIVERGE` = 1), read once at start-up.
/// A build without the `faults` feature refuses them rather than silently running without.
pub fn planted_faults() -> anyhow::Result<tokenlog_raftlog::faults::Faults> {
    let on = |name: &str| std::env::var(name).is_ok_and(|v| v == "1");
    let asked = [
        on("TOKENLOG_PLANT_NO_FENCE"),
        on("TOKENLOG_PLANT_ACK_BEFORE_FSYNC"),
        on("TOKENLOG_PLANT_EARLY_VISIBILITY"),
        on("TOKENLOG_PLANT_UNBOUNDED_CLOCK"),
        on("TOKENLOG_PLANT_NO_UNOWNED_DEADLINE"),
        on("TOKENLOG_PLANT_DIVERGE"),
    ];
    #[cfg(feature = "faults")]
    {
        let [no_fence, ack_before_fsync, early_visibility, unbounded_clock, no_unowned_deadline, diverge] = asked;
        Ok(tokenlog_raftlog::faults::Faults {
            no_fence,
            ack_before_fsync,
            early_visibility,
            unbounded_clock,
            no_unowned_deadline,
            diverge,
        })
    }
    #[cfg(not(feature = "faults"))]
    {
        anyhow::ensure!(
            !asked.contains(&true),
            "TOKENLOG_PLANT_* is set, but this build has no planted bugs (build with --features faults)"
        );
        Ok(Default::default())
    }
}

/// Whether the planted-bug variable `var` is `1`; an error when it is, in a build without the
/// `faults` feature.
fn planted(var: &str) -> anyhow::Result<bool> {
    let on = std::env::var(var).is_ok_and(|v| v == "1");
    anyhow::ensure!(
        !on || cfg!(feature = "faults"),
        "{var} is set, but this build has no planted bugs (build with --features faults)"
    );
    Ok(on)
}

/// The planted bug `zombie` (`TOKENLOG_PLANT_ZOMBIE_DECODER=1`, fault builds only; issue 11
/// bug 1): a decoder whose worker fails keeps renewing its leases and keeps running.
pub fn plant_zombie() -> anyhow::Result<bool> {
    let on = planted("TOKENLOG_PLANT_ZOMBIE_DECODER")?;
    if on {
        eprintln!("PLANTED BUG ON: zombie decoder");
    }
    Ok(on)
}

/// The planted bug `short-stage-rows` (`TOKENLOG_PLANT_SHORT_STAGE_ROWS=1`, a stage of a fault
/// build only): the stage's first answer that carries an item of two or more rows drops that
/// item's last row (a buggy stage; the head must not take its rows).
pub fn plant_short_stage_rows() -> anyhow::Result<bool> {
    let on = planted("TOKENLOG_PLANT_SHORT_STAGE_ROWS")?;
    if on {
        eprintln!("PLANTED BUG ON: short stage rows");
    }
    Ok(on)
}

/// The planted bug `stage-forgets` (`TOKENLOG_PLANT_STAGE_FORGETS=once` or `always`, a stage of
/// a fault build only): the stage loses what it holds of the first sequence it is asked to
/// extend and refuses that item (`once`), or refuses every item of that sequence from then on
/// (`always`). A head feeds a refused sequence again from 0; one refused again ends as failed,
/// alone.
pub fn plant_stage_forgets() -> anyhow::Result<Option<bool>> {
    let var = "TOKENLOG_PLANT_STAGE_FORGETS";
    let always = match std::env::var(var).as_deref() {
        Err(_) => return Ok(None),
        Ok("once") => false,
        Ok("always") => true,
        Ok(other) => anyhow::bail!("{var}={other:?}: it is once or always"),
    };
    anyhow::ensure!(
        cfg!(feature = "faults"),
        "{var} is set, but this build has no planted bugs (build with --features faults)"
    );
    eprintln!(
        "PLANTED BUG ON: the stage forgets a sequence ({})",
        if always { "always" } else { "once" }
    );
    Ok(Some(always))
}

/// The planted bug `stalled-worker` (`TOKENLOG_PLANT_STALLED_WORKER=1`, fault builds only;
/// issue 12): the worker's step loop stops for ever after a few appends while its leases are
/// renewed.
pub fn plant_stall() -> anyhow::Result<bool> {
    let on = planted("TOKENLOG_PLANT_STALLED_WORKER")?;
    if on {
        eprintln!("PLANTED BUG ON: stalled worker");
    }
    Ok(on)
}

/// The planted bug `early-handoff-write` (`TOKENLOG_PLANT_EARLY_HANDOFF_WRITE=1`, fault builds
/// only; issue 15): a handoff's destination decodes before the log committed its ownership.
pub fn plant_early_handoff_write() -> anyhow::Result<bool> {
    let on = planted("TOKENLOG_PLANT_EARLY_HANDOFF_WRITE")?;
    if on {
        eprintln!("PLANTED BUG ON: early handoff write");
    }
    Ok(on)
}

/// Planted bug `false-commit` (fault builds): `TOKENLOG_PLANT_FALSE_COMMIT=1`, a handoff
/// destination that answers every transfer "committed" without taking it.
pub fn plant_false_commit() -> anyhow::Result<bool> {
    let on = planted("TOKENLOG_PLANT_FALSE_COMMIT")?;
    if on {
        eprintln!("PLANTED BUG ON: false commit");
    }
    Ok(on)
}

/// Planted bug `source-frees-early` (fault builds): `TOKENLOG_PLANT_SOURCE_FREES_EARLY=1`.
pub fn plant_source_frees_early() -> anyhow::Result<bool> {
    let on = planted("TOKENLOG_PLANT_SOURCE_FREES_EARLY")?;
    if on {
        eprintln!("PLANTED BUG ON: a handoff source frees its cache before the log released it");
    }
    Ok(on)
}

/// Planted bug `standby-early-write` (fault builds): `TOKENLOG_PLANT_STANDBY_EARLY_WRITE=1`.
pub fn plant_standby_early_write() -> anyhow::Result<bool> {
    let on = planted("TOKENLOG_PLANT_STANDBY_EARLY_WRITE")?;
    if on {
        eprintln!("PLANTED BUG ON: a standby appends without an epoch of its own");
    }
    Ok(on)
}

/// Test only (fault builds): with `TOKENLOG_PLANT_TASK_PANIC=1`, a background task panics
/// 300 ms after start, as a bug in a server task would; the process must not go on without it
/// (see [`abort_on_panic`]).
pub fn plant_task_panic() -> anyhow::Result<()> {
    if planted("TOKENLOG_PLANT_TASK_PANIC")? {
        tokio::spawn(async {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            panic!("planted: a background task panicked");
        });
    }
    Ok(())
}

/// The fault suite's `clock` nemesis: with `TOKENLOG_CLOCK_SKEW_FILE` set, the node adds the
/// number of milliseconds that file holds (signed; missing or empty = 0) to its wall clock,
/// re-read every 50 ms. A build without the `faults` feature refuses the variable.
pub fn wall_clock_skew() -> anyhow::Result<Option<Arc<std::sync::atomic::AtomicI64>>> {
    let Ok(path) = std::env::var("TOKENLOG_CLOCK_SKEW_FILE") else {
        return Ok(None);
    };
    #[cfg(feature = "faults")]
    {
        use std::sync::atomic::{AtomicI64, Ordering};
        eprintln!("TEST CLOCK HOOK ARMED: wall clock skew read from {path}");
        let skew = Arc::new(AtomicI64::new(0));
        let s = skew.clone();
        tokio::spawn(async move {
            let mut last = 0;
            loop {
                let ms = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|t| t.trim().parse::<i64>().ok())
                    .unwrap_or(0);
                if ms != last {
                    tracing::warn!(skew_ms = ms, "test clock hook: wall clock skew changed");
                    last = ms;
                }
                s.store(ms, Ordering::Relaxed);
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        });
        Ok(Some(skew))
    }
    #[cfg(not(feature = "faults"))]
    {
        anyhow::bail!(
            "TOKENLOG_CLOCK_SKEW_FILE={path:?} is set, but this build has no test hooks (build with --features faults)"
        )
    }
}

/// The decoder failpoints `TOKENLOG_FAILPOINTS` names, as worker hooks (none when unset). A build
/// without the `faults` feature refuses the variable.
pub fn failpoint_hooks() -> anyhow::Result<Option<Arc<dyn tokenlog_decoder::worker::StepHooks>>> {
    let Ok(spec) = std::env::var("TOKENLOG_FAILPOINTS") else {
        return Ok(None);
    };
    #[cfg(feature = "faults")]
    {
        let fp = tokenlog_decoder::failpoint::Failpoints::parse(&spec)
            .map_err(|e| anyhow::anyhow!("TOKENLOG_FAILPOINTS: {e}"))?;
        if !fp.any() {
            return Ok(None);
        }
        eprintln!("TEST FAILPOINTS ARMED: {fp:?}");
        Ok(Some(Arc::new(fp)))
    }
    #[cfg(not(feature = "faults"))]
    {
        anyhow::bail!(
            "TOKENLOG_FAILPOINTS={spec:?} is set, but this build has no failpoints (build with --features faults)"
        )
    }
}

/// How a process reaches log nodes (and, for a node, how it serves): the cluster's CA and this
/// process's certificate and key, made by `tokenlog certs`. All three or none.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TlsArgs {
    /// The cluster CA's certificate (PEM). With --tls-cert and --tls-key: talk to log nodes
    /// over mutual TLS; a node then checks every caller's role (node, decoder, gateway, admin)
    /// from its certificate.
    #[arg(long, env = "TOKENLOG_TLS_CA", requires_all = ["tls_cert", "tls_key"], help_heading = "TLS")]
    pub tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM, signed by the CA; its OU names its role).
    #[arg(long, env = "TOKENLOG_TLS_CERT", requires = "tls_ca", help_heading = "TLS")]
    pub tls_cert: Option<PathBuf>,
    /// This process's private key (PEM).
    #[arg(long, env = "TOKENLOG_TLS_KEY", requires = "tls_ca", help_heading = "TLS")]
    pub tls_key: Option<PathBuf>,
}

impl TlsArgs {
    /// The TLS material, read and checked; `None` when no TLS option was given (plain text).
    pub fn load(&self) -> anyhow::Result<ClientTls> {
        let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let files = TlsFiles {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
        };
        let tls = Tls::load(&files).context("loading TLS material (--tls-ca, --tls-cert, --tls-key)")?;
        Ok(Some(Arc::new(tls)))
    }
}

/// The id a decoder (or stage) process acts under in the log: `given` (`flag`), or else
/// `fallback()`. Under TLS the log takes only ids the process's certificate may act as
/// ([`tokenlog_raftlog::tls::Holder::may_act_as`]): another given id is refused here, before
/// anything starts, and the default is the certificate's name (for a pool certificate
/// `NAME-*`, `NAME-` and `fallback()`).
pub fn id_for_certificate(
    given: Option<String>,
    tls: &ClientTls,
    fallback: impl FnOnce() -> String,
    flag: &str,
) -> anyhow::Result<String> {
    let Some(tls) = tls else {
        return Ok(given.unwrap_or_else(fallback));
    };
    let h = &tls.holder;
    let id = given.unwrap_or_else(|| h.id_with(&fallback()));
    if !h.may_act_as(&id) {
        anyhow::bail!(
            "{flag} {id:?} is not an id the certificate of {:?} (role {}) may act as, and the log would refuse every call under it. \
             A decoder certificate names the one id its holder uses; leave {flag} out to take the certificate's, or make a \
             certificate for it (`tokenlog certs --decoder {id}`; for decoders that share one certificate and name themselves, \
             a pool: `tokenlog certs --decoder-pool PREFIX` lets them use PREFIX-anything)",
            h.name,
            h.role
        );
    }
    Ok(id)
}

/// The gRPC server a decoder-role process serves peers with (a handoff listener, a pipeline
/// stage): HTTP/2 and TCP keepalive, and, with `tls`, mutual TLS under its decoder
/// certificate. Wrap the service in `auth::Guarded` so that only decoders may call it.
pub fn decoder_peer_server(tls: &tokenlog_raftlog::tls::ClientTls) -> anyhow::Result<tonic::transport::Server> {
    use tokenlog_raftlog::limits::{KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT};
    let mut b = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .tcp_keepalive(Some(KEEPALIVE_INTERVAL));
    if let Some(t) = tls {
        b = b.tls_config(t.decoder_server_config()?)?;
    }
    Ok(b)
}
