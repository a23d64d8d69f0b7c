//! A row's K/V in blocks of [`BLOCK_POSITIONS`] slots from its shape's [`MetalPool`]: a
//! block table in logical order, each block `[layer][K, V][slot][stride]` units of the
//! model's KV dtype (elements of f32 or bf16; 32-bit words of quantized K/V, a slot the
//! CPU's bytes: `KvDtype::slot_units`), so [`KvStore::read`] and [`KvStore::write_bytes`]
//! take the CPU's format. Kernels read slot `s` of plane `[layer][K, V]` at unit
//! `(2 * layer + half) * plane + (table[s / 64] * block_slots + s % 64) * stride` of the
//! pool's buffer (`kv_slot` in kernels.metal): the same logical slots as contiguous
//! storage, so the block size changes no bit.
//!
//! Blocks are shared between rows and with the prefix cache (reference counted), and a
//! write into a shared block copies it first (copy-on-write), as on the host
//! (`mtp_cache::paged`) and on CUDA. The table the kernels read is uploaded whenever it
//! changes (a fresh buffer, so kernels queued before keep reading the old one).

use std::any::Any;
use std::sync::Arc;

use mtp_cache::{block_table, KvBlock, KvError, KvStore, BLOCK_POSITIONS};

use super::pool::{MetalBlock, MetalPool};
use super::{Arg, Dispatch, KvDtype};
use mtp_base::error::Error;

pub struct MetalKv<D: Dispatch> {
    pool: Arc<MetalPool<D>>,
    dtype: KvDtype,
    planes: usize,
    stride: usize,
    table: Vec<Arc<MetalBlock<D>>>,
    /// `table` as the kernels read it (pool indices, i32), once any block is held.
    device_table: Option<D::Buffer>,
    held: usize,
}

fn kv_err(e: Error) -> KvError {
    KvError(format!("Metal KV cache: {e}"))
}

impl<D: Dispatch> MetalKv<D> {
    pub(crate) fn new(pool: Arc<MetalPool<D>>, n_layers: usize, stride: usize, dtype: KvDtype) -> MetalKv<D> {
        MetalKv { pool, dtype, planes: 2 * n_layers, stride, table: Vec::new(), device_table: None, held: 0 }
    }

