//! Attention on the tensor cores (`flash.cuh`): which layers take it, the tiles a batch gives
//! it, and its two launches. With bf16 activations and bf16 K/V (CUDA's defaults for 16-bit
//! checkpoints) every layer whose head shape fits takes it, in every forward; other layers
//! and modes keep the CUDA-core kernels. The choice follows the mode and the model's shape
//! alone, so each guarantee holds within a mode. On Hopper, launches whose tiles fill a
//! warpgroup at head size 128 (a prompt's) take `flash_attention_128_wg` (hopper.cu), the
//! same arithmetic by wgmma: which kernel runs never changes a query's bits.

use cudarc::driver::CudaSlice;

use super::attention::{split_segments, AttentionKeys};
use super::{ptr, Cuda};
use mtp_base::error::Result;
use mtp_kernels::{negative_control, Activations, Heads, KvDtype};

/// Keys a chunk, chunks a segment, tokens a tile, warps a block (`FA_CHUNK`, `FA_SEG_CHUNKS`,
/// `FA_MAX_WARPS` in flash.cuh; the tile is the host's).
const CHUNK: usize = 64;
pub(super) const SEGMENT: usize = 8 * CHUNK;
const TILE: usize = 16;
const MAX_WARPS: usize = 8;
/// Head-size tiers, one kernel each: `flash_attention_{32, 64, 128}`.
pub(super) const TIERS: [usize; 3] = [32, 64, 128];

/// Positions a K/V block holds (`KV_BLOCK` in forward.cuh).
const BLOCK: usize = 64;
/// A tile's segment end where it reads every segment.
const EVERY_SEGMENT: i32 = i32::MAX;

/// The rows of a batch, cut for the kernel: each run of consecutive tokens of one row in
/// pieces of at most [`TILE`] tokens, as (first token, count, first segment, segment end)
/// quads on the device (segments [0, i32::MAX) but where [`share`] says).
pub(super) struct FlashTiles {
    pub(super) buf: CudaSlice<i32>,
    pub(super) count: usize,
    /// The most tokens a tile holds (sets the block's warps).
    pub(super) most: usize,
}

/// The tile quads of `rows` (each token's row, in batch order), and the most tokens a tile
/// holds.
pub(super) fn tiles(rows: &[usize]) -> (Vec<i32>, usize) {
    let mut out = Vec::new();
    let mut most = 0;
    for (t0, n, _) in row_runs(rows) {
        most = most.max(n.min(TILE));
        cut(&mut out, t0, n, 0, EVERY_SEGMENT);
    }
    (out, most)
}

/// Each maximal run of consecutive tokens of one row: (first token, count, row).
fn row_runs(rows: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for (t, &r) in rows.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if run.2 == r => run.1 += 1,
            _ => runs.push((t, 1, r)),
        }
    }
    runs
}

/// Tokens [t0, t0 + n) as tiles of at most [`TILE`], each reading segments [lo, hi).
fn cut(out: &mut Vec<i32>, t0: usize, n: usize, lo: i32, hi: i32) {
    for t in (t0..t0 + n).step_by(TILE) {
        out.extend([t as i32, TILE.min(t0 + n - t) as i32, lo, hi]);
    }
}

/// What the sharing check knows of a row's K/V (its main store).
pub(super) struct HeldBlocks {
    /// The address of the pool its blocks lie in.
    pub(super) pool: i64,
    /// Its block table (pool indices, in logical order).
    pub(super) table: Vec<i32>,
    /// Positions committed: keys below it sit at their own slot, the rest in the open window.
    pub(super) committed: usize,
    /// Whether the store is a ring (slots wrap: never shared).
    pub(super) ring: bool,
}

/// Blocks two rows hold alike from position 0: the same pool blocks, each full of committed
/// keys in both. (A block's K/V is a pure function of the prefix it ends, so one block held
/// by two tables is the same keys for both.)
fn common_blocks(a: &HeldBlocks, b: &HeldBlocks) -> usize {
    if a.ring || b.ring || a.pool != b.pool {
        return 0;
    }
    let full = (a.committed.min(b.committed) / BLOCK).min(a.table.len()).min(b.table.len());
    if negative_control::share_by_length() {
        return full;
    }
    a.table.iter().zip(&b.table).take(full).take_while(|(x, y)| x == y).count()
}

/// The tiles of a batch in which adjacent rows share leading blocks.
pub(super) struct SharedTiles {
    /// Groups' tokens, up to [`TILE`] a tile, each over the group's shared segments.
    pub(super) shared: FlashTiles,
    /// The rows' own tiles (as [`tiles`] cuts them), a grouped row's from past its group's
    /// shared segments.
    pub(super) own: FlashTiles,
    /// The most shared segments of a group: the shared launch's grid and its states' stride.
    pub(super) segments: usize,
}

