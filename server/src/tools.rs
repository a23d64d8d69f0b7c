//! Tool calling: the request's `tools` and `tool_choice`, and each model family's syntax
//! for calls ([`ToolSyntax`]): the grammar that makes a call parse and match its tool's
//! JSON Schema, and the parser that turns the model's text back into OpenAI tool calls.
//!
//! Contract: everything here is a pure function of one request's own tools and one
//! choice's own text; no parser state is shared between requests or choices, so a
//! response's calls are as bitwise-reproducible as its tokens. The grammar (Lark, compiled
//! by llguidance in the engine) is built so that the parser accepts whatever it allows:
//! with `required` or a named function every output is one or more valid calls; with
//! `auto` the text is free until the family's trigger, after which it must be calls.

mod gemma4;
mod hermes;
mod llama3;
pub mod stream;

use serde_json::Value as Json;

use crate::api::{quote, ApiError};

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON Schema (`{"type": "object"}` when the tool gave none).
    pub parameters: Json,
}

/// What `tool_choice` asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// No call may be made (the tools are still shown to the model).
    None,
    /// The model chooses between text and calls.
    Auto,
    /// One call at least.
    Required,
    /// One call of this function.
    Named(String),
}

/// A parsed call: the function's name and its arguments as JSON text.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// A finished output split into its text and its calls.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// A call as far as the text has come, for streaming: `arguments` is always a prefix of
/// the finished call's arguments (empty until the syntax can tell).
#[derive(Clone, Debug, PartialEq)]
pub struct PartialCall {
    pub name: String,
    pub arguments: String,
    pub complete: bool,
}

/// Turns literal text of the syntax into a Lark terminal: a quoted string, or `<[id]>`
/// when the text is one special token (whose bytes a text terminal cannot match).
pub type Literal<'a> = &'a dyn Fn(&str) -> String;

/// A family's tool-call syntax.
pub trait ToolSyntax: Send + Sync {
    /// The name `--tool-parser` takes.
    fn name(&self) -> &'static str;

    /// The text that starts the calls; everything before it is content.
    fn trigger(&self) -> &'static str;

    /// The texts its parser must see: markers that tokenizers may hold as special tokens
    /// (decoded as nothing unless kept).
    fn markers(&self) -> &'static [&'static str];

    /// A Lark grammar over the whole output: for [`ToolChoice::Required`] one call or more
    /// (exactly one unless `parallel`), for [`ToolChoice::Named`] one call of that tool, for
    /// [`ToolChoice::Auto`] text without the trigger or text, the trigger, then calls.
    /// Never asked for [`ToolChoice::None`]. An error names what the syntax cannot express.
    fn grammar(
        &self,
        tools: &[Tool],
        choice: &ToolChoice,
        parallel: bool,
        lit: Literal,
    ) -> Result<String, String>;

    /// The calls in `text`, which starts at the trigger (calls that do not parse are left
    /// out; under the grammar every call parses).
    fn calls(&self, text: &str) -> Vec<PartialCall>;
}

/// The syntaxes `--tool-parser` knows.
pub const SYNTAXES: [&str; 3] = ["hermes", "llama3-json", "gemma4"];

/// A syntax by name.
pub fn syntax(name: &str) -> Option<Box<dyn ToolSyntax>> {
    match name {
        "hermes" => Some(Box::new(hermes::Hermes)),
        "llama3-json" => Some(Box::new(llama3::Llama3Json)),
        "gemma4" => Some(Box::new(gemma4::Gemma4)),
        _ => None,
    }
}

/// The syntax a chat template renders calls in, recognised by its markup: Gemma 4's
/// `<|tool_call>`, Hermes' `<tool_call>` (Qwen 2.5 and 3, Hermes, the trained family),
/// Llama 3.1+'s `<|python_tag|>` / `"parameters"` JSON. `None`: a template without tools.
pub fn detect(template: &str) -> Option<&'static str> {
    if template.contains("<|tool_call>") {
        Some("gemma4")
    } else if template.contains("<tool_call>") {
        Some("hermes")
    } else if template.contains("<|python_tag|>") || template.contains("<|eom_id|>") {
        Some("llama3-json")
    } else {
        None
    }
}

