//! Drafting with an MTP head that reads the target's final-normed hidden states: the
//! per-row entries, commits and rollback of `crate::head`, over [`MtpHead::forward`].

use std::path::Path;
use std::sync::Arc;

use mtp_base::Error;
use mtp_cache::RowCache;
use mtp_model::{Hidden, Model, MtpHead, MtpInput};

use crate::head::{Head, HeadRows, Pairs, Step};
use crate::{Commit, DraftAsk, Drafter, Proposal, RowId};

pub struct MtpDrafter {
    head: MtpHead,
    target: Arc<Model>,
    rows: HeadRows,
}

impl MtpDrafter {
    pub fn new(head: MtpHead, target: Arc<Model>) -> MtpDrafter {
        MtpDrafter { head, target, rows: HeadRows::default() }
    }

    /// Loads the head from `dir` (a separate MTP checkpoint or the target's own).
    pub fn load(dir: &Path, target: Arc<Model>) -> Result<MtpDrafter, Error> {
        Ok(MtpDrafter::new(MtpHead::load(dir, &target)?, target))
    }

    pub fn head(&self) -> &MtpHead {
        &self.head
    }
}

/// The head with its target's hidden size.
struct Mtp<'a>(&'a MtpHead, usize);

impl Head for Mtp<'_> {
    const NAME: &'static str = "MTP";

    fn target_width(&self) -> usize {
        self.1
    }

    fn new_cache(&self) -> RowCache {
        self.0.new_cache()
    }

    fn step(&self, rows: &mut [Pairs], _first: bool) -> Result<Vec<Step>, Error> {
        // The head reads its own output as it reads the target's: one width, one norm.
        let mut inputs: Vec<MtpInput> = rows
            .iter_mut()
            .map(|p| MtpInput { hidden: p.states, tokens: p.tokens, cache: &mut *p.cache })
            .collect();
        Ok(self
            .0
            .forward(&mut inputs)?
            .into_iter()
            .map(|o| Step { logits: o.logits, state: o.hidden })
            .collect())
    }
}

impl Drafter for MtpDrafter {
    fn name(&self) -> &str {
        "mtp"
    }

    fn hidden(&self) -> Hidden {
        Hidden::Final
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.head.kv_bytes_per_token()
    }

    fn relative_cost(&self) -> f64 {
        // One block, the input projection (2h -> h) and the LM head.
        let c = &self.target.config;
        let head = c.layer_params() + 2 * c.hidden_size * c.hidden_size + c.hidden_size * c.vocab_size;
        head as f64 / c.params_per_token().max(1) as f64
    }

    fn commit(&mut self, row: RowId, c: Commit) -> Result<(), Error> {
        self.rows.commit(&Mtp(&self.head, self.target.config.hidden_size), row, c)
    }

    fn propose(&mut self, asks: &[DraftAsk]) -> Result<Vec<Proposal>, Error> {
        let head = Mtp(&self.head, self.target.config.hidden_size);
        self.rows.propose(&head, asks, self.target.max_positions())
    }

    fn remove(&mut self, row: RowId) {
        self.rows.remove(row);
    }
}
