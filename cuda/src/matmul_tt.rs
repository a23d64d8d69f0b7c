//! The tiled tensor-core matmul for many tokens (`matmul_tt.cuh`): the activations split
//! once into bf16 planes (or, for wgmma, rounded in MMA-step order), the tile launches over
//! one weight or several, and the merges of phase-split launches' partials in phase order
//! (also SwiGLU's, and wgmma's phases).

use cudarc::driver::{CudaFunction, CudaSlice};
use mtp_base::error::{Error, Result};
use mtp_kernels::Out;

use crate::matmul::{CudaMat, LINEAR_THREADS};
use crate::matmul_tc::{activation_terms, TcKernel, TcParts, PARTS_TILES};
use crate::scratch::Scratch;
use crate::{ptr, Cuda};

/// `MergeParts` in matmul_tt.cuh: up to 3 phase launches' partials merged in one launch, part
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

impl Cuda {
    /// `m` x `k` f32 activations as the bf16 planes the tiles read: split exactly into three,
    /// or rounded into one (this instance's [`Activations`]).
    ///
    /// [`Activations`]: mtp_kernels::Activations
    pub(crate) fn split_activations(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        k: usize,
    ) -> Result<Scratch<'_, u16>> {
        let planes = activation_terms(self.activations);
        self.split_into(&self.f.split_activations, x, m, k, planes)
    }

    /// `m` x `k` f32 activations into `planes` bf16 planes of `m * k` by `f` (a
    /// `split_activations` kernel: x, n, out), in scratch of the pool ([`scratch`]).
    ///
    /// [`scratch`]: crate::scratch
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

    /// [`Kernels::linear_parts`] (1 to 3 parts, none empty) by one launch of a phase-split
    /// tile over activations already split, then each part's merge: each output as its own
    /// launch of `kernel` would write it.
    ///
    /// [`Kernels::linear_parts`]: mtp_kernels::Kernels::linear_parts
    pub(crate) fn linear_tile_parts(
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
    pub(crate) fn split_steps(&self, x: &CudaSlice<f32>, m: usize, k: usize) -> Result<Scratch<'_, u16>> {
        self.split_into(&self.f.split_activations_steps, x, m, k, 1)
    }

    /// [`Cuda::linear_tc_with`] by a tile kernel, over activations already split.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_tile(
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
    ///
    /// [`Cuda::swiglu`]: mtp_kernels::Kernels::swiglu
    pub(crate) fn merge_phases_swiglu(
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
}
