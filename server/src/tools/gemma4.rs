//! Gemma 4's calls: `<|tool_call>call:NAME{ARGS}<tool_call|>`, calls back to back, where
//! ARGS is Gemma's own notation (unquoted keys, strings between `<|"|>` markers, JSON
//! numbers, `true`/`false`/`null`, `{...}` and `[...]`, no whitespace).
//!
//! Contract: [`Gemma4::calls`] turns each call's arguments into JSON text (keys quoted in
//! the order written, strings JSON-escaped, numbers as written); an unfinished call gives
//! its name once `call:NAME{` is there and empty arguments (Gemma's arguments are not
//! streamed piecemeal). The grammar translates each tool's JSON Schema into Gemma's
//! notation (keys in the sorted order the chat template writes) and refuses, naming the
//! keyword, what it cannot express; whatever it allows, `calls` reads back as JSON.

use serde_json::{Map, Value as Json};

use super::{frame, quoted, regex_escape, Literal, PartialCall, Tool, ToolChoice, ToolSyntax};

pub struct Gemma4;

const OPEN: &str = "<|tool_call>";
const CLOSE: &str = "<tool_call|>";
/// Gemma's string delimiter, on both sides of a string, nothing escaped inside.
const QUOTE: &str = "<|\"|>";
/// Deepest nesting of objects and arrays `calls` reads.
const MAX_DEPTH: usize = 128;

impl ToolSyntax for Gemma4 {
    fn name(&self) -> &'static str {
        "gemma4"
    }

    fn trigger(&self) -> &'static str {
        OPEN
    }

    fn markers(&self) -> &'static [&'static str] {
        &[OPEN, CLOSE, QUOTE]
    }

    fn grammar(
        &self,
        tools: &[Tool],
        choice: &ToolChoice,
        parallel: bool,
        lit: Literal,
    ) -> Result<String, String> {
        let (allowed, mut g) = frame(tools, choice, parallel, lit, OPEN, None)?;
        let branches: Vec<String> = (0..allowed.len()).map(|i| format!("fn{i}")).collect();
        g.push_str(&format!("body: {}\n", branches.join(" | ")));
        let close = lit(CLOSE);
        let q = lit(QUOTE);
        let mut rules = Rules { tool: "", q: q.clone(), list: Vec::new() };
        for (i, t) in allowed.iter().enumerate() {
            rules.tool = &t.name;
            let args = rules.top(&t.parameters)?;
            g.push_str(&format!("fn{i}: {} {args} {close}\n", quoted(&format!("call:{}", t.name))));
        }
        for r in &rules.list {
            g.push_str(r);
            g.push('\n');
        }
        // Strings: the marker, text without the marker, the marker. When the marker is text,
        // one terminal ends at its first closing marker; a special token ends text by itself.
        if q.starts_with('"') {
            g.push_str(&format!("gstr: GSTR\nGSTR: {q} GTEXT {q}\n"));
            g.push_str(&format!("GTEXT: /(.|\\n)*/ & ~/(.|\\n)*{}(.|\\n)*/\n", regex_escape(QUOTE)));
        } else {
            g.push_str(&format!("gstr: {q} GTEXT {q}\nGTEXT: /(.|\\n)*/\n"));
        }
        g.push_str("INT: /-?(0|[1-9][0-9]*)/\n");
        g.push_str("NUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n");
        // Any value (schemas that leave it open).
        g.push_str("gval: gstr | NUM | \"true\" | \"false\" | \"null\" | gobj | garr\n");
        g.push_str("gobj: \"{\" (gkv (\",\" gkv)*)? \"}\"\n");
        g.push_str("gkv: GKEY \":\" gval\n");
        g.push_str("GKEY: /[^:,{}\\[\\]<>\" \\t\\r\\n]+/\n");
        g.push_str("garr: \"[\" (gval (\",\" gval)*)? \"]\"\n");
        Ok(g)
    }

    fn calls(&self, text: &str) -> Vec<PartialCall> {
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find(OPEN) {
            let body = &rest[start + OPEN.len()..];
            match call(body) {
                Read::Done { name, arguments, len } => {
                    out.push(PartialCall { name, arguments, complete: true });
                    rest = &body[len..];
                }
                Read::Named(name) => {
                    out.push(PartialCall { name, arguments: String::new(), complete: false });
                    break;
                }
                Read::Early => break,
                // A finished call that does not parse is left out; an unfinished one ends the calls.
                Read::Bad => match body.find(CLOSE) {
                    Some(end) => rest = &body[end + CLOSE.len()..],
                    None => break,
                },
            }
        }
        out
    }
}

