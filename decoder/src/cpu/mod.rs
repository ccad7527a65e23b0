//! tokenlog's own CPU forward pass of a llama-family GGUF model: batched, and invariant to the
//! batching.
//!
//! One call feeds any number of sequences any number of positions each ([`forward`]): the rows
//! of every sequence are stacked, each weight matrix is read once per call for all of them
//! ([`quant::Matrix::matmul`]), and attention runs per (row, head) over that row's own sequence.
//! Every operation is per row, in a fixed order, from that row's own inputs:
//! - embedding lookup, RMS norm, rotary embedding, SwiGLU and the residual adds are per row;
//! - a matrix product quantizes each activation row by itself and computes each output element
//!   with one dot product in one order, on one thread ([`quant`]);
//! - attention of the row at position `p` reads keys and values `0..=p` of its own sequence, in
//!   position order; its softmax and weighted sum are sequential over positions.
//!
//! Hence a sequence's logits are the same bits whether it was fed alone or beside other
//! sequences, one position per call or many (a prompt prefill, an exact resume of a committed
//! prefix in one call), with any thread count, on any x86-64 with or without AVX2
//! (`tests/real_model.rs` and `quant`'s tests check it). Transcendental functions go through
//! `f64` and round once, so they do not hang on a libm's last bit of `f32` precision.
//!
//! The KV cache is the sequence's own, position-major (`[position][kv head][head dim]`), kept in
//! chunks of [`KV_CHUNK`] positions ([`KvRows`]) that never move once allocated; a planned
//! handoff exports it as `[1, kv heads, positions, head dim]` per layer.

pub(crate) mod quant;

/// The CPU engine's numerics version. A generation run on this engine is bound to a model
/// identity whose `dtype_class` is the file's followed by `+` and this ([`identity_of`]), so a
/// decoder whose engine computes other bits (an older release's CPU engine, candle's kernels)
/// never continues it. Bumped with every change of the engine's logits, which the test
/// `the_cpu_engines_numbers_do_not_change_between_releases` pins. `cpu4`: attention's dot
/// products and weighted sums, and the norms' sums of squares, in fused multiply-adds
/// (2026-12-06); `cpu3`: `exp` (attention's
/// softmax, SiLU) by the engine's own algorithm, vectorized ([`crate::exp::exp_f32`]), instead of
/// the C library's (2026-12-06: the pinned digest is unchanged, but a rare input rounds
/// otherwise); `cpu2`: whole blocks' integer sums per lane (2026-12-04); before them, the
/// identity carried no tag.
pub const NUMERICS: &str = "cpu4";

/// Which kernels the CPU engine's matrix products use on this CPU (the same numbers on every
/// one), for reports such as `tokenlog bench decode`'s.
pub fn kernels() -> &'static str {
    quant::kernels()
}

/// The identity of a model file's generations on the CPU engine: the file's, with
/// [`NUMERICS`] in its dtype class.
pub fn identity_of(file: crate::identity::ModelIdentity) -> crate::identity::ModelIdentity {
    crate::identity::ModelIdentity {
        dtype_class: format!("{}+{NUMERICS}", file.dtype_class),
        ..file
    }
}

use std::any::Any;
use std::io::{Read, Seek};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::Device;

use crate::cache::{f32s_from_bytes, f32s_to_bytes, BlockKind, CacheBlock};
use crate::error::{Error, Result};
use crate::llama::LlamaShape;
use crate::model::{check_feed, Logits, Sequence};
use quant::{dot_f32, Matrix, SyncPtr};

struct Layer {
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    wo: Matrix,
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

/// The weights of a model on the CPU, shared by all its sequences: the whole model, or one
/// pipeline stage's contiguous range of its layers ([`CpuWeights::from_gguf_layers`]).
pub(crate) struct CpuWeights {
    /// The token embeddings: on the first stage, and on the last one when the output head is
    /// tied to them.
    embed: Option<Matrix>,
    /// The output head when the file has its own (`None`: tied to the embeddings).
    output: Option<Matrix>,
    /// The layers `first_layer..first_layer + layers.len()` of `total_layers`.
    layers: Vec<Layer>,
    first_layer: usize,
    total_layers: usize,
    /// The final norm: on the last stage.
    norm: Option<Vec<f32>>,
    vocab: usize,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    hidden: usize,
    ffn: usize,
    eps: f32,
    /// cos and sin of position × frequency: `[position][head_dim / 2]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
    max_positions: usize,
}

fn matrix<R: Read + Seek>(ct: &gguf_file::Content, r: &mut R, name: &str) -> Result<Matrix> {
    let t = ct.tensor(r, name, &Device::Cpu)?;
    let (rows, cols) = t.shape().dims2()?;
    match t.dtype() {
        GgmlDType::Q4_1 => Matrix::q4_1(rows, cols, &t.data()?),
        GgmlDType::Q8_0 => Matrix::q8_0(rows, cols, &t.data()?),
        _ => Matrix::f32(rows, cols, t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?),
    }
}

fn vector<R: Read + Seek>(ct: &gguf_file::Content, r: &mut R, name: &str, len: usize) -> Result<Vec<f32>> {
    let v: Vec<f32> = ct
        .tensor(r, name, &Device::Cpu)?
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1()?;
    if v.len() != len {
        return Err(Error::Invalid(format!("{name} has {} values, not {len}", v.len())));
    }
    Ok(v)
}

impl CpuWeights {
    /// Reads the weights of a `llama` GGUF file; positions up to `max_positions`.
    pub(crate) fn from_gguf<R: Read + Seek>(ct: &gguf_file::Content, r: &mut R, max_positions: usize) -> Result<Self> {
        Self::from_gguf_layers(ct, r, max_positions, None)
    }

