//! The gateway's core, shared by the gRPC service ([`crate::grpc`]) and the OpenAI-compatible HTTP
//! API ([`crate::http`]): turn a request into a log submission, and turn a generation's committed
//! records into client events.
//!
//! The gateway holds no state of its own. A generation is found by `(tenant, request_id)` in the
//! log, and its events are rebuilt from the log's committed records (Watch) every time: the text
//! delta of record `seq` is a pure function of records `0..=seq` (the incremental detokenizer is
//! fed the prefix again), so any gateway, at any time, produces the same event for the same seq.
//! That is what lets a client resume on another gateway and see every token exactly once
//! (CONTRACT §3).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokenlog_decoder::{identity::tokenizer_sha256, ChatMessage, Tokenizer};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;
use tokenlog_raftlog::convert::{reason_from_pb, state_from_pb};
use tokenlog_raftlog::types::{FinishReason, GenState, SamplingConfig};
use tokio::sync::Semaphore;

use crate::error::{GatewayError, Result};
use crate::limits::*;
use crate::metrics::Metrics;
use crate::tenants::{Held, TenantLimits, TenantUse, Tenants};

/// What the client wants generated.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// A chat: the model's chat template is applied here and bound as token ids
    /// (`Tokenizer::encode_chat`).
    Chat(Vec<ChatMessage>),
    /// Raw prompt text (tokenized by the first decoder that owns the generation).
    Text(String),
    /// Token ids, used as they are.
    Ids(Vec<u32>),
}

/// A generation request, already in the gateway's terms. Zero / empty fields take the defaults.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub request_id: String,
    pub model: String,
    pub prompt: Prompt,
    pub max_tokens: Option<u32>,
    /// The sampler settings; `top_p` and `repetition_penalty` of 0 mean "off" (1). Its `seed`
    /// and `rng_version` are set at binding, from [`GenerateParams::seed`] and the decoder's
    /// sampler version.
    pub sampling: SamplingConfig,
    /// `None`: derived from (tenant, request id), so a retried request binds the same seed.
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub fast_resume: bool,
    /// Do not stop at the model's end-of-sequence tokens.
    pub ignore_eos: bool,
}

impl GenerateParams {
    pub fn new(request_id: impl Into<String>, prompt: Prompt) -> Self {
        GenerateParams {
            request_id: request_id.into(),
            model: String::new(),
            prompt,
            max_tokens: None,
            sampling: SamplingConfig {
                repetition_penalty: 1.0,
                ..SamplingConfig::greedy()
            },
            seed: None,
            stop: Vec::new(),
            fast_resume: false,
            ignore_eos: false,
        }
    }
}

/// How a generation ended, on its last event.
#[derive(Clone, Debug, PartialEq)]
pub struct Finish {
    /// `stop`, `length`, `error` or `cancelled`.
    pub reason: &'static str,
    pub detail: String,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

/// One client-visible event. Token events have `seq` = the record's seq; the last event has
/// `seq` = the number of records (one past the last token), `token_id` = None, the text still held
/// back by the detokenizer, and `finish`.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub request_id: String,
    pub generation: u64,
    pub epoch: u64,
    pub seq: u32,
    pub token_id: Option<u32>,
    pub text: String,
    pub finish: Option<Finish>,
}

/// The OpenAI name of a wire finish reason (`stop`, `length`, `error`, `cancelled`).
pub fn finish_reason_str(r: i32) -> &'static str {
    reason_from_pb(r).map_or("error", FinishReason::as_str)
}

/// The name of a wire generation state (`pending`, `running`, ...).
pub fn state_str(s: i32) -> &'static str {
    state_from_pb(s).map_or("unknown", GenState::name)
}

pub fn is_terminal(info: &pb::GenerationInfo) -> bool {
    matches!(
        pb::GenerationState::try_from(info.state),
        Ok(pb::GenerationState::Finished | pb::GenerationState::Failed | pb::GenerationState::Cancelled)
    )
}

pub fn prompt_tokens(info: &pb::GenerationInfo) -> u32 {
    info.binding.as_ref().map_or(0, |b| b.prompt_token_ids.len() as u32)
}

pub struct Gateway {
    log: LogClient,
    tenants: Tenants,
    /// Tokenizers this gateway can detokenize with, by tokenizer digest: those it was started
    /// with (`--model`), and those fetched from the log as decoders published them.
    tokenizers: Mutex<HashMap<String, Arc<Tokenizer>>>,
    /// Held while a tokenizer is fetched from the log: one fetch at a time, not one per stream.
    fetching: tokio::sync::Mutex<()>,
    models: Mutex<Option<(Instant, Vec<pb::ModelInfo>)>>,
    streams: Arc<Semaphore>,
    tenant_limits: TenantLimits,
    tenant_use: TenantUse,
    bind: BindDefaults,
    pub metrics: Arc<Metrics>,
}

