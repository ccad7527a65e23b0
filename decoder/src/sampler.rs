//! Sampling and stopping, both rebuilt from `(prompt, committed prefix)` alone (CONTRACT §4).
//!
//! The random draw for generated position `seq` is [`uniform`]`(seed, seq)`: a counter-based
//! hash, so a new owner that continues at `seq = frontier` draws exactly what the old owner
//! would have drawn. Penalty state is a pure function of the prompt and the generated tokens, so
//! [`Sampler::new`] with the committed prefix restores it. [`StopMatcher::new`] does the same for
//! stop strings, EOS and the token budget.

use std::collections::{HashMap, HashSet};

pub use tokenlog_raftlog::types::{FinishReason, SamplingConfig, StopConfig};

use crate::stop::StopText;
use crate::tokenizer::{IncrementalDetokenizer, Tokenizer};

/// Version of the sampling scheme: the RNG ([`uniform`]), the arithmetic of the weights and
/// the order and meaning of the penalties and filters in [`Sampler::choose`]. A change to any
/// of them bumps this, and a decoder refuses generations bound to another version. 2
/// (2026-12-06): the weights' `exp` is the decoder's own (`exp::exp_f64`, the same bits
/// on every machine, vectorized) instead of the C library's; 1: the RNG and everything else as
/// now.
pub const RNG_VERSION: u32 = 2;

/// Candidates first examined for top-p without top-k; grown ×8 until the nucleus fits.
const TOP_P_CANDIDATES_START: usize = 64;

/// SplitMix64's output function (Steele, Lea, Flood 2014): a bijection on u64.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform draw in `[0, 1)` for generated position `seq` of a generation seeded `seed`
/// (since [`RNG_VERSION`] 1): `splitmix64(splitmix64(seed) ^ seq)`, top 53 bits.
pub fn uniform(seed: u64, seq: u32) -> f64 {
    let bits = splitmix64(splitmix64(seed) ^ u64::from(seq));
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Chooses generated tokens. Holds only what the prompt and the generated prefix determine.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingConfig,
    /// Tokens of prompt + generated (repetition penalty).
    seen: HashSet<u32>,
    /// Counts of generated tokens (frequency and presence penalties).
    counts: HashMap<u32, u32>,
    /// Number of generated tokens accepted so far = the `seq` of the next draw.
    seq: u32,
}

impl Sampler {
    /// The sampler positioned after `generated` (the committed prefix; empty for a fresh start).
    pub fn new(params: SamplingConfig, prompt: &[u32], generated: &[u32]) -> Self {
        let mut s = Sampler {
            params,
            seen: prompt.iter().copied().collect(),
            counts: HashMap::new(),
            seq: 0,
        };
        for &t in generated {
            s.accept(t);
        }
        s
    }

    pub fn params(&self) -> &SamplingConfig {
        &self.params
    }

    /// Position of the next draw (= generated tokens accepted).
    pub fn seq(&self) -> u32 {
        self.seq
    }

    /// Chooses the token for position [`Sampler::seq`] from `logits`, without advancing.
    pub fn choose(&self, logits: &[f32]) -> u32 {
        assert!(!logits.is_empty(), "choose needs at least one logit");
        let scores = self.penalized(logits);
        if self.params.is_greedy() {
            return argmax(&scores);
        }
        let u = uniform(self.params.seed, self.seq);
        self.draw(&scores, u)
    }

    /// Records `token` as generated at position [`Sampler::seq`] and advances.
    pub fn accept(&mut self, token: u32) {
        self.seen.insert(token);
        *self.counts.entry(token).or_insert(0) += 1;
        self.seq += 1;
    }

