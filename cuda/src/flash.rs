//! Attention on the tensor cores (`flash.cuh`): which layers take it, the tiles a batch gives
//! it, and its two launches. With bf16 activations and bf16 K/V (CUDA's defaults for 16-bit
//! checkpoints) every layer whose head shape fits takes it, in every forward; other layers
//! and modes keep the CUDA-core kernels. The choice follows the mode and the model's shape
//! alone, so each guarantee holds within a mode. On Hopper, launches whose tiles fill a
//! warpgroup at head size 128 (a prompt's) take `flash_attention_128_wg` (hopper.cu), the
//! same arithmetic by wgmma: which kernel runs never changes a query's bits.

use cudarc::driver::CudaSlice;

use super::{ptr, split_segments, AttentionKeys, Cuda};
use mtp_base::error::Result;
use mtp_kernels::{Activations, Heads, KvDtype};

/// Keys a chunk, chunks a segment, tokens a tile, warps a block (`FA_CHUNK`, `FA_SEG_CHUNKS`,
/// `FA_MAX_WARPS` in flash.cuh; the tile is the host's).
const CHUNK: usize = 64;
pub(super) const SEGMENT: usize = 8 * CHUNK;
const TILE: usize = 16;
const MAX_WARPS: usize = 8;
/// Head-size tiers, one kernel each: `flash_attention_{32, 64, 128}`.
pub(super) const TIERS: [usize; 3] = [32, 64, 128];

/// The rows of a batch, cut for the kernel: each run of consecutive tokens of one row in
/// pieces of at most [`TILE`] tokens, as (first token, count) pairs on the device.
pub(super) struct FlashTiles {
    pub(super) buf: CudaSlice<i32>,
    pub(super) count: usize,
    /// The most tokens a tile holds (sets the block's warps).
    pub(super) most: usize,
}

/// The (first token, count) pairs of `rows` (each token's row, in batch order), and the
/// most tokens a tile holds.
pub(super) fn tiles(rows: &[usize]) -> (Vec<i32>, usize) {
    let mut out = Vec::new();
    let mut most = 0;
    let mut t = 0;
    while t < rows.len() {
        let mut n = 1;
        while t + n < rows.len() && n < TILE && rows[t + n] == rows[t] {
            n += 1;
        }
        out.extend([t as i32, n as i32]);
        most = most.max(n);
        t += n;
    }
    (out, most)
}

/// The block's warps for tiles of at most `most` tokens and `per_kv` query heads a KV head
/// (16 query rows a warp; at least 4: a decode step's few rows need one, its K/V loads more
/// threads).
fn warps(most: usize, per_kv: usize) -> usize {
    (most * per_kv).div_ceil(16).clamp(4, MAX_WARPS)
}

/// Whether a launch of tiles of at most `most` tokens takes the wgmma kernel (where the GPU
/// has it): head size 128 (the full-width tier's), tiles of a prompt's run (16 tokens) whose
/// rows fill a warpgroup (64 of them). Decode and verify tiles keep mma.sync: most of a
/// warpgroup's rows would be padding.
pub(super) fn takes_wgmma(most: usize, heads: Heads) -> bool {
    let per_kv = heads.heads / heads.kv_heads.max(1);
    heads.head_dim == 128 && most == TILE && most * per_kv >= 64
}

/// The block's warps: [`warps`], whole warpgroups for the wgmma kernel.
fn block_warps(most: usize, per_kv: usize, wgmma: bool) -> usize {
    let w = warps(most, per_kv);
    if wgmma {
        w.next_multiple_of(4)
    } else {
        w
    }
}

/// The most tokens a launch's block is sized for, from its tiles' `most`: 8 (every tier's 4
/// warps at up to 8 query heads a KV head), 15, or a whole tile (16: a prompt's, which may take
/// wgmma). A warp's rows keep their bits whatever the block's other warps hold (a warp
/// without rows idles), so a CUDA graph recorded for one such batch serves all of its class
/// (a verify whose rows draft 0-7 tokens each, in any mix, or up to 14 with some 8 or more).
pub(super) fn launch_most(most: usize) -> usize {
    match most {
        0..=8 => 8,
        9..TILE => TILE - 1,
        _ => most,
    }
}

