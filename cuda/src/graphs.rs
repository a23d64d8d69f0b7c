//! Decode and verify forwards recorded as CUDA graphs. A B=1 decode step of a small model is
//! ~340 short kernels: launching them one by one from the host costs more than running
//! them. [`CudaGraphs::run`] records a forward's launches once per shape
//! (token count, row count, attention segments, outputs) and replays them, after copying
//! the step's tables (tokens, positions, K/V addresses) into the buffers the recording
//! reads. The replay runs the recorded kernels with the recorded arguments in the
//! recorded order, so every row gets the eager forward's bits. A batch is recorded padded
//! ([`recorded_shape`]: rows to a power of two, tokens to a multiple of them), so a few
//! recordings serve every mix of drafts and rows.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};

use super::{driver, flash, Cuda, CudaBatch};
use mtp_base::error::{Error, Result};
use mtp_kernels::negative_control;
use mtp_kernels::{run_body, ForwardBody, Heads, Kernels};

/// Forwards of more tokens than this run eagerly. 320 takes every decode step up to 320
/// rows (the server's batch buckets) and the verifies of 64 rows at up to k = 4: launched
/// one by one, a 64-row 8B decode step costs 1.2 ms more than replayed (9.99 against 8.81
/// ms), a 128-row one 1.4 ms (13.7 against 12.3), a 64-row k=4 verify 0.5 ms (H100, notes
/// v37, v38). Past it a forward's kernels hide their launches: 100-row k=4 verifies (~500
/// tokens) ran 22.0 ms replayed or not, and recording shapes there only cost (a 128-row
/// k=4 bench, 512 recorded, ran 4% slower, its late rounds' shapes recorded once each).
/// Up to 80 tokens it took every verify
/// of 8 rows at up to the most drafts adaptive k gives, padded (v31, v32); a k=4 one (40
/// tokens) replayed costs 9.7-10.0 ms against 10.6-11.2 launched (8B, H100, v23). The
/// phase-split tiles and wgmma take their scratch (split activations, partials) from the
/// backend's pool ([`super::scratch`]): buffers that live as long as the backend, so the
/// TMA descriptors recorded with their addresses stay true.
pub(super) const MOST_RECORDED_TOKENS: usize = 320;
/// Recordings a model keeps, and the most bytes their output sets may hold (the least
/// recently replayed goes first). A recording costs 1.5-5 ms beyond its forward; unpadded,
/// an 8B B=8 bench met ~40 shapes (k's, rows ending, the drafts' spread over rows) and at 16
/// recordings each repeat of `mtp-bench` recorded its decode and verify shapes anew (H200,
/// notes v31); padded, the whole bench records 22 (notes v32). Recordings share their
/// output buffers ([`OutSet`]), so the bytes bound a set's size, not a count of shapes: a
/// 64-row verify's logits are ~200 MB on the 8B shape, and ten of them to a bound would
/// have evicted each other under adaptive k's spread of shapes.
const MOST_RECORDINGS: usize = 64;
const MOST_RECORDED_BYTES: usize = 2 << 30;

/// The shape [`Kernels::recorded_shape`] gives a recorded forward of `tokens` over `rows`
/// rows (exact where nothing would be recorded, or where padding would pass
/// [`MOST_RECORDED_TOKENS`]).
pub(super) fn recorded_shape(tokens: usize, rows: usize) -> (usize, usize) {
    let recorded = recording() && !negative_control::split_attention();
    match padded(tokens, rows) {
        Some((t, r)) if recorded && t <= MOST_RECORDED_TOKENS => (t, r),
        _ => (tokens, rows),
    }
}

/// Whether forwards are recorded: graphs on, and no negative control that uploads inside
/// the forward (the stock matmul's).
fn recording() -> bool {
    GRAPHS_ON.load(Ordering::Relaxed) && !negative_control::stock_matmul()
}

