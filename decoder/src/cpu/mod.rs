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
//! The KV cache is the sequence's own, position-major (`[position][kv head][head dim]`), grown
//! in place; a planned handoff exports it as `[1, kv heads, positions, head dim]` per layer.

pub(crate) mod quant;

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

/// The weights of a model on the CPU, shared by all its sequences.
pub(crate) struct CpuWeights {
    embed: Matrix,
    /// `None`: tied to the embeddings.
    output: Option<Matrix>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
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
        let head_dim = hidden / n_head;
        if rope_dim != head_dim || head_dim % 2 != 0 {
            return Err(Error::Unsupported(format!(
                "rotary dimension {rope_dim} with heads of {head_dim}"
            )));
        }
        let embed = matrix(ct, r, "token_embd.weight")?;
        let output = match ct.tensor_infos.contains_key("output.weight") {
            true => Some(matrix(ct, r, "output.weight")?),
            false => None,
        };
        let norm = vector(ct, r, "output_norm.weight", hidden)?;
        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
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
        if embed.cols != hidden
            || output
                .as_ref()
                .is_some_and(|o| o.cols != hidden || o.rows != embed.rows)
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
            norm,
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
        self.embed.rows
    }

    fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_dim
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

fn exp(x: f32) -> f32 {
    (x as f64).exp() as f32
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

/// One sequence: the shared weights and its own KV cache.
pub(crate) struct CpuSequence {
    w: Arc<CpuWeights>,
    /// Per layer: keys and values, `[position][kv head][head dim]`.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
    max_context: usize,
}

impl CpuSequence {
    pub(crate) fn new(w: Arc<CpuWeights>, max_context: usize) -> Self {
        let n = w.layers.len();
        CpuSequence {
            max_context: max_context.min(w.max_positions),
            w,
            keys: vec![Vec::new(); n],
            values: vec![Vec::new(); n],
            len: 0,
        }
    }

    fn check(&self, tokens: &[u32]) -> Result<()> {
        check_feed(tokens, self.len, self.max_context, self.w.vocab_size())
    }

    /// Whether `other` runs on the same weights (one batch must).
    fn same_weights(&self, other: &Arc<CpuWeights>) -> bool {
        Arc::ptr_eq(&self.w, other)
    }
}

/// Feeds every item's tokens to its sequence in one pass and returns each item's logits of its
/// last position. Each item must have passed [`CpuSequence::check`] and all must share the
/// weights `w`.
pub(crate) fn forward(w: &CpuWeights, items: &mut [(&mut CpuSequence, &[u32])]) -> Vec<Logits> {
    let (hidden, d, hq, hkv) = (w.hidden, w.head_dim, w.n_head, w.n_kv_head);
    let kvw = w.kv_width();
    // Row r: its item and its position.
    let mut rows: Vec<(usize, usize)> = Vec::new();
    for (i, (s, tokens)) in items.iter().enumerate() {
        assert!(!tokens.is_empty() && s.len + tokens.len() <= s.max_context);
        rows.extend((0..tokens.len()).map(|j| (i, s.len + j)));
    }
    let n = rows.len();
    let mut x = vec![0f32; n * hidden];
    {
        let mut r = 0;
        for (_, tokens) in items.iter() {
            for &t in tokens.iter() {
                w.embed.row_into(t as usize, &mut x[r * hidden..(r + 1) * hidden]);
                r += 1;
            }
        }
    }
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
            for (s, tokens) in items.iter_mut() {
                let span = r * kvw..(r + tokens.len()) * kvw;
                s.keys[l].extend_from_slice(&k[span.clone()]);
                s.values[l].extend_from_slice(&v[span]);
                r += tokens.len();
            }
        }
        let caches: Vec<(&[f32], &[f32])> = items
            .iter()
            .map(|(s, _)| (s.keys[l].as_slice(), s.values[l].as_slice()))
            .collect();
        let out = SyncPtr(att.as_mut_ptr());
        let (q, rows, caches) = (&q, &rows, &caches);
        let work = |range: std::ops::Range<usize>| {
            let mut scores: Vec<f32> = Vec::new();
            let mut acc = vec![0f32; d];
            for item in range {
                let (r, h) = (item / hq, item % hq);
                let (seq, pos) = rows[r];
                let (keys, values) = caches[seq];
                let kvh = h / rep;
                let qh = &q[r * hidden + h * d..r * hidden + (h + 1) * d];
                scores.clear();
                scores
                    .extend((0..=pos).map(|t| dot_f32(qh, &keys[t * kvw + kvh * d..t * kvw + (kvh + 1) * d]) * scale));
                let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                let mut sum = 0f32;
                for s in scores.iter_mut() {
                    *s = exp(*s - max);
                    sum += *s;
                }
                acc.iter_mut().for_each(|a| *a = 0.0);
                for (t, &e) in scores.iter().enumerate() {
                    let p = e / sum;
                    let vt = &values[t * kvw + kvh * d..t * kvw + (kvh + 1) * d];
                    for (a, &vv) in acc.iter_mut().zip(vt) {
                        *a += p * vv;
                    }
                }
                // SAFETY: each (row, head) slice of `att` belongs to one work item.
                #[allow(unsafe_code)]
                unsafe {
                    std::ptr::copy_nonoverlapping(acc.as_ptr(), out.get().add(r * hidden + h * d), d);
                }
            }
        };
        if n * hq <= 4 {
            work(0..n * hq);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(n * hq, work);
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
        for (g, &u) in g.iter_mut().zip(&u) {
            *g = *g / (1.0 + exp(-*g)) * u;
        }
        layer.down.matmul(&g, n, &mut o);
        for (x, o) in x.iter_mut().zip(&o) {
            *x += o;
        }
    }
    // The last row of every item, normed, through the output head.
    let mut last = vec![0f32; items.len() * hidden];
    {
        let mut r = 0;
        for (i, (_, tokens)) in items.iter().enumerate() {
            r += tokens.len();
            rms_norm(
                &x[(r - 1) * hidden..r * hidden],
                &w.norm,
                w.eps,
                &mut last[i * hidden..(i + 1) * hidden],
            );
        }
    }
    let head = w.output.as_ref().unwrap_or(&w.embed);
    let vocab = head.rows;
    let mut logits = vec![0f32; items.len() * vocab];
    head.matmul(&last, items.len(), &mut logits);
    for (s, tokens) in items.iter_mut() {
        s.len += tokens.len();
    }
    logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
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
        self.keys.iter_mut().chain(self.values.iter_mut()).for_each(Vec::clear);
        self.len = 0;
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
        if self.len == 0 {
            return Err(Error::Invalid("an empty sequence has no cache to export".into()));
        }
        let (g, d, kvw) = (self.w.n_kv_head, self.w.head_dim, self.w.kv_width());
        let mut out = Vec::with_capacity(2 * self.keys.len());
        for (i, (k, v)) in self.keys.iter().zip(&self.values).enumerate() {
            for (kind, t) in [(BlockKind::Keys, k), (BlockKind::Values, v)] {
                // Position-major here, head-major on the wire.
                let mut data = Vec::with_capacity(t.len());
                for head in 0..g {
                    for p in 0..self.len {
                        data.extend_from_slice(&t[p * kvw + head * d..p * kvw + (head + 1) * d]);
                    }
                }
                out.push(CacheBlock {
                    layer: i as u32,
                    kind,
                    dtype: "f32".into(),
                    shape: vec![1, g as u32, self.len as u32, d as u32],
                    data: f32s_to_bytes(&data),
                });
            }
        }
        Ok(out)
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
                let mut t = vec![0f32; positions * kvw];
                for head in 0..g {
                    for p in 0..positions {
                        let src = (head * positions + p) * d;
                        t[p * kvw + head * d..p * kvw + (head + 1) * d].copy_from_slice(&data[src..src + d]);
                    }
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
        Ok(())
    }
}
