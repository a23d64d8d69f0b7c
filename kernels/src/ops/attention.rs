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
    attend_ranges(q, head_dim, kv, Ranges::Same(first, n_keys), kv_off, scale, out)
}

/// Query rows of one KV head, row `i` against its own logical positions `ranges[i]` (`[first,
/// end)`; several tokens of a prompt, each with its heads), each with exactly the bits
/// [`attend_from`] gives it alone: each K and V row of the ranges' union is read from
/// memory once for all the rows (blocks of four share each load), and a row's scores,
/// softmax and sums only ever take its own keys, chunk by chunk from the same boundaries.
pub fn attend_rows(
    q: &[f32],
    head_dim: usize,
    kv: &KvView,
    ranges: &[(usize, usize)],
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert!(head_dim > 0 && q.len() == ranges.len() * head_dim, "attend: {} query values", q.len());
    attend_ranges(q, head_dim, kv, Ranges::Each(ranges), kv_off, scale, out)
}

/// Each query row's keys: one range for all, or one a row.
#[derive(Clone, Copy)]
enum Ranges<'a> {
    Same(usize, usize),
    Each(&'a [(usize, usize)]),
}

impl Ranges<'_> {
    #[inline(always)]
    fn row(self, i: usize) -> (usize, usize) {
        match self {
            Ranges::Same(first, end) => (first, end),
            Ranges::Each(r) => r[i],
        }
    }
}

