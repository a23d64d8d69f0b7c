//! Row invariance of the kernels, compared bit for bit, with negative controls on
//! candle's stock ops.

mod common;

use candle_core::{Device, Tensor};
use common::{bits, Lcg};
use mtp::base::{Weight, WeightDtype};
use mtp::cache::KvView;
use mtp::kernels::ops::{attend, bf16_matmul, linear, linear_bf16, simd};

fn weight(rng: &mut Lcg, n: usize, k: usize, dtype: WeightDtype) -> Weight {
    let v = rng.vec(n * k);
    match dtype {
        WeightDtype::F32 => Weight::from_f32(v, n, k),
        // Round to the narrow dtype so the weight is exactly representable in it, then
        // check the kernel's on-the-fly widening path through a checkpoint-like buffer.
        WeightDtype::Bf16 => Weight::from_le_bytes(
            v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
            dtype,
            n,
            k,
        ),
        WeightDtype::F16 => Weight::from_le_bytes(
            v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
            dtype,
            n,
            k,
        ),
    }
}

fn run_linear(x: &[f32], m: usize, w: &Weight) -> Vec<f32> {
    let mut out = vec![0.0; m * w.rows];
    linear(x, m, w, None, &mut out);
    out
}

#[test]
fn matmul_row_is_independent_of_m_and_other_rows() {
    let mut rng = Lcg(1);
    let shapes =
        [(1, 1), (7, 3), (16, 5), (33, 64), (96, 96), (128, 1024), (1024, 128), (300, 67), (4096, 96)];
    for (&(k, n), dtype) in
        shapes.iter().zip([WeightDtype::F32, WeightDtype::Bf16, WeightDtype::F16].iter().cycle())
    {
        let w = weight(&mut rng, n, k, *dtype);
        let row = rng.vec(k);
        let alone = run_linear(&row, 1, &w);
        for m in [2, 3, 4, 5, 8, 13, 20, 64] {
            let mut x = rng.vec(m * k);
            let at = rng.below(m);
            x[at * k..(at + 1) * k].copy_from_slice(&row);
            let out = run_linear(&x, m, &w);
            assert_eq!(
                bits(&out[at * n..(at + 1) * n]),
                bits(&alone),
                "k={k} n={n} m={m} row {at} {dtype:?}"
            );
        }
    }
}

/// bf16 activations (`--activations bf16`): a row's bits do not depend on M, on the other
/// rows or on the threads, at every K (whole chunks and a partial last one).
#[test]
fn bf16_activation_matmul_row_is_independent_of_m_other_rows_and_threads() {
    let mut rng = Lcg(11);
    for (k, n) in [(1, 1), (31, 9), (32, 5), (33, 64), (200, 37), (1024, 128), (3072, 70)] {
        let w = weight(&mut rng, n, k, WeightDtype::Bf16);
        let row = rng.vec(k);
        let mut alone = vec![0.0; n];
        linear_bf16(&row, 1, &w, None, &mut alone);
        for m in [2, 3, 4, 5, 8, 13, 64] {
            let mut x = rng.vec(m * k);
            let at = rng.below(m);
            x[at * k..(at + 1) * k].copy_from_slice(&row);
            let mut out = vec![0.0; m * n];
            linear_bf16(&x, m, &w, None, &mut out);
            assert_eq!(bits(&out[at * n..(at + 1) * n]), bits(&alone), "k={k} n={n} m={m} row {at}");
            let mut one = vec![0.0; m * n];
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap()
                .install(|| linear_bf16(&x, m, &w, None, &mut one));
            assert_eq!(bits(&one), bits(&out), "k={k} n={n} m={m}: one thread");
        }
    }
    eprintln!("bf16-activation path: {:?}", bf16_matmul::path());
}

/// The bf16-activation matmul is its own order, not the f32 one: on the same data the two
/// modes give different bits (so a test of one mode cannot pass on the other's kernel).
#[test]
fn bf16_activations_and_f32_activations_differ() {
    let mut rng = Lcg(12);
    let (m, k, n) = (4, 512, 64);
    let w = weight(&mut rng, n, k, WeightDtype::Bf16);
    let x = rng.vec(m * k);
    let mut bf16 = vec![0.0; m * n];
    linear_bf16(&x, m, &w, None, &mut bf16);
    assert_ne!(bits(&bf16), bits(&run_linear(&x, m, &w)));
}

