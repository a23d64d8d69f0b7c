//! Integer-quantized linear weights (AWQ GEMM, GPTQ, compressed-tensors `pack-quantized`)
//! imported as MLX affine weights, which every backend already runs.
//!
//! Contract: each format is unpacked to one code `q`, zero `z` and scale `s` per value of
//! the `rows x cols` (out x in) weight, with the reference meaning `w = (q - z) * s`; they
//! are stored as MLX's `scale * q + bias` with `scale = s` and `bias = -(z * s)` in f32,
//! codes repacked low bits first into u32 words along each row. For 16-bit `s` (what every
//! writer stores for a 16-bit model) `z * s` and `s * q` are exact in f32 (at most 11 + 9
//! significant bits: 8-bit codes, zeros up to 256) and so is their sum, which is then
//! `(q - z) * s` exactly: the reference
//! dequantization in f32, bit for bit. A group size that is a multiple of 128, 64 or 32 is
//! stored as groups of that size with the scales repeated (same values); one group a row
//! likewise. Every tensor's shape is checked against the weight's, naming the tensor.

use crate::checkpoint::{Checkpoint, Entry};
use crate::error::{Error, Result};
use crate::quant_config::Declared;
use crate::weights::{Quant, Weight, WeightDtype};
use rayon::prelude::*;
use safetensors::Dtype;

/// Where AWQ's GEMM packing puts output column `j` of 8: nibble `AWQ_NIBBLE[j]` of the word
/// (AutoAWQ packs columns in the order 0, 2, 4, 6, 1, 3, 5, 7).
pub(crate) const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// A weight unpacked: `rows x cols` codes, and per row `groups` zeros and scales.
pub(crate) struct Unpacked {
    pub rows: usize,
    pub cols: usize,
    pub bits: usize,
    /// Values per group in the checkpoint (`cols` for one group a row).
    pub group: usize,
    pub codes: Vec<u8>,
    pub zeros: Vec<u32>,
    pub scales: Vec<f32>,
}

impl Unpacked {
    /// The MLX affine weight computing `(q - z) * s` (see the module's contract).
    pub(crate) fn into_weight(self) -> Weight {
        let Unpacked { rows, cols, bits, group, codes, zeros, scales } = self;
        let mlx_group = mlx_group(group);
        let (groups, mlx_groups, per_word) = (cols / group, cols / mlx_group, 32 / bits);
        let mut packed = vec![0u8; rows * cols * bits / 8];
        packed.par_chunks_mut(cols * bits / 8).zip(codes.par_chunks(cols)).for_each(|(out, row)| {
            for (o, word) in out.chunks_exact_mut(4).zip(row.chunks_exact(per_word)) {
                let w = word.iter().enumerate().fold(0u32, |w, (j, &q)| w | (q as u32) << (j * bits));
                o.copy_from_slice(&w.to_le_bytes());
            }
        });
        let (mut s, mut b) = (Vec::with_capacity(rows * mlx_groups), Vec::with_capacity(rows * mlx_groups));
        for r in 0..rows {
            for j in 0..mlx_groups {
                let g = r * groups + j * mlx_group / group;
                s.push(scales[g]);
                b.push(-(zeros[g] as f32 * scales[g]));
            }
        }
        let quant = Quant {
            bits,
            group: mlx_group,
            scales: Weight::from_f32(s, rows, mlx_groups),
            biases: Some(Weight::from_f32(b, rows, mlx_groups)),
        };
        let words = Weight::from_le_bytes(packed, WeightDtype::F32, rows, cols * bits / 32);
        Weight::quantized(words, rows, cols, quant)
    }
}

/// The MLX group a checkpoint group of `g` values is stored as: the largest of 128, 64 and
/// 32 dividing it, else `g` itself (a multiple of 8, checked by [`check_group`]).
fn mlx_group(g: usize) -> usize {
    [128, 64, 32].into_iter().find(|m| g.is_multiple_of(*m)).unwrap_or(g)
}

/// Refuses a group of `group` values for `stem`'s `cols` inputs unless it divides them in
/// whole groups of whole u32 words that the kernels take (a multiple of 8 values).
fn check_group(d: &Declared, stem: &str, group: usize, cols: usize) -> Result<()> {
    if group == 0 || cols == 0 || !cols.is_multiple_of(group) || !group.is_multiple_of(8) {
        return Err(Error::config(
            &d.path,
            "quantization_config.group_size",
            format!("groups of {group} values do not cut `{stem}`'s {cols} inputs into whole groups of a multiple of 8"),
        ));
    }
    Ok(())
}

