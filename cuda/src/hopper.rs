//! The Hopper matmul (`hopper.cu`, compiled for sm_90a): its module, loaded only on a GPU of
//! compute capability 9.0, and its launch, whose operands the TMA reads through descriptors
//! made here. It sums every output in the canonical order of the other tensor-core kernels
//! (`matmul_tc.cuh`, `matmul_tt.cuh`), so picking it changes the speed, never the bits.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice};
use mtp_base::error::{Error, Result};
use mtp_kernels::Out;

use crate::matmul_tc::GRID_SMS;
use crate::scratch::Scratch;
use crate::{ptr, Cuda, CudaMat, TcKernel};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/hopper.ptx"));

/// A block: 128 weight rows (output columns) x 128 tokens (`linear_wg_bf16_128x128_x1`,
/// `linear_wg_phases_bf16_128x128_x1`), 64 (`linear_wg_phases_bf16_128x64_x1`,
/// `linear_wg_phases_parts_bf16_128x64_x1`) or 192 (`linear_wg_bf16_128x192_x1`), a
/// warpgroup loading and two multiplying; in `Functions::linear_wg`'s order.
const COLS: usize = 128;
const TOKS: [usize; 5] = [128, 64, 128, 64, 192];
const THREADS: u32 = 384;
/// K per stage (one 128-byte swizzled row of the tokens' tile), stages in flight.
const STAGE_K: usize = 64;
/// K per box of the weights' tile: two 64-byte rows a stage, unswizzled (a warp's 16-byte
/// fragment loads from rows g and g + 1 then sit side by side: no bank conflicts).
const WEIGHT_BOX_K: usize = 32;
const STAGES: usize = 4;
/// Each kernel's dynamic shared memory: the stages, 1,024 bytes to align them to the
/// swizzle's period, and the 2 x STAGES barriers.
pub(crate) const SMEM_BYTES: [u32; 5] =
    [smem_bytes(TOKS[0]), smem_bytes(TOKS[1]), smem_bytes(TOKS[2]), smem_bytes(TOKS[3]), smem_bytes(TOKS[4])];

/// Blocks of a 64-token phase-split launch over `rows` weight rows and `m` tokens: 8 phases
/// a 128-column, 64-token tile.
fn phase_blocks_64(rows: usize, m: usize) -> usize {
    rows.div_ceil(COLS) * 8 * m.div_ceil(TOKS[1])
}

/// Whether weights of `rows` rows taking the 64-token phases over `m` tokens join others in
/// one phase launch: alone they would give fewer than two blocks an SM (k and v). Wide
/// weights keep a launch each: 24576 x 4096 at 40 tokens took 0.155 ms, two 12288 x 4096
/// 0.063 each (notes v23).
pub(crate) fn stacks_64(rows: usize, m: usize) -> bool {
    phase_blocks_64(rows, m) < 2 * GRID_SMS
}

const fn smem_bytes(toks: usize) -> u32 {
    (STAGES * (COLS + toks) * STAGE_K * 2 + 1024 + 16 * STAGES) as u32
}

/// The Hopper module on a GPU of compute capability 9.0 (H100, H200), None elsewhere.
pub(crate) fn load(ctx: &Arc<CudaContext>) -> std::result::Result<Option<Arc<CudaModule>>, String> {
    let (major, _) = ctx.compute_capability().map_err(|e| format!("compute capability: {e:?}"))?;
    if major != 9 {
        return Ok(None);
    }
    ctx.load_module(cudarc::nvrtc::Ptx::from_src(PTX))
        .map(Some)
        .map_err(|e| format!("cannot load the Hopper kernels' PTX (sm_90a): {e:?}"))
}

/// A TMA descriptor, passed to the kernel by value.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct TensorMap(sys::CUtensorMap);

// SAFETY: the driver's opaque 128-byte descriptor, read by the kernel as its own
// 128-byte, 64-aligned `TensorMap` parameter.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

/// `WgParts` in hopper.cu: each part's partials, columns and first 128-column tile.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct WgParts {
    part: [u64; 3],
    n: [i32; 3],
    first_tile: [i32; 3],
    parts: i32,
}

// SAFETY: plain old data laid out as the kernel's struct (repr(C), the same field types).
unsafe impl cudarc::driver::DeviceRepr for WgParts {}

