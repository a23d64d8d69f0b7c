//! Per-row KV cache.
//!
//! Contract (the layout invariant): between forwards, a row's K/V for logical positions
//! `[0, len)` sit contiguously at slots `[0, len)` of its own store, and nothing else is
//! held. Where the bytes live (host memory, device memory) and in which dtype is the
//! [`KvStore`]'s business; the logic below is the same for every backend.
//!
//! A forward writes a *window* of new positions `[len, len + t)` at physical slots
//! `[base, base + t)` with `base >= len` (the caller picks `base`: the row's own tail, or a
//! slot shared by every row of a batch, which leaves a hole `[len, base)`). Reads go
//! through a [`SlotMap`], which maps logical positions to slots. [`RowCache::commit_window`]
//! keeps the first `keep` window positions, moves them down to `[len, len + keep)`
//! (compacting the hole) and frees everything after: that is rollback after a partial
//! accept. Memory follows the row's own length, never the longest row's.
//!
//! Sliding-window layers (Gemma-style) live in an optional second store, the *ring*: it
//! keeps only the last `cap` committed positions of each of its layers, position `p` at
//! slot `p % cap`, with the open window after them. Committing copies the kept window
//! positions into their ring slots, so after every round the ring's bytes are a function
//! of the row's prefix alone, however the window wrapped. Memory per row for those layers
//! is bounded by the window, not the row's length.

pub mod block_table;
mod paged;
mod quant;
mod ranks;
mod store;

pub use paged::BLOCK_POSITIONS;
use paged::{Half, Paged};
pub use quant::{QuantKv, QuantLayout};
pub use ranks::RankKv;
pub use store::{Bf16Kv, HostKv, KvBlock, KvElem, KvError, KvStore, KvUnit};

/// One row's K/V for every layer.
pub struct RowCache {
    store: Box<dyn KvStore>,
    n_layers: usize,
    len: usize,
    stride: usize,
    window: Window,
    ring: Option<Ring>,
}

/// The sliding-window layers' store: the last `cap` committed positions, then the window.
struct Ring {
    store: Box<dyn KvStore>,
    n_layers: usize,
    stride: usize,
    cap: usize,
}

impl Ring {
    /// Slots holding committed positions when the row is `len` long.
    fn held(&self, len: usize) -> usize {
        len.min(self.cap)
    }
}

impl std::fmt::Debug for RowCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowCache")
            .field("len", &self.len)
            .field("window_base", &self.window.base)
            .field("window_len", &self.window.len)
            .field("bytes", &self.store.bytes())
            .finish()
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Window {
    base: usize,
    len: usize,
}

/// Where logical positions of a row sit among its slots: committed positions at their own
/// slot, the open window's from `base` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotMap {
    pub committed: usize,
    pub base: usize,
    /// A ring's capacity (committed position `p` at slot `p % ring`), 0 for a plain store.
    pub ring: usize,
}

impl SlotMap {
    #[inline]
    pub fn slot(&self, pos: usize) -> usize {
        if pos >= self.committed {
            self.base + (pos - self.committed)
        } else if self.ring == 0 {
            pos
        } else {
            debug_assert!(pos + self.ring >= self.committed, "position {pos} left the ring");
            pos % self.ring
        }
    }

    /// The first logical position still readable (0 for a plain store).
    pub fn first_held(&self) -> usize {
        if self.ring == 0 {
            0
        } else {
            self.committed.saturating_sub(self.ring)
        }
    }
}

/// Read access to one layer of a host row: committed positions plus the open window.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    data: Data<'a>,
    stride: usize,
    map: SlotMap,
}

#[derive(Clone, Copy, Debug)]
enum Data<'a> {
    F32(Rows<'a, f32>),
    Bf16(Rows<'a, half::bf16>),
    Quant(Rows<'a, u8>, QuantLayout),
}

/// Where a view's slots are: contiguous K and V (`[slot][units]`), or one layer of a
/// block table.
#[derive(Debug)]
enum Rows<'a, T> {
    Flat { k: &'a [T], v: &'a [T] },
    Paged { store: &'a Paged<T>, layer: usize },
}

impl<T> Clone for Rows<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Rows<'_, T> {}

impl<'a, T: KvUnit> Rows<'a, T> {
    /// The `units` values of K (or V) at `slot`.
    #[inline(always)]
    fn row(self, slot: usize, key: bool, units: usize) -> &'a [T] {
        match self {
            Rows::Flat { k, v } => &(if key { k } else { v })[slot * units..(slot + 1) * units],
            Rows::Paged { store, layer } => store.row(layer, if key { Half::K } else { Half::V }, slot),
        }
    }

    /// Rows `[slot, slot + n)` (in one block) as one slice from the first row's start to the
    /// last row's end, rows `units` apart; `None` when they span blocks.
    #[inline(always)]
    fn run(self, slot: usize, n: usize, key: bool, units: usize) -> Option<&'a [T]> {
        match self {
            Rows::Flat { k, v } => Some(&(if key { k } else { v })[slot * units..(slot + n) * units]),
            Rows::Paged { store, layer } => store.run(layer, if key { Half::K } else { Half::V }, slot, n),
        }
    }

    fn slots(self, units: usize) -> usize {
        match self {
            Rows::Flat { k, .. } => k.len() / units.max(1),
            Rows::Paged { store, .. } => store.held(),
        }
    }
}

