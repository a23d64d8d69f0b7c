//! Weights read in place from memory-mapped safetensors files, in their on-disk dtype.

use std::ops::Range;
use std::sync::Arc;

use memmap2::Mmap;

/// On-disk dtypes the kernels widen to f32 on the fly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
    F16,
}

impl WeightDtype {
    pub fn size(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 | WeightDtype::F16 => 2,
        }
    }

    /// Reads element `i` of an array of this dtype starting at `p`, as f32.
    ///
    /// # Safety
    /// `p` must point to at least `(i + 1) * self.size()` readable bytes.
    #[inline(always)]
    pub unsafe fn read(self, p: *const u8, i: usize) -> f32 {
        match self {
            WeightDtype::F32 => std::ptr::read_unaligned(p.add(i * 4) as *const f32),
            WeightDtype::Bf16 => {
                let b = std::ptr::read_unaligned(p.add(i * 2) as *const u16);
                f32::from_bits((b as u32) << 16)
            }
            WeightDtype::F16 => {
                half::f16::from_bits(std::ptr::read_unaligned(p.add(i * 2) as *const u16)).to_f32()
            }
        }
    }

    /// Elements `start .. start + out.len()` of an array of this dtype at `p`, as f32: what
    /// [`WeightDtype::read`] gives for each, with one dtype match for the whole run.
    ///
    /// # Safety
    /// `p` must point to at least `(start + out.len()) * self.size()` readable bytes.
    #[inline(always)]
    pub unsafe fn widen(self, p: *const u8, start: usize, out: &mut [f32]) {
        // Each arm calls `read` with a constant dtype, so its match folds away in the loop.
        #[inline(always)]
        unsafe fn each(d: WeightDtype, p: *const u8, start: usize, out: &mut [f32]) {
            for (i, o) in out.iter_mut().enumerate() {
                *o = d.read(p, start + i);
            }
        }
        match self {
            WeightDtype::F32 => each(WeightDtype::F32, p, start, out),
            WeightDtype::Bf16 => each(WeightDtype::Bf16, p, start, out),
            WeightDtype::F16 => each(WeightDtype::F16, p, start, out),
        }
    }

    /// `x` rounded to this dtype and widened back (what `tensor.to(dtype)` of a scalar
    /// gives), round to nearest even.
    pub fn round(self, x: f32) -> f32 {
        match self {
            WeightDtype::F32 => x,
            WeightDtype::Bf16 => half::bf16::from_f32(x).to_f32(),
            WeightDtype::F16 => half::f16::from_f32(x).to_f32(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "F32",
            WeightDtype::Bf16 => "BF16",
            WeightDtype::F16 => "F16",
        }
    }
}

/// Where a tensor's bytes live: a range of a shared memory map, or an owned buffer
/// (synthesized or converted tensors).
#[derive(Clone)]
enum Bytes {
    Mapped(Arc<Mmap>, Range<usize>),
    Owned(Arc<Vec<u8>>),
}

/// A 1-D or 2-D tensor of weights (row-major, `rows x cols`).
#[derive(Clone)]
pub struct Weight {
    bytes: Bytes,
    /// The element dtype (of the scales, for a quantized weight).
    pub dtype: WeightDtype,
    pub rows: usize,
    pub cols: usize,
    /// Set for an MLX-quantized weight, whose bytes are then the packed values.
    quant: Option<Arc<Quant>>,
}

/// MLX quantization ("mlx_lm.convert -q"): each row is cut into groups of `group`
/// consecutive values that share a scale (and, affine, a bias), and the `bits`-bit codes
/// are packed `32 / bits` to a little-endian u32 (value j of a word in bits
/// `[j * bits, (j + 1) * bits)`). Affine: `w = scale * q + bias`. mxfp4: `w = scale *
/// e2m1(q)` with a power-of-two scale per 32 values (stored as f32 here).
#[derive(Clone)]
pub struct Quant {
    pub bits: usize,
    pub group: usize,
    /// `rows x cols / group` each.
    pub scales: Weight,
    /// Affine mode's biases; `None` for mxfp4.
    pub biases: Option<Weight>,
}

/// The 16 FP4 (E2M1) values: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
pub const E2M1: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

impl Weight {
    pub(crate) fn mapped(
        map: Arc<Mmap>,
        range: Range<usize>,
        dtype: WeightDtype,
        rows: usize,
        cols: usize,
    ) -> Self {
        debug_assert_eq!(range.len(), rows * cols * dtype.size());
        Weight { bytes: Bytes::Mapped(map, range), dtype, rows, cols, quant: None }
    }

