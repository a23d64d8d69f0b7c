//! The CUDA backend: the kernels of `kernels.cu` (compiled to PTX by `build.rs`), launched
//! through cudarc on one stream of GPU 0. Activations are f32 device buffers, rounded to
//! bf16 where they meet a bf16 weight (or, `--activations f32`, split exactly into three
//! bf16 terms: [`Activations`]); weights stay in their checkpoint dtype on the device, K/V
//! live in a [`CudaKv`] per row (bf16 for 16-bit checkpoints, f32 for f32 ones). The driver is loaded at run time, so a binary
//! built with `--features cuda` starts (and reports a clear error) on a machine without one.
//!
//! The crate compiles to nothing without its `cuda` feature, so `cargo test --workspace`
//! needs no nvcc; `mtp`'s `--features cuda` turns it on.
#![cfg(feature = "cuda")]

/// Launches kernel `$f` on a `$grid` of blocks of `$block` threads with the named
/// arguments (locals, so they outlive the launch builder).
macro_rules! launch {
    ($cuda:expr, $f:expr, $grid:expr, $block:expr, $what:expr, [$($arg:ident),*]) => {
        launch!($cuda, $f, $grid, $block, 0, $what, [$($arg),*])
    };
    ($cuda:expr, $f:expr, $grid:expr, $block:expr, $smem:expr, $what:expr, [$($arg:ident),*]) => {{
        let (grid, block): ((u32, u32), u32) = ($grid, $block);
        if grid.0 == 0 || grid.1 == 0 {
            Ok(())
        } else {
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (grid.0, grid.1, 1),
                block_dim: (block, 1, 1),
                shared_mem_bytes: $smem,
            };
            let mut b = $cuda.stream.launch_builder($f);
            $( cudarc::driver::PushKernelArg::arg(&mut b, &$arg); )*
            // SAFETY: every kernel checks its bounds against the sizes passed with it, and
            // the buffers behind the pointers outlive the launch (freed later on the same
            // stream).
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(|e| mtp_base::error::Error::Backend(format!("CUDA {}: {e:?}", $what)))
        }
    }};
}

mod flash;
mod graphs;
mod hopper;
mod kv;
mod nccl;
mod pool;
mod scratch;

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError};
use mtp_cache::{KvStore, RowCache};
use scratch::Scratch;

pub use graphs::CudaGraphs;
pub use kv::CudaKv;
pub use nccl::NcclCollective;

use mtp_base::error::{Error, Result};
use mtp_base::weights::{Weight, WeightDtype};
use mtp_kernels::negative_control;
use mtp_kernels::ops::RopeTable;
use mtp_kernels::{
    auto_kv_dtype, check_gpu_heads, check_gpu_kv, held_keys, linear_each, open_windows, Activations,
    AssistantKernels, Backend, ForwardBody, Heads, Kernels, KeyRange, KvDtype, Out, Plane, Slot,
};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

/// Threads per block of the matmul (8 warps sharing 4 columns, or 16 on tensor cores: see
/// kernels.cu).
const LINEAR_THREADS: u32 = 256;
const LINEAR_COLS_PER_BLOCK: usize = 4;
const LINEAR_TC_COLS_PER_BLOCK: usize = 16;
/// Threads per block of attention: 8 warps per (token, head group), key chunks dealt by
/// position.
const ATTENTION_THREADS: u32 = 256;

/// Whether a weight takes the tensor-core matmul: bf16, not quantized, K a multiple of
/// 32. Decided by the weight alone, so every M takes the same path.
fn tensor_core_path(w: &CudaMat) -> bool {
    w.quant.is_none() && w.dtype == WeightDtype::Bf16 && w.cols.is_multiple_of(32)
}

/// Whether a quantized weight takes the tensor-core matmul in bf16 mode (`linear_tcq`):
/// affine 4- or 8-bit codes in groups of 32, 64 or 128 with bf16 scales and biases (what
/// `mlx_lm.convert -q` writes for a bf16 model), K a multiple of 32. Decided by the weight
/// alone, so every M takes the same path.
fn quant_tensor_cores(w: &Weight) -> bool {
    w.quant().is_some_and(|q| {
        matches!(q.bits, 4 | 8)
            && matches!(q.group, 32 | 64 | 128)
            && q.scales.dtype == WeightDtype::Bf16
            && q.biases.as_ref().is_some_and(|b| b.dtype == WeightDtype::Bf16)
            && w.cols.is_multiple_of(32)
    })
}

/// A quantized weight's group words for `linear_tcq`: per (row, group) the scale's bf16
/// bits low and the bias's high.
fn group_words(q: &mtp_base::weights::Quant) -> Vec<u32> {
    let half =
        |b: &[u8]| -> Vec<u16> { b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect() };
    let scales = half(q.scales.bytes());
    let biases = q.biases.as_ref().map(|b| half(b.bytes())).unwrap_or_default();
    scales.iter().zip(&biases).map(|(&s, &b)| s as u32 | (b as u32) << 16).collect()
}

/// A quantized weight's codes in `linear_tcq`'s order (kernels.cu): in each row's chunk of
/// 128 values (its `used` blocks of 32, `bits` words a block, lane t's `bits / 4` of them at
/// `t * bits / 4`), lane t's words of the chunk together, so a lane loads a whole chunk's
/// codes at once. The embedding's `embed_tcq` reads the same order.
fn repack_codes(packed: &[u8], cols: usize, bits: usize) -> Vec<u8> {
    let (row_bytes, blocks, lane_words) = (cols * bits / 8, cols / 32, bits / 4);
    let mut out = vec![0u8; packed.len()];
    for (src, dst) in packed.chunks_exact(row_bytes).zip(out.chunks_exact_mut(row_bytes)) {
        for chunk in 0..blocks.div_ceil(4) {
            let used = (blocks - 4 * chunk).min(4);
            let base = chunk * 4 * bits;
            for u in 0..used {
                for t in 0..4 {
                    for v in 0..lane_words {
                        let from = 4 * (base + u * bits + t * lane_words + v);
                        let to = 4 * (base + t * used * lane_words + u * lane_words + v);
                        dst[to..to + 4].copy_from_slice(&src[from..from + 4]);
                    }
                }
            }
        }
    }
    out
}

/// Whether 1 to 3 weights take one `linear_tcq` launch: each on the quantized tensor-core
/// path, none empty, one K, bits and group size.
fn tcq_stackable(parts: &[(&CudaMat, Option<&CudaSlice<f32>>)]) -> bool {
    let key = |w: &CudaMat| {
        w.quant.as_ref().filter(|q| q.tensor_cores.is_some()).map(|q| (w.cols, q.bits, q.group))
    };
    let first = parts.first().and_then(|(w, _)| key(w));
    (1..=3).contains(&parts.len())
        && first.is_some()
        && parts.iter().all(|(w, _)| w.rows > 0 && key(w) == first)
}

/// The tensor-core matmul's kernels. Every one sums each output in the same order, so they
/// give the same bits, and the host's choice by shape ([`TcKernel::for_shape`]) only
/// changes the speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcKernel {
    /// Stream the weights once per pass of 8, 16, 32 or 64 tokens, each warp splitting its
    /// own activations: the fastest for a few tokens.
    Pass8,
    Pass16,
    Pass32,
    Pass64,
    /// The passes of 8 and 16 tokens over 32 columns a block (two 16-column groups sharing
    /// each activation fragment a warp loads): on wide weights, half the activation reads.
    Pass8Wide,
    Pass16Wide,
    /// Stage (columns x tokens) tiles in shared memory: a fetched weight or activation
    /// serves the whole tile.
    Tile256x16,
    Tile128x32,
    Tile64x64,
    Tile128x64,
    /// A tile's K walk cut into its 8 phases, a block each, then added in phase order by a
    /// second launch: 8 times the blocks, for grids too small to fill the GPU.
    Phases256x16,
    Phases128x32,
    Phases64x64,
    Phases128x64,
    /// 48 tokens a tile: a verify of 33-48 tokens (8 rows x 5) stages and multiplies fewer
    /// idle token rows than a 64-token tile.
    Phases128x48,
    /// wgmma over TMA-fed 128x128 tiles (`hopper.cu`): compute capability 9.0, bf16
    /// activations and K % 128 == 0 only ([`Cuda::runs`]).
    Wgmma128x128,
    /// The same over 128x192 tiles: a quarter fewer L2 reads per MAC.
    Wgmma128x192,
    /// wgmma over 128x64 or 128x128 tiles, a block a phase (then the phase merge): a
    /// verify's 33-128 tokens, on the same conditions.
    WgmmaPhases128x64,
    WgmmaPhases128x128,
}

/// Whether a pass over `m` tokens takes the wide blocks for `groups` 16-column groups: 4 to
/// 16 tokens (one token's activations are a broadcast, nothing to share), where the wide
/// grid still gives every SM four blocks. H200, `gpu_matmul --kernels` (notes v30): at 8
/// tokens 24576 x 4096 0.063 ms against 0.065, 151936 x 4096 0.321 against 0.331, but
/// 12288 x 4096 (three wide blocks an SM) 0.039 against 0.037; at 2 tokens none faster.
fn wide_pass(m: usize, groups: usize) -> bool {
    (4..=16).contains(&m) && groups.div_ceil(TcKernel::Pass8Wide.groups_per_block()) >= 4 * GRID_SMS
}

/// The H100's SMs, by which the kernel choice judges a grid (a block alone on an SM waits
/// on its loads: two an SM is the least that keeps one busy).
const GRID_SMS: usize = 132;

/// A tile kernel's shape: output columns and tokens per block, stages of loads in
/// flight (the shared memory it takes), and whether its K walk is phase-split.
#[derive(Clone, Copy)]
struct Tile {
    cols: usize,
    toks: usize,
    stages: usize,
    phased: bool,
}

impl Tile {
    /// kernels.cu's linear_tt_impl: per stage, 32 k of COLS weight rows and of `terms` TOKS
    /// activation rows (one bf16 plane a term), 2 bytes each.
    fn smem_bytes(self, terms: usize) -> u32 {
        (self.stages * (self.cols + terms * self.toks) * 64) as u32
    }
}

/// bf16 planes a tensor-core matmul takes of each activation: 1 (rounded) or 3 (exact).
fn activation_terms(a: Activations) -> usize {
    if a == Activations::Bf16 {
        1
    } else {
        3
    }
}

impl TcKernel {
    pub const ALL: [TcKernel; 19] = [
        TcKernel::Pass8,
        TcKernel::Pass16,
        TcKernel::Pass32,
        TcKernel::Pass64,
        TcKernel::Pass8Wide,
        TcKernel::Pass16Wide,
        TcKernel::Tile256x16,
        TcKernel::Tile128x32,
        TcKernel::Tile64x64,
        TcKernel::Tile128x64,
        TcKernel::Phases256x16,
        TcKernel::Phases128x32,
        TcKernel::Phases64x64,
        TcKernel::Phases128x64,
        TcKernel::Phases128x48,
        TcKernel::Wgmma128x128,
        TcKernel::Wgmma128x192,
        TcKernel::WgmmaPhases128x64,
        TcKernel::WgmmaPhases128x128,
    ];

    /// The 16-column groups a pass kernel's block owns: two for the wide passes, else one.
    fn groups_per_block(self) -> usize {
        if matches!(self, TcKernel::Pass8Wide | TcKernel::Pass16Wide) {
            2
        } else {
            1
        }
    }

    /// The Hopper kernels (`hopper.cu`).
    pub fn is_wgmma(self) -> bool {
        matches!(
            self,
            TcKernel::Wgmma128x128
                | TcKernel::Wgmma128x192
                | TcKernel::WgmmaPhases128x64
                | TcKernel::WgmmaPhases128x128
        )
    }

    /// The fastest kernel for M tokens and N output columns, as measured on an H100
    /// (`gpu_matmul --kernels`; docs/notes/cuda-speed-notes.md, v15 and v16): passes up to 16
    /// tokens. Past that, while the plain tile's grid would give fewer than 2 blocks an SM
    /// (a block alone waits on its loads), a phase-split tile: where N is at least 4,096
    /// one token tile of 32, 48 or 64 tokens (17-32 tokens: 1.4-1.8x faster than Pass32 at
    /// 32 on the 8B's shapes; 48 tokens for 33-48: a verify of 8 rows x 5 stages fewer idle
    /// token rows; 49-128 tokens the 128x64 tile: at 128 tokens 1.3-1.6x faster than the
    /// 128x32 one on 4096x4096 and 4096x12288, in both activation modes, 2026-11-25), else
    /// 128x32 tiles up to 128 tokens (below 4,096 columns, passes up to 32 tokens: narrower
    /// N unmeasured). Otherwise the plain 128x32 tile.
    pub fn for_shape(m: usize, n: usize) -> TcKernel {
        let phased = n.div_ceil(128) * m.div_ceil(32) < 2 * GRID_SMS;
        let wide = phased && n >= 4096;
        match m {
            2..=8 if wide_pass(m, n.div_ceil(LINEAR_TC_COLS_PER_BLOCK)) => TcKernel::Pass8Wide,
            0..=8 => TcKernel::Pass8,
            9..=16 if wide_pass(m, n.div_ceil(LINEAR_TC_COLS_PER_BLOCK)) => TcKernel::Pass16Wide,
            9..=16 => TcKernel::Pass16,
            17..=32 if wide => TcKernel::Phases128x32,
            17..=32 => TcKernel::Pass32,
            33..=48 if wide => TcKernel::Phases128x48,
            49..=128 if wide => TcKernel::Phases128x64,
            33..=128 if phased => TcKernel::Phases128x32,
            _ => TcKernel::Tile128x32,
        }
    }

