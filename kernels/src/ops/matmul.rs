//! Row-invariant matmul: `out[m, n] = dot(x[m, :], w[n, :])` (HF `Linear` layout,
//! weight `N x K`). No split-K: every output is one canonical dot product, so row `m`
//! of the result does not depend on M, on the other rows, or on the thread count.

use rayon::prelude::*;

use super::bf16_matmul;
use super::q4_bf16;
use super::quant_matmul::{self, tile_quant, QuantCols};
use super::simd::{isa, split_pairs_into, tile, tile_pairs, with_scratch, Portable, Simd16};
use mtp_base::weights::{Weight, WeightDtype};

/// Columns of the output one task computes; a task covers every row for its columns so
/// each weight tile is read from memory once.
const COLS_PER_TASK: usize = 64;

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint columns of the output.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// `out (m x n) = x (m x k) . w^T`, plus `bias` (length n) if given.
pub fn linear(x: &[f32], m: usize, w: &Weight, bias: Option<&[f32]>, out: &mut [f32]) {
    matmul_with(x, m, w, bias, out, |x, m, w, out| {
        if w.quant().is_some_and(quant_matmul::fused) {
            fused_quantized(x, m, w, out);
        } else if w.quant().is_some() {
            quantized(x, m, w, out);
        } else {
            row_invariant(x, m, w, out);
        }
    })
}

/// What every matmul entry does around its kernel: the shape checks, nothing for M = 0,
/// the stock-matmul negative control in place of the kernel, then the bias.
fn matmul_with(
    x: &[f32],
    m: usize,
    w: &Weight,
    bias: Option<&[f32]>,
    out: &mut [f32],
    kernel: impl FnOnce(&[f32], usize, &Weight, &mut [f32]),
) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "linear: input is not m x k");
    assert_eq!(out.len(), m * n, "linear: output is not m x n");
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "linear: bias length");
    }
    if m == 0 {
        return;
    }
    if crate::negative_control::stock_matmul() {
        stock_linear(x, m, w, out);
    } else {
        kernel(x, m, w, out);
    }
    if let Some(b) = bias {
        for row in out.chunks_mut(n) {
            for (o, b) in row.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
}

/// Runs `run(n0, n1, out)` for every `COLS_PER_TASK` columns of the `n`-column output
/// (`work` multiply-adds in all); `out` is the output's start, each task writing only
/// its own columns.
fn for_column_tasks(
    n: usize,
    work: usize,
    out: &mut [f32],
    run: impl Fn(usize, usize, *mut f32) + Sync + Send,
) {
    let optr = SendPtr(out.as_mut_ptr());
    for_each_task(n.div_ceil(COLS_PER_TASK), work, |t| {
        let n0 = t * COLS_PER_TASK;
        let o = optr;
        run(n0, (n0 + COLS_PER_TASK).min(n), o.0)
    });
}

/// `out (m x n) = x (m x k) . w^T` (+ `bias`) with bf16 activations, for the weights
/// [`crate::Activations::for_weight`] gives them: bf16 weights (`x` rounded to bf16 at the
/// input, the bf16-activation order of [`bf16_matmul`]) and MLX 4-bit weights with bf16
/// scales (the order of [`q4_bf16`]).
pub fn linear_bf16(x: &[f32], m: usize, w: &Weight, bias: Option<&[f32]>, out: &mut [f32]) {
    if w.quant().is_some() {
        assert!(q4_bf16::takes(w), "linear_bf16: a quantized weight the bf16 order does not take");
        return matmul_with(x, m, w, bias, out, q4_bf16_linear);
    }
    assert!(w.dtype == WeightDtype::Bf16, "linear_bf16: weights are not plain bf16");
    matmul_with(x, m, w, bias, out, |x, m, w, out| {
        let (n, k, wb) = (w.rows, w.cols, w.bytes());
        with_bf16_scratch(|rounded| {
            bf16_matmul::round_rows(x, m, k, rounded);
            // SAFETY: `rounded` holds m padded rows; each task owns columns n0..n1.
            for_column_tasks(n, m * n * k, out, |n0, n1, o| unsafe {
                bf16_columns(rounded.as_ptr(), m, k, wb.as_ptr(), n0, n1, o, n)
            });
        })
    })
}

thread_local! {
    /// The calling thread's buffer for a matmul's rounded input (as [`with_scratch`]).
    static BF16_SCRATCH: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn with_bf16_scratch<R>(f: impl FnOnce(&mut Vec<u16>) -> R) -> R {
    BF16_SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => f(&mut buf),
        Err(_) => f(&mut Vec::new()),
    })
}

