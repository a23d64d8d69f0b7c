//! Host K/V in fixed-size blocks: the storage under [`crate::HostKv`] and
//! [`crate::QuantKv`].
//!
//! A row's slots live in blocks of `block` positions (a power of two), listed in logical
//! order in the row's *block table*: slot `s` is position `s % block` of block `s / block`.
//! A block holds every layer's K and V for its positions, `[layer][K, V][position][units]`,
//! so one table serves all layers. Blocks are reference counted: a block table can hold a
//! block another row or the prefix cache holds too ([`Paged::share`], [`Paged::adopt`]),
//! and any write into a shared block copies it first (copy-on-write), so a holder never
//! sees another's writes. Sharing is exact because a block's K/V is a pure function of the
//! token prefix it ends (docs/design.md): two rows with the same prefix would have
//! written the same bytes.
//!
//! Attention reads a position's K or V row by logical position through the table
//! ([`Paged::row`]), in the same order as from contiguous storage, so the block size
//! changes no bit.

use std::cell::UnsafeCell;
use std::sync::Arc;

use crate::block_table;
use crate::store::{KvBlock, KvError, KvUnit};

/// Positions per block by default: a multiple of every backend's attention key chunk (the
/// CPU's 32, the GPUs' 64), so chunk boundaries stay anchored at logical position 0.
pub const BLOCK_POSITIONS: usize = 64;

/// `KvStore` for a host store whose slots are its `paged` field's block table: every slot
/// operation is the table's (`HostKv`, `QuantKv`).
macro_rules! paged_kv_store {
    (impl<$($g:ident: $b:path),*> for $ty:ty) => {
        impl<$($g: $b),*> $crate::store::KvStore for $ty {
            fn grow(&mut self, slots: usize) -> Result<(), $crate::store::KvError> {
                self.paged.grow(slots)
            }

            fn truncate(&mut self, slots: usize) {
                self.paged.truncate(slots)
            }

            fn reserve(&mut self, slots: usize) -> Result<(), $crate::store::KvError> {
                self.paged.reserve(slots)
            }

            fn move_down(&mut self, from: usize, to: usize, n: usize) {
                self.paged.move_down(from, to, n).expect("host K/V: copying a shared block");
            }

            fn bytes(&self) -> usize {
                self.paged.bytes()
            }

            fn read(&self, layer: usize, n: usize) -> Result<(Vec<u8>, Vec<u8>), $crate::store::KvError> {
                use $crate::paged::Half;
                Ok((self.paged.read_half(layer, Half::K, n), self.paged.read_half(layer, Half::V, n)))
            }

            fn write_bytes(
                &mut self,
                layer: usize,
                slot: usize,
                k: &[u8],
                v: &[u8],
            ) -> Result<(), $crate::store::KvError> {
                self.paged.write_bytes(layer, slot, k, v)
            }

            fn try_clone(&self) -> Result<Box<dyn $crate::store::KvStore>, $crate::store::KvError> {
                Ok(Box::new(self.clone()))
            }

            fn as_any(&self) -> &dyn std::any::Any {
                self
            }

            fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
                self
            }

            fn block_positions(&self) -> Option<usize> {
                Some(self.paged.block())
            }

            fn share_blocks(
                &self,
                first: usize,
                n: usize,
            ) -> Result<Vec<$crate::store::KvBlock>, $crate::store::KvError> {
                self.paged.share(first, n)
            }

            fn adopt_blocks(
                &mut self,
                blocks: &[$crate::store::KvBlock],
                slots: usize,
            ) -> Result<(), $crate::store::KvError> {
                self.paged.adopt(blocks, slots)
            }

            fn for_each_allocation(&self, f: &mut dyn FnMut(usize, usize)) {
                self.paged.for_each_block(f)
            }

            fn last_block_shared(&self) -> bool {
                self.paged.last_block_shared()
            }
        }
    };
}

pub(crate) use paged_kv_store;

