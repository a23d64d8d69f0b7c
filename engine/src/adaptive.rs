//! How many drafts each row gets per round (adaptive k).
//!
//! A row's output is bitwise the same for any k (greedy and exact sampling), so k may
//! change per row and per round without changing a bit. [`KChooser`] picks, each round,
//! the k's that maximise the batch's expected emitted tokens per second, from what the
//! engine measured so far:
//! - acceptance per draft position, conditional on the drafts before it being accepted:
//!   decayed counts per row, with the drafter's overall counts as the row's prior, weighed
//!   by how much the batch's rows differ beyond chance (alike rows share one k);
//! - a row's tokens weighed by how far it has to go against the batch's mean (the last row
//!   to finish runs on in a thinner batch);
//! - verify cost (the whole round except drafting) by the batch's verify tokens: the
//!   decayed mean at each count seen, a line between the nearest seen on either side;
//! - draft cost as a line in draft steps (the longest row's k), draft tokens and catch-up
//!   (positions an idle drafter must run through first, paid once when a row starts).
//!
//! Until a verify has been timed (the first round is warm-up; on CUDA a verify shape's first
//! run and its recording teach nothing) it judges by priors in plain rounds: a verify token
//! past a plain round's costs a fixed share of one, a draft step the drafter's relative cost.
//!
//! It judges each row at every depth it could reach but at most doubles its k (plus one)
//! per round (so a wrong guess costs little, and a row whose drafts keep landing reaches
//! k = 8 in four rounds, not eight), starts a row only for a clear gain, and when
//! speculation does not pay it drafts nothing, probing one row with k = 1 at growing
//! intervals where optimism says it might pay.
//! Where the backend verifies tokens in groups (CUDA's MMAs take 8 tokens; a partial group
//! costs a whole one), a drafting batch's verify tokens are topped up to a whole group with
//! the drafts likeliest to be accepted, at no more draft steps: free tokens, and a few
//! recurring verify shapes (each new one costs a CUDA graph's first run and recording).
//! Rows in rejection mode at T > 0 are the exception: which positions had drafts changes
//! their output, so their k must depend on nothing but their own history (not on the
//! batch, not on timings): they use their own acceptance and a fixed cost per draft (the
//! drafter's weights relative to the target's, plus a fixed verify share).

use std::collections::HashMap;

use mtp_drafter::RowId;

/// The most drafts a row may get in one round (`k`, fixed or adaptive's bound): deeper
/// chains verify nothing useful, and the chooser and verify windows size buffers by it.
pub const MAX_DRAFT_TOKENS: usize = 64;

/// How many drafts each row gets per round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftLen {
    /// This many (fewer only near `max_tokens` or the context).
    Fixed(usize),
    /// Chosen per row and round, at most this many, to maximise tokens per second.
    Adaptive(usize),
}

impl DraftLen {
    /// The most drafts a row can get in one round.
    pub fn max(self) -> usize {
        match self {
            DraftLen::Fixed(k) | DraftLen::Adaptive(k) => k,
        }
    }
}

/// Conditional acceptance of a fresh drafter at draft position 1; deeper positions start
/// from the estimate of the position before.
const PRIOR_ACCEPT: f64 = 0.6;
/// How much a row's own counts weigh against the drafter's overall estimate (in draws), at
/// least; where the batch's rows accept alike, up to [`MOST_ROW_PRIOR_WEIGHT`]
/// ([`KChooser::row_prior_weight`]).
const ROW_PRIOR_WEIGHT: f64 = 2.0;
/// The most a row's prior weighs: rows whose acceptance differs only by chance then share
/// one k, rather than each following its own luck (64 alike rows at 70% got k's from 0 to
/// 8, and the unlucky ones ran on alone after the others finished).
const MOST_ROW_PRIOR_WEIGHT: f64 = 32.0;
/// Per observation, old counts keep this share (rows drift; the batch changes).
const ROW_DECAY: f64 = 0.9;
const GLOBAL_DECAY: f64 = 0.98;
const COST_DECAY: f64 = 0.95;
const BUCKET_DECAY: f64 = 0.9;
/// A row starts drafting only if that promises this much more throughput on its share
/// of the batch (timings are noisy; a marginal gain is often a loss).
const MIN_GAIN: f64 = 1.05;
/// A timing above this multiple of the prediction counts as this multiple (the machine
/// was busy elsewhere; one stall should not switch speculation off for long).
const OUTLIER: f64 = 2.0;
/// Before verify cost has been seen at different token counts, this share of a verify
/// token's average cost is taken as its marginal cost (what the CPU backend shows).
const PRIOR_MARGINAL_SHARE: f64 = 0.25;
/// A probe goes ahead only if drafting would pay with acceptance this much higher.
const PROBE_OPTIMISM: f64 = 0.15;
/// The most (and 1 over the least) a row's tokens are worth against the batch's mean, by
/// how far it has to go.
const MOST_WORTH: f64 = 2.0;
/// Rounds without speculation before the first probe; doubles up to the maximum.
const PROBE_GAP: u32 = 4;
const MAX_PROBE_GAP: u32 = 64;
/// Self-paced rows: cost of verifying one more token relative to a decode step, until the
/// backend says its own ([`KChooser::with_verify_token_cost`]). Fixed, like the drafter's
/// relative cost, so that their k is a function of their own history only.
const SELF_PACED_VERIFY_COST: f64 = 0.2;
/// Self-paced rows: a position the drafter catches up on costs this share of a draft step
/// (many positions go through in one batched pass).
const CATCH_UP_SHARE: f64 = 0.2;

/// Decayed per-position acceptance counts.
#[derive(Clone, Debug, Default)]
struct Acceptance {
    /// `reached[j]`: verifications that asked for position j + 1 with positions before it
    /// accepted; `accepted[j]`: those that accepted it. `asked`/`drafted`: draft tokens
    /// asked for and delivered (a drafter may find nothing to propose).
    reached: Vec<f64>,
    accepted: Vec<f64>,
    asked: f64,
    drafted: f64,
}

impl Acceptance {
    fn observe(&mut self, asked: usize, drafted: usize, accepted: usize, decay: f64) {
        for v in self.reached.iter_mut().chain(self.accepted.iter_mut()) {
            *v *= decay;
        }
        self.asked = self.asked * decay + asked as f64;
        self.drafted = self.drafted * decay + drafted as f64;
        if self.reached.len() < asked {
            self.reached.resize(asked, 0.0);
            self.accepted.resize(asked, 0.0);
        }
        for j in 0..asked.min(accepted + 1) {
            self.reached[j] += 1.0;
            self.accepted[j] += u8::from(j < accepted) as f64;
        }
    }

    /// P(position j + 1 accepted | positions before it accepted), shrunk towards `prior`.
    fn conditional(&self, j: usize, prior: f64, weight: f64) -> f64 {
        let (a, r) =
            (self.accepted.get(j).copied().unwrap_or(0.0), self.reached.get(j).copied().unwrap_or(0.0));
        (a + weight * prior) / (r + weight)
    }

    /// Share of asked drafts the drafter delivered, shrunk towards 1.
    fn fill(&self) -> f64 {
        (self.drafted + 1.0) / (self.asked + 1.0)
    }
}

