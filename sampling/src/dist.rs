//! The distribution a position samples from, and picks with keyed noise.
//!
//! A pick is a Gumbel-max draw written as an exponential race: with `u_i` the keyed
//! uniform of token `i` and `w_i` its weight, the token minimising `-ln(u_i) / w_i` wins
//! (the same token as `argmax ln(w_i) - ln(-ln(u_i))`). Target and drafters use the same
//! `u_i` at a position, so similar distributions pick the same token.
//!
//! Every step is deterministic given the logits' bits: sums run in id order (or in a
//! fixed sorted order for top-p), ties go to the lowest id.

use std::cmp::Ordering;

use mtp_base::logits::argmax;

use crate::negative_control::position_for;
use crate::rng::{uniform_pair, Purpose};
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
#[derive(Clone, Debug, PartialEq)]
pub struct Filtered {
    /// Kept ids, ascending.
    ids: Vec<u32>,
    /// `exp((logit - max logit) / temperature)` of each kept id: the most likely has 1.
    weights: Vec<f32>,
}

/// Orders candidates most likely first, ties by lower id.
fn likelier(w: &[f32], a: u32, b: u32) -> Ordering {
    w[b as usize].total_cmp(&w[a as usize]).then(a.cmp(&b))
}

impl Filtered {
    /// The sampling distribution of `logits` under `params` (temperature must be > 0).
    pub fn new(logits: &[f32], params: &SamplingParams) -> Filtered {
        debug_assert!(!params.is_greedy(), "Filtered needs temperature > 0");
        let top = argmax(logits);
        let max = logits[top as usize];
        let inv_t = 1.0 / params.temperature;
        // Relative weights over the whole vocabulary; the most likely token has exactly 1.
        let w: Vec<f32> =
            logits.iter().map(|&z| if z.is_nan() { 0.0 } else { ((z - max) * inv_t).exp() }).collect();
        let mut keep: Vec<u32> = (0..w.len() as u32).filter(|&i| w[i as usize] > 0.0).collect();
        if keep.is_empty() {
            keep.push(top); // every logit is -inf or NaN: fall back to one token
        }
        if params.top_k > 0 && params.top_k < keep.len() {
            keep.select_nth_unstable_by(params.top_k - 1, |&a, &b| likelier(&w, a, b));
            keep.truncate(params.top_k);
            keep.sort_unstable();
        }
        if params.top_p < 1.0 {
            keep = top_p(&w, keep, params.top_p as f64);
        }
        if params.min_p > 0.0 {
            keep.retain(|&i| w[i as usize] >= params.min_p);
        }
        let weights = keep.iter().map(|&i| w[i as usize].max(f32::MIN_POSITIVE)).collect();
        Filtered { ids: keep, weights }
    }

    /// Normalised probabilities of the kept tokens.
    pub fn dist(&self) -> Dist {
        let z: f64 = self.weights.iter().map(|&w| w as f64).sum();
        Dist { ids: self.ids.clone(), probs: self.weights.iter().map(|&w| (w as f64 / z) as f32).collect() }
    }

    /// The keyed pick at (seed, position): a draw from [`Filtered::dist`].
    pub fn sample(&self, seed: u64, position: u64) -> u32 {
        race(&self.ids, &self.weights, seed, position, Purpose::Sample)
    }
}

