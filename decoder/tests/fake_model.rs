//! The fake model: determinism, prefix dependence, resume, stop conditions, frontiers, and the
//! byte-level tokenizer and detokenizer.

use tokenlog_decoder::fake::{FAKE_BYTE_OFFSET, FAKE_IM_END};
use tokenlog_decoder::{
    generate, ChatMessage, DecodeState, FakeConfig, FakeModel, Model, ResumeMode, SamplingConfig, StopCause, StopConfig,
};

fn model() -> FakeModel {
    FakeModel::new(FakeConfig::default()).unwrap()
}

fn sampled() -> SamplingConfig {
    SamplingConfig {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 50,
        repetition_penalty: 1.05,
        frequency_penalty: 0.1,
        presence_penalty: 0.1,
        seed: 77,
        rng_version: tokenlog_decoder::RNG_VERSION,
    }
}

fn stop(max_tokens: u32) -> StopConfig {
    StopConfig {
        max_tokens,
        stop_strings: vec![],
        eos_token_ids: vec![FAKE_IM_END],
    }
}

fn prompt(m: &FakeModel, text: &str) -> Vec<u32> {
    m.tokenizer().encode_chat(&[ChatMessage::user(text)]).unwrap()
}

#[test]
fn deterministic_and_prefix_dependent() {
    let m = model();
    let p = prompt(&m, "hello");
    let a = generate(&m, &p, &sampled(), &stop(64)).unwrap();
    let b = generate(&m, &p, &sampled(), &stop(64)).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert_eq!(a.tokens.len(), 64);
    assert_eq!(a.finish, StopCause::Length);
    // Changing only the first prompt token changes the output.
    let mut p2 = p.clone();
    p2[1] += 1;
    let c = generate(&m, &p2, &sampled(), &stop(64)).unwrap();
    assert_ne!(a.tokens, c.tokens);
    // Another seed, another output; greedy is deterministic too.
    let other_seed = SamplingConfig { seed: 78, ..sampled() };
    assert_ne!(a.tokens, generate(&m, &p, &other_seed, &stop(64)).unwrap().tokens);
    let g = SamplingConfig::greedy();
    assert_eq!(
        generate(&m, &p, &g, &stop(32)).unwrap().tokens,
        generate(&m, &p, &g, &stop(32)).unwrap().tokens
    );
    let text = m.tokenizer().decode(&a.tokens, true).unwrap();
    assert!(text.chars().filter(|c| c.is_ascii_lowercase()).count() > 20, "{text:?}");
}

#[test]
fn resume_in_both_modes_continues_identically() {
    let m = model();
    let p = prompt(&m, "resume me");
    let full = generate(&m, &p, &sampled(), &stop(40)).unwrap();
    for mode in [ResumeMode::Exact, ResumeMode::Fast] {
        for k in [0usize, 1, 7, 20, 39] {
            let mut s = DecodeState::resume(&m, &p, &full.tokens[..k], sampled(), stop(40), mode).unwrap();
            let f = s.frontiers();
            assert_eq!((f.sampled, f.fed, f.committed, f.kv), (k, k, k, p.len() + k));
            let (rest, finish) = s.run_to_end().unwrap();
            assert_eq!(rest, full.tokens[k..], "{mode:?} at {k}");
            assert_eq!(finish, StopCause::Length);
        }
    }
}

#[test]
fn interleaved_sequences_do_not_interfere() {
    let m = model();
    let (pa, pb) = (prompt(&m, "first"), prompt(&m, "second"));
    let ga = generate(&m, &pa, &sampled(), &stop(30)).unwrap();
    let gb = generate(&m, &pb, &sampled(), &stop(30)).unwrap();
    let mut a = DecodeState::start(&m, &pa, sampled(), stop(30)).unwrap();
    let mut b = DecodeState::start(&m, &pb, sampled(), stop(30)).unwrap();
    let (mut ta, mut tb) = (vec![], vec![]);
    loop {
        let sa = a.next_token().unwrap();
        let sb = b.next_token().unwrap();
        if sa.is_none() && sb.is_none() {
            break;
        }
        ta.extend(sa.map(|s| s.token));
        tb.extend(sb.map(|s| s.token));
    }
    assert_eq!((ta, tb), (ga.tokens, gb.tokens));
}

