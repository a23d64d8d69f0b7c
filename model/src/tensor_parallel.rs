//! Tensor parallelism, Megatron-style: `N` ranks each hold a slice of every layer and run
//! the same forward side by side, one thread per rank in one process (a rank's device
//! is driven by its thread; the engine, the cache bookkeeping and the server stay single).
//!
//! - Attention: each rank holds `heads / N` query heads and `kv_heads / N` K/V heads
//!   (whole GQA groups), so attention never crosses ranks; q/k/v are cut by output rows,
//!   o by input columns. MLP: gate/up by rows, down by columns. The LM head and the
//!   embedding by vocabulary: each rank's logits are gathered side by side; each rank looks
//!   up the tokens it holds (zeros for the others) and the ranks' rows are summed.
//! - o and down give each rank a partial sum of the hidden state. [`Shard::reduce`]
//!   gathers every rank's partial and adds them to the residual **in rank order** on every
//!   rank: the order of a hidden element's additions is fixed by `N` alone, never by the
//!   token count or the message size (as an all-reduce that picks its algorithm by size
//!   would), so every row stays invariant within one rank count: batched == alone,
//!   speculative == plain, decode == prefill. Different rank counts add differently, as
//!   different backends do.
//! - A row's cache holds one K/V store per rank ([`mtp_cache::RankKv`]); its bookkeeping
//!   (length, window, rollback, compaction) is kept once and applied to every store.

use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use mtp_base::config::Config;
use mtp_base::error::{Error, Result};
use mtp_base::weights::Weight;
use mtp_base::Checkpoint;
use mtp_cache::RowCache;
use mtp_kernels::collective::{Collective, RankSync, ABORTED};
use mtp_kernels::negative_control::{self, Switches};
use mtp_kernels::{Activations, Backend, Kernels, KvDtype};

use crate::forward::{check_tokens, slots_for, Cut, Hidden, Logits, Net, RowInput, RowOutput};
use crate::mtp::{MtpInput, MtpLayout, MtpNet, MtpOutput};

/// Rank `rank` of `ranks`, with the collective its forward exchanges partials through.
pub(crate) struct Shard<B: Kernels> {
    pub(crate) rank: usize,
    pub(crate) ranks: usize,
    pub(crate) collective: Arc<dyn Collective<B>>,
}

impl<B: Kernels> Shard<B> {
    /// This rank's part of `n` things split evenly (the caller checked `n % ranks == 0`).
    pub(crate) fn even(&self, n: usize) -> Range<usize> {
        let each = n / self.ranks;
        self.rank * each..(self.rank + 1) * each
    }

    /// This rank's rows of a `table` with one row a token (an LM head), `name` for errors.
    pub(crate) fn vocab_rows(&self, table: &Weight, name: &str) -> Result<Weight> {
        table.slice_rows(self.even(table.rows)).map_err(|e| Error::Backend(format!("{name}: {e}")))
    }

    /// This rank's rows of an embedding `table` (one row a token), and a row of zeros after
    /// them: what [`Shard::local_tokens`] maps every other token to.
    pub(crate) fn embedding_rows(&self, table: &Weight, name: &str) -> Result<Weight> {
        Ok(self.vocab_rows(table, name)?.with_zero_row())
    }

    /// The cut of an `n`-output projection a rank holds by output rows (`shard` absent:
    /// whole).
    pub(crate) fn rows_cut(shard: Option<&Self>, n: usize) -> Cut {
        shard.map_or(Cut::Whole, |s| Cut::Rows(s.even(n)))
    }

    /// The cut of an `n`-input projection a rank holds by input columns: its outputs are
    /// partial sums, so rank 0 alone adds the bias.
    pub(crate) fn cols_cut(shard: Option<&Self>, n: usize) -> Cut {
        shard.map_or(Cut::Whole, |s| Cut::Cols { cols: s.even(n), bias_here: s.rank == 0 })
    }