/// The smallest most-likely-first prefix of `keep` whose mass reaches `top_p`, ids
/// ascending. Only candidates above a weight threshold are sorted; the threshold drops
/// until they hold enough mass, so the result equals sorting everything.
fn top_p(w: &[f32], keep: Vec<u32>, top_p: f64) -> Vec<u32> {
    let total: f64 = keep.iter().map(|&i| w[i as usize] as f64).sum();
    let need = top_p * total;
    for threshold in [1e-2, 1e-4, 1e-8, 0.0] {
        let mut cand: Vec<u32> = keep.iter().copied().filter(|&i| w[i as usize] >= threshold).collect();
        cand.sort_unstable_by(|&a, &b| likelier(w, a, b));
        let mut mass = 0.0;
        if let Some(n) = cand.iter().position(|&i| {
            mass += w[i as usize] as f64;
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

/// argmin over `ids` of `-ln(u_i) / w_i` with `u_i` keyed by (seed, position, purpose,
/// id), ties to the lowest id. Since `-ln(u) >= 1 - u`, a token with
/// `1 - u_i >= best * w_i` cannot win and needs no logarithm: on average about one token
/// per pick does.
fn race(ids: &[u32], weights: &[f32], seed: u64, position: u64, purpose: Purpose) -> u32 {
    let position = position_for(position);
    let u = |i: u32| uniform_pair(seed, position, purpose, i / 2)[(i % 2) as usize];
    // Start from the heaviest token so the bound prunes from the first candidate on.
    let Some(first) = (0..ids.len()).max_by(|&a, &b| weights[a].total_cmp(&weights[b]).then(b.cmp(&a)))
    else {
        return 0;
    };
    let mut best = (-u(ids[first]).ln() / weights[first] as f64, ids[first]);
    let mut pair = (u32::MAX, [0.0; 2]);
    for (&i, &w) in ids.iter().zip(weights) {
        if i == ids[first] {
            continue;
        }
        if pair.0 != i / 2 {
            pair = (i / 2, uniform_pair(seed, position, purpose, i / 2));
        }
        let ui = pair.1[(i % 2) as usize];
        let w = w as f64;
        // The margin keeps the skip exact despite rounding in ln and the division.
        if (1.0 - ui) * (1.0 - 1e-9) >= best.0 * w {
            continue;
        }
        let v = -ui.ln() / w;
        if v < best.0 || (v == best.0 && i < best.1) {
            best = (v, i);
        }
    }
    best.1
}

/// The token plain decoding emits at `position` from `logits`: the argmax at
/// temperature 0, else the keyed pick from the filtered distribution.
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
    race(&ids, &weights, seed, position, Purpose::Residual)
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
        let all = Filtered::new(&logits, &params(1.0)).dist();
        assert_eq!(all.ids, vec![0, 1, 2, 3, 4, 5]);
        assert!((all.probs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let k2 = Filtered::new(&logits, &SamplingParams { top_k: 3, ..params(1.0) }).dist();
        assert_eq!(k2.ids, vec![0, 3, 5], "top-3 of (3, 3, 2)");
        // p(3) = p(5) ~ 0.37, p(0) ~ 0.14: top-p 0.7 needs both 3.0s (0.74).
        let p = Filtered::new(&logits, &SamplingParams { top_p: 0.7, ..params(1.0) }).dist();
        assert_eq!(p.ids, vec![3, 5]);
        let m = Filtered::new(&logits, &SamplingParams { min_p: 0.3, ..params(1.0) }).dist();
        assert_eq!(m.ids, vec![0, 3, 5], "e^-1 = 0.37 >= 0.3 > e^-2");
        assert_eq!(m.prob(3), m.prob(5));
        assert_eq!(m.prob(1), 0.0);
    }

    #[test]
    fn top_p_equals_a_full_sort() {
        let logits: Vec<f32> = (0..3000).map(|i| ((i * 7919) % 1000) as f32 / 40.0 - 10.0).collect();
        for top_p_value in [0.05f32, 0.5, 0.9, 0.999, 0.99999] {
            let e: Vec<f32> = {
                let max = logits.iter().copied().fold(f32::MIN, f32::max);
                logits.iter().map(|&s| (s - max).exp()).collect()
            };
            let mut all: Vec<u32> = (0..3000).collect();
            all.sort_by(|&a, &b| likelier(&e, a, b));
            let total: f64 = (0..3000).map(|i| e[i] as f64).sum();
            let mut mass = 0.0;
            let n = all.iter().position(|&i| {
                mass += e[i as usize] as f64;
                mass >= top_p_value as f64 * total
            });
            let mut want = all[..=n.unwrap_or(2999)].to_vec();
            want.sort();
            let got = Filtered::new(&logits, &SamplingParams { top_p: top_p_value, ..params(1.0) }).dist();
            assert_eq!(got.ids, want, "top_p {top_p_value}");
        }
    }

    #[test]
    fn keyed_picks_follow_the_distribution() {
        let logits = [0.0f32, 1.0, 2.0, -0.5];
        let f = Filtered::new(&logits, &params(0.8));
        let n = 40_000;
        let mut counts = [0usize; 4];
        for seed in 0..n {
            counts[f.sample(seed, 17) as usize] += 1;
        }
        // Hoeffding with a union bound over 4 tokens at failure probability 1e-9.
        let eps = ((2.0 * 4.0 / 1e-9f64).ln() / (2.0 * n as f64)).sqrt();
        let d = f.dist();
        for (c, p) in counts.iter().zip(&d.probs) {
            assert!((*c as f64 / n as f64 - *p as f64).abs() < eps, "{counts:?} vs {:?}", d.probs);
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
