//! The distribution a position samples from, and Gumbel-max picks with keyed noise.
//!
//! Every step is deterministic given the logits' bits: sums run in id order (or in a
//! fixed sorted order for top-p), ties go to the lowest id.

use std::cmp::Ordering;

use mtp_model::kernels::argmax;

use crate::negative_control::position_for;
use crate::rng::{gumbel, Purpose, GUMBEL_MAX};
use crate::SamplingParams;

/// A sparse distribution: kept token ids (ascending) and their probabilities (sum 1).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dist {
    pub ids: Vec<u32>,
    pub probs: Vec<f32>,
}

impl Dist {
    /// Probability of `token` (0 outside the support).
    pub fn prob(&self, token: u32) -> f32 {
        self.ids.binary_search(&token).map_or(0.0, |i| self.probs[i])
    }

    /// All mass on one token (a drafter without a distribution).
    pub fn one_hot(token: u32) -> Dist {
        Dist { ids: vec![token], probs: vec![1.0] }
    }
}

/// Temperature-scaled logits restricted to what top-k, top-p and min-p keep.
pub struct Filtered {
    /// `logit / temperature` for every id.
    scaled: Vec<f32>,
    pub dist: Dist,
}

/// Orders candidates most likely first, ties by lower id.
fn likelier(e: &[f64], a: u32, b: u32) -> Ordering {
    e[b as usize].total_cmp(&e[a as usize]).then(a.cmp(&b))
}

impl Filtered {
    /// The sampling distribution of `logits` under `params` (temperature must be > 0).
    pub fn new(logits: &[f32], params: &SamplingParams) -> Filtered {
        debug_assert!(!params.is_greedy(), "Filtered needs temperature > 0");
        let scaled: Vec<f32> = logits
            .iter()
            .map(|&z| if z.is_nan() { f32::NEG_INFINITY } else { z / params.temperature })
            .collect();
        let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Relative weights; the most likely token has weight exactly 1.
        let e: Vec<f64> = scaled.iter().map(|&s| ((s - max) as f64).exp()).collect();
        let mut keep: Vec<u32> = (0..e.len() as u32).filter(|&i| e[i as usize] > 0.0).collect();
        if keep.is_empty() {
            keep.push(argmax(logits)); // every logit is -inf or NaN: fall back to one token
        }
        if params.top_k > 0 && params.top_k < keep.len() {
            keep.select_nth_unstable_by(params.top_k - 1, |&a, &b| likelier(&e, a, b));
            keep.truncate(params.top_k);
            keep.sort_unstable();
        }
        if params.top_p < 1.0 {
            keep = top_p(&e, keep, params.top_p as f64);
        }
        if params.min_p > 0.0 {
            keep.retain(|&i| e[i as usize] >= params.min_p as f64);
        }
        let z: f64 = keep.iter().map(|&i| e[i as usize]).sum();
        let probs = keep.iter().map(|&i| (e[i as usize] / z) as f32).collect();
        Filtered { scaled, dist: Dist { ids: keep, probs } }
    }

    /// The Gumbel-max pick over the kept tokens with noise keyed by (seed, position):
    /// a draw from [`Filtered::dist`].
    pub fn sample(&self, seed: u64, position: u64) -> u32 {
        let score = |i: u32| self.scaled[i as usize] as f64;
        gumbel_max(&self.dist.ids, score, seed, position, Purpose::Sample)
    }
}

/// The smallest most-likely-first prefix of `keep` whose mass reaches `top_p`, ids
/// ascending. Only candidates above a weight threshold are sorted; the threshold drops
/// until they hold enough mass, so the result equals sorting everything.
fn top_p(e: &[f64], keep: Vec<u32>, top_p: f64) -> Vec<u32> {
    let total: f64 = keep.iter().map(|&i| e[i as usize]).sum();
    let need = top_p * total;
    for threshold in [1e-2, 1e-4, 1e-8, 0.0] {
        let mut cand: Vec<u32> = keep.iter().copied().filter(|&i| e[i as usize] >= threshold).collect();
        cand.sort_unstable_by(|&a, &b| likelier(e, a, b));
        let mut mass = 0.0;
        if let Some(n) = cand.iter().position(|&i| {
            mass += e[i as usize];
            mass >= need
        }) {
            cand.truncate(n + 1);
            cand.sort_unstable();
            return cand;
        }
        if threshold == 0.0 {
            cand.sort_unstable(); // rounding left the mass just short: keep everything
            return cand;
        }
    }
    unreachable!("the last threshold keeps every candidate")
}

/// argmax over `ids` of `score(id) + gumbel(seed, position, purpose, id)`, ties to the
/// lowest id. Candidates that cannot win whatever their noise are skipped.
fn gumbel_max(ids: &[u32], score: impl Fn(u32) -> f64, seed: u64, position: u64, purpose: Purpose) -> u32 {
    let position = position_for(position);
    let top = ids.iter().copied().max_by(|&a, &b| score(a).total_cmp(&score(b)).then(b.cmp(&a)));
    let Some(top) = top else { return 0 };
    let mut best = (score(top) + gumbel(seed, position, purpose, top), top);
    for &i in ids {
        let s = score(i);
        if i == top || s + GUMBEL_MAX < best.0 {
            continue;
        }
        let v = s + gumbel(seed, position, purpose, i);
        if v > best.0 || (v == best.0 && i < best.1) {
            best = (v, i);
        }
    }
    best.1
}

