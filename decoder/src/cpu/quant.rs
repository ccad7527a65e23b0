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

/// `kb` blocks rounded up to whole groups of 8 (the offset term's vector width): the stride of
/// a Q4_1 row's minimums and of an activation row's sums, zero-padded.
pub(crate) fn padded(kb: usize) -> usize {
    kb.div_ceil(8) * 8
}

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

/// One activation row, quantized: per block, 32 signed values, the scale `d` and `s` = `d` ×
/// the sum of the values (what a block with an offset needs).
#[derive(Default)]
pub(crate) struct QuantRow {
    pub(crate) qs: Vec<[i8; BLOCK]>,
    pub(crate) d: Vec<f32>,
    pub(crate) s: Vec<f32>,
}

/// Quantizes `x` (a whole number of blocks) into `out`: `q = round(x / d)` with
/// `d = max|x| / 127` per block.
pub(crate) fn quantize_row(x: &[f32], out: &mut QuantRow) {
    debug_assert_eq!(x.len() % BLOCK, 0);
    out.qs.clear();
    out.d.clear();
    out.s.clear();
    for block in x.chunks_exact(BLOCK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0i8; BLOCK];
        let mut sum = 0i32;
        for (q, &v) in q.iter_mut().zip(block) {
            *q = (v * id).round() as i8;
            sum += *q as i32;
        }
        out.qs.push(q);
        out.d.push(d);
        out.s.push(d * sum as f32);
    }
    out.s.resize(padded(out.qs.len()), 0.0);
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

enum Data {
    /// GGUF Q4_1: per block 32 unsigned 4-bit values (low nibbles are elements 0..16, high
    /// nibbles 16..32), a scale and a minimum (f16 bits): `w = d·q + m`.
    Q4_1 {
        qs: Vec<[u8; 16]>,
        d: Vec<u16>,
        m: Vec<u16>,
    },
    /// GGUF Q8_0: per block 32 signed values and a scale (f16 bits): `w = d·q`.
    Q8_0 { qs: Vec<[i8; BLOCK]>, d: Vec<u16> },
    /// Any other format, dequantized.
    F32(Vec<f32>),
}

impl Matrix {
    /// From GGUF Q4_1 blocks (20 bytes each: d f16, m f16, 16 bytes of nibbles).
    pub(crate) fn q4_1(rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        let blocks = Self::blocks(rows, cols, bytes, 20, "q4_1")?;
        let mut qs = Vec::with_capacity(blocks);
        let mut d = Vec::with_capacity(blocks);
        let kb = cols / BLOCK;
        let mut m = Vec::with_capacity(rows * padded(kb));
        for (i, b) in bytes.chunks_exact(20).enumerate() {
            d.push(u16::from_le_bytes([b[0], b[1]]));
            m.push(u16::from_le_bytes([b[2], b[3]]));
            qs.push(b[4..20].try_into().expect("16 bytes"));
            if i % kb == kb - 1 {
                // Each row's minimums padded to whole groups of 8 with +0.
                m.resize(m.len() + padded(kb) - kb, 0);
            }
        }
        Ok(Matrix {
            rows,
            cols,
            data: Data::Q4_1 { qs, d, m },
        })
    }

