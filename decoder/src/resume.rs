//! One generation's decoding state, started fresh or resumed from a committed prefix
//! (CONTRACT §4).
//!
//! An uninterrupted run is: prefill the prompt in one batch, then for each generated token:
//! sample it, then feed it with one `step`. Resuming from `k` committed tokens:
//! - [`ResumeMode::Exact`] gives the logits of the uninterrupted run's position `k` bit for bit
//!   on the same device and build, so (the RNG being a function of `(seed, seq)`) the
//!   continuation is the same. A [`Sequence::grouping_invariant`] sequence (the CPU engine)
//!   gets prompt and prefix in one prefill, as fast as a fresh prompt; any other repeats the
//!   uninterrupted run's very calls: the prompt in one batch, then each committed token with its
//!   own `step` (one decode step per committed token).
//! - [`ResumeMode::Fast`] prefills prompt and committed tokens in one batch. The quantized matmul
//!   quantizes activations per call, so logits differ slightly and the continuation may diverge
//!   after the committed prefix (never inside it: the prefix is input, not output).

use std::time::{Duration, Instant};

use crate::cache::{CacheCopy, CacheExport};
use crate::error::{Error, Result};
use crate::model::{Logits, Model, Sequence};
use crate::sampler::{Sampler, SamplingConfig, StopCause, StopConfig, StopMatcher};

pub use tokenlog_raftlog::types::ResumeMode;

/// The four frontiers of a generation on its decoder, in generated-token units except `kv`.
/// They are never confused: a token can be sampled and not yet fed, fed and not yet committed,
/// committed and not yet fed (right after a fast resume they coincide).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Frontiers {
    /// Prompt length; `kv` counts it, the others do not.
    pub prompt_len: usize,
    /// Generated tokens drawn by the sampler (= `seq` of the next draw).
    pub sampled: usize,
    /// Generated tokens fed to the model.
    pub fed: usize,
    /// Positions whose KV is materialized (prompt + fed).
    pub kv: usize,
    /// Generated tokens known committed in the log (told by the worker).
    pub committed: usize,
}

impl Frontiers {
    /// Panics if the frontiers are inconsistent. Kept on in release builds: a violation means
    /// the decoder no longer knows what it wrote.
    pub fn check(&self) {
        assert!(
            self.committed <= self.sampled,
            "committed {} ahead of sampled {}",
            self.committed,
            self.sampled
        );
        assert!(
            self.fed <= self.sampled,
            "fed {} ahead of sampled {}",
            self.fed,
            self.sampled
        );
        if self.kv == 0 {
            // No KV cache built (a resume that found the generation already finished).
            assert_eq!(self.fed, 0, "nothing fed without a KV cache");
            return;
        }
        assert!(
            self.sampled <= self.fed + 1,
            "fed {} vs sampled {}: at most one sampled token awaits feeding",
            self.fed,
            self.sampled
        );
        assert_eq!(self.kv, self.prompt_len + self.fed, "kv positions = prompt + fed");
    }
}

/// One generated token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// Its position among generated tokens (the record's seq).
    pub seq: u32,
    pub token: u32,
    /// Set when this token is the generation's last.
    pub finish: Option<StopCause>,
}

/// What a resume cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResumeStats {
    pub mode: ResumeMode,
    /// Time of the batched prefill (prompt, or prompt + prefix in fast mode).
    pub prefill: Duration,
    /// Time replaying committed tokens one by one (exact mode).
    pub replay: Duration,
    /// Committed tokens fed one by one (exact mode).
    pub replayed_tokens: usize,
    /// Positions taken as rows another holder computed instead of computed here
    /// ([`DecodeState::follow_all_fed_with`]).
    pub appended_rows: usize,
}

/// One position's keys and values as another holder of the generation computed them
/// ([`DecodeState::export_row`]), with the token fed there and, when it has them, the logits of
/// its output.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub token: u32,
    /// In the sequence's cache format ([`Sequence::export_row`]).
    pub data: Vec<u8>,
    pub logits: Option<Logits>,
}

/// What [`DecodeState::from_cache`] takes: a whole cache (with logits), or a partial one whose
/// positions past it are prefilled at once or deferred.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Load {
    Whole,
    Partial,
    PartialDeferred,
}

