//! A synchronous generation loop, for tests and benchmarks (the worker drives [`DecodeState`]
//! itself, committing as it goes).

use std::time::{Duration, Instant};

use crate::error::Result;
use crate::model::Model;
use crate::resume::DecodeState;
use crate::sampler::{SamplingConfig, StopCause, StopConfig};

/// The outcome of [`generate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub finish: StopCause,
    /// Time of the prompt prefill.
    pub prefill: Duration,
    /// Time from the end of the prefill to the last token.
    pub decode: Duration,
}

impl Generated {
    /// Decode throughput: generated tokens after the first, per second of decode time (the
    /// first token's draw only needs the prefill's logits).
    pub fn decode_tokens_per_s(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        n as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

/// Generates from `prompt` until EOS, a stop string, `stop.max_tokens` or the context's end.
pub fn generate(model: &dyn Model, prompt: &[u32], params: &SamplingConfig, stop: &StopConfig) -> Result<Generated> {
    let t0 = Instant::now();
    let mut state = DecodeState::start(model, prompt, params.clone(), stop.clone())?;
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    let (tokens, finish) = state.run_to_end()?;
    Ok(Generated {
        tokens,
        finish,
        prefill,
        decode: t1.elapsed(),
    })
}