/// What one call's text (after the trigger) reads as.
enum Read {
    /// A whole call, `len` bytes with its closing marker.
    Done { name: String, arguments: String, len: usize },
    /// Unfinished, past `call:NAME{`.
    Named(String),
    /// Unfinished, before the name is whole.
    Early,
    /// Not a call.
    Bad,
}

fn call(body: &str) -> Read {
    let mut r = Reader { s: body, at: 0 };
    if let Err(miss) = r.eat("call:") {
        return if miss == Miss::More { Read::Early } else { Read::Bad };
    }
    let name_len = r.rest().find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'));
    let Some(name_len) = name_len else { return Read::Early };
    let name = r.rest()[..name_len].to_string();
    if !(1..=64).contains(&name.len()) || !r.rest()[name_len..].starts_with('{') {
        return Read::Bad;
    }
    r.at += name_len;
    let mut arguments = String::new();
    let read = r.value(&mut arguments, 0).and_then(|()| r.eat(CLOSE));
    match read {
        Ok(()) => Read::Done { name, arguments, len: r.at },
        Err(Miss::More) => Read::Named(name),
        Err(Miss::Bad) => Read::Bad,
    }
}

/// Why a value could not be read: the text ends first, or it is not Gemma's notation.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Miss {
    More,
    Bad,
}

/// Reads Gemma values from `s[at..]`, writing them as JSON.
struct Reader<'a> {
    s: &'a str,
    at: usize,
}

impl Reader<'_> {
    fn rest(&self) -> &str {
        &self.s[self.at..]
    }

    /// Steps over `lit`; `More` when the text is a proper prefix of it.
    fn eat(&mut self, lit: &str) -> Result<(), Miss> {
        let rest = self.rest();
        if rest.starts_with(lit) {
            self.at += lit.len();
            Ok(())
        } else if lit.starts_with(rest) {
            Err(Miss::More)
        } else {
            Err(Miss::Bad)
        }
    }

    fn value(&mut self, out: &mut String, depth: usize) -> Result<(), Miss> {
        let rest = self.rest();
        match rest.bytes().next() {
            None => Err(Miss::More),
            Some(b'{' | b'[') if depth >= MAX_DEPTH => Err(Miss::Bad),
            Some(b'{') => self.object(out, depth),
            Some(b'[') => self.array(out, depth),
            Some(b'<') => {
                self.eat(QUOTE)?;
                let end = self.rest().find(QUOTE).ok_or(Miss::More)?;
                out.push_str(&quoted(&self.rest()[..end]));
                self.at += end + QUOTE.len();
                Ok(())
            }
            Some(b'-' | b'0'..=b'9') => {
                let len = rest.find(|c: char| !matches!(c, '0'..='9' | '-' | '+' | '.' | 'e' | 'E'));
                let len = len.ok_or(Miss::More)?;
                if !json_number(&rest[..len]) {
                    return Err(Miss::Bad);
                }
                out.push_str(&rest[..len]);
                self.at += len;
                Ok(())
            }
            Some(_) => {
                for word in ["true", "false", "null"] {
                    match self.eat(word) {
                        Ok(()) => {
                            out.push_str(word);
                            return Ok(());
                        }
                        Err(Miss::More) => return Err(Miss::More),
                        Err(Miss::Bad) => {}
                    }
                }
                Err(Miss::Bad)
            }
        }
    }

    fn object(&mut self, out: &mut String, depth: usize) -> Result<(), Miss> {
        self.eat("{")?;
        out.push('{');
        if self.eat("}").is_ok() {
            out.push('}');
            return Ok(());
        }
        loop {
            let rest = self.rest();
            let len = rest.find(|c: char| !key_char(c)).ok_or(Miss::More)?;
            if len == 0 || !rest[len..].starts_with(':') {
                return Err(Miss::Bad);
            }
            out.push_str(&quoted(&rest[..len]));
            out.push(':');
            self.at += len + 1;
            self.value(out, depth + 1)?;
            if self.eat(",").is_ok() {
                out.push(',');
            } else {
                self.eat("}")?;
                out.push('}');
                return Ok(());
            }
        }
    }

    fn array(&mut self, out: &mut String, depth: usize) -> Result<(), Miss> {
        self.eat("[")?;
        out.push('[');
        if self.eat("]").is_ok() {
            out.push(']');
            return Ok(());
        }
        loop {
            self.value(out, depth + 1)?;
            if self.eat(",").is_ok() {
                out.push(',');
            } else {
                self.eat("]")?;
                out.push(']');
                return Ok(());
            }
        }
    }
}

