//! `exp` by the decoder's own algorithms, the same bits on every machine and vectorized where
//! the CPU has AVX2 and FMA: the CPU engine's softmax and SiLU ([`exp_f32`]) and a sampler's
//! weights ([`exp_f64`]). The C library's `exp` is not one function everywhere (glibc picks an
//! FMA variant where the CPU has FMA), and exact resume needs the same bits on every decoder.
//! Outside the `model` feature too: the sampler needs it.
//!
//! `unsafe` here: the AVX2 intrinsics, called only once `is_x86_feature_detected!` said AVX2
//! and FMA are there.
#![allow(unsafe_code)]
// Without the `model` feature only the sampler's weights are used.
#![cfg_attr(not(feature = "model"), allow(dead_code))]

/// `e^x` rounded to f32, by one fixed algorithm in f64: the same bits vectorized or not, on
/// every CPU (so a sequence's numbers do not depend on the machine, the C library or its
/// neighbours in a batch):
/// - `x` clamped to [-104, 89] (beyond them `e^x` rounds to 0 or to infinity either way; NaN
///   stays NaN), then taken to f64;
/// - `n = round_ties_even(x × log2 e)`, `r = x - n × ln 2` in two fused steps (ln 2 split into a
///   part with trailing zeros and the rest, as fdlibm does), so `|r| ≤ ~0.347`;
/// - `e^r` by its Taylor polynomial to `r^12 / 12!` (truncation ~2e-16 at the ends), Horner's
///   rule in fused multiply-adds;
/// - times `2^n` (an exact f64 power of two), rounded once to f32 (subnormal, or infinity,
///   where it must be).
///
/// The f64 result is within a few f64 units of `e^x`, so the f32 one is `e^x` correctly
/// rounded except where `e^x` lies within ~1e-15 (relative) of a midpoint between two f32s
/// (the test checks it against f64's `exp` over 265,000 points).
pub(crate) fn exp_f32(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let (n, y) = reduced(f64::from(x.clamp(EXP_MIN, EXP_MAX)));
    (y * pow2_64(n as i64)) as f32
}

/// `(n, e^r)` for `x = n × ln 2 + r`: the reduction and polynomial of [`exp_f32`] and
/// [`exp_f64`].
fn reduced(x: f64) -> (f64, f64) {
    let n = (x * std::f64::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_TAYLOR[0];
    for c in &EXP_TAYLOR[1..] {
        p = p.mul_add(r, *c);
    }
    (n, p.mul_add(r, 1.0))
}

/// `e^x` in f64 by [`exp_f32`]'s reduction and polynomial: `x` clamped to [-746, 710]
/// (beyond them `e^x` rounds to 0 or to infinity; NaN stays NaN), and `2^n` applied as `2^a`
/// then `2^b` (`a = ⌊n / 2⌋`, `b = n - a`: both normal powers of two, so only the last product
/// rounds, into a subnormal or infinity where it must). Within a few f64 units of `e^x`, and
/// the same bits vectorized or not ([`exp_weights`]).
pub(crate) fn exp_f64(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let (n, y) = reduced(x.clamp(EXP64_MIN, EXP64_MAX));
    let n = n as i64;
    let a = n >> 1;
    (y * pow2_64(a)) * pow2_64(n - a)
}

/// `2^k` for `k` in [-1022, 1023].
fn pow2_64(k: i64) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// A sampler's weights: `exp_f64((f64(s[i]) - f64(max)) × inv_t)` for every `i`, in order.
pub(crate) fn exp_weights(s: &[f32], max: f32, inv_t: f64) -> Vec<f64> {
    let mut out = vec![0f64; s.len()];
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2 and FMA are present; `out` is as long as `s`.
        unsafe { avx2_kernels::exp_weights(s, max, inv_t, &mut out) };
        return out;
    }
    for (o, &x) in out.iter_mut().zip(s) {
        *o = exp_f64((f64::from(x) - f64::from(max)) * inv_t);
    }
    out
}

const EXP64_MIN: f64 = -746.0;
const EXP64_MAX: f64 = 710.0;
const EXP_MIN: f32 = -104.0;
const EXP_MAX: f32 = 89.0;
/// ln 2 = `LN2_HI + LN2_LO`, the first with its low 21 bits zero (fdlibm's `ln2HI`, `ln2LO`).
const LN2_HI: f64 = 6.931_471_803_691_238e-1;
const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
/// `1 / k!` for k = 12 down to 1.
const EXP_TAYLOR: [f64; 12] = [
    2.087_675_698_786_81e-9,
    2.505_210_838_544_172e-8,
    2.755_731_922_398_589e-7,
    2.755_731_922_398_589_3e-6,
    2.480_158_730_158_73e-5,
    1.984_126_984_126_984e-4,
    1.388_888_888_888_889e-3,
    8.333_333_333_333_333e-3,
    4.166_666_666_666_666_4e-2,
    0.166_666_666_666_666_66,
    0.5,
    1.0,
];