    /// The kernel for M tokens and N columns: [`TcKernel::for_shape`] up to 16 tokens or
    /// where wgmma does not run (`wgmma`: compute capability 9.0, bf16 activations, K %
    /// 128 == 0), else wgmma:
    /// - where N's 128-column tiles alone give every SM two blocks (an LM head), the
    ///   128x128 tiles: 151936 x 4096 at 32 tokens 0.600 ms against Pass32's 0.858, at 40
    ///   0.450 against the 64-token phases' 0.821 (H100, notes v23);
    /// - past 128 tokens, the plain tiles of [`TcKernel::wgmma_tile`] (128x128 or 128x192
    ///   by the grid's waves);
    /// - else the 128x128 tiles from 49 tokens where N has 64 such tiles, phase-split tiles
    ///   of 64 tokens up to 64, of 128 past that (H200 and H100 at 33-128 tokens on the
    ///   8B's shapes, notes v20: 12288 x 4096 at 96 tokens 0.045 ms against the 128x32
    ///   tile's 0.147; 4096 x 12288 at 40 0.043 against the 128x48 phases' 0.054). From 17
    ///   tokens, not 33: an 8B B=8 verify of 24 or 32 tokens on the 128x32 phases took
    ///   7.9 and 8.2 ms where one of 40 on the 64-token wgmma phases took 7.0 (H200,
    ///   notes v31).
    pub fn picked(m: usize, n: usize, wgmma: bool) -> TcKernel {
        if !wgmma || m <= 16 {
            TcKernel::for_shape(m, n)
        } else if m > 128 {
            TcKernel::wgmma_tile(m, n)
        } else if n.div_ceil(128) >= 2 * GRID_SMS || (m > 48 && n >= 64 * 128) {
            TcKernel::Wgmma128x128
        } else if m > 64 {
            TcKernel::WgmmaPhases128x128
        } else {
            TcKernel::WgmmaPhases128x64
        }
    }

    /// The pass kernels: no tiles, no wgmma.
    fn is_pass(self) -> bool {
        self.tile().is_none() && !self.is_wgmma()
    }

    /// The plain wgmma tile for M tokens and N columns: 128x192 where its grid takes fewer
    /// waves of one block an SM, each wave costing 1.25 of the 128x128 tiles' (1.5 times
    /// the MACs at 1.2 times the rate), else 128x128. On an H100 (notes v25) this picks the
    /// faster at every measured point: 128x192 at 2,048 and 4,096 tokens on the 8B's shapes
    /// (12288 x 4096 at 4,096: 0.898 ms against 1.030), 128x128 at 512 and 1,024 (4096 x
    /// 4096 at 1,024: 0.131 against 0.148) and for narrow weights (k and v's 1,024 rows).
    fn wgmma_tile(m: usize, n: usize) -> TcKernel {
        let waves = |toks: usize| (n.div_ceil(128) * m.div_ceil(toks)).div_ceil(GRID_SMS);
        if 5 * waves(192) < 4 * waves(128) {
            TcKernel::Wgmma128x192
        } else {
            TcKernel::Wgmma128x128
        }
    }

    /// The tile kernel's shape, and its function's index in `Functions::linear_tt`
    /// (unphased) or `linear_tt_phases`; None for the pass kernels and wgmma.
    fn tile(self) -> Option<(usize, Tile)> {
        let t = |cols, toks, stages, phased| Tile { cols, toks, stages, phased };
        Some(match self {
            TcKernel::Pass8
            | TcKernel::Pass16
            | TcKernel::Pass32
            | TcKernel::Pass64
            | TcKernel::Pass8Wide
            | TcKernel::Pass16Wide
            | TcKernel::Wgmma128x128
            | TcKernel::Wgmma128x192
            | TcKernel::WgmmaPhases128x64
            | TcKernel::WgmmaPhases128x128 => return None,
            TcKernel::Tile256x16 => (0, t(256, 16, 2, false)),
            TcKernel::Tile128x32 => (1, t(128, 32, 3, false)),
            TcKernel::Tile64x64 => (2, t(64, 64, 3, false)),
            TcKernel::Tile128x64 => (3, t(128, 64, 2, false)),
            TcKernel::Phases256x16 => (0, t(256, 16, 2, true)),
            TcKernel::Phases128x32 => (1, t(128, 32, 3, true)),
            TcKernel::Phases64x64 => (2, t(64, 64, 3, true)),
            TcKernel::Phases128x64 => (3, t(128, 64, 3, true)),
            TcKernel::Phases128x48 => (4, t(128, 48, 3, true)),
        })
    }
}

/// The phase-split tiles that also run over several weights (`linear_tt_parts_*`, each of
/// its single-weight kernel's shape), in `Functions::linear_tt_parts`' order.
const PARTS_TILES: [TcKernel; 3] = [TcKernel::Phases128x32, TcKernel::Phases128x64, TcKernel::Phases128x48];

/// `TcParts` in kernels.cu: up to 3 weights of one multi-weight matmul launch (a
/// phase-split tile launch writes each part's partials where `out` points, biases unused).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TcParts {
    w: [u64; 3],
    bias: [u64; 3],
    out: [u64; 3],
    n: [i32; 3],
    first_block: [i32; 3],
    parts: i32,
}

// SAFETY: plain old data laid out as the kernel's struct (repr(C), the same field types).
unsafe impl cudarc::driver::DeviceRepr for TcParts {}

/// `MergeParts` in kernels.cu: up to 3 phase launches' partials merged in one launch, part
/// i's outputs the flat indices up to `end[i]`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MergeParts {
    part: [u64; 3],
    bias: [u64; 3],
    out: [u64; 3],
    end: [i64; 3],
    n: [i32; 3],
    parts: i32,
}

// SAFETY: plain old data laid out as the kernel's struct (repr(C), the same field types).
unsafe impl cudarc::driver::DeviceRepr for MergeParts {}

/// `TcqParts` in kernels.cu: up to 3 quantized weights of one bits and group size in one
/// `linear_tcq` launch.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct TcqParts {
    q: [u64; 3],
    group_words: [u64; 3],
    bias: [u64; 3],
    out: [u64; 3],
    n: [i32; 3],
    first_block: [i32; 3],
    parts: i32,
}

// SAFETY: plain old data laid out as the kernel's struct (repr(C), the same field types).
unsafe impl cudarc::driver::DeviceRepr for TcqParts {}

fn driver(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Backend(format!("CUDA {what}: {e:?}"))
}

/// Kernel variant for a K/V dtype: f32, bf16, 8-bit, 4-bit.
fn kv_index(kv: KvDtype) -> usize {
    match kv {
        KvDtype::Auto | KvDtype::F32 => 0,
        KvDtype::Bf16 => 1,
        KvDtype::Q8 => 2,
        KvDtype::Q4 => 3,
    }
}

/// The store-maintenance variant (moves, copies) for a K/V dtype: 4-byte units (f32
/// elements, quantized words), 2-byte (bf16).
fn kv_unit_index(kv: KvDtype) -> usize {
    (kv.unit_bytes() == 2) as usize
}

fn weight_index(d: WeightDtype) -> usize {
    match d {
        WeightDtype::F32 => 0,
        WeightDtype::Bf16 => 1,
        WeightDtype::F16 => 2,
    }
}

struct Functions {
    /// By weight dtype (f32, bf16, f16), then rows per pass (4, 8, 16).
    linear: [[CudaFunction; 3]; 3],
    /// MLX-quantized weights by bits (2, 4, 8), then rows per pass.
    linear_q: [[CudaFunction; 3]; 3],
    /// Quantized weights on tensor cores (bf16 mode), up to 3 a launch: by bits (4, 8),
    /// then tokens per pass (8, 16, 32, 64); over activations made by `prep_q_acts`.
    linear_tcq: [[CudaFunction; 4]; 2],
    prep_q_acts: CudaFunction,
    /// Tensor cores, bf16 weights with K % 32 == 0, by tokens per pass (8, 16, 32, 64), then
    /// the wide passes (8, 16): `TcKernel`'s first six, in order; the variants of this
    /// instance's [`Activations`] (kernels.cu's `_x1` or `_x3`), as every tensor-core
    /// function below.
    linear_tc: [CudaFunction; 6],
    /// The same, up to 3 weights in one launch, by tokens per pass (8, 16, 32).
    linear_tc_parts: [CudaFunction; 3],
    /// Gate and up then SwiGLU, by tokens per pass (8, 16, 32), then the wide passes (8, 16).
    linear_tc_swiglu: [CudaFunction; 5],
    /// The same, tiled in shared memory, on activations split (or rounded) by
    /// `split_activations`: by
    /// [`TcKernel::tile`]'s index, unphased and phase-split.
    linear_tt: [CudaFunction; 4],
    linear_tt_phases: [CudaFunction; 5],
    /// Phase-split tiles over up to 3 weights, as `PARTS_TILES`.
    linear_tt_parts: [CudaFunction; 3],
    /// wgmma tiles (`hopper.cu`): on compute capability 9.0 with bf16 activations only;
    /// 128x128, then the phase-split 128x64 and 128x128, then the phase-split 128x64 over
    /// up to 3 weights.
    linear_wg: Option<[CudaFunction; 5]>,
    split_activations: CudaFunction,
    /// bf16 activations in MMA-step order, for wgmma.
    split_activations_steps: CudaFunction,
    linear_merge_phases: CudaFunction,
    linear_merge_phases_parts: CudaFunction,
    linear_merge_phases_swiglu: CudaFunction,
    embed: [CudaFunction; 3],
    embed_q: [CudaFunction; 3],
    /// The same over codes in `linear_tcq`'s order ([`repack_codes`]), by bits (4, 8).
    embed_tcq: [CudaFunction; 2],
    widen: [CudaFunction; 2],
    rms_norm: CudaFunction,
    swiglu: CudaFunction,
    gather: CudaFunction,
    add_into: CudaFunction,
    /// By K/V dtype ([`kv_index`]).
    qk_rope_store: [CudaFunction; 4],
    /// By K/V dtype ([`kv_index`]), then head size 128 serving 1, 2 or 4 query heads a
    /// block, 256, 512.
    attention: [[CudaFunction; 5]; 4],
    attention_merge: CudaFunction,
    /// Tensor-core attention (flash.cuh) by head-size tier: any head size of the tier, and
    /// the tier's own (sizes known at compile time); and its merge.
    flash: [[CudaFunction; 2]; 3],
    /// The full-width head-size-128 kernel by wgmma (`hopper.cu`), on compute capability 9.0.
    flash_wg: Option<CudaFunction>,
    flash_merge: CudaFunction,
    /// By unit ([`kv_unit_index`]).
    kv_move: [CudaFunction; 2],
    kv_copy: [CudaFunction; 2],
    gelu_tanh_mul: CudaFunction,
    scale_by: CudaFunction,
    add_to: CudaFunction,
    add_parts: CudaFunction,
    concat_columns: CudaFunction,
    add_rows_scaled: CudaFunction,
    rope_rows: CudaFunction,
    logit_summaries: CudaFunction,
}

/// A GPU, its stream and the loaded kernels. One per GPU and [`Activations`] mode
/// ([`Cuda::on_device`]; GPU 0 is [`Cuda::shared_with`]'s); both modes share the GPU's one
/// stream, so every model's and cache's work on it is ordered without events.
pub struct Cuda {
    stream: Arc<CudaStream>,
    f: Functions,
    /// `Bf16` or `F32`, never `Auto`: which tensor-core kernels `f` holds.
    activations: Activations,
    device: String,
    /// cuBLAS, loaded only for the negative control.
    blas: OnceLock<std::result::Result<cudarc::cublas::CudaBlas, String>>,
    /// Page-locked host memory every download lands in first ([`Cuda::to_host`]), grown to
    /// the largest download so far.
    staging: std::sync::Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
    /// Matmul scratch kept between launches of recordable size ([`scratch`]).
    scratch: scratch::Pools,
    /// K/V block pools, one per store shape (layers, slot units, dtype).
    kv_pools: std::sync::Mutex<std::collections::HashMap<(usize, usize, usize), Arc<pool::BlockPool>>>,
}

