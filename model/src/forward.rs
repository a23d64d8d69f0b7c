//! The forward plumbing every family shares: projections ([`Proj`]), each token's slot at
//! its row's logical position ([`slots_for`]), the LM head's outputs per row
//! ([`head_outputs`]), the [`Net`] a family implements, and [`Model`], the handle the
//! engine holds. Nothing here knows a family; `crate::registry` picks one.

use std::sync::atomic::{AtomicU64, Ordering};

use mtp_base::config::Config;
use mtp_base::error::{Error, Result};
use mtp_base::logits::LogitSummary;
use mtp_base::weights::Weight;
use mtp_base::Checkpoint;
use mtp_cache::RowCache;
use mtp_kernels::negative_control;
use mtp_kernels::{
    host_summaries, summaries_from, Activations, Backend, Kernels, KvDtype, Numerics, Out, Slot,
    SUMMARY_VALUES,
};

use crate::eagle3::{Eagle3Net, Eagle3Spec};
use crate::mtp::{MtpLayout, MtpNet};
use crate::tensor_parallel::Shard;

/// Which part of a projection's weight a load keeps.
#[derive(Clone, Debug)]
pub(crate) enum Cut {
    Whole,
    /// Output rows (a rank's heads or MLP columns): its outputs are whole values.
    Rows(std::ops::Range<usize>),
    /// Input columns: its outputs are partial sums; `bias_here` on one rank only.
    Cols {
        cols: std::ops::Range<usize>,
        bias_here: bool,
    },
}

pub(crate) struct Proj<B: Kernels> {
    pub(crate) w: B::Mat,
    bias: Option<B::Vec>,
    pub(crate) out: usize,
}

impl<B: Kernels> Proj<B> {
    /// A projection of `out` outputs over an already loaded weight (no bias).
    pub(crate) fn from_weight(be: &B, w: &mtp_base::weights::Weight) -> Result<Proj<B>> {
        Ok(Proj { w: be.matrix(w)?, bias: None, out: w.rows })
    }
}

