//! A tokenizer's special (control) tokens, found in text as the tokenizer finds them:
//! the leftmost occurrence first, and at one position the longest text.

pub struct Specials {
    /// (text, id), longest text first, so the first match at a position is the longest.
    tokens: Vec<(String, u32)>,
    /// For each first byte, the indices into `tokens` of the texts starting with it.
    by_first: Vec<Vec<usize>>,
    /// The ids, sorted.
    ids: Vec<u32>,
}

impl Specials {
    /// The tokens `(text, id)`; empty texts are left out (they match nowhere).
    pub fn new(tokens: impl IntoIterator<Item = (String, u32)>) -> Specials {
        let mut tokens: Vec<(String, u32)> = tokens.into_iter().filter(|(t, _)| !t.is_empty()).collect();
        // Longest first; ties by id, so the order never depends on a hash map's.
        tokens.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut by_first = vec![Vec::new(); 256];
        for (i, (t, _)) in tokens.iter().enumerate() {
            by_first[t.as_bytes()[0] as usize].push(i);
        }
        let mut ids: Vec<u32> = tokens.iter().map(|(_, id)| *id).collect();
        ids.sort_unstable();
        Specials { tokens, by_first, ids }
    }

    /// Whether `id` is a special token's.
    pub fn has_id(&self, id: u32) -> bool {
        self.ids.binary_search(&id).is_ok()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The tokens' texts and ids, longest text first.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u32)> {
        self.tokens.iter().map(|(t, id)| (t.as_str(), *id))
    }

    /// The first special-token text in `text` at or after byte `from`: `(start, end, id)`.
    /// A match starts on a character boundary (a token's text starts with a leading byte).
    pub fn find(&self, text: &str, from: usize) -> Option<(usize, usize, u32)> {
        let bytes = text.as_bytes();
        (from..bytes.len()).find_map(|i| {
            self.by_first[bytes[i] as usize].iter().find_map(|&k| {
                let (t, id) = &self.tokens[k];
                bytes[i..].starts_with(t.as_bytes()).then(|| (i, i + t.len(), *id))
            })
        })
    }

    /// Whether `text` holds the text of some special token.
    pub fn occur_in(&self, text: &str) -> bool {
        self.find(text, 0).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::Specials;

    #[test]
    fn leftmost_then_longest() {
        let s = Specials::new([("<a>".to_string(), 1), ("<a>>".to_string(), 2), ("<b>".to_string(), 3)]);
        assert_eq!(s.find("x<b><a>>", 0), Some((1, 4, 3)));
        assert_eq!(s.find("x<b><a>>", 4), Some((4, 8, 2)));
        assert_eq!(s.find("x<b><a", 4), None);
        assert!(!s.occur_in("é<ab>"));
        assert!(Specials::new([(String::new(), 0)]).is_empty());
    }
}