fn attend_ranges(
    q: &[f32],
    hd: usize,
    kv: &KvView,
    ranges: Ranges,
    kv_off: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert_eq!(out.len(), q.len());
    for i in 0..q.len() / hd {
        let (first, end) = ranges.row(i);
        assert!(
            first < end && kv.len() >= end,
            "attend: keys [{first}, {end}) wanted, {} readable",
            kv.len()
        );
    }
    let keys = Keys { kv, hd, ranges, kv_off, scale };
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

/// What the query rows of one call read: `kv`'s KV head at `kv_off`, `hd` values a head,
/// each row its own keys of `ranges`, scores scaled by `scale`.
struct Keys<'a> {
    kv: &'a KvView<'a>,
    hd: usize,
    ranges: Ranges<'a>,
    kv_off: usize,
    scale: f32,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn attend_avx512(q: &[f32], keys: &Keys, out: &mut [f32]) {
    attend_with::<super::simd::Avx512>(q, keys, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(q: &[f32], keys: &Keys, out: &mut [f32]) {
    attend_with::<super::simd::Avx2>(q, keys, out)
}

/// The rows in blocks of four, all of them in one pass over the keys, then the rest (a
/// `match`, not a closure: a closure would not inherit the caller's target features).
#[inline(always)]
fn attend_with<S: Simd16>(q: &[f32], keys: &Keys, out: &mut [f32]) {
    let hd = keys.hd;
    let rows = q.len() / hd;
    let full = rows / 4 * 4;
    if full > 0 {
        attend_block::<S, 4>(&q[..full * hd], keys, 0, &mut out[..full * hd]);
    }
    let (q, out) = (&q[full * hd..], &mut out[full * hd..]);
    match rows - full {
        3 => attend_block::<S, 3>(q, keys, full, out),
        2 => attend_block::<S, 2>(q, keys, full, out),
        1 => attend_block::<S, 1>(q, keys, full, out),
        _ => {}
    }
}

/// Blocks of `B` rows (`q`: `[blocks * B][hd]`, `out` likewise; row `i`'s keys
/// `keys.ranges.row(row0 + i)`), each row with its own online softmax: per row, chunk by
/// chunk over its keys, the scores, the running maximum and rescale, then `l += p` and `out
/// += p * v` in key order. The chunks run over the ranges' union, each chunk through every
/// block before the next (its K and V rows read from memory once for all of them); a
/// block's scores are computed for the chunk's keys that any of its rows takes, and each
/// row takes those of its own.
#[inline(always)]
fn attend_block<S: Simd16, const B: usize>(q: &[f32], keys: &Keys, row0: usize, out: &mut [f32]) {
    let &Keys { kv, hd, ranges, kv_off, scale } = keys;
    let blocks = q.len() / (B * hd);
    let block_ranges: Vec<[(usize, usize); B]> =
        (0..blocks).map(|k| std::array::from_fn(|b| ranges.row(row0 + k * B + b))).collect();
    let first = block_ranges.iter().flatten().map(|r| r.0).min().unwrap_or(0);
    let n_keys = block_ranges.iter().flatten().map(|r| r.1).max().unwrap_or(0);
    let mut ms = vec![[f32::NEG_INFINITY; B]; blocks];
    let mut ls = vec![[0.0f32; B]; blocks];
    out.fill(0.0);
    // A quantized cache dequantizes each key into `key_buf` (consumed by its dot at once)
    // and a chunk's values into `value_buf`; an f32 cache lends slices, and a bf16 cache's
    // rows go to the tile and to P·V as stored, widened exactly as they load: the bits of
    // f32 rows holding the same values.
    let dequantizes = !kv.lends_rows();
    let mut key_buf = vec![0.0f32; if dequantizes { KEY_TILE * hd } else { 0 }];
    let mut value_buf = vec![0.0f32; if dequantizes { CHUNK.min(n_keys - first) * hd } else { 0 }];
    for chunk in (first / CHUNK)..n_keys.div_ceil(CHUNK) {
        let (c0, c1) = ((chunk * CHUNK).max(first), ((chunk + 1) * CHUNK).min(n_keys));
        let n = c1 - c0;
        // The chunk's V rows, for every block: a bf16 cache's as stored, an f32 cache's
        // lent, a quantized cache's dequantized.
        let bf16_rows = kv.value_bf16(c0, kv_off, hd).is_some();
        let mut v_bf16: [&[bf16]; CHUNK] = [&[]; CHUNK];
        let mut v_f32: [&[f32]; CHUNK] = [&[]; CHUNK];
        if bf16_rows {
            // One lookup for a chunk in one block of consecutive slots, else row by row.
            if let Some(run) = kv.rows_bf16(c0, n, kv_off, hd, false) {
                let stride = kv.row_stride();
                for (i, row) in v_bf16[..n].iter_mut().enumerate() {
                    *row = &run[i * stride..i * stride + hd];
                }
            } else {
                for (row, pos) in v_bf16.iter_mut().zip(c0..c1) {
                    *row = kv.value_bf16(pos, kv_off, hd).unwrap_or(&[]);
                }
            }
        } else {
            let mut spare = value_buf.chunks_mut(hd);
            for (row, pos) in v_f32.iter_mut().zip(c0..c1) {
                // An f32 cache lends its own rows and leaves the buffer alone.
                *row = kv.value(pos, kv_off, hd, spare.next().unwrap_or(&mut []));
            }
        }
        for (k, rg) in block_ranges.iter().enumerate() {
            // Row b's keys in this chunk, `own[b].0 .. own[b].1` from c0 (empty outside
            // its range), and the keys any row of the block takes.
            let own: [(usize, usize); B] = std::array::from_fn(|b| {
                let (lo, hi) = (c0.max(rg[b].0), c1.min(rg[b].1));
                if lo < hi {
                    (lo - c0, hi - c0)
                } else {
                    (0, 0)
                }
            });
            let taken = own.iter().filter(|o| o.0 < o.1);
            let (ja, jz) = (taken.clone().map(|o| o.0).min(), taken.map(|o| o.1).max());
            let (Some(ja), Some(jz)) = (ja, jz) else { continue };
            let (q, out) = (&q[k * B * hd..(k + 1) * B * hd], &mut out[k * B * hd..(k + 1) * B * hd]);
            let (m, l) = (&mut ms[k], &mut ls[k]);
            let mut scores = [[0.0f32; CHUNK]; B];
            let mut j = ja;
            while j < jz {
                // KEY_TILE keys at once where their rows are evenly spaced: B x KEY_TILE
                // independent sums instead of B chains of dependent FMAs, each the same dot.
                if j + KEY_TILE <= jz {
                    if let Some((key, dtype, stride)) = key_block(kv, c0 + j, kv_off, hd, &mut key_buf) {
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
                let (key, dtype) = key_row(kv, c0 + j, kv_off, hd, &mut key_buf);
                let mut dots = [0.0f32; B];
                // SAFETY: `q` holds B rows of hd f32 and `key` hd values of `dtype`; B
                // outputs, one per row (each the canonical dot of `simd::dot_f32`).
                unsafe { tile::<S, B, 1>(q.as_ptr(), hd, key, dtype, 0, dots.as_mut_ptr(), 1) };
                for (row, dot) in scores.iter_mut().zip(dots) {
                    row[j] = dot * scale;
                }
                j += 1;
            }
            for b in 0..B {
                let (a, z) = own[b];
                if a == z {
                    continue;
                }
                let cm = scores[b][a..z].iter().copied().fold(f32::NEG_INFINITY, f32::max);
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
            // Each row's probabilities, `l += p` in key order.
            let mut probs = [[0.0f32; CHUNK]; B];
            for b in 0..B {
                for j in own[b].0..own[b].1 {
                    let p = (scores[b][j] - m[b]).exp();
                    l[b] += p;
                    probs[b][j] = p;
                }
            }
            if bf16_rows {
                accumulate_pv::<B, bf16>(&probs, &own, &v_bf16[..n], out, hd);
            } else {
                accumulate_pv::<B, f32>(&probs, &own, &v_f32[..n], out, hd);
            }
        }
    }
    for (k, l) in ls.iter().enumerate() {
        for b in 0..B {
            let inv = 1.0 / l[b];
            for o in out[(k * B + b) * hd..(k * B + b + 1) * hd].iter_mut() {
                *o *= inv;
            }
        }
    }
}

/// Keys whose scores one tile computes together.
const KEY_TILE: usize = 4;

/// The K rows of positions `pos .. pos + KEY_TILE` as one evenly spaced block: (first
/// row, dtype, bytes from one row to the next). A bf16 or f32 cache lends its rows (evenly
/// spaced where the positions' slots are consecutive; None across a ring's wrap or the
/// window's edge); a quantized cache's rows are dequantized into `buf` (`KEY_TILE` rows).
#[inline(always)]
fn key_block(
    kv: &KvView,
    pos: usize,
    kv_off: usize,
    hd: usize,
    buf: &mut [f32],
) -> Option<(*const u8, WeightDtype, usize)> {
    if let Some(run) = kv.rows_bf16(pos, KEY_TILE, kv_off, hd, true) {
        return Some((run.as_ptr().cast(), WeightDtype::Bf16, kv.row_stride() * 2));
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

/// `out[b] += p[b][j] * v[j]` for the chunk's keys `j` of row `b` (`own[b].0 .. own[b].1`)
/// in order, each a product rounded and then a sum rounded, as element-wise loops give it:
/// `PV_BLOCK` values of every row at a time stay in registers while the keys stream past,
/// where a loop over keys would load and store the whole output for each key (the same
/// bits: each value's sum runs over the same keys in the same order).
#[inline(always)]
fn accumulate_pv<const B: usize, T: Widen>(
    probs: &[[f32; CHUNK]; B],
    own: &[(usize, usize); B],
    rows: &[&[T]],
    out: &mut [f32],
    hd: usize,
) {
    // Every row takes every key (all but a prompt's last chunk): the loop without the test.
    let every_key = own.iter().all(|&o| o == (0, rows.len()));
    let mut e0 = 0;
    while e0 + PV_BLOCK <= hd {
        let mut acc = [[0.0f32; PV_BLOCK]; B];
        for (b, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&out[b * hd + e0..b * hd + e0 + PV_BLOCK]);
        }
        if every_key {
            for (j, v) in rows.iter().enumerate() {
                let v = &v[e0..e0 + PV_BLOCK];
                for (a, p) in acc.iter_mut().zip(probs) {
                    add_scaled(a, p[j], v);
                }
            }
        } else {
            for (j, v) in rows.iter().enumerate() {
                let v = &v[e0..e0 + PV_BLOCK];
                for ((a, p), &(lo, hi)) in acc.iter_mut().zip(probs).zip(own) {
                    if j < lo || j >= hi {
                        continue;
                    }
                    add_scaled(a, p[j], v);
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
            for ((o, p), &(lo, hi)) in out.chunks_mut(hd).zip(probs).zip(own) {
                if j < lo || j >= hi {
                    continue;
                }
                add_scaled(&mut o[e0..], p[j], &v[e0..]);
            }
        }
    }
}

/// `out[e] += p * v[e]`, a product rounded and then a sum rounded, for each value.
#[inline(always)]
fn add_scaled<T: Widen>(out: &mut [f32], p: f32, v: &[T]) {
    for (o, &vv) in out.iter_mut().zip(v) {
        *o += p * vv.f32();
    }
}
