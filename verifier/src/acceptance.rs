/// Greedy acceptance for one row: the number of draft tokens accepted, i.e. the length
/// of the longest prefix of `draft` equal to the target's choices. `target[i]` is the
/// target's argmax after the prefix plus `draft[..i]`, so `target` has `draft.len() + 1`
/// entries and `target[accepted_len]` is the bonus token the target emits next.
pub fn accepted_len(draft: &[u32], target: &[u32]) -> usize {
    assert_eq!(
        target.len(),
        draft.len() + 1,
        "accepted_len: need one target choice per draft plus the bonus"
    );
    draft.iter().zip(target).take_while(|(d, t)| d == t).count()
}

#[cfg(test)]
mod tests {
    use super::accepted_len;

    #[test]
    fn longest_matching_prefix() {
        assert_eq!(accepted_len(&[], &[4]), 0);
        assert_eq!(accepted_len(&[1, 2, 3], &[1, 2, 3, 9]), 3);
        assert_eq!(accepted_len(&[1, 2, 3], &[1, 5, 3, 9]), 1);
        assert_eq!(accepted_len(&[7, 2, 3], &[1, 2, 3, 9]), 0);
    }
}