    /// [`Sampler::choose`] then [`Sampler::accept`].
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let t = self.choose(logits);
        self.accept(t);
        t
    }

    fn penalized(&self, logits: &[f32]) -> Vec<f32> {
        let mut s: Vec<f32> = logits
            .iter()
            .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x })
            .collect();
        let p = &self.params;
        if p.repetition_on() {
            for &t in &self.seen {
                if let Some(x) = s.get_mut(t as usize) {
                    *x = if *x > 0.0 {
                        *x / p.repetition_penalty
                    } else {
                        *x * p.repetition_penalty
                    };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &n) in &self.counts {
                if let Some(x) = s.get_mut(t as usize) {
                    *x -= p.frequency_penalty * n as f32 + p.presence_penalty;
                }
            }
        }
        s
    }

    /// Temperature, then top-k, then top-p, then the draw `u` over what is left, in order of
    /// decreasing probability (ties to the lower id) when filtered, in id order otherwise.
    fn draw(&self, scores: &[f32], u: f64) -> u32 {
        let p = &self.params;
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return 0; // every logit -inf or NaN: nothing to prefer
        }
        let inv_t = 1.0 / f64::from(p.temperature);
        let w = crate::exp::exp_weights(scores, max, inv_t);
        let vocab = w.len();
        let top_k = if p.top_k == 0 {
            vocab
        } else {
            (p.top_k as usize).min(vocab)
        };
        if top_k == vocab && !p.top_p_on() {
            let total: f64 = w.iter().sum();
            return pick(w.iter().copied(), u * total) as u32;
        }
        let order = |a: &u32, b: &u32| w[*b as usize].total_cmp(&w[*a as usize]).then(a.cmp(b));
        let mut idx: Vec<u32> = (0..vocab as u32).collect();
        let total_all: f64 = w.iter().sum();
        let mut n = if top_k < vocab || !p.top_p_on() {
            top_k
        } else {
            TOP_P_CANDIDATES_START.min(vocab)
        };
        let (kept, mass) = loop {
            if n < vocab {
                idx.select_nth_unstable_by(n - 1, order);
            }
            idx[..n].sort_unstable_by(order);
            let mass_n: f64 = idx[..n].iter().map(|&i| w[i as usize]).sum();
            // The mass the nucleus is measured against: the top-k set, or everything.
            let base = if top_k < vocab { mass_n } else { total_all };
            if !p.top_p_on() {
                break (n, mass_n);
            }
            let target = f64::from(p.top_p) * base;
            let mut acc = 0.0;
            let found = idx[..n].iter().position(|&i| {
                acc += w[i as usize];
                acc >= target
            });
            match found {
                Some(m) => break (m + 1, acc),
                None if n == top_k => break (n, mass_n),
                None => n = (n * 8).min(top_k),
            }
        };
        let pos = pick(idx[..kept].iter().map(|&i| w[i as usize]), u * mass);
        idx[pos]
    }
}

/// The position of the first weight at which the running sum passes `target`; the last
/// positive weight if rounding leaves `target` at the very end.
fn pick(weights: impl Iterator<Item = f64>, target: f64) -> usize {
    let mut acc = 0.0;
    let mut last_positive = 0;
    for (pos, wt) in weights.enumerate() {
        if wt > 0.0 {
            last_positive = pos;
        }
        acc += wt;
        if acc > target {
            return pos;
        }
    }
    last_positive
}

fn argmax(scores: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in scores.iter().enumerate() {
        if x > scores[best] {
            best = i;
        }
    }
    best as u32
}

/// Why a generation finished, as the decoder saw it; [`StopCause::reason`] is what the log
/// records, and its `Display` the detail clients see.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopCause {
    /// An EOS token was generated.
    Eos { token: u32 },
    /// The generated text reached `stop_strings[index]`.
    StopString { index: usize },
    /// `max_tokens` were generated.
    Length,
    /// The model's context window is full.
    ContextFull,
    /// The decoder could not go on with it (the model or a pipeline stage failed for this
    /// generation alone); the text says why.
    Failed(String),
}

impl std::fmt::Display for StopCause {
    /// The finish detail clients see.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopCause::Eos { token } => write!(f, "end-of-sequence token {token}"),
            StopCause::StopString { index } => write!(f, "stop string #{index}"),
            StopCause::Length => write!(f, "max_tokens reached"),
            StopCause::ContextFull => write!(f, "the model's context window is full"),
            StopCause::Failed(why) => f.write_str(why),
        }
    }
}

impl StopCause {
    /// The log's finish reason for this cause.
    pub fn reason(&self) -> FinishReason {
        match self {
            StopCause::Eos { .. } | StopCause::StopString { .. } => FinishReason::Stop,
            StopCause::Length | StopCause::ContextFull => FinishReason::Length,
            StopCause::Failed(_) => FinishReason::Error,
        }
    }
}

/// Decides after each generated token whether the generation is finished.
#[derive(Clone, Debug)]
pub struct StopMatcher {
    conditions: StopConfig,
    detokenizer: IncrementalDetokenizer,
    /// The stop-string matcher the gateway runs over the same deltas.
    text: StopText,
    generated: u32,
    finished: Option<StopCause>,
}

impl StopMatcher {
    /// The matcher positioned after `generated` (the committed prefix; empty when fresh).
    pub fn new(conditions: StopConfig, tokenizer: &Tokenizer, generated: &[u32]) -> Self {
        let mut m = StopMatcher {
            text: StopText::new(conditions.stop_strings.clone()),
            conditions,
            detokenizer: tokenizer.detokenizer(true),
            generated: 0,
            finished: None,
        };
        for &t in generated {
            m.push(t);
        }
        m
    }

    pub fn conditions(&self) -> &StopConfig {
        &self.conditions
    }

    /// Tokens seen so far.
    pub fn generated(&self) -> u32 {
        self.generated
    }

    pub fn finished(&self) -> Option<&StopCause> {
        self.finished.as_ref()
    }

    /// Takes the next generated token; returns the finish reason if this token ends the
    /// generation (and keeps returning it afterwards, ignoring further tokens).
    pub fn push(&mut self, token: u32) -> Option<StopCause> {
        if self.finished.is_some() {
            return self.finished.clone();
        }
        self.generated += 1;
        let reason = if self.conditions.eos_token_ids.contains(&token) {
            Some(StopCause::Eos { token })
        } else if let Some(index) = self.match_stop_string(token) {
            Some(StopCause::StopString { index })
        } else if self.conditions.max_tokens > 0 && self.generated >= self.conditions.max_tokens {
            Some(StopCause::Length)
        } else {
            None
        };
        self.finished = reason.clone();
        reason
    }

