//! Constrained rows' part of the round (see docs/design.md, "Constrained rows in the
//! round"): each row's masks come from its own guide, walked along its own draft; the
//! first token of a row is picked from its masked logits. The rollback after
//! verification is `Guide::settle`, called in `Engine::commit`.

use mtp_base::Error;
use mtp_constraint::{Guide, TokenMask};
use mtp_drafter::Proposal;
use mtp_sampling::{pick, SamplingParams};
use rayon::prelude::*;

/// Per row (`guides[i]`: `None` for an unconstrained row), the masks of its window
/// positions (`walked + 1` of them) and its grammar's failure. A failed row is verified
/// unconstrained, then failed in `Engine::commit`.
#[allow(clippy::type_complexity)]
pub(crate) fn walk_masks(
    guides: Vec<Option<&mut Guide>>,
    drafts: &[Proposal],
) -> (Vec<Option<Vec<TokenMask>>>, Vec<Option<String>>) {
    // Rows walk in parallel: each guide is its row's alone.
    let walked: Vec<Option<Result<Vec<TokenMask>, String>>> =
        guides.into_par_iter().zip(drafts).map(|(g, d)| g.map(|g| g.walk(&d.tokens))).collect();
    let mut errors = vec![None; walked.len()];
    let mut masks: Vec<Option<Vec<TokenMask>>> = walked
        .into_iter()
        .zip(&mut errors)
        .map(|(w, err)| match w? {
            Ok(m) => Some(m),
            Err(e) => {
                *err = Some(e);
                None
            }
        })
        .collect();
    if mtp_constraint::negative_control::foreign_masks() {
        // Test-only fault: each constrained row gets the next constrained row's masks.
        let rows: Vec<usize> = (0..masks.len()).filter(|&i| masks[i].is_some()).collect();
        let taken: Vec<Vec<TokenMask>> = rows.iter().map(|&i| masks[i].take().expect("some")).collect();
        for (j, &i) in rows.iter().enumerate() {
            let mut m = taken[(j + 1) % rows.len()].clone();
            m.truncate(taken[j].len());
            masks[i] = Some(m);
        }
    }
    (masks, errors)
}

/// A constrained row's first token: the pick from the masked logits at the prompt's end,
/// consumed by its guide; with the count of tokens after which the grammar is complete.
pub(crate) fn first_masked(
    guide: &mut Guide,
    logits: &[f32],
    sampling: &SamplingParams,
    position: usize,
) -> Result<(u32, Option<usize>), String> {
    let mut masked = logits.to_vec();
    guide.mask()?.apply(&mut masked);
    let first = pick(&masked, sampling, position as u64);
    Ok((first, guide.settle(0, first)?))
}

/// A row's grammar failure as the request's error.
pub(crate) fn grammar_error(name: &str, msg: String) -> Error {
    Error::Request { request: name.to_string(), msg: format!("grammar: {msg}") }
}