/// `rows` x `k` bf16 elements at `addr` (row-major) as boxes of `box_k` x `box_rows`,
/// plain (the weights, read into registers) or in the 128-byte swizzle wgmma reads (the
/// activations), zeros past the edges.
fn tensor_map(
    addr: u64,
    rows: usize,
    k: usize,
    (box_k, box_rows): (usize, usize),
    swizzled: bool,
    what: &str,
) -> Result<TensorMap> {
    use sys::{
        CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 as BF16,
        CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE as ZEROS,
        CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE as PLAIN,
        CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B as L2_256,
        CUtensorMapSwizzle::{
            CU_TENSOR_MAP_SWIZZLE_128B as SWIZZLE_128, CU_TENSOR_MAP_SWIZZLE_NONE as NO_SWIZZLE,
        },
    };
    let dims = [k as u64, rows as u64];
    let row_bytes = [(2 * k) as u64];
    let boxes = [box_k as u32, box_rows as u32];
    let steps = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: the arrays hold rank (2) and rank - 1 entries as the call requires; `map` is
    // written by the call before it is read, and only when it succeeds.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            BF16,
            2,
            addr as *mut std::ffi::c_void,
            dims.as_ptr(),
            row_bytes.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            PLAIN,
            if swizzled { SWIZZLE_128 } else { NO_SWIZZLE },
            L2_256,
            ZEROS,
        )
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Backend(format!(
            "CUDA: TMA descriptor of {what} ({rows} x {k} bf16): {status:?}"
        )));
    }
    // SAFETY: written by the successful call above.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

impl Cuda {
    /// The wgmma kernels, in the order of `Functions::linear_wg`.
    fn wgmma_functions(&self) -> Result<&[CudaFunction; 5]> {
        self.f.linear_wg.as_ref().ok_or_else(|| {
            Error::Backend(
                "the wgmma matmul runs on compute capability 9.0 with bf16 activations only".into(),
            )
        })
    }