/// A character an unquoted key may hold (the grammar's `GKEY`).
fn key_char(c: char) -> bool {
    !matches!(c, ':' | ',' | '{' | '}' | '[' | ']' | '<' | '>' | '"' | ' ' | '\t' | '\r' | '\n')
}

/// `s` is a JSON number: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`.
fn json_number(s: &str) -> bool {
    fn digits(b: &[u8]) -> usize {
        b.iter().take_while(|c| c.is_ascii_digit()).count()
    }
    let mut b = s.as_bytes();
    if let [b'-', tail @ ..] = b {
        b = tail;
    }
    let n = digits(b);
    if n == 0 || (n > 1 && b[0] == b'0') {
        return false;
    }
    b = &b[n..];
    if let [b'.', tail @ ..] = b {
        let n = digits(tail);
        if n == 0 {
            return false;
        }
        b = &tail[n..];
    }
    if let [b'e' | b'E', tail @ ..] = b {
        let tail = match tail {
            [b'+' | b'-', t @ ..] => t,
            t => t,
        };
        let n = digits(tail);
        if n == 0 {
            return false;
        }
        b = &tail[n..];
    }
    b.is_empty()
}

/// `s` with regex metacharacters escaped.
/// Keywords that constrain values in ways the grammar does not translate.
const UNSUPPORTED: [&str; 21] = [
    "$ref",
    "$dynamicRef",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "if",
    "then",
    "else",
    "patternProperties",
    "prefixItems",
    "additionalItems",
    "contains",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "minProperties",
    "maxProperties",
];

/// The Lark rules of the tools' argument schemas, in Gemma's notation.
struct Rules<'a> {
    tool: &'a str,
    /// The string marker's terminal.
    q: String,
    list: Vec<String>,
}

