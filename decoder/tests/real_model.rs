//! The real model (SmolLM2-135M-Instruct Q4_1) on CPU: coherence, seeded determinism, exact
//! resume bit-for-bit, fast-resume divergence (measured, not asserted), sequence isolation.
//! Run in release: `cargo test -p tokenlog-decoder --release`.

mod common;

use std::time::Instant;

use tokenlog_decoder::fetch::{DEFAULT_MODEL_FILE, DEFAULT_MODEL_SHA256};
use tokenlog_decoder::{
    generate, ChatMessage, DecodeState, DeviceSpec, GgufEngine, GgufModel, Logits, Model, ResumeMode, SamplingConfig,
    Sequence, StopConfig, CPU_ENGINE_NUMERICS,
};

fn chat(m: &dyn Model, text: &str) -> Vec<u32> {
    m.tokenizer().encode_chat(&[ChatMessage::user(text)]).unwrap()
}

fn stop(m: &dyn Model, max_tokens: u32) -> StopConfig {
    StopConfig {
        max_tokens,
        stop_strings: vec![],
        eos_token_ids: m.eos_token_ids(),
    }
}

fn sampled(seed: u64) -> SamplingConfig {
    SamplingConfig {
        temperature: 0.8,
        top_p: 0.9,
        seed,
        ..Default::default()
    }
}

#[test]
fn identity_of_the_default_model() {
    let m = common::real_model();
    let id = m.identity();
    assert_eq!(id.architecture, "llama");
    // The CPU engine binds its generations to its numerics as well (candle's do not carry it).
    assert_eq!(m.engine(), GgufEngine::Cpu);
    assert_eq!(id.dtype_class, format!("q4_1+{CPU_ENGINE_NUMERICS}"));
    if m.path().file_name().unwrap() == DEFAULT_MODEL_FILE {
        assert_eq!(id.weights_sha256, DEFAULT_MODEL_SHA256);
    }
    assert_eq!(m.vocab_size(), 49152);
    eprintln!("identity {id:?}, max_context {}", m.max_context());
}

#[test]
fn answers_an_instruct_prompt_coherently() {
    let m = common::real_model();
    // The bare question makes this Q4_1 135M model wander off ("L'Étoile, la Marseillaise,
    // ..."); asking for one sentence gets the straight answer.
    let p = chat(&*m, "What is the capital of France? Answer in one sentence.");
    let g = generate(&*m, &p, &SamplingConfig::greedy(), &stop(&*m, 24)).unwrap();
    let text = m.tokenizer().decode(&g.tokens, true).unwrap();
    eprintln!(
        "greedy: {text:?} ({:?}); prompt {} tokens prefilled in {:?} ({:.0} tok/s); \
         decode {:.1} tok/s on 1 thread",
        g.finish,
        p.len(),
        g.prefill,
        p.len() as f64 / g.prefill.as_secs_f64(),
        g.decode_tokens_per_s()
    );
    assert!(text.contains("Paris"), "{text:?}");
}

#[test]
fn same_seed_same_tokens() {
    let m = common::real_model();
    let p = chat(&*m, "Tell me something about cats.");
    let a = generate(&*m, &p, &sampled(42), &stop(&*m, 16)).unwrap();
    let b = generate(&*m, &p, &sampled(42), &stop(&*m, 16)).unwrap();
    assert_eq!(a.tokens, b.tokens);
    let c = generate(&*m, &p, &sampled(43), &stop(&*m, 16)).unwrap();
    eprintln!(
        "seed 42: {:?}\nseed 43: {:?}",
        m.tokenizer().decode(&a.tokens, true).unwrap(),
        m.tokenizer().decode(&c.tokens, true).unwrap()
    );
}

