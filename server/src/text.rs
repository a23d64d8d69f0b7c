//! A choice's text as its tokens arrive: what may be sent now (never half a character, never
//! the start of a stop string that may still complete) and the final text, cut before the
//! first stop string as OpenAI's API returns it.

use mtp_base::Tokenizer;

pub struct TextState {
    stops: Vec<String>,
    tokens: Vec<u32>,
    /// Bytes of the text already handed out.
    sent: usize,
    /// Special tokens decoded as their text (tool-call and reasoning markers).
    keep: Vec<u32>,
}

impl TextState {
    pub fn new(stops: Vec<String>) -> TextState {
        TextState { stops, tokens: Vec::new(), sent: 0, keep: Vec::new() }
    }

    /// Decodes the special tokens `keep` as their text (markers a parser reads).
    pub fn keeping(mut self, keep: Vec<u32>) -> TextState {
        self.keep = keep;
        self
    }

    pub fn push(&mut self, token: u32) {
        self.tokens.push(token);
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The full text, cut before the earliest stop string.
    fn cut(&self, tok: &Tokenizer) -> (String, bool) {
        let text = tok.decode_keeping(&self.tokens, &self.keep).unwrap_or_default();
        match self.earliest_stop(&text) {
            Some((at, _)) => (text[..at].to_string(), true),
            None => (text, false),
        }
    }

    /// Where the earliest stop string in `text` starts, and which it is (of two starting
    /// there, the first given).
    fn earliest_stop(&self, text: &str) -> Option<(usize, &str)> {
        let found = self.stops.iter().filter_map(|s| text.find(s.as_str()).map(|at| (at, s.as_str())));
        found.min_by_key(|&(at, _)| at)
    }

    /// The stop string the text was cut at, if any (Anthropic's `stop_sequence`).
    pub fn stopped_by(&self, tok: &Tokenizer) -> Option<&str> {
        let text = tok.decode_keeping(&self.tokens, &self.keep).unwrap_or_default();
        self.earliest_stop(&text).map(|(_, s)| s)
    }

    /// Text not yet handed out that is safe to send: when `finished`, all of it (cut at a
    /// stop string); otherwise up to any trailing incomplete character or possible start
    /// of a stop string.
    pub fn delta(&mut self, tok: &Tokenizer, finished: bool) -> String {
        let (text, end) = self.visible(tok, finished);
        if end <= self.sent || !text.is_char_boundary(self.sent) {
            return String::new();
        }
        let out = text[self.sent..end].to_string();
        self.sent = end;
        out
    }

    /// The text so far (cut at a stop string) and how much of it is safe to send: all of
    /// it when `finished`; otherwise up to any trailing incomplete character or possible
    /// start of a stop string.
    pub fn visible(&self, tok: &Tokenizer, finished: bool) -> (String, usize) {
        let (text, stopped) = self.cut(tok);
        let mut end = text.len();
        if !finished && !stopped {
            // An incomplete UTF-8 sequence decodes to U+FFFD until its last byte arrives.
            while text[..end].ends_with('\u{FFFD}') {
                end -= '\u{FFFD}'.len_utf8();
            }
            let held = self.stops.iter().map(|s| longest_suffix_prefix(&text[..end], s)).max().unwrap_or(0);
            end -= held;
        }
        (text, end)
    }

    /// The whole final text.
    pub fn final_text(&self, tok: &Tokenizer) -> String {
        self.cut(tok).0
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`, in time
/// linear in `stop` (the prefix function of `stop` run over `text`'s tail), so a long stop
/// string costs no quadratic work per token. The suffix starts where `stop` does, on a
/// character's first byte, so the length always cuts `text` at a character boundary.
pub(crate) fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let Some((_, p)) = stop.as_bytes().split_last() else { return 0 };
    if p.is_empty() {
        return 0;
    }
    let mut fail = vec![0usize; p.len()];
    let mut k = 0;
    for i in 1..p.len() {
        while k > 0 && p[i] != p[k] {
            k = fail[k - 1];
        }
        if p[i] == p[k] {
            k += 1;
        }
        fail[i] = k;
    }
    let t = text.as_bytes();
    k = 0;
    for &c in &t[t.len().saturating_sub(p.len())..] {
        while k > 0 && (k == p.len() || c != p[k]) {
            k = fail[k - 1];
        }
        if k < p.len() && c == p[k] {
            k += 1;
        }
    }
    k
}

#[cfg(test)]
mod tests {
    use super::longest_suffix_prefix;

    #[test]
    fn held_back_suffixes() {
        assert_eq!(longest_suffix_prefix("abc END", "END"), 0);
        assert_eq!(longest_suffix_prefix("abc EN", "END"), 2);
        assert_eq!(longest_suffix_prefix("abc E", "END"), 1);
        assert_eq!(longest_suffix_prefix("abc", "END"), 0);
        assert_eq!(longest_suffix_prefix("x\n\n", "\n\n\n"), 2);
        assert_eq!(longest_suffix_prefix("abab", "ababc"), 4);
        assert_eq!(longest_suffix_prefix("aabab", "abac"), 2);
        assert_eq!(longest_suffix_prefix("é", "éa"), 2);
        assert_eq!(longest_suffix_prefix("", "ab"), 0);
        assert_eq!(longest_suffix_prefix("abc", ""), 0);
    }

    /// Equal to the quadratic definition on every pair of short strings over a small alphabet.
    #[test]
    fn equals_the_definition() {
        let naive = |text: &str, stop: &str| {
            (1..stop.len())
                .rev()
                .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
                .unwrap_or(0)
        };
        let words = |len: usize| -> Vec<String> {
            let mut all = vec![String::new()];
            for _ in 0..len {
                all = all.iter().flat_map(|w| ["a", "b", "é"].map(|c| format!("{w}{c}"))).collect();
            }
            all
        };
        for text in (0..=4).flat_map(words) {
            for stop in (0..=4).flat_map(words) {
                assert_eq!(longest_suffix_prefix(&text, &stop), naive(&text, &stop), "{text:?} {stop:?}");
            }
        }
    }
}
