//! Varlen causal attention over one row's cache. The query at logical position `p`
//! reads exactly keys `[0, p]` of its own row (`(p - W, p]` on a sliding-window layer), with an online softmax over chunks whose
//! boundaries are anchored at position 0, so the result depends only on `p` and the
//! row's K/V: never on padding, batch, other rows or how many queries ran together.

use mtp_cache::KvView;

use super::simd::dot_f32;

/// Keys per online-softmax chunk.
pub const CHUNK: usize = 32;

/// One query head against the first `n_keys` logical positions of a row's cache.
///
/// `kv` maps logical positions to the row's slots; `kv_off` picks the KV head
/// (`kv_head * head_dim`) within a position.
pub fn attend(q: &[f32], kv: &KvView, n_keys: usize, kv_off: usize, scale: f32, out: &mut [f32]) {
    attend_from(q, kv, 0, n_keys, kv_off, scale, out)
}

/// One query head against logical positions `[first, n_keys)` (a sliding window). Chunk
/// boundaries stay anchored at position 0, so the order depends only on the range.
pub fn attend_from(
    q: &[f32],
    kv: &KvView,
    first: usize,
    n_keys: usize,
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = q.len();
    assert!(
        first < n_keys && kv.len() >= n_keys,
        "attend: keys [{first}, {n_keys}) wanted, {} readable",
        kv.len()
    );
    assert_eq!(out.len(), hd);
    let mut m = f32::NEG_INFINITY;
    let mut l = 0.0f32;
    out.fill(0.0);
    let mut scores = [0.0f32; CHUNK];
    // Where a quantized cache dequantizes one head's K or V (a plain one lends slices).
    let mut buf = if kv.is_quantized() { vec![0.0f32; hd] } else { Vec::new() };
    for chunk in (first / CHUNK)..n_keys.div_ceil(CHUNK) {
        let (c0, c1) = ((chunk * CHUNK).max(first), ((chunk + 1) * CHUNK).min(n_keys));
        let s = &mut scores[..c1 - c0];
        for (j, sj) in s.iter_mut().enumerate() {
            *sj = dot_f32(q, kv.key(c0 + j, kv_off, hd, &mut buf)) * scale;
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
            for (o, &vv) in out.iter_mut().zip(kv.value(c0 + j, kv_off, hd, &mut buf)) {
                *o += p * vv;
            }
        }
    }
    let inv = 1.0 / l;
    for o in out.iter_mut() {
        *o *= inv;
    }
}
