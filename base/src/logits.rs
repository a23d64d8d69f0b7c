//! The host's logit math: argmax, the log-softmax normaliser, top log-probabilities and the
//! [`LogitSummary`] every backend computes per token. Each sum runs in the canonical 16-lane
//! order (lane `j` takes elements `i ≡ j (mod 16)`, then [`lane_tree`]), which depends on the
//! row's length alone, so the engine, the verifier and the samplers read the same bits
//! whichever backend produced the logits.

/// Lanes of the canonical reduction order.
pub const LANES: usize = 16;

/// The canonical lane tree: `v8[i] = l[i] + l[i+8]`, `v4[i] = v8[i] + v8[i+4]`,
/// `v2[i] = v4[i] + v4[i+2]`, `r = v2[0] + v2[1]` (every kernel's reductions end with it).
#[inline(always)]
pub fn lane_tree(l: [f32; LANES]) -> f32 {
    let mut v8 = [0.0f32; 8];
    for i in 0..8 {
        v8[i] = l[i] + l[i + 8];
    }
    let mut v4 = [0.0f32; 4];
    for i in 0..4 {
        v4[i] = v8[i] + v8[i + 4];
    }
    let v2 = [v4[0] + v4[2], v4[1] + v4[3]];
    v2[0] + v2[1]
}

/// Sum in the canonical 16-lane order (lane j takes i ≡ j mod 16, then the fixed tree).
pub fn canonical_sum(x: &[f32]) -> f32 {
    canonical_sum_of(x, |v| v)
}

/// `canonical_sum` of `f(x[i])`, without storing the values.
fn canonical_sum_of(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            lanes[j] += f(c[j]);
        }
    }
    for (j, &v) in chunks.remainder().iter().enumerate() {
        lanes[j] += f(v);
    }
    lane_tree(lanes)
}

/// Logits normalised a block at a time: each block's exponentials in the canonical 16-lane
/// order, the blocks' sums added in block order (`0 + s` is `s`: a row of one block is the
/// plain `canonical_sum`). Blocks run in parallel (a 151,936-entry row's exponentials take
/// ~0.25 ms on one core, on every decode step's critical path); the order, so the bits,
/// depend on the row's length alone.
const SOFTMAX_BLOCK: usize = 16_384;

/// Natural-log softmax normaliser of a logit row: returns `(max, ln(sum(exp(x - max))))`,
/// so `logprob(t) = (x[t] - max) - lse` (the sum per [`SOFTMAX_BLOCK`]).
pub fn log_softmax_parts(logits: &[f32]) -> (f32, f32) {
    use rayon::prelude::*;
    // max is exact in any order; the sums are added in block order.
    let max = logits.par_chunks(SOFTMAX_BLOCK).map(max_of).reduce(|| f32::NEG_INFINITY, f32::max);
    let sums: Vec<f32> =
        logits.par_chunks(SOFTMAX_BLOCK).map(|b| canonical_sum_of(b, |v| (v - max).exp())).collect();
    (max, sums.iter().fold(0.0f32, |a, &s| a + s).ln())
}

/// What the engine reads from one token's logits when it needs no more than the greedy
/// choice and log-probabilities: computed where the logits are (on a GPU, by one kernel a
/// row), so a greedy step downloads three numbers a token instead of the vocabulary.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitSummary {
    /// [`argmax`]'s token: ties to the lowest id, NaN never wins, 0 when nothing beats -inf.
    pub argmax: u32,
    /// The largest logit (NaN ignored).
    pub max: f32,
    /// `ln(sum(exp(logit - max)))`.
    pub lse: f32,
}

impl LogitSummary {
    /// The host's summary of one row: [`argmax`] and [`log_softmax_parts`].
    pub fn of(logits: &[f32]) -> LogitSummary {
        let (max, lse) = log_softmax_parts(logits);
        LogitSummary { argmax: argmax(logits), max, lse }
    }

    /// Log-probability at temperature 1 of a token whose logit is `logit`.
    pub fn logprob(&self, logit: f32) -> f32 {
        (logit - self.max) - self.lse
    }

    /// [`LogitSummary::logprob`] of the argmax, whose logit is `max` when any logit beats
    /// -inf.
    pub fn argmax_logprob(&self) -> f32 {
        self.logprob(self.max)
    }
}

/// The `n` most likely tokens and their log-probabilities (temperature 1) under `logits`,
/// whose summary is `summary`, most likely first; equal logits go to the lower id.
pub fn top_logprobs(logits: &[f32], summary: &LogitSummary, n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let LogitSummary { max, lse, .. } = *summary;
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(ids.len());
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    ids.select_nth_unstable_by(n.saturating_sub(1), by_logit);
    ids.truncate(n);
    ids.sort_by(by_logit);
    ids.into_iter().map(|t| (t, (logits[t as usize] - max) - lse)).collect()
}