impl Rules<'_> {
    fn fail(&self, what: &str) -> String {
        format!("the gemma4 tool syntax cannot express `{what}` in tool `{}`'s parameters", self.tool)
    }

    /// A new rule with this body; its name.
    fn rule(&mut self, body: String) -> String {
        let name = format!("v{}", self.list.len());
        self.list.push(format!("{name}: {body}"));
        name
    }

    fn fields<'s>(&self, s: &'s Json) -> Result<&'s Map<String, Json>, String> {
        let Json::Object(m) = s else { return Err(self.fail(&s.to_string())) };
        if let Some(k) = UNSUPPORTED.iter().find(|k| m.contains_key(**k)) {
            return Err(self.fail(k));
        }
        Ok(m)
    }

    /// A call's arguments: an object.
    fn top(&mut self, s: &Json) -> Result<String, String> {
        let m = self.fields(s)?;
        match m.get("type") {
            None => {}
            Some(Json::String(t)) if t == "object" => {}
            Some(t) => return Err(self.fail(&format!("type: {t}"))),
        }
        self.object(m)
    }

    /// A value of schema `s`: a rule name or a terminal.
    fn value(&mut self, s: &Json) -> Result<String, String> {
        if s == &Json::Bool(true) {
            return Ok("gval".into());
        }
        let m = self.fields(s)?;
        let fixed = match (m.get("const"), m.get("enum")) {
            (Some(c), _) => Some(std::slice::from_ref(c)),
            (None, Some(Json::Array(list))) => Some(list.as_slice()),
            (None, Some(_)) => return Err(self.fail("enum")),
            (None, None) => None,
        };
        if let Some(values) = fixed {
            let mut alts = Vec::new();
            for v in values {
                alts.push(match v {
                    Json::String(t) if t.contains(QUOTE) => return Err(self.fail("enum")),
                    Json::String(t) if t.is_empty() => format!("{} {}", self.q, self.q),
                    Json::String(t) => format!("{} {} {}", self.q, quoted(t), self.q),
                    Json::Number(_) | Json::Bool(_) | Json::Null => quoted(&v.to_string()),
                    _ => return Err(self.fail("enum")),
                });
            }
            if alts.is_empty() {
                return Err(self.fail("enum"));
            }
            return Ok(self.rule(alts.join(" | ")));
        }
        let types: Vec<&str> = match m.get("type") {
            None if m.contains_key("properties") || m.contains_key("additionalProperties") => vec!["object"],
            None if m.contains_key("items") => vec!["array"],
            None => return Ok("gval".into()),
            Some(Json::String(t)) => vec![t.as_str()],
            Some(Json::Array(list)) if !list.is_empty() => {
                let names: Option<Vec<&str>> = list.iter().map(Json::as_str).collect();
                names.ok_or_else(|| self.fail("type"))?
            }
            Some(_) => return Err(self.fail("type")),
        };
        let mut alts = Vec::new();
        for t in types {
            alts.push(match t {
                "string" => "gstr".to_string(),
                "integer" => "INT".to_string(),
                "number" => "NUM".to_string(),
                "boolean" => "\"true\" | \"false\"".to_string(),
                "null" => "\"null\"".to_string(),
                "object" => self.object(m)?,
                "array" => self.array(m)?,
                other => return Err(self.fail(&format!("type: {other}"))),
            });
        }
        Ok(match alts.as_slice() {
            [one] if !one.contains('|') => one.clone(),
            _ => self.rule(alts.join(" | ")),
        })
    }

    fn object(&mut self, m: &Map<String, Json>) -> Result<String, String> {
        let open_schema = matches!(m.get("additionalProperties"), Some(Json::Object(_)));
        let props = match m.get("properties") {
            None if open_schema => return Err(self.fail("additionalProperties")),
            None if m.get("additionalProperties") == Some(&Json::Bool(false)) => return Ok("\"{}\"".into()),
            None => return Ok("gobj".into()),
            Some(Json::Object(p)) if p.is_empty() && open_schema => {
                return Err(self.fail("additionalProperties"))
            }
            Some(Json::Object(p)) => p,
            Some(_) => return Err(self.fail("properties")),
        };
        let required: Vec<&str> = match m.get("required") {
            None => Vec::new(),
            Some(Json::Array(list)) => {
                let names: Option<Vec<&str>> = list.iter().map(Json::as_str).collect();
                names.ok_or_else(|| self.fail("required"))?
            }
            Some(_) => return Err(self.fail("required")),
        };
        if let Some(r) = required.iter().find(|r| !props.contains_key(**r)) {
            return Err(self.fail(&format!("required: {r}")));
        }
        if props.is_empty() {
            return Ok("\"{}\"".into());
        }
        // The template's order: Jinja's dictsort, which ignores case.
        let mut keys: Vec<&String> = props.keys().collect();
        keys.sort_by_key(|k| (k.to_lowercase(), k.as_str()));
        let mut kv = Vec::new();
        let mut need = Vec::new();
        for k in &keys {
            if k.is_empty() || !k.chars().all(key_char) {
                return Err(self.fail(&format!("property name {}", quoted(k))));
            }
            let v = self.value(&props[k.as_str()])?;
            kv.push(self.rule(format!("{} {v}", quoted(&format!("{k}:")))));
            need.push(required.contains(&k.as_str()));
        }
        // first[i]: the properties from i on, at least one, the first without its comma.
        let n = keys.len();
        let base = self.list.len();
        let first: Vec<String> = (0..n).map(|i| format!("v{}", base + i)).collect();
        for i in 0..n {
            let after: String = (i + 1..n)
                .map(|j| if need[j] { format!(" \",\" {}", kv[j]) } else { format!(" (\",\" {})?", kv[j]) })
                .collect();
            let mut body = format!("{}{after}", kv[i]);
            if !need[i] && i + 1 < n {
                body.push_str(&format!(" | {}", first[i + 1]));
            }
            self.rule(body);
        }
        let inner = if need.iter().any(|r| *r) { first[0].clone() } else { format!("{}?", first[0]) };
        Ok(self.rule(format!("\"{{\" {inner} \"}}\"")))
    }

    fn array(&mut self, m: &Map<String, Json>) -> Result<String, String> {
        let item = match m.get("items") {
            None => "gval".to_string(),
            Some(s @ (Json::Object(_) | Json::Bool(true))) => self.value(s)?,
            Some(_) => return Err(self.fail("items")),
        };
        let nonempty = m.get("minItems").and_then(Json::as_u64).is_some_and(|n| n > 0);
        let list = format!("{item} (\",\" {item})*");
        let inner = if nonempty { list } else { format!("({list})?") };
        Ok(self.rule(format!("\"[\" {inner} \"]\"")))
    }
}

