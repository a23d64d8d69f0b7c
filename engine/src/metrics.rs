//! Speculative-decoding counters: acceptance rate, mean accepted length (bonus token
//! included), per-position acceptance, and where the time went.

use std::time::Duration;

#[derive(Clone, Debug, Default)]
pub struct SpecStats {
    /// Engine rounds that ran a verify forward.
    pub rounds: u64,
    /// Row verifications (one per row per round).
    pub verifies: u64,
    /// Draft tokens proposed and verified.
    pub drafted: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// `drafted_at[j]`: verifications with a draft at position `j + 1`.
    pub drafted_at: Vec<u64>,
    /// `accepted_at[j]`: verifications that accepted position `j + 1`.
    pub accepted_at: Vec<u64>,
    /// Prompt tokens admitted, and how many of them the prefix cache supplied.
    pub prompt_tokens: u64,
    pub prompt_tokens_cached: u64,
    /// Rows preempted for lack of K/V room (their blocks freed, their tokens recomputed
    /// when they resume).
    pub preemptions: u64,
    pub prefill_time: Duration,
    pub draft_time: Duration,
    pub verify_time: Duration,
    /// Rounds timed after the cost model had seen one (`timed_rounds`), and how long plain
    /// decoding is estimated to take for the tokens they emitted (`plain_estimate`).
    pub timed_rounds: Duration,
    pub plain_estimate: Duration,
}

impl SpecStats {
    /// Counts one row's verification of `drafted` tokens, `accepted` of them accepted.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.verifies += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        if self.drafted_at.len() < drafted {
            self.drafted_at.resize(drafted, 0);
            self.accepted_at.resize(drafted, 0);
        }
        for j in 0..drafted {
            self.drafted_at[j] += 1;
            self.accepted_at[j] += (j < accepted) as u64;
        }
    }

    /// Accepted / drafted (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted, self.drafted)
    }

    /// Tokens a row gains per verification: accepted drafts plus the bonus token.
    pub fn mean_accepted_length(&self) -> f64 {
        ratio(self.accepted + self.verifies, self.verifies)
    }

    /// Drafts per row verification (the mean k).
    pub fn mean_drafted(&self) -> f64 {
        ratio(self.drafted, self.verifies)
    }

    /// How many times faster than plain decoding the rounds ran, by the engine's own cost
    /// model of a plain round at the same batch size (None before it had timed a round).
    pub fn estimated_speedup(&self) -> Option<f64> {
        let actual = self.timed_rounds.as_secs_f64();
        (actual > 0.0).then(|| self.plain_estimate.as_secs_f64() / actual)
    }

    /// Acceptance rate at draft positions 1..=k (of the verifications that drafted there).
    pub fn per_position_acceptance(&self) -> Vec<f64> {
        self.accepted_at.iter().zip(&self.drafted_at).map(|(&a, &d)| ratio(a, d)).collect()
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_positions_and_bonus() {
        let mut s = SpecStats::default();
        s.record(3, 1);
        s.record(2, 2);
        s.record(0, 0);
        assert_eq!((s.drafted, s.accepted, s.verifies), (5, 3, 3));
        assert_eq!(s.acceptance_rate(), 0.6);
        assert_eq!(s.mean_accepted_length(), 2.0);
        assert_eq!(s.per_position_acceptance(), vec![1.0, 0.5, 0.0]);
    }
}
