//! The stock-matmul negative control (`stock.cuh`): cuBLAS SGEMM on an f32 copy of the
//! weights, whose kernel choice (and reduction order) depends on M; `Kernels::linear`
//! (lib.rs) adds its output in with `add_into`.

use cudarc::driver::CudaSlice;
use mtp_base::error::{Error, Result};
use mtp_base::weights::WeightDtype;

use crate::matmul::{weight_index, CudaMat};
use crate::{driver, ptr, Cuda};

impl Cuda {
    /// The negative control's matmul: cuBLAS SGEMM on an f32 copy of the weights, whose
    /// kernel choice (and reduction order) depends on M.
    pub(crate) fn stock_linear(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        w: &CudaMat,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
        let blas = self
            .blas
            .get_or_init(|| {
                // SAFETY: only probes whether libcublas can be loaded.
                if !unsafe { cudarc::cublas::sys::is_culib_present() } {
                    return Err("libcublas not found".into());
                }
                CudaBlas::new(self.stream.clone()).map_err(|e| format!("{e:?}"))
            })
            .as_ref()
            .map_err(|e| Error::Backend(format!("cuBLAS: {e}")))?;
        let n_el = w.rows * w.cols;
        let wf: CudaSlice<f32> = match (&w.quant, w.dtype) {
            // The control only needs the same values: dequantized on the host.
            (Some(q), _) => self.upload_as(&q.host.to_f32(), "dequantized weight")?,
            (None, WeightDtype::F32) => {
                // SAFETY: the bytes of an f32 matrix, reinterpreted.
                let v = unsafe { w.buf.transmute::<f32>(n_el) }.expect("f32 matrix bytes");
                self.stream.clone_dtod(&v).map_err(driver("widen"))?
            }
            (None, d) => {
                // SAFETY: written in full by the widening kernel below.
                let out = unsafe { self.stream.alloc::<f32>(n_el) }.map_err(driver("widen"))?;
                let (src, dst, n) = (ptr(&w.buf, &self.stream), ptr(&out, &self.stream), n_el as i64);
                let f = &self.f.widen[weight_index(d) - 1];
                launch!(self, f, (n_el.div_ceil(256) as u32, 1), 256, "widen", [src, dst, n])?;
                out
            }
        };
        let (n, k) = (w.rows as i32, w.cols as i32);
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n,
            n: m as i32,
            k,
            alpha: 1.0f32,
            lda: k,
            ldb: k,
            beta: 0.0f32,
            ldc: n,
        };
        // SAFETY: shapes as above; y holds m x n.
        unsafe { blas.gemm(cfg, &wf, x, y) }.map_err(|e| Error::Backend(format!("cuBLAS: {e:?}")))
    }
}
