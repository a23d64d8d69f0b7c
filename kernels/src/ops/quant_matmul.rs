//! The fused matmul of MLX affine-quantized weights (4 or 8 bits, groups of a multiple of
//! 32): the packed values are unpacked in registers, never copied out dequantized.
//!
//! The quantized order, per output (x a row, one weight row of groups `g` with `scale_g`,
//! `bias_g` and integers `q`):
//! - lane `l` (0..16) accumulates, for each 32-value chunk in increasing K, `x[2l] *
//!   (scale_g * q[2l])` then `x[2l + 1] * (scale_g * q[2l + 1])` with fused multiply-add
//!   (the bf16 pair order of [`super::simd`]; `scale_g * q` is one rounded product, exact
//!   for bf16 and f16 scales);
//! - `b` accumulates `bias_g * xsum_g` over the groups in order, one fused multiply-add each,
//!   where `xsum_g` is the sum of the group's x: lane `l` adds `x[2l]` then `x[2l + 1]` for
//!   each chunk of the group, and the canonical lane tree ends it;
//! - the result is the lane tree of the lanes, plus `b`.
//!
//! It depends only on K and the group size, never on M or the threads, and every ISA path
//! computes the same bits (`tests` below, and `tests/quantized.rs` for M-invariance with its
//! stock-matmul negative control). Mathematically it is `sum_g scale_g * dot(x_g, q_g) +
//! bias_g * sum(x_g)`, the weights' affine form, with the scale multiplied into each value.

use super::simd::{pair_step, split_pairs_into, Simd16, LANES, PAIR_CHUNK};
use mtp_base::weights::{Quant, Weight, WeightDtype};

/// Whether `q` takes the fused kernel: affine (with biases) at 4 or 8 bits, in groups of
/// whole 32-value chunks. Others (2 bits, mxfp4, groups of 8 or 16) dequantize rows first.
pub fn fused(q: &Quant) -> bool {
    q.biases.is_some() && matches!(q.bits, 4 | 8) && q.group.is_multiple_of(PAIR_CHUNK)
}

/// `x` (`m` rows of `k`) prepared for [`tile_quant`] into `out`: the rows pair-split as for
/// bf16 weights (`m x k`), then every row's group sums (`m x k / group`).
pub fn prepare_into(x: &[f32], m: usize, k: usize, group: usize, out: &mut Vec<f32>) {
    split_pairs_into(x, m, k, out);
    for g in 0..m * k / group {
        let sum = group_sum(&out[g * group..(g + 1) * group]);
        out.push(sum);
    }
}

/// `xsum_g` of one pair-split group: lane `l` adds `x[2l]` then `x[2l + 1]` per chunk.
fn group_sum(g: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    for c in g.chunks_exact(PAIR_CHUNK) {
        for (l, s) in lanes.iter_mut().enumerate() {
            *s = *s + c[l] + c[LANES + l];
        }
    }
    mtp_base::logits::lane_tree(lanes)
}

/// A quantized weight's columns, as raw pointers for the tiles.
#[derive(Clone, Copy)]
pub struct QuantCols {
    packed: *const u8,
    row_bytes: usize,
    bits: usize,
    group: usize,
    groups: usize,
    scales: *const u8,
    scale_dtype: WeightDtype,
    biases: *const u8,
    bias_dtype: WeightDtype,
}

// SAFETY: read-only pointers into a `Weight` the caller keeps alive for the matmul.
unsafe impl Send for QuantCols {}
unsafe impl Sync for QuantCols {}

impl QuantCols {
    /// `w`'s pointers; `w` must be quantized with [`fused`] true.
    pub fn of(w: &Weight) -> QuantCols {
        let q = w.quant().expect("a quantized weight");
        let biases = q.biases.as_ref().expect("affine quantization");
        QuantCols {
            packed: w.bytes().as_ptr(),
            row_bytes: w.cols * q.bits / 8,
            bits: q.bits,
            group: q.group,
            groups: w.cols / q.group,
            scales: q.scales.bytes().as_ptr(),
            scale_dtype: q.scales.dtype,
            biases: biases.bytes().as_ptr(),
            bias_dtype: biases.dtype,
        }
    }

    pub fn bits(&self) -> usize {
        self.bits
    }

    pub fn groups(&self) -> usize {
        self.groups
    }

    pub fn group(&self) -> usize {
        self.group
    }

    /// The packed codes: `row_bytes` a row.
    pub fn packed(&self) -> *const u8 {
        self.packed
    }

    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The scales (`groups` a row) in their dtype.
    pub fn scales(&self) -> *const u8 {
        self.scales
    }

    /// The biases (`groups` a row) in their dtype.
    pub fn biases(&self) -> *const u8 {
        self.biases
    }
}

/// Groups whose scales and biases a tile widens to f32 at a time: one dtype match per block,
/// not one per group and row.
const GROUP_BLOCK: usize = 16;

