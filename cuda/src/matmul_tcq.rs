//! MLX-quantized weights on the tensor cores in bf16 mode (`matmul_tcq.cuh`): which weights
//! take them, their group words and codes repacked at upload, and the launch over 1 to 3
//! weights of one K, bits and group size (`prep_q_acts`, then `linear_tcq`).

use cudarc::driver::CudaSlice;
use mtp_base::error::Result;
use mtp_base::weights::{Weight, WeightDtype};
use mtp_kernels::Out;

use crate::matmul::{CudaMat, LINEAR_TC_COLS_PER_BLOCK, LINEAR_THREADS};
use crate::{ptr, Cuda};

/// Whether a quantized weight takes the tensor-core matmul in bf16 mode (`linear_tcq`):
/// affine 4- or 8-bit codes in groups of 32, 64 or 128 with bf16 scales and biases (what
/// `mlx_lm.convert -q` writes for a bf16 model), K a multiple of 32. Decided by the weight
/// alone, so every M takes the same path.
pub(crate) fn quant_tensor_cores(w: &Weight) -> bool {
    w.quant().is_some_and(|q| {
        matches!(q.bits, 4 | 8)
            && matches!(q.group, 32 | 64 | 128)
            && q.scales.dtype == WeightDtype::Bf16
            && q.biases.as_ref().is_some_and(|b| b.dtype == WeightDtype::Bf16)
            && w.cols.is_multiple_of(32)
    })
}

/// A quantized weight's group words for `linear_tcq`: per (row, group) the scale's bf16
/// bits low and the bias's high.
pub(crate) fn group_words(q: &mtp_base::weights::Quant) -> Vec<u32> {
    let half =
        |b: &[u8]| -> Vec<u16> { b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect() };
    let scales = half(q.scales.bytes());
    let biases = q.biases.as_ref().map(|b| half(b.bytes())).unwrap_or_default();
    scales.iter().zip(&biases).map(|(&s, &b)| s as u32 | (b as u32) << 16).collect()
}

/// A quantized weight's codes in `linear_tcq`'s order (matmul_tcq.cuh): in each row's chunk of
/// 128 values (its `used` blocks of 32, `bits` words a block, lane t's `bits / 4` of them at
/// `t * bits / 4`), lane t's words of the chunk together, so a lane loads a whole chunk's
/// codes at once. The embedding's `embed_tcq` reads the same order.
pub(crate) fn repack_codes(packed: &[u8], cols: usize, bits: usize) -> Vec<u8> {
    let (row_bytes, blocks, lane_words) = (cols * bits / 8, cols / 32, bits / 4);
    let mut out = vec![0u8; packed.len()];
    for (src, dst) in packed.chunks_exact(row_bytes).zip(out.chunks_exact_mut(row_bytes)) {
        for chunk in 0..blocks.div_ceil(4) {
            let used = (blocks - 4 * chunk).min(4);
            let base = chunk * 4 * bits;
            for u in 0..used {
                for t in 0..4 {
                    for v in 0..lane_words {
                        let from = 4 * (base + u * bits + t * lane_words + v);
                        let to = 4 * (base + t * used * lane_words + u * lane_words + v);
                        dst[to..to + 4].copy_from_slice(&src[from..from + 4]);
                    }
                }
            }
        }
    }
    out
}

/// Whether 1 to 3 weights take one `linear_tcq` launch: each on the quantized tensor-core
/// path, none empty, one K, bits and group size.
pub(crate) fn tcq_stackable(parts: &[(&CudaMat, Option<&CudaSlice<f32>>)]) -> bool {
    let key = |w: &CudaMat| {
        w.quant.as_ref().filter(|q| q.tensor_cores.is_some()).map(|q| (w.cols, q.bits, q.group))
    };
    let first = parts.first().and_then(|(w, _)| key(w));
    (1..=3).contains(&parts.len())
        && first.is_some()
        && parts.iter().all(|(w, _)| w.rows > 0 && key(w) == first)
}

/// `TcqParts` in matmul_tcq.cuh: up to 3 quantized weights of one bits and group size in one
/// `linear_tcq` launch.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TcqParts {
    q: [u64; 3],
    group_words: [u64; 3],
    bias: [u64; 3],
    out: [u64; 3],
    n: [i32; 3],
    first_block: [i32; 3],
    parts: i32,
}

// SAFETY: plain old data laid out as the kernel's struct (repr(C), the same field types).
unsafe impl cudarc::driver::DeviceRepr for TcqParts {}

