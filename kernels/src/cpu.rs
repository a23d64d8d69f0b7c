//! The reference backend: the row-invariant CPU kernels of [`crate::ops`] over f32
//! host buffers, K/V in a [`HostKv`] (f32 or bf16) or a [`QuantKv`] per row.

use std::sync::Arc;

use mtp_cache::{Bf16Kv, HostKv, KvStore, KvView, QuantKv, RowCache, SlotMap};
use rayon::prelude::*;

use mtp_base::error::{Error, Result};
use mtp_base::weights::{Weight, WeightDtype};

use crate::ops::{
    attend_heads, attend_rows, gelu_tanh_mul, linear, linear_bf16, rms_norm, rms_norm_inplace, swiglu,
    RopeTable,
};
use crate::{
    held_keys, open_windows, Activations, AssistantKernels, Backend, Heads, Kernels, KeyRange, KvDtype, Out,
    Plane, Slot,
};

/// The CPU kernel set; `activations` says how matmuls meet bf16 weights (resolved: `F32`
/// or `Bf16`).
#[derive(Clone, Copy, Debug)]
pub struct Cpu {
    activations: Activations,
}

impl Default for Cpu {
    fn default() -> Cpu {
        Cpu { activations: Activations::F32 }
    }
}

impl Cpu {
    /// The kernel set computing matmul activations as `activations` says. `Auto` is `Bf16`
    /// where this CPU computes the bf16 order natively (AVX512-BF16's `vdpbf16ps`, checked
    /// against the order written out), else `F32`: elsewhere the bf16 order's emulation costs
    /// more than f32 activations (docs/benchmarks.md, "Against llama.cpp").
    pub fn with_activations(activations: Activations) -> Cpu {
        let native = || crate::ops::bf16_matmul::path() == crate::ops::bf16_matmul::Path::Native;
        match activations {
            Activations::Bf16 => Cpu { activations },
            Activations::Auto if native() => Cpu { activations: Activations::Bf16 },
            Activations::Auto | Activations::F32 => Cpu::default(),
        }
    }
}

/// One CPU forward: every token's slot, every row's slot map.
pub struct CpuBatch {
    slots: Vec<Slot>,
    tokens: Vec<u32>,
    maps: Vec<SlotMap>,
    /// Each row's ring map, for rows with sliding-window layers.
    ring_maps: Vec<Option<SlotMap>>,
}

impl CpuBatch {
    /// Where `plane` of row `r` holds its positions and window.
    fn map(&self, r: usize, plane: Plane) -> Result<SlotMap> {
        match plane {
            Plane::Main(_) => Ok(self.maps[r]),
            Plane::Ring(_) => self.ring_maps[r].ok_or_else(|| Error::Request {
                request: format!("row {r}"),
                msg: "its cache has no sliding-window ring".into(),
            }),
        }
    }
}

/// Layer `plane` of row `r`'s host store, read through `map`.
fn view<'a>(cache: &'a RowCache, r: usize, plane: Plane, map: SlotMap) -> Result<KvView<'a>> {
    plane.store(cache).and_then(|s| KvView::of_store(s, plane.layer(), map)).ok_or_else(|| foreign(r))
}

fn foreign(row: usize) -> Error {
    Error::Request { request: format!("row {row}"), msg: "its KV cache belongs to another backend".into() }
}

impl Kernels for Cpu {
    type Act = Vec<f32>;
    type Mat = Weight;
    type Vec = Vec<f32>;
    type Rope = RopeTable;
    type Batch = CpuBatch;
    type Recordings = ();

    fn backend(&self) -> Backend {
        Backend::Cpu
    }

    fn activations(&self) -> Activations {
        self.activations
    }

    fn matrix(&self, w: &Weight) -> Result<Weight> {
        Ok(w.clone())
    }

    fn vector(&self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }

    fn rope_table(&self, table: RopeTable) -> Result<RopeTable> {
        Ok(table)
    }

