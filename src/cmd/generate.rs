//! `tokenlog generate`: a command-line client. Streams a generation as it is committed, and keeps
//! streaming across gateway deaths (it resumes on the next gateway after the last seq it printed).

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use futures::StreamExt;
use tokenlog_gateway::client::GatewayClient;
use tokenlog_proto::tokenlog as tpb;

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// The prompt (a user message; see --raw).
    #[arg(conflicts_with = "resume")]
    pub prompt: Option<String>,
    /// Gateway gRPC addresses (comma-separated); the client fails over between them.
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1:7100")]
    pub gateway: Vec<String>,
    /// The CA (PEM) that signed the gateways' certificates: dial them over TLS (gateways
    /// started with --listen-tls-cert). Plain text without.
    #[arg(long, env = "TOKENLOG_GATEWAY_CA")]
    pub gateway_ca: Option<std::path::PathBuf>,
    /// API key (bearer token), when the gateway has a keys file.
    #[arg(long, env = "TOKENLOG_API_KEY")]
    pub api_key: Option<String>,
    /// Request id: the idempotency key. Running again with the same id re-attaches to the same
    /// generation instead of starting another. Default: a random one (printed).
    #[arg(long)]
    pub request_id: Option<String>,
    /// Only re-attach to --request-id (no new submit); print events after --after.
    #[arg(long, requires = "request_id")]
    pub resume: bool,
    /// With --resume: the last seq already seen (-1 = from the start).
    #[arg(long, allow_hyphen_values = true)]
    pub after: Option<i64>,
    // The request's settings are the submitted generation's: a resume (which submits nothing)
    // refuses them rather than dropping them silently.
    /// Model name (default: the model the log serves; needed when it serves several).
    #[arg(long, default_value = "", conflicts_with = "resume")]
    pub model: String,
    /// System message (a chat prompt's; not with --raw).
    #[arg(long, conflicts_with_all = ["resume", "raw"])]
    pub system: Option<String>,
    /// Send the prompt as raw text (no chat template).
    #[arg(long, conflicts_with = "resume")]
    pub raw: bool,
    #[arg(long, default_value_t = 128, conflicts_with = "resume")]
    pub max_tokens: u32,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, conflicts_with = "resume")]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.0, conflicts_with = "resume")]
    pub top_p: f32,
    /// 0 = derived from the request id.
    #[arg(long, default_value_t = 0, conflicts_with = "resume")]
    pub seed: u64,
    /// Stop strings (repeatable).
    #[arg(long, conflicts_with = "resume")]
    pub stop: Vec<String>,
    /// Generate all --max-tokens: an end-of-sequence token does not end the generation.
    #[arg(long, conflicts_with = "resume")]
    pub ignore_eos: bool,
    /// Print every event as a JSON line instead of the text.
    #[arg(long)]
    pub json: bool,
}

pub async fn run(a: GenerateArgs) -> anyhow::Result<()> {
    if a.after.is_some() && !a.resume {
        // Not clap's `requires`: a flag (`--resume`) counts as present through its default.
        clap::Error::raw(
            clap::error::ErrorKind::MissingRequiredArgument,
            "--after needs --resume: a new generation is printed from its start\n",
        )
        .exit();
    }
    let ca = match &a.gateway_ca {
        Some(p) => Some(std::fs::read(p).with_context(|| format!("reading --gateway-ca {}", p.display()))?),
        None => None,
    };
    let client = GatewayClient::with_ca(a.gateway.clone(), a.api_key.clone(), ca.as_deref())?;
    let rid = a
        .request_id
        .clone()
        .unwrap_or_else(|| format!("cli-{:016x}", rand::random::<u64>()));
    let started = Instant::now();
    let mut stream = if a.resume {
        client.resume(rid.clone(), a.after.unwrap_or(-1)).boxed()
    } else {
        let prompt = a
            .prompt
            .clone()
            .context("give a prompt (or --resume --request-id ID)")?;
        let mut req = tpb::GenerateRequest {
            request_id: rid.clone(),
            model: a.model.clone(),
            max_tokens: a.max_tokens,
            temperature: a.temperature,
            top_p: a.top_p,
            seed: a.seed,
            stop: a.stop.clone(),
            ignore_eos: a.ignore_eos,
            ..Default::default()
        };
        if a.raw {
            req.prompt = prompt;
        } else {
            if let Some(s) = &a.system {
                req.messages.push(tpb::ChatMessage {
                    role: "system".into(),
                    content: s.clone(),
                });
            }
            req.messages.push(tpb::ChatMessage {
                role: "user".into(),
                content: prompt,
            });
        }
        client.generate(req).boxed()
    };
    eprintln!("request {rid}");
    let mut out = std::io::stdout();
    let mut first = None;
    let mut tokens = 0u32;
    while let Some(ev) = stream.next().await {
        let ev = ev.with_context(|| format!("request {rid}"))?;
        if !ev.last {
            tokens += 1;
            first.get_or_insert_with(Instant::now);
        }
        if a.json {
            let line = serde_json::json!({"request_id": ev.request_id, "generation": ev.generation, "epoch": ev.epoch,
                "seq": ev.seq, "token_id": ev.token_id, "text": ev.text_delta, "last": ev.last,
                "finish_reason": ev.finish_reason, "finish_detail": ev.finish_detail});
            writeln!(out, "{line}")?;
        } else {
            write!(out, "{}", ev.text_delta)?;
        }
        out.flush()?;
        if ev.last {
            if !a.json {
                writeln!(out)?;
            }
            let secs = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
            let detail = if ev.finish_detail.is_empty() {
                String::new()
            } else {
                format!(" ({})", ev.finish_detail)
            };
            eprintln!(
                "finished: {}{detail}; {} tokens in {:.1}s ({:.1} tok/s after the first, first token after {:.2}s); {} reconnects",
                ev.finish_reason,
                ev.usage.as_ref().map_or(tokens, |u| u.completion_tokens),
                started.elapsed().as_secs_f64(),
                if secs > 0.0 { f64::from(tokens.saturating_sub(1)) / secs } else { 0.0 },
                first.map_or(0.0, |f| (f - started).as_secs_f64()),
                client.reconnects()
            );
            if ev.finish_reason == "error" {
                anyhow::bail!("generation failed: {}", ev.finish_detail);
            }
            return Ok(());
        }
    }
    anyhow::bail!("the stream ended before the generation did")
}