/// Full log-softmax of a row.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let (max, lse) = log_softmax_parts(logits);
    logits.iter().map(|&v| (v - max) - lse).collect()
}

/// The largest value (NaN ignored; -inf for none): 16 independent lanes, so the running
/// maxima do not wait on each other (max is exact: the value of a sequential fold).
fn max_of(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            lanes[j] = lanes[j].max(c[j]);
        }
    }
    chunks.remainder().iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Index of the largest logit; ties go to the lowest id, NaN never wins (0 when nothing
/// beats -inf). Lane j keeps the first maximum of ids j mod 16; the lanes' winners then
/// compare by value, then id: the sequential scan's answer.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best_v = [f32::NEG_INFINITY; LANES];
    let mut best_i = [0u32; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for (ci, c) in (&mut chunks).enumerate() {
        let base = (ci * LANES) as u32;
        for j in 0..LANES {
            let better = c[j] > best_v[j];
            best_v[j] = if better { c[j] } else { best_v[j] };
            best_i[j] = if better { base + j as u32 } else { best_i[j] };
        }
    }
    let tail = (logits.len() - chunks.remainder().len()) as u32;
    let tail = chunks.remainder().iter().enumerate().map(|(j, &v)| (v, tail + j as u32));
    let mut best = (f32::NEG_INFINITY, 0u32);
    for (v, i) in best_v.into_iter().zip(best_i).chain(tail) {
        if v > best.0 || (v == best.0 && v > f32::NEG_INFINITY && i < best.1) {
            best = (v, i);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The normaliser is, bit for bit, `canonical_sum` over the stored exponentials of
    /// each block, the blocks added in order, however many threads run the blocks (lengths
    /// with a remainder past the 16 lanes and past the last block, one without, one block).
    /// Control: one canonical sum over a whole long row gives other bits.
    #[test]
    fn log_softmax_parts_sums_blocks_in_order_on_any_thread_count() {
        let mut control_differs = false;
        for n in [151_936usize + 7, 3 * SOFTMAX_BLOCK, SOFTMAX_BLOCK, 64] {
            let logits: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.031).collect();
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_of(&logits).to_bits(), max.to_bits());
            let exps: Vec<f32> = logits.iter().map(|&v| (v - max).exp()).collect();
            let want = exps.chunks(SOFTMAX_BLOCK).map(canonical_sum).fold(0.0f32, |a, s| a + s).ln();
            for threads in [1, 3, 8] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let (m, lse) = pool.install(|| log_softmax_parts(&logits));
                assert_eq!(
                    (m.to_bits(), lse.to_bits()),
                    (max.to_bits(), want.to_bits()),
                    "n {n}, {threads} threads"
                );
            }
            control_differs |= canonical_sum(&exps).ln().to_bits() != want.to_bits();
        }
        assert!(control_differs, "one whole-row sum matched the blocked one: the check cannot see the order");
    }

    /// The lane-wise argmax is the sequential scan's: first maximum wins, NaN never does,
    /// 0 when nothing beats -inf; ties placed in every lane and in the tail.
    #[test]
    fn argmax_matches_the_sequential_scan() {
        let scan = |x: &[f32]| {
            let (mut best, mut best_v) = (0usize, f32::NEG_INFINITY);
            for (i, &v) in x.iter().enumerate() {
                if v > best_v {
                    (best, best_v) = (i, v);
                }
            }
            best as u32
        };
        let mut rows: Vec<Vec<f32>> = vec![
            vec![],
            vec![f32::NAN; 40],
            vec![f32::NEG_INFINITY; 37],
            vec![1.0; 35],
            (0..100).map(|i| if i == 50 { f32::NAN } else { (i % 7) as f32 }).collect(),
            (0..21).map(|i| if i >= 16 { 9.0 } else { 1.0 }).collect(),
        ];
        let mut seed = 7u64;
        for n in [1usize, 15, 16, 17, 64, 1000, 151_936] {
            rows.push(
                (0..n)
                    .map(|_| {
                        seed = seed
                            .wrapping_mul(6_364_136_223_846_793_005)
                            .wrapping_add(1_442_695_040_888_963_407);
                        ((seed >> 33) % 50) as f32 // few distinct values: many ties
                    })
                    .collect(),
            );
        }
        for row in &rows {
            assert_eq!(argmax(row), scan(row), "{} logits", row.len());
        }
    }
}
