//! The canonical 16-lane reduction shared by every dot product in the engine.
//!
//! A dot product of length K is defined as: lane `j` (0..16) accumulates
//! `x[k] * w[k]` for `k ≡ j (mod 16)` in increasing `k` with fused multiply-add
//! (missing tail elements count as zero), then the lanes are summed by the fixed tree
//! `v8[i] = l[i] + l[i+8]`, `v4[i] = v8[i] + v8[i+4]`, `v2[i] = v4[i] + v4[i+2]`,
//! `r = v2[0] + v2[1]`. The order depends only on K, never on M, batch, padding or
//! threads, and the AVX-512, AVX2 and portable paths compute exactly the same bits.
//!
//! bf16 weights take the bf16 order instead (see [`tile_pairs`]): in each full chunk of 32
//! elements lane `j` accumulates element `2j` then `2j + 1`, the rest of K goes as above,
//! and the same lane tree ends it. Widening a bf16 pair is then a shift and a mask, with
//! no shuffle: the CPU matmul's bottleneck at the small M of decoding and verifying.

use mtp_base::weights::WeightDtype;

pub use mtp_base::isa::{isa, Isa};
pub use mtp_base::logits::LANES;

/// A vector of 16 f32 lanes.
pub trait Simd16: Copy {
    type V: Copy;
    fn zero() -> Self::V;
    /// Loads 16 f32 from `p` (unaligned).
    ///
    /// # Safety
    /// `p` must point to 16 readable f32.
    unsafe fn load(p: *const f32) -> Self::V;
    /// Loads 16 weights of dtype `d` starting at byte pointer `p`, widened to f32.
    ///
    /// # Safety
    /// `p` must point to 16 readable elements of dtype `d`.
    unsafe fn load_w(p: *const u8, d: WeightDtype) -> Self::V;
    /// Loads 32 bf16 weights at byte pointer `p` as two vectors: lane `l` of the first
    /// holds element `2l`, of the second element `2l + 1` (widening a bf16 pair is a
    /// shift and a mask, no shuffle).
    ///
    /// # Safety
    /// `p` must point to 32 readable bf16.
    unsafe fn load_bf16_pairs(p: *const u8) -> (Self::V, Self::V);
    /// Loads 32 MLX 4-bit values (16 bytes at `p`; value `2l` in byte `l`'s low nibble,
    /// `2l + 1` in its high nibble) as f32 integers 0..15: (even, odd), as
    /// [`Simd16::load_bf16_pairs`] does.
    ///
    /// # Safety
    /// `p` must point to 16 readable bytes.
    unsafe fn load_q4_pairs(p: *const u8) -> (Self::V, Self::V);
    /// Loads 32 MLX 8-bit values (32 bytes at `p`) as f32 integers 0..255: (even, odd).
    ///
    /// # Safety
    /// `p` must point to 32 readable bytes.
    unsafe fn load_q8_pairs(p: *const u8) -> (Self::V, Self::V);
    /// What [`Simd16::load_q4_scaled`] takes for one group's `scale`: where the path has a
    /// lane permute, the 16 products `scale * q` (q = 0..15, each rounded once), a lookup
    /// table; else `scale` in every lane.
    #[inline(always)]
    fn q4_table(scale: f32) -> Self::V {
        Self::splat(scale)
    }
    /// 32 MLX 4-bit values at `p` times their group's scale (`table` from
    /// [`Simd16::q4_table`]): (even, odd) as [`Simd16::load_q4_pairs`] orders them, each lane
    /// `scale * q` rounded once, the bits of `mul(splat(scale), q)` on every path.
    ///
    /// # Safety
    /// `p` must point to 16 readable bytes.
    #[inline(always)]
    unsafe fn load_q4_scaled(p: *const u8, table: Self::V) -> (Self::V, Self::V) {
        let (even, odd) = Self::load_q4_pairs(p);
        (Self::mul(table, even), Self::mul(table, odd))
    }
    /// Every lane `v`.
    fn splat(v: f32) -> Self::V;
    /// `a * b`, rounded.
    fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// Asks for the cache line at `p` ahead of its use (no effect on any result).
    #[inline(always)]
    fn prefetch(_p: *const u8) {}
    /// `acc + a * b`, rounded once.
    fn fma(acc: Self::V, a: Self::V, b: Self::V) -> Self::V;
    /// The canonical lane tree.
    fn reduce(v: Self::V) -> f32;
}