/// Under 8 rows, rows to a power of two and tokens to a multiple of the rows, after a token
/// for each padding row; from 8 rows on, rows to a multiple of 8 (or one more: the one
/// padding row that a batch already a multiple of 8 needs for its tokens) and tokens to a
/// multiple of 8 (an MMA's token width, so a partial group costs a whole one anyway). A
/// batch already so shaped is as it is. The verifies of up to 8 rows drafting up to 8 tokens
/// each then take a few dozen shapes where the rows' own spread of drafts and the rows
/// ending at different rounds gave hundreds, each paying a first eager run and a
/// recording; a batch of many rows pads at most 8 rows and 15 tokens (a power of two of
/// rows would cost 64 rows of tokens at 64 rows: past 128 tokens the matmul pays for
/// each). A single row is never padded (its shapes are few: one a draft count).
fn padded(tokens: usize, rows: usize) -> Option<(usize, usize)> {
    const GROUP: usize = 8;
    let r = if rows >= GROUP {
        if tokens.is_multiple_of(GROUP) && rows % GROUP <= 1 {
            return Some((tokens, rows));
        }
        match rows % GROUP {
            0 => rows.checked_add(1)?,
            _ => rows.checked_next_multiple_of(GROUP)?,
        }
    } else {
        let group = |r: usize| r.min(GROUP);
        if rows == 0 || (rows.is_power_of_two() && tokens.is_multiple_of(group(rows))) {
            return Some((tokens, rows));
        }
        rows.checked_add(1)?.checked_next_power_of_two()?
    };
    let t = tokens.checked_add(r - rows)?.checked_next_multiple_of(r.min(GROUP))?;
    Some((t, r))
}

/// Whether forwards are recorded (process-wide; on unless [`Cuda::set_graphs`] turned
/// them off).
static GRAPHS_ON: AtomicBool = AtomicBool::new(true);

/// What fixes a forward's launches and their arguments (the caller's promise in
/// [`Kernels::run_recorded`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Shape {
    tokens: usize,
    rows: usize,
    /// Attention's segments (512 keys, the tensor-core kernel's and the CUDA-core
    /// kernel's) for the most keys a token reads: the split launch's grid
    /// follows it.
    segments: usize,
    /// The tensor-core attention's tiles, and what its block depends on: the warps and
    /// kernel the most tokens a tile holds take ([`flash::launch_class`]), or that most
    /// ([`flash::launch_most`]) where the model's heads are not known.
    tiles: (usize, (usize, bool)),
    /// Where rows share leading blocks: the shared tiles' count and class, and the shared
    /// segments (the shared launch's grid).
    shared: Option<(usize, (usize, bool), usize)>,
    ring: bool,
    /// The K/V dtype (which attention and store kernels the recording launches).
    kv: mtp_kernels::KvDtype,
    out_lens: Vec<usize>,
}

struct Recording {
    graph: CudaGraph,
    /// The batch the graph was recorded with: its device tables are what the graph reads,
    /// refreshed before each replay.
    batch: CudaBatch,
    /// The [`OutSet`] the graph writes its outputs into.
    set: u64,
    last_used: u64,
}

/// Output buffers shared by the recordings that fit them. A replay's outputs are
/// downloaded before anything else runs (one stream, a synchronous download), and a
/// forward writes every output before reading it, so one set serves every recording
/// whose outputs are no longer than its buffers.
struct OutSet {
    id: u64,
    bufs: Vec<CudaSlice<f32>>,
}

impl OutSet {
    fn fits(&self, lens: &[usize]) -> bool {
        self.bufs.len() == lens.len() && self.bufs.iter().zip(lens).all(|(b, &n)| b.len() >= n.max(1))
    }

    fn bytes(&self) -> usize {
        self.bufs.iter().map(|b| b.len() * 4).sum()
    }
}

/// One model's recorded forwards ([`Kernels::Recordings`] on CUDA).
#[derive(Default)]
pub struct CudaGraphs {
    /// The model's attention heads, where known: its tensor-core attention's launch then
    /// keys a recording by the warps and kernel it takes, not by its tiles' most tokens.
    heads: Option<Heads>,
    inner: Mutex<Recorded>,
}

#[derive(Default)]
struct Recorded {
    graphs: HashMap<Shape, Recording>,
    /// The output sets some recording writes (the newest last).
    sets: Vec<OutSet>,
    next_set: u64,
    /// Shapes seen but not recorded: a shape is recorded the second time it runs.
    seen: HashMap<Shape, u32>,
    /// Shapes whose recording failed: they run eagerly.
    refused: Vec<Shape>,
    clock: u64,
    /// Graphs recorded and replays run (for the debug log).
    recorded: u64,
    replayed: u64,
    /// Forwards that ran a recordable shape eagerly for the first time or recorded it: each
    /// paid a one-time cost (no graph yet, or the capture), so its time says little about
    /// the shape's next run.
    one_time: u64,
}

