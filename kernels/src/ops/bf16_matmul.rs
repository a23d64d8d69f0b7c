//! The matmul of bf16 weights with bf16 activations (`--activations bf16`, the numerics
//! decision of docs/design.md: activations rounded to the weights' 16-bit type at each
//! matmul's input, products exact, f32 accumulation).
//!
//! The bf16-activation order, per output (x a row rounded to bf16, nearest even; w a weight
//! row; both zero-padded to whole 32-element chunks):
//! - lane `l` (0..16), for each chunk in increasing K: `acc = acc + x[2l+1] * w[2l+1]`, then
//!   `acc = acc + x[2l] * w[2l]`, each one rounding (the product of two bf16 is exact in
//!   f32), with subnormal inputs read as zero and subnormal results flushed to zero (sign
//!   kept);
//! - the canonical lane tree of the 16 lanes.
//!
//! That is exactly what AVX512-BF16's `vdpbf16ps` computes on each chunk, so CPUs that have
//! it run one instruction a chunk; the others run the same arithmetic from f32 fused
//! multiply-adds with the flushes written out. A CPU's instruction is used only after it
//! reproduced the written-out order on a set of edge cases ([`native_matches`]); every path
//! gives the portable path's bits (`tests` below; `tests/kernel_invariance.rs` for M).

use super::simd::LANES;

/// Elements per chunk: 16 lanes of a pair each.
pub const CHUNK: usize = 2 * LANES;

/// `v` rounded to bf16 (nearest even; a NaN stays a quiet NaN), as bits: the bits of
/// `WeightDtype::Bf16.round`, written without branches so that [`round_rows`] vectorizes.
#[inline(always)]
pub fn to_bf16(v: f32) -> u16 {
    let x = v.to_bits();
    let nan = ((x >> 16) | 0x40) as u16;
    let rounded = (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16;
    if x & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

/// `x` (`m` rows of `k`) rounded to bf16 into `out`: `m` rows of `k` rounded up to whole
/// chunks, zero-padded.
pub fn round_rows(x: &[f32], m: usize, k: usize, out: &mut Vec<u16>) {
    let kp = k.div_ceil(CHUNK) * CHUNK;
    out.clear();
    out.resize(m * kp, 0);
    for (src, dst) in x.chunks_exact(k).zip(out.chunks_exact_mut(kp)) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = to_bf16(*s);
        }
    }
}

/// The smallest positive normal f32.
const MIN_NORMAL: f32 = f32::MIN_POSITIVE;

/// A bf16 input as the order reads it: subnormals are zero (sign kept).
#[inline(always)]
fn input(b: u16) -> f32 {
    let v = f32::from_bits((b as u32) << 16);
    if b & 0x7F80 == 0 {
        f32::from_bits(v.to_bits() & 0x8000_0000)
    } else {
        v
    }
}

/// A result as the order keeps it: subnormals flushed to zero (sign kept).
#[inline(always)]
fn flushed(v: f32) -> f32 {
    if v.abs() < MIN_NORMAL {
        f32::from_bits(v.to_bits() & 0x8000_0000)
    } else {
        v
    }
}

/// One chunk of the bf16-activation order on 16 f32 lanes.
pub trait Bf16Dot: Copy {
    /// 16 f32 accumulator lanes.
    type V: Copy;
    /// 32 bf16 values as [`Bf16Dot::dot`] takes them.
    type C: Copy;
    fn zero() -> Self::V;
    /// Loads 32 bf16 at `p`.
    ///
    /// # Safety
    /// `p` must point to 32 readable bf16.
    unsafe fn load(p: *const u16) -> Self::C;
    /// Lane `l`: `acc + x[2l+1] * w[2l+1]`, then `+ x[2l] * w[2l]`, as the order says.
    fn dot(acc: Self::V, x: Self::C, w: Self::C) -> Self::V;
    /// The canonical lane tree.
    fn reduce(v: Self::V) -> f32;
    /// Asks for the cache line at `p` ahead of its use.
    #[inline(always)]
    fn prefetch(_p: *const u8) {}
}

/// The order written out one lane at a time (non-x86 targets, and the reference).
#[derive(Clone, Copy)]
pub struct Portable;