/// One block's K and V, `[layer][K, V][position][units]`.
pub(crate) struct Block<E> {
    // Mutated only through `&mut Block` (an unshared `Arc`, by `Arc::get_mut`), except by
    // the test-only fault `negative_control::set_write_shared_in_place`.
    data: UnsafeCell<Box<[E]>>,
}

// SAFETY: a block's data is written only through `&mut Block` or, under the test-only
// fault, while no reference into it is alive (writes and reads are separate phases of a
// forward); otherwise it is shared read-only.
unsafe impl<E: Sync> Sync for Block<E> {}

impl<E: KvUnit> Block<E> {
    fn zeroed(len: usize) -> Result<Block<E>, KvError> {
        let mut v = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|e| KvError(format!("cannot allocate a {}-byte host K/V block: {e}", len * E::BYTES)))?;
        v.resize(len, E::default());
        Ok(Block { data: UnsafeCell::new(v.into_boxed_slice()) })
    }

    fn values(&self) -> &[E] {
        // SAFETY: see the `Sync` impl: no `&mut` into the data is alive while `&self` reads.
        unsafe { &*self.data.get() }
    }

    fn values_mut(&mut self) -> &mut [E] {
        self.data.get_mut()
    }

    fn try_copy(&self) -> Result<Block<E>, KvError> {
        let mut b = Block::zeroed(self.values().len())?;
        b.values_mut().copy_from_slice(self.values());
        Ok(b)
    }
}

/// A row's block table and the blocks' shape.
pub struct Paged<E> {
    table: Vec<Arc<Block<E>>>,
    held: usize,
    n_layers: usize,
    units: usize,
    shift: u32,
}

impl<E> Clone for Paged<E> {
    /// Another table holding the same blocks: the first write into one copies it.
    fn clone(&self) -> Self {
        Paged { table: self.table.clone(), ..*self }
    }
}

impl<E> std::fmt::Debug for Paged<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Paged").field("held", &self.held).field("blocks", &self.table.len()).finish()
    }
}

/// Which half of a layer a row is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Half {
    K = 0,
    V = 1,
}

impl<E: KvUnit> Paged<E> {
    /// An empty table of `n_layers` layers, `units` values a slot, in blocks of `block`
    /// positions (a power of two).
    pub fn new(n_layers: usize, units: usize, block: usize) -> Paged<E> {
        assert!(block.is_power_of_two(), "K/V blocks hold a power of two positions (got {block})");
        Paged { table: Vec::new(), held: 0, n_layers, units, shift: block.trailing_zeros() }
    }

    /// Positions per block.
    pub fn block(&self) -> usize {
        1 << self.shift
    }

    /// Values per slot and layer.
    pub fn units(&self) -> usize {
        self.units
    }

    /// Slots held.
    pub fn held(&self) -> usize {
        self.held
    }

    fn block_len(&self) -> usize {
        self.n_layers * 2 * self.block() * self.units
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.block_len() * E::BYTES
    }

    #[inline(always)]
    fn offset(&self, layer: usize, half: Half, slot: usize) -> usize {
        (((layer << 1) | half as usize) * self.block() + (slot & (self.block() - 1))) * self.units
    }

    /// The `units` values of `slot` (held) in `half` of `layer`.
    ///
    /// # Panics
    /// If `slot` is past the table or `layer` past the layers.
    #[inline(always)]
    pub(crate) fn row(&self, layer: usize, half: Half, slot: usize) -> &[E] {
        assert!(layer < self.n_layers, "K/V layer {layer} of {}", self.n_layers);
        let at = self.offset(layer, half, slot);
        let values = self.table[slot >> self.shift].values();
        debug_assert!(at + self.units <= values.len());
        // SAFETY: `layer < n_layers` and `slot % block < block`, so `at + units` is within
        // the block's `n_layers * 2 * block * units` values.
        unsafe { values.get_unchecked(at..at + self.units) }
    }