/// What the gateway binds into every generation where a request says nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BindDefaults {
    /// A generation with records that no decoder has owned this long (ms of log time) fails
    /// explicitly; 0 = the log's default (`UNOWNED_MS_DEFAULT`).
    pub unowned_ms: u64,
}

mod binding;
mod events;
mod models;

/// The refusal of a stream while `STREAMS_MAX` are open.
fn overloaded() -> GatewayError {
    GatewayError::Overloaded(format!("gateway overloaded: {STREAMS_MAX} streams open"))
}

use binding::check_request_id;
pub use binding::{default_seed, random_request_id};
pub use models::ResolvedModel;

impl Gateway {
    pub fn new(
        log: LogClient,
        tenants: Tenants,
        tokenizers: Vec<Tokenizer>,
        tenant_limits: TenantLimits,
        bind: BindDefaults,
    ) -> Result<Arc<Gateway>> {
        let mut map = HashMap::new();
        for t in tokenizers {
            let digest = tokenizer_sha256(&t).map_err(|e| GatewayError::Internal(e.to_string()))?;
            map.insert(digest, Arc::new(t));
        }
        Ok(Arc::new(Gateway {
            log,
            tenants,
            tokenizers: Mutex::new(map),
            fetching: tokio::sync::Mutex::new(()),
            models: Mutex::new(None),
            streams: Arc::new(Semaphore::new(STREAMS_MAX)),
            tenant_limits,
            tenant_use: TenantUse::default(),
            bind,
            metrics: Arc::new(Metrics::default()),
        }))
    }

    pub fn tenant(&self, key: Option<&str>) -> Result<String> {
        self.tenants.tenant(key)
    }

    /// The tenant of a request from its credential headers ([`crate::tenants::Tenants::tenant_of`]).
    pub fn tenant_of(
        &self,
        authorization: Option<Result<&str, ()>>,
        x_api_key: Option<Result<&str, ()>>,
    ) -> Result<String> {
        self.tenants.tenant_of(authorization, x_api_key)
    }

    pub fn http_request(&self) {
        self.metrics.http_requests.inc();
    }

    pub fn log(&self) -> &LogClient {
        &self.log
    }

    /// Submits (idempotently: the same request id and request give the same generation).
    pub async fn submit(&self, tenant: &str, p: &GenerateParams) -> Result<(pb::GenerationInfo, String)> {
        let _submitting = self.tenant_use.take(tenant, Held::Submit, self.tenant_limits.submits)?;
        // Refuse before creating anything when the tenant, or the gateway, could not stream it
        // anyway: a generation made and then refused its stream ran for nobody, under a request
        // id its client never saw (and every retry of a 429 made another).
        self.tenant_use
            .check(tenant, Held::Stream, self.tenant_limits.streams)?;
        if self.streams.available_permits() == 0 {
            return Err(overloaded());
        }
        let m = match self.resolve_model(&p.model).await {
            Ok(m) => m,
            // No live decoder serves the model now (or the name picks none): a retry of a
            // request the log holds is still answered from the log.
            Err(e @ (GatewayError::Precondition(_) | GatewayError::Invalid(_) | GatewayError::NotFound(_))) => {
                return match self.retried(tenant, p).await? {
                    Some(existing) => Ok(existing),
                    None => Err(e),
                };
            }
            Err(e) => return Err(e),
        };
        let binding = self.binding(tenant, p, &m).await?;
        let submitted = self
            .log
            .submit(pb::SubmitRequest {
                tenant: tenant.to_string(),
                request_id: p.request_id.clone(),
                binding: Some(binding.clone()),
            })
            .await
            .map_err(GatewayError::from);
        let r = match submitted {
            Ok(r) => r,
            Err(GatewayError::Conflict(msg)) => {
                // The same chat request bound by a gateway of an earlier release (as text)?
                let existing = self.lookup(tenant, &p.request_id).await?;
                let same = existing
                    .binding
                    .as_ref()
                    .is_some_and(|b| binding::same_but_bound_as_text(p, &m, &binding, b))
                    || self.same_as_bound(tenant, p, &existing).await.unwrap_or(false);
                if !same {
                    return Err(GatewayError::Conflict(format!(
                        "request id {:?} was already used for a different request ({msg})",
                        p.request_id
                    )));
                }
                pb::SubmitResponse {
                    generation: Some(existing),
                    created: false,
                }
            }
            Err(e) => return Err(e),
        };
        let info = r
            .generation
            .ok_or_else(|| GatewayError::Internal("submit answered without a generation".into()))?;
        self.metrics.submits.inc();
        if r.created {
            self.metrics.generations_created.inc();
        }
        tracing::info!(tenant, request_id = %p.request_id, generation = info.generation_id, created = r.created, "submitted");
        Ok((info, m.info.name))
    }

