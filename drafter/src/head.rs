//! The per-row state of a drafter whose head reads the target's hidden states and then its
//! own output (the MTP head, [`crate::MtpDrafter`]; EAGLE-3, [`crate::Eagle3Drafter`]).
//!
//! The head's cache holds one entry per target position `i`: the pair (the target's
//! states at `i`, token at `i + 1`). Commits queue the pairs the target just made known; a
//! proposal runs the queued pairs (the last one predicts the first draft), then feeds the
//! head its own output and draft for each further token. Those recursive entries are not
//! the target's, so the next commit truncates them: that is the head's rollback.

use std::collections::HashMap;

use mtp_base::Error;
use mtp_cache::RowCache;

use crate::{check_distinct, draw, states_of, unknown_row, Commit, DraftAsk, Proposal, RowId};

/// One row of a head step: `tokens.len()` (state, next token) pairs.
pub(crate) struct Pairs<'a> {
    pub states: &'a [f32],
    pub tokens: &'a [u32],
    pub cache: &'a mut RowCache,
}

/// What a head step gives one row: the logits over the target's vocabulary after its
/// last pair, and the state the next recursive step reads.
pub(crate) struct Step {
    pub logits: Vec<f32>,
    pub state: Vec<f32>,
}

/// A head the rows below drive.
pub(crate) trait Head {
    /// What its entries are called in errors (`MTP`, `EAGLE-3`).
    const NAME: &'static str;
    /// Floats of the target's states a committed position carries.
    fn target_width(&self) -> usize;
    fn new_cache(&self) -> RowCache;
    /// Runs each row's pairs (the target's states when `first`, else the head's own
    /// output); the K/V stay in each row's open window.
    fn step(&self, rows: &mut [Pairs], first: bool) -> Result<Vec<Step>, Error>;
}

struct HeadRow {
    cache: RowCache,
    /// Entries in `cache` that came from the target (the rest are recursive drafts).
    true_len: usize,
    /// Pairs committed by the target but not run yet.
    queued_states: Vec<f32>,
    queued_tokens: Vec<u32>,
}

#[derive(Default)]
pub(crate) struct HeadRows {
    rows: HashMap<RowId, HeadRow>,
}

impl HeadRows {
    pub(crate) fn commit<H: Head>(&mut self, head: &H, row: RowId, c: Commit) -> Result<(), Error> {
        let h = head.target_width();
        if c.hidden.len() != c.tokens.len() * h {
            return Err(Error::Request {
                request: format!("row {row}"),
                msg: format!(
                    "{} commit needs {} hidden floats, got {}",
                    H::NAME,
                    c.tokens.len() * h,
                    c.hidden.len()
                ),
            });
        }
        let r = self.rows.entry(row).or_insert_with(|| HeadRow {
            cache: head.new_cache(),
            true_len: 0,
            queued_states: Vec::new(),
            queued_tokens: Vec::new(),
        });
        let known = r.true_len + r.queued_tokens.len();
        if c.start > known {
            return Err(Error::Request {
                request: format!("row {row}"),
                msg: format!("commit at position {} leaves a gap after {known} {} entries", c.start, H::NAME),
            });
        }
        // Drop recursive entries and anything at or past `start`, then queue the new pairs.
        if c.start < r.true_len {
            r.true_len = c.start;
            r.queued_tokens.clear();
            r.queued_states.clear();
        } else {
            r.queued_tokens.truncate(c.start - r.true_len);
            r.queued_states.truncate((c.start - r.true_len) * h);
        }
        r.cache.truncate(r.true_len);
        r.queued_states.extend_from_slice(c.hidden);
        r.queued_tokens.extend(c.tokens.iter().skip(1).copied().chain([c.next]));
        Ok(())
    }

    /// Up to `k` drafts for each ask, positions below `context`.
    pub(crate) fn propose<H: Head>(
        &mut self,
        head: &H,
        asks: &[DraftAsk],
        context: usize,
    ) -> Result<Vec<Proposal>, Error> {
        check_distinct(asks)?;
        let mut drafts: Vec<Proposal> = vec![Proposal::default(); asks.len()];
        let mut want = Vec::with_capacity(asks.len());
        // Logical position of each row's first draft (entry `end - 1` predicts `end + 1`).
        let mut first = Vec::with_capacity(asks.len());
        for &DraftAsk { row, k, .. } in asks {
            let r = self.rows.get(&row).ok_or_else(|| unknown_row(row))?;
            let end = r.true_len + r.queued_tokens.len();
            first.push(end + 1);
            // Without queued pairs there is nothing new to predict from.
            want.push(if r.queued_tokens.is_empty() { 0 } else { k.min((context + 1).saturating_sub(end)) });
        }
        // (state, token) to feed each row at the next recursive step.
        let mut next: Vec<(Vec<f32>, u32)> = vec![(Vec::new(), 0); asks.len()];
        for step in 0.. {
            let active: Vec<usize> = (0..asks.len()).filter(|&i| want[i] > step).collect();
            if active.is_empty() {
                break;
            }
            let ids: Vec<RowId> = active.iter().map(|&i| asks[i].row).collect();
            let mut state = states_of(&mut self.rows, &ids).into_iter();
            let mut inputs: Vec<Pairs> = Vec::with_capacity(active.len());
            for &i in &active {
                let r = state.next().expect("one state per active row");
                if step == 0 {
                    r.true_len += r.queued_tokens.len();
                    inputs.push(Pairs {
                        states: &r.queued_states,
                        tokens: &r.queued_tokens,
                        cache: &mut r.cache,
                    });
                } else {
                    let (s, tok) = &next[i];
                    inputs.push(Pairs { states: s, tokens: std::slice::from_ref(tok), cache: &mut r.cache });
                }
            }
            let result = head.step(&mut inputs, step == 0);
            for input in inputs.iter_mut() {
                let t = if result.is_ok() { input.tokens.len() } else { 0 };
                input.cache.commit_window(t);
            }
            drop(inputs);
            let outs = match result {
                Ok(outs) => outs,
                Err(e) => {
                    // Nothing was committed: put the queued pairs back in the queue.
                    if step == 0 {
                        for &i in &active {
                            let r = self.rows.get_mut(&asks[i].row).expect("row state exists");
                            r.true_len -= r.queued_tokens.len();
                        }
                    }
                    return Err(e);
                }
            };
            for (&i, Step { logits, state }) in active.iter().zip(outs) {
                let (d, dist) = draw(&logits, &asks[i].sampling, first[i] + step);
                drafts[i].tokens.push(d);
                drafts[i].dists.extend(dist);
                next[i] = (state, d);
            }
            if step == 0 {
                for &i in &active {
                    let r = self.rows.get_mut(&asks[i].row).expect("row state exists");
                    r.queued_tokens.clear();
                    r.queued_states.clear();
                }
            }
        }
        Ok(drafts)
    }

    pub(crate) fn remove(&mut self, row: RowId) {
        self.rows.remove(&row);
    }
}