/// `v[i] = exp_f32(v[i] - shift)`: a softmax's numerators.
pub(crate) fn exp_shifted(v: &mut [f32], shift: f32) {
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { avx2_kernels::exp_shifted(v, shift) };
    }
    for x in v {
        *x = exp_f32(*x - shift);
    }
}

/// `g[i] = g[i] / (1 + exp_f32(-g[i])) × u[i]`: SiLU of the gate times the up projection.
pub(crate) fn silu_times(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len());
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX2 and FMA are present; the lengths are equal.
        return unsafe { avx2_kernels::silu_times(g, u) };
    }
    for (g, &u) in g.iter_mut().zip(u) {
        *g = *g / (1.0 + exp_f32(-*g)) * u;
    }
}

/// Whether the vectorized forms run (AVX2 and FMA; checked once). The CPU engine's kernels
/// need this and F16C.
pub(crate) fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static SIMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *SIMD.get_or_init(|| std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2_kernels {
    use super::*;
    use std::arch::x86_64::*;

    /// [`super::exp_f32`] of 8 lanes: the same operations in the same order, 4 lanes of f64
    /// at a time.
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        // `max` gives its second operand for a NaN lane: restored at the end.
        let c = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)), _mm256_set1_ps(EXP_MAX));
        let lo = exp4(_mm256_cvtps_pd(_mm256_castps256_ps128(c)));
        let hi = exp4(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(c)));
        let e = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
        _mm256_blendv_ps(e, x, nan)
    }

    /// [`super::exp_f32`]'s f64 part (from the clamped value to before the rounding to f32)
    /// of 4 lanes.
    #[inline(always)]
    unsafe fn exp4(x: __m256d) -> __m256d {
        let (n, y) = reduced4(x);
        // `n` is whole and within ±150: exact as i32, then as i64.
        let k = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n));
        let pow2 = _mm256_slli_epi64::<52>(_mm256_add_epi64(k, _mm256_set1_epi64x(1023)));
        _mm256_mul_pd(y, _mm256_castsi256_pd(pow2))
    }

    /// [`super::reduced`] of 4 lanes: the same operations in the same order.
    #[inline(always)]
    unsafe fn reduced4(x: __m256d) -> (__m256d, __m256d) {
        let n = _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_pd(
            x,
            _mm256_set1_pd(std::f64::consts::LOG2_E),
        ));
        let r = _mm256_fnmadd_pd(n, _mm256_set1_pd(LN2_HI), x);
        let r = _mm256_fnmadd_pd(n, _mm256_set1_pd(LN2_LO), r);
        let mut p = _mm256_set1_pd(EXP_TAYLOR[0]);
        for c in &EXP_TAYLOR[1..] {
            p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(*c));
        }
        (n, _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0)))
    }

    /// [`super::exp_f64`] of 4 lanes: the same operations in the same order.
    #[inline(always)]
    unsafe fn exp4_f64(x: __m256d) -> __m256d {
        let nan = _mm256_cmp_pd::<_CMP_UNORD_Q>(x, x);
        // `max` gives its second operand for a NaN lane: restored at the end.
        let x0 = x;
        let x = _mm256_min_pd(_mm256_max_pd(x, _mm256_set1_pd(EXP64_MIN)), _mm256_set1_pd(EXP64_MAX));
        let (n, y) = reduced4(x);
        // `a = ⌊n / 2⌋` and `b = n - a`, whole and within [-539, 513]: exact in f64, as i32
        // and as i64 (AVX2 has no 64-bit arithmetic shift).
        let a = _mm256_floor_pd(_mm256_mul_pd(n, _mm256_set1_pd(0.5)));
        let b = _mm256_sub_pd(n, a);
        let pa = pow2x4(a);
        let pb = pow2x4(b);
        let e = _mm256_mul_pd(_mm256_mul_pd(y, pa), pb);
        _mm256_blendv_pd(e, x0, nan)
    }

    /// `2^k` of 4 whole f64 lanes `k` in [-1022, 1023].
    #[inline(always)]
    unsafe fn pow2x4(k: __m256d) -> __m256d {
        let k = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(k));
        _mm256_castsi256_pd(_mm256_slli_epi64::<52>(_mm256_add_epi64(k, _mm256_set1_epi64x(1023))))
    }

    /// One lane of [`super::exp_weights`] for 4 values.
    #[inline(always)]
    unsafe fn weight4(x: __m128, max: __m256d, inv_t: __m256d) -> __m256d {
        exp4_f64(_mm256_mul_pd(_mm256_sub_pd(_mm256_cvtps_pd(x), max), inv_t))
    }

    /// [`super::exp_weights`] into `out`, as long as `s`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_weights(s: &[f32], max: f32, inv_t: f64, out: &mut [f64]) {
        let (m, t) = (_mm256_set1_pd(f64::from(max)), _mm256_set1_pd(inv_t));
        let whole = s.len() / 4 * 4;
        for i in (0..whole).step_by(4) {
            let w = weight4(_mm_loadu_ps(s.as_ptr().add(i)), m, t);
            _mm256_storeu_pd(out.as_mut_ptr().add(i), w);
        }
        let rest = s.len() - whole;
        if rest > 0 {
            let (mut x, mut w) = ([0f32; 4], [0f64; 4]);
            x[..rest].copy_from_slice(&s[whole..]);
            _mm256_storeu_pd(w.as_mut_ptr(), weight4(_mm_loadu_ps(x.as_ptr()), m, t));
            out[whole..].copy_from_slice(&w[..rest]);
        }
    }

    /// [`super::exp_shifted`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_shifted(v: &mut [f32], shift: f32) {
        let s = _mm256_set1_ps(shift);
        let whole = v.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            let x = _mm256_loadu_ps(v.as_ptr().add(i));
            _mm256_storeu_ps(v.as_mut_ptr().add(i), exp8(_mm256_sub_ps(x, s)));
        }
        let rest = v.len() - whole;
        if rest > 0 {
            let mut lanes = [0f32; 8];
            lanes[..rest].copy_from_slice(&v[whole..]);
            let x = exp8(_mm256_sub_ps(_mm256_loadu_ps(lanes.as_ptr()), s));
            _mm256_storeu_ps(lanes.as_mut_ptr(), x);
            v[whole..].copy_from_slice(&lanes[..rest]);
        }
    }

    /// [`super::silu_times`]; `g` and `u` of equal lengths.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_times(g: &mut [f32], u: &[f32]) {
        #[inline(always)]
        unsafe fn one(x: __m256, u: __m256) -> __m256 {
            // `-x` as the scalar negation: the sign bit flipped.
            let e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0)));
            _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e)), u)
        }
        let whole = g.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            let x = one(_mm256_loadu_ps(g.as_ptr().add(i)), _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(g.as_mut_ptr().add(i), x);
        }
        let rest = g.len() - whole;
        if rest > 0 {
            let (mut x, mut y) = ([0f32; 8], [0f32; 8]);
            x[..rest].copy_from_slice(&g[whole..]);
            y[..rest].copy_from_slice(&u[whole..]);
            let x = one(_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr()));
            let mut out = [0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), x);
            g[whole..].copy_from_slice(&out[..rest]);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A deterministic stream of values in [-1, 1) (the CPU engine's tests use it too).
    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The fixed `exp` is f64's `exp` rounded to f32, but for at most one unit in the last
    /// place at a few points (subnormal results included), and gives the IEEE answers at the
    /// edges.
    #[test]
    fn exp_is_close_to_the_exact_one() {
        let (mut worst, mut apart, mut points) = (0u32, 0usize, 0usize);
        let mut x = -104.5f32;
        while x < 89.5 {
            let got = exp_f32(x);
            let want = (x as f64).exp() as f32;
            // Positive floats order as their bits (infinity one unit above `f32::MAX`).
            let ulps = got.to_bits().abs_diff(want.to_bits());
            assert!(ulps <= 1, "{x}: {got:e} against {want:e}, {ulps} units apart");
            worst = worst.max(ulps);
            apart += usize::from(ulps > 0);
            points += 1;
            x += 0.000_731;
        }
        eprintln!("{apart} of {points} points differ from f64's exp by a unit");
        assert!(
            apart * 10_000 <= points,
            "{apart} of {points} points differ from f64's exp (worst {worst})"
        );
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-1e30), 0.0);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(1e30), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(
            exp_f32(-87.0) > 0.0 && exp_f32(-100.0) > 0.0,
            "subnormal results are kept"
        );
    }

    /// The f64 `exp` is within 4 units in the last place of the C library's (subnormal results
    /// within 4 of the smallest subnormal), and gives the IEEE answers at the edges.
    #[test]
    fn exp_f64_is_close_to_the_c_librarys() {
        let mut worst = 0u64;
        let mut x = -746.5f64;
        while x < 710.5 {
            let (got, want) = (exp_f64(x), x.exp());
            let ulps = got.to_bits().abs_diff(want.to_bits());
            assert!(ulps <= 4, "{x}: {got:e} against {want:e}, {ulps} units apart");
            worst = worst.max(ulps);
            x += 0.000_937_5 + x.abs() * 1e-9;
        }
        eprintln!("exp_f64: at most {worst} units from the C library's");
        assert_eq!(exp_f64(0.0), 1.0);
        assert_eq!(exp_f64(f64::NEG_INFINITY), 0.0);
        assert_eq!(exp_f64(f64::INFINITY), f64::INFINITY);
        assert!(exp_f64(f64::NAN).is_nan());
        assert!(exp_f64(-740.0) > 0.0, "subnormal results are kept");
    }

    /// A sampler's vectorized weights give [`exp_f64`]'s bits, for every length and at the
    /// edges (infinite and NaN scores, a temperature that scales into overflow).
    #[test]
    fn the_vectorized_weights_agree_with_the_scalar_ones() {
        let specials = [
            0.0,
            -0.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            f32::MIN,
            -1e30,
            3.0,
        ];
        for len in [0usize, 1, 3, 4, 7, 64, 49_153] {
            let mut v: Vec<f32> = values(len, 51).iter().map(|x| x * 30.0).collect();
            for (slot, s) in v.iter_mut().step_by(5).zip(specials) {
                *slot = s;
            }
            for (max, inv_t) in [
                (3.0f32, 1.0f64),
                (30.0, 1.0 / 0.7),
                (0.5, 1.0 / 1e-3),
                (f32::INFINITY, 1.0),
            ] {
                let fast = exp_weights(&v, max, inv_t);
                assert_eq!(fast.len(), len);
                for (i, (&f, &x)) in fast.iter().zip(&v).enumerate() {
                    let s = exp_f64((f64::from(x) - f64::from(max)) * inv_t);
                    assert!(
                        f.to_bits() == s.to_bits() || (f.is_nan() && s.is_nan()),
                        "weight of {x} (max {max}, 1/t {inv_t}; element {i} of {len}): {f} against {s}"
                    );
                }
            }
        }
    }

    /// The vectorized softmax numerators and SiLU give the scalar definitions' bits, for every
    /// length (whole vectors and the rest) and at the edges.
    #[test]
    fn the_vectorized_exp_agrees_with_the_scalar_one() {
        let specials = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            88.7,
            88.8,
            -87.4,
            -103.9,
            -104.1,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN,
            1e-40,
        ];
        for len in [0usize, 1, 5, 8, 13, 64, 67, 1536] {
            let mut v: Vec<f32> = values(len, 41).iter().map(|x| x * 120.0).collect();
            for (slot, s) in v.iter_mut().step_by(3).zip(specials) {
                *slot = s;
            }
            let u = values(len, 42);
            let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            for shift in [0.0f32, 3.5, -20.0] {
                let mut fast = v.clone();
                exp_shifted(&mut fast, shift);
                for (i, (&f, &x)) in fast.iter().zip(&v).enumerate() {
                    let s = exp_f32(x - shift);
                    assert!(
                        same(f, s),
                        "exp of {x} - {shift} (element {i} of {len}): {f} against {s}"
                    );
                }
            }
            let mut fast = v.clone();
            silu_times(&mut fast, &u);
            for (i, ((&f, &g), &u)) in fast.iter().zip(&v).zip(&u).enumerate() {
                let s = g / (1.0 + exp_f32(-g)) * u;
                assert!(
                    same(f, s),
                    "silu of {g} times {u} (element {i} of {len}): {f} against {s}"
                );
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;

    /// Not a check: prints the time per element of the engine's `exp` (vectorized where the CPU
    /// allows) against the C library's through f64, the engine's form before `cpu3`.
    /// `cargo test --workspace --features tokenlog/faults --lib exp_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn exp_speed() {
        let x: Vec<f32> = (0..4096).map(|i| -((i * 7919 % 4096) as f32) / 256.0).collect();
        let reps = 2_000;
        let mut v = x.clone();
        let t = std::time::Instant::now();
        for _ in 0..reps {
            v.copy_from_slice(&x);
            exp_shifted(&mut v, 0.5);
        }
        let ours = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        for _ in 0..reps {
            v.copy_from_slice(&x);
            for e in v.iter_mut() {
                *e = ((*e - 0.5) as f64).exp() as f32;
            }
            std::hint::black_box(&v);
        }
        let libm = t.elapsed().as_secs_f64();
        let per = |s: f64| s * 1e9 / (reps * x.len()) as f64;
        eprintln!(
            "exp: {:.2} ns per element (the engine's), {:.2} ns (the C library's through f64)",
            per(ours),
            per(libm)
        );
        let t = std::time::Instant::now();
        for _ in 0..reps {
            std::hint::black_box(exp_weights(&x, 0.5, 1.25));
        }
        let ours = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        for _ in 0..reps {
            let w: Vec<f64> = x.iter().map(|&v| ((f64::from(v) - 0.5) * 1.25).exp()).collect();
            std::hint::black_box(w);
        }
        let libm = t.elapsed().as_secs_f64();
        eprintln!(
            "a sampler's weights: {:.2} ns per element (exp_weights), {:.2} ns (the C library's exp)",
            per(ours),
            per(libm)
        );
    }
}