/// The token plain decoding emits at `position` from `logits`: the argmax at
/// temperature 0, else a keyed Gumbel-max draw from the filtered distribution.
pub fn pick(logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
    if params.is_greedy() {
        argmax(logits)
    } else {
        Filtered::new(logits, params).sample(params.seed, position)
    }
}

/// A draw from `norm(max(0, p - q))` with noise keyed by (seed, position), the
/// replacement token after a rejected draft. Falls back to `p` if the residual is empty.
pub fn sample_residual(p: &Dist, q: &Dist, seed: u64, position: u64) -> u32 {
    let residual: Vec<(u32, f32)> =
        p.ids.iter().zip(&p.probs).map(|(&i, &pi)| (i, pi - q.prob(i))).filter(|&(_, r)| r > 0.0).collect();
    let (ids, weights): (Vec<u32>, Vec<f32>) =
        if residual.is_empty() { (p.ids.clone(), p.probs.clone()) } else { residual.into_iter().unzip() };
    let score = |i: u32| {
        let at = ids.binary_search(&i).expect("scored ids come from the list");
        (weights[at] as f64).ln()
    };
    gumbel_max(&ids, score, seed, position, Purpose::Residual)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, ..SamplingParams::default() }
    }

    #[test]
    fn filters_keep_what_they_promise() {
        let logits = [2.0f32, 1.0, 0.5, 3.0, -1.0, 3.0];
        let all = Filtered::new(&logits, &params(1.0)).dist;
        assert_eq!(all.ids, vec![0, 1, 2, 3, 4, 5]);
        assert!((all.probs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let k2 = Filtered::new(&logits, &SamplingParams { top_k: 3, ..params(1.0) }).dist;
        assert_eq!(k2.ids, vec![0, 3, 5], "top-3 of (3, 3, 2)");
        // p(3) = p(5) ~ 0.37, p(0) ~ 0.14: top-p 0.7 needs both 3.0s (0.74).
        let p = Filtered::new(&logits, &SamplingParams { top_p: 0.7, ..params(1.0) }).dist;
        assert_eq!(p.ids, vec![3, 5]);
        let m = Filtered::new(&logits, &SamplingParams { min_p: 0.3, ..params(1.0) }).dist;
        assert_eq!(m.ids, vec![0, 3, 5], "e^-1 = 0.37 >= 0.3 > e^-2");
        assert_eq!(m.prob(3), m.prob(5));
        assert_eq!(m.prob(1), 0.0);
    }

    #[test]
    fn top_p_equals_a_full_sort() {
        let logits: Vec<f32> = (0..3000).map(|i| ((i * 7919) % 1000) as f32 / 40.0 - 10.0).collect();
        for top_p_value in [0.05f32, 0.5, 0.9, 0.999, 0.99999] {
            let e: Vec<f64> = {
                let max = logits.iter().copied().fold(f32::MIN, f32::max);
                logits.iter().map(|&s| ((s - max) as f64).exp()).collect()
            };
            let mut all: Vec<u32> = (0..3000).collect();
            all.sort_by(|&a, &b| likelier(&e, a, b));
            let total: f64 = (0..3000).map(|i| e[i]).sum();
            let mut mass = 0.0;
            let n = all.iter().position(|&i| {
                mass += e[i as usize];
                mass >= top_p_value as f64 * total
            });
            let mut want = all[..=n.unwrap_or(2999)].to_vec();
            want.sort();
            let got = Filtered::new(&logits, &SamplingParams { top_p: top_p_value, ..params(1.0) }).dist;
            assert_eq!(got.ids, want, "top_p {top_p_value}");
        }
    }

    #[test]
    fn gumbel_max_draws_follow_the_distribution() {
        let logits = [0.0f32, 1.0, 2.0, -0.5];
        let f = Filtered::new(&logits, &params(0.8));
        let n = 40_000;
        let mut counts = [0usize; 4];
        for seed in 0..n {
            counts[f.sample(seed, 17) as usize] += 1;
        }
        // Hoeffding with a union bound over 4 tokens at failure probability 1e-9.
        let eps = ((2.0 * 4.0 / 1e-9f64).ln() / (2.0 * n as f64)).sqrt();
        for (c, p) in counts.iter().zip(&f.dist.probs) {
            assert!((*c as f64 / n as f64 - *p as f64).abs() < eps, "{counts:?} vs {:?}", f.dist.probs);
        }
    }

    #[test]
    fn picks_are_keyed_and_greedy_at_zero() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 37) % 101) as f32 / 30.0).collect();
        assert_eq!(pick(&logits, &params(0.0), 5), argmax(&logits));
        let p = SamplingParams { seed: 9, ..params(1.0) };
        assert_eq!(pick(&logits, &p, 5), pick(&logits, &p, 5));
        let distinct: std::collections::HashSet<u32> = (0..50).map(|pos| pick(&logits, &p, pos)).collect();
        assert!(distinct.len() > 5, "different positions draw differently: {distinct:?}");
    }

    #[test]
    fn residual_never_picks_where_q_covers_p() {
        let p = Dist { ids: vec![0, 1, 2], probs: vec![0.5, 0.3, 0.2] };
        let q = Dist { ids: vec![0, 1, 2], probs: vec![0.6, 0.4, 0.0] };
        for seed in 0..200 {
            assert_eq!(sample_residual(&p, &q, seed, 3), 2, "only token 2 has p > q");
        }
    }
}
