//! `tokenlog gateway`: a stateless gateway process. gRPC (`tokenlog.v1`) and OpenAI-compatible
//! HTTP on two listeners, over a log cluster.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use tokenlog_decoder::{fake::fake_tokenizer, Tokenizer};
use tokenlog_gateway::health::log_readiness;
use tokenlog_gateway::limits::LOG_PROBE_BUDGET;
use tokenlog_gateway::server::ServeOptions;
use tokenlog_gateway::tenants::Tenants;
use tokenlog_gateway::Gateway;
use tokenlog_raftlog::client::LogClient;
use tokenlog_raftlog::health::Health;
use tokenlog_raftlog::tls::ServingCert;

#[derive(clap::Args, Clone)]
pub struct GatewayArgs {
    /// Addresses of log nodes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1:7001")]
    pub cluster: Vec<String>,
    #[command(flatten)]
    pub tls: crate::process::TlsArgs,
    /// gRPC listen address (tokenlog.v1 Generation service).
    #[arg(long, default_value = "127.0.0.1:7100")]
    pub grpc_listen: SocketAddr,
    /// HTTP listen address (OpenAI-compatible API, /metrics).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub http_listen: SocketAddr,
    /// Serve both listeners over TLS with this certificate chain (PEM) and --listen-tls-key:
    /// what clients of the gateway see (a public CA's, or `tokenlog certs --gateway NAME --san
    /// HOST`). Clients then dial https (`tokenlog generate --gateway-ca`). Plain text without.
    #[arg(long, requires = "listen_tls_key", help_heading = "TLS")]
    pub listen_tls_cert: Option<PathBuf>,
    /// The key of --listen-tls-cert (PEM).
    #[arg(long, requires = "listen_tls_cert", help_heading = "TLS")]
    pub listen_tls_key: Option<PathBuf>,
    /// Serve plain HTTP on ADDR for probes and scrapers: /metrics (also on the HTTP API's
    /// listener), /livez, /readyz (the log answers with a leader) and grpc.health.v1 (also on
    /// the gRPC listener).
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// API keys file: one `sha256:<hex> <tenant>` per line (`tokenlog keys new --tenant T` makes a
    /// key and its line; the file holds only hashes). Without it the gateway is open and
    /// every caller is the tenant `default`.
    #[arg(long)]
    pub keys: Option<PathBuf>,
    /// Not needed: a gateway serves every model a decoder serves, with the tokenizer that
    /// decoder published in the log (fetched on first use, checked against the model's
    /// tokenizer digest). Optionally, models whose tokenizers it holds from the start
    /// (repeatable): GGUF files or Hugging Face model folders (their tokenizer.json).
    #[arg(long)]
    pub model: Vec<PathBuf>,
    /// Streams one tenant may have open at once on this gateway; more are refused with
    /// RESOURCE_EXHAUSTED (HTTP 429).
    #[arg(long, default_value_t = tokenlog_gateway::limits::TENANT_STREAMS_MAX_DEFAULT as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub tenant_streams_max: u64,
    /// Submits one tenant may have waiting for the log at once on this gateway.
    #[arg(long, default_value_t = tokenlog_gateway::limits::TENANT_SUBMITS_MAX_DEFAULT as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub tenant_submits_max: u64,
    /// A generation that has committed tokens but no decoder for this long (ms of log time
    /// after its last lease ended: every decoder of its model gone) fails explicitly, and its
    /// clients are told; 0 = the log's default (120 s).
    #[arg(long, default_value_t = 0, value_parser = parse_unowned_ms)]
    pub unowned_ms: u64,
}

fn parse_unowned_ms(s: &str) -> Result<u64, String> {
    use tokenlog_raftlog::limits::{LEASE_MS_MIN, UNOWNED_MS_MAX};
    let v: u64 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if v != 0 && !(LEASE_MS_MIN..=UNOWNED_MS_MAX).contains(&v) {
        return Err(format!(
            "{v} ms: must be 0 (the log's default) or {LEASE_MS_MIN}..={UNOWNED_MS_MAX}"
        ));
    }
    Ok(v)
}

