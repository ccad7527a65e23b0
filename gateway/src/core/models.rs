//! Which model a request uses: live decoder registrations (cached briefly) and the tokenizer this
//! gateway holds for each.

use std::sync::Arc;
use std::time::Instant;

use tokenlog_decoder::Tokenizer;
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::ClientError;

use super::Gateway;
use crate::error::{GatewayError, Result};
use crate::limits::*;

/// A model a request can use: its registration and the tokenizer for its text.
#[derive(Clone)]
pub struct ResolvedModel {
    pub info: pb::ModelInfo,
    pub tokenizer: Arc<Tokenizer>,
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

    /// The tokenizer with digest `tokenizer_sha256` (of model or request `name`, for messages):
    /// one this gateway holds, or the package a decoder published in the log, checked against
    /// the digest and kept from then on.
    pub(super) async fn tokenizer_for(&self, tokenizer_sha256: &str, name: &str) -> Result<Arc<Tokenizer>> {
        if let Some(t) = self.held_tokenizer(tokenizer_sha256) {
            return Ok(t);
        }
        let _one_fetch = self.fetching.lock().await;
        if let Some(t) = self.held_tokenizer(tokenizer_sha256) {
            return Ok(t);
        }
        let package = match self.log.tokenizer(tokenizer_sha256).await {
            Ok(p) => p,
            Err(ClientError::Status(s)) if s.code() == tonic::Code::NotFound => {
                return Err(GatewayError::Precondition(format!(
                    "no tokenizer for {name:?} (tokenizer sha256 {tokenizer_sha256}): no decoder of that model has \
                     published it in the log; start one, or start this gateway with --model <the model's file or folder>"
                )))
            }
            Err(e) => return Err(e.into()),
        };
        let digest = tokenizer_sha256.to_string();
        let t = tokio::task::spawn_blocking(move || Tokenizer::from_package(&package, &digest))
            .await
            .map_err(|e| GatewayError::Internal(format!("reading a tokenizer package: {e}")))?
            .map_err(|e| GatewayError::Internal(e.to_string()))?;
        let t = Arc::new(t);
        tracing::info!(
            tokenizer_sha256,
            vocab = t.vocab_size(),
            "tokenizer fetched from the log"
        );
        self.metrics.tokenizers_fetched.inc();
        self.tokenizers
            .lock()
            .expect("lock")
            .insert(tokenizer_sha256.to_string(), t.clone());
        Ok(t)
    }

    fn held_tokenizer(&self, tokenizer_sha256: &str) -> Option<Arc<Tokenizer>> {
        self.tokenizers.lock().expect("lock").get(tokenizer_sha256).cloned()
    }

    /// The model `name` names. Empty: the one model the log serves; with several, the request
    /// must name one (a default that depended on this gateway, on which tokenizers it had
    /// fetched so far, sent a retry through another gateway to another model).
    pub async fn resolve_model(&self, name: &str) -> Result<ResolvedModel> {
        let models = self.models().await?;
        if models.is_empty() {
            return Err(GatewayError::Precondition(
                "no decoder is registered with the log: start one (`tokenlog decoder`)".into(),
            ));
        }
        let names = || models.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", ");
        let info =
            match (name.is_empty(), models.as_slice()) {
                (true, [only]) => only.clone(),
                (true, _) => {
                    return Err(GatewayError::Invalid(format!(
                        "model is required: the log serves several models ({})",
                        names()
                    )))
                }
                (false, _) => models.iter().find(|m| m.name == name).cloned().ok_or_else(|| {
                    GatewayError::NotFound(format!("unknown model {name:?}; served models: {}", names()))
                })?,
            };
        let digest = info
            .identity
            .as_ref()
            .map(|i| i.tokenizer_sha256.clone())
            .unwrap_or_default();
        let tokenizer = self.tokenizer_for(&digest, &info.name).await?;
        Ok(ResolvedModel { info, tokenizer })
    }
}
