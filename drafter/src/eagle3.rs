//! Drafting with an EAGLE-3 head that reads the target's tapped layers
//! ([`mtp_model::Eagle3Head`]; the math in `mtp_model::eagle3`): the per-row entries,
//! commits and rollback of `crate::head`, as the MTP head's. The first step runs the
//! queued pairs of target taps through `fc`; each further draft feeds the head its own
//! output (before its final norm, without `fc`). Drafts are drawn over the target's
//! vocabulary (the draft vocabulary mapped through `d2t`, -inf elsewhere) as
//! [`crate::draw`] draws any drafter's.

use std::path::Path;
use std::sync::Arc;

use mtp_base::Error;
use mtp_cache::RowCache;
use mtp_model::{Eagle3Feed, Eagle3Head, Eagle3Input, Hidden, Model};

use crate::head::{Head, HeadRows, Pairs, Step};
use crate::{Commit, DraftAsk, Drafter, Proposal, RowId};

pub struct Eagle3Drafter {
    head: Eagle3Head,
    target: Arc<Model>,
    rows: HeadRows,
}

impl Eagle3Drafter {
    pub fn new(head: Eagle3Head, target: Arc<Model>) -> Eagle3Drafter {
        Eagle3Drafter { head, target, rows: HeadRows::default() }
    }

    /// Loads the head in `dir` for `target`.
    pub fn load(dir: &Path, target: Arc<Model>) -> Result<Eagle3Drafter, Error> {
        Ok(Eagle3Drafter::new(Eagle3Head::load(dir, &target)?, target))
    }

    pub fn head(&self) -> &Eagle3Head {
        &self.head
    }
}

/// The head with its taps' width.
struct Eagle3<'a>(&'a Eagle3Head, usize);

impl<'a> Eagle3<'a> {
    fn of(head: &'a Eagle3Head, target: &Model) -> Eagle3<'a> {
        Eagle3(head, head.hidden().width(target.config.hidden_size))
    }
}

impl Head for Eagle3<'_> {
    const NAME: &'static str = "EAGLE-3";

    fn target_width(&self) -> usize {
        self.1
    }

    fn new_cache(&self) -> RowCache {
        self.0.new_cache()
    }

    fn step(&self, rows: &mut [Pairs], first: bool) -> Result<Vec<Step>, Error> {
        let mut inputs: Vec<Eagle3Input> = rows
            .iter_mut()
            .map(|p| Eagle3Input { states: p.states, tokens: p.tokens, cache: &mut *p.cache })
            .collect();
        let feed = if first { Eagle3Feed::Taps } else { Eagle3Feed::Own };
        Ok(self
            .0
            .forward(&mut inputs, feed)?
            .into_iter()
            .map(|o| Step { logits: o.logits, state: o.hidden })
            .collect())
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
        self.rows.commit(&Eagle3::of(&self.head, &self.target), row, c)
    }

    fn propose(&mut self, asks: &[DraftAsk]) -> Result<Vec<Proposal>, Error> {
        self.rows.propose(&Eagle3::of(&self.head, &self.target), asks, self.target.max_positions())
    }

    fn remove(&mut self, row: RowId) {
        self.rows.remove(row);
    }
}