    /// Rows `[slot, slot + n)` of `half` of `layer` as one slice (first row's start to the
    /// last row's end), when they lie in one block.
    #[inline(always)]
    pub(crate) fn run(&self, layer: usize, half: Half, slot: usize, n: usize) -> Option<&[E]> {
        if n == 0 || slot >> self.shift != (slot + n - 1) >> self.shift || slot + n > self.held {
            return None;
        }
        let at = self.offset(layer, half, slot);
        self.table[slot >> self.shift].values().get(at..at + n * self.units)
    }

    /// Block `b` of the table for writing: copied first when another table holds it too.
    fn block_mut(&mut self, b: usize) -> Result<&mut [E], KvError> {
        if Arc::get_mut(&mut self.table[b]).is_none() {
            if crate::negative_control::write_shared_in_place() {
                // SAFETY (test-only fault): the forward writes while no reader holds a slice.
                return Ok(unsafe { &mut *self.table[b].data.get() });
            }
            let copy = self.table[b].try_copy()?;
            self.table[b] = Arc::new(copy);
        }
        Ok(Arc::get_mut(&mut self.table[b]).expect("unshared after the copy").values_mut())
    }

    /// The values of `slot` (held) in `half` of `layer`, for writing.
    pub(crate) fn row_mut(&mut self, layer: usize, half: Half, slot: usize) -> Result<&mut [E], KvError> {
        let (at, units) = (self.offset(layer, half, slot), self.units);
        Ok(&mut self.block_mut(slot >> self.shift)?[at..at + units])
    }

    /// Holds `slots` slots; new slots read as zeros. Fails, leaving the table as it was,
    /// when memory runs out.
    pub fn grow(&mut self, slots: usize) -> Result<(), KvError> {
        if slots <= self.held {
            return Ok(());
        }
        let blocks = slots.div_ceil(self.block());
        let mut fresh = Vec::new();
        fresh.try_reserve_exact(blocks.saturating_sub(self.table.len())).map_err(|e| {
            KvError(format!("cannot allocate a block table of {blocks} host K/V blocks: {e}"))
        })?;
        for _ in self.table.len()..blocks {
            fresh.push(Arc::new(Block::zeroed(self.block_len())?));
        }
        self.table.try_reserve(fresh.len()).map_err(|e| KvError(format!("host K/V block table: {e}")))?;
        // Slots past the held ones in the last held block may keep what a rollback left.
        let stale_end = slots.min(self.table.len() * self.block());
        for slot in self.held..stale_end {
            for layer in 0..self.n_layers {
                for half in [Half::K, Half::V] {
                    self.row_mut(layer, half, slot)?.fill(E::default());
                }
            }
        }
        self.table.extend(fresh);
        self.held = slots;
        Ok(())
    }

    /// Drops every slot from `slots` on (and the blocks left empty).
    pub fn truncate(&mut self, slots: usize) {
        self.held = self.held.min(slots);
        self.table.truncate(self.held.div_ceil(self.block()));
    }

    /// Makes room in the table for `slots` slots.
    pub fn reserve(&mut self, slots: usize) -> Result<(), KvError> {
        let blocks = slots.div_ceil(self.block()).saturating_sub(self.table.len());
        self.table.try_reserve(blocks).map_err(|e| KvError(format!("host K/V block table: {e}")))
    }

    /// Copies slots `[from, from + n)` to `[to, to + n)` in every layer, `to < from`.
    pub fn move_down(&mut self, from: usize, to: usize, n: usize) -> Result<(), KvError> {
        let mut buf = vec![E::default(); self.units];
        for i in 0..n {
            for layer in 0..self.n_layers {
                for half in [Half::K, Half::V] {
                    buf.copy_from_slice(self.row(layer, half, from + i));
                    self.row_mut(layer, half, to + i)?.copy_from_slice(&buf);
                }
            }
        }
        Ok(())
    }

