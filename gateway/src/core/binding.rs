//! A request checked against every limit and turned into the binding the log holds (CONTRACT §1).

use tokenlog_decoder::{ChatMessage, RNG_VERSION};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::types::{Binding, ResumeMode, SamplingConfig, StopConfig};

use super::{Gateway, GenerateParams, Prompt, ResolvedModel};
use crate::error::{GatewayError, Result};
use crate::limits::*;

impl Gateway {
    /// Checks `p` and builds the binding the log will hold, on a blocking thread: a prompt of
    /// `PROMPT_TEXT_BYTES_MAX` takes the tokenizer a while, and on the async runtime it held
    /// up every stream of that worker thread meanwhile.
    pub async fn binding(&self, tenant: &str, p: &GenerateParams, m: &ResolvedModel) -> Result<pb::Binding> {
        let (tenant, p, m, unowned_ms) = (tenant.to_string(), p.clone(), m.clone(), self.bind.unowned_ms);
        tokio::task::spawn_blocking(move || binding(&tenant, &p, &m, unowned_ms))
            .await
            .map_err(|e| GatewayError::Internal(format!("binding a request: {e}")))?
    }
}

/// [`Gateway::binding`]'s work.
fn binding(tenant: &str, p: &GenerateParams, m: &ResolvedModel, unowned_ms: u64) -> Result<pb::Binding> {
    check_request_id(&p.request_id)?;
    let (ids, text) = prompt_of(p, m)?;
    let max_tokens = p.max_tokens.unwrap_or(MAX_TOKENS_DEFAULT);
    if max_tokens == 0 || max_tokens > GENERATION_TOKENS_MAX {
        return Err(GatewayError::Invalid(format!(
            "max_tokens {max_tokens}: must be 1..={GENERATION_TOKENS_MAX}"
        )));
    }
    let s = &p.sampling;
    check_range("temperature", s.temperature, 0.0, TEMPERATURE_MAX)?;
    check_range("top_p", s.top_p, 0.0, 1.0)?;
    check_range("repetition_penalty", s.repetition_penalty, 0.0, REPETITION_PENALTY_MAX)?;
    check_range(
        "frequency_penalty",
        s.frequency_penalty,
        -PENALTY_ABS_MAX,
        PENALTY_ABS_MAX,
    )?;
    check_range(
        "presence_penalty",
        s.presence_penalty,
        -PENALTY_ABS_MAX,
        PENALTY_ABS_MAX,
    )?;
    check_stops(&p.stop)?;
    let off_is_one = |v: f32| if v == 0.0 { 1.0 } else { v };
    let binding = Binding {
        model: m.info.identity.clone().unwrap_or_default().into(),
        prompt_token_ids: ids,
        prompt_text: text,
        sampling: SamplingConfig {
            top_p: off_is_one(s.top_p),
            repetition_penalty: off_is_one(s.repetition_penalty),
            seed: p.seed.unwrap_or_else(|| default_seed(tenant, &p.request_id)),
            rng_version: RNG_VERSION,
            ..s.clone()
        },
        stop: StopConfig {
            max_tokens,
            stop_strings: p.stop.clone(),
            eos_token_ids: if p.ignore_eos {
                Vec::new()
            } else {
                m.tokenizer.eos_token_ids().to_vec()
            },
        },
        mode: if p.fast_resume {
            ResumeMode::Fast
        } else {
            ResumeMode::Exact
        },
        deadline_ms: 0,
        unowned_ms,
    };
    Ok(binding.into())
}

/// A request's messages as the chat template takes them (`developer` is `system`).
fn chat_messages(msgs: &[ChatMessage]) -> Vec<ChatMessage> {
    msgs.iter()
        .map(|m| {
            let role = if m.role == "developer" {
                "system"
            } else {
                m.role.as_str()
            };
            ChatMessage::new(role, m.content.clone())
        })
        .collect()
}

/// Whether `existing` is `ours` as a gateway of an earlier release bound it: a chat prompt
/// as the template's text (the owner tokenized it) instead of token ids, all else the same.
/// A request retried across a rolling upgrade is then the same request, not a conflict.
pub(super) fn same_but_bound_as_text(
    p: &GenerateParams,
    m: &ResolvedModel,
    ours: &pb::Binding,
    existing: &pb::Binding,
) -> bool {
    let Prompt::Chat(msgs) = &p.prompt else {
        return false;
    };
    let mut as_text = ours.clone();
    as_text.prompt_token_ids.clear();
    as_text.prompt_text = m.tokenizer.apply_chat_template(&chat_messages(msgs));
    let mut theirs = existing.clone();
    // The owner's `BindPrompt` fills in the ids of a text prompt.
    theirs.prompt_token_ids.clear();
    as_text == theirs
}