/// Groups the adjacent rows of a batch (`rows`: each token's row; `held`: each row's blocks)
/// that hold the same blocks for at least one whole segment of keys: a group's first two
/// rows set its shared segments, later rows join while they share as many with its first.
/// Only decode and verify rows (fewer than [`TILE`] tokens) group: a prompt's chunk fills
/// whole tiles of its own, so a shared tile would read its keys no fewer times.
/// Returns the shared tiles' quads, the own tiles' quads (as [`tiles`] gives, with a grouped
/// row's first segment) and the most shared segments; `None` where no two rows share one.
pub(super) fn share(rows: &[usize], held: &[HeldBlocks]) -> Option<(Vec<i32>, Vec<i32>, usize)> {
    let runs = row_runs(rows);
    let (mut shared, mut own, mut most) = (Vec::new(), Vec::new(), 0);
    let mut i = 0;
    while i < runs.len() {
        let first = &held[runs[i].2];
        let (mut segs, mut j) = (0, i + 1);
        while let Some(&(_, n, r)) = runs.get(j).filter(|_| runs[i].1 < TILE) {
            if n >= TILE {
                break;
            }
            let common = common_blocks(first, &held[r]) * BLOCK / SEGMENT;
            if common == 0 || common < segs {
                break;
            }
            if segs == 0 {
                segs = common;
            }
            j += 1;
        }
        if segs > 0 {
            let (t0, last) = (runs[i].0, runs[j - 1]);
            cut(&mut shared, t0, last.0 + last.1 - t0, 0, segs as i32);
            most = most.max(segs);
        }
        for &(t0, n, _) in &runs[i..j] {
            cut(&mut own, t0, n, segs as i32, EVERY_SEGMENT);
        }
        i = j;
    }
    (most > 0).then_some((shared, own, most))
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
    /// (tile, KV head, segment) and the merge; where rows share leading blocks (`shared`),
    /// the shared tiles' split launch first, then the own tiles walking from past them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_flash(
        &self,
        tier: usize,
        q: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        toks: &CudaSlice<i32>,
        rows: &CudaSlice<i64>,
        tiles: &FlashTiles,
        shared: Option<&SharedTiles>,
        li: i32,
        heads: Heads,
        scale: f32,
        keys: AttentionKeys,
    ) -> Result<()> {
        let s = &self.stream;
        let launch =
            |tiles: &FlashTiles, partial: u64, states: u64, state_segs: usize, grid_segs: usize, out: u64| {
                let max_hd = TIERS[tier];
                let wgmma = self.f.flash_wg.as_ref().filter(|_| takes_wgmma(tiles.most, heads));
                let f = wgmma.unwrap_or(&self.f.flash[tier][usize::from(heads.head_dim == max_hd)]);
                let per_kv = heads.heads / heads.kv_heads;
                let warps = block_warps(launch_most(tiles.most), per_kv, wgmma.is_some());
                let smem = smem_bytes(max_hd, heads.head_dim, warps) as u32;
                let (qp, tp, rp, tl) = (ptr(q, s), ptr(toks, s), ptr(rows, s), ptr(&tiles.buf, s));
                let (nh, nkv, hd, ss) =
                    (heads.heads as i32, heads.kv_heads as i32, heads.head_dim as i32, state_segs as i32);
                let (splits, win) = (keys.splits, keys.window);
                let grid = (tiles.count as u32, (heads.kv_heads * grid_segs) as u32);
                launch!(
                    self,
                    f,
                    grid,
                    (32 * warps) as u32,
                    smem,
                    "tensor-core attention",
                    [qp, out, partial, tp, rp, tl, states, ss, li, nh, nkv, hd, scale, splits, win]
                )
            };
        let op = ptr(out, s);
        if let Some(sh) = shared {
            // The groups' shared segments, each query's states kept for its own tile's walk.
            let len = keys.tokens * heads.heads * sh.segments * (heads.head_dim + 2);
            let states = self.scratch_f32(len, keys.tokens, "shared attention states")?;
            let sp = ptr(&states, s);
            launch(&sh.shared, sp, 0, 0, sh.segments, 0)?;
            return launch(&sh.own, 0, sp, sh.segments, 1, op);
        }
        let segs = split_segments(&keys, heads, SEGMENT, heads.kv_heads);
        let partial = self.attention_partials(&keys, heads, segs)?;
        let pp = partial.as_ref().map_or(0, |p| ptr(p, s));
        launch(tiles, pp, 0, 0, segs.unwrap_or(1), op)?;
        let Some(segs) = segs else { return Ok(()) };
        let (nh, hd, ms) = (heads.heads as i32, heads.head_dim as i32, segs as i32);
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

    const M: i32 = i32::MAX;

    #[test]
    fn tiles_cut_runs_of_one_row_at_sixteen_tokens() {
        assert_eq!(tiles(&[]), (vec![], 0));
        assert_eq!(tiles(&[0, 1, 2]), (vec![0, 1, 0, M, 1, 1, 0, M, 2, 1, 0, M], 1));
        let rows: Vec<usize> = [vec![0; 20], vec![1; 3], vec![0; 2]].concat();
        assert_eq!(tiles(&rows), (vec![0, 16, 0, M, 16, 4, 0, M, 20, 3, 0, M, 23, 2, 0, M], 16));
    }

    fn held(table: &[i32], committed: usize) -> HeldBlocks {
        HeldBlocks { pool: 1, table: table.to_vec(), committed, ring: false }
    }

    #[test]
    fn adjacent_rows_holding_the_same_blocks_share_whole_segments() {
        // Rows 0-2 hold the same 9 blocks first (576 keys: one whole segment), row 3 its own.
        let prefix: Vec<i32> = (0..9).collect();
        let own = |r: i32| [prefix.clone(), vec![100 + r]].concat();
        let rows_held = [
            held(&own(0), 600),
            held(&own(1), 600),
            held(&own(2), 600),
            held(&(50..60).collect::<Vec<_>>(), 600),
        ];
        // Decode rows, row 1 verifying three tokens.
        let rows = [0, 1, 1, 1, 2, 3];
        let (shared, own_tiles, segs) = share(&rows, &rows_held).unwrap();
        assert_eq!(segs, 1);
        assert_eq!(shared, [0, 5, 0, 1], "rows 0-2's five tokens in one tile over segment 0");
        assert_eq!(
            own_tiles,
            [0, 1, 1, M, 1, 3, 1, M, 4, 1, 1, M, 5, 1, 0, M],
            "grouped rows walk from segment 1"
        );
        let firsts = |q: &[i32]| q.chunks(4).map(|t| (t[0], t[1])).collect::<Vec<_>>();
        assert_eq!(firsts(&own_tiles), firsts(&tiles(&rows).0), "own tiles are cut as the plain ones");
        // Control: by committed length alone, row 3 joins the group.
        negative_control::set_share_by_length(true);
        let by_length = share(&rows, &rows_held).unwrap().0;
        negative_control::set_share_by_length(false);
        assert_eq!(by_length, [0, 6, 0, 1]);
        // Twenty decode rows sharing: tiles of at most sixteen tokens.
        let many: Vec<HeldBlocks> = (0..20).map(|r| held(&own(r), 600)).collect();
        let rows: Vec<usize> = (0..20).collect();
        assert_eq!(share(&rows, &many).unwrap().0, [0, 16, 0, 1, 16, 4, 0, 1]);
        // A prompt's chunk (16 tokens or more) between them stays out of the groups.
        let rows: Vec<usize> = [vec![0, 1], vec![2; 16], vec![3, 4]].concat();
        let (shared, own_tiles, _) = share(&rows, &many).unwrap();
        assert_eq!(shared, [0, 2, 0, 1, 18, 2, 0, 1]);
        assert_eq!(own_tiles[8..12], [2, 16, 0, M], "the chunk reads every segment itself");
    }

    #[test]
    fn rows_share_only_whole_segments_of_committed_blocks_in_one_pool() {
        let t: Vec<i32> = (0..16).collect();
        assert!(share(&[0, 1], &[held(&t, 511), held(&t, 1024)]).is_none(), "511 keys: no whole segment");
        assert_eq!(share(&[0, 1], &[held(&t, 1024), held(&t, 1024)]).unwrap().2, 2);
        let mut other_pool = held(&t, 1024);
        other_pool.pool = 2;
        assert!(share(&[0, 1], &[held(&t, 1024), other_pool]).is_none());
        let mut ring = held(&t, 1024);
        ring.ring = true;
        assert!(share(&[0, 1], &[held(&t, 1024), ring]).is_none());
        assert!(share(&[0], &[held(&t, 1024)]).is_none(), "a row alone shares nothing");
        // Rows 0 and 1 share two segments; row 2 only one with row 0, so it starts a group
        // with row 3 (one segment between them).
        let two: Vec<i32> = (0..8).chain(200..208).collect();
        let three: Vec<i32> = (0..8).chain(300..308).collect();
        let four = [held(&t, 1024), held(&t, 1024), held(&two, 1024), held(&three, 1024)];
        let (shared, own, segs) = share(&[0, 1, 2, 3], &four).unwrap();
        assert_eq!((shared, segs), (vec![0, 2, 0, 2, 2, 2, 0, 1], 2));
        assert_eq!(own, [0, 1, 2, M, 1, 1, 2, M, 2, 1, 1, M, 3, 1, 1, M]);
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