/// A GPU's stream, the module of every kernel, and the Hopper module on compute
/// capability 9.0.
type Device = (Arc<CudaStream>, Arc<cudarc::driver::CudaModule>, Option<Arc<cudarc::driver::CudaModule>>);

/// The most GPUs one process drives (tensor-parallel ranks).
pub const MAX_GPUS: usize = 8;

// SAFETY: the cuBLAS handle is used only from the thread running a forward, behind &self,
// and cuBLAS handles may be shared between host threads that do not call it concurrently
// on the same stream; every other field is Send + Sync.
unsafe impl Sync for Cuda {}
unsafe impl Send for Cuda {}

/// Fields of a row's K/V layout (`RowKv` in forward.cuh).
pub(crate) const ROW_FIELDS: usize = 7;

// The kernels' block (KV_BLOCK in forward.cuh) is the cache's.
const _: () = assert!(mtp_cache::BLOCK_POSITIONS == 64);

/// One device pointer as a kernel argument.
fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

impl Cuda {
    /// The process's CUDA backend on GPU 0 in the default numerics (bf16 activations),
    /// started on first use. Fails with a clear message when there is no driver, no GPU, or
    /// the kernels cannot be loaded.
    pub fn shared() -> Result<Arc<Cuda>> {
        Cuda::shared_with(Activations::Auto)
    }

    /// The same, with activations as `activations` says (`Auto`: bf16).
    pub fn shared_with(activations: Activations) -> Result<Arc<Cuda>> {
        Cuda::on_device(0, activations)
    }

    /// The backend on GPU `ordinal` (a tensor-parallel rank's), activations as
    /// `activations` says: one per GPU and mode, each GPU with its own stream.
    pub fn on_device(ordinal: usize, activations: Activations) -> Result<Arc<Cuda>> {
        type Slot = OnceLock<std::result::Result<Arc<Cuda>, String>>;
        static SHARED: [[Slot; 2]; MAX_GPUS] = [const { [const { OnceLock::new() }; 2] }; MAX_GPUS];
        let activations = match activations {
            Activations::F32 => Activations::F32,
            Activations::Auto | Activations::Bf16 => Activations::Bf16,
        };
        let slots = SHARED.get(ordinal).ok_or_else(|| {
            Error::Backend(format!("GPU {ordinal}: this build drives at most {MAX_GPUS} GPUs"))
        })?;
        slots[(activations == Activations::Bf16) as usize]
            .get_or_init(|| Cuda::start(ordinal, activations).map(Arc::new))
            .clone()
            .map_err(Error::Backend)
    }

    /// GPUs the driver sees (0 without a driver).
    pub fn device_count() -> usize {
        // SAFETY: only probes whether the driver library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    }

    /// GPU `ordinal`'s one stream and the loaded kernels, shared by both modes.
    fn device(ordinal: usize) -> std::result::Result<Device, String> {
        type Slot = OnceLock<std::result::Result<Device, String>>;
        static DEVICE: [Slot; MAX_GPUS] = [const { OnceLock::new() }; MAX_GPUS];
        DEVICE[ordinal]
            .get_or_init(|| {
                // SAFETY: only probes whether the driver library can be loaded.
                if !unsafe { cudarc::driver::sys::is_culib_present() } {
                    return Err("no NVIDIA driver found (libcuda.so could not be loaded): \
                                this machine has no GPU driver, or LD_LIBRARY_PATH does not reach it"
                        .into());
                }
                let ctx = cudarc::driver::CudaContext::new(ordinal)
                    .map_err(|e| format!("cannot open GPU {ordinal}: {e:?}"))?;
                // One stream for everything: no cross-stream events needed.
                // SAFETY: every buffer is used on `stream` only.
                unsafe { ctx.disable_event_tracking() };
                let stream = ctx.new_stream().map_err(|e| format!("cannot create a stream: {e:?}"))?;
                let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(PTX)).map_err(|e| {
                    format!("cannot load the kernels' PTX (driver too old for CUDA 13 PTX?): {e:?}")
                })?;
                Ok((stream, module, hopper::load(&ctx)?))
            })
            .clone()
    }

    fn start(ordinal: usize, activations: Activations) -> std::result::Result<Cuda, String> {
        let (stream, module, hopper) = Cuda::device(ordinal)?;
        let ctx = stream.context();
        let get = |name: &str| module.load_function(name).map_err(|e| format!("kernel {name}: {e:?}"));
        // The tensor-core kernels of this mode: activations as 1 or 3 bf16 terms.
        let terms = activation_terms(activations);
        let tc = |name: &str| get(&format!("{name}_x{terms}"));
        let f = Functions {
            linear: [
                [get("linear_f32_4")?, get("linear_f32_8")?, get("linear_f32_16")?],
                [get("linear_bf16_4")?, get("linear_bf16_8")?, get("linear_bf16_16")?],
                [get("linear_f16_4")?, get("linear_f16_8")?, get("linear_f16_16")?],
            ],
            linear_q: [
                [get("linear_q2_4")?, get("linear_q2_8")?, get("linear_q2_16")?],
                [get("linear_q4_4")?, get("linear_q4_8")?, get("linear_q4_16")?],
                [get("linear_q8_4")?, get("linear_q8_8")?, get("linear_q8_16")?],
            ],
            linear_tcq: [
                [
                    get("linear_tcq4_8")?,
                    get("linear_tcq4_16")?,
                    get("linear_tcq4_32")?,
                    get("linear_tcq4_64")?,
                ],
                [
                    get("linear_tcq8_8")?,
                    get("linear_tcq8_16")?,
                    get("linear_tcq8_32")?,
                    get("linear_tcq8_64")?,
                ],
            ],
            prep_q_acts: get("prep_q_acts")?,
            linear_tc: [
                tc("linear_tc_bf16_8")?,
                tc("linear_tc_bf16_16")?,
                tc("linear_tc_bf16_32")?,
                tc("linear_tc_bf16_64")?,
                tc("linear_tc_wide_bf16_8")?,
                tc("linear_tc_wide_bf16_16")?,
            ],
            linear_tc_swiglu: [
                tc("linear_tc_swiglu_bf16_8")?,
                tc("linear_tc_swiglu_bf16_16")?,
                tc("linear_tc_swiglu_bf16_32")?,
                tc("linear_tc_swiglu_wide_bf16_8")?,
                tc("linear_tc_swiglu_wide_bf16_16")?,
            ],
            linear_tc_parts: [
                tc("linear_tc_parts_bf16_8")?,
                tc("linear_tc_parts_bf16_16")?,
                tc("linear_tc_parts_bf16_32")?,
            ],
            linear_tt: [
                tc("linear_tt_bf16_256x16")?,
                tc("linear_tt_bf16_128x32")?,
                tc("linear_tt_bf16_64x64")?,
                tc("linear_tt_bf16_128x64")?,
            ],
            linear_tt_phases: [
                tc("linear_tt_phases_bf16_256x16")?,
                tc("linear_tt_phases_bf16_128x32")?,
                tc("linear_tt_phases_bf16_64x64")?,
                tc("linear_tt_phases_bf16_128x64")?,
                tc("linear_tt_phases_bf16_128x48")?,
            ],
            linear_tt_parts: [
                tc("linear_tt_parts_bf16_128x32")?,
                tc("linear_tt_parts_bf16_128x64")?,
                tc("linear_tt_parts_bf16_128x48")?,
            ],
            linear_wg: match &hopper {
                Some(h) if terms == 1 => {
                    let f = |name: &str| h.load_function(name).map_err(|e| format!("kernel {name}: {e:?}"));
                    Some([
                        f("linear_wg_bf16_128x128_x1")?,
                        f("linear_wg_phases_bf16_128x64_x1")?,
                        f("linear_wg_phases_bf16_128x128_x1")?,
                        f("linear_wg_phases_parts_bf16_128x64_x1")?,
                        f("linear_wg_bf16_128x192_x1")?,
                    ])
                }
                _ => None,
            },
            split_activations: tc("split_activations")?,
            split_activations_steps: get("split_activations_steps")?,
            linear_merge_phases: get("linear_merge_phases")?,
            linear_merge_phases_parts: get("linear_merge_phases_parts")?,
            linear_merge_phases_swiglu: get("linear_merge_phases_swiglu")?,
            embed: [get("embed_f32")?, get("embed_bf16")?, get("embed_f16")?],
            embed_q: [get("embed_q2")?, get("embed_q4")?, get("embed_q8")?],
            embed_tcq: [get("embed_tcq4")?, get("embed_tcq8")?],
            widen: [get("widen_bf16")?, get("widen_f16")?],
            rms_norm: get("rms_norm")?,
            swiglu: get("swiglu")?,
            gather: get("gather_rows")?,
            add_into: get("add_into")?,
            qk_rope_store: [
                get("qk_rope_store_f32")?,
                get("qk_rope_store_bf16")?,
                get("qk_rope_store_q8")?,
                get("qk_rope_store_q4")?,
            ],
            attention: [
                [
                    get("attention_f32_128")?,
                    get("attention_f32_128_g2")?,
                    get("attention_f32_128_g4")?,
                    get("attention_f32_256")?,
                    get("attention_f32_512")?,
                ],
                [
                    get("attention_bf16_128")?,
                    get("attention_bf16_128_g2")?,
                    get("attention_bf16_128_g4")?,
                    get("attention_bf16_256")?,
                    get("attention_bf16_512")?,
                ],
                [
                    get("attention_q8_128")?,
                    get("attention_q8_128_g2")?,
                    get("attention_q8_128_g4")?,
                    get("attention_q8_256")?,
                    get("attention_q8_512")?,
                ],
                [
                    get("attention_q4_128")?,
                    get("attention_q4_128_g2")?,
                    get("attention_q4_128_g4")?,
                    get("attention_q4_256")?,
                    get("attention_q4_512")?,
                ],
            ],
            attention_merge: get("attention_merge")?,
            flash: [
                [get("flash_attention_32")?, get("flash_attention_32_full")?],
                [get("flash_attention_64")?, get("flash_attention_64_full")?],
                [get("flash_attention_128")?, get("flash_attention_128_full")?],
            ],
            flash_wg: match &hopper {
                Some(h) => Some(
                    h.load_function("flash_attention_128_wg")
                        .map_err(|e| format!("kernel flash_attention_128_wg: {e:?}"))?,
                ),
                None => None,
            },
            flash_merge: get("flash_merge")?,
            kv_move: [get("kv_move_4")?, get("kv_move_2")?],
            kv_copy: [get("kv_copy_4")?, get("kv_copy_2")?],
            gelu_tanh_mul: get("gelu_tanh_mul")?,
            scale_by: get("scale_by")?,
            add_to: get("add_to")?,
            add_parts: get("add_parts")?,
            concat_columns: get("concat_columns")?,
            add_rows_scaled: get("add_rows_scaled")?,
            rope_rows: get("rope_rows")?,
            logit_summaries: get("logit_summaries")?,
        };
        // The tiles take their stages as dynamic shared memory, past 48 KB only when allowed.
        for kernel in TcKernel::ALL {
            let Some((i, tile)) = kernel.tile() else { continue };
            let single = if tile.phased { &f.linear_tt_phases[i] } else { &f.linear_tt[i] };
            let parts = PARTS_TILES.iter().position(|k| *k == kernel).map(|p| &f.linear_tt_parts[p]);
            for func in std::iter::once(single).chain(parts) {
                use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX;
                let bytes = tile.smem_bytes(terms);
                func.set_attribute(MAX, bytes as i32)
                    .map_err(|e| format!("shared memory for {kernel:?} ({bytes} bytes): {e:?}"))?;
            }
        }
        let flash_funcs = f
            .flash
            .iter()
            .zip(flash::TIERS)
            .flat_map(|(funcs, max_hd)| funcs.iter().map(move |f| (f, max_hd)));
        for (func, max_hd) in flash_funcs.chain(f.flash_wg.iter().map(|f| (f, 128))) {
            use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX;
            let bytes = flash::most_smem_bytes(max_hd);
            func.set_attribute(MAX, bytes as i32)
                .map_err(|e| format!("shared memory for the tensor-core attention ({bytes} bytes): {e:?}"))?;
        }
        for (func, bytes) in f.linear_wg.iter().flatten().zip(hopper::SMEM_BYTES) {
            use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX;
            func.set_attribute(MAX, bytes as i32)
                .map_err(|e| format!("shared memory for the wgmma matmul ({bytes} bytes): {e:?}"))?;
        }
        let device = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        tracing::info!("CUDA backend on {device}");
        Ok(Cuda {
            stream,
            f,
            activations,
            device,
            blas: OnceLock::new(),
            staging: std::sync::Mutex::new(None),
            scratch: scratch::Pools::default(),
            kv_pools: Default::default(),
        })
    }