impl<'a> KvView<'a> {
    /// A view of plain contiguous K/V (`[pos][stride]`), logical position = slot.
    pub fn contiguous(k: &'a [f32], v: &'a [f32], stride: usize) -> Self {
        let n = k.len() / stride.max(1);
        KvView {
            data: Data::F32(Rows::Flat { k, v }),
            stride,
            map: SlotMap { committed: n, base: n, ring: 0 },
        }
    }

    /// Layer `layer` of a host store, read through `map`.
    pub fn of(store: &'a HostKv, layer: usize, map: SlotMap) -> Self {
        KvView { data: Data::F32(Rows::Paged { store: &store.paged, layer }), stride: store.stride(), map }
    }

    /// Layer `layer` of a bf16 host store, read through `map`.
    pub fn of_bf16(store: &'a Bf16Kv, layer: usize, map: SlotMap) -> Self {
        KvView { data: Data::Bf16(Rows::Paged { store: &store.paged, layer }), stride: store.stride(), map }
    }

    /// Layer `layer` of a host store, f32, bf16 or quantized, read through `map` (`None`
    /// for a device store).
    pub fn of_store(store: &'a dyn KvStore, layer: usize, map: SlotMap) -> Option<Self> {
        let any = store.as_any();
        if let Some(host) = any.downcast_ref::<HostKv>() {
            return Some(KvView::of(host, layer, map));
        }
        if let Some(host) = any.downcast_ref::<Bf16Kv>() {
            return Some(KvView::of_bf16(host, layer, map));
        }
        any.downcast_ref::<QuantKv>().map(|q| KvView::of_quant(q, layer, map))
    }

    /// Whether K and V rows can be read as stored (an f32 store through [`KvView::key`],
    /// a bf16 one through [`KvView::key_bf16`] and [`KvView::value_bf16`]): only a
    /// quantized store's reads need a buffer to dequantize into.
    pub fn lends_rows(&self) -> bool {
        !matches!(self.data, Data::Quant(..))
    }

