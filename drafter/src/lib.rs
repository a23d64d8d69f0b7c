//! Drafters propose tokens for the target to verify.
//!
//! So far: the [`Drafter`] interface and the weight-free n-gram prompt-lookup drafter.
//! Draft-model and MTP-head drafters land with the speculative engine.

/// Proposes up to `k` tokens to follow a row's sequence (prompt + output so far).
pub trait Drafter {
    /// Up to `k` proposed tokens; fewer or none is allowed.
    fn propose(&mut self, sequence: &[u32], k: usize) -> Vec<u32>;
}

/// N-gram prompt lookup: finds the most recent earlier occurrence of the sequence's
/// trailing n-gram (longest n first, from `max_n` down to `min_n`) and proposes the
/// tokens that followed it. Stateless, so it needs no rollback.
#[derive(Clone, Debug)]
pub struct NgramDrafter {
    pub min_n: usize,
    pub max_n: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter { min_n: 1, max_n: 4 }
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, seq: &[u32], k: usize) -> Vec<u32> {
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if seq.len() <= n {
                continue;
            }
            let tail = &seq[seq.len() - n..];
            // Latest earlier match whose continuation exists.
            if let Some(start) = (0..seq.len() - n).rev().find(|&s| &seq[s..s + n] == tail) {
                let from = start + n;
                return seq[from..(from + k).min(seq.len())].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_match() {
        let mut d = NgramDrafter { min_n: 1, max_n: 3 };
        // trailing [1, 2] occurred at 0 and 4; the latest (4) is followed by 7, 1, 2.
        assert_eq!(d.propose(&[1, 2, 3, 9, 1, 2, 7, 1, 2], 2), vec![7, 1]);
        assert_eq!(d.propose(&[1, 2, 3, 1, 2], 5), vec![3, 1, 2]);
        assert_eq!(d.propose(&[5, 6, 7], 3), Vec::<u32>::new());
        assert_eq!(d.propose(&[5, 5], 0), Vec::<u32>::new());
    }

    #[test]
    fn prefers_longer_ngrams() {
        let mut d = NgramDrafter { min_n: 1, max_n: 2 };
        // n=2 tail [4, 2] matches at 0 (-> 8); n=1 tail [2] would match at 3 (-> 6).
        assert_eq!(d.propose(&[4, 2, 8, 2, 6, 4, 2], 1), vec![8]);
    }
}