    /// `x` in host memory: copied into page-locked staging memory (a pageable destination
    /// makes the driver stage it in small pieces, at a fraction of the link's speed), then
    /// out into a new vector on the host's threads. Waits for the stream.
    fn to_host(&self, x: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.first_to_host(x, x.len())
    }

    /// The first `n` values of `x` in host memory ([`Cuda::to_host`]).
    fn first_to_host(&self, x: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        use rayon::prelude::*;
        const PIECE: usize = 1 << 16;
        let n = n.min(x.len());
        let x = x.slice(..n);
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let buf = match &mut *staging {
            Some(buf) if buf.len() >= n => buf,
            slot => {
                // The old buffer goes before a larger one comes.
                *slot = None;
                // SAFETY: every element read below is written by the copy before it.
                let buf = unsafe { self.stream.context().alloc_pinned_with_flags::<f32>(n.max(1), 0) };
                slot.insert(buf.map_err(driver("page-locked host memory for downloads"))?)
            }
        };
        // Event tracking is off (one stream), so the buffer's own event says nothing: the
        // copy takes exactly n elements and the stream is waited for by hand.
        let host = &mut buf.as_mut_slice().map_err(driver("download"))?[..n];
        self.stream.memcpy_dtoh(&x, host).map_err(driver("download"))?;
        self.stream.synchronize().map_err(driver("download"))?;
        let host = &*host;
        let mut out: Vec<f32> = Vec::with_capacity(n);
        out.spare_capacity_mut()[..n].par_chunks_mut(PIECE).zip(host.par_chunks(PIECE)).for_each(|(d, s)| {
            d.iter_mut().zip(s).for_each(|(d, &v)| {
                d.write(v);
            })
        });
        // SAFETY: the loop above wrote all n elements.
        unsafe { out.set_len(n) };
        Ok(out)
    }

    /// The GPU's name, as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `out` (+)= `x` (M rows) times `w`'s transpose by one tensor-core kernel: what
    /// [`Kernels::linear`] does for a bf16 weight with K % 32 == 0 (it picks the kernel by
    /// [`Cuda::pick`]), open to benchmarks and tests of each kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_tc_with(
        &self,
        kernel: TcKernel,
        x: &CudaSlice<f32>,
        m: usize,
        w: &CudaMat,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        mode: Out,
    ) -> Result<()> {
        if !tensor_core_path(w) {
            return Err(Error::Backend(format!(
                "{kernel:?}: the tensor-core matmul takes unquantized bf16 weights with K % 32 == 0, \
                 not {:?} {}x{}",
                w.dtype, w.rows, w.cols
            )));
        }
        if m == 0 || w.rows == 0 {
            return Ok(());
        }
        if !self.runs(kernel, w.cols) {
            return Err(Error::Backend(format!(
                "{kernel:?} does not run here (compute capability 9.0, bf16 activations and K % 128 == 0), K = {}",
                w.cols
            )));
        }
        if kernel.is_wgmma() {
            let split = self.split_steps(x, m, w.cols)?;
            return self.linear_wgmma(kernel, &split, m, w, bias, out, mode);
        }
        if kernel.tile().is_none() {
            let s = &self.stream;
            let (xp, wp, op, bp) = (ptr(x, s), ptr(&w.buf, s), ptr(out, s), bias.map_or(0, |b| ptr(b, s)));
            let (mi, k, n, acc) = (m as i32, w.cols as i32, w.rows as i32, (mode == Out::Add) as i32);
            let f = &self.f.linear_tc[kernel as usize]; // declared first, in this order
            let groups = w.rows.div_ceil(LINEAR_TC_COLS_PER_BLOCK);
            let grid = (groups.div_ceil(kernel.groups_per_block()) as u32, 1);
            return launch!(self, f, grid, LINEAR_THREADS, "linear", [xp, mi, k, wp, n, bp, op, acc]);
        }
        let split = self.split_activations(x, m, w.cols)?;
        self.linear_tile(kernel, &split, m, w, bias, out, mode)
    }

    /// Whether `kernel` runs on this GPU and mode for a K-wide weight: every kernel does but
    /// wgmma, which needs compute capability 9.0, bf16 activations and K % 128 == 0.
    pub fn runs(&self, kernel: TcKernel, k: usize) -> bool {
        !kernel.is_wgmma() || (self.f.linear_wg.is_some() && k.is_multiple_of(128))
    }

    /// The pass kernel (8, 16 or 32 tokens a pass: `linear_tc_parts`' and
    /// `linear_tc_swiglu`'s index) that takes `parts` over `m` tokens in one launch, where
    /// [`Kernels::linear_parts`] gives them one: 1-3 bf16 weights of one K on the tensor
    /// cores, none empty, up to 32 tokens, their total width picking a pass kernel.
    fn parts_pass(&self, m: usize, parts: &[(&CudaMat, Option<&CudaSlice<f32>>)]) -> Option<usize> {
        let k = parts.first()?.0.cols;
        let one_launch = (1..=32).contains(&m)
            && (1..=3).contains(&parts.len())
            && !negative_control::stock_matmul()
            && parts.iter().all(|(w, _)| tensor_core_path(w) && w.cols == k && w.rows > 0)
            && self.pick(m, parts.iter().map(|(w, _)| w.rows).sum(), k).is_pass();
        one_launch.then_some((m > 8) as usize + (m > 16) as usize)
    }

    /// The kernel [`Kernels::linear`] takes for M tokens, N columns and K
    /// ([`TcKernel::picked`], with wgmma where it runs for K).
    pub fn pick(&self, m: usize, n: usize, k: usize) -> TcKernel {
        TcKernel::picked(m, n, self.runs(TcKernel::WgmmaPhases128x64, k))
    }

    /// The phase-split wgmma kernel SwiGLU's gate and up both take at M tokens (one shape,
    /// bf16 weights on the tensor cores), where their merges can go with SwiGLU's.
    fn phased_wgmma_pair(&self, m: usize, gate: &CudaMat, up: &CudaMat) -> Option<TcKernel> {
        let (n, k) = (gate.rows, gate.cols);
        let tensor_cores = (up.rows, up.cols) == (n, k)
            && n > 0
            && !negative_control::stock_matmul()
            && tensor_core_path(gate)
            && tensor_core_path(up);
        let kernel = self.pick(m, n, k);
        let phased = matches!(kernel, TcKernel::WgmmaPhases128x64 | TcKernel::WgmmaPhases128x128);
        (tensor_cores && phased && self.runs(kernel, k)).then_some(kernel)
    }

    /// `m` x `k` f32 activations as the bf16 planes the tiles read: split exactly into three,
    /// or rounded into one (this instance's [`Activations`]).
    fn split_activations(&self, x: &CudaSlice<f32>, m: usize, k: usize) -> Result<Scratch<'_, u16>> {
        let planes = activation_terms(self.activations);
        self.split_into(&self.f.split_activations, x, m, k, planes)
    }

    /// `m` x `k` f32 activations into `planes` bf16 planes of `m * k` by `f` (a
    /// `split_activations` kernel: x, n, out), in scratch of the pool ([`scratch`]).
    fn split_into(
        &self,
        f: &CudaFunction,
        x: &CudaSlice<f32>,
        m: usize,
        k: usize,
        planes: usize,
    ) -> Result<Scratch<'_, u16>> {
        let (s, len) = (&self.stream, m * k);
        let split = self.scratch_u16(planes * len, m, "split activations")?;
        let (xp, sp, n) = (ptr(x, s), ptr(&split, s), len as i64);
        let blocks = (len / 2).div_ceil(256).clamp(1, 4096) as u32;
        launch!(self, f, (blocks, 1), 256, "split", [xp, n, sp])?;
        Ok(split)
    }

    /// `len` f32 of a launch's scratch over `m` tokens ([`scratch`]).
    fn scratch_f32(&self, len: usize, m: usize, what: &'static str) -> Result<Scratch<'_, f32>> {
        let pools = &self.scratch;
        pools.take(&pools.f32s, &self.stream, len, m, what)
    }

    /// `len` bf16 of a launch's scratch over `m` tokens ([`scratch`]).
    fn scratch_u16(&self, len: usize, m: usize, what: &'static str) -> Result<Scratch<'_, u16>> {
        let pools = &self.scratch;
        pools.take(&pools.u16s, &self.stream, len, m, what)
    }

    /// A split attention launch's per-segment states for its merge ([`split_segments`]'s
    /// `segs`; none where it does not split).
    fn attention_partials(
        &self,
        keys: &AttentionKeys,
        heads: Heads,
        segs: Option<usize>,
    ) -> Result<Option<Scratch<'_, f32>>> {
        let len = |n: usize| keys.tokens * heads.heads * n * (heads.head_dim + 2);
        segs.map(|n| self.scratch_f32(len(n), keys.tokens, "attention partials")).transpose()
    }

    /// `outs[i]` (+)= `x` (M rows) times `parts[i]`'s transpose, for 1 to 3 quantized weights
    /// of one K, bits and group size on the tensor-core path ([`tcq_stackable`]): the
    /// activations made once (`prep_q_acts`: bf16 pairs and group sums), then one launch.
    fn linear_tcq(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        parts: &[(&CudaMat, Option<&CudaSlice<f32>>)],
        outs: &mut [&mut CudaSlice<f32>],
        mode: Out,
    ) -> Result<()> {
        // Its callers take this path only for parts `tcq_stackable` accepts.
        debug_assert!(tcq_stackable(parts) && parts.len() == outs.len());
        let Some((q, k)) = parts.first().and_then(|(w, _)| Some((w.quant.as_ref()?, w.cols))) else {
            return Ok(());
        };
        if m == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let groups = k / q.group;
        // The bf16 pairs (m k / 2 words, as m k bf16) and group sums: pooled scratch, which
        // prep_q_acts writes whole before the matmul reads it.
        let xb = self.scratch_u16(m * k, m, "quantized matmul activations")?;
        let xs = self.scratch_f32(m * groups, m, "quantized matmul activations")?;
        let (xp, xbp, xsp) = (ptr(x, s), ptr(&xb, s), ptr(&xs, s));
        let (mi, ki, gi) = (m as i32, k as i32, q.group as i32);
        // A warp per token and 256 values of K.
        let prep_blocks = (m * k.div_ceil(256)).div_ceil(4).clamp(1, 4096) as u32;
        launch!(
            self,
            &self.f.prep_q_acts,
            (prep_blocks, 1),
            128,
            "quantized matmul activations",
            [xp, mi, ki, gi, xbp, xsp]
        )?;
        let mut p = TcqParts { parts: parts.len() as i32, ..TcqParts::default() };
        let mut blocks = 0;
        for (i, ((w, bias), out)) in parts.iter().zip(outs.iter()).enumerate() {
            let words = w.quant.as_ref().and_then(|q| q.tensor_cores.as_ref());
            p.q[i] = ptr(&w.buf, s);
            p.group_words[i] = words.map_or(0, |g| ptr(g, s));
            p.bias[i] = bias.map_or(0, |b| ptr(b, s));
            p.out[i] = ptr(&**out, s);
            p.n[i] = w.rows as i32;
            p.first_block[i] = blocks as i32;
            blocks += w.rows.div_ceil(LINEAR_TC_COLS_PER_BLOCK);
        }
        // Tokens per pass over the weights: 8, 16, 32, 64 (the same bits for each).
        let pass = match m {
            0..=8 => 0,
            9..=16 => 1,
            17..=32 => 2,
            _ => 3,
        };
        let f = &self.f.linear_tcq[(q.bits == 8) as usize][pass];
        let acc = (mode == Out::Add) as i32;
        launch!(self, f, (blocks as u32, 1), LINEAR_THREADS, "linear", [xbp, xsp, mi, ki, gi, p, acc])
    }

    /// [`Kernels::linear_parts`] (1 to 3 parts, none empty) by one launch of a phase-split
    /// tile over activations already split, then each part's merge: each output as its own
    /// launch of `kernel` would write it.
    fn linear_tile_parts(
        &self,
        kernel: TcKernel,
        split: &CudaSlice<u16>,
        m: usize,
        parts: &[(&CudaMat, Option<&CudaSlice<f32>>)],
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<()> {
        let (Some(i), Some((_, tile))) = (PARTS_TILES.iter().position(|k| *k == kernel), kernel.tile())
        else {
            return Err(Error::Backend(format!("{kernel:?} has no launch over several weights")));
        };
        let (f, cols, toks) = (&self.f.linear_tt_parts[i], tile.cols, tile.toks);
        let s = &self.stream;
        let total: usize = parts.iter().map(|(w, _)| w.rows).sum();
        // Every phase block writes its whole tile of partials before the merges.
        let partials = self.scratch_f32(8 * m * total, m, "matmul partials")?;
        let base = ptr(&partials, s);
        let mut p = TcParts { parts: parts.len() as i32, ..TcParts::default() };
        let (mut blocks, mut offset) = (0, 0);
        for (i, (w, _)) in parts.iter().enumerate() {
            p.w[i] = ptr(&w.buf, s);
            p.out[i] = base + 4 * offset as u64;
            p.n[i] = w.rows as i32;
            p.first_block[i] = blocks as i32;
            blocks += w.rows.div_ceil(cols);
            offset += 8 * m * w.rows;
        }
        let (sp, mi, k) = (ptr(split, s), m as i32, parts[0].0.cols as i32);
        let grid = (blocks as u32, 8 * m.div_ceil(toks) as u32);
        let smem = tile.smem_bytes(activation_terms(self.activations));
        launch!(self, f, grid, LINEAR_THREADS, smem, "linear", [sp, mi, k, p])?;
        let merges: Vec<_> = parts.iter().zip(p.out).map(|((w, bias), part)| (part, w.rows, *bias)).collect();
        self.merge_phases_parts(m, &merges, outs)?;
        drop(partials);
        Ok(())
    }

    /// `m` x `k` f32 activations rounded to bf16 in the order wgmma reads them
    /// (`split_activations_steps`: each 32-wide block as its two MMA steps).
    fn split_steps(&self, x: &CudaSlice<f32>, m: usize, k: usize) -> Result<Scratch<'_, u16>> {
        self.split_into(&self.f.split_activations_steps, x, m, k, 1)
    }

    /// [`Cuda::linear_tc_with`] by a tile kernel, over activations already split.
    #[allow(clippy::too_many_arguments)]
    fn linear_tile(
        &self,
        kernel: TcKernel,
        split: &CudaSlice<u16>,
        m: usize,
        w: &CudaMat,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        mode: Out,
    ) -> Result<()> {
        let s = &self.stream;
        let (sp, wp, op, bp) = (ptr(split, s), ptr(&w.buf, s), ptr(out, s), bias.map_or(0, |b| ptr(b, s)));
        let (mi, k, n, acc) = (m as i32, w.cols as i32, w.rows as i32, (mode == Out::Add) as i32);
        let Some((i, tile)) = kernel.tile() else {
            return Err(Error::Backend(format!("{kernel:?} is not a tile kernel")));
        };
        let (smem, cols_grid, token_tiles) = (
            tile.smem_bytes(activation_terms(self.activations)),
            w.rows.div_ceil(tile.cols) as u32,
            m.div_ceil(tile.toks) as u32,
        );
        if !tile.phased {
            let f = &self.f.linear_tt[i];
            return launch!(
                self,
                f,
                (cols_grid, token_tiles),
                LINEAR_THREADS,
                smem,
                "linear",
                [sp, mi, k, wp, n, bp, op, acc]
            );
        }
        // Every phase block writes its whole tile of partials before the merge.
        let part = self.scratch_f32(8 * m * w.rows, m, "matmul partials")?;
        let pp = ptr(&part, s);
        let f = &self.f.linear_tt_phases[i];
        launch!(
            self,
            f,
            (cols_grid, 8 * token_tiles),
            LINEAR_THREADS,
            smem,
            "linear",
            [sp, mi, k, wp, n, pp]
        )?;
        self.merge_phases(pp, m, w.rows, bias, out, mode)
    }

    /// `out` (+)= the 8 phase partials at device address `part` (8 x M x N f32) added in
    /// phase order, + `bias`.
    pub(crate) fn merge_phases(
        &self,
        part: u64,
        m: usize,
        n: usize,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        mode: Out,
    ) -> Result<()> {
        let s = &self.stream;
        let (op, bp) = (ptr(out, s), bias.map_or(0, |b| ptr(b, s)));
        let (mi, ni, acc) = (m as i32, n as i32, (mode == Out::Add) as i32);
        let blocks = (m * n).div_ceil(256).min(4096) as u32;
        launch!(self, &self.f.linear_merge_phases, (blocks, 1), 256, "merge", [part, mi, ni, bp, op, acc])
    }

    /// Each `outs[i]` = the 8 phase partials at device address `parts[i].0` (8 x M x
    /// `parts[i].1` f32) added in phase order, + `parts[i].2`, for 1-3 parts in one launch:
    /// each output as [`Cuda::merge_phases`] writes it.
    pub(crate) fn merge_phases_parts(
        &self,
        m: usize,
        parts: &[(u64, usize, Option<&CudaSlice<f32>>)],
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<()> {
        if !(1..=3).contains(&parts.len()) || parts.len() != outs.len() {
            return Err(Error::Backend(format!(
                "{} merges for {} outputs in one launch (1 to 3)",
                parts.len(),
                outs.len()
            )));
        }
        let s = &self.stream;
        let mut p = MergeParts { parts: parts.len() as i32, ..MergeParts::default() };
        let mut end = 0;
        for (i, ((part, n, bias), out)) in parts.iter().zip(outs.iter()).enumerate() {
            end += (m * n) as i64;
            (p.part[i], p.bias[i], p.out[i]) = (*part, bias.map_or(0, |b| ptr(b, s)), ptr(&**out, s));
            (p.end[i], p.n[i]) = (end, *n as i32);
        }
        let blocks = (end as usize).div_ceil(256).clamp(1, 4096) as u32;
        let mi = m as i32;
        launch!(self, &self.f.linear_merge_phases_parts, (blocks, 1), 256, "merge", [p, mi])
    }

    /// `out` = silu(gate) * up, gate and up each the merge of an M x N phase launch's
    /// partials (at device addresses `gate.0`, `up.0`) + its bias: the bits of the two
    /// merges and then [`Cuda::swiglu`], in one launch.
    fn merge_phases_swiglu(
        &self,
        m: usize,
        n: usize,
        gate: (u64, Option<&CudaSlice<f32>>),
        up: (u64, Option<&CudaSlice<f32>>),
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let s = &self.stream;
        let (gb, ub) = (gate.1.map_or(0, |b| ptr(b, s)), up.1.map_or(0, |b| ptr(b, s)));
        let (mi, ni, op) = (m as i32, n as i32, ptr(out, s));
        let blocks = (m * n).div_ceil(256).clamp(1, 4096) as u32;
        let (gp, upp) = (gate.0, up.0);
        launch!(
            self,
            &self.f.linear_merge_phases_swiglu,
            (blocks, 1),
            256,
            "merge",
            [gp, upp, mi, ni, gb, ub, op]
        )
    }

    /// Waits for every queued kernel (for timing).
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    /// The GPU time, in milliseconds, of the work `queue` puts on the stream (events
    /// recorded around it; the host's launch time left out). Waits for the stream.
    pub fn gpu_time_ms(&self, queue: impl FnOnce() -> Result<()>) -> Result<f64> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let start = self.stream.record_event(Some(CU_EVENT_DEFAULT)).map_err(driver("event"))?;
        queue()?;
        let end = self.stream.record_event(Some(CU_EVENT_DEFAULT)).map_err(driver("event"))?;
        Ok(start.elapsed_ms(&end).map_err(driver("event"))? as f64)
    }

    /// The rows' K/V layouts for the kernels (`RowKv` in forward.cuh, [`ROW_FIELDS`] each)
    /// and their rings', with every block table uploaded in one buffer they point into.
    #[allow(clippy::type_complexity)]
    fn row_layouts(
        &self,
        stores: &[(&CudaKv, mtp_cache::SlotMap)],
        rings: &[(&CudaKv, mtp_cache::SlotMap)],
    ) -> Result<(Vec<i64>, Vec<i64>, CudaSlice<i32>)> {
        let mut indices: Vec<i32> = Vec::new();
        let mut starts = Vec::with_capacity(stores.len() + rings.len());
        for (store, _) in stores.iter().chain(rings) {
            starts.push(indices.len());
            indices.extend(store.table());
        }
        let tables = self.upload_as(&indices, "block tables")?;
        let at = ptr(&tables, &self.stream) as i64;
        let layout = |(store, map): &(&CudaKv, mtp_cache::SlotMap), start: usize| {
            [
                store.base(),
                store.plane() as i64,
                map.committed as i64,
                map.base as i64,
                map.ring as i64,
                at + 4 * start as i64,
                store.block_slots() as i64,
            ]
        };
        let rows = stores.iter().zip(&starts).flat_map(|(s, &i)| layout(s, i)).collect();
        let ring_rows = rings.iter().zip(&starts[stores.len()..]).flat_map(|(s, &i)| layout(s, i)).collect();
        Ok((rows, ring_rows, tables))
    }

    fn upload_as<T: cudarc::driver::DeviceRepr>(&self, x: &[T], what: &str) -> Result<CudaSlice<T>> {
        if x.is_empty() {
            // SAFETY: one element, never read.
            return unsafe { self.stream.alloc::<T>(1) }.map_err(driver(what));
        }
        self.stream.clone_htod(x).map_err(driver(what))
    }

    /// The negative control's matmul: cuBLAS SGEMM on an f32 copy of the weights, whose
    /// kernel choice (and reduction order) depends on M.
    fn stock_linear(&self, x: &CudaSlice<f32>, m: usize, w: &CudaMat, y: &mut CudaSlice<f32>) -> Result<()> {
        use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
        let blas = self
            .blas
            .get_or_init(|| {
                // SAFETY: only probes whether libcublas can be loaded.
                if !unsafe { cudarc::cublas::sys::is_culib_present() } {
                    return Err("libcublas not found".into());
                }
                CudaBlas::new(self.stream.clone()).map_err(|e| format!("{e:?}"))
            })
            .as_ref()
            .map_err(|e| Error::Backend(format!("cuBLAS: {e}")))?;
        let n_el = w.rows * w.cols;
        let wf: CudaSlice<f32> = match (&w.quant, w.dtype) {
            // The control only needs the same values: dequantized on the host.
            (Some(q), _) => self.upload_as(&q.host.to_f32(), "dequantized weight")?,
            (None, WeightDtype::F32) => {
                // SAFETY: the bytes of an f32 matrix, reinterpreted.
                let v = unsafe { w.buf.transmute::<f32>(n_el) }.expect("f32 matrix bytes");
                self.stream.clone_dtod(&v).map_err(driver("widen"))?
            }
            (None, d) => {
                // SAFETY: written in full by the widening kernel below.
                let out = unsafe { self.stream.alloc::<f32>(n_el) }.map_err(driver("widen"))?;
                let (src, dst, n) = (ptr(&w.buf, &self.stream), ptr(&out, &self.stream), n_el as i64);
                let f = &self.f.widen[weight_index(d) - 1];
                launch!(self, f, (n_el.div_ceil(256) as u32, 1), 256, "widen", [src, dst, n])?;
                out
            }
        };
        let (n, k) = (w.rows as i32, w.cols as i32);
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: n,
            n: m as i32,
            k,
            alpha: 1.0f32,
            lda: k,
            ldb: k,
            beta: 0.0f32,
            ldc: n,
        };
        // SAFETY: shapes as above; y holds m x n.
        unsafe { blas.gemm(cfg, &wf, x, y) }.map_err(|e| Error::Backend(format!("cuBLAS: {e:?}")))
    }
}

