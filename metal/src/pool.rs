//! K/V blocks of one shape (layers, slot units, dtype) in one device buffer, handed out by
//! index: a block is `block_bytes` bytes at `index * block_bytes`, free indices are reused,
//! and the buffer grows by doubling when none is free (a kernel copies the old contents
//! into the new buffer in queue order, so indices, and every row's block table, stay
//! valid). A [`MetalBlock`] returns its index to the free list when its last holder drops
//! it; the pool lives as long as any block of it.

use std::sync::{Arc, Mutex};

use mtp_cache::KvError;

use super::{Arg, Dispatch, Metal};

/// Blocks the first buffer of a pool holds.
const FIRST_BLOCKS: usize = 16;

pub(crate) struct MetalPool<D: Dispatch> {
    metal: Arc<Metal<D>>,
    block_bytes: usize,
    /// Bytes of one unit (4: f32 and quantized K/V, 2: bf16): the copy kernels' element.
    unit_bytes: usize,
    state: Mutex<State<D>>,
}

struct State<D: Dispatch> {
    /// Every block, `blocks` of them; `None` until the first block is taken.
    buf: Option<Arc<D::Buffer>>,
    blocks: usize,
    /// Indices below `next` not held.
    free: Vec<usize>,
    next: usize,
}

/// One block of a pool, held by every table that holds its `Arc`.
pub(crate) struct MetalBlock<D: Dispatch> {
    pool: Arc<MetalPool<D>>,
    pub index: usize,
}

impl<D: Dispatch> Drop for MetalBlock<D> {
    fn drop(&mut self) {
        self.pool.lock().free.push(self.index);
    }
}

fn kv_err(what: &str, e: impl std::fmt::Display) -> KvError {
    KvError(format!("Metal K/V pool: {what}: {e}"))
}

impl<D: Dispatch> MetalPool<D> {
    pub fn new(metal: Arc<Metal<D>>, block_bytes: usize, unit_bytes: usize) -> MetalPool<D> {
        let state = State { buf: None, blocks: 0, free: Vec::new(), next: 0 };
        MetalPool { metal, block_bytes: block_bytes.max(4), unit_bytes, state: Mutex::new(state) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<D>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The buffer every block lies in (an error before any block was taken).
    pub fn buffer(&self) -> mtp_base::error::Result<Arc<D::Buffer>> {
        self.lock().buf.clone().ok_or_else(|| {
            mtp_base::error::Error::Backend("a Metal K/V pool was read before any block was taken".into())
        })
    }

    /// The copy kernel for this pool's unit.
    fn copy_kernel(&self) -> &'static str {
        if self.unit_bytes == 2 {
            "kv_copy_2"
        } else {
            "kv_copy_4"
        }
    }

    /// Queues a copy of `n` units from `src` at byte `src_at` to `dst` at `dst_at` and zeroes
    /// `dst` units `[zero_from, zero_to)` past `dst_at`, for each of `planes` planes of
    /// `plane` units (both sides).
    #[allow(clippy::too_many_arguments)]
    pub fn copy(
        &self,
        (src, src_at): (&D::Buffer, usize),
        (dst, dst_at): (&D::Buffer, usize),
        planes: usize,
        plane: usize,
        n: usize,
        zero_from: usize,
        zero_to: usize,
    ) -> Result<(), KvError> {
        let work = n + zero_to.saturating_sub(zero_from);
        let groups = work.div_ceil(256).clamp(1, 1024);
        self.metal
            .run(
                self.copy_kernel(),
                (groups as u32, planes as u32),
                256,
                &[
                    Arg::In(src, src_at),
                    Arg::I64(plane as i64),
                    Arg::Out(dst, dst_at),
                    Arg::I64(plane as i64),
                    Arg::I64(n as i64),
                    Arg::I64(zero_from as i64),
                    Arg::I64(zero_to as i64),
                    Arg::I64(groups as i64),
                ],
            )
            .map_err(|e| kv_err("copy", e))
    }

    /// Moves to a buffer of `blocks` blocks, keeping the first `s.next`.
    fn grow(&self, s: &mut State<D>, blocks: usize) -> Result<(), KvError> {
        let bytes = blocks
            .checked_mul(self.block_bytes)
            .ok_or_else(|| KvError("Metal K/V pool: the block count overflows".into()))?;
        let new = self.metal.dispatch().alloc(bytes).map_err(|e| {
            KvError(format!("out of device memory: cannot allocate {bytes} bytes of K/V blocks ({e})"))
        })?;
        if let Some(old) = &s.buf {
            let units = s.next * self.block_bytes / self.unit_bytes;
            self.copy((old, 0), (&new, 0), 1, units, units, 0, 0)?;
        }
        s.buf = Some(Arc::new(new));
        s.blocks = blocks;
        Ok(())
    }

    /// A zeroed block.
    pub fn take(self: &Arc<Self>) -> Result<MetalBlock<D>, KvError> {
        let (index, buf) = {
            let mut s = self.lock();
            let index = match s.free.pop() {
                Some(i) => i,
                None => {
                    if s.next == s.blocks {
                        let blocks = s.blocks.saturating_mul(2).max(FIRST_BLOCKS);
                        self.grow(&mut s, blocks)?;
                    }
                    s.next += 1;
                    s.next - 1
                }
            };
            (index, s.buf.clone().expect("grown above"))
        };
        let block = MetalBlock { pool: self.clone(), index };
        let units = self.block_bytes / self.unit_bytes;
        self.copy((&buf, 0), (&buf, self.address(index)), 1, units, 0, 0, units)?;
        Ok(block)
    }

    /// A fresh block holding a copy of `block`.
    pub fn copy_of(self: &Arc<Self>, block: &MetalBlock<D>) -> Result<MetalBlock<D>, KvError> {
        let fresh = self.take()?;
        let buf = self.buffer().map_err(|e| kv_err("copy", e))?;
        let units = self.block_bytes / self.unit_bytes;
        self.copy(
            (&buf, self.address(block.index)),
            (&buf, self.address(fresh.index)),
            1,
            units,
            units,
            0,
            0,
        )?;
        Ok(fresh)
    }

    /// Byte offset of block `index` in the buffer.
    pub fn address(&self, index: usize) -> usize {
        index * self.block_bytes
    }

    pub fn owns(self: &Arc<Self>, block: &MetalBlock<D>) -> bool {
        Arc::ptr_eq(self, &block.pool)
    }

    pub fn metal(&self) -> &Arc<Metal<D>> {
        &self.metal
    }
}
