//! Quantized host K/V (`--kv-bits 8|4`): each position's K (and V) of one KV head is one
//! group of `head_dim` values, stored as an f32 scale, an f32 bias (the group's minimum)
//! and `bits`-bit integers (two per byte at 4 bits, low nibble first), `x ~ scale * q +
//! bias`. Quantizing a group reads only that group, so an entry is a pure function of the
//! f32 K/V the model computed: row invariance carries over, and rollback and compaction
//! move whole entries like any store.

use crate::paged::{Half, Paged, BLOCK_POSITIONS};

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

/// Quantized K and V per layer, each slot `[head][scale, bias, values]`, in blocks of
/// positions ([`crate::paged`]).
#[derive(Clone, Debug)]
pub struct QuantKv {
    paged: Paged<u8>,
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
        let layout = QuantLayout { heads, head_dim, bits };
        QuantKv { paged: Paged::new(n_layers, layout.slot_bytes(), BLOCK_POSITIONS), layout }
    }

    pub fn layout(&self) -> QuantLayout {
        self.layout
    }

    pub(crate) fn paged(&self) -> &Paged<u8> {
        &self.paged
    }

    /// Quantizes and writes whole slots of `layer` from `slot` on (which must be held):
    /// `k` and `v` hold `heads * head_dim` f32 values per slot.
    ///
    /// # Panics
    /// If the slots are not held, or copying a shared block runs out of memory.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let l = self.layout;
        let per_slot = (l.heads * l.head_dim).max(1);
        for (half, src) in [(Half::K, k), (Half::V, v)] {
            for (i, vals) in src.chunks_exact(per_slot).enumerate() {
                let out = self.paged.row_mut(layer, half, slot + i).expect("QuantKv::write: host K/V block");
                for (o, x) in out.chunks_exact_mut(l.head_bytes()).zip(vals.chunks_exact(l.head_dim)) {
                    l.quantize_head(x, o);
                }
            }
        }
    }
}

crate::paged::paged_kv_store!(impl<> for QuantKv);

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
