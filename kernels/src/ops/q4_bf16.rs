//! The matmul of MLX 4-bit weights with bf16 activations (`--activations bf16`, the numerics
//! decision of docs/design.md, and the function CUDA's `linear_tcq` computes): per group
//! `scale * dot(bf16(x), 128 + q) + (bias - 128 scale) * sum(bf16(x))`. bf16 holds `128 + q`
//! exactly (the bits `0x4300 | q`), so a block of packed codes becomes `vdpbf16ps` operands
//! by one mask, one shift and a byte interleave with `0x43`: no table, no dequantized value.
//!
//! Which weights: affine 4-bit with bf16 scales and biases in groups of 32, 64 or 128
//! ([`takes`]; what mlx-lm writes for a bf16 model). The order, per output (x a row rounded
//! to bf16, nearest even; one weight row of codes `q`):
//! - K runs in blocks of 128 values, the last zero-padded (x 0, codes 0). A block's 64 packed
//!   bytes make four chunks of 32 codes: chunk `c`'s lane `l = 4j + t` (j, t in 0..4) holds
//!   the even element at block offset `32j + 16 (c & 1) + 4t + (c >> 1)` and the odd one 2
//!   past it (the low nibbles' bytes interleaved, then the high ones'). [`prepare_into`] lays
//!   x out the same way, so lane `j`'s quarter of every chunk lies in block offsets
//!   `32j .. 32j + 32`, one group.
//! - Per block, lane `l`: `d = 0`, then chunks 0 to 3 in the bf16-activation order of
//!   [`super::bf16_matmul`] (odd element then even, subnormals flushed); then
//!   `acc_l = fma(s_l, d, acc_l)`, `s_l` the scale of the group holding offset `32j`.
//! - Before the blocks of every 16 groups `g0 .. g0 + 16` (zero-padded past the last), lane
//!   `i`: `acc_i = fma(c, xsum, acc_i)` for group `g0 + i`, where `c = fma(-128, scale,
//!   bias)` and `xsum` is the group's sum of bf16(x): lane `i` of 16 adds its values
//!   `i, i + 16, ...` in order, then the canonical lane tree.
//! - The result is the canonical lane tree of `acc`.
//!
//! It depends only on K and the group size, never on M or the threads. CPUs with
//! AVX512-BF16 run it natively; the others compute the same bits from f32 fused
//! multiply-adds (the paths of [`super::bf16_matmul`]), checked by `tests` below and
//! `tests/kernel_invariance.rs` (M-invariance, with the stock-matmul negative control).

use super::bf16_matmul::{to_bf16, Bf16Dot, Portable, CHUNK};
use super::quant_matmul::QuantCols;
use super::simd::LANES;
use mtp_base::weights::{Weight, WeightDtype};

/// Values per block: four chunks.
pub const BLOCK: usize = 4 * CHUNK;
/// Groups whose scales one vector holds.
const GROUPS: usize = LANES;

/// Whether `w` takes this kernel in bf16 mode: affine 4-bit, bf16 scales and biases, groups
/// of 32, 64 or 128.
pub fn takes(w: &Weight) -> bool {
    w.quant().is_some_and(|q| {
        q.bits == 4
            && matches!(q.group, 32 | 64 | 128)
            && w.cols.is_multiple_of(q.group)
            && q.scales.dtype == WeightDtype::Bf16
            && q.biases.as_ref().is_some_and(|b| b.dtype == WeightDtype::Bf16)
    })
}

/// Values and groups of one prepared row: K padded to whole blocks, groups to whole 16s.
pub fn padded(k: usize, group: usize) -> (usize, usize) {
    (k.div_ceil(BLOCK) * BLOCK, (k / group).div_ceil(GROUPS) * GROUPS)
}

/// Block offset of chunk `c`'s element `e` (0..32).
#[inline(always)]
fn offset(c: usize, e: usize) -> usize {
    let (l, odd) = (e / 2, e % 2);
    let (j, t) = (l / 4, l % 4);
    32 * j + 16 * (c & 1) + 4 * t + (c >> 1) + 2 * odd
}

