//! A Responses body into the chat body the chat endpoint runs, and the fields a `Response`
//! restates.
//!
//! Contract: every field of OpenAI's `POST /v1/responses` is honoured, ignored (metadata
//! that cannot change the output) or refused unless neutral, as [`crate::api::audit`]
//! rules chat's; a key neither the API nor an extension (`seed`, `top_k`, `min_p`)
//! defines is refused, at every level. What is honoured becomes chat fields: `input` and
//! `instructions` become `messages` (a `function_call` item joins the assistant message
//! before it, or starts one; a `function_call_output` is a `tool` message; a `reasoning`
//! item is the next assistant message's `reasoning_content`), the flat function tools
//! become chat's `{"type": "function", "function": {...}}`, `text.format` becomes
//! `response_format`, `max_output_tokens` becomes `max_completion_tokens`. Nothing is
//! rendered, parsed or sampled here. [`Converted::origins`] tells which input item each
//! message came from, so that a refusal the chat path names (`messages[2].content`) is
//! told by the Responses name (`input[1].content`, [`super::rename`]).
//!
//! No state is kept: `previous_response_id`, `conversation` and `item_reference` items
//! are refused, `store: true` too (a response left unstored says `store: false`).

use serde_json::{json, Map, Value};

use crate::api::audit::{self, Rule, Type};
use crate::api::{quote, ApiError};
use Rule::{Honoured, Ignored, Refused};

fn never(_: &Value) -> bool {
    false
}
fn empty_list(v: &Value) -> bool {
    v.as_array().is_some_and(|a| a.is_empty())
}
/// `reasoning: {}` or with every setting null.
fn no_reasoning(v: &Value) -> bool {
    v.as_object().is_some_and(|o| o.values().all(Value::is_null))
}

const STATELESS: &str =
    "this server keeps no responses or conversations: send the whole conversation in `input`";

/// `POST /v1/responses`' own fields.
const FIELDS: &[(&str, Rule)] = &[
    ("input", Honoured),
    ("instructions", Honoured),
    ("model", Honoured),
    ("max_output_tokens", Honoured),
    ("temperature", Honoured),
    ("top_p", Honoured),
    ("tools", Honoured),
    ("tool_choice", Honoured),
    ("parallel_tool_calls", Honoured),
    ("text", Honoured),
    ("stream", Honoured),
    ("stream_options", Honoured),
    ("metadata", Honoured),
    ("store", Honoured),
    // Extensions, as chat's (vLLM's names).
    ("seed", Honoured),
    ("top_k", Honoured),
    ("min_p", Honoured),
    ("previous_response_id", Refused { neutral: never, why: STATELESS }),
    ("conversation", Refused { neutral: never, why: STATELESS }),
    ("background", Refused { neutral: |v| v == false, why: "responses are answered in the foreground" }),
    ("prompt", Refused { neutral: never, why: "stored prompt templates are OpenAI's" }),
    // Read by `convert`: only `message.output_text.logprobs` can be included.
    ("include", Honoured),
    ("reasoning", Refused { neutral: no_reasoning, why: "the model has no reasoning setting" }),
    (
        "truncation",
        Refused { neutral: |v| v == "disabled", why: "a prompt over the context is refused, never cut" },
    ),
    ("top_logprobs", Honoured),
    // It bounds calls of built-in tools, and there are none.
    ("max_tool_calls", Refused { neutral: Value::is_u64, why: "it must be a non-negative integer" }),
    ("context_management", Refused { neutral: empty_list, why: "the context is never compacted" }),
    ("moderation", Refused { neutral: never, why: "moderation is OpenAI's" }),
    ("image", Refused { neutral: never, why: "images are not supported" }),
    ("access_programs", Refused { neutral: never, why: "access programs are OpenAI's" }),
    ("background_options", Refused { neutral: never, why: "responses are answered in the foreground" }),
    // Metadata: routed or cached by OpenAI, never read by the model.
    ("user", Ignored(Type::String)),
    ("service_tier", Ignored(Type::String)),
    ("safety_identifier", Ignored(Type::String)),
    ("prompt_cache_key", Ignored(Type::String)),
    ("prompt_cache_retention", Ignored(Type::String)),
    ("prompt_cache_options", Ignored(Type::Object)),
];

