//! Every field OpenAI's completions and chat APIs define, and what this server does with
//! it: honours it, ignores it (metadata that cannot change the output; its JSON type is
//! still checked), or refuses it unless it holds its neutral value. A field neither API
//! defines (nor one of the extensions) is refused, as OpenAI refuses an unrecognized
//! argument: a misspelt `temprature` must not silently sample at the default.
//!
//! Contract: [`check`] returns the first offending field in key order, `null` values
//! pass (they mean "not given"), and each error's `param` is the field's JSON path.

use serde_json::{json, Value};

use super::{quote, ApiError};

/// What the server does with a field.
pub enum Rule {
    /// Read by the request structs, which check its type and value.
    Honoured,
    /// Accepted and ignored; the value must have this JSON type.
    Ignored(Type),
    /// Refused unless `neutral` holds (the value that asks for nothing); `why` ends the message.
    Refused { neutral: fn(&Value) -> bool, why: &'static str },
}

#[derive(Clone, Copy)]
pub enum Type {
    String,
    Bool,
    Object,
}

impl Type {
    fn admits(self, v: &Value) -> bool {
        match self {
            Type::String => v.is_string(),
            Type::Bool => v.is_boolean(),
            Type::Object => v.is_object(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Type::String => "a string",
            Type::Bool => "a boolean",
            Type::Object => "an object",
        }
    }
}

use Rule::{Honoured, Ignored, Refused};

fn zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}
fn no_entries(v: &Value) -> bool {
    v.as_object().is_some_and(|o| o.is_empty()) || v.as_array().is_some_and(|a| a.is_empty())
}
fn no_tool(v: &Value) -> bool {
    v == "none" || v == "auto"
}
fn never(_: &Value) -> bool {
    false
}

const PENALTY: &str = "penalties change the model's distribution; only 0 is accepted";
const FUNCTIONS: &str = "the deprecated `functions` API is not supported (use `tools`)";

/// Fields both endpoints define.
pub const COMMON: &[(&str, Rule)] = &[
    ("model", Honoured),
    ("max_tokens", Honoured),
    ("response_format", Honoured),
    ("temperature", Honoured),
    ("top_p", Honoured),
    ("n", Honoured),
    ("seed", Honoured),
    ("stop", Honoured),
    ("stream", Honoured),
    ("stream_options", Honoured),
    // Extensions, as vLLM spells them.
    ("top_k", Honoured),
    ("min_p", Honoured),
    ("return_token_ids", Honoured),
    ("ignore_eos", Honoured),
    ("prompt_logprobs", Honoured),
    ("frequency_penalty", Refused { neutral: zero, why: PENALTY }),
    ("presence_penalty", Refused { neutral: zero, why: PENALTY }),
    (
        "logit_bias",
        Refused { neutral: no_entries, why: "it changes the model's distribution; only {} is accepted" },
    ),
    ("user", Ignored(Type::String)),
];

/// Fields only `POST /v1/completions` defines.
pub const COMPLETIONS: &[(&str, Rule)] = &[
    ("prompt", Honoured),
    ("logprobs", Honoured),
    ("echo", Honoured),
    ("suffix", Refused { neutral: |v| v == "", why: "insertion is not supported" }),
    ("best_of", Refused { neutral: |v| v == 1, why: "only 1 is accepted (use `n`)" }),
];

/// Fields only `POST /v1/chat/completions` defines.
pub const CHAT: &[(&str, Rule)] = &[
    ("messages", Honoured),
    ("logprobs", Honoured),
    ("top_logprobs", Honoured),
    ("max_completion_tokens", Honoured),
    ("tools", Honoured),
    ("tool_choice", Honoured),
    ("parallel_tool_calls", Honoured),
    // vLLM's: extra variables for the chat template (Qwen3's `enable_thinking`).
    ("chat_template_kwargs", Honoured),
    ("functions", Refused { neutral: no_entries, why: FUNCTIONS }),
    ("function_call", Refused { neutral: no_tool, why: FUNCTIONS }),
    ("modalities", Refused { neutral: |v| *v == json!(["text"]), why: "only [\"text\"] is supported" }),
    ("audio", Refused { neutral: never, why: "audio output is not supported" }),
    ("reasoning_effort", Refused { neutral: never, why: "the model has no reasoning setting" }),
    ("verbosity", Refused { neutral: never, why: "the model has no verbosity setting" }),
    ("web_search_options", Refused { neutral: never, why: "web search is not supported" }),
    // Metadata: stored or routed by OpenAI, never read by the model.
    ("metadata", Ignored(Type::Object)),
    ("store", Ignored(Type::Bool)),
    ("service_tier", Ignored(Type::String)),
    ("prompt_cache_key", Ignored(Type::String)),
    ("safety_identifier", Ignored(Type::String)),
    // Predicted output only speeds OpenAI's decoding up; the output is the same.
    ("prediction", Ignored(Type::Object)),
];

/// Fields of a chat message, given to the template as transformers gives them.
pub const MESSAGE: &[(&str, Rule)] = &[
    ("role", Honoured),
    ("content", Honoured),
    ("name", Honoured),
    ("tool_calls", Honoured),
    ("tool_call_id", Honoured),
    ("reasoning_content", Honoured),
    ("function_call", Refused { neutral: never, why: FUNCTIONS }),
    ("refusal", Refused { neutral: never, why: "the chat template has no place for a refusal" }),
    ("audio", Refused { neutral: never, why: "audio is not supported" }),
];

/// Fields of a text content part (`{"type": "text", "text": ...}`): a key beside them
/// (Anthropic's `cache_control`, a misspelt `txt`) is refused as an unknown field is.
/// Parts of other types are refused by their `type` ([`super::Message::read`]).
pub const TEXT_PART: &[(&str, Rule)] = &[("type", Honoured), ("text", Honoured)];

/// Vets the fields of `body` against `tables` (the first holding a field wins): unknown
/// fields, ignored fields of the wrong type and refused fields asking for something.
pub fn check(body: &Value, tables: &[&[(&str, Rule)]], at: &str) -> Result<(), ApiError> {
    let Some(fields) = body.as_object() else { return Ok(()) };
    for (key, v) in fields {
        if v.is_null() {
            continue;
        }
        let path = if at.is_empty() { key.clone() } else { format!("{at}.{key}") };
        let rule = tables.iter().flat_map(|t| t.iter()).find(|(name, _)| name == key).map(|(_, r)| r);
        match rule {
            None => {
                return Err(ApiError::bad(&path, format!("unrecognized request argument `{}`", quote(&path))))
            }
            Some(Honoured) => {}
            Some(Ignored(t)) if !t.admits(v) => {
                return Err(ApiError::bad(&path, format!("`{path}` must be {}", t.name())))
            }
            Some(Ignored(_)) => {}
            Some(Refused { neutral, why }) if !neutral(v) => {
                return Err(ApiError::bad(&path, format!("`{path}` is not supported: {why}")))
            }
            Some(Refused { .. }) => {}
        }
    }
    Ok(())
}

/// The objects inside both endpoints' bodies that have fields of their own
/// ([`super::nested`]), and numbers the request structs would round past what was sent.
fn check_nested(body: &Value) -> Result<(), ApiError> {
    // `top_p` is an f32 from here on: 1e-300 would be refused as "got 0".
    if let Some(x) = body.get("top_p").and_then(Value::as_f64) {
        if x > 0.0 && x as f32 == 0.0 {
            return Err(ApiError::bad(
                "top_p",
                format!("top_p must be in (0, 1], got {}, 0 as an f32", body["top_p"]),
            ));
        }
    }
    super::nested::check(body)?;
    // As OpenAI answers: options for a stream that is not asked for do nothing.
    if body.get("stream_options").is_some_and(Value::is_object)
        && body.get("stream") != Some(&Value::Bool(true))
    {
        return Err(ApiError::bad("stream_options", "`stream_options` is only allowed with `stream: true`"));
    }
    Ok(())
}

/// [`check`] for a chat body: its own fields, then each message's and its text parts'.
pub fn check_chat(body: &Value) -> Result<(), ApiError> {
    check(body, &[COMMON, CHAT], "")?;
    check_nested(body)?;
    for (i, m) in body.get("messages").and_then(Value::as_array).into_iter().flatten().enumerate() {
        check(m, &[MESSAGE], &format!("messages[{i}]"))?;
        for (j, p) in m.get("content").and_then(Value::as_array).into_iter().flatten().enumerate() {
            if p.get("type").and_then(Value::as_str) == Some("text") {
                check(p, &[TEXT_PART], &format!("messages[{i}].content[{j}]"))?;
            }
        }
    }
    Ok(())
}

/// [`check`] for a completions body.
pub fn check_completion(body: &Value) -> Result<(), ApiError> {
    check(body, &[COMMON, COMPLETIONS], "")?;
    check_nested(body)
}
