//! The CUDA-core attention (`attention.cuh`): the kernel for a head shape, the split into
//! a block per key segment where that pays (for both attention kernels), and the launch,
//! which hands bf16 layers to the tensor-core attention (`flash.rs`); and the assistant's
//! kernels ([`AssistantKernels`]: attention over the target's K/V, RoPE at given positions).

use cudarc::driver::CudaSlice;
use mtp_base::error::{Error, Result};
use mtp_cache::RowCache;
use mtp_kernels::{check_gpu_kv, held_keys, AssistantKernels, Heads, KeyRange, KvDtype, Plane};

use crate::scratch::Scratch;
use crate::{check_heads, flash, kv_index, ptr, Cuda, CudaKv, CudaRope};

/// Threads per block of attention: 8 warps per (token, head group), key chunks dealt by
/// position.
const ATTENTION_THREADS: u32 = 256;

/// One attention launch's queries and keys.
pub(crate) struct AttentionKeys {
    pub(crate) tokens: usize,
    /// The most keys any token reads (its position + 1).
    pub(crate) most: usize,
    /// Key segments per query under the split-attention negative control (else 1).
    pub(crate) splits: i32,
    /// Sliding window (0: none).
    pub(crate) window: i32,
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

/// Keys per attention segment (`ATT_SEG` in attention.cuh).
const ATTENTION_SEGMENT: usize = 512;

/// The segments (of `segment` keys) a block-per-segment launch would cover, when that
/// launch pays: few tokens over more than one segment (one block per (token, head) would
/// leave most of the GPU idle), at most 65,535 grid rows (`per_segment` a segment), its
/// scratch under 256 MiB. Either launch gives the same bits, so this choice may follow
/// the batch. For both attention kernels.
pub(crate) fn split_segments(
    keys: &AttentionKeys,
    heads: Heads,
    segment: usize,
    per_segment: usize,
) -> Option<usize> {
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
    /// A split attention launch's per-segment states for its merge ([`split_segments`]'s
    /// `segs`; none where it does not split).
    pub(crate) fn attention_partials(
        &self,
        keys: &AttentionKeys,
        heads: Heads,
        segs: Option<usize>,
    ) -> Result<Option<Scratch<'_, f32>>> {
        let len = |n: usize| keys.tokens * heads.heads * n * (heads.head_dim + 2);
        segs.map(|n| self.scratch_f32(len(n), keys.tokens, "attention partials")).transpose()
    }

    /// Attention of `keys.tokens` queries over their rows' K/V (`toks`, `rows`: the
    /// kernels' layout), by one block per (token, head) or, per [`split_segments`], a block
    /// per (token, head, segment) and the merge.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_attention(
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