    /// `p` as a retry of the generation the log holds under its request id, when there is one
    /// and `p` is the request it was bound from (else a conflict): answered from the log, with
    /// no model resolved from the decoders registered now.
    async fn retried(&self, tenant: &str, p: &GenerateParams) -> Result<Option<(pb::GenerationInfo, String)>> {
        let existing = match self.lookup(tenant, &p.request_id).await {
            Ok(g) => g,
            Err(GatewayError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        if !self.same_as_bound(tenant, p, &existing).await? {
            return Err(GatewayError::Conflict(format!(
                "request id {:?} was already used for a different request",
                p.request_id
            )));
        }
        self.metrics.submits.inc();
        tracing::info!(tenant, request_id = %p.request_id, generation = existing.generation_id, "retry answered from the log");
        let name = match p.model.is_empty() {
            true => self.model_name(&existing).await,
            false => p.model.clone(),
        };
        Ok(Some((existing, name)))
    }

    /// Whether `p` is the request `existing` was bound from, bound again against that
    /// binding's own model and settings: the decoders registered now may serve another model
    /// or none, and another gateway may have bound it with another `--unowned-ms`, none of which
    /// makes a retry a different request. The log's rule: a text prompt's ids, filled in by
    /// its owner, are not part of the request.
    async fn same_as_bound(&self, tenant: &str, p: &GenerateParams, existing: &pb::GenerationInfo) -> Result<bool> {
        let Some(bound) = &existing.binding else {
            return Ok(false);
        };
        let Some(identity) = bound.model.clone() else {
            return Ok(false);
        };
        // The binding keeps the model's identity, not the name it was asked by. A name under
        // which decoders serve that identity now is the same model; a name none of them uses
        // while some serve it is another model (or none). With none serving it (all gone, or
        // upgraded to other weights under the same name) the name cannot be told apart and the
        // retry stands.
        if !p.model.is_empty() {
            let models = self.models().await?;
            let mut names = models
                .iter()
                .filter(|m| m.identity.as_ref() == Some(&identity))
                .map(|m| m.name.as_str())
                .peekable();
            if names.peek().is_some() && !names.any(|n| n == p.model) {
                return Ok(false);
            }
        }
        let tokenizer = self.tokenizer_for(&identity.tokenizer_sha256, &p.model).await?;
        let m = ResolvedModel {
            info: pb::ModelInfo {
                name: p.model.clone(),
                identity: Some(identity),
                // The binding passed the context's check when it was made.
                context_tokens: u32::MAX,
                ..Default::default()
            },
            tokenizer,
        };
        let Ok(mut ours) = self.binding(tenant, p, &m).await else {
            return Ok(false);
        };
        ours.unowned_ms = bound.unowned_ms;
        ours.deadline_ms = bound.deadline_ms;
        let mut theirs = bound.clone();
        if !theirs.prompt_text.is_empty() {
            theirs.prompt_token_ids.clear();
        }
        Ok(ours == theirs || binding::same_but_bound_as_text(p, &m, &ours, bound))
    }

    /// The generation of `(tenant, request_id)`, read linearizably (never creates one).
    pub async fn lookup(&self, tenant: &str, request_id: &str) -> Result<pb::GenerationInfo> {
        check_request_id(request_id)?;
        let r = self
            .log
            .get(pb::GetRequest {
                generation_id: 0,
                tenant: tenant.to_string(),
                request_id: request_id.to_string(),
                linearizable: true,
            })
            .await
            .map_err(|e| match GatewayError::from(e) {
                GatewayError::NotFound(_) => GatewayError::NotFound(format!("no request {request_id:?}")),
                other => other,
            })?;
        r.generation
            .ok_or_else(|| GatewayError::NotFound(format!("no request {request_id:?}")))
    }

    pub async fn cancel(&self, tenant: &str, request_id: &str) -> Result<pb::GenerationInfo> {
        let info = self.lookup(tenant, request_id).await?;
        if is_terminal(&info) {
            return Ok(info);
        }
        let r = self
            .log
            .cancel(pb::CancelRequest {
                tenant: tenant.to_string(),
                request_id: request_id.to_string(),
            })
            .await?;
        tracing::info!(tenant, request_id, ok = r.ok, "cancel");
        match (r.ok, r.generation) {
            (true, Some(g)) => Ok(g),
            _ => self.lookup(tenant, request_id).await,
        }
    }

    /// The name clients use for the model a generation is bound to (its registration's name).
    pub async fn model_name(&self, info: &pb::GenerationInfo) -> String {
        let digest = info
            .binding
            .as_ref()
            .and_then(|b| b.model.as_ref())
            .map(|m| m.weights_sha256.clone());
        if let (Ok(models), Some(d)) = (self.models().await, digest) {
            if let Some(m) = models
                .iter()
                .find(|m| m.identity.as_ref().is_some_and(|i| i.weights_sha256 == d))
            {
                return m.name.clone();
            }
        }
        "unknown".into()
    }
}
