//! Reasoning: a model family's thinking markup, split from the answer for the chat API's
//! `reasoning_content`, whole ([`Reasoning::split`]) and streamed ([`ReasoningStream`]).
//!
//! Contract: pure functions of one choice's own text; nothing is shared between requests
//! or choices. A stream fed every prefix of a text (each extending the one before) and
//! then the finished text sends, concatenated, exactly the reasoning and content that
//! `split` gives for the finished text (reasoning `None` reads as ""). It never sends part
//! of a tag, nor text whose side (reasoning or content) or trimming could still change:
//! it holds back a suffix that may begin a tag, and whitespace that may yet be trimmed.
//!
//! The families:
//! - Qwen3 (also DeepSeek-R1 and others that think in `<think>...</think>`): an output
//!   that starts (after whitespace) with `<think>` is reasoning up to `</think>`, trimmed,
//!   and content after it (leading whitespace dropped); without the `</think>` it is all
//!   reasoning, cut off while thinking. Any other output is content. A template that opens
//!   the think block in the prompt (R1, Qwen3 thinking models) is handled by the caller,
//!   which reads the output as if it began with the open tag ([`Reasoning::opened_by`]).
//! - Gemma4: an output that starts (after whitespace) with `<|channel>` is reasoning up to
//!   `<channel|>`, less the channel's name on its first line (`thought\n`), trimmed; the
//!   content follows `<channel|>`, leading whitespace dropped. Any other output is content.
//!
//! Reasoning that trims to nothing is `None`.

/// A family's reasoning markup.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Reasoning {
    Qwen3,
    Gemma4,
}

impl Reasoning {
    /// The names [`Reasoning::from_name`] takes.
    pub const NAMES: [&'static str; 2] = ["qwen3", "gemma4"];

    pub fn name(self) -> &'static str {
        match self {
            Reasoning::Qwen3 => "qwen3",
            Reasoning::Gemma4 => "gemma4",
        }
    }

    pub fn from_name(s: &str) -> Option<Reasoning> {
        match s {
            "qwen3" => Some(Reasoning::Qwen3),
            "gemma4" => Some(Reasoning::Gemma4),
            _ => None,
        }
    }

    /// Recognised from a chat template's markup: `<|channel>` is Gemma4's, `<think>` or
    /// `</think>` Qwen3's (and DeepSeek-R1's); `None` for a template without either.
    pub fn detect(template: &str) -> Option<Reasoning> {
        if template.contains("<|channel>") {
            Some(Reasoning::Gemma4)
        } else if template.contains("<think>") || template.contains("</think>") {
            Some(Reasoning::Qwen3)
        } else {
            None
        }
    }

    /// Whether a rendered prompt leaves a reasoning block open (its last opening tag has
    /// no closing tag after it): the output then starts inside it.
    pub fn opened_by(self, prompt: &str) -> bool {
        let (open, close) = self.tags();
        prompt.rfind(open).is_some_and(|at| !prompt[at..].contains(close))
    }

    /// The tags, which tokenizers may hold as special tokens a parser must see.
    pub fn markers(self) -> [&'static str; 2] {
        let (open, close) = self.tags();
        [open, close]
    }