#[test]
fn matmul_is_independent_of_thread_count() {
    let mut rng = Lcg(2);
    let (m, k, n) = (9, 512, 700);
    let w = weight(&mut rng, n, k, WeightDtype::F32);
    let x = rng.vec(m * k);
    let many = run_linear(&x, m, &w);
    let one =
        rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| run_linear(&x, m, &w));
    assert_eq!(bits(&many), bits(&one));
}

#[test]
fn matmul_reads_16_bit_weights_in_place_in_the_canonical_order() {
    // A bf16/f16 checkpoint tensor read in place gives each output the canonical dot of
    // its dtype (simd.rs): for f16 the same bits as the values stored as f32; for bf16 the
    // bf16 pair order, the same for every M.
    let mut rng = Lcg(3);
    let (m, k, n) = (5, 200, 37);
    let x = rng.vec(m * k);
    for dtype in [WeightDtype::Bf16, WeightDtype::F16] {
        let vals: Vec<f32> = rng.vec(n * k);
        let narrow: Vec<u8> = vals
            .iter()
            .flat_map(|v| match dtype {
                WeightDtype::Bf16 => half::bf16::from_f32(*v).to_le_bytes(),
                _ => half::f16::from_f32(*v).to_le_bytes(),
            })
            .collect();
        let widened: Vec<f32> = narrow
            .chunks(2)
            .map(|b| {
                let u = u16::from_le_bytes([b[0], b[1]]);
                match dtype {
                    WeightDtype::Bf16 => half::bf16::from_bits(u).to_f32(),
                    _ => half::f16::from_bits(u).to_f32(),
                }
            })
            .collect();
        let mut dots = vec![0.0; m * n];
        for r in 0..m {
            for c in 0..n {
                dots[r * n + c] =
                    simd::dot(&x[r * k..(r + 1) * k], &narrow[c * k * 2..(c + 1) * k * 2], dtype);
            }
        }
        let in_place = run_linear(&x, m, &Weight::from_le_bytes(narrow.clone(), dtype, n, k));
        assert_eq!(bits(&in_place), bits(&dots), "{dtype:?}");
        for rows in 1..m {
            let fewer = run_linear(&x[..rows * k], rows, &Weight::from_le_bytes(narrow.clone(), dtype, n, k));
            assert_eq!(bits(&fewer), bits(&in_place[..rows * n]), "{dtype:?}, {rows} rows");
        }
        if dtype == WeightDtype::F16 {
            let out_f32 = run_linear(&x, m, &Weight::from_f32(widened, n, k));
            assert_eq!(bits(&in_place), bits(&out_f32), "{dtype:?}");
        }
    }
}

/// Negative control: candle's stock matmul gives a row different bits depending on M,
/// so the test above is able to fail.
#[test]
fn negative_control_stock_matmul_depends_on_m() {
    let mut rng = Lcg(4);
    let mut differs = 0;
    for &(k, n) in &[(4096, 4096), (1024, 128), (1024, 3072)] {
        let x = rng.vec(8 * k);
        let w = rng.vec(n * k);
        let wt = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
        let stock = |m: usize| -> Vec<f32> {
            let xt = Tensor::from_slice(&x[..m * k], (m, k), &Device::Cpu).unwrap();
            xt.matmul(&wt.t().unwrap()).unwrap().get(0).unwrap().to_vec1().unwrap()
        };
        let one = stock(1);
        if [2, 3, 8].iter().any(|&m| bits(&stock(m)) != bits(&one)) {
            differs += 1;
        }
    }
    assert!(differs > 0, "candle's stock matmul was row-invariant on every shape: the control cannot fail");
}

fn attend_at(q: &[f32], keys: &[f32], values: &[f32], n_keys: usize, kvd: usize, hd: usize) -> Vec<f32> {
    let mut out = vec![0.0; hd];
    attend(q, &KvView::contiguous(keys, values, kvd), n_keys, 0, 1.0 / (hd as f32).sqrt(), &mut out);
    out
}

