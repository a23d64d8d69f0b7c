//! Per-row KV cache.
//!
//! Contract: a row's K/V for logical positions `[0, len)` sit contiguously at slots
//! `[0, len)` of its own storage, laid out `[position][kv_head][head_dim]` per layer.
//! A forward appends a window after `len` in every layer and then [`RowCache::advance`]s;
//! [`RowCache::truncate`] rolls back to any shorter prefix. Memory follows the row's own
//! length, never the longest row's.

/// One row's K/V for every layer.
#[derive(Clone, Debug, Default)]
pub struct RowCache {
    layers: Vec<LayerKv>,
    len: usize,
    stride: usize,
}

#[derive(Clone, Debug, Default)]
struct LayerKv {
    k: Vec<f32>,
    v: Vec<f32>,
}

impl RowCache {
    /// An empty cache for `n_layers` layers of `stride = n_kv_heads * head_dim` floats per
    /// position.
    pub fn new(n_layers: usize, stride: usize) -> Self {
        RowCache { layers: vec![LayerKv::default(); n_layers], len: 0, stride }
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

    /// Appends the K/V of a window of new positions `[len, len + t)` to `layer`,
    /// discarding anything an earlier uncommitted window left there.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        assert_eq!(k.len(), v.len(), "append: K and V windows differ");
        assert_eq!(k.len() % self.stride, 0, "append: window is not whole positions");
        let keep = self.len * self.stride;
        let l = &mut self.layers[layer];
        l.k.truncate(keep);
        l.v.truncate(keep);
        l.k.extend_from_slice(k);
        l.v.extend_from_slice(v);
    }

    /// K and V of `layer` for positions `[0, n)`, where `n` may include the window
    /// appended by the forward in progress.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let l = &self.layers[layer];
        (&l.k, &l.v)
    }

    /// Commits `t` appended positions in every layer.
    pub fn advance(&mut self, t: usize) {
        let new_len = self.len + t;
        for l in &self.layers {
            assert!(l.k.len() >= new_len * self.stride, "advance: a layer has no K/V for the window");
        }
        self.len = new_len;
    }

    /// Rolls the row back to its first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        assert!(len <= self.len, "truncate: {len} is beyond the row's length {}", self.len);
        self.len = len;
        for l in &mut self.layers {
            l.k.truncate(len * self.stride);
            l.v.truncate(len * self.stride);
        }
    }

    /// Bytes of K/V currently held (committed and any pending window).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_advance_truncate() {
        let mut c = RowCache::new(2, 2);
        for layer in 0..2 {
            c.append(layer, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
        }
        c.advance(2);
        assert_eq!(c.len(), 2);
        assert_eq!(c.committed(1).0, &[1.0, 2.0, 3.0, 4.0]);
        c.truncate(1);
        assert_eq!(c.committed(0).1, &[5.0, 6.0]);
        // A window appended and then re-appended replaces the first one.
        c.append(0, &[9.0, 9.0], &[9.0, 9.0]);
        c.append(0, &[7.0, 7.0], &[7.0, 7.0]);
        assert_eq!(c.layer(0).0, &[1.0, 2.0, 7.0, 7.0]);
        assert_eq!(c.bytes(), (4 + 4 + 2 + 2) * 4);
    }

    #[test]
    #[should_panic(expected = "beyond")]
    fn truncate_past_end_panics() {
        RowCache::new(1, 1).truncate(3);
    }
}