/// Portable path (also what non-x86 targets compile to).
#[derive(Clone, Copy)]
pub struct Portable;

impl Simd16 for Portable {
    type V = [f32; LANES];
    #[inline(always)]
    fn zero() -> Self::V {
        [0.0; LANES]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::ptr::read_unaligned(p as *const [f32; LANES])
    }
    #[inline(always)]
    unsafe fn load_w(p: *const u8, d: WeightDtype) -> Self::V {
        let mut out = [0.0f32; LANES];
        for (i, o) in out.iter_mut().enumerate() {
            *o = d.read(p, i);
        }
        out
    }
    #[inline(always)]
    unsafe fn load_bf16_pairs(p: *const u8) -> (Self::V, Self::V) {
        let (mut even, mut odd) = ([0.0f32; LANES], [0.0f32; LANES]);
        for l in 0..LANES {
            even[l] = WeightDtype::Bf16.read(p, 2 * l);
            odd[l] = WeightDtype::Bf16.read(p, 2 * l + 1);
        }
        (even, odd)
    }
    #[inline(always)]
    unsafe fn load_q4_pairs(p: *const u8) -> (Self::V, Self::V) {
        let (mut even, mut odd) = ([0.0f32; LANES], [0.0f32; LANES]);
        for l in 0..LANES {
            let b = *p.add(l);
            even[l] = (b & 15) as f32;
            odd[l] = (b >> 4) as f32;
        }
        (even, odd)
    }
    #[inline(always)]
    unsafe fn load_q8_pairs(p: *const u8) -> (Self::V, Self::V) {
        let (mut even, mut odd) = ([0.0f32; LANES], [0.0f32; LANES]);
        for l in 0..LANES {
            even[l] = *p.add(2 * l) as f32;
            odd[l] = *p.add(2 * l + 1) as f32;
        }
        (even, odd)
    }
    #[inline(always)]
    fn splat(v: f32) -> Self::V {
        [v; LANES]
    }
    #[inline(always)]
    fn mul(a: Self::V, b: Self::V) -> Self::V {
        let mut r = a;
        for i in 0..LANES {
            r[i] = a[i] * b[i];
        }
        r
    }
    #[inline(always)]
    fn fma(acc: Self::V, a: Self::V, b: Self::V) -> Self::V {
        let mut r = acc;
        for i in 0..LANES {
            r[i] = a[i].mul_add(b[i], acc[i]);
        }
        r
    }
    #[inline(always)]
    fn reduce(l: Self::V) -> f32 {
        mtp_base::logits::lane_tree(l)
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// 16 lanes in one zmm register.
    #[derive(Clone, Copy)]
    pub struct Avx512;

    impl Simd16 for Avx512 {
        type V = __m512;
        #[inline(always)]
        fn zero() -> __m512 {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_w(p: *const u8, d: WeightDtype) -> __m512 {
            match d {
                WeightDtype::F32 => _mm512_loadu_ps(p as *const f32),
                WeightDtype::Bf16 => {
                    let h = _mm256_loadu_si256(p as *const __m256i);
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                }
                WeightDtype::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            }
        }
        #[inline(always)]
        unsafe fn load_bf16_pairs(p: *const u8) -> (__m512, __m512) {
            let raw = _mm512_loadu_si512(p as *const __m512i);
            let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            (
                _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)),
                _mm512_castsi512_ps(_mm512_and_si512(raw, high)),
            )
        }
        #[inline(always)]
        unsafe fn load_q4_pairs(p: *const u8) -> (__m512, __m512) {
            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            let low = _mm512_and_si512(b, _mm512_set1_epi32(15));
            (_mm512_cvtepi32_ps(low), _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)))
        }
        #[inline(always)]
        fn q4_table(scale: f32) -> __m512 {
            unsafe {
                let codes = _mm512_setr_ps(
                    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
                );
                _mm512_mul_ps(_mm512_set1_ps(scale), codes)
            }
        }
        #[inline(always)]
        unsafe fn load_q4_scaled(p: *const u8, table: __m512) -> (__m512, __m512) {
            // vpermps reads the low 4 bits of each index: a byte's low nibble as it is, its
            // high nibble after the shift.
            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            (_mm512_permutexvar_ps(b, table), _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table))
        }
        #[inline(always)]
        unsafe fn load_q8_pairs(p: *const u8) -> (__m512, __m512) {
            let b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            let low = _mm512_and_si512(b, _mm512_set1_epi32(255));
            (_mm512_cvtepi32_ps(low), _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 8)))
        }
        #[inline(always)]
        fn splat(v: f32) -> __m512 {
            unsafe { _mm512_set1_ps(v) }
        }
        #[inline(always)]
        fn mul(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_mul_ps(a, b) }
        }
        // Into L2, not L1: a tile streaming several weight rows keeps few enough of its
        // own L1 misses in flight that prefetches into L1 held it to ~10 GB/s a core at
        // M = 8, into L2 ~16 (docs/benchmarks.md, 2026-11-28 (session 32)).
        #[inline(always)]
        fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
        }
        #[inline(always)]
        fn fma(acc: __m512, a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_fmadd_ps(a, b, acc) }
        }
        #[inline(always)]
        fn reduce(v: __m512) -> f32 {
            unsafe {
                let lo = _mm512_castps512_ps256(v);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
                reduce8(_mm256_add_ps(lo, hi))
            }
        }
    }

    #[inline(always)]
    unsafe fn reduce8(v8: __m256) -> f32 {
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        let r = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 0b01));
        _mm_cvtss_f32(r)
    }

    /// 16 lanes as two ymm registers: lanes 0..8 and 8..16.
    #[derive(Clone, Copy)]
    pub struct Avx2;

    impl Simd16 for Avx2 {
        type V = (__m256, __m256);
        #[inline(always)]
        fn zero() -> Self::V {
            unsafe { (_mm256_setzero_ps(), _mm256_setzero_ps()) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self::V {
            (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
        #[inline(always)]
        unsafe fn load_w(p: *const u8, d: WeightDtype) -> Self::V {
            match d {
                WeightDtype::F32 => Self::load(p as *const f32),
                WeightDtype::Bf16 => {
                    let a = _mm_loadu_si128(p as *const __m128i);
                    let b = _mm_loadu_si128(p.add(16) as *const __m128i);
                    (
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)),
                    )
                }
                WeightDtype::F16 => (
                    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)),
                ),
            }
        }
        #[inline(always)]
        unsafe fn load_bf16_pairs(p: *const u8) -> (Self::V, Self::V) {
            let lo = _mm256_loadu_si256(p as *const __m256i);
            let hi = _mm256_loadu_si256(p.add(32) as *const __m256i);
            let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            let even = |v| _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            let odd = |v| _mm256_castsi256_ps(_mm256_and_si256(v, high));
            ((even(lo), even(hi)), (odd(lo), odd(hi)))
        }
        #[inline(always)]
        unsafe fn load_q4_pairs(p: *const u8) -> (Self::V, Self::V) {
            let half = |p: *const u8| _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
            let (a, b) = (half(p), half(p.add(8)));
            let m = _mm256_set1_epi32(15);
            let f = _mm256_cvtepi32_ps;
            (
                (f(_mm256_and_si256(a, m)), f(_mm256_and_si256(b, m))),
                (f(_mm256_srli_epi32(a, 4)), f(_mm256_srli_epi32(b, 4))),
            )
        }
        #[inline(always)]
        unsafe fn load_q8_pairs(p: *const u8) -> (Self::V, Self::V) {
            let half = |p: *const u8| _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            let (a, b) = (half(p), half(p.add(16)));
            let m = _mm256_set1_epi32(255);
            let f = _mm256_cvtepi32_ps;
            (
                (f(_mm256_and_si256(a, m)), f(_mm256_and_si256(b, m))),
                (f(_mm256_srli_epi32(a, 8)), f(_mm256_srli_epi32(b, 8))),
            )
        }
        #[inline(always)]
        fn splat(v: f32) -> Self::V {
            unsafe { (_mm256_set1_ps(v), _mm256_set1_ps(v)) }
        }
        // Into L2, as `Avx512::prefetch` says why.
        #[inline(always)]
        fn prefetch(p: *const u8) {
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
        }
        #[inline(always)]
        fn mul(a: Self::V, b: Self::V) -> Self::V {
            unsafe { (_mm256_mul_ps(a.0, b.0), _mm256_mul_ps(a.1, b.1)) }
        }
        #[inline(always)]
        fn fma(acc: Self::V, a: Self::V, b: Self::V) -> Self::V {
            unsafe { (_mm256_fmadd_ps(a.0, b.0, acc.0), _mm256_fmadd_ps(a.1, b.1, acc.1)) }
        }
        #[inline(always)]
        fn reduce(v: Self::V) -> f32 {
            unsafe { reduce8(_mm256_add_ps(v.0, v.1)) }
        }
    }
}