#[test]
fn attention_never_reads_past_its_position() {
    let mut rng = Lcg(5);
    for &(hd, kvh) in &[(16, 1), (24, 2), (128, 2)] {
        let kvd = hd * kvh;
        for n_keys in [1, 5, 31, 32, 33, 100, 257] {
            let q = rng.vec(hd);
            let keys = rng.vec(n_keys * kvd);
            let values = rng.vec(n_keys * kvd);
            let exact = attend_at(&q, &keys, &values, n_keys, kvd, hd);
            // Same keys followed by garbage (padding, other windows, capacity).
            for extra in [1, 7, 64, 500] {
                let mut k2 = keys.clone();
                k2.extend(rng.vec(extra * kvd).iter().map(|v| v * 1e3));
                let mut v2 = values.clone();
                v2.extend(rng.vec(extra * kvd));
                assert_eq!(bits(&attend_at(&q, &k2, &v2, n_keys, kvd, hd)), bits(&exact));
            }
        }
    }
}

/// The attention order written out one value at a time (`ops::attention`'s contract): chunks
/// of 32 keys anchored at position 0; scores the canonical dot (`simd::dot_f32`) times
/// `scale`; the running maximum and, where it grows, `l` and the output rescaled by
/// `exp(old - new)`; then in key order `l += p` and `o += p * v`, each a product rounded
/// and a sum rounded (`fused`: one fused multiply-add instead, the control's order);
/// finally `o * (1 / l)`.
#[allow(clippy::too_many_arguments)]
fn attention_written_out(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    first: usize,
    n_keys: usize,
    (kvd, off, hd): (usize, usize, usize),
    scale: f32,
    fused: bool,
) -> Vec<f32> {
    let (mut m, mut l, mut o) = (f32::NEG_INFINITY, 0.0f32, vec![0.0f32; hd]);
    for chunk in first / 32..n_keys.div_ceil(32) {
        let (c0, c1) = ((chunk * 32).max(first), ((chunk + 1) * 32).min(n_keys));
        let s: Vec<f32> = (c0..c1).map(|p| simd::dot_f32(q, &keys[p * kvd + off..][..hd]) * scale).collect();
        let m_new = s.iter().copied().fold(m, f32::max);
        if m_new > m {
            let alpha = (m - m_new).exp();
            l *= alpha;
            o.iter_mut().for_each(|x| *x *= alpha);
            m = m_new;
        }
        for (score, pos) in s.iter().zip(c0..c1) {
            let p = (score - m).exp();
            l += p;
            for (x, &v) in o.iter_mut().zip(&values[pos * kvd + off..][..hd]) {
                *x = if fused { p.mul_add(v, *x) } else { *x + p * v };
            }
        }
    }
    let inv = 1.0 / l;
    o.iter().map(|x| x * inv).collect()
}

/// Every head of `attend_heads` has exactly the bits of the order written out, for head
/// sizes whose values split into whole register blocks, a remainder or both (16, 24, 80,
/// 128, 200), 1 to 5 heads, full and sliding ranges. Control: the written-out order with a
/// fused multiply-add in `o += p * v` differs, so the comparison sees that step's rounding.
#[test]
fn attention_has_the_bits_of_its_order_written_out() {
    use mtp::kernels::ops::attend_heads;
    let mut rng = Lcg(23);
    let mut control_differs = false;
    for (hd, g) in [(16, 1), (24, 2), (80, 3), (128, 2), (200, 5)] {
        let (kvh, n_keys) = (2, 75);
        let kvd = hd * kvh;
        let (keys, values) = (rng.vec(n_keys * kvd), rng.vec(n_keys * kvd));
        let view = KvView::contiguous(&keys, &values, kvd);
        let scale = 1.0 / (hd as f32).sqrt();
        let q = rng.vec(g * hd);
        for (kv_head, first, end) in [(0, 0, n_keys), (1, 0, 33), (1, 40, n_keys)] {
            let mut got = vec![0.0; g * hd];
            attend_heads(&q, hd, &view, first, end, kv_head * hd, scale, &mut got);
            for (h, (qh, o)) in q.chunks(hd).zip(got.chunks(hd)).enumerate() {
                let at = (kvd, kv_head * hd, hd);
                let want = attention_written_out(qh, &keys, &values, first, end, at, scale, false);
                assert_eq!(bits(o), bits(&want), "head size {hd}, head {h} of {g}, keys [{first}, {end})");
                let fused = attention_written_out(qh, &keys, &values, first, end, at, scale, true);
                control_differs |= bits(&fused) != bits(&want);
            }
        }
    }
    assert!(control_differs, "control: a fused P·V step gave the same bits everywhere");
}

