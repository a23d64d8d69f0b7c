//! The OpenAI request bodies this server accepts, parsed with errors that name the field,
//! and the error body it answers with.
//!
//! Contract: every refusal is an [`ApiError`] whose `param` names the field to blame (a
//! JSON path such as `messages[2].role` for nested fields); which fields are honoured,
//! ignored or refused is [`audit`]'s table. A JSON `null` is the same as leaving the
//! field out.

pub mod audit;
mod nested;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

/// An OpenAI-style error: status, message, the offending parameter.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), param: None }
    }

    pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: Some(param.into()) }
    }

    /// The 404 for a model this server does not serve (`served` is the one it does).
    pub fn unknown_model(served: &str, model: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("model `{}` is not served here (this server serves `{served}`)", quote(model)),
            param: Some("model".into()),
        }
    }

    /// The same error answered with `status`.
    pub fn with_status(self, status: StatusCode) -> ApiError {
        ApiError { status, ..self }
    }

    pub fn body(&self) -> Value {
        let kind = match self.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            StatusCode::NOT_FOUND => "not_found_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status.as_u16()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// A value quoted in an error message, cut to a readable length (a refused field may hold
/// megabytes).
pub fn quote(v: &str) -> String {
    const MAX: usize = 80;
    match v.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}...", &v[..end]),
        None => v.to_string(),
    }
}

/// Parses a request body: malformed JSON, a key given twice in one object, or anything but
/// an object, is a 400.
pub fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    match mtp_base::json::parse(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(ApiError::new(StatusCode::BAD_REQUEST, "the request body must be a JSON object")),
        Err(e) => Err(ApiError::new(StatusCode::BAD_REQUEST, format!("malformed JSON body: {e}"))),
    }
}

/// Reads the fields of `T` from a parsed body (fields `T` lacks were vetted by [`audit`]);
/// a missing required field or a field of the wrong type is a 400 naming its JSON path.
pub fn fields<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if let Some(field) = inner.strip_prefix("missing field `").and_then(|m| m.split('`').next()) {
            let at = if path == "." { field.to_string() } else { format!("{path}.{field}") };
            ApiError::bad(&at, format!("missing field `{at}`"))
        } else if path == "." {
            ApiError::new(StatusCode::BAD_REQUEST, format!("invalid request: {inner}"))
        } else {
            ApiError::bad(&path, format!("invalid `{path}`: {inner}"))
        }
    })
}