impl GatewayArgs {
    pub fn tenant_limits(&self) -> tokenlog_gateway::tenants::TenantLimits {
        tokenlog_gateway::tenants::TenantLimits {
            streams: self.tenant_streams_max as usize,
            submits: self.tenant_submits_max as usize,
        }
    }
}

/// The tokenizers a gateway holds from the start: the fake model's, and those of `models`.
pub fn tokenizers(models: &[PathBuf]) -> anyhow::Result<Vec<Tokenizer>> {
    let mut out = vec![fake_tokenizer()?];
    for p in models {
        out.push(Tokenizer::from_model_path(p).with_context(|| format!("reading the tokenizer of {}", p.display()))?);
    }
    Ok(out)
}

pub async fn run(a: GatewayArgs) -> anyhow::Result<()> {
    // Without keys every caller is one tenant: said at start when a listener is not loopback.
    let open = a.keys.is_none();
    let tenants = match &a.keys {
        Some(p) => Tenants::load(p)?,
        None => Tenants::Open,
    };
    let toks = tokenizers(&a.model)?;
    let bind = tokenlog_gateway::BindDefaults {
        unowned_ms: a.unowned_ms,
    };
    let tls = a.tls.load()?;
    let serving_cert = match (&a.listen_tls_cert, &a.listen_tls_key) {
        (Some(cert), Some(key)) => Some(
            ServingCert::load(cert, key)
                .context("loading the gateway's certificate (--listen-tls-cert, --listen-tls-key)")?,
        ),
        _ => None,
    };
    let probe = LogClient::with_options(a.cluster.clone(), LOG_PROBE_BUDGET, tls.clone())?;
    let health = Health::follow(log_readiness(probe), std::future::pending()).await;
    let gw = Gateway::new(
        LogClient::with_tls(a.cluster.clone(), tls)?,
        tenants,
        toks,
        a.tenant_limits(),
        bind,
    )?;
    if let Some(m) = a.metrics_listen {
        let metrics = gw.metrics.clone();
        let render = std::sync::Arc::new(move || metrics.render());
        let (addr, _) = crate::process::serve_status(m, render, health.clone())
            .await
            .context("binding --metrics-listen")?;
        eprintln!("status on http://{addr}: /metrics /livez /readyz, grpc.health.v1");
    }
    let tls_on = serving_cert.is_some();
    let opts = ServeOptions {
        tls: serving_cert,
        health: Some(health),
    };
    let serving = tokenlog_gateway::server::serve_with(gw, a.grpc_listen, a.http_listen, opts)
        .await
        .with_context(|| {
            format!(
                "binding the gateway's listeners (--grpc-listen {}, --http-listen {})",
                a.grpc_listen, a.http_listen
            )
        })?;
    let (g, h) = if tls_on {
        ("gRPC+TLS", "HTTPS")
    } else {
        ("gRPC", "HTTP")
    };
    if open {
        let exposed: Vec<String> = [serving.grpc_addr, serving.http_addr]
            .iter()
            .filter(|s| !s.ip().is_loopback())
            .map(|s| s.to_string())
            .collect();
        if !exposed.is_empty() {
            eprintln!(
                "warning: no --keys: the gateway is open on {}: every caller there is tenant {:?}, who may read and resume every request of that tenant. Give it an API keys file (`tokenlog keys new --tenant T`) unless a proxy in front authenticates callers.",
                exposed.join(" and "),
                tokenlog_gateway::tenants::OPEN_TENANT
            );
        }
    }
    say!(
        "gateway: {g} {}  {h} {}  log {}",
        serving.grpc_addr,
        serving.http_addr,
        a.cluster.join(",")
    );
    crate::process::shutdown_signal().await;
    eprintln!("gateway stopping ...");
    serving.shutdown().await;
    Ok(())
}
