//! `POST /v1/responses`, OpenAI's Responses API, as a thin layer over the chat endpoint.
//!
//! Contract: a Responses body is read into the chat body it means ([`request`]), which
//! then takes the chat endpoint's own path ([`crate::routes::start`]): the same vetting,
//! chat template, tool grammar, reasoning split, sampling and engine. Only the answer's
//! shape differs: a `Response` object ([`reply`]) or the Responses event stream
//! ([`stream`]). So a request's reply is, token for token, that of the chat request it
//! means, and as bitwise the same alone or among others, streamed or not. A refusal names
//! the Responses field (`input[1].content`, `tools[0].name`, `text.format.schema`), never
//! the chat field it became ([`rename`]). Nothing is stored: the server is stateless.

mod reply;
mod request;
mod stream;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api::ApiError;
use crate::body::LimitedBody;
use crate::output::collect;
use crate::request_log::RequestLog;
use crate::routes::{self, now, Kind};
use crate::AppState;
use request::{Converted, Origin};

/// A fresh id of `prefix` (`resp`, `msg`, `rs`, `fc`), unique in this server's life.
fn fresh_id(app: &AppState, prefix: &str) -> String {
    format!("{prefix}_{}", app.next_id.fetch_add(1, Ordering::Relaxed))
}

/// The handler; its access-log line has route `responses`.
pub async fn create(State(app): State<Arc<AppState>>, LimitedBody(body): LimitedBody) -> Response {
    let mut log = RequestLog::new(fresh_id(&app, "resp"), Kind::Chat).on_route("responses");
    match respond(&app, body, &mut log).await {
        Ok(r) => {
            log.answered(r.status().as_u16());
            r
        }
        Err(e) => {
            log.answered(e.status.as_u16());
            app.refuse(e)
        }
    }
}

async fn respond(app: &Arc<AppState>, body: Bytes, log: &mut RequestLog) -> Result<Response, ApiError> {
    app.requests.fetch_add(1, Ordering::Relaxed);
    let body = routes::parse(body).await?;
    let Converted { chat, origins, echo, logprobs } = request::convert(&body)?;
    if logprobs && app.reasoning.is_some() {
        return Err(ApiError::bad(
            "include",
            "logprobs are reported for replies of text alone: this model's replies may hold reasoning",
        ));
    }
    let (plan, mut receivers, slots) =
        routes::start(app, Kind::Chat, &chat, log).await.map_err(|e| rename(e, &origins))?;
    let created_at = now();
    if plan.stream {
        let Some(updates) = receivers.pop() else {
            return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "no choice to stream"));
        };
        return Ok(stream::respond(app.clone(), plan, updates, slots, log.hand_off(), echo).into_response());
    }
    let whole = collect(app, &plan, receivers, slots, log).await?;
    let id = log.id().to_string();
    let r = reply::from_chat(&id, created_at, &app.model_name, &whole, &echo, &mut |p| fresh_id(app, p));
    Ok(Json(r).into_response())
}

/// A refusal from the chat path, its field named as the Responses body names it (the
/// message's mentions too).
fn rename(mut e: ApiError, origins: &[Origin]) -> ApiError {
    let Some(param) = e.param.take() else { return e };
    let renamed = responses_path(&param, origins);
    e.message = e.message.replace(&param, &renamed);
    e.param = Some(renamed);
    e
}

/// The Responses path of a chat body's field.
fn responses_path(param: &str, origins: &[Origin]) -> String {
    let (head, rest) = match param.find(['.', '[']) {
        Some(at) => param.split_at(at),
        None => (param, ""),
    };
    match head {
        "messages" => match message_index(rest) {
            Some((k, tail)) => message_path(k, tail, origins),
            None => "input".into(),
        },
        "tools" => param.replacen(".function", "", 1),
        "tool_choice" => param.replacen(".function", "", 1),
        "response_format" => match rest.strip_prefix(".json_schema.schema") {
            // A keyword inside the schema keeps its path.
            Some(inside) => format!("text.format.schema{inside}"),
            None => "text.format".into(),
        },
        "max_completion_tokens" => "max_output_tokens".into(),
        _ => param.into(),
    }
}

/// `[k]` and what follows it.
fn message_index(rest: &str) -> Option<(usize, &str)> {
    let inner = rest.strip_prefix('[')?;
    let end = inner.find(']')?;
    Some((inner[..end].parse().ok()?, &inner[end + 1..]))
}

/// Message `k`'s field `tail` (`.content`, `.tool_calls[1].function.arguments`) as the
/// field of the input item it came from.
fn message_path(k: usize, tail: &str, origins: &[Origin]) -> String {
    let Some(origin) = origins.get(k) else { return "input".into() };
    let Some(item) = origin.item else { return "instructions".into() };
    if let Some((j, call)) = tail.strip_prefix(".tool_calls").and_then(message_index) {
        let at = origin.calls.get(j).copied().unwrap_or(item);
        // A `function_call` item is flat, its id `call_id`.
        let field = match call.replacen(".function", "", 1) {
            f if f == ".id" => ".call_id".to_string(),
            f => f,
        };
        return format!("input[{at}]{field}");
    }
    format!("input[{item}]{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_fields_are_named_as_the_responses_body_names_them() {
        let origins = [
            Origin { item: None, calls: vec![] },
            Origin { item: Some(0), calls: vec![] },
            Origin { item: Some(1), calls: vec![1, 2] },
        ];
        for (chat, want) in [
            ("messages", "input"),
            ("messages[0].content", "instructions"),
            ("messages[1].content[0].text", "input[0].content[0].text"),
            ("messages[2].tool_calls[1].function.arguments", "input[2].arguments"),
            ("messages[9].role", "input"),
            ("tools[3].function.name", "tools[3].name"),
            ("tool_choice.function.name", "tool_choice.name"),
            ("response_format.json_schema.schema", "text.format.schema"),
            (
                "response_format.json_schema.schema.properties.a.minLenght",
                "text.format.schema.properties.a.minLenght",
            ),
            ("messages[2].tool_calls[1].id", "input[2].call_id"),
            ("tools[0].function.parameters.requred", "tools[0].parameters.requred"),
            ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"),
            ("temperature", "temperature"),
        ] {
            assert_eq!(responses_path(chat, &origins), want, "{chat}");
        }
        let e = rename(
            ApiError::bad("max_completion_tokens", "`max_completion_tokens` must be at least 1"),
            &origins,
        );
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (Some("max_output_tokens"), "`max_output_tokens` must be at least 1")
        );
    }
}