/// The syntax `--tool-parser` names: `auto` detects it from the chat template (none when
/// the template has no tool markup), `none` turns tool calls off.
pub fn choose(flag: &str, template: Option<&str>) -> anyhow::Result<Option<Box<dyn ToolSyntax>>> {
    match flag {
        "none" => Ok(None),
        "auto" => Ok(template.and_then(detect).and_then(syntax)),
        name => syntax(name).map(Some).ok_or_else(|| {
            anyhow::anyhow!("--tool-parser {name}: not one of auto, none, {}", SYNTAXES.join(", "))
        }),
    }
}

/// The id of the special token whose text is exactly `text`.
pub fn special_id(tok: &mtp_base::Tokenizer, text: &str) -> Option<u32> {
    tok.specials().iter().find(|(t, _)| *t == text).map(|(_, id)| id)
}

/// Splits a finished output: the content before the trigger, the calls after it. Without
/// the trigger, or when nothing after it parses, all of it is content. An output cut
/// inside a call (by `max_tokens` or a stop string) keeps that call as far as its stream
/// went, its name and its arguments so far (OpenAI's truncated calls, `finish_reason:
/// length`): a streamed reply cannot take back a call's first chunk, so the whole reply
/// holds what the stream sent.
pub fn parse(syntax: &dyn ToolSyntax, text: &str) -> Parsed {
    let Some(at) = text.find(syntax.trigger()) else {
        return Parsed { content: text.to_string(), calls: Vec::new() };
    };
    let calls: Vec<ToolCall> = syntax
        .calls(&text[at..])
        .into_iter()
        .map(|c| ToolCall { name: c.name, arguments: c.arguments })
        .collect();
    if calls.is_empty() {
        return Parsed { content: text.to_string(), calls };
    }
    Parsed { content: text[..at].to_string(), calls }
}

/// The request's `tools`: `[{"type": "function", "function": {"name", "description",
/// "parameters"}}]`. Names are unique, 1-64 of `a-zA-Z0-9_-` (OpenAI's rule, which keeps
/// them safe inside every family's markup); parameters are a JSON Schema object of known
/// keywords ([`mtp_engine::check_schema_keywords`]), kept with its objects closed
/// ([`mtp_engine::closed_schema`]) for the grammar.
pub fn read_tools(v: &Json) -> Result<Vec<Tool>, ApiError> {
    let list = v.as_array().ok_or_else(|| ApiError::bad("tools", "`tools` must be a list of tools"))?;
    if list.len() > MAX_TOOLS {
        return Err(ApiError::bad("tools", format!("at most {MAX_TOOLS} tools per request")));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let kind = t.get("type").and_then(Json::as_str);
        if kind != Some("function") {
            return Err(ApiError::bad(&format!("tools[{i}].type"), "only tools of type `function` exist"));
        }
        let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
            ApiError::bad(&format!("tools[{i}].function"), "a tool needs a `function` object")
        })?;
        let name = f.get("name").and_then(Json::as_str).unwrap_or_default();
        if !valid_name(name) {
            return Err(ApiError::bad(
                &format!("tools[{i}].function.name"),
                format!("`{}` is not a function name: 1 to 64 of a-z, A-Z, 0-9, _ and -", quote(name)),
            ));
        }
        if tools.iter().any(|t| t.name == name) {
            return Err(ApiError::bad(
                &format!("tools[{i}].function.name"),
                format!("two tools are named `{name}`"),
            ));
        }
        let description = match f.get("description") {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) => Some(s.clone()),
            Some(_) => {
                return Err(ApiError::bad(&format!("tools[{i}].function.description"), "must be a string"))
            }
        };
        let parameters = match f.get("parameters") {
            None | Some(Json::Null) => serde_json::json!({"type": "object", "properties": {}}),
            // Closed as vLLM and SGLang close them: only declared keys, each once.
            Some(p @ Json::Object(_)) => {
                // An endless schema would stall the call mid-way: refused now, by path.
                let at = format!("tools[{i}].function.parameters");
                // A misspelt keyword would constrain nothing: refused by its path.
                mtp_engine::check_schema_keywords(p)
                    .map_err(|(k, e)| ApiError::bad(&format!("{at}.{k}"), e))?;
                mtp_engine::check_finite_schema(p).map_err(|e| ApiError::bad(&at, e))?;
                mtp_engine::closed_schema(p)
            }
            Some(_) => {
                return Err(ApiError::bad(
                    &format!("tools[{i}].function.parameters"),
                    "must be a JSON Schema object",
                ))
            }
        };
        tools.push(Tool { name: name.to_string(), description, parameters });
    }
    Ok(tools)
}

