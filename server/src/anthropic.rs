//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, a
//! thin layer over the chat endpoint's path.
//!
//! Contract: a request is vetted field by field ([`request`]: unknown fields refused by
//! name, the SDK's metadata accepted), converted into the chat endpoint's own request
//! (system prompt, `tool_use` blocks as assistant tool calls, `tool_result` blocks as tool
//! messages, `tool_choice` `any`/`tool` as `required`/named) and run by
//! [`crate::routes::run`]: the same template, tool grammar and parser, reasoning split and
//! sampling, so a reply's tokens are those of the same chat request, alone or among many,
//! streamed or not. The chat endpoint's output is re-encoded: whole ([`reply`]) or as
//! Anthropic's SSE events ([`events`]). Every refusal is Anthropic's error body naming the
//! field (`{"type": "error", "error": {"type": "invalid_request_error", "message":
//! "max_tokens: ..."}}`), with the status the chat endpoint gives it.

mod events;
mod reply;
mod request;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::api::{self, ApiError};
use crate::request_log::RequestLog;
use crate::routes::{self, prompt, Kind};
use crate::AppState;

type Shared = State<Arc<AppState>>;

/// `POST /v1/messages`.
pub(crate) async fn messages(State(app): Shared, req: Request) -> Response {
    let id = format!("msg_{}", app.next_id.fetch_add(1, Ordering::Relaxed));
    let mut log = RequestLog::for_route(id, "messages");
    match create(&app, req, &mut log).await {
        Ok(r) => {
            log.answered(r.status().as_u16());
            r
        }
        Err(e) => {
            log.answered(e.status.as_u16());
            refuse(&app, &e)
        }
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's length, as `usage.input_tokens` of the
/// same request to `/v1/messages` counts it.
pub(crate) async fn count_tokens(State(app): Shared, req: Request) -> Response {
    match count(&app, req).await {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => refuse(&app, &e),
    }
}

async fn create(app: &Arc<AppState>, req: Request, log: &mut RequestLog) -> Result<Response, ApiError> {
    app.requests.fetch_add(1, Ordering::Relaxed);
    let body = read_body(app, req).await?;
    request::check(&body, request::Endpoint::Create)?;
    let r: request::MessagesRequest = api::fields(&body)?;
    log.set_stream(r.stream == Some(true));
    let (common, chat) = request::convert(r, request::Endpoint::Create)?;
    let sourced = routes::chat_source(app, chat).map_err(request::renamed)?;
    let (plan, receivers, slots) =
        routes::run(app, Kind::Chat, common, sourced, log).await.map_err(request::renamed)?;
    let id = log.id().to_string();
    if plan.stream {
        let encoder = events::Encoder::new(app, &plan, id);
        let chunks = crate::output::chunks(app.clone(), plan, receivers, slots, log.hand_off());
        return Ok(encoder.respond(chunks).into_response());
    }
    let chat = crate::output::collect(app, &plan, receivers, slots, log).await?;
    Ok(Json(reply::message(app, &plan, &id, &chat)).into_response())
}

async fn count(app: &Arc<AppState>, req: Request) -> Result<usize, ApiError> {
    let body = read_body(app, req).await?;
    request::check(&body, request::Endpoint::CountTokens)?;
    let r: request::MessagesRequest = api::fields(&body)?;
    if r.model != app.model_name {
        return Err(ApiError::unknown_model(&app.model_name, &r.model));
    }
    let (_, chat) = request::convert(r, request::Endpoint::CountTokens)?;
    let source = routes::chat_source(app, chat).map_err(request::renamed)?.source;
    Ok(prompt::tokenize(app, source, "messages").await?.len())
}

/// The body within the server's limits, parsed (a large one off the async workers).
async fn read_body(app: &Arc<AppState>, req: Request) -> Result<Value, ApiError> {
    routes::parse(crate::body::read(req, app).await?).await
}

fn refuse(app: &AppState, e: &ApiError) -> Response {
    app.count_refusal(e);
    error_response(e)
}

/// Anthropic's error type for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500.. => "api_error",
        _ => "invalid_request_error",
    }
}

/// Anthropic's error body: the message led by the field at fault, in Anthropic's dotted
/// path (`messages.0.content.1.type: ...`).
pub(crate) fn error_body(e: &ApiError) -> Value {
    let message = match &e.param {
        Some(p) => format!("{}: {}", p.replace('[', ".").replace(']', ""), e.message),
        None => e.message.clone(),
    };
    json!({"type": "error", "error": {"type": error_type(e.status), "message": message}})
}

pub(crate) fn error_response(e: &ApiError) -> Response {
    (e.status, Json(error_body(e))).into_response()
}