impl Bf16Dot for Portable {
    type V = [f32; LANES];
    type C = [u16; CHUNK];
    #[inline(always)]
    fn zero() -> Self::V {
        [0.0; LANES]
    }
    #[inline(always)]
    unsafe fn load(p: *const u16) -> Self::C {
        std::ptr::read_unaligned(p as *const [u16; CHUNK])
    }
    #[inline(always)]
    fn dot(acc: Self::V, x: Self::C, w: Self::C) -> Self::V {
        let mut r = acc;
        for l in 0..LANES {
            let odd = flushed(input(x[2 * l + 1]).mul_add(input(w[2 * l + 1]), r[l]));
            r[l] = flushed(input(x[2 * l]).mul_add(input(w[2 * l]), odd));
        }
        r
    }
    #[inline(always)]
    fn reduce(v: Self::V) -> f32 {
        mtp_base::logits::lane_tree(v)
    }
}

#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2Emulated, Avx512Emulated, Avx512Native};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::ops::simd::{Avx2, Avx512, Simd16};
    use std::arch::x86_64::*;

    /// `vdpbf16ps` (AVX512-BF16), one instruction a chunk. Its tiles are compiled with
    /// AVX512-VL as well: without it LLVM gave the instruction registers zmm0-15 only and
    /// spilled a 4x4 tile's accumulators to the stack (1.5x slower on Zen 4).
    #[derive(Clone, Copy)]
    pub struct Avx512Native;

    impl Bf16Dot for Avx512Native {
        type V = __m512;
        /// Held as integers (the instruction takes them as they are loaded).
        type C = __m512i;
        #[inline(always)]
        fn zero() -> __m512 {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const u16) -> __m512i {
            _mm512_loadu_si512(p as *const __m512i)
        }
        #[inline(always)]
        fn dot(acc: __m512, x: __m512i, w: __m512i) -> __m512 {
            unsafe {
                _mm512_dpbf16_ps(
                    acc,
                    std::mem::transmute::<__m512i, __m512bh>(x),
                    std::mem::transmute::<__m512i, __m512bh>(w),
                )
            }
        }
        #[inline(always)]
        fn reduce(v: __m512) -> f32 {
            Avx512::reduce(v)
        }
        #[inline(always)]
        fn prefetch(p: *const u8) {
            Avx512::prefetch(p)
        }
    }

    /// The order from AVX-512F fused multiply-adds: pairs widened by a shift and a mask,
    /// subnormal inputs zeroed, subnormal results flushed.
    #[derive(Clone, Copy)]
    pub struct Avx512Emulated;

    impl Avx512Emulated {
        /// Zero (sign kept) where `v`'s exponent bits are all zero.
        #[inline(always)]
        unsafe fn zero_subnormal(v: __m512i) -> __m512 {
            let exp = _mm512_set1_epi32(0x7F80_0000);
            let tiny = _mm512_testn_epi32_mask(v, exp);
            let sign = _mm512_set1_epi32(0x8000_0000u32 as i32);
            _mm512_castsi512_ps(_mm512_mask_and_epi32(v, tiny, v, sign))
        }

        #[inline(always)]
        unsafe fn fma_flushed(a: __m512, b: __m512, acc: __m512) -> __m512 {
            let r = _mm512_fmadd_ps(a, b, acc);
            let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(r), _mm512_set1_ps(MIN_NORMAL));
            let (bits, sign) = (_mm512_castps_si512(r), _mm512_set1_epi32(0x8000_0000u32 as i32));
            _mm512_castsi512_ps(_mm512_mask_and_epi32(bits, tiny, bits, sign))
        }
    }

    impl Bf16Dot for Avx512Emulated {
        type V = __m512;
        /// (even, odd) elements widened.
        type C = (__m512, __m512);
        #[inline(always)]
        fn zero() -> __m512 {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const u16) -> Self::C {
            let raw = _mm512_loadu_si512(p as *const __m512i);
            let even = _mm512_slli_epi32(raw, 16);
            let odd = _mm512_and_si512(raw, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
            (Self::zero_subnormal(even), Self::zero_subnormal(odd))
        }
        #[inline(always)]
        fn dot(acc: __m512, x: Self::C, w: Self::C) -> __m512 {
            unsafe { Self::fma_flushed(x.0, w.0, Self::fma_flushed(x.1, w.1, acc)) }
        }
        #[inline(always)]
        fn reduce(v: __m512) -> f32 {
            Avx512::reduce(v)
        }
        #[inline(always)]
        fn prefetch(p: *const u8) {
            Avx512::prefetch(p)
        }
    }

    /// The order from AVX2 fused multiply-adds, 16 lanes as two halves.
    #[derive(Clone, Copy)]
    pub struct Avx2Emulated;

    impl Avx2Emulated {
        #[inline(always)]
        unsafe fn zero_subnormal(v: __m256i) -> __m256 {
            let exp = _mm256_and_si256(v, _mm256_set1_epi32(0x7F80_0000));
            let tiny = _mm256_cmpeq_epi32(exp, _mm256_setzero_si256());
            let sign = _mm256_and_si256(v, _mm256_set1_epi32(0x8000_0000u32 as i32));
            _mm256_castsi256_ps(_mm256_blendv_epi8(v, sign, tiny))
        }

        #[inline(always)]
        unsafe fn fma_flushed(a: __m256, b: __m256, acc: __m256) -> __m256 {
            let r = _mm256_fmadd_ps(a, b, acc);
            let sign = _mm256_set1_ps(-0.0);
            let abs = _mm256_andnot_ps(sign, r);
            let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(abs, _mm256_set1_ps(MIN_NORMAL));
            _mm256_blendv_ps(r, _mm256_and_ps(r, sign), tiny)
        }

        /// 16 bf16 pairs' halves: (even, odd) of 8 pairs at `p`.
        #[inline(always)]
        unsafe fn half(p: *const u16) -> (__m256, __m256) {
            let raw = _mm256_loadu_si256(p as *const __m256i);
            let even = _mm256_slli_epi32(raw, 16);
            let odd = _mm256_and_si256(raw, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
            (Self::zero_subnormal(even), Self::zero_subnormal(odd))
        }
    }

    impl Bf16Dot for Avx2Emulated {
        type V = (__m256, __m256);
        /// (even, odd) of lanes 0..8, then of lanes 8..16.
        type C = ((__m256, __m256), (__m256, __m256));
        #[inline(always)]
        fn zero() -> Self::V {
            Avx2::zero()
        }
        #[inline(always)]
        unsafe fn load(p: *const u16) -> Self::C {
            (Self::half(p), Self::half(p.add(LANES)))
        }
        #[inline(always)]
        fn dot(acc: Self::V, x: Self::C, w: Self::C) -> Self::V {
            unsafe {
                let lo = Self::fma_flushed(x.0 .0, w.0 .0, Self::fma_flushed(x.0 .1, w.0 .1, acc.0));
                let hi = Self::fma_flushed(x.1 .0, w.1 .0, Self::fma_flushed(x.1 .1, w.1 .1, acc.1));
                (lo, hi)
            }
        }
        #[inline(always)]
        fn reduce(v: Self::V) -> f32 {
            Avx2::reduce(v)
        }
        #[inline(always)]
        fn prefetch(p: *const u8) {
            Avx2::prefetch(p)
        }
    }

    /// Whether `vdpbf16ps` on this CPU computes the written-out order on edge cases: tiny
    /// and subnormal inputs and results, signed zeros, cancellation, large magnitudes.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn native_matches() -> bool {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for t in 0..4096 {
            let mut value = || {
                let r = next();
                // Exponents across the range, a third of them tiny; some zeros and subnormals.
                let exp = match r % 6 {
                    0 | 1 => (r >> 8) % 16,
                    2 => 0,
                    _ => 100 + (r >> 8) % 40,
                };
                let sign = ((r >> 20) & 1) << 15;
                (sign | (exp << 7) | ((r >> 24) & 127)) as u16
            };
            let x: [u16; CHUNK] = std::array::from_fn(|_| value());
            let w: [u16; CHUNK] = std::array::from_fn(|_| value());
            let acc: [f32; LANES] = std::array::from_fn(|l| {
                let r = next();
                if (t + l) % 3 == 0 {
                    0.0
                } else {
                    flushed(f32::from_bits((r as u32 & 0x8FFF_FFFF) >> ((r >> 40) % 4)))
                }
            });
            let hw = Avx512Native::dot(
                _mm512_loadu_ps(acc.as_ptr()),
                Avx512Native::load(x.as_ptr()),
                Avx512Native::load(w.as_ptr()),
            );
            let mut got = [0.0f32; LANES];
            _mm512_storeu_ps(got.as_mut_ptr(), hw);
            let want = Portable::dot(acc, x, w);
            if got.iter().zip(&want).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return false;
            }
        }
        true
    }
}