    /// K of logical position `pos`, values `[off, off + len)`, as stored in a bf16 store
    /// (`None` for any other): what a kernel widening bf16 as it loads reads directly.
    #[inline(always)]
    pub fn key_bf16(&self, pos: usize, off: usize, len: usize) -> Option<&'a [half::bf16]> {
        self.bf16_row(pos, off, len, true)
    }

    /// V of logical position `pos` as stored in a bf16 store, like [`KvView::key_bf16`].
    #[inline(always)]
    pub fn value_bf16(&self, pos: usize, off: usize, len: usize) -> Option<&'a [half::bf16]> {
        self.bf16_row(pos, off, len, false)
    }

    #[inline(always)]
    fn bf16_row(&self, pos: usize, off: usize, len: usize, key: bool) -> Option<&'a [half::bf16]> {
        match self.data {
            Data::Bf16(rows) => Some(&rows.row(self.map.slot(pos), key, self.stride)[off..off + len]),
            _ => None,
        }
    }

    /// K (or V) of logical positions `[pos, pos + n)` as stored in a bf16 store, when
    /// their rows are evenly spaced (consecutive slots in one block): one slice from the
    /// first row to the end of the last, the rows [`KvView::row_stride`] apart, each row's
    /// values `[off, off + len)` from its start. `None` otherwise (read row by row).
    #[inline(always)]
    pub fn rows_bf16(
        &self,
        pos: usize,
        n: usize,
        off: usize,
        len: usize,
        key: bool,
    ) -> Option<&'a [half::bf16]> {
        let Data::Bf16(rows) = self.data else { return None };
        let slot = self.map.slot(pos);
        if n == 0 || self.map.slot(pos + n - 1) != slot + n - 1 {
            return None;
        }
        let run = rows.run(slot, n, key, self.stride)?;
        Some(&run[off..(n - 1) * self.stride + off + len])
    }

    /// Distance in values between consecutive rows of [`KvView::rows_bf16`].
    pub fn row_stride(&self) -> usize {
        self.stride
    }

    /// Layer `layer` of a quantized host store, read through `map`.
    pub fn of_quant(store: &'a QuantKv, layer: usize, map: SlotMap) -> Self {
        let layout = store.layout();
        KvView {
            data: Data::Quant(Rows::Paged { store: store.paged(), layer }, layout),
            stride: layout.heads * layout.head_dim,
            map,
        }
    }

    /// Positions readable through this view.
    pub fn len(&self) -> usize {
        let slots = match self.data {
            Data::F32(rows) => rows.slots(self.stride),
            Data::Bf16(rows) => rows.slots(self.stride),
            Data::Quant(rows, layout) => rows.slots(layout.slot_bytes()),
        };
        self.map.committed + slots.saturating_sub(self.map.base)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// K of logical position `pos`, values `[off, off + len)` (one KV head: `off` is a
    /// multiple of `len` = head_dim for a quantized store): a slice of an f32 store, or the
    /// values widened (bf16) or dequantized into `buf` (at least `len` long).
    #[inline(always)]
    pub fn key<'b>(&'b self, pos: usize, off: usize, len: usize, buf: &'b mut [f32]) -> &'b [f32] {
        self.read(pos, off, len, buf, true)
    }

    /// V of logical position `pos`, like [`KvView::key`].
    #[inline(always)]
    pub fn value<'b>(&'b self, pos: usize, off: usize, len: usize, buf: &'b mut [f32]) -> &'b [f32] {
        self.read(pos, off, len, buf, false)
    }

    #[inline(always)]
    fn read<'b>(&'b self, pos: usize, off: usize, len: usize, buf: &'b mut [f32], key: bool) -> &'b [f32] {
        match self.data {
            Data::F32(rows) => &rows.row(self.map.slot(pos), key, self.stride)[off..off + len],
            _ => self.read_into(pos, off, len, buf, key),
        }
    }

    /// [`KvView::read`] of a store that widens or dequantizes into `buf`: apart, so the f32
    /// store's lending inlines into the attention loop (one call per key and value row).
    #[inline(never)]
    fn read_into<'b>(
        &'b self,
        pos: usize,
        off: usize,
        len: usize,
        buf: &'b mut [f32],
        key: bool,
    ) -> &'b [f32] {
        let slot = self.map.slot(pos);
        match self.data {
            // Not taken (`read` lends an f32 store's rows before calling this); lent the same way.
            Data::F32(..) => self.read(pos, off, len, buf, key),
            Data::Bf16(rows) => {
                let src = &rows.row(slot, key, self.stride)[off..off + len];
                buf[..len].iter_mut().zip(src).for_each(|(o, x)| *o = x.to_f32());
                &buf[..len]
            }
            Data::Quant(rows, layout) => {
                debug_assert!(
                    len == layout.head_dim && off.is_multiple_of(len),
                    "quantized K/V are read a head at a time"
                );
                let at = off / layout.head_dim * layout.head_bytes();
                let g = &rows.row(slot, key, layout.slot_bytes())[at..at + layout.head_bytes()];
                layout.dequantize_head(g, &mut buf[..len]);
                &buf[..len]
            }
        }
    }
}

impl RowCache {
    /// An empty host (f32) cache for `n_layers` layers of `stride = n_kv_heads * head_dim`
    /// floats per position.
    pub fn new(n_layers: usize, stride: usize) -> Self {
        RowCache::with_store(Box::new(HostKv::<f32>::new(n_layers, stride)), n_layers, stride)
    }

    /// An empty cache whose bytes live in `store` (a backend's device memory).
    pub fn with_store(store: Box<dyn KvStore>, n_layers: usize, stride: usize) -> Self {
        RowCache { store, n_layers, len: 0, stride, window: Window::default(), ring: None }
    }

    /// Adds a ring of `n_layers` sliding-window layers of `stride` values per position
    /// that keeps the last `cap` committed positions (`cap >= 1`).
    pub fn with_ring(mut self, store: Box<dyn KvStore>, n_layers: usize, stride: usize, cap: usize) -> Self {
        assert!(cap > 0, "with_ring: a ring needs at least one slot");
        self.ring = Some(Ring { store, n_layers, stride, cap });
        self
    }

    /// Whether this row keeps sliding-window layers in a ring (whose evicted positions
    /// cannot be rolled back to or copied out).
    pub fn has_ring(&self) -> bool {
        self.ring.is_some()
    }

    /// The ring's store (`None` without a ring).
    pub fn ring_store(&self) -> Option<&dyn KvStore> {
        self.ring.as_ref().map(|r| &*r.store)
    }