/// Canonical dot product of f32 `x` with `x.len()` weights of dtype `d` at `w`.
/// Shared by norms, attention and matmul tails so they all reduce the same way.
pub fn dot(x: &[f32], w: &[u8], d: WeightDtype) -> f32 {
    assert!(w.len() >= x.len() * d.size(), "dot: weight slice too short");
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { dot_avx512(x, w, d) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { dot_avx2(x, w, d) },
        _ => dot_generic::<Portable>(x, w, d),
    }
}

/// Dot of two f32 slices, same canonical order.
pub fn dot_f32(x: &[f32], y: &[f32]) -> f32 {
    assert_eq!(x.len(), y.len());
    // SAFETY: reinterpreting f32 as bytes is always valid.
    let bytes = unsafe { std::slice::from_raw_parts(y.as_ptr() as *const u8, y.len() * 4) };
    dot(x, bytes, WeightDtype::F32)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn dot_avx512(x: &[f32], w: &[u8], d: WeightDtype) -> f32 {
    dot_generic::<Avx512>(x, w, d)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(x: &[f32], w: &[u8], d: WeightDtype) -> f32 {
    dot_generic::<Avx2>(x, w, d)
}

#[inline(always)]
fn dot_generic<S: Simd16>(x: &[f32], w: &[u8], d: WeightDtype) -> f32 {
    let mut out = 0.0f32;
    // SAFETY: `dot` checked that `w` holds `x.len()` weights; one output.
    unsafe {
        if d == WeightDtype::Bf16 {
            with_scratch(|xs| {
                split_pairs_into(x, 1, x.len(), xs);
                tile_pairs::<S, 1, 1>(xs.as_ptr(), x.len(), w.as_ptr(), 0, &mut out, 0)
            })
        } else {
            tile::<S, 1, 1>(x.as_ptr(), x.len(), w.as_ptr(), d, 0, &mut out, 0)
        }
    };
    out
}

/// An `MR x NR` block of dot products: rows `x[r*k..]` against weight rows at
/// `w + j*w_stride`, written to `out[r*ldo + j]`. Each output follows the canonical order
/// whatever MR and NR are, so tiling never changes a bit.
///
/// # Safety
/// `x` must hold `MR * k` floats, each weight row `k` elements of `d`, and `out` must be
/// writable at every `r*ldo + j`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub unsafe fn tile<S: Simd16, const MR: usize, const NR: usize>(
    x: *const f32,
    k: usize,
    w: *const u8,
    d: WeightDtype,
    w_stride: usize,
    out: *mut f32,
    ldo: usize,
) {
    let mut acc = [[S::zero(); NR]; MR];
    lanes_from::<S, MR, NR>(&mut acc, 0, x, k, w, d, w_stride);
    store::<S, MR, NR>(&acc, out, ldo);
}

/// One pair chunk at `i` into `acc`, in the pair order: for every row `r` of pair-split `x`
/// (`k` a row) and weight row `j`, `acc += x_even * even[j]`, then `+= x_odd * odd[j]`, each
/// a fused multiply-add (what [`tile_pairs`] and the quantized tile add per chunk).
///
/// # Safety
/// `x` must hold `MR` rows of `k` floats with a whole pair chunk at `i`.
#[inline(always)]
pub unsafe fn pair_step<S: Simd16, const MR: usize, const NR: usize>(
    acc: &mut [[S::V; NR]; MR],
    x: *const f32,
    k: usize,
    i: usize,
    even: &[S::V; NR],
    odd: &[S::V; NR],
) {
    for (r, row) in acc.iter_mut().enumerate() {
        let xe = S::load(x.add(r * k + i));
        let xo = S::load(x.add(r * k + i + LANES));
        for j in 0..NR {
            row[j] = S::fma(S::fma(row[j], xe, even[j]), xo, odd[j]);
        }
    }
}

/// The canonical 16-lane accumulation of elements `start..k` into `acc` (16-lane chunks,
/// then the zero-padded tail): all of [`tile`], and the rest of K after [`tile_pairs`]'s
/// pair chunks.
///
/// # Safety
/// As for [`tile`]; `start` must be a multiple of 16.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn lanes_from<S: Simd16, const MR: usize, const NR: usize>(
    acc: &mut [[S::V; NR]; MR],
    start: usize,
    x: *const f32,
    k: usize,
    w: *const u8,
    d: WeightDtype,
    w_stride: usize,
) {
    let ds = d.size();
    let mut i = start;
    while i + LANES <= k {
        let mut wv = [S::zero(); NR];
        for (j, v) in wv.iter_mut().enumerate() {
            let p = w.add(j * w_stride + i * ds);
            if NR > 1 && w_stride != 0 {
                S::prefetch(p.wrapping_add(NR * w_stride));
            }
            *v = S::load_w(p, d);
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = S::load(x.add(r * k + i));
            for j in 0..NR {
                row[j] = S::fma(row[j], xv, wv[j]);
            }
        }
        i += LANES;
    }
    if i < k {
        for (r, row) in acc.iter_mut().enumerate() {
            let xs = std::slice::from_raw_parts(x.add(r * k), k);
            for (j, a) in row.iter_mut().enumerate() {
                let ws = std::slice::from_raw_parts(w.add(j * w_stride), k * ds);
                let (xt, wt) = tail_f32(xs, ws, d, i);
                *a = S::fma(*a, S::load(xt.as_ptr()), S::load(wt.as_ptr()));
            }
        }
    }
}