impl Cuda {
    /// `outs[i]` (+)= `x` (M rows) times `parts[i]`'s transpose, for 1 to 3 quantized weights
    /// of one K, bits and group size on the tensor-core path ([`tcq_stackable`]): the
    /// activations made once (`prep_q_acts`: bf16 pairs and group sums), then one launch.
    pub(crate) fn linear_tcq(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        parts: &[(&CudaMat, Option<&CudaSlice<f32>>)],
        outs: &mut [&mut CudaSlice<f32>],
        mode: Out,
    ) -> Result<()> {
        // Its callers take this path only for parts `tcq_stackable` accepts.
        debug_assert!(tcq_stackable(parts) && parts.len() == outs.len());
        let Some((q, k)) = parts.first().and_then(|(w, _)| Some((w.quant.as_ref()?, w.cols))) else {
            return Ok(());
        };
        if m == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let groups = k / q.group;
        // The bf16 pairs (m k / 2 words, as m k bf16) and group sums: pooled scratch, which
        // prep_q_acts writes whole before the matmul reads it.
        let xb = self.scratch_u16(m * k, m, "quantized matmul activations")?;
        let xs = self.scratch_f32(m * groups, m, "quantized matmul activations")?;
        let (xp, xbp, xsp) = (ptr(x, s), ptr(&xb, s), ptr(&xs, s));
        let (mi, ki, gi) = (m as i32, k as i32, q.group as i32);
        // A warp per token and 256 values of K.
        let prep_blocks = (m * k.div_ceil(256)).div_ceil(4).clamp(1, 4096) as u32;
        launch!(
            self,
            &self.f.prep_q_acts,
            (prep_blocks, 1),
            128,
            "quantized matmul activations",
            [xp, mi, ki, gi, xbp, xsp]
        )?;
        let mut p = TcqParts { parts: parts.len() as i32, ..TcqParts::default() };
        let mut blocks = 0;
        for (i, ((w, bias), out)) in parts.iter().zip(outs.iter()).enumerate() {
            let words = w.quant.as_ref().and_then(|q| q.tensor_cores.as_ref());
            p.q[i] = ptr(&w.buf, s);
            p.group_words[i] = words.map_or(0, |g| ptr(g, s));
            p.bias[i] = bias.map_or(0, |b| ptr(b, s));
            p.out[i] = ptr(&**out, s);
            p.n[i] = w.rows as i32;
            p.first_block[i] = blocks as i32;
            blocks += w.rows.div_ceil(LINEAR_TC_COLS_PER_BLOCK);
        }
        // Tokens per pass over the weights: 8, 16, 32, 64 (the same bits for each).
        let pass = match m {
            0..=8 => 0,
            9..=16 => 1,
            17..=32 => 2,
            _ => 3,
        };
        let f = &self.f.linear_tcq[(q.bits == 8) as usize][pass];
        let acc = (mode == Out::Add) as i32;
        launch!(self, f, (blocks as u32, 1), LINEAR_THREADS, "linear", [xbp, xsp, mi, ki, gi, p, acc])
    }
}

#[cfg(test)]
mod tests {
    use super::repack_codes;

    /// Every MLX word lands once, and where `linear_tcq`'s lane t reads block u of a chunk
    /// (its words together: whole chunks, and the partial last chunk of K = 96 and 160).
    #[test]
    fn repacked_codes_are_where_each_lane_reads_them() {
        for bits in [4, 8] {
            for cols in [96, 128, 160, 4096] {
                let (rows, words, lane_words) = (3, cols * bits / 32, bits / 4);
                let mlx: Vec<u8> = (0..(rows * words) as u32).flat_map(|i| i.to_le_bytes()).collect();
                let out: Vec<u32> = repack_codes(&mlx, cols, bits)
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let mut seen = out.clone();
                seen.sort_unstable();
                assert!(
                    seen.iter().copied().eq(0..(rows * words) as u32),
                    "{bits}-bit, K = {cols}: not a permutation"
                );
                for row in 0..rows {
                    for kc in (0..cols).step_by(128) {
                        let used = ((cols - kc) / 32).min(4);
                        for t in 0..4 {
                            let lane = row * words + kc / 32 * bits + t * used * lane_words;
                            for u in 0..used {
                                for v in 0..lane_words {
                                    let mlx_word = row * words + (kc / 32 + u) * bits + t * lane_words + v;
                                    assert_eq!(
                                        out[lane + u * lane_words + v],
                                        mlx_word as u32,
                                        "{bits}-bit, K = {cols}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