impl<B: Kernels> Proj<B> {
    pub(crate) fn load(
        be: &B,
        ck: &Checkpoint,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Proj<B>> {
        Proj::load_cut(be, ck, name, out, inp, bias, Cut::Whole)
    }

    /// The `cut` of an `out x inp` projection a tensor-parallel rank holds.
    pub(crate) fn load_cut(
        be: &B,
        ck: &Checkpoint,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
        cut: Cut,
    ) -> Result<Proj<B>> {
        let bias = if bias { Some(ck.get_f32(&format!("{name}.bias"), out)?) } else { None };
        let w = ck.get(&format!("{name}.weight"), &[out, inp])?;
        let sliced = |r: std::result::Result<Weight, String>| {
            r.map_err(|e| {
                Error::Backend(format!("{name}.weight: cannot split between tensor-parallel ranks: {e}"))
            })
        };
        let (w, bias) = match cut {
            Cut::Whole => (w, bias),
            Cut::Rows(r) => (sliced(w.slice_rows(r.clone()))?, bias.map(|b| b[r].to_vec())),
            // Every rank's partial is summed: only rank 0's carries the bias.
            Cut::Cols { cols, bias_here } => (sliced(w.slice_cols(cols))?, bias.filter(|_| bias_here)),
        };
        let bias = bias.map(|b| be.vector(&b)).transpose()?;
        Ok(Proj { out: w.rows, w: be.matrix(&w)?, bias })
    }

    pub(crate) fn forward(&self, be: &B, x: &B::Act, m: usize) -> Result<B::Act> {
        let mut y = be.alloc(m * self.out)?;
        be.linear(x, m, &self.w, self.bias.as_ref(), &mut y, Out::Write)?;
        Ok(y)
    }

    /// The weight and bias, as [`Kernels::linear_parts`] takes them.
    pub(crate) fn part(&self) -> (&B::Mat, Option<&B::Vec>) {
        (&self.w, self.bias.as_ref())
    }

    /// `acc += self(x)`: the residual add.
    pub(crate) fn add_to(&self, be: &B, x: &B::Act, m: usize, acc: &mut B::Act) -> Result<()> {
        be.linear(x, m, &self.w, self.bias.as_ref(), acc, Out::Add)
    }
}

/// A tied checkpoint's stored `head` (some ship one; zeros, in one red-team case): ignored,
/// as transformers' tying and mlx-lm's loading ignore it, and marked read so the
/// unread-tensor check passes it.
pub(crate) fn ignore_tied_head(ck: &Checkpoint, head: &str) {
    if ck.contains(head) {
        ck.mark_read(head);
        tracing::warn!("{head} ignored: tie_word_embeddings is true, so the head is the embedding");
    }
}

/// Token slots of a batched forward over rows of `t` new tokens each, at logical
/// positions `[len, len + t)` of their caches. Refuses a row that would pass `context`.
pub(crate) fn slots_for(rows: &[(&RowCache, usize)], context: usize) -> Result<Vec<Slot>> {
    let physical = negative_control::physical_rope();
    let mut slots = Vec::new();
    for (r, &(cache, t)) in rows.iter().enumerate() {
        let (start, base) = (cache.len(), cache.window_base());
        if start + t > context || base + t > context {
            return Err(Error::Request {
                request: format!("row {r}"),
                msg: format!("{} positions exceed the model's context of {context}", start + t),
            });
        }
        slots.extend((0..t).map(|i| Slot {
            row: r,
            pos: start + i,
            rope_pos: if physical { base + i } else { start + i },
        }));
    }
    Ok(slots)
}

/// Refuses a token outside the vocabulary, naming the row.
pub(crate) fn check_tokens<'a>(
    rows: impl Iterator<Item = &'a [u32]>,
    vocab: usize,
    what: &str,
) -> Result<()> {
    for (r, tokens) in rows.enumerate() {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Request {
                request: format!("{what} {r}"),
                msg: format!("token id {bad} is outside the vocabulary of {vocab}"),
            });
        }
    }
    Ok(())
}

/// Which logits a row wants back from a forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    /// Only after the row's last token (prefill).
    Last,
    /// After every token (verification).
    All,
}

impl Logits {
    /// Indices, within a window of `t` tokens, of the tokens whose logits are wanted.
    pub(crate) fn wanted(self, t: usize) -> std::ops::Range<usize> {
        match self {
            Logits::None => t..t,
            Logits::Last => t.saturating_sub(1)..t,
            Logits::All => 0..t,
        }
    }
}

/// One row of a batched forward: new tokens appended after the row's cache.
pub struct RowInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut RowCache,
    /// Which tokens' logits the row wants.
    pub logits: Logits,
    /// Whether it wants those logits whole, or their [`LogitSummary`] is enough (greedy
    /// rows: the logits then stay where they were computed).
    pub full_logits: bool,
    /// Which hidden states of its tokens it wants back ([`RowOutput::hidden`]): a drafter
    /// reads them. A prompt's forward without them leaves its 2,048 x 4,096 floats (an 8B
    /// model's) on the device.
    pub hidden: Hidden,
}

/// The most layers one forward taps ([`Taps`]).
pub const MAX_TAPS: usize = 8;

/// Layers whose incoming residual stream a forward copies out, in order (repeats allowed
/// by the type; loaders refuse them). `Copy`, so a row's request costs no allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Taps {
    ids: [u32; MAX_TAPS],
    len: u8,
}

impl Taps {
    /// The layers `ids`, or None when there are none or more than [`MAX_TAPS`].
    pub fn new(ids: &[usize]) -> Option<Taps> {
        if ids.is_empty() || ids.len() > MAX_TAPS {
            return None;
        }
        let mut t = Taps { ids: [0; MAX_TAPS], len: ids.len() as u8 };
        for (slot, &id) in t.ids.iter_mut().zip(ids) {
            *slot = u32::try_from(id).ok()?;
        }
        Some(t)
    }

