//! Dequantization of MLX-quantized rows: affine `scale * q + bias` per value, in f32, a
//! multiply then an add (never fused), so every ISA path gives the same bits; mxfp4
//! `scale * e2m1(q)` (exact: the scale is a power of two).

use crate::isa::isa;
#[cfg(target_arch = "x86_64")]
use crate::isa::Isa;
use crate::weights::{Quant, E2M1};

/// Dequantizes one row: `packed` holds its `out.len() * bits / 8` bytes, `scales` and
/// `biases` its groups' (in `dtype`).
pub fn dequantize_row(q: &Quant, packed: &[u8], group_index: usize, out: &mut [f32]) {
    let groups = out.len() / q.group;
    let sb = q.scales.bytes();
    let d = q.scales.dtype;
    let Some(biases) = &q.biases else {
        // mxfp4: a power-of-two scale times an FP4 value (exact).
        for (g, o) in out.chunks_exact_mut(q.group).enumerate() {
            // SAFETY: scales hold rows x groups elements of their dtype.
            let scale = unsafe { d.read(sb.as_ptr(), group_index + g) };
            let words = &packed[g * q.group / 2..(g + 1) * q.group / 2];
            for (o, w) in o.chunks_exact_mut(8).zip(words.chunks_exact(4)) {
                let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                for (j, v) in o.iter_mut().enumerate() {
                    *v = scale * E2M1[((w >> (4 * j)) & 15) as usize];
                }
            }
        }
        return;
    };
    let bb = biases.bytes();
    // SAFETY: scales and biases hold rows x groups elements of their dtype; the row's
    // groups start at `group_index`.
    let sb = |g: usize| unsafe {
        (d.read(sb.as_ptr(), group_index + g), biases.dtype.read(bb.as_ptr(), group_index + g))
    };
    let scales: Vec<(f32, f32)> = (0..groups).map(sb).collect();
    match (q.bits, isa()) {
        #[cfg(target_arch = "x86_64")]
        (4, Isa::Avx512 | Isa::Avx2) => unsafe { dequant_avx2::<4>(packed, q.group, &scales, out) },
        #[cfg(target_arch = "x86_64")]
        (8, Isa::Avx512 | Isa::Avx2) => unsafe { dequant_avx2::<8>(packed, q.group, &scales, out) },
        #[cfg(target_arch = "x86_64")]
        (2, Isa::Avx512 | Isa::Avx2) => unsafe { dequant_avx2::<2>(packed, q.group, &scales, out) },
        (4, _) => dequant::<4>(packed, q.group, &scales, out),
        (8, _) => dequant::<8>(packed, q.group, &scales, out),
        _ => dequant::<2>(packed, q.group, &scales, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dequant_avx2<const BITS: usize>(
    packed: &[u8],
    group: usize,
    scales: &[(f32, f32)],
    out: &mut [f32],
) {
    dequant::<BITS>(packed, group, scales, out)
}

/// Fixed-width words of `32 / BITS` values: the inner loop has a constant length, which
/// the compiler turns into vector shifts, masks, conversions, multiplies and adds.
#[inline(always)]
fn dequant<const BITS: usize>(packed: &[u8], group: usize, scales: &[(f32, f32)], out: &mut [f32]) {
    let mask = (1u32 << BITS) - 1;
    let per_word = 32 / BITS;
    let group_bytes = group * BITS / 8;
    for ((o, words), &(scale, bias)) in
        out.chunks_exact_mut(group).zip(packed.chunks_exact(group_bytes)).zip(scales)
    {
        for (o, w) in o.chunks_exact_mut(per_word).zip(words.chunks_exact(4)) {
            let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            for (j, v) in o.iter_mut().enumerate() {
                *v = scale * ((w >> (j * BITS)) & mask) as f32 + bias;
            }
        }
    }
}