/// What a launch over tiles of at most `most` tokens depends on, for layers of `heads`: its
/// block's warps and whether it takes wgmma (where the GPU has it). At up to 4 query heads
/// a KV head, every tile of a decode or verify (up to 15 tokens) takes 4 warps.
pub(super) fn launch_class(most: usize, heads: Heads) -> (usize, bool) {
    let most = launch_most(most);
    let wgmma = takes_wgmma(most, heads);
    (block_warps(most, heads.heads / heads.kv_heads.max(1), wgmma), wgmma)
}

/// The kernel tier (index into [`TIERS`]) for `heads`, or `None` where the CUDA-core
/// kernels run: head size a multiple of 8 up to 128, at most 8 query heads per KV head.
pub(super) fn tier(heads: Heads) -> Option<usize> {
    let per_kv = heads.heads / heads.kv_heads.max(1);
    if heads.head_dim == 0 || !heads.head_dim.is_multiple_of(8) || per_kv == 0 || per_kv > MAX_WARPS {
        return None;
    }
    TIERS.iter().position(|&t| heads.head_dim <= t)
}

/// The tier a layer of shape `heads` takes the tensor-core attention with in `activations`
/// mode with `kv` K/V, or `None`: it keeps the CUDA-core kernels.
pub(super) fn pick(activations: Activations, kv: KvDtype, heads: Heads) -> Option<usize> {
    (activations == Activations::Bf16 && kv == KvDtype::Bf16).then(|| tier(heads)).flatten()
}

/// Dynamic shared memory of a block, as flash.cuh lays it out: two stages of a chunk's K and
/// V, the q tile (16 rows a warp), each lane's merged outputs, each warp's key range.
pub(super) fn smem_bytes(max_hd: usize, head_dim: usize, warps: usize) -> usize {
    let hdp = head_dim.next_multiple_of(16);
    2 * 2 * CHUNK * hdp * 2 + 16 * warps * hdp * 2 + warps * 32 * (max_hd / 2) * 4 + warps * 2 * 4
}

/// The most shared memory a tier's kernel asks for (every warp, the widest head).
pub(super) fn most_smem_bytes(max_hd: usize) -> usize {
    smem_bytes(max_hd, max_hd, MAX_WARPS)
}

