//! A Messages API body: its fields vetted ([`check`]), read ([`MessagesRequest`]) and
//! converted into the chat endpoint's request ([`convert`]).
//!
//! Contract: every field Anthropic's API defines is honoured, ignored (metadata that
//! cannot change the output, its JSON type still checked) or refused unless neutral, as
//! [`crate::api::audit`] does for OpenAI's; a field it does not define (nor the `seed`
//! extension) is refused by name. Content blocks are text, `tool_use` (assistant),
//! `tool_result` (user) and `thinking` / `redacted_thinking` (assistant); images,
//! documents and server tools are refused naming the block. The conversion only renames:
//! the system prompt becomes the first message, a user message's `tool_result` blocks
//! become tool messages in order, an assistant's `tool_use` blocks its tool calls, its
//! `thinking` its `reasoning_content`. A refusal from the chat path is renamed back to the
//! Anthropic field ([`renamed`]).

use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::audit::{self, Rule, Type};
use crate::api::{quote, ApiError, ChatRequest, Common, Content, Message, Stop, StreamOptions};
use Rule::{Honoured, Ignored, Refused};

/// Which endpoint a body came to: `count_tokens` takes the prompt's fields only.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Endpoint {
    Create,
    CountTokens,
}

fn never(_: &Value) -> bool {
    false
}
fn no_entries(v: &Value) -> bool {
    v.as_array().is_some_and(|a| a.is_empty())
}

/// Fields both endpoints define.
const PROMPT: &[(&str, Rule)] = &[
    ("model", Honoured),
    ("messages", Honoured),
    ("system", Honoured),
    ("tools", Honoured),
    ("tool_choice", Honoured),
    // Validated; the model reasons when its output does (its markup is split into
    // thinking blocks), and `max_tokens` bounds reasoning and answer together.
    ("thinking", Honoured),
    ("output_config", Honoured),
    // Caching and routing hints: the output is the same without them.
    ("cache_control", Ignored(Type::Object)),
    ("speed", Ignored(Type::String)),
    ("user_profile_id", Ignored(Type::String)),
    ("workspace_id", Ignored(Type::String)),
    ("mcp_servers", Refused { neutral: no_entries, why: "MCP servers are not supported" }),
    ("context_management", Refused { neutral: never, why: "context management is not supported" }),
];

/// Fields only `POST /v1/messages` defines.
const CREATE: &[(&str, Rule)] = &[
    ("max_tokens", Honoured),
    ("stop_sequences", Honoured),
    ("stream", Honoured),
    ("temperature", Honoured),
    ("top_p", Honoured),
    ("top_k", Honoured),
    // Extension, as the chat endpoint's: a sampled reply reproduces with its seed.
    ("seed", Honoured),
    ("metadata", Ignored(Type::Object)),
    ("service_tier", Ignored(Type::String)),
    ("inference_geo", Ignored(Type::String)),
    ("diagnostics", Ignored(Type::Object)),
    ("container", Refused { neutral: never, why: "containers (code execution) are not supported" }),
];

const MESSAGE: &[(&str, Rule)] = &[("role", Honoured), ("content", Honoured)];
const TEXT: &[(&str, Rule)] = &[
    ("type", Honoured),
    ("text", Honoured),
    ("cache_control", Ignored(Type::Object)),
    ("citations", Refused { neutral: no_entries, why: "citations are not supported" }),
];
const TOOL_USE: &[(&str, Rule)] = &[
    ("type", Honoured),
    ("id", Honoured),
    ("name", Honoured),
    ("input", Honoured),
    ("cache_control", Ignored(Type::Object)),
    ("caller", Ignored(Type::Object)),
];
/// `is_error` has no place in a chat template's tool message: the result's text is what
/// the model reads.
const TOOL_RESULT: &[(&str, Rule)] = &[
    ("type", Honoured),
    ("tool_use_id", Honoured),
    ("content", Honoured),
    ("is_error", Ignored(Type::Bool)),
    ("cache_control", Ignored(Type::Object)),
];
const THINKING: &[(&str, Rule)] =
    &[("type", Honoured), ("thinking", Honoured), ("signature", Ignored(Type::String))];
