//! Where a row's K/V bytes live. [`crate::RowCache`] keeps the logic (logical length,
//! window, rollback); a [`KvStore`] only holds slots: host memory here ([`HostKv`]),
//! device memory in a GPU backend.

use std::any::Any;

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
    /// A copy of this store.
    fn try_clone(&self) -> Result<Box<dyn KvStore>, KvError>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// f32 K/V in host memory, `[slot][stride]` per layer: the CPU backend's store.
#[derive(Clone, Debug, Default)]
pub struct HostKv {
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    stride: usize,
}

impl HostKv {
    pub fn new(n_layers: usize, stride: usize) -> Self {
        HostKv { layers: vec![(Vec::new(), Vec::new()); n_layers], stride }
    }

    /// Values per slot and layer.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// K and V of `layer`, every held slot.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        let (k, v) = &self.layers[layer];
        (k, v)
    }

    /// Writes whole slots of `layer` starting at `slot` (which must be held).
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        assert_eq!(k.len(), v.len(), "HostKv::write: K and V differ");
        let at = slot * self.stride;
        let (lk, lv) = &mut self.layers[layer];
        lk[at..at + k.len()].copy_from_slice(k);
        lv[at..at + v.len()].copy_from_slice(v);
    }
}

impl KvStore for HostKv {
    fn grow(&mut self, slots: usize) -> Result<(), KvError> {
        self.reserve(slots)?;
        for (k, v) in &mut self.layers {
            k.resize(k.len().max(slots * self.stride), 0.0);
            v.resize(v.len().max(slots * self.stride), 0.0);
        }
        Ok(())
    }

    fn truncate(&mut self, slots: usize) {
        for (k, v) in &mut self.layers {
            k.truncate(slots * self.stride);
            v.truncate(slots * self.stride);
        }
    }

    fn reserve(&mut self, slots: usize) -> Result<(), KvError> {
        let need = slots * self.stride;
        for (k, v) in &mut self.layers {
            for x in [k, v] {
                x.try_reserve(need.saturating_sub(x.len()))
                    .map_err(|e| KvError(format!("cannot allocate {} bytes of host KV: {e}", need * 4)))?;
            }
        }
        Ok(())
    }

    fn move_down(&mut self, from: usize, to: usize, n: usize) {
        let (from, to, n) = (from * self.stride, to * self.stride, n * self.stride);
        for (k, v) in &mut self.layers {
            k.copy_within(from..from + n, to);
            v.copy_within(from..from + n, to);
        }
    }

    fn bytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| (k.len() + v.len()) * 4).sum()
    }

    fn read(&self, layer: usize, n: usize) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        let (k, v) = &self.layers[layer];
        let n = n * self.stride;
        let bytes = |x: &[f32]| x[..n].iter().flat_map(|f| f.to_le_bytes()).collect();
        Ok((bytes(k), bytes(v)))
    }

    fn write_bytes(&mut self, layer: usize, slot: usize, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        let floats = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        let (k, v) = (floats(k), floats(v));
        let end = slot * self.stride + k.len();
        if k.len() != v.len() || k.len() % self.stride != 0 || end > self.layers[layer].0.len() {
            return Err(KvError(format!(
                "host KV: cannot write {} K and {} V bytes at slot {slot} of a store holding {} slots",
                k.len() * 4,
                v.len() * 4,
                self.layers[layer].0.len() / self.stride.max(1)
            )));
        }
        self.write(layer, slot, &k, &v);
        Ok(())
    }

    fn try_clone(&self) -> Result<Box<dyn KvStore>, KvError> {
        Ok(Box::new(self.clone()))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