    /// The opening tag (prefixed to an output that starts inside the block).
    pub fn open_tag(self) -> &'static str {
        self.tags().0
    }

    /// [`Reasoning::split`] of a reply whose prompt opened the block when `opened`.
    pub fn split_reply(self, text: &str, opened: bool) -> (Option<String>, String) {
        if opened {
            self.split(&format!("{}{text}", self.open_tag()))
        } else {
            self.split(text)
        }
    }

    /// (reasoning, content) of a finished output.
    pub fn split(self, text: &str) -> (Option<String>, String) {
        let (reasoning, content) = self.parts(text);
        ((!reasoning.is_empty()).then(|| reasoning.to_string()), content.to_string())
    }

    /// The opening and closing tags.
    fn tags(self) -> (&'static str, &'static str) {
        match self {
            Reasoning::Qwen3 => ("<think>", "</think>"),
            Reasoning::Gemma4 => ("<|channel>", "<channel|>"),
        }
    }

    /// [`Reasoning::split`] as slices of `text` (reasoning "" for none).
    fn parts(self, text: &str) -> (&str, &str) {
        let (open, close) = self.tags();
        let Some(body) = text.trim_start().strip_prefix(open) else { return ("", text) };
        let (inner, content) = match body.find(close) {
            Some(at) => (&body[..at], body[at + close.len()..].trim_start()),
            None => (body, ""),
        };
        (self.without_channel_name(inner).trim(), content)
    }

    /// Gemma's reasoning less its channel's name (Qwen3's as it is).
    fn without_channel_name(self, inner: &str) -> &str {
        match self {
            Reasoning::Qwen3 => inner,
            Reasoning::Gemma4 => after_channel_name(inner),
        }
    }

    /// What of an unfinished output is sure: a prefix of the reasoning and of the content
    /// that `parts` gives for every output that extends `text`.
    fn sure(self, text: &str) -> (&str, &str) {
        let (open, close) = self.tags();
        let lead = text.trim_start();
        match lead.strip_prefix(open) {
            // The first close is fixed: the reasoning is whole, the content grows.
            Some(body) if body.contains(close) => self.parts(text),
            Some(body) => (self.without_channel_name(hold_back(body, close)).trim(), ""),
            // The opening tag may still be coming.
            None if open.starts_with(lead) => ("", ""),
            None => ("", text),
        }
    }
}

/// Gemma's channel text less its first line, the channel's name ("" until that line ends).
fn after_channel_name(inner: &str) -> &str {
    inner.split_once('\n').map_or("", |(_, rest)| rest)
}

/// `text` less its longest suffix that begins `tag` (which may yet complete it).
fn hold_back<'a>(text: &'a str, tag: &str) -> &'a str {
    (1..tag.len()).rev().find(|&n| text.ends_with(&tag[..n])).map_or(text, |n| &text[..text.len() - n])
}

/// One choice's streaming split: fed the whole text so far each time, it returns the new
/// reasoning and content that are safe to send (never part of a tag, never text that
/// could still turn out to be part of a tag or be trimmed).
#[derive(Clone, Debug)]
pub struct ReasoningStream {
    reasoning: Reasoning,
    /// The prompt opened the block: the output is read with the opening tag before it.
    opened: bool,
    /// Bytes of reasoning and of content sent so far.
    sent: (usize, usize),
}

impl ReasoningStream {
    pub fn new(reasoning: Reasoning) -> Self {
        ReasoningStream { reasoning, opened: false, sent: (0, 0) }
    }

    /// A stream whose output starts inside the block when `opened` (see
    /// [`Reasoning::opened_by`]).
    pub fn opened(mut self, opened: bool) -> Self {
        self.opened = opened;
        self
    }

