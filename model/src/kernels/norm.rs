//! Per-row elementwise kernels: RMSNorm, SwiGLU, log-softmax, argmax, canonical sum.

use super::simd::{dot_f32, Portable, Simd16, LANES};

/// `1 / sqrt(mean(x^2) + eps)` of one row, with the canonical dot product.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot_f32(x, x) / x.len() as f32 + eps).sqrt()
}

/// `out = w * (x / sqrt(mean(x^2) + eps))`, row by row (rows of length `w.len()`).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert!(n > 0 && x.len().is_multiple_of(n) && out.len() == x.len(), "rms_norm: shape");
    for (xr, or) in x.chunks(n).zip(out.chunks_mut(n)) {
        let r = inv_rms(xr, eps);
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
            *o = wv * (xv * r);
        }
    }
}

/// In-place RMSNorm of each length-`w.len()` slice (Qwen3's per-head q/k norm).
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for xr in x.chunks_mut(n) {
        let r = inv_rms(xr, eps);
        for (v, &wv) in xr.iter_mut().zip(w) {
            *v = wv * (*v * r);
        }
    }
}

/// `gate <- silu(gate) * up`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: shape");
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `gate <- gelu_tanh(gate) * up` (GELU with the tanh approximation, as
/// `gelu_pytorch_tanh`).
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gelu_tanh_mul: shape");
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh()) * u;
    }
}

/// Sum in the canonical 16-lane order (lane j takes i ≡ j mod 16, then the fixed tree).
pub fn canonical_sum(x: &[f32]) -> f32 {
    canonical_sum_of(x, |v| v)
}

/// `canonical_sum` of `f(x[i])`, without storing the values.
fn canonical_sum_of(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            lanes[j] += f(c[j]);
        }
    }
    for (j, &v) in chunks.remainder().iter().enumerate() {
        lanes[j] += f(v);
    }
    Portable::reduce(lanes)
}

/// Natural-log softmax normaliser of a logit row: returns `(max, ln(sum(exp(x - max))))`,
/// so `logprob(t) = (x[t] - max) - lse`.
pub fn log_softmax_parts(logits: &[f32]) -> (f32, f32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    (max, canonical_sum_of(logits, |v| (v - max).exp()).ln())
}

/// Log-probability of `token` under `logits` at temperature 1.
pub fn logprob(logits: &[f32], token: u32) -> f32 {
    let (max, lse) = log_softmax_parts(logits);
    (logits[token as usize] - max) - lse
}

/// The `n` most likely tokens and their log-probabilities (temperature 1), most likely
/// first; equal logits go to the lower id.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let (max, lse) = log_softmax_parts(logits);
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(ids.len());
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    ids.select_nth_unstable_by(n.saturating_sub(1), by_logit);
    ids.truncate(n);
    ids.sort_by(by_logit);
    ids.into_iter().map(|t| (t, (logits[t as usize] - max) - lse)).collect()
}

/// Full log-softmax of a row.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let (max, lse) = log_softmax_parts(logits);
    logits.iter().map(|&v| (v - max) - lse).collect()
}

/// Index of the largest logit; ties go to the lowest id, NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streamed normaliser is `canonical_sum` over the stored exponentials, bit for bit
    /// (a length with a remainder past the 16 lanes, and one without).
    #[test]
    fn log_softmax_parts_streams_the_canonical_sum() {
        for n in [151_936usize + 7, 64] {
            let logits: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.031).collect();
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = logits.iter().map(|&v| (v - max).exp()).collect();
            let (m, lse) = log_softmax_parts(&logits);
            assert_eq!((m.to_bits(), lse.to_bits()), (max.to_bits(), canonical_sum(&exps).ln().to_bits()));
        }
    }
}
