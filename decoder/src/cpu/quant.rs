//! Weight matrices and the matrix-vector products of [`super`]'s forward pass.
//!
//! A product's output element `(row r, column c)` is one dot product of activation row `r` with
//! weight row `c`, computed by one thread, in one fixed order, from that activation row alone:
//! - the activation row is quantized to 8 bits per block of 32 ([`quantize_row`]) on its own
//!   (scale from the block's own maximum), never together with other rows;
//! - the integer part of a block's dot product is exact (`i32` sums of `i8 × u4` or `i8 × i8`
//!   products; the order of an exact integer sum does not matter), so the AVX2 kernel and the
//!   portable one give the same integers;
//! - the float part is the same operations in the same order in both kernels (see
//!   [`portable`], which defines it).
//!
//! Weights and activations are laid out for the AVX2 kernels: each whole group of 8 blocks of
//! a row is interleaved so that block `j` fills lane `j` of 8 vectors ([`interleaved`]). A
//! block's integer sum then ends in one lane, and the conversion, the scales and the Q4_1
//! offset cost one vector operation per 8 blocks instead of one per block; the weights are
//! rearranged once, at load.
//!
//! So the result does not depend on how many rows are multiplied at once (other generations of a
//! batch, other positions of a prefill), on the thread count, or on whether the CPU has AVX2:
//! `tests` below check all four.
//!
//! `unsafe` here, and only here and in the attention of [`super::forward`]: the AVX2 intrinsics
//! (called only once `is_x86_feature_detected!` said AVX2, F16C and FMA are there), and the pool's workers
//! writing their own disjoint elements of one output through a shared pointer.
#![allow(unsafe_code)]

use crate::error::{Error, Result};

/// Elements per quantization block (GGUF's `QK4_1` and `QK8_0`).
pub(crate) const BLOCK: usize = 32;

/// IEEE half → single precision (exact: every f16 is an f32).
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let frac = (h & 0x3ff) as u32;
    let bits = match (exp, frac) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: normalize.
            let shift = frac.leading_zeros() - 21;
            let frac = (frac << shift) & 0x3ff;
            sign | ((127 - 15 + 1 - shift) << 23) | (frac << 13)
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (frac << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (frac << 13),
    };
    f32::from_bits(bits)
}

/// Blocks per interleaved group. The kernels give each block of a group one 32-bit lane of a
/// 256-bit vector: a block's whole integer dot product ends in its own lane, and the float part
/// (the scales, a Q4_1 block's offset) is one vector operation for the 8 blocks.
pub(crate) const GROUP: usize = 8;

/// Bytes of a group of [`GROUP`] blocks of 8-bit values, interleaved ([`interleaved`]).
pub(crate) const GROUP_BYTES: usize = GROUP * BLOCK;

/// Where element `e` of block `j` of a group is among its [`GROUP_BYTES`] interleaved bytes:
/// byte `32·s + 4·j + e % 4` with `s = e / 4`. So the group is 8 vectors of 32 bytes (`s`), and
/// lane `j` of vector `s` holds elements `4·s..4·s + 4` of block `j`.
#[inline(always)]
pub(crate) fn interleaved(j: usize, e: usize) -> usize {
    32 * (e / 4) + 4 * j + e % 4
}

/// One activation row, quantized: per block, 32 signed values, the scale `d`, their integer sum
/// and `s = d × sum` (what a block with an offset needs).
#[derive(Default)]
pub(crate) struct QuantRow {
    /// The row's whole groups of [`GROUP`] blocks, interleaved ([`interleaved`]).
    pub(crate) groups: Vec<[i8; GROUP_BYTES]>,
    /// The blocks after the last whole group, in order.
    pub(crate) tail: Vec<[i8; BLOCK]>,
    pub(crate) d: Vec<f32>,
    pub(crate) sum: Vec<i32>,
    pub(crate) s: Vec<f32>,
}

impl QuantRow {
    /// Whether it is a row of `kb` blocks (what the kernels index without checks).
    fn has_blocks(&self, kb: usize) -> bool {
        self.groups.len() == kb / GROUP
            && self.tail.len() == kb % GROUP
            && self.d.len() == kb
            && self.sum.len() == kb
            && self.s.len() == kb
    }
}

/// Quantizes `x` (a whole number of blocks) into `out`: `q = round(x / d)` with
/// `d = max|x| / 127` per block.
pub(crate) fn quantize_row(x: &[f32], out: &mut QuantRow) {
    debug_assert_eq!(x.len() % BLOCK, 0);
    let kb = x.len() / BLOCK;
    let grouped = kb / GROUP * GROUP;
    out.groups.clear();
    out.groups.resize(kb / GROUP, [0; GROUP_BYTES]);
    out.tail.clear();
    out.d.clear();
    out.sum.clear();
    out.s.clear();
    for (b, block) in x.chunks_exact(BLOCK).enumerate() {
        let mut q = [0i8; BLOCK];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 is present; a block is `BLOCK` values.
        let fast = if simd() {
            unsafe { avx2_kernels::quantize_block(block, &mut q) }
        } else {
            None
        };
        #[cfg(not(target_arch = "x86_64"))]
        let fast = None;
        let (d, sum) = fast.unwrap_or_else(|| quantize_block(block, &mut q));
        if b < grouped {
            // Elements 4·s..4·s + 4 of block j at `interleaved(j, 4·s)`.
            let group = &mut out.groups[b / GROUP];
            for (s, run) in q.chunks_exact(4).enumerate() {
                let at = interleaved(b % GROUP, 4 * s);
                group[at..at + 4].copy_from_slice(run);
            }
        } else {
            out.tail.push(q);
        }
        out.d.push(d);
        out.sum.push(sum);
        out.s.push(d * sum as f32);
    }
}

/// One block of [`quantize_row`]: its values into `q`; the scale `d` and the sum of `q`.
fn quantize_block(block: &[f32], q: &mut [i8; BLOCK]) -> (f32, i32) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(block) {
        // Within ±127 always: the kernels negate activations (`_mm256_sign_epi8`), and -128
        // has no negation in i8. Only a block so small that `1 / d` overflows (its largest
        // value under ~4e-37) would reach it; for any other the clamp changes nothing.
        *q = (v * id).round().clamp(-127.0, 127.0) as i8;
        sum += *q as i32;
    }
    (d, sum)
}

/// Every row of `x` (rows of `cols` elements) quantized on its own ([`quantize_row`]).
pub(crate) fn quantize(x: &[f32], cols: usize) -> Vec<QuantRow> {
    x.chunks_exact(cols)
        .map(|row| {
            let mut q = QuantRow::default();
            quantize_row(row, &mut q);
            q
        })
        .collect()
}

/// A weight matrix of `rows` rows of `cols` elements (row `c` makes output column `c`).
pub(crate) struct Matrix {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    data: Data,
}

/// Per weight row: its whole groups of [`GROUP`] blocks, then the blocks after them (`tail`),
/// and a scale (and minimum) per block as f16 bits, as GGUF has them.
enum Data {
    /// GGUF Q4_1: `w = d·q + m`, `q` unsigned 4-bit. A group is 128 bytes of nibbles: byte
    /// `32·k + i` holds byte `i` of interleaved vector `2·k` ([`interleaved`]) in its low nibble
    /// and of vector `2·k + 1` in its high one; a tail block is GGUF's 16 bytes (low nibbles are
    /// elements 0..16, high nibbles 16..32).
    Q4_1 {
        groups: Vec<[u8; GROUP_BYTES / 2]>,
        tail: Vec<[u8; 16]>,
        d: Vec<u16>,
        m: Vec<u16>,
    },
    /// GGUF Q8_0: `w = d·q`, `q` signed 8-bit; groups interleaved ([`interleaved`]).
    Q8_0 {
        groups: Vec<[i8; GROUP_BYTES]>,
        tail: Vec<[i8; BLOCK]>,
        d: Vec<u16>,
    },
    /// Any other format, dequantized.
    F32(Vec<f32>),
}

/// The 4-bit value of element `e` of block `j` of a Q4_1 group.
fn group_nibble(group: &[u8; GROUP_BYTES / 2], j: usize, e: usize) -> u8 {
    let i = interleaved(j, e);
    let (vector, byte) = (i / 32, i % 32);
    (group[32 * (vector / 2) + byte] >> (4 * (vector % 2))) & 0x0f
}

/// The 4-bit value of element `e` of a Q4_1 block in GGUF's layout.
fn gguf_nibble(q: &[u8; 16], e: usize) -> u8 {
    if e < 16 {
        q[e] & 0x0f
    } else {
        q[e - 16] >> 4
    }
}