const STREAM_OPTIONS: &[(&str, Rule)] = &[("include_obfuscation", Ignored(Type::Bool))];
const TEXT: &[(&str, Rule)] = &[
    ("format", Honoured),
    ("verbosity", Refused { neutral: |v| v == "medium", why: "the model has no verbosity setting" }),
];
const FORMAT_PLAIN: &[(&str, Rule)] = &[("type", Honoured)];
const FORMAT_SCHEMA: &[(&str, Rule)] = &[
    ("type", Honoured),
    ("schema", Honoured),
    ("name", Ignored(Type::String)),
    ("description", Ignored(Type::String)),
    ("strict", Ignored(Type::Bool)),
];
const FUNCTION_TOOL: &[(&str, Rule)] = &[
    ("type", Honoured),
    ("name", Honoured),
    ("description", Honoured),
    ("parameters", Honoured),
    ("strict", Honoured),
];
const TOOL_CHOICE: &[(&str, Rule)] = &[("type", Honoured), ("name", Honoured)];
/// Keys an item of OpenAI's own output carries when a client sends it back.
const ECHOED: [(&str, Rule); 2] = [("id", Ignored(Type::String)), ("status", Ignored(Type::String))];
const MESSAGE: &[(&str, Rule)] =
    &[("type", Honoured), ("role", Honoured), ("content", Honoured), ("phase", Ignored(Type::String))];
const TEXT_PART: &[(&str, Rule)] =
    &[("type", Honoured), ("text", Honoured), ("annotations", Honoured), ("logprobs", Honoured)];
const FUNCTION_CALL: &[(&str, Rule)] =
    &[("type", Honoured), ("call_id", Honoured), ("name", Honoured), ("arguments", Honoured)];
const FUNCTION_CALL_OUTPUT: &[(&str, Rule)] =
    &[("type", Honoured), ("call_id", Honoured), ("output", Honoured)];
const REASONING: &[(&str, Rule)] = &[
    ("type", Honoured),
    ("summary", Honoured),
    ("content", Honoured),
    ("encrypted_content", Refused { neutral: never, why: "encrypted reasoning is OpenAI's" }),
];

/// The roles an input message may have.
const ROLES: [&str; 4] = ["user", "system", "developer", "assistant"];

/// Where a chat message came from: the input item (none: `instructions`) and, for an
/// assistant message that makes calls, each call's item.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Origin {
    pub(crate) item: Option<usize>,
    pub(crate) calls: Vec<usize>,
}

/// A Responses body as chat's, with what its `Response` restates.
pub(crate) struct Converted {
    pub(crate) chat: Value,
    pub(crate) origins: Vec<Origin>,
    /// The request's settings as a `Response` restates them (`tools`, `tool_choice`, ...).
    pub(crate) echo: Map<String, Value>,
    /// `include` asks for the message text's logprobs.
    pub(crate) logprobs: bool,
}

/// What `include` may name.
const TEXT_LOGPROBS: &str = "message.output_text.logprobs";

/// Whether `include` asks for the text's logprobs (the only extra output there is).
fn include(v: Option<&Value>) -> Result<bool, ApiError> {
    let Some(v) = v else { return Ok(false) };
    let list = v.as_array().ok_or_else(|| ApiError::bad("include", "`include` must be a list"))?;
    for (i, item) in list.iter().enumerate() {
        if item != TEXT_LOGPROBS {
            return Err(ApiError::bad(
                &format!("include[{i}]"),
                format!("only `{TEXT_LOGPROBS}` can be included; got {}", quote(&item.to_string())),
            ));
        }
    }
    Ok(!list.is_empty())
}