/// How this CPU computes the bf16-activation order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// `vdpbf16ps`, checked against the written-out order.
    Native,
    Avx512Emulated,
    Avx2Emulated,
    Portable,
}

/// This CPU's path, chosen once.
pub fn path() -> Path {
    static PATH: std::sync::OnceLock<Path> = std::sync::OnceLock::new();
    *PATH.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use mtp_base::isa::{isa, Isa};
            match isa() {
                Isa::Avx512 => {
                    // AVX512-VL too: the native tiles are compiled with it (see `Avx512Native`).
                    let bf16 = std::is_x86_feature_detected!("avx512bf16")
                        && std::is_x86_feature_detected!("avx512bw")
                        && std::is_x86_feature_detected!("avx512vl");
                    // SAFETY: the features were just detected.
                    if bf16 && unsafe { x86::native_matches() } {
                        return Path::Native;
                    }
                    return Path::Avx512Emulated;
                }
                Isa::Avx2 => return Path::Avx2Emulated,
                Isa::Portable => {}
            }
        }
        Path::Portable
    })
}

/// An `MR x NR` block: rounded rows at `x` (`kp` a row, whole chunks) against bf16 weight
/// rows at `w + j * w_stride` bytes (`k` each), into `out[r*ldo + j]`.
///
/// # Safety
/// `x` must hold `MR` rows of `kp = k` rounded up to chunks, each weight row `k` bf16, and
/// `out` be writable at every `r*ldo + j`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub unsafe fn tile<S: Bf16Dot, const MR: usize, const NR: usize>(
    x: *const u16,
    k: usize,
    w: *const u8,
    w_stride: usize,
    out: *mut f32,
    ldo: usize,
) {
    let kp = k.div_ceil(CHUNK) * CHUNK;
    let full = k / CHUNK * CHUNK;
    let mut acc = [[S::zero(); NR]; MR];
    let mut i = 0;
    while i < full {
        // A loop, not `array::from_fn`: a closure does not inherit the caller's target
        // features, and the emulated paths' intrinsics became calls (40-70x slower).
        let mut wv = [S::load(w.add(i * 2) as *const u16); NR];
        for (j, v) in wv.iter_mut().enumerate() {
            let p = w.add(j * w_stride + i * 2);
            // The same place in the next block's rows (decoding reads each weight once); one
            // row is a stream the hardware prefetcher follows (see `simd::tile_pairs`).
            if NR > 1 {
                S::prefetch(p.wrapping_add(NR * w_stride));
            }
            if j > 0 {
                *v = S::load(p as *const u16);
            }
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = S::load(x.add(r * kp + i));
            for j in 0..NR {
                row[j] = S::dot(row[j], xv, wv[j]);
            }
        }
        i += CHUNK;
    }
    if full < k {
        // The last partial chunk, zero-padded (x is padded already).
        let mut tails = [[0u16; CHUNK]; NR];
        for (j, t) in tails.iter_mut().enumerate() {
            let row = w.add(j * w_stride + full * 2) as *const u16;
            std::ptr::copy_nonoverlapping(row, t.as_mut_ptr(), k - full);
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = S::load(x.add(r * kp + full));
            for j in 0..NR {
                row[j] = S::dot(row[j], xv, S::load(tails[j].as_ptr()));
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (j, a) in row.iter().enumerate() {
            *out.add(r * ldo + j) = S::reduce(*a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mtp_base::weights::WeightDtype;

    /// Values across the exponent range (some tiny, subnormal or zero) as bf16 bits.
    fn values(n: usize, seed: u64) -> Vec<u16> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let exp = match s % 5 {
                    0 => (s >> 8) % 12,
                    1 => 0,
                    _ => 110 + (s >> 8) % 25,
                };
                ((((s >> 20) & 1) << 15) | (exp << 7) | ((s >> 24) & 127)) as u16
            })
            .collect()
    }

    /// `tile::<S, 1, 1>` on one row against one weight row.
    fn one<S: Bf16Dot>(x: &[u16], w: &[u16], k: usize) -> u32 {
        let mut out = 0.0f32;
        // SAFETY: x is padded to whole chunks, w holds k values.
        unsafe { tile::<S, 1, 1>(x.as_ptr(), k, w.as_ptr() as *const u8, 0, &mut out, 0) };
        out.to_bits()
    }

    /// The branch-free rounding gives `WeightDtype::Bf16.round`'s bits: ties both ways,
    /// overflow to infinity, infinities, NaNs, subnormals, zeros, and random values.
    #[test]
    fn to_bf16_is_the_reference_rounding() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let edges = [
            0u32,
            0x8000_0000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_7FFF,
            0x3F80_8001,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
            0x0000_8000,
            0x0001_8000,
        ];
        let random = (0..1_000_000).map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u32
        });
        for x in edges.into_iter().chain(random) {
            let want = (WeightDtype::Bf16.round(f32::from_bits(x)).to_bits() >> 16) as u16;
            assert_eq!(to_bf16(f32::from_bits(x)), want, "{x:#010x}");
        }
    }

    /// The portable path is the order as documented, one scalar at a time.
    #[test]
    fn portable_is_the_documented_order() {
        for k in [1usize, 31, 32, 33, 64, 100] {
            let kp = k.div_ceil(CHUNK) * CHUNK;
            let mut x = values(kp, k as u64);
            x[k..].iter_mut().for_each(|v| *v = 0);
            let w = values(k, 99 + k as u64);
            let mut lanes = [0.0f32; LANES];
            for c in (0..kp).step_by(CHUNK) {
                for (l, a) in lanes.iter_mut().enumerate() {
                    let at = |v: &[u16], i: usize| input(v.get(i).copied().unwrap_or(0));
                    *a = flushed(at(&x, c + 2 * l + 1).mul_add(at(&w, c + 2 * l + 1), *a));
                    *a = flushed(at(&x, c + 2 * l).mul_add(at(&w, c + 2 * l), *a));
                }
            }
            let want = mtp_base::logits::lane_tree(lanes).to_bits();
            assert_eq!(one::<Portable>(&x, &w, k), want, "k={k}");
        }
    }

    /// Every x86 path this CPU can run gives the portable bits, tiny values included.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_path_gives_the_portable_bits() {
        let mut checked = Vec::new();
        for k in [16usize, 32, 45, 64, 1024, 3071] {
            let kp = k.div_ceil(CHUNK) * CHUNK;
            for seed in 0..20u64 {
                let mut x = values(kp, seed * 31 + k as u64);
                x[k..].iter_mut().for_each(|v| *v = 0);
                let w = values(k, seed * 17 + 5);
                let want = one::<Portable>(&x, &w, k);
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    assert_eq!(one::<Avx2Emulated>(&x, &w, k), want, "avx2 k={k} seed={seed}");
                    checked.push("avx2");
                }
                if std::is_x86_feature_detected!("avx512f") {
                    assert_eq!(one::<Avx512Emulated>(&x, &w, k), want, "avx512 k={k} seed={seed}");
                    checked.push("avx512");
                }
                if path() == Path::Native {
                    assert_eq!(one::<Avx512Native>(&x, &w, k), want, "vdpbf16ps k={k} seed={seed}");
                    checked.push("native");
                }
            }
        }
        eprintln!(
            "bf16-activation paths checked: {:?} ({:?} picked)",
            checked.iter().collect::<std::collections::BTreeSet<_>>(),
            path()
        );
    }

    /// bf16 bits with exponents in `exps` (random signs and mantissas).
    fn ranged(n: usize, seed: u64, exps: std::ops::Range<u64>) -> Vec<u16> {
        values(n, seed)
            .iter()
            .map(|v| {
                ((v & 0x807F) as u64 | ((exps.start + (*v as u64 * 7) % (exps.end - exps.start)) << 7)) as u16
            })
            .collect()
    }

    /// Negative control: the same arithmetic without the flushes (on products near the
    /// subnormal range), or even before odd (on values near 1), gives other bits, so the
    /// tests above can tell the orders apart.
    #[test]
    fn the_flushes_and_the_pair_order_matter() {
        let k = 64;
        let f = |v: u16| f32::from_bits((v as u32) << 16);
        let (mut unflushed, mut swapped) = (false, false);
        for seed in 0..20u64 {
            let (x, w) = (ranged(k, seed, 55..70), ranged(k, seed + 1000, 55..70));
            let want = one::<Portable>(&x, &w, k);
            let mut a = [0.0f32; LANES];
            for c in (0..k).step_by(CHUNK) {
                for (l, a) in a.iter_mut().enumerate() {
                    let (e, o) = (c + 2 * l, c + 2 * l + 1);
                    *a = f(x[e]).mul_add(f(w[e]), f(x[o]).mul_add(f(w[o]), *a));
                }
            }
            unflushed |= mtp_base::logits::lane_tree(a).to_bits() != want;

            let (x, w) = (ranged(k, seed, 120..130), ranged(k, seed + 1000, 120..130));
            let want = one::<Portable>(&x, &w, k);
            let mut b = [0.0f32; LANES];
            for c in (0..k).step_by(CHUNK) {
                for (l, b) in b.iter_mut().enumerate() {
                    let (e, o) = (c + 2 * l, c + 2 * l + 1);
                    *b = f(x[o]).mul_add(f(w[o]), f(x[e]).mul_add(f(w[e]), *b));
                }
            }
            swapped |= mtp_base::logits::lane_tree(b).to_bits() != want;
        }
        assert!(unflushed && swapped, "unflushed differs: {unflushed}, even-first differs: {swapped}");
    }
}