const REDACTED_THINKING: &[(&str, Rule)] = &[("type", Honoured), ("data", Ignored(Type::String))];
const TOOL: &[(&str, Rule)] = &[
    ("type", Honoured),
    ("name", Honoured),
    ("description", Honoured),
    ("input_schema", Honoured),
    ("cache_control", Ignored(Type::Object)),
    // The input is generated under the schema, closed, whether or not `strict` is sent.
    ("strict", Ignored(Type::Bool)),
    ("eager_input_streaming", Ignored(Type::Bool)),
];
const TOOL_CHOICE: &[(&str, Rule)] =
    &[("type", Honoured), ("name", Honoured), ("disable_parallel_tool_use", Honoured)];
const THINKING_CONFIG: &[(&str, Rule)] =
    &[("type", Honoured), ("budget_tokens", Honoured), ("display", Ignored(Type::String))];
const OUTPUT_CONFIG: &[(&str, Rule)] =
    &[("format", Honoured), ("effort", Refused { neutral: never, why: "the model has no effort setting" })];
const FORMAT: &[(&str, Rule)] = &[("type", Honoured), ("schema", Honoured)];

/// Vets `body`'s fields and those of the objects inside it, in order: the first offending
/// one is refused, named by its JSON path.
pub(super) fn check(body: &Value, endpoint: Endpoint) -> Result<(), ApiError> {
    match endpoint {
        Endpoint::Create => audit::check(body, &[PROMPT, CREATE], "")?,
        Endpoint::CountTokens => audit::check(body, &[PROMPT], "")?,
    }
    let list = |key: &str| body.get(key).and_then(Value::as_array).into_iter().flatten().enumerate();
    for (i, m) in list("messages") {
        let at = format!("messages[{i}]");
        audit::check(m, &[MESSAGE], &at)?;
        for (j, b) in m.get("content").and_then(Value::as_array).into_iter().flatten().enumerate() {
            check_block(b, &format!("{at}.content[{j}]"))?;
        }
    }
    for (i, b) in list("system") {
        check_block(b, &format!("system[{i}]"))?;
    }
    for (i, t) in list("tools") {
        audit::check(t, &[TOOL], &format!("tools[{i}]"))?;
    }
    for (key, table) in
        [("tool_choice", TOOL_CHOICE), ("thinking", THINKING_CONFIG), ("output_config", OUTPUT_CONFIG)]
    {
        if let Some(v) = body.get(key) {
            audit::check(v, &[table], key)?;
        }
    }
    if let Some(f) = body.get("output_config").and_then(|o| o.get("format")) {
        audit::check(f, &[FORMAT], "output_config.format")?;
    }
    Ok(())
}

/// A content block's keys by its type (an unknown type is the reader's to refuse).
fn check_block(b: &Value, at: &str) -> Result<(), ApiError> {
    let table = match b.get("type").and_then(Value::as_str) {
        Some("text") => TEXT,
        Some("tool_use") => TOOL_USE,
        Some("tool_result") => TOOL_RESULT,
        Some("thinking") => THINKING,
        Some("redacted_thinking") => REDACTED_THINKING,
        _ => return Ok(()),
    };
    audit::check(b, &[table], at)?;
    if let Some(inner) = b.get("content").and_then(Value::as_array) {
        for (k, c) in inner.iter().enumerate() {
            check_block(c, &format!("{at}.content[{k}]"))?;
        }
    }
    Ok(())
}

/// The fields both endpoints read (`max_tokens` is required by `/v1/messages` only, and
/// the generation fields are refused by [`check`] at `count_tokens`).
#[derive(Deserialize, Debug)]
pub(super) struct MessagesRequest {
    pub model: String,
    pub messages: Vec<InputMessage>,
    pub system: Option<System>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<ToolChoice>,
    pub thinking: Option<ThinkingConfig>,
    pub output_config: Option<OutputConfig>,
    pub max_tokens: Option<u64>,
    pub stop_sequences: Option<Vec<String>>,
    pub stream: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
}

#[derive(Deserialize, Debug)]
pub(super) struct InputMessage {
    pub role: String,
    pub content: InputContent,
}

/// A string, or content blocks (read by [`blocks`], which names the one at fault).
#[derive(Deserialize, Debug)]
#[serde(untagged, expecting = "a string or a list of content blocks")]
pub(super) enum InputContent {
    Text(String),
    Blocks(Vec<Value>),
}

#[derive(Deserialize, Debug)]
#[serde(untagged, expecting = "a string or a list of text blocks")]
pub(super) enum System {
    Text(String),
    Blocks(Vec<Value>),
}

#[derive(Deserialize, Debug)]
pub(super) struct ToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    pub disable_parallel_tool_use: Option<bool>,
}