/// The row that may draft whose catch-up costs least (where a probe goes).
fn cheapest(catch_up: &[f64], limit: &[usize]) -> Option<usize> {
    (0..limit.len()).filter(|&i| limit[i] > 0).min_by(|&a, &b| catch_up[a].total_cmp(&catch_up[b]))
}

/// Expected tokens a row emits with `k` drafts: the bonus token plus each draft times the
/// chance it and all before it are accepted.
fn expected_tokens(p: &[f64], k: usize) -> f64 {
    let mut chain = 1.0;
    1.0 + p[..k]
        .iter()
        .map(|q| {
            chain *= q;
            chain
        })
        .sum::<f64>()
}

/// A decayed weighted least-squares line `y = a + b x`.
#[derive(Clone, Debug, Default)]
struct Line {
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

impl Line {
    fn observe(&mut self, x: f64, y: f64) {
        let d = COST_DECAY;
        self.w = self.w * d + 1.0;
        self.sx = self.sx * d + x;
        self.sy = self.sy * d + y;
        self.sxx = self.sxx * d + x * x;
        self.sxy = self.sxy * d + x * y;
    }

    fn seen(&self) -> bool {
        self.w > 0.0
    }

    /// Intercept and slope, the slope shrunk towards `prior_share` of the mean cost per x
    /// while the x's seen barely vary; the slope is never negative.
    fn fit(&self, prior_share: f64) -> (f64, f64) {
        if self.w == 0.0 {
            return (0.0, 0.0);
        }
        let (mx, my) = (self.sx / self.w, self.sy / self.w);
        let prior = prior_share * my / mx.max(1e-9);
        let ridge = 2.0;
        let b =
            ((self.sxy - self.w * mx * my + ridge * prior) / (self.sxx - self.w * mx * mx + ridge)).max(0.0);
        ((my - b * mx).max(0.0), b)
    }
}

/// Verify cost by verify tokens: the decayed mean of each token count seen; between two
/// counts seen, the line between them (never falling); past them, a line fitted to all
/// (anchored at the nearest count seen), since the comparison that matters (B tokens
/// against B + k) needs the step between counts more than any one level, and a GPU's
/// curve has steps (at 64 rows on the H100, 3 ms between 128 and 136 tokens) that one
/// line through every count would spread over all of them.
#[derive(Clone, Debug, Default)]
struct VerifyCost {
    line: Line,
    /// Token count -> (decayed weight, decayed sum of seconds).
    seen_at: HashMap<usize, (f64, f64)>,
}

impl VerifyCost {
    fn observe(&mut self, tokens: usize, secs: f64) {
        let secs = if self.line.seen() { secs.min(OUTLIER * self.predict(tokens as f64)) } else { secs };
        self.line.observe(tokens as f64, secs);
        let (w, sum) = self.seen_at.entry(tokens).or_default();
        *w = *w * BUCKET_DECAY + 1.0;
        *sum = *sum * BUCKET_DECAY + secs;
    }

    fn seen(&self) -> bool {
        self.line.seen()
    }

    fn predict(&self, tokens: f64) -> f64 {
        let (a, b) = self.line.fit(PRIOR_MARGINAL_SHARE);
        let settled =
            || self.seen_at.iter().filter(|(_, (w, _))| *w >= 2.0).map(|(&t, &(w, sum))| (t as f64, sum / w));
        let below = settled().filter(|&(t, _)| t <= tokens).max_by(|x, y| x.0.total_cmp(&y.0));
        let above = settled().filter(|&(t, _)| t >= tokens).min_by(|x, y| x.0.total_cmp(&y.0));
        let secs = match (below, above) {
            // Between two counts seen: the line between them (never falling).
            (Some((t0, s0)), Some((t1, s1))) if t1 > t0 => {
                s0 + (s1 - s0).max(0.0) * (tokens - t0) / (t1 - t0)
            }
            (Some((_, s)), Some(_)) => s,
            (Some((t0, s0)), None) | (None, Some((t0, s0))) => s0 + b * (tokens - t0),
            (None, None) => a + b * tokens,
        };
        secs.max(0.0)
    }
}

/// Draft cost `c * steps + d * tokens + e * behind` (`behind`: positions the drafter
/// first catches up on: the tokens committed since the row last drafted), by decayed
/// least squares with a small ridge (at batch 1 steps and tokens are equal and only their
/// sum is known).
#[derive(Clone, Debug, Default)]
struct DraftCost {
    /// Decayed X^T X and X^T y.
    xx: [[f64; 3]; 3],
    xy: [f64; 3],
}

impl DraftCost {
    fn observe(&mut self, x: [f64; 3], y: f64) {
        let y = if self.seen() { y.min(OUTLIER * self.predict(x)) } else { y };
        for i in 0..3 {
            for j in 0..3 {
                self.xx[i][j] = self.xx[i][j] * COST_DECAY + x[i] * x[j];
            }
            self.xy[i] = self.xy[i] * COST_DECAY + x[i] * y;
        }
    }

    fn seen(&self) -> bool {
        self.xx[0][0] > 0.0
    }

    fn predict(&self, x: [f64; 3]) -> f64 {
        let c = self.fit();
        (0..3).map(|i| c[i] * x[i]).sum()
    }

    /// Coefficients (none negative) by Gaussian elimination on the ridged normal equations.
    fn fit(&self) -> [f64; 3] {
        let ridge = 1e-3 * (0..3).map(|i| self.xx[i][i]).sum::<f64>().max(1e-12);
        let mut a = self.xx;
        let mut b = self.xy;
        for (i, row) in a.iter_mut().enumerate() {
            row[i] += ridge;
        }
        for col in 0..3 {
            let pivot = a[col][col];
            if pivot.abs() < 1e-300 {
                return [0.0; 3];
            }
            let top = a[col];
            for r in col + 1..3 {
                let f = a[r][col] / pivot;
                for (v, t) in a[r].iter_mut().zip(top).skip(col) {
                    *v -= f * t;
                }
                b[r] -= f * b[col];
            }
        }
        let mut c = [0.0; 3];
        for i in (0..3).rev() {
            let tail: f64 = (i + 1..3).map(|j| a[i][j] * c[j]).sum();
            c[i] = (b[i] - tail) / a[i][i];
        }
        c.map(|v| v.max(0.0))
    }
}

/// One row that may draft this round.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub row: RowId,
    /// The most drafts this row can take (context, max_tokens, the configured maximum).
    pub cap: usize,
    /// Rejection-mode row at T > 0: k from its own history only.
    pub self_paced: bool,
    /// Positions the drafter must catch up on before drafting for this row.
    pub behind: usize,
    /// Tokens the row may still emit (bounds how long turning drafting on can pay).
    pub remaining: usize,
}

/// What one row did in a round: drafts asked for, delivered, accepted.
#[derive(Clone, Copy, Debug)]
pub struct Outcome {
    pub row: RowId,
    /// Positions the drafter caught up on (0 when it was not asked).
    pub behind: usize,
    pub asked: usize,
    pub drafted: usize,
    pub accepted: usize,
}

