//! CPU thread count of candle.
//!
//! candle 0.11 runs quantized matmuls on one process-wide barrier pool and f32 matmuls (gemm) on
//! rayon; both size themselves once, from `CANDLE_NUM_THREADS` / `RAYON_NUM_THREADS`, on first
//! use. With one thread the pool has no workers and every operation runs inline on the calling
//! thread, so N decoder threads use N cores and never wait on each other. That is what a host
//! that runs several decoders (or shares its cores with anything else) wants: candle's pool spins
//! and then parks, and under contention its throughput collapses (shared/gpu/README.md).
//!
//! The thread count does not change the numbers: on this build, 32 steps of SmolLM2 gave
//! bit-identical logits with 1 and 2 threads (each output element is one dot product computed by
//! one thread), so exact resume holds across decoders configured differently.
//!
//! The count is per process, not per decoder: call [`init_cpu_threads`] at process start, before
//! loading a model. Setting the environment variables yourself works the same way.

use std::sync::OnceLock;

static CONFIGURED: OnceLock<usize> = OnceLock::new();

/// Sets candle's CPU thread count for this process (1 = each decoder thread computes inline).
/// Must run before the first tensor operation; returns the count in force, which is the first
/// one ever set if this is called again.
pub fn init_cpu_threads(threads: usize) -> usize {
    let threads = threads.max(1);
    *CONFIGURED.get_or_init(|| {
        // Edition 2021: set_var is safe; it is still racy against threads reading the
        // environment, so this belongs at process start.
        std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
        threads
    })
}

/// The thread count candle will use (or uses), as its own environment lookup sees it.
pub fn cpu_threads() -> usize {
    candle_core::utils::get_num_threads()
}
