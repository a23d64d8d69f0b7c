//! Llama 3.1, 3.2 and 3.3's JSON calls (Meta's custom-tool format): the reply is the call
//! itself, `{"name": NAME, "parameters": {...}}`, perhaps after `<|python_tag|>`; several
//! calls are separated by `; `. Some fine-tunes write `"arguments"` for `"parameters"`; both
//! are read. The grammar writes `{"name": "NAME", "parameters": ARGS}` with compact ARGS.

use serde_json::value::RawValue;

use super::{frame, json_branches, Literal, PartialCall, Tool, ToolChoice, ToolSyntax};

pub struct Llama3Json;

/// How every call starts (plain text, not a special token).
const TRIGGER: &str = "{\"name\": ";
/// Llama's marker before a call it means to run; the call follows it.
const PYTHON_TAG: &str = "<|python_tag|>";
/// Between two calls.
const SEPARATOR: &str = "; ";

impl ToolSyntax for Llama3Json {
    fn name(&self) -> &'static str {
        "llama3-json"
    }

    fn trigger(&self) -> &'static str {
        TRIGGER
    }

    fn markers(&self) -> &'static [&'static str] {
        &["<|python_tag|>"]
    }

    fn grammar(
        &self,
        tools: &[Tool],
        choice: &ToolChoice,
        parallel: bool,
        lit: Literal,
    ) -> Result<String, String> {
        let (allowed, mut g) = frame(tools, choice, parallel, lit, TRIGGER, Some(&lit(SEPARATOR)))?;
        g.push_str("body: fn \"}\"\n");
        g.push_str(&json_branches(&allowed, "parameters")?);
        Ok(g)
    }

    fn calls(&self, text: &str) -> Vec<PartialCall> {
        let mut out = Vec::new();
        let mut rest = text.trim_start();
        rest = rest.strip_prefix(PYTHON_TAG).unwrap_or(rest).trim_start();
        while rest.starts_with('{') {
            let mut values = serde_json::Deserializer::from_str(rest).into_iter::<&RawValue>();
            match values.next() {
                Some(Ok(raw)) => {
                    let end = values.byte_offset();
                    match whole(raw.get()) {
                        Some(c) => out.push(c),
                        None => break,
                    }
                    // `;` and the next call, or the end of the calls.
                    match rest[end..].trim_start().strip_prefix(';') {
                        Some(next) => rest = next.trim_start(),
                        None => break,
                    }
                }
                Some(Err(e)) if e.is_eof() => {
                    out.extend(partial(rest));
                    break;
                }
                _ => break,
            }
        }
        out
    }
}

/// Escapes `s` for a regex of a Lark `/.../` literal (Rust `regex` syntax; `/` ends it).
/// A finished call object: its name, and its arguments exactly as generated (so streamed
/// prefixes are prefixes of them), or a JSON string's text when the model wrote a string.
fn whole(json: &str) -> Option<PartialCall> {
    #[derive(serde::Deserialize)]
    struct Call<'a> {
        name: String,
        #[serde(borrow)]
        parameters: Option<&'a RawValue>,
        #[serde(borrow)]
        arguments: Option<&'a RawValue>,
    }
    let c: Call = serde_json::from_str(json).ok()?;
    let arguments = arguments(c.parameters.or(c.arguments))?;
    Some(PartialCall { name: c.name, arguments, complete: true })
}

/// A whole arguments value as the call's arguments: its text, a string's content, `{}`
/// for none or `null`.
fn arguments(raw: Option<&RawValue>) -> Option<String> {
    match raw.map(RawValue::get) {
        Some(raw) if raw.starts_with('"') => serde_json::from_str::<String>(raw).ok(),
        Some(raw) if raw != "null" => Some(raw.to_string()),
        _ => Some("{}".to_string()),
    }
}

