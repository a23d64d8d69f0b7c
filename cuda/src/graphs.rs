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

/// Forwards of more tokens than this run eagerly. 80 takes every verify of the default
/// batch (8 rows) at up to the most drafts adaptive k gives (8, 72 tokens), padded
/// ([`recorded_shape`]: 8 more rows of a token): a k=4 one (40 tokens)
/// replayed costs 9.7-10.0 ms against 10.6-11.2 launched (8B, H100,
/// docs/notes/cuda-speed-notes.md, v23); at 48 tokens the limit left 56-64-token verifies
/// 1.2 ms slower than 48-token ones (H200, v31). The phase-split tiles and wgmma take their
/// scratch (split activations, partials) from the backend's pool ([`super::scratch`]):
/// buffers that live as long as the backend, so the TMA descriptors recorded with their
/// addresses stay true.
pub(super) const MOST_RECORDED_TOKENS: usize = 80;
/// Recordings a model keeps, and the most bytes their outputs may hold (the least recently
/// replayed goes first). A recording costs 1.5-5 ms beyond its forward; unpadded, an 8B
/// B=8 bench met ~40 shapes (k's, rows ending, the drafts' spread over rows) and at 16
/// recordings each repeat of `mtp-bench` recorded its decode and verify shapes anew (H200,
/// notes v31); padded, the whole bench records 22 (notes v32).
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

/// Rows to a power of two and tokens to a multiple of the rows (8 from 8 rows on: an MMA's
/// token width, so a partial group costs a whole one anyway), after a token for each
/// padding row; a batch already so shaped as it is. The verifies of up to 8 rows drafting
/// up to 8 tokens each then take a few dozen shapes (8 and 16 rows, 8 to 80 tokens; 2 and
/// 4 rows for the tails) where the rows' own spread of drafts and the rows ending at
/// different rounds gave hundreds, each paying a first eager run and a recording. A single
/// row is never padded (its shapes are few: one a draft count).
fn padded(tokens: usize, rows: usize) -> Option<(usize, usize)> {
    let group = |r: usize| r.min(8);
    if rows == 0 || (rows.is_power_of_two() && tokens.is_multiple_of(group(rows))) {
        return Some((tokens, rows));
    }
    let r = rows.checked_add(1)?.checked_next_power_of_two()?;
    let t = tokens.checked_add(r - rows)?.checked_next_multiple_of(group(r))?;
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
    outs: Vec<CudaSlice<f32>>,
    last_used: u64,
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
            return cuda.outputs_to_host(&r.outs, fetch);
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
        let outs = out_lens.iter().map(|&n| cuda.alloc(n)).collect::<Result<Vec<_>>>()?;
        let started = std::time::Instant::now();
        let recorded = cuda.record(&batch, outs, body);
        let instantiated = started.elapsed();
        let (graph, outs) = match recorded {
            Ok(recorded) => recorded,
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
            "CUDA graph {} recorded for {shape:?} in {} us ({} us captured and instantiated; {} replays so far)",
            rec.recorded,
            started.elapsed().as_micros(),
            instantiated.as_micros(),
            rec.replayed
        );
        let host = cuda.outputs_to_host(&outs, fetch);
        let mut held: usize = rec.graphs.values().map(|r| out_bytes(&r.outs)).sum();
        let new_bytes = out_bytes(&outs);
        while rec.graphs.len() >= MOST_RECORDINGS
            || (!rec.graphs.is_empty() && held + new_bytes > MOST_RECORDED_BYTES)
        {
            let oldest = rec.graphs.iter().min_by_key(|(_, r)| r.last_used).map(|(s, _)| s.clone());
            if let Some(r) = oldest.and_then(|s| rec.graphs.remove(&s)) {
                held -= out_bytes(&r.outs);
            }
        }
        rec.graphs.insert(shape, Recording { graph, batch, outs, last_used: clock });
        host
    }
}

/// Bytes a recording's outputs hold (f32).
fn out_bytes(outs: &[CudaSlice<f32>]) -> usize {
    outs.iter().map(|o| o.len() * 4).sum()
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
        mut outs: Vec<CudaSlice<f32>>,
        body: &mut ForwardBody<'_, Cuda>,
    ) -> Result<(CudaGraph, Vec<CudaSlice<f32>>)> {
        let s = &self.stream;
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("begin graph capture"))?;
        self.scratch.set_capturing(true);
        let captured = body(batch, &mut outs);
        self.scratch.set_capturing(false);
        // The capture must end whether or not the body failed.
        let graph = s.end_capture(CUgraphInstantiate_flags(0)).map_err(driver("end graph capture"));
        captured?;
        let graph = graph?.ok_or_else(|| Error::Backend("CUDA graph capture recorded nothing".into()))?;
        Ok((graph, outs))
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
        for rows in 1..=16 {
            for tokens in rows..=9 * rows {
                let (t, r) = padded(tokens, rows).unwrap();
                assert!(r >= rows && r.is_power_of_two(), "{tokens} tokens, {rows} rows: {r} rows");
                let (pads, extra) = (r - rows, t - tokens);
                assert!(extra >= pads, "{tokens} tokens, {rows} rows: {extra} tokens for {pads} rows");
                // The first padding row takes what the others' one token each leaves.
                assert!(pads == 0 || extra - (pads - 1) <= 8, "{tokens} tokens, {rows} rows -> {t}, {r}");
                assert_eq!(padded(t, r), Some((t, r)), "a padded shape is its own padding");
            }
        }
    }

    #[test]
    fn decode_and_even_verifies_keep_their_shape() {
        for rows in [1usize, 2, 4, 8, 16] {
            for k in 0..=8 {
                let tokens = rows * (k + 1);
                if tokens.is_multiple_of(rows.min(8)) {
                    assert_eq!(padded(tokens, rows), Some((tokens, rows)));
                }
            }
        }
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
        // Control: unpadded, the same batches give hundreds.
        assert!(exact.len() > 250, "{} shapes", exact.len());
    }
}