    pub fn ring_store_mut(&mut self) -> Option<&mut dyn KvStore> {
        self.ring.as_mut().map(|r| &mut *r.store as &mut dyn KvStore)
    }

    /// Where the ring's committed positions and open window sit (`None` without a ring).
    pub fn ring_map(&self) -> Option<SlotMap> {
        self.ring.as_ref().map(|r| SlotMap { committed: self.len, base: r.held(self.len), ring: r.cap })
    }

    /// Committed positions still held in the ring and the open window of ring layer
    /// `layer`, by logical position, for a host ring (`None` otherwise).
    pub fn ring_view(&self, layer: usize) -> Option<KvView<'_>> {
        let map = self.ring_map()?;
        KvView::of_store(self.ring_store()?, layer, map)
    }

    /// The ring's bytes of `layer` as stored (slots `[0, min(len, cap))`): a function of
    /// the row's prefix, for byte comparisons.
    pub fn ring_bytes(&self, layer: usize) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        match &self.ring {
            Some(r) => r.store.read(layer, r.held(self.len)),
            None => Err(KvError("ring_bytes: this row has no ring".into())),
        }
    }

    /// Layers in the ring (0 without one).
    pub fn ring_layers(&self) -> usize {
        self.ring.as_ref().map_or(0, |r| r.n_layers)
    }

    /// Logical length: positions whose K/V are committed.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Values per position and layer (`n_kv_heads * head_dim`).
    pub fn stride(&self) -> usize {
        self.stride
    }

    pub fn store(&self) -> &dyn KvStore {
        &*self.store
    }

    pub fn store_mut(&mut self) -> &mut dyn KvStore {
        &mut *self.store
    }

    /// Opens a window that the next writes fill at physical slots `[base, ..)`, dropping
    /// any window still open. Slots `[len, base)` become a hole until the commit.
    pub fn begin_window(&mut self, base: usize) {
        assert!(base >= self.len, "begin_window: slot {base} would overwrite committed positions");
        self.store.truncate(self.len);
        if let Some(r) = &mut self.ring {
            r.store.truncate(r.held(self.len));
        }
        self.window = Window { base, len: 0 };
    }

    /// Physical slot where the open window starts.
    pub fn window_base(&self) -> usize {
        self.window.base.max(self.len)
    }

    /// Reserves room for a window of `t` positions at `base` in every layer, reporting
    /// allocation failure instead of aborting the process.
    pub fn try_reserve_window(&mut self, base: usize, t: usize) -> Result<(), KvError> {
        if let Some(r) = &mut self.ring {
            r.store.reserve(r.held(self.len) + t)?;
        }
        self.store.reserve(base.max(self.len) + t)
    }

    /// Sizes the open window to `t` positions (the hole before it reads as zeros, as a
    /// padded tensor would) and returns where logical positions sit: what a forward
    /// calls before writing the window's K/V at slots `[window_base(), window_base() + t)`.
    pub fn open_window(&mut self, t: usize) -> Result<SlotMap, KvError> {
        let base = self.window_base();
        if let Some(r) = &mut self.ring {
            let held = r.held(self.len);
            r.store.truncate(held);
            r.store.grow(held + t)?;
        }
        self.store.truncate(base);
        self.store.grow(base + t)?;
        self.window = Window { base, len: t };
        Ok(self.slot_map())
    }

    /// Where committed positions and the open window sit.
    pub fn slot_map(&self) -> SlotMap {
        SlotMap { committed: self.len, base: self.window_base(), ring: 0 }
    }

    /// Writes the window's K/V for `layer` (whole positions) at the window's slots, in a
    /// host cache (tests and CPU benches; the forward writes through its backend).
    ///
    /// # Panics
    /// If the cache is not a host cache or the host is out of memory.
    pub fn write_window(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        assert_eq!(k.len() % self.stride, 0, "write_window: window is not whole positions");
        let t = k.len() / self.stride;
        if self.window.len != t {
            self.open_window(t).expect("write_window: host KV allocation");
        }
        let base = self.window.base;
        let host = self.store.as_any_mut().downcast_mut::<HostKv>().expect("write_window: host cache");
        host.write(layer, base, k, v);
    }

    /// Writes the window's K/V for ring layer `layer` (whole positions) after the ring's
    /// committed slots, in a host ring (tests and benches), opening the window if needed.
    ///
    /// # Panics
    /// If the row has no host ring or the host is out of memory.
    pub fn write_ring_window(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let stride = self.ring.as_ref().expect("write_ring_window: no ring").stride;
        let t = k.len() / stride;
        if self.window.len != t {
            self.open_window(t).expect("write_ring_window: host KV allocation");
        }
        let base = self.ring_map().map_or(0, |m| m.base);
        let ring = self.ring.as_mut().expect("write_ring_window: no ring");
        let host = ring.store.as_any_mut().downcast_mut::<HostKv>().expect("write_ring_window: host ring");
        host.write(layer, base, k, v);
    }

    /// Positions written into the open window.
    pub fn window_len(&self) -> usize {
        self.window.len
    }

    /// Committed positions plus the open window of `layer`, by logical position, for a host
    /// cache, plain or quantized (`None` for a device cache).
    pub fn view(&self, layer: usize) -> Option<KvView<'_>> {
        KvView::of_store(&*self.store, layer, self.slot_map())
    }

    /// Keeps the first `keep` positions of the open window (rollback of the rest): moves
    /// them to slots `[len, len + keep)`, frees everything after and closes the window.
    pub fn commit_window(&mut self, keep: usize) {
        assert!(
            keep <= self.window.len,
            "commit_window: keeping {keep} of a {}-position window",
            self.window.len
        );
        let from = self.window_base();
        if from != self.len && keep > 0 && !negative_control::skip_compaction() {
            self.store.move_down(from, self.len, keep);
        }
        if let Some(r) = &mut self.ring {
            let held = r.held(self.len);
            // Window position i (logical len + i, at slot held + i) goes to its ring slot,
            // in order: a slot written here never holds a window position not yet copied.
            for i in 0..keep {
                let slot = (self.len + i) % r.cap;
                if slot != held + i && !negative_control::skip_compaction() {
                    r.store.move_down(held + i, slot, 1);
                }
            }
            r.store.truncate(r.held(self.len + keep));
        }
        self.len += keep;
        self.store.truncate(self.len);
        self.window = Window { base: self.len, len: 0 };
    }

    /// Rolls the row back to its first `len` positions (closing any open window).
    ///
    /// # Panics
    /// If `len` is beyond the row's length, or the row has a ring and `len` is shorter than
    /// its length once the ring has wrapped (the positions it would need are gone).
    pub fn truncate(&mut self, len: usize) {
        assert!(len <= self.len, "truncate: {len} is beyond the row's length {}", self.len);
        if let Some(r) = &mut self.ring {
            assert!(
                len == self.len || self.len <= r.cap,
                "truncate: a sliding-window ring of {} cannot roll back from {} to {len}",
                r.cap,
                self.len
            );
            r.store.truncate(r.held(len));
        }
        self.len = len;
        self.store.truncate(len);
        self.window = Window { base: len, len: 0 };
    }

    /// Whether [`RowCache::truncate`] to `len` is possible.
    pub fn can_truncate(&self, len: usize) -> bool {
        len <= self.len && self.ring.as_ref().is_none_or(|r| len == self.len || self.len <= r.cap)
    }

    /// Bytes of K/V currently held (committed and any open window, hole included).
    pub fn bytes(&self) -> usize {
        self.store.bytes() + self.ring.as_ref().map_or(0, |r| r.store.bytes())
    }

    /// Committed K and V bytes of `layer` (positions `[0, len)`) as stored, for byte
    /// comparisons.
    pub fn committed_bytes(&self, layer: usize) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        self.store.read(layer, self.len)
    }

    /// Positions per block at which this row's committed prefix is shared
    /// ([`RowCache::share_blocks`]): its store's block, or [`BLOCK_POSITIONS`] where the
    /// store copies instead.
    pub fn block_positions(&self) -> usize {
        self.store.block_positions().unwrap_or(BLOCK_POSITIONS)
    }

    /// Blocks `[first, first + n)` of committed positions (block `b` is positions
    /// `[b * bp, (b + 1) * bp)`, `bp` = [`RowCache::block_positions`]; the last may be
    /// committed in part) for another row of the same model to append with
    /// [`RowCache::adopt_blocks`]: the blocks themselves where the store pages on the host
    /// (no copy; the first write into a shared block copies it), a copy of their committed
    /// bytes otherwise.
    pub fn share_blocks(&self, first: usize, n: usize) -> Result<Vec<KvBlock>, KvError> {
        let bp = self.block_positions();
        if self.ring.is_some() {
            return Err(KvError("a row with a sliding-window ring shares no prefix".into()));
        }
        if first.saturating_add(n) > self.len.div_ceil(bp) {
            return Err(KvError(format!(
                "share_blocks: blocks [{first}, {}) of {bp} positions are not committed ({} positions are)",
                first.saturating_add(n),
                self.len
            )));
        }
        match self.store.block_positions() {
            Some(_) => self.store.share_blocks(first, n),
            None => ByteBlock::copy_out(&*self.store, self.n_layers, self.len, first..first + n, bp),
        }
    }

    /// Appends `positions` committed positions from blocks of [`RowCache::share_blocks`]
    /// of a row of the same model (the last block may give only its first positions;
    /// this row's length a whole number of blocks, no window open). A failed append leaves
    /// the row as it was.
    pub fn adopt_blocks(&mut self, blocks: &[KvBlock], positions: usize) -> Result<(), KvError> {
        let bp = self.block_positions();
        if self.ring.is_some() {
            return Err(KvError("a row with a sliding-window ring shares no prefix".into()));
        }
        let whole = blocks.len().saturating_mul(bp);
        if self.window.len != 0
            || !self.len.is_multiple_of(bp)
            || positions > whole
            || positions + bp <= whole
        {
            return Err(KvError(format!(
                "adopt_blocks: {positions} positions from {} blocks of {bp} after {} positions (window of {} open)",
                blocks.len(),
                self.len,
                self.window.len
            )));
        }
        self.store.truncate(self.len);
        match self.store.block_positions() {
            Some(_) => self.store.adopt_blocks(blocks, positions)?,
            None => ByteBlock::copy_in(&mut *self.store, self.n_layers, self.len, blocks, positions, bp)?,
        }
        self.len += positions;
        self.window = Window { base: self.len, len: 0 };
        Ok(())
    }

    /// Calls `f(id, bytes)` for each allocation holding this row's K/V, with one id
    /// wherever one is shared with another row or the prefix cache: summing each id once
    /// gives the physical bytes of many rows.
    pub fn for_each_allocation(&self, f: &mut dyn FnMut(usize, usize)) {
        self.store.for_each_allocation(f);
        if let Some(r) = &self.ring {
            r.store.for_each_allocation(f);
        }
    }

    /// Whether this row's last block is shared with another row or the prefix cache, so
    /// that its next write copies the block first (one block more of memory).
    pub fn last_block_shared(&self) -> bool {
        self.store.last_block_shared()
    }

    /// A copy of this row's cache (a device cache copies on the device).
    pub fn try_clone(&self) -> Result<RowCache, KvError> {
        let ring = match &self.ring {
            Some(r) => Some(Ring { store: r.store.try_clone()?, ..*r }),
            None => None,
        };
        Ok(RowCache { store: self.store.try_clone()?, ring, ..*self })
    }
}