    /// A quantized `rows x cols` weight: `packed` holds the u32 words (as raw bytes,
    /// `rows x cols * bits / 32` words), `quant` the group layout, scales and biases.
    pub fn quantized(packed: Weight, rows: usize, cols: usize, quant: Quant) -> Self {
        debug_assert_eq!(packed.bytes().len(), rows * cols * quant.bits / 8);
        let dtype = quant.scales.dtype;
        Weight { bytes: packed.bytes, dtype, rows, cols, quant: Some(Arc::new(quant)) }
    }

    /// The quantization, for a quantized weight.
    pub fn quant(&self) -> Option<&Quant> {
        self.quant.as_deref()
    }

    /// An owned weight from little-endian bytes of `dtype` (as a checkpoint stores them).
    pub fn from_le_bytes(bytes: Vec<u8>, dtype: WeightDtype, rows: usize, cols: usize) -> Self {
        assert_eq!(bytes.len(), rows * cols * dtype.size(), "from_le_bytes: {rows} x {cols} {dtype:?}");
        Weight { bytes: Bytes::Owned(Arc::new(bytes)), dtype, rows, cols, quant: None }
    }

    /// An owned f32 weight (used by tests and for small converted tensors).
    pub fn from_f32(values: Vec<f32>, rows: usize, cols: usize) -> Self {
        assert_eq!(values.len(), rows * cols, "Weight::from_f32: shape mismatch");
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Weight { bytes: Bytes::Owned(Arc::new(bytes)), dtype: WeightDtype::F32, rows, cols, quant: None }
    }