/// Query heads sharing a KV head computed together (`attend_heads`: each K/V row read once
/// for up to four heads) give each head the bits it has alone, for 1 to 9 heads (blocks of
/// 4, 3, 2 and 1), both KV heads, full and sliding ranges. Control: the same heads with
/// their KV offsets swapped differ, so the comparison sees which keys a head read.
#[test]
fn grouped_query_heads_have_the_bits_of_each_head_alone() {
    use mtp::kernels::ops::{attend_from, attend_heads};
    let mut rng = Lcg(9);
    let (hd, kvh) = (64, 2);
    let kvd = hd * kvh;
    let n_keys = 77;
    let keys = rng.vec(n_keys * kvd);
    let values = rng.vec(n_keys * kvd);
    let view = KvView::contiguous(&keys, &values, kvd);
    let scale = 1.0 / (hd as f32).sqrt();
    for g in 1..=9 {
        let q = rng.vec(g * hd);
        for (kv_head, first) in [(0, 0), (1, 0), (1, 40)] {
            let mut together = vec![0.0; g * hd];
            attend_heads(&q, hd, &view, first, n_keys, kv_head * hd, scale, &mut together);
            let mut alone = vec![0.0; g * hd];
            for (qh, o) in q.chunks(hd).zip(alone.chunks_mut(hd)) {
                attend_from(qh, &view, first, n_keys, kv_head * hd, scale, o);
            }
            assert_eq!(bits(&together), bits(&alone), "{g} heads, KV head {kv_head}, keys from {first}");
            let mut other = vec![0.0; g * hd];
            attend_heads(&q, hd, &view, first, n_keys, (1 - kv_head) * hd, scale, &mut other);
            assert_ne!(bits(&other), bits(&alone), "control: {g} heads, KV head {kv_head}");
        }
    }
}

/// Query rows with ranges of their own computed together (`attend_rows`: a prompt's tokens
/// and their heads, blocks of up to four reading each K/V row of the ranges' union once)
/// give each row the bits it has alone, for 1 to 9 rows whose ranges end and start inside
/// chunks, on chunk boundaries and in different chunks (sliding windows), over f32 and bf16
/// stores, head sizes with and without a remainder past the P·V register block. Control:
/// the first row given the second's range differs, so the comparison sees which keys a
/// row read.
#[test]
fn query_rows_with_their_own_ranges_have_the_bits_of_each_row_alone() {
    use mtp::cache::{Bf16Kv, KvStore, SlotMap};
    use mtp::kernels::ops::{attend_from, attend_rows};
    let mut rng = Lcg(31);
    let ranges = [(0, 70), (0, 71), (0, 33), (40, 64), (10, 65), (63, 77), (0, 5), (39, 40), (0, 77)];
    for hd in [64, 80] {
        let (kvh, n_keys) = (2, 77);
        let kvd = hd * kvh;
        let (keys, values) = (rng.vec(n_keys * kvd), rng.vec(n_keys * kvd));
        let mut store = Bf16Kv::new(1, kvd);
        store.grow(n_keys).unwrap();
        store.write(0, 0, &keys, &values);
        let map = SlotMap { committed: n_keys, base: n_keys, ring: 0 };
        let views = [KvView::contiguous(&keys, &values, kvd), KvView::of_store(&store, 0, map).unwrap()];
        let scale = 1.0 / (hd as f32).sqrt();
        for view in &views {
            for rows in 1..=ranges.len() {
                let q = rng.vec(rows * hd);
                for kv_head in 0..kvh {
                    let mut together = vec![0.0; rows * hd];
                    attend_rows(&q, hd, view, &ranges[..rows], kv_head * hd, scale, &mut together);
                    let mut alone = vec![0.0; rows * hd];
                    for ((qr, o), &(first, end)) in q.chunks(hd).zip(alone.chunks_mut(hd)).zip(&ranges) {
                        attend_from(qr, view, first, end, kv_head * hd, scale, o);
                    }
                    assert_eq!(
                        bits(&together),
                        bits(&alone),
                        "head size {hd}, {rows} rows, KV head {kv_head}"
                    );
                    if rows > 1 {
                        let mut moved = ranges[..rows].to_vec();
                        moved[0] = ranges[1];
                        let mut other = vec![0.0; rows * hd];
                        attend_rows(&q, hd, view, &moved, kv_head * hd, scale, &mut other);
                        assert_ne!(
                            bits(&other[..hd]),
                            bits(&alone[..hd]),
                            "control: {rows} rows, KV head {kv_head}"
                        );
                    }
                }
            }
        }
    }
}