// SAFETY: a recording's graph (raw driver handles) is only touched under the mutex, from
// one thread at a time, on the stream it was recorded on.
unsafe impl Send for Recording {}

impl CudaGraphs {
    /// The recordings of a model whose layers' attention has `heads`.
    pub(super) fn for_heads(heads: Heads) -> CudaGraphs {
        CudaGraphs { heads: Some(heads), ..CudaGraphs::default() }
    }

    /// [`Kernels::run_recorded`] on `cuda`: eagerly the first time a shape
    /// runs, recorded the second, replayed after.
    pub(super) fn run(
        &self,
        cuda: &Cuda,
        batch: CudaBatch,
        out_lens: &[usize],
        fetch: &[usize],
        body: &mut ForwardBody<'_, Cuda>,
    ) -> Result<Vec<Vec<f32>>> {
        // The stock-matmul control uploads inside the forward; the split control sizes its
        // grid from the batch: neither is a fixed recording.
        let recordable = recording() && batch.m <= MOST_RECORDED_TOKENS && batch.splits == 1;
        if !recordable {
            return run_body(cuda, batch, out_lens, fetch, body);
        }
        let class = |most: usize| match self.heads {
            Some(heads) => flash::launch_class(most, heads),
            None => (flash::launch_most(most), false),
        };
        let shape = Shape {
            tokens: batch.m,
            rows: batch.rows.len() / super::ROW_FIELDS,
            segments: batch.most_keys.div_ceil(flash::SEGMENT),
            tiles: (batch.tiles.count, class(batch.tiles.most)),
            shared: batch.shared.as_ref().map(|sh| (sh.shared.count, class(sh.shared.most), sh.segments)),
            ring: batch.ring_rows.is_some(),
            kv: batch.kv,
            out_lens: out_lens.to_vec(),
        };
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let rec = &mut *guard;
        rec.clock += 1;
        let clock = rec.clock;
        if let Some(r) = rec.graphs.get_mut(&shape) {
            r.last_used = clock;
            rec.replayed += 1;
            if !negative_control::stale_replay() {
                cuda.refresh_tables(&mut r.batch, &batch)?;
            }
            r.graph.launch().map_err(driver("graph replay"))?;
            let (set, sets) = (r.set, &rec.sets);
            let outs = sets.iter().find(|o| o.id == set).ok_or_else(|| lost_set(&shape))?;
            return cuda.outputs_to_host(&outs.bufs, fetch);
        }
        if rec.refused.contains(&shape) {
            drop(guard);
            return run_body(cuda, batch, out_lens, fetch, body);
        }
        if rec.seen.len() > 4096 {
            rec.seen.clear();
        }
        let sightings = rec.seen.entry(shape.clone()).or_insert(0);
        *sightings += 1;
        rec.one_time += 1;
        if *sightings < 2 {
            drop(guard);
            return run_body(cuda, batch, out_lens, fetch, body);
        }
        rec.seen.remove(&shape);
        let set = rec.set_for(cuda, out_lens)?;
        let at = rec.sets.iter().position(|o| o.id == set).ok_or_else(|| lost_set(&shape))?;
        let started = std::time::Instant::now();
        let recorded = cuda.record(&batch, &mut rec.sets[at].bufs, body);
        let instantiated = started.elapsed();
        let graph = match recorded {
            Ok(graph) => graph,
            Err(e) => {
                tracing::warn!("CUDA graph of a {shape:?} forward not recorded ({e}); it runs eagerly");
                rec.refused.push(shape);
                drop(guard);
                return run_body(cuda, batch, out_lens, fetch, body);
            }
        };
        // Recording only records: this launch runs the step.
        graph.launch().map_err(driver("graph launch"))?;
        rec.recorded += 1;
        tracing::debug!(
            "CUDA graph {} recorded for {shape:?} in {} us ({} us captured and instantiated; {} replays so far; {} MB of output sets)",
            rec.recorded,
            started.elapsed().as_micros(),
            instantiated.as_micros(),
            rec.replayed,
            rec.sets.iter().map(OutSet::bytes).sum::<usize>() >> 20
        );
        let host = cuda.outputs_to_host(&rec.sets[at].bufs, fetch);
        rec.graphs.insert(shape, Recording { graph, batch, set, last_used: clock });
        host
    }
}