/// Reads a Responses body; a refusal names the field by its Responses path.
pub(crate) fn convert(body: &Value) -> Result<Converted, ApiError> {
    audit::check(body, &[FIELDS], "")?;
    let get = |k: &str| body.get(k).filter(|v| !v.is_null());
    if get("store") == Some(&Value::Bool(true)) {
        return Err(ApiError::bad(
            "store",
            "`store: true` is not supported: this server keeps no responses (send `store: false` or leave it out)",
        ));
    }
    if let Some(v) = get("store").filter(|v| !v.is_boolean()) {
        return Err(ApiError::bad(
            "store",
            format!("`store` must be a boolean, not {}", quote(&v.to_string())),
        ));
    }
    let stream = get("stream");
    if let Some(o) = get("stream_options") {
        audit::check(o, &[STREAM_OPTIONS], "stream_options")?;
        if stream != Some(&Value::Bool(true)) {
            return Err(ApiError::bad(
                "stream_options",
                "`stream_options` is only allowed with `stream: true`",
            ));
        }
    }
    let metadata = metadata(get("metadata"))?;
    let logprobs = include(get("include"))?;
    let top_logprobs = match get("top_logprobs") {
        None => 0,
        Some(v) => v.as_u64().filter(|&k| k <= 20).ok_or_else(|| {
            ApiError::bad("top_logprobs", "`top_logprobs` must be an integer between 0 and 20")
        })?,
    };
    if logprobs && get("tools").and_then(Value::as_array).is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::bad(
            "include",
            "logprobs are reported for replies of text alone: not beside `tools` (send no tools to score text)",
        ));
    }
    let mut chat = Map::new();
    let mut echo = Map::new();
    let instructions = match get("instructions") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::bad("instructions", "`instructions` must be a string")),
    };
    let (messages, origins) = messages(get("input"), instructions.as_deref())?;
    chat.insert("messages".into(), Value::Array(messages));
    let tools = match get("tools") {
        None => Vec::new(),
        Some(Value::Array(list)) => {
            list.iter().enumerate().map(|(i, t)| tool(t, i)).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(ApiError::bad("tools", "`tools` must be a list")),
    };
    if !tools.is_empty() {
        chat.insert("tools".into(), Value::Array(tools));
    }
    if let Some(c) = get("tool_choice") {
        chat.insert("tool_choice".into(), tool_choice(c)?);
    }
    if let Some(f) = get("text") {
        if let Some(format) = text_format(f)? {
            chat.insert("response_format".into(), format);
        }
    }
    if logprobs {
        chat.insert("logprobs".into(), json!(true));
        chat.insert("top_logprobs".into(), json!(top_logprobs));
    }
    for (from, to) in [
        ("model", "model"),
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("stream", "stream"),
        ("seed", "seed"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
    ] {
        if let Some(v) = get(from) {
            chat.insert(to.into(), v.clone());
        }
    }
    // What the `Response` restates: the settings as given, OpenAI's defaults for the rest.
    let or = |k: &str, default: Value| get(k).cloned().unwrap_or(default);
    echo.insert("instructions".into(), or("instructions", Value::Null));
    echo.insert("max_output_tokens".into(), or("max_output_tokens", Value::Null));
    echo.insert("parallel_tool_calls".into(), or("parallel_tool_calls", json!(true)));
    echo.insert("previous_response_id".into(), Value::Null);
    echo.insert("reasoning".into(), json!({"effort": null, "summary": null}));
    echo.insert("store".into(), json!(false));
    // Numbers as OpenAI writes them (`0.0`, not the `0` a client may have sent).
    let float = |k: &str| json!(get(k).and_then(Value::as_f64).unwrap_or(1.0));
    echo.insert("temperature".into(), float("temperature"));
    echo.insert("text".into(), json!({"format": get("text").and_then(|t| t.get("format")).filter(|f| !f.is_null()).cloned().unwrap_or(json!({"type": "text"}))}));
    echo.insert("tool_choice".into(), or("tool_choice", json!("auto")));
    echo.insert("tools".into(), or("tools", json!([])));
    echo.insert("top_p".into(), float("top_p"));
    echo.insert("top_logprobs".into(), json!(top_logprobs));
    echo.insert("truncation".into(), json!("disabled"));
    echo.insert("user".into(), or("user", Value::Null));
    echo.insert("metadata".into(), metadata);
    Ok(Converted { chat: Value::Object(chat), origins, echo, logprobs })
}

/// `metadata`: up to 16 string values under keys of at most 64 characters, as OpenAI's.
fn metadata(v: Option<&Value>) -> Result<Value, ApiError> {
    let Some(v) = v else { return Ok(json!({})) };
    let Some(o) = v.as_object() else {
        return Err(ApiError::bad("metadata", "`metadata` must be an object"));
    };
    if o.len() > 16 {
        return Err(ApiError::bad("metadata", "`metadata` holds at most 16 keys"));
    }
    for (k, v) in o {
        if k.chars().count() > 64 || v.as_str().is_none_or(|s| s.chars().count() > 512) {
            return Err(ApiError::bad(
                &format!("metadata.{k}"),
                "`metadata` keys are at most 64 characters, its values strings of at most 512",
            ));
        }
    }
    Ok(v.clone())
}

/// The chat messages of `input` after `instructions` (a system message first).
fn messages(
    input: Option<&Value>,
    instructions: Option<&str>,
) -> Result<(Vec<Value>, Vec<Origin>), ApiError> {
    let mut messages = Vec::new();
    let mut origins = Vec::new();
    if let Some(s) = instructions {
        messages.push(json!({"role": "system", "content": s}));
        origins.push(Origin::default());
    }
    let items = match input {
        None => return Err(ApiError::bad("input", "missing field `input`")),
        Some(Value::String(s)) => {
            messages.push(json!({"role": "user", "content": s}));
            origins.push(Origin { item: Some(0), calls: Vec::new() });
            return Ok((messages, origins));
        }
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(ApiError::bad("input", "`input` is empty"))
        }
        Some(Value::Array(items)) => items,
        Some(_) => return Err(ApiError::bad("input", "`input` must be a string or a list of items")),
    };
    // A reasoning item's text, waiting for the assistant message it preceded.
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        if !item.is_object() {
            return Err(ApiError::bad(&at, "an input item must be an object"));
        }
        let kind = match item.get("type") {
            None | Some(Value::Null) if item.get("role").is_some() => "message",
            Some(Value::String(t)) => t.as_str(),
            _ => return Err(ApiError::bad(&format!("{at}.type"), "an input item needs a `type`")),
        };
        let table = |own: &'static [(&'static str, Rule)]| -> Vec<&'static [(&'static str, Rule)]> {
            vec![own, &ECHOED]
        };
        match kind {
            "message" => {
                audit::check(item, &table(MESSAGE), &at)?;
                let role = match item.get("role") {
                    Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.as_str(),
                    Some(Value::String(r)) => {
                        return Err(ApiError::bad(
                            &format!("{at}.role"),
                            format!("unknown role `{}` (known: {})", quote(r), ROLES.join(", ")),
                        ))
                    }
                    _ => return Err(ApiError::bad(&format!("{at}.role"), "a message needs a `role`")),
                };
                let mut m = json!({"role": role, "content": content(item.get("content"), &format!("{at}.content"))?});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        m["reasoning_content"] = json!(r);
                    }
                }
                messages.push(m);
                origins.push(Origin { item: Some(i), calls: Vec::new() });
            }
            "function_call" => {
                audit::check(item, &table(FUNCTION_CALL), &at)?;
                let field = |k: &str| match item.get(k) {
                    Some(Value::String(s)) => Ok(s.clone()),
                    _ => Err(ApiError::bad(&format!("{at}.{k}"), format!("a function_call needs `{k}`, a string"))),
                };
                let call = json!({"id": field("call_id")?, "type": "function",
                                  "function": {"name": field("name")?, "arguments": field("arguments")?}});
                // Calls join the assistant turn they follow (parallel calls are one turn).
                let joins = messages.last().is_some_and(|m| m["role"] == "assistant");
                if !joins {
                    messages.push(json!({"role": "assistant", "content": null}));
                    origins.push(Origin { item: Some(i), calls: Vec::new() });
                }
                let (Some(last), Some(origin)) = (messages.last_mut(), origins.last_mut()) else {
                    return Err(ApiError::bad(&at, "a function_call with no assistant turn"));
                };
                if let Some(r) = reasoning.take() {
                    last["reasoning_content"] = json!(r);
                }
                match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    Some(calls) => calls.push(call),
                    None => last["tool_calls"] = json!([call]),
                }
                origin.calls.push(i);
            }
            "function_call_output" => {
                audit::check(item, &table(FUNCTION_CALL_OUTPUT), &at)?;
                let Some(Value::String(id)) = item.get("call_id") else {
                    return Err(ApiError::bad(&format!("{at}.call_id"), "a function_call_output needs `call_id`, a string"));
                };
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(_)) => content(item.get("output"), &format!("{at}.output"))?,
                    _ => {
                        return Err(ApiError::bad(
                            &format!("{at}.output"),
                            "a function_call_output needs `output`: a string or a list of input_text parts",
                        ))
                    }
                };
                messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
                origins.push(Origin { item: Some(i), calls: Vec::new() });
            }
            "reasoning" => {
                audit::check(item, &table(REASONING), &at)?;
                reasoning = Some(reasoning_text(item, &at)?);
            }
            "item_reference" => {
                return Err(ApiError::bad(&format!("{at}.type"), format!("`item_reference` is not supported: {STATELESS}")))
            }
            other => {
                return Err(ApiError::bad(
                    &format!("{at}.type"),
                    format!(
                        "input item of type `{}` is not supported (message, function_call, function_call_output, reasoning)",
                        quote(other)
                    ),
                ))
            }
        }
    }
    Ok((messages, origins))
}