#[test]
fn eos_and_stop_strings_finish_and_survive_resume() {
    let m = FakeModel::new(FakeConfig {
        eos_one_in: 10,
        ..Default::default()
    })
    .unwrap();
    let p = prompt(&m, "stop soon");
    let g = generate(&m, &p, &SamplingConfig::greedy(), &stop(500)).unwrap();
    assert_eq!(g.finish, StopCause::Eos { token: FAKE_IM_END });
    assert_eq!(*g.tokens.last().unwrap(), FAKE_IM_END);
    // A prefix that already ends with EOS resumes as finished, without building a KV cache.
    let s = DecodeState::resume(
        &m,
        &p,
        &g.tokens,
        SamplingConfig::greedy(),
        stop(500),
        ResumeMode::Exact,
    )
    .unwrap();
    assert_eq!(s.finished(), Some(&StopCause::Eos { token: FAKE_IM_END }));
    assert_eq!(s.frontiers().kv, 0);

    // Stop string: a piece of the text the generation would produce.
    let m = model();
    let full = generate(&m, &p, &sampled(), &stop(60)).unwrap();
    let text = m.tokenizer().decode(&full.tokens, true).unwrap();
    let needle = text[30..34].to_string();
    let first = text.find(&needle).unwrap();
    let cond = StopConfig {
        stop_strings: vec!["never there \u{1F389}".into(), needle.clone()],
        ..stop(60)
    };
    let g = generate(&m, &p, &sampled(), &cond).unwrap();
    assert_eq!(g.finish, StopCause::StopString { index: 1 });
    assert_eq!(g.tokens.len(), first + needle.len(), "byte tokens: one per char");
    // The stop matcher rebuilt from a prefix that ends just before the stop token still stops.
    let k = g.tokens.len() - 1;
    let mut s = DecodeState::resume(&m, &p, &g.tokens[..k], sampled(), cond, ResumeMode::Exact).unwrap();
    let last = s.next_token().unwrap().unwrap();
    assert_eq!(last.token, g.tokens[k]);
    assert_eq!(last.finish, Some(StopCause::StopString { index: 1 }));
}

#[test]
fn stop_string_split_across_byte_tokens() {
    let m = model();
    let tok = m.tokenizer();
    let ids: Vec<u32> = "ok 🎉".bytes().map(|b| FAKE_BYTE_OFFSET + u32::from(b)).collect();
    let mut matcher = tokenlog_decoder::StopMatcher::new(
        StopConfig {
            max_tokens: 0,
            stop_strings: vec!["🎉".into()],
            eos_token_ids: vec![],
        },
        tok,
        &[],
    );
    let reasons: Vec<_> = ids.iter().map(|&t| matcher.push(t)).collect();
    assert!(reasons[..ids.len() - 1].iter().all(Option::is_none));
    assert_eq!(reasons.last().unwrap(), &Some(StopCause::StopString { index: 0 }));
    // The detokenizer holds the emoji's bytes back until the last one arrives.
    let mut d = tok.detokenizer(true);
    let deltas: Vec<String> = ids.iter().map(|&t| d.push(t)).collect();
    assert_eq!(deltas, ["o", "k", " ", "", "", "", "🎉"]);
    // An invalid byte sequence becomes U+FFFD, a truncated one too at the end.
    let mut d = tok.detokenizer(true);
    let bad = [0xFFu8, b'a', 0xF0, 0x9F];
    let out: String = bad.iter().map(|&b| d.push(FAKE_BYTE_OFFSET + u32::from(b))).collect();
    assert_eq!(out + &d.finish(), "\u{FFFD}a\u{FFFD}");
}