/// A copied block of a store that does not page: per layer, the K and V bytes of its
/// first `positions` positions as [`KvStore::read`] gives them.
struct ByteBlock {
    positions: usize,
    kv: Vec<(Vec<u8>, Vec<u8>)>,
}

impl ByteBlock {
    /// Copies of `blocks` (of `bp` positions) of the first `len` slots of `store`.
    fn copy_out(
        store: &dyn KvStore,
        n_layers: usize,
        len: usize,
        blocks: std::ops::Range<usize>,
        bp: usize,
    ) -> Result<Vec<KvBlock>, KvError> {
        let end = (blocks.end * bp).min(len);
        let layers: Vec<(Vec<u8>, Vec<u8>)> =
            (0..n_layers).map(|l| store.read(l, end)).collect::<Result<_, _>>()?;
        Ok(blocks
            .map(|b| {
                let positions = (b * bp..((b + 1) * bp).min(end)).len();
                let part = |x: &Vec<u8>| {
                    let slot = x.len() / end.max(1);
                    x[b * bp * slot..(b * bp + positions) * slot].to_vec()
                };
                let kv: Vec<(Vec<u8>, Vec<u8>)> = layers.iter().map(|(k, v)| (part(k), part(v))).collect();
                let bytes = kv.iter().map(|(k, v)| k.len() + v.len()).sum();
                KvBlock::new(std::sync::Arc::new(ByteBlock { positions, kv }), bytes)
            })
            .collect())
    }