/// The prompt as the binding holds it, `(token ids, text)` (one of them empty), checked against
/// the limits and the model's context.
fn prompt_of(p: &GenerateParams, m: &ResolvedModel) -> Result<(Vec<u32>, String)> {
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
            let msgs = chat_messages(msgs);
            // Bound as token ids: what the messages say is tokenized as text, so a message
            // cannot close its turn and open one of another role (bound as the template's text,
            // the decoder's tokenizer read `<|im_start|>system` in a user's content as the
            // control token). The same ids as the text's for ordinary messages.
            let text_len = m.tokenizer.apply_chat_template(&msgs).len();
            if text_len > PROMPT_TEXT_BYTES_MAX {
                return Err(GatewayError::Invalid(format!(
                    "prompt is {text_len} bytes; the limit is {PROMPT_TEXT_BYTES_MAX}"
                )));
            }
            let ids = m
                .tokenizer
                .encode_chat(&msgs)
                .map_err(|e| GatewayError::Invalid(format!("prompt cannot be tokenized: {e}")))?;
            (ids, String::new())
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
    Ok((ids, text))
}

fn check_stops(stops: &[String]) -> Result<()> {
    if stops.len() > STOP_STRINGS_MAX {
        return Err(GatewayError::Invalid(format!(
            "{} stop strings; at most {STOP_STRINGS_MAX}",
            stops.len()
        )));
    }
    if let Some(s) = stops.iter().find(|s| s.is_empty() || s.len() > STOP_STRING_BYTES_MAX) {
        return Err(GatewayError::Invalid(format!(
            "stop string {s:?}: must be 1..={STOP_STRING_BYTES_MAX} bytes"
        )));
    }
    Ok(())
}

pub(super) fn check_request_id(id: &str) -> Result<()> {
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
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use tokenlog_proto::raftlog as pb;
    use tokenlog_raftlog::client::LogClient;

    use crate::core::{BindDefaults, Gateway, GenerateParams, Prompt, ResolvedModel};
    use crate::limits::PROMPT_TEXT_BYTES_MAX;
    use crate::tenants::{TenantLimits, Tenants};

    /// A prompt of the largest size is bound off the async runtime: a task on the same runtime
    /// (one thread here; a gateway's worker thread runs the streams queued on it) keeps running
    /// while the tokenizer works. Before, the runtime's thread was held for the whole of it.
    #[tokio::test(flavor = "current_thread")]
    async fn a_long_prompt_is_tokenized_off_the_async_runtime() {
        let path = tokenlog_decoder::fetch::ensure_default_model(&tokenlog_decoder::fetch::repo_models_dir()).unwrap();
        let tokenizer = tokenlog_decoder::Tokenizer::from_model_path(&path).unwrap();
        let text = "The keeper climbed the lighthouse stairs at dusk. ".repeat(PROMPT_TEXT_BYTES_MAX / 50);
        let t0 = Instant::now();
        let tokens = tokenizer.encode(&text).unwrap().len();
        let alone = t0.elapsed();
        let gw = Gateway::new(
            LogClient::new(vec!["127.0.0.1:9".into()]).unwrap(),
            Tenants::Open,
            vec![],
            TenantLimits { streams: 1, submits: 1 },
            BindDefaults::default(),
        )
        .unwrap();
        let m = ResolvedModel {
            info: pb::ModelInfo {
                name: "m".into(),
                context_tokens: 1 << 20,
                ..Default::default()
            },
            tokenizer: Arc::new(tokenizer),
        };
        let p = GenerateParams::new("r", Prompt::Text(text));
        let longest = Arc::new(Mutex::new(Duration::ZERO));
        let ticker = tokio::spawn({
            let longest = longest.clone();
            async move {
                let mut last = Instant::now();
                loop {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    let mut l = longest.lock().unwrap();
                    *l = (*l).max(last.elapsed());
                    last = Instant::now();
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let bound = gw.binding("t", &p, &m).await;
        // The ticker's next tick measures the pause it is in.
        tokio::time::sleep(Duration::from_millis(10)).await;
        ticker.abort();
        let longest = *longest.lock().unwrap();
        eprintln!(
            "{tokens} tokens in {alone:?}; the longest pause of the ticker {longest:?}; {:?}",
            bound.as_ref().err()
        );
        assert!(
            alone >= Duration::from_millis(20),
            "the tokenizer took {alone:?}: too short to tell"
        );
        assert!(
            longest < alone / 2,
            "the runtime paused for {longest:?} while a prompt that takes {alone:?} was tokenized"
        );
    }
}
