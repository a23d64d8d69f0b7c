//! One position of modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

use crate::dist::{sample_residual, Dist};
use crate::negative_control::{biased_rejection, position_for};
use crate::rng::{uniform, Purpose};

/// What the target makes of one draft token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Judgement {
    Accept,
    /// Rejected: the position gets this token instead, and the round ends.
    Replace(u32),
}

/// Keeps the draft `x`, proposed from `q`, with probability `min(1, p(x) / q(x))` using
/// the uniform keyed by (seed, position); on rejection draws the replacement from
/// `norm(max(0, p - q))`. The position's token is then distributed exactly as `p`.
pub fn judge_draft(p: &Dist, q: &Dist, x: u32, seed: u64, position: u64) -> Judgement {
    let u = uniform(seed, position_for(position), Purpose::Accept, 0);
    if u * (q.prob(x) as f64) < p.prob(x) as f64 {
        return Judgement::Accept;
    }
    if biased_rejection() {
        // The classic bug: resampling from p itself over-weights what q already covered.
        return Judgement::Replace(sample_residual(p, &Dist::default(), seed, position));
    }
    Judgement::Replace(sample_residual(p, q, seed, position))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::Filtered;
    use crate::negative_control::set_biased_rejection;
    use crate::SamplingParams;

    fn dist(probs: &[f32]) -> Dist {
        let ids = (0..probs.len() as u32).filter(|&i| probs[i as usize] > 0.0).collect::<Vec<_>>();
        let probs = ids.iter().map(|&i| probs[i as usize]).collect();
        Dist { ids, probs }
    }

    /// Largest |empirical - p| over tokens when each seed proposes a draft from `q`
    /// (keyed Gumbel-max over `q_logits`) and the target judges it against `p`; and the
    /// Hoeffding bound (union over tokens, failure probability 1e-9) it must stay under.
    fn deviation(p: &Dist, q_logits: &[f32], n: u64) -> (f64, f64) {
        let q = Filtered::new(q_logits, &SamplingParams { temperature: 1.0, ..Default::default() });
        let mut counts = vec![0u64; q_logits.len()];
        for seed in 0..n {
            let x = q.sample(seed, 40);
            let token = match judge_draft(p, &q.dist(), x, seed, 40) {
                Judgement::Accept => x,
                Judgement::Replace(t) => t,
            };
            counts[token as usize] += 1;
        }
        let worst = (0..counts.len() as u32)
            .map(|t| (counts[t as usize] as f64 / n as f64 - p.prob(t) as f64).abs())
            .fold(0.0, f64::max);
        let bound = ((2.0 * counts.len() as f64 / 1e-9).ln() / (2.0 * n as f64)).sqrt();
        (worst, bound)
    }

    #[test]
    fn judged_tokens_follow_p_and_a_biased_acceptor_does_not() {
        let p = dist(&[0.5, 0.3, 0.1, 0.1, 0.0, 0.0]);
        // q = softmax of these: mass on tokens 4 and 5 that p lacks, little on token 0.
        let q_logits = [-1.0f32, 0.5, 0.8, -3.0, 1.0, 0.2];
        let (worst, bound) = deviation(&p, &q_logits, 60_000);
        assert!(worst < bound, "lossless: deviation {worst:.4} >= bound {bound:.4}");
        set_biased_rejection(true);
        let (biased, bound) = deviation(&p, &q_logits, 60_000);
        set_biased_rejection(false);
        assert!(biased > bound, "the biased acceptor must fail: {biased:.4} <= {bound:.4}");
    }

    #[test]
    fn one_hot_drafts_are_judged_losslessly() {
        let p = dist(&[0.2, 0.5, 0.3]);
        let n = 40_000u64;
        let mut counts = [0u64; 3];
        for seed in 0..n {
            let token = match judge_draft(&p, &Dist::one_hot(1), 1, seed, 7) {
                Judgement::Accept => 1,
                Judgement::Replace(t) => t,
            };
            counts[token as usize] += 1;
        }
        let bound = ((2.0 * 3.0 / 1e-9f64).ln() / (2.0 * n as f64)).sqrt();
        for t in 0..3u32 {
            let dev = (counts[t as usize] as f64 / n as f64 - p.prob(t) as f64).abs();
            assert!(dev < bound, "token {t}: {counts:?}");
        }
    }
}