/// A generation being decoded: sequence, sampler, stop matcher and frontiers, advanced together.
pub struct DecodeState {
    sequence: Box<dyn Sequence>,
    sampler: Sampler,
    stop: StopMatcher,
    frontiers: Frontiers,
    max_context: usize,
    /// Logits for position `frontiers.sampled`, when the last sampled token has been fed.
    logits: Option<Logits>,
    /// While [`DecodeState::keep_logits`] is on: the logits of the last draw and the position
    /// whose output they are (a handoff source streams them with that position's row).
    kept_logits: Option<(usize, Logits)>,
    keep_logits: bool,
    /// The last sampled token while it awaits feeding (fed lazily, at the next draw).
    unfed: Option<u32>,
    /// A deferred prefill's positions not fed yet ([`DecodeState::resume_deferred`]); the
    /// frontiers count them as not fed until the last chunk is in.
    to_prefill: Vec<u32>,
    finished: Option<StopCause>,
    stats: ResumeStats,
}

impl std::fmt::Debug for DecodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeState")
            .field("frontiers", &self.frontiers)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl DecodeState {
    /// A fresh generation: prefills the prompt.
    pub fn start(model: &dyn Model, prompt: &[u32], params: SamplingConfig, stop: StopConfig) -> Result<Self> {
        Self::resume(model, prompt, &[], params, stop, ResumeMode::Exact)
    }

    /// Continues a generation whose first `committed.len()` tokens are committed: restores the
    /// sampler (RNG position, penalty counts) and stop matcher from the prefix, rebuilds the KV
    /// cache per `mode`. If the prefix already finishes the generation, nothing is prefilled
    /// and [`DecodeState::finished`] says why.
    pub fn resume(
        model: &dyn Model,
        prompt: &[u32],
        committed: &[u32],
        params: SamplingConfig,
        stop: StopConfig,
        mode: ResumeMode,
    ) -> Result<Self> {
        Self::resume_inner(model, prompt, committed, params, stop, mode, false)
    }

    /// [`DecodeState::resume`] without the prefill where the sequence is
    /// [`Sequence::grouping_invariant`]: its positions are fed later, a chunk per
    /// [`DecodeState::feed_pending_batch`] ([`crate::limits::PREFILL_CHUNK_TOKENS`]), beside
    /// other generations' steps, or all at once by the first draw. The logits come out the
    /// same. Other sequences prefill here, as `resume` does.
    pub fn resume_deferred(
        model: &dyn Model,
        prompt: &[u32],
        committed: &[u32],
        params: SamplingConfig,
        stop: StopConfig,
        mode: ResumeMode,
    ) -> Result<Self> {
        Self::resume_inner(model, prompt, committed, params, stop, mode, true)
    }

    fn resume_inner(
        model: &dyn Model,
        prompt: &[u32],
        committed: &[u32],
        params: SamplingConfig,
        stop: StopConfig,
        mode: ResumeMode,
        defer: bool,
    ) -> Result<Self> {
        let max_context = model.max_context();
        if prompt.is_empty() {
            return Err(Error::Invalid("empty prompt".into()));
        }
        if prompt.len() > max_context {
            return Err(Error::ContextFull {
                needed: prompt.len(),
                max: max_context,
            });
        }
        let sampler = Sampler::new(params, prompt, committed);
        let stop = StopMatcher::new(stop, model.tokenizer(), committed);
        let k = committed.len();
        let mut finished = stop.finished().cloned();
        // The uninterrupted run ended at the token that would not fit in the context.
        if finished.is_none() && k > 0 && prompt.len() + k > max_context {
            finished = Some(StopCause::ContextFull);
        }
        let mut state = DecodeState {
            sequence: model.new_sequence()?,
            sampler,
            stop,
            frontiers: Frontiers {
                prompt_len: prompt.len(),
                sampled: k,
                fed: k,
                kv: 0,
                committed: k,
            },
            max_context,
            logits: None,
            unfed: None,
            kept_logits: None,
            keep_logits: false,
            to_prefill: Vec::new(),
            finished,
            stats: ResumeStats {
                mode,
                ..Default::default()
            },
        };
        if state.finished.is_some() {
            // Nothing left to decode; the KV cache is never built.
            state.frontiers.fed = 0;
            state.frontiers.check();
            return Ok(state);
        }
        if defer && state.sequence.grouping_invariant() {
            state.to_prefill.reserve(prompt.len() + k);
            state.to_prefill.extend_from_slice(prompt);
            state.to_prefill.extend_from_slice(committed);
            // Not fed until the last chunk is in.
            state.frontiers.fed = 0;
            state.frontiers.check();
            return Ok(state);
        }
        state.rebuild(prompt, committed, mode)?;
        state.frontiers.check();
        Ok(state)
    }

    /// Continues a generation from a cache handed over by its previous owner (a planned
    /// handoff) instead of rebuilding it: the sampler and stop matcher are restored from the
    /// committed prefix as in [`DecodeState::resume`], the cache and the logits of the next
    /// position are taken as they are. The next token is then the one the source would have
    /// drawn (the same numbers, whatever the mode). Refused: a cache of another layout, of other
    /// than `prompt + committed` positions, logits of another vocabulary, or a prefix that
    /// already ends the generation.
    pub fn import(
        model: &dyn Model,
        prompt: &[u32],
        committed: &[u32],
        params: SamplingConfig,
        stop: StopConfig,
        mode: ResumeMode,
        cache: &CacheExport,
    ) -> Result<Self> {
        Self::from_cache(model, prompt, committed, params, stop, mode, cache, Load::Whole)
    }

    /// Continues a generation from a prefix cache entry (issue 15 item 6): `cache` holds the
    /// first `cache.positions` positions of `prompt + committed` (the caller matched the token
    /// ids), which are loaded as they are; the positions after them are prefilled in one call.
    /// Exact only on a [`Sequence::grouping_invariant`] sequence (a prefill after a loaded
    /// cache is the bits of the whole prefill), so any other is refused in exact mode.
    pub fn resume_from_cache(
        model: &dyn Model,
        prompt: &[u32],
        committed: &[u32],
        params: SamplingConfig,
        stop: StopConfig,
        mode: ResumeMode,
        cache: &CacheExport,
    ) -> Result<Self> {
        Self::from_cache(model, prompt, committed, params, stop, mode, cache, Load::Partial)
    }

    /// [`DecodeState::resume_from_cache`] without the prefill of the positions past the cache
    /// where the sequence is [`Sequence::grouping_invariant`]: they are fed by the first
    /// [`DecodeState::follow_all_fed`] in the same call as its records (a handoff destination
    /// catching up: one forward pass fewer), or by the first draw or
    /// [`DecodeState::feed_pending_batch`] as a deferred prefill. The logits come out the same.
    pub fn resume_from_cache_deferred(
        model: &dyn Model,
        prompt: &[u32],
        committed: &[u32],
        params: SamplingConfig,
        stop: StopConfig,
        mode: ResumeMode,
        cache: &CacheExport,
    ) -> Result<Self> {
        Self::from_cache(
            model,
            prompt,
            committed,
            params,
            stop,
            mode,
            cache,
            Load::PartialDeferred,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn from_cache(
        model: &dyn Model,
        prompt: &[u32],
        committed: &[u32],
        params: SamplingConfig,
        stop: StopConfig,
        mode: ResumeMode,
        cache: &CacheExport,
        load: Load,
    ) -> Result<Self> {
        let partial = load != Load::Whole;
        if prompt.is_empty() {
            return Err(Error::Invalid("empty prompt".into()));
        }
        let k = committed.len();
        let positions = prompt.len() + k;
        let cached = cache.positions as usize;
        let fits = if partial {
            cached > 0 && cached <= positions
        } else {
            cached == positions
        };
        if !fits {
            return Err(Error::Invalid(format!(
                "the cache holds {} positions; prompt and committed prefix are {positions}",
                cache.positions
            )));
        }
        // A partial cache's logits are those of its prefill here.
        if cached == positions && cache.logits.len() != model.vocab_size() {
            return Err(Error::Invalid(format!(
                "the cache carries {} logits for a vocabulary of {}",
                cache.logits.len(),
                model.vocab_size()
            )));
        }
        let mut sequence = model.new_sequence()?;
        match sequence.cache_format() {
            Some(f) if f == cache.format => {}
            f => {
                return Err(Error::Unsupported(format!(
                    "a cache of format {:?} cannot be loaded by a sequence of format {f:?}",
                    cache.format
                )))
            }
        }
        let stop = StopMatcher::new(stop, model.tokenizer(), committed);
        if let Some(f) = stop.finished() {
            return Err(Error::Invalid(format!(
                "the committed prefix already ends the generation ({f})"
            )));
        }
        if cached < positions && mode == ResumeMode::Exact && !sequence.grouping_invariant() {
            return Err(Error::Unsupported(
                "an exact resume from a partial cache needs a grouping-invariant sequence".into(),
            ));
        }
        let t0 = Instant::now();
        sequence.import_cache(&cache.blocks, cached)?;
        let mut to_prefill = Vec::new();
        let logits = if cached < positions {
            let rest: Vec<u32> = prompt.iter().chain(committed).skip(cached).copied().collect();
            if load == Load::PartialDeferred && sequence.grouping_invariant() {
                to_prefill = rest;
                None
            } else {
                Some(sequence.prefill(&rest)?)
            }
        } else {
            Some(cache.logits.clone())
        };
        // A deferred rest counts as not fed until it is in (as after `resume_deferred`).
        let (fed, kv) = if to_prefill.is_empty() { (k, positions) } else { (0, 0) };
        let state = DecodeState {
            sequence,
            sampler: Sampler::new(params, prompt, committed),
            stop,
            frontiers: Frontiers {
                prompt_len: prompt.len(),
                sampled: k,
                fed,
                kv,
                committed: k,
            },
            max_context: model.max_context(),
            logits,
            unfed: None,
            kept_logits: None,
            keep_logits: false,
            to_prefill,
            finished: None,
            stats: ResumeStats {
                mode,
                prefill: t0.elapsed(),
                ..Default::default()
            },
        };
        state.frontiers.check();
        Ok(state)
    }

    /// This generation's cache and the logits of the position it samples next, for a planned
    /// handoff (feeds the last sampled token first). Only between steps with every sampled
    /// token committed: the cache then covers exactly the committed prefix.
    pub fn export_cache(&mut self) -> Result<CacheExport> {
        if let Some(f) = &self.finished {
            return Err(Error::Invalid(format!(
                "a finished generation ({f}) is not handed over"
            )));
        }
        if self.frontiers.sampled != self.frontiers.committed {
            return Err(Error::Invalid(format!(
                "{} sampled tokens are not committed yet",
                self.frontiers.sampled - self.frontiers.committed
            )));
        }
        let format = self
            .sequence
            .cache_format()
            .ok_or_else(|| Error::Unsupported("this model cannot hand over its cache".into()))?;
        self.feed_pending()?;
        let logits = self
            .logits
            .clone()
            .expect("logits are ready after feeding: the invariant of an unfinished state");
        let blocks = self.sequence.export_cache()?;
        Ok(CacheExport {
            format,
            positions: self.frontiers.kv as u32,
            blocks,
            logits,
        })
    }

    /// The positions [`DecodeState::copy_committed_cache`] would copy, when it can: an
    /// unfinished state of a grouping-invariant sequence whose deferred prefill (if any) is
    /// done, with at least one such position, a copy of no more than
    /// `limits::CACHE_COPY_IN_STEP_BYTES_MAX` to take them ([`Sequence::snapshot_copy_bytes`]),
    /// and a sequence that gives them.
    fn committed_copy_positions(&self) -> Option<usize> {
        if self.finished.is_some()
            || self.prefilling()
            || !self.sequence.grouping_invariant()
            || self.sequence.cache_format().is_none()
        {
            return None;
        }
        let positions = self
            .sequence
            .kv_len()
            .min((self.frontiers.prompt_len + self.frontiers.committed).saturating_sub(1));
        let bytes = self.sequence.snapshot_copy_bytes(positions)?;
        (positions >= 1 && bytes <= crate::limits::CACHE_COPY_IN_STEP_BYTES_MAX).then_some(positions)
    }

    /// Whether [`DecodeState::copy_committed_cache`] works on this state now: a copy for a
    /// planned handoff taken between two steps, without pausing the generation.
    pub fn copies_while_decoding(&self) -> bool {
        self.committed_copy_positions().is_some()
    }

    /// A copy of this generation's cache over its committed positions but the last (at most
    /// what is fed: prompt + committed - 1), without logits, for a planned handoff while it
    /// decodes on. No model call and no wait for the answers in flight: the destination
    /// prefills the committed positions past the copy, which on a
    /// [`Sequence::grouping_invariant`] sequence gives the bits this state holds. When
    /// [`DecodeState::copies_while_decoding`] says no: `Unsupported` (the caller copies with
    /// [`DecodeState::export_cache`] once every sampled token is committed).
    pub fn copy_committed_cache(&self) -> Result<CacheExport> {
        self.snapshot_committed_cache()?.export()
    }

    /// [`DecodeState::copy_committed_cache`] taken now, its blocks built later
    /// ([`CacheCopy::export`]): on the CPU engine this shares the cache's chunks of positions
    /// instead of copying them, so the step that takes it is not held up by a copy.
    pub fn snapshot_committed_cache(&self) -> Result<CacheCopy> {
        if let Some(f) = &self.finished {
            return Err(Error::Invalid(format!(
                "a finished generation ({f}) is not handed over"
            )));
        }
        let positions = self.committed_copy_positions().ok_or_else(|| {
            Error::Unsupported("this cache is copied only with every sampled token fed and committed".into())
        })?;
        let format = self
            .sequence
            .cache_format()
            .expect("checked by committed_copy_positions");
        let blocks = self.sequence.snapshot_cache_prefix(positions)?;
        Ok(CacheCopy {
            format,
            positions: positions as u32,
            blocks,
            logits: Vec::new(),
        })
    }

    fn rebuild(&mut self, prompt: &[u32], committed: &[u32], mode: ResumeMode) -> Result<()> {
        let t0 = Instant::now();
        let logits = match mode {
            // One call gives the very logits of the uninterrupted run's calls.
            ResumeMode::Exact if self.sequence.grouping_invariant() => {
                let mut all = Vec::with_capacity(prompt.len() + committed.len());
                all.extend_from_slice(prompt);
                all.extend_from_slice(committed);
                let logits = self.sequence.prefill(&all)?;
                self.stats.prefill = t0.elapsed();
                logits
            }
            ResumeMode::Exact => {
                let mut logits = self.sequence.prefill(prompt)?;
                self.stats.prefill = t0.elapsed();
                let t1 = Instant::now();
                for &t in committed {
                    logits = self.sequence.step(t)?;
                }
                self.stats.replay = t1.elapsed();
                self.stats.replayed_tokens = committed.len();
                logits
            }
            ResumeMode::Fast => {
                let mut all = Vec::with_capacity(prompt.len() + committed.len());
                all.extend_from_slice(prompt);
                all.extend_from_slice(committed);
                let logits = self.sequence.prefill(&all)?;
                self.stats.prefill = t0.elapsed();
                logits
            }
        };
        self.frontiers.kv = self.sequence.kv_len();
        self.logits = Some(logits);
        Ok(())
    }

    /// Samples the next token (feeding the previous one first). `None` once finished.
    pub fn next_token(&mut self) -> Result<Option<Step>> {
        if self.finished.is_some() {
            return Ok(None);
        }
        self.feed_pending()?;
        let logits = self
            .logits
            .take()
            .expect("logits are ready after feeding: the invariant of an unfinished state");
        let seq = self.sampler.seq();
        assert_eq!(seq as usize, self.frontiers.sampled);
        let token = self.sampler.sample(&logits);
        if self.keep_logits {
            self.kept_logits = Some((self.frontiers.kv - 1, logits));
        }
        self.frontiers.sampled += 1;
        let mut finish = self.stop.push(token);
        // Another draw needs this token fed: one more position.
        if finish.is_none() && self.frontiers.kv + 1 > self.max_context {
            finish = Some(StopCause::ContextFull);
        }
        match &finish {
            None => self.unfed = Some(token),
            Some(reason) => self.finished = Some(reason.clone()),
        }
        self.frontiers.check();
        Ok(Some(Step { seq, token, finish }))
    }

    /// Feeds the last sampled token if it is still waiting (the worker may call this while an
    /// append is in flight, to overlap compute with replication).
    pub fn feed_pending(&mut self) -> Result<()> {
        if self.prefilling() {
            let rest = std::mem::take(&mut self.to_prefill);
            let t0 = Instant::now();
            let logits = self.sequence.prefill(&rest)?;
            self.stats.prefill += t0.elapsed();
            self.prefilled(logits);
            return Ok(());
        }
        if let Some(t) = self.unfed.take() {
            self.logits = Some(self.sequence.step(t)?);
            self.frontiers.fed += 1;
            self.frontiers.kv = self.sequence.kv_len();
            self.frontiers.check();
        }
        Ok(())
    }

    /// [`DecodeState::feed_pending`] for many generations of `model` at once: their pending
    /// tokens go through one [`Model::prefill_batch`] (one forward pass where the model
    /// batches), each getting the logits it would get alone. Returns the first failure; a
    /// failed generation cannot draw again (as after a failed `feed_pending`).
    pub fn feed_pending_batch(model: &dyn Model, states: &mut [&mut DecodeState]) -> Result<()> {
        Self::feed_pending_batch_each(model, states).into_iter().collect()
    }

    /// [`DecodeState::feed_pending_batch`], with each state's own outcome (in the order of
    /// `states`): one generation's failure leaves the others fed.
    pub fn feed_pending_batch_each(model: &dyn Model, states: &mut [&mut DecodeState]) -> Vec<Result<()>> {
        // Per state: what goes in (its pending token, or the next chunk of a deferred prefill)
        // and whether that is a prefill chunk.
        let inputs: Vec<Option<(Vec<u32>, bool)>> = states
            .iter_mut()
            .map(|s| {
                if s.prefilling() {
                    let n = s.to_prefill.len().min(crate::limits::PREFILL_CHUNK_TOKENS);
                    Some((s.to_prefill.drain(..n).collect(), true))
                } else {
                    s.unfed.take().map(|t| (vec![t], false))
                }
            })
            .collect();
        let fed = inputs.iter().filter(|t| t.is_some()).count();
        let mut outcomes: Vec<Result<()>> = states.iter().map(|_| Ok(())).collect();
        if fed == 0 {
            return outcomes;
        }
        let t0 = Instant::now();
        let results = {
            let mut items: Vec<(&mut dyn Sequence, &[u32])> = states
                .iter_mut()
                .zip(&inputs)
                .filter_map(|(s, t)| t.as_ref().map(|(t, _)| (&mut *s.sequence as &mut dyn Sequence, &t[..])))
                .collect();
            model.prefill_batch(&mut items)
        };
        let took = t0.elapsed();
        assert_eq!(results.len(), fed, "one result per fed generation");
        let mut results = results.into_iter();
        for ((s, t), outcome) in states.iter_mut().zip(&inputs).zip(outcomes.iter_mut()) {
            let Some((_, chunk)) = t else {
                continue;
            };
            match results.next().expect("counted") {
                Ok(logits) if *chunk => {
                    s.stats.prefill += took;
                    if !s.prefilling() {
                        s.prefilled(logits);
                    }
                }
                Ok(logits) => {
                    s.logits = Some(logits);
                    s.frontiers.fed += 1;
                    s.frontiers.kv = s.sequence.kv_len();
                    s.frontiers.check();
                }
                Err(e) => *outcome = Err(e),
            }
        }
        outcomes
    }

    /// Takes `token`, committed by the generation's owner at position [`Frontiers::sampled`],
    /// as if this state had drawn it (a hot standby following the log, issue 15 item 3): the
    /// sampler (RNG position, penalty counts) and the stop matcher advance as at a draw, and the
    /// token is fed lazily, one position per call, as the uninterrupted run fed it. So
    /// `resume(k)` followed by `follow` of records `k..n` is `resume(n)`: on a takeover the next
    /// draw costs one decode step. Only while every token is committed (a standby samples
    /// nothing of its own); refused once the followed tokens end the generation.
    pub fn follow(&mut self, token: u32) -> Result<()> {
        self.check_follower()?;
        self.feed_pending()?;
        // The owner drew this position from these logits; the follower only needs the cache.
        self.logits = None;
        if self.accept_followed(token).is_none() {
            self.unfed = Some(token);
        }
        self.frontiers.check();
        Ok(())
    }

    /// [`DecodeState::follow`] of several records: on a [`Sequence::grouping_invariant`]
    /// sequence all but the last go through the model in one call (the same bits as one call
    /// each), so a follower that fell behind catches up in one forward pass; on any other, one
    /// position per call, as the owner fed them.
    pub fn follow_all(&mut self, tokens: &[u32]) -> Result<()> {
        let Some((&last, rest)) = tokens.split_last() else {
            return Ok(());
        };
        if rest.is_empty() || !self.sequence.grouping_invariant() {
            return tokens.iter().try_for_each(|&t| self.follow(t));
        }
        self.check_follower()?;
        self.feed_pending()?;
        for &t in rest {
            if let Some(f) = self.accept_followed(t) {
                return Err(Error::Invalid(format!(
                    "record {} ended the generation ({f}); records follow it",
                    self.frontiers.sampled - 1
                )));
            }
        }
        let t0 = Instant::now();
        self.logits = Some(self.sequence.prefill(rest)?);
        self.stats.replay += t0.elapsed();
        self.frontiers.fed += rest.len();
        self.frontiers.kv = self.sequence.kv_len();
        self.follow(last)
    }

    /// [`DecodeState::follow_all`] with the last record fed too, so that the next draw needs no
    /// forward pass (a destination about to take a generation over): on a
    /// [`Sequence::grouping_invariant`] sequence all of them in one call. A record that ends the
    /// generation is not fed, as with `follow`.
    ///
    /// A deferred prefill not done yet goes into the same call, ahead of the records.
    pub fn follow_all_fed(&mut self, tokens: &[u32]) -> Result<()> {
        self.follow_all_fed_with(tokens, |_, _| Vec::new())
    }

    /// [`DecodeState::follow_all_fed`] that first takes rows another holder of the generation
    /// computed ([`DecodeState::export_row`]; a handoff destination gets them from the source):
    /// `rows(first, n)` gives rows of consecutive positions from `first` (at most `n`, maybe
    /// none), and those whose tokens are the ones fed at their positions are appended
    /// ([`Sequence::append_rows`]) instead of computed. The last position is computed unless
    /// its row carries its logits (the next draw's), so that with every row at hand following
    /// costs no forward pass. The same bits as without rows on a grouping-invariant sequence;
    /// rows that do not fit are left and computed.
    pub fn follow_all_fed_with(&mut self, tokens: &[u32], rows: impl FnOnce(usize, usize) -> Vec<Row>) -> Result<()> {
        if !self.sequence.grouping_invariant() || (tokens.is_empty() && !self.prefilling()) {
            self.follow_all(tokens)?;
            return match self.finished {
                None => self.feed_pending(),
                Some(_) => Ok(()),
            };
        }
        self.check_follower()?;
        // The positions before the records: a deferred prefill's, or the last record followed.
        let mut input = std::mem::take(&mut self.to_prefill);
        if input.is_empty() {
            self.feed_pending()?;
        }
        let base = self.frontiers.sampled;
        let mut fed = tokens.len();
        for (i, &t) in tokens.iter().enumerate() {
            if let Some(f) = self.accept_followed(t) {
                if i + 1 < tokens.len() {
                    return Err(Error::Invalid(format!(
                        "record {} ended the generation ({f}); records follow it",
                        self.frontiers.sampled - 1
                    )));
                }
                fed = i;
            }
        }
        self.logits = None;
        input.extend_from_slice(&tokens[..fed]);
        if !input.is_empty() {
            let t0 = Instant::now();
            let mut given = rows(self.sequence.kv_len(), input.len());
            let fit = given.iter().zip(&input).take_while(|(r, i)| r.token == **i).count();
            // Every position as a row: the last one's logits from its row (none needed when
            // a record ended the generation); else the last position is computed.
            let whole = fit == input.len() && (self.finished.is_some() || given[fit - 1].logits.is_some());
            let take = if whole { fit } else { fit.min(input.len() - 1) };
            let mut row_logits = None;
            if take > 0 {
                let fit_rows: Vec<(u32, &[u8])> = given[..take].iter().map(|r| (r.token, &r.data[..])).collect();
                match self.sequence.append_rows(&fit_rows) {
                    Ok(()) => {
                        input.drain(..take);
                        self.stats.appended_rows += take;
                        row_logits = given[take - 1].logits.take();
                    }
                    Err(e) => tracing::warn!(error = %e, rows = take, "rows not appended: computing them"),
                }
            }
            let logits = if input.is_empty() {
                row_logits.unwrap_or_default()
            } else {
                self.sequence.prefill(&input)?
            };
            self.stats.replay += t0.elapsed();
            self.frontiers.fed = base + fed;
            self.frontiers.kv = self.sequence.kv_len();
            if self.finished.is_none() {
                self.logits = Some(logits);
            }
        }
        self.frontiers.check();
        Ok(())
    }

    /// Why this state cannot follow records: it finished, or it drew tokens of its own.
    fn check_follower(&self) -> Result<()> {
        if let Some(f) = &self.finished {
            return Err(Error::Invalid(format!(
                "the generation ended ({f}): record {} has nothing to follow",
                self.frontiers.sampled
            )));
        }
        if self.frontiers.sampled != self.frontiers.committed {
            return Err(Error::Invalid(format!(
                "{} tokens of this state's own are not committed: it is not a follower",
                self.frontiers.sampled - self.frontiers.committed
            )));
        }
        Ok(())
    }

    /// Takes a committed record as drawn (sampler, stop matcher, frontiers), without feeding
    /// it; what ends the generation with it, if anything.
    fn accept_followed(&mut self, token: u32) -> Option<StopCause> {
        self.sampler.accept(token);
        self.frontiers.sampled += 1;
        self.frontiers.committed += 1;
        let mut finish = self.stop.push(token);
        // Another record would need this one fed: one more position.
        if finish.is_none() && self.frontiers.prompt_len + self.frontiers.sampled > self.max_context {
            finish = Some(StopCause::ContextFull);
        }
        if let Some(f) = &finish {
            self.finished = Some(f.clone());
        }
        finish
    }

    /// Whether a deferred prefill still has positions to feed.
    pub fn prefilling(&self) -> bool {
        !self.to_prefill.is_empty()
    }

    /// Positions of a deferred prefill not fed yet.
    pub fn deferred_prefill(&self) -> usize {
        self.to_prefill.len()
    }

    /// The last chunk of a deferred prefill is in: the committed prefix counts as fed.
    fn prefilled(&mut self, logits: Logits) {
        self.logits = Some(logits);
        self.frontiers.fed = self.frontiers.sampled;
        self.frontiers.kv = self.sequence.kv_len();
        self.frontiers.check();
    }

    /// Whether the next token can be drawn without a forward pass (the logits of its position
    /// are at hand: right after a prefill, an import or a feed).
    pub fn logits_ready(&self) -> bool {
        self.finished.is_none() && self.unfed.is_none() && self.logits.is_some()
    }

    /// Records that the log has committed the first `frontier` generated tokens.
    pub fn mark_committed(&mut self, frontier: usize) {
        assert!(
            frontier >= self.frontiers.committed,
            "committed frontier moved back: {} -> {frontier}",
            self.frontiers.committed
        );
        self.frontiers.committed = frontier;
        self.frontiers.check();
    }

    pub fn frontiers(&self) -> Frontiers {
        self.frontiers
    }

    /// Positions the model's KV cache holds, as the model counts them (the frontiers' `kv` is
    /// what the state expects it to hold).
    pub fn kv_positions(&self) -> usize {
        self.sequence.kv_len()
    }

    /// Position `p`'s row and the token fed there ([`Sequence::export_row`]), when this state's
    /// model gives rows and knows that token; with the logits of its output when they were the
    /// last draw's and [`DecodeState::keep_logits`] kept them.
    pub fn export_row(&self, p: usize) -> Option<Row> {
        let (token, data) = (p < self.sequence.kv_len())
            .then(|| self.sequence.export_row(p))
            .flatten()?;
        let logits = self
            .kept_logits
            .as_ref()
            .filter(|(q, _)| *q == p)
            .map(|(_, l)| l.clone());
        Some(Row { token, data, logits })
    }

    /// Whether this state's rows can be streamed to a handoff's destination: a grouping-invariant
    /// sequence whose last position's row it gives (its token known: fed here).
    pub fn gives_rows(&self) -> bool {
        self.sequence.grouping_invariant()
            && self
                .sequence
                .kv_len()
                .checked_sub(1)
                .is_some_and(|p| self.sequence.export_row(p).is_some())
    }

    /// Keeps (or stops keeping) the logits of the last draw for [`DecodeState::export_row`]:
    /// a handoff source's rows carry them, so that its destination needs no forward pass.
    pub fn keep_logits(&mut self, on: bool) {
        self.keep_logits = on;
        if !on {
            self.kept_logits = None;
        }
    }

    /// Positions this state's cache covers, its record not yet fed (a followed one, or the
    /// last draw) included: prompt + committed for a follower.
    /// A deferred prefill's positions count as covered.
    pub fn covered_positions(&self) -> usize {
        self.sequence.kv_len() + usize::from(self.unfed.is_some()) + self.to_prefill.len()
    }

    /// Planted bug `source-frees-early` (fault builds only): empties the KV cache behind the
    /// frontiers' back, as a handoff source that frees its blocks before the log released it.
    #[cfg(feature = "faults")]
    pub fn forget_cache(&mut self) {
        self.sequence.reset();
    }

    pub fn finished(&self) -> Option<&StopCause> {
        self.finished.as_ref()
    }

    pub fn stats(&self) -> ResumeStats {
        self.stats
    }

    /// Decodes until finished; returns the tokens generated by this call.
    pub fn run_to_end(&mut self) -> Result<(Vec<u32>, StopCause)> {
        let mut tokens = Vec::new();
        while let Some(step) = self.next_token()? {
            tokens.push(step.token);
        }
        let reason = self.finished.clone().expect("loop ends only when finished");
        Ok((tokens, reason))
    }
}