/// An unfinished call `{"name": "NAME", "parameters": ARGS...`: the name once its string
/// is closed; the arguments' text so far, held back by trailing `}` and whitespace (they
/// may close the call rather than the arguments). Arguments that are not an object or
/// list (a JSON string, `null`) stay empty until their value ends.
fn partial(text: &str) -> Option<PartialCall> {
    let after = text.strip_prefix('{')?.trim_start().strip_prefix("\"name\"")?;
    let after = after.trim_start().strip_prefix(':')?.trim_start().strip_prefix('"')?;
    let end = after.find('"')?;
    let name = after[..end].to_string();
    let args = after[end + 1..].trim_start().strip_prefix(',').map(str::trim_start).and_then(|s| {
        let s = s.strip_prefix("\"parameters\"").or_else(|| s.strip_prefix("\"arguments\""))?;
        s.trim_start().strip_prefix(':').map(str::trim_start)
    });
    let args = args.unwrap_or("");
    // A value already whole (a call with more keys after it) is the arguments.
    let mut values = serde_json::Deserializer::from_str(args).into_iter::<&RawValue>();
    let arguments = match values.next() {
        Some(Ok(raw)) => arguments(Some(raw))?,
        _ if args.starts_with(['{', '[']) => args.trim_end_matches(['}', '\n', '\r', '\t', ' ']).to_string(),
        // A string, literal or number still being written: nothing sure yet.
        _ => String::new(),
    };
    Some(PartialCall { name, arguments, complete: false })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::parse;

    fn call(name: &str, arguments: &str, complete: bool) -> PartialCall {
        PartialCall { name: name.into(), arguments: arguments.into(), complete }
    }

    #[test]
    fn calls_parse_whole() {
        let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
        let p = parse(&Llama3Json, text);
        assert_eq!(p.content, "");
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.calls[0].name, "get_weather");
        assert_eq!(p.calls[0].arguments, "{\"city\": \"Paris\"}");
        // After the python tag, and as `parse` sees it under `auto`: text, then the call.
        let tagged = Llama3Json.calls("<|python_tag|>{\"name\": \"ping\", \"parameters\": {}}");
        assert_eq!(tagged, vec![call("ping", "{}", true)]);
        let p = parse(&Llama3Json, "Checking. {\"name\": \"ping\", \"parameters\": {}}");
        assert_eq!(p.content, "Checking. ");
        assert_eq!(p.calls[0].name, "ping");
        // Without parameters: empty arguments.
        assert_eq!(Llama3Json.calls("{\"name\": \"ping\"}"), vec![call("ping", "{}", true)]);
    }

    #[test]
    fn calls_parse_two_calls() {
        let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\":\"Paris\"}}; {\"name\": \"ping\", \"parameters\": {}}";
        assert_eq!(
            Llama3Json.calls(text),
            vec![call("get_weather", "{\"city\":\"Paris\"}", true), call("ping", "{}", true)]
        );
        // Spacing around `;` is free; the second call may be unfinished.
        let text =
            "{\"name\": \"ping\", \"parameters\": {}} ;\n{\"name\": \"get_weather\", \"parameters\": {\"ci";
        assert_eq!(
            Llama3Json.calls(text),
            vec![call("ping", "{}", true), call("get_weather", "{\"ci", false)]
        );
        // A separator with nothing after it yet: one call.
        assert_eq!(
            Llama3Json.calls("{\"name\": \"ping\", \"parameters\": {}}; "),
            vec![call("ping", "{}", true)]
        );
    }

    #[test]
    fn calls_read_the_arguments_key_and_string_parameters() {
        let text = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}";
        assert_eq!(Llama3Json.calls(text), vec![call("get_weather", "{\"city\": \"Oslo\"}", true)]);
        let text = "{\"name\": \"get_weather\", \"parameters\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}";
        assert_eq!(Llama3Json.calls(text), vec![call("get_weather", "{\"city\": \"Oslo\"}", true)]);
        // A string still open has no arguments yet; once closed, its text.
        let open = "{\"name\": \"get_weather\", \"parameters\": \"{\\\"ci";
        assert_eq!(Llama3Json.calls(open), vec![call("get_weather", "", false)]);
        let closed = "{\"name\": \"get_weather\", \"parameters\": \"{}\"";
        assert_eq!(Llama3Json.calls(closed), vec![call("get_weather", "{}", false)]);
        // `null` is no arguments, whole or partial.
        assert_eq!(
            Llama3Json.calls("{\"name\": \"ping\", \"parameters\": nu"),
            vec![call("ping", "", false)]
        );
        assert_eq!(
            Llama3Json.calls("{\"name\": \"ping\", \"parameters\": null}"),
            vec![call("ping", "{}", true)]
        );
        let partial = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Os";
        assert_eq!(Llama3Json.calls(partial), vec![call("get_weather", "{\"city\": \"Os", false)]);
    }

    /// Every prefix of a call reads as a call whose arguments are a prefix of the finished
    /// arguments, with the name only once it is whole.
    #[test]
    fn partial_calls_grow_into_the_whole_call() {
        let texts = [
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris }\", \"opts\": {\"days\": [3, 4]}}}; {\"name\": \"ping\", \"parameters\": {}}",
            "<|python_tag|>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"} };\n{\"name\": \"ping\", \"parameters\": null}",
            "{\"name\": \"get_weather\", \"parameters\": \"{\\\"city\\\": \\\"Oslo\\\"}\"}",
        ];
        for text in texts {
            let whole = Llama3Json.calls(text);
            assert!(!whole.is_empty() && whole.iter().all(|c| c.complete), "{whole:?}");
            let ends = (0..=text.len()).filter(|&i| text.is_char_boundary(i));
            for end in ends {
                let calls = Llama3Json.calls(&text[..end]);
                assert!(calls.len() <= whole.len(), "{end}");
                for (c, w) in calls.iter().zip(&whole) {
                    assert_eq!(c.name, w.name, "{:?}", &text[..end]);
                    assert!(w.arguments.starts_with(&c.arguments), "{:?} -> {c:?}", &text[..end]);
                    assert!(!c.complete || c == w);
                }
            }
        }
        assert_eq!(Llama3Json.calls("{\"name\": \"get_wea"), vec![]);
        assert_eq!(Llama3Json.calls("{\"name\": \"get_weather\""), vec![call("get_weather", "", false)]);
    }

    #[test]
    fn malformed_calls_are_left_out() {
        // Not JSON: no call, all content.
        let p = parse(&Llama3Json, "use {\"name\": here} in the config");
        assert_eq!(p.content, "use {\"name\": here} in the config");
        assert!(p.calls.is_empty());
        // JSON without a string name.
        assert!(Llama3Json.calls("{\"name\": 3, \"parameters\": {}}").is_empty());
        // A good call, then garbage: the good call only.
        let text = "{\"name\": \"ping\", \"parameters\": {}}; {\"name\": oops}";
        assert_eq!(Llama3Json.calls(text), vec![call("ping", "{}", true)]);
        // A call not followed by `;` ends the calls.
        let text = "{\"name\": \"ping\", \"parameters\": {}} and {\"name\": \"ping\", \"parameters\": {}}";
        assert_eq!(Llama3Json.calls(text).len(), 1);
    }

    /// The grammar allows exactly well-formed calls of the given tools (and, under `auto`,
    /// free text first), and whatever it allows parses back into those calls.
    #[test]
    fn grammar_allows_what_the_parser_reads() {
        let cases = crate::tools::test_support::cases();
        crate::tools::test_support::check(&Llama3Json, &cases.tools, &[
            (ToolChoice::Required, "{\"name\": \"get_weather\", \"parameters\": {\"city\":\"Paris\"}}", true),
            (ToolChoice::Required, "{\"name\": \"get_weather\", \"parameters\": {\"city\":\"Paris\",\"days\":3}}; {\"name\": \"ping\", \"parameters\": {}}", true),
            (ToolChoice::Required, "{\"name\": \"get_weather\", \"parameters\": {\"town\":\"Paris\"}}", false),
            (ToolChoice::Required, "{\"name\": \"get_weather\", \"parameters\": {\"days\":3}}", false),
            (ToolChoice::Required, "{\"name\": \"nope\"", false),
            (ToolChoice::Required, "{\"name\": \"get_weather\", \"arguments\": {", false),
            (ToolChoice::Required, "Sure: {\"name\": ", false),
            (ToolChoice::Required, "{\"name\": \"ping\", \"parameters\": {}} and more", false),
            (ToolChoice::Named("ping".into()), "{\"name\": \"get_weather\"", false),
            (ToolChoice::Named("ping".into()), "{\"name\": \"ping\", \"parameters\": {}}", true),
            (ToolChoice::Named("ping".into()), "{\"name\": \"ping\", \"parameters\": {}}; {\"name\": ", false),
            (ToolChoice::Auto, "Just text, no call.", true),
            (ToolChoice::Auto, "JSON-ish {\"name\":\"x\"} text is text.", true),
            (ToolChoice::Auto, "Checking. {\"name\": \"get_weather\", \"parameters\": {\"city\":\"Oslo\"}}", true),
            (ToolChoice::Auto, "{\"name\": \"ping\", \"parameters\": {}}; {\"name\": \"ping\", \"parameters\": {}}", true),
            (ToolChoice::Auto, "Checking. {\"name\": \"nope\"", false),
            (ToolChoice::Auto, "Checking. {\"name\": garbage", false),
            (ToolChoice::Auto, "a {\"name\": \"ping\", \"parameters\": {}} then text", false),
            (ToolChoice::Auto, "a {\"name\": \"ping\", \"parameters\": {}}", true),
        ]);
    }

    #[test]
    fn grammar_obeys_parallel() {
        let cases = crate::tools::test_support::cases();
        let lit = |s: &str| crate::tools::quoted(s);
        let one = Llama3Json.grammar(&cases.tools, &ToolChoice::Required, false, &lit).unwrap();
        assert!(one.starts_with("start: call\n"), "{one}");
        let many = Llama3Json.grammar(&cases.tools, &ToolChoice::Required, true, &lit).unwrap();
        assert!(many.starts_with("start: call (\"; \" call)*\n"), "{many}");
        assert_eq!(crate::tools::regex_escape(TRIGGER), "\\{\\\"name\\\": ");
    }
}