#[derive(Deserialize, Debug)]
pub(super) struct ThinkingConfig {
    #[serde(rename = "type")]
    pub kind: String,
    pub budget_tokens: Option<u64>,
}

#[derive(Deserialize, Debug)]
pub(super) struct OutputConfig {
    pub format: Option<Value>,
}

/// The chat endpoint's fields for a Messages body: the shared ones and the chat request.
pub(super) fn convert(r: MessagesRequest, endpoint: Endpoint) -> Result<(Common, ChatRequest), ApiError> {
    if endpoint == Endpoint::Create && r.max_tokens.is_none() {
        return Err(ApiError::bad("max_tokens", "missing field `max_tokens`"));
    }
    if r.messages.is_empty() {
        return Err(ApiError::bad("messages", "`messages` is empty"));
    }
    // Anthropic's range, narrower than chat's: 1.5 would sample hotter than the API allows.
    if let Some(t) = r.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(ApiError::bad("temperature", format!("`temperature` must be between 0 and 1, got {t}")));
    }
    if let Some(t) = &r.thinking {
        if !["enabled", "disabled", "adaptive"].contains(&t.kind.as_str()) {
            return Err(ApiError::bad(
                "thinking.type",
                format!("`{}` is not one of enabled, disabled, adaptive", quote(&t.kind)),
            ));
        }
        if t.kind == "enabled" && t.budget_tokens.is_none() {
            return Err(ApiError::bad(
                "thinking.budget_tokens",
                "`thinking` of type enabled needs `budget_tokens`",
            ));
        }
    }
    let mut messages = Vec::new();
    match r.system {
        None => {}
        Some(System::Text(s)) => messages.push(text_message("system", s)),
        Some(System::Blocks(blocks)) => {
            let text = blocks
                .iter()
                .enumerate()
                .map(|(i, b)| text_of(b, &format!("system[{i}]")))
                .collect::<Result<String, _>>()?;
            messages.push(text_message("system", text));
        }
    }
    let last = r.messages.len() - 1;
    for (i, m) in r.messages.into_iter().enumerate() {
        let at = format!("messages[{i}]");
        match m.role.as_str() {
            "user" => user(m.content, &at, &mut messages)?,
            "assistant" if i == last => {
                return Err(ApiError::bad(
                    &format!("{at}.role"),
                    "a final assistant message (prefill) is not supported: end with a user message",
                ))
            }
            "assistant" => messages.push(assistant(m.content, &at)?),
            other => {
                return Err(ApiError::bad(
                    &format!("{at}.role"),
                    format!("unknown role `{}` (known: user, assistant)", quote(other)),
                ))
            }
        }
    }
    let tools = r.tools.map(|list| list.iter().enumerate().map(|(i, t)| tool(t, i)).collect()).transpose()?;
    let (tool_choice, parallel) = match r.tool_choice {
        None => (None, None),
        Some(c) => {
            let choice = match (c.kind.as_str(), &c.name) {
                ("auto", _) => json!("auto"),
                ("any", _) => json!("required"),
                ("none", _) => json!("none"),
                ("tool", Some(name)) => json!({"type": "function", "function": {"name": name}}),
                ("tool", None) => {
                    return Err(ApiError::bad(
                        "tool_choice.name",
                        "a `tool_choice` of type tool needs `name`",
                    ))
                }
                (other, _) => {
                    return Err(ApiError::bad(
                        "tool_choice.type",
                        format!("`{}` is not one of auto, any, tool, none", quote(other)),
                    ))
                }
            };
            (Some(choice), c.disable_parallel_tool_use.map(|d| !d))
        }
    };
    let response_format = match r.output_config.and_then(|o| o.format) {
        None | Some(Value::Null) => None,
        Some(f) if f.get("type").and_then(Value::as_str) == Some("json_schema") => {
            Some(json!({"type": "json_schema", "json_schema": {"schema": f.get("schema")}}))
        }
        Some(_) => {
            return Err(ApiError::bad("output_config.format.type", "the only output format is `json_schema`"))
        }
    };
    let stream = r.stream.unwrap_or(false);
    let common = Common {
        model: Some(r.model),
        max_tokens: r.max_tokens,
        temperature: r.temperature,
        top_p: r.top_p,
        top_k: r.top_k,
        seed: r.seed,
        stop: r.stop_sequences.map(Stop::Many),
        stream: Some(stream),
        // The usage chunk carries the stream's output tokens; the token ids tell which
        // stop sequence ended the reply.
        stream_options: stream.then_some(StreamOptions { include_usage: Some(true) }),
        return_token_ids: Some(true),
        response_format,
        ..Common::default()
    };
    let chat = ChatRequest {
        messages,
        logprobs: None,
        top_logprobs: None,
        max_completion_tokens: None,
        tools: tools.map(Value::Array),
        tool_choice,
        parallel_tool_calls: parallel,
        // Thinking on or off as templates that can switch it read it (Qwen3's
        // `enable_thinking`); adaptive leaves the template's default.
        chat_template_kwargs: match r.thinking.as_ref().map(|t| t.kind.as_str()) {
            Some("enabled") => Some(serde_json::json!({"enable_thinking": true})),
            Some("disabled") => Some(serde_json::json!({"enable_thinking": false})),
            _ => None,
        },
    };
    Ok((common, chat))
}

