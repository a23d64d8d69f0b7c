//! Where a row's K/V bytes live. [`crate::RowCache`] keeps the logic (logical length,
//! window, rollback); a [`KvStore`] only holds slots: host memory in blocks here
//! ([`HostKv`], over [`crate::paged`]), device memory in a GPU backend.

use std::any::Any;
use std::sync::Arc;

use crate::paged::{Half, Paged, BLOCK_POSITIONS};

/// A failed K/V allocation or device transfer, in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvError(pub String);

impl std::fmt::Display for KvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KvError {}

/// Slots of K and V for every layer of one row. A slot holds one position's K (or V) for
/// all KV heads; slot `s` of every layer is held when `s < slots()`.
pub trait KvStore: Send + Sync + 'static {
    /// Holds `slots` slots; new slots read as zeros. Fails (leaving the store as it was)
    /// when memory runs out.
    fn grow(&mut self, slots: usize) -> Result<(), KvError>;
    /// Drops every slot from `slots` on.
    fn truncate(&mut self, slots: usize);
    /// Makes room for `slots` slots without changing what is held.
    fn reserve(&mut self, slots: usize) -> Result<(), KvError>;
    /// Copies slots `[from, from + n)` to `[to, to + n)` in every layer, `to < from`
    /// (the ranges may overlap).
    fn move_down(&mut self, from: usize, to: usize, n: usize);
    /// Bytes allocated for K and V.
    fn bytes(&self) -> usize;
    /// Bytes of slots `[0, n)` of `layer`'s K and V, as stored.
    fn read(&self, layer: usize, n: usize) -> Result<(Vec<u8>, Vec<u8>), KvError>;
    /// Writes slots `[slot, slot + n)` of `layer` from bytes as [`KvStore::read`] gives
    /// them (the slots must be held; `k` and `v` hold whole slots).
    fn write_bytes(&mut self, layer: usize, slot: usize, k: &[u8], v: &[u8]) -> Result<(), KvError>;
    /// A copy of this store (a paged host store shares its blocks until either writes).
    fn try_clone(&self) -> Result<Box<dyn KvStore>, KvError>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;

    /// Positions per block where the store keeps K/V in shareable blocks (a paged host
    /// store, CUDA's and Metal's), `None` where it does not.
    fn block_positions(&self) -> Option<usize> {
        None
    }

    /// Blocks `[first, first + n)` of held slots themselves (the last may be held in
    /// part), shared, for another row of the same shape to append (only where
    /// [`KvStore::block_positions`] is some).
    fn share_blocks(&self, first: usize, n: usize) -> Result<Vec<KvBlock>, KvError> {
        let _ = (first, n);
        Err(KvError("this K/V store does not share blocks".into()))
    }

    /// Appends blocks from [`KvStore::share_blocks`] of a store of the same shape after the
    /// held slots, which end on a block boundary; the first `slots` of them become held
    /// (the last block may be held in part).
    fn adopt_blocks(&mut self, blocks: &[KvBlock], slots: usize) -> Result<(), KvError> {
        let _ = (blocks, slots);
        Err(KvError("this K/V store does not share blocks".into()))
    }

    /// Calls `f(id, bytes)` for each allocation the store holds, with one id wherever an
    /// allocation is shared: what counting physical bytes (a shared block once) needs.
    fn for_each_allocation(&self, f: &mut dyn FnMut(usize, usize)) {
        f(self as *const Self as *const () as usize, self.bytes())
    }

    /// Whether the block holding the last held slot is shared, so that the next write
    /// into it copies it first (false where the store does not share blocks).
    fn last_block_shared(&self) -> bool {
        false
    }
}

/// Held K/V of some positions, in a form another row of the same shape can append: a
/// reference-counted block of a paged store, or a copy of another store's bytes
/// (`RowCache::share_blocks`).
#[derive(Clone)]
pub struct KvBlock {
    inner: Arc<dyn Any + Send + Sync>,
    bytes: usize,
}

impl std::fmt::Debug for KvBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvBlock").field("id", &self.id()).field("bytes", &self.bytes).finish()
    }
}

