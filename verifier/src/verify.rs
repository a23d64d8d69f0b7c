//! The verify step and the rollback that follows it.
//!
//! Row `r` has committed positions `[0, L_r)` and one pending token `x` (emitted, not yet
//! run). Its window `[x, d_1, .., d_k]` runs at logical positions `[L_r, L_r + k]`; the
//! logits after window token `j` decide the token at position `L_r + j + 1` (see
//! [`crate::decide`]). With `a` drafts accepted, the row emits `a + 1` tokens (the accepted
//! drafts, then the target's bonus or replacement token) and keeps `a + 1` window
//! positions. Plain decoding is the same step with no drafts. A constrained row brings
//! one grammar mask per window position; its picks are made from the masked logits, its
//! logprobs stay the target's unmasked log-softmax.

use mtp_base::logits::top_logprobs;
use mtp_base::Error;
use mtp_cache::RowCache;
use mtp_constraint::TokenMask;
use mtp_model::{Hidden, Logits, Model, RowInput, RowOutput};
use mtp_sampling::{Filtered, SamplingMode, SamplingParams};
use rayon::prelude::*;

use crate::{decide, decide_greedy};

/// Where a verify forward writes each row's window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WindowLayout {
    /// At the row's own tail: no hole, rollback only truncates.
    #[default]
    RowTail,
    /// At one slot shared by every row of the forward (the longest row's length), as a
    /// padded batch tensor would: shorter rows get a hole that rollback compacts.
    SharedSlots,
}

/// One row to verify.
pub struct VerifyRow<'a> {
    pub cache: &'a mut RowCache,
    /// The row's last emitted token, not yet in the cache.
    pub pending: u32,
    pub draft: &'a [u32],
    /// The drafter's distribution for each draft token (rejection mode); missing
    /// entries count as one-hot on the draft.
    pub draft_dists: &'a [Filtered],
    pub sampling: SamplingParams,
    /// How many most-likely alternatives to report at each emitted position (0: none).
    pub top_logprobs: usize,
    /// A constrained row's grammar mask at each window position (`draft.len() + 1` of
    /// them): every decision picks among the allowed tokens only.
    pub masks: Option<&'a [TokenMask]>,
    /// Which hidden states [`Verified::hidden`] carries (those a drafter reads); without
    /// any the forward leaves them on the device.
    pub hidden: Hidden,
}

impl<'a> VerifyRow<'a> {
    /// A greedy row (temperature 0, one-hot drafts).
    pub fn greedy(cache: &'a mut RowCache, pending: u32, draft: &'a [u32]) -> VerifyRow<'a> {
        VerifyRow {
            cache,
            pending,
            draft,
            draft_dists: &[],
            sampling: SamplingParams::default(),
            top_logprobs: 0,
            masks: None,
            hidden: Hidden::Final,
        }
    }
}

/// The outcome for one row, after its cache was rolled back to the accepted prefix.
#[derive(Clone, Debug, PartialEq)]
pub struct Verified {
    /// Drafts accepted.
    pub accepted: usize,
    /// The accepted drafts then the target's bonus token (`accepted + 1` tokens).
    pub tokens: Vec<u32>,
    /// Natural-log probability of each of `tokens` under the target's unfiltered
    /// distribution at temperature 1.
    pub logprobs: Vec<f32>,
    /// For each of `tokens`, the row's `top_logprobs` most likely tokens there (empty
    /// lists when it asked for none).
    pub top: Vec<Vec<(u32, f32)>>,
    /// The target's final-normed hidden state at each kept position (`pending` and the
    /// accepted drafts), `(accepted + 1) * hidden_size` floats: what MTP heads read. Empty
    /// unless the row asked for it ([`VerifyRow::hidden`]).
    pub hidden: Vec<f32>,
}

/// Verifies every row in one forward and rolls each cache back to its accepted prefix.
/// A row whose window cannot be allocated gets an error and is left out; the others run.
pub fn verify(
    model: &Model,
    rows: &mut [VerifyRow],
    layout: WindowLayout,
    mode: SamplingMode,
) -> Vec<Result<Verified, Error>> {
    verify_beside(model, rows, layout, mode, Vec::new()).0
}

/// What [`verify_beside`] returns: each verify row's outcome, and the rows beside's outputs
/// (or the forward's error).
pub type VerifiedBeside = (Vec<Result<Verified, Error>>, Result<Vec<RowOutput>, Error>);

