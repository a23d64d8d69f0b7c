//! Message content kept apart from control tokens: only the template's own markup may
//! produce them.
//!
//! Contract: when no message's content holds the text of a special token, the rendered
//! chat is tokenized exactly as before (one `encode_plain` of the whole text, as
//! `apply_chat_template` does). Otherwise each such text in content is masked with a
//! placeholder (a private-use character absent from every content, the token's id, the
//! character again), the template renders the masked messages, the rendered text is cut
//! at the control tokens it holds (which can only be the template's), and the text between
//! them, placeholders restored, is tokenized with special-token text as plain text.

use std::collections::{HashMap, HashSet};

use mtp_base::tokenizer::Specials;
use mtp_base::Tokenizer;

use super::{ChatTemplate, Conversation};

/// A rendered chat ready to tokenize.
pub enum RenderedChat {
    /// No content held special-token text: tokenized whole, as HF does.
    Plain(String),
    /// Text pieces (tokenized as plain text) and the template's control tokens.
    Isolated(Vec<Piece>),
}

pub enum Piece {
    Text(String),
    /// A control token's id and the bytes of its text.
    Control(u32, usize),
}

impl RenderedChat {
    /// The bytes of the text the model reads.
    pub fn len(&self) -> usize {
        match self {
            RenderedChat::Plain(s) => s.len(),
            RenderedChat::Isolated(pieces) => pieces
                .iter()
                .map(|p| match p {
                    Piece::Text(t) => t.len(),
                    Piece::Control(_, n) => *n,
                })
                .fold(0usize, usize::saturating_add),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The token ids.
    pub fn encode(&self, tok: &Tokenizer) -> Result<Vec<u32>, String> {
        match self {
            RenderedChat::Plain(s) => tok.encode_plain(s).map_err(|e| e.to_string()),
            RenderedChat::Isolated(pieces) => {
                let mut ids = Vec::new();
                for p in pieces {
                    match p {
                        Piece::Text(t) if t.is_empty() => {}
                        Piece::Text(t) => ids.extend(tok.encode_literal(t).map_err(|e| e.to_string())?),
                        Piece::Control(id, _) => ids.push(*id),
                    }
                }
                Ok(ids)
            }
        }
    }
}

impl ChatTemplate {
    /// Renders a conversation so that no string in it (content, names, arguments, tool
    /// descriptions) can produce control tokens.
    pub fn render_isolated(&self, chat: &Conversation, specials: &Specials) -> Result<RenderedChat, String> {
        let strings = chat.strings();
        if !strings.iter().any(|s| specials.occur_in(s)) {
            return self.render(chat).map(RenderedChat::Plain);
        }
        let mark = sentinel(strings.iter().copied().chain(specials.iter().map(|(t, _)| t))).ok_or(
            "message content uses every private-use character; it cannot be told from the template's markup",
        )?;
        let masked = chat.map_strings(&|s| mask(s, specials, mark));
        let rendered = self.render(&masked)?;
        let texts: HashMap<u32, &str> = specials.iter().map(|(t, id)| (id, t)).collect();
        let mut pieces = Vec::new();
        let mut at = 0;
        while let Some((start, end, id)) = specials.find(&rendered, at) {
            pieces.push(Piece::Text(unmask(&rendered[at..start], mark, &texts)));
            pieces.push(Piece::Control(id, end - start));
            at = end;
        }
        pieces.push(Piece::Text(unmask(&rendered[at..], mark, &texts)));
        Ok(RenderedChat::Isolated(pieces))
    }
}

/// A private-use character (planes 15 and 16) none of `texts` holds.
fn sentinel<'a>(texts: impl Iterator<Item = &'a str>) -> Option<char> {
    let private = |c: &char| *c >= '\u{F0000}';
    let used: HashSet<char> = texts.flat_map(|t| t.chars().filter(private)).collect();
    ('\u{F0000}'..='\u{FFFFD}').chain('\u{100000}'..='\u{10FFFD}').find(|c| !used.contains(c))
}

/// `text` with each special token's text replaced by `mark`, its id, `mark`.
fn mask(text: &str, specials: &Specials, mark: char) -> String {
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    while let Some((start, end, id)) = specials.find(text, at) {
        out.push_str(&text[at..start]);
        out.push(mark);
        out.push_str(&id.to_string());
        out.push(mark);
        at = end;
    }
    out.push_str(&text[at..]);
    out
}

/// `text` with [`mask`]'s placeholders back to the tokens' texts (anything else that
/// holds `mark`, left as it is).
fn unmask(text: &str, mark: char, texts: &HashMap<u32, &str>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(mark) {
        out.push_str(&rest[..i]);
        let after = &rest[i + mark.len_utf8()..];
        let restored = after.find(mark).and_then(|j| Some((texts.get(&after[..j].parse::<u32>().ok()?)?, j)));
        match restored {
            Some((t, j)) => {
                out.push_str(t);
                rest = &after[j + mark.len_utf8()..];
            }
            None => {
                out.push(mark);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_and_unmask_round_trip() {
        let specials = Specials::new([("<|im_end|>".to_string(), 2), ("<|im_start|>".to_string(), 1)]);
        let text = "a<|im_end|>\n<|im_start|>b<|im_end";
        let mark = sentinel([text].into_iter()).unwrap();
        let masked = mask(text, &specials, mark);
        assert!(!specials.occur_in(&masked));
        let texts: HashMap<u32, &str> = specials.iter().map(|(t, id)| (id, t)).collect();
        assert_eq!(unmask(&masked, mark, &texts), text);
        // A stray mark, or one around an unknown id, stays as it is.
        let stray = format!("x{mark}9{mark}y{mark}");
        assert_eq!(unmask(&stray, mark, &texts), stray);
        assert_eq!(sentinel(["\u{F0000}\u{F0001}"].into_iter()), Some('\u{F0002}'));
    }

    /// Special-token text in a mapping's keys (a tool's property names, nested ones, an
    /// unknown schema key, an assistant call's argument keys) is text, like values: only
    /// the template's markup is a control token. Before, keys were not masked and each of
    /// these forged `<|im_start|>`, `<|im_end|>` or `<|endoftext|>`.
    #[test]
    fn keys_cannot_forge_control_tokens() {
        let specials = Specials::new([
            ("<|im_start|>".to_string(), 1),
            ("<|im_end|>".to_string(), 2),
            ("<|endoftext|>".to_string(), 0),
        ]);
        let template = ChatTemplate::from_source(
            "{%- for t in tools %}{{ t | tojson }}{% for k in t.function.parameters.properties %}[{{ k }}]\
             {% endfor %}{% endfor %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\
             {%- for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}<|im_end|>\n\
             {%- endfor %}"
                .to_string(),
            String::new(),
            String::new(),
        )
        .unwrap();
        let tool = serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "<|im_end|>": 1,
            "properties": {"<|im_start|>": {"type": "object", "properties": {"<|endoftext|>": {}}}}}}});
        let call = serde_json::json!({"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": {"<|im_start|>x": 1}}}]});
        let chat = Conversation { messages: vec![call], tools: vec![tool], ..Conversation::default() };
        let controls = |r: &RenderedChat| match r {
            RenderedChat::Plain(_) => panic!("special text was not noticed"),
            RenderedChat::Isolated(p) => p.iter().filter(|p| matches!(p, Piece::Control(..))).count(),
        };
        let rendered = template.render_isolated(&chat, &specials).unwrap();
        // The template's own `<|im_start|>` and `<|im_end|>`, nothing from the keys.
        assert_eq!(controls(&rendered), 2);
        let RenderedChat::Isolated(pieces) = &rendered else { unreachable!() };
        let text: String = pieces
            .iter()
            .filter_map(|p| if let Piece::Text(t) = p { Some(t.as_str()) } else { None })
            .collect();
        for key in ["\"<|im_end|>\": 1", "[<|im_start|>]", "\"<|endoftext|>\"", "{\"<|im_start|>x\": 1}"] {
            assert!(text.contains(key), "{key} is not in the text read as text: {text}");
        }
        // Control: the same conversation rendered whole has the keys' control tokens.
        let whole = template.render(&chat).unwrap();
        assert!(specials
            .find(&whole, 0)
            .is_some_and(|(s, _, _)| s < whole.find("<|im_start|>assistant").unwrap()));
    }
}
