//! N-gram prompt lookup: no weights, only the row's own tokens.

use mtp_base::Error;

use crate::sequences::Sequences;
use crate::{unknown_row, Commit, DraftAsk, Drafter, Proposal, RowId};

/// Finds the most recent earlier occurrence of the row's trailing n-gram (longest n
/// first, from `max_n` down to `min_n`) in its prompt and output, and proposes the tokens
/// that followed it. Its only state is each row's sequence, which commits roll back.
#[derive(Debug)]
pub struct NgramDrafter {
    min_n: usize,
    max_n: usize,
    seqs: Sequences,
}

impl NgramDrafter {
    /// Matches n-grams of `min_n..=max_n` tokens (`min_n` at least 1).
    pub fn new(min_n: usize, max_n: usize) -> Result<NgramDrafter, Error> {
        if min_n == 0 || min_n > max_n {
            return Err(Error::Request {
                request: "ngram drafter".into(),
                msg: format!("need 1 <= min_n <= max_n, got min_n {min_n}, max_n {max_n}"),
            });
        }
        Ok(NgramDrafter { min_n, max_n, seqs: Sequences::default() })
    }
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter { min_n: 1, max_n: 4, seqs: Sequences::default() }
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> &str {
        "ngram"
    }

    fn commit(&mut self, row: RowId, c: Commit) -> Result<(), Error> {
        self.seqs.apply(row, &c).map(|_| ())
    }

    fn propose(&mut self, asks: &[DraftAsk]) -> Result<Vec<Proposal>, Error> {
        asks.iter()
            .map(|a| {
                let seq = self.seqs.get(a.row).ok_or_else(|| unknown_row(a.row))?;
                Ok(Proposal { tokens: lookup(seq, a.k, self.min_n, self.max_n), dists: Vec::new() })
            })
            .collect()
    }

    fn remove(&mut self, row: RowId) {
        self.seqs.remove(row);
    }
}

/// Up to `k` tokens that followed the latest earlier match of `seq`'s trailing n-gram.
fn lookup(seq: &[u32], k: usize, min_n: usize, max_n: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    for n in (min_n..=max_n).rev() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_match() {
        // trailing [1, 2] occurred at 0 and 4; the latest (4) is followed by 7, 1, 2.
        assert_eq!(lookup(&[1, 2, 3, 9, 1, 2, 7, 1, 2], 2, 1, 3), vec![7, 1]);
        assert_eq!(lookup(&[1, 2, 3, 1, 2], 5, 1, 3), vec![3, 1, 2]);
        assert_eq!(lookup(&[5, 6, 7], 3, 1, 3), Vec::<u32>::new());
        assert_eq!(lookup(&[5, 5], 0, 1, 3), Vec::<u32>::new());
    }

    #[test]
    fn prefers_longer_ngrams() {
        // n=2 tail [4, 2] matches at 0 (-> 8); n=1 tail [2] would match at 3 (-> 6).
        assert_eq!(lookup(&[4, 2, 8, 2, 6, 4, 2], 1, 1, 2), vec![8]);
    }

    #[test]
    fn commits_roll_the_sequence_back() {
        let mut d = NgramDrafter::new(1, 2).unwrap();
        let c = |start, tokens, next| Commit { start, tokens, hidden: &[], next };
        d.commit(7, c(0, &[1, 2, 3, 1], 2)).unwrap();
        let tokens =
            |d: &mut NgramDrafter, row| d.propose(&[DraftAsk::greedy(row, 2)]).map(|p| p[0].tokens.clone());
        assert_eq!(tokens(&mut d, 7).unwrap(), vec![3, 1]);
        // Positions 4.. are replaced: the sequence is now 1 2 3 1 9 5.
        d.commit(7, c(4, &[9], 5)).unwrap();
        assert_eq!(tokens(&mut d, 7).unwrap(), Vec::<u32>::new());
        assert!(tokens(&mut d, 8).is_err());
        assert!(NgramDrafter::new(0, 2).is_err());
    }
}