/// Most tools one request may define (each becomes a branch of the grammar).
pub const MAX_TOOLS: usize = 128;

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The request's `tool_choice` (default: `auto` with tools, `none` without).
pub fn read_choice(v: Option<&Json>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let choice = match v {
        None | Some(Json::Null) if tools.is_empty() => ToolChoice::None,
        None | Some(Json::Null) => ToolChoice::Auto,
        Some(Json::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::bad(
                    "tool_choice",
                    format!("`tool_choice` `{}` is not none, auto, required or a function", quote(other)),
                ))
            }
        },
        Some(o @ Json::Object(_)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Json::as_str);
            match (o.get("type").and_then(Json::as_str), name) {
                (Some("function"), Some(n)) => ToolChoice::Named(n.to_string()),
                _ => {
                    return Err(ApiError::bad(
                        "tool_choice",
                        "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ))
                }
            }
        }
        Some(_) => return Err(ApiError::bad("tool_choice", "`tool_choice` must be a string or an object")),
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => {
            Err(ApiError::bad("tool_choice", "`tool_choice` asks for a call but `tools` is empty"))
        }
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => {
            Err(ApiError::bad("tool_choice.function.name", format!("no tool is named `{}`", quote(n))))
        }
        _ => Ok(choice),
    }
}

/// The start of every syntax's grammar: the tools a reply may call (a named choice: that
/// one) and the rules `start` and `call: TRIGGER body` for the choice; the syntax writes
/// `body`. `separator` is the Lark between parallel calls (none: back to back).
pub(crate) fn frame<'t>(
    tools: &'t [Tool],
    choice: &ToolChoice,
    parallel: bool,
    lit: Literal,
    trigger: &str,
    separator: Option<&str>,
) -> Result<(Vec<&'t Tool>, String), String> {
    let allowed: Vec<&Tool> = match choice {
        ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).collect(),
        _ => tools.iter().collect(),
    };
    if allowed.is_empty() {
        return Err("no tool to call".into());
    }
    let more = match separator {
        _ if !parallel || matches!(choice, ToolChoice::Named(_)) => String::new(),
        Some(sep) => format!(" ({sep} call)*"),
        None => " call*".into(),
    };
    let open = lit(trigger);
    let mut g = match choice {
        // Free text that never holds the trigger; or such text and the trigger, then calls.
        // PRE is one terminal: a `stop=` lexeme would refuse a token that runs past the
        // trigger into the call (`>\n` or ` "` is one token in many vocabularies).
        ToolChoice::Auto if open.starts_with('"') => format!(
            "start: PLAIN | PRE body{more}\nPLAIN: /(.|\\n)*/ & ~/(.|\\n)*{}(.|\\n)*/\nPRE: PLAIN {open}\n",
            regex_escape(trigger)
        ),
        // A special token: text cannot spell it, so free text ends where it comes.
        ToolChoice::Auto => format!("start: PLAIN | PLAIN {open} body{more}\nPLAIN: /(.|\\n)*/\n"),
        _ => format!("start: call{more}\n"),
    };
    g.push_str(&format!("call: {open} body\n"));
    Ok((allowed, g))
}

/// Rules `fn: fn0 | fn1 ...`, one per tool, each `"NAME", "KEY": ` then the tool's
/// arguments as compact JSON under its schema (the JSON syntaxes' calls).
pub(crate) fn json_branches(allowed: &[&Tool], key: &str) -> Result<String, String> {
    let names: Vec<String> = (0..allowed.len()).map(|i| format!("fn{i}")).collect();
    let mut g = format!("fn: {}\n", names.join(" | "));
    for (i, t) in allowed.iter().enumerate() {
        let head = format!("{}, {}: ", quoted(&t.name), quoted(key));
        g.push_str(&format!("fn{i}: {} {}\n", quoted(&head), mtp_engine::lark_json(&t.parameters)?));
    }
    Ok(g)
}

