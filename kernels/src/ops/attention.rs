//! Varlen causal attention over one row's cache. The query at logical position `p`
//! reads exactly keys `[0, p]` of its own row (`(p - W, p]` on a sliding-window layer), with an online softmax over chunks whose
//! boundaries are anchored at position 0, so the result depends only on `p` and the
//! row's K/V: never on padding, batch, other rows or how many queries ran together.

use half::bf16;
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
    attend_heads(q, q.len(), kv, first, n_keys, kv_off, scale, out)
}

/// The query heads in `q` (`q.len() / head_dim` of them, heads of one KV head: grouped
/// query attention) against the same keys, each with exactly the bits [`attend_from`]
/// gives it alone: every K and V row is read once for up to four heads, whose scores are
/// the rows of one canonical tile (a row's dot does not depend on the other rows).
#[allow(clippy::too_many_arguments)]
pub fn attend_heads(
    q: &[f32],
    head_dim: usize,
    kv: &KvView,
    first: usize,
    n_keys: usize,
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert!(head_dim > 0 && q.len().is_multiple_of(head_dim), "attend: {} query values", q.len());
    assert_eq!(out.len(), q.len());
    assert!(
        first < n_keys && kv.len() >= n_keys,
        "attend: keys [{first}, {n_keys}) wanted, {} readable",
        kv.len()
    );
    let keys = Keys { kv, hd: head_dim, first, n_keys, kv_off, scale };
    // One body, compiled for each ISA: the scores are canonical dot products (the same
    // bits on every path) and the rest is element-wise, so wider vectors change no bit.
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the features were detected.
        super::simd::Isa::Avx512 => unsafe { attend_avx512(q, &keys, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the features were detected.
        super::simd::Isa::Avx2 => unsafe { attend_avx2(q, &keys, out) },
        _ => attend_with::<Portable>(q, &keys, out),
    }
}

/// What every query head of one call reads: keys `[first, n_keys)` of `kv`'s KV head at
/// `kv_off`, `hd` values a head, scores scaled by `scale`.
struct Keys<'a> {
    kv: &'a KvView<'a>,
    hd: usize,
    first: usize,
    n_keys: usize,
    kv_off: usize,
    scale: f32,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn attend_avx512(q: &[f32], keys: &Keys, out: &mut [f32]) {
    attend_with::<super::simd::Avx512>(q, keys, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(q: &[f32], keys: &Keys, out: &mut [f32]) {
    attend_with::<super::simd::Avx2>(q, keys, out)
}

/// The heads in blocks of up to four (a `match`, not a closure: a closure would not inherit
/// the caller's target features).
#[inline(always)]
fn attend_with<S: Simd16>(q: &[f32], keys: &Keys, out: &mut [f32]) {
    let hd = keys.hd;
    for (q, out) in q.chunks(4 * hd).zip(out.chunks_mut(4 * hd)) {
        match q.len() / hd {
            4 => attend_block::<S, 4>(q, keys, out),
            3 => attend_block::<S, 3>(q, keys, out),
            2 => attend_block::<S, 2>(q, keys, out),
            _ => attend_block::<S, 1>(q, keys, out),
        }
    }
}

/// `B` heads (`q`: `[B][hd]`, `out` likewise), each with its own online softmax: per head,
/// chunk by chunk, the scores, the running maximum and rescale, then `l += p` and
/// `out += p * v` in key order.
#[inline(always)]
fn attend_block<S: Simd16, const B: usize>(q: &[f32], keys: &Keys, out: &mut [f32]) {
    let &Keys { kv, hd, first, n_keys, kv_off, scale } = keys;
    let mut m = [f32::NEG_INFINITY; B];
    let mut l = [0.0f32; B];
    out.fill(0.0);
    let mut scores = [[0.0f32; CHUNK]; B];
    // Where a bf16 or quantized cache widens or dequantizes a chunk's values, and before
    // them each key into the first row (consumed by its dot at once); an f32 cache lends
    // slices, and bf16 keys go to the tile as stored, which widens them exactly as it
    // loads: the bits of f32 keys holding the same values.
    let chunk_keys = CHUNK.min(n_keys - first);
    let mut buf = vec![0.0f32; if kv.reads_into_buffer() { chunk_keys * hd } else { 0 }];
    let key_buf = buf.len().min(hd);
    for chunk in (first / CHUNK)..n_keys.div_ceil(CHUNK) {
        let (c0, c1) = ((chunk * CHUNK).max(first), ((chunk + 1) * CHUNK).min(n_keys));
        let n = c1 - c0;
        let mut j = 0;
        while j < n {
            // KEY_TILE keys at once where their rows are evenly spaced: B x KEY_TILE
            // independent sums instead of B chains of dependent FMAs, each the same dot.
            if j + KEY_TILE <= n {
                if let Some((key, dtype, stride)) = key_block(kv, c0 + j, kv_off, hd, &mut buf) {
                    let mut dots = [[0.0f32; KEY_TILE]; B];
                    // SAFETY: `q` holds B rows of hd f32, `key_block` KEY_TILE rows of hd
                    // values of `dtype` `stride` bytes apart; outputs `dots[b][t]`.
                    unsafe {
                        tile::<S, B, KEY_TILE>(
                            q.as_ptr(),
                            hd,
                            key,
                            dtype,
                            stride,
                            dots.as_mut_ptr().cast(),
                            KEY_TILE,
                        )
                    };
                    for (row, dots) in scores.iter_mut().zip(dots) {
                        for (t, dot) in dots.into_iter().enumerate() {
                            row[j + t] = dot * scale;
                        }
                    }
                    j += KEY_TILE;
                    continue;
                }
            }
            let (key, dtype) = key_row(kv, c0 + j, kv_off, hd, &mut buf[..key_buf]);
            let mut dots = [0.0f32; B];
            // SAFETY: `q` holds B rows of hd f32 and `key` hd values of `dtype`; B outputs,
            // one per row (each the canonical dot of `simd::dot_f32`).
            unsafe { tile::<S, B, 1>(q.as_ptr(), hd, key, dtype, 0, dots.as_mut_ptr(), 1) };
            for (row, dot) in scores.iter_mut().zip(dots) {
                row[j] = dot * scale;
            }
            j += 1;
        }
        for b in 0..B {
            let cm = scores[b][..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let m_new = m[b].max(cm);
            if m_new > m[b] {
                let alpha = (m[b] - m_new).exp();
                l[b] *= alpha;
                for o in out[b * hd..(b + 1) * hd].iter_mut() {
                    *o *= alpha;
                }
                m[b] = m_new;
            }
        }
        // Each head's probabilities, `l += p` in key order.
        let mut probs = [[0.0f32; CHUNK]; B];
        for b in 0..B {
            for j in 0..n {
                let p = (scores[b][j] - m[b]).exp();
                l[b] += p;
                probs[b][j] = p;
            }
        }
        // The chunk's V rows: a bf16 cache's as stored (widened as they load: the bits of
        // f32 rows holding the same values), an f32 cache's lent, a quantized cache's
        // dequantized into `buf`.
        if kv.value_bf16(c0, kv_off, hd).is_some() {
            let mut rows: [&[bf16]; CHUNK] = [&[]; CHUNK];
            for (row, pos) in rows.iter_mut().zip(c0..c1) {
                *row = kv.value_bf16(pos, kv_off, hd).unwrap_or(&[]);
            }
            accumulate_pv::<B, bf16>(&probs, &rows[..n], out, hd);
        } else {
            let mut rows: [&[f32]; CHUNK] = [&[]; CHUNK];
            let mut spare = buf.chunks_mut(hd);
            for (row, pos) in rows.iter_mut().zip(c0..c1) {
                // An f32 cache lends its own rows and leaves the buffer alone.
                *row = kv.value(pos, kv_off, hd, spare.next().unwrap_or(&mut []));
            }
            accumulate_pv::<B, f32>(&probs, &rows[..n], out, hd);
        }
    }
    for b in 0..B {
        let inv = 1.0 / l[b];
        for o in out[b * hd..(b + 1) * hd].iter_mut() {
            *o *= inv;
        }
    }
}

/// Keys whose scores one tile computes together.
const KEY_TILE: usize = 4;

/// The K rows of positions `pos .. pos + KEY_TILE` as one evenly spaced block: (first
/// row, dtype, bytes from one row to the next). A bf16 or f32 cache lends its rows (evenly
/// spaced where the positions' slots are consecutive; None across a ring's wrap or the
/// window's edge); a quantized cache's rows are dequantized into the first rows of `buf`.
#[inline(always)]
fn key_block(
    kv: &KvView,
    pos: usize,
    kv_off: usize,
    hd: usize,
    buf: &mut [f32],
) -> Option<(*const u8, WeightDtype, usize)> {
    if kv.reads_into_buffer() && buf.len() < KEY_TILE * hd {
        return None;
    }
    let (mut rows, mut dtype) = ([std::ptr::null::<u8>(); KEY_TILE], WeightDtype::F32);
    let mut spare = buf.chunks_mut(hd);
    for (t, row) in rows.iter_mut().enumerate() {
        (*row, dtype) = key_row(kv, pos + t, kv_off, hd, spare.next().unwrap_or(&mut []));
    }
    let stride = (rows[1] as usize).checked_sub(rows[0] as usize)?;
    let even = rows.windows(2).all(|w| (w[1] as usize).checked_sub(w[0] as usize) == Some(stride));
    (stride > 0 && even).then_some((rows[0], dtype, stride))
}

/// The K row of position `pos` for a tile: bf16 as a bf16 store holds it (the tile widens
/// it as it loads), else f32, lent by an f32 store or widened or dequantized into `buf`.
#[inline(always)]
fn key_row(kv: &KvView, pos: usize, kv_off: usize, hd: usize, buf: &mut [f32]) -> (*const u8, WeightDtype) {
    match kv.key_bf16(pos, kv_off, hd) {
        Some(k) => (k.as_ptr().cast(), WeightDtype::Bf16),
        None => (kv.key(pos, kv_off, hd, buf).as_ptr().cast(), WeightDtype::F32),
    }
}

/// A stored V value as the P·V step reads it (bf16 widened exactly).
trait Widen: Copy {
    fn f32(self) -> f32;
}

impl Widen for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl Widen for bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// Values of each head's output one pass of [`accumulate_pv`] keeps in registers.
const PV_BLOCK: usize = 64;

/// `out[b] += p[b][j] * v[j]` for the chunk's keys `j` in order, each a product rounded
/// and then a sum rounded, as element-wise loops give it: `PV_BLOCK` values of every head at
/// a time stay in registers while the keys stream past, where a loop over keys would load
/// and store the whole output for each key (the same bits: each value's sum runs over the
/// keys in the same order).
#[inline(always)]
fn accumulate_pv<const B: usize, T: Widen>(
    probs: &[[f32; CHUNK]; B],
    rows: &[&[T]],
    out: &mut [f32],
    hd: usize,
) {
    let mut e0 = 0;
    while e0 + PV_BLOCK <= hd {
        let mut acc = [[0.0f32; PV_BLOCK]; B];
        for (b, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&out[b * hd + e0..b * hd + e0 + PV_BLOCK]);
        }
        for (j, v) in rows.iter().enumerate() {
            let v = &v[e0..e0 + PV_BLOCK];
            for (a, p) in acc.iter_mut().zip(probs) {
                let p = p[j];
                for (a, &vv) in a.iter_mut().zip(v) {
                    *a += p * vv.f32();
                }
            }
        }
        for (b, a) in acc.iter().enumerate() {
            out[b * hd + e0..b * hd + e0 + PV_BLOCK].copy_from_slice(a);
        }
        e0 += PV_BLOCK;
    }
    if e0 < hd {
        for (j, v) in rows.iter().enumerate() {
            for (o, p) in out.chunks_mut(hd).zip(probs) {
                let p = p[j];
                for (o, &vv) in o[e0..].iter_mut().zip(&v[e0..]) {
                    *o += p * vv.f32();
                }
            }
        }
    }
}