    /// `tokens` as rows of this rank's [`Shard::embedding_rows`] of a `vocab`-row table:
    /// its own tokens at their row, every other token at the zero row.
    pub(crate) fn local_tokens(&self, tokens: &[u32], vocab: usize) -> Vec<u32> {
        let own = self.even(vocab);
        let zero = own.len() as u32;
        tokens
            .iter()
            .map(|&t| if own.contains(&(t as usize)) { t - own.start as u32 } else { zero })
            .collect()
    }

    /// Every rank's `part` (`m x h`; this rank's given) summed from zero in rank order: a
    /// column-split projection's output where a norm must read it whole, or the embedding
    /// (each token's one nonzero row: zeros from the ranks that do not hold it).
    pub(crate) fn sum(&self, be: &B, part: &B::Act, m: usize, h: usize) -> Result<B::Act> {
        let mut x = be.zeros(m * h)?;
        let mut gathered = be.alloc(self.ranks * m * h)?;
        self.reduce(be, part, &mut gathered, &mut x, m)?;
        Ok(x)
    }

    /// `x += part_0 + part_1 + ...`: every rank's `part` (this rank's given), added to `x`
    /// one rank after another in rank order, the same on every rank. `gathered` holds
    /// `ranks` times `part`'s length.
    pub(crate) fn reduce(
        &self,
        be: &B,
        part: &B::Act,
        gathered: &mut B::Act,
        x: &mut B::Act,
        m: usize,
    ) -> Result<()> {
        self.collective.all_gather(self.rank, part, gathered)?;
        // The control: an order that follows the token count.
        let reversed = negative_control::token_ordered_reduction() && m.is_multiple_of(2);
        be.add_parts(x, gathered, self.ranks, reversed)
    }
}

/// `tokens`' rows of the embedding `table` of `vocab` rows (`h` wide): looked up whole, or on
/// a rank (`shard`) its rows' lookup, every rank's summed.
pub(crate) fn embed_tokens<B: Kernels>(
    be: &B,
    shard: Option<&Shard<B>>,
    table: &B::Mat,
    tokens: &[u32],
    vocab: usize,
    h: usize,
) -> Result<B::Act> {
    let m = tokens.len();
    let mut x = be.alloc(m * h)?;
    match shard {
        None => be.embed(table, tokens, &mut x)?,
        Some(s) => {
            be.embed(table, &s.local_tokens(tokens, vocab), &mut x)?;
            x = s.sum(be, &x, m, h)?;
        }
    }
    Ok(x)
}

/// Refuses `ranks` where a model of these sizes cannot be split evenly, naming the key.
pub(crate) fn check_split<K: AsRef<str>>(ranks: usize, sizes: &[(K, usize)]) -> Result<()> {
    for (key, n) in sizes {
        let (key, n) = (key.as_ref(), *n);
        if !n.is_multiple_of(ranks) {
            return Err(Error::InvalidOption(format!(
                "--tensor-parallel {ranks}: config.json's {key} ({n}) does not split evenly between {ranks} ranks"
            )));
        }
    }
    Ok(())
}

/// A model split between ranks: each rank's net computes its slice, all of them for every
/// forward, and rank 0's outputs (the same on every rank) are the model's.
pub(crate) struct TensorParallel {
    ranks: Vec<Box<dyn Net>>,
    sync: Arc<dyn RankSync>,
    vocab: usize,
}

impl TensorParallel {
    /// The ranks' nets (in rank order) of a model shaped `config`, exchanging through the
    /// collective behind `sync`.
    pub(crate) fn new(ranks: Vec<Box<dyn Net>>, sync: Arc<dyn RankSync>, config: &Config) -> TensorParallel {
        TensorParallel { ranks, sync, vocab: config.vocab_size }
    }
}

