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

/// One stored K or V value of a host store: f32, or bf16 (`--kv-dtype bf16`: each value
/// rounded to nearest-even as it is written, half the bytes).
pub trait KvElem: Copy + Default + std::fmt::Debug + Send + Sync + 'static {
    /// Bytes of one value as stored.
    const BYTES: usize;
    fn from_f32(x: f32) -> Self;
    /// Appends the value's `BYTES` little-endian bytes.
    fn put_le(self, out: &mut Vec<u8>);
    /// The value from its `BYTES` little-endian bytes.
    fn from_le(b: &[u8]) -> Self;
}

impl KvElem for f32 {
    const BYTES: usize = 4;
    #[inline]
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes())
    }
    fn from_le(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl KvElem for half::bf16 {
    const BYTES: usize = 2;
    #[inline]
    fn from_f32(x: f32) -> half::bf16 {
        half::bf16::from_f32(x)
    }
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes())
    }
    fn from_le(b: &[u8]) -> half::bf16 {
        half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
}

/// K/V in host memory, `[slot][stride]` per layer: the CPU backend's store, f32 by default
/// or bf16 ([`Bf16Kv`]).
#[derive(Clone, Debug, Default)]
pub struct HostKv<T: KvElem = f32> {
    layers: Vec<(Vec<T>, Vec<T>)>,
    stride: usize,
}

/// bf16 K/V in host memory (`--kv-dtype bf16` on the CPU).
pub type Bf16Kv = HostKv<half::bf16>;

impl<T: KvElem> HostKv<T> {
    pub fn new(n_layers: usize, stride: usize) -> Self {
        HostKv { layers: vec![(Vec::new(), Vec::new()); n_layers], stride }
    }

    /// Values per slot and layer.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// K and V of `layer`, every held slot.
    pub fn layer(&self, layer: usize) -> (&[T], &[T]) {
        let (k, v) = &self.layers[layer];
        (k, v)
    }

    /// Writes whole slots of `layer` starting at `slot` (which must be held), each value
    /// converted to the stored type.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        assert_eq!(k.len(), v.len(), "HostKv::write: K and V differ");
        let at = slot * self.stride;
        let (lk, lv) = &mut self.layers[layer];
        for (dst, src) in [(&mut lk[at..at + k.len()], k), (&mut lv[at..at + v.len()], v)] {
            dst.iter_mut().zip(src).for_each(|(d, &x)| *d = T::from_f32(x));
        }
    }
}

impl<T: KvElem> KvStore for HostKv<T> {
    fn grow(&mut self, slots: usize) -> Result<(), KvError> {
        self.reserve(slots)?;
        for (k, v) in &mut self.layers {
            k.resize(k.len().max(slots * self.stride), T::default());
            v.resize(v.len().max(slots * self.stride), T::default());
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
                x.try_reserve(need.saturating_sub(x.len())).map_err(|e| {
                    KvError(format!("cannot allocate {} bytes of host KV: {e}", need * T::BYTES))
                })?;
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
        self.layers.iter().map(|(k, v)| (k.len() + v.len()) * T::BYTES).sum()
    }

    fn read(&self, layer: usize, n: usize) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        let (k, v) = &self.layers[layer];
        let n = n * self.stride;
        let bytes = |x: &[T]| {
            let mut out = Vec::with_capacity(n * T::BYTES);
            x[..n].iter().for_each(|e| e.put_le(&mut out));
            out
        };
        Ok((bytes(k), bytes(v)))
    }

    fn write_bytes(&mut self, layer: usize, slot: usize, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        let slot_bytes = self.stride * T::BYTES;
        let held = self.layers[layer].0.len() / self.stride.max(1);
        let n = k.len() / slot_bytes.max(1);
        if k.len() != v.len() || !k.len().is_multiple_of(slot_bytes.max(1)) || slot + n > held {
            return Err(KvError(format!(
                "host KV: cannot write {} K and {} V bytes at slot {slot} of a store holding {held} slots of {slot_bytes} bytes",
                k.len(),
                v.len(),
            )));
        }
        let at = slot * self.stride;
        let (lk, lv) = &mut self.layers[layer];
        for (dst, src) in [(lk, k), (lv, v)] {
            let dst = &mut dst[at..at + n * self.stride];
            dst.iter_mut().zip(src.chunks_exact(T::BYTES)).for_each(|(d, b)| *d = T::from_le(b));
        }
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