impl Checkpoint {
    /// Tensor `name`, checked to have `shape` and one of `dtypes`, recorded as read.
    fn typed(&self, name: &str, shape: &[usize], dtypes: &[Dtype]) -> Result<&Entry> {
        let e = self.entry(name)?;
        if e.shape != shape {
            return Err(Error::TensorShape {
                path: (*e.file).clone(),
                name: name.to_string(),
                got: e.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        if !dtypes.contains(&e.dtype) {
            return Err(Error::Safetensors {
                path: (*e.file).clone(),
                msg: format!("`{name}` has dtype {:?}, expected {dtypes:?}", e.dtype),
            });
        }
        Ok(e)
    }

    /// Packed int32 words of `name` (shape `shape`).
    fn words(&self, name: &str, shape: &[usize]) -> Result<Vec<u32>> {
        let e = self.typed(name, shape, &[Dtype::I32, Dtype::U32])?;
        Ok(e.map[e.range.clone()]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Float tensor `name` (shape `shape`) widened to f32, exactly.
    pub(super) fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let e = self.typed(name, shape, &[Dtype::F16, Dtype::BF16, Dtype::F32])?;
        let d = e.float_dtype(name)?;
        let bytes = &e.map[e.range.clone()];
        let mut out = vec![0.0; bytes.len() / d.size()];
        // SAFETY: `bytes` holds `out.len()` elements of `d`.
        unsafe { d.widen(bytes.as_ptr(), 0, &mut out) };
        Ok(out)
    }

    /// AWQ GEMM `{stem}.qweight` [cols, rows/8], `.qzeros` [groups, rows/8], `.scales`
    /// [groups, rows].
    pub(super) fn awq(
        &self,
        d: &Declared,
        stem: &str,
        rows: usize,
        cols: usize,
        group: usize,
    ) -> Result<Weight> {
        check_group(d, stem, group, cols)?;
        let (groups, wide) = (cols / group, rows / 8);
        if !rows.is_multiple_of(8) {
            return Err(
                self.layout(stem, format!("{rows} outputs are not whole words of 8 (AWQ packs outputs)"))
            );
        }
        let q = self.words(&format!("{stem}.qweight"), &[cols, wide])?;
        let z = self.words(&format!("{stem}.qzeros"), &[groups, wide])?;
        let s = self.floats(&format!("{stem}.scales"), &[groups, rows])?;
        let nib = |w: u32, n: usize| (w >> (4 * AWQ_NIBBLE[n % 8])) & 15;
        let mut u = Unpacked::new(rows, cols, 4, group);
        u.codes = tiled(rows, cols, |n, k| nib(q[k * wide + n / 8], n) as u8);
        for n in 0..rows {
            for g in 0..groups {
                u.zeros.push(nib(z[g * wide + n / 8], n));
                u.scales.push(s[g * rows + n]);
            }
        }
        Ok(u.into_weight())
    }

    /// GPTQ `{stem}.qweight` [cols/pack, rows], `.qzeros` [groups, rows/pack] (each zero
    /// less `zero_offset`), `.scales` [groups, rows], `.g_idx` [cols] when present (it must
    /// name the contiguous groups).
    pub(super) fn gptq(
        &self,
        d: &Declared,
        stem: &str,
        (rows, cols): (usize, usize),
        bits: usize,
        group: Option<usize>,
        zero_offset: u32,
    ) -> Result<Weight> {
        let group = group.unwrap_or(cols);
        check_group(d, stem, group, cols)?;
        let (pack, mask, groups) = (32 / bits, (1u32 << bits) - 1, cols / group);
        if !rows.is_multiple_of(pack) {
            return Err(self
                .layout(stem, format!("{rows} outputs are not whole words of {pack} (its zeros' packing)")));
        }
        let q = self.words(&format!("{stem}.qweight"), &[cols / pack, rows])?;
        let z = self.words(&format!("{stem}.qzeros"), &[groups, rows / pack])?;
        let s = self.floats(&format!("{stem}.scales"), &[groups, rows])?;
        let g_idx = format!("{stem}.g_idx");
        if self.contains(&g_idx) {
            let idx = self.words(&g_idx, &[cols])?;
            if let Some(k) = (0..cols).find(|&k| idx[k] as usize != k / group) {
                return Err(Error::config(
                    &d.path,
                    "quantization_config.desc_act",
                    format!(
                        "`{g_idx}` puts input {k} in group {}, not {}: activation-ordered groups are not supported",
                        idx[k] as i32,
                        k / group
                    ),
                ));
            }
        }
        let mut u = Unpacked::new(rows, cols, bits, group);
        u.codes = tiled(rows, cols, |n, k| ((q[(k / pack) * rows + n] >> (bits * (k % pack))) & mask) as u8);
        for n in 0..rows {
            for g in 0..groups {
                let stored = (z[g * (rows / pack) + n / pack] >> (bits * (n % pack))) & mask;
                u.zeros.push(stored + zero_offset);
                u.scales.push(s[g * rows + n]);
            }
        }
        Ok(u.into_weight())
    }

    /// compressed-tensors `{stem}.weight_packed` [rows, cols/pack], `.weight_shape`,
    /// `.weight_scale` [rows, groups], `.weight_zero_point` [rows/pack, groups] when
    /// asymmetric (codes and zeros stored as signed values plus `2^(bits-1)`).
    pub(super) fn ct_int(
        &self,
        d: &Declared,
        stem: &str,
        (rows, cols): (usize, usize),
        bits: usize,
        group: Option<usize>,
        symmetric: bool,
    ) -> Result<Weight> {
        let group = group.unwrap_or(cols);
        check_group(d, stem, group, cols)?;
        let (pack, mask, groups) = (32 / bits, (1u32 << bits) - 1, cols / group);
        let shape_name = format!("{stem}.weight_shape");
        let e = self.typed(&shape_name, &[2], &[Dtype::I64, Dtype::I32])?;
        let b = &e.map[e.range.clone()];
        let shape: Vec<i64> = match e.dtype {
            Dtype::I64 => {
                b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
            }
            _ => {
                b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64).collect()
            }
        };
        if shape != [rows as i64, cols as i64] {
            return Err(self.layout(
                stem,
                format!("`{shape_name}` says {shape:?}, the model's weight is [{rows}, {cols}]"),
            ));
        }
        let wide = cols / pack;
        let q = self.words(&format!("{stem}.weight_packed"), &[rows, wide])?;
        let s = self.floats(&format!("{stem}.weight_scale"), &[rows, groups])?;
        let z = match symmetric {
            true => None,
            false => Some(self.words(&format!("{stem}.weight_zero_point"), &[rows.div_ceil(pack), groups])?),
        };
        let mut u = Unpacked::new(rows, cols, bits, group);
        for n in 0..rows {
            for k in 0..cols {
                u.codes.push(((q[n * wide + k / pack] >> (bits * (k % pack))) & mask) as u8);
            }
            for g in 0..groups {
                u.zeros.push(match &z {
                    Some(z) => (z[(n / pack) * groups + g] >> (bits * (n % pack))) & mask,
                    None => 1 << (bits - 1),
                });
                u.scales.push(s[n * groups + g]);
            }
        }
        Ok(u.into_weight())
    }

    /// An error naming `{stem}.weight`'s layout.
    fn layout(&self, stem: &str, msg: String) -> Error {
        Error::Safetensors { path: self.dir.clone(), msg: format!("`{stem}`: {msg}") }
    }
}

/// The `rows x cols` codes `code(n, k)`, filled in square tiles (the transposing formats
/// read their words down columns).
fn tiled(rows: usize, cols: usize, code: impl Fn(usize, usize) -> u8 + Sync) -> Vec<u8> {
    const T: usize = 64;
    let mut out = vec![0u8; rows * cols];
    // Each task fills T whole rows (in tiles of T columns).
    out.par_chunks_mut(T * cols).enumerate().for_each(|(t, band)| {
        let n0 = t * T;
        for k0 in (0..cols).step_by(T) {
            for (i, row) in band.chunks_exact_mut(cols).enumerate() {
                let end = (k0 + T).min(cols);
                for (k, v) in row[k0..end].iter_mut().enumerate() {
                    *v = code(n0 + i, k0 + k);
                }
            }
        }
    });
    out
}

impl Unpacked {
    fn new(rows: usize, cols: usize, bits: usize, group: usize) -> Unpacked {
        let groups = rows * (cols / group);
        Unpacked {
            rows,
            cols,
            bits,
            group,
            codes: Vec::with_capacity(rows * cols),
            zeros: Vec::with_capacity(groups),
            scales: Vec::with_capacity(groups),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group of 256 stored as MLX groups of 128, one group a row (384 = 3 x 128), a group
    /// of 16 kept, 8-bit codes: each value is `(q - z) * s` exactly, for f16 scales and
    /// zeros up to `2^bits` (GPTQ v1's largest stored zero plus one).
    #[test]
    fn groups_map_onto_mlx_groups_exactly() {
        let mut seed = 12345u64;
        let mut next = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let cases =
            [(4, 512, 256, 128), (4, 384, 384, 128), (4, 48, 16, 16), (4, 96, 96, 32), (8, 256, 64, 64)];
        for (bits, cols, group, mlx) in cases {
            let (rows, groups, levels) = (3, cols / group, 1u64 << bits);
            let mut u = Unpacked::new(rows, cols, bits, group);
            u.codes = (0..rows * cols).map(|_| next(levels) as u8).collect();
            u.zeros = (0..rows * groups).map(|_| next(levels + 1) as u32).collect();
            u.scales = (0..rows * groups)
                .map(|_| half::f16::from_bits(0x2000 + next(0x3000) as u16).to_f32())
                .collect();
            let (codes, zeros, scales) = (u.codes.clone(), u.zeros.clone(), u.scales.clone());
            let w = u.into_weight();
            assert_eq!(w.quant().map(|q| q.group), Some(mlx));
            let got = w.to_f32();
            for r in 0..rows {
                for k in 0..cols {
                    let g = r * groups + k / group;
                    let want = ((codes[r * cols + k] as f64 - zeros[g] as f64) * scales[g] as f64) as f32;
                    assert_eq!(
                        got[r * cols + k].to_bits(),
                        want.to_bits(),
                        "cols {cols} group {group}: ({r}, {k})"
                    );
                }
            }
        }
    }
}
