//! A llama-family LLM from a GGUF file, run by candle (`candle_transformers::models::quantized_llama`),
//! on CPU or, with the `cuda` feature, on a CUDA device.
//!
//! The weights are shared between sequences (candle's `QMatMul` holds `Arc<QTensor>`, tensors are
//! reference-counted), so a sequence costs only its KV cache, and sequences can be interleaved
//! without touching each other's numerics.

use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::{ModelWeights, MAX_SEQ_LEN};

use crate::error::{Error, Result};
use crate::identity::{self, ModelIdentity};
use crate::kv::{Forward, KvSequence};
use crate::model::{DeviceSpec, Model, Sequence};
use crate::tokenizer::Tokenizer;

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
        let tokenizer = Tokenizer::from_gguf_file(path)?;
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

/// A GGUF model's weights clone (shared) with its own KV cache.
impl Forward for ModelWeights {
    fn run(&mut self, input: &Tensor, pos: usize) -> candle_core::Result<Tensor> {
        self.forward(input, pos)
    }
    fn clear(&mut self) {
        self.clear_kv_cache();
    }
}
