//! tokenlog's model layer: everything a decoder needs to turn a bound generation (model identity,
//! prompt ids, sampling configuration, stop conditions) into tokens, and to pick it up again from
//! a committed prefix after another decoder died (CONTRACT §1, §4).
//!
//! The lease worker ([`worker`]) sits on top of this API; everything else here has no networking
//! and no log.
//!
//! # Layout
//! - [`model`]: the [`Model`] / [`Sequence`] traits the worker drives, and [`GgufModel`], a real
//!   llama-family LLM (candle, GGUF, CPU or CUDA). One `Sequence` per generation, each with its
//!   own KV cache, so generations can be interleaved without touching each other's numerics.
//! - [`safetensors_model`]: [`SafetensorsModel`], a llama-family model folder in Hugging Face
//!   layout (`config.json`, `*.safetensors`, `tokenizer.json`).
//! - [`export`]: writes a GGUF llama model as such a folder (dequantized), for tests and tries.
//! - [`fake`]: [`FakeModel`], an instant deterministic twin of the real model for tests.
//! - [`tokenizer`]: [`Tokenizer`] built from the GGUF file's own vocabulary, ChatML prompts, and
//!   [`IncrementalDetokenizer`] (UTF-8-safe text deltas).
//! - [`identity`]: [`ModelIdentity`], the digests a generation is bound to.
//! - [`sampler`]: [`SamplingParams`], the counter-based [`Sampler`] (draw `seq` depends only on
//!   `(seed, seq)`), [`StopConditions`] and [`StopMatcher`].
//! - [`resume`]: [`ResumeMode`] (exact / fast re-prefill), [`Frontiers`] (sampled, fed, KV,
//!   committed) and [`DecodeState`], one generation's decoding state, started fresh or resumed.
//! - [`generate`]: a synchronous loop over `DecodeState`, for tests and benchmarks.
//! - [`fetch`]: locating and fetching the default model (SmolLM2-135M-Instruct, Q4_1).
//! - [`threads`]: the process-wide CPU thread count of candle.
//! - [`worker`]: the lease worker: acquire, re-prefill, decode, fenced appends, renewals.
//! - [`failpoint`]: test-only failpoints of the worker (`TOKENLOG_FAILPOINTS`), for the fault
//!   suite's scenarios.
//! - [`history`]: the worker's optional JSONL record of acquires and appends, for the checkers.
//!
//! # Invariants
//! - The random draw at position `seq` is a pure function of `(seed, seq)` ([`RNG_VERSION`]).
//! - Sampler and stop-matcher state are rebuilt from `(prompt, committed prefix)` alone.
//! - Exact resume issues the same sequence of model calls as an uninterrupted run (one batch for
//!   the prompt, then one call per token), so on the same device and build its logits are
//!   bit-identical. Fast resume prefills prompt and prefix in one batch and may diverge later.
//! - Nothing here re-tokenizes committed text: the worker hands ids in, ids come out.

pub mod error;
pub mod export;
pub mod failpoint;
pub mod fake;
pub mod fetch;
pub mod generate;
pub mod history;
pub mod identity;
pub mod model;
pub mod resume;
pub mod safetensors_model;
pub mod sampler;
pub mod threads;
pub mod tokenizer;
pub mod worker;

pub use error::{Error, Result};
pub use fake::{FakeConfig, FakeModel};
pub use generate::{generate, Generated};
pub use identity::ModelIdentity;
pub use model::{load_model, DeviceSpec, GgufModel, Logits, Model, Sequence};
pub use resume::{DecodeState, Frontiers, ResumeMode, ResumeStats, Step};
pub use safetensors_model::SafetensorsModel;
pub use sampler::{FinishReason, Sampler, SamplingParams, StopConditions, StopMatcher, RNG_VERSION};
pub use tokenizer::{ChatMessage, IncrementalDetokenizer, Tokenizer};