/// A message's content as text: a string, or its text parts (`input_text`, `output_text`)
/// joined.
fn content(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    let parts = match v {
        None | Some(Value::Null) => return Ok(String::new()),
        Some(Value::String(s)) => return Ok(s.clone()),
        Some(Value::Array(parts)) => parts,
        Some(_) => return Err(ApiError::bad(at, "content must be a string or a list of parts")),
    };
    let mut text = String::new();
    for (j, p) in parts.iter().enumerate() {
        let here = format!("{at}[{j}]");
        match p.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text") => {
                audit::check(p, &[TEXT_PART], &here)?;
                match p.get("text") {
                    Some(Value::String(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::bad(
                            &format!("{here}.text"),
                            "a text part needs `text`, a string",
                        ))
                    }
                }
            }
            Some(kind) => {
                return Err(ApiError::bad(
                    &format!("{here}.type"),
                    format!(
                        "content part of type `{}` is not supported (input_text and output_text only)",
                        quote(kind)
                    ),
                ))
            }
            None => return Err(ApiError::bad(&format!("{here}.type"), "a content part needs a `type`")),
        }
    }
    Ok(text)
}

/// A reasoning item's text: its `reasoning_text` parts joined (its summary's when it has
/// none).
fn reasoning_text(item: &Value, at: &str) -> Result<String, ApiError> {
    let (key, kind) = match item.get("content") {
        Some(Value::Array(c)) if !c.is_empty() => ("content", "reasoning_text"),
        _ => ("summary", "summary_text"),
    };
    let mut text = String::new();
    for (j, p) in item.get(key).and_then(Value::as_array).into_iter().flatten().enumerate() {
        let here = format!("{at}.{key}[{j}]");
        audit::check(p, &[&[("type", Honoured), ("text", Honoured)]], &here)?;
        match (p.get("type").and_then(Value::as_str), p.get("text")) {
            (Some(t), Some(Value::String(s))) if t == kind => text.push_str(s),
            _ => {
                return Err(ApiError::bad(
                    &here,
                    format!("a `{key}` part is {{\"type\": \"{kind}\", \"text\": ...}}"),
                ))
            }
        }
    }
    Ok(text)
}

