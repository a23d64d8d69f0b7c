//! Per-row KV cache.
//!
//! Contract (the layout invariant): between forwards, a row's K/V for logical positions
//! `[0, len)` sit contiguously at slots `[0, len)` of its own storage, laid out
//! `[position][kv_head][head_dim]` per layer, and nothing else is stored.
//!
//! A forward writes a *window* of new positions `[len, len + t)` at physical slots
//! `[base, base + t)` with `base >= len` (the caller picks `base`: the row's own tail, or a
//! slot shared by every row of a batch, which leaves a hole `[len, base)`). Reads go
//! through a [`KvView`], which maps logical positions to slots. [`RowCache::commit_window`]
//! keeps the first `keep` window positions, moves them down to `[len, len + keep)`
//! (compacting the hole) and frees everything after: that is rollback after a partial
//! accept. Memory follows the row's own length, never the longest row's.

/// One row's K/V for every layer.
#[derive(Clone, Debug, Default)]
pub struct RowCache {
    layers: Vec<LayerKv>,
    len: usize,
    stride: usize,
    window: Window,
}

#[derive(Clone, Debug, Default)]
struct LayerKv {
    k: Vec<f32>,
    v: Vec<f32>,
}

#[derive(Clone, Copy, Debug, Default)]
struct Window {
    base: usize,
    len: usize,
}

/// Read access to one layer of a row: committed positions plus the open window.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    k: &'a [f32],
    v: &'a [f32],
    stride: usize,
    committed: usize,
    base: usize,
}

impl<'a> KvView<'a> {
    /// A view of plain contiguous K/V (`[pos][stride]`), logical position = slot.
    pub fn contiguous(k: &'a [f32], v: &'a [f32], stride: usize) -> Self {
        KvView { k, v, stride, committed: k.len() / stride.max(1), base: k.len() / stride.max(1) }
    }

    /// Positions readable through this view.
    pub fn len(&self) -> usize {
        self.committed + (self.k.len() / self.stride.max(1)).saturating_sub(self.base)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn slot(&self, pos: usize) -> usize {
        if pos < self.committed {
            pos
        } else {
            self.base + (pos - self.committed)
        }
    }

    /// K of logical position `pos`, all KV heads (`stride` floats).
    #[inline]
    pub fn key(&self, pos: usize) -> &'a [f32] {
        let s = self.slot(pos) * self.stride;
        &self.k[s..s + self.stride]
    }

    /// V of logical position `pos`, all KV heads.
    #[inline]
    pub fn value(&self, pos: usize) -> &'a [f32] {
        let s = self.slot(pos) * self.stride;
        &self.v[s..s + self.stride]
    }
}

impl RowCache {
    /// An empty cache for `n_layers` layers of `stride = n_kv_heads * head_dim` floats per
    /// position.
    pub fn new(n_layers: usize, stride: usize) -> Self {
        RowCache { layers: vec![LayerKv::default(); n_layers], len: 0, stride, window: Window::default() }
    }

    /// Logical length: positions whose K/V are committed.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Opens a window that the next writes fill at physical slots `[base, ..)`, dropping
    /// any window still open. Slots `[len, base)` become a hole until the commit.
    pub fn begin_window(&mut self, base: usize) {
        assert!(base >= self.len, "begin_window: slot {base} would overwrite committed positions");
        self.truncate_storage(self.len);
        self.window = Window { base, len: 0 };
    }

    /// Physical slot where the open window starts.
    pub fn window_base(&self) -> usize {
        self.window.base.max(self.len)
    }

    /// Reserves room for a window of `t` positions at `base` in every layer, reporting
    /// allocation failure instead of aborting the process.
    pub fn try_reserve_window(
        &mut self,
        base: usize,
        t: usize,
    ) -> Result<(), std::collections::TryReserveError> {
        let need = (base.max(self.len) + t) * self.stride;
        for l in &mut self.layers {
            l.k.try_reserve(need.saturating_sub(l.k.len()))?;
            l.v.try_reserve(need.saturating_sub(l.v.len()))?;
        }
        Ok(())
    }

    /// Writes the window's K/V for `layer` (whole positions) at the window's slots.
    pub fn write_window(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        assert_eq!(k.len(), v.len(), "write_window: K and V windows differ");
        assert_eq!(k.len() % self.stride, 0, "write_window: window is not whole positions");
        let base = self.window_base();
        let start = base * self.stride;
        let l = &mut self.layers[layer];
        // A hole left by a shared base reads as zeros, as a padded tensor would.
        l.k.resize(start, 0.0);
        l.v.resize(start, 0.0);
        l.k.extend_from_slice(k);
        l.v.extend_from_slice(v);
        self.window = Window { base, len: k.len() / self.stride };
    }