impl KvBlock {
    /// A store's block of `bytes` bytes as a shareable handle (`KvStore::share_blocks`).
    pub fn new<T: Any + Send + Sync>(inner: Arc<T>, bytes: usize) -> KvBlock {
        KvBlock { inner, bytes }
    }

    /// The store's own block, when it is a `T` (`KvStore::adopt_blocks`).
    pub fn downcast<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.inner.clone().downcast::<T>().ok()
    }

    pub(crate) fn inner_ref<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.inner.downcast_ref::<T>()
    }

    /// Bytes of K/V the block holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether another holder (a row, another cache entry) holds this block too: dropping
    /// this reference then frees nothing.
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.inner) > 1
    }

    /// The same for every holder of this block (as [`KvStore::for_each_allocation`] gives).
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as *const () as usize
    }
}

/// A value as a host store keeps it, with its little-endian bytes.
pub trait KvUnit: Copy + Default + std::fmt::Debug + Send + Sync + 'static {
    /// Bytes of one value as stored.
    const BYTES: usize;
    /// Appends the value's `BYTES` little-endian bytes.
    fn put_le(self, out: &mut Vec<u8>);
    /// The value from its `BYTES` little-endian bytes.
    fn from_le(b: &[u8]) -> Self;
}

impl KvUnit for u8 {
    const BYTES: usize = 1;
    fn put_le(self, out: &mut Vec<u8>) {
        out.push(self)
    }
    fn from_le(b: &[u8]) -> u8 {
        b[0]
    }
}

/// One stored K or V value of a host store: f32, or bf16 (`--kv-dtype bf16`: each value
/// rounded to nearest-even as it is written, half the bytes).
pub trait KvElem: KvUnit {
    fn from_f32(x: f32) -> Self;
}

impl KvUnit for f32 {
    const BYTES: usize = 4;
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes())
    }
    fn from_le(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl KvElem for f32 {
    #[inline]
    fn from_f32(x: f32) -> f32 {
        x
    }
}

impl KvUnit for half::bf16 {
    const BYTES: usize = 2;
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes())
    }
    fn from_le(b: &[u8]) -> half::bf16 {
        half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
}

impl KvElem for half::bf16 {
    #[inline]
    fn from_f32(x: f32) -> half::bf16 {
        half::bf16::from_f32(x)
    }
}

/// K/V in host memory, in blocks of positions ([`crate::paged`]): the CPU backend's store,
/// f32 by default or bf16 ([`Bf16Kv`]).
#[derive(Clone, Debug)]
pub struct HostKv<T: KvElem = f32> {
    pub(crate) paged: Paged<T>,
}

/// bf16 K/V in host memory (`--kv-dtype bf16` on the CPU).
pub type Bf16Kv = HostKv<half::bf16>;

impl<T: KvElem> HostKv<T> {
    /// An empty store in blocks of [`BLOCK_POSITIONS`].
    pub fn new(n_layers: usize, stride: usize) -> Self {
        HostKv::with_block(n_layers, stride, BLOCK_POSITIONS)
    }

    /// An empty store in blocks of `block` positions (a power of two).
    pub fn with_block(n_layers: usize, stride: usize, block: usize) -> Self {
        HostKv { paged: Paged::new(n_layers, stride, block) }
    }

    /// Values per slot and layer.
    pub fn stride(&self) -> usize {
        self.paged.units()
    }

    /// Writes whole slots of `layer` starting at `slot` (which must be held), each value
    /// converted to the stored type (a shared block is copied first).
    ///
    /// # Panics
    /// If the slots are not held, or copying a shared block runs out of memory.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        assert_eq!(k.len(), v.len(), "HostKv::write: K and V differ");
        let stride = self.stride().max(1);
        for (half, src) in [(Half::K, k), (Half::V, v)] {
            for (i, vals) in src.chunks_exact(stride).enumerate() {
                let row = self.paged.row_mut(layer, half, slot + i).expect("HostKv::write: host K/V block");
                row.iter_mut().zip(vals).for_each(|(d, &x)| *d = T::from_f32(x));
            }
        }
    }
}

crate::paged::paged_kv_store!(impl<T: KvElem> for HostKv<T>);