/// How long a failed rank waits for the others to finish before aborting the collective
/// (which on GPUs ends the communicators for good): ranks that fail alike all finish.
const GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Runs `run(net, caches)` for every rank at once, one thread each, where `caches` is that
/// rank's view of each row's cache (split from `rows` here and joined back whatever
/// happens), and returns rank 0's result: the same on every rank. A rank's error is
/// returned in preference to the others' word that it failed.
fn on_ranks<N: ?Sized + Sync, O: Send>(
    nets: &[Box<N>],
    sync: &dyn RankSync,
    mut rows: Vec<&mut RowCache>,
    run: impl Fn(&N, &mut [RowCache]) -> Result<O> + Sync,
) -> Result<O> {
    let n = nets.len();
    // views[rank][row]
    let mut views: Vec<Vec<RowCache>> = (0..n).map(|_| Vec::with_capacity(rows.len())).collect();
    let mut split = 0;
    let mut refused = None;
    for (i, cache) in rows.iter_mut().enumerate() {
        match cache.split_ranks().filter(|parts| parts.len() == n) {
            Some(parts) => {
                parts.into_iter().zip(views.iter_mut()).for_each(|(p, v)| v.push(p));
                split += 1;
            }
            None => {
                refused = Some(Error::Request {
                    request: format!("row {i}"),
                    msg: format!("its cache was not made by this {n}-rank model (new_cache)"),
                });
                break;
            }
        }
    }
    let results = match refused {
        Some(e) => vec![Err(e)],
        None => {
            sync.reset();
            let switches = Switches::current();
            let finished = (std::sync::Mutex::new(0usize), std::sync::Condvar::new());
            std::thread::scope(|s| {
                let handles: Vec<_> = nets
                    .iter()
                    .zip(views.iter_mut())
                    .map(|(net, views)| {
                        let (run, finished) = (&run, &finished);
                        s.spawn(move || {
                            switches.apply();
                            let out = std::panic::catch_unwind(AssertUnwindSafe(|| run(net, views)))
                                .unwrap_or_else(|_| {
                                    Err(Error::Backend("a tensor-parallel rank panicked".into()))
                                });
                            let (count, changed) = finished;
                            let mut done = count.lock().unwrap_or_else(|e| e.into_inner());
                            *done += 1;
                            changed.notify_all();
                            if out.is_err() {
                                let (done, _) = changed
                                    .wait_timeout_while(done, GRACE, |d| *d < n)
                                    .unwrap_or_else(|e| e.into_inner());
                                if *done < n {
                                    // Some rank waits on this one: wake it.
                                    sync.abort();
                                }
                            }
                            out
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(Error::Backend("a tensor-parallel rank panicked".into())))
                    })
                    .collect::<Vec<_>>()
            })
        }
    };
    // The stores go back to their rows whatever happened.
    let mut join_error = None;
    for (i, cache) in rows.iter_mut().enumerate().take(split) {
        let parts: Vec<RowCache> = views.iter_mut().map(|v| v.remove(0)).collect();
        if let Err(e) = cache.join_ranks(parts) {
            join_error.get_or_insert(Error::Backend(format!("row {i}: {e}")));
        }
    }
    let (mut outputs, mut errors) = (Vec::new(), Vec::new());
    for r in results {
        match r {
            Ok(out) => outputs.push(out),
            Err(e) => errors.push(e),
        }
    }
    let aborted = |e: &Error| matches!(e, Error::Backend(m) if m == ABORTED);
    if let Some(i) = errors.iter().position(|e| !aborted(e)).or((!errors.is_empty()).then_some(0)) {
        return Err(errors.swap_remove(i));
    }
    if let Some(e) = join_error {
        return Err(e);
    }
    outputs.into_iter().next().ok_or_else(|| Error::Backend("a tensor-parallel forward with no ranks".into()))
}

impl Net for TensorParallel {
    fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>> {
        // What every rank would refuse alike is refused here, before any rank waits on
        // another.
        let sizes: Vec<(&RowCache, usize)> = rows.iter().map(|r| (&*r.cache, r.tokens.len())).collect();
        slots_for(&sizes, self.max_positions())?;
        check_tokens(rows.iter().map(|r| r.tokens), self.vocab, "row")?;
        let meta: Vec<(&[u32], Logits, bool, Hidden)> =
            rows.iter().map(|r| (r.tokens, r.logits, r.full_logits, r.hidden)).collect();
        let caches = rows.iter_mut().map(|r| &mut *r.cache).collect();
        on_ranks(&self.ranks, &*self.sync, caches, |net, views| {
            let mut inputs: Vec<RowInput> = meta
                .iter()
                .zip(views.iter_mut())
                .map(|(&(tokens, logits, full_logits, hidden), cache)| RowInput {
                    tokens,
                    cache,
                    logits,
                    full_logits,
                    hidden,
                })
                .collect();
            net.forward(&mut inputs)
        })
    }

    fn new_cache(&self) -> RowCache {
        RowCache::from_ranks(self.ranks.iter().map(|r| r.new_cache()).collect())
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.ranks.iter().map(|r| r.kv_bytes_per_token()).sum()
    }

    fn kv_bytes_per_row(&self) -> usize {
        self.ranks.iter().map(|r| r.kv_bytes_per_row()).sum()
    }

    fn backend(&self) -> Backend {
        self.ranks[0].backend()
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        let each: Option<Vec<(usize, usize)>> = self.ranks.iter().map(|r| r.device_memory()).collect();
        let each = each?;
        let free = each.iter().map(|m| m.0).min()?.saturating_mul(each.len());
        Some((free, each.iter().map(|m| m.1).sum()))
    }

    fn kv_dtype(&self) -> KvDtype {
        self.ranks[0].kv_dtype()
    }

    fn activations(&self) -> Activations {
        self.ranks[0].activations()
    }

    fn one_time_forwards(&self) -> u64 {
        self.ranks[0].one_time_forwards()
    }

    fn verify_token_group(&self) -> usize {
        self.ranks[0].verify_token_group()
    }

    fn verify_token_cost(&self) -> f64 {
        self.ranks[0].verify_token_cost()
    }

    fn max_positions(&self) -> usize {
        self.ranks[0].max_positions()
    }

    fn tensor_parallel(&self) -> usize {
        self.ranks.len()
    }

    fn load_mtp(&self, ck: &Checkpoint, layout: MtpLayout, prefix: &str) -> Result<Box<dyn MtpNet>> {
        let ranks = self.ranks.iter().map(|r| r.load_mtp(ck, layout, prefix)).collect::<Result<Vec<_>>>()?;
        Ok(Box::new(TensorParallelMtp { ranks, sync: self.sync.clone() }))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// An MTP head split between the ranks of its target, as the target is.
struct TensorParallelMtp {
    ranks: Vec<Box<dyn MtpNet>>,
    sync: Arc<dyn RankSync>,
}

impl MtpNet for TensorParallelMtp {
    fn forward(&self, rows: &mut [MtpInput]) -> Result<Vec<MtpOutput>> {
        let meta: Vec<(&[f32], &[u32])> = rows.iter().map(|r| (r.hidden, r.tokens)).collect();
        let caches = rows.iter_mut().map(|r| &mut *r.cache).collect();
        on_ranks(&self.ranks, &*self.sync, caches, |net, views| {
            let mut inputs: Vec<MtpInput> = meta
                .iter()
                .zip(views.iter_mut())
                .map(|(&(hidden, tokens), cache)| MtpInput { hidden, tokens, cache })
                .collect();
            net.forward(&mut inputs)
        })
    }

    fn new_cache(&self) -> RowCache {
        RowCache::from_ranks(self.ranks.iter().map(|r| r.new_cache()).collect())
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.ranks.iter().map(|r| r.kv_bytes_per_token()).sum()
    }
}