    /// The tapped layers, in order.
    pub fn layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.ids[..self.len as usize].iter().map(|&i| i as usize)
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Which hidden states a row wants back from a forward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Hidden {
    #[default]
    None,
    /// The last layer's output after the final norm, `hidden_size` floats a token: what MTP
    /// heads and Gemma 4's assistant read.
    Final,
    /// The residual stream entering each tapped layer (the embedding for layer 0; before
    /// that layer's input norm), concatenated in the taps' order: `taps.len() *
    /// hidden_size` floats a token, what EAGLE-3 heads read. A forward that taps runs its
    /// layers launched, never as a recorded replay.
    Taps(Taps),
}

impl From<bool> for Hidden {
    /// `true`: [`Hidden::Final`].
    fn from(final_states: bool) -> Hidden {
        if final_states {
            Hidden::Final
        } else {
            Hidden::None
        }
    }
}

impl Hidden {
    /// Whether any hidden state is wanted.
    pub fn wanted(self) -> bool {
        self != Hidden::None
    }

    /// Floats a token for a model of `hidden_size` `h`.
    pub fn width(self, h: usize) -> usize {
        match self {
            Hidden::None => 0,
            Hidden::Final => h,
            Hidden::Taps(t) => t.len() * h,
        }
    }

    /// The one kind of hidden state `rows` want (None when none does); rows asking for
    /// different kinds in one forward are refused.
    pub(crate) fn of_rows(rows: &[RowInput]) -> Result<Hidden> {
        let mut kind = Hidden::None;
        for (r, row) in rows.iter().enumerate() {
            match (kind, row.hidden) {
                (_, Hidden::None) => {}
                (Hidden::None, k) => kind = k,
                (k, j) if k == j => {}
                _ => {
                    return Err(Error::Request {
                        request: format!("row {r}"),
                        msg: "rows of one forward ask for different hidden states".into(),
                    })
                }
            }
        }
        Ok(kind)
    }
}

#[derive(Debug, Default)]
pub struct RowOutput {
    /// One vocab-sized row per wanted token when the row asked for full logits; empty
    /// otherwise.
    pub logits: Vec<Vec<f32>>,
    /// One summary per wanted token, always.
    pub summaries: Vec<LogitSummary>,
    /// The hidden states the row asked for ([`RowInput::hidden`]), one row of
    /// [`Hidden::width`] floats per input token; empty unless it asked.
    pub hidden: Vec<f32>,
}

/// The LM head's results for a forward's wanted tokens, in order: every token's summary,
/// and the logits (`vocab` wide) when some row wanted them whole (empty otherwise).
pub(crate) struct Head {
    pub(crate) summaries: Vec<LogitSummary>,
    pub(crate) logits: Vec<f32>,
}

/// Indices (among all the rows' tokens, in order) of the tokens whose logits are wanted.
pub(crate) fn wanted_tokens(rows: &[RowInput]) -> Vec<usize> {
    let mut want: Vec<usize> = Vec::new();
    let mut off = 0;
    for row in rows.iter() {
        let t = row.tokens.len();
        want.extend(row.logits.wanted(t).map(|i| off + i));
        off += t;
    }
    want
}

/// The tokens of each padding row that take a forward of `tokens` over `rows` rows to
/// `shape` ([`Kernels::recorded_shape`]): one each, the first what the others leave.
pub(crate) fn padding_rows(shape: (usize, usize), tokens: usize, rows: usize) -> Result<Vec<usize>> {
    let (to_tokens, to_rows) = shape;
    let bad = || {
        Error::Backend(format!("cannot pad {tokens} tokens over {rows} rows to {to_tokens} over {to_rows}"))
    };
    let pads = to_rows.checked_sub(rows).ok_or_else(bad)?;
    let extra = to_tokens.checked_sub(tokens).ok_or_else(bad)?;
    if pads == 0 {
        return if extra == 0 { Ok(Vec::new()) } else { Err(bad()) };
    }
    let first = extra.checked_sub(pads - 1).filter(|&n| n > 0).ok_or_else(bad)?;
    Ok(std::iter::once(first).chain(std::iter::repeat_n(1, pads - 1)).collect())
}

/// Each row's outputs from the wanted tokens' `head` results and every token's `hidden`
/// state (`h` wide: [`Hidden::width`]; may be empty where no row wants it).
pub(crate) fn row_outputs(
    rows: &[RowInput],
    head: &Head,
    hidden: &[f32],
    vocab: usize,
    h: usize,
) -> Vec<RowOutput> {
    use rayon::prelude::*;
    let vocab = vocab.max(1);
    let mut outs = Vec::with_capacity(rows.len());
    let (mut off, mut wanted) = (0, 0);
    for row in rows.iter() {
        let t = row.tokens.len();
        let n = row.logits.wanted(t).len();
        let logits = match head.logits.get(wanted * vocab..(wanted + n) * vocab) {
            // Copied on the host's threads: a verify's logits are tens of MB.
            Some(l) if row.full_logits => l.par_chunks(vocab).map(|l| l.to_vec()).collect(),
            _ => Vec::new(),
        };
        outs.push(RowOutput {
            logits,
            summaries: head.summaries[wanted..wanted + n].to_vec(),
            hidden: match hidden.get(off * h..(off + t) * h) {
                Some(states) if row.hidden.wanted() => states.to_vec(),
                _ => Vec::new(),
            },
        });
        off += t;
        wanted += n;
    }
    outs
}

/// Each row's outputs from the final-normed hidden states `normed` (one `h`-wide row per
/// token): `lm_head` only for the tokens whose logits were asked for, soft-capped
/// (`cap * tanh(l / cap)`, on the host) when `softcap` is given. `tapped`: every token's
/// tapped states ([`Hidden::Taps`]), for rows that asked for them; a model that taps no
/// layer passes None and refuses such rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_outputs<B: Kernels>(
    be: &B,
    rows: &[RowInput],
    normed: B::Act,
    lm_head: LmHead<B>,
    vocab: usize,
    h: usize,
    softcap: Option<f32>,
    tapped: Option<Vec<f32>>,
) -> Result<Vec<RowOutput>> {
    let kind = Hidden::of_rows(rows)?;
    if matches!(kind, Hidden::Taps(_)) && tapped.is_none() {
        return Err(Error::Request {
            request: "forward".into(),
            msg: "this model's forward taps no layers (EAGLE-3 heads read Llama-family targets)".into(),
        });
    }
    let want = wanted_tokens(rows);
    let all = rows.iter().map(|r| r.tokens.len()).sum::<usize>();
    let mut head = Head { summaries: Vec::new(), logits: Vec::new() };
    if !want.is_empty() {
        // Every token wanted (decode, verify): the rows are already in order.
        let gathered = if want.len() == all { None } else { Some(be.gather(&normed, h, &want)?) };
        let mut logits = be.alloc(want.len() * vocab)?;
        lm_head.logits(be, gathered.as_ref().unwrap_or(&normed), want.len(), vocab, &mut logits)?;
        if let Some(cap) = softcap {
            // Capped on the host, so summarised there.
            head.logits = be.download(logits)?;
            head.logits.iter_mut().for_each(|l| *l = (*l / cap).tanh() * cap);
            let mut values = vec![0.0; SUMMARY_VALUES * want.len()];
            host_summaries(&head.logits, want.len(), vocab, &mut values)?;
            head.summaries = summaries_from(&values);
        } else {
            let mut summaries = be.alloc(SUMMARY_VALUES * want.len())?;
            be.logit_summaries(&logits, want.len(), vocab, &mut summaries)?;
            head.summaries = summaries_from(&be.download(summaries)?);
            if rows.iter().any(|r| r.full_logits) {
                head.logits = be.download(logits)?;
            }
        }
    }
    let hidden = match (kind, tapped) {
        (Hidden::Taps(_), Some(t)) => t,
        (Hidden::Final, _) => be.download(normed)?,
        _ => Vec::new(),
    };
    Ok(row_outputs(rows, &head, &hidden, vocab, kind.width(h)))
}