/// A weight matrix on the device, in its checkpoint dtype.
pub struct CudaMat {
    buf: CudaSlice<u8>,
    dtype: WeightDtype,
    rows: usize,
    cols: usize,
    /// For an MLX-quantized weight (`buf` then holds the packed values).
    quant: Option<CudaQuant>,
}

/// Scales and biases of a quantized matrix, widened to f32, and its layout.
struct CudaQuant {
    scales: CudaSlice<f32>,
    /// Affine mode's biases (`None`: mxfp4).
    biases: Option<CudaSlice<f32>>,
    bits: usize,
    group: usize,
    /// `linear_tcq`'s group words, where this kernel set's bf16 mode takes the weight on
    /// tensor cores ([`quant_tensor_cores`]).
    tensor_cores: Option<CudaSlice<u32>>,
    /// The weight as loaded (host, memory-mapped), for the stock-matmul negative control.
    host: Weight,
}

/// Kernel variant for quantized bits: 2, 4, 8.
fn bits_index(bits: usize) -> usize {
    match bits {
        2 => 0,
        4 => 1,
        _ => 2,
    }
}

/// The RoPE table on the device.
pub struct CudaRope {
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

/// One forward's layout on the device (see `Tok` and `RowKv` in kernels.cu).
pub struct CudaBatch {
    toks: CudaSlice<i32>,
    rows: CudaSlice<i64>,
    /// The rows' sliding-window rings, when every row has one.
    ring_rows: Option<CudaSlice<i64>>,
    /// The rows' block tables (pool indices), which `rows` and `ring_rows` point into: held
    /// until the forward's kernels are queued.
    _tables: CudaSlice<i32>,
    /// Each token's id.
    tokens: CudaSlice<u32>,
    m: usize,
    /// The most keys a token reads (position + 1).
    most_keys: usize,
    kv: KvDtype,
    /// Key segments per query: 1, except under the split-attention negative control.
    splits: i32,
    /// The tokens cut into the tensor-core attention's tiles.
    tiles: flash::FlashTiles,
    /// Where adjacent rows hold the same leading blocks: the tiles that read them once for
    /// all (the main store's full-attention layers with the tensor-core attention).
    shared: Option<flash::SharedTiles>,
}

impl Kernels for Cuda {
    type Act = CudaSlice<f32>;
    type Mat = CudaMat;
    type Vec = CudaSlice<f32>;
    type Rope = CudaRope;
    type Batch = CudaBatch;
    type Recordings = CudaGraphs;

