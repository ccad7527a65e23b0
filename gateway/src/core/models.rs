//! Which model a request uses: live decoder registrations (cached briefly) and the tokenizer this
//! gateway holds for each.

use std::time::Instant;

use tokenlog_decoder::Tokenizer;
use tokenlog_proto::raftlog as pb;

use super::Gateway;
use crate::error::{GatewayError, Result};
use crate::limits::*;

/// A model a request can use: its registration and the tokenizer for its text.
pub struct ResolvedModel {
    pub info: pb::ModelInfo,
    pub tokenizer: Tokenizer,
}

impl Gateway {
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

    pub(super) fn tokenizer_for(&self, tokenizer_sha256: &str, name: &str) -> Result<Tokenizer> {
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
}