#[test]
fn fake_tokenizer_round_trips() {
    let m = model();
    let t = m.tokenizer();
    for text in ["héllo 日本 🎉\t\n 123", "", "  x"] {
        let ids = t.encode(text).unwrap();
        assert_eq!(ids.len(), text.len(), "one token per byte");
        assert_eq!(t.decode(&ids, false).unwrap(), text);
    }
    let chat = t.encode_chat(&[ChatMessage::user("hi")]).unwrap();
    assert_eq!(
        t.decode(&chat, false).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn context_limit_and_frontiers() {
    let m = FakeModel::new(FakeConfig {
        max_context: 24,
        ..Default::default()
    })
    .unwrap();
    let p: Vec<u32> = (0..20).map(|i| FAKE_BYTE_OFFSET + 97 + i % 26).collect();
    let g = generate(&m, &p, &sampled(), &stop(0)).unwrap();
    // Positions 20..24 hold 4 fed tokens; the 5th is drawn from the last logits, never fed.
    assert_eq!(g.tokens.len(), 5);
    assert_eq!(g.finish, StopCause::ContextFull);
    let s = DecodeState::resume(&m, &p, &g.tokens, sampled(), stop(0), ResumeMode::Exact).unwrap();
    assert_eq!(s.finished(), Some(&StopCause::ContextFull));

    let mut s = DecodeState::start(&m, &p, sampled(), stop(0)).unwrap();
    s.next_token().unwrap();
    let f = s.frontiers();
    assert_eq!((f.sampled, f.fed, f.kv, f.committed), (1, 0, 20, 0));
    s.feed_pending().unwrap();
    s.mark_committed(1);
    let f = s.frontiers();
    assert_eq!((f.sampled, f.fed, f.kv, f.committed), (1, 1, 21, 1));
}

#[test]
#[should_panic(expected = "committed 3 ahead of sampled")]
fn committing_unsampled_tokens_is_a_bug() {
    let m = model();
    let p = prompt(&m, "x");
    let mut s = DecodeState::start(&m, &p, sampled(), stop(10)).unwrap();
    s.next_token().unwrap();
    s.mark_committed(3);
}

#[test]
fn identities_differ_by_variant() {
    let a = model();
    let b = FakeModel::new(FakeConfig {
        variant: 1,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(a.identity().dtype_class, "fake");
    assert_eq!(a.identity().tokenizer_sha256, b.identity().tokenizer_sha256);
    assert_ne!(a.identity().weights_sha256, b.identity().weights_sha256);
    assert_eq!(a.identity(), model().identity());
}

#[test]
fn types_cross_threads() {
    fn send<T: Send>() {}
    fn shared<T: Send + Sync>() {}
    send::<DecodeState>();
    send::<Box<dyn tokenlog_decoder::Sequence>>();
    shared::<FakeModel>();
    shared::<tokenlog_decoder::GgufModel>();
    shared::<std::sync::Arc<dyn Model>>();
}

/// A planned handoff's state transfer: a cache exported after any number of committed tokens
/// and imported by a fresh state continues exactly as the uninterrupted run; a cache that does
/// not fit (positions, logits, another prefix) is refused.
#[test]
fn an_exported_cache_continues_exactly_at_the_destination() {
    let m = model();
    let p = prompt(&m, "hand me over");
    let mut whole = DecodeState::start(&m, &p, sampled(), stop(40)).unwrap();
    let (all, _) = whole.run_to_end().unwrap();
    assert!(all.len() >= 12, "{}", all.len());
    for k in [0usize, 1, 5, 11] {
        let mut src = DecodeState::start(&m, &p, sampled(), stop(40)).unwrap();
        for _ in 0..k {
            src.next_token().unwrap().unwrap();
        }
        // Not before every sampled token is committed.
        if k > 0 {
            assert!(src.export_cache().is_err());
        }
        src.mark_committed(k);
        let cache = src.export_cache().unwrap();
        assert_eq!(cache.positions as usize, p.len() + k);
        assert_eq!(cache.sha256(), cache.sha256());
        let mut dst = DecodeState::import(&m, &p, &all[..k], sampled(), stop(40), ResumeMode::Exact, &cache).unwrap();
        assert_eq!(dst.frontiers().kv, p.len() + k);
        let (rest, _) = dst.run_to_end().unwrap();
        assert_eq!(rest, all[k..], "continued after {k} tokens");
        // The source, had it kept going, draws the same.
        let (src_rest, _) = src.run_to_end().unwrap();
        assert_eq!(src_rest, rest);

        let mut short = cache.clone();
        short.positions -= 1;
        assert!(DecodeState::import(&m, &p, &all[..k], sampled(), stop(40), ResumeMode::Exact, &short).is_err());
        let mut logits = cache.clone();
        logits.logits.pop();
        assert!(DecodeState::import(&m, &p, &all[..k], sampled(), stop(40), ResumeMode::Exact, &logits).is_err());
        let mut format = cache.clone();
        format.format = "other".into();
        assert!(DecodeState::import(&m, &p, &all[..k], sampled(), stop(40), ResumeMode::Exact, &format).is_err());
    }
    // A finished generation has nothing to hand over.
    assert!(whole.export_cache().is_err());
}

/// A copy taken while the generation decodes on (`copy_committed_cache`: committed positions
/// but the last, no logits, no model call), with tokens sampled and not yet committed, loads at
/// the destination at the committed frontier (the left-out position prefilled there) and
/// continues exactly as the uninterrupted run; the source, decoding on, draws the same.
#[test]
fn a_cache_copied_while_decoding_continues_exactly_at_the_destination() {
    let m = model();
    let p = prompt(&m, "copy me while I run");
    let (all, _) = DecodeState::start(&m, &p, sampled(), stop(40))
        .unwrap()
        .run_to_end()
        .unwrap();
    assert!(all.len() >= 12, "{}", all.len());
    for (committed, sampled_ahead) in [(0usize, 0usize), (0, 3), (1, 0), (5, 2), (11, 4)] {
        let mut src = DecodeState::start(&m, &p, sampled(), stop(40)).unwrap();
        assert!(src.copies_while_decoding());
        for _ in 0..committed + sampled_ahead {
            src.next_token().unwrap().unwrap();
        }
        src.mark_committed(committed);
        let fed = src.frontiers().kv;
        let cache = src.copy_committed_cache().unwrap();
        assert_eq!(
            cache.positions as usize,
            fed.min(p.len() + committed - 1),
            "committed {committed}, {sampled_ahead} ahead"
        );
        assert!(cache.logits.is_empty());
        assert_eq!(src.frontiers().kv, fed, "the copy fed nothing");
        // Not a whole cache: `import` refuses it, the resume from a partial cache takes it.
        assert!(DecodeState::import(
            &m,
            &p,
            &all[..committed],
            sampled(),
            stop(40),
            ResumeMode::Exact,
            &cache
        )
        .is_err());
        let mut dst = DecodeState::resume_from_cache(
            &m,
            &p,
            &all[..committed],
            sampled(),
            stop(40),
            ResumeMode::Exact,
            &cache,
        )
        .unwrap();
        assert_eq!(dst.frontiers().kv, p.len() + committed);
        let (rest, _) = dst.run_to_end().unwrap();
        assert_eq!(rest, all[committed..], "continued at {committed}");
        let (src_rest, _) = src.run_to_end().unwrap();
        assert_eq!(src_rest, all[committed + sampled_ahead..]);
    }
    // A copy of a prefix of an imported cache that does not reach back to it is refused.
    let mut whole = DecodeState::start(&m, &p, sampled(), stop(40)).unwrap();
    for _ in 0..4 {
        whole.next_token().unwrap().unwrap();
    }
    whole.mark_committed(4);
    let cache = whole.export_cache().unwrap();
    let mut imported = DecodeState::import(&m, &p, &all[..4], sampled(), stop(40), ResumeMode::Exact, &cache).unwrap();
    assert!(!imported.copies_while_decoding());
    assert!(
        imported.copy_committed_cache().is_err(),
        "the position before the import's last is unknown"
    );
    imported.next_token().unwrap().unwrap();
    imported.next_token().unwrap().unwrap();
    imported.mark_committed(6);
    let c = imported.copy_committed_cache().unwrap();
    assert_eq!(c.positions as usize, p.len() + 5);
    let (rest, _) = DecodeState::resume_from_cache(&m, &p, &all[..6], sampled(), stop(40), ResumeMode::Exact, &c)
        .unwrap()
        .run_to_end()
        .unwrap();
    assert_eq!(rest, all[6..]);
    // A deferred prefill not done yet is copied the other way (fed first, the generation paused).
    let deferred = DecodeState::resume_deferred(&m, &p, &all[..3], sampled(), stop(40), ResumeMode::Exact).unwrap();
    assert!(deferred.prefilling());
    assert!(!deferred.copies_while_decoding());
    assert!(deferred.copy_committed_cache().is_err());
    // A one-token prompt with nothing committed has no committed position to copy but the last.
    let one = DecodeState::start(&m, &p[..1], sampled(), stop(40)).unwrap();
    assert!(!one.copies_while_decoding());
}

/// A hot standby (issue 15 item 3): `resume(k)` then `follow` of records `k..n` continues as
/// `resume(n)`, from a deferred resume too and fed in batches beside another follower; a
/// follower refuses records past the generation's end and a state with its own draws.
#[test]
fn following_committed_records_continues_as_a_resume_there() {
    let m = model();
    let p = prompt(&m, "stand by");
    let full = generate(&m, &p, &sampled(), &stop(40)).unwrap();
    for (k, n) in [(0usize, 5usize), (3, 17), (10, 39)] {
        let mut s = DecodeState::resume(&m, &p, &full.tokens[..k], sampled(), stop(40), ResumeMode::Exact).unwrap();
        let mut deferred =
            DecodeState::resume_deferred(&m, &p, &full.tokens[..k], sampled(), stop(40), ResumeMode::Exact).unwrap();
        for &t in &full.tokens[k..n] {
            s.follow(t).unwrap();
            DecodeState::feed_pending_batch(&m, &mut [&mut deferred]).unwrap();
            deferred.follow(t).unwrap();
        }
        for st in [&mut s, &mut deferred] {
            let f = st.frontiers();
            assert_eq!((f.sampled, f.committed), (n, n), "followed to {n}");
            let (rest, finish) = st.run_to_end().unwrap();
            assert_eq!(rest, full.tokens[n..], "followed {k}..{n}");
            assert_eq!(finish, StopCause::Length);
        }
    }
    // Several records at once (a follower catching up) land where one at a time do.
    for (k, n) in [(0usize, 1usize), (2, 12), (5, 40)] {
        let mut s = DecodeState::resume(&m, &p, &full.tokens[..k], sampled(), stop(40), ResumeMode::Exact).unwrap();
        s.follow_all(&full.tokens[k..n.min(38)]).unwrap();
        s.follow_all(&full.tokens[n.min(38)..n]).unwrap();
        let (rest, _) = s.run_to_end().unwrap();
        assert_eq!(rest, full.tokens[n..], "followed {k}..{n} in two batches");
    }
    // Fed up to the last record (the next draw needs no forward pass): the same continuation.
    for (k, n) in [(0usize, 1usize), (2, 12), (5, 40)] {
        let mut s = DecodeState::resume(&m, &p, &full.tokens[..k], sampled(), stop(40), ResumeMode::Exact).unwrap();
        s.follow_all_fed(&full.tokens[k..n.min(38)]).unwrap();
        s.follow_all_fed(&full.tokens[n.min(38)..n]).unwrap();
        let f = s.frontiers();
        if n < 40 {
            assert!(s.logits_ready(), "followed {k}..{n}");
            assert_eq!((f.fed, f.kv), (n, p.len() + n));
        } else {
            assert!(s.finished().is_some());
        }
        let (rest, _) = s.run_to_end().unwrap();
        assert_eq!(rest, full.tokens[n..], "followed {k}..{n} fed");
    }
    // The last record ends the generation: nothing more to follow.
    let mut s = DecodeState::resume(&m, &p, &full.tokens[..38], sampled(), stop(40), ResumeMode::Exact).unwrap();
    s.follow(full.tokens[38]).unwrap();
    s.follow(full.tokens[39]).unwrap();
    assert_eq!(s.finished(), Some(&StopCause::Length));
    assert!(s.follow(1).is_err());
    // A state that drew a token of its own is an owner, not a follower.
    let mut owner = DecodeState::start(&m, &p, sampled(), stop(40)).unwrap();
    owner.next_token().unwrap();
    assert!(owner.follow(full.tokens[1]).is_err());
}

/// A prefix cache entry (issue 15 item 6): the cache of the prompt alone, loaded for a
/// generation with k committed records (the rest prefilled), continues as `resume(k)`; a cache
/// longer than the run is refused.
#[test]
fn a_prompt_cache_plus_a_prefill_of_the_rest_continues_as_a_resume() {
    let m = model();
    let p = prompt(&m, "cached prompt");
    let full = generate(&m, &p, &sampled(), &stop(40)).unwrap();
    let mut fresh = DecodeState::start(&m, &p, sampled(), stop(40)).unwrap();
    let cache = fresh.export_cache().unwrap();
    assert_eq!(cache.positions as usize, p.len());
    for k in [0usize, 1, 13, 39] {
        let mut s = DecodeState::resume_from_cache(
            &m,
            &p,
            &full.tokens[..k],
            sampled(),
            stop(40),
            ResumeMode::Exact,
            &cache,
        )
        .unwrap();
        let (rest, _) = s.run_to_end().unwrap();
        assert_eq!(rest, full.tokens[k..], "from the prompt's cache at {k}");
    }
    let short = &p[..p.len() - 1];
    assert!(DecodeState::resume_from_cache(&m, short, &[], sampled(), stop(40), ResumeMode::Exact, &cache).is_err());
}

/// A model that counts the forward passes of its sequences (each `prefill` or `step` call).
struct Counting {
    inner: FakeModel,
    passes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

struct CountingSequence {
    inner: Box<dyn tokenlog_decoder::Sequence>,
    passes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Counting {
    fn passes(&self) -> usize {
        self.passes.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Model for Counting {
    fn identity(&self) -> &tokenlog_decoder::ModelIdentity {
        self.inner.identity()
    }
    fn tokenizer(&self) -> &tokenlog_decoder::Tokenizer {
        self.inner.tokenizer()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn new_sequence(&self) -> tokenlog_decoder::Result<Box<dyn tokenlog_decoder::Sequence>> {
        Ok(Box::new(CountingSequence {
            inner: self.inner.new_sequence()?,
            passes: self.passes.clone(),
        }))
    }
}

impl tokenlog_decoder::Sequence for CountingSequence {
    fn prefill(&mut self, tokens: &[u32]) -> tokenlog_decoder::Result<tokenlog_decoder::Logits> {
        self.passes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.prefill(tokens)
    }
    fn kv_len(&self) -> usize {
        self.inner.kv_len()
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
    fn cache_format(&self) -> Option<String> {
        self.inner.cache_format()
    }
    fn export_cache(&self) -> tokenlog_decoder::Result<Vec<tokenlog_decoder::cache::CacheBlock>> {
        self.inner.export_cache()
    }
    fn export_cache_prefix(
        &self,
        positions: usize,
    ) -> tokenlog_decoder::Result<Vec<tokenlog_decoder::cache::CacheBlock>> {
        self.inner.export_cache_prefix(positions)
    }
    fn prefix_export_bytes(&self, positions: usize) -> Option<usize> {
        self.inner.prefix_export_bytes(positions)
    }
    fn import_cache(
        &mut self,
        blocks: &[tokenlog_decoder::cache::CacheBlock],
        positions: usize,
    ) -> tokenlog_decoder::Result<()> {
        self.inner.import_cache(blocks, positions)
    }
    fn grouping_invariant(&self) -> bool {
        self.inner.grouping_invariant()
    }
    fn export_row(&self, p: usize) -> Option<(u32, Vec<u8>)> {
        self.inner.export_row(p)
    }
    fn append_rows(&mut self, rows: &[(u32, &[u8])]) -> tokenlog_decoder::Result<()> {
        self.inner.append_rows(rows)
    }
}

/// A handoff destination (issue 15): the copy taken while the source decodes on leaves out
/// the last committed position; `resume_from_cache_deferred` loads it without a forward pass,
/// and the first `follow_all_fed` feeds that position and the records the source committed
/// since, in one pass (`resume_from_cache` then `follow_all_fed` takes two). The continuation
/// is the uninterrupted run's, with records to follow, with none, and drawn at once.
#[test]
fn a_handed_over_cache_is_fed_with_the_first_records_in_one_forward_pass() {
    let m = Counting {
        inner: model(),
        passes: Default::default(),
    };
    let p = prompt(&m.inner, "hand me over in one pass");
    let (all, _) = DecodeState::start(&m, &p, sampled(), stop(40))
        .unwrap()
        .run_to_end()
        .unwrap();
    assert!(all.len() >= 16, "{}", all.len());
    for (k, since) in [(0usize, 3usize), (1, 0), (5, 1), (9, 6)] {
        let mut src = DecodeState::start(&m, &p, sampled(), stop(40)).unwrap();
        for _ in 0..k + 1 {
            src.next_token().unwrap().unwrap();
        }
        src.mark_committed(k);
        let cache = src.copy_committed_cache().unwrap();
        let load = |deferred: bool| {
            let f = if deferred {
                DecodeState::resume_from_cache_deferred
            } else {
                DecodeState::resume_from_cache
            };
            f(&m, &p, &all[..k], sampled(), stop(40), ResumeMode::Exact, &cache).unwrap()
        };
        let before = m.passes();
        let mut dst = load(true);
        assert_eq!(m.passes(), before, "loaded without a forward pass ({k})");
        assert!(dst.prefilling() && !dst.logits_ready());
        assert_eq!(dst.covered_positions(), p.len() + k);
        assert!(!dst.copies_while_decoding());
        let before = m.passes();
        dst.follow_all_fed(&all[k..k + since]).unwrap();
        assert_eq!(
            m.passes() - before,
            1,
            "the left-out position and {since} records in one pass"
        );
        assert!(dst.logits_ready() && !dst.prefilling());
        let f = dst.frontiers();
        assert_eq!(
            (f.sampled, f.fed, f.kv, f.committed),
            (k + since, k + since, p.len() + k + since, k + since)
        );
        let (rest, _) = dst.run_to_end().unwrap();
        assert_eq!(rest, all[k + since..], "handed over at {k}, followed {since}");
        // Loaded and prefilled at once, then followed: two passes, the same continuation.
        let before = m.passes();
        let mut eager = load(false);
        eager.follow_all_fed(&all[k..k + since]).unwrap();
        assert_eq!(m.passes() - before, if since == 0 { 1 } else { 2 });
        assert_eq!(eager.run_to_end().unwrap().0, all[k + since..]);
        // Drawn from at once: the deferred position is fed by the first draw.
        let (rest, _) = load(true).run_to_end().unwrap();
        assert_eq!(rest, all[k..], "drawn at {k}");
        // Beside another generation in a batch, as a deferred prefill.
        let mut batched = load(true);
        DecodeState::feed_pending_batch(&m, &mut [&mut batched]).unwrap();
        assert!(batched.logits_ready());
        assert_eq!(batched.run_to_end().unwrap().0, all[k..], "fed in a batch at {k}");
    }
    // A record that ends the generation is taken, not fed; the left-out position is.
    let (n, c) = (all.len(), all.len() - 4);
    let mut src = DecodeState::start(&m, &p, sampled(), stop(40)).unwrap();
    for _ in 0..c + 1 {
        src.next_token().unwrap().unwrap();
    }
    src.mark_committed(c);
    let cache = src.copy_committed_cache().unwrap();
    let mut dst =
        DecodeState::resume_from_cache_deferred(&m, &p, &all[..c], sampled(), stop(40), ResumeMode::Exact, &cache)
            .unwrap();
    dst.follow_all_fed(&all[c..]).unwrap();
    assert!(dst.finished().is_some());
    let f = dst.frontiers();
    assert_eq!((f.sampled, f.fed, f.kv), (n, n - 1, p.len() + n - 1));
}

/// A handoff destination given the rows its source fed past the copy (issue 15): they are
/// appended instead of computed, the last position too when its row carries the logits the
/// source drew from (no forward pass at all), else all but the last; the continuation is the
/// uninterrupted run's; a row that is not the cache after its token is refused whole (the fake
/// model checks its hash chain) and computed instead.
#[test]
fn rows_the_source_fed_past_its_copy_are_appended_and_checked() {
    let m = Counting {
        inner: model(),
        passes: Default::default(),
    };
    let p = prompt(&m.inner, "hand me my rows");
    let (all, _) = DecodeState::start(&m, &p, sampled(), stop(40))
        .unwrap()
        .run_to_end()
        .unwrap();
    let (k, since) = (5usize, 6usize);
    assert!(all.len() > k + since + 1, "{}", all.len());
    for keep in [false, true] {
        let mut src = DecodeState::start(&m, &p, sampled(), stop(40)).unwrap();
        for _ in 0..k + 1 {
            src.next_token().unwrap().unwrap();
        }
        src.mark_committed(k);
        let cache = src.copy_committed_cache().unwrap();
        assert_eq!(cache.positions as usize, p.len() + k - 1);
        // The source decodes on: `since` more records committed, all but its last draw fed.
        src.keep_logits(keep);
        for _ in 0..since {
            src.next_token().unwrap().unwrap();
        }
        src.mark_committed(k + since);
        assert_eq!(src.kv_positions(), p.len() + k + since);
        let last = p.len() + k + since - 1;
        assert_eq!(src.export_row(last).unwrap().logits.is_some(), keep);
        assert_eq!(src.export_row(last - 1).unwrap().logits, None, "only the last draw's");
        let rows = |first: usize, n: usize| (first..first + n).map_while(|q| src.export_row(q)).collect::<Vec<_>>();
        let load = || {
            DecodeState::resume_from_cache_deferred(&m, &p, &all[..k], sampled(), stop(40), ResumeMode::Exact, &cache)
                .unwrap()
        };
        let mut dst = load();
        let before = m.passes();
        dst.follow_all_fed_with(&all[k..k + since], rows).unwrap();
        let (appended, passes) = if keep { (since + 1, 0) } else { (since, 1) };
        assert_eq!(
            (dst.stats().appended_rows, m.passes() - before),
            (appended, passes),
            "logits kept: {keep}"
        );
        assert!(dst.logits_ready());
        assert_eq!(dst.frontiers().kv, p.len() + k + since);
        assert_eq!(dst.run_to_end().unwrap().0, all[k + since..]);
        // A corrupted row: none are appended, all are computed, the same continuation.
        let mut dst = load();
        dst.follow_all_fed_with(&all[k..k + since], |first, n| {
            let mut r = rows(first, n);
            r[2].data[0] ^= 1;
            r
        })
        .unwrap();
        assert_eq!(dst.stats().appended_rows, 0);
        assert_eq!(dst.run_to_end().unwrap().0, all[k + since..]);
        // Rows that run out early: those there are appended, the rest computed.
        let mut dst = load();
        dst.follow_all_fed_with(&all[k..k + since], |first, _| rows(first, 2))
            .unwrap();
        assert_eq!(dst.stats().appended_rows, 2);
        assert_eq!(dst.run_to_end().unwrap().0, all[k + since..]);
    }
}