    /// Bytes of the blocks in the table (a block another table holds too counted here as
    /// well: [`Paged::for_each_block`] tells them apart).
    pub fn bytes(&self) -> usize {
        self.table.len() * self.block_bytes()
    }

    /// Whether the table's last block is held elsewhere too (its next write copies it).
    pub fn last_block_shared(&self) -> bool {
        block_table::last_shared(&self.table)
    }

    /// Calls `f(id, bytes)` for each block in the table: the same id wherever a block is
    /// shared.
    pub fn for_each_block(&self, f: &mut dyn FnMut(usize, usize)) {
        block_table::for_each(&self.table, self.block_bytes(), f)
    }

    /// Slots `[0, n)` of `half` of `layer`, little-endian, as stored.
    pub(crate) fn read_half(&self, layer: usize, half: Half, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * self.units * E::BYTES);
        for slot in 0..n {
            self.row(layer, half, slot).iter().for_each(|e| e.put_le(&mut out));
        }
        out
    }

    /// Writes slots from `slot` on of `layer` from bytes as [`Paged::read_half`] gives them.
    pub(crate) fn write_bytes(
        &mut self,
        layer: usize,
        slot: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), KvError> {
        let slot_bytes = (self.units * E::BYTES).max(1);
        let n = k.len() / slot_bytes;
        if k.len() != v.len() || !k.len().is_multiple_of(slot_bytes) || slot + n > self.held {
            return Err(KvError(format!(
                "host KV: cannot write {} K and {} V bytes at slot {slot} of a store holding {} slots of {slot_bytes} bytes",
                k.len(),
                v.len(),
                self.held,
            )));
        }
        for (half, src) in [(Half::K, k), (Half::V, v)] {
            for (i, bytes) in src.chunks_exact(slot_bytes).enumerate() {
                let row = self.row_mut(layer, half, slot + i)?;
                row.iter_mut().zip(bytes.chunks_exact(E::BYTES)).for_each(|(d, b)| *d = E::from_le(b));
            }
        }
        Ok(())
    }

    /// Blocks `[first, first + n)` of the table, shared (the last may be partly held).
    pub fn share(&self, first: usize, n: usize) -> Result<Vec<KvBlock>, KvError> {
        block_table::share(&self.table, first, n, self.block_bytes(), self.held, "host KV")
    }

    /// Appends shared blocks (made by [`Paged::share`] of a table of this shape) after the
    /// held slots (`block_table::adopt`).
    pub fn adopt(&mut self, blocks: &[KvBlock], slots: usize) -> Result<(), KvError> {
        let (len, block) = (self.block_len(), self.block());
        let fits = |b: &Arc<Block<E>>| b.values().len() == len;
        self.held = block_table::adopt(&mut self.table, self.held, block, blocks, slots, fits, "host KV")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn val(slot: usize, layer: usize, half: Half, u: usize) -> f32 {
        (slot * 1000 + layer * 100 + half as usize * 10 + u) as f32
    }

    fn filled(block: usize, slots: usize) -> Paged<f32> {
        let mut p = Paged::new(2, 3, block);
        p.grow(slots).unwrap();
        for s in 0..slots {
            for l in 0..2 {
                for h in [Half::K, Half::V] {
                    let row = p.row_mut(l, h, s).unwrap();
                    row.iter_mut().enumerate().for_each(|(u, x)| *x = val(s, l, h, u));
                }
            }
        }
        p
    }

    /// Every block size reads back every slot's values, the same bytes as contiguous
    /// storage would hold.
    #[test]
    fn any_block_size_reads_the_same_bytes() {
        let reference = filled(1 << 10, 37);
        for block in [1, 2, 4, 16, 64] {
            let p = filled(block, 37);
            assert_eq!(p.table.len(), 37usize.div_ceil(block));
            for l in 0..2 {
                for h in [Half::K, Half::V] {
                    assert_eq!(p.read_half(l, h, 37), reference.read_half(l, h, 37), "block {block}");
                }
            }
        }
    }

    #[test]
    fn a_write_into_a_shared_block_copies_it() {
        let a = filled(4, 8);
        let mut b = a.clone();
        b.row_mut(1, Half::V, 5).unwrap()[0] = -1.0;
        assert_eq!(a.row(1, Half::V, 5)[0], val(5, 1, Half::V, 0), "the other holder kept its bytes");
        assert_eq!(b.row(1, Half::V, 5)[0], -1.0);
        let ids = |p: &Paged<f32>| {
            let mut v = Vec::new();
            p.for_each_block(&mut |id, _| v.push(id));
            v
        };
        let (ia, ib) = (ids(&a), ids(&b));
        assert_eq!(ia[0], ib[0], "the untouched block is still shared");
        assert_ne!(ia[1], ib[1], "the written block was copied");
    }

    #[test]
    fn negative_control_writing_a_shared_block_in_place_leaks_into_its_holders() {
        let a = filled(4, 8);
        let mut b = a.clone();
        crate::negative_control::set_write_shared_in_place(true);
        b.row_mut(1, Half::V, 5).unwrap()[0] = -1.0;
        crate::negative_control::set_write_shared_in_place(false);
        assert_eq!(a.row(1, Half::V, 5)[0], -1.0);
    }

    #[test]
    fn shared_blocks_adopted_read_as_their_source() {
        let a = filled(4, 10);
        let mut b: Paged<f32> = Paged::new(2, 3, 4);
        b.adopt(&a.share(0, 2).unwrap(), 8).unwrap();
        assert_eq!(b.held(), 8);
        assert_eq!(b.read_half(0, Half::K, 8), a.read_half(0, Half::K, 8));
        assert!(a.share(2, 2).is_err(), "block 3 is not held");
        assert!(b.adopt(&filled(8, 8).share(0, 1).unwrap(), 8).is_err(), "another shape");
        // Growing past the shared blocks and rolling back into them keeps the source intact.
        b.grow(12).unwrap();
        b.truncate(6);
        b.grow(8).unwrap();
        assert_eq!(b.row(0, Half::K, 7), &[0.0; 3], "slots past a rollback read as zeros");
        assert_eq!(a.row(0, Half::K, 7)[0], val(7, 0, Half::K, 0));
    }

    /// A partly held block adopted by two tables: each one's writes past its held slots
    /// go to its own copy, and the zeros a new slot reads are its own too.
    #[test]
    fn a_partly_held_block_is_copied_on_first_write() {
        let a = filled(4, 6);
        let (mut b, mut c): (Paged<f32>, Paged<f32>) = (Paged::new(2, 3, 4), Paged::new(2, 3, 4));
        b.adopt(&a.share(0, 2).unwrap(), 5).unwrap();
        c.adopt(&a.share(0, 2).unwrap(), 6).unwrap();
        assert!(b.adopt(&a.share(0, 2).unwrap(), 3).is_err(), "a block wholly past the held slots");
        b.grow(7).unwrap();
        b.row_mut(0, Half::K, 6).unwrap()[0] = -6.0;
        assert_eq!(b.row(0, Half::K, 5), &[0.0; 3], "a new slot reads as zeros");
        assert_eq!(c.row(0, Half::K, 5)[0], val(5, 0, Half::K, 0), "the other holder kept slot 5");
        assert_eq!(a.row(0, Half::K, 5)[0], val(5, 0, Half::K, 0));
    }

    #[test]
    fn truncate_frees_whole_blocks_only() {
        let mut p = filled(4, 10);
        p.truncate(5);
        assert_eq!((p.held(), p.table.len()), (5, 2));
        p.truncate(4);
        assert_eq!(p.table.len(), 1);
        p.move_down(3, 0, 1).unwrap();
        assert_eq!(p.row(1, Half::K, 0)[2], val(3, 1, Half::K, 2));
    }
}