    // The GPUs' rule: bf16 K/V for 16-bit checkpoints (half the bytes; attention widens
    // them as it loads, as fast as f32 K/V: docs/benchmarks.md, 2026-11-28 (session 32)).
    fn kv_dtype(&self, kv: KvDtype, weights: WeightDtype) -> Result<KvDtype> {
        crate::auto_kv_dtype(kv, weights)
    }

    fn kv_store(
        self: &Arc<Self>,
        n_layers: usize,
        heads: usize,
        head_dim: usize,
        kv: KvDtype,
    ) -> Box<dyn KvStore> {
        match (kv, kv.bits()) {
            (_, Some(bits)) => Box::new(QuantKv::new(n_layers, heads, head_dim, bits)),
            (KvDtype::Bf16, None) => Box::new(Bf16Kv::new(n_layers, heads * head_dim)),
            _ => Box::new(HostKv::<f32>::new(n_layers, heads * head_dim)),
        }
    }

    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn upload(&self, x: &[f32]) -> Result<Vec<f32>> {
        Ok(x.to_vec())
    }

    fn download(&self, x: Vec<f32>) -> Result<Vec<f32>> {
        Ok(x)
    }

    fn logit_summaries(
        &self,
        logits: &Vec<f32>,
        rows: usize,
        vocab: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        super::host_summaries(logits, rows, vocab, out)
    }

    fn batch(&self, slots: &[Slot], tokens: &[u32], caches: &mut [&mut RowCache]) -> Result<CpuBatch> {
        let maps = open_windows(slots, caches)?;
        Ok(CpuBatch {
            slots: slots.to_vec(),
            tokens: tokens.to_vec(),
            maps,
            ring_maps: caches.iter().map(|c| c.ring_map()).collect(),
        })
    }

    fn embed(&self, table: &Weight, tokens: &[u32], out: &mut Vec<f32>) -> Result<()> {
        for (o, &t) in out.chunks_mut(table.cols).zip(tokens) {
            table.row_f32(t as usize, o);
        }
        Ok(())
    }

    fn embed_batch(&self, table: &Weight, batch: &CpuBatch, out: &mut Vec<f32>) -> Result<()> {
        self.embed(table, &batch.tokens, out)
    }

    fn linear(
        &self,
        x: &Vec<f32>,
        m: usize,
        w: &Weight,
        bias: Option<&Vec<f32>>,
        out: &mut Vec<f32>,
        mode: Out,
    ) -> Result<()> {
        let matmul = match self.activations.for_weight(w) {
            Activations::Bf16 => linear_bf16,
            _ => linear,
        };
        match mode {
            Out::Write => matmul(x, m, w, bias.map(|b| b.as_slice()), out),
            Out::Add => {
                let mut y = vec![0.0f32; m * w.rows];
                matmul(x, m, w, bias.map(|b| b.as_slice()), &mut y);
                for (a, b) in out.iter_mut().zip(&y) {
                    *a += b;
                }
            }
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        eps: f32,
        out: &mut Vec<f32>,
        out_width: usize,
        col: usize,
    ) -> Result<()> {
        let n = w.len();
        if out_width == n {
            rms_norm(x, w, eps, out);
        } else {
            for (xr, or) in x.chunks(n).zip(out.chunks_mut(out_width)) {
                rms_norm(xr, w, eps, &mut or[col..col + n]);
            }
        }
        Ok(())
    }

    fn swiglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>) -> Result<()> {
        swiglu(gate, up);
        Ok(())
    }