/// `x` (`m` rows of `k`) prepared for [`tile`]: each row rounded to bf16 in the block
/// layout into `words` (`m` rows of the padded K), its group sums into `sums` (`m` rows of
/// the padded groups).
pub fn prepare_into(x: &[f32], m: usize, k: usize, group: usize, words: &mut Vec<u16>, sums: &mut Vec<f32>) {
    let (kp, gp) = padded(k, group);
    words.clear();
    words.resize(m * kp, 0);
    sums.clear();
    sums.resize(m * gp, 0.0);
    let widen = |b: u16| f32::from_bits((b as u32) << 16);
    for (r, row) in x.chunks_exact(k).enumerate() {
        let out = &mut words[r * kp..(r + 1) * kp];
        for (b, block) in out.chunks_exact_mut(BLOCK).enumerate() {
            for (i, w) in block.iter_mut().enumerate() {
                let at = b * BLOCK + offset(i / CHUNK, i % CHUNK);
                if at < k {
                    *w = to_bf16(row[at]);
                }
            }
        }
        for (g, sum) in sums[r * gp..r * gp + k / group].iter_mut().enumerate() {
            let mut lanes = [0.0f32; LANES];
            for (i, v) in row[g * group..(g + 1) * group].iter().enumerate() {
                lanes[i % LANES] += widen(to_bf16(*v));
            }
            *sum = mtp_base::logits::lane_tree(lanes);
        }
    }
}

/// The codes of one block as the order reads them: `0x4300 | q` (bf16 of `128 + q`) in the
/// chunk layout, codes past `bytes` (the block's packed bytes that exist) zero.
///
/// # Safety
/// `p` must point to `bytes` readable bytes.
#[inline(always)]
unsafe fn block_words(p: *const u8, bytes: usize) -> [u16; BLOCK] {
    let mut words = [0u16; BLOCK];
    for (i, w) in words.iter_mut().enumerate() {
        let at = offset(i / CHUNK, i % CHUNK);
        let byte = if at / 2 < bytes { *p.add(at / 2) } else { 0 };
        *w = 0x4300 | ((byte >> (4 * (at % 2))) & 15) as u16;
    }
    words
}

/// What [`tile`] needs beyond [`Bf16Dot`]: lane-wise f32 arithmetic and the block's codes.
/// The defaults go through arrays; the native path overrides them with single instructions.
pub trait Q4Bf16: Bf16Dot {
    fn lanes(v: Self::V) -> [f32; LANES];
    fn from_lanes(a: [f32; LANES]) -> Self::V;
    /// Lane-wise `a * b + c`, one rounding.
    #[inline(always)]
    fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        let (a, b, c) = (Self::lanes(a), Self::lanes(b), Self::lanes(c));
        Self::from_lanes(std::array::from_fn(|l| a[l].mul_add(b[l], c[l])))
    }
    /// 16 bf16 at `p`, the first `n` read and the rest zero, widened to f32.
    ///
    /// # Safety
    /// `p` must point to `n` readable bf16.
    #[inline(always)]
    unsafe fn widen(p: *const u16, n: usize) -> Self::V {
        let mut a = [0.0f32; LANES];
        for (i, v) in a.iter_mut().take(n).enumerate() {
            *v = f32::from_bits((std::ptr::read_unaligned(p.add(i)) as u32) << 16);
        }
        Self::from_lanes(a)
    }
    /// 16 f32 at `p`.
    ///
    /// # Safety
    /// `p` must point to 16 readable f32.
    #[inline(always)]
    unsafe fn load_f32(p: *const f32) -> Self::V {
        Self::from_lanes(std::ptr::read_unaligned(p as *const [f32; LANES]))
    }
    /// Lane `l` takes `v`'s lane `first + (l / 4) * 32 / group`: each quarter of a block its
    /// group's scale.
    #[inline(always)]
    fn lane_scales(v: Self::V, first: usize, group: usize) -> Self::V {
        let v = Self::lanes(v);
        Self::from_lanes(std::array::from_fn(|l| v[first + l / 4 * 32 / group]))
    }
    /// A block's four chunks of codes (see [`block_words`]).
    ///
    /// # Safety
    /// `p` must point to `bytes` readable bytes.
    #[inline(always)]
    unsafe fn block(p: *const u8, bytes: usize) -> [Self::C; 4] {
        let words = block_words(p, bytes);
        let w = words.as_ptr();
        [Self::load(w), Self::load(w.add(CHUNK)), Self::load(w.add(2 * CHUNK)), Self::load(w.add(3 * CHUNK))]
    }
}