    /// From GGUF Q8_0 blocks (34 bytes each: d f16, 32 signed bytes).
    pub(crate) fn q8_0(rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        let blocks = Self::blocks(rows, cols, bytes, 34, "q8_0")?;
        let mut qs = Vec::with_capacity(blocks);
        let mut d = Vec::with_capacity(blocks);
        for b in bytes.chunks_exact(34) {
            d.push(u16::from_le_bytes([b[0], b[1]]));
            let mut q = [0i8; BLOCK];
            for (q, &v) in q.iter_mut().zip(&b[2..34]) {
                *q = v as i8;
            }
            qs.push(q);
        }
        Ok(Matrix {
            rows,
            cols,
            data: Data::Q8_0 { qs, d },
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

    /// Weight row `r`, dequantized into `out` (an embedding lookup).
    pub(crate) fn row_into(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols);
        let kb = self.kb();
        match &self.data {
            Data::Q4_1 { qs, d, m } => {
                for (b, out) in out.chunks_exact_mut(BLOCK).enumerate() {
                    let i = r * kb + b;
                    let (q, d, m) = (&qs[i], f16_to_f32(d[i]), f16_to_f32(m[r * padded(kb) + b]));
                    for j in 0..16 {
                        out[j] = (q[j] & 0x0f) as f32 * d + m;
                        out[j + 16] = (q[j] >> 4) as f32 * d + m;
                    }
                }
            }
            Data::Q8_0 { qs, d } => {
                for (b, out) in out.chunks_exact_mut(BLOCK).enumerate() {
                    let (q, d) = (&qs[r * kb + b], f16_to_f32(d[r * kb + b]));
                    for (o, &v) in out.iter_mut().zip(q) {
                        *o = v as f32 * d;
                    }
                }
            }
            Data::F32(w) => out.copy_from_slice(&w[r * self.cols..(r + 1) * self.cols]),
        }
    }

    /// `out[r * cols.len() + j] = x_r · row (cols.start + j)` for the at most [`ROWS`] activation
    /// rows `x_r` (`xq[r]` quantized, [`quantize_row`]).
    fn dots(&self, xs: &[&[f32]], xq: &[QuantRow], cols: std::ops::Range<usize>, out: &mut [f32]) {
        let kb = self.kb();
        let width = cols.len();
        let mut one = [0f32; ROWS];
        let n = xs.len();
        for (j, c) in cols.enumerate() {
            let b = c * kb..(c + 1) * kb;
            match &self.data {
                Data::Q4_1 { qs, d, m } => {
                    let col = Q4_1Col {
                        qs: &qs[b.clone()],
                        d: &d[b],
                        m: &m[c * padded(kb)..(c + 1) * padded(kb)],
                    };
                    dot_q4_1(&col, xq, &mut one[..n]);
                }
                Data::Q8_0 { qs, d } => {
                    let col = Q8_0Col {
                        qs: &qs[b.clone()],
                        d: &d[b],
                    };
                    dot_q8_0(&col, xq, &mut one[..n]);
                }
                Data::F32(w) => {
                    let row = &w[c * self.cols..(c + 1) * self.cols];
                    for (o, x) in one.iter_mut().zip(xs) {
                        *o = dot_f32(row, x);
                    }
                }
            }
            for (r, &v) in one[..n].iter().enumerate() {
                out[r * width + j] = v;
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
        assert!(
            matches!(self.data, Data::F32(_))
                || (xq.len() == m
                    && xq
                        .iter()
                        .all(|q| q.qs.len() == kb && q.d.len() == kb && q.s.len() == padded(kb)))
        );
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
/// sequential sum), added in a fixed tree, then the tail. Vectorized or not, the same numbers.
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (at, bt) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (x, y) in at.iter().zip(bt) {
        s += x * y;
    }
    s
}

/// Whether the AVX2 kernels run (AVX2, F16C and FMA; checked once).
fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static SIMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *SIMD.get_or_init(|| {
            std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("f16c")
                && std::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Activation rows one kernel call multiplies with a weight row (its blocks decoded once).
pub(crate) const ROWS: usize = 8;

/// One weight row of a Q4_1 matrix.
pub(crate) struct Q4_1Col<'a> {
    pub(crate) qs: &'a [[u8; 16]],
    pub(crate) d: &'a [u16],
    pub(crate) m: &'a [u16],
}

/// One weight row of a Q8_0 matrix.
pub(crate) struct Q8_0Col<'a> {
    pub(crate) qs: &'a [[i8; BLOCK]],
    pub(crate) d: &'a [u16],
}

/// Whether the AVX2 kernels may use AVX-VNNI's dot product instruction (checked once).
fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VNNI.get_or_init(|| simd() && std::is_x86_feature_detected!("avxvnni"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[r] = col · xs[r]`, for any number of rows.
fn dot_q4_1(col: &Q4_1Col, xs: &[QuantRow], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if vnni() {
        // SAFETY: AVX2, F16C, FMA and AVX-VNNI are present.
        return unsafe { avx2_kernels::dot_q4_1_vnni(col, xs, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2, F16C and FMA are present.
        return unsafe { avx2_kernels::dot_q4_1(col, xs, out) };
    }
    portable::dot_q4_1(col, xs, out)
}

fn dot_q8_0(col: &Q8_0Col, xs: &[QuantRow], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if vnni() {
        // SAFETY: AVX2, F16C, FMA and AVX-VNNI are present.
        return unsafe { avx2_kernels::dot_q8_0_vnni(col, xs, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2, F16C and FMA are present.
        return unsafe { avx2_kernels::dot_q8_0(col, xs, out) };
    }
    portable::dot_q8_0(col, xs, out)
}

/// The fixed order in which 8 lane sums are added (the one an AVX2 horizontal add of two
/// 128-bit halves, then pairs, computes).
#[inline(always)]
fn reduce_lanes(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// The kernels, as the definition of the numbers the AVX2 ones reproduce:
/// - a block's 32 products are summed exactly as integers in 8 lanes of 4 consecutive
///   elements; each lane's sum (as f32) is multiplied by the activation block's scale `d_x`,
///   then multiplied by the weight block's `d_w` and added in one fused multiply-add
///   to that lane's accumulator, block after block; the lanes are added at the end
///   ([`reduce_lanes`]);
/// - a Q4_1 row's offset term `Σ m_b · s_b` is a second dot product: lane `b % 8` accumulates
///   block `b`'s product (both sides zero-padded to whole groups of 8, [`padded`]), the lanes
///   are added ([`reduce_lanes`]); it is added to the first.
pub(crate) mod portable {
    use super::*;

    fn lanes_q4_1(q: &[u8; 16], a: &[i8; BLOCK]) -> [i32; 8] {
        std::array::from_fn(|lane| {
            (4 * lane..4 * lane + 4)
                .map(|e| {
                    let w = if e < 16 { q[e] & 0x0f } else { q[e - 16] >> 4 };
                    w as i32 * a[e] as i32
                })
                .sum()
        })
    }

    /// `m` and `s` padded to whole groups of 8 ([`padded`]).
    pub(super) fn offsets(m: &[u16], s: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        for (m, s) in m.chunks_exact(8).zip(s.chunks_exact(8)) {
            for i in 0..8 {
                acc[i] += f16_to_f32(m[i]) * s[i];
            }
        }
        reduce_lanes(acc)
    }

    pub(crate) fn dot_q4_1(col: &Q4_1Col, xs: &[QuantRow], out: &mut [f32]) {
        for (x, out) in xs.iter().zip(out) {
            let mut acc = [0f32; 8];
            for b in 0..col.qs.len() {
                let (d, xd) = (f16_to_f32(col.d[b]), x.d[b]);
                for (acc, sumi) in acc.iter_mut().zip(lanes_q4_1(&col.qs[b], &x.qs[b])) {
                    *acc = (sumi as f32 * xd).mul_add(d, *acc);
                }
            }
            *out = reduce_lanes(acc) + offsets(col.m, &x.s);
        }
    }

    pub(crate) fn dot_q8_0(col: &Q8_0Col, xs: &[QuantRow], out: &mut [f32]) {
        for (x, out) in xs.iter().zip(out) {
            let mut acc = [0f32; 8];
            for b in 0..col.qs.len() {
                let (q, a) = (&col.qs[b], &x.qs[b]);
                let (d, xd) = (f16_to_f32(col.d[b]), x.d[b]);
                for (lane, acc) in acc.iter_mut().enumerate() {
                    let sumi: i32 = (4 * lane..4 * lane + 4).map(|e| q[e] as i32 * a[e] as i32).sum();
                    *acc = (sumi as f32 * xd).mul_add(d, *acc);
                }
            }
            *out = reduce_lanes(acc);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2_kernels {
    use super::*;
    use std::arch::x86_64::*;

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

    /// [`portable::offsets`].
    #[inline(always)]
    unsafe fn offsets(m: &[u16], s: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for g in 0..m.len() / 8 {
            let mv = _mm256_cvtph_ps(_mm_loadu_si128(m.as_ptr().add(8 * g) as *const __m128i));
            let sv = _mm256_loadu_ps(s.as_ptr().add(8 * g));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(mv, sv));
        }
        reduce(acc)
    }

    /// The 8 exact sums of 4 consecutive `u8 × i8` products: VNNI's one instruction, or the
    /// pairs summed into i16 then into i32 (no saturation for the operands here, see the
    /// callers): the same integers either way.
    #[inline(always)]
    unsafe fn dot4<const VNNI: bool>(w: __m256i, a: __m256i, ones: __m256i) -> __m256i {
        if VNNI {
            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, a)
        } else {
            _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones)
        }
    }

    /// The 8 exact lane sums of one Q4_1 block (`w`: its nibbles, decoded) with activations `a`.
    #[inline(always)]
    unsafe fn lanes_q4_1<const VNNI: bool>(w: __m256i, a: *const [i8; BLOCK], ones: __m256i) -> __m256 {
        let a = _mm256_loadu_si256(a as *const __m256i);
        // u4 × i8 pairs summed into i16 (at most 2 × 15 × 128: no saturation), then lanes of
        // 4 in i32: exact, and exact in f32 (at most 7,680).
        _mm256_cvtepi32_ps(dot4::<VNNI>(w, a, ones))
    }

    /// The 8 exact lane sums of one Q8_0 block.
    #[inline(always)]
    unsafe fn lanes_q8_0<const VNNI: bool>(w: __m256i, wabs: __m256i, a: *const [i8; BLOCK], ones: __m256i) -> __m256 {
        let a = _mm256_loadu_si256(a as *const __m256i);
        // |w| × (a with w's sign): the same products, with an unsigned left operand. |w| ≤ 128
        // and |a| ≤ 127: pairs sum to at most 32,512, no saturation; lanes at most 65,024.
        _mm256_cvtepi32_ps(dot4::<VNNI>(wabs, _mm256_sign_epi8(a, w), ones))
    }

    #[inline(always)]
    unsafe fn nibbles(q: &[u8; 16], mask: __m128i) -> __m256i {
        let q = _mm_loadu_si128(q.as_ptr() as *const __m128i);
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask))
    }

    /// `out[r] = col · xs[r]` for exactly `R` rows, each weight block decoded once for all.
    #[inline(always)]
    unsafe fn q4_1_rows<const VNNI: bool, const R: usize>(col: &Q4_1Col, xs: &[QuantRow], out: &mut [f32]) {
        let kb = col.qs.len();
        let mask = _mm_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..kb {
            let w = nibbles(col.qs.get_unchecked(b), mask);
            let d = _mm256_set1_ps(half(*col.d.get_unchecked(b)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = xs.get_unchecked(r);
                let l = lanes_q4_1::<VNNI>(w, x.qs.as_ptr().add(b), ones);
                let l = _mm256_mul_ps(l, _mm256_broadcast_ss(x.d.get_unchecked(b)));
                *acc = _mm256_fmadd_ps(l, d, *acc);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            *out.get_unchecked_mut(r) = reduce(*acc) + offsets(col.m, &xs.get_unchecked(r).s);
        }
    }

    /// `out[r] = col · xs[r]` for exactly `R` rows.
    #[inline(always)]
    unsafe fn q8_0_rows<const VNNI: bool, const R: usize>(col: &Q8_0Col, xs: &[QuantRow], out: &mut [f32]) {
        let kb = col.qs.len();
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..kb {
            let w = _mm256_loadu_si256(col.qs.as_ptr().add(b) as *const __m256i);
            let wabs = _mm256_sign_epi8(w, w);
            let d = _mm256_set1_ps(half(*col.d.get_unchecked(b)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = xs.get_unchecked(r);
                let l = lanes_q8_0::<VNNI>(w, wabs, x.qs.as_ptr().add(b), ones);
                let l = _mm256_mul_ps(l, _mm256_broadcast_ss(x.d.get_unchecked(b)));
                *acc = _mm256_fmadd_ps(l, d, *acc);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            *out.get_unchecked_mut(r) = reduce(*acc);
        }
    }

    /// Groups of [`ROWS`], then one of half as many, then the rest one by one; every row's
    /// numbers are the same either way.
    #[inline(always)]
    unsafe fn q4_1_any<const VNNI: bool>(col: &Q4_1Col, xs: &[QuantRow], out: &mut [f32]) {
        // Checked once per product by `Matrix::matmul`.
        let kb = col.qs.len();
        debug_assert!(col.d.len() == kb && col.m.len() == padded(kb) && out.len() == xs.len());
        debug_assert!(xs
            .iter()
            .all(|x| x.qs.len() == kb && x.d.len() == kb && x.s.len() == padded(kb)));
        let mut i = 0;
        while i + ROWS <= xs.len() {
            q4_1_rows::<VNNI, ROWS>(col, &xs[i..i + ROWS], &mut out[i..i + ROWS]);
            i += ROWS;
        }
        if i + ROWS / 2 <= xs.len() {
            q4_1_rows::<VNNI, { ROWS / 2 }>(col, &xs[i..i + ROWS / 2], &mut out[i..i + ROWS / 2]);
            i += ROWS / 2;
        }
        while i < xs.len() {
            q4_1_rows::<VNNI, 1>(col, &xs[i..i + 1], &mut out[i..i + 1]);
            i += 1;
        }
    }

    #[inline(always)]
    unsafe fn q8_0_any<const VNNI: bool>(col: &Q8_0Col, xs: &[QuantRow], out: &mut [f32]) {
        // Checked once per product by `Matrix::matmul`.
        let kb = col.qs.len();
        debug_assert!(col.d.len() == kb && out.len() == xs.len());
        debug_assert!(xs.iter().all(|x| x.qs.len() == kb && x.d.len() == kb));
        let mut i = 0;
        while i + ROWS <= xs.len() {
            q8_0_rows::<VNNI, ROWS>(col, &xs[i..i + ROWS], &mut out[i..i + ROWS]);
            i += ROWS;
        }
        if i + ROWS / 2 <= xs.len() {
            q8_0_rows::<VNNI, { ROWS / 2 }>(col, &xs[i..i + ROWS / 2], &mut out[i..i + ROWS / 2]);
            i += ROWS / 2;
        }
        while i < xs.len() {
            q8_0_rows::<VNNI, 1>(col, &xs[i..i + 1], &mut out[i..i + 1]);
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn dot_q4_1(col: &Q4_1Col, xs: &[QuantRow], out: &mut [f32]) {
        q4_1_any::<false>(col, xs, out)
    }

    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn dot_q8_0(col: &Q8_0Col, xs: &[QuantRow], out: &mut [f32]) {
        q8_0_any::<false>(col, xs, out)
    }

    /// [`dot_q4_1`] with AVX-VNNI's dot product instruction (the same numbers).
    #[target_feature(enable = "avx2,f16c,fma,avxvnni")]
    pub(super) unsafe fn dot_q4_1_vnni(col: &Q4_1Col, xs: &[QuantRow], out: &mut [f32]) {
        q4_1_any::<true>(col, xs, out)
    }

    #[target_feature(enable = "avx2,f16c,fma,avxvnni")]
    pub(super) unsafe fn dot_q8_0_vnni(col: &Q8_0Col, xs: &[QuantRow], out: &mut [f32]) {
        q8_0_any::<true>(col, xs, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic stream of values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

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

    fn matrices() -> Vec<Matrix> {
        let (rows, cols) = (37, 96);
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
        let x = values(3 * 96, 9);
        for w in matrices() {
            let mut y = vec![0f32; 3 * w.rows];
            w.matmul(&x, 3, &mut y);
            let mut row = vec![0f32; w.cols];
            for r in 0..3 {
                for c in 0..w.rows {
                    w.row_into(c, &mut row);
                    let exact: f32 = row.iter().zip(&x[r * 96..(r + 1) * 96]).map(|(a, b)| a * b).sum();
                    let got = y[r * w.rows + c];
                    assert!((got - exact).abs() < 0.05 + exact.abs() * 0.02, "{got} vs {exact}");
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_the_rows_beside_it() {
        let m = 8;
        let x = values(m * 96, 11);
        for w in matrices() {
            let mut all = vec![0f32; m * w.rows];
            w.matmul(&x, m, &mut all);
            for r in 0..m {
                let mut one = vec![0f32; w.rows];
                w.matmul(&x[r * 96..(r + 1) * 96], 1, &mut one);
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
        // 96 columns: 3 blocks (no whole group of 8 for the offsets); 320: 10 blocks (one group
        // and a tail).
        for cols in [96usize, 320] {
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
            for n in [1, 3, ROWS] {
                let xs = &quantized[..n];
                for w in &ms {
                    let kb = w.kb();
                    for c in 0..w.rows {
                        let b = c * kb..(c + 1) * kb;
                        let (mut fast, mut slow, mut vnni_out) = ([0f32; ROWS], [0f32; ROWS], [0f32; ROWS]);
                        match &w.data {
                            Data::Q4_1 { qs, d, m } => {
                                let col = Q4_1Col {
                                    qs: &qs[b.clone()],
                                    d: &d[b],
                                    m: &m[c * padded(kb)..(c + 1) * padded(kb)],
                                };
                                unsafe { avx2_kernels::dot_q4_1(&col, xs, &mut fast[..n]) };
                                if vnni() {
                                    unsafe { avx2_kernels::dot_q4_1_vnni(&col, xs, &mut vnni_out[..n]) };
                                }
                                portable::dot_q4_1(&col, xs, &mut slow[..n]);
                            }
                            Data::Q8_0 { qs, d } => {
                                let col = Q8_0Col {
                                    qs: &qs[b.clone()],
                                    d: &d[b],
                                };
                                unsafe { avx2_kernels::dot_q8_0(&col, xs, &mut fast[..n]) };
                                if vnni() {
                                    unsafe { avx2_kernels::dot_q8_0_vnni(&col, xs, &mut vnni_out[..n]) };
                                }
                                portable::dot_q8_0(&col, xs, &mut slow[..n]);
                            }
                            Data::F32(_) => unreachable!(),
                        }
                        for i in 0..n {
                            assert_eq!(
                                fast[i].to_bits(),
                                slow[i].to_bits(),
                                "{cols} columns, column {c}, {n} rows: {fast:?} vs {slow:?}"
                            );
                            if vnni() {
                                assert_eq!(
                                    vnni_out[i].to_bits(),
                                    slow[i].to_bits(),
                                    "VNNI: {cols} columns, column {c}, {n} rows: {vnni_out:?} vs {slow:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
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
        for (rows, cols) in [(1536usize, 576usize), (576, 1536)] {
            let bytes: Vec<u8> = (0..rows * cols / BLOCK * 20)
                .map(|i| (i * 7919 % 251) as u8 & 0x3f)
                .collect();
            let w = Matrix::q4_1(rows, cols, &bytes).unwrap();
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
                    "{rows}x{cols} m={m:>3}: {:>8.1} us per product, {:.2} ns per block-row",
                    per * 1e6,
                    per * 1e9 / block_rows
                );
            }
        }
    }
}