/// What an engine's adaptive k learned (see [`crate::Engine::learned`]): the drafter's
/// acceptance, the verify and draft costs, and where new rows' k starts; no row's state.
#[derive(Clone, Debug)]
pub struct Learned(KChooser);

/// Learns acceptance and costs as the engine runs and picks each round's k's.
#[derive(Clone, Debug)]
pub struct KChooser {
    max_k: usize,
    overall: Acceptance,
    rows: HashMap<RowId, Acceptance>,
    /// k each row got last round (the next may be at most twice that plus one).
    last_k: HashMap<RowId, usize>,
    /// Where a new row's k starts: the last k chosen for any row.
    recent_k: usize,
    verify: VerifyCost,
    draft: DraftCost,
    quiet_rounds: u32,
    probe_gap: u32,
    /// One draft step of the drafter relative to a decode step (see `new`).
    drafter_cost: f64,
    /// The first round and the first drafting round are warm-up (page faults, first
    /// allocations): their timings are not learned from.
    warm_verify: bool,
    warm_draft: bool,
    /// Verify tokens the backend computes as one (see [`KChooser::with_token_group`]).
    token_group: usize,
    /// A self-paced row's verify token, in decode steps (see
    /// [`KChooser::with_verify_token_cost`]).
    verify_token_cost: f64,
}

impl KChooser {
    /// A chooser for drafts of up to `max_k` tokens from a drafter whose step costs
    /// `drafter_cost` decode steps ([`mtp_drafter::Drafter::relative_cost`]).
    pub fn new(max_k: usize, drafter_cost: f64) -> KChooser {
        KChooser {
            drafter_cost,
            max_k,
            overall: Acceptance::default(),
            rows: HashMap::new(),
            last_k: HashMap::new(),
            recent_k: 1,
            verify: VerifyCost::default(),
            draft: DraftCost::default(),
            quiet_rounds: 0,
            probe_gap: PROBE_GAP,
            warm_verify: false,
            warm_draft: false,
            token_group: 1,
            verify_token_cost: SELF_PACED_VERIFY_COST,
        }
    }

    /// The backend verifies tokens in groups of `group` (a partial group costs a whole
    /// one): drafting batches are topped up to whole groups.
    pub fn with_token_group(mut self, group: usize) -> KChooser {
        self.token_group = group.max(1);
        self
    }

    /// Self-paced rows price one more verify token at `cost` decode steps: the backend's
    /// fixed figure ([`mtp_model::Model::verify_token_cost`]; 1 on the CPU, whose
    /// matmuls cost each token its own share, so those rows draft only where a drafter
    /// could pay there). `cost` is finite and 0 or more (`Engine::new` refuses others).
    pub fn with_verify_token_cost(mut self, cost: f64) -> KChooser {
        self.verify_token_cost = cost;
        self
    }

    /// What this chooser learned that outlives its rows (acceptance overall, costs, where
    /// new rows start), for a later engine of the same model and drafter.
    pub fn learned(&self) -> Learned {
        Learned(KChooser { rows: HashMap::new(), last_k: HashMap::new(), ..self.clone() })
    }

    /// Continues from `learned` (this chooser's own maximum k, token group, drafter cost
    /// and verify token cost stay: they describe the new engine).
    pub fn resume(&mut self, learned: Learned) {
        let l = learned.0;
        self.overall = l.overall;
        self.recent_k = l.recent_k.min(self.max_k);
        self.verify = l.verify;
        self.draft = l.draft;
        self.quiet_rounds = l.quiet_rounds;
        self.probe_gap = l.probe_gap;
        self.warm_verify = l.warm_verify;
        self.warm_draft = l.warm_draft;
    }

    /// The drafter's conditional acceptance at positions 1..=max_k.
    fn overall_p(&self) -> Vec<f64> {
        let mut prior = PRIOR_ACCEPT;
        (0..self.max_k)
            .map(|j| {
                prior = self.overall.conditional(j, prior, 1.0);
                prior
            })
            .collect()
    }

    /// Seconds the verify step (the round minus drafting) is expected to take for
    /// `tokens` verify tokens; None before any round was timed.
    pub fn verify_seconds(&self, tokens: usize) -> Option<f64> {
        self.verify.seen().then(|| self.verify.predict(tokens as f64))
    }

