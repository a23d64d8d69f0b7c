//! A separate small model with the target's tokenizer, decoding ahead (greedily, or
//! sampling with the row's keyed noise).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use mtp_base::{Error, Tokenizer};
use mtp_cache::RowCache;
use mtp_model::{Hidden, Logits, Model, RowInput};

use crate::sequences::Sequences;
use crate::{check_distinct, draw, states_of, unknown_row, Commit, DraftAsk, Drafter, Proposal, RowId};

/// Per row: its own KV cache and the tokens that cache holds.
struct DraftRow {
    cache: RowCache,
    fed: Vec<u32>,
}

pub struct DraftModelDrafter {
    model: Arc<Model>,
    /// Weights per token of the draft model over the target's.
    relative_cost: f64,
    seqs: Sequences,
    rows: HashMap<RowId, DraftRow>,
}

impl DraftModelDrafter {
    /// Wraps `draft` for drafting ahead of `target`; refuses a vocabulary mismatch.
    pub fn new(draft: Arc<Model>, target: &Model) -> Result<DraftModelDrafter, Error> {
        let (dv, tv) = (draft.config.vocab_size, target.config.vocab_size);
        if dv != tv {
            return Err(Error::Request {
                request: "draft model".into(),
                msg: format!("vocabulary of {dv} tokens does not match the target's {tv}"),
            });
        }
        if draft.new_cache().has_ring() {
            return Err(Error::Request {
                request: "draft model".into(),
                msg: "keeps sliding-window layers in a ring, which cannot roll back past its window; a Gemma 4 target drafts with its assistant (--drafter assistant)".into(),
            });
        }
        let relative_cost =
            draft.config.params_per_token() as f64 / target.config.params_per_token().max(1) as f64;
        Ok(DraftModelDrafter {
            model: draft,
            relative_cost,
            seqs: Sequences::default(),
            rows: HashMap::new(),
        })
    }

    /// Loads the draft checkpoint in `draft_dir` and checks it against the target in
    /// `target_dir`: same vocabulary size and, when both ship a tokenizer.json, the same
    /// token-to-id map (without one, a warning says the map went unchecked).
    pub fn load(draft_dir: &Path, target_dir: &Path, target: &Model) -> Result<DraftModelDrafter, Error> {
        let named = |msg: String| Error::Request {
            request: format!("draft model {}", draft_dir.display()),
            msg: format!("{msg} ({})", target_dir.display()),
        };
        let drafter = DraftModelDrafter::new(
            Arc::new(Model::load_with(draft_dir, target.backend(), target.numerics())?),
            target,
        )
        .map_err(|e| match e {
            Error::Request { msg, .. } => named(msg),
            other => other,
        })?;
        match (Tokenizer::from_dir_if_present(draft_dir)?, Tokenizer::from_dir_if_present(target_dir)?) {
            (Some(d), Some(t)) if d.vocab() != t.vocab() => {
                return Err(named("tokenizer.json maps tokens to different ids than the target's".into()))
            }
            (Some(_), Some(_)) => {}
            // Equal sizes are all that can be checked: say so rather than skip it silently.
            (d, _) => tracing::warn!(
                "draft model {}: no tokenizer.json in {}, so its token map cannot be checked against the \
                 target's (only the vocabulary sizes, {} tokens each, are)",
                draft_dir.display(),
                if d.is_none() { draft_dir.display() } else { target_dir.display() },
                target.config.vocab_size
            ),
        }
        Ok(drafter)
    }

    /// The draft model's weights (shared, so fresh drafters need not reload them).
    pub fn model(&self) -> Arc<Model> {
        self.model.clone()
    }
}

impl Drafter for DraftModelDrafter {
    fn name(&self) -> &str {
        "draft-model"
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.model.kv_bytes_per_token()
    }

    fn relative_cost(&self) -> f64 {
        self.relative_cost
    }

    fn commit(&mut self, row: RowId, c: Commit) -> Result<(), Error> {
        let seq = self.seqs.apply(row, &c)?;
        let r = self
            .rows
            .entry(row)
            .or_insert_with(|| DraftRow { cache: self.model.new_cache(), fed: Vec::new() });
        // Rollback: keep the cache only as far as it agrees with the committed tokens.
        let valid = r.fed.iter().zip(seq).take_while(|(a, b)| a == b).count().min(r.cache.len());
        r.cache.truncate(valid);
        r.fed.truncate(valid);
        Ok(())
    }

    fn propose(&mut self, asks: &[DraftAsk]) -> Result<Vec<Proposal>, Error> {
        check_distinct(asks)?;
        let context = self.model.max_positions();
        let mut drafts: Vec<Proposal> = vec![Proposal::default(); asks.len()];
        // Step 0 feeds each row what its cache lacks (at least its last token); step s
        // feeds draft s. Rows drop out when they have their k tokens.
        let mut feed: Vec<Vec<u32>> = Vec::with_capacity(asks.len());
        let mut want: Vec<usize> = Vec::with_capacity(asks.len());
        // Logical position of each row's first draft.
        let mut first: Vec<usize> = Vec::with_capacity(asks.len());
        for &DraftAsk { row, k, .. } in asks {
            let seq = self.seqs.get(row).ok_or_else(|| unknown_row(row))?;
            let r = self.rows.get_mut(&row).ok_or_else(|| unknown_row(row))?;
            if r.fed.len() >= seq.len() {
                r.cache.truncate(seq.len() - 1);
                r.fed.truncate(seq.len() - 1);
            }
            // The k-th draft is never fed, so the cache reaches seq.len() + k - 1.
            want.push(k.min((context + 1).saturating_sub(seq.len())));
            first.push(seq.len());
            feed.push(seq[r.fed.len()..].to_vec());
        }
        for step in 0.. {
            let active: Vec<usize> = (0..asks.len()).filter(|&i| want[i] > step).collect();
            if active.is_empty() {
                break;
            }
            let ids: Vec<RowId> = active.iter().map(|&i| asks[i].row).collect();
            let mut caches = states_of(&mut self.rows, &ids).into_iter();
            let mut inputs: Vec<RowInput> = Vec::with_capacity(active.len());
            for &i in &active {
                let r = caches.next().expect("one state per active row");
                r.fed.extend_from_slice(&feed[i]);
                let full_logits = !asks[i].sampling.is_greedy();
                inputs.push(RowInput {
                    tokens: &feed[i],
                    cache: &mut r.cache,
                    logits: Logits::Last,
                    full_logits,
                    hidden: Hidden::None,
                });
            }
            let outs = self.model.forward(&mut inputs)?;
            for input in inputs.iter_mut() {
                let t = input.tokens.len();
                input.cache.commit_window(t);
            }
            drop(inputs);
            for (&i, out) in active.iter().zip(outs) {
                let (d, dist) = match out.summaries.first() {
                    // Greedy: the forward's summary has the argmax (the logits stayed put).
                    Some(s) if asks[i].sampling.is_greedy() => (s.argmax, None),
                    _ => draw(&out.logits[0], &asks[i].sampling, first[i] + step),
                };
                drafts[i].tokens.push(d);
                drafts[i].dists.extend(dist);
                feed[i] = vec![d];
            }
        }
        Ok(drafts)
    }

    fn remove(&mut self, row: RowId) {
        self.seqs.remove(row);
        self.rows.remove(&row);
    }
}