    /// Bytes of one block of this shape.
    pub(crate) fn block_bytes(n_layers: usize, stride: usize, dtype: KvDtype) -> usize {
        2 * n_layers * BLOCK_POSITIONS * stride * dtype.unit_bytes()
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Units per plane within a block.
    pub fn plane(&self) -> usize {
        BLOCK_POSITIONS * self.stride
    }

    /// Slots (of `stride` units) from one block's start to the next's.
    pub fn block_slots(&self) -> usize {
        self.planes * BLOCK_POSITIONS
    }

    /// The pool's buffer (every block) and the block table the kernels read (an error
    /// while no block is held: no forward opened a window).
    pub(super) fn buffers(&self) -> mtp_base::error::Result<(Arc<D::Buffer>, &D::Buffer)> {
        let table = self
            .device_table
            .as_ref()
            .ok_or_else(|| Error::Backend("a Metal KV store was read before any window opened".into()))?;
        Ok((self.pool.buffer()?, table))
    }

    fn slot_bytes(&self) -> usize {
        self.stride * self.dtype.unit_bytes()
    }

    fn unit_bytes(&self) -> usize {
        self.dtype.unit_bytes()
    }

    /// Byte offset of block `b` of the table in the pool's buffer.
    fn address(&self, b: usize) -> usize {
        self.pool.address(self.table[b].index)
    }

    /// Uploads the table after a change.
    fn sync_table(&mut self) -> Result<(), KvError> {
        let indices: Vec<i32> = self.table.iter().map(|b| b.index as i32).collect();
        let bytes: Vec<u8> = indices.iter().flat_map(|i| i.to_ne_bytes()).collect();
        let buf = self.pool.metal().dispatch().upload(&bytes).map_err(kv_err)?;
        self.device_table = Some(buf);
        Ok(())
    }

    /// Block `b` for writing: copied first when another table holds it too.
    fn unshare(&mut self, b: usize) -> Result<(), KvError> {
        if Arc::get_mut(&mut self.table[b]).is_none() && !mtp_cache::negative_control::write_shared_in_place()
        {
            let copy = self.pool.copy_of(&self.table[b])?;
            self.table[b] = Arc::new(copy);
            self.sync_table()?;
        }
        Ok(())
    }

    /// Moves slots within one block, `[from, from + n)` to `[to, to + n)`, `to < from`.
    fn move_in_block(
        &self,
        buf: &D::Buffer,
        b: usize,
        from: usize,
        to: usize,
        n: usize,
    ) -> Result<(), KvError> {
        let name = if self.unit_bytes() == 2 { "kv_move_2" } else { "kv_move_4" };
        let s = self.stride as i64;
        self.pool
            .metal()
            .run(
                name,
                (self.planes as u32, 1),
                256,
                &[
                    Arg::Out(buf, self.address(b)),
                    Arg::I64(self.plane() as i64),
                    Arg::I64(from as i64 * s),
                    Arg::I64(to as i64 * s),
                    Arg::I64(n as i64 * s),
                ],
            )
            .map_err(kv_err)
    }

    /// Moves held slots `[from, from + n)` down to `[to, to + n)`, block piece by piece.
    fn slide(&mut self, from: usize, to: usize, n: usize) -> Result<(), KvError> {
        let bp = BLOCK_POSITIONS;
        let mut i = 0;
        while i < n {
            let (s, d) = (from + i, to + i);
            let len = (n - i).min(bp - s % bp).min(bp - d % bp);
            self.unshare(d / bp)?;
            let buf = self.pool.buffer().map_err(kv_err)?;
            if s / bp == d / bp {
                self.move_in_block(&buf, d / bp, s % bp, d % bp, len)?;
            } else {
                let (src, dst) = (
                    self.address(s / bp) + (s % bp) * self.slot_bytes(),
                    self.address(d / bp) + (d % bp) * self.slot_bytes(),
                );
                self.pool.copy(
                    (&buf, src),
                    (&buf, dst),
                    self.planes,
                    self.plane(),
                    len * self.stride,
                    0,
                    0,
                )?;
            }
            i += len;
        }
        Ok(())
    }

    /// Byte offset of `layer`'s `half` (0: K, 1: V) at `slot` of block `b` (within it).
    fn span(&self, b: usize, layer: usize, half: usize, slot: usize) -> usize {
        self.address(b) + ((2 * layer + half) * BLOCK_POSITIONS + slot) * self.slot_bytes()
    }
}

impl<D: Dispatch> KvStore for MetalKv<D> {
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
            let buf = self.pool.buffer().map_err(kv_err)?;
            let at = self.address(b);
            self.pool.copy((&buf, at), (&buf, at), self.planes, self.plane(), 0, from, to)?;
        }
        let grew = !fresh.is_empty();
        self.table.extend(fresh);
        self.held = slots;
        if grew || self.device_table.is_none() {
            self.sync_table()?;
        }
        Ok(())
    }

    fn truncate(&mut self, slots: usize) {
        // The uploaded table may keep dropped blocks past the held ones: nothing reads them.
        self.held = self.held.min(slots);
        self.table.truncate(self.held.div_ceil(BLOCK_POSITIONS));
    }

    fn reserve(&mut self, slots: usize) -> Result<(), KvError> {
        let more = slots.div_ceil(BLOCK_POSITIONS).saturating_sub(self.table.len());
        self.table.try_reserve(more).map_err(|e| KvError(format!("Metal K/V block table: {e}")))
    }

    fn move_down(&mut self, from: usize, to: usize, n: usize) {
        // A dispatch fails only on a broken device, whose error every later call reports.
        if let Err(e) = self.slide(from, to, n) {
            tracing::error!("{e}");
        }
    }

    fn bytes(&self) -> usize {
        self.table.len() * self.pool.block_bytes()
    }

    fn read(&self, layer: usize, n: usize) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        let sb = self.slot_bytes();
        let mut out = (vec![0u8; n * sb], vec![0u8; n * sb]);
        if n == 0 {
            return Ok(out);
        }
        let buf = self.pool.buffer().map_err(kv_err)?;
        let d = self.pool.metal().dispatch();
        for (half, dst) in [(0, &mut out.0), (1, &mut out.1)] {
            for (b, chunk) in dst.chunks_mut(BLOCK_POSITIONS * sb).enumerate() {
                d.read(&buf, self.span(b, layer, half, 0), chunk).map_err(kv_err)?;
            }
        }
        Ok(out)
    }

    fn write_bytes(&mut self, layer: usize, slot: usize, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        let sb = self.slot_bytes().max(1);
        let n = k.len() / sb;
        if k.len() != v.len() || !k.len().is_multiple_of(sb) || slot + n > self.held {
            return Err(KvError(format!(
                "Metal KV cache: cannot write {} bytes at slot {slot} of {} held slots",
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
            let buf = self.pool.buffer().map_err(kv_err)?;
            let d = self.pool.metal().dispatch();
            for (half, src) in [(0, k), (1, v)] {
                d.write(&buf, self.span(s / bp, layer, half, s % bp), &src[i * sb..(i + len) * sb])
                    .map_err(kv_err)?;
            }
            i += len;
        }
        Ok(())
    }

    fn try_clone(&self) -> Result<Box<dyn KvStore>, KvError> {
        let mut copy =
            MetalKv { pool: self.pool.clone(), table: self.table.clone(), device_table: None, ..*self };
        if !copy.table.is_empty() {
            copy.sync_table()?;
        }
        Ok(Box::new(copy))
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
        block_table::share(&self.table, first, n, self.pool.block_bytes(), self.held, "Metal KV")
    }

    fn adopt_blocks(&mut self, blocks: &[KvBlock], slots: usize) -> Result<(), KvError> {
        let pool = self.pool.clone();
        let fits = |b: &Arc<MetalBlock<D>>| pool.owns(b);
        self.held =
            block_table::adopt(&mut self.table, self.held, BLOCK_POSITIONS, blocks, slots, fits, "Metal KV")?;
        self.sync_table()
    }

    fn for_each_allocation(&self, f: &mut dyn FnMut(usize, usize)) {
        block_table::for_each(&self.table, self.pool.block_bytes(), f)
    }

    fn last_block_shared(&self) -> bool {
        block_table::last_shared(&self.table)
    }
}