    /// [`CpuWeights::from_gguf`] of the layers `layers` only (`None`: all of them): the first
    /// stage also holds the embeddings, the last the final norm and the output head.
    pub(crate) fn from_gguf_layers<R: Read + Seek>(
        ct: &gguf_file::Content,
        r: &mut R,
        max_positions: usize,
        layers: Option<std::ops::Range<usize>>,
    ) -> Result<Self> {
        let LlamaShape {
            n_head,
            n_kv_head,
            n_layers,
            hidden,
            ffn,
            rope_dim,
            eps,
            rope_base,
        } = LlamaShape::from_gguf(ct)?;
        let range = layers.unwrap_or(0..n_layers);
        if range.start >= range.end || range.end > n_layers {
            return Err(Error::Invalid(format!(
                "layers {}..{} of a model of {n_layers} layers (a range is A..B with A < B <= {n_layers})",
                range.start, range.end
            )));
        }
        let (first, last) = (range.start == 0, range.end == n_layers);
        let head_dim = hidden / n_head;
        if rope_dim != head_dim || head_dim % 2 != 0 {
            return Err(Error::Unsupported(format!(
                "rotary dimension {rope_dim} with heads of {head_dim}"
            )));
        }
        let tied = !ct.tensor_infos.contains_key("output.weight");
        let vocab = match ct.tensor_infos.get("token_embd.weight") {
            Some(info) => info.shape.dims2()?.0,
            None => return Err(Error::Invalid("the file has no token_embd.weight".into())),
        };
        let embed = match first || (last && tied) {
            true => Some(matrix(ct, r, "token_embd.weight")?),
            false => None,
        };
        let output = match last && !tied {
            true => Some(matrix(ct, r, "output.weight")?),
            false => None,
        };
        let norm = match last {
            true => Some(vector(ct, r, "output_norm.weight", hidden)?),
            false => None,
        };
        let mut layers = Vec::with_capacity(range.len());
        for i in range.clone() {
            let mut m = |what: &str, rows: usize, cols: usize| -> Result<Matrix> {
                let m = matrix(ct, r, &format!("blk.{i}.{what}.weight"))?;
                if (m.rows, m.cols) != (rows, cols) {
                    return Err(Error::Invalid(format!(
                        "blk.{i}.{what} is {}×{}, not {rows}×{cols}",
                        m.rows, m.cols
                    )));
                }
                Ok(m)
            };
            let kv = n_kv_head * head_dim;
            layers.push(Layer {
                wq: m("attn_q", hidden, hidden)?,
                wk: m("attn_k", kv, hidden)?,
                wv: m("attn_v", kv, hidden)?,
                wo: m("attn_output", hidden, hidden)?,
                gate: m("ffn_gate", ffn, hidden)?,
                up: m("ffn_up", ffn, hidden)?,
                down: m("ffn_down", hidden, ffn)?,
                attn_norm: vector(ct, r, &format!("blk.{i}.attn_norm.weight"), hidden)?,
                ffn_norm: vector(ct, r, &format!("blk.{i}.ffn_norm.weight"), hidden)?,
            });
        }
        if embed.as_ref().is_some_and(|e| e.cols != hidden || e.rows != vocab)
            || output.as_ref().is_some_and(|o| o.cols != hidden || o.rows != vocab)
        {
            return Err(Error::Invalid("embedding and output sizes do not match".into()));
        }
        let half = head_dim / 2;
        let (mut cos, mut sin) = (
            Vec::with_capacity(max_positions * half),
            Vec::with_capacity(max_positions * half),
        );
        for p in 0..max_positions {
            for i in 0..half {
                let freq = 1.0 / (rope_base as f64).powf((2 * i) as f64 / head_dim as f64);
                let angle = p as f64 * freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Ok(CpuWeights {
            embed,
            output,
            layers,
            first_layer: range.start,
            total_layers: n_layers,
            norm,
            vocab,
            n_head,
            n_kv_head,
            head_dim,
            hidden,
            ffn,
            eps,
            cos,
            sin,
            max_positions,
        })
    }

    pub(crate) fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The layers it holds, of [`CpuWeights::total_layers`].
    pub(crate) fn layer_range(&self) -> std::ops::Range<usize> {
        self.first_layer..self.first_layer + self.layers.len()
    }

    pub(crate) fn total_layers(&self) -> usize {
        self.total_layers
    }

    pub(crate) fn hidden(&self) -> usize {
        self.hidden
    }

    pub(crate) fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Whether it takes token ids (it holds the first layer and the embeddings).
    pub(crate) fn is_first(&self) -> bool {
        self.first_layer == 0
    }

    /// Whether it gives logits (it holds the last layer, the final norm and the output head).
    pub(crate) fn is_last(&self) -> bool {
        self.first_layer + self.layers.len() == self.total_layers
    }

    fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// The bytes of one position of an exported cache: keys and values of every layer, f32.
    pub(crate) fn cache_position_bytes(&self) -> usize {
        2 * self.layers.len() * self.kv_width() * std::mem::size_of::<f32>()
    }

    fn cache_format(&self) -> String {
        format!(
            "tokenlog-cpu-kv/f32/{}x{}x{}",
            self.layers.len(),
            self.n_kv_head,
            self.head_dim
        )
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mean = dot_f32(x, x) / x.len() as f32;
    let scale = (1.0 / (mean as f64 + eps as f64).sqrt()) as f32;
    for ((o, &x), &w) in out.iter_mut().zip(x).zip(w) {
        *o = (x * scale) * w;
    }
}

/// Interleaved rotary embedding of one head at position `pos`.
fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for (i, pair) in x.chunks_exact_mut(2).enumerate() {
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a * cos[i] - b * sin[i];
        pair[1] = a * sin[i] + b * cos[i];
    }
}

/// Positions per allocation of a sequence's keys (or values) of one layer ([`KvRows`]).
/// SmolLM2-135M: 64 positions x 3 KV heads x 64 values x 4 bytes = 48 KiB, an allocation the
/// allocator recycles between sequences.
const KV_CHUNK: usize = 64;

/// One layer's keys (or values) of one sequence, `[position][kv head][head dim]`, in chunks of
/// [`KV_CHUNK`] positions. A growing cache allocates one chunk at a time and never moves what
/// it holds: one grown by doubling copied every layer to fresh memory in one step, and
/// sequences decoded in lockstep did so in the same step (4 of them at position 1,185: a step
/// of ~120 ms against a median of ~40 ms). A copy for a handoff shares the chunks
/// ([`KvRows::share`]); a shared chunk still being filled is copied when next written or cut
/// by a truncation (in a later step, at most one chunk per layer's keys and values).
#[derive(Default)]
struct KvRows {
    /// Every chunk but the last holds [`KV_CHUNK`] rows; each was allocated for that many.
    chunks: Vec<Arc<Vec<f32>>>,
}

impl KvRows {
    /// Chunk `c` to write: this cache's own (a copy if a handoff's copy shares it).
    fn chunk_mut(&mut self, c: usize, width: usize) -> &mut Vec<f32> {
        let chunk = &mut self.chunks[c];
        if Arc::get_mut(chunk).is_none() {
            let mut own = Vec::with_capacity(KV_CHUNK * width);
            own.extend_from_slice(chunk);
            *chunk = Arc::new(own);
        }
        Arc::get_mut(chunk).expect("not shared")
    }

    /// The chunks holding positions `0..n`, shared.
    fn share(&self, n: usize) -> Vec<Arc<Vec<f32>>> {
        self.chunks[..n.div_ceil(KV_CHUNK)].to_vec()
    }

    /// Appends `rows` (whole rows of `width` values) after the `len` positions held.
    fn extend(&mut self, len: usize, width: usize, mut rows: &[f32]) {
        let mut p = len;
        while !rows.is_empty() {
            let (c, at) = (p / KV_CHUNK, p % KV_CHUNK);
            if c == self.chunks.len() {
                self.chunks.push(Arc::new(Vec::with_capacity(KV_CHUNK * width)));
            }
            let chunk = self.chunk_mut(c, width);
            assert_eq!(chunk.len(), at * width, "rows appended at the end");
            let take = ((KV_CHUNK - at) * width).min(rows.len());
            chunk.extend_from_slice(&rows[..take]);
            debug_assert!(chunk.capacity() == KV_CHUNK * width, "a chunk never moves");
            rows = &rows[take..];
            p += take / width;
        }
    }

    /// Keeps the first `n` positions.
    fn truncate(&mut self, n: usize, width: usize) {
        let keep = n.div_ceil(KV_CHUNK);
        self.chunks.truncate(keep);
        let rows = (n - keep.saturating_sub(1) * KV_CHUNK) * width;
        // A chunk a copy shares is copied only when the cut falls inside it.
        if keep > 0 && self.chunks[keep - 1].len() != rows {
            self.chunk_mut(keep - 1, width).truncate(rows);
        }
    }

    /// Position `p`'s row.
    fn row(&self, p: usize, width: usize) -> &[f32] {
        &self.chunks[p / KV_CHUNK][p % KV_CHUNK * width..][..width]
    }

    /// Positions `0..n` as (first position, its chunk's rows up to `n`), in position order.
    fn spans(&self, n: usize, width: usize) -> impl Iterator<Item = (usize, &[f32])> {
        self.chunks
            .iter()
            .enumerate()
            .map(move |(c, chunk)| (c * KV_CHUNK, chunk))
            .take_while(move |&(first, _)| first < n)
            .map(move |(first, chunk)| (first, &chunk[..(n - first).min(KV_CHUNK) * width]))
    }
}

/// One sequence: the shared weights and its own KV cache.
pub(crate) struct CpuSequence {
    w: Arc<CpuWeights>,
    /// Per layer: keys and values.
    keys: Vec<KvRows>,
    values: Vec<KvRows>,
    len: usize,
    max_context: usize,
    /// The token fed at each position, when known (`None`: imported with a cache, or fed as
    /// rows from the stage before): what [`Sequence::export_row`] gives beside the row.
    tokens: Vec<Option<u32>>,
}

impl CpuSequence {
    pub(crate) fn new(w: Arc<CpuWeights>, max_context: usize) -> Self {
        let n = w.layers.len();
        CpuSequence {
            max_context: max_context.min(w.max_positions),
            w,
            keys: (0..n).map(|_| KvRows::default()).collect(),
            values: (0..n).map(|_| KvRows::default()).collect(),
            len: 0,
            tokens: Vec::new(),
        }
    }

    /// Positions fed so far.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Forgets positions `n..` (their keys and values); the first `n` stay as they were.
    pub(crate) fn truncate(&mut self, n: usize) {
        let kvw = self.w.kv_width();
        if n < self.len {
            for t in self.keys.iter_mut().chain(self.values.iter_mut()) {
                t.truncate(n, kvw);
            }
            self.len = n;
            self.tokens.truncate(n);
        }
    }

    fn check(&self, tokens: &[u32]) -> Result<()> {
        check_feed(tokens, self.len, self.max_context, self.w.vocab_size())
    }

    /// The bytes of one row ([`Sequence::export_row`]): every layer's keys, then its values.
    fn row_bytes(&self) -> usize {
        2 * self.keys.len() * self.w.kv_width() * std::mem::size_of::<f32>()
    }

    /// Whether `other` runs on the same weights (one batch must).
    fn same_weights(&self, other: &Arc<CpuWeights>) -> bool {
        Arc::ptr_eq(&self.w, other)
    }
}

/// What one item feeds a stage: token ids (a first stage) or the rows the stage before it
/// gave (`rows × hidden` values).
pub(crate) enum Feed<'a> {
    Tokens(&'a [u32]),
    Hidden(&'a [f32]),
}

/// What a stage gives for one item: the rows of every fed position after its layers (to the
/// next stage), or the logits of the last one (a last stage).
pub(crate) enum Fed {
    Hidden(Vec<f32>),
    Logits(Logits),
}

/// Feeds every item's tokens to its sequence in one pass and returns each item's logits of its
/// last position. Each item must have passed [`CpuSequence::check`] and all must share the
/// weights `w` (a whole model).
pub(crate) fn forward(w: &CpuWeights, items: &mut [(&mut CpuSequence, &[u32])]) -> Vec<Logits> {
    assert!(w.is_first() && w.is_last(), "a whole model");
    let mut feeds: Vec<(&mut CpuSequence, Feed)> = items.iter_mut().map(|(s, t)| (&mut **s, Feed::Tokens(t))).collect();
    forward_stage(w, &mut feeds)
        .into_iter()
        .map(|f| match f {
            Fed::Logits(l) => l,
            Fed::Hidden(_) => unreachable!("a last stage gives logits"),
        })
        .collect()
}

/// One stage's pass over every item (a whole model is one stage): the embeddings of the
/// tokens or the given rows, through its layers (each item's sequence keeps its keys and
/// values), and, on a last stage, the final norm and output head of each item's last row.
/// Tokens need a first stage and rows a later one; each item must have passed the checks of
/// its kind (`check_feed`, or a whole number of rows in the context).
pub(crate) fn forward_stage(w: &CpuWeights, items: &mut [(&mut CpuSequence, Feed)]) -> Vec<Fed> {
    let hidden = w.hidden;
    let counts: Vec<usize> = items
        .iter()
        .map(|(_, f)| match f {
            Feed::Tokens(t) => t.len(),
            Feed::Hidden(h) => h.len() / hidden,
        })
        .collect();
    let n: usize = counts.iter().sum();
    let mut x = vec![0f32; n * hidden];
    {
        let mut r = 0;
        for (_, feed) in items.iter() {
            match feed {
                Feed::Tokens(tokens) => {
                    let embed = w
                        .embed
                        .as_ref()
                        .filter(|_| w.is_first())
                        .expect("tokens go to a first stage");
                    for &t in tokens.iter() {
                        embed.row_into(t as usize, &mut x[r * hidden..(r + 1) * hidden]);
                        r += 1;
                    }
                }
                Feed::Hidden(h) => {
                    assert!(!w.is_first(), "rows go to a later stage");
                    x[r * hidden..r * hidden + h.len()].copy_from_slice(h);
                    r += h.len() / hidden;
                }
            }
        }
    }
    for (s, feed) in items.iter_mut() {
        match feed {
            Feed::Tokens(tokens) => s.tokens.extend(tokens.iter().map(|&t| Some(t))),
            Feed::Hidden(h) => s.tokens.extend(std::iter::repeat_n(None, h.len() / hidden)),
        }
    }
    let mut seqs: Vec<(&mut CpuSequence, usize)> = items
        .iter_mut()
        .zip(&counts)
        .map(|((s, _), &c)| (&mut **s, c))
        .collect();
    run_layers(w, &mut seqs, &mut x);
    if !w.is_last() {
        let mut out = Vec::with_capacity(counts.len());
        let mut r = 0;
        for &c in &counts {
            out.push(Fed::Hidden(x[r * hidden..(r + c) * hidden].to_vec()));
            r += c;
        }
        return out;
    }
    // The last row of every item, normed, through the output head.
    let norm = w.norm.as_ref().expect("a last stage holds the final norm");
    let mut last = vec![0f32; counts.len() * hidden];
    {
        let mut r = 0;
        for (i, &c) in counts.iter().enumerate() {
            r += c;
            rms_norm(
                &x[(r - 1) * hidden..r * hidden],
                norm,
                w.eps,
                &mut last[i * hidden..(i + 1) * hidden],
            );
        }
    }
    let head = w
        .output
        .as_ref()
        .or(w.embed.as_ref())
        .expect("a last stage holds the output head");
    let vocab = head.rows;
    let mut logits = vec![0f32; counts.len() * vocab];
    head.matmul(&last, counts.len(), &mut logits);
    logits.chunks_exact(vocab).map(|l| Fed::Logits(l.to_vec())).collect()
}

/// One row's attention over its sequence's cache, for query heads that share one key/value
/// head.
struct Attend<'a> {
    keys: &'a KvRows,
    values: &'a KvRows,
    /// Positions attended to: the row's own and all before it.
    len: usize,
    /// Floats per cached position (all key/value heads).
    kvw: usize,
    /// Where the key/value head starts within a position.
    offset: usize,
    scale: f32,
}

impl Attend<'_> {
    /// The attention outputs of `G` query heads (`q`: their `G × d` values) into `out` (`G ×
    /// d`); `scores` is scratch. Per head the bits of one head alone: scores chunk by chunk,
    /// softmax (max, `exp`, the sum in order, division), the weighted sum chunk by chunk.
    fn heads<const G: usize>(&self, q: &[f32], scores: &mut Vec<f32>, out: &mut [f32]) {
        let len = self.len;
        scores.clear();
        scores.resize(G * len, 0.0);
        for (first, keys) in self.keys.spans(len, self.kvw) {
            let m = keys.len() / self.kvw;
            let mut parts = scores.chunks_exact_mut(len);
            let mut o: [&mut [f32]; G] =
                std::array::from_fn(|_| &mut parts.next().expect("a score row per head")[first..first + m]);
            quant::scores_heads::<G>(q, keys, self.kvw, self.offset, self.scale, &mut o);
        }
        for s in scores.chunks_exact_mut(len) {
            let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            crate::exp::exp_shifted(s, max);
            let mut sum = 0f32;
            for x in s.iter() {
                sum += *x;
            }
            for x in s.iter_mut() {
                *x /= sum;
            }
        }
        out.fill(0.0);
        for (first, values) in self.values.spans(len, self.kvw) {
            let m = values.len() / self.kvw;
            let p: [&[f32]; G] = std::array::from_fn(|g| &scores[g * len + first..g * len + first + m]);
            quant::weighted_sums_on::<G>(&p, values, self.kvw, self.offset, out);
        }
    }
}

/// The layers of `w` over the rows `x` (`rows × hidden`, item after item, `count` rows each):
/// each item's sequence gets the keys and values of its rows, and its length grows by them.
fn run_layers(w: &CpuWeights, items: &mut [(&mut CpuSequence, usize)], x: &mut [f32]) {
    let (hidden, d, hq, hkv) = (w.hidden, w.head_dim, w.n_head, w.n_kv_head);
    let kvw = w.kv_width();
    // Row r: its item and its position.
    let mut rows: Vec<(usize, usize)> = Vec::new();
    for (i, (s, count)) in items.iter().enumerate() {
        assert!(*count > 0 && s.len + count <= s.max_context);
        rows.extend((0..*count).map(|j| (i, s.len + j)));
    }
    let n = rows.len();
    assert_eq!(x.len(), n * hidden);
    let mut xn = vec![0f32; n * hidden];
    let mut q = vec![0f32; n * hidden];
    let mut k = vec![0f32; n * kvw];
    let mut v = vec![0f32; n * kvw];
    let mut att = vec![0f32; n * hidden];
    let mut o = vec![0f32; n * hidden];
    let mut g = vec![0f32; n * w.ffn];
    let mut u = vec![0f32; n * w.ffn];
    let rep = hq / hkv;
    let half = d / 2;
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    for (l, layer) in w.layers.iter().enumerate() {
        for r in 0..n {
            let span = r * hidden..(r + 1) * hidden;
            rms_norm(&x[span.clone()], &layer.attn_norm, w.eps, &mut xn[span]);
        }
        // One quantization of the normed rows for the three products that read them.
        let xq = quant::quantize(&xn, hidden);
        layer.wq.matmul_quantized(&xn, &xq, n, &mut q);
        layer.wk.matmul_quantized(&xn, &xq, n, &mut k);
        layer.wv.matmul_quantized(&xn, &xq, n, &mut v);
        for (r, &(_, pos)) in rows.iter().enumerate() {
            let (cos, sin) = (
                &w.cos[pos * half..(pos + 1) * half],
                &w.sin[pos * half..(pos + 1) * half],
            );
            for head in q[r * hidden..(r + 1) * hidden].chunks_exact_mut(d) {
                rotate(head, cos, sin);
            }
            for head in k[r * kvw..(r + 1) * kvw].chunks_exact_mut(d) {
                rotate(head, cos, sin);
            }
        }
        // Append this call's keys and values; the attention below then only reads.
        {
            let mut r = 0;
            for (s, count) in items.iter_mut() {
                let span = r * kvw..(r + *count) * kvw;
                let len = s.len;
                s.keys[l].extend(len, kvw, &k[span.clone()]);
                s.values[l].extend(len, kvw, &v[span]);
                r += *count;
            }
        }
        let caches: Vec<(&KvRows, &KvRows)> = items.iter().map(|(s, _)| (&s.keys[l], &s.values[l])).collect();
        let out = SyncPtr(att.as_mut_ptr());
        let (q, rows, caches) = (&q, &rows, &caches);
        // The query heads of one key/value head in groups (all `rep` of them where 4 or fewer),
        // the cache read once per group: one work item per row and group.
        let group = [4, 3, 2, 1].into_iter().find(|g| rep % g == 0).expect("1 divides");
        let per_row = hq / group;
        let work = |range: std::ops::Range<usize>| {
            let mut scores: Vec<f32> = Vec::new();
            let mut acc = vec![0f32; group * d];
            for item in range {
                let (r, h) = (item / per_row, item % per_row * group);
                let (seq, pos) = rows[r];
                let (keys, values) = caches[seq];
                let heads = &q[r * hidden + h * d..r * hidden + (h + group) * d];
                let at = Attend {
                    keys,
                    values,
                    len: pos + 1,
                    kvw,
                    offset: h / rep * d,
                    scale,
                };
                match group {
                    4 => at.heads::<4>(heads, &mut scores, &mut acc),
                    3 => at.heads::<3>(heads, &mut scores, &mut acc),
                    2 => at.heads::<2>(heads, &mut scores, &mut acc),
                    _ => at.heads::<1>(heads, &mut scores, &mut acc),
                }
                // SAFETY: each (row, group of heads) slice of `att` belongs to one work item.
                #[allow(unsafe_code)]
                unsafe {
                    std::ptr::copy_nonoverlapping(acc.as_ptr(), out.get().add(r * hidden + h * d), group * d);
                }
            }
        };
        if n * hq <= 4 {
            work(0..n * per_row);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(n * per_row, work);
        }
        layer.wo.matmul(&att, n, &mut o);
        for (x, o) in x.iter_mut().zip(&o) {
            *x += o;
        }
        for r in 0..n {
            let span = r * hidden..(r + 1) * hidden;
            rms_norm(&x[span.clone()], &layer.ffn_norm, w.eps, &mut xn[span]);
        }
        let xq = quant::quantize(&xn, hidden);
        layer.gate.matmul_quantized(&xn, &xq, n, &mut g);
        layer.up.matmul_quantized(&xn, &xq, n, &mut u);
        crate::exp::silu_times(&mut g, &u);
        layer.down.matmul(&g, n, &mut o);
        for (x, o) in x.iter_mut().zip(&o) {
            *x += o;
        }
    }
    for (s, count) in items.iter_mut() {
        s.len += *count;
    }
}

/// Feeds a batch of sequences of one model at once: each item's result is its logits, or why
/// it was refused (that sequence is then reset, the others go on). `None`: some item is not a
/// [`CpuSequence`] of `w` (the caller feeds them one by one).
pub(crate) fn prefill_batch(
    w: &Arc<CpuWeights>,
    items: &mut [(&mut dyn Sequence, &[u32])],
) -> Option<Vec<Result<Logits>>> {
    let mut seqs: Vec<(&mut CpuSequence, &[u32])> = Vec::with_capacity(items.len());
    for (s, t) in items.iter_mut() {
        let s = s.as_any_mut()?.downcast_mut::<CpuSequence>()?;
        if !s.same_weights(w) {
            return None;
        }
        seqs.push((s, *t));
    }
    let mut results: Vec<Option<Result<Logits>>> = Vec::with_capacity(seqs.len());
    let mut ok: Vec<(&mut CpuSequence, &[u32])> = Vec::with_capacity(seqs.len());
    for (s, t) in seqs {
        match s.check(t) {
            Ok(()) => {
                results.push(None);
                ok.push((s, t));
            }
            Err(e) => {
                s.reset();
                results.push(Some(Err(e)));
            }
        }
    }
    let mut logits = if ok.is_empty() { Vec::new() } else { forward(w, &mut ok) }.into_iter();
    Some(
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Ok(logits.next().expect("one per fed item"))))
            .collect(),
    )
}