impl Cuda {
    /// Tensor-core attention of `keys.tokens` queries over their rows' K/V by tier `tier`'s
    /// kernel (the wgmma one where [`takes_wgmma`] and the GPU has it, the full-width one
    /// where the head size is the tier's: the same bits): a block per (tile, KV head), or per
    /// (tile, KV head, segment) and the merge.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_flash(
        &self,
        tier: usize,
        q: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        toks: &CudaSlice<i32>,
        rows: &CudaSlice<i64>,
        tiles: &FlashTiles,
        li: i32,
        heads: Heads,
        scale: f32,
        keys: AttentionKeys,
    ) -> Result<()> {
        let max_hd = TIERS[tier];
        let wgmma = self.f.flash_wg.as_ref().filter(|_| takes_wgmma(tiles.most, heads));
        let f = wgmma.unwrap_or(&self.f.flash[tier][usize::from(heads.head_dim == max_hd)]);
        let s = &self.stream;
        let per_kv = heads.heads / heads.kv_heads;
        let warps = block_warps(launch_most(tiles.most), per_kv, wgmma.is_some());
        let smem = smem_bytes(max_hd, heads.head_dim, warps) as u32;
        let segs = split_segments(&keys, heads, SEGMENT, heads.kv_heads);
        let partial = self.attention_partials(&keys, heads, segs)?;
        let (qp, op, pp, tp, rp, tl) = (
            ptr(q, s),
            ptr(out, s),
            partial.as_ref().map_or(0, |p| ptr(p, s)),
            ptr(toks, s),
            ptr(rows, s),
            ptr(&tiles.buf, s),
        );
        let (nh, nkv, hd) = (heads.heads as i32, heads.kv_heads as i32, heads.head_dim as i32);
        let (splits, win) = (keys.splits, keys.window);
        let grid = (tiles.count as u32, (heads.kv_heads * segs.unwrap_or(1)) as u32);
        launch!(
            self,
            f,
            grid,
            (32 * warps) as u32,
            smem,
            "tensor-core attention",
            [qp, op, pp, tp, rp, tl, li, nh, nkv, hd, scale, splits, win]
        )?;
        let Some(segs) = segs else { return Ok(()) };
        let ms = segs as i32;
        launch!(
            self,
            &self.f.flash_merge,
            (keys.tokens as u32, heads.heads as u32),
            32,
            "tensor-core attention merge",
            [pp, op, nh, hd, ms]
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cut_runs_of_one_row_at_sixteen_tokens() {
        assert_eq!(tiles(&[]), (vec![], 0));
        assert_eq!(tiles(&[0, 1, 2]), (vec![0, 1, 1, 1, 2, 1], 1));
        let rows: Vec<usize> = [vec![0; 20], vec![1; 3], vec![0; 2]].concat();
        assert_eq!(tiles(&rows), (vec![0, 16, 16, 4, 20, 3, 23, 2], 16));
    }

    #[test]
    fn a_launch_has_warps_for_its_tiles_in_one_of_three_classes() {
        for per_kv in 1..=MAX_WARPS {
            for most in 1..=TILE {
                let w = warps(launch_most(most), per_kv);
                assert!(16 * w >= most * per_kv, "{most} tokens, {per_kv} heads: {w} warps");
                let h = Heads { heads: 8 * per_kv, kv_heads: 8, head_dim: 128 };
                assert_eq!(takes_wgmma(launch_most(most), h), takes_wgmma(most, h), "{most} tokens");
            }
        }
        let classes: std::collections::BTreeSet<usize> = (1..=TILE).map(launch_most).collect();
        assert_eq!(classes.into_iter().collect::<Vec<_>>(), [8, 15, 16]);
        // Control: sized by their own most, tiles of 9 and 15 tokens take different warps.
        assert_ne!(warps(9, MAX_WARPS), warps(15, MAX_WARPS));
    }

    #[test]
    fn verify_tiles_share_a_launch_class_at_four_query_heads_a_kv_head() {
        let h = |per_kv: usize| Heads { heads: 8 * per_kv, kv_heads: 8, head_dim: 128 };
        for per_kv in 1..=4 {
            assert!((1..TILE).all(|m| launch_class(m, h(per_kv)) == (4, false)), "{per_kv} heads a KV head");
            assert_eq!(launch_class(TILE, h(4)), (4, true), "a prompt's whole tiles: wgmma");
        }
        // Control: at 8 query heads a KV head, tiles of 9 tokens or more need more warps.
        assert_eq!(launch_class(8, h(8)), (4, false));
        assert_eq!(launch_class(9, h(8)), (8, false));
    }

    #[test]
    fn tiers_follow_the_head_shape() {
        let h = |heads, kv_heads, head_dim| Heads { heads, kv_heads, head_dim };
        assert_eq!(tier(h(32, 8, 128)), Some(2));
        assert_eq!(tier(h(4, 2, 24)), Some(0));
        assert_eq!(tier(h(6, 2, 64)), Some(1));
        assert_eq!(tier(h(2, 1, 136)), None, "past 128");
        assert_eq!(tier(h(8, 2, 12)), None, "not a multiple of 8");
        assert_eq!(tier(h(16, 1, 64)), None, "16 query heads per KV head");
        assert!(smem_bytes(128, 128, MAX_WARPS) <= 227 * 1024);
    }

    #[test]
    fn prompt_tiles_that_fill_a_warpgroup_take_wgmma() {
        let h = |heads, kv_heads, head_dim| Heads { heads, kv_heads, head_dim };
        assert!(takes_wgmma(TILE, h(32, 8, 128)), "a prompt of the 8B shape");
        assert!(takes_wgmma(TILE, h(12, 2, 128)));
        assert!(!takes_wgmma(TILE - 1, h(32, 8, 128)), "a verify's tiles");
        assert!(!takes_wgmma(TILE, h(16, 8, 128)), "32 rows a tile: half a warpgroup");
        assert!(!takes_wgmma(TILE, h(32, 8, 64)), "another tier");
        // Whole warpgroups: 6 query heads a KV head fill 6 warps, launched as 8.
        assert_eq!(block_warps(TILE, 6, true), 8);
        assert_eq!(block_warps(TILE, 6, false), 6);
        // Two blocks of a warpgroup fit an SM (228 KB, 1 KB of it reserved a block).
        assert!(2 * (smem_bytes(128, 128, 4) + 1024) <= 228 * 1024);
    }
}