fn text_message(role: &str, text: String) -> Message {
    Message {
        role: role.into(),
        content: Some(Content::Text(text)),
        name: None,
        tool_calls: None,
        tool_call_id: None,
        reasoning_content: None,
    }
}

/// The block's `type`, or a refusal naming it.
fn block_type<'a>(b: &'a Value, at: &str) -> Result<&'a str, ApiError> {
    b.get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad(&format!("{at}.type"), "a content block needs a `type`"))
}

/// A string field of a block, or a refusal naming it.
fn string<'a>(b: &'a Value, key: &str, at: &str) -> Result<&'a str, ApiError> {
    b.get(key).and_then(Value::as_str).ok_or_else(|| {
        ApiError::bad(
            &format!("{at}.{key}"),
            format!("a `{}` block needs `{key}`, a string", b["type"].as_str().unwrap_or("")),
        )
    })
}

/// The text of a text block (anything else refused, naming its type).
fn text_of(b: &Value, at: &str) -> Result<String, ApiError> {
    match block_type(b, at)? {
        "text" => Ok(string(b, "text", at)?.to_string()),
        other => Err(unsupported(other, &format!("{at}.type"), "text")),
    }
}

fn unsupported(kind: &str, at: &str, here: &str) -> ApiError {
    ApiError::bad(
        at,
        format!("content blocks of type `{}` are not supported here ({here} only)", quote(kind)),
    )
}

/// A user turn: its text as one user message, each `tool_result` a tool message, in order.
fn user(content: InputContent, at: &str, out: &mut Vec<Message>) -> Result<(), ApiError> {
    let blocks = match content {
        InputContent::Text(s) => {
            out.push(text_message("user", s));
            return Ok(());
        }
        InputContent::Blocks(b) if b.is_empty() => {
            return Err(ApiError::bad(&format!("{at}.content"), "a user message needs content"))
        }
        InputContent::Blocks(b) => b,
    };
    let mut text: Option<String> = None;
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match block_type(b, &at)? {
            "text" => text.get_or_insert_with(String::new).push_str(string(b, "text", &at)?),
            "tool_result" => {
                if let Some(t) = text.take() {
                    out.push(text_message("user", t));
                }
                let id = string(b, "tool_use_id", &at)?;
                let result = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .enumerate()
                        .map(|(k, p)| text_of(p, &format!("{at}.content[{k}]")))
                        .collect::<Result<String, _>>()?,
                    Some(_) => {
                        return Err(ApiError::bad(
                            &format!("{at}.content"),
                            "a tool result's content is a string or a list of text blocks",
                        ))
                    }
                };
                let mut m = text_message("tool", result);
                m.tool_call_id = Some(id.to_string());
                out.push(m);
            }
            other => return Err(unsupported(other, &format!("{at}.type"), "text and tool_result")),
        }
    }
    if let Some(t) = text {
        out.push(text_message("user", t));
    }
    Ok(())
}