/// A matrix's weight rows, as the kernels take them.
enum View<'a> {
    Q4_1(Q4_1Rows<'a>),
    Q8_0(Q8_0Rows<'a>),
    F32(&'a [f32]),
}

impl Matrix {
    /// From GGUF Q4_1 blocks (20 bytes each: d f16, m f16, 16 bytes of nibbles).
    pub(crate) fn q4_1(rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        let blocks = Self::blocks(rows, cols, bytes, 20, "q4_1")?;
        let kb = cols / BLOCK;
        let grouped = kb / GROUP * GROUP;
        let mut groups = Vec::with_capacity(rows * (kb / GROUP));
        let mut tail = Vec::with_capacity(rows * (kb % GROUP));
        let (mut d, mut m) = (Vec::with_capacity(blocks), Vec::with_capacity(blocks));
        for (i, blk) in bytes.chunks_exact(20).enumerate() {
            let b = i % kb;
            d.push(u16::from_le_bytes([blk[0], blk[1]]));
            m.push(u16::from_le_bytes([blk[2], blk[3]]));
            let q: &[u8; 16] = blk[4..20].try_into().expect("16 bytes");
            if b >= grouped {
                tail.push(*q);
                continue;
            }
            if b.is_multiple_of(GROUP) {
                groups.push([0u8; GROUP_BYTES / 2]);
            }
            let group = groups.last_mut().expect("pushed at the group's first block");
            for e in 0..BLOCK {
                let i = interleaved(b % GROUP, e);
                let (vector, byte) = (i / 32, i % 32);
                group[32 * (vector / 2) + byte] |= gguf_nibble(q, e) << (4 * (vector % 2));
            }
        }
        Ok(Matrix {
            rows,
            cols,
            data: Data::Q4_1 { groups, tail, d, m },
        })
    }

    /// From GGUF Q8_0 blocks (34 bytes each: d f16, 32 signed bytes).
    pub(crate) fn q8_0(rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        let blocks = Self::blocks(rows, cols, bytes, 34, "q8_0")?;
        let kb = cols / BLOCK;
        let grouped = kb / GROUP * GROUP;
        let mut groups = Vec::with_capacity(rows * (kb / GROUP));
        let mut tail = Vec::with_capacity(rows * (kb % GROUP));
        let mut d = Vec::with_capacity(blocks);
        for (i, blk) in bytes.chunks_exact(34).enumerate() {
            let b = i % kb;
            d.push(u16::from_le_bytes([blk[0], blk[1]]));
            let mut q = [0i8; BLOCK];
            for (q, &v) in q.iter_mut().zip(&blk[2..34]) {
                *q = v as i8;
            }
            if b >= grouped {
                tail.push(q);
                continue;
            }
            if b.is_multiple_of(GROUP) {
                groups.push([0i8; GROUP_BYTES]);
            }
            let group = groups.last_mut().expect("pushed at the group's first block");
            for (e, &v) in q.iter().enumerate() {
                group[interleaved(b % GROUP, e)] = v;
            }
        }
        Ok(Matrix {
            rows,
            cols,
            data: Data::Q8_0 { groups, tail, d },
        })
    }

    pub(crate) fn f32(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self> {
        if data.len() != rows * cols || !cols.is_multiple_of(BLOCK) {
            return Err(Error::Unsupported(format!(
                "a {rows}×{cols} matrix with {} values (columns must be a multiple of {BLOCK})",
                data.len()
            )));
        }
        Ok(Matrix {
            rows,
            cols,
            data: Data::F32(data),
        })
    }

    fn blocks(rows: usize, cols: usize, bytes: &[u8], size: usize, what: &str) -> Result<usize> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(Error::Unsupported(format!(
                "{what} rows of {cols} elements (not a multiple of {BLOCK})"
            )));
        }
        let blocks = rows
            .checked_mul(cols / BLOCK)
            .ok_or_else(|| Error::Invalid(format!("a {rows}×{cols} {what} matrix is too large")))?;
        if blocks.checked_mul(size) != Some(bytes.len()) {
            return Err(Error::Invalid(format!(
                "a {rows}×{cols} {what} matrix needs {blocks} blocks of {size} bytes, the file holds {} bytes",
                bytes.len()
            )));
        }
        Ok(blocks)
    }

    /// Blocks per row.
    fn kb(&self) -> usize {
        self.cols / BLOCK
    }

    fn view(&self) -> View<'_> {
        let kb = self.kb();
        match &self.data {
            Data::Q4_1 { groups, tail, d, m } => View::Q4_1(Q4_1Rows { groups, tail, d, m, kb }),
            Data::Q8_0 { groups, tail, d } => View::Q8_0(Q8_0Rows { groups, tail, d, kb }),
            Data::F32(w) => View::F32(w),
        }
    }

    /// Weight row `r`, dequantized into `out` (an embedding lookup).
    pub(crate) fn row_into(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols);
        let grouped = self.kb() / GROUP * GROUP;
        match self.view() {
            View::Q4_1(w) => {
                let col = w.col(r);
                for (b, out) in out.chunks_exact_mut(BLOCK).enumerate() {
                    let (d, m) = (f16_to_f32(col.d[b]), f16_to_f32(col.m[b]));
                    for (e, out) in out.iter_mut().enumerate() {
                        let q = match b < grouped {
                            true => group_nibble(&col.groups[b / GROUP], b % GROUP, e),
                            false => gguf_nibble(&col.tail[b - grouped], e),
                        };
                        *out = q as f32 * d + m;
                    }
                }
            }
            View::Q8_0(w) => {
                let col = w.col(r);
                for (b, out) in out.chunks_exact_mut(BLOCK).enumerate() {
                    let d = f16_to_f32(col.d[b]);
                    for (e, out) in out.iter_mut().enumerate() {
                        let q = match b < grouped {
                            true => col.groups[b / GROUP][interleaved(b % GROUP, e)],
                            false => col.tail[b - grouped][e],
                        };
                        *out = q as f32 * d;
                    }
                }
            }
            View::F32(w) => out.copy_from_slice(&w[r * self.cols..(r + 1) * self.cols]),
        }
    }

    /// `out[r * cols.len() + j] = x_r · row (cols.start + j)` for the at most [`ROWS`] activation
    /// rows `x_r` (`xq[r]` quantized, [`quantize_row`]).
    fn dots(&self, xs: &[&[f32]], xq: &[QuantRow], cols: std::ops::Range<usize>, out: &mut [f32]) {
        match self.view() {
            View::Q4_1(w) => dots_q4_1(&w, xq, cols, out),
            View::Q8_0(w) => dots_q8_0(&w, xq, cols, out),
            View::F32(w) => {
                let width = cols.len();
                for (j, c) in cols.enumerate() {
                    let row = &w[c * self.cols..(c + 1) * self.cols];
                    for (r, x) in xs.iter().enumerate() {
                        out[r * width + j] = dot_f32(row, x);
                    }
                }
            }
        }
    }

    /// `y = x · Wᵀ` for `m` activation rows: `x` is `m × cols`, `y` is `m × rows`. Parallel
    /// over weight rows on candle's CPU pool; see the module comment for why the numbers do not
    /// depend on `m` or the threads.
    pub(crate) fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) {
        let xq = match self.data {
            Data::F32(_) => Vec::new(),
            _ => quantize(x, self.cols),
        };
        self.matmul_quantized(x, &xq, m, y)
    }

    /// [`Matrix::matmul`] with `x` already quantized ([`quantize`]), for several matrices
    /// applied to the same activations (Q, K and V; gate and up). An f32 matrix ignores `xq`.
    pub(crate) fn matmul_quantized(&self, x: &[f32], xq: &[QuantRow], m: usize, y: &mut [f32]) {
        assert_eq!(x.len(), m * self.cols, "activation rows of {} elements", self.cols);
        assert_eq!(y.len(), m * self.rows, "output rows of {} elements", self.rows);
        // What the kernels rely on (they index without checks).
        let kb = self.kb();
        assert!(matches!(self.data, Data::F32(_)) || (xq.len() == m && xq.iter().all(|q| q.has_blocks(kb))));
        let out = SyncPtr(y.as_mut_ptr());
        let n = self.rows;
        // Work items: chunks of 16 weight rows, each multiplied with every activation row (up
        // to `ROWS` at once) while it is in cache.
        const CHUNK: usize = 16;
        let items = n.div_ceil(CHUNK);
        let rows: Vec<&[f32]> = x.chunks_exact(self.cols).collect();
        let work = |range: std::ops::Range<usize>| {
            let mut tmp = [0f32; CHUNK * ROWS];
            for item in range {
                let cols = item * CHUNK..((item + 1) * CHUNK).min(n);
                let len = cols.len();
                // Groups of up to `ROWS` rows (the kernels split a group further; a row's
                // numbers never depend on its group).
                let groups = (0..m).step_by(ROWS).map(|f| f..(f + ROWS).min(m));
                for group in groups {
                    let xq = if xq.is_empty() { &[][..] } else { &xq[group.clone()] };
                    self.dots(&rows[group.clone()], xq, cols.clone(), &mut tmp);
                    for (i, r) in group.enumerate() {
                        // SAFETY: every (row, column) of `y` belongs to exactly one work item,
                        // and `y` outlives the pool call.
                        unsafe {
                            let dst = out.get().add(r * n + cols.start);
                            std::ptr::copy_nonoverlapping(tmp.as_ptr().add(i * len), dst, len);
                        }
                    }
                }
            }
        };
        if items == 1 {
            work(0..1);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(items, work);
        }
    }
}

/// A raw pointer the pool's workers may share (each writes its own elements).
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub(crate) *mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// The dot product of two f32 slices in one fixed order: 8 lanes of partial sums (each a
/// sequential chain of fused multiply-adds), added in a fixed tree, then the tail (fused
/// multiply-adds onto the sum). Vectorized or not, the same numbers.
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2 is present; the lengths are equal.
        return unsafe { avx2_kernels::dot_f32(a, b) };
    }
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    dot_f32_finish(acc, a, b)
}

/// [`dot_f32`]'s lanes added in its tree, then its tail (the elements after the last 8).
#[inline(always)]
fn dot_f32_finish(acc: [f32; 8], a: &[f32], b: &[f32]) -> f32 {
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    let whole = a.len() / 8 * 8;
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        s = x.mul_add(*y, s);
    }
    s
}

/// `acc[i] += p × v[i]` (one fused multiply-add): [`weighted_sum_on`]'s step.
pub(crate) fn add_scaled(acc: &mut [f32], p: f32, v: &[f32]) {
    assert_eq!(acc.len(), v.len());
    for (a, &x) in acc.iter_mut().zip(v) {
        *a = p.mul_add(x, *a);
    }
}