/// bf16 K/V (`--kv-dtype bf16` on the CPU): attention over a bf16 store gives, bit for bit,
/// what it gives over f32 K/V holding the same rounded values (keys widen exactly as the
/// tile loads them, values as they are read), for 1 to 5 query heads, both KV heads, full
/// and sliding ranges. Control: over the unrounded f32 values the bits differ, so the
/// comparison sees the rounding.
#[test]
fn bf16_kv_attention_has_the_bits_of_f32_kv_holding_the_rounded_values() {
    use mtp::cache::{Bf16Kv, KvStore, SlotMap};
    use mtp::kernels::ops::attend_heads;
    let mut rng = Lcg(17);
    let (hd, kvh, n_keys) = (128, 2, 70);
    let kvd = hd * kvh;
    let (keys, values) = (rng.vec(n_keys * kvd), rng.vec(n_keys * kvd));
    let round = |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect() };
    let (rk, rv) = (round(&keys), round(&values));
    let mut store = Bf16Kv::new(1, kvd);
    store.grow(n_keys).unwrap();
    store.write(0, 0, &keys, &values);
    let map = SlotMap { committed: n_keys, base: n_keys, ring: 0 };
    let bf16 = KvView::of_store(&store, 0, map).unwrap();
    let (rounded, unrounded) = (KvView::contiguous(&rk, &rv, kvd), KvView::contiguous(&keys, &values, kvd));
    let scale = 1.0 / (hd as f32).sqrt();
    for g in 1..=5 {
        let q = rng.vec(g * hd);
        for (kv_head, first) in [(0, 0), (1, 0), (1, 40)] {
            let run = |view: &KvView| {
                let mut out = vec![0.0; g * hd];
                attend_heads(&q, hd, view, first, n_keys, kv_head * hd, scale, &mut out);
                bits(&out)
            };
            let got = run(&bf16);
            assert_eq!(got, run(&rounded), "{g} heads, KV head {kv_head}, keys from {first}");
            assert_ne!(got, run(&unrounded), "control: {g} heads, KV head {kv_head}");
        }
    }
}

