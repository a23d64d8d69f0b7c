//! Prompts into token ids, off the async workers.
//!
//! Contract: a prompt whose bytes are more than the context could hold (context times the
//! tokenizer's most bytes per token) is refused with 413 before any tokenizing; chat
//! templates are rendered and prompts tokenized on tokio's blocking pool, at most one per
//! core at a time, so that a burst of long prompts neither stalls the async workers
//! (`/health` keeps answering) nor takes every blocking thread. Message content is
//! tokenized so that it cannot produce control tokens ([`crate::chat`]); a completion
//! prompt is the caller's own raw text and is tokenized as HF does, control tokens
//! included.

use std::sync::{Arc, OnceLock};

use axum::http::StatusCode;
use tokio::sync::Semaphore;

use crate::api::ApiError;
use crate::chat::Conversation;
use crate::AppState;

/// A prompt as the request gave it.
pub(crate) enum Source {
    Text(String),
    Ids(Vec<u32>),
    Chat(Conversation),
}

/// One process-wide limit: tokenizing is CPU work and the cores are the process's,
/// however many servers it runs.
fn permits() -> &'static Semaphore {
    static PERMITS: OnceLock<Semaphore> = OnceLock::new();
    PERMITS.get_or_init(|| Semaphore::new(std::thread::available_parallelism().map_or(2, |n| n.get())))
}

/// Runs `work` on tokio's blocking pool once a permit is free; the permit moves into the
/// work, so it is held until the work ends even if the client has gone.
pub(crate) async fn off_workers<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let permit = permits()
        .acquire()
        .await
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down"))?;
    let done = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        work()
    });
    match done.await {
        Ok(result) => result,
        Err(e) => {
            Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("request preparation failed: {e}")))
        }
    }
}

/// The token ids of `source`, or the refusal naming `param` (`prompt` or `messages`).
pub(crate) async fn tokenize(
    app: &Arc<AppState>,
    source: Source,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let text_bytes = match source {
        Source::Ids(ids) => return Ok(ids),
        Source::Text(ref t) => t.len(),
        // Content a template would drop (some drop earlier turns' reasoning) still counts:
        // a chat this far over the context is refused without rendering it.
        Source::Chat(ref c) => c.strings().iter().fold(0usize, |n, s| n.saturating_add(s.len())),
    };
    fits(app, text_bytes, param, false)?;
    let tok = app.tokenizer.clone().ok_or_else(|| {
        ApiError::bad(
            param,
            format!("`{param}` as text needs a tokenizer and the target has no tokenizer.json"),
        )
    })?;
    let app = app.clone();
    off_workers(move || match source {
        Source::Text(t) => tok.encode(&t).map_err(|e| ApiError::bad(param, e.to_string())),
        Source::Ids(ids) => Ok(ids),
        Source::Chat(messages) => {
            let template = app.template.as_ref().ok_or_else(|| {
                ApiError::bad(
                    param,
                    "the target has no chat template (chat_template.jinja or tokenizer_config.json; a GGUF's tokenizer.chat_template)",
                )
            })?;
            let rendered =
                template.render_isolated(&messages, tok.specials()).map_err(|e| ApiError::bad(param, e))?;
            fits(&app, rendered.len(), param, true)?;
            rendered.encode(&tok).map_err(|e| ApiError::bad(param, e))
        }
    })
    .await
}

/// Refuses `bytes` of text that cannot fit the context, whatever they tokenize to.
pub(crate) fn fits(app: &AppState, bytes: usize, param: &str, rendered: bool) -> Result<(), ApiError> {
    let Some(per) = app.tokenizer.as_ref().and_then(|t| t.max_bytes_per_token()) else { return Ok(()) };
    let limit = app.context.saturating_mul(per);
    if bytes <= limit {
        return Ok(());
    }
    let what = if rendered {
        "the rendered chat"
    } else if param == "messages" {
        "the messages' content"
    } else {
        "the prompt"
    };
    Err(ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        message: format!(
            "{what} is {bytes} bytes; the model's context of {} tokens holds at most {limit} bytes (one token stands for at most {per})",
            app.context
        ),
        param: Some(param.into()),
    })
}