impl Q4Bf16 for Portable {
    #[inline(always)]
    fn lanes(v: Self::V) -> [f32; LANES] {
        v
    }
    #[inline(always)]
    fn from_lanes(a: [f32; LANES]) -> Self::V {
        a
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::ops::bf16_matmul::{Avx2Emulated, Avx512Emulated, Avx512Native};
    use std::arch::x86_64::*;

    /// The lane arithmetic of the two paths whose 16 lanes are one zmm register.
    macro_rules! zmm_lanes {
        () => {
            #[inline(always)]
            fn lanes(v: __m512) -> [f32; LANES] {
                unsafe { std::mem::transmute::<__m512, [f32; LANES]>(v) }
            }
            #[inline(always)]
            fn from_lanes(a: [f32; LANES]) -> __m512 {
                unsafe { std::mem::transmute::<[f32; LANES], __m512>(a) }
            }
            #[inline(always)]
            fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
                unsafe { _mm512_fmadd_ps(a, b, c) }
            }
        };
    }

    impl Q4Bf16 for Avx512Native {
        zmm_lanes!();
        #[inline(always)]
        unsafe fn widen(p: *const u16, n: usize) -> __m512 {
            let raw = _mm256_maskz_loadu_epi16(((1u32 << n) - 1) as u16, p as *const i16);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
        }
        #[inline(always)]
        unsafe fn load_f32(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        fn lane_scales(v: __m512, first: usize, group: usize) -> __m512 {
            unsafe {
                // Lane l's group past `first`: its quarter l / 4 times 32 / group.
                let step = match group {
                    32 => _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                    64 => _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                    _ => _mm512_setzero_si512(),
                };
                _mm512_permutexvar_ps(_mm512_add_epi32(step, _mm512_set1_epi32(first as i32)), v)
            }
        }
        #[inline(always)]
        unsafe fn block(p: *const u8, bytes: usize) -> [__m512i; 4] {
            let raw = if bytes == 64 {
                _mm512_loadu_si512(p as *const __m512i)
            } else {
                _mm512_maskz_loadu_epi8((1u64 << bytes) - 1, p as *const i8)
            };
            let nibble = _mm512_set1_epi8(15);
            let low = _mm512_and_si512(raw, nibble);
            let high = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nibble);
            let exponent = _mm512_set1_epi8(0x43);
            [
                _mm512_unpacklo_epi8(low, exponent),
                _mm512_unpackhi_epi8(low, exponent),
                _mm512_unpacklo_epi8(high, exponent),
                _mm512_unpackhi_epi8(high, exponent),
            ]
        }
    }

    impl Q4Bf16 for Avx512Emulated {
        zmm_lanes!();
    }

    impl Q4Bf16 for Avx2Emulated {
        #[inline(always)]
        fn lanes(v: (__m256, __m256)) -> [f32; LANES] {
            unsafe { std::mem::transmute::<(__m256, __m256), [f32; LANES]>(v) }
        }
        #[inline(always)]
        fn from_lanes(a: [f32; LANES]) -> (__m256, __m256) {
            unsafe { std::mem::transmute::<[f32; LANES], (__m256, __m256)>(a) }
        }
        #[inline(always)]
        fn fma(a: (__m256, __m256), b: (__m256, __m256), c: (__m256, __m256)) -> (__m256, __m256) {
            unsafe { (_mm256_fmadd_ps(a.0, b.0, c.0), _mm256_fmadd_ps(a.1, b.1, c.1)) }
        }
    }
}

