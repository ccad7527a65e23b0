//! The model interface the worker drives: a [`Model`] is loaded once per process and shared
//! (`Arc<dyn Model>`); each generation gets its own [`Sequence`] with its own KV cache. The real
//! implementations ([`crate::GgufModel`], [`crate::SafetensorsModel`]) need the `model` cargo
//! feature (candle); [`crate::FakeModel`] does not.

use crate::error::{Error, Result};
use crate::identity::ModelIdentity;
use crate::tokenizer::Tokenizer;

/// Logits of the last fed position, one per vocabulary entry.
pub type Logits = Vec<f32>;

/// A loaded model. Shared by all generations of a decoder process.
pub trait Model: Send + Sync {
    /// What generations run on this model are bound to.
    fn identity(&self) -> &ModelIdentity;
    fn tokenizer(&self) -> &Tokenizer;
    /// Token ids that end a generation by default ([`Tokenizer::eos_token_ids`]).
    fn eos_token_ids(&self) -> Vec<u32> {
        self.tokenizer().eos_token_ids().to_vec()
    }
    /// Most positions (prompt + generated) a sequence can hold.
    fn max_context(&self) -> usize;
    /// Length of every [`Logits`] this model returns.
    fn vocab_size(&self) -> usize;
    /// The bytes of an exported cache ([`Sequence::export_cache`]) of `positions` positions
    /// (`None`: its sequences export none, or it does not say). What a handoff's destination
    /// takes in for one transfer is bounded by it.
    fn cache_bytes(&self, _positions: usize) -> Option<u64> {
        None
    }
    /// A new, empty sequence (its own KV cache).
    fn new_sequence(&self) -> Result<Box<dyn Sequence>>;
    /// Feeds each item's tokens to its sequence (sequences of this model), in one forward pass
    /// where the model can batch them, and returns each item's logits of its last position, or
    /// why it failed (that sequence is then reset; the others are not affected). Default: one
    /// [`Sequence::prefill`] after another.
    fn prefill_batch(&self, items: &mut [(&mut dyn Sequence, &[u32])]) -> Vec<Result<Logits>> {
        items.iter_mut().map(|(s, t)| s.prefill(t)).collect()
    }
}