/// Attention scores of one query head: `out[t] = dot_f32(q, key t) × scale` for `t <
/// out.len()`, where key `t` is `keys[t × stride + offset..][..q.len()]` (a cache of rows of
/// `stride` values), each in [`dot_f32`]'s order. The definition of one head's scores: the
/// engine runs [`scores_heads`], which gives these bits (and runs this where AVX2 is absent).
pub(crate) fn scores(q: &[f32], keys: &[f32], stride: usize, offset: usize, scale: f32, out: &mut [f32]) {
    assert_rows_within(out.len(), stride, offset + q.len(), keys.len(), "keys");
    let d = q.len();
    for (t, o) in out.iter_mut().enumerate() {
        *o = dot_f32(q, &keys[t * stride + offset..t * stride + offset + d]) * scale;
    }
}

/// The attention's weighted sum from a zeroed `out` ([`weighted_sum_on`]), the form the tests
/// compare with its definition.
#[cfg(test)]
pub(crate) fn weighted_sum(probs: &[f32], values: &[f32], stride: usize, offset: usize, out: &mut [f32]) {
    out.iter_mut().for_each(|o| *o = 0.0);
    weighted_sum_on(probs, values, stride, offset, out);
}

/// The attention's weighted sum, continued: adds `Σ probs[t] × value t` to `out`, with value
/// `t` = `values[t × stride + offset..][..out.len()]`, each element summed onto what `out`
/// holds in `t` order (fused multiply-adds): the bits of [`add_scaled`] called for
/// `t = 0, 1, …`. So a cache kept in chunks, summed chunk after chunk onto a zeroed `out`,
/// gives the bits of one call over all its values. The definition for one head: the engine
/// runs [`weighted_sums_on`], which gives these bits (and runs this where AVX2 is absent).
pub(crate) fn weighted_sum_on(probs: &[f32], values: &[f32], stride: usize, offset: usize, out: &mut [f32]) {
    assert_rows_within(probs.len(), stride, offset + out.len(), values.len(), "values");
    let d = out.len();
    for (t, &p) in probs.iter().enumerate() {
        add_scaled(out, p, &values[t * stride + offset..t * stride + offset + d]);
    }
}

/// [`scores`] of the `G` query heads that share one key head (`q`: their `G × d` values, head
/// after head), the keys read once for all of them: `out[g][t]` = [`scores`] of head `g`, the
/// same bits. Every `out[g]` is as long as the first.
pub(crate) fn scores_heads<const G: usize>(
    q: &[f32],
    keys: &[f32],
    stride: usize,
    offset: usize,
    scale: f32,
    out: &mut [&mut [f32]; G],
) {
    let d = group_width::<G>(q.len(), out.iter().map(|o| o.len()), stride, offset, keys.len(), "keys");
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2 is present; every key lies within `keys`, every output within its
        // slice (checked above).
        return unsafe { avx2_kernels::scores_heads::<G>(q, d, keys, stride, offset, scale, out) };
    }
    for (g, out) in out.iter_mut().enumerate() {
        scores(&q[g * d..(g + 1) * d], keys, stride, offset, scale, out);
    }
}

/// [`weighted_sum_on`] of the `G` query heads that share one value head, the values read
/// once for all of them: `out` (their `G × d` sums, head after head) gets `Σ probs[g][t] ×
/// value t` for head `g`, the same bits. Every `probs[g]` is as long as the first.
pub(crate) fn weighted_sums_on<const G: usize>(
    probs: &[&[f32]; G],
    values: &[f32],
    stride: usize,
    offset: usize,
    out: &mut [f32],
) {
    let d = group_width::<G>(
        out.len(),
        probs.iter().map(|p| p.len()),
        stride,
        offset,
        values.len(),
        "values",
    );
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2 is present; every value row lies within `values` (checked above).
        return unsafe { avx2_kernels::weighted_sums_on::<G>(probs, values, stride, offset, out) };
    }
    for (g, p) in probs.iter().enumerate() {
        weighted_sum_on(p, values, stride, offset, &mut out[g * d..(g + 1) * d]);
    }
}

/// The head width `d` of a group of `G` heads (`heads`: their `G × d` values), checking that
/// every head has as many scores or weights as the first (`per_head`) and that that many rows
/// of the cache, read from `offset` for `d` values each, lie within it.
fn group_width<const G: usize>(
    heads: usize,
    mut per_head: impl Iterator<Item = usize>,
    stride: usize,
    offset: usize,
    cache: usize,
    what: &str,
) -> usize {
    let d = heads / G;
    assert_eq!(heads, G * d, "whole heads");
    let n = per_head.next().expect("a group of at least one head");
    assert!(per_head.all(|m| m == n), "as many {what} for every head");
    assert_rows_within(n, stride, offset + d, cache, what);
    d
}

/// That `n` rows of `stride` values, each read up to `end` values into its row, lie within a
/// cache of `len` values (what the attention's unsafe kernels rely on).
fn assert_rows_within(n: usize, stride: usize, end: usize, len: usize, what: &str) {
    if let Some(last) = n.checked_sub(1) {
        assert!(last * stride + end <= len, "{what} within the cache");
    }
}

/// Whether the AVX2 kernels run: what `exp`'s vectorized forms need (AVX2 and FMA), and F16C.
fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static SIMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *SIMD.get_or_init(|| crate::exp::simd() && std::is_x86_feature_detected!("f16c"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Activation rows one kernel call multiplies with a weight row (its blocks decoded once).
pub(crate) const ROWS: usize = 8;

/// The weight rows of a Q4_1 matrix ([`Data::Q4_1`]), `kb` blocks each.
#[derive(Clone, Copy)]
pub(crate) struct Q4_1Rows<'a> {
    groups: &'a [[u8; GROUP_BYTES / 2]],
    tail: &'a [[u8; 16]],
    d: &'a [u16],
    m: &'a [u16],
    kb: usize,
}

impl<'a> Q4_1Rows<'a> {
    #[inline(always)]
    fn col(&self, c: usize) -> Q4_1Col<'a> {
        let (kb, g, t) = (self.kb, self.kb / GROUP, self.kb % GROUP);
        Q4_1Col {
            groups: &self.groups[c * g..(c + 1) * g],
            tail: &self.tail[c * t..(c + 1) * t],
            d: &self.d[c * kb..(c + 1) * kb],
            m: &self.m[c * kb..(c + 1) * kb],
        }
    }
}

/// The weight rows of a Q8_0 matrix ([`Data::Q8_0`]), `kb` blocks each.
#[derive(Clone, Copy)]
pub(crate) struct Q8_0Rows<'a> {
    groups: &'a [[i8; GROUP_BYTES]],
    tail: &'a [[i8; BLOCK]],
    d: &'a [u16],
    kb: usize,
}

impl<'a> Q8_0Rows<'a> {
    #[inline(always)]
    fn col(&self, c: usize) -> Q8_0Col<'a> {
        let (kb, g, t) = (self.kb, self.kb / GROUP, self.kb % GROUP);
        Q8_0Col {
            groups: &self.groups[c * g..(c + 1) * g],
            tail: &self.tail[c * t..(c + 1) * t],
            d: &self.d[c * kb..(c + 1) * kb],
        }
    }
}

/// One weight row of a Q4_1 matrix ([`Data::Q4_1`]): `d` and `m` per block.
pub(crate) struct Q4_1Col<'a> {
    pub(crate) groups: &'a [[u8; GROUP_BYTES / 2]],
    pub(crate) tail: &'a [[u8; 16]],
    pub(crate) d: &'a [u16],
    pub(crate) m: &'a [u16],
}

/// One weight row of a Q8_0 matrix ([`Data::Q8_0`]).
pub(crate) struct Q8_0Col<'a> {
    pub(crate) groups: &'a [[i8; GROUP_BYTES]],
    pub(crate) tail: &'a [[i8; BLOCK]],
    pub(crate) d: &'a [u16],
}

/// Which dot product instruction the AVX2 kernels may use (checked once): AVX-VNNI's where the
/// CPU has it, else AVX512-VNNI's on 256-bit vectors where it has that (with AVX512-VL), else
/// none (`avx2_kernels::PLAIN`, also without AVX2).
fn dot_kind() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        static KIND: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
        *KIND.get_or_init(|| {
            if !simd() {
                avx2_kernels::PLAIN
            } else if std::is_x86_feature_detected!("avxvnni") {
                avx2_kernels::AVX_VNNI
            } else if std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl") {
                avx2_kernels::AVX512_VNNI
            } else {
                avx2_kernels::PLAIN
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// Which kernels the CPU engine's products run on this CPU, for reports.
pub(crate) fn kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    match dot_kind() {
        avx2_kernels::AVX_VNNI => return "AVX2 with AVX-VNNI",
        avx2_kernels::AVX512_VNNI => return "AVX2 with AVX512-VNNI (256-bit)",
        _ if simd() => return "AVX2",
        _ => {}
    }
    "portable"
}

/// `out[r * cols.len() + j] = xs[r] · row (cols.start + j)` of `w`, for any number of rows.
fn dots_q4_1(w: &Q4_1Rows, xs: &[QuantRow], cols: std::ops::Range<usize>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match dot_kind() {
        // SAFETY: AVX2, F16C, FMA and AVX-VNNI are present.
        avx2_kernels::AVX_VNNI => return unsafe { avx2_kernels::dots_q4_1_vnni(w, xs, cols, out) },
        // SAFETY: AVX2, F16C, FMA, AVX512-VNNI and AVX512-VL are present.
        avx2_kernels::AVX512_VNNI => return unsafe { avx2_kernels::dots_q4_1_vnni512(w, xs, cols, out) },
        _ => {}
    }
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2, F16C and FMA are present.
        return unsafe { avx2_kernels::dots_q4_1(w, xs, cols, out) };
    }
    portable::dots_q4_1(w, xs, cols, out)
}

