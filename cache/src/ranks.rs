//! K/V of a row whose attention heads are split between tensor-parallel ranks: one store
//! per rank ([`RankKv`]), every slot operation applied to each, so a row's bookkeeping
//! (length, window, rollback, compaction) is kept once and its bytes stay where each
//! rank's heads are computed. A forward runs each rank on its own view of the row
//! ([`RowCache::split_ranks`]), then [`RowCache::join_ranks`] puts the stores back.

use std::any::Any;

use crate::{KvError, KvStore, Ring, RowCache};

/// One store per rank, each holding that rank's K/V heads for every slot.
pub struct RankKv {
    ranks: Vec<Box<dyn KvStore>>,
    /// Values per slot and layer in each rank's store.
    rank_stride: usize,
}

impl RankKv {
    /// The stores of ranks `0..stores.len()`, in rank order, each `rank_stride` values a slot.
    pub fn new(stores: Vec<Box<dyn KvStore>>, rank_stride: usize) -> RankKv {
        RankKv { ranks: stores, rank_stride }
    }

    fn checked(&self) -> Result<(), KvError> {
        if self.ranks.is_empty() {
            return Err(KvError("a tensor-parallel row's stores are lent to a forward".into()));
        }
        Ok(())
    }
}

impl KvStore for RankKv {
    fn grow(&mut self, slots: usize) -> Result<(), KvError> {
        // Reserve everywhere first, so a rank out of memory leaves every store as it was.
        self.reserve(slots)?;
        self.ranks.iter_mut().try_for_each(|s| s.grow(slots))
    }

    fn truncate(&mut self, slots: usize) {
        self.ranks.iter_mut().for_each(|s| s.truncate(slots));
    }

    fn reserve(&mut self, slots: usize) -> Result<(), KvError> {
        self.checked()?;
        self.ranks.iter_mut().try_for_each(|s| s.reserve(slots))
    }

    fn move_down(&mut self, from: usize, to: usize, n: usize) {
        self.ranks.iter_mut().for_each(|s| s.move_down(from, to, n));
    }

    fn bytes(&self) -> usize {
        self.ranks.iter().map(|s| s.bytes()).sum()
    }