/// A flat function tool as chat's.
fn tool(t: &Value, i: usize) -> Result<Value, ApiError> {
    let at = format!("tools[{i}]");
    match t.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(ApiError::bad(
                &format!("{at}.type"),
                format!("tool type `{}` is not supported (function only)", quote(other)),
            ))
        }
        None => return Err(ApiError::bad(&format!("{at}.type"), "a tool needs `type`: function")),
    }
    audit::check(t, &[FUNCTION_TOOL], &at)?;
    if let Some(s) = t.get("strict").filter(|s| !s.is_null() && !s.is_boolean()) {
        return Err(ApiError::bad(
            &format!("{at}.strict"),
            format!("must be a boolean, not {}", quote(&s.to_string())),
        ));
    }
    let mut function = Map::new();
    for key in ["name", "description", "parameters", "strict"] {
        if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
            function.insert(key.into(), v.clone());
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice` as chat's: the same strings, a function named as `{"type": "function",
/// "name": ...}`.
fn tool_choice(c: &Value) -> Result<Value, ApiError> {
    let Some(o) = c.as_object() else { return Ok(c.clone()) };
    match o.get("type").and_then(Value::as_str) {
        Some("function") => {
            audit::check(c, &[TOOL_CHOICE], "tool_choice")?;
            match o.get("name") {
                Some(Value::String(n)) => Ok(json!({"type": "function", "function": {"name": n}})),
                _ => Err(ApiError::bad("tool_choice.name", "a named `tool_choice` needs `name`, a string")),
            }
        }
        Some(other) => Err(ApiError::bad(
            "tool_choice.type",
            format!(
                "`tool_choice` of type `{}` is not supported (none, auto, required or a function)",
                quote(other)
            ),
        )),
        None => Err(ApiError::bad("tool_choice.type", "a `tool_choice` object needs `type`: function")),
    }
}

/// `text.format` as chat's `response_format` (none for plain text).
fn text_format(text: &Value) -> Result<Option<Value>, ApiError> {
    if !text.is_object() {
        return Err(ApiError::bad("text", "`text` must be an object"));
    }
    audit::check(text, &[TEXT], "text")?;
    let Some(f) = text.get("format").filter(|f| !f.is_null()) else { return Ok(None) };
    let kind = f.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => {
            audit::check(f, &[FORMAT_PLAIN], "text.format")?;
            Ok(None)
        }
        Some("json_object") => {
            audit::check(f, &[FORMAT_PLAIN], "text.format")?;
            Ok(Some(json!({"type": "json_object"})))
        }
        Some("json_schema") => {
            audit::check(f, &[FORMAT_SCHEMA], "text.format")?;
            let mut inner = Map::new();
            for key in ["name", "description", "schema", "strict"] {
                if let Some(v) = f.get(key).filter(|v| !v.is_null()) {
                    inner.insert(key.into(), v.clone());
                }
            }
            if !inner.contains_key("schema") {
                return Err(ApiError::bad(
                    "text.format.schema",
                    "`text.format` of type json_schema needs `schema`, a JSON Schema object",
                ));
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": inner})))
        }
        Some(other) => Err(ApiError::bad(
            "text.format.type",
            format!("`text.format.type` `{}` is not one of text, json_object, json_schema", quote(other)),
        )),
        None => Err(ApiError::bad(
            "text.format.type",
            "`text.format` needs `type`: text, json_object or json_schema",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(body: Value) -> Option<String> {
        convert(&body).err().and_then(|e| e.param)
    }

    #[test]
    fn items_become_chat_messages_with_their_origins() {
        let c = convert(&json!({
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": "weather?"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}", "id": "fc_2", "status": "completed"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is ", "annotations": []}, {"type": "output_text", "text": "sunny."}]}
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "max_output_tokens": 9, "store": false
        }))
        .unwrap();
        let m = &c.chat["messages"];
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[1], json!({"role": "user", "content": "weather?"}));
        assert_eq!(m[2]["reasoning_content"], "think");
        assert_eq!(m[2]["tool_calls"][1]["function"]["name"], "get_time");
        assert_eq!(m[2]["tool_calls"][0]["id"], "call_1");
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}));
        assert_eq!(m[4], json!({"role": "assistant", "content": "It is sunny."}));
        assert_eq!(c.origins[2], Origin { item: Some(2), calls: vec![2, 3] });
        assert_eq!(c.chat["tools"][0]["function"]["name"], "get_weather");
        assert_eq!(c.chat["tool_choice"], json!({"type": "function", "function": {"name": "get_weather"}}));
        assert_eq!(c.chat["response_format"]["json_schema"]["schema"], json!({"type": "object"}));
        assert_eq!(c.chat["max_completion_tokens"], 9);
        assert_eq!(c.echo["store"], false);
    }

    #[test]
    fn refusals_name_the_responses_field() {
        for (body, want) in [
            (json!({"input": "hi", "previous_response_id": "resp_1"}), "previous_response_id"),
            (json!({"input": "hi", "temprature": 0.5}), "temprature"),
            (json!({"input": "hi", "store": true}), "store"),
            (json!({}), "input"),
            (json!({"input": []}), "input"),
            (json!({"input": [{"role": "tool", "content": "x"}]}), "input[0].role"),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
                "input[0].content[0].type",
            ),
            (json!({"input": [{"type": "item_reference", "id": "x"}]}), "input[0].type"),
            (
                json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
                "input[0].call_id",
            ),
            (json!({"input": "hi", "tools": [{"type": "web_search"}]}), "tools[0].type"),
            (
                json!({"input": "hi", "tools": [{"type": "function", "name": "f", "function": {}}]}),
                "tools[0].function",
            ),
            (json!({"input": "hi", "text": {"format": {"type": "json_schema"}}}), "text.format.schema"),
            (json!({"input": "hi", "text": {"format": {"type": "yaml"}}}), "text.format.type"),
            (json!({"input": "hi", "tool_choice": {"type": "file_search"}}), "tool_choice.type"),
            (json!({"input": "hi", "reasoning": {"effort": "high"}}), "reasoning"),
            (json!({"input": "hi", "stream_options": {"include_obfuscation": false}}), "stream_options"),
            (json!({"input": "hi", "metadata": {"k": 1}}), "metadata.k"),
        ] {
            assert_eq!(param(body.clone()).as_deref(), Some(want), "{body}");
        }
        assert!(convert(
            &json!({"input": "hi", "reasoning": {"effort": null}, "include": [], "truncation": "disabled"})
        )
        .is_ok());
    }
}