/// `s` with llguidance's regex metacharacters escaped (and `"`, which ends a Lark regex).
pub(crate) fn regex_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "\\.+*?()|[]{}^$/\"".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Lark's quoted string for `s` (JSON's escapes are Lark's).
pub fn quoted(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tools_and_choices_are_read_or_refused_by_field() {
        let tools = read_tools(&serde_json::json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "ping"}},
            // Recursion with a way out (the control of the endless schema below).
            {"type": "function", "function": {"name": "tree", "parameters":
                {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}}}
        ]))
        .unwrap();
        assert_eq!(tools.len(), 3);
        assert_eq!(tools[1].parameters["type"], "object");
        for (bad, param) in [
            (serde_json::json!([{"type": "retrieval"}]), "tools[0].type"),
            (
                serde_json::json!([{"type": "function", "function": {"name": "a b"}}]),
                "tools[0].function.name",
            ),
            (
                serde_json::json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]),
                "tools[1].function.name",
            ),
            (
                serde_json::json!([{"type": "function", "function": {"name": "a", "parameters": 3}}]),
                "tools[0].function.parameters",
            ),
            (
                serde_json::json!([{"type": "function", "function": {"name": "a", "parameters":
                    {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}}}]),
                "tools[0].function.parameters",
            ),
        ] {
            assert_eq!(read_tools(&bad).unwrap_err().param.as_deref(), Some(param), "{bad}");
        }
        assert_eq!(read_choice(None, &tools).unwrap(), ToolChoice::Auto);
        assert_eq!(read_choice(None, &[]).unwrap(), ToolChoice::None);
        let named = serde_json::json!({"type": "function", "function": {"name": "ping"}});
        assert_eq!(read_choice(Some(&named), &tools).unwrap(), ToolChoice::Named("ping".into()));
        let unknown = serde_json::json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(
            read_choice(Some(&unknown), &tools).unwrap_err().param.as_deref(),
            Some("tool_choice.function.name")
        );
        assert!(read_choice(Some(&Json::from("required")), &[]).is_err());
    }

    #[test]
    fn detect_finds_each_family_by_its_markup() {
        assert_eq!(detect("{{ '<|tool_call>call:' }}"), Some("gemma4"));
        assert_eq!(detect("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>"), Some("hermes"));
        assert_eq!(detect("{{ '<|python_tag|>' }}"), Some("llama3-json"));
        assert_eq!(detect("{{ messages }}"), None);
        for name in SYNTAXES {
            assert_eq!(syntax(name).unwrap().name(), name);
        }
    }
}

/// What the syntaxes' tests share: a tokenizer's grammar environment and a check that a
/// grammar allows (or forbids) a text and that what it allows parses into calls.
#[cfg(test)]
pub(crate) mod test_support {
    use std::path::PathBuf;

    use mtp_base::Tokenizer;
    use mtp_engine::{Constraint, Grammars};

    use super::*;

    pub struct Cases {
        pub tools: Vec<Tool>,
    }

    pub fn cases() -> Cases {
        let tools = read_tools(&serde_json::json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city"], "additionalProperties": false}}},
            {"type": "function", "function": {"name": "ping"}}
        ]))
        .expect("valid tools");
        Cases { tools }
    }

    /// The trained family's tokenizer (byte-level BPE: any text is tokens).
    pub fn tokenizer() -> Tokenizer {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/trained/target");
        Tokenizer::from_dir(&dir).expect("the trained family's tokenizer")
    }

    /// For each (choice, text, whole): the grammar accepts every token of `text` and can
    /// end there (`whole`), or forbids one of its tokens. Accepted texts parse into calls
    /// whenever the choice requires one.
    pub fn check(syntax: &dyn ToolSyntax, tools: &[Tool], cases: &[(ToolChoice, &str, bool)]) {
        let tok = tokenizer();
        let eos = 0;
        let grammars = Grammars::new(&tok, tok.vocab_size(), &[eos]).expect("grammar environment");
        let lit = |s: &str| quoted(s);
        for (choice, text, whole) in cases {
            let lark = syntax.grammar(tools, choice, true, &lit).expect("a grammar");
            let mut guide =
                grammars.compile(&Constraint::Lark(lark.clone())).unwrap_or_else(|e| panic!("{e}\n{lark}"));
            let ids = tok.encode_plain(text).unwrap();
            let mut allowed = true;
            for &t in &ids {
                if !guide.mask().unwrap().allows(t) {
                    allowed = false;
                    break;
                }
                guide.settle(0, t).unwrap();
            }
            let ends = allowed && guide.mask().unwrap().allows(eos);
            assert_eq!(ends, *whole, "{choice:?} {text:?}\n{lark}");
            if *whole && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
                let p = parse(syntax, text);
                assert!(!p.calls.is_empty() && p.content.is_empty(), "{text:?} -> {p:?}");
                for c in &p.calls {
                    serde_json::from_str::<Json>(&c.arguments).expect("arguments are JSON");
                }
            }
        }
    }
}