    /// Whether the bytes are a memory-mapped checkpoint's (not an owned copy).
    pub fn is_mapped(&self) -> bool {
        matches!(self.bytes, Bytes::Mapped(..))
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped(m, r) => &m[r.clone()],
            Bytes::Owned(v) => v,
        }
    }

    /// Row `r` widened (or dequantized) to f32.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols);
        if let Some(q) = &self.quant {
            return self.dequantize_row(q, r, out);
        }
        let row = &self.bytes()[r * self.cols * self.dtype.size()..][..self.cols * self.dtype.size()];
        for (i, o) in out.iter_mut().enumerate() {
            // SAFETY: `row` holds `cols` elements of `dtype`.
            *o = unsafe { self.dtype.read(row.as_ptr(), i) };
        }
    }

    /// Row `r` of a quantized weight: `scale * q + bias` per element, in f32.
    fn dequantize_row(&self, q: &Quant, r: usize, out: &mut [f32]) {
        let row_bytes = self.cols * q.bits / 8;
        let row = &self.bytes()[r * row_bytes..][..row_bytes];
        crate::quant::dequantize_row(q, row, r * (self.cols / q.group), out);
    }

    /// Rows `r` of this weight (a tensor-parallel rank's outputs): zero-copy for mapped
    /// bytes; a quantized weight keeps its groups (each row holds whole groups).
    pub fn slice_rows(&self, r: Range<usize>) -> Result<Weight, String> {
        if r.start > r.end || r.end > self.rows {
            return Err(format!("rows {r:?} are outside the weight's {} rows", self.rows));
        }
        let row_bytes = self.row_bytes();
        let bytes = self.byte_range(r.start * row_bytes..r.end * row_bytes);
        let quant = match &self.quant {
            Some(q) => Some(Arc::new(Quant {
                scales: q.scales.slice_rows(r.clone())?,
                biases: q.biases.as_ref().map(|b| b.slice_rows(r.clone())).transpose()?,
                ..*q.as_ref()
            })),
            None => None,
        };
        Ok(Weight { bytes, dtype: self.dtype, rows: r.len(), cols: self.cols, quant })
    }

    /// Columns `c` of this weight (a tensor-parallel rank's inputs), copied. A quantized
    /// weight is cut at group boundaries only.
    pub fn slice_cols(&self, c: Range<usize>) -> Result<Weight, String> {
        if c.start > c.end || c.end > self.cols {
            return Err(format!("columns {c:?} are outside the weight's {} columns", self.cols));
        }
        let (elem_bits, quant) = match &self.quant {
            Some(q) => {
                if !c.start.is_multiple_of(q.group)
                    || !c.end.is_multiple_of(q.group)
                    || !(c.start * q.bits).is_multiple_of(8)
                {
                    return Err(format!("columns {c:?} cut a quantization group of {} values", q.group));
                }
                let groups = c.start / q.group..c.end / q.group;
                let quant = Quant {
                    scales: q.scales.slice_cols(groups.clone())?,
                    biases: q.biases.as_ref().map(|b| b.slice_cols(groups.clone())).transpose()?,
                    ..**q
                };
                (q.bits, Some(Arc::new(quant)))
            }
            None => (self.dtype.size() * 8, None),
        };
        let (from, to, row_bytes) = (c.start * elem_bits / 8, c.end * elem_bits / 8, self.row_bytes());
        let all = self.bytes();
        let mut out = Vec::with_capacity(self.rows * (to - from));
        for row in 0..self.rows {
            out.extend_from_slice(&all[row * row_bytes + from..row * row_bytes + to]);
        }
        Ok(Weight {
            bytes: Bytes::Owned(Arc::new(out)),
            dtype: self.dtype,
            rows: self.rows,
            cols: c.len(),
            quant,
        })
    }

    /// This weight with one more row of zeros after its last (a quantized weight: zero
    /// codes, scales and biases), copied: the row a tensor-parallel rank's embedding
    /// gives tokens outside its vocabulary rows.
    pub fn with_zero_row(&self) -> Weight {
        let mut bytes = self.bytes().to_vec();
        bytes.resize(bytes.len() + self.row_bytes(), 0);
        let quant = self.quant.as_ref().map(|q| {
            Arc::new(Quant {
                scales: q.scales.with_zero_row(),
                biases: q.biases.as_ref().map(Weight::with_zero_row),
                ..**q
            })
        });
        Weight {
            bytes: Bytes::Owned(Arc::new(bytes)),
            dtype: self.dtype,
            rows: self.rows + 1,
            cols: self.cols,
            quant,
        }
    }

    /// Bytes a row takes as stored (packed codes for a quantized weight).
    fn row_bytes(&self) -> usize {
        match &self.quant {
            Some(q) => self.cols * q.bits / 8,
            None => self.cols * self.dtype.size(),
        }
    }

    /// Bytes `r` of this weight's storage, shared with it where it is mapped.
    fn byte_range(&self, r: Range<usize>) -> Bytes {
        match &self.bytes {
            Bytes::Mapped(m, all) => Bytes::Mapped(m.clone(), all.start + r.start..all.start + r.end),
            Bytes::Owned(v) => Bytes::Owned(Arc::new(v[r].to_vec())),
        }
    }

    /// The whole tensor widened to f32 (for small tensors: norms, biases).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        if self.quant.is_some() {
            for (r, row) in out.chunks_mut(self.cols).enumerate() {
                self.row_f32(r, row);
            }
            return out;
        }
        let b = self.bytes();
        for (i, o) in out.iter_mut().enumerate() {
            // SAFETY: `b` holds rows * cols elements of `dtype`.
            *o = unsafe { self.dtype.read(b.as_ptr(), i) };
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows_of(w: &Weight) -> Vec<Vec<f32>> {
        (0..w.rows)
            .map(|r| {
                let mut row = vec![0.0; w.cols];
                w.row_f32(r, &mut row);
                row
            })
            .collect()
    }

    #[test]
    fn slices_hold_the_weights_they_cut() {
        let (rows, cols) = (6, 8);
        let w = Weight::from_f32((0..rows * cols).map(|i| i as f32 * 0.5 - 3.0).collect(), rows, cols);
        let full = rows_of(&w);
        let r = w.slice_rows(2..5).unwrap();
        assert_eq!(rows_of(&r), full[2..5].to_vec());
        let c = w.slice_cols(3..7).unwrap();
        let want: Vec<Vec<f32>> = full.iter().map(|row| row[3..7].to_vec()).collect();
        assert_eq!(rows_of(&c), want);
        assert!(w.slice_rows(4..7).is_err() && w.slice_cols(0..9).is_err());
    }

    #[test]
    fn quantized_slices_keep_whole_groups() {
        // 4 rows of 128 values at 4 bits in groups of 32: 16 words a row, 4 groups.
        let (rows, cols, bits, group) = (4, 128, 4, 32);
        let packed: Vec<u8> = (0..rows * cols * bits / 8).map(|i| (i * 37 % 251) as u8).collect();
        let groups = rows * cols / group;
        let scales =
            Weight::from_f32((0..groups).map(|g| 0.01 * (g + 1) as f32).collect(), rows, cols / group);
        let biases = Weight::from_f32((0..groups).map(|g| -0.1 * g as f32).collect(), rows, cols / group);
        let quant = Quant { bits, group, scales, biases: Some(biases) };
        let w = Weight::quantized(
            Weight::from_le_bytes(packed, WeightDtype::F32, rows, cols / 8),
            rows,
            cols,
            quant,
        );
        let full = rows_of(&w);
        assert_eq!(rows_of(&w.slice_rows(1..3).unwrap()), full[1..3].to_vec());
        let c = w.slice_cols(32..96).unwrap();
        let want: Vec<Vec<f32>> = full.iter().map(|row| row[32..96].to_vec()).collect();
        assert_eq!(rows_of(&c), want);
        let err = w.slice_cols(16..96).err().unwrap();
        assert!(err.contains("quantization group of 32"), "{err}");
        let z = w.slice_rows(2..4).unwrap().with_zero_row();
        let mut want = full[2..4].to_vec();
        want.push(vec![0.0; cols]);
        assert_eq!(rows_of(&z), want);
    }
}
