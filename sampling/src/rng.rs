//! Counter-based randomness: every number is a pure function of
//! (seed, absolute token position, purpose, index), so what a row draws never depends on
//! how many draws happened before it (batch composition, k, accepted drafts, arrival).
//!
//! The generator is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
//! 1, 2, 3", SC 2011): the counter is (index, position low, position high, purpose), the
//! key is the seed.

/// What a random number is for; each purpose has its own independent stream per position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// Gumbel noise for picking the token at a position (plain sampling, the bonus token,
    /// exact-mode verification and drafters' proposals).
    Sample = 1,
    /// The uniform that accepts or rejects a draft (rejection mode).
    Accept = 2,
    /// Gumbel noise for the replacement token after a rejection (rejection mode).
    Residual = 3,
}

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for _ in 0..10 {
        let p0 = M0 as u64 * c[0] as u64;
        let p1 = M1 as u64 * c[2] as u64;
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// The uniforms of indices `2 * pair` and `2 * pair + 1` (one generator call), each in
/// the open interval (0, 1) with 53 random bits.
pub fn uniform_pair(seed: u64, position: u64, purpose: Purpose, pair: u32) -> [f64; 2] {
    let counter = [pair, position as u32, (position >> 32) as u32, purpose as u32];
    let [a, b, c, d] = philox4x32_10(counter, [seed as u32, (seed >> 32) as u32]);
    let open = |hi: u32, lo: u32| {
        ((((hi as u64) << 21) ^ (lo as u64 >> 11)) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
    };
    [open(a, b), open(c, d)]
}

/// The uniform of `index` for (seed, position, purpose).
pub fn uniform(seed: u64, position: u64, purpose: Purpose, index: u32) -> f64 {
    uniform_pair(seed, position, purpose, index / 2)[(index % 2) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answers() {
        // Known-answer vectors of the Random123 distribution (kat_vectors, philox4x32 10).
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniforms_are_open_interval_and_keyed() {
        let mut sum = 0.0;
        for i in 0..10_000u32 {
            let u = uniform(7, 3, Purpose::Sample, i);
            assert!(u > 0.0 && u < 1.0);
            sum += u;
        }
        assert!((sum / 10_000.0 - 0.5).abs() < 0.01, "mean {}", sum / 10_000.0);
        let u = uniform(7, 3, Purpose::Sample, 0);
        assert_eq!(u.to_bits(), uniform(7, 3, Purpose::Sample, 0).to_bits());
        for other in [
            uniform(8, 3, Purpose::Sample, 0),
            uniform(7, 4, Purpose::Sample, 0),
            uniform(7, 3, Purpose::Accept, 0),
            uniform(7, 3, Purpose::Sample, 1),
        ] {
            assert_ne!(u, other);
        }
        assert_eq!(uniform(7, 3, Purpose::Sample, 5), uniform_pair(7, 3, Purpose::Sample, 2)[1]);
    }
}