    /// Each rank's bytes of slots `[0, n)`, concatenated in rank order.
    fn read(&self, layer: usize, n: usize) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        self.checked()?;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for s in &self.ranks {
            let (rk, rv) = s.read(layer, n)?;
            k.extend_from_slice(&rk);
            v.extend_from_slice(&rv);
        }
        Ok((k, v))
    }

    /// Bytes as [`RankKv::read`] gives them: one equal part per rank.
    fn write_bytes(&mut self, layer: usize, slot: usize, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        self.checked()?;
        let n = self.ranks.len();
        if !k.len().is_multiple_of(n) || !v.len().is_multiple_of(n) {
            return Err(KvError(format!(
                "tensor-parallel KV: {} K and {} V bytes do not split between {n} ranks",
                k.len(),
                v.len()
            )));
        }
        let (kp, vp) = (k.len() / n, v.len() / n);
        for (r, s) in self.ranks.iter_mut().enumerate() {
            s.write_bytes(layer, slot, &k[r * kp..(r + 1) * kp], &v[r * vp..(r + 1) * vp])?;
        }
        Ok(())
    }

    fn try_clone(&self) -> Result<Box<dyn KvStore>, KvError> {
        self.checked()?;
        let ranks = self.ranks.iter().map(|s| s.try_clone()).collect::<Result<_, _>>()?;
        Ok(Box::new(RankKv { ranks, rank_stride: self.rank_stride }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl RowCache {
    /// One row's empty cache over the empty caches `parts` of each rank (in rank order, all
    /// of one shape): its stores (and its ring's) become [`RankKv`]s.
    pub fn from_ranks(parts: Vec<RowCache>) -> RowCache {
        let n = parts.len();
        let first = parts.first().expect("from_ranks: no rank caches");
        let (n_layers, stride) = (first.n_layers, first.stride);
        let ring_shape = first.ring.as_ref().map(|r| (r.n_layers, r.stride, r.cap));
        let (mut main, mut rings) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for p in parts {
            main.push(p.store);
            rings.extend(p.ring.map(|r| r.store));
        }
        let mut row = RowCache::with_store(Box::new(RankKv::new(main, stride)), n_layers, stride * n);
        if let Some((layers, ring_stride, cap)) = ring_shape {
            row = row.with_ring(Box::new(RankKv::new(rings, ring_stride)), layers, ring_stride * n, cap);
        }
        row
    }

    /// One cache per rank, each holding that rank's stores and this row's bookkeeping, for
    /// a forward that runs the ranks side by side; `None` when this row's stores are not
    /// split between ranks. [`RowCache::join_ranks`] must get them back.
    pub fn split_ranks(&mut self) -> Option<Vec<RowCache>> {
        let is_split = |store: &dyn KvStore| store.as_any().is::<RankKv>();
        if !is_split(&*self.store) || self.ring.as_ref().is_some_and(|r| !is_split(&*r.store)) {
            return None;
        }
        let take = |store: &mut Box<dyn KvStore>| {
            let kv = store.as_any_mut().downcast_mut::<RankKv>().expect("checked above");
            (std::mem::take(&mut kv.ranks), kv.rank_stride)
        };
        let (main, stride) = take(&mut self.store);
        let mut rings = match &mut self.ring {
            Some(r) => {
                let (stores, stride) = take(&mut r.store);
                stores.into_iter().map(|s| Some(Ring { store: s, stride, ..*r })).collect()
            }
            None => Vec::new(),
        }
        .into_iter();
        let caches = main
            .into_iter()
            .map(|store| RowCache { store, stride, ring: rings.next().flatten(), ..*self })
            .collect();
        Some(caches)
    }

    /// Puts back the rank caches [`RowCache::split_ranks`] lent, taking rank 0's
    /// bookkeeping. Every rank opens the same window; an error says they did not.
    pub fn join_ranks(&mut self, parts: Vec<RowCache>) -> Result<(), KvError> {
        let Some(first) = parts.first() else {
            return Err(KvError("join_ranks: no rank caches".into()));
        };
        let (len, window) = (first.len, first.window);
        let agree =
            parts.iter().all(|p| p.len == len && p.window.base == window.base && p.window.len == window.len);
        let (mut main, mut ring) = (Vec::new(), Vec::new());
        for p in parts {
            main.push(p.store);
            ring.extend(p.ring.map(|r| r.store));
        }
        let put = |store: &mut Box<dyn KvStore>, stores: Vec<Box<dyn KvStore>>| {
            if let Some(kv) = store.as_any_mut().downcast_mut::<RankKv>() {
                kv.ranks = stores;
            }
        };
        put(&mut self.store, main);
        if let Some(r) = &mut self.ring {
            put(&mut r.store, ring);
        }
        self.len = len;
        self.window = window;
        if !agree {
            return Err(KvError("join_ranks: the ranks' windows differ".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostKv;

    fn split_row(ranks: usize, stride: usize) -> RowCache {
        let stores =
            (0..ranks).map(|_| Box::new(HostKv::<f32>::new(1, stride)) as Box<dyn KvStore>).collect();
        RowCache::with_store(Box::new(RankKv::new(stores, stride)), 1, ranks * stride)
    }

    /// Rank `r`'s K (V is its negation) at logical position `p`.
    fn val(r: usize, p: usize, stride: usize) -> Vec<f32> {
        (0..stride).map(|i| (100 * r + 10 * p + i) as f32).collect()
    }

    /// Writes positions `[len, len + t)` at window base `base` through each rank's view.
    fn write(c: &mut RowCache, base: usize, t: usize, stride: usize) {
        let len = c.len();
        c.begin_window(base);
        let mut parts = c.split_ranks().expect("a split row");
        for (r, part) in parts.iter_mut().enumerate() {
            let k: Vec<f32> = (len..len + t).flat_map(|p| val(r, p, stride)).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            part.write_window(0, &k, &v);
        }
        c.join_ranks(parts).unwrap();
    }

    #[test]
    fn split_rows_roll_back_and_compact_every_rank() {
        let (ranks, stride) = (3, 2);
        let mut c = split_row(ranks, stride);
        write(&mut c, 0, 4, stride);
        c.commit_window(4);
        // A window behind a hole (a batch's shared base), of which 2 of 5 are accepted.
        write(&mut c, 7, 5, stride);
        c.commit_window(2);
        assert_eq!(c.len(), 6);
        let (k, v) = c.committed_bytes(0).unwrap();
        let want: Vec<u8> = (0..ranks)
            .flat_map(|r| (0..6).flat_map(move |p| val(r, p, stride)))
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(k, want);
        assert_eq!(v.len(), want.len());
        // The bytes come back into a fresh split row unchanged.
        let mut copy = split_row(ranks, stride);
        copy.store_mut().grow(6).unwrap();
        copy.store_mut().write_bytes(0, 0, &k, &v).unwrap();
        assert_eq!(copy.store().read(0, 6).unwrap().0, k);
    }

    #[test]
    fn a_row_not_split_has_no_rank_views() {
        assert!(RowCache::new(1, 4).split_ranks().is_none());
    }

    #[test]
    fn lent_stores_refuse_to_grow() {
        let mut c = split_row(2, 2);
        let parts = c.split_ranks().unwrap();
        assert!(c.open_window(1).is_err(), "a row whose stores are lent must not pretend to grow");
        c.join_ranks(parts).unwrap();
        assert!(c.open_window(1).is_ok());
    }
}
