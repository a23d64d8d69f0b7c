//! The CUDA [`Collective`]: one NCCL communicator per GPU of this process (made together by
//! `ncclCommInitAll`, through cudarc), each on its GPU's one stream, so an exchange is
//! ordered with the rank's kernels without events. Only all-gather is used: NCCL moves the
//! bytes and `add_parts` adds them in rank order, because NCCL's own all-reduce picks its
//! algorithm and chunking by message size, and the message size follows the token count.
//!
//! NCCL has no way to wake a rank waiting for a peer that never comes: after a rank fails
//! mid-forward, [`RankSync::abort`] aborts every communicator and the model refuses further
//! forwards. (The tensor-parallel driver checks what can be checked before any rank starts,
//! so a bad request fails alone and never gets here.)

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;
use cudarc::nccl::Comm;
use mtp_base::error::{Error, Result};
use mtp_kernels::collective::{Collective, RankSync};

use crate::Cuda;

/// One rank's communicator; `None` once aborted.
struct RankComm(Mutex<Option<Comm>>);

// SAFETY: each communicator is used by its own rank's thread, one call at a time behind the
// mutex (abort takes the same mutex), as NCCL allows.
unsafe impl Send for RankComm {}
unsafe impl Sync for RankComm {}

/// NCCL between the GPUs of `ranks`, rank `r` on `ranks[r]`'s GPU.
pub struct NcclCollective {
    comms: Vec<RankComm>,
}

impl NcclCollective {
    /// Communicators between the GPUs of `ranks` (each on its own GPU, in rank order).
    /// Fails with a clear message when the NCCL library cannot be loaded.
    pub fn new(ranks: &[Arc<Cuda>]) -> Result<NcclCollective> {
        // SAFETY: only probes whether the library can be loaded.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(Error::Backend(
                "tensor parallelism on CUDA needs NCCL: libnccl.so could not be loaded (install NCCL, or \
                 put the directory holding libnccl.so on LD_LIBRARY_PATH; pip's nvidia-nccl ships \
                 libnccl.so.2, which needs a libnccl.so link beside it)"
                    .into(),
            ));
        }
        let streams = ranks.iter().map(|c| c.stream().clone()).collect();
        let comms = Comm::from_devices(streams)
            .map_err(|e| Error::Backend(format!("NCCL: cannot connect {} GPUs: {e:?}", ranks.len())))?;
        Ok(NcclCollective { comms: comms.into_iter().map(|c| RankComm(Mutex::new(Some(c)))).collect() })
    }
}

impl RankSync for NcclCollective {
    fn abort(&self) {
        for c in &self.comms {
            // Dropping a communicator aborts it (cudarc), releasing peers stuck in it.
            drop(c.0.lock().unwrap_or_else(|e| e.into_inner()).take());
        }
    }

    fn reset(&self) {}
}

impl Collective<Cuda> for NcclCollective {
    fn all_gather(&self, rank: usize, part: &CudaSlice<f32>, gathered: &mut CudaSlice<f32>) -> Result<()> {
        let slot = self.comms.get(rank).ok_or_else(|| Error::Backend(format!("NCCL: no rank {rank}")))?;
        if gathered.len() != self.comms.len() * part.len() {
            return Err(Error::Backend(format!(
                "NCCL: rank {rank} gathers {} values into {}",
                part.len(),
                gathered.len()
            )));
        }
        let comm = slot.0.lock().unwrap_or_else(|e| e.into_inner());
        let comm = comm.as_ref().ok_or_else(|| {
            Error::Backend(
                "the tensor-parallel GPUs' NCCL communicators were aborted after a rank failed; load the \
                 model again"
                    .into(),
            )
        })?;
        comm.all_gather(part, gathered)
            .map(|_| ())
            .map_err(|e| Error::Backend(format!("NCCL all-gather: {e:?}")))
    }
}

impl NcclCollective {
    /// NCCL's own sum all-reduce of `x` in place on rank `rank`: what [`Collective::all_gather`]
    /// and `add_parts` replace (NCCL picks its algorithm and chunking by message size, so
    /// the order of a sum follows the token count). For `examples/gpu_collective.rs`, which
    /// times the two side by side.
    pub fn stock_all_reduce(&self, rank: usize, x: &mut CudaSlice<f32>) -> Result<()> {
        let slot = self.comms.get(rank).ok_or_else(|| Error::Backend(format!("NCCL: no rank {rank}")))?;
        let comm = slot.0.lock().unwrap_or_else(|e| e.into_inner());
        let comm = comm.as_ref().ok_or_else(|| Error::Backend("NCCL communicators aborted".into()))?;
        comm.all_reduce_in_place(x, &cudarc::nccl::ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| Error::Backend(format!("NCCL all-reduce: {e:?}")))
    }
}
