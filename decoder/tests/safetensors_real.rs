//! Safetensors llama models with `tokenizer.json`, on the real SmolLM2 weights: the GGUF file is
//! exported (dequantized to f32, Hugging Face names and rotary layout) into a model folder, which
//! [`SafetensorsModel`] loads through candle's `llama`. The same network in another number
//! format must agree with the Q4_1 model on what comes next, and resume exactly.

mod common;

use tokenlog_decoder::{generate, ChatMessage, DecodeState, Model, ResumeMode, SamplingConfig, StopConfig, Tokenizer};

fn stop(m: &dyn Model, max_tokens: u32) -> StopConfig {
    StopConfig {
        max_tokens,
        stop_strings: vec![],
        eos_token_ids: m.eos_token_ids(),
    }
}

fn top_k(logits: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    idx.truncate(k);
    idx
}

#[test]
fn tokenizer_json_reproduces_the_gguf_tokenizer() {
    let gguf = common::real_model();
    let st = common::safetensors_model();
    let (a, b) = (gguf.tokenizer(), st.tokenizer());
    assert_eq!(a.canonical_json().unwrap(), b.canonical_json().unwrap());
    assert_eq!(gguf.identity().tokenizer_sha256, st.identity().tokenizer_sha256);
    assert_eq!(a.eos_token_ids(), b.eos_token_ids());
    assert_eq!(a.chat_template(), b.chat_template());
    for text in [
        "Hello, world!",
        "naïve café 東京 🦀\t42 + 7 = 49",
        "<|im_start|>user\nhi<|im_end|>",
    ] {
        let ids = b.encode(text).unwrap();
        assert_eq!(ids, a.encode(text).unwrap(), "{text:?}");
        assert_eq!(b.decode(&ids, false).unwrap(), text);
        let mut d = b.detokenizer(false);
        let streamed: String = ids.iter().map(|&i| d.push(i)).collect();
        assert_eq!(streamed, text);
    }
    // A folder's tokenizer without tokenizer_config.json still loads; EOS ids come from
    // config.json and generation_config.json (a list), the chat format falls back to plain.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        common::safetensors_dir().join("tokenizer.json"),
        tmp.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(tmp.path().join("config.json"), r#"{"eos_token_id": 2}"#).unwrap();
    std::fs::write(tmp.path().join("generation_config.json"), r#"{"eos_token_id": [2, 5]}"#).unwrap();
    let bare = Tokenizer::from_tokenizer_json(&tmp.path().join("tokenizer.json")).unwrap();
    assert_eq!(
        bare.eos_token_ids()[..2],
        [2, 5],
        "config.json, then generation_config.json"
    );
    assert_eq!(*bare.chat_template(), tokenlog_decoder::tokenizer::ChatTemplate::Plain);
}

#[test]
fn identity_names_the_folder_weights_and_differs_from_the_gguf() {
    let gguf = common::real_model();
    let st = common::safetensors_model();
    let id = st.identity();
    assert_eq!(id.architecture, "llama");
    assert_eq!(id.dtype_class, "f32");
    assert_eq!(
        id.weights_sha256,
        tokenlog_decoder::identity::sha256_file(&common::safetensors_dir().join("model.safetensors")).unwrap()
    );
    assert_eq!(st.vocab_size(), gguf.vocab_size());
    assert_eq!(st.max_context(), 8192);
    let why = st.identity().refusal(
        tokenlog_decoder::RNG_VERSION,
        gguf.identity(),
        tokenlog_decoder::RNG_VERSION,
    );
    assert!(
        why.as_deref().is_some_and(|w| w.starts_with("weights sha256")),
        "{why:?}"
    );
}

#[test]
fn agrees_with_the_quantized_model_and_answers_coherently() {
    let gguf = common::real_model();
    let st = common::safetensors_model();
    let prompt = st
        .tokenizer()
        .encode_chat(&[ChatMessage::user(
            "What is the capital of France? Answer in one sentence.",
        )])
        .unwrap();
    let a = gguf.new_sequence().unwrap().prefill(&prompt).unwrap();
    let b = st.new_sequence().unwrap().prefill(&prompt).unwrap();
    let (ta, tb) = (top_k(&a, 5), top_k(&b, 5));
    let max_diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    eprintln!("next-token top 5: q4_1 {ta:?}, f32 {tb:?}; max |logit difference| {max_diff:.2}");
    assert_eq!(ta[0], tb[0], "both formats pick the same next token");
    assert!(tb.iter().filter(|t| ta.contains(t)).count() >= 3);

    let g = generate(&*st, &prompt, &SamplingConfig::greedy(), &stop(&*st, 24)).unwrap();
    let q = generate(&*gguf, &prompt, &SamplingConfig::greedy(), &stop(&*gguf, 24)).unwrap();
    let text = st.tokenizer().decode(&g.tokens, true).unwrap();
    let same = g.tokens.iter().zip(&q.tokens).take_while(|(x, y)| x == y).count();
    eprintln!(
        "f32 greedy: {text:?} ({:.1} tok/s on 1 thread); equal to the q4_1 answer for its first {same} tokens",
        g.decode_tokens_per_s()
    );
    assert!(text.contains("Paris"), "{text:?}");
}

#[test]
fn resumes_exactly_from_a_committed_prefix() {
    let st = common::safetensors_model();
    let prompt = st
        .tokenizer()
        .encode_chat(&[ChatMessage::user("Write a short poem about the sea.")])
        .unwrap();
    let params = SamplingConfig {
        temperature: 0.8,
        top_p: 0.9,
        seed: 11,
        ..Default::default()
    };
    let full = generate(&*st, &prompt, &params, &stop(&*st, 24)).unwrap();
    assert!(full.tokens.len() > 12, "{:?}", full.tokens);
    for k in [1usize, 12] {
        let mut s = DecodeState::resume(
            &*st,
            &prompt,
            &full.tokens[..k],
            params.clone(),
            stop(&*st, 24),
            ResumeMode::Exact,
        )
        .unwrap();
        let f = s.frontiers();
        assert_eq!((f.committed, f.fed, f.kv), (k, k, prompt.len() + k));
        let (rest, finish) = s.run_to_end().unwrap();
        assert_eq!(rest, full.tokens[k..], "exact resume at {k}");
        assert_eq!(finish, full.finish);
    }
}

#[test]
fn a_folder_that_is_not_a_llama_model_is_refused_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let err = tokenlog_decoder::SafetensorsModel::load(tmp.path(), tokenlog_decoder::DeviceSpec::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
    std::fs::write(tmp.path().join("config.json"), r#"{"model_type": "gpt2"}"#).unwrap();
    let err = tokenlog_decoder::SafetensorsModel::load(tmp.path(), tokenlog_decoder::DeviceSpec::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("only llama-family"), "{err}");
    let dir = common::safetensors_dir();
    for f in ["config.json", "tokenizer_config.json"] {
        std::fs::copy(dir.join(f), tmp.path().join(f)).unwrap();
    }
    let err = tokenlog_decoder::SafetensorsModel::load(tmp.path(), tokenlog_decoder::DeviceSpec::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::copy(dir.join("tokenizer.json"), tmp.path().join("tokenizer.json")).unwrap();
    let err = tokenlog_decoder::SafetensorsModel::load(tmp.path(), tokenlog_decoder::DeviceSpec::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no *.safetensors"), "{err}");
}