#[cfg(test)]
mod tests {
    use mtp_engine::{Constraint, Grammars};
    use serde_json::json;

    use super::*;
    use crate::tools::test_support::{check, tokenizer};
    use crate::tools::{parse, read_tools};

    /// `get_weather` and `ping` as the shared cases, and `plan` with nested objects, arrays,
    /// an enum, a type list and an object opened explicitly (objects are closed by default).
    fn tools() -> Vec<Tool> {
        let mut tools = crate::tools::test_support::cases().tools;
        tools.extend(
            read_tools(&json!([{"type": "function", "function": {"name": "plan", "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "steps": {"type": "array", "items": {"type": "object",
                        "properties": {"what": {"type": "string"}, "done": {"type": "boolean"}},
                        "required": ["what"]}},
                    "owner": {"type": "object",
                        "properties": {"name": {"type": "string"}, "age": {"type": ["integer", "null"]}},
                        "required": ["name"]},
                    "mode": {"enum": ["fast", "slow"]},
                    "ratio": {"type": "number"},
                    "extra": {"type": "object", "additionalProperties": true}
                },
                "required": ["title", "steps"]}}}]))
            .unwrap(),
        );
        tools
    }

    fn args(text: &str) -> Vec<(String, String)> {
        parse(&Gemma4, text).calls.into_iter().map(|c| (c.name, c.arguments)).collect()
    }

    #[test]
    fn calls_parse_whole_and_partial() {
        let text = "Let me check.<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:3}<tool_call|><|tool_call>call:ping{}<tool_call|>";
        let p = parse(&Gemma4, text);
        assert_eq!(p.content, "Let me check.");
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.calls[0].name, "get_weather");
        assert_eq!(p.calls[0].arguments, r#"{"city":"Paris","days":3}"#);
        assert_eq!(p.calls[1].name, "ping");
        assert_eq!(p.calls[1].arguments, "{}");
        // Unfinished: the name once `call:NAME{` is whole, never the arguments.
        for (text, name) in [
            ("<|tool_call>call:get_weather{city:<|\"|>Pa", Some("get_weather")),
            ("<|tool_call>call:get_weather{", Some("get_weather")),
            ("<|tool_call>call:ping{}<tool_ca", Some("ping")),
            ("<|tool_call>call:get_weather{days:1", Some("get_weather")),
            ("<|tool_call>call:get_weather{city:<|\"|>a<|\"|>,days:tr", Some("get_weather")),
            ("<|tool_call>call:get_wea", None),
            ("<|tool_call>cal", None),
            ("<|tool_call>", None),
        ] {
            let calls = Gemma4.calls(text);
            let want: Vec<PartialCall> = name
                .map(|n| PartialCall { name: n.into(), arguments: String::new(), complete: false })
                .into_iter()
                .collect();
            assert_eq!(calls, want, "{text:?}");
        }
        // A whole call, then one under way.
        let calls = Gemma4.calls("<|tool_call>call:ping{}<tool_call|><|tool_call>call:get_weather{ci");
        assert_eq!(calls.len(), 2);
        assert!(calls[0].complete && !calls[1].complete);
        // Not a call: stays content.
        let p = parse(&Gemma4, "see <|tool_call> in the docs");
        assert_eq!(p.content, "see <|tool_call> in the docs");
        assert!(p.calls.is_empty());
    }

    #[test]
    fn arguments_become_json() {
        // Strings hold anything but the marker: commas, colons, braces, quotes, the close tag.
        let text = "<|tool_call>call:get_weather{city:<|\"|>Paris, \"FR\": {x} [y] \\n<tool_call|>\nok<|\"|>}<tool_call|>";
        let want = json!({"city": "Paris, \"FR\": {x} [y] \\n<tool_call|>\nok"});
        let got = args(text);
        assert_eq!(got.len(), 1);
        assert_eq!(serde_json::from_str::<Json>(&got[0].1).unwrap(), want);
        // Nested objects and arrays, numbers as written, booleans, null, keys in order written.
        let text = "<|tool_call>call:plan{extra:{a:[1,<|\"|>x<|\"|>,{b:null}],z:-0.5},mode:<|\"|>fast<|\"|>,owner:{age:null,name:<|\"|><|\"|>},ratio:-1.5e3,steps:[{done:true,what:<|\"|>a<|\"|>},{done:false,what:<|\"|>b<|\"|>}],title:<|\"|>T<|\"|>}<tool_call|>";
        let got = args(text);
        assert_eq!(
            got,
            [(
                "plan".to_string(),
                r#"{"extra":{"a":[1,"x",{"b":null}],"z":-0.5},"mode":"fast","owner":{"age":null,"name":""},"ratio":-1.5e3,"steps":[{"done":true,"what":"a"},{"done":false,"what":"b"}],"title":"T"}"#
                    .to_string()
            )]
        );
        assert_eq!(
            args("<|tool_call>call:plan{a:[],b:{},c:0,d:1E+2}<tool_call|>")[0].1,
            r#"{"a":[],"b":{},"c":0,"d":1E+2}"#
        );
    }

    #[test]
    fn malformed_calls_are_left_out() {
        for bad in [
            "call:get_weather{city:Paris}",
            "call:get_weather{days:01}",
            "call:get_weather{days:1.}",
            "call:get_weather{days:nan}",
            "call:get_weather{city:<|\"|>a<|\"|>,}",
            "call:get_weather{:1}",
            "call:get_weather{city:<|\"|>a<|\"|>} ",
            "call:get weather{}",
            "call:{}",
            "get_weather{}",
            "call:get_weather[1]",
        ] {
            let text = format!("<|tool_call>{bad}<tool_call|><|tool_call>call:ping{{}}<tool_call|>");
            assert_eq!(args(&text), [("ping".to_string(), "{}".to_string())], "{bad:?}");
            let text = format!("Hi<|tool_call>{bad}<tool_call|>");
            let p = parse(&Gemma4, &text);
            assert!(p.calls.is_empty(), "{bad:?}");
            assert_eq!(p.content, text);
        }
        // Unfinished and malformed: nothing, and nothing after it.
        assert!(Gemma4.calls("<|tool_call>call:get_weather{city:Pa").is_empty());
    }

    /// The grammar allows exactly well-formed calls of the given tools (keys in sorted order,
    /// values of their schema's types; under `auto`, free text first), and whatever it allows
    /// parses back into those calls.
    #[test]
    fn grammar_allows_what_the_parser_reads() {
        let q = "<|\"|>";
        let weather = |args: &str| format!("<|tool_call>call:get_weather{{{args}}}<tool_call|>");
        let paris = weather(&format!("city:{q}Paris{q}"));
        let tricky = weather(&format!("city:{q}a, b: {{\"c\"}} [d] <tool_call|> <|\"| e{q},days:-3"));
        let two = format!("{paris}<|tool_call>call:ping{{}}<tool_call|>");
        let plan_full = format!(
            "<|tool_call>call:plan{{extra:{{a:[1,{q}x{q},{{b:null}}],z:-0.5e2}},mode:{q}fast{q},owner:{{age:7,name:{q}Ann{q}}},ratio:1.25,steps:[{{done:true,what:{q}a{q}}},{{what:{q}b{q}}}],title:{q}T{q}}}<tool_call|>"
        );
        let plan_least = format!("<|tool_call>call:plan{{steps:[],title:{q}{q}}}<tool_call|>");
        let plan = |args: &str| format!("<|tool_call>call:plan{{{args}}}<tool_call|>");
        let auto_call = format!("Checking.{paris}");
        let cases: Vec<(ToolChoice, String, bool)> = vec![
            (ToolChoice::Required, paris.clone(), true),
            (ToolChoice::Required, weather(&format!("city:{q}Paris{q},days:3")), true),
            (ToolChoice::Required, tricky, true),
            (ToolChoice::Required, two.clone(), true),
            (ToolChoice::Required, plan_full, true),
            (ToolChoice::Required, plan_least, true),
            // Wrong tool, missing required key, wrong types, keys out of order, extra keys.
            (ToolChoice::Required, "<|tool_call>call:get_wether{".into(), false),
            (ToolChoice::Required, weather("days:3"), false),
            (ToolChoice::Required, weather(&format!("city:{q}Paris{q},days:{q}3{q}")), false),
            (ToolChoice::Required, weather(&format!("city:{q}Paris{q},days:3.5")), false),
            (ToolChoice::Required, weather(&format!("days:3,city:{q}Paris{q}")), false),
            (ToolChoice::Required, weather(&format!("city:{q}Paris{q},town:{q}x{q}")), false),
            (ToolChoice::Required, weather("city:Paris"), false),
            (ToolChoice::Required, weather(&format!("city:{q}Paris{q}, days:3")), false),
            (ToolChoice::Required, plan(&format!("mode:{q}medium{q},steps:[],title:{q}T{q}")), false),
            (ToolChoice::Required, plan(&format!("steps:[{{done:true}}],title:{q}T{q}")), false),
            (
                ToolChoice::Required,
                plan(&format!("owner:{{age:1.5,name:{q}A{q}}},steps:[],title:{q}T{q}")),
                false,
            ),
            (ToolChoice::Required, format!("Sure: {paris}"), false),
            (ToolChoice::Required, format!("{paris}\n"), false),
            (ToolChoice::Required, "<|tool_call>call:get_weather{city:<|\"|>Paris".into(), false),
            (ToolChoice::Named("ping".into()), "<|tool_call>call:get_weather".into(), false),
            (ToolChoice::Named("ping".into()), "<|tool_call>call:ping{}<tool_call|>".into(), true),
            (ToolChoice::Named("ping".into()), "<|tool_call>call:ping{a:1}<tool_call|>".into(), false),
            (
                ToolChoice::Named("ping".into()),
                format!("<|tool_call>call:ping{{}}<tool_call|>{paris}"),
                false,
            ),
            (ToolChoice::Auto, "Just text, no call.".into(), true),
            (ToolChoice::Auto, "A <|tool_call but not the trigger, <tool_call|> neither.".into(), true),
            (ToolChoice::Auto, auto_call, true),
            (ToolChoice::Auto, format!("Two:{two}"), true),
            (ToolChoice::Auto, format!("Checking.{paris} done"), false),
            (ToolChoice::Auto, "Checking.<|tool_call>garbage".into(), false),
            (ToolChoice::Auto, "Checking.<|tool_call>call:nope{".into(), false),
        ];
        let cases: Vec<(ToolChoice, &str, bool)> =
            cases.iter().map(|(c, t, w)| (c.clone(), t.as_str(), *w)).collect();
        let tools = tools();
        check(&Gemma4, &tools, &cases);
        // And the parser reads the allowed texts as the calls written.
        assert_eq!(
            args(&two),
            [
                ("get_weather".to_string(), r#"{"city":"Paris"}"#.to_string()),
                ("ping".to_string(), "{}".to_string())
            ]
        );
    }

    /// Whether `lark` allows `ids` and can end after them.
    fn walk(lark: &str, ids: &[u32]) -> bool {
        let tok = tokenizer();
        let grammars = Grammars::new(&tok, tok.vocab_size(), &[0]).unwrap();
        let mut guide =
            grammars.compile(&Constraint::Lark(lark.to_string())).unwrap_or_else(|e| panic!("{e}\n{lark}"));
        for &t in ids {
            if !guide.mask().unwrap().allows(t) {
                return false;
            }
            guide.settle(0, t).unwrap();
        }
        guide.mask().unwrap().allows(0)
    }

    /// With the call markers as special tokens, text cannot spell them: free text may hold
    /// their spelling, and a call takes the tokens themselves.
    #[test]
    fn grammar_takes_special_tokens() {
        let tok = tokenizer();
        let special = |s: &str| match s {
            OPEN => "<[1]>".to_string(),
            CLOSE => "<[2]>".to_string(),
            _ => quoted(s),
        };
        let text = |s: &str| tok.encode_plain(s).unwrap();
        let call = [vec![1], text("call:get_weather{city:<|\"|>Paris<|\"|>}"), vec![2]].concat();
        let tools = tools();
        let required = Gemma4.grammar(&tools, &ToolChoice::Required, false, &special).unwrap();
        assert!(walk(&required, &call));
        assert!(!walk(&required, &[call.clone(), call.clone()].concat()));
        assert!(!walk(&required, &text("<|tool_call>call:ping{}<tool_call|>")));
        let auto = Gemma4.grammar(&tools, &ToolChoice::Auto, true, &special).unwrap();
        assert!(walk(&auto, &text("Spelled <|tool_call>call:ping{}<tool_call|> is text.")));
        assert!(walk(&auto, &[text("Calling."), call.clone(), call.clone()].concat()));
        assert!(!walk(&auto, &[text("Calling."), vec![1], text("nope")].concat()));
        // The string marker as a special token too: the grammar still compiles and reads.
        let all = |s: &str| match s {
            QUOTE => "<[0]>".to_string(),
            s => special(s),
        };
        let lark = Gemma4.grammar(&tools, &ToolChoice::Required, true, &all).unwrap();
        let ids =
            [vec![1], text("call:get_weather{city:"), vec![0], text("a<|\"|>b"), vec![0], text("}"), vec![2]];
        assert!(walk(&lark, &ids.concat()));
    }

    #[test]
    fn schemas_it_cannot_express_are_named() {
        let tool = |params: Json| {
            read_tools(&json!([{"type": "function", "function": {"name": "t", "parameters": params}}]))
                .unwrap()
        };
        for (params, what) in [
            (json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}}), "$ref"),
            (json!({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}}), "anyOf"),
            (json!({"oneOf": []}), "oneOf"),
            (json!({"type": "object", "properties": {"a": {"allOf": []}}}), "allOf"),
            (json!({"type": "object", "patternProperties": {"^x": {}}}), "patternProperties"),
            (json!({"type": "object", "additionalProperties": {"type": "string"}}), "additionalProperties"),
            (json!({"type": "string"}), "type: \"string\""),
            (json!({"type": "object", "properties": {"a": {"type": "date"}}}), "type: date"),
            (json!({"type": "object", "properties": {"a": {"enum": [{"x": 1}]}}}), "enum"),
            (json!({"type": "object", "properties": {"a": {"type": "array", "items": [{}]}}}), "items"),
            (json!({"type": "object", "properties": {"a b": {}}}), "property name \"a b\""),
            (json!({"type": "object", "properties": {}, "required": ["a"]}), "required: a"),
        ] {
            let err =
                Gemma4.grammar(&tool(params.clone()), &ToolChoice::Required, true, &quoted).unwrap_err();
            assert_eq!(
                err,
                format!("the gemma4 tool syntax cannot express `{what}` in tool `t`'s parameters"),
                "{params}"
            );
        }
        // What it can: additional properties beside listed ones are simply not generated.
        let open = json!({"type": "object", "properties": {"a": {"type": ["string", "integer"], "const": 1}},
                          "additionalProperties": {"type": "string"}});
        assert!(Gemma4.grammar(&tool(open), &ToolChoice::Auto, false, &quoted).is_ok());
    }
}