/// [`verify`], with `beside` (rows that only run their tokens: a prompt's next chunk) in
/// the same forward, so that one pass over the weights serves both. Their outputs come
/// back as the model returned them; their caches are the caller's to commit. The forward
/// is batch-invariant, so no row's bits depend on what runs beside it.
pub fn verify_beside(
    model: &Model,
    rows: &mut [VerifyRow],
    layout: WindowLayout,
    mode: SamplingMode,
    beside: Vec<RowInput>,
) -> VerifiedBeside {
    let shared = rows.iter().map(|r| r.cache.len()).max().unwrap_or(0);
    let mut results: Vec<Option<Result<Verified, Error>>> = rows.iter().map(|_| None).collect();
    let mut windows: Vec<Vec<u32>> = Vec::new();
    let mut live: Vec<usize> = Vec::new();
    let starts: Vec<usize> = rows.iter().map(|r| r.cache.len()).collect();
    for (i, row) in rows.iter_mut().enumerate() {
        let base = match layout {
            WindowLayout::RowTail => row.cache.len(),
            WindowLayout::SharedSlots => shared,
        };
        let t = 1 + row.draft.len();
        if row.masks.is_some_and(|m| m.len() != t) {
            results[i] = Some(Err(Error::Request {
                request: format!("row {i}"),
                msg: format!("{} grammar masks for a window of {t} tokens", row.masks.map_or(0, |m| m.len())),
            }));
            continue;
        }
        if let Err(e) = row.cache.try_reserve_window(base, t) {
            let bytes = t * model.kv_bytes_per_token();
            results[i] = Some(Err(Error::Request {
                request: format!("row {i}"),
                msg: format!(
                    "out of memory: cannot allocate {bytes} bytes of KV for the verify window ({e})"
                ),
            }));
            continue;
        }
        row.cache.begin_window(base);
        windows.push(std::iter::once(row.pending).chain(row.draft.iter().copied()).collect());
        live.push(i);
    }
    let mut inputs: Vec<RowInput> = Vec::with_capacity(live.len());
    let mut window_of = windows.iter();
    for (i, row) in rows.iter_mut().enumerate() {
        if live.contains(&i) {
            let tokens = window_of.next().expect("one window per live row");
            // A greedy row reads its logits' summaries alone, unless it reports alternatives
            // or masks them.
            let full_logits = !row.sampling.is_greedy() || row.top_logprobs > 0 || row.masks.is_some();
            inputs.push(RowInput {
                tokens,
                cache: &mut *row.cache,
                logits: Logits::All,
                full_logits,
                hidden: row.hidden,
            });
        }
    }
    let verified = inputs.len();
    inputs.extend(beside);
    let beside_out = match model.forward(&mut inputs) {
        Ok(mut outs) => {
            drop(inputs);
            let beside_out = outs.split_off(verified);
            // Rows decide in parallel (a sampled pick over a large vocabulary costs ms); every
            // log-probability comes from its token's summary (the forward's log-softmax
            // normaliser); test fault switches follow the work onto the pool's threads.
            let faults = mtp_sampling::negative_control::current();
            type Decided = (usize, Vec<u32>, Vec<f32>, Vec<Vec<(u32, f32)>>);
            let decided: Vec<Decided> = live
                .par_iter()
                .zip(&outs)
                .zip(&windows)
                .map(|((&i, out), window)| {
                    let row = &rows[i];
                    // Greedy rows without a grammar decide from the summaries' argmaxes.
                    let greedy = row.sampling.is_greedy() && row.masks.is_none();
                    let (a, tokens) = if let Some(masks) = row.masks {
                        // Each position picks from its masked logits (argmax or keyed pick).
                        let masked: Vec<Vec<f32>> = out
                            .logits
                            .iter()
                            .zip(masks)
                            .map(|(l, m)| {
                                let mut l = l.clone();
                                m.apply(&mut l);
                                l
                            })
                            .collect();
                        faults.apply(|| {
                            decide(&masked, &window[1..], row.draft_dists, &row.sampling, mode, starts[i] + 1)
                        })
                    } else if greedy {
                        let target: Vec<u32> = out.summaries.iter().map(|s| s.argmax).collect();
                        decide_greedy(&window[1..], &target)
                    } else {
                        faults.apply(|| {
                            decide(
                                &out.logits,
                                &window[1..],
                                row.draft_dists,
                                &row.sampling,
                                mode,
                                starts[i] + 1,
                            )
                        })
                    };
                    let summaries = &out.summaries[..tokens.len()];
                    let logprobs = if greedy {
                        summaries.iter().map(|s| s.argmax_logprob()).collect()
                    } else {
                        tokens
                            .iter()
                            .zip(&out.logits)
                            .zip(summaries)
                            .map(|((&t, l), s)| s.logprob(l[t as usize]))
                            .collect()
                    };
                    let top = summaries
                        .iter()
                        .enumerate()
                        .map(|(j, s)| {
                            out.logits.get(j).map_or_else(Vec::new, |l| top_logprobs(l, s, row.top_logprobs))
                        })
                        .collect();
                    (a, tokens, logprobs, top)
                })
                .collect();
            for ((&i, out), (a, tokens, logprobs, top)) in live.iter().zip(outs).zip(decided) {
                // Rollback: keep `pending` and the accepted drafts, compact, free the rest.
                rows[i].cache.commit_window(a + 1);
                let h = rows[i].hidden.width(model.config.hidden_size);
                let hidden = out.hidden.get(..(a + 1) * h).map_or_else(Vec::new, <[f32]>::to_vec);
                results[i] = Some(Ok(Verified { accepted: a, tokens, logprobs, top, hidden }));
            }
            Ok(beside_out)
        }
        Err(e) => {
            drop(inputs);
            for &i in &live {
                rows[i].cache.commit_window(0);
                results[i] = Some(Err(Error::Request { request: format!("row {i}"), msg: e.to_string() }));
            }
            Err(e)
        }
    };
    (results.into_iter().map(|r| r.expect("every row has a result")).collect(), beside_out)
}