    fn qk_rope_store(
        &self,
        q: &mut Vec<f32>,
        kv: Option<(&mut Vec<f32>, &Vec<f32>)>,
        norms: Option<(&Vec<f32>, &Vec<f32>, f32)>,
        rope: &RopeTable,
        batch: &CpuBatch,
        caches: &mut [&mut RowCache],
        plane: Plane,
        heads: Heads,
    ) -> Result<()> {
        let mut kv = kv;
        if let Some((qn, kn, eps)) = norms {
            rms_norm_inplace(q, qn, eps);
            if let Some((k, _)) = kv.as_mut() {
                rms_norm_inplace(k, kn, eps);
            }
        }
        let (qd, kvd) = (heads.heads * heads.head_dim, heads.kv_heads * heads.head_dim);
        for (i, s) in batch.slots.iter().enumerate() {
            rope.apply(&mut q[i * qd..(i + 1) * qd], s.rope_pos);
        }
        let Some((k, v)) = kv else { return Ok(()) };
        for (i, s) in batch.slots.iter().enumerate() {
            rope.apply(&mut k[i * kvd..(i + 1) * kvd], s.rope_pos);
        }
        let mut off = 0;
        for (r, cache) in caches.iter_mut().enumerate() {
            let (t, base) = (cache.window_len(), batch.map(r, plane)?.base);
            let (kw, vw) = (&k[off * kvd..(off + t) * kvd], &v[off * kvd..(off + t) * kvd]);
            let layer = plane.layer();
            let store = plane.store_mut(cache).ok_or_else(|| foreign(r))?.as_any_mut();
            if let Some(host) = store.downcast_mut::<HostKv>() {
                host.write(layer, base, kw, vw);
            } else if let Some(host) = store.downcast_mut::<Bf16Kv>() {
                host.write(layer, base, kw, vw);
            } else {
                let quant = store.downcast_mut::<QuantKv>().ok_or_else(|| foreign(r))?;
                quant.write(layer, base, kw, vw);
            }
            off += t;
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        batch: &CpuBatch,
        caches: &[&mut RowCache],
        plane: Plane,
        heads: Heads,
        scale: f32,
        window: Option<usize>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let (nh, nkv, hd) = (heads.heads, heads.kv_heads, heads.head_dim);
        let views = caches
            .iter()
            .enumerate()
            .map(|(r, c)| view(c, r, plane, batch.map(r, plane)?))
            .collect::<Result<Vec<KvView>>>()?;
        let slots = &batch.slots;
        // One task per KV head and token, or per KV head and a run of a row's consecutive
        // tokens with up to 16 query rows (tokens x query heads) in all: `attend_rows`
        // reads a prompt's K/V rows once for all of them, and a single decode token still
        // uses every core. Tasks go KV head by KV head, so a thread's next task reads the
        // K/V its last one left in cache.
        let g = nh / nkv;
        let per_task = (16 / g).max(1);
        let mut chunks: Vec<Option<&mut [f32]>> = out.chunks_mut(g * hd).map(Some).collect();
        let mut tasks = Vec::new();
        for kv_head in 0..nkv {
            let mut t = 0;
            while t < slots.len() {
                let mut n = 1;
                while n < per_task && t + n < slots.len() && slots[t + n].row == slots[t].row {
                    n += 1;
                }
                // Each (token, KV head) output is taken once: by its KV head's run.
                let outs: Vec<&mut [f32]> =
                    (t..t + n).filter_map(|u| chunks[u * nkv + kv_head].take()).collect();
                debug_assert_eq!(outs.len(), n);
                tasks.push((kv_head, t, outs));
                t += n;
            }
        }
        let keys = |u: usize| {
            let end = slots[u].pos + 1;
            (window.map_or(0, |w| end.saturating_sub(w)), end)
        };
        tasks.into_par_iter().for_each(|(kv_head, t, mut outs)| {
            let (view, qs) = (&views[slots[t].row], |u: usize| &q[(u * nkv + kv_head) * g * hd..][..g * hd]);
            if let [o] = &mut outs[..] {
                let (first, end) = keys(t);
                return attend_heads(qs(t), hd, view, first, end, kv_head * hd, scale, o);
            }
            let n = outs.len();
            let rows: Vec<f32> = (t..t + n).flat_map(|u| qs(u).iter().copied()).collect();
            let ranges: Vec<(usize, usize)> =
                (t..t + n).flat_map(|u| std::iter::repeat_n(keys(u), g)).collect();
            let mut o = vec![0.0; n * g * hd];
            attend_rows(&rows, hd, view, &ranges, kv_head * hd, scale, &mut o);
            for (dst, src) in outs.iter_mut().zip(o.chunks(g * hd)) {
                dst.copy_from_slice(src);
            }
        });
        Ok(())
    }

    fn gather(&self, x: &Vec<f32>, width: usize, rows: &[usize]) -> Result<Vec<f32>> {
        Ok(rows.iter().flat_map(|&i| x[i * width..(i + 1) * width].iter().copied()).collect())
    }

    fn add_parts(&self, x: &mut Vec<f32>, parts: &Vec<f32>, n: usize, reversed: bool) -> Result<()> {
        let len = x.len();
        if parts.len() != n * len {
            return Err(Error::Backend(format!("add_parts: {n} parts of {len} in {} values", parts.len())));
        }
        let order: Vec<usize> = if reversed { (0..n).rev().collect() } else { (0..n).collect() };
        let add = |(i, x): (usize, &mut f32)| order.iter().for_each(|&r| *x += parts[r * len + i]);
        // A decode step's few thousand values cost less than waking the pool.
        if n * len < 1 << 16 {
            x.iter_mut().enumerate().for_each(add);
        } else {
            x.par_iter_mut().enumerate().for_each(add);
        }
        Ok(())
    }

    fn concat_columns(
        &self,
        parts: &Vec<f32>,
        n: usize,
        width: usize,
        m: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        if parts.len() != n * m * width || out.len() != m * n * width {
            return Err(Error::Backend(format!(
                "concat_columns: {n} parts of {m} x {width} in {} values into {}",
                parts.len(),
                out.len()
            )));
        }
        for (t, row) in out.chunks_exact_mut((n * width).max(1)).enumerate() {
            for (r, dst) in row.chunks_exact_mut(width.max(1)).enumerate() {
                dst.copy_from_slice(&parts[(r * m + t) * width..(r * m + t + 1) * width]);
            }
        }
        Ok(())
    }

    fn gelu_tanh_mul(&self, gate: &mut Vec<f32>, up: &Vec<f32>) -> Result<()> {
        gelu_tanh_mul(gate, up);
        Ok(())
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32) -> Result<()> {
        x.iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<()> {
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn add_rows_scaled(
        &self,
        out: &mut Vec<f32>,
        width: usize,
        src: &Vec<f32>,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()> {
        for ((&r, &w), s) in rows.iter().zip(weights).zip(src.chunks(width)) {
            for (o, &v) in out[r * width..(r + 1) * width].iter_mut().zip(s) {
                *o += v * w;
            }
        }
        Ok(())
    }
}

impl AssistantKernels for Cpu {
    fn rope_at(
        &self,
        x: &mut Vec<f32>,
        width: usize,
        _head_dim: usize,
        positions: &[usize],
        rope: &RopeTable,
    ) -> Result<()> {
        for (row, &p) in x.chunks_mut(width).zip(positions) {
            rope.apply(row, p);
        }
        Ok(())
    }

    fn attention_over(
        &self,
        q: &Vec<f32>,
        keys: &[KeyRange],
        caches: &[&RowCache],
        plane: Plane,
        heads: Heads,
        scale: f32,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let (nh, nkv, hd) = (heads.heads, heads.kv_heads, heads.head_dim);
        let mut views = Vec::with_capacity(caches.len());
        for (r, (c, k)) in caches.iter().zip(keys).enumerate() {
            let map = held_keys(c, r, plane, *k)?;
            views.push(view(c, r, plane, map)?);
        }
        let g = nh / nkv;
        out.par_chunks_mut(g * hd).zip(q.par_chunks(g * hd)).enumerate().for_each(|(i, (o, qs))| {
            let (r, kv_head) = (i / nkv, i % nkv);
            attend_heads(qs, hd, &views[r], keys[r].first, keys[r].end, kv_head * hd, scale, o);
        });
        Ok(())
    }
}
