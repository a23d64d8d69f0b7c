//! A drafter that knows the target's answer: it replays a reference continuation per
//! prompt and corrupts each proposed token with probability `1 - alpha`. With `alpha` it
//! sets the acceptance rate on any checkpoint (speed versus acceptance), and with
//! corruption it forces mixed accepts across a batch (the parity gate's adversary).

use std::collections::HashMap;

use mtp_base::Error;

use crate::sequences::Sequences;
use crate::{unknown_row, Commit, DraftAsk, Drafter, Proposal, RowId};

pub struct OracleDrafter {
    /// prompt -> the target's continuation of it.
    references: HashMap<Vec<u32>, Vec<u32>>,
    alpha: f64,
    seed: u64,
    vocab_size: u32,
    seqs: Sequences,
    prompt_len: HashMap<RowId, usize>,
}

impl OracleDrafter {
    /// `references` pairs each prompt with the target's continuation; `alpha` in [0, 1]
    /// is the probability that a proposed token is left uncorrupted.
    pub fn new(
        references: impl IntoIterator<Item = (Vec<u32>, Vec<u32>)>,
        alpha: f64,
        seed: u64,
        vocab_size: usize,
    ) -> Result<OracleDrafter, Error> {
        if !(0.0..=1.0).contains(&alpha) || vocab_size < 2 {
            return Err(Error::Request {
                request: "oracle drafter".into(),
                msg: format!("alpha must be in [0, 1] (got {alpha}) and the vocabulary at least 2 tokens"),
            });
        }
        Ok(OracleDrafter {
            references: references.into_iter().collect(),
            alpha,
            seed,
            vocab_size: vocab_size as u32,
            seqs: Sequences::default(),
            prompt_len: HashMap::new(),
        })
    }

    /// A uniform draw in [0, 1) fixed by (seed, prompt, position): the same row gets the
    /// same corruption alone or in any batch.
    fn uniform(&self, prompt: &[u32], pos: usize) -> (f64, u32) {
        let mut z = self.seed ^ 0x243F_6A88_85A3_08D3;
        for &t in prompt.iter().chain([&(pos as u32)]) {
            z = splitmix(z ^ t as u64);
        }
        ((z >> 11) as f64 / (1u64 << 53) as f64, (z & 0xFFFF_FFFF) as u32)
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Drafter for OracleDrafter {
    fn name(&self) -> &str {
        "oracle"
    }

    fn commit(&mut self, row: RowId, c: Commit) -> Result<(), Error> {
        if c.start == 0 {
            self.prompt_len.insert(row, c.tokens.len());
        }
        self.seqs.apply(row, &c).map(|_| ())
    }

    fn propose(&mut self, asks: &[DraftAsk]) -> Result<Vec<Proposal>, Error> {
        asks.iter()
            .map(|&DraftAsk { row, k, .. }| {
                let seq = self.seqs.get(row).ok_or_else(|| unknown_row(row))?;
                let p = *self.prompt_len.get(&row).ok_or_else(|| unknown_row(row))?;
                let (prompt, out) = seq.split_at(p);
                let Some(reference) = self.references.get(prompt) else { return Ok(Proposal::default()) };
                // Only while the row still follows the reference.
                if reference.len() < out.len() || reference[..out.len()] != *out {
                    return Ok(Proposal::default());
                }
                let proposal = reference[out.len()..].iter().take(k).enumerate().map(|(j, &t)| {
                    let (u, r) = self.uniform(prompt, seq.len() + j);
                    if u < self.alpha {
                        t
                    } else {
                        (t + 1 + r % (self.vocab_size - 1)) % self.vocab_size
                    }
                });
                Ok(Proposal { tokens: proposal.collect(), dists: Vec::new() })
            })
            .collect()
    }

    fn remove(&mut self, row: RowId) {
        self.seqs.remove(row);
        self.prompt_len.remove(&row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alpha_one_replays_alpha_zero_never_does() {
        let refs = [(vec![5, 6], vec![7, 8, 9, 10])];
        let c = Commit { start: 0, tokens: &[5, 6], hidden: &[], next: 7 };
        let mut exact = OracleDrafter::new(refs.clone(), 1.0, 3, 512).unwrap();
        exact.commit(1, c).unwrap();
        assert_eq!(exact.propose(&[DraftAsk::greedy(1, 5)]).unwrap()[0].tokens, vec![8, 9, 10]);
        let mut wrong = OracleDrafter::new(refs, 0.0, 3, 512).unwrap();
        wrong.commit(1, c).unwrap();
        let d = wrong.propose(&[DraftAsk::greedy(1, 3)]).unwrap().remove(0).tokens;
        assert!(d.iter().zip([8, 9, 10]).all(|(a, b)| *a != b && *a < 512), "{d:?}");
        assert!(OracleDrafter::new([], 1.5, 0, 512).is_err());
    }
}