    /// How much each row's prior weighs against its own counts (in draws), by empirical
    /// Bayes over the rows the batch search moves: the first position's acceptance spread
    /// between rows beyond what chance gives at their counts (`tau2`) against the chance
    /// spread of one draw, between [`ROW_PRIOR_WEIGHT`] (rows that really differ: an
    /// n-gram drafter on code and on prose) and [`MOST_ROW_PRIOR_WEIGHT`] (rows alike).
    fn row_prior_weight(&self, rows: &[Candidate]) -> f64 {
        let counts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|c| !c.self_paced)
            .filter_map(|c| self.rows.get(&c.row))
            .filter_map(|a| Some((a.accepted.first().copied()?, a.reached.first().copied()?)))
            .filter(|&(_, n)| n > 0.0)
            .collect();
        let (acc, n): (f64, f64) = counts.iter().fold((0.0, 0.0), |(a, n), &(ai, ni)| (a + ai, n + ni));
        // Too few rows to tell, or every draft accepted (or none): nothing to weigh.
        let p = acc / n;
        let chance = p * (1.0 - p);
        if counts.len() < 4 || chance <= 0.0 {
            return ROW_PRIOR_WEIGHT;
        }
        let spread: f64 = counts.iter().map(|&(a, ni)| ni * (a / ni - p).powi(2)).sum();
        let tau2 = ((spread - (counts.len() - 1) as f64 * chance) / n).max(0.0);
        (chance / tau2.max(1e-12)).clamp(ROW_PRIOR_WEIGHT, MOST_ROW_PRIOR_WEIGHT)
    }

    /// k for each candidate, in order; `others` rows verify this round without drafting.
    pub fn choose(&mut self, rows: &[Candidate], others: usize) -> Vec<usize> {
        let overall = self.overall_p();
        let weight = self.row_prior_weight(rows);
        let mut ks = vec![0; rows.len()];
        // Per row: conditional acceptance, delivered share, and the most it can take.
        let mut p = Vec::with_capacity(rows.len());
        let mut fill = Vec::with_capacity(rows.len());
        let mut limit = Vec::with_capacity(rows.len());
        // The most each row may take this round: twice last round's, plus one.
        let mut step_cap = Vec::with_capacity(rows.len());
        // Catch-up cost of drafting for each row, in the draft cost's `behind` units.
        let mut catch_up = Vec::with_capacity(rows.len());
        for c in rows {
            let own = self.rows.get(&c.row);
            // A self-paced row's start may not depend on other rows either.
            let start = if c.self_paced { 1 } else { self.recent_k };
            let last = self.last_k.get(&c.row).copied().unwrap_or(start);
            step_cap.push(2 * last + 1);
            let lim = c.cap.min(self.max_k);
            if c.self_paced {
                let lim = lim.min(2 * last + 1);
                let mut prior = PRIOR_ACCEPT;
                let pr: Vec<f64> = (0..self.max_k)
                    .map(|j| {
                        prior = own.map_or(prior, |a| a.conditional(j, prior, ROW_PRIOR_WEIGHT));
                        prior
                    })
                    .collect();
                // Per draft: the drafter's step and one verify token; to start drafting, the
                // catch-up, spread over the rounds the row has left.
                let per_draft = self.drafter_cost + self.verify_token_cost;
                let rate = |k: usize| {
                    let tokens = expected_tokens(&pr, k);
                    let horizon = if last > 0 { 1.0 } else { (c.remaining as f64 / tokens).max(1.0) };
                    let catch_up = if k > 0 {
                        c.behind as f64 * self.drafter_cost * CATCH_UP_SHARE / horizon
                    } else {
                        0.0
                    };
                    tokens / (1.0 + per_draft * k as f64 + catch_up)
                };
                ks[p.len()] = (0..=lim).max_by(|&a, &b| rate(a).total_cmp(&rate(b))).unwrap_or(0);
                p.push(pr);
                fill.push(1.0);
                limit.push(0); // fixed above; the batch search leaves it alone
                catch_up.push(c.behind as f64);
                continue;
            }
            let pr: Vec<f64> = match own {
                Some(a) => (0..self.max_k).map(|j| a.conditional(j, overall[j], weight)).collect(),
                None => overall.clone(),
            };
            // A row that drafted last round catches up on one round's tokens, every round;
            // one that did not pays its backlog once, spread over the rounds it has left.
            let horizon =
                if last > 0 { 1.0 } else { (c.remaining as f64 / expected_tokens(&pr, lim)).max(1.0) };
            catch_up.push(c.behind as f64 / horizon);
            p.push(pr);
            fill.push(own.map_or(self.overall.fill(), |a| a.fill()));
            limit.push(lim);
        }
        // What a row's tokens are worth: by how far it has to go against the batch's mean
        // (the row that finishes last runs on in a thinner batch; where all have as far to
        // go, all are alike).
        let mean_left = rows.iter().map(|c| c.remaining as f64).sum::<f64>() / rows.len().max(1) as f64;
        let worth: Vec<f64> = rows
            .iter()
            .map(|c| (c.remaining as f64 / mean_left.max(1.0)).clamp(1.0 / MOST_WORTH, MOST_WORTH))
            .collect();
        let searching = limit.iter().any(|&l| l > 0);
        if searching {
            // The search may look as deep as each row can go (a batch may gain only from
            // deep drafts); the step taken is at most twice last round's, plus one. Before
            // any verify was timed it judges by the prior costs (`round_cost`).
            self.search(&mut ks, &p, &worth, &fill, &catch_up, &limit, others, MIN_GAIN);
            for ((k, &cap), &l) in ks.iter_mut().zip(&step_cap).zip(&limit) {
                if l > 0 {
                    *k = (*k).min(cap);
                }
            }
            // Nothing timed yet and the priors say no: one draft for the cheapest row, to
            // start measuring.
            if !self.verify.seen() && ks.iter().zip(&limit).all(|(&k, &l)| l == 0 || k == 0) {
                if let Some(i) = cheapest(&catch_up, &limit) {
                    ks[i] = 1;
                }
            }
        }
        // Probe when speculation has been off for a while: acceptance and costs drift.
        let drafting = ks.iter().zip(&limit).any(|(&k, &l)| l > 0 && k > 0);
        if searching && !drafting {
            self.quiet_rounds += 1;
            if self.quiet_rounds >= self.probe_gap {
                self.quiet_rounds = 0;
                self.probe_gap = (self.probe_gap * 2).min(MAX_PROBE_GAP);
                // Only where drafting would pay if acceptance were somewhat better than
                // estimated: a probe costs a catch-up, wasted where costs alone rule it out.
                let hopeful: Vec<Vec<f64>> =
                    p.iter().map(|r| r.iter().map(|q| (q + PROBE_OPTIMISM).min(0.99)).collect()).collect();
                let mut trial = ks.clone();
                self.search(&mut trial, &hopeful, &worth, &fill, &catch_up, &limit, others, 1.0);
                if let (true, Some(i)) = (trial.iter().any(|&k| k > 0), cheapest(&catch_up, &limit)) {
                    ks[i] = 1;
                }
            }
        } else if drafting {
            self.quiet_rounds = 0;
            self.probe_gap = PROBE_GAP;
        }
        if ks.iter().zip(&limit).any(|(&k, &l)| l > 0 && k > 0) {
            self.top_up(&mut ks, &p, &limit, rows.len() + others);
        }
        for (c, &k) in rows.iter().zip(&ks) {
            self.last_k.insert(c.row, k);
        }
        // New rows start where the deepest row its cap did not bind is (a row near its end
        // says nothing about how deep drafts pay).
        let unbound = rows.iter().zip(&ks).filter(|(c, &k)| k < c.cap.min(self.max_k) || c.cap >= self.max_k);
        if let Some(k) = unbound.map(|(_, &k)| k).max() {
            self.recent_k = k;
        }
        ks
    }

    /// Fills whole token groups: raises k's (rows the search may move, each at most to the
    /// deepest k already chosen, so the draft steps stay), each time the row whose next
    /// draft is likeliest to be accepted; where that cannot reach the next group boundary
    /// and the one below is less than half a group away, drops the drafts least likely to
    /// be accepted instead.
    fn top_up(&self, ks: &mut [usize], p: &[Vec<f64>], limit: &[usize], rows: usize) {
        let group = self.token_group;
        let deepest = ks.iter().copied().max().unwrap_or(0);
        let tokens = rows + ks.iter().sum::<usize>();
        let (up, down) = (tokens.next_multiple_of(group) - tokens, tokens % group);
        // P(row i's draft at depth d is accepted): the chain up to it.
        let reach = |i: usize, d: usize| p[i][..d].iter().product::<f64>();
        let room: usize = (0..ks.len()).map(|i| limit[i].min(deepest).saturating_sub(ks[i])).sum();
        // Only drafts of rows the search moves may go (not self-paced rows').
        let droppable: usize = (0..ks.len()).filter(|&i| limit[i] > 0).map(|i| ks[i]).sum();
        if up <= room {
            for _ in 0..up {
                let Some(i) = (0..ks.len())
                    .filter(|&i| ks[i] < limit[i].min(deepest))
                    .max_by(|&a, &b| reach(a, ks[a] + 1).total_cmp(&reach(b, ks[b] + 1)))
                else {
                    break;
                };
                ks[i] += 1;
            }
        } else if 2 * down < group && down <= droppable {
            for _ in 0..down {
                let Some(i) = (0..ks.len())
                    .filter(|&i| ks[i] > 0 && limit[i] > 0)
                    .min_by(|&a, &b| reach(a, ks[a]).total_cmp(&reach(b, ks[b])))
                else {
                    break;
                };
                ks[i] -= 1;
            }
        }
    }

    /// A round's cost by its verify tokens, draft steps, draft tokens and catch-up: in
    /// seconds as measured, or before any verify was timed (the first rounds, and on CUDA
    /// the rounds whose verify shapes were new or recorded) in plain rounds of
    /// `plain_tokens` tokens by the priors: each verify token past those costs
    /// `PRIOR_MARGINAL_SHARE` of a plain token, a draft step `drafter_cost`, a position
    /// caught up on `CATCH_UP_SHARE` of a step.
    fn round_cost(&self, plain_tokens: f64) -> impl Fn(f64, usize, usize, f64) -> f64 + '_ {
        let timed = self.verify.seen();
        let [steps_c, tokens_c, behind_c] = if timed {
            self.draft.fit()
        } else {
            [self.drafter_cost, 0.0, self.drafter_cost * CATCH_UP_SHARE]
        };
        let plain = plain_tokens.max(1.0);
        move |verify_tokens, steps, drafted, behind| {
            let verify = if timed {
                self.verify.predict(verify_tokens)
            } else {
                1.0 + PRIOR_MARGINAL_SHARE * (verify_tokens - plain).max(0.0) / plain
            };
            verify + steps_c * steps as f64 + tokens_c * drafted as f64 + behind_c * behind
        }
    }

    /// Greedy search: from the current k's, repeatedly apply the single raise (one row,
    /// by any amount up to its limit) that most improves expected tokens per second (by
    /// `min_gain` at least, for a row that would start drafting).
    #[allow(clippy::too_many_arguments)]
    fn search(
        &self,
        ks: &mut [usize],
        p: &[Vec<f64>],
        worth: &[f64],
        fill: &[f64],
        catch_up: &[f64],
        limit: &[usize],
        others: usize,
        min_gain: f64,
    ) {
        let cost = self.round_cost((ks.len() + others) as f64);
        let rate = |tokens: f64, verify_tokens: f64, steps: usize, drafted: usize, behind: f64| {
            tokens / cost(verify_tokens, steps, drafted, behind).max(1e-12)
        };
        let mut tokens: f64 =
            others as f64 + (0..ks.len()).map(|i| worth[i] * expected_tokens(&p[i], ks[i])).sum::<f64>();
        let mut verify_tokens: f64 =
            (others + ks.len()) as f64 + (0..ks.len()).map(|i| fill[i] * ks[i] as f64).sum::<f64>();
        let mut steps = ks.iter().copied().max().unwrap_or(0);
        let mut drafted: usize = ks.iter().sum();
        let mut behind: f64 = (0..ks.len()).filter(|&i| ks[i] > 0).map(|i| catch_up[i]).sum();
        let mut best = rate(tokens, verify_tokens, steps, drafted, behind);
        let rows = (ks.len() + others).max(1);
        loop {
            let mut pick: Option<(usize, usize, f64)> = None;
            for i in 0..ks.len() {
                let base = worth[i] * expected_tokens(&p[i], ks[i]);
                for k in ks[i] + 1..=limit[i] {
                    let t = tokens - base + worth[i] * expected_tokens(&p[i], k);
                    let v = verify_tokens + fill[i] * (k - ks[i]) as f64;
                    let b = if ks[i] == 0 { behind + catch_up[i] } else { behind };
                    let r = rate(t, v, steps.max(k), drafted + k - ks[i], b);
                    // A row that starts drafting must gain `min_gain` on its own share.
                    let bar = if ks[i] == 0 { best * (1.0 + (min_gain - 1.0) / rows as f64) } else { best };
                    if r > pick.map_or(bar, |(_, _, r)| r.max(bar)) {
                        pick = Some((i, k, r));
                    }
                }
            }
            let Some((i, k, r)) = pick else { break };
            tokens += worth[i] * (expected_tokens(&p[i], k) - expected_tokens(&p[i], ks[i]));
            verify_tokens += fill[i] * (k - ks[i]) as f64;
            drafted += k - ks[i];
            if ks[i] == 0 {
                behind += catch_up[i];
            }
            steps = steps.max(k);
            ks[i] = k;
            best = r;
        }
    }

    /// Records a round: each row's outcome, the drafting time (for `steps` steps) and the
    /// rest of the round's time for `verify_tokens` tokens, learned only when `steady` (the
    /// verify forward paid no one-time cost: a CUDA graph's first sighting or recording).
    pub fn observe(
        &mut self,
        outcomes: &[Outcome],
        draft_secs: f64,
        rest_secs: f64,
        verify_tokens: usize,
        steady: bool,
    ) {
        let asked: usize = outcomes.iter().map(|o| o.asked).sum();
        let behind: usize = outcomes.iter().filter(|o| o.asked > 0).map(|o| o.behind).sum();
        let steps = outcomes.iter().map(|o| o.asked).max().unwrap_or(0);
        for o in outcomes.iter().filter(|o| o.asked > 0) {
            self.overall.observe(o.asked, o.drafted, o.accepted, GLOBAL_DECAY);
            self.rows.entry(o.row).or_default().observe(o.asked, o.drafted, o.accepted, ROW_DECAY);
        }
        if asked > 0 {
            if self.warm_draft {
                self.draft.observe([steps as f64, asked as f64, behind as f64], draft_secs);
            }
            self.warm_draft = true;
        }
        if self.warm_verify && steady {
            self.verify.observe(verify_tokens, rest_secs);
        }
        self.warm_verify = true;
    }

    /// Forgets a finished row.
    pub fn remove(&mut self, row: RowId) {
        self.rows.remove(&row);
        self.last_k.remove(&row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(row: RowId, cap: usize) -> Candidate {
        Candidate { row, cap, self_paced: false, behind: 2, remaining: 100 }
    }

    /// Row i's outcome for its `ks[i]` drafts, `accepted(i, k)` of them accepted.
    fn outcomes(ks: &[usize], behind: usize, accepted: impl Fn(usize, usize) -> usize) -> Vec<Outcome> {
        ks.iter()
            .enumerate()
            .map(|(i, &k)| Outcome { row: i as u64, behind, asked: k, drafted: k, accepted: accepted(i, k) })
            .collect()
    }

    /// Drafts row i accepts of k in `round`: a deterministic pattern accepting each
    /// position with rate `p`.
    fn patterned(round: usize, i: usize, k: usize, p: f64) -> usize {
        (0..k).take_while(|j| ((round * 7 + i * 3 + j * 5) % 100) as f64 / 100.0 < p).count()
    }

    /// Drives the chooser with a simulated cost model and acceptance `p` per position.
    fn settle(
        max_k: usize,
        p: f64,
        round_secs: impl Fn(usize, usize) -> (f64, f64),
        rows: usize,
    ) -> Vec<usize> {
        let mut c = KChooser::new(max_k, 0.3);
        let cands: Vec<Candidate> = (0..rows as u64).map(|r| cand(r, max_k)).collect();
        let mut ks = Vec::new();
        for round in 0..200 {
            ks = c.choose(&cands, 0);
            let outcomes = outcomes(&ks, 2, |i, k| patterned(round, i, k, p));
            let steps = ks.iter().copied().max().unwrap_or(0);
            let tokens: usize = rows + ks.iter().sum::<usize>();
            let (d, v) = round_secs(steps, tokens);
            c.observe(&outcomes, d, v, tokens, true);
        }
        ks
    }

    #[test]
    fn drafts_deep_when_verify_tokens_are_cheap_and_drafts_good() {
        // GPU-like: verifying more tokens is nearly free, drafting is cheap.
        let ks = settle(8, 0.9, |steps, tokens| (0.05 * steps as f64, 1.0 + 0.01 * tokens as f64), 1);
        assert!(ks[0] >= 6, "{ks:?}");
    }

    #[test]
    fn a_large_batch_drafts_when_verify_tokens_are_cheap() {
        // H100-like at batch 8: each verify token costs 1/10 of a round, drafts are free
        // and always right: every row should draft deep.
        let ks = settle(4, 1.0, |_, tokens| (0.0, 10.0 + 1.0 * tokens as f64), 8);
        assert!(ks.iter().all(|&k| k >= 3), "{ks:?}");
    }

    /// A verify that paid a one-time cost (a CUDA graph's first run or recording: 11.5-22.8
    /// ms where the same shape replays in 10.6 on the H100) teaches nothing: the prediction
    /// stays. Control: the same time learned as steady moves it.
    #[test]
    fn a_verify_that_paid_a_one_time_cost_is_not_learned() {
        let learn = |steady: bool| {
            let mut c = KChooser::new(4, 0.3);
            let o = [Outcome { row: 0, behind: 1, asked: 1, drafted: 1, accepted: 1 }];
            for _ in 0..3 {
                c.observe(&o, 0.0, 10.0, 9, true);
            }
            let before = c.verify_seconds(9).unwrap();
            c.observe(&o, 0.0, 22.0, 9, steady);
            (before, c.verify_seconds(9).unwrap())
        };
        let (before, after) = learn(false);
        assert_eq!(before.to_bits(), after.to_bits());
        let (before, after) = learn(true);
        assert!(after > before, "the control learned nothing: {before} -> {after}");
    }

    /// The first rounds of 8 rows whose drafts are always accepted, while no verify is
    /// timed (the first round is warm-up; on CUDA a new verify shape's first run and its
    /// recording are not learned from): each round's k's.
    fn cold_rounds(drafter_cost: f64) -> Vec<Vec<usize>> {
        let mut c = KChooser::new(8, drafter_cost).with_token_group(8);
        let cands: Vec<Candidate> = (0..8).map(|r| cand(r, 8)).collect();
        (0..4)
            .map(|_| {
                let ks = c.choose(&cands, 0);
                let outcomes = outcomes(&ks, 2, |_, k| k);
                c.observe(&outcomes, 0.001, 0.01, 8 + ks.iter().sum::<usize>(), false);
                ks
            })
            .collect()
    }

    /// Before any verify is timed, the k's follow the priors and the acceptance seen so far:
    /// a free drafter starts every row at 2 and reaches 8 by the third round (it was one
    /// row at k = 1 for as long as nothing was timed: three rounds of a 64-token request on
    /// CUDA). Control: a drafter as costly as the target stays at k = 1 (one row's draft, to
    /// measure, topped up to a whole group of 8 verify tokens).
    #[test]
    fn untimed_rounds_follow_the_priors() {
        let free = cold_rounds(0.0);
        println!("free drafter: {free:?}");
        assert!(free[0].iter().all(|&k| k >= 2), "{free:?}");
        assert!(free[2].iter().all(|&k| k == 8), "{free:?}");
        let costly = cold_rounds(1.0);
        println!("costly drafter: {costly:?}");
        assert!(costly[0].iter().any(|&k| k > 0), "{costly:?}");
        assert!(costly.iter().flatten().all(|&k| k <= 1), "{costly:?}");
    }

    /// The k's of 5 rows over 40 rounds (acceptance 0.8, verify nearly free per token) with
    /// verify tokens in groups of `group`: each round's total verify tokens.
    fn verify_totals(group: usize) -> Vec<usize> {
        let mut c = KChooser::new(4, 0.1).with_token_group(group);
        let cands: Vec<Candidate> = (0..5).map(|r| cand(r, 4)).collect();
        (0..40)
            .map(|round| {
                let ks = c.choose(&cands, 0);
                let outcomes = outcomes(&ks, 1, |i, k| patterned(round, i, k, 0.8));
                let tokens = 5 + ks.iter().sum::<usize>();
                c.observe(&outcomes, 0.01, 10.0 + 0.05 * tokens as f64, tokens, true);
                tokens
            })
            .collect()
    }

    /// With tokens verified 8 at a time, the drafting rounds past the first few fill whole
    /// groups (5 rows at up to 4 drafts: 24 tokens, not 25). Control: without groups they
    /// do not.
    #[test]
    fn drafting_batches_fill_whole_token_groups() {
        let grouped = verify_totals(8);
        println!("groups of 8: {grouped:?}");
        assert!(grouped[5..].iter().all(|&t| t > 5 && t % 8 == 0), "{grouped:?}");
        let plain = verify_totals(1);
        println!("no groups: {plain:?}");
        assert!(plain[5..].iter().any(|&t| t % 8 != 0), "the control filled groups too: {plain:?}");
    }

    #[test]
    fn stops_drafting_when_it_cannot_pay() {
        // Every verify token costs as much as a round: speculation can only lose.
        let ks = settle(8, 0.5, |steps, tokens| (0.5 * steps as f64, tokens as f64), 4);
        assert_eq!(ks, vec![0; 4]);
    }

    #[test]
    fn probes_after_quiet_rounds() {
        let mut c = KChooser::new(4, 0.3);
        let cands = [cand(0, 4)];
        // Costs that make speculation lose, learned from a first round.
        c.observe(&[Outcome { row: 0, behind: 2, asked: 1, drafted: 1, accepted: 0 }], 1.0, 2.0, 2, true);
        c.observe(&[Outcome { row: 0, behind: 2, asked: 0, drafted: 0, accepted: 0 }], 0.0, 1.0, 1, true);
        let picks: Vec<usize> = (0..PROBE_GAP).map(|_| c.choose(&cands, 0)[0]).collect();
        assert_eq!(&picks[..PROBE_GAP as usize - 1], &vec![0; PROBE_GAP as usize - 1][..]);
        assert_eq!(picks[PROBE_GAP as usize - 1], 1, "a probe after {PROBE_GAP} quiet rounds");
    }

    #[test]
    fn at_most_doubles_k_per_round() {
        let mut c = KChooser::new(8, 0.3);
        let cands = [cand(0, 8)];
        let (mut last, mut ks) = (0, Vec::new());
        for _ in 0..10 {
            let k = c.choose(&cands, 0)[0];
            assert!(k <= 2 * last + 1, "{k} after {last}");
            ks.push(k);
            c.observe(
                &[Outcome { row: 0, behind: 2, asked: k, drafted: k, accepted: k }],
                0.0,
                1.0,
                1 + k,
                true,
            );
            last = k;
        }
        // 1, 2 (the priors, nothing timed yet), then doubling: 5, 8 (one more a round would
        // reach 8 in the eighth).
        println!("{ks:?}");
        assert_eq!(ks[3], 8, "perfect free drafts should reach k = 8 by the fourth round: {ks:?}");
    }

    #[test]
    fn self_paced_rows_ignore_the_batch_and_timings() {
        // Same history, different batch companions and timings: same k.
        let history = [(2, 2), (3, 1), (2, 2), (3, 3)];
        let run = |others: usize, secs: f64| {
            let mut c = KChooser::new(6, 0.3);
            let me = Candidate { row: 9, cap: 6, self_paced: true, behind: 2, remaining: 50 };
            let mut picks = Vec::new();
            for &(asked, accepted) in &history {
                picks.push(c.choose(&[me, cand(1, 6)], others)[0]);
                c.observe(
                    &[Outcome { row: 9, behind: 2, asked, drafted: asked, accepted }],
                    secs,
                    secs * 3.0,
                    10,
                    true,
                );
            }
            picks
        };
        assert_eq!(run(0, 0.001), run(7, 5.0));
    }

    /// A self-paced row prices its drafts by the backend's verify token: on the CPU (a
    /// token costs a decode step) a free drafter accepted half the time is not worth it
    /// (it drafted, and cost the default mtp-bench's rejection rows up to half their
    /// speed); where a token costs a fifth (the GPUs), the same history drafts.
    #[test]
    fn self_paced_rows_price_drafts_by_the_backends_verify_token() {
        let picks = |cost: f64| {
            let mut c = KChooser::new(6, 0.0).with_verify_token_cost(cost);
            let me = Candidate { row: 9, cap: 6, self_paced: true, behind: 0, remaining: 50 };
            let mut picks = Vec::new();
            for _ in 0..8 {
                let k = c.choose(&[me], 0)[0];
                picks.push(k);
                let accepted = k / 2;
                c.observe(
                    &[Outcome { row: 9, behind: 0, asked: k, drafted: k, accepted }],
                    0.001,
                    0.0,
                    1,
                    true,
                );
            }
            picks
        };
        assert!(picks(1.0).iter().all(|&k| k == 0), "{:?}", picks(1.0));
        // The control: the GPUs' figure (and the chooser's default) drafts.
        assert!(picks(0.2).iter().any(|&k| k > 0), "{:?}", picks(0.2));
        assert_eq!(picks(SELF_PACED_VERIFY_COST), picks(0.2));
    }

    /// Whatever the timings, k's stay within each row's cap, with and without token groups
    /// (with groups, 14 more rows that do not draft: 17 verify tokens before any draft, so a
    /// trim to 16 would drop more drafts than there are; that panicked once).
    #[test]
    fn wild_timings_keep_choices_in_range() {
        for group in [1, 8] {
            wild_timings(group);
        }
    }

    fn wild_timings(group: usize) {
        let mut c = KChooser::new(5, 0.3).with_token_group(group);
        assert_eq!(c.verify_seconds(1), None);
        let cands = [cand(0, 3), cand(1, 5), Candidate { behind: 500, ..cand(2, 1) }];
        let mut seed = 7u64;
        let others = if group > 1 { 14 } else { 2 };
        for round in 0..500 {
            let ks = c.choose(&cands, others);
            assert!(ks.iter().zip(&cands).all(|(&k, c)| k <= c.cap), "{ks:?}");
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let noise = [0.0, 1e-9, 1.0, 1e3][(seed >> 60) as usize % 4];
            let outcomes: Vec<Outcome> = ks
                .iter()
                .enumerate()
                .map(|(i, &k)| Outcome {
                    row: i as u64,
                    behind: 3,
                    asked: k,
                    drafted: k / 2,
                    accepted: k / 3,
                })
                .collect();
            c.observe(&outcomes, noise * (seed % 3) as f64, noise, 5 + ks.iter().sum::<usize>(), true);
            // The first round is warm-up, not learned from.
            assert_eq!(c.verify_seconds(1).is_some(), round > 0);
            for v in (0..20).filter_map(|t| c.verify_seconds(t)) {
                assert!(v.is_finite() && v >= 0.0, "{v}");
            }
        }
    }

    /// 8 rows whose drafts always land, through a 65-token request (each row's cap falls
    /// to what it has left: k = 2, 5, 8 x 6, then 1), verify tokens nearly free: the
    /// chooser at the end.
    fn served_one_request() -> KChooser {
        let mut c = KChooser::new(8, 0.0).with_token_group(8);
        let mut left = 65;
        while left > 1 {
            let cands: Vec<Candidate> =
                (0..8).map(|r| Candidate { remaining: left, ..cand(r, 8.min(left - 1)) }).collect();
            let ks = c.choose(&cands, 0);
            let outcomes = outcomes(&ks, 2, |_, k| k);
            let tokens = 8 + ks.iter().sum::<usize>();
            c.observe(&outcomes, 0.0, 10.0 + 0.1 * tokens as f64, tokens, true);
            left -= 1 + ks[0].min(left - 1);
        }
        c
    }

    /// What a chooser learned carries to the next engine: a new request's rows draft 8 from
    /// their first round, though the last rounds before were capped near their requests'
    /// ends. Controls: a fresh chooser starts those rows at 2; one resumed where the last
    /// round's capped k set where new rows start would start them lower.
    #[test]
    fn a_resumed_chooser_starts_new_rows_where_drafting_paid() {
        let new_rows: Vec<Candidate> = (100..108).map(|r| cand(r, 8)).collect();
        let learned = served_one_request().learned();
        assert_eq!(learned.0.recent_k, 8);
        let first_round = |from: Option<Learned>| {
            let mut c = KChooser::new(8, 0.0).with_token_group(8);
            if let Some(l) = from {
                c.resume(l);
            }
            c.choose(&new_rows, 0)
        };
        let ks = first_round(Some(learned.clone()));
        assert!(ks.iter().all(|&k| k == 8), "{ks:?}");
        let fresh = first_round(None);
        assert!(fresh.iter().all(|&k| k <= 2), "the fresh control: {fresh:?}");
        let low = first_round(Some(Learned(KChooser { recent_k: 1, ..learned.0 })));
        assert!(low.iter().all(|&k| k <= 3), "the capped control: {low:?}");
    }

    #[test]
    fn expected_tokens_counts_the_bonus() {
        assert_eq!(expected_tokens(&[0.5, 0.5], 0), 1.0);
        assert_eq!(expected_tokens(&[0.5, 0.5], 2), 1.75);
    }
}

/// Adaptive k over whole workloads (many rows of a fixed length, all arriving at once, as
/// `mtp-bench` runs them) against a verify cost curve measured on a GPU.
#[cfg(test)]
mod workload {
    use super::*;

    /// ms by verify tokens, piecewise linear (extended past the last point).
    fn interp(pts: &[(f64, f64)], t: f64) -> f64 {
        for w in pts.windows(2) {
            let ((x0, y0), (x1, y1)) = (w[0], w[1]);
            if t <= x1 {
                return y0 + (y1 - y0) * (t - x0).max(0.0) / (x1 - x0);
            }
        }
        let ((x0, y0), (x1, y1)) = (pts[pts.len() - 2], pts[pts.len() - 1]);
        y1 + (t - x1) * (y1 - y0) / (x1 - x0)
    }

    /// The 8B shape's verify ms at 64 rows by verify tokens (H100, 2026-12-07, the
    /// chooser's round log: `RUST_LOG=mtp_engine=debug mtp-bench --batch 64`).
    const H100_64_ROWS: &[(f64, f64)] = &[
        (1.0, 6.4),
        (8.0, 6.7),
        (16.0, 7.5),
        (64.0, 8.8),
        (96.0, 10.9),
        (128.0, 12.0),
        (136.0, 15.3),
        (200.0, 18.0),
        (256.0, 18.6),
        (320.0, 20.5),
        (400.0, 26.6),
        (576.0, 33.0),
    ];
    /// The same at 8 rows (H200, notes v31).
    const H200_8_ROWS: &[(f64, f64)] = &[
        (1.0, 4.7),
        (8.0, 5.6),
        (16.0, 6.6),
        (24.0, 6.78),
        (32.0, 6.9),
        (40.0, 7.03),
        (48.0, 7.18),
        (56.0, 7.59),
        (64.0, 7.57),
        (72.0, 8.16),
    ];

    struct Lcg(u64);

    impl Lcg {
        fn unit(&mut self) -> f64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// ms until every row (row i accepting each draft with chance `p[i]`) has emitted `new`
    /// tokens, with fixed k or adaptive (after a first run it learns from, as mtp-bench's
    /// repeats do).
    fn makespan(p: &[f64], new: usize, curve: &[(f64, f64)], fixed: Option<usize>, seed: u64) -> f64 {
        let mut cold = KChooser::new(8, 0.0).with_token_group(8);
        run(&mut cold, p, new, curve, fixed, seed + 1000);
        let mut warm = KChooser::new(8, 0.0).with_token_group(8);
        warm.resume(cold.learned());
        run(&mut warm, p, new, curve, fixed, seed)
    }

    fn run(
        c: &mut KChooser,
        p: &[f64],
        new: usize,
        curve: &[(f64, f64)],
        fixed: Option<usize>,
        seed: u64,
    ) -> f64 {
        let mut rng = Lcg(seed);
        let mut left = vec![new; p.len()];
        let mut behind = vec![0; p.len()];
        let mut ms = 0.0;
        while left.iter().any(|&l| l > 0) {
            let live: Vec<usize> = (0..p.len()).filter(|&i| left[i] > 0).collect();
            let cands: Vec<Candidate> = live
                .iter()
                .filter(|&&i| left[i] > 1)
                .map(|&i| Candidate {
                    row: i as u64,
                    cap: 8.min(left[i] - 1),
                    self_paced: false,
                    behind: behind[i],
                    remaining: left[i],
                })
                .collect();
            let ks: Vec<usize> = match fixed {
                Some(k) => cands.iter().map(|c| k.min(c.cap)).collect(),
                None => c.choose(&cands, live.len() - cands.len()),
            };
            let outcomes: Vec<Outcome> = cands
                .iter()
                .zip(&ks)
                .map(|(cand, &k)| {
                    let i = cand.row as usize;
                    let accepted = (0..k).take_while(|_| rng.unit() < p[i]).count();
                    Outcome { row: cand.row, behind: behind[i], asked: k, drafted: k, accepted }
                })
                .collect();
            let tokens = live.len() + ks.iter().sum::<usize>();
            // 2% timing noise.
            let secs = interp(curve, tokens as f64) * 1e-3 * (1.0 + 0.02 * (rng.unit() - 0.5));
            ms += secs * 1e3;
            c.observe(&outcomes, 0.0, secs, tokens, true);
            for &i in &live {
                let o = outcomes.iter().find(|o| o.row == i as u64);
                left[i] -= o.map_or(1, |o| o.accepted + 1).min(left[i]);
                behind[i] = if o.is_some_and(|o| o.asked > 0) { 0 } else { behind[i] + 1 };
                if left[i] == 0 {
                    c.remove(i as u64);
                }
            }
        }
        ms
    }

    /// Mean makespan over seeds.
    fn mean(p: &[f64], curve: &[(f64, f64)], fixed: Option<usize>) -> f64 {
        (1..=6).map(|s| makespan(p, 64, curve, fixed, s)).sum::<f64>() / 6.0
    }

    #[test]
    fn alike_rows_at_batch_finish_near_a_fixed_k() {
        // 64 rows at 70% (oracle:0.7): the rows' own counts used to scatter their k's from
        // 0 to 8, the unlucky rows running on alone at the end: 1.20x k=4's time here
        // (0.98x plain's speed on the H100 where k=4 gave 1.08x).
        let alike = vec![0.7; 64];
        let (k4, auto) = (mean(&alike, H100_64_ROWS, Some(4)), mean(&alike, H100_64_ROWS, None));
        assert!(auto <= 1.05 * k4, "auto {auto:.0} ms against k=4's {k4:.0}");
        // 8 rows (H200): within 3% of the best fixed k, as before.
        for p in [0.4, 0.7, 1.0] {
            let rows = vec![p; 8];
            let best = (1..=8).map(|k| mean(&rows, H200_8_ROWS, Some(k))).fold(f64::MAX, f64::min);
            let auto = mean(&rows, H200_8_ROWS, None);
            assert!(
                auto <= 1.04 * best,
                "8 rows at {p}: auto {auto:.0} ms against the best fixed k's {best:.0}"
            );
        }
    }

    #[test]
    fn rows_that_differ_keep_their_own_k() {
        // Half the rows accept 90%, half 30%: one k for all would be far from either.
        let rows: Vec<f64> = (0..64).map(|i| if i % 2 == 0 { 0.9 } else { 0.3 }).collect();
        let (k4, auto) = (mean(&rows, H100_64_ROWS, Some(4)), mean(&rows, H100_64_ROWS, None));
        assert!(auto <= 0.8 * k4, "auto {auto:.0} ms against k=4's {k4:.0}");
    }

    #[test]
    fn the_row_prior_weighs_by_how_much_rows_differ() {
        let mut c = KChooser::new(8, 0.0);
        let cands: Vec<Candidate> = (0..32)
            .map(|r| Candidate { row: r, cap: 8, self_paced: false, behind: 0, remaining: 64 })
            .collect();
        let mut rng = Lcg(7);
        let observe = |c: &mut KChooser, rng: &mut Lcg, p: &dyn Fn(u64) -> f64| {
            for _ in 0..20 {
                let outcomes: Vec<Outcome> = cands
                    .iter()
                    .map(|cand| {
                        let accepted = (0..4).take_while(|_| rng.unit() < p(cand.row)).count();
                        Outcome { row: cand.row, behind: 0, asked: 4, drafted: 4, accepted }
                    })
                    .collect();
                c.observe(&outcomes, 0.0, 0.01, 160, true);
            }
        };
        assert_eq!(c.row_prior_weight(&cands), ROW_PRIOR_WEIGHT, "no counts yet");
        observe(&mut c, &mut rng, &|_| 0.7);
        let alike = c.row_prior_weight(&cands);
        assert!(alike >= 0.5 * MOST_ROW_PRIOR_WEIGHT, "alike rows: {alike}");
        let mut d = KChooser::new(8, 0.0);
        observe(&mut d, &mut rng, &|r| if r % 2 == 0 { 0.95 } else { 0.2 });
        let differ = d.row_prior_weight(&cands);
        assert!(differ <= 2.0 * ROW_PRIOR_WEIGHT, "rows that differ: {differ}");
    }
}
