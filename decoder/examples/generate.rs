//! Generates from a chat prompt with the default model, printing the prompt's tokens, the
//! answer and timings: `cargo run --release -p tokenlog-decoder --example generate -- "Hi"`.
//! Environment: TOKENLOG_MODEL (model file), THREADS (candle CPU threads, default 1),
//! MAX_TOKENS (default 48), TEMPERATURE (default 0 = greedy), SEED.

use tokenlog_decoder::fetch::{locate_model, repo_models_dir};
use tokenlog_decoder::threads::init_cpu_threads;
use tokenlog_decoder::{generate, ChatMessage, DeviceSpec, GgufModel, Model, SamplingConfig, StopConfig};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    init_cpu_threads(env_or("THREADS", 1));
    let question = std::env::args()
        .nth(1)
        .unwrap_or("What is the capital of France?".into());
    let model = GgufModel::load(&locate_model(&repo_models_dir())?, DeviceSpec::Cpu)?;
    let tok = model.tokenizer();
    let prompt = tok.encode_chat(&[ChatMessage::user(question)])?;
    let pieces: Vec<String> = prompt
        .iter()
        .map(|&id| format!("{id}:{:?}", tok.decode(&[id], false).unwrap_or_default()))
        .collect();
    eprintln!("prompt ({} tokens): {}", prompt.len(), pieces.join(" "));
    let params = SamplingConfig {
        temperature: env_or("TEMPERATURE", 0.0),
        top_p: 0.9,
        seed: env_or("SEED", 0),
        ..Default::default()
    };
    let stop = StopConfig {
        max_tokens: env_or("MAX_TOKENS", 48),
        stop_strings: vec![],
        eos_token_ids: model.eos_token_ids(),
    };
    let g = generate(&model, &prompt, &params, &stop)?;
    println!("{}", tok.decode(&g.tokens, true)?);
    eprintln!(
        "{} tokens, {:?}; prefill {:?} ({:.0} tok/s), decode {:.1} tok/s, threads {}",
        g.tokens.len(),
        g.finish,
        g.prefill,
        prompt.len() as f64 / g.prefill.as_secs_f64(),
        g.decode_tokens_per_s(),
        tokenlog_decoder::threads::cpu_threads()
    );
    Ok(())
}
