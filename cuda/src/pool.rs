//! Device memory for K/V blocks: one pool per store shape (layers, slot units, dtype) and
//! GPU, a stretch of virtual addresses reserved once and backed by physical memory as
//! blocks are needed (the driver's virtual memory management), so the pool's base
//! address never moves and a block is named by its index: a row's block table is a list
//! of indices, its K/V at `base + index * block_bytes` (`[layer][K, V][position][units]`,
//! as the host's blocks, `mtp_cache::paged`).
//!
//! A block freed goes back on the free list, and is taken again before the pool grows;
//! the memory stays with the pool (what `mtp_kv_bytes` counts is the blocks rows hold).
//! Every use of a block runs on the one stream, so a block freed while kernels queued
//! before still read it is rewritten only after them.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::CudaStream;
use mtp_cache::KvError;

/// Bytes mapped at a time at least (then rounded to the driver's granularity).
const GROWTH_BYTES: usize = 64 << 20;

pub(crate) struct BlockPool {
    stream: Arc<CudaStream>,
    block_bytes: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Reserved virtual addresses (0 until the first block).
    base: u64,
    reserved: usize,
    granularity: usize,
    /// Physical allocations mapped from `base` on, in order.
    mapped: Vec<(sys::CUmemGenericAllocationHandle, usize)>,
    mapped_bytes: usize,
    /// Blocks handed out so far (indices `[0, next)`), and those given back.
    next: u32,
    free: Vec<u32>,
}

/// A block of a pool, held by the block tables (and prefix cache) that share it; dropping
/// the last holder gives its index back.
pub(crate) struct DevBlock {
    pool: Arc<BlockPool>,
    pub index: u32,
}

impl Drop for DevBlock {
    fn drop(&mut self) {
        self.pool.state.lock().unwrap_or_else(|p| p.into_inner()).free.push(self.index);
    }
}

fn check(what: &str, r: sys::CUresult) -> Result<(), KvError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        Err(KvError(format!("out of GPU memory: cannot map more K/V blocks ({what})")))
    } else {
        Err(KvError(format!("GPU K/V pool: {what}: {r:?}")))
    }
}

impl BlockPool {
    pub fn new(stream: Arc<CudaStream>, block_bytes: usize) -> BlockPool {
        BlockPool { stream, block_bytes: block_bytes.max(1), state: Mutex::new(State::default()) }
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The pool's base address (0 before its first block).
    pub fn base(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).base
    }

    /// Bytes the pool can ever map: the GPU's memory.
    pub fn capacity(&self) -> Result<usize, KvError> {
        let reserved = self.state.lock().unwrap_or_else(|p| p.into_inner()).reserved;
        if reserved > 0 {
            return Ok(reserved);
        }
        // SAFETY: the device handle of the stream's own context.
        unsafe { cudarc::driver::result::device::total_mem(self.stream.context().cu_device()) }
            .map_err(|e| KvError(format!("GPU K/V pool: {e:?}")))
    }

    /// Device address of block `index`.
    pub fn address(&self, index: u32) -> u64 {
        self.base() + index as u64 * self.block_bytes as u64
    }