/// An MLX 4-bit weight with bf16 activations: `x` rounded and laid out once (with its
/// group sums), then each task's columns in [`q4_bf16::tile`]s.
fn q4_bf16_linear(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    let q = QuantCols::of(w);
    with_bf16_scratch(|words| {
        with_scratch(|sums| {
            q4_bf16::prepare_into(x, m, k, q.group(), words, sums);
            // SAFETY: `words` and `sums` hold m prepared rows; each task owns columns n0..n1.
            for_column_tasks(n, m * n * k, out, |n0, n1, o| unsafe {
                q4_bf16_columns(words.as_ptr(), sums.as_ptr(), m, &q, n0, n1, o, n)
            });
        })
    })
}

#[allow(clippy::too_many_arguments)]
unsafe fn q4_bf16_columns(
    x: *const u16,
    xsum: *const f32,
    m: usize,
    q: &QuantCols,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    match bf16_matmul::path() {
        #[cfg(target_arch = "x86_64")]
        bf16_matmul::Path::Native => q4_bf16_columns_native(x, xsum, m, q, n0, n1, out, ldo),
        #[cfg(target_arch = "x86_64")]
        bf16_matmul::Path::Avx512Emulated => q4_bf16_columns_avx512(x, xsum, m, q, n0, n1, out, ldo),
        #[cfg(target_arch = "x86_64")]
        bf16_matmul::Path::Avx2Emulated => q4_bf16_columns_avx2(x, xsum, m, q, n0, n1, out, ldo),
        _ => q4_bf16_columns_generic::<bf16_matmul::Portable, 2, 2>(x, xsum, m, q, n0, n1, out, ldo),
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
unsafe fn q4_bf16_columns_native(
    x: *const u16,
    xsum: *const f32,
    m: usize,
    q: &QuantCols,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    use bf16_matmul::Avx512Native as S;
    if m == 1 {
        // As the f32-activation tiles: 8 columns of independent sums for one row.
        q4_bf16_columns_generic::<S, 1, 8>(x, xsum, m, q, n0, n1, out, ldo)
    } else {
        q4_bf16_columns_generic::<S, 4, 4>(x, xsum, m, q, n0, n1, out, ldo)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn q4_bf16_columns_avx512(
    x: *const u16,
    xsum: *const f32,
    m: usize,
    q: &QuantCols,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    q4_bf16_columns_generic::<bf16_matmul::Avx512Emulated, 2, 4>(x, xsum, m, q, n0, n1, out, ldo)
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn q4_bf16_columns_avx2(
    x: *const u16,
    xsum: *const f32,
    m: usize,
    q: &QuantCols,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    q4_bf16_columns_generic::<bf16_matmul::Avx2Emulated, 2, 2>(x, xsum, m, q, n0, n1, out, ldo)
}

/// Columns `n0..n1` for all `m` rows in `MR x NR` tiles of [`q4_bf16::tile`]; the edges in
/// tiles of one row or one output (one order per output whatever the tile).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn q4_bf16_columns_generic<S: q4_bf16::Q4Bf16, const MR: usize, const NR: usize>(
    x: *const u16,
    xsum: *const f32,
    m: usize,
    q: &QuantCols,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    let (kp, gp) = q4_bf16::padded(q.group() * q.groups(), q.group());
    let mut n = n0;
    while n < n1 {
        let nr = NR.min(n1 - n);
        let mut r = 0;
        while r < m {
            let mr = MR.min(m - r);
            let (xp, sp, op) = (x.add(r * kp), xsum.add(r * gp), out.add(r * ldo + n));
            if mr == MR && nr == NR {
                q4_bf16::tile::<S, MR, NR>(xp, sp, kp, gp, q, n, op, ldo);
            } else if nr == NR {
                for i in 0..mr {
                    q4_bf16::tile::<S, 1, NR>(
                        xp.add(i * kp),
                        sp.add(i * gp),
                        kp,
                        gp,
                        q,
                        n,
                        op.add(i * ldo),
                        ldo,
                    );
                }
            } else {
                for i in 0..mr {
                    for j in 0..nr {
                        let (xr, sr, o) = (xp.add(i * kp), sp.add(i * gp), op.add(i * ldo + j));
                        q4_bf16::tile::<S, 1, 1>(xr, sr, kp, gp, q, n + j, o, ldo);
                    }
                }
            }
            r += mr;
        }
        n += nr;
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn bf16_columns(
    x: *const u16,
    m: usize,
    k: usize,
    w: *const u8,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    match bf16_matmul::path() {
        #[cfg(target_arch = "x86_64")]
        bf16_matmul::Path::Native => bf16_columns_native(x, m, k, w, n0, n1, out, ldo),
        #[cfg(target_arch = "x86_64")]
        bf16_matmul::Path::Avx512Emulated => bf16_columns_avx512(x, m, k, w, n0, n1, out, ldo),
        #[cfg(target_arch = "x86_64")]
        bf16_matmul::Path::Avx2Emulated => bf16_columns_avx2(x, m, k, w, n0, n1, out, ldo),
        _ => bf16_columns_generic::<bf16_matmul::Portable, 2, 2>(x, m, k, w, n0, n1, out, ldo),
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
unsafe fn bf16_columns_native(
    x: *const u16,
    m: usize,
    k: usize,
    w: *const u8,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    use bf16_matmul::Avx512Native as S;
    if m == 1 {
        bf16_columns_generic::<S, 1, 1>(x, m, k, w, n0, n1, out, ldo)
    } else {
        bf16_columns_generic::<S, 4, 4>(x, m, k, w, n0, n1, out, ldo)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn bf16_columns_avx512(
    x: *const u16,
    m: usize,
    k: usize,
    w: *const u8,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    use bf16_matmul::Avx512Emulated as S;
    if m == 1 {
        bf16_columns_generic::<S, 1, 1>(x, m, k, w, n0, n1, out, ldo)
    } else {
        bf16_columns_generic::<S, 4, 4>(x, m, k, w, n0, n1, out, ldo)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn bf16_columns_avx2(
    x: *const u16,
    m: usize,
    k: usize,
    w: *const u8,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    use bf16_matmul::Avx2Emulated as S;
    if m == 1 {
        bf16_columns_generic::<S, 1, 1>(x, m, k, w, n0, n1, out, ldo)
    } else {
        bf16_columns_generic::<S, 2, 2>(x, m, k, w, n0, n1, out, ldo)
    }
}

/// Columns `n0..n1` for all `m` rows in `MR x NR` bf16-activation tiles; the edges in tiles
/// of one row or one output (the order per output is the same whatever the tile). One row
/// (`m == 1`) takes `1 x 1` tiles, as [`columns_generic`] says why.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn bf16_columns_generic<S: bf16_matmul::Bf16Dot, const MR: usize, const NR: usize>(
    x: *const u16,
    m: usize,
    k: usize,
    w: *const u8,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    let (kp, ws) = (k.div_ceil(bf16_matmul::CHUNK) * bf16_matmul::CHUNK, k * 2);
    let mut n = n0;
    while n < n1 {
        let nr = NR.min(n1 - n);
        let mut r = 0;
        while r < m {
            let mr = MR.min(m - r);
            let (xp, wp, op) = (x.add(r * kp), w.add(n * ws), out.add(r * ldo + n));
            if mr == MR && nr == NR {
                bf16_matmul::tile::<S, MR, NR>(xp, k, wp, ws, op, ldo);
            } else if nr == NR {
                for i in 0..mr {
                    bf16_matmul::tile::<S, 1, NR>(xp.add(i * kp), k, wp, ws, op.add(i * ldo), ldo);
                }
            } else {
                for i in 0..mr {
                    for j in 0..nr {
                        let (xr, o) = (xp.add(i * kp), op.add(i * ldo + j));
                        bf16_matmul::tile::<S, 1, 1>(xr, k, wp.add(j * ws), ws, o, ldo);
                    }
                }
            }
            r += mr;
        }
        n += nr;
    }
}

fn row_invariant(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    let wb = w.bytes();
    let d = w.dtype;
    let run_on = |x: &[f32], out: &mut [f32]| {
        // SAFETY: shapes checked by `matmul_with`; each task owns columns n0..n1.
        for_column_tasks(n, m * n * k, out, |n0, n1, o| unsafe {
            columns(x.as_ptr(), m, k, wb.as_ptr(), d, n0, n1, o, n)
        });
    };
    if d == WeightDtype::Bf16 {
        // bf16 weights take the bf16 order, which reads x pair-split (see `simd`).
        with_scratch(|split| {
            split_pairs_into(x, m, k, split);
            run_on(split, out)
        })
    } else {
        run_on(x, out)
    }
}

/// An affine-quantized weight through the fused tiles (the quantized order of
/// [`quant_matmul`]): each task unpacks its columns' values in registers for all `m` rows.
fn fused_quantized(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    let q = QuantCols::of(w);
    let group = k / q.groups();
    with_scratch(|scratch| {
        // The rows pair-split, then their group sums: `m x k`, then `m x groups`.
        quant_matmul::prepare_into(x, m, k, group, scratch);
        let (split, sums) = scratch.split_at(m * k);
        // SAFETY: `split` and `sums` hold m rows; each task owns columns n0..n1.
        for_column_tasks(n, m * n * k, out, |n0, n1, o| unsafe {
            quant_columns(split.as_ptr(), sums.as_ptr(), m, k, &q, n0, n1, o, n)
        });
    })
}

#[allow(clippy::too_many_arguments)]
unsafe fn quant_columns(
    x: *const f32,
    xsum: *const f32,
    m: usize,
    k: usize,
    q: &QuantCols,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        super::simd::Isa::Avx512 => quant_columns_avx512(x, xsum, m, k, q, n0, n1, out, ldo),
        #[cfg(target_arch = "x86_64")]
        super::simd::Isa::Avx2 => quant_columns_avx2(x, xsum, m, k, q, n0, n1, out, ldo),
        _ => quant_columns_generic::<Portable, 2, 2>(x, xsum, m, k, q, n0, n1, out, ldo),
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn quant_columns_avx512(
    x: *const f32,
    xsum: *const f32,
    m: usize,
    k: usize,
    q: &QuantCols,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    if m == 1 {
        // Unpacking makes one row compute-bound (unlike 16-bit weights): 8 columns give
        // enough independent sums to hide the FMA latency.
        quant_columns_generic::<super::simd::Avx512, 1, 8>(x, xsum, m, k, q, n0, n1, out, ldo)
    } else {
        quant_columns_generic::<super::simd::Avx512, 4, 4>(x, xsum, m, k, q, n0, n1, out, ldo)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quant_columns_avx2(
    x: *const f32,
    xsum: *const f32,
    m: usize,
    k: usize,
    q: &QuantCols,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    quant_columns_generic::<super::simd::Avx2, 2, 2>(x, xsum, m, k, q, n0, n1, out, ldo)
}

/// Columns `n0..n1` for all `m` rows in `MR x NR` quantized tiles; the edges in tiles of
/// one row or one column (the order per output is the same whatever the tile).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn quant_columns_generic<S: Simd16, const MR: usize, const NR: usize>(
    x: *const f32,
    xsum: *const f32,
    m: usize,
    k: usize,
    q: &QuantCols,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    let mut n = n0;
    while n < n1 {
        let nr = NR.min(n1 - n);
        let mut r = 0;
        while r < m {
            let mr = MR.min(m - r);
            // Full tiles, else rows of NR, else one output at a time (no closure: it would
            // not inherit the caller's target features).
            let (rows, cols) = if mr == MR && nr == NR {
                (1, 1)
            } else if nr == NR {
                (mr, 1)
            } else {
                (mr, nr)
            };
            for i in 0..rows {
                for j in 0..cols {
                    let rr = r + i;
                    let (xp, sp, op) = (x.add(rr * k), xsum.add(rr * q.groups()), out.add(rr * ldo + n + j));
                    match (q.bits() == 4, mr == MR && nr == NR, nr == NR) {
                        (true, true, _) => tile_quant::<S, MR, NR, 4>(xp, sp, k, q, n, op, ldo),
                        (false, true, _) => tile_quant::<S, MR, NR, 8>(xp, sp, k, q, n, op, ldo),
                        (true, false, true) => tile_quant::<S, 1, NR, 4>(xp, sp, k, q, n, op, ldo),
                        (false, false, true) => tile_quant::<S, 1, NR, 8>(xp, sp, k, q, n, op, ldo),
                        (true, false, false) => tile_quant::<S, 1, 1, 4>(xp, sp, k, q, n + j, op, ldo),
                        (false, false, false) => tile_quant::<S, 1, 1, 8>(xp, sp, k, q, n + j, op, ldo),
                    }
                }
            }
            r += mr;
        }
        n += nr;
    }
}

/// Output columns one quantized task dequantizes at a time.
const QUANT_COLS_PER_TASK: usize = 16;

/// A quantized weight: each task dequantizes its weight rows to f32 (the same values
/// whatever M) and runs the f32 tiles over them, so the order per output is the f32
/// order for every M.
fn quantized(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    let optr = SendPtr(out.as_mut_ptr());
    let run = |t: usize| {
        let n0 = t * QUANT_COLS_PER_TASK;
        let rows = QUANT_COLS_PER_TASK.min(n - n0);
        let mut scratch = vec![0f32; rows * k];
        for (j, row) in scratch.chunks_mut(k).enumerate() {
            w.row_f32(n0 + j, row);
        }
        let o = optr;
        // SAFETY: `scratch` holds `rows` f32 rows of k; this task owns columns n0..n0+rows.
        unsafe {
            columns(
                x.as_ptr(),
                m,
                k,
                scratch.as_ptr() as *const u8,
                WeightDtype::F32,
                0,
                rows,
                o.0.add(n0),
                n,
            )
        };
    };
    let tasks = n.div_ceil(QUANT_COLS_PER_TASK);
    for_each_task(tasks, m * n * k, run);
}

/// Runs `run(0..tasks)`: on the calling thread for small products (`work` multiply-adds),
/// where waking the pool costs more than it saves, else across the pool.
fn for_each_task(tasks: usize, work: usize, run: impl Fn(usize) + Sync + Send) {
    if work < 1 << 16 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// candle's stock matmul, whose kernel choice depends on M: the path the invariance
/// tests switch on (`negative_control::set_stock_matmul`) to prove they can fail.
fn stock_linear(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    use candle_core::{Device, Tensor};
    let run = || -> candle_core::Result<Vec<f32>> {
        let xt = Tensor::from_slice(x, (m, w.cols), &Device::Cpu)?;
        let wt = Tensor::from_vec(w.to_f32(), (w.rows, w.cols), &Device::Cpu)?;
        xt.matmul(&wt.t()?)?.flatten_all()?.to_vec1::<f32>()
    };
    out.copy_from_slice(&run().expect("stock matmul on valid shapes"));
}

#[allow(clippy::too_many_arguments)]
unsafe fn columns(
    x: *const f32,
    m: usize,
    k: usize,
    w: *const u8,
    d: WeightDtype,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        super::simd::Isa::Avx512 => columns_avx512(x, m, k, w, d, n0, n1, out, ldo),
        #[cfg(target_arch = "x86_64")]
        super::simd::Isa::Avx2 => columns_avx2(x, m, k, w, d, n0, n1, out, ldo),
        _ => columns_generic::<Portable, 2, 2>(x, m, k, w, d, n0, n1, out, ldo),
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn columns_avx512(
    x: *const f32,
    m: usize,
    k: usize,
    w: *const u8,
    d: WeightDtype,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    if m == 1 {
        columns_generic::<super::simd::Avx512, 1, 1>(x, m, k, w, d, n0, n1, out, ldo)
    } else {
        columns_generic::<super::simd::Avx512, 4, 4>(x, m, k, w, d, n0, n1, out, ldo)
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn columns_avx2(
    x: *const f32,
    m: usize,
    k: usize,
    w: *const u8,
    d: WeightDtype,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    if m == 1 {
        columns_generic::<super::simd::Avx2, 1, 1>(x, m, k, w, d, n0, n1, out, ldo)
    } else {
        columns_generic::<super::simd::Avx2, 2, 2>(x, m, k, w, d, n0, n1, out, ldo)
    }
}

/// Tiles columns `n0..n1` for all `m` rows: `NR` weight rows stay hot in L1 while the
/// `MR`-row blocks of `x` stream past them. On x86 one row (`m == 1`, decoding) takes
/// `1 x 1` tiles: each weight row is read front to back, a stream the hardware prefetcher
/// follows, and out-of-order execution overlaps one row's sum with the next (on Zen 4,
/// 1.2-1.4x the bandwidth of 8 interleaved rows with software prefetch; docs/benchmarks.md).
/// The portable path keeps `2 x 2` (not measured where it runs, on Arm).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn columns_generic<S: Simd16, const MR: usize, const NR: usize>(
    x: *const f32,
    m: usize,
    k: usize,
    w: *const u8,
    d: WeightDtype,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    let ws = k * d.size();
    let mut n = n0;
    while n < n1 {
        let nr = NR.min(n1 - n);
        let wp = w.add(n * ws);
        let mut r = 0;
        while r < m {
            let mr = MR.min(m - r);
            let xp = x.add(r * k);
            let op = out.add(r * ldo + n);
            if mr == MR && nr == NR {
                block::<S, MR, NR>(xp, k, wp, d, ws, op, ldo);
            } else if nr == NR && mr < MR {
                // Fewer rows than a full tile (a verify window of 2 or 3 tokens): still
                // one pass over the weights for all of them.
                match mr {
                    1 => block::<S, 1, NR>(xp, k, wp, d, ws, op, ldo),
                    2 => block::<S, 2, NR>(xp, k, wp, d, ws, op, ldo),
                    3 => block::<S, 3, NR>(xp, k, wp, d, ws, op, ldo),
                    _ => edge::<S>(mr, nr, xp, k, wp, d, ws, op, ldo),
                }
            } else {
                edge::<S>(mr, nr, xp, k, wp, d, ws, op, ldo);
            }
            r += mr;
        }
        n += nr;
    }
}

/// Partial tiles at the bottom/right edge, one output row at a time.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn edge<S: Simd16>(
    mr: usize,
    nr: usize,
    x: *const f32,
    k: usize,
    w: *const u8,
    d: WeightDtype,
    ws: usize,
    out: *mut f32,
    ldo: usize,
) {
    for r in 0..mr {
        let xp = x.add(r * k);
        let op = out.add(r * ldo);
        match nr {
            4 => block::<S, 1, 4>(xp, k, w, d, ws, op, ldo),
            3 => block::<S, 1, 3>(xp, k, w, d, ws, op, ldo),
            2 => block::<S, 1, 2>(xp, k, w, d, ws, op, ldo),
            _ => {
                for j in 0..nr {
                    block::<S, 1, 1>(xp, k, w.add(j * ws), d, ws, op.add(j), ldo)
                }
            }
        }
    }
}

/// One tile in the order of the weights' dtype.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn block<S: Simd16, const MR: usize, const NR: usize>(
    x: *const f32,
    k: usize,
    w: *const u8,
    d: WeightDtype,
    ws: usize,
    out: *mut f32,
    ldo: usize,
) {
    if d == WeightDtype::Bf16 {
        tile_pairs::<S, MR, NR>(x, k, w, ws, out, ldo)
    } else {
        tile::<S, MR, NR>(x, k, w, d, ws, out, ldo)
    }
}
