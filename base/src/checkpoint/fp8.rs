//! FP8 E4M3 weights (Qwen/DeepSeek `weight_scale_inv` blocks, compressed-tensors
//! `float-quantized` scales per tensor, channel or block), dequantized at load into the
//! config's 16-bit dtype (bf16 unless it says f16; f32 when it says f32).
//!
//! Contract: `w[r][c] = dense(f32(fp8) * f32(scale[r / rows_per_block][c / cols_per_block]))`:
//! the E4M3 value exactly in f32 ([`e4m3`]), one f32 multiply, one round to nearest even
//! into the dense dtype, which is transformers' dequantization (`q.to(float32) * s`, then
//! `.to(dtype)`) bit for bit. Blocks at the right and bottom edges may be partial (the
//! scale grid is the ceiling division of the shape). Every backend then runs the weight
//! through its 16-bit path; the GPU holds twice the file's bytes until FP8 kernels exist.

use rayon::prelude::*;
use safetensors::Dtype;

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::quant_config::{Declared, Fp8Strategy};
use crate::weights::{Weight, WeightDtype};

/// The E4M3 (`float8_e4m3fn`) value of byte `b`, exactly: sign bit 7, 4 exponent bits of
/// bias 7, 3 mantissa bits; exponent 0 is subnormal (`m / 8 * 2^-6`); `0x7f` and `0xff`
/// are NaN, and there are no infinities (`0x7e` is 448).
pub fn e4m3(b: u8) -> f32 {
    let (e, m) = ((b >> 3) & 15, (b & 7) as f32);
    let v = match e {
        15 if b & 7 == 7 => f32::NAN,
        0 => m * (1.0 / 512.0),
        e => (8.0 + m) * 2f32.powi(e as i32 - 10),
    };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

impl Checkpoint {
    /// `{stem}.weight` (E4M3, `rows x cols`) times its scales `{stem}.{scale}`, each
    /// covering a `block` of rows and columns, dequantized into `d.dense`.
    fn fp8_blocks(
        &self,
        d: &Declared,
        stem: &str,
        (rows, cols): (usize, usize),
        scale: &str,
        block: [usize; 2],
    ) -> Result<Weight> {
        if rows == 0 || cols == 0 {
            return Err(self.fp8_empty(stem, rows, cols));
        }
        let [bm, bn] = block;
        let (grid_r, grid_c) = (rows.div_ceil(bm), cols.div_ceil(bn));
        let scale_name = format!("{stem}.{scale}");
        let s = self.fp8_scales(&scale_name, grid_r, grid_c)?;
        let name = format!("{stem}.weight");
        let e = self.entry(&name)?;
        if e.shape != [rows, cols] {
            return Err(Error::TensorShape {
                path: (*e.file).clone(),
                name,
                got: e.shape.clone(),
                expected: vec![rows, cols],
            });
        }
        if e.dtype != Dtype::F8_E4M3 {
            return Err(Error::Safetensors {
                path: (*e.file).clone(),
                msg: format!(
                    "`{name}` has dtype {:?}; `{}` declares F8_E4M3 weights beside `{scale_name}`",
                    e.dtype,
                    d.path.display()
                ),
            });
        }
        let table: Vec<f32> = (0..=255u8).map(e4m3).collect();
        let codes = &e.map[e.range.clone()];
        let dense = d.dense;
        let size = dense.size();
        let mut out = vec![0u8; rows * cols * size];
        out.par_chunks_mut(cols * size).zip(codes.par_chunks(cols)).enumerate().for_each(
            |(r, (out, row))| {
                let srow = &s[(r / bm) * grid_c..][..grid_c];
                for ((c, &q), o) in row.iter().enumerate().zip(out.chunks_exact_mut(size)) {
                    let w = table[q as usize] * srow[c / bn];
                    match dense {
                        WeightDtype::Bf16 => {
                            o.copy_from_slice(&half::bf16::from_f32(w).to_bits().to_le_bytes())
                        }
                        WeightDtype::F16 => {
                            o.copy_from_slice(&half::f16::from_f32(w).to_bits().to_le_bytes())
                        }
                        WeightDtype::F32 => o.copy_from_slice(&w.to_le_bytes()),
                    }
                }
            },
        );
        Ok(Weight::from_le_bytes(out, dense, rows, cols))
    }

    /// A `grid_r x grid_c` scale tensor, stored 2-D (or, for one row or one scale, 1-D or
    /// 0-D), widened to f32.
    fn fp8_scales(&self, name: &str, grid_r: usize, grid_c: usize) -> Result<Vec<f32>> {
        let stored = self.shape(name).map(<[usize]>::to_vec).unwrap_or_default();
        let flat: Option<usize> = stored.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let fits = stored == [grid_r, grid_c]
            || (grid_c == 1 && stored == [grid_r])
            || (grid_r == 1 && grid_c == 1 && flat == Some(1) && stored.len() <= 2);
        if !self.contains(name) || fits {
            return self.floats(name, &stored);
        }
        let e = self.entry(name)?;
        Err(Error::TensorShape {
            path: (*e.file).clone(),
            name: name.to_string(),
            got: stored,
            expected: vec![grid_r, grid_c],
        })
    }

    fn fp8_empty(&self, stem: &str, rows: usize, cols: usize) -> Error {
        Error::Safetensors {
            path: self.dir.clone(),
            msg: format!("`{stem}.weight`: an FP8 weight of {rows} x {cols} values"),
        }
    }

    /// Qwen/DeepSeek's `weight_scale_inv` per `block`.
    pub(super) fn fp8_block(
        &self,
        d: &Declared,
        stem: &str,
        shape: (usize, usize),
        block: [usize; 2],
    ) -> Result<Weight> {
        self.fp8_blocks(d, stem, shape, "weight_scale_inv", block)
    }

    /// compressed-tensors' `weight_scale` per tensor, output channel or block.
    pub(super) fn ct_fp8(
        &self,
        d: &Declared,
        stem: &str,
        (rows, cols): (usize, usize),
        strategy: Fp8Strategy,
    ) -> Result<Weight> {
        let block = match strategy {
            Fp8Strategy::Tensor => [rows.max(1), cols.max(1)],
            Fp8Strategy::Channel => [1, cols.max(1)],
            Fp8Strategy::Block(b) => b,
        };
        self.fp8_blocks(d, stem, (rows, cols), "weight_scale", block)
    }
}

#[cfg(test)]
mod tests {
    use super::e4m3;

    /// The table against values worked by hand, and every byte against the format's
    /// definition through f64.
    #[test]
    fn e4m3_values_are_exact() {
        assert_eq!(e4m3(0x00), 0.0);
        assert!(e4m3(0x80) == 0.0 && e4m3(0x80).is_sign_negative());
        assert_eq!(e4m3(0x01), 2f32.powi(-9));
        assert_eq!(e4m3(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3(0x08), 2f32.powi(-6));
        assert_eq!(e4m3(0x38), 1.0);
        assert_eq!(e4m3(0x7e), 448.0);
        assert_eq!(e4m3(0xfe), -448.0);
        assert!(e4m3(0x7f).is_nan() && e4m3(0xff).is_nan());
        for b in 0..=255u8 {
            if b & 0x7f == 0x7f {
                continue;
            }
            let (s, e, m) = (if b & 0x80 != 0 { -1.0 } else { 1.0 }, ((b >> 3) & 15) as i32, (b & 7) as f64);
            let want =
                if e == 0 { s * m / 8.0 * 2f64.powi(-6) } else { s * (1.0 + m / 8.0) * 2f64.powi(e - 7) };
            assert_eq!(e4m3(b) as f64, want, "byte {b:#04x}");
        }
    }
}
