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

use tokenlog_decoder::{identity::tokenizer_sha256, ChatMessage, Tokenizer, RNG_VERSION};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::error::{GatewayError, Result};
use crate::limits::*;
use crate::metrics::Metrics;
use crate::tenants::Tenants;

/// What the client wants generated.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// A chat: the model's chat template is applied here, the decoder tokenizes the text.
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
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
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
            temperature: 0.0,
            top_p: 0.0,
            top_k: 0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
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

pub fn finish_reason_str(r: i32) -> &'static str {
    match pb::FinishReason::try_from(r).unwrap_or(pb::FinishReason::Unspecified) {
        pb::FinishReason::Stop => "stop",
        pb::FinishReason::Length => "length",
        pb::FinishReason::Cancelled => "cancelled",
        pb::FinishReason::Error | pb::FinishReason::Unspecified => "error",
    }
}

pub fn state_str(s: i32) -> &'static str {
    match pb::GenerationState::try_from(s).unwrap_or(pb::GenerationState::Unspecified) {
        pb::GenerationState::Pending => "pending",
        pb::GenerationState::Running => "running",
        pb::GenerationState::Finished => "finished",
        pb::GenerationState::Failed => "failed",
        pb::GenerationState::Cancelled => "cancelled",
        pb::GenerationState::Unspecified => "unknown",
    }
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
    /// Tokenizers this gateway can detokenize with, by tokenizer digest.
    tokenizers: HashMap<String, Tokenizer>,
    models: Mutex<Option<(Instant, Vec<pb::ModelInfo>)>>,
    streams: Arc<Semaphore>,
    pub metrics: Arc<Metrics>,
}

/// A model a request can use: its registration and the tokenizer for its text.
pub struct ResolvedModel {
    pub info: pb::ModelInfo,
    pub tokenizer: Tokenizer,
}

impl Gateway {
    pub fn new(log: LogClient, tenants: Tenants, tokenizers: Vec<Tokenizer>) -> Result<Arc<Gateway>> {
        let mut map = HashMap::new();
        for t in tokenizers {
            let digest = tokenizer_sha256(&t).map_err(|e| GatewayError::Internal(e.to_string()))?;
            map.insert(digest, t);
        }
        Ok(Arc::new(Gateway {
            log,
            tenants,
            tokenizers: map,
            models: Mutex::new(None),
            streams: Arc::new(Semaphore::new(STREAMS_MAX)),
            metrics: Arc::new(Metrics::default()),
        }))
    }

    pub fn tenant(&self, key: Option<&str>) -> Result<String> {
        self.tenants.tenant(key)
    }

    pub fn http_request(&self) {
        self.metrics.http_requests.inc();
    }

    pub fn log(&self) -> &LogClient {
        &self.log
    }

    /// Models with a live decoder registration, as the log lists them (cached briefly).
    pub async fn models(&self) -> Result<Vec<pb::ModelInfo>> {
        if let Some((at, models)) = &*self.models.lock().expect("lock") {
            if at.elapsed() < MODELS_CACHE_TTL {
                return Ok(models.clone());
            }
        }
        let mut models = self.log.list_models().await?.models;
        models.sort_by(|a, b| a.name.cmp(&b.name));
        *self.models.lock().expect("lock") = Some((Instant::now(), models.clone()));
        Ok(models)
    }

    fn tokenizer_for(&self, tokenizer_sha256: &str, name: &str) -> Result<Tokenizer> {
        self.tokenizers.get(tokenizer_sha256).cloned().ok_or_else(|| {
            GatewayError::Precondition(format!(
                "this gateway has no tokenizer for model {name:?} (tokenizer sha256 {tokenizer_sha256}); \
                 start it with --model <the model's GGUF file or folder>"
            ))
        })
    }

    /// The model `name` names (empty: the first registered model this gateway can serve).
    pub async fn resolve_model(&self, name: &str) -> Result<ResolvedModel> {
        let models = self.models().await?;
        if models.is_empty() {
            return Err(GatewayError::Precondition(
                "no decoder is registered with the log: start one (`tokenlog decoder`)".into(),
            ));
        }
        let info = if name.is_empty() {
            models
                .iter()
                .find(|m| {
                    m.identity
                        .as_ref()
                        .is_some_and(|i| self.tokenizers.contains_key(&i.tokenizer_sha256))
                })
                .or(models.first())
        } else {
            models.iter().find(|m| m.name == name)
        }
        .cloned()
        .ok_or_else(|| {
            let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
            GatewayError::NotFound(format!("unknown model {name:?}; served models: {}", names.join(", ")))
        })?;
        let digest = info
            .identity
            .as_ref()
            .map(|i| i.tokenizer_sha256.clone())
            .unwrap_or_default();
        let tokenizer = self.tokenizer_for(&digest, &info.name)?;
        Ok(ResolvedModel { info, tokenizer })
    }