#[test]
fn resume_exact_is_bit_identical_and_fast_is_measured() {
    let m = common::real_model();
    let p = chat(&*m, "Write a short poem about the sea.");
    let params = sampled(7);
    let max = 28;
    let full = generate(&*m, &p, &params, &stop(&*m, max)).unwrap();
    eprintln!(
        "uninterrupted ({} tokens, {:?}): {:?}",
        full.tokens.len(),
        full.finish,
        m.tokenizer().decode(&full.tokens, true).unwrap()
    );
    assert!(
        full.tokens.len() > 20,
        "the answer should be long enough to resume at 20"
    );
    let mut replay_ms_per_token = Vec::new();
    for k in [1usize, 7, 20] {
        let t0 = Instant::now();
        let mut s = DecodeState::resume(
            &*m,
            &p,
            &full.tokens[..k],
            params.clone(),
            stop(&*m, max),
            ResumeMode::Exact,
        )
        .unwrap();
        let stats = s.stats();
        let resume_time = t0.elapsed();
        let (rest, finish) = s.run_to_end().unwrap();
        assert_eq!(rest, full.tokens[k..], "exact resume at {k}");
        assert_eq!(finish, full.finish);
        let per_token = stats.replay.as_secs_f64() * 1e3 / k as f64;
        replay_ms_per_token.push(per_token);
        eprintln!(
            "exact resume at {k}: identical; resume {resume_time:?} (prefill {:?}, replay {:?} = \
             {per_token:.1} ms/token)",
            stats.prefill, stats.replay
        );
    }
    for k in [1usize, 7, 20] {
        let mut s = DecodeState::resume(
            &*m,
            &p,
            &full.tokens[..k],
            params.clone(),
            stop(&*m, max),
            ResumeMode::Fast,
        )
        .unwrap();
        let stats = s.stats();
        let (rest, _) = s.run_to_end().unwrap();
        let diverged = rest
            .iter()
            .zip(&full.tokens[k..])
            .position(|(a, b)| a != b)
            .map(|i| k + i)
            .or((rest.len() != full.tokens.len() - k).then_some(k + rest.len()));
        match diverged {
            Some(at) => eprintln!("fast resume at {k} (prefill {:?}): diverges at seq {at}", stats.prefill),
            None => eprintln!(
                "fast resume at {k} (prefill {:?}): no divergence through seq {}",
                stats.prefill,
                full.tokens.len() - 1
            ),
        }
    }
}

#[test]
fn interleaved_sequences_keep_their_own_kv_cache() {
    let m = common::real_model();
    let (pa, pb) = (chat(&*m, "Count to five."), chat(&*m, "Name a color."));
    let g = SamplingConfig::greedy();
    let alone_a = generate(&*m, &pa, &g, &stop(&*m, 8)).unwrap().tokens;
    let alone_b = generate(&*m, &pb, &g, &stop(&*m, 8)).unwrap().tokens;
    let mut a = DecodeState::start(&*m, &pa, g.clone(), stop(&*m, 8)).unwrap();
    let mut b = DecodeState::start(&*m, &pb, g.clone(), stop(&*m, 8)).unwrap();
    let (mut ta, mut tb) = (vec![], vec![]);
    loop {
        let (sa, sb) = (a.next_token().unwrap(), b.next_token().unwrap());
        if sa.is_none() && sb.is_none() {
            break;
        }
        ta.extend(sa.map(|s| s.token));
        tb.extend(sb.map(|s| s.token));
    }
    assert_eq!(ta, alone_a);
    assert_eq!(tb, alone_b);
}

