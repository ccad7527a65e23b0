//! tokenlog's model layer: everything a decoder needs to turn a bound generation (model identity,
//! prompt ids, sampling configuration, stop conditions) into tokens, and to pick it up again from
//! a committed prefix after another decoder died (CONTRACT §1, §4).
//!
//! The lease worker ([`worker`]) sits on top of this API; everything else here has no networking
//! and no log.
//!
//! # Features
//! `model` (default) compiles the candle models (`GgufModel`, `SafetensorsModel`, export,
//! threads). Without it the crate is the text layer and the protocol side only: tokenizer, chat
//! template, detokenizer, stop matcher, sampler, identity, the fake model and the worker. The
//! gateway uses it that way and links no candle crate.
//!
//! # Layout
//! - [`model`]: the [`Model`] / [`Sequence`] traits the worker drives. One `Sequence` per
//!   generation, each with its own KV cache, so generations can be interleaved without touching
//!   each other's numerics.
//! - [`gguf_model`]: `GgufModel`, a real llama-family LLM (GGUF, CPU or CUDA); `cpu`: its own
//!   batched CPU forward pass, invariant to batching (`cpu::quant`: the weight formats and
//!   matrix products); `llama`: its candle forward pass (CUDA); `kv`: the KV-cache sequence
//!   every candle model shares.
//! - [`stage`]: a pipeline stage, a layer range of a GGUF model on the CPU engine, and its
//!   `decoder.v1.Stage` service; [`pipeline`]: `PipelineModel`, a pipeline head's [`Model`]
//!   whose layers run in stage processes (the same bits as the whole model).
//! - [`gguf_meta`]: a candle-free reader of a GGUF file's metadata (the tokenizer's source).
//! - [`safetensors_model`]: [`SafetensorsModel`], a llama-family model folder in Hugging Face
//!   layout (`config.json`, `*.safetensors`, `tokenizer.json`).
//! - [`export`]: writes a GGUF llama model as such a folder (dequantized), for tests and tries.
//! - [`fake`]: [`FakeModel`], an instant deterministic twin of the real model for tests.
//! - [`tokenizer`]: [`Tokenizer`] built from the GGUF file's own vocabulary, ChatML prompts, and
//!   [`IncrementalDetokenizer`] (UTF-8-safe text deltas).
//! - [`identity`]: [`ModelIdentity`], the digests a generation is bound to.
//! - [`sampler`]: [`SamplingConfig`], the counter-based [`Sampler`] (draw `seq` depends only on
//!   `(seed, seq)`), [`StopConfig`] and [`StopMatcher`].
//! - [`stop`]: [`StopText`], the one stop-string matcher (decoder and gateway).
//! - [`resume`]: [`ResumeMode`] (exact / fast re-prefill), [`Frontiers`] (sampled, fed, KV,
//!   committed) and [`DecodeState`], one generation's decoding state, started fresh or resumed.
//! - [`generate`]: a synchronous loop over `DecodeState`, for tests and benchmarks.
//! - [`fetch`]: locating and fetching the default model (SmolLM2-135M-Instruct, Q4_1).
//! - [`threads`]: the process-wide CPU thread count of candle.
//! - [`worker`]: the lease worker: acquire, re-prefill, decode, fenced appends, renewals.
//! - [`failpoint`]: test-only failpoints of the worker (`TOKENLOG_FAILPOINTS`), for the fault
//!   suite's scenarios.
//! - [`history`]: the worker's optional JSONL record of acquires and appends, for the checkers.
//! - [`simulation`]: what changes when the deterministic simulation runs real workers (model
//!   work inline, counted session ids, simulated history times), per thread.
//!
//! # Invariants
//! - The random draw at position `seq` is a pure function of `(seed, seq)` ([`RNG_VERSION`]).
//! - Sampler and stop-matcher state are rebuilt from `(prompt, committed prefix)` alone.
//! - Exact resume gives the logits of an uninterrupted run bit for bit, on the same device and
//!   build: a sequence that is [`Sequence::grouping_invariant`] (the CPU engine, the fake) gets
//!   prompt and committed prefix in one call; any other repeats the uninterrupted run's calls
//!   (one batch for the prompt, then one call per token). Fast resume prefills prompt and prefix
//!   in one batch and may diverge later on a sequence that is not invariant.
//! - A batch of generations ([`Model::prefill_batch`]) gives each one the logits it would get
//!   alone.
//! - Nothing here re-tokenizes committed text: the worker hands ids in, ids come out.

pub mod cache;
#[cfg(feature = "model")]
mod cpu;
#[cfg(feature = "model")]
pub use cpu::kernels as cpu_engine_kernels;
#[cfg(feature = "model")]
pub use cpu::NUMERICS as CPU_ENGINE_NUMERICS;
pub mod detokenizer;
pub mod error;
mod exp;
#[cfg(feature = "model")]
pub mod export;
#[cfg(feature = "faults")]
pub mod failpoint;
pub mod fake;
pub mod fetch;
pub mod generate;
pub mod gguf_meta;
#[cfg(feature = "model")]
pub mod gguf_model;
pub mod handoff;
pub mod history;
pub mod identity;
#[cfg(feature = "model")]
mod kv;
pub mod limits;
#[cfg(feature = "model")]
mod llama;
pub mod model;
pub mod panics;
#[cfg(feature = "model")]
pub mod pipeline;
pub mod prefix_cache;
pub mod resume;
#[cfg(feature = "model")]
pub mod safetensors_model;
pub mod sampler;
pub mod simulation;
#[cfg(feature = "model")]
pub mod stage;
pub mod stage_fence;
mod standby;
pub mod stop;
#[cfg(feature = "model")]
pub mod threads;
pub mod tokenizer;
pub mod worker;
mod worker_hooks;
mod worker_lease;

pub use error::{Error, Result};
pub use fake::{FakeConfig, FakeModel};
pub use generate::{generate, Generated};
#[cfg(feature = "model")]
pub use gguf_model::{GgufEngine, GgufModel};
pub use identity::ModelIdentity;
#[cfg(feature = "model")]
pub use model::load_model;
pub use model::{DeviceSpec, Logits, Model, Sequence};
pub use resume::{DecodeState, Frontiers, ResumeMode, ResumeStats, Row, Step};
#[cfg(feature = "model")]
pub use safetensors_model::SafetensorsModel;
pub use sampler::{Sampler, SamplingConfig, StopCause, StopConfig, StopMatcher, RNG_VERSION};
pub use stop::StopText;
pub use tokenizer::{ChatMessage, IncrementalDetokenizer, Tokenizer};
