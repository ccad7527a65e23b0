//! [`KvSequence`]: one generation's KV cache over any candle model ([`Forward`]), with the feed
//! rules every [`Sequence`] shares; and the candle device of a [`DeviceSpec`].

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::model::{check_feed, DeviceSpec, Logits, Sequence};

impl DeviceSpec {
    pub(crate) fn device(self) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            #[cfg(feature = "cuda")]
            DeviceSpec::Cuda(ordinal) => Ok(Device::new_cuda(ordinal)?),
            #[cfg(not(feature = "cuda"))]
            DeviceSpec::Cuda(_) => Err(Error::Unsupported(
                "this build has no CUDA support (cargo feature `cuda`)".into(),
            )),
        }
    }
}

/// What differs between model kinds inside a [`Sequence`]: one forward pass over `input`
/// (1 × n token ids) at position `pos`, appending to the sequence's own KV cache, returning the
/// last position's logits; and emptying that cache.
pub(crate) trait Forward: Send {
    fn run(&mut self, input: &Tensor, pos: usize) -> candle_core::Result<Tensor>;
    fn clear(&mut self);
    /// See [`Sequence::cache_format`].
    fn cache_format(&self) -> Option<String> {
        None
    }
    fn export_cache(&self) -> Result<Vec<crate::cache::CacheBlock>> {
        Err(Error::Unsupported("this model cannot export its cache".into()))
    }
    /// Replaces the cache; the blocks hold `positions` positions.
    fn import_cache(&mut self, _blocks: &[crate::cache::CacheBlock], _positions: usize) -> Result<()> {
        Err(Error::Unsupported("this model cannot import a cache".into()))
    }
}

/// A [`Sequence`] over any [`Forward`]: the feed rules, the KV length, reset on error.
pub(crate) struct KvSequence<F> {
    model: F,
    device: Device,
    kv_len: usize,
    max_context: usize,
    vocab_size: usize,
}

impl<F: Forward> KvSequence<F> {
    pub(crate) fn new(model: F, device: &Device, max_context: usize, vocab_size: usize) -> Self {
        KvSequence {
            model,
            device: device.clone(),
            kv_len: 0,
            max_context,
            vocab_size,
        }
    }

    fn forward(&mut self, tokens: &[u32]) -> Result<Logits> {
        let input = Tensor::new(tokens, &self.device)?.unsqueeze(0)?;
        let logits = self.model.run(&input, self.kv_len)?;
        let logits = logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if logits.len() != self.vocab_size {
            return Err(Error::Unsupported(format!(
                "model returned {} logits for a vocabulary of {}",
                logits.len(),
                self.vocab_size
            )));
        }
        Ok(logits)
    }
}

impl<F: Forward> Sequence for KvSequence<F> {
    fn prefill(&mut self, tokens: &[u32]) -> Result<Logits> {
        check_feed(tokens, self.kv_len, self.max_context, self.vocab_size)?;
        match self.forward(tokens) {
            Ok(logits) => {
                self.kv_len += tokens.len();
                Ok(logits)
            }
            Err(e) => {
                // Some layers may have appended to their cache: start over rather than guess.
                self.reset();
                Err(e)
            }
        }
    }

    fn kv_len(&self) -> usize {
        self.kv_len
    }

    fn reset(&mut self) {
        self.model.clear();
        self.kv_len = 0;
    }

    fn cache_format(&self) -> Option<String> {
        self.model.cache_format()
    }

    fn export_cache(&self) -> Result<Vec<crate::cache::CacheBlock>> {
        self.model.export_cache()
    }

    fn import_cache(&mut self, blocks: &[crate::cache::CacheBlock], positions: usize) -> Result<()> {
        if positions > self.max_context {
            return Err(Error::ContextFull {
                needed: positions,
                max: self.max_context,
            });
        }
        match self.model.import_cache(blocks, positions) {
            Ok(()) => {
                self.kv_len = positions;
                Ok(())
            }
            Err(e) => {
                self.reset();
                Err(e)
            }
        }
    }
}
