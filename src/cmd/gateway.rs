//! `tokenlog gateway`: a stateless gateway process. gRPC (`tokenlog.v1`) and OpenAI-compatible
//! HTTP on two listeners, over a log cluster.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use tokenlog_decoder::{fake::fake_tokenizer, fetch, Tokenizer};
use tokenlog_gateway::tenants::Tenants;
use tokenlog_gateway::Gateway;
use tokenlog_raftlog::client::LogClient;

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
    /// API keys file: one `sha256:<hex> <tenant>` per line (`tokenlog keys new --tenant T` makes a
    /// key and its line; the file holds only hashes). Without it the gateway is open and
    /// every caller is the tenant `default`.
    #[arg(long)]
    pub keys: Option<PathBuf>,
    /// Models whose tokenizers this gateway detokenizes with (repeatable): GGUF files or
    /// Hugging Face model folders (their tokenizer.json). Default: the bundled SmolLM2 model
    /// (fetched into ./models on first use).
    #[arg(long)]
    pub model: Vec<PathBuf>,
    /// Only the fake model's tokenizer (for tests; no model file needed).
    #[arg(long, conflicts_with = "model")]
    pub fake: bool,
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

pub fn tokenizers(models: &[PathBuf], fake_only: bool) -> anyhow::Result<Vec<Tokenizer>> {
    let mut out = vec![fake_tokenizer()?];
    if fake_only {
        return Ok(out);
    }
    let paths = if models.is_empty() {
        vec![fetch::ensure_default_model(&fetch::repo_models_dir()).context("fetching the default model")?]
    } else {
        models.to_vec()
    };
    for p in paths {
        out.push(Tokenizer::from_model_path(&p).with_context(|| format!("reading the tokenizer of {}", p.display()))?);
    }
    Ok(out)
}

pub async fn run(a: GatewayArgs) -> anyhow::Result<()> {
    let tenants = match &a.keys {
        Some(p) => Tenants::load(p)?,
        None => Tenants::Open,
    };
    let toks = tokenizers(&a.model, a.fake)?;
    let bind = tokenlog_gateway::BindDefaults {
        unowned_ms: a.unowned_ms,
    };
    let gw = Gateway::new(
        LogClient::with_tls(a.cluster.clone(), a.tls.load()?)?,
        tenants,
        toks,
        a.tenant_limits(),
        bind,
    )?;
    let serving = tokenlog_gateway::server::serve(gw, a.grpc_listen, a.http_listen)
        .await
        .context("binding the gateway's listeners")?;
    println!(
        "gateway: gRPC {}  HTTP {}  log {}",
        serving.grpc_addr,
        serving.http_addr,
        a.cluster.join(",")
    );
    crate::process::shutdown_signal().await;
    eprintln!("gateway stopping ...");
    serving.shutdown().await;
    Ok(())
}
