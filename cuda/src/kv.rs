//! A row's K/V in device memory, in blocks of [`BLOCK_POSITIONS`] slots from its shape's
//! [`BlockPool`]: a block table in logical order, each block `[layer][K, V][slot][stride]`
//! units of the model's KV dtype (elements of f32 or bf16; 32-bit words of quantized K/V,
//! a slot the CPU's bytes: `KvDtype::slot_units`). Kernels read slot `s` at
//! `base + (table[s / 64] * 2 * layers * 64 + s % 64) * stride` of plane `[layer][K, V]`
//! (`kv_slot` in forward.cuh): the same logical slots as contiguous storage, so the block
//! size changes no bit.
//!
//! Blocks are shared between rows and with the prefix cache (reference counted), and a
//! write into a shared block copies it first (copy-on-write), as on the host
//! (`mtp_cache::paged`): a prefix many rows hold is in device memory once.

use std::any::Any;
use std::sync::Arc;

use mtp_cache::{block_table, KvBlock, KvError, KvStore, BLOCK_POSITIONS};

use super::pool::{BlockPool, DevBlock};
use super::{kv_unit_index, Cuda, KvDtype};

pub struct CudaKv {
    cuda: Arc<Cuda>,
    pool: Arc<BlockPool>,
    dtype: KvDtype,
    planes: usize,
    stride: usize,
    table: Vec<Arc<DevBlock>>,
    held: usize,
}

impl CudaKv {
    pub(crate) fn new(
        cuda: Arc<Cuda>,
        pool: Arc<BlockPool>,
        n_layers: usize,
        stride: usize,
        dtype: KvDtype,
    ) -> CudaKv {
        CudaKv { cuda, pool, dtype, planes: 2 * n_layers, stride, table: Vec::new(), held: 0 }
    }

    /// Bytes of one block of this shape.
    pub(crate) fn block_bytes(n_layers: usize, stride: usize, dtype: KvDtype) -> usize {
        2 * n_layers * BLOCK_POSITIONS * stride * dtype.unit_bytes()
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Device address of the pool every block lies in.
    pub fn base(&self) -> i64 {
        self.pool.base() as i64
    }

    /// Units per plane within a block.
    pub fn plane(&self) -> usize {
        BLOCK_POSITIONS * self.stride
    }

    /// Slots (of `stride` units) from one block's start to the next's.
    pub fn block_slots(&self) -> usize {
        self.planes * BLOCK_POSITIONS
    }

    /// The block table as pool indices, in logical order.
    pub fn table(&self) -> impl Iterator<Item = i32> + '_ {
        self.table.iter().map(|b| b.index as i32)
    }

    fn slot_bytes(&self) -> usize {
        self.stride * self.dtype.unit_bytes()
    }

    fn address(&self, b: usize) -> u64 {
        self.pool.address(self.table[b].index)
    }

    /// Block `b` for writing: copied first when another table holds it too.
    fn unshare(&mut self, b: usize) -> Result<(), KvError> {
        if Arc::get_mut(&mut self.table[b]).is_none() && !mtp_cache::negative_control::write_shared_in_place()
        {
            let copy = self.pool.copy(&self.table[b])?;
            self.table[b] = Arc::new(copy);
        }
        Ok(())
    }

    /// Copies `n` units of every plane from `src` to `dst` (planes of a block apart) and
    /// zeroes `dst` units `[zero_from, zero_to)` of every plane.
    fn copy_planes(
        &self,
        src: u64,
        dst: u64,
        n: usize,
        zero_from: usize,
        zero_to: usize,
    ) -> Result<(), KvError> {
        let f = &self.cuda.f.kv_copy[kv_unit_index(self.dtype)];
        let work = n + zero_to.saturating_sub(zero_from);
        let blocks = work.div_ceil(256).clamp(1, 1024) as u32;
        let plane = self.plane() as i64;
        let (sp, dp, n, z0, z1) = (plane, plane, n as i64, zero_from as i64, zero_to as i64);
        launch!(self.cuda, f, (blocks, self.planes as u32), 256, "KV copy", [src, sp, dst, dp, n, z0, z1])
            .map_err(|e: mtp_base::error::Error| KvError(e.to_string()))
    }

    /// Moves slots within one block, `[from, from + n)` to `[to, to + n)`, `to < from`.
    fn move_in_block(&self, block: u64, from: usize, to: usize, n: usize) -> Result<(), KvError> {
        let f = &self.cuda.f.kv_move[kv_unit_index(self.dtype)];
        let s = self.stride as i64;
        let (plane, from, to, n) = (self.plane() as i64, from as i64 * s, to as i64 * s, n as i64 * s);
        launch!(self.cuda, f, (self.planes as u32, 1), 256, "KV move", [block, plane, from, to, n])
            .map_err(|e: mtp_base::error::Error| KvError(e.to_string()))
    }

    fn slide(&mut self, from: usize, to: usize, n: usize) -> Result<(), KvError> {
        let bp = BLOCK_POSITIONS;
        let mut i = 0;
        while i < n {
            let (s, d) = (from + i, to + i);
            let len = (n - i).min(bp - s % bp).min(bp - d % bp);
            self.unshare(d / bp)?;
            let unit = self.slot_bytes() as u64;
            if s / bp == d / bp {
                self.move_in_block(self.address(d / bp), s % bp, d % bp, len)?;
            } else {
                let (src, dst) = (
                    self.address(s / bp) + (s % bp) as u64 * unit,
                    self.address(d / bp) + (d % bp) as u64 * unit,
                );
                self.copy_planes(src, dst, len * self.stride, 0, 0)?;
            }
            i += len;
        }
        Ok(())
    }

