//! Drafting with Gemma 4's assistant, which reads the target's own K/V.
//!
//! Per row it keeps only what the last commit made known: the target's next token (at the
//! row's next position `L - 1`), and the target's hidden state at the last committed
//! position. A proposal runs the assistant's steps, each querying at `L - 1` over the
//! committed keys of the target's cache. It holds no cache of its own, so rolling it back
//! is rolling back the target.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use mtp_base::Error;
use mtp_cache::RowCache;
use mtp_model::models::gemma4::assistant::{AssistantRow, Gemma4Assistant};
use mtp_model::{Hidden, Model};

use crate::{check_distinct, draw, unknown_row, Commit, DraftAsk, Drafter, Proposal, RowId};

struct AssistantState {
    /// The target's next token, at logical position `pos`.
    token: u32,
    pos: usize,
    /// The target's final-normed hidden state at `pos - 1`.
    hidden: Vec<f32>,
}

pub struct AssistantDrafter {
    net: Gemma4Assistant,
    target: Arc<Model>,
    rows: HashMap<RowId, AssistantState>,
}

impl AssistantDrafter {
    /// Loads the assistant in `dir` for `target` (a Gemma 4 model).
    pub fn load(dir: &Path, target: Arc<Model>) -> Result<AssistantDrafter, Error> {
        Ok(AssistantDrafter {
            net: Gemma4Assistant::load(dir, target.clone())?,
            target,
            rows: HashMap::new(),
        })
    }
}

impl Drafter for AssistantDrafter {
    fn name(&self) -> &str {
        "assistant"
    }

    fn hidden(&self) -> Hidden {
        Hidden::Final
    }

    fn relative_cost(&self) -> f64 {
        self.net.params_per_step() as f64 / self.target.config.params_per_token().max(1) as f64
    }

    fn commit(&mut self, row: RowId, c: Commit) -> Result<(), Error> {
        let h = self.net.backbone_hidden();
        if c.tokens.is_empty() || c.hidden.len() != c.tokens.len() * h {
            return Err(Error::Request {
                request: format!("row {row}"),
                msg: format!(
                    "assistant commit needs {} hidden floats, got {}",
                    c.tokens.len() * h,
                    c.hidden.len()
                ),
            });
        }
        let last = &c.hidden[(c.tokens.len() - 1) * h..];
        let state = AssistantState { token: c.next, pos: c.start + c.tokens.len(), hidden: last.to_vec() };
        self.rows.insert(row, state);
        Ok(())
    }

    fn propose(&mut self, _asks: &[DraftAsk]) -> Result<Vec<Proposal>, Error> {
        Err(Error::InvalidOption(
            "the Gemma 4 assistant drafts from the target's K/V: call propose_reading".into(),
        ))
    }

    fn propose_reading(&mut self, asks: &[DraftAsk], targets: &[&RowCache]) -> Result<Vec<Proposal>, Error> {
        check_distinct(asks)?;
        if targets.len() != asks.len() {
            return Err(Error::InvalidOption(format!(
                "{} asks with {} target caches",
                asks.len(),
                targets.len()
            )));
        }
        let context = self.target.max_positions();
        let mut drafts: Vec<Proposal> = vec![Proposal::default(); asks.len()];
        let mut next: Vec<(u32, Vec<f32>)> = Vec::with_capacity(asks.len());
        let mut want = Vec::with_capacity(asks.len());
        for (a, cache) in asks.iter().zip(targets) {
            let r = self.rows.get(&a.row).ok_or_else(|| unknown_row(a.row))?;
            if cache.len() != r.pos {
                return Err(Error::Request {
                    request: format!("row {}", a.row),
                    msg: format!(
                        "target cache holds {} positions, the assistant expects {}",
                        cache.len(),
                        r.pos
                    ),
                });
            }
            want.push(a.k.min(context.saturating_sub(r.pos + 1)));
            next.push((r.token, r.hidden.clone()));
        }
        for step in 0.. {
            let active: Vec<usize> = (0..asks.len()).filter(|&i| want[i] > step).collect();
            if active.is_empty() {
                break;
            }
            let rows: Vec<AssistantRow> = active
                .iter()
                .map(|&i| {
                    let pos = targets[i].len();
                    let (full, sliding) = self.net.key_ranges(pos);
                    AssistantRow {
                        token: next[i].0,
                        hidden: &next[i].1,
                        pos,
                        full: (targets[i], full),
                        sliding: targets[i].has_ring().then_some((targets[i], sliding)),
                    }
                })
                .collect();
            let outs = self.net.step(&rows)?;
            for (&i, out) in active.iter().zip(outs) {
                let (d, dist) = draw(&out.logits, &asks[i].sampling, targets[i].len() + 1 + step);
                drafts[i].tokens.push(d);
                drafts[i].dists.extend(dist);
                next[i] = (d, out.hidden);
            }
        }
        Ok(drafts)
    }

    fn remove(&mut self, row: RowId) {
        self.rows.remove(&row);
    }
}
