//! The OpenAI request bodies this server accepts, parsed with errors that name the field,
//! and the error body it answers with.

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

/// Parses a request body: malformed JSON, or anything but an object, is a 400.
pub fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(ApiError::new(StatusCode::BAD_REQUEST, "the request body must be a JSON object")),
        Err(e) => Err(ApiError::new(StatusCode::BAD_REQUEST, format!("malformed JSON body: {e}"))),
    }
}

/// Reads the fields of `T` from a parsed body (other fields are ignored); a missing
/// required field or a field of the wrong type is a 400 naming it.
pub fn fields<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.to_string();
        if let Some(field) = msg.strip_prefix("missing field `").and_then(|m| m.split('`').next()) {
            ApiError::bad(field, format!("missing field `{field}`"))
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
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields both endpoints share.
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
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Extension (as vLLM spells it): return the prompt's and each choice's token ids.
    #[serde(default)]
    pub return_token_ids: bool,
    /// Extension: keep generating past EOS ids.
    #[serde(default)]
    pub ignore_eos: bool,
}

/// `POST /v1/completions`.
#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// How many most likely alternatives to report per token (0 to 20); present means
    /// report logprobs.
    pub logprobs: Option<u64>,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
    pub best_of: Option<u64>,
}

/// A completion prompt: text, or token ids.
#[derive(Deserialize, Debug)]
#[serde(untagged, expecting = "a string or a list of token ids")]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Batch(Vec<Value>),
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub tools: Option<Vec<Value>>,
}

#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
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

impl Content {
    /// The message's text; non-text parts are refused, naming the message.
    pub fn text(&self, i: usize) -> Result<String, ApiError> {
        match self {
            Content::Text(s) => Ok(s.clone()),
            Content::Parts(parts) => parts
                .iter()
                .enumerate()
                .map(|(j, p)| match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => Ok(t.as_str()),
                    (kind, _) => Err(ApiError::bad(
                        &format!("messages[{i}].content[{j}]"),
                        format!("content part of type `{kind}` is not supported (text only)"),
                    )),
                })
                .collect(),
        }
    }
}