/// Attention scores keys four at a time where their rows are evenly spaced in the store and
/// one at a time elsewhere (a ring's wrap, the open window after the committed positions):
/// a ring store with its window, in f32 and bf16, gives every query the bits of a plain
/// store holding the same positions, for keys starting at each offset into a group of four.
/// Control: the same ring read with one position's slot moved (another key) differs.
#[test]
fn attention_has_the_same_bits_wherever_its_keys_are_stored() {
    use mtp::cache::{Bf16Kv, HostKv, KvStore, SlotMap};
    use mtp::kernels::ops::attend_heads;
    let mut rng = Lcg(23);
    let (hd, kvh, n_keys) = (64, 2, 70);
    let kvd = hd * kvh;
    let (keys, values) = (rng.vec(n_keys * kvd), rng.vec(n_keys * kvd));
    // Ring of 48 slots holding committed positions 14..62 (position p at slot p % 48, so
    // the ring wraps at position 48), the window 62..70 at slots 48..56.
    let (ring, committed) = (48, 62);
    let map = SlotMap { committed, base: ring, ring };
    let slot_of = |p: usize| map.slot(p);
    let mut f32_ring = HostKv::<f32>::new(1, kvd);
    let mut bf16_ring = Bf16Kv::new(1, kvd);
    let mut bf16_plain = Bf16Kv::new(1, kvd);
    f32_ring.grow(ring + n_keys - committed).unwrap();
    bf16_ring.grow(ring + n_keys - committed).unwrap();
    bf16_plain.grow(n_keys).unwrap();
    for p in 0..n_keys {
        let (k, v) = (&keys[p * kvd..(p + 1) * kvd], &values[p * kvd..(p + 1) * kvd]);
        bf16_plain.write(0, p, k, v);
        if p >= committed - ring {
            f32_ring.write(0, slot_of(p), k, v);
            bf16_ring.write(0, slot_of(p), k, v);
        }
    }
    let plain_map = SlotMap { committed: n_keys, base: n_keys, ring: 0 };
    let views = [
        (KvView::contiguous(&keys, &values, kvd), KvView::of_store(&f32_ring, 0, map).unwrap(), "f32"),
        (
            KvView::of_store(&bf16_plain, 0, plain_map).unwrap(),
            KvView::of_store(&bf16_ring, 0, map).unwrap(),
            "bf16",
        ),
    ];
    let scale = 1.0 / (hd as f32).sqrt();
    for (plain, ringed, dtype) in &views {
        for g in [1, 2, 3] {
            let q = rng.vec(g * hd);
            for first in [14, 15, 16, 17, 33, 45, 47, 60, 66] {
                for kv_head in 0..kvh {
                    let run = |view: &KvView| {
                        let mut out = vec![0.0; g * hd];
                        attend_heads(&q, hd, view, first, n_keys, kv_head * hd, scale, &mut out);
                        bits(&out)
                    };
                    assert_eq!(
                        run(ringed),
                        run(plain),
                        "{dtype}: {g} heads, keys from {first}, KV head {kv_head}"
                    );
                }
            }
        }
    }
    // Control: position 50's slot (2) holds position 20's key instead.
    let mut moved = HostKv::<f32>::new(1, kvd);
    moved.grow(ring + n_keys - committed).unwrap();
    for p in committed - ring..n_keys {
        let src = if p == 50 { 20 } else { p };
        moved.write(0, slot_of(p), &keys[src * kvd..(src + 1) * kvd], &values[src * kvd..(src + 1) * kvd]);
    }
    let q = rng.vec(hd);
    let run = |view: &KvView| {
        let mut out = vec![0.0; hd];
        attend_heads(&q, hd, view, 14, n_keys, 0, scale, &mut out);
        bits(&out)
    };
    assert_ne!(run(&KvView::of_store(&moved, 0, map).unwrap()), run(&views[0].0), "control: a moved key");
}

/// Negative control: stock attention (matmul, masked softmax, matmul) over a zero-padded
/// key length gives different bits for the same query as the unpadded length.
#[test]
fn negative_control_stock_attention_depends_on_padding() {
    let mut rng = Lcg(6);
    let hd = 64;
    let mut differs = false;
    for n_keys in [20usize, 40, 100, 300] {
        let q = rng.vec(hd);
        let keys = rng.vec(n_keys * hd);
        let values = rng.vec(n_keys * hd);
        let stock = |len: usize| -> Vec<f32> {
            let dev = Device::Cpu;
            let mut kp = keys.clone();
            kp.resize(len * hd, 0.0);
            let mut vp = values.clone();
            vp.resize(len * hd, 0.0);
            let qt = Tensor::from_slice(&q, (1, hd), &dev).unwrap();
            let kt = Tensor::from_vec(kp, (len, hd), &dev).unwrap();
            let vt = Tensor::from_vec(vp, (len, hd), &dev).unwrap();
            let mask: Vec<f32> = (0..len).map(|j| if j < n_keys { 0.0 } else { f32::NEG_INFINITY }).collect();
            let mask = Tensor::from_vec(mask, (1, len), &dev).unwrap();
            let s = (qt.matmul(&kt.t().unwrap()).unwrap() * (1.0 / (hd as f64).sqrt())).unwrap();
            let p = candle_nn::ops::softmax_last_dim(&s.broadcast_add(&mask).unwrap()).unwrap();
            p.matmul(&vt).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        let base = stock(n_keys);
        if [n_keys + 3, n_keys + 64, 1024].iter().any(|&len| bits(&stock(len)) != bits(&base)) {
            differs = true;
        }
    }
    assert!(differs, "stock attention ignored padding everywhere: the control cannot fail");
}