/// A model's LM head: the whole weight, or a tensor-parallel rank's vocabulary rows.
pub(crate) struct LmHead<'a, B: Kernels> {
    pub(crate) w: &'a B::Mat,
    pub(crate) shard: Option<&'a Shard<B>>,
}

impl<'a, B: Kernels> LmHead<'a, B> {
    /// `out = lm_head(x)` over `n` tokens, `vocab` wide: on a rank, its vocabulary rows'
    /// logits beside every other rank's.
    pub(crate) fn logits(&self, be: &B, x: &B::Act, n: usize, vocab: usize, out: &mut B::Act) -> Result<()> {
        let Some(shard) = self.shard else {
            return be.linear(x, n, self.w, None, out, Out::Write);
        };
        // The ranks hold equal vocabulary rows (the load checked `vocab % ranks == 0`).
        let width = vocab / shard.ranks;
        let mut local = be.alloc(n * width)?;
        be.linear(x, n, self.w, None, &mut local, Out::Write)?;
        let mut gathered = be.alloc(shard.ranks * n * width)?;
        shard.collective.all_gather(shard.rank, &local, &mut gathered)?;
        be.concat_columns(&gathered, shard.ranks, width, n, out)
    }
}

/// A model on some backend, as the engine sees it.
pub(crate) trait Net: Send + Sync {
    fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>>;
    fn new_cache(&self) -> RowCache;
    fn kv_bytes_per_token(&self) -> usize;
    /// K/V bytes a row holds whatever its length (a sliding-window ring).
    fn kv_bytes_per_row(&self) -> usize {
        0
    }
    fn backend(&self) -> Backend;
    fn kv_dtype(&self) -> KvDtype;
    /// The kernel set's activations where they meet bf16 weights (resolved).
    fn activations(&self) -> Activations;
    /// Free and total bytes of the device the model runs on ([`Kernels::device_memory`]).
    fn device_memory(&self) -> Option<(usize, usize)> {
        None
    }
    /// Forwards so far that paid a one-time cost ([`Kernels::one_time_forwards`]).
    fn one_time_forwards(&self) -> u64 {
        0
    }
    /// [`Kernels::token_group`] of the model's backend.
    fn verify_token_group(&self) -> usize {
        1
    }
    /// [`Kernels::verify_token_cost`] of the model's backend.
    fn verify_token_cost(&self) -> f64 {
        1.0
    }
    fn max_positions(&self) -> usize;
    /// Ranks the model is split between (tensor parallelism; 1 for a whole model).
    fn tensor_parallel(&self) -> usize {
        1
    }
    /// Loads MTP module `prefix` of `ck` onto this model's backend, sharing its weights.
    fn load_mtp(&self, ck: &Checkpoint, layout: MtpLayout, prefix: &str) -> Result<Box<dyn MtpNet>>;
    /// Loads the EAGLE-3 head `ck` (described by `spec`) onto this model's backend.
    fn load_eagle3(&self, ck: &Checkpoint, spec: &Eagle3Spec) -> Result<Box<dyn Eagle3Net>> {
        let _ = ck;
        Err(Error::config(
            &spec.path,
            "architectures",
            "EAGLE-3 heads draft for Llama, Mistral, Qwen2 and Qwen3 targets (this target taps no layers)",
        ))
    }
    /// The concrete net, for drafters that share a family's internals (Gemma 4's assistant).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A model on some backend, as the engine holds it (loaded by `crate::registry`).
pub struct Model {
    pub config: Config,
    pub(crate) net: Box<dyn Net>,
    /// Calls of [`Model::forward`] so far.
    pub(crate) forwards: AtomicU64,
}

impl Model {
    /// Where this model runs.
    pub fn backend(&self) -> Backend {
        self.net.backend()
    }