/// Each accumulator through the canonical lane tree into `out[r*ldo + j]`.
///
/// # Safety
/// `out` must be writable at every `r*ldo + j`.
#[inline(always)]
unsafe fn store<S: Simd16, const MR: usize, const NR: usize>(
    acc: &[[S::V; NR]; MR],
    out: *mut f32,
    ldo: usize,
) {
    for (r, row) in acc.iter().enumerate() {
        for (j, a) in row.iter().enumerate() {
            *out.add(r * ldo + j) = S::reduce(*a);
        }
    }
}

/// Elements per pair chunk of the bf16 order.
pub const PAIR_CHUNK: usize = 2 * LANES;

/// `x` (`m` rows of `k`) rearranged for [`tile_pairs`]: in each full 32-element chunk the
/// even elements first, then the odd ones; the rest of each row as it was.
pub fn split_pairs(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let mut out = Vec::new();
    split_pairs_into(x, m, k, &mut out);
    out
}

/// [`split_pairs`] into `out` (cleared first; its allocation reused).
pub fn split_pairs_into(x: &[f32], m: usize, k: usize, out: &mut Vec<f32>) {
    out.clear();
    out.extend_from_slice(x);
    let full = k / PAIR_CHUNK * PAIR_CHUNK;
    for r in 0..m {
        for c in (0..full).step_by(PAIR_CHUNK) {
            let (src, dst) = (&x[r * k + c..], &mut out[r * k + c..]);
            for l in 0..LANES {
                dst[l] = src[2 * l];
                dst[LANES + l] = src[2 * l + 1];
            }
        }
    }
}

