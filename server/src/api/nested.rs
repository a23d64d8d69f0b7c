//! The objects inside a body that have keys of their own: `response_format` (and its
//! `json_schema`), `stream_options`, each of `tools` (and its `function`) and an object
//! `tool_choice` (and its `function`). An unknown key in one is refused as an unknown
//! top-level field is: a misspelt `strict_mode` or a stray `value` must not be dropped
//! silently while the request runs as if it had not been sent.
//!
//! Contract: [`check`] vets keys (and the types of ignored ones) with [`audit::check`]'s
//! rules, so a refusal has the same shape, its `param` the key's JSON path
//! (`tools[0].function.strict_mode`); values and missing keys are the readers' to refuse
//! ([`crate::tools`], [`crate::routes`]). `response_format`'s keys depend on its type:
//! TGI's `{"type": "json_object" | "json", "value": schema}` (huggingface_hub's form) is
//! accepted, `value` beside `json_schema` or under another type is not.

use serde_json::Value;

use super::audit::{self, Rule, Type};
use super::ApiError;
use Rule::{Honoured, Ignored};

/// `stream_options`' fields (an unknown one, a misspelt `include_usge`, silently dropped
/// the usage chunk).
const STREAM_OPTIONS: &[(&str, Rule)] = &[
    ("include_usage", Honoured),
    // OpenAI's padding of streamed events against length side channels: nothing to pad here.
    ("include_obfuscation", Ignored(Type::Bool)),
];

const FORMAT_TEXT: &[(&str, Rule)] = &[("type", Honoured)];
/// `json_object`, and TGI's `json_object` or `json` with the schema as `value`.
const FORMAT_JSON: &[(&str, Rule)] = &[("type", Honoured), ("value", Honoured)];
const FORMAT_SCHEMA: &[(&str, Rule)] = &[("type", Honoured), ("json_schema", Honoured)];
/// `response_format.json_schema`: the schema is closed whether or not `strict` is sent
/// (OpenAI's strict schemas are closed already).
const JSON_SCHEMA: &[(&str, Rule)] = &[
    ("schema", Honoured),
    ("name", Ignored(Type::String)),
    ("description", Ignored(Type::String)),
    ("strict", Ignored(Type::Bool)),
];

const TOOL: &[(&str, Rule)] = &[("type", Honoured), ("function", Honoured)];
/// A tool's function; `strict` as for `json_schema`.
const FUNCTION: &[(&str, Rule)] = &[
    ("name", Honoured),
    ("description", Honoured),
    ("parameters", Honoured),
    ("strict", Ignored(Type::Bool)),
];
const TOOL_CHOICE: &[(&str, Rule)] = &[("type", Honoured), ("function", Honoured)];
const TOOL_CHOICE_FUNCTION: &[(&str, Rule)] = &[("name", Honoured)];

/// Vets the keys of `body`'s nested objects (those that are objects; the readers refuse
/// the rest), in the order above.
pub fn check(body: &Value) -> Result<(), ApiError> {
    if let Some(o) = body.get("stream_options") {
        audit::check(o, &[STREAM_OPTIONS], "stream_options")?;
    }
    if let Some(f) = body.get("response_format") {
        let kind = f.get("type").and_then(Value::as_str);
        let table = match kind {
            Some("text") => FORMAT_TEXT,
            Some("json_object" | "json") => FORMAT_JSON,
            Some("json_schema") => FORMAT_SCHEMA,
            // No type or an unknown one: the reader names it.
            _ => &[],
        };
        if !table.is_empty() {
            audit::check(f, &[table], "response_format")?;
        }
        if let (Some("json_schema"), Some(s)) = (kind, f.get("json_schema")) {
            audit::check(s, &[JSON_SCHEMA], "response_format.json_schema")?;
        }
    }
    for (i, t) in body.get("tools").and_then(Value::as_array).into_iter().flatten().enumerate() {
        audit::check(t, &[TOOL], &format!("tools[{i}]"))?;
        if let Some(f) = t.get("function") {
            audit::check(f, &[FUNCTION], &format!("tools[{i}].function"))?;
        }
    }
    if let Some(c) = body.get("tool_choice") {
        audit::check(c, &[TOOL_CHOICE], "tool_choice")?;
        if let Some(f) = c.get("function") {
            audit::check(f, &[TOOL_CHOICE_FUNCTION], "tool_choice.function")?;
        }
    }
    Ok(())
}
