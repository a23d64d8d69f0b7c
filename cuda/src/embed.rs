//! The embedding lookup's launch (`embed.cuh`): a table's rows for device token ids, by
//! the table's dtype or quantization.

use cudarc::driver::CudaSlice;
use mtp_base::error::Result;

use crate::matmul::{bits_index, weight_index, CudaMat};
use crate::{ptr, Cuda};

impl Cuda {
    /// `out[i] = table[toks[i]]` for `n` device token ids.
    pub(crate) fn embed_ids(
        &self,
        table: &CudaMat,
        toks: &CudaSlice<u32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let s = &self.stream;
        let (t, tk, cols, o) = (ptr(&table.buf, s), ptr(toks, s), table.cols as i32, ptr(out, s));
        if let Some(q) = &table.quant {
            let (sc, bi, g) = (ptr(&q.scales, s), q.biases.as_ref().map_or(0, |b| ptr(b, s)), q.group as i32);
            let f = match q.tensor_cores {
                Some(_) => &self.f.embed_tcq[(q.bits == 8) as usize],
                None => &self.f.embed_q[bits_index(q.bits)],
            };
            return launch!(self, f, (n as u32, 1), 256, "embed", [t, sc, bi, g, tk, cols, o]);
        }
        launch!(self, &self.f.embed[weight_index(table.dtype)], (n as u32, 1), 256, "embed", [t, tk, cols, o])
    }
}
