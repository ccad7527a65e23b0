//! The model interface the worker drives, and the real implementation: a llama-family GGUF model
//! run by candle (`candle_transformers::models::quantized_llama`), on CPU or, with the `cuda`
//! feature, on a CUDA device.
//!
//! A [`Model`] is loaded once per process and shared (`Arc<dyn Model>`); each generation gets its
//! own [`Sequence`] with its own KV cache. The weights are shared between sequences (candle's
//! `QMatMul` holds `Arc<QTensor>`, tensors are reference-counted), so a sequence costs only its
//! KV cache, and sequences can be interleaved without touching each other's numerics.

use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{DType, Device, Tensor};
use candle_transformers::models::quantized_llama::{ModelWeights, MAX_SEQ_LEN};

use crate::error::{Error, Result};
use crate::identity::{self, ModelIdentity};
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
    /// A new, empty sequence (its own KV cache).
    fn new_sequence(&self) -> Result<Box<dyn Sequence>>;
}

/// One generation's model state: the KV cache of the positions fed so far.
///
/// Numerics: a call's logits depend on how the positions were batched (the quantized matmul
/// quantizes activations per call), so replaying the same calls reproduces the same logits bit
/// for bit on the same device and build, and a different batching may not (see
/// [`crate::ResumeMode`]).
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

    /// Short name, e.g. for logs and metrics: `cpu`, `cuda:0`.
    pub fn name(self) -> String {
        match self {
            DeviceSpec::Cpu => "cpu".into(),
            DeviceSpec::Cuda(i) => format!("cuda:{i}"),
        }
    }
}

/// Loads a model by its path: a folder is a Hugging Face model folder
/// ([`crate::SafetensorsModel`]), a file is GGUF ([`GgufModel`]).
pub fn load_model(path: &Path, device: DeviceSpec) -> Result<std::sync::Arc<dyn Model>> {
    Ok(if path.is_dir() {
        std::sync::Arc::new(crate::SafetensorsModel::load(path, device)?)
    } else {
        std::sync::Arc::new(GgufModel::load(path, device)?)
    })
}

/// A llama-family model from a GGUF file (SmolLM2, Llama, Mistral, ...).
pub struct GgufModel {
    /// Weights with an empty KV cache; each sequence clones it (shares the weights).
    template: ModelWeights,
    device: Device,
    device_spec: DeviceSpec,
    tokenizer: Tokenizer,
    identity: ModelIdentity,
    max_context: usize,
    path: PathBuf,
}

impl GgufModel {
    /// Loads the model file: tokenizer from its metadata, weights onto `device`, identity
    /// (the weights digest is cached beside the file, see [`identity::weights_sha256`]).
    pub fn load(path: &Path, device: DeviceSpec) -> Result<Self> {
        let dev = device.device()?;
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        let content = gguf_file::Content::read(&mut file).map_err(|e| e.with_path(path))?;
        let architecture = content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if architecture != "llama" {
            return Err(Error::Unsupported(format!(
                "architecture {architecture:?}; only llama-family GGUF files are supported"
            )));
        }
        let context_length = content
            .metadata
            .get("llama.context_length")
            .and_then(|v| v.to_u32().ok())
            .map_or(MAX_SEQ_LEN, |n| n as usize);
        let dtype_class = dtype_class(&content);
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let template = ModelWeights::from_gguf(content, &mut file, &dev)?;
        let identity = ModelIdentity {
            weights_sha256: identity::weights_sha256(path)?,
            tokenizer_sha256: identity::tokenizer_sha256(&tokenizer)?,
            architecture,
            dtype_class,
        };
        Ok(GgufModel {
            template,
            device: dev,
            device_spec: device,
            tokenizer,
            identity,
            // candle's rotary tables stop at MAX_SEQ_LEN.
            max_context: context_length.min(MAX_SEQ_LEN),
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn device(&self) -> DeviceSpec {
        self.device_spec
    }
}

/// The number format holding most of the weights' elements, lowercase (`q4_1`, `q8_0`, `f16`).
fn dtype_class(content: &gguf_file::Content) -> String {
    let mut by_dtype: Vec<(GgmlDType, usize)> = Vec::new();
    for info in content.tensor_infos.values() {
        let n = info.shape.elem_count();
        match by_dtype.iter_mut().find(|(d, _)| *d == info.ggml_dtype) {
            Some((_, total)) => *total += n,
            None => by_dtype.push((info.ggml_dtype, n)),
        }
    }
    by_dtype
        .into_iter()
        .max_by_key(|&(_, n)| n)
        .map(|(d, _)| format!("{d:?}").to_lowercase())
        .unwrap_or_default()
}

impl Model for GgufModel {
    fn identity(&self) -> &ModelIdentity {
        &self.identity
    }

    fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }

    fn new_sequence(&self) -> Result<Box<dyn Sequence>> {
        Ok(Box::new(KvSequence::new(
            self.template.clone(),
            &self.device,
            self.max_context,
            self.vocab_size(),
        )))
    }
}

/// What differs between model kinds inside a [`Sequence`]: one forward pass over `input`
/// (1 × n token ids) at position `pos`, appending to the sequence's own KV cache, returning the
/// last position's logits; and emptying that cache.
pub(crate) trait Forward: Send {
    fn run(&mut self, input: &Tensor, pos: usize) -> candle_core::Result<Tensor>;
    fn clear(&mut self);
}

/// A GGUF model's weights clone (shared) with its own KV cache.
impl Forward for ModelWeights {
    fn run(&mut self, input: &Tensor, pos: usize) -> candle_core::Result<Tensor> {
        self.forward(input, pos)
    }
    fn clear(&mut self) {
        self.clear_kv_cache();
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