thread_local! {
    /// The calling thread's buffer for a matmul's rearranged input, kept between calls so
    /// a decode step allocates nothing per matmul.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's reusable scratch buffer, or a fresh one when the thread's
/// is already in use (a pool thread that stole another matmul's task while waiting).
pub fn with_scratch<R>(f: impl FnOnce(&mut Vec<f32>) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => f(&mut buf),
        Err(_) => f(&mut Vec::new()),
    })
}

/// Like [`tile`] for bf16 weights, in the bf16 order: lane `l` takes, for each full
/// 32-element chunk, element `2l` then `2l + 1`; the rest of K then goes as in [`tile`]
/// (16-lane chunks, zero-padded tail); the same lane tree at the end. Widening bf16 pairs
/// needs no shuffle, and each weight is widened once for all `MR` rows.
///
/// # Safety
/// As for [`tile`]; `x` rows must come from [`split_pairs`] and the weights be bf16.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub unsafe fn tile_pairs<S: Simd16, const MR: usize, const NR: usize>(
    x: *const f32,
    k: usize,
    w: *const u8,
    w_stride: usize,
    out: *mut f32,
    ldo: usize,
) {
    let d = WeightDtype::Bf16;
    let mut acc = [[S::zero(); NR]; MR];
    let pairs = k / PAIR_CHUNK * PAIR_CHUNK;
    let mut i = 0;
    while i < pairs {
        let mut even = [S::zero(); NR];
        let mut odd = [S::zero(); NR];
        for j in 0..NR {
            let p = w.add(j * w_stride + i * 2);
            // The same place in the next block's rows: with rows interleaved the hardware
            // prefetchers alone leave ~20% of the bandwidth unused. One row is a single
            // stream they follow, where a software prefetch only costs bandwidth.
            if NR > 1 {
                S::prefetch(p.wrapping_add(NR * w_stride));
            }
            (even[j], odd[j]) = S::load_bf16_pairs(p);
        }
        pair_step::<S, MR, NR>(&mut acc, x, k, i, &even, &odd);
        i += PAIR_CHUNK;
    }
    lanes_from::<S, MR, NR>(&mut acc, i, x, k, w, d, w_stride);
    store::<S, MR, NR>(&acc, out, ldo);
}