impl Sequence for CpuSequence {
    fn prefill(&mut self, tokens: &[u32]) -> Result<Logits> {
        if let Err(e) = self.check(tokens) {
            self.reset();
            return Err(e);
        }
        let w = self.w.clone();
        Ok(forward(&w, &mut [(self, tokens)]).pop().expect("one item"))
    }

    fn kv_len(&self) -> usize {
        self.len
    }

    fn reset(&mut self) {
        self.keys
            .iter_mut()
            .chain(self.values.iter_mut())
            .for_each(|t| t.chunks.clear());
        self.len = 0;
        self.tokens.clear();
    }

    fn grouping_invariant(&self) -> bool {
        true
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn Any> {
        Some(self)
    }

    fn cache_format(&self) -> Option<String> {
        Some(self.w.cache_format())
    }

    fn export_cache(&self) -> Result<Vec<CacheBlock>> {
        self.export_cache_prefix(self.len)
    }

    fn prefix_export_bytes(&self, positions: usize) -> Option<usize> {
        (1..=self.len)
            .contains(&positions)
            .then(|| 2 * self.keys.len() * positions * self.w.kv_width() * std::mem::size_of::<f32>())
    }

    fn export_cache_prefix(&self, positions: usize) -> Result<Vec<CacheBlock>> {
        self.snapshot_cache_prefix(positions)?()
    }

    fn snapshot_copy_bytes(&self, positions: usize) -> Option<usize> {
        // At most the chunk each layer's keys and values are filling, copied at their next
        // write (or a truncation inside it): whole chunks of up to 64 rows, whatever `positions`.
        self.prefix_export_bytes(positions)?;
        Some(2 * self.keys.len() * KV_CHUNK * self.w.kv_width() * std::mem::size_of::<f32>())
    }

    fn snapshot_cache_prefix(&self, positions: usize) -> Result<crate::cache::BlocksLater> {
        if positions == 0 {
            return Err(Error::Invalid("a cache of no positions is not exported".into()));
        }
        if positions > self.len {
            return Err(Error::Invalid(format!(
                "the first {positions} positions of a cache of {}",
                self.len
            )));
        }
        let (g, d, kvw) = (self.w.n_kv_head, self.w.head_dim, self.w.kv_width());
        // Shared now (no copy), laid out for the wire by the caller's thread.
        let layers: Vec<[Vec<Arc<Vec<f32>>>; 2]> = self
            .keys
            .iter()
            .zip(&self.values)
            .map(|(k, v)| [k.share(positions), v.share(positions)])
            .collect();
        Ok(Box::new(move || {
            let mut out = Vec::with_capacity(2 * layers.len());
            for (i, pair) in layers.iter().enumerate() {
                for (kind, chunks) in [BlockKind::Keys, BlockKind::Values].into_iter().zip(pair) {
                    let row = |p: usize| &chunks[p / KV_CHUNK][p % KV_CHUNK * kvw..][..kvw];
                    // Position-major here, head-major on the wire.
                    let mut data = Vec::with_capacity(positions * kvw);
                    for head in 0..g {
                        for p in 0..positions {
                            data.extend_from_slice(&row(p)[head * d..(head + 1) * d]);
                        }
                    }
                    out.push(CacheBlock {
                        layer: i as u32,
                        kind,
                        dtype: "f32".into(),
                        shape: vec![1, g as u32, positions as u32, d as u32],
                        data: f32s_to_bytes(&data),
                    });
                }
            }
            Ok(out)
        }))
    }

    fn import_cache(&mut self, blocks: &[CacheBlock], positions: usize) -> Result<()> {
        let w = self.w.clone();
        let (g, d, kvw) = (w.n_kv_head, w.head_dim, w.kv_width());
        if positions == 0 {
            return Err(Error::Invalid("a cache of no positions".into()));
        }
        if positions > self.max_context {
            return Err(Error::ContextFull {
                needed: positions,
                max: self.max_context,
            });
        }
        if blocks.len() != 2 * w.layers.len() {
            return Err(Error::Invalid(format!(
                "{} cache blocks for a model of {} layers",
                blocks.len(),
                w.layers.len()
            )));
        }
        let want = [1, g as u32, positions as u32, d as u32];
        let mut keys = Vec::with_capacity(w.layers.len());
        let mut values = Vec::with_capacity(w.layers.len());
        for (i, pair) in blocks.chunks(2).enumerate() {
            for (b, kind) in pair.iter().zip([BlockKind::Keys, BlockKind::Values]) {
                b.check()?;
                if b.layer as usize != i || b.kind != kind || b.dtype != "f32" || b.shape != want {
                    return Err(Error::Invalid(format!(
                        "cache block {} of layer {} ({}, {:?}) where layer {i} {} of shape {want:?} in f32 belongs",
                        b.kind.name(),
                        b.layer,
                        b.dtype,
                        b.shape,
                        kind.name()
                    )));
                }
                let data = f32s_from_bytes(&b.data)?;
                let mut t = KvRows::default();
                let mut row = vec![0f32; kvw];
                for p in 0..positions {
                    for head in 0..g {
                        let src = (head * positions + p) * d;
                        row[head * d..(head + 1) * d].copy_from_slice(&data[src..src + d]);
                    }
                    t.extend(p, kvw, &row);
                }
                match kind {
                    BlockKind::Keys => keys.push(t),
                    BlockKind::Values => values.push(t),
                }
            }
        }
        self.keys = keys;
        self.values = values;
        self.len = positions;
        self.tokens = vec![None; positions];
        Ok(())
    }

    fn export_row(&self, p: usize) -> Option<(u32, Vec<u8>)> {
        let token = (*self.tokens.get(p)?)?;
        let kvw = self.w.kv_width();
        let mut data = Vec::with_capacity(self.row_bytes());
        for (k, v) in self.keys.iter().zip(&self.values) {
            for &x in k.row(p, kvw).iter().chain(v.row(p, kvw)) {
                data.extend_from_slice(&x.to_le_bytes());
            }
        }
        Some((token, data))
    }

    fn append_rows(&mut self, rows: &[(u32, &[u8])]) -> Result<()> {
        let tokens: Vec<u32> = rows.iter().map(|&(t, _)| t).collect();
        check_feed(&tokens, self.len, self.max_context, self.w.vocab_size())?;
        let want = self.row_bytes();
        if let Some((i, (_, d))) = rows.iter().enumerate().find(|(_, (_, d))| d.len() != want) {
            return Err(Error::Invalid(format!(
                "row {i} of {} bytes; this model's rows are {want}",
                d.len()
            )));
        }
        let kvw = self.w.kv_width();
        let mut row = vec![0f32; 2 * kvw];
        for (i, &(token, data)) in rows.iter().enumerate() {
            for (l, bytes) in data.chunks_exact(2 * kvw * 4).enumerate() {
                for (x, b) in row.iter_mut().zip(bytes.chunks_exact(4)) {
                    *x = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                }
                self.keys[l].extend(self.len + i, kvw, &row[..kvw]);
                self.values[l].extend(self.len + i, kvw, &row[kvw..]);
            }
            self.tokens.push(Some(token));
        }
        self.len += rows.len();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{KvRows, KV_CHUNK};

    /// A cache grown one position at a time and several at once keeps its rows where they
    /// were (no chunk is reallocated), reads back every row in order, and truncates to any
    /// length, chunk boundaries included.
    #[test]
    fn a_chunked_cache_never_moves_its_rows_and_reads_them_back() {
        let width = 6;
        let row = |p: usize| (0..width).map(|i| (p * width + i) as f32).collect::<Vec<f32>>();
        let mut kv = KvRows::default();
        let mut len = 0;
        let mut first_chunk = None;
        // 1, then 37 at once (across a boundary), then one at a time to 3 chunks and a bit.
        for n in std::iter::once(1)
            .chain(std::iter::once(37))
            .chain(std::iter::repeat_n(1, 3 * KV_CHUNK))
        {
            let rows: Vec<f32> = (len..len + n).flat_map(row).collect();
            kv.extend(len, width, &rows);
            len += n;
            let at = kv.chunks[0].as_ptr();
            assert_eq!(*first_chunk.get_or_insert(at), at, "the first chunk moved at {len}");
            assert!(kv.chunks.iter().all(|c| c.capacity() == KV_CHUNK * width));
        }
        assert_eq!(kv.chunks.len(), len.div_ceil(KV_CHUNK));
        for p in 0..len {
            assert_eq!(kv.row(p, width), row(p).as_slice(), "row {p}");
        }
        for n in [len, 2 * KV_CHUNK + 1, 2 * KV_CHUNK, KV_CHUNK - 1, 1, 0] {
            let spans: Vec<(usize, usize)> = kv.spans(n, width).map(|(f, s)| (f, s.len() / width)).collect();
            let covered: usize = spans.iter().map(|s| s.1).sum();
            assert_eq!(covered, n, "spans of {n}: {spans:?}");
            assert!(spans.iter().all(|&(f, c)| f % KV_CHUNK == 0 && c > 0 && c <= KV_CHUNK));
        }
        kv.truncate(2 * KV_CHUNK, width);
        assert_eq!(kv.chunks.len(), 2);
        kv.extend(2 * KV_CHUNK, width, &row(2 * KV_CHUNK));
        kv.truncate(KV_CHUNK + 3, width);
        assert_eq!((kv.chunks.len(), kv.chunks[1].len()), (2, 3 * width));
        kv.extend(KV_CHUNK + 3, width, &row(KV_CHUNK + 3));
        for p in 0..KV_CHUNK + 4 {
            assert_eq!(kv.row(p, width), row(p).as_slice(), "row {p} after truncating");
        }
        // A copy shares the chunks; writing after it copies the chunk being filled and leaves
        // the copy as it was.
        let n = KV_CHUNK + 4;
        let shared = kv.share(n);
        assert!(std::sync::Arc::ptr_eq(&shared[0], &kv.chunks[0]));
        kv.extend(n, width, &[-1.0; 6]);
        kv.truncate(n - 1, width);
        assert_eq!(shared[1].len(), 4 * width, "the copy keeps its rows");
        assert_eq!(shared[1][3 * width..], row(KV_CHUNK + 3)[..]);
        assert_eq!(
            kv.chunks[1].capacity(),
            KV_CHUNK * width,
            "the written chunk is this cache's own"
        );
        assert!(
            std::sync::Arc::ptr_eq(&shared[0], &kv.chunks[0]),
            "full chunks stay shared"
        );
        // A cut at a chunk's end leaves that chunk shared; one inside it copies it.
        kv.truncate(KV_CHUNK, width);
        assert!(std::sync::Arc::ptr_eq(&shared[0], &kv.chunks[0]));
        kv.truncate(KV_CHUNK - 1, width);
        assert!(!std::sync::Arc::ptr_eq(&shared[0], &kv.chunks[0]));
        assert_eq!(shared[0].len(), KV_CHUNK * width, "the copy keeps its rows");
        kv.extend(KV_CHUNK - 1, width, &row(KV_CHUNK - 1));
        for p in 0..KV_CHUNK {
            assert_eq!(kv.row(p, width), row(p).as_slice(), "row {p} after the cut");
        }
        kv.truncate(0, width);
        assert!(kv.chunks.is_empty());
    }
}
