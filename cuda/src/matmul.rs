//! Weights on the device ([`CudaMat`], in their checkpoint dtype; MLX-quantized ones with
//! their scales, biases and layout) and the matmul's shared shapes: which weights take the
//! tensor cores ([`tensor_core_path`]), the kernel variant of a weight dtype or of quantized
//! bits. The CUDA-core matmul (`matmul.cuh`) is launched by `Kernels::linear` (lib.rs); the
//! tensor-core kernels by `matmul_tc.rs`, `matmul_tt.rs`, `matmul_tcq.rs` and `hopper.rs`.

use cudarc::driver::CudaSlice;
use mtp_base::weights::{Weight, WeightDtype};

/// Threads per block of the matmul (8 warps sharing 4 columns, or 16 on tensor cores: see
/// matmul.cuh and matmul_tc.cuh).
pub(crate) const LINEAR_THREADS: u32 = 256;
pub(crate) const LINEAR_COLS_PER_BLOCK: usize = 4;
pub(crate) const LINEAR_TC_COLS_PER_BLOCK: usize = 16;

/// Whether a weight takes the tensor-core matmul: bf16, not quantized, K a multiple of
/// 32. Decided by the weight alone, so every M takes the same path.
pub(crate) fn tensor_core_path(w: &CudaMat) -> bool {
    w.quant.is_none() && w.dtype == WeightDtype::Bf16 && w.cols.is_multiple_of(32)
}

pub(crate) fn weight_index(d: WeightDtype) -> usize {
    match d {
        WeightDtype::F32 => 0,
        WeightDtype::Bf16 => 1,
        WeightDtype::F16 => 2,
    }
}

/// A weight matrix on the device, in its checkpoint dtype.
pub struct CudaMat {
    pub(crate) buf: CudaSlice<u8>,
    pub(crate) dtype: WeightDtype,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// For an MLX-quantized weight (`buf` then holds the packed values).
    pub(crate) quant: Option<CudaQuant>,
}

/// Scales and biases of a quantized matrix, widened to f32, and its layout.
pub(crate) struct CudaQuant {
    pub(crate) scales: CudaSlice<f32>,
    /// Affine mode's biases (`None`: mxfp4).
    pub(crate) biases: Option<CudaSlice<f32>>,
    pub(crate) bits: usize,
    pub(crate) group: usize,
    /// `linear_tcq`'s group words, where this kernel set's bf16 mode takes the weight on
    /// tensor cores ([`quant_tensor_cores`]).
    ///
    /// [`quant_tensor_cores`]: crate::matmul_tcq::quant_tensor_cores
    pub(crate) tensor_cores: Option<CudaSlice<u32>>,
    /// The weight as loaded (host, memory-mapped), for the stock-matmul negative control.
    pub(crate) host: Weight,
}

/// Kernel variant for quantized bits: 2, 4, 8.
pub(crate) fn bits_index(bits: usize) -> usize {
    match bits {
        2 => 0,
        4 => 1,
        _ => 2,
    }
}