/// The last partial chunk of a dot product, zero-padded to 16 lanes.
#[inline(always)]
fn tail_f32(x: &[f32], w: &[u8], d: WeightDtype, start: usize) -> ([f32; 16], [f32; 16]) {
    let mut xt = [0.0f32; LANES];
    let mut wt = [0.0f32; LANES];
    for (j, i) in (start..x.len()).enumerate() {
        xt[j] = x[i];
        wt[j] = unsafe { d.read(w.as_ptr(), i) };
    }
    (xt, wt)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// Every SIMD path computes exactly the portable path's bits, for f32 and bf16 weights
    /// (whose orders differ).
    #[test]
    fn all_paths_agree_bitwise() {
        for k in [1, 15, 16, 17, 31, 32, 33, 48, 50, 100, 1024, 3071] {
            let x = data(k, 1);
            let w = data(k, 2);
            let f32s: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let bf16s: Vec<u8> = w.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
            for (d, wb) in [(WeightDtype::F32, &f32s), (WeightDtype::Bf16, &bf16s)] {
                let portable = dot_generic::<Portable>(&x, wb, d).to_bits();
                assert_eq!(dot(&x, wb, d).to_bits(), portable, "k={k} {d:?}");
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    let avx2 = unsafe { dot_avx2(&x, wb, d) }.to_bits();
                    assert_eq!(avx2, portable, "k={k} {d:?}");
                }
            }
        }
    }

    /// The bf16 order is the one documented: pairs within 32-element chunks, then the rest
    /// in 16-lane chunks, then the lane tree (checked against a scalar model).
    #[test]
    fn bf16_order_is_pairs_then_lanes() {
        for k in [32, 45, 64, 100] {
            let x = data(k, 3);
            let w: Vec<f32> = data(k, 4).iter().map(|v| f32::from_bits(v.to_bits() & 0xFFFF_0000)).collect();
            let wb: Vec<u8> = w.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
            let mut lanes = [0.0f32; LANES];
            let pairs = k / 32 * 32;
            for c in (0..pairs).step_by(32) {
                for (l, a) in lanes.iter_mut().enumerate() {
                    *a = x[c + 2 * l].mul_add(w[c + 2 * l], *a);
                    *a = x[c + 2 * l + 1].mul_add(w[c + 2 * l + 1], *a);
                }
            }
            for (i, (xv, wv)) in x.iter().zip(&w).enumerate().skip(pairs) {
                let l = (i - pairs) % LANES;
                lanes[l] = xv.mul_add(*wv, lanes[l]);
            }
            let want = Portable::reduce(lanes);
            assert_eq!(dot(&x, &wb, WeightDtype::Bf16).to_bits(), want.to_bits(), "k={k}");
        }
    }

    /// Negative control: a plain sequential sum (another order) gives other bits.
    #[test]
    fn a_different_order_changes_bits() {
        let x = data(3071, 1);
        let w = data(3071, 2);
        let sequential = x.iter().zip(&w).fold(0.0f32, |a, (x, w)| a + x * w);
        assert_ne!(dot_f32(&x, &w).to_bits(), sequential.to_bits());
    }
}