    /// Checks `p` and builds the binding the log will hold.
    pub fn binding(&self, tenant: &str, p: &GenerateParams, m: &ResolvedModel) -> Result<pb::Binding> {
        check_request_id(&p.request_id)?;
        let context = m.info.context_tokens as usize;
        let (ids, text) = match &p.prompt {
            Prompt::Ids(ids) => {
                if ids.is_empty() {
                    return Err(GatewayError::Invalid("prompt_token_ids is empty".into()));
                }
                let vocab = m.tokenizer.vocab_size() as u32;
                if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
                    return Err(GatewayError::Invalid(format!(
                        "prompt token id {bad} is outside the model's vocabulary ({vocab} tokens)"
                    )));
                }
                (ids.clone(), String::new())
            }
            Prompt::Text(t) => {
                if t.is_empty() {
                    return Err(GatewayError::Invalid("prompt is empty".into()));
                }
                (Vec::new(), t.clone())
            }
            Prompt::Chat(msgs) => {
                if msgs.is_empty() {
                    return Err(GatewayError::Invalid("messages is empty".into()));
                }
                if msgs.len() > MESSAGES_MAX {
                    return Err(GatewayError::Invalid(format!(
                        "{} messages; at most {MESSAGES_MAX}",
                        msgs.len()
                    )));
                }
                for m in msgs {
                    if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer") {
                        return Err(GatewayError::Invalid(format!(
                            "message role {:?}: expected system, developer, user or assistant",
                            m.role
                        )));
                    }
                }
                let msgs: Vec<ChatMessage> = msgs
                    .iter()
                    .map(|m| {
                        let role = if m.role == "developer" {
                            "system"
                        } else {
                            m.role.as_str()
                        };
                        ChatMessage::new(role, m.content.clone())
                    })
                    .collect();
                (Vec::new(), m.tokenizer.apply_chat_template(&msgs))
            }
        };
        if text.len() > PROMPT_TEXT_BYTES_MAX {
            return Err(GatewayError::Invalid(format!(
                "prompt is {} bytes; the limit is {PROMPT_TEXT_BYTES_MAX}",
                text.len()
            )));
        }
        // Count the prompt's tokens here (the decoder tokenizes the same text the same way) so an
        // oversized prompt is refused before it is submitted.
        let prompt_len = if text.is_empty() {
            ids.len()
        } else {
            m.tokenizer
                .encode(&text)
                .map_err(|e| GatewayError::Invalid(format!("prompt cannot be tokenized: {e}")))?
                .len()
        };
        let cap = PROMPT_TOKENS_MAX.min(context.saturating_sub(1).max(1));
        if prompt_len > cap {
            return Err(GatewayError::Invalid(format!(
                "prompt is {prompt_len} tokens; model {:?} takes at most {cap} (context {context})",
                m.info.name
            )));
        }
        let max_tokens = p.max_tokens.unwrap_or(MAX_TOKENS_DEFAULT);
        if max_tokens == 0 || max_tokens > GENERATION_TOKENS_MAX {
            return Err(GatewayError::Invalid(format!(
                "max_tokens {max_tokens}: must be 1..={GENERATION_TOKENS_MAX}"
            )));
        }
        check_range("temperature", p.temperature, 0.0, TEMPERATURE_MAX)?;
        check_range("top_p", p.top_p, 0.0, 1.0)?;
        check_range("repetition_penalty", p.repetition_penalty, 0.0, 10.0)?;
        check_range(
            "frequency_penalty",
            p.frequency_penalty,
            -PENALTY_ABS_MAX,
            PENALTY_ABS_MAX,
        )?;
        check_range(
            "presence_penalty",
            p.presence_penalty,
            -PENALTY_ABS_MAX,
            PENALTY_ABS_MAX,
        )?;
        if p.stop.len() > STOP_STRINGS_MAX {
            return Err(GatewayError::Invalid(format!(
                "{} stop strings; at most {STOP_STRINGS_MAX}",
                p.stop.len()
            )));
        }
        if let Some(s) = p.stop.iter().find(|s| s.is_empty() || s.len() > STOP_STRING_BYTES_MAX) {
            return Err(GatewayError::Invalid(format!(
                "stop string {s:?}: must be 1..={STOP_STRING_BYTES_MAX} bytes"
            )));
        }
        let seed = p.seed.unwrap_or_else(|| default_seed(tenant, &p.request_id));
        Ok(pb::Binding {
            model: m.info.identity.clone(),
            prompt_token_ids: ids,
            prompt_text: text,
            sampling: Some(pb::SamplingConfig {
                temperature: p.temperature,
                top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
                top_k: p.top_k,
                repetition_penalty: if p.repetition_penalty == 0.0 {
                    1.0
                } else {
                    p.repetition_penalty
                },
                frequency_penalty: p.frequency_penalty,
                presence_penalty: p.presence_penalty,
                seed,
                rng_version: RNG_VERSION,
            }),
            stop: Some(pb::StopConfig {
                max_tokens,
                stop_strings: p.stop.clone(),
                eos_token_ids: if p.ignore_eos {
                    Vec::new()
                } else {
                    m.tokenizer.eos_token_ids().to_vec()
                },
            }),
            mode: if p.fast_resume {
                pb::ResumeMode::Fast
            } else {
                pb::ResumeMode::Exact
            } as i32,
            deadline_ms: 0,
        })
    }

    /// Submits (idempotently: the same request id and request give the same generation).
    pub async fn submit(&self, tenant: &str, p: &GenerateParams) -> Result<(pb::GenerationInfo, String)> {
        let m = self.resolve_model(&p.model).await?;
        let binding = self.binding(tenant, p, &m)?;
        let r = self
            .log
            .submit(pb::SubmitRequest {
                tenant: tenant.to_string(),
                request_id: p.request_id.clone(),
                binding: Some(binding),
            })
            .await
            .map_err(|e| match GatewayError::from(e) {
                GatewayError::Conflict(msg) => GatewayError::Conflict(format!(
                    "request id {:?} was already used for a different request ({msg})",
                    p.request_id
                )),
                other => other,
            })?;
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

    /// Streams the events of `info`'s generation with seq > `after_seq` (-1 = all), ending with
    /// the last event once the generation is terminal. Errors end the stream.
    pub fn events(self: &Arc<Self>, info: pb::GenerationInfo, after_seq: i64) -> Result<mpsc::Receiver<Result<Event>>> {
        let digest = info
            .binding
            .as_ref()
            .and_then(|b| b.model.as_ref())
            .map(|m| m.tokenizer_sha256.clone())
            .unwrap_or_default();
        let tokenizer = self.tokenizer_for(&digest, &info.request_id)?;
        let permit = self
            .streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| GatewayError::Overloaded(format!("gateway overloaded: {STREAMS_MAX} streams open")))?;
        let (tx, rx) = mpsc::channel(STREAM_BUFFER_EVENTS);
        let gw = self.clone();
        tokio::spawn(async move { gw.pump(info, after_seq, tokenizer, tx, permit).await });
        Ok(rx)
    }

    async fn pump(
        self: Arc<Self>,
        info: pb::GenerationInfo,
        after_seq: i64,
        tokenizer: Tokenizer,
        tx: mpsc::Sender<Result<Event>>,
        _permit: OwnedSemaphorePermit,
    ) {
        let _active = self.metrics.stream_guard();
        let gid = info.generation_id;
        let mut detok = tokenizer.detokenizer(true);
        let stops = info
            .binding
            .as_ref()
            .and_then(|b| b.stop.as_ref())
            .map(|s| s.stop_strings.clone())
            .unwrap_or_default();
        let mut stop_text = StopText::new(stops);
        let mut next: u32 = 0;
        let mut last_progress = Instant::now();
        let mk = |seq: u32, epoch: u64, token_id: Option<u32>, text: String, finish: Option<Finish>| Event {
            request_id: info.request_id.clone(),
            generation: gid,
            epoch,
            seq,
            token_id,
            text,
            finish,
        };
        loop {
            let mut stream = match self.log.watch(gid, next).await {
                Ok(s) => s,
                Err(e) => {
                    if last_progress.elapsed() > WATCH_RETRY_BUDGET {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    continue;
                }
            };
            let mut last_epoch = 0;
            loop {
                let ev = match stream.message().await {
                    Ok(Some(ev)) => ev,
                    Ok(None) => break,
                    Err(status) => {
                        if status.code() == tonic::Code::NotFound {
                            let _ = tx.send(Err(GatewayError::NotFound(status.message().to_string()))).await;
                            return;
                        }
                        tracing::debug!(generation = gid, "watch broke ({status}); reopening at seq {next}");
                        break;
                    }
                };
                last_progress = Instant::now();
                for r in ev.records {
                    if r.seq < next {
                        continue;
                    }
                    if r.seq > next {
                        let _ = tx
                            .send(Err(GatewayError::Internal(format!(
                                "log skipped from seq {next} to {} for generation {gid}",
                                r.seq
                            ))))
                            .await;
                        return;
                    }
                    let text = stop_text.push(&detok.push(r.token_id));
                    last_epoch = r.epoch;
                    if i64::from(r.seq) > after_seq {
                        if tx
                            .send(Ok(mk(r.seq, r.epoch, Some(r.token_id), text, None)))
                            .await
                            .is_err()
                        {
                            return;
                        }
                        self.metrics.tokens_streamed.inc();
                    }
                    next += 1;
                }
                if let Some(term) = ev.terminal {
                    if i64::from(next) > after_seq {
                        let finish = Finish {
                            reason: finish_reason_str(term.finish_reason),
                            detail: term.finish_detail.clone(),
                            prompt_tokens: prompt_tokens(&term),
                            completion_tokens: term.frontier,
                        };
                        let epoch = term.lease.as_ref().map_or(last_epoch, |l| l.epoch);
                        let rest = stop_text.finish(&detok.finish());
                        let _ = tx.send(Ok(mk(next, epoch, None, rest, Some(finish)))).await;
                    }
                    return;
                }
            }
            if tx.is_closed() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}

/// Client-visible text with OpenAI's stop-string semantics: the stop string and everything after
/// it are not shown. Text that could still become a stop string is held back until it cannot;
/// the decoder has committed the tokens that contain the stop string (it stops after them), so
/// only the text is cut, never the records. A pure function of the text so far, so every
/// gateway cuts the same way.
pub struct StopText {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopText {
    pub fn new(stops: Vec<String>) -> Self {
        StopText {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// The text that can be shown after `delta`.
    pub fn push(&mut self, delta: &str) -> String {
        if self.stopped {
            return String::new();
        }
        if self.stops.is_empty() {
            return delta.to_string();
        }
        self.held.push_str(delta);
        if let Some(pos) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.stopped = true;
            let out = self.held[..pos].to_string();
            self.held.clear();
            return out;
        }
        // Keep the longest tail of `held` that is the start of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                s.char_indices()
                    .skip(1)
                    .map(|(i, _)| &s[..i])
                    .chain(std::iter::once(s.as_str()))
            })
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }

    /// The rest at the end of the generation (held-back text that never became a stop string).
    pub fn finish(&mut self, delta: &str) -> String {
        let mut out = self.push(delta);
        if !self.stopped {
            out.push_str(&std::mem::take(&mut self.held));
        }
        out
    }
}

fn check_request_id(id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(GatewayError::Invalid("request_id is empty".into()));
    }
    if id.len() > REQUEST_ID_BYTES_MAX {
        return Err(GatewayError::Invalid(format!(
            "request_id is {} bytes; at most {REQUEST_ID_BYTES_MAX}",
            id.len()
        )));
    }
    if id.chars().any(|c| c.is_control()) {
        return Err(GatewayError::Invalid("request_id contains control characters".into()));
    }
    Ok(())
}

fn check_range(name: &str, v: f32, lo: f32, hi: f32) -> Result<()> {
    if !v.is_finite() || v < lo || v > hi {
        return Err(GatewayError::Invalid(format!("{name} {v}: must be in [{lo}, {hi}]")));
    }
    Ok(())
}

/// The seed of a request that names none: a function of (tenant, request id), so a retry binds
/// the same seed and is idempotent.
pub fn default_seed(tenant: &str, request_id: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let d = Sha256::new()
        .chain_update(tenant.as_bytes())
        .chain_update([0u8])
        .chain_update(request_id.as_bytes())
        .finalize();
    u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
}

/// A fresh random request id (for HTTP requests without an Idempotency-Key).
pub fn random_request_id() -> String {
    format!("req-{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>())
}

#[cfg(test)]
mod tests {
    use super::StopText;

    fn run(stops: &[&str], deltas: &[&str]) -> (Vec<String>, String) {
        let mut s = StopText::new(stops.iter().map(|x| x.to_string()).collect());
        let (last, body) = deltas.split_last().unwrap();
        let shown: Vec<String> = body.iter().map(|d| s.push(d)).collect();
        (shown, s.finish(last))
    }

    #[test]
    fn stop_string_and_what_follows_are_cut() {
        let (shown, rest) = run(&["END"], &["hello ", "wor", "ld E", "N", "D and more", ""]);
        assert_eq!(shown.concat() + &rest, "hello world ");
        // "E" and "N" were held back while they could still become "END".
        assert_eq!(shown, vec!["hello ", "wor", "ld ", "", ""]);
    }

    #[test]
    fn held_text_is_released_when_it_cannot_become_a_stop_string() {
        let (shown, rest) = run(&["END"], &["an E", "NOUGH", " text", ""]);
        assert_eq!(shown.concat() + &rest, "an ENOUGH text");
        let (shown, rest) = run(&["END"], &["the E"]);
        assert!(shown.is_empty());
        assert_eq!(
            rest, "the E",
            "a generation that ends for another reason shows everything"
        );
    }

    #[test]
    fn earliest_of_several_stop_strings_wins_and_no_stops_is_identity() {
        let (shown, rest) = run(&["xyz", "b"], &["aab", "cxyz", ""]);
        assert_eq!(shown.concat() + &rest, "aa");
        let (shown, rest) = run(&[], &["a", "b", "c"]);
        assert_eq!(shown.concat() + &rest, "abc");
    }
}