/// `stop`: one string or a list of them.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Deserialize, Debug, Default, Clone)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Fields both endpoints share and honour.
#[derive(Deserialize, Debug, Default, Clone)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub n: Option<u64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Extension (as vLLM spells it): return the prompt's and each choice's token ids.
    pub return_token_ids: Option<bool>,
    /// Extension: keep generating past EOS ids.
    pub ignore_eos: Option<bool>,
    /// Extension (vLLM's): each prompt token's logprob and this many alternatives.
    pub prompt_logprobs: Option<i64>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}`,
    /// read by [`crate::routes`] (which names the part at fault).
    pub response_format: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    /// Text or token ids, read by [`crate::routes`] (which names a bad id's index).
    pub prompt: Value,
    /// How many most likely alternatives to report per token (0 to 20); present means
    /// report logprobs.
    pub logprobs: Option<u64>,
    /// The prompt before the completion, in the text and (with `logprobs`) the logprobs.
    pub echo: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    /// Read by [`crate::tools`] (which names the tool at fault).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Extra variables for the chat template, checked by [`crate::chat::Conversation::kwargs`].
    #[serde(default)]
    pub chat_template_kwargs: Option<Value>,
}

/// The roles a message may have (OpenAI's; `developer` is its newer name for `system`,
/// passed to the template as written).
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<Value>>,
    pub tool_call_id: Option<String>,
    pub reasoning_content: Option<String>,
}

/// Message content: a string or a list of parts (only text parts are understood).
#[derive(Deserialize, Debug)]
#[serde(untagged, expecting = "a string or a list of content parts")]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize, Debug)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

impl Message {
    /// The message as the chat template sees it (transformers' shape): `role`, `content`
    /// as text, and when given `name`, `tool_call_id`, `reasoning_content` and `tool_calls`
    /// (each `{"id", "type", "function": {"name", "arguments"}}`, the arguments parsed
    /// from their JSON text into a mapping as templates expect). An unknown role, a
    /// non-text part or a malformed call is refused, naming message `i`'s field.
    pub fn read(&self, i: usize) -> Result<Value, ApiError> {
        if !ROLES.contains(&self.role.as_str()) {
            return Err(ApiError::bad(
                &format!("messages[{i}].role"),
                format!("unknown role `{}` (known: {})", quote(&self.role), ROLES.join(", ")),
            ));
        }
        let text = match &self.content {
            None => String::new(),
            Some(Content::Text(s)) => s.clone(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .enumerate()
                .map(|(j, p)| match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => Ok(t.as_str()),
                    ("text", None) => Err(ApiError::bad(
                        &format!("messages[{i}].content[{j}].text"),
                        "a text part needs `text`",
                    )),
                    (kind, _) => Err(ApiError::bad(
                        &format!("messages[{i}].content[{j}].type"),
                        format!("content part of type `{}` is not supported (text only)", quote(kind)),
                    )),
                })
                .collect::<Result<String, ApiError>>()?,
        };
        let mut m = json!({"role": self.role, "content": text});
        for (key, v) in [
            ("name", &self.name),
            ("tool_call_id", &self.tool_call_id),
            ("reasoning_content", &self.reasoning_content),
        ] {
            if let Some(v) = v {
                m[key] = json!(v);
            }
        }
        if let Some(calls) = &self.tool_calls {
            if self.role != "assistant" && !calls.is_empty() {
                return Err(ApiError::bad(
                    &format!("messages[{i}].tool_calls"),
                    "only assistant messages make tool calls",
                ));
            }
            let mut read: Vec<Value> = Vec::with_capacity(calls.len());
            for (j, c) in calls.iter().enumerate() {
                let at = format!("messages[{i}].tool_calls[{j}]");
                let call = tool_call(c, &at)?;
                let id = call["id"].as_str().unwrap_or_default();
                if let Some(k) = read.iter().position(|r| !id.is_empty() && r["id"] == id) {
                    return Err(ApiError::bad(
                        &format!("{at}.id"),
                        format!("`{}` is also the id of messages[{i}].tool_calls[{k}]: a message's calls have distinct ids", quote(id)),
                    ));
                }
                read.push(call);
            }
            m["tool_calls"] = Value::Array(read);
        }
        Ok(m)
    }
}

/// An assistant message's call, for the template: `{"id", "type": "function", "function":
/// {"name", "arguments"}}` as OpenAI's wire format has it, the arguments JSON text holding
/// an object (left out: `{}`), which becomes the mapping it encodes. A `type` other than
/// `function`, an id that is not a string, an empty name or arguments that are not an
/// object's JSON text are refused naming the field.
fn tool_call(c: &Value, at: &str) -> Result<Value, ApiError> {
    match c.get("type") {
        None | Some(Value::Null) => {}
        Some(t) if t == "function" => {}
        Some(t) => {
            return Err(ApiError::bad(
                &format!("{at}.type"),
                format!("a tool call's `type` is `function`, not {}", quote(&t.to_string())),
            ))
        }
    }
    let id = match c.get("id") {
        None | Some(Value::Null) => "",
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err(ApiError::bad(&format!("{at}.id"), "a tool call's `id` must be a string")),
    };
    let f = c
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| ApiError::bad(&format!("{at}.function"), "a tool call needs a `function` object"))?;
    let name = f.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).ok_or_else(|| {
        ApiError::bad(&format!("{at}.function.name"), "a tool call needs a function name, a non-empty string")
    })?;
    let args_at = format!("{at}.function.arguments");
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => match mtp_base::json::parse(s.as_bytes()) {
            Ok(v @ Value::Object(_)) => v,
            Ok(v) => {
                return Err(ApiError::bad(
                    &args_at,
                    format!("the arguments must be a JSON object's text, not {}", quote(&v.to_string())),
                ))
            }
            Err(e) => return Err(ApiError::bad(&args_at, format!("the arguments are not JSON: {e}"))),
        },
        Some(v) => {
            return Err(ApiError::bad(
                &args_at,
                format!(
                    "the arguments must be a string holding a JSON object (`\"{{}}\"`), not {}",
                    quote(&v.to_string())
                ),
            ))
        }
    };
    Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
}