    /// `out` (+)= `split` (M x K bf16: activations rounded in MMA-step order by
    /// [`Cuda::split_steps`]) times `w`'s transpose by wgmma: `kernel` is one of
    /// [`TcKernel::is_wgmma`], and the caller checked [`Cuda::runs`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_wgmma(
        &self,
        kernel: TcKernel,
        split: &CudaSlice<u16>,
        m: usize,
        w: &CudaMat,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        mode: Out,
    ) -> Result<()> {
        if matches!(kernel, TcKernel::WgmmaPhases128x64 | TcKernel::WgmmaPhases128x128) {
            let part = self.wgmma_partials(kernel, split, m, w)?;
            return self.merge_phases(ptr(&part, &self.stream), m, w.rows, bias, out, mode);
        }
        let fs = self.wgmma_functions()?;
        // The kernel's index in `Functions::linear_wg`.
        let i = match kernel {
            TcKernel::Wgmma128x128 => 0,
            TcKernel::Wgmma128x192 => 4,
            _ => return Err(Error::Backend(format!("{kernel:?} is not a wgmma kernel"))),
        };
        let (f, tile_toks) = (&fs[i], TOKS[i]);
        let s = &self.stream;
        let wmap = tensor_map(ptr(&w.buf, s), w.rows, w.cols, (WEIGHT_BOX_K, COLS), false, "the weight")?;
        let xmap = tensor_map(ptr(split, s), m, w.cols, (STAGE_K, tile_toks), true, "the activations")?;
        let (mi, k, n, acc) = (m as i32, w.cols as i32, w.rows as i32, (mode == Out::Add) as i32);
        let (op, bp) = (ptr(out, s), bias.map_or(0, |b| ptr(b, s)));
        let (cols, toks) = (w.rows.div_ceil(COLS) as u32, m.div_ceil(tile_toks) as u32);
        // The grid's x walks the smaller operand's tiles, so the blocks running together share
        // a few tiles of the larger, each read from DRAM once (measured both ways on an H200,
        // notes v18: token tiles first at 12288 x 4096 and M = 2,048, 0.489 -> 0.435 ms;
        // column tiles first at 4096 x 12288 and M = 4,096, 0.950 -> 0.894 ms).
        let tokens_first = w.rows > m;
        let grid = if tokens_first { (toks, cols) } else { (cols, toks) };
        let tokens_first = tokens_first as i32;
        launch!(
            self,
            f,
            grid,
            THREADS,
            SMEM_BYTES[i],
            "linear",
            [wmap, xmap, mi, k, n, bp, op, acc, tokens_first]
        )
    }

    /// The 8 phase partials (8 x M x N f32) of `split` times `w`'s transpose by `kernel`, a
    /// phase-split wgmma kernel, for [`Cuda::merge_phases`] or a merge beside others.
    pub(crate) fn wgmma_partials(
        &self,
        kernel: TcKernel,
        split: &CudaSlice<u16>,
        m: usize,
        w: &CudaMat,
    ) -> Result<Scratch<'_, f32>> {
        let fs = self.wgmma_functions()?;
        let i = match kernel {
            TcKernel::WgmmaPhases128x64 => 1,
            TcKernel::WgmmaPhases128x128 => 2,
            _ => return Err(Error::Backend(format!("{kernel:?} is not a phase-split wgmma kernel"))),
        };
        let s = &self.stream;
        let wmap = tensor_map(ptr(&w.buf, s), w.rows, w.cols, (WEIGHT_BOX_K, COLS), false, "the weight")?;
        let xmap = tensor_map(ptr(split, s), m, w.cols, (STAGE_K, TOKS[i]), true, "the activations")?;
        let (mi, k, n) = (m as i32, w.cols as i32, w.rows as i32);
        let (cols, toks) = (w.rows.div_ceil(COLS) as u32, m.div_ceil(TOKS[i]) as u32);
        // Every phase block writes its whole tile of partials before a merge reads them.
        let part = self.scratch_f32(8 * m * w.rows, m, "matmul partials")?;
        let pp = ptr(&part, s);
        launch!(
            self,
            &fs[i],
            (cols, 8 * toks),
            THREADS,
            SMEM_BYTES[i],
            "linear",
            [wmap, xmap, mi, k, n, pp]
        )?;
        Ok(part)
    }

    /// `outs[i]` = `split` (as [`Cuda::linear_wgmma`]'s) times `parts[i]`'s transpose (+ its
    /// bias) for 1-3 weights of one K, each of which [`Cuda::pick`] gives
    /// [`TcKernel::WgmmaPhases128x64`]: their tiles in one launch, then the parts' phase
    /// merges in one more, so every output has the bits of its own launch.
    pub(crate) fn linear_wgmma_parts(
        &self,
        split: &CudaSlice<u16>,
        m: usize,
        parts: &[(&CudaMat, Option<&CudaSlice<f32>>)],
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<()> {
        if parts.len() != outs.len() {
            return Err(Error::Backend(format!(
                "{} weights for {} outputs in one wgmma launch",
                parts.len(),
                outs.len()
            )));
        }
        let weights: Vec<&CudaMat> = parts.iter().map(|(w, _)| *w).collect();
        let (partials, at) = self.wgmma_parts_partials(split, m, &weights)?;
        let merges: Vec<_> = parts.iter().zip(at).map(|((w, bias), part)| (part, w.rows, *bias)).collect();
        self.merge_phases_parts(m, &merges, outs)?;
        drop(partials);
        Ok(())
    }

    /// The phase partials of `split` times each of 1-3 weights of one K (as
    /// [`Cuda::linear_wgmma_parts`] takes them) by one launch of the 64-token phase tiles:
    /// the buffer and each weight's partials' device address in it.
    pub(crate) fn wgmma_parts_partials(
        &self,
        split: &CudaSlice<u16>,
        m: usize,
        parts: &[&CudaMat],
    ) -> Result<(Scratch<'_, f32>, Vec<u64>)> {
        let fs = self.wgmma_functions()?;
        let Some(first) = parts.first().filter(|_| parts.len() <= 3) else {
            return Err(Error::Backend(format!("{} weights in one wgmma launch (1 to 3)", parts.len())));
        };
        let (s, k) = (&self.stream, first.cols);
        let xmap = tensor_map(ptr(split, s), m, k, (STAGE_K, TOKS[3]), true, "the activations")?;
        let total: usize = parts.iter().map(|w| w.rows).sum();
        // Every phase block writes its whole tile of partials before the merges.
        let partials = self.scratch_f32(8 * m * total, m, "matmul partials")?;
        let base = ptr(&partials, s);
        let mut p = WgParts { parts: parts.len() as i32, ..WgParts::default() };
        let map = |w: &CudaMat| {
            tensor_map(ptr(&w.buf, s), w.rows, w.cols, (WEIGHT_BOX_K, COLS), false, "the weight")
        };
        let mut maps = [map(first)?; 3];
        let (mut offset, mut tiles) = (0, 0);
        for (i, w) in parts.iter().enumerate() {
            if i > 0 {
                maps[i] = map(w)?;
            }
            p.part[i] = base + (4 * offset) as u64;
            p.n[i] = w.rows as i32;
            p.first_tile[i] = tiles as i32;
            offset += 8 * m * w.rows;
            tiles += w.rows.div_ceil(COLS);
        }
        let [w0, w1, w2] = maps;
        let (mi, ki, toks) = (m as i32, k as i32, m.div_ceil(TOKS[3]) as u32);
        let grid = (tiles as u32, 8 * toks);
        launch!(self, &fs[3], grid, THREADS, SMEM_BYTES[3], "linear", [w0, w1, w2, xmap, mi, ki, p])?;
        Ok((partials, p.part[..parts.len()].to_vec()))
    }
}
