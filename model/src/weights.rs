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
    pub dtype: WeightDtype,
    pub rows: usize,
    pub cols: usize,
}

impl Weight {
    pub(crate) fn mapped(
        map: Arc<Mmap>,
        range: Range<usize>,
        dtype: WeightDtype,
        rows: usize,
        cols: usize,
    ) -> Self {
        debug_assert_eq!(range.len(), rows * cols * dtype.size());
        Weight { bytes: Bytes::Mapped(map, range), dtype, rows, cols }
    }

    /// An owned weight from little-endian bytes of `dtype` (as a checkpoint stores them).
    pub fn from_le_bytes(bytes: Vec<u8>, dtype: WeightDtype, rows: usize, cols: usize) -> Self {
        assert_eq!(bytes.len(), rows * cols * dtype.size(), "from_le_bytes: {rows} x {cols} {dtype:?}");
        Weight { bytes: Bytes::Owned(Arc::new(bytes)), dtype, rows, cols }
    }

    /// An owned f32 weight (used by tests and for small converted tensors).
    pub fn from_f32(values: Vec<f32>, rows: usize, cols: usize) -> Self {
        assert_eq!(values.len(), rows * cols, "Weight::from_f32: shape mismatch");
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Weight { bytes: Bytes::Owned(Arc::new(bytes)), dtype: WeightDtype::F32, rows, cols }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped(m, r) => &m[r.clone()],
            Bytes::Owned(v) => v,
        }
    }

    /// Row `r` widened to f32.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols);
        let row = &self.bytes()[r * self.cols * self.dtype.size()..][..self.cols * self.dtype.size()];
        for (i, o) in out.iter_mut().enumerate() {
            // SAFETY: `row` holds `cols` elements of `dtype`.
            *o = unsafe { self.dtype.read(row.as_ptr(), i) };
        }
    }

    /// The whole tensor widened to f32 (for small tensors: norms, biases).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        let b = self.bytes();
        for (i, o) in out.iter_mut().enumerate() {
            // SAFETY: `b` holds rows * cols elements of `dtype`.
            *o = unsafe { self.dtype.read(b.as_ptr(), i) };
        }
        out
    }
}