    /// Writes the first `positions` positions of `blocks` (from [`ByteBlock::copy_out`])
    /// into `store` from slot `at`, leaving it as it was on failure.
    fn copy_in(
        store: &mut dyn KvStore,
        n_layers: usize,
        at: usize,
        blocks: &[KvBlock],
        positions: usize,
        bp: usize,
    ) -> Result<(), KvError> {
        let copies: Vec<&ByteBlock> = blocks
            .iter()
            .map(|b| b.inner_ref::<ByteBlock>())
            .collect::<Option<_>>()
            .ok_or_else(|| KvError("adopt_blocks: blocks of another kind of store".into()))?;
        if copies.iter().any(|c| c.kv.len() != n_layers) {
            return Err(KvError("adopt_blocks: blocks of another model's layers".into()));
        }
        store.grow(at + positions)?;
        for (i, c) in copies.iter().enumerate() {
            let take = (positions - i * bp).min(c.positions);
            for (layer, (k, v)) in c.kv.iter().enumerate() {
                let slot = k.len() / c.positions.max(1);
                if let Err(e) = store.write_bytes(layer, at + i * bp, &k[..take * slot], &v[..take * slot]) {
                    store.truncate(at);
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

/// Test-only fault injection. Nothing in the library turns it on; the parity tests do,
/// to prove they catch a rollback that forgets to compact, a write into a shared block
/// without copying it, and a block table out of logical order.
pub mod negative_control {
    use std::cell::Cell;

    thread_local! {
        static SKIP_COMPACTION: Cell<bool> = const { Cell::new(false) };
        static WRITE_SHARED_IN_PLACE: Cell<bool> = const { Cell::new(false) };
        static ADOPT_OUT_OF_ORDER: Cell<bool> = const { Cell::new(false) };
    }

    /// When on, a write into a K/V block another row (or the prefix cache) holds too goes
    /// into that block in place instead of into a copy (no copy-on-write).
    pub fn set_write_shared_in_place(on: bool) {
        WRITE_SHARED_IN_PLACE.with(|c| c.set(on));
    }

    /// Whether [`set_write_shared_in_place`] is on (for stores in other crates too).
    pub fn write_shared_in_place() -> bool {
        WRITE_SHARED_IN_PLACE.with(|c| c.get())
    }

    /// When on, blocks a row adopts (a cached prefix) enter its block table in reverse
    /// order: a table out of logical order.
    pub fn set_adopt_out_of_order(on: bool) {
        ADOPT_OUT_OF_ORDER.with(|c| c.set(on));
    }

    /// Whether [`set_adopt_out_of_order`] is on (for stores in other crates too).
    pub fn adopt_out_of_order() -> bool {
        ADOPT_OUT_OF_ORDER.with(|c| c.get())
    }

    /// When on, [`super::RowCache::commit_window`] keeps positions where the window was
    /// written, without moving them down over the hole.
    pub fn set_skip_compaction(on: bool) {
        SKIP_COMPACTION.with(|c| c.set(on));
    }

    pub(crate) fn skip_compaction() -> bool {
        SKIP_COMPACTION.with(|c| c.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host row in blocks of one position, so that its bytes are its slots'.
    fn unit_blocks(n_layers: usize, stride: usize) -> RowCache {
        RowCache::with_store(Box::new(HostKv::<f32>::with_block(n_layers, stride, 1)), n_layers, stride)
    }

    fn committed(c: &RowCache, layer: usize) -> (Vec<f32>, Vec<f32>) {
        let f = |b: Vec<u8>| b.chunks(4).map(|x| f32::from_le_bytes(x.try_into().unwrap())).collect();
        let (k, v) = c.committed_bytes(layer).unwrap();
        (f(k), f(v))
    }

    fn write(c: &mut RowCache, base: usize, vals: &[f32]) {
        c.begin_window(base);
        for layer in 0..c.n_layers() {
            c.write_window(layer, vals, &vals.iter().map(|x| -x).collect::<Vec<_>>());
        }
    }

    #[test]
    fn window_at_tail_commit_and_rollback() {
        let mut c = unit_blocks(2, 2);
        write(&mut c, 0, &[1.0, 2.0, 3.0, 4.0]);
        c.commit_window(2);
        assert_eq!(c.len(), 2);
        assert_eq!(committed(&c, 1).0, &[1.0, 2.0, 3.0, 4.0]);
        write(&mut c, 2, &[5.0, 6.0, 7.0, 8.0]);
        assert_eq!(c.view(0).unwrap().len(), 4);
        assert_eq!(c.view(0).unwrap().key(3, 0, 2, &mut [0.0; 2]), &[7.0, 8.0]);
        c.commit_window(1);
        assert_eq!(committed(&c, 0).0, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(c.bytes(), 2 * 2 * 6 * 4);
        c.truncate(1);
        assert_eq!(committed(&c, 0).1, &[-1.0, -2.0]);
    }

    #[test]
    fn shared_base_leaves_a_hole_that_commit_compacts() {
        let mut c = unit_blocks(1, 1);
        write(&mut c, 0, &[1.0]);
        c.commit_window(1);
        write(&mut c, 4, &[5.0, 6.0, 7.0]);
        let v = c.view(0).unwrap();
        let b = &mut [0.0; 1];
        assert_eq!(
            (v.len(), v.key(0, 0, 1, b).to_vec(), v.key(1, 0, 1, b).to_vec(), v.key(3, 0, 1, b).to_vec()),
            (4, vec![1.0], vec![5.0], vec![7.0])
        );
        c.commit_window(2);
        assert_eq!(committed(&c, 0).0, &[1.0, 5.0, 6.0]);
        assert_eq!(c.bytes(), 2 * 3 * 4);
    }

    #[test]
    fn skipping_compaction_corrupts_the_row() {
        let mut c = unit_blocks(1, 1);
        write(&mut c, 2, &[5.0, 6.0]);
        negative_control::set_skip_compaction(true);
        c.commit_window(2);
        negative_control::set_skip_compaction(false);
        assert_eq!(committed(&c, 0).0, &[0.0, 0.0]);
    }

    /// K of logical position `p` in ring layer `l`: what any run writes there.
    fn val(p: usize, l: usize, stride: usize) -> Vec<f32> {
        (0..stride).map(|j| (p * 100 + l * 10 + j) as f32).collect()
    }

    fn ring_row(cap: usize) -> RowCache {
        unit_blocks(1, 1).with_ring(Box::new(HostKv::<f32>::with_block(2, 3, 1)), 2, 3, cap)
    }

    /// Writes logical positions `[len, len + t)` into a window `hole` slots past the
    /// row's tail in the plain store.
    fn write_ring(c: &mut RowCache, hole: usize, t: usize) {
        let len = c.len();
        c.begin_window(len + hole);
        for l in 0..c.ring_layers() {
            let k: Vec<f32> = (len..len + t).flat_map(|p| val(p, l, 3)).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            c.write_ring_window(l, &k, &v);
        }
        c.write_window(0, &vec![1.0; t], &vec![1.0; t]);
    }

    fn ring_state(c: &RowCache) -> Vec<(Vec<u8>, Vec<u8>)> {
        (0..c.ring_layers()).map(|l| c.ring_bytes(l).unwrap()).collect()
    }

    /// Rollbacks of up to k + 1 positions with the ring smaller than k, at every offset
    /// around the wrap: after each commit the ring's bytes equal those of the same row
    /// built one position at a time, and the window read back by logical position holds
    /// exactly the keys `(p - cap, p]` of each of its queries.
    #[test]
    fn ring_rollback_matches_the_row_built_alone() {
        for cap in [1, 2, 3, 5] {
            for k in [cap + 1, cap + 3] {
                for start in 0..2 * cap + 2 {
                    for keep in 0..=k + 1 {
                        let mut c = ring_row(cap);
                        let mut alone = ring_row(cap);
                        for _ in 0..start {
                            write_ring(&mut c, 2, 1);
                            c.commit_window(1);
                        }
                        write_ring(&mut c, 3, k + 1);
                        let view = c.ring_view(1).unwrap();
                        for p in start..start + k + 1 {
                            for q in p.saturating_sub(cap - 1).max(view_first(&c))..=p {
                                assert_eq!(
                                    view.key(q, 0, 3, &mut []),
                                    val(q, 1, 3),
                                    "cap {cap} query {p} key {q}"
                                );
                            }
                        }
                        c.commit_window(keep);
                        for _ in 0..start + keep {
                            write_ring(&mut alone, 0, 1);
                            alone.commit_window(1);
                        }
                        assert_eq!(c.len(), alone.len());
                        assert_eq!(
                            ring_state(&c),
                            ring_state(&alone),
                            "cap {cap} k {k} start {start} keep {keep}"
                        );
                        assert!(
                            c.ring_bytes(0).unwrap().0.len() <= cap * 3 * 4,
                            "the ring outgrew its window"
                        );
                    }
                }
            }
        }
    }

    fn view_first(c: &RowCache) -> usize {
        c.ring_map().unwrap().first_held()
    }

    #[test]
    fn ring_without_compaction_differs() {
        let mut c = ring_row(2);
        let mut alone = ring_row(2);
        for _ in 0..3 {
            write_ring(&mut c, 0, 1);
            c.commit_window(1);
        }
        write_ring(&mut c, 0, 3);
        negative_control::set_skip_compaction(true);
        c.commit_window(2);
        negative_control::set_skip_compaction(false);
        for _ in 0..5 {
            write_ring(&mut alone, 0, 1);
            alone.commit_window(1);
        }
        assert_ne!(ring_state(&c), ring_state(&alone));
    }

    #[test]
    fn ring_refuses_what_it_cannot_hold() {
        let mut c = ring_row(2);
        write_ring(&mut c, 0, 4);
        c.commit_window(4);
        assert!(!c.can_truncate(3) && c.can_truncate(4));
        assert!(c.adopt_blocks(&[], 0).is_err() && c.share_blocks(0, 1).is_err());
        assert_eq!(c.bytes(), 4 * 4 * 2 + 2 * 2 * 3 * 4 * 2);
    }

    #[test]
    #[should_panic(expected = "beyond")]
    fn truncate_past_end_panics() {
        unit_blocks(1, 1).truncate(3);
    }
}
