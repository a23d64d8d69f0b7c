//! Drafting with an EAGLE-3 head that reads the target's tapped layers
//! ([`mtp_model::Eagle3Head`]; the math in `mtp_model::eagle3`).
//!
//! As with the MTP head ([`crate::MtpDrafter`]), the head's cache holds one entry per
//! target position `i`: the pair (the target's taps at `i`, token at `i + 1`). Commits
//! queue the pairs the target just made known; a proposal runs the queued pairs through
//! `fc` and the layer (the last one predicts the first draft), then feeds the head its own
//! output (before its final norm, without `fc`) and draft for each further token. Drafts
//! are drawn over the target's vocabulary (the draft vocabulary mapped through `d2t`, -inf
//! elsewhere) as [`crate::draw`] draws any drafter's. Recursive entries are not the
//! target's, so the next commit truncates them: that is the head's rollback.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use mtp_base::Error;
use mtp_cache::RowCache;
use mtp_model::{Eagle3Feed, Eagle3Head, Eagle3Input, Hidden, Model};

use crate::{check_distinct, draw, states_of, unknown_row, Commit, DraftAsk, Drafter, Proposal, RowId};

struct Eagle3Row {
    cache: RowCache,
    /// Entries in `cache` that came from the target (the rest are recursive drafts).
    true_len: usize,
    /// Pairs committed by the target but not run yet.
    queued_hidden: Vec<f32>,
    queued_tokens: Vec<u32>,
}

pub struct Eagle3Drafter {
    head: Eagle3Head,
    target: Arc<Model>,
    rows: HashMap<RowId, Eagle3Row>,
}

impl Eagle3Drafter {
    pub fn new(head: Eagle3Head, target: Arc<Model>) -> Eagle3Drafter {
        Eagle3Drafter { head, target, rows: HashMap::new() }
    }

    /// Loads the head in `dir` for `target`.
    pub fn load(dir: &Path, target: Arc<Model>) -> Result<Eagle3Drafter, Error> {
        Ok(Eagle3Drafter::new(Eagle3Head::load(dir, &target)?, target))
    }

    pub fn head(&self) -> &Eagle3Head {
        &self.head
    }
}

impl Drafter for Eagle3Drafter {
    fn name(&self) -> &str {
        "eagle3"
    }

    fn hidden(&self) -> Hidden {
        self.head.hidden()
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.head.kv_bytes_per_token()
    }

    fn relative_cost(&self) -> f64 {
        // The layer (q/k/v twice as wide), fc (3 target states -> h) and the draft LM head.
        let (s, t) = (&self.head.spec, &self.target.config);
        let (c, h) = (&s.config, s.config.hidden_size);
        let qkv = h * c.head_dim * (c.num_attention_heads + 2 * c.num_key_value_heads);
        let head = c.layer_params() + qkv + s.taps.len() * t.hidden_size * h + h * s.draft_vocab;
        head as f64 / t.params_per_token().max(1) as f64
    }

    fn commit(&mut self, row: RowId, c: Commit) -> Result<(), Error> {
        let h = self.head.hidden().width(self.target.config.hidden_size);
        if c.hidden.len() != c.tokens.len() * h {
            return Err(Error::Request {
                request: format!("row {row}"),
                msg: format!(
                    "EAGLE-3 commit needs {} tapped floats, got {}",
                    c.tokens.len() * h,
                    c.hidden.len()
                ),
            });
        }
        let r = self.rows.entry(row).or_insert_with(|| Eagle3Row {
            cache: self.head.new_cache(),
            true_len: 0,
            queued_hidden: Vec::new(),
            queued_tokens: Vec::new(),
        });
        let known = r.true_len + r.queued_tokens.len();
        if c.start > known {
            return Err(Error::Request {
                request: format!("row {row}"),
                msg: format!("commit at position {} leaves a gap after {known} EAGLE-3 entries", c.start),
            });
        }
        // Drop recursive entries and anything at or past `start`, then queue the new pairs.
        if c.start < r.true_len {
            r.true_len = c.start;
            r.queued_tokens.clear();
            r.queued_hidden.clear();
        } else {
            r.queued_tokens.truncate(c.start - r.true_len);
            r.queued_hidden.truncate((c.start - r.true_len) * h);
        }
        r.cache.truncate(r.true_len);
        r.queued_hidden.extend_from_slice(c.hidden);
        r.queued_tokens.extend(c.tokens.iter().skip(1).copied().chain([c.next]));
        Ok(())
    }

    fn propose(&mut self, asks: &[DraftAsk]) -> Result<Vec<Proposal>, Error> {
        check_distinct(asks)?;
        let h = self.head.spec.config.hidden_size;
        let context = self.target.max_positions();
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
        // (hidden, token) to feed each row at the next recursive step.
        let mut next: Vec<(Vec<f32>, u32)> = vec![(Vec::new(), 0); asks.len()];
        for step in 0.. {
            let active: Vec<usize> = (0..asks.len()).filter(|&i| want[i] > step).collect();
            if active.is_empty() {
                break;
            }
            let ids: Vec<RowId> = active.iter().map(|&i| asks[i].row).collect();
            let mut state = states_of(&mut self.rows, &ids).into_iter();
            let mut inputs: Vec<Eagle3Input> = Vec::with_capacity(active.len());
            for &i in &active {
                let r = state.next().expect("one state per active row");
                if step == 0 {
                    r.true_len += r.queued_tokens.len();
                    inputs.push(Eagle3Input {
                        states: &r.queued_hidden,
                        tokens: &r.queued_tokens,
                        cache: &mut r.cache,
                    });
                } else {
                    let (hid, tok) = &next[i];
                    inputs.push(Eagle3Input {
                        states: hid,
                        tokens: std::slice::from_ref(tok),
                        cache: &mut r.cache,
                    });
                }
            }
            let feed = if step == 0 { Eagle3Feed::Taps } else { Eagle3Feed::Own };
            let result = self.head.forward(&mut inputs, feed);
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
            for (&i, out) in active.iter().zip(outs) {
                let (d, dist) = draw(&out.logits, &asks[i].sampling, first[i] + step);
                drafts[i].tokens.push(d);
                drafts[i].dists.extend(dist);
                debug_assert_eq!(out.hidden.len(), h);
                next[i] = (out.hidden, d);
            }
            if step == 0 {
                for &i in &active {
                    let r = self.rows.get_mut(&asks[i].row).expect("row state exists");
                    r.queued_tokens.clear();
                    r.queued_hidden.clear();
                }
            }
        }
        Ok(drafts)
    }

    fn remove(&mut self, row: RowId) {
        self.rows.remove(&row);
    }
}