impl Recorded {
    /// The output set a new recording with outputs `lens` writes: the newest that fits, or a
    /// new one (half as large again as the newest, or `lens` where that is more), after
    /// room is made (recordings over [`MOST_RECORDINGS`], or sets over
    /// [`MOST_RECORDED_BYTES`], go least recently replayed first; a set goes with its last
    /// recording).
    fn set_for(&mut self, cuda: &Cuda, lens: &[usize]) -> Result<u64> {
        let fitting = self.sets.iter().rev().find(|o| o.fits(lens)).map(|o| o.id);
        let newest = self.sets.iter().rev().find(|o| o.bufs.len() == lens.len());
        let grown: Vec<usize> = match newest {
            Some(o) => o.bufs.iter().zip(lens).map(|(b, &n)| n.max(b.len() + b.len() / 2)).collect(),
            None => lens.to_vec(),
        };
        let new_bytes = if fitting.is_some() { 0 } else { grown.iter().map(|&n| n.max(1) * 4).sum() };
        loop {
            let held: usize = self.sets.iter().map(OutSet::bytes).sum();
            if self.graphs.is_empty()
                || (self.graphs.len() < MOST_RECORDINGS && held + new_bytes <= MOST_RECORDED_BYTES)
            {
                break;
            }
            let oldest = self.graphs.iter().min_by_key(|(_, r)| r.last_used).map(|(s, _)| s.clone());
            if let Some(gone) = oldest.and_then(|s| self.graphs.remove(&s)) {
                if fitting != Some(gone.set) && !self.graphs.values().any(|r| r.set == gone.set) {
                    self.sets.retain(|o| o.id != gone.set);
                }
            }
        }
        if let Some(id) = fitting {
            return Ok(id);
        }
        let bufs = grown.iter().map(|&n| cuda.alloc(n)).collect::<Result<Vec<_>>>()?;
        self.next_set += 1;
        self.sets.push(OutSet { id: self.next_set, bufs });
        Ok(self.next_set)
    }
}

/// A recording whose output set is gone (a bug: sets go only with their last recording).
fn lost_set(shape: &Shape) -> Error {
    Error::Backend(format!("the CUDA graph of a {shape:?} forward lost its outputs"))
}

impl CudaGraphs {
    /// Forwards so far that paid a one-time cost: a recordable shape's first (eager) run
    /// or its recording.
    pub(super) fn one_time_forwards(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).one_time
    }
}

impl Cuda {
    /// Turns recording and replay of decode and verify forwards on (the default) or off
    /// (every kernel launched from the host each step: for comparisons). A recording
    /// captures its GPU's one stream, which every model on that GPU shares, so while graphs
    /// are on, forwards on one GPU must come from one thread at a time (as in the CLI, the
    /// server's engine thread and the tensor-parallel ranks, one thread a GPU); a program
    /// running models on several threads at once turns them off.
    pub fn set_graphs(on: bool) {
        GRAPHS_ON.store(on, Ordering::Relaxed);
    }

