//! Which drafts a row keeps, given the target's logits after each window token.

use mtp_sampling::{judge_draft, pick, Dist, Filtered, Judgement, SamplingMode, SamplingParams};

/// Greedy acceptance for one row: the number of draft tokens accepted, i.e. the length
/// of the longest prefix of `draft` equal to the target's choices. `target[i]` is the
/// target's choice after the prefix plus `draft[..i]`, so `target` has `draft.len() + 1`
/// entries and `target[accepted_len]` is the bonus token the target emits next.
pub fn accepted_len(draft: &[u32], target: &[u32]) -> usize {
    assert_eq!(
        target.len(),
        draft.len() + 1,
        "accepted_len: need one target choice per draft plus the bonus"
    );
    draft.iter().zip(target).take_while(|(d, t)| d == t).count()
}

/// Decides a greedy row's round from the target's choice after each window token
/// (`target[j]`, the argmax of the logits there; `draft.len() + 1` of them): the accepted
/// count and the emitted tokens, as [`decide`] makes them at temperature 0.
pub fn decide_greedy(draft: &[u32], target: &[u32]) -> (usize, Vec<u32>) {
    let a = accepted_len(draft, target);
    (a, target[..=a].to_vec())
}

/// Decides a row's round: `logits[j]` follows window token `j` and picks the token at
/// logical position `first_position + j`. Returns the accepted count and the emitted
/// tokens (accepted drafts, then the target's bonus or replacement token).
///
/// - Greedy (temperature 0) and [`SamplingMode::Exact`]: the target's choice at each
///   position is what plain decoding picks there (argmax, or keyed Gumbel-max); drafts
///   are kept while equal to it.
/// - [`SamplingMode::Rejection`]: each draft is judged by modified rejection sampling
///   against `draft_dists[j]` (its drafter's distribution; one-hot when absent).
pub fn decide(
    logits: &[Vec<f32>],
    draft: &[u32],
    draft_dists: &[Filtered],
    params: &SamplingParams,
    mode: SamplingMode,
    first_position: usize,
) -> (usize, Vec<u32>) {
    debug_assert_eq!(logits.len(), draft.len() + 1);
    let at = |j: usize| (first_position + j) as u64;
    let mut tokens = Vec::with_capacity(draft.len() + 1);
    if params.is_greedy() || mode == SamplingMode::Exact {
        for (j, &d) in draft.iter().enumerate() {
            let t = pick(&logits[j], params, at(j));
            tokens.push(t);
            if t != d {
                return (j, tokens);
            }
        }
    } else {
        for (j, &d) in draft.iter().enumerate() {
            let p = Filtered::new(&logits[j], params).dist();
            let q = draft_dists.get(j).map_or_else(|| Dist::one_hot(d), Filtered::dist);
            match judge_draft(&p, &q, d, params.seed, at(j)) {
                Judgement::Accept => tokens.push(d),
                Judgement::Replace(t) => {
                    tokens.push(t);
                    return (j, tokens);
                }
            }
        }
    }
    let k = draft.len();
    tokens.push(pick(&logits[k], params, at(k)));
    (k, tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_matching_prefix() {
        assert_eq!(accepted_len(&[], &[4]), 0);
        assert_eq!(accepted_len(&[1, 2, 3], &[1, 2, 3, 9]), 3);
        assert_eq!(accepted_len(&[1, 2, 3], &[1, 5, 3, 9]), 1);
        assert_eq!(accepted_len(&[7, 2, 3], &[1, 2, 3, 9]), 0);
    }

    fn logits_rows(n: usize) -> Vec<Vec<f32>> {
        (0..n).map(|j| (0..64).map(|i| (((i * 31 + j * 17) % 29) as f32) / 7.0).collect()).collect()
    }

    #[test]
    fn exact_mode_emits_what_plain_decoding_picks() {
        let logits = logits_rows(4);
        let params = SamplingParams { temperature: 0.9, top_k: 20, seed: 5, ..Default::default() };
        let plain: Vec<u32> = (0..4).map(|j| pick(&logits[j], &params, 10 + j as u64)).collect();
        let mode = SamplingMode::Exact;
        // Perfect drafts: all kept, bonus is plain's 4th pick.
        let (a, t) = decide(&logits, &plain[..3], &[], &params, mode, 10);
        assert_eq!((a, t.as_slice()), (3, plain.as_slice()));
        // A wrong second draft: one kept, then plain's second pick.
        let wrong = [plain[0], plain[1] ^ 1, plain[2]];
        let (a, t) = decide(&logits, &wrong, &[], &params, mode, 10);
        assert_eq!((a, t.as_slice()), (1, &plain[..2]));
    }

    #[test]
    fn rejection_mode_keeps_drafts_the_target_would_rarely_refuse() {
        // The target is nearly certain of token 3 at every position: a one-hot draft of 3
        // is kept (p(3) ~ 1 > u), a draft of 4 is replaced by 3.
        let row: Vec<f32> = (0..8).map(|i| if i == 3 { 30.0 } else { 0.0 }).collect();
        let logits = vec![row; 3];
        let params = SamplingParams { temperature: 1.0, seed: 1, ..Default::default() };
        assert_eq!(decide(&logits, &[3, 3], &[], &params, SamplingMode::Rejection, 0), (2, vec![3, 3, 3]));
        assert_eq!(decide(&logits, &[3, 4], &[], &params, SamplingMode::Rejection, 0), (1, vec![3, 3]));
    }
}