    /// How this model stores K/V (resolved: `F32` or `Bf16`).
    pub fn kv_dtype(&self) -> KvDtype {
        self.net.kv_dtype()
    }

    /// How this model computes (resolved): its K/V dtype, and its kernel set's activations
    /// where they meet bf16 weights (`Bf16` on CUDA by default; f32 weights compute in f32
    /// whatever this says). A drafter loads with its target's.
    pub fn numerics(&self) -> Numerics {
        Numerics { kv: self.net.kv_dtype(), activations: self.net.activations() }
    }

    /// Forwards so far that paid a one-time cost: a recordable shape's first run or its
    /// recording as a CUDA graph (0 where nothing is recorded). The engine's adaptive k
    /// learns verify cost only from rounds that left this unchanged.
    pub fn one_time_forwards(&self) -> u64 {
        self.net.one_time_forwards()
    }

    /// Free and total bytes of the GPU memory the model's K/V would live in (summed over
    /// tensor-parallel ranks, free as the fullest rank's times their count); None on the CPU.
    pub fn device_memory(&self) -> Option<(usize, usize)> {
        self.net.device_memory()
    }

    /// Tokens a forward computes as one group (CUDA: 8): a verify of a partial group costs
    /// about a whole one, so adaptive k fills groups.
    pub fn verify_token_group(&self) -> usize {
        self.net.verify_token_group()
    }