/// An assistant turn: its text, reasoning and tool calls as one assistant message.
fn assistant(content: InputContent, at: &str) -> Result<Message, ApiError> {
    let blocks = match content {
        InputContent::Text(s) => return Ok(text_message("assistant", s)),
        InputContent::Blocks(b) => b,
    };
    let (mut text, mut reasoning, mut calls) = (String::new(), None::<String>, Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match block_type(b, &at)? {
            "text" => text.push_str(string(b, "text", &at)?),
            "thinking" => reasoning.get_or_insert_with(String::new).push_str(string(b, "thinking", &at)?),
            // Encrypted reasoning of another model: nothing this one can read.
            "redacted_thinking" => {}
            "tool_use" => {
                let (id, name) = (string(b, "id", &at)?, string(b, "name", &at)?);
                for (key, v) in [("id", id), ("name", name)] {
                    if v.is_empty() {
                        return Err(ApiError::bad(
                            &format!("{at}.{key}"),
                            format!("a `tool_use` block's `{key}` is empty"),
                        ));
                    }
                }
                if let Some(k) = calls.iter().position(|(_, c): &(usize, Value)| c["id"] == id) {
                    return Err(ApiError::bad(
                        &format!("{at}.id"),
                        format!("`{}` is also the id of the `tool_use` block content[{}]: a message's calls have distinct ids", quote(id), calls[k].0),
                    ));
                }
                let input = b.get("input").filter(|v| v.is_object()).ok_or_else(|| {
                    ApiError::bad(&format!("{at}.input"), "a `tool_use` block needs `input`, an object")
                })?;
                // As chat's wire format carries them: the arguments' JSON text.
                let arguments = input.to_string();
                calls.push((
                    j,
                    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}),
                ));
            }
            other => return Err(unsupported(other, &format!("{at}.type"), "text, thinking and tool_use")),
        }
    }
    let mut m = text_message("assistant", text);
    m.reasoning_content = reasoning;
    m.tool_calls = (!calls.is_empty()).then(|| calls.into_iter().map(|(_, c)| c).collect());
    Ok(m)
}

/// A tool in the chat endpoint's shape (`input_schema` as the function's `parameters`).
fn tool(t: &Value, i: usize) -> Result<Value, ApiError> {
    let at = format!("tools[{i}]");
    match t.get("type") {
        None | Some(Value::Null) => {}
        Some(k) if k == "custom" => {}
        Some(k) => {
            return Err(ApiError::bad(
                &format!("{at}.type"),
                format!("only client tools (type `custom`) are supported, not {}", quote(&k.to_string())),
            ))
        }
    }
    let name = t
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad(&format!("{at}.name"), "a tool needs `name`, a string"))?;
    let schema = t.get("input_schema").filter(|s| s.is_object()).ok_or_else(|| {
        ApiError::bad(&format!("{at}.input_schema"), "a tool needs `input_schema`, a JSON Schema object")
    })?;
    let mut function = json!({"name": name, "parameters": schema});
    if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
        function["description"] = d.clone();
    }
    Ok(json!({"type": "function", "function": function}))
}

/// The chat endpoint's names for fields, and this API's.
const RENAMES: &[(&str, &str)] = &[
    (".function.parameters", ".input_schema"),
    (".function.description", ".description"),
    (".function.name", ".name"),
    ("response_format.json_schema.schema", "output_config.format.schema"),
    ("response_format", "output_config.format"),
    ("stop", "stop_sequences"),
];