    /// The byte range of `layer`'s `half` (0: K, 1: V) for slots `[slot, slot + n)` of block
    /// `b` (within it).
    fn span(&self, b: usize, layer: usize, half: usize, slot: usize, n: usize) -> (u64, usize) {
        let at = ((2 * layer + half) * BLOCK_POSITIONS + slot) * self.slot_bytes();
        (self.address(b) + at as u64, n * self.slot_bytes())
    }

    fn err(what: &str, e: impl std::fmt::Debug) -> KvError {
        KvError(format!("GPU KV cache: {what}: {e:?}"))
    }
}

impl KvStore for CudaKv {
    fn grow(&mut self, slots: usize) -> Result<(), KvError> {
        if slots <= self.held {
            return Ok(());
        }
        let bp = BLOCK_POSITIONS;
        let mut fresh = Vec::new();
        for _ in self.table.len()..slots.div_ceil(bp) {
            fresh.push(Arc::new(self.pool.take()?));
        }
        // Slots past the held ones in the last held block may keep what a rollback left.
        let stale_end = slots.min(self.table.len() * bp);
        if self.held < stale_end {
            let b = self.held / bp;
            self.unshare(b)?;
            let (from, to) = ((self.held % bp) * self.stride, (stale_end - b * bp) * self.stride);
            let at = self.address(b);
            self.copy_planes(at, at, 0, from, to)?;
        }
        self.table.extend(fresh);
        self.held = slots;
        Ok(())
    }

    fn truncate(&mut self, slots: usize) {
        self.held = self.held.min(slots);
        self.table.truncate(self.held.div_ceil(BLOCK_POSITIONS));
    }

    fn reserve(&mut self, slots: usize) -> Result<(), KvError> {
        let blocks = slots.div_ceil(BLOCK_POSITIONS);
        let (bytes, gpu) = (blocks.saturating_mul(self.pool.block_bytes()), self.pool.capacity()?);
        if bytes > gpu {
            return Err(KvError(format!(
                "out of GPU memory: {slots} positions of K/V take {bytes} bytes, more than the GPU's {gpu}"
            )));
        }
        let more = blocks.saturating_sub(self.table.len());
        self.table.try_reserve(more).map_err(|e| KvError(format!("GPU K/V block table: {e}")))
    }

    fn move_down(&mut self, from: usize, to: usize, n: usize) {
        // A launch fails only on a broken context, whose error every later call reports.
        if let Err(e) = self.slide(from, to, n) {
            tracing::error!("{e}");
        }
    }

    fn bytes(&self) -> usize {
        self.table.len() * self.pool.block_bytes()
    }

    fn read(&self, layer: usize, n: usize) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        let stream = self.pool.stream();
        let mut out = (vec![0u8; n * self.slot_bytes()], vec![0u8; n * self.slot_bytes()]);
        for (half, dst) in [(0, &mut out.0), (1, &mut out.1)] {
            for (b, chunk) in dst.chunks_mut(BLOCK_POSITIONS * self.slot_bytes()).enumerate() {
                let (at, _) = self.span(b, layer, half, 0, 0);
                // SAFETY: the range lies in a held block; the stream is synchronized below.
                unsafe { cudarc::driver::result::memcpy_dtoh_async(chunk, at, stream.cu_stream()) }
                    .map_err(|e| Self::err("read", e))?;
            }
        }
        stream.synchronize().map_err(|e| Self::err("read", e))?;
        Ok(out)
    }

    fn write_bytes(&mut self, layer: usize, slot: usize, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        let sb = self.slot_bytes().max(1);
        let n = k.len() / sb;
        if k.len() != v.len() || !k.len().is_multiple_of(sb) || slot + n > self.held {
            return Err(KvError(format!(
                "GPU KV cache: cannot write {} bytes at slot {slot} of {} held slots",
                k.len(),
                self.held
            )));
        }
        let bp = BLOCK_POSITIONS;
        let mut i = 0;
        while i < n {
            let s = slot + i;
            let len = (n - i).min(bp - s % bp);
            self.unshare(s / bp)?;
            for (half, src) in [(0, k), (1, v)] {
                let (at, bytes) = self.span(s / bp, layer, half, s % bp, len);
                let piece = &src[i * sb..i * sb + bytes];
                // SAFETY: the range lies in a held, unshared block; synchronized below, so the
                // host bytes outlive the copy.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(at, piece, self.pool.stream().cu_stream())
                }
                .map_err(|e| Self::err("write", e))?;
            }
            i += len;
        }
        self.pool.stream().synchronize().map_err(|e| Self::err("write", e))
    }

    fn try_clone(&self) -> Result<Box<dyn KvStore>, KvError> {
        Ok(Box::new(CudaKv {
            cuda: self.cuda.clone(),
            pool: self.pool.clone(),
            table: self.table.clone(),
            ..*self
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn block_positions(&self) -> Option<usize> {
        Some(BLOCK_POSITIONS)
    }

    fn share_blocks(&self, first: usize, n: usize) -> Result<Vec<KvBlock>, KvError> {
        block_table::share(&self.table, first, n, self.pool.block_bytes(), self.held, "GPU KV")
    }

    fn adopt_blocks(&mut self, blocks: &[KvBlock], slots: usize) -> Result<(), KvError> {
        let pool = self.pool.clone();
        let fits = |b: &Arc<DevBlock>| pool.owns(b);
        self.held =
            block_table::adopt(&mut self.table, self.held, BLOCK_POSITIONS, blocks, slots, fits, "GPU KV")?;
        Ok(())
    }

    fn for_each_allocation(&self, f: &mut dyn FnMut(usize, usize)) {
        block_table::for_each(&self.table, self.pool.block_bytes(), f)
    }

    fn last_block_shared(&self) -> bool {
        block_table::last_shared(&self.table)
    }
}
