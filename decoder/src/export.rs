//! Writes a llama-family GGUF model as a Hugging Face model folder: `config.json`,
//! `model.safetensors` (the weights dequantized to f32, under Hugging Face tensor names),
//! `tokenizer.json` and `tokenizer_config.json`. `tokenlog export-safetensors` and the
//! safetensors tests use it: these machines reach no model hub, and it gives the
//! [`crate::SafetensorsModel`] path the real SmolLM2 weights to run.
//!
//! llama.cpp stores the query and key projections with their rows permuted for its interleaved
//! rotary embedding; Hugging Face's layout (and candle's `llama`) rotates halves. The export
//! undoes the permutation, so both files compute the same model.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// GGUF tensor name suffixes (after `blk.N.`) and their Hugging Face names (after
/// `model.layers.N.`).
const LAYER_TENSORS: [(&str, &str); 9] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// Rows of a projection from llama.cpp's rotary order back to Hugging Face's: per head, the
/// rows `0, 2, 4, ...` then `1, 3, 5, ...`.
fn unpermute(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let head_dim = rows / heads;
    Ok(w.reshape((heads, head_dim / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// Exports `gguf` into the folder `out` (created; existing files are replaced). Progress goes to
/// stderr. Returns the number of tensors written.
pub fn export_gguf_as_safetensors(gguf: &Path, out: &Path) -> Result<usize> {
    let mut file = File::open(gguf).map_err(|e| Error::io(gguf, e))?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| e.with_path(gguf))?;
    let md = &content.metadata;
    let arch = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    if arch != "llama" {
        return Err(Error::Unsupported(format!(
            "architecture {arch:?}; only llama GGUF files export"
        )));
    }
    let num = |k: &str| -> Result<u64> {
        let v = md
            .get(&format!("llama.{k}"))
            .ok_or_else(|| Error::Unsupported(format!("GGUF metadata has no llama.{k}")))?;
        Ok(v.to_u64().or_else(|_| v.to_u32().map(u64::from))?)
    };
    let float = |k: &str, default: f32| {
        md.get(&format!("llama.{k}"))
            .and_then(|v| v.to_f32().ok())
            .unwrap_or(default)
    };
    // Rotary scaling (Llama 3.1+) has no place in the exported config: refuse rather than
    // write a folder that computes another model.
    if content.tensor_infos.contains_key("rope_freqs.weight") || md.contains_key("llama.rope.scaling.type") {
        return Err(Error::Unsupported(
            "rotary scaling (rope_freqs / rope.scaling) does not export".into(),
        ));
    }
    let heads = num("attention.head_count")? as usize;
    let kv_heads = num("attention.head_count_kv").map_or(heads, |n| n as usize);
    let layers = num("block_count")? as usize;
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(Error::Unsupported(format!(
            "{heads} attention heads, {kv_heads} key/value heads"
        )));
    }
    let tokenizer = Tokenizer::from_gguf(&crate::gguf_model::metadata_of(&content))?;

    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut get = |name: &str| -> Result<Tensor> {
        Ok(content
            .tensor(&mut file, name, &Device::Cpu)?
            .dequantize(&Device::Cpu)?)
    };
    tensors.insert("model.embed_tokens.weight".into(), get("token_embd.weight")?);
    tensors.insert("model.norm.weight".into(), get("output_norm.weight")?);
    let tied = !content.tensor_infos.contains_key("output.weight");
    if !tied {
        tensors.insert("lm_head.weight".into(), get("output.weight")?);
    }
    for i in 0..layers {
        eprint!("\rexport: layer {}/{layers}", i + 1);
        for (ours, theirs) in LAYER_TENSORS {
            let mut t = get(&format!("blk.{i}.{ours}"))?;
            if ours == "attn_q.weight" {
                t = unpermute(&t, heads)?;
            } else if ours == "attn_k.weight" {
                t = unpermute(&t, kv_heads)?;
            }
            tensors.insert(format!("model.layers.{i}.{theirs}"), t);
        }
    }
    eprintln!();
    let vocab = tensors["model.embed_tokens.weight"].dims2()?.0;
    let shape = Shape {
        hidden: num("embedding_length")?,
        intermediate: num("feed_forward_length")?,
        layers,
        heads,
        kv_heads,
        rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta: float("rope.freq_base", 10_000.0),
        context: num("context_length")?,
        vocab,
        tied,
    };
    let chat_template = md.get("tokenizer.chat_template").and_then(|v| v.to_string().ok());
    write_text_files(out, &shape, &tokenizer, chat_template.map(String::as_str))?;
    let n = tensors.len();
    candle_core::safetensors::save(&tensors, out.join("model.safetensors"))?;
    Ok(n)
}

/// The numbers `config.json` names.
struct Shape {
    hidden: u64,
    intermediate: u64,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    rms_norm_eps: f32,
    rope_theta: f32,
    context: u64,
    vocab: usize,
    tied: bool,
}

/// Writes `config.json`, `tokenizer_config.json` and `tokenizer.json` into `out`.
fn write_text_files(out: &Path, shape: &Shape, tokenizer: &Tokenizer, chat_template: Option<&str>) -> Result<()> {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.context,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied,
        "bos_token_id": tokenizer.bos_token_id(),
        "eos_token_id": tokenizer.eos_token_ids().first(),
        "torch_dtype": "float32",
    });
    let token_text = |id: Option<u32>| id.and_then(|i| tokenizer.inner().id_to_token(i));
    let tokenizer_config = serde_json::json!({
        "bos_token": token_text(tokenizer.bos_token_id()),
        "eos_token": token_text(tokenizer.eos_token_ids().first().copied()),
        "chat_template": chat_template,
    });
    let write = |name: &str, text: String| -> Result<()> {
        let p = out.join(name);
        std::fs::write(&p, text).map_err(|e| Error::io(p, e))
    };
    write("config.json", serde_json::to_string_pretty(&config).expect("json"))?;
    write(
        "tokenizer_config.json",
        serde_json::to_string_pretty(&tokenizer_config).expect("json"),
    )?;
    write(
        "tokenizer.json",
        tokenizer.inner().to_string(true).map_err(Error::tokenizer)?,
    )
}

/// The folder `export_gguf_as_safetensors(gguf, ...)` wrote under `parent`, made on first use
/// and reused after (named by the GGUF's digest, so a changed file gets a new folder). Safe to
/// race: each caller exports into its own temporary folder and renames it into place.
pub fn ensure_exported(gguf: &Path, parent: &Path) -> Result<std::path::PathBuf> {
    let digest = crate::identity::weights_sha256(gguf)?;
    let dir = parent.join(format!("safetensors-{}", &digest[..16]));
    if !dir.join("model.safetensors").is_file() {
        let tmp = parent.join(format!(".export-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        export_gguf_as_safetensors(gguf, &tmp)?;
        // Another process may have won the race: keep its folder.
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    Ok(dir)
}
