//! The tensor-core matmul for bf16 weights: its kernels ([`TcKernel`]: the passes of
//! `matmul_tc.cuh`, the tiles of `matmul_tt.cuh`, wgmma in `hopper.cu`), the choice among
//! them by shape (every one sums each output in the same order, so the choice changes the
//! speed, never the bits), and the pass kernels' launches: one weight
//! ([`Cuda::linear_tc_with`]), or up to 3 in one launch (`TcParts`).

use cudarc::driver::CudaSlice;
use mtp_base::error::{Error, Result};
use mtp_kernels::{negative_control, Activations, Out};

use crate::matmul::{tensor_core_path, CudaMat, LINEAR_TC_COLS_PER_BLOCK, LINEAR_THREADS};
use crate::{ptr, Cuda};

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
pub(crate) fn wide_pass(m: usize, groups: usize) -> bool {
    (4..=16).contains(&m) && groups.div_ceil(TcKernel::Pass8Wide.groups_per_block()) >= 4 * GRID_SMS
}

/// The H100's SMs, by which the kernel choice judges a grid (a block alone on an SM waits
/// on its loads: two an SM is the least that keeps one busy).
pub(crate) const GRID_SMS: usize = 132;

/// A tile kernel's shape: output columns and tokens per block, stages of loads in
/// flight (the shared memory it takes), and whether its K walk is phase-split.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    pub(crate) cols: usize,
    pub(crate) toks: usize,
    pub(crate) stages: usize,
    pub(crate) phased: bool,
}

impl Tile {
    /// matmul_tt.cuh's linear_tt_impl: per stage, 32 k of COLS weight rows and of `terms` TOKS
    /// activation rows (one bf16 plane a term), 2 bytes each.
    pub(crate) fn smem_bytes(self, terms: usize) -> u32 {
        (self.stages * (self.cols + terms * self.toks) * 64) as u32
    }
}

/// bf16 planes a tensor-core matmul takes of each activation: 1 (rounded) or 3 (exact).
pub(crate) fn activation_terms(a: Activations) -> usize {
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
    pub(crate) fn groups_per_block(self) -> usize {
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
    pub(crate) fn tile(self) -> Option<(usize, Tile)> {
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
pub(crate) const PARTS_TILES: [TcKernel; 3] =
    [TcKernel::Phases128x32, TcKernel::Phases128x64, TcKernel::Phases128x48];

/// `TcParts` in matmul_tc.cuh: up to 3 weights of one multi-weight matmul launch (a
/// phase-split tile launch writes each part's partials where `out` points, biases unused).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct TcParts {
    pub(crate) w: [u64; 3],
    pub(crate) bias: [u64; 3],
    pub(crate) out: [u64; 3],
    pub(crate) n: [i32; 3],
    pub(crate) first_block: [i32; 3],
    pub(crate) parts: i32,
}

// SAFETY: plain old data laid out as the kernel's struct (repr(C), the same field types).
unsafe impl cudarc::driver::DeviceRepr for TcParts {}

impl Cuda {
    /// `out` (+)= `x` (M rows) times `w`'s transpose by one tensor-core kernel: what
    /// [`Kernels::linear`] does for a bf16 weight with K % 32 == 0 (it picks the kernel by
    /// [`Cuda::pick`]), open to benchmarks and tests of each kernel.
    ///
    /// [`Kernels::linear`]: mtp_kernels::Kernels::linear
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
    ///
    /// [`Kernels::linear_parts`]: mtp_kernels::Kernels::linear_parts
    pub(crate) fn parts_pass(
        &self,
        m: usize,
        parts: &[(&CudaMat, Option<&CudaSlice<f32>>)],
    ) -> Option<usize> {
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
    ///
    /// [`Kernels::linear`]: mtp_kernels::Kernels::linear
    pub fn pick(&self, m: usize, n: usize, k: usize) -> TcKernel {
        TcKernel::picked(m, n, self.runs(TcKernel::WgmmaPhases128x64, k))
    }

    /// The phase-split wgmma kernel SwiGLU's gate and up both take at M tokens (one shape,
    /// bf16 weights on the tensor cores), where their merges can go with SwiGLU's.
    pub(crate) fn phased_wgmma_pair(&self, m: usize, gate: &CudaMat, up: &CudaMat) -> Option<TcKernel> {
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
}

#[cfg(test)]
mod tests {
    use super::{wide_pass, TcKernel};

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
}