    fn backend(&self) -> Backend {
        Backend::Cuda
    }

    fn activations(&self) -> Activations {
        self.activations
    }

    fn activations_for(&self, w: &Weight) -> Activations {
        match self.activations == Activations::Bf16 && quant_tensor_cores(w) {
            true => Activations::Bf16,
            false => self.activations.for_weight(w),
        }
    }

    fn matrix(&self, w: &Weight) -> Result<CudaMat> {
        let quant = match w.quant() {
            Some(q) => Some(CudaQuant {
                scales: self.upload_as(&q.scales.to_f32(), "quantization scales")?,
                biases: match &q.biases {
                    Some(b) => Some(self.upload_as(&b.to_f32(), "quantization biases")?),
                    None => None,
                },
                bits: q.bits,
                group: q.group,
                tensor_cores: match self.activations_for(w) == Activations::Bf16 {
                    true => Some(self.upload_as(&group_words(q), "quantization group words")?),
                    false => None,
                },
                host: w.clone(),
            }),
            None => None,
        };
        let copy_err = |e| {
            Error::Backend(format!(
                "cannot copy a {} x {} {} weight to the GPU: {e:?}",
                w.rows,
                w.cols,
                w.dtype.name()
            ))
        };
        let buf = match quant.as_ref().filter(|q| q.tensor_cores.is_some()) {
            Some(q) => self.stream.clone_htod(&repack_codes(w.bytes(), w.cols, q.bits)).map_err(copy_err)?,
            None => self.stream.clone_htod(w.bytes()).map_err(copy_err)?,
        };
        Ok(CudaMat { buf, dtype: w.dtype, rows: w.rows, cols: w.cols, quant })
    }

    fn vector(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        self.upload_as(v, "vector upload")
    }

    fn rope_table(&self, table: RopeTable) -> Result<CudaRope> {
        let (cos, sin) = table.cos_sin();
        Ok(CudaRope { cos: self.upload_as(cos, "RoPE table")?, sin: self.upload_as(sin, "RoPE table")? })
    }

    fn kv_dtype(&self, kv: KvDtype, weights: WeightDtype) -> Result<KvDtype> {
        auto_kv_dtype(kv, weights)
    }

    fn kv_store(
        self: &Arc<Self>,
        n_layers: usize,
        heads: usize,
        head_dim: usize,
        kv: KvDtype,
    ) -> Box<dyn KvStore> {
        let stride = kv.slot_units(heads, head_dim);
        let pool = self
            .kv_pools
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((n_layers, stride, kv_index(kv)))
            .or_insert_with(|| {
                let bytes = CudaKv::block_bytes(n_layers, stride, kv);
                Arc::new(pool::BlockPool::new(self.stream.clone(), bytes))
            })
            .clone();
        Box::new(CudaKv::new(self.clone(), pool, n_layers, stride, kv))
    }

    fn alloc(&self, len: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: every op writes its whole output before anything reads it.
        unsafe { self.stream.alloc::<f32>(len.max(1)) }.map_err(driver("out of GPU memory for activations"))
    }

    fn upload(&self, x: &[f32]) -> Result<CudaSlice<f32>> {
        self.upload_as(x, "upload")
    }

    fn zeros(&self, len: usize) -> Result<CudaSlice<f32>> {
        // An allocation and a memset on the stream: both recordable into a CUDA graph.
        self.stream.alloc_zeros::<f32>(len.max(1)).map_err(driver("out of GPU memory for activations"))
    }

    fn download(&self, x: CudaSlice<f32>) -> Result<Vec<f32>> {
        self.to_host(&x)
    }

    fn logit_summaries(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        mtp_kernels::check_summary_lens(logits.len(), out.len(), rows, vocab)?;
        let s = &self.stream;
        let (lp, op, v) = (ptr(logits, s), ptr(out, s), vocab as i32);
        launch!(self, &self.f.logit_summaries, (rows as u32, 1), 1024, "logit_summaries", [lp, v, op])
    }

    fn batch(&self, slots: &[Slot], tokens: &[u32], caches: &mut [&mut RowCache]) -> Result<CudaBatch> {
        if tokens.len() != slots.len() {
            return Err(Error::Backend(format!("{} token ids for {} slots", tokens.len(), slots.len())));
        }
        let maps = open_windows(slots, caches)?;
        let mut kv = None;
        let foreign = |r: usize| Error::Request {
            request: format!("row {r}"),
            msg: "its KV cache is not on the GPU (made by a model on another backend)".into(),
        };
        let (mut stores, mut ring_stores) = (Vec::with_capacity(caches.len()), Vec::new());
        for (r, c) in caches.iter().enumerate() {
            let store = c.store().as_any().downcast_ref::<CudaKv>().ok_or_else(|| foreign(r))?;
            if *kv.get_or_insert(store.dtype()) != store.dtype() {
                return Err(Error::Backend("rows of one forward hold K/V in different dtypes".into()));
            }
            stores.push((store, maps[r]));
            if let (Some(ring), Some(map)) = (c.ring_store(), c.ring_map()) {
                let ring = ring.as_any().downcast_ref::<CudaKv>().ok_or_else(|| foreign(r))?;
                ring_stores.push((ring, map));
            }
        }
        let (rows, ring_rows, tables) = self.row_layouts(&stores, &ring_stores)?;
        // (row, position, RoPE position, first key: 0, the window is the kernel's argument).
        let toks: Vec<i32> =
            slots.iter().flat_map(|s| [s.row as i32, s.pos as i32, s.rope_pos as i32, 0]).collect();
        let ring_rows = if !caches.is_empty() && ring_stores.len() == caches.len() {
            Some(self.upload_as(&ring_rows, "batch layout")?)
        } else {
            None
        };
        let splits = if negative_control::split_attention() { (16 / caches.len().max(1)).max(1) } else { 1 };
        let token_rows: Vec<usize> = slots.iter().map(|s| s.row).collect();
        let tiles = self.flash_tiles(&token_rows)?;
        // (The split control moves the chunks' anchor: a shared tile's segments would not be
        // its rows'. A row alone shares with nobody: its table is not copied.)
        let held = || -> Vec<flash::HeldBlocks> {
            stores
                .iter()
                .map(|(store, map)| flash::HeldBlocks {
                    pool: store.base(),
                    table: store.table().collect(),
                    committed: map.committed,
                    ring: map.ring != 0,
                })
                .collect()
        };
        let grouped = (splits == 1 && stores.len() > 1).then(|| flash::share(&token_rows, &held())).flatten();
        let shared = match grouped {
            Some((shared, own, segments)) => Some(flash::SharedTiles {
                shared: self.tiles_on_device(shared, "shared tiles")?,
                own: self.tiles_on_device(own, "batch layout")?,
                segments,
            }),
            None => None,
        };
        Ok(CudaBatch {
            toks: self.upload_as(&toks, "batch layout")?,
            rows: self.upload_as(&rows, "batch layout")?,
            ring_rows,
            _tables: tables,
            tokens: self.upload_as(tokens, "tokens")?,
            m: slots.len(),
            most_keys: slots.iter().map(|s| s.pos + 1).max().unwrap_or(0),
            kv: kv.unwrap_or(KvDtype::F32),
            splits: splits as i32,
            tiles,
            shared,
        })
    }

    fn embed(&self, table: &CudaMat, tokens: &[u32], out: &mut CudaSlice<f32>) -> Result<()> {
        let toks = self.upload_as(tokens, "tokens")?;
        self.embed_ids(table, &toks, tokens.len(), out)
    }

    fn embed_batch(&self, table: &CudaMat, batch: &CudaBatch, out: &mut CudaSlice<f32>) -> Result<()> {
        self.embed_ids(table, &batch.tokens, batch.m, out)
    }

    fn run_recorded(
        &self,
        recordings: &CudaGraphs,
        batch: CudaBatch,
        out_lens: &[usize],
        fetch: &[usize],
        body: &mut ForwardBody<'_, Cuda>,
    ) -> Result<Vec<Vec<f32>>> {
        recordings.run(self, batch, out_lens, fetch, body)
    }

    fn recorded_shape(&self, tokens: usize, rows: usize) -> (usize, usize) {
        graphs::recorded_shape(tokens, rows)
    }

    fn token_group(&self) -> usize {
        // Every tensor-core matmul takes tokens 8 at a time (mma m16n8k16's n).
        8
    }

    fn verify_token_cost(&self) -> f64 {
        // A decode step streams the weights; tokens within a group ride along (the
        // figure adaptive k used for every backend before the CPU's was measured).
        0.2
    }

    fn recordings(&self, heads: Heads) -> CudaGraphs {
        CudaGraphs::for_heads(heads)
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        self.stream.context().bind_to_thread().ok()?;
        cudarc::driver::result::mem_get_info().ok()
    }

    fn one_time_forwards(&self, recordings: &CudaGraphs) -> u64 {
        recordings.one_time_forwards()
    }

    fn linear(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        w: &CudaMat,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        mode: Out,
    ) -> Result<()> {
        let s = &self.stream;
        let acc = (mode == Out::Add) as i32;
        let bp = bias.map_or(0, |b| ptr(b, s));
        if negative_control::stock_matmul() {
            let mut y = self.alloc(m * w.rows)?;
            self.stock_linear(x, m, w, &mut y)?;
            let (yp, op, n, mi) = (ptr(&y, s), ptr(out, s), w.rows as i32, m as i32);
            return launch!(self, &self.f.add_into, (m as u32, 1), 256, "add", [op, yp, bp, mi, n, acc]);
        }
        if tensor_core_path(w) {
            return self.linear_tc_with(self.pick(m, w.rows, w.cols), x, m, w, bias, out, mode);
        }
        let (xp, wp, op) = (ptr(x, s), ptr(&w.buf, s), ptr(out, s));
        let (mi, k, n) = (m as i32, w.cols as i32, w.rows as i32);
        let grid = w.rows.div_ceil(LINEAR_COLS_PER_BLOCK) as u32;
        // Rows per pass over the weights; every variant sums each output in the same order.
        let rows_per_pass = match m {
            0..=4 => 0,
            5..=8 => 1,
            _ => 2,
        };
        if let Some(q) = &w.quant {
            if q.tensor_cores.is_some() {
                return self.linear_tcq(x, m, &[(w, bias)], &mut [out], mode);
            }
            let (sc, bi, g) = (ptr(&q.scales, s), q.biases.as_ref().map_or(0, |b| ptr(b, s)), q.group as i32);
            let f = &self.f.linear_q[bits_index(q.bits)][rows_per_pass];
            return launch!(
                self,
                f,
                (grid, 1),
                LINEAR_THREADS,
                "linear",
                [xp, mi, k, wp, sc, bi, g, n, bp, op, acc]
            );
        }
        let f = &self.f.linear[weight_index(w.dtype)][rows_per_pass];
        launch!(self, f, (grid, 1), LINEAR_THREADS, "linear", [xp, mi, k, wp, n, bp, op, acc])
    }