/// An `MR x NR` block in the quantized order: rows of pair-split `x` (their group sums at
/// `xsum`, `groups` a row) against weight rows `n .. n + NR`, into `out[r*ldo + j]`.
///
/// # Safety
/// `x` must hold `MR` rows of `k`, `xsum` `MR` rows of `q.groups`, the weight rows
/// `n .. n + NR` must exist, and `out` be writable at every `r*ldo + j`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub unsafe fn tile_quant<S: Simd16, const MR: usize, const NR: usize, const BITS: usize>(
    x: *const f32,
    xsum: *const f32,
    k: usize,
    q: &QuantCols,
    n: usize,
    out: *mut f32,
    ldo: usize,
) {
    let mut acc = [[S::zero(); NR]; MR];
    let mut bsum = [[0.0f32; NR]; MR];
    let chunk_bytes = PAIR_CHUNK * BITS / 8;
    // A block of groups' scales and biases, widened to f32 (`NR x GROUP_BLOCK` each).
    let mut scales = [[0.0f32; GROUP_BLOCK]; NR];
    let mut biases = [[0.0f32; GROUP_BLOCK]; NR];
    let mut g0 = 0;
    while g0 < q.groups {
        let block = GROUP_BLOCK.min(q.groups - g0);
        for j in 0..NR {
            let at = (n + j) * q.groups + g0;
            q.scale_dtype.widen(q.scales, at, &mut scales[j][..block]);
            q.bias_dtype.widen(q.biases, at, &mut biases[j][..block]);
        }
        for b in 0..block {
            let g = g0 + b;
            // 4-bit: the group's `scale * q` table (or the scale, per path); 8-bit: the scale.
            let mut scale = [S::zero(); NR];
            for j in 0..NR {
                scale[j] = if BITS == 4 { S::q4_table(scales[j][b]) } else { S::splat(scales[j][b]) };
            }
            let mut i = g * q.group;
            while i < (g + 1) * q.group {
                let mut even = [S::zero(); NR];
                let mut odd = [S::zero(); NR];
                for j in 0..NR {
                    let p = q.packed.add((n + j) * q.row_bytes + i / PAIR_CHUNK * chunk_bytes);
                    if NR > 1 {
                        S::prefetch(p.wrapping_add(NR * q.row_bytes));
                    }
                    (even[j], odd[j]) = if BITS == 4 {
                        S::load_q4_scaled(p, scale[j])
                    } else {
                        let (e, o) = S::load_q8_pairs(p);
                        (S::mul(scale[j], e), S::mul(scale[j], o))
                    };
                }
                pair_step::<S, MR, NR>(&mut acc, x, k, i, &even, &odd);
                i += PAIR_CHUNK;
            }
            for (r, row) in bsum.iter_mut().enumerate() {
                let s = *xsum.add(r * q.groups + g);
                for (j, sum) in row.iter_mut().enumerate() {
                    *sum = biases[j][b].mul_add(s, *sum);
                }
            }
        }
        g0 += block;
    }
    for r in 0..MR {
        for j in 0..NR {
            *out.add(r * ldo + j) = S::reduce(acc[r][j]) + bsum[r][j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::simd::Portable;

    /// A quantized `rows x k` weight with `bits`, `group` and bf16 scales and biases.
    fn weight(rows: usize, k: usize, bits: usize, group: usize, seed: u64) -> Weight {
        weight_with(rows, k, bits, group, seed, WeightDtype::Bf16)
    }

    /// A quantized `rows x k` weight whose scales and biases are stored as `dtype`.
    fn weight_with(
        rows: usize,
        k: usize,
        bits: usize,
        group: usize,
        seed: u64,
        dtype: WeightDtype,
    ) -> Weight {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let words: Vec<u8> = (0..rows * k * bits / 32).flat_map(|_| next().to_le_bytes()).collect();
        let groups = rows * k / group;
        let store = |v: f32| match dtype {
            WeightDtype::F32 => v.to_le_bytes().to_vec(),
            WeightDtype::Bf16 => ((v.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
            WeightDtype::F16 => half::f16::from_f32(v).to_bits().to_le_bytes().to_vec(),
        };
        let scales: Vec<u8> =
            (0..groups).flat_map(|_| store((next() % 1000) as f32 / 40000.0 + 1e-3)).collect();
        let biases: Vec<u8> = (0..groups).flat_map(|_| store(-((next() % 1000) as f32) / 5000.0)).collect();
        let quant = Quant {
            bits,
            group,
            scales: Weight::from_le_bytes(scales, dtype, rows, k / group),
            biases: Some(Weight::from_le_bytes(biases, dtype, rows, k / group)),
        };
        Weight::quantized(Weight::from_le_bytes(words, WeightDtype::F32, rows, k * bits / 32), rows, k, quant)
    }

    /// The quantized order written out one scalar at a time.
    fn scalar(x: &[f32], w: &Weight, n: usize) -> f32 {
        let q = w.quant().unwrap();
        let mut row = vec![0.0f32; w.cols];
        // Integers: dequantize with scale 1, bias 0 by reading the packed bits directly.
        let bytes = &w.bytes()[n * w.cols * q.bits / 8..];
        for (i, v) in row.iter_mut().enumerate() {
            let bit = i * q.bits;
            *v = ((bytes[bit / 8] >> (bit % 8)) as u32 & ((1 << q.bits) - 1)) as f32;
        }
        let groups = w.cols / q.group;
        let (mut lanes, mut b) = ([0.0f32; LANES], 0.0f32);
        for g in 0..groups {
            let read = |t: &Weight| unsafe { t.dtype.read(t.bytes().as_ptr(), n * groups + g) };
            let (scale, bias) = (read(&q.scales), read(q.biases.as_ref().unwrap()));
            let mut xs = [0.0f32; LANES];
            for c in (g * q.group..(g + 1) * q.group).step_by(PAIR_CHUNK) {
                for l in 0..LANES {
                    lanes[l] = x[c + 2 * l].mul_add(scale * row[c + 2 * l], lanes[l]);
                    lanes[l] = x[c + 2 * l + 1].mul_add(scale * row[c + 2 * l + 1], lanes[l]);
                    xs[l] = xs[l] + x[c + 2 * l] + x[c + 2 * l + 1];
                }
            }
            b = bias.mul_add(mtp_base::logits::lane_tree(xs), b);
        }
        mtp_base::logits::lane_tree(lanes) + b
    }

    /// `tile_quant` on one ISA for every output of `m x n`, one output a call.
    fn one_by_one<S: Simd16>(x: &[f32], m: usize, k: usize, w: &Weight) -> Vec<f32> {
        let q = w.quant().unwrap();
        let mut prepared = Vec::new();
        prepare_into(x, m, k, q.group, &mut prepared);
        let (split, sums) = prepared.split_at(m * k);
        let cols = QuantCols::of(w);
        let mut out = vec![0.0f32; m * w.rows];
        for r in 0..m {
            for j in 0..w.rows {
                let (xp, sp, op) =
                    (split[r * k..].as_ptr(), sums[r * cols.groups()..].as_ptr(), &mut out[r * w.rows + j]);
                // SAFETY: one row of x and its sums, weight row j, one output.
                unsafe {
                    if q.bits == 4 {
                        tile_quant::<S, 1, 1, 4>(xp, sp, k, &cols, j, op, 0)
                    } else {
                        tile_quant::<S, 1, 1, 8>(xp, sp, k, &cols, j, op, 0)
                    }
                }
            }
        }
        out
    }

    /// Every ISA path computes the scalar model's bits, at 4 and 8 bits, through the matmul's
    /// tiles (several rows and columns, and their edges) and one output at a time; rows of
    /// more groups than a tile widens at once (`GROUP_BLOCK`), and f16 and f32 scales.
    #[test]
    fn paths_compute_the_documented_order() {
        let cases = [
            (4, 64, 256, WeightDtype::Bf16),
            (4, 32, 96, WeightDtype::Bf16),
            (8, 64, 192, WeightDtype::Bf16),
            (4, 128, 384, WeightDtype::Bf16),
            (8, 32, 64, WeightDtype::Bf16),
            (4, 32, 32 * (2 * GROUP_BLOCK + 5), WeightDtype::Bf16),
            (8, 32, 32 * (GROUP_BLOCK + 3), WeightDtype::F16),
            (4, 64, 64 * (GROUP_BLOCK + 1), WeightDtype::F32),
            (4, 64, 64 * GROUP_BLOCK, WeightDtype::F16),
        ];
        for (bits, group, k, dtype) in cases {
            let n = 9;
            let w = weight_with(n, k, bits, group, bits as u64 * 7 + k as u64, dtype);
            for m in [1, 5] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 777.0).collect();
                let want: Vec<u32> =
                    (0..m * n).map(|i| scalar(&x[i / n * k..][..k], &w, i % n).to_bits()).collect();
                let bits_of = |v: Vec<f32>| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let mut out = vec![0.0f32; m * n];
                crate::ops::linear(&x, m, &w, None, &mut out);
                assert_eq!(bits_of(out), want, "matmul, {bits} bits, group {group}, k {k}, {dtype:?}, m {m}");
                assert_eq!(bits_of(one_by_one::<Portable>(&x, m, k, &w)), want, "portable, {bits} bits");
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    let avx2 = one_by_one::<crate::ops::simd::Avx2>(&x, m, k, &w);
                    assert_eq!(bits_of(avx2), want, "avx2, {bits} bits");
                }
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx512f") {
                    let avx512 = one_by_one::<crate::ops::simd::Avx512>(&x, m, k, &w);
                    assert_eq!(bits_of(avx512), want, "avx512, {bits} bits");
                }
            }
        }
    }

    /// Negative control: the dequantize-then-dot order gives other bits on the same data,
    /// so the test above can tell the orders apart.
    #[test]
    fn the_dequantized_order_differs() {
        let (k, n) = (256, 8);
        let w = weight(n, k, 4, 64, 3);
        let x: Vec<f32> = (0..k).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 777.0).collect();
        let differs = (0..n).any(|j| {
            let mut row = vec![0.0f32; k];
            w.row_f32(j, &mut row);
            crate::ops::simd::dot_f32(&x, &row).to_bits() != scalar(&x, &w, j).to_bits()
        });
        assert!(differs, "the two orders agreed on every output");
    }
}