    /// (reasoning_delta, content_delta) for the text so far, which extends the last one
    /// pushed; `finished` on the last push, which sends all that is left.
    pub fn push(&mut self, text: &str, finished: bool) -> (String, String) {
        let with_tag;
        let text = if self.opened {
            with_tag = format!("{}{text}", self.reasoning.open_tag());
            &with_tag
        } else {
            text
        };
        let (r, c) = if finished { self.reasoning.parts(text) } else { self.reasoning.sure(text) };
        // Both are prefixes of the final parts, so what was sent is a prefix of each.
        let delta = |s: &str, sent: &mut usize| {
            let d = s.get(*sent..).unwrap_or_default().to_string();
            *sent = (*sent).max(s.len());
            d
        };
        (delta(r, &mut self.sent.0), delta(c, &mut self.sent.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN: &[&str] = &[
        "<think>\nLet me add 2 and 2.\n</think>\n\nIt is 4.",
        "<think>\n\n</think>\n\nHi",
        "  <think>cut off by max_tokens while thin",
        "Plain answer, no thinking at all.",
        "Reasoning without an opening tag (R1 style)\n</think>\n\nAnswer.",
        "<think>ünïcödé 思考 🎉 <thi </think答え</think>答え 🎉",
        "<think>a </thinking> b</think>c</think>d",
        "<thin",
        "<think>",
        "",
        "   \n",
    ];

    const GEMMA: &[&str] = &[
        "<|channel>thought\nPondering ✓.\n<channel|>\n\nThe answer.",
        "<|channel>thought<channel|>Hi",
        "<|channel>thought\ncut off while thin",
        "No channel here, <|channel>thought\nx<channel|>y",
        "<|chan",
        "  <|channel>thought\nx <channel| y<channel|>z",
        "<|channel>thought\n\n<channel|>ok 🎉 <channel|> again",
        "<|channel>thought\n思考 <channel<channel|>答え",
        "<|channel>",
    ];

    fn some(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    #[test]
    fn names_and_detection() {
        for name in Reasoning::NAMES {
            assert_eq!(Reasoning::from_name(name).unwrap().name(), name);
        }
        assert_eq!(Reasoning::from_name("nope"), None);
        assert_eq!(Reasoning::detect("{{ '<think>\\n' }}"), Some(Reasoning::Qwen3));
        assert_eq!(Reasoning::detect("{% set c = c.split('</think>')[-1] %}"), Some(Reasoning::Qwen3));
        assert_eq!(Reasoning::detect("{{ '<|channel>thought\\n' }}"), Some(Reasoning::Gemma4));
        assert_eq!(Reasoning::detect("{{ messages }}"), None);
    }

    #[test]
    fn qwen3_splits() {
        let q = Reasoning::Qwen3;
        assert_eq!(q.split(QWEN[0]), (some("Let me add 2 and 2."), "It is 4.".into()));
        assert_eq!(q.split(QWEN[1]), (None, "Hi".into()));
        assert_eq!(q.split(QWEN[2]), (some("cut off by max_tokens while thin"), "".into()));
        assert_eq!(q.split(QWEN[3]), (None, QWEN[3].into()));
        // Without the opening tag it is content; a prompt that opened the block is read
        // with the tag put back (`opened_by`).
        assert_eq!(q.split(QWEN[4]), (None, QWEN[4].into()));
        assert!(q.opened_by("<|im_start|>assistant\n<think>\n"));
        assert!(!q.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!q.opened_by("<|im_start|>assistant\n"));
        let opened = format!("{}{}", q.open_tag(), QWEN[4]);
        assert_eq!(q.split(&opened), (some("Reasoning without an opening tag (R1 style)"), "Answer.".into()));
        assert_eq!(q.split(QWEN[6]), (some("a </thinking> b"), "c</think>d".into()));
        assert_eq!(q.split("<thin"), (None, "<thin".into()));
        assert_eq!(q.split("<think>"), (None, "".into()));
        assert_eq!(q.split(""), (None, "".into()));
    }

    #[test]
    fn gemma4_splits() {
        let g = Reasoning::Gemma4;
        assert_eq!(g.split(GEMMA[0]), (some("Pondering ✓."), "The answer.".into()));
        assert_eq!(g.split(GEMMA[1]), (None, "Hi".into()));
        assert_eq!(g.split(GEMMA[2]), (some("cut off while thin"), "".into()));
        assert_eq!(g.split(GEMMA[3]), (None, GEMMA[3].into()));
        assert_eq!(g.split(GEMMA[4]), (None, "<|chan".into()));
        assert_eq!(g.split(GEMMA[5]), (some("x <channel| y"), "z".into()));
        assert_eq!(g.split(GEMMA[6]), (None, "ok 🎉 <channel|> again".into()));
        assert_eq!(g.split("<think>x</think>y"), (None, "<think>x</think>y".into()));
    }

    /// Deltas of `stream` over pushes of `text` cut at `cuts` (increasing byte offsets at
    /// char boundaries), then the finished text; concatenated.
    fn streamed(r: Reasoning, text: &str, cuts: &[usize], hold: bool) -> (String, String) {
        let mut stream = ReasoningStream::new(r);
        let mut naive = (0, 0);
        let (mut reasoning, mut content) = (String::new(), String::new());
        for (i, &end) in cuts.iter().chain([&text.len()]).enumerate() {
            let finished = i == cuts.len();
            let (dr, dc) = if hold {
                stream.push(&text[..end], finished)
            } else {
                naive_push(r, &mut naive, &text[..end])
            };
            reasoning += &dr;
            content += &dc;
        }
        (reasoning, content)
    }

    /// A stream that sends what `split` gives for each prefix as if it were finished,
    /// holding nothing back: the negative control.
    fn naive_push(r: Reasoning, sent: &mut (usize, usize), text: &str) -> (String, String) {
        let (reasoning, content) = r.split(text);
        let reasoning = reasoning.unwrap_or_default();
        let dr = reasoning.get(sent.0..).unwrap_or_default().to_string();
        let dc = content.get(sent.1..).unwrap_or_default().to_string();
        *sent = (sent.0.max(reasoning.len()), sent.1.max(content.len()));
        (dr, dc)
    }

    fn expected(r: Reasoning, text: &str) -> (String, String) {
        let (reasoning, content) = r.split(text);
        (reasoning.unwrap_or_default(), content)
    }

    fn all_texts() -> impl Iterator<Item = (Reasoning, &'static str)> {
        let families = [Reasoning::Qwen3, Reasoning::Gemma4];
        families.into_iter().flat_map(|r| QWEN.iter().chain(GEMMA).map(move |t| (r, *t)))
    }

    fn boundaries(text: &str) -> Vec<usize> {
        (0..text.len()).filter(|&i| text.is_char_boundary(i)).collect()
    }

    #[test]
    fn streaming_every_prefix_matches_split() {
        for (r, text) in all_texts() {
            let cuts = boundaries(text);
            assert_eq!(streamed(r, text, &cuts, true), expected(r, text), "{r:?} {text:?}");
            // One cut anywhere, and one push only.
            for &cut in &cuts {
                assert_eq!(streamed(r, text, &[cut], true), expected(r, text), "{r:?} {text:?} at {cut}");
            }
            assert_eq!(streamed(r, text, &[], true), expected(r, text));
        }
    }

    #[test]
    fn streaming_random_chunks_match_split() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for (r, text) in all_texts() {
            let bounds = boundaries(text);
            for _ in 0..50 {
                let cuts: Vec<usize> = bounds.iter().copied().filter(|_| next() % 3 == 0).collect();
                assert_eq!(streamed(r, text, &cuts, true), expected(r, text), "{r:?} {text:?} {cuts:?}");
            }
        }
    }

    /// The stream sends as it goes, not only at the end: reasoning while thinking, the
    /// answer after the close, never a piece of a tag.
    #[test]
    fn streaming_sends_early_and_never_a_partial_tag() {
        let mut s = ReasoningStream::new(Reasoning::Qwen3);
        assert_eq!(s.push("<think>\nAdd", false), ("Add".into(), "".into()));
        assert_eq!(s.push("<think>\nAdd them. </th", false), (" them.".into(), "".into()));
        assert_eq!(s.push("<think>\nAdd them. </think>\n\nIt", false), ("".into(), "It".into()));
        assert_eq!(s.push("<think>\nAdd them. </think>\n\nIt is 4.", true), ("".into(), " is 4.".into()));
        let mut s = ReasoningStream::new(Reasoning::Gemma4);
        assert_eq!(s.push("<|channel>though", false), ("".into(), "".into()));
        assert_eq!(s.push("<|channel>thought\nHm <chann", false), ("Hm".into(), "".into()));
        assert_eq!(s.push("<|channel>thought\nHm <channel|>Yes", false), ("".into(), "Yes".into()));
        // Output that cannot be reasoning streams as content at once.
        let mut s = ReasoningStream::new(Reasoning::Gemma4);
        assert_eq!(s.push("Hello", false), ("".into(), "Hello".into()));
        // Qwen3 without `<think>` streams as content at once; `<thi` is held.
        let mut s = ReasoningStream::new(Reasoning::Qwen3);
        assert_eq!(s.push("<thi", false), ("".into(), "".into()));
        let mut s = ReasoningStream::new(Reasoning::Qwen3);
        assert_eq!(s.push("Hello", false), ("".into(), "Hello".into()));
        assert_eq!(s.push("Hello there", true), ("".into(), " there".into()));
    }

    /// Negative control: a stream that does not hold back partial tags and trimmable
    /// whitespace sends text that `split` of the finished output leaves out.
    #[test]
    fn naive_streaming_breaks_the_property() {
        let broken: Vec<_> = all_texts()
            .filter(|&(r, text)| streamed(r, text, &boundaries(text), false) != expected(r, text))
            .collect();
        assert!(!broken.is_empty());
        let text = QWEN[0];
        let (reasoning, _) = streamed(Reasoning::Qwen3, text, &boundaries(text), false);
        assert!(reasoning.contains("</"), "{reasoning:?}");
    }
}