/// The candle engine (`tokenlog_decoder::llama`, whose cache a handoff can move; the CUDA
/// path) computes the very numbers of candle-transformers' `quantized_llama`: the logits of a
/// batched prefill and of single steps after it are equal to the bit.
#[test]
fn our_forward_pass_matches_candles_quantized_llama_bit_for_bit() {
    use candle_core::quantized::gguf_file;
    use candle_core::{Device, Tensor};
    use candle_transformers::models::quantized_llama::ModelWeights;

    let m = common::real_model();
    let p = chat(&*m, "Name three colours.");
    let mut file = std::fs::File::open(m.path()).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut reference = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let logits = |t: Tensor| -> Vec<f32> { t.squeeze(0).unwrap().to_vec1().unwrap() };
    let candle = GgufModel::load_with(m.path(), DeviceSpec::Cpu, GgufEngine::Candle).unwrap();
    assert_eq!(candle.engine(), GgufEngine::Candle);
    let mut ours = candle.new_sequence().unwrap();

    let input = Tensor::new(p.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let want = logits(reference.forward(&input, 0).unwrap());
    let got = ours.prefill(&p).unwrap();
    assert_eq!(got.len(), want.len());
    assert!(bits(&got) == bits(&want), "prefill logits differ");
    let mut next = argmax(&got);
    for pos in p.len()..p.len() + 6 {
        let input = Tensor::new(&[next], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let want = logits(reference.forward(&input, pos).unwrap());
        let got = ours.step(next).unwrap();
        assert!(bits(&got) == bits(&want), "step logits differ at position {pos}");
        next = argmax(&got);
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The CPU engine (our own kernels: activations quantized per row with f32 scales) is not
/// candle's numbers to the bit, but the same model: against the f32 model (the GGUF weights
/// dequantized, f32 activations: the safetensors export) its logits are at least as close as
/// candle's, and its greedy tokens are the f32 model's wherever candle's are.
#[test]
fn the_cpu_engine_computes_the_model_candle_computes() {
    let m = common::real_model();
    assert_eq!(m.engine(), GgufEngine::Cpu);
    let candle = GgufModel::load_with(m.path(), DeviceSpec::Cpu, GgufEngine::Candle).unwrap();
    let reference = common::safetensors_model();
    let p = chat(&*m, "Name three colours.");
    let mut seqs = [&*m as &dyn Model, &candle, &*reference].map(|x| x.new_sequence().unwrap());
    let mut logits: Vec<Logits> = seqs.iter_mut().map(|s| s.prefill(&p).unwrap()).collect();
    let cosine = |a: &[f32], b: &[f32]| {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        dot / (norm(a) * norm(b))
    };
    for step in 0..8 {
        let (ours, theirs) = (cosine(&logits[0], &logits[2]), cosine(&logits[1], &logits[2]));
        eprintln!("step {step}: cosine to the f32 model: cpu engine {ours:.6}, candle {theirs:.6}");
        assert!(
            ours > 0.995 && ours >= theirs - 0.002,
            "step {step}: {ours} vs candle's {theirs}"
        );
        let want = argmax(&logits[2]);
        if argmax(&logits[1]) == want {
            assert_eq!(argmax(&logits[0]), want, "step {step}: greedy token");
        }
        // Every model is fed the f32 model's greedy token.
        logits = seqs.iter_mut().map(|s| s.step(want).unwrap()).collect();
    }
}

/// Greedy-decodes `n` tokens of `prompt` alone: the tokens and the logits after each feed
/// (the prefill's first).
fn alone(m: &dyn Model, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Logits>) {
    let mut s = m.new_sequence().unwrap();
    let mut logits = vec![s.prefill(prompt).unwrap()];
    let mut tokens = vec![];
    for _ in 0..n {
        let t = argmax(logits.last().unwrap());
        tokens.push(t);
        logits.push(s.step(t).unwrap());
    }
    (tokens, logits)
}

/// Batch invariance (issue 17): a generation decoded alone and inside batches of 2, 4 and 8
/// with different neighbours (other prompts, neighbours prefilling their prompt in the same call,
/// neighbours joining late) gets the same logits to the bit at every position.
#[test]
fn a_generation_gets_the_same_logits_alone_and_in_batches_of_2_4_8() {
    let m = common::real_model();
    let questions = [
        "Write a haiku about snow.",
        "What is the capital of France?",
        "Count from one to ten.",
        "Explain rain to a child.",
        "Name a famous painter.",
        "Why is the sky blue?",
        "Give me a word that rhymes with cat.",
        "Say hello in Spanish.",
    ];
    let prompts: Vec<Vec<u32>> = questions.iter().map(|q| chat(&*m, q)).collect();
    let n = 10;
    let want = alone(&*m, &prompts[0], n);
    for size in [2usize, 4, 8] {
        // Generation 0 and `size - 1` neighbours; neighbour j joins at step j % 3 (its prompt
        // prefilled in the same call as the others' single tokens).
        let mut seqs: Vec<Box<dyn Sequence>> = (0..size).map(|_| m.new_sequence().unwrap()).collect();
        let mut next: Vec<Option<Vec<u32>>> = (0..size).map(|j| (j == 0).then(|| prompts[0].clone())).collect();
        let mut got = vec![];
        for step in 0..=n + 2 {
            for j in 1..size {
                if step == j % 3 && seqs[j].kv_len() == 0 {
                    next[j] = Some(prompts[j].clone());
                }
            }
            let fed: Vec<usize> = (0..size).filter(|&j| next[j].is_some()).collect();
            let inputs: Vec<Vec<u32>> = fed.iter().map(|&j| next[j].take().unwrap()).collect();
            let results = {
                let mut items: Vec<(&mut dyn Sequence, &[u32])> = seqs
                    .iter_mut()
                    .enumerate()
                    .filter(|(j, _)| fed.contains(j))
                    .zip(&inputs)
                    .map(|((_, s), t)| (&mut **s as &mut dyn Sequence, t.as_slice()))
                    .collect();
                m.prefill_batch(&mut items)
            };
            for (&j, logits) in fed.iter().zip(results) {
                let logits = logits.unwrap();
                if j == 0 {
                    got.push(logits.clone());
                }
                if j == 0 && got.len() > n {
                    continue;
                }
                next[j] = Some(vec![argmax(&logits)]);
            }
        }
        assert_eq!(got.len(), n + 1);
        for (i, (g, w)) in got.iter().zip(&want.1).enumerate() {
            assert!(bits(g) == bits(w), "batch of {size}: logits differ after feed {i}");
        }
    }
}

/// Invariance along the sequence: a prefill of the prompt and `k` generated tokens in one call
/// gives, to the bit, the logits of the prompt's prefill followed by `k` single steps; so an
/// exact resume costs one prefill.
#[test]
fn a_prefill_of_k_tokens_gives_the_logits_of_k_single_steps() {
    let m = common::real_model();
    let p = chat(&*m, "Tell me about the moon.");
    let (tokens, logits) = alone(&*m, &p, 12);
    for k in [1usize, 5, 12] {
        let mut s = m.new_sequence().unwrap();
        let mut all = p.clone();
        all.extend_from_slice(&tokens[..k]);
        let got = s.prefill(&all).unwrap();
        assert!(bits(&got) == bits(&logits[k]), "prefill of prompt + {k} tokens");
        assert!(s.grouping_invariant());
    }
    // And in two uneven calls.
    let mut s = m.new_sequence().unwrap();
    s.prefill(&p[..p.len() - 3]).unwrap();
    let mut rest = p[p.len() - 3..].to_vec();
    rest.extend_from_slice(&tokens[..4]);
    assert!(
        bits(&s.prefill(&rest).unwrap()) == bits(&logits[4]),
        "a prompt split in two calls"
    );
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i as u32)
        .unwrap()
}

/// A planned handoff with the real model: the cache (every layer's keys and values and the
/// logits) exported after k committed tokens and imported by a new state continues exactly as
/// the uninterrupted sampled run, with no re-prefill.
#[test]
fn an_exported_kv_cache_continues_the_sampled_run_exactly() {
    let m = common::real_model();
    let p = chat(&*m, "Write a short poem about rivers.");
    let n = 24;
    let whole = generate(&*m, &p, &sampled(11), &stop(&*m, n)).unwrap().tokens;
    for k in [0usize, 9] {
        let mut src = DecodeState::start(&*m, &p, sampled(11), stop(&*m, n)).unwrap();
        for _ in 0..k {
            src.next_token().unwrap();
        }
        src.mark_committed(k);
        let t0 = Instant::now();
        let cache = src.export_cache().unwrap();
        let exported = t0.elapsed();
        assert_eq!(cache.positions as usize, p.len() + k);
        assert_eq!(cache.blocks.len(), 2 * 30, "keys and values of 30 layers");
        let t1 = Instant::now();
        let mut dst = DecodeState::import(
            &*m,
            &p,
            &whole[..k],
            sampled(11),
            stop(&*m, n),
            ResumeMode::Exact,
            &cache,
        )
        .unwrap();
        eprintln!(
            "k={k}: cache of {} positions, {} bytes, exported in {exported:?}, imported in {:?}",
            cache.positions,
            cache.bytes(),
            t1.elapsed()
        );
        let (rest, _) = dst.run_to_end().unwrap();
        assert_eq!(rest, whole[k..], "continued after {k} tokens");
    }
}

/// A copy taken while the generation decodes on (the committed positions but the last, no
/// model call), with two tokens sampled past the committed frontier, continues the sampled run
/// exactly once the destination prefilled the position the copy left out.
#[test]
fn a_kv_cache_copied_while_decoding_continues_the_sampled_run_exactly() {
    let m = common::real_model();
    let p = chat(&*m, "Write a short poem about rivers.");
    let n = 24;
    let whole = generate(&*m, &p, &sampled(11), &stop(&*m, n)).unwrap().tokens;
    let (k, ahead) = (9usize, 2usize);
    let mut src = DecodeState::start(&*m, &p, sampled(11), stop(&*m, n)).unwrap();
    // As a handoff source does: the logits of its last draw kept for its rows.
    src.keep_logits(true);
    for _ in 0..k + ahead {
        src.next_token().unwrap();
    }
    src.mark_committed(k);
    let t0 = Instant::now();
    let cache = src.copy_committed_cache().unwrap();
    let copied = t0.elapsed();
    assert_eq!(cache.positions as usize, p.len() + k - 1);
    let t1 = Instant::now();
    let mut dst = DecodeState::resume_from_cache(
        &*m,
        &p,
        &whole[..k],
        sampled(11),
        stop(&*m, n),
        ResumeMode::Exact,
        &cache,
    )
    .unwrap();
    eprintln!(
        "copy of {} positions, {} bytes, in {copied:?}; loaded and the last position prefilled in {:?}",
        cache.positions,
        cache.bytes(),
        t1.elapsed()
    );
    let (rest, _) = dst.run_to_end().unwrap();
    assert_eq!(rest, whole[k..], "continued after {k} tokens");
    // A handoff destination: the left-out position fed with the records committed since the
    // copy, in one forward pass.
    let deferred_load = || {
        DecodeState::resume_from_cache_deferred(
            &*m,
            &p,
            &whole[..k],
            sampled(11),
            stop(&*m, n),
            ResumeMode::Exact,
            &cache,
        )
        .unwrap()
    };
    let mut deferred = deferred_load();
    assert!(deferred.prefilling());
    deferred.follow_all_fed(&whole[k..k + ahead]).unwrap();
    assert!(deferred.logits_ready());
    let (rest, _) = deferred.run_to_end().unwrap();
    assert_eq!(rest, whole[k + ahead..], "fed with {ahead} records after {k}");
    // The same with the rows the source fed past its copy (a handoff source streams them):
    // appended instead of computed, all but the last position, the same bits.
    let from_source = |first: usize, n: usize| (first..first + n).map_while(|q| src.export_row(q)).collect::<Vec<_>>();
    let mut with_rows = deferred_load();
    with_rows
        .follow_all_fed_with(&whole[k..k + ahead], from_source)
        .unwrap();
    assert_eq!(
        with_rows.stats().appended_rows,
        ahead,
        "the left-out position and the first record as rows, the last record computed"
    );
    for q in cache.positions as usize..p.len() + k + ahead - 1 {
        let bits = |r: Option<tokenlog_decoder::Row>| r.map(|r| (r.token, r.data));
        assert!(
            bits(with_rows.export_row(q)) == bits(src.export_row(q)),
            "position {q}: the source's bits"
        );
    }
    let (rest, _) = with_rows.run_to_end().unwrap();
    assert_eq!(
        rest,
        whole[k + ahead..],
        "fed with {ahead} records after {k}, rows appended"
    );
    // Up to the source's last fed position, whose row carries the logits it drew from: no
    // forward pass at all, and the draws go on as the source's did.
    let mut no_pass = deferred_load();
    no_pass
        .follow_all_fed_with(&whole[k..k + ahead - 1], from_source)
        .unwrap();
    assert_eq!(no_pass.stats().appended_rows, ahead, "every position as a row");
    let (rest, _) = no_pass.run_to_end().unwrap();
    assert_eq!(rest, whole[k + ahead - 1..], "drawn from the source's logits");
    // Rows whose tokens are not the records' are left, and computed.
    let mut wrong = deferred_load();
    wrong
        .follow_all_fed_with(&whole[k..k + ahead], |first, n| {
            let mut rows = from_source(first, n);
            rows[0].token ^= 1;
            rows
        })
        .unwrap();
    assert_eq!(wrong.stats().appended_rows, 0);
    let (rest, _) = wrong.run_to_end().unwrap();
    assert_eq!(rest, whole[k + ahead..], "rows of other tokens left out");
    let (src_rest, _) = src.run_to_end().unwrap();
    assert_eq!(src_rest, whole[k + ahead..], "the source decoded on");
}

/// A hot standby on the real model (issue 15 item 3): resumed at k, then following the sampled
/// run's records one at a time to n, it draws the uninterrupted run's tokens from n on.
#[test]
fn a_standby_following_the_records_continues_the_sampled_run_exactly() {
    let m = common::real_model();
    let p = chat(&*m, "Write a short poem about rivers.");
    let n = 24;
    let whole = generate(&*m, &p, &sampled(11), &stop(&*m, n)).unwrap().tokens;
    for (k, upto) in [(0usize, 9usize), (5, 16)] {
        let mut s = DecodeState::resume(&*m, &p, &whole[..k], sampled(11), stop(&*m, n), ResumeMode::Exact).unwrap();
        for &t in &whole[k..upto] {
            s.follow(t).unwrap();
        }
        let (rest, _) = s.run_to_end().unwrap();
        assert_eq!(rest, whole[upto..], "resumed at {k}, followed to {upto}");
    }
    // A follower that fell behind takes 7 records in one call: the same continuation.
    let mut s = DecodeState::resume(&*m, &p, &whole[..3], sampled(11), stop(&*m, n), ResumeMode::Exact).unwrap();
    s.follow_all(&whole[3..10]).unwrap();
    s.follow_all(&whole[10..12]).unwrap();
    let (rest, _) = s.run_to_end().unwrap();
    assert_eq!(rest, whole[12..], "caught up in batches");
    // The same with the last record fed too (a handoff destination's catch-up).
    let mut s = DecodeState::resume(&*m, &p, &whole[..3], sampled(11), stop(&*m, n), ResumeMode::Exact).unwrap();
    s.follow_all_fed(&whole[3..10]).unwrap();
    assert!(s.logits_ready());
    s.follow_all_fed(&whole[10..12]).unwrap();
    let (rest, _) = s.run_to_end().unwrap();
    assert_eq!(rest, whole[12..], "caught up in batches, fed");
}

/// A prefix cache entry on the real model: the prompt's cache, loaded for a generation with 9
/// committed records and the rest prefilled, continues the sampled run exactly.
#[test]
fn a_prompt_cache_and_a_prefill_of_the_rest_continue_the_sampled_run_exactly() {
    let m = common::real_model();
    let p = chat(&*m, "Write a short poem about rivers.");
    let n = 24;
    let whole = generate(&*m, &p, &sampled(11), &stop(&*m, n)).unwrap().tokens;
    let cache = DecodeState::start(&*m, &p, sampled(11), stop(&*m, n))
        .unwrap()
        .export_cache()
        .unwrap();
    let mut s = DecodeState::resume_from_cache(
        &*m,
        &p,
        &whole[..9],
        sampled(11),
        stop(&*m, n),
        ResumeMode::Exact,
        &cache,
    )
    .unwrap();
    let (rest, _) = s.run_to_end().unwrap();
    assert_eq!(rest, whole[9..]);
}

/// Pipeline stages (issue 16): the model split into 2 and into 3 stages (each a layer range on
/// the CPU engine, the rows between them moved as they are) gives the whole model's logits to
/// the bit: for a prompt prefill, for single steps, and for two sequences in one batched pass
/// per stage, one prefilling while the other steps.
#[test]
fn a_model_split_into_stages_computes_the_whole_models_bits() {
    use tokenlog_decoder::stage::{StageInput, StageModel, StageOutput};
    let m = common::real_model();
    let prompts = [
        chat(&*m, "Name three colours."),
        chat(&*m, "Tell me about lighthouses."),
    ];
    let (tokens0, want0) = alone(&*m, &prompts[0], 6);
    let (_, want1) = alone(&*m, &prompts[1], 0);
    for split in [vec![0..15, 15..30], vec![0..10, 10..20, 20..30]] {
        let stages: Vec<StageModel> = split
            .iter()
            .map(|r| StageModel::load(m.path(), r.clone()).unwrap())
            .collect();
        assert!(stages[0].is_first() && stages.last().unwrap().is_last());
        let mut seqs: Vec<_> = stages.iter().map(|s| [s.new_sequence(), s.new_sequence()]).collect();
        // One pass through every stage: per item, its tokens; the last stage's logits.
        let mut pass = |feeds: &[(usize, &[u32])]| -> Vec<Vec<f32>> {
            let mut rows: Vec<Vec<f32>> = Vec::new();
            for (k, stage) in stages.iter().enumerate() {
                let [a, b] = &mut seqs[k];
                let mut pair = [Some(a), Some(b)];
                let mut items: Vec<(&mut tokenlog_decoder::stage::StageSequence, StageInput)> = Vec::new();
                for (j, (seq, toks)) in feeds.iter().enumerate() {
                    let input = match k {
                        0 => StageInput::Tokens(toks),
                        _ => StageInput::Hidden(&rows[j]),
                    };
                    items.push((pair[*seq].take().unwrap(), input));
                }
                let out = stage.forward(&mut items);
                rows = out
                    .into_iter()
                    .map(|o| match o.unwrap() {
                        StageOutput::Hidden(h) => h,
                        StageOutput::Logits(l) => l,
                    })
                    .collect();
            }
            rows
        };
        let got = pass(&[(0, &prompts[0])]);
        assert!(bits(&got[0]) == bits(&want0[0]), "{split:?}: the prompt's prefill");
        // The second sequence prefills in the same passes as the first one's first step.
        let got = pass(&[(0, &tokens0[..1]), (1, &prompts[1])]);
        assert!(bits(&got[0]) == bits(&want0[1]), "{split:?}: step 1 beside a prefill");
        assert!(bits(&got[1]) == bits(&want1[0]), "{split:?}: a prefill beside a step");
        for (i, &t) in tokens0.iter().enumerate().skip(1) {
            let got = pass(&[(0, &[t])]);
            assert!(bits(&got[0]) == bits(&want0[i + 1]), "{split:?}: step {}", i + 1);
        }
    }
    // A rewound sequence (a pass sent again after a later stage failed) gives the same rows.
    let first = StageModel::load(m.path(), 0..10).unwrap();
    let mut s = first.new_sequence();
    first.forward(&mut [(&mut s, StageInput::Tokens(&prompts[0]))]);
    let once = first
        .forward(&mut [(&mut s, StageInput::Tokens(&tokens0[..2]))])
        .pop()
        .unwrap()
        .unwrap();
    s.truncate(prompts[0].len());
    assert_eq!(s.len(), prompts[0].len());
    let again = first
        .forward(&mut [(&mut s, StageInput::Tokens(&tokens0[..2]))])
        .pop()
        .unwrap()
        .unwrap();
    assert!(once == again, "rewound and fed again: the same rows");
    // What a stage refuses, it says.
    let middle = StageModel::load(m.path(), 10..20).unwrap();
    let mut s = middle.new_sequence();
    let e = middle
        .forward(&mut [(&mut s, StageInput::Tokens(&[1, 2]))])
        .pop()
        .unwrap()
        .unwrap_err();
    assert!(e.to_string().contains("takes the rows"), "{e}");
    let e = middle
        .forward(&mut [(&mut s, StageInput::Hidden(&[0.5; 7]))])
        .pop()
        .unwrap()
        .unwrap_err();
    assert!(e.to_string().contains("whole rows"), "{e}");
    for (start, end) in [(20, 10), (0, 31), (5, 5)] {
        let bad = std::ops::Range { start, end };
        let e = StageModel::load(m.path(), bad.clone()).err().expect("refused");
        assert!(e.to_string().contains("layers"), "{bad:?}: {e}");
    }
}

/// The CPU engine's numbers are pinned: a digest of the logits of a fixed prompt and 40 greedy
/// steps. Exact-mode takeover across decoder releases (a generation begun by one release and
/// continued by the next) needs the same bits; a kernel change (such as AVX-VNNI, or more rows per
/// weight block) must keep this digest. If it has to change, the model identity must change
/// with it (so that old and new decoders never continue each other's generations): the digest
/// is pinned together with the engine's numerics version, which is in the identity
/// (`CPU_ENGINE_NUMERICS`). `cpu2` (2026-12-04): one lane per whole block in the kernels.
/// `cpu3` (2026-12-06): `exp` by the engine's own algorithm (vectorized, in f64) instead of the
/// C library's, which is not the same function on every machine (glibc picks an FMA variant
/// where the CPU has FMA); the digest did not change, but a rare input may round otherwise.
/// `cpu4` (2026-12-06): attention's dot products and weighted sums, and the norms' sums of
/// squares, in fused multiply-adds.
#[test]
fn the_cpu_engines_numbers_do_not_change_between_releases() {
    let m = common::real_model();
    assert_eq!(m.engine(), GgufEngine::Cpu);
    let mut s = m.new_sequence().unwrap();
    let mut digest: u64 = 0xcbf2_9ce4_8422_2325;
    let mut logits = s.prefill(&chat(&*m, "Tell me about lighthouses.")).unwrap();
    for _ in 0..40 {
        for v in logits.iter() {
            digest = (digest ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3);
        }
        let next = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        logits = s.prefill(&[next]).unwrap();
    }
    assert_eq!(
        (CPU_ENGINE_NUMERICS, format!("{digest:016x}").as_str()),
        ("cpu4", "dfbea981543f9ed7"),
        "the CPU engine's logits changed: bump its numerics version (it is in the model identity) with the digest"
    );
}

/// A cache over 16 MB (`CACHE_COPY_IN_STEP_BYTES_MAX`; ~350 positions of SmolLM2) is still
/// taken between two steps without pausing its generation (the CPU engine shares its chunks
/// and copies only the ones being filled), and the copy does not change while the generation
/// decodes on past it: built afterwards, across a chunk boundary, it gives the blocks of one
/// exported at the moment it was taken.
#[test]
fn a_long_cache_is_taken_while_decoding_and_stays_as_taken() {
    let m = common::real_model();
    let p = chat(
        &*m,
        &"The river runs to the sea and the sea returns the rain. ".repeat(30),
    );
    assert!(p.len() > 400, "a prompt of {} tokens", p.len());
    // No end of text: it decodes on past the next chunk boundary whatever it samples.
    let no_eos = StopConfig {
        max_tokens: 100,
        stop_strings: vec![],
        eos_token_ids: vec![],
    };
    let mut src = DecodeState::start(&*m, &p, sampled(5), no_eos).unwrap();
    for _ in 0..3 {
        src.next_token().unwrap();
    }
    src.mark_committed(2);
    assert!(
        src.copies_while_decoding(),
        "a cache of {} positions is taken between two steps",
        src.kv_positions()
    );
    let now = src.copy_committed_cache().unwrap();
    assert!(now.bytes() > 16 << 20, "{} bytes", now.bytes());
    let taken = src.snapshot_committed_cache().unwrap();
    // On past the next chunk boundary (chunks of 64 positions), writing into the shared one.
    for _ in 0..70 {
        src.next_token().unwrap();
    }
    let later = taken.export().unwrap();
    assert_eq!(later.positions, now.positions);
    assert!(later == now, "the copy changed while its generation decoded on");
}

/// Timing, not a check (`cargo test --workspace --features tokenlog/faults --test real_model
/// -- --ignored --nocapture steps_of_4`): 4 sequences decoded in lockstep to 1,400 positions,
/// one batched forward pass per step; prints the median step and the slowest ones with their
/// positions. A cache that grows by doubling copies every layer of all 4 in the same step
/// (positions 75, 149, 297, 593, 1185 from this 37-token prompt); one kept in chunks does not.
#[test]
#[ignore]
fn steps_of_4_sequences_to_1400_positions() {
    let m = common::real_model();
    // One prompt for all 4, so that their caches grow in the same steps (as in `bench drain`).
    let prompts: Vec<Vec<u32>> = vec![chat(&*m, "Tell me about lighthouses."); 4];
    let mut seqs: Vec<Box<dyn Sequence>> = (0..4).map(|_| m.new_sequence().unwrap()).collect();
    let mut next: Vec<Vec<u32>> = prompts.clone();
    let mut steps: Vec<(std::time::Duration, usize)> = vec![];
    while seqs[0].kv_len() < 1_400 {
        let began = std::time::Instant::now();
        let results = {
            let mut items: Vec<(&mut dyn Sequence, &[u32])> = seqs
                .iter_mut()
                .zip(&next)
                .map(|(s, t)| (&mut **s as &mut dyn Sequence, t.as_slice()))
                .collect();
            m.prefill_batch(&mut items)
        };
        steps.push((began.elapsed(), seqs[0].kv_len()));
        for (n, logits) in next.iter_mut().zip(results) {
            let logits = logits.unwrap();
            // Greedy, but never the end of the text: the run goes on to 1,400 positions.
            let eos = m.eos_token_ids();
            let t = logits
                .iter()
                .enumerate()
                .filter(|(i, _)| !eos.contains(&(*i as u32)))
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32;
            *n = vec![t];
        }
    }
    let mut sorted: Vec<_> = steps[1..].to_vec();
    sorted.sort();
    let median = sorted[sorted.len() / 2].0;
    let slowest: Vec<String> = sorted
        .iter()
        .rev()
        .take(6)
        .map(|(d, p)| format!("{:.1} ms at {p}", d.as_secs_f64() * 1e3))
        .collect();
    let total: std::time::Duration = steps[1..].iter().map(|s| s.0).sum();
    println!(
        "steps of 4 to {} positions: median {:.1} ms, total {:.2} s, slowest {}",
        seqs[0].kv_len(),
        median.as_secs_f64() * 1e3,
        total.as_secs_f64(),
        slowest.join(", ")
    );
}