/// An `MR x NR` block in the order above: prepared rows at `x` (`kp` words a row) and their
/// group sums at `xsum` (`gp` a row; [`padded`]) against weight rows `n .. n + NR`, into
/// `out[r*ldo + j]`.
///
/// # Safety
/// `x` and `xsum` must hold `MR` prepared rows, `q` must be a weight [`takes`] accepts with
/// rows `n .. n + NR`, and `out` be writable at every `r*ldo + j`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub unsafe fn tile<S: Q4Bf16, const MR: usize, const NR: usize>(
    x: *const u16,
    xsum: *const f32,
    kp: usize,
    gp: usize,
    q: &QuantCols,
    n: usize,
    out: *mut f32,
    ldo: usize,
) {
    let (group, groups) = (q.group(), q.groups());
    let k = group * groups;
    let (scales, biases) = (q.scales() as *const u16, q.biases() as *const u16);
    let mut acc = [[S::zero(); NR]; MR];
    let mut g0 = 0;
    while g0 < groups {
        let valid = GROUPS.min(groups - g0);
        let mut scale = [S::zero(); NR];
        for j in 0..NR {
            let at = (n + j) * groups + g0;
            scale[j] = S::widen(scales.add(at), valid);
            let c = S::fma(S::from_lanes([-128.0; LANES]), scale[j], S::widen(biases.add(at), valid));
            for (r, row) in acc.iter_mut().enumerate() {
                row[j] = S::fma(c, S::load_f32(xsum.add(r * gp + g0)), row[j]);
            }
        }
        let (v0, v1) = (g0 * group, ((g0 + GROUPS) * group).min(k));
        let mut v = v0;
        while v < v1 {
            let bytes = (BLOCK / 2).min((k - v) / 2);
            for j in 0..NR {
                let p = q.packed().add((n + j) * q.row_bytes() + v / 2);
                if NR > 1 {
                    S::prefetch(p.wrapping_add(NR * q.row_bytes()));
                }
                let w = S::block(p, bytes);
                let s = S::lane_scales(scale[j], (v - v0) / group, group);
                for (r, row) in acc.iter_mut().enumerate() {
                    let xb = x.add(r * kp + v);
                    let mut d = S::zero();
                    for (c, wc) in w.iter().enumerate() {
                        d = S::dot(d, S::load(xb.add(c * CHUNK)), *wc);
                    }
                    row[j] = S::fma(s, d, row[j]);
                }
            }
            v += BLOCK;
        }
        g0 += GROUPS;
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
    use mtp_base::weights::Quant;

    /// A 4-bit `rows x k` weight in groups of `group` with bf16 scales and biases.
    fn weight(rows: usize, k: usize, group: usize, seed: u64) -> Weight {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let words: Vec<u8> = (0..rows * k / 2).map(|_| next() as u8).collect();
        let groups = rows * k / group;
        let bf16 = |v: f32| to_bf16(v).to_le_bytes();
        let scales: Vec<u8> =
            (0..groups).flat_map(|_| bf16((next() % 1000) as f32 / 40000.0 + 1e-3)).collect();
        let biases: Vec<u8> = (0..groups).flat_map(|_| bf16(-((next() % 1000) as f32) / 5000.0)).collect();
        let quant = Quant {
            bits: 4,
            group,
            scales: Weight::from_le_bytes(scales, WeightDtype::Bf16, rows, k / group),
            biases: Some(Weight::from_le_bytes(biases, WeightDtype::Bf16, rows, k / group)),
        };
        Weight::quantized(Weight::from_le_bytes(words, WeightDtype::F32, rows, k / 8), rows, k, quant)
    }

    fn activations(m: usize, k: usize, seed: usize) -> Vec<f32> {
        (0..m * k).map(|i| (((i + seed) * 7919 % 2001) as f32 - 1000.0) / 777.0).collect()
    }

    /// The order written out from the module doc, one scalar at a time, with plain indices.
    fn scalar(x: &[f32], w: &Weight, n: usize) -> f32 {
        let q = w.quant().unwrap();
        let (k, group) = (w.cols, q.group);
        let groups = k / group;
        let code = |i: usize| -> f32 {
            if i >= k {
                return 0.0;
            }
            let byte = w.bytes()[n * k / 2 + i / 2];
            (((byte >> (4 * (i % 2))) & 15) as f32) + 128.0
        };
        let xb = |i: usize| if i < k { f32::from_bits((to_bf16(x[i]) as u32) << 16) } else { 0.0 };
        let daz =
            |v: f32| if v.abs() < f32::MIN_POSITIVE { f32::from_bits(v.to_bits() & 0x8000_0000) } else { v };
        // SAFETY: group g < groups of row n.
        let read = |t: &Weight, g: usize| {
            if g < groups {
                unsafe { t.dtype.read(t.bytes().as_ptr(), n * groups + g) }
            } else {
                0.0
            }
        };
        let bias_t = q.biases.as_ref().unwrap();
        let mut acc = [0.0f32; LANES];
        for g0 in (0..groups).step_by(GROUPS) {
            for (i, a) in acc.iter_mut().enumerate() {
                let g = g0 + i;
                let c = (-128.0f32).mul_add(read(&q.scales, g), read(bias_t, g));
                let sum = if g < groups {
                    let mut lanes = [0.0f32; LANES];
                    for e in 0..group {
                        lanes[e % LANES] += xb(g * group + e);
                    }
                    mtp_base::logits::lane_tree(lanes)
                } else {
                    0.0
                };
                *a = c.mul_add(sum, *a);
            }
            for v in (g0 * group..((g0 + GROUPS) * group).min(k)).step_by(BLOCK) {
                for (l, a) in acc.iter_mut().enumerate() {
                    let (j, t) = (l / 4, l % 4);
                    let mut d = 0.0f32;
                    for c in 0..4 {
                        let even = v + 32 * j + 16 * (c & 1) + 4 * t + (c >> 1);
                        d = daz(daz(xb(even + 2)).mul_add(code(even + 2), d));
                        d = daz(daz(xb(even)).mul_add(code(even), d));
                    }
                    *a = read(&q.scales, (v + 32 * j) / group).mul_add(d, *a);
                }
            }
        }
        mtp_base::logits::lane_tree(acc)
    }

    /// `tile::<S, 1, 1>` for every output of `m x n`, one output a call.
    fn one_by_one<S: Q4Bf16>(x: &[f32], m: usize, w: &Weight) -> Vec<u32> {
        let (k, q) = (w.cols, QuantCols::of(w));
        let (mut words, mut sums) = (Vec::new(), Vec::new());
        prepare_into(x, m, k, q.group(), &mut words, &mut sums);
        let (kp, gp) = padded(k, q.group());
        let mut out = vec![0.0f32; m * w.rows];
        for r in 0..m {
            for j in 0..w.rows {
                // SAFETY: one prepared row and its sums, weight row j, one output.
                unsafe {
                    tile::<S, 1, 1>(
                        words[r * kp..].as_ptr(),
                        sums[r * gp..].as_ptr(),
                        kp,
                        gp,
                        &q,
                        j,
                        &mut out[r * w.rows + j],
                        0,
                    )
                }
            }
        }
        out.iter().map(|v| v.to_bits()).collect()
    }

    const CASES: [(usize, usize); 7] =
        [(32, 96), (64, 256), (128, 384), (32, 32 * 37), (64, 64 * 21), (128, 128 * 17), (64, 64)];

    /// Every path (the matmul's tiles through `linear_bf16`, and each ISA one output at a
    /// time) computes the order written out, at group sizes 32, 64 and 128, for K of partial
    /// blocks and of several 16-group spans with a partial last one.
    #[test]
    fn paths_compute_the_documented_order() {
        let mut checked = std::collections::BTreeSet::new();
        for (group, k) in CASES {
            let n = 9;
            let w = weight(n, k, group, (group + k) as u64);
            assert!(takes(&w));
            for m in [1, 5] {
                let x = activations(m, k, group);
                let want: Vec<u32> =
                    (0..m * n).map(|i| scalar(&x[i / n * k..][..k], &w, i % n).to_bits()).collect();
                let mut out = vec![0.0f32; m * n];
                crate::ops::linear_bf16(&x, m, &w, None, &mut out);
                let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "matmul, group {group}, k {k}, m {m}");
                assert_eq!(one_by_one::<Portable>(&x, m, &w), want, "portable, group {group}, k {k}");
                #[cfg(target_arch = "x86_64")]
                {
                    use crate::ops::bf16_matmul::{path, Avx2Emulated, Avx512Emulated, Avx512Native, Path};
                    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                        assert_eq!(one_by_one::<Avx2Emulated>(&x, m, &w), want, "avx2, group {group}, k {k}");
                        checked.insert("avx2");
                    }
                    if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
                        assert_eq!(
                            one_by_one::<Avx512Emulated>(&x, m, &w),
                            want,
                            "avx512, group {group}, k {k}"
                        );
                        checked.insert("avx512");
                    }
                    if path() == Path::Native {
                        assert_eq!(
                            one_by_one::<Avx512Native>(&x, m, &w),
                            want,
                            "vdpbf16ps, group {group}, k {k}"
                        );
                        checked.insert("native");
                    }
                }
            }
        }
        eprintln!("4-bit bf16-activation paths checked: {checked:?}");
    }

    /// The order computes the weights' affine function: within bf16 activations' rounding of
    /// the f32 matmul over the dequantized rows. (The bit tests above share the layout with
    /// the code; this one would catch a layout that pairs x with the wrong codes.)
    #[test]
    fn it_computes_the_dequantized_product() {
        for (group, k) in CASES {
            let (m, n) = (3, 7);
            let w = weight(n, k, group, 11 + k as u64);
            let x = activations(m, k, 3);
            let mut out = vec![0.0f32; m * n];
            crate::ops::linear_bf16(&x, m, &w, None, &mut out);
            let mut row = vec![0.0f32; k];
            for j in 0..n {
                w.row_f32(j, &mut row);
                for r in 0..m {
                    let xs = &x[r * k..(r + 1) * k];
                    let want: f64 = xs.iter().zip(&row).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let scale: f64 = xs.iter().zip(&row).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                    let err = (out[r * n + j] as f64 - want).abs();
                    assert!(
                        err <= 1e-2 * scale,
                        "group {group}, k {k}, ({r}, {j}): {} vs {want}",
                        out[r * n + j]
                    );
                }
            }
        }
    }

    /// Negative control: pairing x with the codes in plain K order (the layout undone)
    /// gives another result, far outside the tolerance above.
    #[test]
    fn a_wrong_layout_is_caught() {
        let (group, k, n) = (64, 256, 4);
        let w = weight(n, k, group, 5);
        let x = activations(1, k, 1);
        let mut shuffled = x.clone();
        for b in 0..k / BLOCK {
            for i in 0..BLOCK {
                shuffled[b * BLOCK + offset(i / CHUNK, i % CHUNK)] = x[b * BLOCK + i];
            }
        }
        let (mut good, mut bad) = (vec![0.0f32; n], vec![0.0f32; n]);
        crate::ops::linear_bf16(&x, 1, &w, None, &mut good);
        crate::ops::linear_bf16(&shuffled, 1, &w, None, &mut bad);
        let mut row = vec![0.0f32; k];
        let differs = (0..n).any(|j| {
            w.row_f32(j, &mut row);
            let scale: f32 = x.iter().zip(&row).map(|(a, b)| (a * b).abs()).sum();
            (good[j] - bad[j]).abs() > 1e-2 * scale
        });
        assert!(differs, "a shuffled layout agreed with the right one");
    }
}