fn dots_q8_0(w: &Q8_0Rows, xs: &[QuantRow], cols: std::ops::Range<usize>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match dot_kind() {
        // SAFETY: AVX2, F16C, FMA and AVX-VNNI are present.
        avx2_kernels::AVX_VNNI => return unsafe { avx2_kernels::dots_q8_0_vnni(w, xs, cols, out) },
        // SAFETY: AVX2, F16C, FMA, AVX512-VNNI and AVX512-VL are present.
        avx2_kernels::AVX512_VNNI => return unsafe { avx2_kernels::dots_q8_0_vnni512(w, xs, cols, out) },
        _ => {}
    }
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2, F16C and FMA are present.
        return unsafe { avx2_kernels::dots_q8_0(w, xs, cols, out) };
    }
    portable::dots_q8_0(w, xs, cols, out)
}

/// Runs `one` (the products of one weight row with every row of `xs`) for each weight row of
/// `cols`, writing `out[r * cols.len() + j]`.
#[inline(always)]
fn each_col(n: usize, cols: std::ops::Range<usize>, out: &mut [f32], mut one: impl FnMut(usize, &mut [f32])) {
    let width = cols.len();
    assert!(n <= ROWS && out.len() >= n * width);
    let mut tmp = [0f32; ROWS];
    for (j, c) in cols.enumerate() {
        one(c, &mut tmp[..n]);
        for (r, &v) in tmp[..n].iter().enumerate() {
            out[r * width + j] = v;
        }
    }
}