    fn match_stop_string(&mut self, token: u32) -> Option<usize> {
        let delta = self.detokenizer.push(token);
        if self.conditions.stop_strings.is_empty() || delta.is_empty() {
            return None;
        }
        self.text.push(&delta);
        self.text.hit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(n: usize, salt: u64) -> Vec<f32> {
        (0..n).map(|i| (uniform(salt, i as u32) * 8.0 - 4.0) as f32).collect()
    }

    #[test]
    fn rng_v1_is_pinned() {
        // Changing these values changes every sampled generation: bump RNG_VERSION instead.
        let got: Vec<u64> = (0..3).map(|s| (uniform(42, s) * (1u64 << 53) as f64) as u64).collect();
        assert_eq!(got, RNG_V1_SEED42);
        assert!((0..10_000).all(|s| (0.0..1.0).contains(&uniform(7, s))));
    }
    const RNG_V1_SEED42: [u64; 3] = [3_092_098_744_885_774, 8_560_785_262_482_024, 4_022_505_963_573_781];

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let s = Sampler::new(SamplingConfig::greedy(), &[], &[]);
        assert_eq!(s.choose(&[0.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(s.choose(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn resume_at_k_draws_like_uninterrupted() {
        let params = SamplingConfig {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 0,
            repetition_penalty: 1.1,
            frequency_penalty: 0.3,
            presence_penalty: 0.2,
            seed: 1234,
            rng_version: RNG_VERSION,
        };
        let prompt = [1u32, 2, 3];
        let steps = 40;
        let mut full = Sampler::new(params.clone(), &prompt, &[]);
        let tokens: Vec<u32> = (0..steps).map(|i| full.sample(&logits(300, i as u64))).collect();
        for k in [0usize, 1, 7, 20, 39] {
            let mut resumed = Sampler::new(params.clone(), &prompt, &tokens[..k]);
            assert_eq!(resumed.seq(), k as u32);
            let rest: Vec<u32> = (k..steps).map(|i| resumed.sample(&logits(300, i as u64))).collect();
            assert_eq!(rest, tokens[k..], "resume at {k}");
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_filters() {
        // Two heavy tokens (ids 3, 5), the rest far below.
        let mut l = vec![-10.0f32; 50];
        l[3] = 2.0;
        l[5] = 2.0 + (3.0f32).ln(); // 3x as likely as id 3
        let base = SamplingConfig {
            temperature: 1.0,
            seed: 9,
            ..Default::default()
        };
        let count = |params: SamplingConfig| {
            let mut s = Sampler::new(params, &[], &[]);
            let mut hits = HashMap::new();
            for _ in 0..4000 {
                *hits.entry(s.sample(&l)).or_insert(0u32) += 1;
            }
            hits
        };
        let h = count(base.clone());
        let r = f64::from(h[&5]) / f64::from(h[&3]);
        assert!((2.5..3.6).contains(&r), "ratio {r}");
        let h = count(SamplingConfig {
            top_k: 1,
            ..base.clone()
        });
        assert_eq!(h.len(), 1);
        assert!(h.contains_key(&5));
        let h = count(SamplingConfig {
            top_p: 0.9,
            ..base.clone()
        });
        assert_eq!(h.keys().copied().collect::<HashSet<_>>(), HashSet::from([3, 5]));
        let h = count(SamplingConfig { top_p: 0.5, ..base });
        assert_eq!(h.keys().copied().collect::<Vec<_>>(), vec![5]);
    }

    #[test]
    fn penalties_use_prompt_and_generated_as_documented() {
        let l = [1.0f32, 1.0, 0.5];
        // Repetition penalty counts the prompt: token 0 (prompt) is pushed below token 1.
        let s = Sampler::new(
            SamplingConfig {
                repetition_penalty: 2.0,
                ..Default::default()
            },
            &[0],
            &[],
        );
        assert_eq!(s.choose(&l), 1);
        // Frequency/presence penalties ignore the prompt ...
        let freq = SamplingConfig {
            frequency_penalty: 0.3,
            ..Default::default()
        };
        assert_eq!(Sampler::new(freq.clone(), &[0], &[]).choose(&l), 0);
        // ... and scale with the generated count: 0 twice (-0.6) and 1 once (-0.3) fall
        // below token 2.
        let l2 = [1.0f32, 0.75, 0.5];
        assert_eq!(Sampler::new(freq.clone(), &[], &[0]).choose(&l2), 1);
        assert_eq!(Sampler::new(freq, &[], &[0, 0, 1]).choose(&l2), 2);
        let s = Sampler::new(
            SamplingConfig {
                presence_penalty: 0.6,
                ..Default::default()
            },
            &[],
            &[0, 1],
        );
        assert_eq!(s.choose(&l), 2);
    }
}
