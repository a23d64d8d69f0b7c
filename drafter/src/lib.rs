//! Drafters propose tokens for the target to verify. One interface, several kinds:
//! a separate draft model ([`DraftModelDrafter`]), an MTP head ([`MtpDrafter`]), an
//! EAGLE-3 head reading the target's tapped layers ([`Eagle3Drafter`]), Gemma 4's
//! assistant reading the target's K/V ([`AssistantDrafter`]), n-gram
//! prompt lookup ([`NgramDrafter`]) and, for benchmarks and tests, an [`OracleDrafter`]
//! that replays the target's own continuation with controlled corruption.
//!
//! Contract with the engine, per row: every time the target commits positions it calls
//! [`Drafter::commit`] (first with the prompt, then after every verify), which also rolls
//! back whatever the drafter computed past the accepted prefix; between commits it calls
//! [`Drafter::propose`] at most once.

mod assistant;
mod draft_model;
mod eagle3;
mod head;
mod mtp;
mod ngram;
mod oracle;
mod sequences;

pub use assistant::AssistantDrafter;
pub use draft_model::DraftModelDrafter;
pub use eagle3::Eagle3Drafter;
pub use mtp::MtpDrafter;
pub use ngram::NgramDrafter;
pub use oracle::OracleDrafter;

use mtp_base::logits::argmax;
use mtp_base::Error;
use mtp_cache::RowCache;
use mtp_model::Hidden;
use mtp_sampling::{Filtered, SamplingParams};

/// The engine's handle for a row (unique for the engine's lifetime).
pub type RowId = u64;

/// What the target committed for a row: `tokens` at logical positions
/// `[start, start + tokens.len())`, and `next`, the token the target emitted after them
/// (not yet run through the target).
#[derive(Clone, Copy, Debug)]
pub struct Commit<'a> {
    pub start: usize,
    pub tokens: &'a [u32],
    /// The target's hidden states at each of those positions, [`Drafter::hidden`]'s kind
    /// (`tokens.len() * width` floats: [`Hidden::width`]); empty when it wants none.
    pub hidden: &'a [f32],
    pub next: u32,
}

/// One row's request for drafts: up to `k` tokens, drawn the way the row samples.
#[derive(Clone, Copy, Debug)]
pub struct DraftAsk {
    pub row: RowId,
    pub k: usize,
    pub sampling: SamplingParams,
}

impl DraftAsk {
    pub fn greedy(row: RowId, k: usize) -> DraftAsk {
        DraftAsk { row, k, sampling: SamplingParams::default() }
    }
}

/// A row's drafts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// The distribution each token was drawn from, when the drafter sampled from one
    /// (temperature > 0); empty when its drafts are deterministic (one-hot).
    pub dists: Vec<Filtered>,
}

/// Proposes draft tokens for many rows at once and keeps per-row state in step with the
/// target.
pub trait Drafter {
    /// A short name for tables and logs (`draft-model`, `mtp`, `eagle3`, `ngram`, `oracle`).
    fn name(&self) -> &str;

    /// Which of the target's hidden states commits must carry (none by default).
    fn hidden(&self) -> Hidden {
        Hidden::None
    }

    /// Work of one draft step for one row relative to one target decode step (weights
    /// multiplied per token): what a draft costs where timings may not be used (0 for
    /// drafters that run no model).
    fn relative_cost(&self) -> f64 {
        0.0
    }

    /// KV bytes the drafter holds per row position (for the engine's memory budget).
    fn kv_bytes_per_token(&self) -> usize {
        0
    }

    /// Records a commit for `row` (a row is created by its first commit, at start 0) and
    /// discards any drafter state past the committed prefix.
    fn commit(&mut self, row: RowId, commit: Commit) -> Result<(), Error>;

    /// Up to `k` tokens to follow each asking row, one proposal per ask; fewer or none is
    /// allowed. Drafters with a distribution sample at temperature > 0 with the row's
    /// keyed noise for each draft's position, so they agree with the target as often as
    /// their distributions allow.
    fn propose(&mut self, asks: &[DraftAsk]) -> Result<Vec<Proposal>, Error>;

    /// [`Drafter::propose`] with each asking row's target cache (`targets[i]` for
    /// `asks[i]`, committed positions only): what the engine calls, for drafters that read
    /// the target's K/V.
    fn propose_reading(&mut self, asks: &[DraftAsk], targets: &[&RowCache]) -> Result<Vec<Proposal>, Error> {
        let _ = targets;
        self.propose(asks)
    }

    /// Forgets a row that finished or was cancelled.
    fn remove(&mut self, row: RowId);
}

fn unknown_row(row: RowId) -> Error {
    Error::Request { request: format!("row {row}"), msg: "drafter has no state for this row".into() }
}

/// Refuses a proposal request that names a row twice.
fn check_distinct(asks: &[DraftAsk]) -> Result<(), Error> {
    let mut ids: Vec<RowId> = asks.iter().map(|a| a.row).collect();
    ids.sort_unstable();
    match ids.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(Error::Request {
            request: format!("row {}", w[0]),
            msg: "proposed for twice in one call".into(),
        }),
        None => Ok(()),
    }
}

/// Mutable state of the rows `ids` (distinct, all present), in `ids` order.
fn states_of<'a, T>(states: &'a mut std::collections::HashMap<RowId, T>, ids: &[RowId]) -> Vec<&'a mut T> {
    let mut found: std::collections::HashMap<RowId, &'a mut T> =
        states.iter_mut().filter(|(id, _)| ids.contains(id)).map(|(&id, s)| (id, s)).collect();
    ids.iter().map(|id| found.remove(id).expect("row state exists")).collect()
}

/// A drafter's token for logical `position` from its logits: the argmax when greedy, else
/// the keyed Gumbel-max draw plain decoding would make with these logits, and the
/// distribution it came from.
fn draw(logits: &[f32], sampling: &SamplingParams, position: usize) -> (u32, Option<Filtered>) {
    if sampling.is_greedy() {
        return (argmax(logits), None);
    }
    let f = Filtered::new(logits, sampling);
    (f.sample(sampling.seed, position as u64), Some(f))
}
