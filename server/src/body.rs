//! Request bodies, read within the server's size and time limits ([`crate::net::Limits`]).
//! Each refusal is an OpenAI error JSON: over the size, `413` (after reading and dropping
//! the rest of the body, up to a bound, so the client is not reset mid-send and sees the
//! answer); too slow or shorter than its `Content-Length`, `408`.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::Response;
use http_body_util::BodyExt;

use crate::api::ApiError;
use crate::AppState;

/// A request body within the limits.
pub(crate) struct LimitedBody(pub(crate) Bytes);

/// Bytes of an oversized body read and dropped before answering 413; past this the
/// connection is closed after the answer.
const DRAIN_BYTES: usize = 64 << 20;

impl FromRequest<Arc<AppState>> for LimitedBody {
    type Rejection = Response;

    async fn from_request(req: Request, app: &Arc<AppState>) -> Result<Self, Response> {
        read(req, app).await.map(LimitedBody).map_err(|e| app.refuse(e))
    }
}

/// The body of `req` within the limits, or the refusal (for endpoints whose error bodies
/// take another shape).
pub(crate) async fn read(req: Request, app: &AppState) -> Result<Bytes, ApiError> {
    let limits = &app.limits;
    let declared = req.headers().get(axum::http::header::CONTENT_LENGTH);
    let declared = declared.and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let media = req.headers().get(axum::http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    // A form's parts are not the JSON they may hold (no Content-Type, JSON's, text and
    // curl's default form type are read as JSON).
    let multipart = media.is_some_and(|m| m.trim_start().to_ascii_lowercase().starts_with("multipart/"));
    let body = req.into_body();
    let read = async {
        // Declared too large to drain: answer at once (the connection closes after).
        if declared.is_some_and(|n| n > DRAIN_BYTES as u64) {
            return Ok(None);
        }
        read_limited(body, limits.max_body_bytes).await
    };
    match tokio::time::timeout(limits.body_timeout, read).await {
        Ok(Ok(Some(_))) if multipart => Err(ApiError::bad(
            "Content-Type",
            "a multipart/form-data body is not read: send the request as JSON (Content-Type: application/json)",
        )
        .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE)),
        Ok(Ok(Some(body))) => Ok(body),
        Ok(Ok(None)) => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is over {} bytes (--max-body-mib)", limits.max_body_bytes),
        )),
        Ok(Err(e)) => {
            Err(ApiError::new(StatusCode::BAD_REQUEST, format!("the request body could not be read: {e}")))
        }
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s (--body-timeout)",
                limits.body_timeout.as_secs_f64()
            ),
        )),
    }
}

/// The body if it has at most `max` bytes; `None` (after draining) if it has more.
async fn read_limited(mut body: Body, max: usize) -> Result<Option<Bytes>, axum::Error> {
    let mut kept = Vec::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        seen = seen.saturating_add(data.len());
        if seen > DRAIN_BYTES {
            return Ok(None);
        }
        if seen <= max {
            kept.extend_from_slice(&data);
        } else {
            kept = Vec::new();
        }
    }
    Ok((seen <= max).then(|| Bytes::from(kept)))
}