    fn linear_parts(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        parts: &[(&CudaMat, Option<&CudaSlice<f32>>)],
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<()> {
        // Tensor cores over the same K: one launch for up to 3 parts (a phase-split tile
        // where they together take one, else up to 32 tokens the pass kernel); past 32
        // tokens otherwise a tile launch each over activations split once. Else a launch each.
        let k = parts.first().map_or(0, |(w, _)| w.cols);
        if m > 0 && parts.len() == outs.len() && tcq_stackable(parts) && !negative_control::stock_matmul() {
            return self.linear_tcq(x, m, parts, outs, Out::Write);
        }
        if let Some(pass) = self.parts_pass(m, parts).filter(|_| parts.len() == outs.len()) {
            let s = &self.stream;
            let mut p = TcParts { parts: parts.len() as i32, ..TcParts::default() };
            let mut blocks = 0;
            for (i, ((w, bias), out)) in parts.iter().zip(outs.iter()).enumerate() {
                p.w[i] = ptr(&w.buf, s);
                p.bias[i] = bias.map_or(0, |b| ptr(b, s));
                p.out[i] = ptr(&**out, s);
                p.n[i] = w.rows as i32;
                p.first_block[i] = blocks as i32;
                blocks += w.rows.div_ceil(LINEAR_TC_COLS_PER_BLOCK);
            }
            let (xp, mi, ki) = (ptr(x, s), m as i32, k as i32);
            let f = &self.f.linear_tc_parts[pass];
            return launch!(self, f, (blocks as u32, 1), LINEAR_THREADS, "linear", [xp, mi, ki, p]);
        }
        let tensor_cores = parts.len() == outs.len()
            && !negative_control::stock_matmul()
            && parts.iter().all(|(w, _)| tensor_core_path(w) && w.cols == k);
        let stackable =
            tensor_cores && (1..=3).contains(&parts.len()) && parts.iter().all(|(w, _)| w.rows > 0);
        if m == 0 || !tensor_cores || (m <= 32 && !stackable) {
            return linear_each(self, x, m, parts, outs);
        }
        let kernel = self.pick(m, parts.iter().map(|(w, _)| w.rows).sum(), k);
        if stackable && PARTS_TILES.contains(&kernel) {
            let split = self.split_activations(x, m, k)?;
            return self.linear_tile_parts(kernel, &split, m, parts, outs);
        }
        // Where each part would take the 64-token wgmma phases and some would stack
        // (`hopper::stacks_64`), one launch for all.
        if stackable
            && parts.iter().all(|(w, _)| self.pick(m, w.rows, k) == TcKernel::WgmmaPhases128x64)
            && parts.iter().any(|(w, _)| hopper::stacks_64(w.rows, m))
        {
            let steps = self.split_steps(x, m, k)?;
            return self.linear_wgmma_parts(&steps, m, parts, outs);
        }
        // Past 32 tokens (fewer took the pass kernel or a tile above) every width takes a
        // tile kernel or wgmma, each kind's split made once.
        let (mut split, mut steps) = (None, None);
        for ((w, bias), out) in parts.iter().zip(outs.iter_mut()) {
            if w.rows == 0 {
                continue;
            }
            let kernel = self.pick(m, w.rows, k);
            if kernel.is_wgmma() {
                let steps = match &steps {
                    Some(s) => s,
                    None => steps.insert(self.split_steps(x, m, k)?),
                };
                self.linear_wgmma(kernel, steps, m, w, *bias, out, Out::Write)?;
            } else {
                let split = match &split {
                    Some(s) => s,
                    None => split.insert(self.split_activations(x, m, k)?),
                };
                self.linear_tile(kernel, split, m, w, *bias, out, Out::Write)?;
            }
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
        out_width: usize,
        col: usize,
    ) -> Result<()> {
        let s = &self.stream;
        let n = w.len();
        let rows = (x.len() / n) as u32;
        let (xp, wp, op, ni, ow, c) =
            (ptr(x, s), ptr(w, s), ptr(out, s), n as i32, out_width as i32, col as i32);
        launch!(self, &self.f.rms_norm, (rows, 1), 256, "rms_norm", [xp, wp, ni, eps, op, ow, c])
    }

    /// One launch (`linear_tc_swiglu`) where [`Kernels::linear_parts`] would take the pass
    /// kernel for the pair (bf16 weights of one shape, up to 32 tokens, no tile picked):
    /// decode and small verifies. Elsewhere `linear_parts` then `swiglu`.
    fn linear_swiglu(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        gate: (&CudaMat, Option<&CudaSlice<f32>>),
        up: (&CudaMat, Option<&CudaSlice<f32>>),
        gate_out: &mut CudaSlice<f32>,
        up_out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let ((gw, gb), (uw, ub)) = (gate, up);
        let (n, k) = (gw.rows, gw.cols);
        if let Some(kernel) = self.phased_wgmma_pair(m, gw, uw) {
            // Past 32 tokens on a Hopper: the two phase launches (one where they stack, as
            // linear_parts would), then their merges and SwiGLU in one launch.
            let steps = self.split_steps(x, m, k)?;
            if kernel == TcKernel::WgmmaPhases128x64 && hopper::stacks_64(n, m) {
                let (partials, at) = self.wgmma_parts_partials(&steps, m, &[gw, uw])?;
                self.merge_phases_swiglu(m, n, (at[0], gb), (at[1], ub), gate_out)?;
                drop(partials);
            } else {
                let (gp, upp) = (
                    self.wgmma_partials(kernel, &steps, m, gw)?,
                    self.wgmma_partials(kernel, &steps, m, uw)?,
                );
                let s = &self.stream;
                self.merge_phases_swiglu(m, n, (ptr(&gp, s), gb), (ptr(&upp, s), ub), gate_out)?;
            }
            return Ok(());
        }
        let pass = self.parts_pass(m, &[gate, up]).filter(|_| (uw.rows, uw.cols) == (n, k));
        let Some(pass) = pass else {
            self.linear_parts(x, m, &[gate, up], &mut [&mut *gate_out, &mut *up_out])?;
            return self.swiglu(gate_out, up_out);
        };
        let s = &self.stream;
        let (xp, gp, upp, op) = (ptr(x, s), ptr(&gw.buf, s), ptr(&uw.buf, s), ptr(gate_out, s));
        let (gbp, ubp) = (gb.map_or(0, |b| ptr(b, s)), ub.map_or(0, |b| ptr(b, s)));
        let (mi, ki, ni) = (m as i32, k as i32, n as i32);
        // A block's 16-column groups each take 8 gate and 8 up columns.
        let groups = n.div_ceil(LINEAR_TC_COLS_PER_BLOCK / 2);
        let (f, blocks) = match pass {
            0 | 1 if wide_pass(m, groups) => {
                (&self.f.linear_tc_swiglu[3 + pass], groups.div_ceil(TcKernel::Pass8Wide.groups_per_block()))
            }
            _ => (&self.f.linear_tc_swiglu[pass], groups),
        };
        launch!(
            self,
            f,
            (blocks as u32, 1),
            LINEAR_THREADS,
            "linear_swiglu",
            [xp, mi, ki, gp, upp, ni, gbp, ubp, op]
        )
    }

    fn swiglu(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>) -> Result<()> {
        let s = &self.stream;
        let n = gate.len().min(up.len()) as i64;
        let (g, u) = (ptr(gate, s), ptr(up, s));
        launch!(self, &self.f.swiglu, ((n as usize).div_ceil(256) as u32, 1), 256, "swiglu", [g, u, n])
    }

    fn qk_rope_store(
        &self,
        q: &mut CudaSlice<f32>,
        kv: Option<(&mut CudaSlice<f32>, &CudaSlice<f32>)>,
        norms: Option<(&CudaSlice<f32>, &CudaSlice<f32>, f32)>,
        rope: &CudaRope,
        batch: &CudaBatch,
        _caches: &mut [&mut RowCache],
        plane: Plane,
        heads: Heads,
    ) -> Result<()> {
        check_heads(heads)?;
        check_gpu_kv(batch.kv, heads.head_dim, "CUDA")?;
        let s = &self.stream;
        let (rows, li) = self.plane_rows(batch, plane)?;
        let (qn, kn, eps) = norms.map_or((0, 0, 0.0), |(a, b, e)| (ptr(a, s), ptr(b, s), e));
        let blocks = if kv.is_some() { heads.heads + 2 * heads.kv_heads } else { heads.heads };
        let (kp, vp) = kv.map_or((0, 0), |(k, v)| (ptr(k, s), ptr(v, s)));
        let qp = ptr(q, s);
        let (cp, sp, tp, rp) = (ptr(&rope.cos, s), ptr(&rope.sin, s), ptr(&batch.toks, s), ptr(rows, s));
        let (nh, nkv, hd) = (heads.heads as i32, heads.kv_heads as i32, heads.head_dim as i32);
        let grid = (batch.m as u32, blocks as u32);
        launch!(
            self,
            &self.f.qk_rope_store[kv_index(batch.kv)],
            grid,
            128,
            "qk_rope_store",
            [qp, kp, vp, qn, kn, eps, cp, sp, tp, rp, li, nh, nkv, hd]
        )
    }

    fn attention(
        &self,
        q: &CudaSlice<f32>,
        batch: &CudaBatch,
        _caches: &[&mut RowCache],
        plane: Plane,
        heads: Heads,
        scale: f32,
        window: Option<usize>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_heads(heads)?;
        let (rows, li) = self.plane_rows(batch, plane)?;
        let win = window.map_or(0, |w| w as i32);
        let keys =
            AttentionKeys { tokens: batch.m, most: batch.most_keys, splits: batch.splits, window: win };
        // Shared blocks are the main store's, read in full (no window).
        let shared = batch.shared.as_ref().filter(|_| win == 0 && matches!(plane, Plane::Main(_)));
        self.launch_attention(
            q,
            out,
            &batch.toks,
            rows,
            &batch.tiles,
            shared,
            li,
            heads,
            scale,
            batch.kv,
            keys,
        )
    }

    fn gather(&self, x: &CudaSlice<f32>, width: usize, rows: &[usize]) -> Result<CudaSlice<f32>> {
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let idx = self.upload_as(&idx, "row selection")?;
        let out = self.alloc(rows.len() * width)?;
        let s = &self.stream;
        let (xp, ip, w, op) = (ptr(x, s), ptr(&idx, s), width as i32, ptr(&out, s));
        launch!(self, &self.f.gather, (rows.len() as u32, 1), 256, "gather", [xp, ip, w, op])?;
        Ok(out)
    }

    fn gelu_tanh_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>) -> Result<()> {
        let n = gate.len().min(up.len());
        let (g, u, n64) = (ptr(gate, &self.stream), ptr(up, &self.stream), n as i64);
        launch!(self, &self.f.gelu_tanh_mul, grid256(n), 256, "gelu", [g, u, n64])
    }

    fn scale(&self, x: &mut CudaSlice<f32>, by: f32) -> Result<()> {
        let (xp, n64) = (ptr(x, &self.stream), x.len() as i64);
        launch!(self, &self.f.scale_by, grid256(x.len()), 256, "scale", [xp, by, n64])
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<()> {
        let n = x.len().min(y.len());
        let (xp, yp, n64) = (ptr(x, &self.stream), ptr(y, &self.stream), n as i64);
        launch!(self, &self.f.add_to, grid256(n), 256, "add", [xp, yp, n64])
    }

    fn add_parts(
        &self,
        x: &mut CudaSlice<f32>,
        parts: &CudaSlice<f32>,
        n: usize,
        reversed: bool,
    ) -> Result<()> {
        let len = x.len();
        if parts.len() != n * len {
            return Err(Error::Backend(format!("add_parts: {n} parts of {len} in {} values", parts.len())));
        }
        let (xp, pp, len64, n32, rev) =
            (ptr(x, &self.stream), ptr(parts, &self.stream), len as i64, n as i32, reversed as i32);
        launch!(self, &self.f.add_parts, grid256(len), 256, "add_parts", [xp, pp, len64, n32, rev])
    }

    fn concat_columns(
        &self,
        parts: &CudaSlice<f32>,
        n: usize,
        width: usize,
        m: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let total = n * m * width;
        if parts.len() < total || out.len() < total {
            return Err(Error::Backend(format!(
                "concat_columns: {n} parts of {m} x {width} in {} values into {}",
                parts.len(),
                out.len()
            )));
        }
        let (op, pp, n32, w64, m64) =
            (ptr(out, &self.stream), ptr(parts, &self.stream), n as i32, width as i64, m as i64);
        launch!(self, &self.f.concat_columns, grid256(total), 256, "concat_columns", [op, pp, n32, w64, m64])
    }

    fn add_rows_scaled(
        &self,
        out: &mut CudaSlice<f32>,
        width: usize,
        src: &CudaSlice<f32>,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()> {
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let (idx, w) = (self.upload_as(&idx, "expert rows")?, self.upload_as(weights, "expert weights")?);
        let s = &self.stream;
        let (op, sp, ip, wp, wd) = (ptr(out, s), ptr(src, s), ptr(&idx, s), ptr(&w, s), width as i32);
        launch!(
            self,
            &self.f.add_rows_scaled,
            (rows.len() as u32, 1),
            256,
            "add_rows_scaled",
            [op, sp, ip, wp, wd]
        )
    }
}

/// One attention launch's queries and keys.
struct AttentionKeys {
    tokens: usize,
    /// The most keys any token reads (its position + 1).
    most: usize,
    /// Key segments per query under the split-attention negative control (else 1).
    splits: i32,
    /// Sliding window (0: none).
    window: i32,
}

/// The attention kernel for a head shape (its index in `Functions::attention`) and the query
/// heads a block serves: up to head size 128, the most of 4, 2, 1 that divides the query
/// heads per KV head (each key and value loaded once for them all); above it, one. Fixed by
/// the model's shape, so every launch of a model computes each head the same way.
fn attention_variant(h: Heads) -> (usize, usize) {
    let per_kv = h.heads / h.kv_heads.max(1);
    match h.head_dim {
        0..=128 if per_kv.is_multiple_of(4) => (2, 4),
        0..=128 if per_kv.is_multiple_of(2) => (1, 2),
        0..=128 => (0, 1),
        129..=256 => (3, 1),
        _ => (4, 1),
    }
}

/// Keys per attention segment (`ATT_SEG` in kernels.cu).
const ATTENTION_SEGMENT: usize = 512;

/// The segments (of `segment` keys) a block-per-segment launch would cover, when that
/// launch pays: few tokens over more than one segment (one block per (token, head) would
/// leave most of the GPU idle), at most 65,535 grid rows (`per_segment` a segment), its
/// scratch under 256 MiB. Either launch gives the same bits, so this choice may follow
/// the batch. For both attention kernels.
fn split_segments(keys: &AttentionKeys, heads: Heads, segment: usize, per_segment: usize) -> Option<usize> {
    let segs = keys.most.div_ceil(segment);
    let scratch = keys.tokens * heads.heads * segs * (heads.head_dim + 2) * 4;
    (keys.splits == 1
        && segs >= 2
        && keys.tokens <= 64
        && per_segment * segs <= 65_535
        && scratch <= 256 << 20)
        .then_some(segs)
}

impl Cuda {
    /// Attention of `keys.tokens` queries over their rows' K/V (`toks`, `rows`: the
    /// kernels' layout), by one block per (token, head) or, per [`split_segments`], a block
    /// per (token, head, segment) and the merge.
    #[allow(clippy::too_many_arguments)]
    fn launch_attention(
        &self,
        q: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        toks: &CudaSlice<i32>,
        rows: &CudaSlice<i64>,
        tiles: &flash::FlashTiles,
        shared: Option<&flash::SharedTiles>,
        li: i32,
        heads: Heads,
        scale: f32,
        kv: KvDtype,
        keys: AttentionKeys,
    ) -> Result<()> {
        check_gpu_kv(kv, heads.head_dim, "CUDA")?;
        if let Some(tier) = flash::pick(self.activations, kv, heads) {
            return self.launch_flash(tier, q, out, toks, rows, tiles, shared, li, heads, scale, keys);
        }
        let s = &self.stream;
        let (variant, group) = attention_variant(heads);
        let f = &self.f.attention[kv_index(kv)][variant];
        let (qp, op, tp, rp) = (ptr(q, s), ptr(out, s), ptr(toks, s), ptr(rows, s));
        let (nh, nkv, hd) = (heads.heads as i32, heads.kv_heads as i32, heads.head_dim as i32);
        let (splits, win) = (keys.splits, keys.window);
        let tokens = keys.tokens as u32;
        // Split: a block per segment, its state in `partial` for the merge launch.
        let segs = split_segments(&keys, heads, ATTENTION_SEGMENT, heads.heads);
        let partial = self.attention_partials(&keys, heads, segs)?;
        let pp = partial.as_ref().map_or(0, |p| ptr(p, s));
        let grid = (tokens, (heads.heads / group * segs.unwrap_or(1)) as u32);
        launch!(
            self,
            f,
            grid,
            ATTENTION_THREADS,
            "attention",
            [qp, op, pp, tp, rp, li, nh, nkv, hd, scale, splits, win]
        )?;
        let Some(segs) = segs else { return Ok(()) };
        let ms = segs as i32;
        launch!(
            self,
            &self.f.attention_merge,
            (tokens, heads.heads as u32),
            32,
            "attention merge",
            [pp, op, nh, hd, ms]
        )
    }

    /// `out[i] = table[toks[i]]` for `n` device token ids.
    fn embed_ids(
        &self,
        table: &CudaMat,
        toks: &CudaSlice<u32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let s = &self.stream;
        let (t, tk, cols, o) = (ptr(&table.buf, s), ptr(toks, s), table.cols as i32, ptr(out, s));
        if let Some(q) = &table.quant {
            let (sc, bi, g) = (ptr(&q.scales, s), q.biases.as_ref().map_or(0, |b| ptr(b, s)), q.group as i32);
            let f = match q.tensor_cores {
                Some(_) => &self.f.embed_tcq[(q.bits == 8) as usize],
                None => &self.f.embed_q[bits_index(q.bits)],
            };
            return launch!(self, f, (n as u32, 1), 256, "embed", [t, sc, bi, g, tk, cols, o]);
        }
        launch!(self, &self.f.embed[weight_index(table.dtype)], (n as u32, 1), 256, "embed", [t, tk, cols, o])
    }

    /// The tensor-core attention's tiles of a batch whose tokens sit in `rows`.
    fn flash_tiles(&self, rows: &[usize]) -> Result<flash::FlashTiles> {
        self.tiles_on_device(flash::tiles(rows).0, "batch layout")
    }

    /// Tile quads ([`flash::FlashTiles`]) on the device.
    fn tiles_on_device(&self, quads: Vec<i32>, what: &str) -> Result<flash::FlashTiles> {
        let most = quads.chunks(4).map(|q| q[1] as usize).max().unwrap_or(0);
        Ok(flash::FlashTiles { buf: self.upload_as(&quads, what)?, count: quads.len() / 4, most })
    }

    /// The row layout of `plane` and the layer within it.
    fn plane_rows<'a>(&self, batch: &'a CudaBatch, plane: Plane) -> Result<(&'a CudaSlice<i64>, i32)> {
        match plane {
            Plane::Main(l) => Ok((&batch.rows, l as i32)),
            Plane::Ring(l) => match &batch.ring_rows {
                Some(rows) => Ok((rows, l as i32)),
                None => Err(Error::Backend("a sliding-window layer ran over rows without a ring".into())),
            },
        }
    }
}

/// Blocks of 256 threads covering `n` values.
fn grid256(n: usize) -> (u32, u32) {
    (n.div_ceil(256) as u32, 1)
}

impl AssistantKernels for Cuda {
    fn rope_at(
        &self,
        x: &mut CudaSlice<f32>,
        width: usize,
        head_dim: usize,
        positions: &[usize],
        rope: &CudaRope,
    ) -> Result<()> {
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let pos = self.upload_as(&pos, "positions")?;
        let s = &self.stream;
        let (xp, w, hd, pp, cp, sp) =
            (ptr(x, s), width as i32, head_dim as i32, ptr(&pos, s), ptr(&rope.cos, s), ptr(&rope.sin, s));
        let grid = (positions.len() as u32, (width / head_dim.max(1)) as u32);
        launch!(self, &self.f.rope_rows, grid, 128, "rope_rows", [xp, w, hd, pp, cp, sp])
    }

    fn attention_over(
        &self,
        q: &CudaSlice<f32>,
        keys: &[KeyRange],
        caches: &[&RowCache],
        plane: Plane,
        heads: Heads,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_heads(heads)?;
        let mut stores = Vec::with_capacity(caches.len());
        let mut toks: Vec<i32> = Vec::with_capacity(4 * caches.len());
        let mut kv = None;
        for (r, (c, k)) in caches.iter().zip(keys).enumerate() {
            let map = held_keys(c, r, plane, *k)?;
            let store =
                plane.store(c).and_then(|s| s.as_any().downcast_ref::<CudaKv>()).ok_or_else(|| {
                    Error::Request {
                        request: format!("row {r}"),
                        msg: "its target K/V are not on the GPU".into(),
                    }
                })?;
            if *kv.get_or_insert(store.dtype()) != store.dtype() {
                return Err(Error::Backend("rows of one step hold K/V in different dtypes".into()));
            }
            stores.push((store, map));
            toks.extend([r as i32, k.end as i32 - 1, 0, k.first as i32]);
        }
        let most = keys.iter().map(|k| k.end).max().unwrap_or(0);
        let (rows, _, tables) = self.row_layouts(&stores, &[])?;
        let (toks, rows) = (self.upload_as(&toks, "key ranges")?, self.upload_as(&rows, "key ranges")?);
        let keys = AttentionKeys { tokens: caches.len(), most, splits: 1, window: 0 };
        let kv = kv.unwrap_or(KvDtype::F32);
        let tiles = self.flash_tiles(&(0..caches.len()).collect::<Vec<_>>())?;
        self.launch_attention(
            q,
            out,
            &toks,
            &rows,
            &tiles,
            None,
            plane.layer() as i32,
            heads,
            scale,
            kv,
            keys,
        )?;
        drop(tables); // freed after the launch on the same stream
        Ok(())
    }
}

fn check_heads(h: Heads) -> Result<()> {
    check_gpu_heads(h, "CUDA")
}

#[cfg(test)]
mod tests {
    use super::{repack_codes, wide_pass, TcKernel};

    /// The wave rule picks the tile that was faster at each point measured on an H100
    /// (notes v25): 128x192 at 2,048 and 4,096 tokens on the 8B's wide shapes, 128x128 at
    /// 512 and 1,024 tokens and for k and v's 1,024 rows.
    /// The wide passes where the H200 measured them faster (notes v30): 8 and 16 tokens on
    /// the LM head, 8 on 24,576 rows (gate and up together); not on 12,288 rows or at 1-2
    /// tokens.
    #[test]
    fn the_wide_pass_is_taken_where_it_was_measured_faster() {
        for (m, n, want) in [
            (8, 151936, TcKernel::Pass8Wide),
            (16, 151936, TcKernel::Pass16Wide),
            (8, 24576, TcKernel::Pass8Wide),
            (8, 12288, TcKernel::Pass8),
            (16, 12288, TcKernel::Pass16),
            (2, 151936, TcKernel::Pass8),
            (1, 151936, TcKernel::Pass8),
            (8, 4096, TcKernel::Pass8),
        ] {
            assert_eq!(TcKernel::for_shape(m, n), want, "M = {m}, N = {n}");
        }
        // SwiGLU's gate of 12,288 columns: 1,536 groups of 8 gate and 8 up columns.
        assert!(wide_pass(8, 12288 / 8) && !wide_pass(2, 12288 / 8));
    }

    #[test]
    fn the_wgmma_tile_is_the_one_measured_faster() {
        for (m, n, want) in [
            (2048, 4096, TcKernel::Wgmma128x192),
            (4096, 4096, TcKernel::Wgmma128x192),
            (2048, 12288, TcKernel::Wgmma128x192),
            (4096, 12288, TcKernel::Wgmma128x192),
            (512, 4096, TcKernel::Wgmma128x128),
            (1024, 4096, TcKernel::Wgmma128x128),
            (512, 12288, TcKernel::Wgmma128x128),
            (1024, 12288, TcKernel::Wgmma128x128),
            (2048, 1024, TcKernel::Wgmma128x128),
        ] {
            assert_eq!(TcKernel::wgmma_tile(m, n), want, "M = {m}, N = {n}");
        }
    }

    /// A verify's 17-32 tokens take the 64-token wgmma phases where wgmma runs, as 33-64
    /// did (the LM head its 128x128 tiles); up to 16 tokens and without wgmma the choice
    /// by shape alone.
    #[test]
    fn verifies_take_wgmma_from_17_tokens() {
        for m in [17, 24, 32, 40, 48] {
            for n in [1024, 2048, 4096, 6144, 12288, 24576] {
                assert_eq!(TcKernel::picked(m, n, true), TcKernel::WgmmaPhases128x64, "M = {m}, N = {n}");
                assert_eq!(TcKernel::picked(m, n, false), TcKernel::for_shape(m, n), "M = {m}, N = {n}");
            }
            assert_eq!(TcKernel::picked(m, 151936, true), TcKernel::Wgmma128x128, "M = {m}");
        }
        for (m, n) in [(8, 24576), (16, 12288), (16, 151936), (1, 4096)] {
            assert_eq!(TcKernel::picked(m, n, true), TcKernel::for_shape(m, n), "M = {m}, N = {n}");
        }
        assert!(TcKernel::picked(24, 4096, false).tile().is_some() && TcKernel::Pass32.is_pass());
    }

    /// Every MLX word lands once, and where `linear_tcq`'s lane t reads block u of a chunk
    /// (its words together: whole chunks, and the partial last chunk of K = 96 and 160).
    #[test]
    fn repacked_codes_are_where_each_lane_reads_them() {
        for bits in [4, 8] {
            for cols in [96, 128, 160, 4096] {
                let (rows, words, lane_words) = (3, cols * bits / 32, bits / 4);
                let mlx: Vec<u8> = (0..(rows * words) as u32).flat_map(|i| i.to_le_bytes()).collect();
                let out: Vec<u32> = repack_codes(&mlx, cols, bits)
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let mut seen = out.clone();
                seen.sort_unstable();
                assert!(
                    seen.iter().copied().eq(0..(rows * words) as u32),
                    "{bits}-bit, K = {cols}: not a permutation"
                );
                for row in 0..rows {
                    for kc in (0..cols).step_by(128) {
                        let used = ((cols - kc) / 32).min(4);
                        for t in 0..4 {
                            let lane = row * words + kc / 32 * bits + t * used * lane_words;
                            for u in 0..used {
                                for v in 0..lane_words {
                                    let mlx_word = row * words + (kc / 32 + u) * bits + t * lane_words + v;
                                    assert_eq!(
                                        out[lane + u * lane_words + v],
                                        mlx_word as u32,
                                        "{bits}-bit, K = {cols}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
