//! `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` as vLLM spells them, and
//! `GET /v1/models/{id}`.
//!
//! `/tokenize` takes `prompt` (text, tokenized as `/v1/completions` tokenizes it;
//! `add_special_tokens: false` leaves the tokenizer's own out) or `messages` (and `tools`,
//! rendered and tokenized exactly as `/v1/chat/completions` does: the ids a chat's
//! `usage.prompt_tokens` counts) and answers `{"count", "max_model_len", "tokens",
//! "token_strs": null}`; `/detokenize` takes `tokens` and answers `{"prompt"}`. `model`,
//! when given, must be the served one; any other key is refused by name.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::api::{self, ApiError, ChatRequest};
use crate::body::LimitedBody;
use crate::routes::{self, prompt, Shared};
use crate::AppState;

pub async fn tokenize(State(app): Shared, LimitedBody(body): LimitedBody) -> Response {
    match count(&app, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => app.refuse(e),
    }
}

pub async fn detokenize(State(app): Shared, LimitedBody(body): LimitedBody) -> Response {
    let text = async {
        let body = routes::parse(body).await?;
        known(&app, &body, &["model", "tokens"])?;
        let ids = body
            .get("tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| ApiError::bad("tokens", "`tokens` must be a list of token ids"))?;
        let ids = routes::token_ids(&app, ids, "tokens")?;
        let tok = app
            .tokenizer
            .clone()
            .ok_or_else(|| ApiError::bad("tokens", "the target has no tokenizer.json"))?;
        tok.decode(&ids).map_err(|e| ApiError::bad("tokens", e.to_string()))
    };
    match text.await {
        Ok(prompt) => Json(json!({"prompt": prompt})).into_response(),
        Err(e) => app.refuse(e),
    }
}

/// `GET /tokenizer_info`: the special tokens' text, the chat template and the context, as
/// vLLM answers it (lm-eval's remote tokenizer reads it, then tokenizes through
/// `/tokenize`).
pub async fn info(State(app): Shared) -> Json<Value> {
    Json(json!({
        "eos_token": app.eos_token,
        "bos_token": app.bos_token,
        "pad_token": null,
        "chat_template": app.template.as_ref().map(|t| t.source()),
        "model_max_length": app.context,
    }))
}

/// `GET /v1/models/{id}`: the served model's entry, or a 404 naming it.
pub async fn model(State(app): Shared, Path(id): Path<String>) -> Response {
    if id != app.model_name {
        let e = ApiError::unknown_model(&app.model_name, &id);
        return (e.status, Json(e.body())).into_response();
    }
    Json(routes::model_entry(&app)).into_response()
}

async fn count(app: &Arc<AppState>, body: axum::body::Bytes) -> Result<Value, ApiError> {
    let body = routes::parse(body).await?;
    let ids = match (body.get("prompt"), body.get("messages")) {
        (Some(_), Some(_)) => return Err(ApiError::bad("messages", "give `prompt` or `messages`, not both")),
        (Some(p), None) => {
            known(app, &body, &["model", "prompt", "add_special_tokens"])?;
            let text = p.as_str().ok_or_else(|| ApiError::bad("prompt", "`prompt` must be a string"))?;
            match body.get("add_special_tokens").filter(|v| !v.is_null()).map(Value::as_bool) {
                None | Some(Some(true)) => {
                    prompt::tokenize(app, prompt::Source::Text(text.into()), "prompt").await?
                }
                Some(Some(false)) => {
                    prompt::fits(app, text.len(), "prompt", false)?;
                    let tok = app
                        .tokenizer
                        .clone()
                        .ok_or_else(|| ApiError::bad("prompt", "the target has no tokenizer.json"))?;
                    let text = text.to_string();
                    prompt::off_workers(move || {
                        tok.encode_plain(&text).map_err(|e| ApiError::bad("prompt", e.to_string()))
                    })
                    .await?
                }
                Some(None) => {
                    return Err(ApiError::bad("add_special_tokens", "`add_special_tokens` must be a boolean"))
                }
            }
        }
        (None, Some(_)) => {
            known(
                app,
                &body,
                &["model", "messages", "tools", "add_generation_prompt", "chat_template_kwargs"],
            )?;
            if body.get("add_generation_prompt").is_some_and(|v| !v.is_null() && v != &json!(true)) {
                return Err(ApiError::bad(
                    "add_generation_prompt",
                    "only `true` is accepted (the chat endpoint always adds the generation prompt)",
                ));
            }
            // The chat endpoint's own fields, vetted and read as it reads them.
            let mut chat_body = body.clone();
            if let Some(m) = chat_body.as_object_mut() {
                m.retain(|k, _| ["messages", "tools", "chat_template_kwargs"].contains(&k.as_str()));
            }
            api::audit::check_chat(&chat_body)?;
            let chat: ChatRequest = api::fields(&chat_body)?;
            let source = routes::chat_source(app, chat)?.source;
            prompt::tokenize(app, source, "messages").await?
        }
        (None, None) => return Err(ApiError::bad("prompt", "give `prompt` (text) or `messages`")),
    };
    Ok(json!({"count": ids.len(), "max_model_len": app.context, "tokens": ids, "token_strs": null}))
}

/// Refuses a key of `body` outside `allowed` by name, and a `model` other than the served one.
fn known(app: &AppState, body: &Value, allowed: &[&str]) -> Result<(), ApiError> {
    let map = body
        .as_object()
        .ok_or_else(|| ApiError::new(StatusCode::BAD_REQUEST, "the body must be a JSON object"))?;
    if let Some(k) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(ApiError::bad(k, format!("unrecognized request argument `{}`", api::quote(k))));
    }
    match map.get("model") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(m)) if *m == app.model_name => Ok(()),
        Some(Value::String(m)) => Err(ApiError::unknown_model(&app.model_name, m)),
        Some(_) => Err(ApiError::bad("model", "`model` must be a string")),
    }
}