/// A refusal from the chat path with its field renamed to this API's (`tools[0].name`
/// for `tools[0].function.name`, `stop_sequences` for `stop`), in its message too.
pub(super) fn renamed(mut e: ApiError) -> ApiError {
    let Some(param) = e.param.take() else { return e };
    let mut new = param.clone();
    for (from, to) in RENAMES {
        if from.starts_with('.') {
            new = new.replace(from, to);
        } else if new == *from || new.starts_with(&format!("{from}.")) {
            new = format!("{to}{}", &new[from.len()..]);
            e.message = e.message.replace(&format!("`{from}`"), &format!("`{to}`"));
        }
    }
    e.param = Some(new);
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Result<(Common, ChatRequest), ApiError> {
        check(&v, Endpoint::Create)?;
        convert(crate::api::fields(&v)?, Endpoint::Create)
    }

    fn refused(v: Value) -> String {
        body(v).err().and_then(|e| e.param).unwrap_or_default()
    }

    #[test]
    fn blocks_become_chat_messages_in_order() {
        let (common, chat) = body(json!({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["\n\n"], "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "tools": [{"name": "ping", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "ping?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "Sure."}, {"type": "tool_use", "id": "toolu_1", "name": "ping", "input": {"n": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "pong"}]},
                    {"type": "text", "text": "and now?"}]}
            ]}))
        .unwrap();
        let m: Vec<Value> = chat.messages.iter().enumerate().map(|(i, m)| m.read(i).unwrap()).collect();
        assert_eq!(m.len(), 5);
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[2]["reasoning_content"], "hm");
        assert_eq!(m[2]["content"], "Sure.");
        assert_eq!(m[2]["tool_calls"][0]["function"], json!({"name": "ping", "arguments": {"n": 1}}));
        assert_eq!(m[3], json!({"role": "tool", "content": "pong", "tool_call_id": "toolu_1"}));
        assert_eq!(m[4], json!({"role": "user", "content": "and now?"}));
        assert_eq!(chat.tool_choice, Some(json!("required")));
        assert_eq!(chat.parallel_tool_calls, Some(false));
        assert_eq!(chat.tools.unwrap()[0]["function"]["parameters"], json!({"type": "object"}));
        assert_eq!(common.stop.unwrap().into_vec(), ["\n\n"]);
    }

    #[test]
    fn refusals_name_the_anthropic_field() {
        let ok = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
        let with = |key: &str, v: Value| {
            let mut b = ok.clone();
            b[key] = v;
            b
        };
        assert_eq!(refused(ok.clone()), "");
        let mut no_max = ok.clone();
        no_max.as_object_mut().unwrap().remove("max_tokens");
        assert_eq!(refused(no_max), "max_tokens");
        assert_eq!(refused(with("temprature", json!(0.5))), "temprature");
        assert_eq!(refused(with("metadata", json!({"user_id": "u"}))), "");
        assert_eq!(refused(with("metadata", json!("u"))), "metadata");
        assert_eq!(refused(with("container", json!("c"))), "container");
        assert_eq!(
            refused(with(
                "messages",
                json!([{"role": "user", "content": [{"type": "image", "source": {}}]}])
            )),
            "messages[0].content[0].type"
        );
        assert_eq!(
            refused(with("messages", json!([{"role": "user", "content": [{"type": "text", "txt": "a"}]}]))),
            "messages[0].content[0].txt"
        );
        assert_eq!(
            refused(with("messages", json!([{"role": "system", "content": "a"}]))),
            "messages[0].role"
        );
        assert_eq!(
            refused(with(
                "messages",
                json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
            )),
            "messages[1].role"
        );
        assert_eq!(refused(with("tools", json!([{"name": "a"}]))), "tools[0].input_schema");
        assert_eq!(
            refused(with("tools", json!([{"type": "web_search_20250305", "name": "w"}]))),
            "tools[0].type"
        );
        assert_eq!(refused(with("tool_choice", json!({"type": "tool"}))), "tool_choice.name");
        assert_eq!(refused(with("tool_choice", json!({"type": "required"}))), "tool_choice.type");
        assert_eq!(refused(with("thinking", json!({"type": "on"}))), "thinking.type");
        assert_eq!(refused(with("output_config", json!({"effort": "high"}))), "output_config.effort");
        assert_eq!(refused(with("stop_sequences", json!("x"))), "stop_sequences");
        // Anthropic's temperature is 0 to 1.
        assert_eq!(refused(with("temperature", json!(1.5))), "temperature");
        assert_eq!(refused(with("temperature", json!(1))), "");
        // An assistant's calls: named, with distinct ids.
        let call = |id: &str, name: &str| json!({"type": "tool_use", "id": id, "name": name, "input": {}});
        let turn = |blocks: Value| {
            json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": blocks},
                   {"role": "user", "content": "b"}])
        };
        assert_eq!(
            refused(with("messages", turn(json!([call("t1", ""), call("t2", "f")])))),
            "messages[1].content[0].name"
        );
        assert_eq!(
            refused(with("messages", turn(json!([call("t1", "f"), call("t1", "g")])))),
            "messages[1].content[1].id"
        );
        assert_eq!(refused(with("messages", turn(json!([call("t1", "f"), call("t2", "f")])))), "");
        // The count_tokens body has no generation fields.
        let counted = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
        assert_eq!(check(&counted, Endpoint::CountTokens).unwrap_err().param.as_deref(), Some("max_tokens"));
    }

    #[test]
    fn chat_path_fields_are_renamed_back() {
        let e = renamed(ApiError::bad("tools[1].function.name", "two tools are named `a`"));
        assert_eq!(e.param.as_deref(), Some("tools[1].name"));
        let e = renamed(ApiError::bad("stop", "`stop` takes up to 16 non-empty strings"));
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (Some("stop_sequences"), "`stop_sequences` takes up to 16 non-empty strings")
        );
        let e = renamed(ApiError::bad("tool_choice.function.name", "no tool is named `x`"));
        assert_eq!(e.param.as_deref(), Some("tool_choice.name"));
        let e = renamed(ApiError::bad("top_k", "`top_k` must be positive"));
        assert_eq!(e.param.as_deref(), Some("top_k"));
    }
}
