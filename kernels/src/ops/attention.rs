//! Varlen causal attention over one row's cache. The query at logical position `p`
//! reads exactly keys `[0, p]` of its own row (`(p - W, p]` on a sliding-window layer), with an online softmax over chunks whose
//! boundaries are anchored at position 0, so the result depends only on `p` and the
//! row's K/V: never on padding, batch, other rows or how many queries ran together.

use mtp_base::weights::WeightDtype;
use mtp_cache::KvView;

use super::simd::{isa, tile, Portable, Simd16};

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
    // One body, compiled for each ISA: the scores are canonical dot products (the same
    // bits on every path) and the rest is element-wise, so wider vectors change no bit.
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the features were detected.
        super::simd::Isa::Avx512 => unsafe { attend_avx512(q, kv, first, n_keys, kv_off, scale, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the features were detected.
        super::simd::Isa::Avx2 => unsafe { attend_avx2(q, kv, first, n_keys, kv_off, scale, out) },
        _ => attend_with::<Portable>(q, kv, first, n_keys, kv_off, scale, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn attend_avx512(
    q: &[f32],
    kv: &KvView,
    first: usize,
    n_keys: usize,
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
) {
    attend_with::<super::simd::Avx512>(q, kv, first, n_keys, kv_off, scale, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(
    q: &[f32],
    kv: &KvView,
    first: usize,
    n_keys: usize,
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
) {
    attend_with::<super::simd::Avx2>(q, kv, first, n_keys, kv_off, scale, out)
}

#[inline(always)]
fn attend_with<S: Simd16>(
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
            let key = kv.key(c0 + j, kv_off, hd, &mut buf);
            let mut dot = 0.0f32;
            // SAFETY: `key` holds hd f32, one output (the canonical dot of `simd::dot_f32`).
            unsafe {
                tile::<S, 1, 1>(q.as_ptr(), hd, key.as_ptr() as *const u8, WeightDtype::F32, 0, &mut dot, 0)
            };
            *sj = dot * scale;
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
