//! Varlen causal attention over one row's cache. The query at logical position `p`
//! reads exactly keys `[0, p]` of its own row, with an online softmax over chunks whose
//! boundaries are anchored at position 0, so the result depends only on `p` and the
//! row's K/V: never on padding, batch, other rows or how many queries ran together.

use super::simd::dot_f32;

/// Keys per online-softmax chunk.
pub const CHUNK: usize = 32;

/// One query head against `n_keys` cached keys.
///
/// `keys`/`values` are the row's cache, `[pos][kv_head][head_dim]`; `kv_off` picks the KV
/// head (`kv_head * head_dim`), `stride` is `n_kv_heads * head_dim`.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    n_keys: usize,
    stride: usize,
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = q.len();
    assert!(n_keys > 0 && keys.len() >= n_keys * stride && values.len() >= n_keys * stride);
    assert_eq!(out.len(), hd);
    let mut m = f32::NEG_INFINITY;
    let mut l = 0.0f32;
    out.fill(0.0);
    let mut scores = [0.0f32; CHUNK];
    for c0 in (0..n_keys).step_by(CHUNK) {
        let c1 = (c0 + CHUNK).min(n_keys);
        let s = &mut scores[..c1 - c0];
        for (j, sj) in s.iter_mut().enumerate() {
            let k = &keys[(c0 + j) * stride + kv_off..][..hd];
            *sj = dot_f32(q, k) * scale;
        }
        let cm = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let m_new = m.max(cm);
        if m_new > m {
            let alpha = (m - m_new).exp();
            l *= alpha;
            for o in out.iter_mut() {
                *o *= alpha;
            }
            m = m_new;
        }
        for (j, &sj) in s.iter().enumerate() {
            let p = (sj - m).exp();
            l += p;
            let v = &values[(c0 + j) * stride + kv_off..][..hd];
            for (o, &vv) in out.iter_mut().zip(v) {
                *o += p * vv;
            }
        }
    }
    let inv = 1.0 / l;
    for o in out.iter_mut() {
        *o *= inv;
    }
}