    fn location(&self) -> sys::CUmemLocation {
        sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.stream.context().ordinal() as i32,
        }
    }

    fn properties(&self) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct, all zeros a valid start (no handle types, no flags).
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = self.location();
        prop
    }

    /// Reserves the pool's addresses: as many as the GPU has memory.
    fn reserve(&self, s: &mut State) -> Result<(), KvError> {
        let prop = self.properties();
        let ctx = self.stream.context();
        let mut granularity = 0usize;
        // SAFETY: out-pointers to locals; `prop` lives across the call.
        check("granularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        // SAFETY: the device handle of the stream's own context.
        let total = unsafe { cudarc::driver::result::device::total_mem(ctx.cu_device()) }
            .map_err(|e| KvError(format!("GPU K/V pool: {e:?}")))?;
        let granularity = granularity.max(1);
        let reserved = total.div_ceil(granularity) * granularity;
        let mut base = 0u64;
        // SAFETY: an out-pointer to a local; no fixed address asked for.
        check("reserving addresses", unsafe { sys::cuMemAddressReserve(&mut base, reserved, 0, 0, 0) })?;
        (s.base, s.reserved, s.granularity) = (base, reserved, granularity);
        Ok(())
    }

    /// Makes the pool's context current on this thread (the driver calls below need it; a
    /// row may grow on another thread than the one that reserved the pool).
    fn bind(&self) -> Result<(), KvError> {
        self.stream.context().bind_to_thread().map_err(|e| KvError(format!("GPU K/V pool: {e:?}")))
    }

    /// Maps physical memory until `bytes` from the base are backed.
    fn map_to(&self, s: &mut State, bytes: usize) -> Result<(), KvError> {
        self.bind()?;
        if s.base == 0 {
            self.reserve(s)?;
        }
        if bytes > s.reserved {
            return Err(KvError(format!(
                "out of GPU memory: {bytes} bytes of K/V blocks exceed the GPU's {} bytes",
                s.reserved
            )));
        }
        while s.mapped_bytes < bytes {
            let want = (bytes - s.mapped_bytes).max(GROWTH_BYTES).div_ceil(s.granularity) * s.granularity;
            let size = want.min(s.reserved - s.mapped_bytes);
            let prop = self.properties();
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: an out-pointer to a local; `prop` describes device memory.
            check("allocating", unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) })?;
            let at = s.base + s.mapped_bytes as u64;
            // SAFETY: `[at, at + size)` lies in the reserved range and is not mapped yet.
            let mapped = check("mapping", unsafe { sys::cuMemMap(at, size, 0, handle, 0) });
            if let Err(e) = mapped {
                // SAFETY: the handle was created above and is not mapped.
                unsafe { sys::cuMemRelease(handle) };
                return Err(e);
            }
            let access = sys::CUmemAccessDesc {
                location: self.location(),
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the range was just mapped; one descriptor.
            check("granting access", unsafe { sys::cuMemSetAccess(at, size, &access, 1) })?;
            s.mapped.push((handle, size));
            s.mapped_bytes += size;
        }
        Ok(())
    }

    /// A block for the caller alone, its bytes zeroed (on the stream).
    pub fn take(self: &Arc<Self>) -> Result<DevBlock, KvError> {
        let index = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match s.free.pop() {
                Some(i) => i,
                None => {
                    let i = s.next;
                    let end = (i as usize + 1)
                        .checked_mul(self.block_bytes)
                        .ok_or_else(|| KvError("GPU K/V pool: block count overflows".into()))?;
                    self.map_to(&mut s, end)?;
                    s.next += 1;
                    i
                }
            }
        };
        let block = DevBlock { pool: self.clone(), index };
        self.bind()?;
        // SAFETY: the block's bytes lie in the mapped range; the stream orders the write.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.address(index),
                0,
                self.block_bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| KvError(format!("GPU K/V pool: zeroing a block: {e:?}")))?;
        Ok(block)
    }

    /// A copy of `block` (on the stream).
    pub fn copy(self: &Arc<Self>, block: &DevBlock) -> Result<DevBlock, KvError> {
        let fresh = self.take()?;
        // SAFETY: both blocks lie in the mapped range and are distinct.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                self.address(fresh.index),
                self.address(block.index),
                self.block_bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| KvError(format!("GPU K/V pool: copying a block: {e:?}")))?;
        Ok(fresh)
    }

    /// Whether `block` is one of this pool's.
    pub fn owns(self: &Arc<Self>, block: &DevBlock) -> bool {
        Arc::ptr_eq(self, &block.pool)
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl Drop for BlockPool {
    fn drop(&mut self) {
        let s = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if s.base == 0 {
            return;
        }
        let _ = self.stream.synchronize();
        let mut at = s.base;
        for &(handle, size) in &s.mapped {
            // SAFETY: each range was mapped from this handle; no block outlives the pool.
            unsafe {
                sys::cuMemUnmap(at, size);
                sys::cuMemRelease(handle);
            }
            at += size as u64;
        }
        // SAFETY: the range reserved in `reserve`, now unmapped.
        unsafe { sys::cuMemAddressFree(s.base, s.reserved) };
    }
}