    /// Captures `body` on the stream (nothing runs) into an instantiated graph.
    fn record(
        &self,
        batch: &CudaBatch,
        outs: &mut [CudaSlice<f32>],
        body: &mut ForwardBody<'_, Cuda>,
    ) -> Result<CudaGraph> {
        let s = &self.stream;
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("begin graph capture"))?;
        self.scratch.set_capturing(true);
        let captured = body(batch, outs);
        self.scratch.set_capturing(false);
        // The capture must end whether or not the body failed.
        let graph = s.end_capture(CUgraphInstantiate_flags(0)).map_err(driver("end graph capture"));
        captured?;
        graph?.ok_or_else(|| Error::Backend("CUDA graph capture recorded nothing".into()))
    }

    /// The first `fetch[i]` values of each recorded output `i` in host memory.
    fn outputs_to_host(&self, outs: &[CudaSlice<f32>], fetch: &[usize]) -> Result<Vec<Vec<f32>>> {
        mtp_kernels::fetched(outs, fetch, |o, n| self.first_to_host(o, n))
    }

    /// Copies `step`'s tables into the recorded batch's buffers (same lengths: same shape),
    /// on the stream, before the replay that reads them.
    fn refresh_tables(&self, recorded: &mut CudaBatch, step: &CudaBatch) -> Result<()> {
        let s = &self.stream;
        s.memcpy_dtod(&step.toks, &mut recorded.toks).map_err(driver("graph tables"))?;
        s.memcpy_dtod(&step.rows, &mut recorded.rows).map_err(driver("graph tables"))?;
        s.memcpy_dtod(&step.tokens, &mut recorded.tokens).map_err(driver("graph tables"))?;
        s.memcpy_dtod(&step.tiles.buf, &mut recorded.tiles.buf).map_err(driver("graph tables"))?;
        if let (Some(dst), Some(src)) = (recorded.shared.as_mut(), step.shared.as_ref()) {
            s.memcpy_dtod(&src.shared.buf, &mut dst.shared.buf).map_err(driver("graph tables"))?;
            s.memcpy_dtod(&src.own.buf, &mut dst.own.buf).map_err(driver("graph tables"))?;
        }
        if let (Some(dst), Some(src)) = (recorded.ring_rows.as_mut(), step.ring_rows.as_ref()) {
            s.memcpy_dtod(src, dst).map_err(driver("graph tables"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::padded;
    use std::collections::HashSet;

    #[test]
    fn padding_leaves_each_padding_row_a_token_and_the_first_at_most_eight() {
        for rows in (1..=40).chain([63, 64, 65, 100, 127, 128, 129, 255, 256]) {
            for tokens in rows..=9 * rows {
                let (t, r) = padded(tokens, rows).unwrap();
                let bucket = if r < 8 { r.is_power_of_two() } else { r % 8 <= 1 && t % 8 == 0 };
                assert!(r >= rows && bucket, "{tokens} tokens, {rows} rows: {t} tokens, {r} rows");
                let (pads, extra) = (r - rows, t - tokens);
                assert!(extra >= pads, "{tokens} tokens, {rows} rows: {extra} tokens for {pads} rows");
                // The first padding row takes what the others' one token each leaves.
                assert!(pads == 0 || extra - (pads - 1) <= 8, "{tokens} tokens, {rows} rows -> {t}, {r}");
                if rows >= 8 {
                    assert!(pads <= 8 && extra <= 15, "{tokens} tokens, {rows} rows -> {t}, {r}");
                }
                assert_eq!(padded(t, r), Some((t, r)), "a padded shape is its own padding");
            }
        }
    }

    #[test]
    fn decode_and_even_verifies_keep_their_shape() {
        for rows in [1usize, 2, 4, 8, 16, 64, 128, 256] {
            for k in 0..=8 {
                let tokens = rows * (k + 1);
                if tokens.is_multiple_of(rows.min(8)) {
                    assert_eq!(padded(tokens, rows), Some((tokens, rows)));
                }
            }
        }
        // A decode of 100 rows pads 4 (a power of two of rows would have padded 28).
        assert_eq!(padded(100, 100), Some((104, 104)));
        // A single row is never padded, whatever it drafts.
        assert!((1..=64).all(|t| padded(t, 1) == Some((t, 1))));
        assert_eq!(padded(0, 0), Some((0, 0)));
    }

    #[test]
    fn up_to_eight_rows_drafting_up_to_eight_take_a_few_dozen_shapes() {
        // Every (tokens, rows) a batch of 2-8 rows drafting 0-8 tokens each can give.
        let exact: HashSet<(usize, usize)> = (2..=8).flat_map(|r| (r..=9 * r).map(move |t| (t, r))).collect();
        let shapes: HashSet<(usize, usize)> = exact.iter().map(|&(t, r)| padded(t, r).unwrap()).collect();
        assert!(shapes.len() <= 40, "{} padded shapes", shapes.len());
        // And 64 rows drafting 0-7 each (adaptive k at batch): a shape every 8 tokens.
        let wide: HashSet<(usize, usize)> = (64..=512).map(|t| padded(t, 64).unwrap()).collect();
        assert!(wide.len() <= 2 * 57, "{} padded shapes", wide.len());
        // Control: unpadded, the same batches give hundreds.
        assert!(exact.len() > 250, "{} shapes", exact.len());
    }
}
