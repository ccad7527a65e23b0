//! A llama-family LLM from a GGUF file. Two engines ([`GgufEngine`]):
//! - on the CPU, tokenlog's own forward pass ([`crate::cpu`]): batched over generations
//!   ([`Model::prefill_batch`]) and invariant to batching, so exact resume prefills a committed
//!   prefix in one call;
//! - on a CUDA device (the `cuda` feature), candle's quantized kernels ([`crate::llama`]: the
//!   forward pass of `candle_transformers::models::quantized_llama` with a cache a handoff can
//!   move), one sequence per call. It also runs on the CPU, for comparison.
//!
//! The weights are loaded once and shared by every sequence (`Arc`), so a sequence costs only its
//! KV cache, and sequences can be interleaved without touching each other's numerics.

use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType};
use std::sync::Arc;

use candle_core::Device;
use candle_transformers::models::quantized_llama::MAX_SEQ_LEN;

use crate::cpu::{CpuSequence, CpuWeights};
use crate::error::{Error, Result};
use crate::gguf_meta::{GgufMetadata, MetaValue};
use crate::identity::{self, ModelIdentity};
use crate::kv::KvSequence;
use crate::llama::{LlamaSequence, LlamaWeights};
use crate::model::{DeviceSpec, Logits, Model, Sequence};
use crate::tokenizer::Tokenizer;

/// Which forward pass runs a [`GgufModel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufEngine {
    /// tokenlog's own batched CPU pass ([`crate::cpu`]); CPU only.
    Cpu,
    /// candle's quantized kernels, one sequence per call; any device.
    Candle,
}

impl GgufEngine {
    /// The engine [`GgufModel::load`] picks for a device.
    pub fn for_device(device: DeviceSpec) -> Self {
        match device {
            DeviceSpec::Cpu => GgufEngine::Cpu,
            DeviceSpec::Cuda(_) => GgufEngine::Candle,
        }
    }
}

/// The weights every sequence shares, of one engine.
enum Weights {
    Cpu(Arc<CpuWeights>),
    Candle(Arc<LlamaWeights>),
}

/// A llama-family model from a GGUF file (SmolLM2, Llama, Mistral, ...).
pub struct GgufModel {
    weights: Weights,
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
        Self::load_with(path, device, GgufEngine::for_device(device))
    }

    /// [`GgufModel::load`] with a chosen engine.
    pub fn load_with(path: &Path, device: DeviceSpec, engine: GgufEngine) -> Result<Self> {
        if engine == GgufEngine::Cpu && device != DeviceSpec::Cpu {
            return Err(Error::Unsupported(format!(
                "the CPU engine cannot run on {}",
                device.name()
            )));
        }
        let dev = device.device()?;
        let LlamaFile {
            mut file,
            content,
            tokenizer,
            identity,
            max_context,
        } = LlamaFile::open(path)?;
        let (weights, identity) = match engine {
            GgufEngine::Cpu => (
                Weights::Cpu(Arc::new(CpuWeights::from_gguf(&content, &mut file, max_context)?)),
                crate::cpu::identity_of(identity),
            ),
            GgufEngine::Candle => (
                Weights::Candle(Arc::new(LlamaWeights::from_gguf(&content, &mut file, &dev)?)),
                identity,
            ),
        };
        Ok(GgufModel {
            weights,
            device: dev,
            device_spec: device,
            tokenizer,
            identity,
            max_context,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn device(&self) -> DeviceSpec {
        self.device_spec
    }

    pub fn engine(&self) -> GgufEngine {
        match self.weights {
            Weights::Cpu(_) => GgufEngine::Cpu,
            Weights::Candle(_) => GgufEngine::Candle,
        }
    }
}

/// A llama-family GGUF file with its header read: the tensors' index, the tokenizer of its
/// metadata, the identity a generation on it is bound to, and its usable context. A whole
/// model, a pipeline stage and a pipeline head read it the same way, so all three get the same
/// identity.
pub(crate) struct LlamaFile {
    pub file: File,
    pub content: gguf_file::Content,
    pub tokenizer: Tokenizer,
    pub identity: ModelIdentity,
    pub max_context: usize,
}

impl LlamaFile {
    pub(crate) fn open(path: &Path) -> Result<Self> {
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
        let tokenizer = Tokenizer::from_gguf(&metadata_of(&content))?;
        // candle's rotary tables stop at MAX_SEQ_LEN; the CPU engine's are sized the same.
        let max_context = context_length.min(MAX_SEQ_LEN);
        let identity = ModelIdentity {
            weights_sha256: identity::weights_sha256(path)?,
            tokenizer_sha256: identity::tokenizer_sha256(&tokenizer)?,
            architecture,
            dtype_class,
        };
        Ok(LlamaFile {
            file,
            content,
            tokenizer,
            identity,
            max_context,
        })
    }
}

/// The metadata candle already read, in the text layer's form (so the tokenizer of a loaded
/// model comes from the same parse as its weights, not a second read of the file).
pub(crate) fn metadata_of(content: &gguf_file::Content) -> GgufMetadata {
    fn value(v: &gguf_file::Value) -> MetaValue {
        use gguf_file::Value as V;
        match v {
            V::U8(x) => MetaValue::U8(*x),
            V::I8(x) => MetaValue::I8(*x),
            V::U16(x) => MetaValue::U16(*x),
            V::I16(x) => MetaValue::I16(*x),
            V::U32(x) => MetaValue::U32(*x),
            V::I32(x) => MetaValue::I32(*x),
            V::U64(x) => MetaValue::U64(*x),
            V::I64(x) => MetaValue::I64(*x),
            V::F32(x) => MetaValue::F32(*x),
            V::F64(x) => MetaValue::F64(*x),
            V::Bool(x) => MetaValue::Bool(*x),
            V::String(x) => MetaValue::String(x.clone()),
            V::Array(x) => MetaValue::Array(x.iter().map(value).collect()),
        }
    }
    GgufMetadata {
        version: match content.magic {
            gguf_file::VersionedMagic::GgufV1 => 1,
            gguf_file::VersionedMagic::GgufV2 => 2,
            gguf_file::VersionedMagic::GgufV3 => 3,
        },
        values: content.metadata.iter().map(|(k, v)| (k.clone(), value(v))).collect(),
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

    fn cache_bytes(&self, positions: usize) -> Option<u64> {
        let per_position = match &self.weights {
            Weights::Cpu(w) => w.cache_position_bytes(),
            Weights::Candle(w) => w.cache_position_bytes(),
        };
        Some(per_position as u64 * positions as u64)
    }

    fn new_sequence(&self) -> Result<Box<dyn Sequence>> {
        Ok(match &self.weights {
            Weights::Cpu(w) => Box::new(CpuSequence::new(w.clone(), self.max_context)),
            Weights::Candle(w) => Box::new(KvSequence::new(
                LlamaSequence::new(w.clone()),
                &self.device,
                self.max_context,
                self.vocab_size(),
            )),
        })
    }

    fn prefill_batch(&self, items: &mut [(&mut dyn Sequence, &[u32])]) -> Vec<Result<Logits>> {
        if let Weights::Cpu(w) = &self.weights {
            if let Some(out) = crate::cpu::prefill_batch(w, items) {
                return out;
            }
        }
        items.iter_mut().map(|(s, t)| s.prefill(t)).collect()
    }
}
