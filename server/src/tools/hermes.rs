//! Hermes-style calls (Qwen 2.5 and 3, NousResearch Hermes, the trained family): each call
//! is `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>`, calls one per line.

use serde_json::value::RawValue;

use crate::text::longest_suffix_prefix;

use super::{frame, json_branches, Literal, PartialCall, Tool, ToolChoice, ToolSyntax};

pub struct Hermes;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

impl ToolSyntax for Hermes {
    fn name(&self) -> &'static str {
        "hermes"
    }

    fn trigger(&self) -> &'static str {
        OPEN
    }

    fn markers(&self) -> &'static [&'static str] {
        &[OPEN, CLOSE]
    }

    fn grammar(
        &self,
        tools: &[Tool],
        choice: &ToolChoice,
        parallel: bool,
        lit: Literal,
    ) -> Result<String, String> {
        let (allowed, mut g) = frame(tools, choice, parallel, lit, OPEN, Some("\"\\n\""))?;
        g.push_str(&format!("body: \"\\n{{\\\"name\\\": \" fn \"}}\\n\" {}\n", lit(CLOSE)));
        g.push_str(&json_branches(&allowed, "arguments")?);
        Ok(g)
    }

    fn calls(&self, text: &str) -> Vec<PartialCall> {
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find(OPEN) {
            let body = &rest[start + OPEN.len()..];
            let (inner, complete, next) = match body.find(CLOSE) {
                Some(end) => (&body[..end], true, &body[end + CLOSE.len()..]),
                None => (body, false, ""),
            };
            match call(inner.trim(), complete) {
                Some(c) => out.push(c),
                None if complete => {}
                None => break,
            }
            if !complete {
                break;
            }
            rest = next;
        }
        out
    }
}

/// One call's JSON `{"name": ..., "arguments": ...}`. Unfinished: the name once its string
/// is closed, and the arguments' text so far, held back by the one `}` that closes the call.
fn call(inner: &str, complete: bool) -> Option<PartialCall> {
    if complete {
        #[derive(serde::Deserialize)]
        struct Call<'a> {
            name: String,
            #[serde(borrow)]
            arguments: Option<&'a RawValue>,
        }
        let c: Call = serde_json::from_str(inner).ok()?;
        // The arguments exactly as generated (so the streamed prefixes are prefixes of it);
        // a model that wrote them as a JSON string gets the string's text.
        let arguments = match c.arguments.map(RawValue::get) {
            Some(raw) if raw.starts_with('"') => serde_json::from_str::<String>(raw).ok()?,
            Some(raw) => raw.to_string(),
            None => "{}".to_string(),
        };
        return Some(PartialCall { name: c.name, arguments, complete });
    }
    // The grammar's form: {"name": "NAME", "arguments": ARGS}
    let after = inner.strip_prefix("{\"name\": \"")?;
    let end = after.find('"')?;
    let name = after[..end].to_string();
    let args = after[end + 1..].strip_prefix(", \"arguments\": ").unwrap_or("");
    // Keep back what may be the start of the call's end, `}\n</tool_call>`.
    let args = &args[..args.len() - longest_suffix_prefix(args, "}\n</tool_call>")];
    let args = args.trim_end_matches(['}', '\n', ' ']);
    // Keep back the closing braces: they may be the arguments' own or the call's.
    Some(PartialCall { name, arguments: args.to_string(), complete: false })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::parse;

    #[test]
    fn calls_parse_whole_and_partial() {
        let text = "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>";
        let p = parse(&Hermes, text);
        assert_eq!(p.content, "Let me check.");
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.calls[0].name, "get_weather");
        assert_eq!(p.calls[0].arguments, "{\"city\": \"Paris\"}");
        assert_eq!(p.calls[1].arguments, "{}");
        let partial = Hermes.calls("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa");
        assert_eq!(partial.len(), 1);
        assert_eq!(partial[0].name, "get_weather");
        assert!(!partial[0].complete);
        assert_eq!(partial[0].arguments, "{\"city\": \"Pa");
        // Not a call: stays content.
        let p = parse(&Hermes, "see <tool_call> in the docs");
        assert_eq!(p.content, "see <tool_call> in the docs");
        assert!(p.calls.is_empty());
    }

    /// The grammar allows exactly well-formed calls of the given tools (and, under `auto`,
    /// free text first), and whatever it allows parses back into those calls.
    #[test]
    fn grammar_allows_what_the_parser_reads() {
        let cases = crate::tools::test_support::cases();
        crate::tools::test_support::check(&Hermes, &cases.tools, &[
            (ToolChoice::Required, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>", true),
            (ToolChoice::Required, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\":\"Paris\"}}\n</tool_call>", false),
            (ToolChoice::Required, "Sure: <tool_call>", false),
            (ToolChoice::Named("ping".into()), "<tool_call>\n{\"name\": \"get_weather\"", false),
            (ToolChoice::Named("ping".into()), "<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>", true),
            (ToolChoice::Auto, "Just text, no call.", true),
            (ToolChoice::Auto, "Checking.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Oslo\"}}\n</tool_call>", true),
            (ToolChoice::Auto, "Checking.<tool_call>\n{\"name\": \"nope\"", false),
        ]);
    }
}
