//! Rotary embeddings at logical positions, from one precomputed table.

use mtp_base::config::RopeScaling;

/// cos/sin for every position up to the model's context, `half = head_dim / 2` wide.
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(head_dim: usize, theta: f32, scaling: Option<&RopeScaling>, max_pos: usize) -> Self {
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let f = 1.0 / theta.powf((2 * i) as f32 / head_dim as f32);
                match scaling {
                    Some(s) => s.adjust(f),
                    None => f,
                }
            })
            .collect();
        RopeTable::from_inv_freq(inv_freq, max_pos)
    }

    /// The table of `inv_freq.len()` rotated pairs (a zero frequency leaves its pair as is).
    pub fn from_inv_freq(inv_freq: Vec<f32>, max_pos: usize) -> Self {
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for &f in &inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        RopeTable { half, cos, sin }
    }

    /// The cos and sin tables, `[position][head_dim / 2]`.
    pub fn cos_sin(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    pub fn max_positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates every head (length `2 * half`) of `x` as position `pos`, HF
    /// `rotate_half` convention (first half paired with second half).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let h = self.half;
        let cos = &self.cos[pos * h..(pos + 1) * h];
        let sin = &self.sin[pos * h..(pos + 1) * h];
        for head in x.chunks_mut(2 * h) {
            let (a, b) = head.split_at_mut(h);
            for i in 0..h {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}
