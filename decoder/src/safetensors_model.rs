//! A llama-family model in Hugging Face layout: a folder with `config.json`, the weights as
//! `*.safetensors` (one file, or shards listed by `model.safetensors.index.json`), and
//! `tokenizer.json` (plus `tokenizer_config.json` for EOS and chat template). Run by candle's
//! `llama` model, in f32 on CPU and in the file's own float type on CUDA.
//!
//! Identity: the weights digest is the sha256 of the weight file, or for shards the sha256 of
//! the lines `<file name> <sha256>` in file-name order; the dtype class is the float type the
//! weights are stored in (`f32`, `f16`, `bf16`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Llama, LlamaConfig};

use crate::error::{Error, Result};
use crate::identity::{self, ModelIdentity};
use crate::kv::{Forward, KvSequence};
use crate::model::{DeviceSpec, Model, Sequence};
use crate::tokenizer::Tokenizer;

/// The `model_type` values of `config.json` this loader runs (they share llama's layout).
const LLAMA_MODEL_TYPES: [&str; 1] = ["llama"];

pub struct SafetensorsModel {
    weights: Arc<Llama>,
    /// An empty cache with the rotary tables, cloned (tensors shared) for each sequence.
    template: Cache,
    device: Device,
    tokenizer: Tokenizer,
    identity: ModelIdentity,
    vocab_size: usize,
    max_context: usize,
}

/// The weight files of a model folder, in name order.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    let mut files: Vec<PathBuf> = if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::Unsupported(format!("{}: {e}", index.display())))?;
        let map = v["weight_map"]
            .as_object()
            .ok_or_else(|| Error::Unsupported(format!("{}: no weight_map", index.display())))?;
        let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
        rd.filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect()
    };
    files.sort();
    if files.is_empty() {
        return Err(Error::Unsupported(format!("{}: no *.safetensors file", dir.display())));
    }
    Ok(files)
}

fn dtype_name(d: DType) -> String {
    format!("{d:?}").to_lowercase()
}

/// The float type most of the weights are stored in (read from the files' headers).
fn stored_dtype(files: &[PathBuf]) -> Result<DType> {
    let mut counts: Vec<(DType, usize)> = Vec::new();
    for f in files {
        // SAFETY: the file is mapped read-only and not modified while mapped (as in candle's
        // own loaders); a concurrent writer would be a broken model folder.
        // SAFETY: the file is mapped read-only and not modified while the model lives (candle's API).
        #[allow(unsafe_code)]
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(f)? };
        for (_, view) in st.tensors() {
            let d = DType::try_from(view.dtype())?;
            let n = view.shape().iter().product::<usize>();
            match counts.iter_mut().find(|(x, _)| *x == d) {
                Some((_, c)) => *c += n,
                None => counts.push((d, n)),
            }
        }
    }
    Ok(counts
        .into_iter()
        .max_by_key(|&(_, n)| n)
        .map_or(DType::F32, |(d, _)| d))
}

fn weights_digest(files: &[PathBuf]) -> Result<String> {
    if let [one] = files {
        return identity::weights_sha256(one);
    }
    let mut lines = String::new();
    for f in files {
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        lines.push_str(&format!("{name} {}\n", identity::weights_sha256(f)?));
    }
    Ok(identity::sha256_hex(lines.as_bytes()))
}

impl SafetensorsModel {
    /// Loads the model folder `dir` onto `device`.
    pub fn load(dir: &Path, device: DeviceSpec) -> Result<Self> {
        let dev = device.device()?;
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
        let raw: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::Unsupported(format!("{}: {e}", cfg_path.display())))?;
        let model_type = raw["model_type"].as_str().unwrap_or_default();
        if !LLAMA_MODEL_TYPES.contains(&model_type) {
            return Err(Error::Unsupported(format!(
                "{}: model_type {model_type:?}; only llama-family models are supported",
                cfg_path.display()
            )));
        }
        let llama_cfg: LlamaConfig =
            serde_json::from_value(raw).map_err(|e| Error::Unsupported(format!("{}: {e}", cfg_path.display())))?;
        let vocab_size = llama_cfg.vocab_size;
        let max_context = llama_cfg.max_position_embeddings;
        let config = llama_cfg.into_config(false);
        let tokenizer = Tokenizer::from_tokenizer_json(&dir.join("tokenizer.json"))?;
        if tokenizer.vocab_size() > vocab_size {
            return Err(Error::Unsupported(format!(
                "tokenizer has {} tokens, the model only {vocab_size}",
                tokenizer.vocab_size()
            )));
        }
        let files = weight_files(dir)?;
        let stored = stored_dtype(&files)?;
        // CPU kernels are fastest (and complete) in f32; GPUs run the stored half type.
        let dtype = if dev.is_cpu() { DType::F32 } else { stored };
        // SAFETY: as in `stored_dtype`.
        // SAFETY: as above; the weight files are not modified while mapped.
        #[allow(unsafe_code)]
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, &dev)? };
        // candle's `Llama::load` unwraps each layer's tensors: a folder whose weights do not
        // match its config.json would panic; report it instead.
        let weights = crate::panics::catch_expected(|| Llama::load(vb, &config)).map_err(|p| {
            let why = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Error::Unsupported(format!(
                "{}: the weights do not match config.json: {why}",
                dir.display()
            ))
        })??;
        let template = Cache::new(true, dtype, &config, &dev)?;
        let identity = ModelIdentity {
            weights_sha256: weights_digest(&files)?,
            tokenizer_sha256: identity::tokenizer_sha256(&tokenizer)?,
            architecture: "llama".into(),
            dtype_class: dtype_name(stored),
        };
        Ok(SafetensorsModel {
            weights: Arc::new(weights),
            template,
            device: dev,
            tokenizer,
            identity,
            vocab_size,
            max_context,
        })
    }
}

impl Model for SafetensorsModel {
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
        self.vocab_size
    }

    fn new_sequence(&self) -> Result<Box<dyn Sequence>> {
        let state = LlamaState {
            weights: self.weights.clone(),
            fresh: self.template.clone(),
            cache: self.template.clone(),
        };
        Ok(Box::new(KvSequence::new(
            state,
            &self.device,
            self.max_context,
            self.vocab_size,
        )))
    }
}

/// The shared weights with one sequence's cache (KV and rotary tables).
struct LlamaState {
    weights: Arc<Llama>,
    cache: Cache,
    /// An empty cache to reset to.
    fresh: Cache,
}

impl Forward for LlamaState {
    fn run(&mut self, input: &Tensor, pos: usize) -> candle_core::Result<Tensor> {
        self.weights.forward(input, pos, &mut self.cache)
    }
    fn clear(&mut self) {
        self.cache = self.fresh.clone();
    }
}