/// One generation's model state: the KV cache of the positions fed so far.
///
/// Numerics: on some models a call's logits depend on how the positions were batched (candle's
/// kernels), so replaying the same calls reproduces the same logits bit for bit on the same
/// device and build, and a different batching may not (see [`crate::ResumeMode`]); a sequence
/// that says [`Sequence::grouping_invariant`] does not depend on it.
pub trait Sequence: Send {
    /// Feeds `tokens` (at least one) in one forward pass, at positions `kv_len()..kv_len() + n`,
    /// and returns the logits of the last one. On error the sequence is reset to empty.
    fn prefill(&mut self, tokens: &[u32]) -> Result<Logits>;
    /// Feeds one token; the same as `prefill(&[token])`.
    fn step(&mut self, token: u32) -> Result<Logits> {
        self.prefill(&[token])
    }
    /// Positions whose keys and values are materialized.
    fn kv_len(&self) -> usize;
    /// Drops the KV cache.
    fn reset(&mut self);
    /// The name of this sequence's cache layout and device class when it can export and import
    /// its cache (a planned handoff moves it); `None`: a handoff of it falls back to re-prefill.
    fn cache_format(&self) -> Option<String> {
        None
    }
    /// Its cache, every layer's blocks (without logits: the caller has them).
    fn export_cache(&self) -> Result<Vec<crate::cache::CacheBlock>> {
        Err(Error::Unsupported("this model cannot export its cache".into()))
    }
    /// The first `positions` positions of its cache (at most `kv_len()`), for a copy of a
    /// committed prefix taken while the sequence runs on. By default only the whole cache.
    fn export_cache_prefix(&self, positions: usize) -> Result<Vec<crate::cache::CacheBlock>> {
        if positions == self.kv_len() {
            self.export_cache()
        } else {
            Err(Error::Unsupported(format!(
                "this model exports its whole cache ({} positions), not the first {positions}",
                self.kv_len()
            )))
        }
    }
    /// [`Sequence::export_cache_prefix`] taken now and built later: what the blocks need is
    /// held (a sequence that can share its cache's memory instead of copying it does so) and
    /// the returned function builds them, on any thread. By default built now.
    fn snapshot_cache_prefix(&self, positions: usize) -> Result<crate::cache::BlocksLater> {
        let blocks = self.export_cache_prefix(positions)?;
        Ok(Box::new(move || Ok(blocks)))
    }
    /// The most [`Sequence::snapshot_cache_prefix`] of its first `positions` positions copies on
    /// the thread that takes it, in bytes: while it is taken, or at the sequence's next write
    /// (a copy-on-write of shared memory); the rest is shared or built later. By default the
    /// whole export.
    fn snapshot_copy_bytes(&self, positions: usize) -> Option<usize> {
        self.prefix_export_bytes(positions)
    }
    /// The bytes of [`Sequence::export_cache_prefix`] of its first `positions` positions, when
    /// it can give them (`None`: it cannot, or does not say).
    fn prefix_export_bytes(&self, _positions: usize) -> Option<usize> {
        None
    }
    /// Replaces its cache with `blocks` of `positions` positions (checked against the layout).
    fn import_cache(&mut self, _blocks: &[crate::cache::CacheBlock], _positions: usize) -> Result<()> {
        Err(Error::Unsupported("this model cannot import a cache".into()))
    }
    /// The keys and values of position `p` (below `kv_len()`) as one row of its cache format,
    /// with the token fed there: what a planned handoff's source streams of the positions it
    /// feeds after its copy ([`Sequence::append_rows`]). `None`: it cannot give rows (the
    /// default), or does not know that position's token (an imported one).
    fn export_row(&self, _p: usize) -> Option<(u32, Vec<u8>)> {
        None
    }
    /// Appends positions `kv_len()..` from rows a sequence of the same cache format exported
    /// ([`Sequence::export_row`]), each with its token, without a forward pass: on a
    /// [`Sequence::grouping_invariant`] sequence what feeding those tokens would hold, bit for
    /// bit. Everything is checked before anything changes: on error the sequence is as it was.
    fn append_rows(&mut self, _rows: &[(u32, &[u8])]) -> Result<()> {
        Err(Error::Unsupported("this model cannot append exported rows".into()))
    }
    /// Whether its logits are the same bits however its positions were grouped into calls (one
    /// prefill of `k` tokens = `k` single steps) and whatever other sequences shared a
    /// [`Model::prefill_batch`] with it. Exact resume then rebuilds a committed prefix in one
    /// call instead of one step per token.
    fn grouping_invariant(&self) -> bool {
        false
    }
    /// Itself, for a model that batches its own sequence type ([`Model::prefill_batch`]).
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

/// Where to run a model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// CUDA device by ordinal; needs the `cuda` cargo feature.
    Cuda(usize),
}

impl DeviceSpec {
    /// Short name, e.g. for logs and metrics: `cpu`, `cuda:0`.
    pub fn name(self) -> String {
        match self {
            DeviceSpec::Cpu => "cpu".into(),
            DeviceSpec::Cuda(i) => format!("cuda:{i}"),
        }
    }
}

#[cfg(feature = "model")]
/// Loads a model by its path: a folder is a Hugging Face model folder
/// ([`crate::SafetensorsModel`]), a file is GGUF ([`GgufModel`]).
pub fn load_model(path: &std::path::Path, device: DeviceSpec) -> Result<std::sync::Arc<dyn Model>> {
    Ok(if path.is_dir() {
        std::sync::Arc::new(crate::SafetensorsModel::load(path, device)?)
    } else {
        std::sync::Arc::new(crate::GgufModel::load(path, device)?)
    })
}

/// The rules every [`Sequence::prefill`] checks before touching the model.
pub(crate) fn check_feed(tokens: &[u32], kv_len: usize, max_context: usize, vocab_size: usize) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::Invalid("prefill needs at least one token".into()));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(Error::Invalid(format!(
            "token id {bad} outside the vocabulary of {vocab_size}"
        )));
    }
    let needed = kv_len + tokens.len();
    if needed > max_context {
        return Err(Error::ContextFull {
            needed,
            max: max_context,
        });
    }
    Ok(())
}
