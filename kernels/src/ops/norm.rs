//! Per-row elementwise kernels: RMSNorm, SwiGLU, GELU (the logit math is `mtp_base::logits`).

use super::simd::dot_f32;

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