    /// Positions written into the open window.
    pub fn window_len(&self) -> usize {
        self.window.len
    }

    /// Committed positions plus the open window of `layer`, by logical position.
    pub fn view(&self, layer: usize) -> KvView<'_> {
        let l = &self.layers[layer];
        KvView { k: &l.k, v: &l.v, stride: self.stride, committed: self.len, base: self.window_base() }
    }

    /// Keeps the first `keep` positions of the open window (rollback of the rest): moves
    /// them to slots `[len, len + keep)`, frees everything after and closes the window.
    pub fn commit_window(&mut self, keep: usize) {
        assert!(
            keep <= self.window.len,
            "commit_window: keeping {keep} of a {}-position window",
            self.window.len
        );
        let (from, to, n) = (self.window_base() * self.stride, self.len * self.stride, keep * self.stride);
        if from != to && !negative_control::skip_compaction() {
            for l in &mut self.layers {
                l.k.copy_within(from..from + n, to);
                l.v.copy_within(from..from + n, to);
            }
        }
        self.len += keep;
        self.truncate_storage(self.len);
        self.window = Window { base: self.len, len: 0 };
    }

    /// Rolls the row back to its first `len` positions (closing any open window).
    pub fn truncate(&mut self, len: usize) {
        assert!(len <= self.len, "truncate: {len} is beyond the row's length {}", self.len);
        self.len = len;
        self.truncate_storage(len);
        self.window = Window { base: len, len: 0 };
    }

    fn truncate_storage(&mut self, len: usize) {
        for l in &mut self.layers {
            l.k.truncate(len * self.stride);
            l.v.truncate(len * self.stride);
        }
    }

    /// Bytes of K/V currently held (committed and any open window, hole included).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| (l.k.len() + l.v.len()) * 4).sum()
    }

    /// Committed K and V of `layer` (positions `[0, len)`), for byte comparisons.
    pub fn committed(&self, layer: usize) -> (&[f32], &[f32]) {
        let n = self.len * self.stride;
        let l = &self.layers[layer];
        (&l.k[..n], &l.v[..n])
    }
}

/// Test-only fault injection. Nothing in the library turns it on; the parity tests do,
/// to prove they catch a rollback that forgets to compact.
pub mod negative_control {
    use std::cell::Cell;

    thread_local! {
        static SKIP_COMPACTION: Cell<bool> = const { Cell::new(false) };
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

    fn write(c: &mut RowCache, base: usize, vals: &[f32]) {
        c.begin_window(base);
        for layer in 0..c.n_layers() {
            c.write_window(layer, vals, &vals.iter().map(|x| -x).collect::<Vec<_>>());
        }
    }

    #[test]
    fn window_at_tail_commit_and_rollback() {
        let mut c = RowCache::new(2, 2);
        write(&mut c, 0, &[1.0, 2.0, 3.0, 4.0]);
        c.commit_window(2);
        assert_eq!(c.len(), 2);
        assert_eq!(c.committed(1).0, &[1.0, 2.0, 3.0, 4.0]);
        write(&mut c, 2, &[5.0, 6.0, 7.0, 8.0]);
        assert_eq!(c.view(0).len(), 4);
        assert_eq!(c.view(0).key(3), &[7.0, 8.0]);
        c.commit_window(1);
        assert_eq!(c.committed(0).0, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(c.bytes(), 2 * 2 * 6 * 4);
        c.truncate(1);
        assert_eq!(c.committed(0).1, &[-1.0, -2.0]);
    }

    #[test]
    fn shared_base_leaves_a_hole_that_commit_compacts() {
        let mut c = RowCache::new(1, 1);
        write(&mut c, 0, &[1.0]);
        c.commit_window(1);
        write(&mut c, 4, &[5.0, 6.0, 7.0]);
        let v = c.view(0);
        assert_eq!((v.len(), v.key(0), v.key(1), v.key(3)), (4, &[1.0][..], &[5.0][..], &[7.0][..]));
        c.commit_window(2);
        assert_eq!(c.committed(0).0, &[1.0, 5.0, 6.0]);
        assert_eq!(c.bytes(), 2 * 3 * 4);
    }

    #[test]
    fn skipping_compaction_corrupts_the_row() {
        let mut c = RowCache::new(1, 1);
        write(&mut c, 2, &[5.0, 6.0]);
        negative_control::set_skip_compaction(true);
        c.commit_window(2);
        negative_control::set_skip_compaction(false);
        assert_eq!(c.committed(0).0, &[0.0, 0.0]);
    }

    #[test]
    #[should_panic(expected = "beyond")]
    fn truncate_past_end_panics() {
        RowCache::new(1, 1).truncate(3);
    }
}