/// The fixed order in which 8 lane sums are added (the one an AVX2 horizontal add of two
/// 128-bit halves, then pairs, computes).
#[inline(always)]
fn reduce_lanes(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// The kernels, as the definition of the numbers the AVX2 ones reproduce. For each weight row
/// and activation row:
/// - the blocks of whole groups ([`GROUP`]): block `b` goes to lane `b % 8`; its 32 products are
///   summed exactly as an integer; that sum (as f32) times the activation block's scale `d_x`
///   is multiplied by the weight block's `d_w` and added to the lane's accumulator in one fused
///   multiply-add; a Q4_1 block then adds its offset `m_b · s_b` in a second one;
/// - the blocks after them (the tail), in a second accumulator: the 32 products summed exactly
///   in 8 lanes of 4 consecutive elements, each lane's sum times `d_x`, then times `d_w` and
///   added in one fused multiply-add; a Q4_1 tail's offsets `m_b · s_b` are summed in order by
///   fused multiply-adds into a scalar;
/// - the result is `lanes(groups) + (lanes(tail) + offsets(tail))` (Q8_0: `lanes(groups) +
///   lanes(tail)`), lanes added by [`reduce_lanes`].
pub(crate) mod portable {
    use super::*;

    pub(crate) fn dots_q4_1(w: &Q4_1Rows, xs: &[QuantRow], cols: std::ops::Range<usize>, out: &mut [f32]) {
        each_col(xs.len(), cols, out, |c, out| dot_q4_1(&w.col(c), xs, out))
    }

    pub(crate) fn dots_q8_0(w: &Q8_0Rows, xs: &[QuantRow], cols: std::ops::Range<usize>, out: &mut [f32]) {
        each_col(xs.len(), cols, out, |c, out| dot_q8_0(&w.col(c), xs, out))
    }

    fn lanes_q4_1(q: &[u8; 16], a: &[i8; BLOCK]) -> [i32; 8] {
        std::array::from_fn(|lane| {
            (4 * lane..4 * lane + 4)
                .map(|e| gguf_nibble(q, e) as i32 * a[e] as i32)
                .sum()
        })
    }

    fn dot_q4_1(col: &Q4_1Col, xs: &[QuantRow], out: &mut [f32]) {
        let grouped = col.groups.len() * GROUP;
        for (x, out) in xs.iter().zip(out) {
            let mut acc = [0f32; 8];
            for (g, (w, a)) in col.groups.iter().zip(&x.groups).enumerate() {
                for (j, acc) in acc.iter_mut().enumerate() {
                    let b = g * GROUP + j;
                    let sum: i32 = (0..BLOCK)
                        .map(|e| group_nibble(w, j, e) as i32 * a[interleaved(j, e)] as i32)
                        .sum();
                    *acc = (sum as f32 * x.d[b]).mul_add(f16_to_f32(col.d[b]), *acc);
                    *acc = f16_to_f32(col.m[b]).mul_add(x.s[b], *acc);
                }
            }
            let (mut tail, mut offsets) = ([0f32; 8], 0f32);
            for (t, (w, a)) in col.tail.iter().zip(&x.tail).enumerate() {
                let b = grouped + t;
                for (acc, sum) in tail.iter_mut().zip(lanes_q4_1(w, a)) {
                    *acc = (sum as f32 * x.d[b]).mul_add(f16_to_f32(col.d[b]), *acc);
                }
                offsets = f16_to_f32(col.m[b]).mul_add(x.s[b], offsets);
            }
            *out = reduce_lanes(acc) + (reduce_lanes(tail) + offsets);
        }
    }

    fn dot_q8_0(col: &Q8_0Col, xs: &[QuantRow], out: &mut [f32]) {
        let grouped = col.groups.len() * GROUP;
        for (x, out) in xs.iter().zip(out) {
            let mut acc = [0f32; 8];
            for (g, (w, a)) in col.groups.iter().zip(&x.groups).enumerate() {
                for (j, acc) in acc.iter_mut().enumerate() {
                    let b = g * GROUP + j;
                    let sum: i32 = (0..BLOCK)
                        .map(|e| w[interleaved(j, e)] as i32 * a[interleaved(j, e)] as i32)
                        .sum();
                    *acc = (sum as f32 * x.d[b]).mul_add(f16_to_f32(col.d[b]), *acc);
                }
            }
            let mut tail = [0f32; 8];
            for (t, (w, a)) in col.tail.iter().zip(&x.tail).enumerate() {
                let b = grouped + t;
                for (lane, acc) in tail.iter_mut().enumerate() {
                    let sum: i32 = (4 * lane..4 * lane + 4).map(|e| w[e] as i32 * a[e] as i32).sum();
                    *acc = (sum as f32 * x.d[b]).mul_add(f16_to_f32(col.d[b]), *acc);
                }
            }
            *out = reduce_lanes(acc) + reduce_lanes(tail);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2_kernels {
    use super::*;
    use std::arch::x86_64::*;

    /// [`super::dot_f32`]; `a` and `b` of equal lengths.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for i in 0..a.len() / 8 {
            let x = _mm256_loadu_ps(a.as_ptr().add(8 * i));
            let y = _mm256_loadu_ps(b.as_ptr().add(8 * i));
            acc = _mm256_fmadd_ps(x, y, acc);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        dot_f32_finish(lanes, a, b)
    }

    /// [`super::quantize_block`] vectorized, for a block of finite values with a finite
    /// `1 / d` (`None` otherwise: the caller takes the scalar path). Round half away from zero
    /// as `f32::round`: truncate, then step away when the dropped fraction (exact) is at least
    /// one half.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_block(block: &[f32], q: &mut [i8; BLOCK]) -> Option<(f32, i32)> {
        assert_eq!(block.len(), BLOCK);
        let p = block.as_ptr();
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let sign = _mm256_set1_ps(-0.0);
        let zero = _mm256_setzero_ps();
        let mut amax = zero;
        let mut finite = _mm256_cmp_ps(zero, zero, _CMP_EQ_OQ);
        for v in v {
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
            // `v - v` is 0 for a finite value and NaN for an infinite or NaN one.
            finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_EQ_OQ));
        }
        if _mm256_movemask_ps(finite) != 0xff {
            return None;
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        if !id.is_finite() {
            return None;
        }
        let (idv, half, one, lim) = (
            _mm256_set1_ps(id),
            _mm256_set1_ps(0.5),
            _mm256_set1_ps(1.0),
            _mm256_set1_ps(127.0),
        );
        let mut ints = [_mm256_setzero_si256(); 4];
        for (int, v) in ints.iter_mut().zip(v) {
            let x = _mm256_mul_ps(v, idv);
            let t = _mm256_round_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            let up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(x, t)), half, _CMP_GE_OQ);
            let step = _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(x, sign)));
            let r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(t, step), _mm256_sub_ps(zero, lim)), lim);
            *int = _mm256_cvttps_epi32(r);
        }
        // i32 → i8 by saturating packs (exact: within ±127), which interleave 4-byte runs per
        // 128-bit half; the permutation puts elements 0..32 back in order.
        let a = _mm256_packs_epi32(ints[0], ints[1]);
        let b = _mm256_packs_epi32(ints[2], ints[3]);
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes);
        let s = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        Some((d, _mm_cvtsi128_si32(s)))
    }

    /// [`super::scores_heads`]: 4 keys at a time, each key's vectors loaded once for the `G`
    /// heads, one partial-sum vector per key and head, their lanes added in
    /// [`dot_f32_finish`]'s tree. A head width with a tail, and the keys after the last 4, go
    /// through [`dot_f32`] one by one.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_heads<const G: usize>(
        q: &[f32],
        d: usize,
        keys: &[f32],
        stride: usize,
        offset: usize,
        scale: f32,
        out: &mut [&mut [f32]; G],
    ) {
        const KEYS: usize = 4;
        let key = |t: usize| keys.as_ptr().add(t * stride + offset);
        let n = out[0].len();
        let mut t = 0;
        while d.is_multiple_of(8) && t + KEYS <= n {
            let mut acc = [[_mm256_setzero_ps(); KEYS]; G];
            for i in 0..d / 8 {
                for k in 0..KEYS {
                    let y = _mm256_loadu_ps(key(t + k).add(8 * i));
                    for (g, acc) in acc.iter_mut().enumerate() {
                        let x = _mm256_loadu_ps(q.as_ptr().add(g * d + 8 * i));
                        acc[k] = _mm256_fmadd_ps(x, y, acc[k]);
                    }
                }
            }
            for (acc, out) in acc.iter().zip(out.iter_mut()) {
                // `hadd` of two keys' vectors gives each key's lane pairs (0+1), (2+3) in the
                // low half and (4+5), (6+7) in the high one; a second `hadd` gives per key
                // (01+23) low and (45+67) high, then added: `dot_f32_finish`'s tree.
                let a = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
                let sums = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
                _mm_storeu_ps(out.as_mut_ptr().add(t), _mm_mul_ps(sums, _mm_set1_ps(scale)));
            }
            t += KEYS;
        }
        for t in t..n {
            let k = std::slice::from_raw_parts(key(t), d);
            for (g, out) in out.iter_mut().enumerate() {
                *out.get_unchecked_mut(t) = dot_f32(q.get_unchecked(g * d..(g + 1) * d), k) * scale;
            }
        }
    }

    /// [`super::weighted_sums_on`]: 32 columns at a time (then 8) for the `G` heads, held in
    /// registers across all `t`, each value vector loaded once for all heads; the columns after
    /// the last 8 one by one, as [`weighted_sum_on`] does.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sums_on<const G: usize>(
        probs: &[&[f32]; G],
        values: &[f32],
        stride: usize,
        offset: usize,
        out: &mut [f32],
    ) {
        let d = out.len() / G;
        let whole = d / 8 * 8;
        let mut c = 0;
        while c < whole {
            let (v, o) = (values.as_ptr().add(offset + c), out.as_mut_ptr().add(c));
            if c + 32 <= whole {
                columns_heads::<G, 4>(probs, v, stride, o, d);
                c += 32;
            } else {
                columns_heads::<G, 1>(probs, v, stride, o, d);
                c += 8;
            }
        }
        for (g, probs) in probs.iter().enumerate() {
            for (t, &p) in probs.iter().enumerate() {
                let v = values.as_ptr().add(t * stride + offset);
                for j in whole..d {
                    let o = out.get_unchecked_mut(g * d + j);
                    *o = p.mul_add(*v.add(j), *o);
                }
            }
        }
    }

    /// `W` vectors of columns of [`weighted_sums_on`] for the `G` heads, from `v` (value 0's
    /// first column) onto `out` (head 0's first column; head `g`'s `g × d` further).
    #[inline(always)]
    unsafe fn columns_heads<const G: usize, const W: usize>(
        probs: &[&[f32]; G],
        v: *const f32,
        stride: usize,
        out: *mut f32,
        d: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); W]; G];
        for (g, acc) in acc.iter_mut().enumerate() {
            for (j, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_loadu_ps(out.add(g * d + 8 * j));
            }
        }
        for t in 0..probs[0].len() {
            let row = v.add(t * stride);
            for j in 0..W {
                let x = _mm256_loadu_ps(row.add(8 * j));
                for (g, acc) in acc.iter_mut().enumerate() {
                    let p = _mm256_set1_ps(*probs.get_unchecked(g).get_unchecked(t));
                    acc[j] = _mm256_fmadd_ps(p, x, acc[j]);
                }
            }
        }
        for (g, acc) in acc.iter().enumerate() {
            for (j, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(g * d + 8 * j), *acc);
            }
        }
    }

    /// [`reduce`] of each of `R` vectors, two at a time (one per 128-bit half): the same
    /// additions of the same operands in the same order, in half the instructions.
    #[inline(always)]
    unsafe fn reduce_each<const R: usize>(v: &[__m256; R]) -> [f32; R] {
        let mut out = [0f32; R];
        let mut r = 0;
        while r + 2 <= R {
            let (a, b) = (v[r], v[r + 1]);
            // Lane j of each half: its vector's low lane j plus its high lane j.
            let s = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
            // Lanes 0 and 1 of each half: s0 + s2 and s1 + s3 (`reduce`'s `movehl`).
            let s = _mm256_add_ps(s, _mm256_permute_ps(s, 0b11_10_11_10));
            // Lane 0 of each half: (s0 + s2) + (s1 + s3).
            let s = _mm256_add_ps(s, _mm256_permute_ps(s, 0b01));
            out[r] = _mm256_cvtss_f32(s);
            out[r + 1] = _mm_cvtss_f32(_mm256_extractf128_ps(s, 1));
            r += 2;
        }
        if r < R {
            out[r] = reduce(v[r]);
        }
        out
    }

    /// [`reduce_lanes`] of a vector.
    #[inline(always)]
    unsafe fn reduce(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[inline(always)]
    unsafe fn half(h: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    /// 8 f16 values from `p`, as f32.
    #[inline(always)]
    unsafe fn halves(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    #[inline(always)]
    unsafe fn load(p: *const i8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    /// Which instruction sums 4 `u8 × i8` products into an `i32` lane (a const parameter of
    /// the kernels): none ([`PLAIN`]: two instructions and a multiply by ones), AVX-VNNI's
    /// (VEX), or AVX512-VNNI's on 256-bit vectors (EVEX: CPUs with AVX-512 but without
    /// AVX-VNNI, such as AMD Zen 4 and Intel Ice Lake servers; the kernel then also has 32
    /// vector registers). The same integers every way.
    pub(super) const PLAIN: u8 = 0;
    pub(super) const AVX_VNNI: u8 = 1;
    pub(super) const AVX512_VNNI: u8 = 2;

    /// `acc` plus the 8 exact sums of 4 consecutive `u8 × i8` products: VNNI's one
    /// instruction, or the pairs summed into i16 then into i32 (no saturation for the operands
    /// here, see the callers): the same integers either way.
    #[inline(always)]
    unsafe fn dot4<const DOT: u8>(acc: __m256i, w: __m256i, a: __m256i, ones: __m256i) -> __m256i {
        match DOT {
            AVX_VNNI => _mm256_dpbusd_avx_epi32(acc, w, a),
            AVX512_VNNI => _mm256_dpbusd_epi32(acc, w, a),
            _ => _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones)),
        }
    }

    #[inline(always)]
    unsafe fn nibbles(q: &[u8; 16], mask: __m128i) -> __m256i {
        let q = _mm_loadu_si128(q.as_ptr() as *const __m128i);
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask))
    }

    /// `out[r] = col · xs[r]` for exactly `R` rows, each weight vector decoded once for all.
    #[inline(always)]
    unsafe fn q4_1_rows<const DOT: u8, const R: usize>(col: &Q4_1Col, xs: &[QuantRow], out: &mut [f32]) {
        let mask = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for g in 0..col.groups.len() {
            let w = col.groups.get_unchecked(g).as_ptr();
            let mut sums = [_mm256_setzero_si256(); R];
            for k in 0..4 {
                let q = _mm256_loadu_si256(w.add(32 * k) as *const __m256i);
                let lo = _mm256_and_si256(q, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                for (r, sum) in sums.iter_mut().enumerate() {
                    let a = xs.get_unchecked(r).groups.get_unchecked(g).as_ptr().add(64 * k);
                    // u4 × i8 pairs summed into i16 (at most 2 × 15 × 128: no saturation), then
                    // lanes of 4 in i32: exact, and exact in f32 (at most 61,440 per block).
                    *sum = dot4::<DOT>(*sum, lo, load(a), ones);
                    *sum = dot4::<DOT>(*sum, hi, load(a.add(32)), ones);
                }
            }
            let (d, m) = (
                halves(col.d.as_ptr().add(GROUP * g)),
                halves(col.m.as_ptr().add(GROUP * g)),
            );
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = xs.get_unchecked(r);
                let xd = _mm256_loadu_ps(x.d.as_ptr().add(GROUP * g));
                let l = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r]), xd);
                *acc = _mm256_fmadd_ps(l, d, *acc);
                *acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(x.s.as_ptr().add(GROUP * g)), *acc);
            }
        }
        let grouped = col.groups.len() * GROUP;
        let mask = _mm_set1_epi8(0x0f);
        let mut tail = [_mm256_setzero_ps(); R];
        let mut offsets = [0f32; R];
        for t in 0..col.tail.len() {
            let b = grouped + t;
            let w = nibbles(col.tail.get_unchecked(t), mask);
            let (d, m) = (half(*col.d.get_unchecked(b)), half(*col.m.get_unchecked(b)));
            for r in 0..R {
                let x = xs.get_unchecked(r);
                let l = dot4::<DOT>(_mm256_setzero_si256(), w, load(x.tail.get_unchecked(t).as_ptr()), ones);
                let l = _mm256_mul_ps(_mm256_cvtepi32_ps(l), _mm256_broadcast_ss(x.d.get_unchecked(b)));
                tail[r] = _mm256_fmadd_ps(l, _mm256_set1_ps(d), tail[r]);
                offsets[r] = m.mul_add(*x.s.get_unchecked(b), offsets[r]);
            }
        }
        let (acc, tail) = (reduce_each(&acc), reduce_each(&tail));
        for r in 0..R {
            *out.get_unchecked_mut(r) = acc[r] + (tail[r] + offsets[r]);
        }
    }

    /// `out[r] = col · xs[r]` for exactly `R` rows.
    #[inline(always)]
    unsafe fn q8_0_rows<const DOT: u8, const R: usize>(col: &Q8_0Col, xs: &[QuantRow], out: &mut [f32]) {
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        let mut acc = [_mm256_setzero_ps(); R];
        for g in 0..col.groups.len() {
            let w = col.groups.get_unchecked(g).as_ptr();
            let mut sums = [_mm256_setzero_si256(); R];
            for s in 0..8 {
                let v = load(w.add(32 * s));
                // VNNI: `w + 128` (unsigned) × a, and 128 × the block's sum taken off below.
                // Otherwise |w| × (a with w's sign): |w| ≤ 128 and |a| ≤ 127, pairs sum to at
                // most 32,512 (no saturation). The same integers.
                let u = if DOT != PLAIN {
                    _mm256_xor_si256(v, flip)
                } else {
                    _mm256_sign_epi8(v, v)
                };
                for (r, sum) in sums.iter_mut().enumerate() {
                    let a = load(xs.get_unchecked(r).groups.get_unchecked(g).as_ptr().add(32 * s));
                    let a = if DOT != PLAIN { a } else { _mm256_sign_epi8(a, v) };
                    *sum = dot4::<DOT>(*sum, u, a, ones);
                }
            }
            let d = halves(col.d.as_ptr().add(GROUP * g));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = xs.get_unchecked(r);
                let mut sum = sums[r];
                if DOT != PLAIN {
                    let asum = _mm256_loadu_si256(x.sum.as_ptr().add(GROUP * g) as *const __m256i);
                    sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(asum, 7));
                }
                let xd = _mm256_loadu_ps(x.d.as_ptr().add(GROUP * g));
                let l = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), xd);
                *acc = _mm256_fmadd_ps(l, d, *acc);
            }
        }
        let grouped = col.groups.len() * GROUP;
        let mut tail = [_mm256_setzero_ps(); R];
        for t in 0..col.tail.len() {
            let b = grouped + t;
            let w = load(col.tail.get_unchecked(t).as_ptr());
            let wabs = _mm256_sign_epi8(w, w);
            let d = _mm256_set1_ps(half(*col.d.get_unchecked(b)));
            for (r, tail) in tail.iter_mut().enumerate() {
                let x = xs.get_unchecked(r);
                let a = _mm256_sign_epi8(load(x.tail.get_unchecked(t).as_ptr()), w);
                let l = dot4::<DOT>(_mm256_setzero_si256(), wabs, a, ones);
                let l = _mm256_mul_ps(_mm256_cvtepi32_ps(l), _mm256_broadcast_ss(x.d.get_unchecked(b)));
                *tail = _mm256_fmadd_ps(l, d, *tail);
            }
        }
        let (acc, tail) = (reduce_each(&acc), reduce_each(&tail));
        for r in 0..R {
            *out.get_unchecked_mut(r) = acc[r] + tail[r];
        }
    }

    /// Groups of [`ROWS`], then one of half as many, then the rest one by one; every row's
    /// numbers are the same either way.
    #[inline(always)]
    unsafe fn q4_1_any<const DOT: u8>(col: &Q4_1Col, xs: &[QuantRow], out: &mut [f32]) {
        // Checked once per product by `Matrix::matmul`.
        let kb = col.d.len();
        debug_assert!(col.m.len() == kb && out.len() == xs.len());
        debug_assert!(xs.iter().all(|x| x.has_blocks(kb)));
        let mut i = 0;
        while i + ROWS <= xs.len() {
            q4_1_rows::<DOT, ROWS>(col, &xs[i..i + ROWS], &mut out[i..i + ROWS]);
            i += ROWS;
        }
        if i + ROWS / 2 <= xs.len() {
            q4_1_rows::<DOT, { ROWS / 2 }>(col, &xs[i..i + ROWS / 2], &mut out[i..i + ROWS / 2]);
            i += ROWS / 2;
        }
        while i < xs.len() {
            q4_1_rows::<DOT, 1>(col, &xs[i..i + 1], &mut out[i..i + 1]);
            i += 1;
        }
    }

    #[inline(always)]
    unsafe fn q8_0_any<const DOT: u8>(col: &Q8_0Col, xs: &[QuantRow], out: &mut [f32]) {
        // Checked once per product by `Matrix::matmul`.
        let kb = col.d.len();
        debug_assert!(out.len() == xs.len());
        debug_assert!(xs.iter().all(|x| x.has_blocks(kb)));
        let mut i = 0;
        while i + ROWS <= xs.len() {
            q8_0_rows::<DOT, ROWS>(col, &xs[i..i + ROWS], &mut out[i..i + ROWS]);
            i += ROWS;
        }
        if i + ROWS / 2 <= xs.len() {
            q8_0_rows::<DOT, { ROWS / 2 }>(col, &xs[i..i + ROWS / 2], &mut out[i..i + ROWS / 2]);
            i += ROWS / 2;
        }
        while i < xs.len() {
            q8_0_rows::<DOT, 1>(col, &xs[i..i + 1], &mut out[i..i + 1]);
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn dots_q4_1(w: &Q4_1Rows, xs: &[QuantRow], cols: std::ops::Range<usize>, out: &mut [f32]) {
        each_col(xs.len(), cols, out, |c, out| q4_1_any::<PLAIN>(&w.col(c), xs, out))
    }

    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn dots_q8_0(w: &Q8_0Rows, xs: &[QuantRow], cols: std::ops::Range<usize>, out: &mut [f32]) {
        each_col(xs.len(), cols, out, |c, out| q8_0_any::<PLAIN>(&w.col(c), xs, out))
    }

    /// [`dots_q4_1`] with AVX-VNNI's dot product instruction (the same numbers).
    #[target_feature(enable = "avx2,f16c,fma,avxvnni")]
    pub(super) unsafe fn dots_q4_1_vnni(w: &Q4_1Rows, xs: &[QuantRow], cols: std::ops::Range<usize>, out: &mut [f32]) {
        each_col(xs.len(), cols, out, |c, out| q4_1_any::<AVX_VNNI>(&w.col(c), xs, out))
    }

    #[target_feature(enable = "avx2,f16c,fma,avxvnni")]
    pub(super) unsafe fn dots_q8_0_vnni(w: &Q8_0Rows, xs: &[QuantRow], cols: std::ops::Range<usize>, out: &mut [f32]) {
        each_col(xs.len(), cols, out, |c, out| q8_0_any::<AVX_VNNI>(&w.col(c), xs, out))
    }

    /// [`dots_q4_1`] with AVX512-VNNI's dot product instruction on 256-bit vectors (the same
    /// numbers).
    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn dots_q4_1_vnni512(
        w: &Q4_1Rows,
        xs: &[QuantRow],
        cols: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        each_col(xs.len(), cols, out, |c, out| {
            q4_1_any::<AVX512_VNNI>(&w.col(c), xs, out)
        })
    }

    #[target_feature(enable = "avx2,f16c,fma,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn dots_q8_0_vnni512(
        w: &Q8_0Rows,
        xs: &[QuantRow],
        cols: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        each_col(xs.len(), cols, out, |c, out| {
            q8_0_any::<AVX512_VNNI>(&w.col(c), xs, out)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::exp::tests::values;

    fn q4_1_bytes(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let v = values(rows * cols, seed);
        let mut out = Vec::new();
        for (i, block) in v.chunks_exact(BLOCK).enumerate() {
            // Scales near 1/16 and minimums near -1, different per block.
            out.extend_from_slice(&(0x2c00u16 + (i % 7) as u16 * 37).to_le_bytes());
            out.extend_from_slice(&(0xbc00u16 + (i % 5) as u16 * 53).to_le_bytes());
            for j in 0..16 {
                let lo = ((block[j] + 1.0) * 7.5) as u8 & 0x0f;
                let hi = ((block[j + 16] + 1.0) * 7.5) as u8 & 0x0f;
                out.push(lo | (hi << 4));
            }
        }
        out
    }

    fn q8_0_bytes(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let v = values(rows * cols, seed);
        let mut out = Vec::new();
        for (i, block) in v.chunks_exact(BLOCK).enumerate() {
            // Scales near 1/128, different per block.
            out.extend_from_slice(&(0x2000u16 + (i % 11) as u16 * 29).to_le_bytes());
            out.extend(block.iter().map(|x| ((x * 127.0) as i8) as u8));
        }
        // One extreme value, to cover -128.
        out[2] = 0x80;
        out
    }

    /// 96 columns: 3 blocks, all a tail; 320: one whole group and a tail of 2.
    fn matrices(cols: usize) -> Vec<Matrix> {
        let rows = 37;
        vec![
            Matrix::q4_1(rows, cols, &q4_1_bytes(rows, cols, 1)).unwrap(),
            Matrix::q8_0(rows, cols, &q8_0_bytes(rows, cols, 2)).unwrap(),
            Matrix::f32(rows, cols, values(rows * cols, 3)).unwrap(),
        ]
    }

    #[test]
    fn f16_conversion_is_exact() {
        for (h, f) in [
            (0x0000u16, 0.0f32),
            (0x3c00, 1.0),
            (0xbc00, -1.0),
            (0x2c00, 0.0625),
            (0x7bff, 65504.0),
            (0x0001, 5.960_464_5e-8),
            (0x03ff, 6.097_555e-5),
            (0x7c00, f32::INFINITY),
        ] {
            assert_eq!(f16_to_f32(h), f, "{h:#06x}");
        }
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn a_product_is_close_to_the_dequantized_one() {
        for cols in [96, 320] {
            close_to_the_dequantized_one(cols);
        }
    }

    fn close_to_the_dequantized_one(cols: usize) {
        let x = values(3 * cols, 9);
        for w in matrices(cols) {
            let mut y = vec![0f32; 3 * w.rows];
            w.matmul(&x, 3, &mut y);
            let mut row = vec![0f32; w.cols];
            for r in 0..3 {
                for c in 0..w.rows {
                    w.row_into(c, &mut row);
                    let exact: f32 = row.iter().zip(&x[r * cols..(r + 1) * cols]).map(|(a, b)| a * b).sum();
                    let got = y[r * w.rows + c];
                    assert!((got - exact).abs() < 0.05 + exact.abs() * 0.02, "{got} vs {exact}");
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_the_rows_beside_it() {
        for cols in [96, 320] {
            row_alone_and_among_others(cols);
        }
    }

    fn row_alone_and_among_others(cols: usize) {
        let m = 8;
        let x = values(m * cols, 11);
        for w in matrices(cols) {
            let mut all = vec![0f32; m * w.rows];
            w.matmul(&x, m, &mut all);
            for r in 0..m {
                let mut one = vec![0f32; w.rows];
                w.matmul(&x[r * cols..(r + 1) * cols], 1, &mut one);
                let batched = &all[r * w.rows..(r + 1) * w.rows];
                assert!(
                    one.iter().zip(batched).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "row {r} alone differs from row {r} among {m}"
                );
            }
        }
    }

    #[test]
    fn the_avx2_kernels_agree_with_the_portable_ones_to_the_bit() {
        if !simd() {
            eprintln!("no AVX2, F16C and FMA on this CPU: nothing to compare");
            return;
        }
        // The dot product instructions this CPU has: each of their kernels is compared too.
        let avx = std::is_x86_feature_detected!("avxvnni");
        let avx512 = std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl");
        eprintln!(
            "the portable kernels against AVX2 (plain){}{}",
            if avx { ", AVX-VNNI" } else { "" },
            if avx512 { ", AVX512-VNNI" } else { "" }
        );
        // 96 columns: 3 blocks (no whole group, a tail); 320: 10 blocks (one group and a tail
        // of 2); 512: two groups, no tail; 576: the model's rows (two groups, a tail of 2).
        for cols in [96usize, 320, 512, 576] {
            let quantized: Vec<QuantRow> = (0..ROWS as u64)
                .map(|i| {
                    let mut q = QuantRow::default();
                    quantize_row(&values(cols, 13 + i), &mut q);
                    q
                })
                .collect();
            let rows = 9;
            let ms = [
                Matrix::q4_1(rows, cols, &q4_1_bytes(rows, cols, 5)).unwrap(),
                Matrix::q8_0(rows, cols, &q8_0_bytes(rows, cols, 6)).unwrap(),
            ];
            for n in [1, 3, ROWS / 2, ROWS / 2 + 1, ROWS] {
                let xs = &quantized[..n];
                for w in &ms {
                    for c in 0..w.rows {
                        let (mut fast, mut slow) = ([0f32; ROWS], [0f32; ROWS]);
                        // Each VNNI kernel's results.
                        let mut vnni: Vec<(&str, [f32; ROWS])> = Vec::new();
                        match w.view() {
                            View::Q4_1(w) => {
                                unsafe { avx2_kernels::dots_q4_1(&w, xs, c..c + 1, &mut fast[..n]) };
                                if avx {
                                    let mut o = [0f32; ROWS];
                                    unsafe { avx2_kernels::dots_q4_1_vnni(&w, xs, c..c + 1, &mut o[..n]) };
                                    vnni.push(("AVX-VNNI", o));
                                }
                                if avx512 {
                                    let mut o = [0f32; ROWS];
                                    unsafe { avx2_kernels::dots_q4_1_vnni512(&w, xs, c..c + 1, &mut o[..n]) };
                                    vnni.push(("AVX512-VNNI", o));
                                }
                                portable::dots_q4_1(&w, xs, c..c + 1, &mut slow[..n]);
                            }
                            View::Q8_0(w) => {
                                unsafe { avx2_kernels::dots_q8_0(&w, xs, c..c + 1, &mut fast[..n]) };
                                if avx {
                                    let mut o = [0f32; ROWS];
                                    unsafe { avx2_kernels::dots_q8_0_vnni(&w, xs, c..c + 1, &mut o[..n]) };
                                    vnni.push(("AVX-VNNI", o));
                                }
                                if avx512 {
                                    let mut o = [0f32; ROWS];
                                    unsafe { avx2_kernels::dots_q8_0_vnni512(&w, xs, c..c + 1, &mut o[..n]) };
                                    vnni.push(("AVX512-VNNI", o));
                                }
                                portable::dots_q8_0(&w, xs, c..c + 1, &mut slow[..n]);
                            }
                            View::F32(_) => unreachable!(),
                        }
                        for i in 0..n {
                            assert_eq!(
                                fast[i].to_bits(),
                                slow[i].to_bits(),
                                "{cols} columns, column {c}, {n} rows: {fast:?} vs {slow:?}"
                            );
                            for (what, o) in &vnni {
                                assert_eq!(
                                    o[i].to_bits(),
                                    slow[i].to_bits(),
                                    "{what}: {cols} columns, column {c}, {n} rows: {o:?} vs {slow:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The grouped layout holds the file's values: every element dequantized from the matrix
    /// equals the one dequantized from GGUF's bytes directly.
    #[test]
    fn a_row_reads_back_as_the_file_holds_it() {
        for cols in [96usize, 320, 576] {
            let rows = 5;
            let (b4, b8) = (q4_1_bytes(rows, cols, 21), q8_0_bytes(rows, cols, 22));
            let (q4, q8) = (
                Matrix::q4_1(rows, cols, &b4).unwrap(),
                Matrix::q8_0(rows, cols, &b8).unwrap(),
            );
            let mut got = vec![0f32; cols];
            for r in 0..rows {
                q4.row_into(r, &mut got);
                for (e, &v) in got.iter().enumerate() {
                    let blk = &b4[(r * cols + e) / BLOCK * 20..][..20];
                    let (d, m) = (
                        f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])),
                        f16_to_f32(u16::from_le_bytes([blk[2], blk[3]])),
                    );
                    let i = e % BLOCK;
                    let q = if i < 16 {
                        blk[4 + i] & 0x0f
                    } else {
                        blk[4 + i - 16] >> 4
                    };
                    assert_eq!(
                        v.to_bits(),
                        (q as f32 * d + m).to_bits(),
                        "q4_1 {cols} columns, row {r}, element {e}"
                    );
                }
                q8.row_into(r, &mut got);
                for (e, &v) in got.iter().enumerate() {
                    let blk = &b8[(r * cols + e) / BLOCK * 34..][..34];
                    let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]]));
                    let q = blk[2 + e % BLOCK] as i8;
                    assert_eq!(
                        v.to_bits(),
                        (q as f32 * d).to_bits(),
                        "q8_0 {cols} columns, row {r}, element {e}"
                    );
                }
            }
        }
    }

    /// The vectorized f32 dot product and scaled add give the scalar definition's bits.
    #[test]
    fn the_f32_helpers_agree_with_their_scalar_definitions() {
        for len in [0usize, 5, 8, 64, 67] {
            let (a, b) = (values(len, 31), values(len, 32));
            let mut acc = [0f32; 8];
            for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
                for i in 0..8 {
                    acc[i] = x[i].mul_add(y[i], acc[i]);
                }
            }
            let scalar = dot_f32_finish(acc, &a, &b);
            assert_eq!(dot_f32(&a, &b).to_bits(), scalar.to_bits(), "dot of {len}");
            let mut fast = values(len, 33);
            let mut slow = fast.clone();
            add_scaled(&mut fast, 0.37, &a);
            for (s, &x) in slow.iter_mut().zip(&a) {
                *s = 0.37f32.mul_add(x, *s);
            }
            assert!(
                fast.iter().zip(&slow).all(|(f, s)| f.to_bits() == s.to_bits()),
                "add_scaled of {len}"
            );
        }
    }

    /// The attention's scores and weighted sums of several heads sharing one key/value head
    /// give the bits of the one-head helpers, for 1 to 4 heads, any number of keys (groups of 4
    /// and the rest), head widths with and without a tail, sums continued onto what `out` holds.
    #[test]
    fn the_grouped_attention_helpers_agree_with_the_one_head_ones() {
        fn check<const G: usize>() {
            for d in [3usize, 8, 60, 64, 72, 136] {
                let stride = 3 * d + 5;
                let offset = d + 2;
                for n in [0usize, 1, 3, 4, 5, 9, 17, 40] {
                    let keys = values(n * stride + offset + d, 61);
                    let q = values(G * d, 62);
                    let mut buf = vec![0f32; G * n.max(1)];
                    let mut parts = buf.chunks_exact_mut(n.max(1));
                    let mut out: [&mut [f32]; G] = std::array::from_fn(|_| &mut parts.next().unwrap()[..n]);
                    scores_heads::<G>(&q, &keys, stride, offset, 0.125, &mut out);
                    for (g, out) in out.iter().enumerate() {
                        let mut one = vec![0f32; n];
                        scores(&q[g * d..(g + 1) * d], &keys, stride, offset, 0.125, &mut one);
                        assert!(
                            out.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "scores of head {g} of {G}, {n} keys, width {d}"
                        );
                    }
                    let probs: Vec<Vec<f32>> = (0..G).map(|g| values(n, 63 + g as u64)).collect();
                    let probs: [&[f32]; G] = std::array::from_fn(|g| probs[g].as_slice());
                    let start = values(G * d, 70);
                    let mut fast = start.clone();
                    weighted_sums_on::<G>(&probs, &keys, stride, offset, &mut fast);
                    for g in 0..G {
                        let mut one = start[g * d..(g + 1) * d].to_vec();
                        weighted_sum_on(probs[g], &keys, stride, offset, &mut one);
                        assert!(
                            fast[g * d..(g + 1) * d]
                                .iter()
                                .zip(&one)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "weighted sum of head {g} of {G}, {n} values, width {d}"
                        );
                    }
                }
            }
        }
        check::<1>();
        check::<2>();
        check::<3>();
        check::<4>();
    }

    /// The attention's scores and weighted sum give the bits of their one-key, one-row
    /// definitions: any number of keys (whole groups of 8 and the rest), head widths with and
    /// without a tail, an offset into rows of a wider stride.
    #[test]
    fn the_attention_helpers_agree_with_their_definitions() {
        for d in [3usize, 8, 60, 64, 72, 136] {
            let stride = 3 * d + 5;
            let offset = d + 2;
            for n in [0usize, 1, 7, 8, 9, 17, 40] {
                let keys = values(n * stride + offset + d, 41);
                let q = values(d, 42);
                let mut fast = vec![0f32; n];
                scores(&q, &keys, stride, offset, 0.125, &mut fast);
                for (t, f) in fast.iter().enumerate() {
                    let slow = dot_f32(&q, &keys[t * stride + offset..t * stride + offset + d]) * 0.125;
                    assert_eq!(f.to_bits(), slow.to_bits(), "score {t} of {n}, width {d}");
                }
                let probs: Vec<f32> = values(n, 43).iter().map(|p| p.abs()).collect();
                let mut fast = values(d, 44); // overwritten
                weighted_sum(&probs, &keys, stride, offset, &mut fast);
                let mut slow = vec![0f32; d];
                for (t, &p) in probs.iter().enumerate() {
                    for (s, &v) in slow.iter_mut().zip(&keys[t * stride + offset..t * stride + offset + d]) {
                        *s = p.mul_add(v, *s);
                    }
                }
                assert!(
                    fast.iter().zip(&slow).all(|(f, s)| f.to_bits() == s.to_bits()),
                    "weighted sum of {n}, width {d}"
                );
                // Continued over a cache split in two (as one kept in chunks is): the same bits.
                for cut in [0, n / 3, n] {
                    let mut parts = vec![0f32; d];
                    weighted_sum_on(&probs[..cut], &keys, stride, offset, &mut parts);
                    weighted_sum_on(&probs[cut..], &keys[cut * stride..], stride, offset, &mut parts);
                    assert!(
                        parts.iter().zip(&slow).all(|(f, s)| f.to_bits() == s.to_bits()),
                        "weighted sum of {n} split at {cut}, width {d}"
                    );
                }
            }
        }
    }

    /// The vectorized quantization of a block gives the scalar one's scale, values and sum, or
    /// leaves the block to it (values that are not finite, a scale whose inverse overflows);
    /// rounding halves away from zero included.
    #[test]
    fn the_vectorized_quantization_agrees_with_the_scalar_one() {
        #[cfg(target_arch = "x86_64")]
        if simd() {
            let mut blocks: Vec<Vec<f32>> = (0..400u64)
                .map(|i| {
                    let scale = [1e-30f32, 1e-3, 0.7, 1.0, 300.0, 1e30][i as usize % 6];
                    values(BLOCK, 100 + i).iter().map(|v| v * scale).collect()
                })
                .collect();
            // max |x| = 127, so d = 1 and the values are what is rounded: halves, values just
            // below a half, negative zero.
            let mut halves: Vec<f32> = vec![127.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5];
            halves.extend([0.49999997f32, -0.49999997, 2.4999998, -2.4999998, 1e-40, -1e-40]);
            halves.resize(BLOCK, 3.0);
            blocks.push(halves);
            blocks.push(vec![0.0; BLOCK]);
            blocks.push((0..BLOCK).map(|i| if i == 7 { 1e-39 } else { 0.0 }).collect());
            let mut fast_taken = 0;
            for (i, block) in blocks.iter().enumerate() {
                let (mut slow, mut fast) = ([0i8; BLOCK], [0i8; BLOCK]);
                let want = quantize_block(block, &mut slow);
                // SAFETY: AVX2 is present.
                if let Some(got) = unsafe { avx2_kernels::quantize_block(block, &mut fast) } {
                    fast_taken += 1;
                    assert_eq!(
                        (got.0.to_bits(), got.1, fast),
                        (want.0.to_bits(), want.1, slow),
                        "block {i}: {block:?}"
                    );
                }
            }
            // Only the block whose `1 / d` overflows (the 1e-39 one) goes scalar.
            assert!(fast_taken >= blocks.len() - 70, "{fast_taken} of {}", blocks.len());
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                let mut block = values(BLOCK, 7);
                block[5] = bad;
                // SAFETY: AVX2 is present.
                assert!(unsafe { avx2_kernels::quantize_block(&block, &mut [0; BLOCK]) }.is_none());
            }
        }
    }

    /// A block so small that the inverse of its scale overflows quantizes within ±127, so the
    /// kernels that negate activations agree with the portable ones on it too.
    #[test]
    fn a_tiny_block_quantizes_within_127_and_the_kernels_agree_on_it() {
        let cols = 320;
        let mut x = values(cols, 41);
        for v in &mut x[..BLOCK] {
            *v *= 1e-38;
        }
        for v in &mut x[8 * BLOCK..9 * BLOCK] {
            *v *= 1e-38;
        }
        let mut q = QuantRow::default();
        quantize_row(&x, &mut q);
        assert!(q
            .groups
            .iter()
            .flatten()
            .chain(q.tail.iter().flatten())
            .all(|&v| v != i8::MIN));
        if !simd() {
            return;
        }
        let xs = std::slice::from_ref(&q);
        let w = Matrix::q8_0(9, cols, &q8_0_bytes(9, cols, 42)).unwrap();
        let View::Q8_0(w) = w.view() else { unreachable!() };
        let (mut fast, mut slow) = ([0f32; 9], [0f32; 9]);
        unsafe { avx2_kernels::dots_q8_0(&w, xs, 0..9, &mut fast) };
        portable::dots_q8_0(&w, xs, 0..9, &mut slow);
        assert!(
            fast.iter().zip(&slow).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{fast:?} vs {slow:?}"
        );
    }

    #[test]
    fn a_truncated_matrix_is_refused() {
        assert!(Matrix::q4_1(2, 64, &[0u8; 79]).is_err());
        assert!(Matrix::q8_0(2, 64, &[0u8; 136]).is_ok());
        assert!(Matrix::q8_0(2, 48, &[0u8; 136]).is_err());
    }
}

#[cfg(test)]
mod speed {
    use super::*;

    /// Not a check: prints the time per block-row of products of the model's shapes.
    /// `cargo test --workspace --features tokenlog/faults --lib speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn time_per_block_row() {
        // Q4_1 in the layers' shapes, Q8_0 in the output head's (a slice of its 49,152 rows).
        for (rows, cols, q8) in [(1536usize, 576usize, false), (576, 1536, false), (4096, 576, true)] {
            let size = if q8 { 34 } else { 20 };
            let bytes: Vec<u8> = (0..rows * cols / BLOCK * size)
                .map(|i| (i * 7919 % 251) as u8 & 0x3f)
                .collect();
            let w = match q8 {
                true => Matrix::q8_0(rows, cols, &bytes).unwrap(),
                false => Matrix::q4_1(rows, cols, &bytes).unwrap(),
            };
            let kind = if q8 { "q8_0" } else { "q4_1" };
            for m in [1usize, 4, 8, 64] {
                let x: Vec<f32> = (0..m * cols).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
                let mut y = vec![0f32; m * rows];
                let reps = 200 / m.max(1) + 5;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    w.matmul(&x, m, &mut y);
                }
                let per = t.elapsed().as_secs_f64() / reps as f64;
                let block_rows = (rows * cols / BLOCK * m) as f64;
                eprintln!(
                    "{kind} {rows}x{cols} m={m:>3}: {:>8.1} us per product, {:.2} ns per block-row",
                    per * 1e6,
                    per * 1e9 / block_rows
                );
            }
        }
    }

    /// Not a check: the attention helpers per head and grouped, 3 heads of width 64 over 400
    /// positions of 3 key/value heads (SmolLM2's shape).
    /// `cargo test --workspace --features tokenlog/faults --lib attention_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn attention_speed() {
        let (d, kvw, n, reps) = (64usize, 192usize, 400usize, 2_000);
        let keys: Vec<f32> = (0..n * kvw)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
            .collect();
        let q: Vec<f32> = (0..3 * d).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect();
        let probs: Vec<f32> = (0..3 * n).map(|i| (i % 7) as f32 / 7.0 / n as f32).collect();
        let mut out = vec![0f32; 3 * n];
        let t = std::time::Instant::now();
        for _ in 0..reps {
            for (g, o) in out.chunks_exact_mut(n).enumerate() {
                scores(&q[g * d..(g + 1) * d], &keys, kvw, d, 0.125, o);
            }
        }
        let one = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        for _ in 0..reps {
            let mut parts = out.chunks_exact_mut(n);
            let mut o: [&mut [f32]; 3] = std::array::from_fn(|_| parts.next().unwrap());
            scores_heads::<3>(&q, &keys, kvw, d, 0.125, &mut o);
        }
        let grouped = t.elapsed().as_secs_f64();
        eprintln!(
            "scores of 3 heads: {:.1} us one head at a time (the scalar definition), {:.1} us grouped",
            one * 1e6 / reps as f64,
            grouped * 1e6 / reps as f64
        );
        let mut acc = vec![0f32; 3 * d];
        let t = std::time::Instant::now();
        for _ in 0..reps {
            for (g, a) in acc.chunks_exact_mut(d).enumerate() {
                weighted_sum_on(&probs[g * n..(g + 1) * n], &keys, kvw, d, a);
            }
        }
        let one = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        for _ in 0..reps {
            let p: [&[f32]; 3] = std::array::from_fn(|g| &probs[g * n..(g + 1) * n]);
            weighted_sums_on::<3>(&p, &keys, kvw, d, &mut acc);
        }
        let grouped = t.elapsed().as_secs_f64();
        eprintln!(
            "weighted sums of 3 heads: {:.1} us one head at a time (the scalar definition), {:.1} us grouped",
            one * 1e6 / reps as f64,
            grouped * 1e6 / reps as f64
        );
        // The same over 240 caches of that size (8 sequences x 30 layers, ~74 MB: beyond
        // every cache level, as a step of 8 generations reads them).
        let caches = 240;
        let big: Vec<f32> = (0..caches * n * kvw)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
            .collect();
        let reps = 10;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            for c in big.chunks_exact(n * kvw) {
                let mut parts = out.chunks_exact_mut(n);
                let mut o: [&mut [f32]; 3] = std::array::from_fn(|_| parts.next().unwrap());
                scores_heads::<3>(&q, c, kvw, d, 0.125, &mut o);
                let p: [&[f32]; 3] = std::array::from_fn(|g| &probs[g * n..(g + 1) * n]);
                weighted_sums_on::<3>(&p, c, kvw, d, &mut acc);
            }
        }
        let cold = t.elapsed().as_secs_f64() * 1e6 / (reps * caches) as f64;
        eprintln!("scores and weighted sums of 3 heads, caches beyond every cache level: {cold:.1} us");
    }
}
