//! Quantized host K/V (`--kv-bits 8|4`): each position's K (and V) of one KV head is one
//! group of `head_dim` values, stored as an f32 scale, an f32 bias (the group's minimum)
//! and `bits`-bit integers (two per byte at 4 bits, low nibble first), `x ~ scale * q +
//! bias`. Quantizing a group reads only that group, so an entry is a pure function of the
//! f32 K/V the model computed: row invariance carries over, and rollback and compaction
//! move whole entries like any store.

use std::any::Any;

use crate::store::{KvError, KvStore};

/// The shape of one quantized slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantLayout {
    pub heads: usize,
    pub head_dim: usize,
    pub bits: usize,
}

impl QuantLayout {
    /// Bytes of one head's group: scale, bias, packed values.
    pub fn head_bytes(self) -> usize {
        8 + self.head_dim * self.bits / 8
    }

    /// Bytes of one slot (all KV heads) of K or of V.
    pub fn slot_bytes(self) -> usize {
        self.heads * self.head_bytes()
    }

    /// Quantizes one head's values into `out` (`head_bytes` long).
    pub fn quantize_head(self, x: &[f32], out: &mut [u8]) {
        let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let levels = ((1u32 << self.bits) - 1) as f32;
        let scale = (hi - lo) / levels;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        out[..4].copy_from_slice(&scale.to_le_bytes());
        out[4..8].copy_from_slice(&lo.to_le_bytes());
        let q = |v: f32| ((v - lo) * inv).round().clamp(0.0, levels) as u8;
        let packed = &mut out[8..];
        match self.bits {
            8 => packed.iter_mut().zip(x).for_each(|(p, &v)| *p = q(v)),
            _ => packed.iter_mut().zip(x.chunks_exact(2)).for_each(|(p, v)| *p = q(v[0]) | (q(v[1]) << 4)),
        }
    }

    /// Dequantizes one head's group (`head_bytes` long) into `out` (`head_dim` long).
    pub fn dequantize_head(self, g: &[u8], out: &mut [f32]) {
        let scale = f32::from_le_bytes([g[0], g[1], g[2], g[3]]);
        let bias = f32::from_le_bytes([g[4], g[5], g[6], g[7]]);
        let packed = &g[8..self.head_bytes()];
        match self.bits {
            8 => out.iter_mut().zip(packed).for_each(|(o, &p)| *o = scale * p as f32 + bias),
            _ => out.chunks_exact_mut(2).zip(packed).for_each(|(o, &p)| {
                o[0] = scale * (p & 15) as f32 + bias;
                o[1] = scale * (p >> 4) as f32 + bias;
            }),
        }
    }
}

/// Quantized K and V per layer, `[slot][head][scale, bias, values]`.
#[derive(Clone, Debug)]
pub struct QuantKv {
    layers: Vec<(Vec<u8>, Vec<u8>)>,
    layout: QuantLayout,
}

impl QuantKv {
    /// A store for `n_layers` layers of `heads` KV heads of `head_dim` values at `bits`
    /// (8 or 4; `head_dim` even).
    pub fn new(n_layers: usize, heads: usize, head_dim: usize, bits: usize) -> QuantKv {
        assert!(
            bits == 8 || (bits == 4 && head_dim.is_multiple_of(2)),
            "QuantKv: {bits} bits, head_dim {head_dim}"
        );
        QuantKv {
            layers: vec![(Vec::new(), Vec::new()); n_layers],
            layout: QuantLayout { heads, head_dim, bits },
        }
    }

    pub fn layout(&self) -> QuantLayout {
        self.layout
    }

    /// Quantized K and V bytes of `layer`, every held slot.
    pub fn layer(&self, layer: usize) -> (&[u8], &[u8]) {
        let (k, v) = &self.layers[layer];
        (k, v)
    }

    /// Quantizes and writes whole slots of `layer` from `slot` on (which must be held):
    /// `k` and `v` hold `heads * head_dim` f32 values per slot.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let (l, hd, sb) = (self.layout, self.layout.head_dim, self.layout.slot_bytes());
        let (lk, lv) = &mut self.layers[layer];
        for (dst, src) in [(lk, k), (lv, v)] {
            let out = &mut dst[slot * sb..slot * sb + src.len() / hd * l.head_bytes()];
            for (o, x) in out.chunks_exact_mut(l.head_bytes()).zip(src.chunks_exact(hd)) {
                l.quantize_head(x, o);
            }
        }
    }
}

impl KvStore for QuantKv {
    fn grow(&mut self, slots: usize) -> Result<(), KvError> {
        self.reserve(slots)?;
        let n = slots * self.layout.slot_bytes();
        for (k, v) in &mut self.layers {
            k.resize(k.len().max(n), 0);
            v.resize(v.len().max(n), 0);
        }
        Ok(())
    }

    fn truncate(&mut self, slots: usize) {
        let n = slots * self.layout.slot_bytes();
        for (k, v) in &mut self.layers {
            k.truncate(n);
            v.truncate(n);
        }
    }

    fn reserve(&mut self, slots: usize) -> Result<(), KvError> {
        let need = slots * self.layout.slot_bytes();
        for (k, v) in &mut self.layers {
            for x in [k, v] {
                x.try_reserve(need.saturating_sub(x.len())).map_err(|e| {
                    KvError(format!("cannot allocate {need} bytes of quantized host KV: {e}"))
                })?;
            }
        }
        Ok(())
    }

    fn move_down(&mut self, from: usize, to: usize, n: usize) {
        let sb = self.layout.slot_bytes();
        for (k, v) in &mut self.layers {
            k.copy_within(from * sb..(from + n) * sb, to * sb);
            v.copy_within(from * sb..(from + n) * sb, to * sb);
        }
    }

    fn bytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| k.len() + v.len()).sum()
    }

    fn read(&self, layer: usize, n: usize) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        let (k, v) = &self.layers[layer];
        let n = n * self.layout.slot_bytes();
        Ok((k[..n].to_vec(), v[..n].to_vec()))
    }

    fn write_bytes(&mut self, layer: usize, slot: usize, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        let at = slot * self.layout.slot_bytes();
        let (lk, lv) = &mut self.layers[layer];
        if k.len() != v.len() || !k.len().is_multiple_of(self.layout.slot_bytes()) || at + k.len() > lk.len()
        {
            return Err(KvError(format!(
                "quantized host KV: cannot write {} bytes at slot {slot} of a store holding {} bytes",
                k.len(),
                lk.len()
            )));
        }
        lk[at..at + k.len()].copy_from_slice(k);
        lv[at..at + v.len()].copy_from_slice(v);
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

#[cfg(test)]
mod tests {
    use super::QuantLayout;

    #[test]
    fn a_head_round_trips_within_half_a_step() {
        for bits in [8, 4] {
            let l = QuantLayout { heads: 1, head_dim: 16, bits };
            let x: Vec<f32> = (0..16).map(|i| ((i * 7) % 11) as f32 * 0.37 - 1.5).collect();
            let mut g = vec![0u8; l.head_bytes()];
            l.quantize_head(&x, &mut g);
            let mut y = vec![0.0; 16];
            l.dequantize_head(&g, &mut y);
            let step = 3.7 / ((1 << bits) - 1) as f32;
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= step / 2.0 + 1e-6, "{bits} bits: {a} -> {b}");
            }
            // The extremes are exact.
            let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
            assert!(y.contains(&lo));
        }
    }
}