    /// One more verify token's cost in decode steps, fixed for the backend (CPU: 1;
    /// GPUs, whose decode steps are bound by the weights' bytes: a fraction).
    pub fn verify_token_cost(&self) -> f64 {
        self.net.verify_token_cost()
    }

    /// An empty cache for one row of this model, on its backend.
    pub fn new_cache(&self) -> RowCache {
        self.net.new_cache()
    }

    /// KV bytes one position costs (device bytes on a GPU backend).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.net.kv_bytes_per_token()
    }

    /// K/V bytes a row holds whatever its length, besides [`Model::kv_bytes_per_token`]
    /// per position: Gemma 4's sliding-window rings (0 for other models).
    pub fn kv_bytes_per_row(&self) -> usize {
        self.net.kv_bytes_per_row()
    }

    /// Ranks (devices or CPU threads) the model is split between: `--tensor-parallel`.
    pub fn tensor_parallel(&self) -> usize {
        self.net.tensor_parallel()
    }

    /// The longest sequence (prompt + output) a row may reach.
    pub fn max_positions(&self) -> usize {
        self.net.max_positions()
    }

    /// Runs every row's tokens at its own logical positions `[len, len + t)` and returns
    /// the requested logits and the final-normed hidden state of every token. The new
    /// K/V are left in each row's open window (at the slot the caller chose with
    /// `RowCache::begin_window`, the row's tail by default); the caller commits what it
    /// keeps with `RowCache::commit_window`. Every value a row gets back is a function of
    /// its own prefix only: batch composition and chunking change no bit.
    pub fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>> {
        self.forwards.fetch_add(1, Ordering::Relaxed);
        self.net.forward(rows)
    }

    /// Forwards run so far (each one pass over the weights, whatever its rows).
    pub fn forwards(&self) -> u64 {
        self.forwards.load(Ordering::Relaxed)
    }

    pub(crate) fn net(&self) -> &dyn Net {
        &*self.net
    }
}

#[cfg(test)]
mod tests {
    use super::padding_rows;

    #[test]
    fn padding_rows_take_a_token_each_and_the_first_the_rest() {
        assert_eq!(padding_rows((40, 8), 40, 8).unwrap(), Vec::<usize>::new());
        assert_eq!(padding_rows((16, 4), 15, 3).unwrap(), vec![1]);
        assert_eq!(padding_rows((48, 16), 37, 8).unwrap(), vec![4, 1, 1, 1, 1, 1, 1, 1]);
        // Shapes no padding reaches are refused, not run short.
        assert!(padding_rows((40, 8), 37, 8).is_err(), "tokens but no row to hold them");
        assert!(padding_rows((17, 8), 15, 4).is_err(), "fewer tokens than padding rows");
        assert!(padding_rows((8, 2), 9, 2).is_err() && padding_rows((9, 1), 9, 2).is_err(), "smaller");
    }
}
