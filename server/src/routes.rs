//! The HTTP endpoints: requests become engine jobs (one per choice), updates become
//! OpenAI response bodies or SSE chunks.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mtp_engine::{Request, SamplingParams};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use crate::api::{self, ApiError, ChatRequest, Common, CompletionRequest, Prompt};
use crate::body::LimitedBody;
use crate::output::{collect, stream_response};
use crate::worker::{Job, Update};
use crate::AppState;

type Shared = State<Arc<AppState>>;

/// Which endpoint a request came through (they differ only in their bodies).
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

/// Everything a validated request needs to run and be answered.
pub(crate) struct Plan {
    pub(crate) kind: Kind,
    pub(crate) prompt: Vec<u32>,
    pub(crate) n: usize,
    pub(crate) max_tokens: usize,
    pub(crate) sampling: SamplingParams,
    pub(crate) stop: Vec<String>,
    /// `None`: no logprobs; `Some(k)`: logprobs with k alternatives.
    pub(crate) logprobs: Option<usize>,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) return_token_ids: bool,
    pub(crate) ignore_eos: bool,
}

pub(crate) fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn models(State(app): Shared) -> Json<Value> {
    Json(json!({"object": "list", "data": [
        {"id": app.model_name, "object": "model", "created": app.started, "owned_by": "mtp",
         "max_model_len": app.context}
    ]}))
}

pub async fn metrics(State(app): Shared) -> Response {
    let text = crate::metrics::render(&app);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

pub async fn completions(State(app): Shared, LimitedBody(body): LimitedBody) -> Response {
    respond(&app, Kind::Completion, &body).await.unwrap_or_else(|e| app.refuse(e))
}

pub async fn chat(State(app): Shared, LimitedBody(body): LimitedBody) -> Response {
    respond(&app, Kind::Chat, &body).await.unwrap_or_else(|e| app.refuse(e))
}

async fn respond(app: &Arc<AppState>, kind: Kind, body: &[u8]) -> Result<Response, ApiError> {
    app.requests.fetch_add(1, Ordering::Relaxed);
    let body = api::parse_body(body)?;
    let common: Common = api::fields(&body)?;
    let plan = match kind {
        Kind::Completion => plan_completion(app, api::fields(&body)?, common)?,
        Kind::Chat => plan_chat(app, api::fields(&body)?, common)?,
    };
    let (receivers, slots) = submit(app, &plan).await?;
    if plan.stream {
        Ok(stream_response(app.clone(), plan, receivers, slots).into_response())
    } else {
        collect(app, &plan, receivers, slots).await.map(|v| Json(v).into_response())
    }
}

fn tokenizer(app: &AppState, what: &str) -> Result<Arc<mtp_base::Tokenizer>, ApiError> {
    app.tokenizer.clone().ok_or_else(|| {
        ApiError::bad(what, format!("`{what}` needs a tokenizer and the target has no tokenizer.json"))
    })
}

fn plan_completion(app: &AppState, r: CompletionRequest, common: Common) -> Result<Plan, ApiError> {
    if r.echo {
        return Err(ApiError::bad("echo", "`echo` is not supported"));
    }
    if r.suffix.is_some() {
        return Err(ApiError::bad("suffix", "`suffix` is not supported"));
    }
    if r.best_of.is_some_and(|b| b > 1) {
        return Err(ApiError::bad("best_of", "`best_of` above 1 is not supported (use `n`)"));
    }
    let prompt = match r.prompt {
        Prompt::Text(t) => {
            tokenizer(app, "prompt")?.encode(&t).map_err(|e| ApiError::bad("prompt", e.to_string()))?
        }
        Prompt::Ids(ids) => ids,
        Prompt::Batch(_) => {
            return Err(ApiError::bad("prompt", "one prompt per request: a string or a list of token ids"))
        }
    };
    let logprobs = match r.logprobs {
        None => None,
        Some(k) if k <= 20 => Some(k as usize),
        Some(_) => return Err(ApiError::bad("logprobs", "`logprobs` must be between 0 and 20")),
    };
    plan(app, Kind::Completion, prompt, common, None, logprobs)
}

fn plan_chat(app: &AppState, r: ChatRequest, common: Common) -> Result<Plan, ApiError> {
    if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::bad("tools", "`tools` is not supported (describe tools in the messages)"));
    }
    if r.messages.is_empty() {
        return Err(ApiError::bad("messages", "`messages` is empty"));
    }
    let template = app.template.as_ref().ok_or_else(|| {
        ApiError::bad(
            "messages",
            "the target has no chat template (chat_template.jinja or tokenizer_config.json)",
        )
    })?;
    let messages = r
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| Ok((m.role.clone(), m.content.as_ref().map_or(Ok(String::new()), |c| c.text(i))?)))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let text = template.render(&messages).map_err(|e| ApiError::bad("messages", e))?;
    let prompt = tokenizer(app, "messages")?
        .encode_plain(&text)
        .map_err(|e| ApiError::bad("messages", e.to_string()))?;
    let logprobs = match (r.logprobs, r.top_logprobs) {
        (_, Some(k)) if k > 20 => {
            return Err(ApiError::bad("top_logprobs", "`top_logprobs` must be between 0 and 20"))
        }
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::bad("top_logprobs", "`top_logprobs` needs `logprobs: true`"))
        }
        (true, k) => Some(k.unwrap_or(0) as usize),
        (false, _) => None,
    };
    plan(app, Kind::Chat, prompt, common, r.max_completion_tokens, logprobs)
}

fn plan(
    app: &AppState,
    kind: Kind,
    prompt: Vec<u32>,
    c: Common,
    max_completion_tokens: Option<u64>,
    logprobs: Option<usize>,
) -> Result<Plan, ApiError> {
    if let Some(m) = &c.model {
        if *m != app.model_name {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("model `{m}` is not served here (this server serves `{}`)", app.model_name),
                param: Some("model".into()),
            });
        }
    }
    for (name, v) in [("frequency_penalty", c.frequency_penalty), ("presence_penalty", c.presence_penalty)] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(ApiError::bad(
                name,
                format!("`{name}` is not supported (penalties change the model's distribution)"),
            ));
        }
    }
    if c.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(ApiError::bad("logit_bias", "`logit_bias` is not supported"));
    }
    if prompt.is_empty() {
        return Err(ApiError::bad("prompt", "the prompt is empty"));
    }
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= app.vocab) {
        return Err(ApiError::bad(
            "prompt",
            format!("token id {t} is outside the vocabulary of {}", app.vocab),
        ));
    }
    if prompt.len() > app.context {
        return Err(ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "the prompt has {} tokens; the model's context is {}",
                prompt.len(),
                app.context
            ),
            param: Some(if kind == Kind::Chat { "messages" } else { "prompt" }.into()),
        });
    }
    let n = c.n.unwrap_or(1);
    if !(1..=16).contains(&n) {
        return Err(ApiError::bad("n", "`n` must be between 1 and 16"));
    }
    let (max_name, max_tokens) = match (max_completion_tokens, c.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let room = app.context + 1 - prompt.len();
    let max_tokens = match (max_tokens, kind) {
        (Some(0), _) => return Err(ApiError::bad(max_name, format!("`{max_name}` must be at least 1"))),
        (Some(m), _) => m.min(room as u64) as usize,
        (None, Kind::Completion) => 16.min(room),
        (None, Kind::Chat) => room,
    };
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(_) => return Err(ApiError::bad("top_k", "`top_k` must be positive (or -1 / 0: off)")),
    };
    let temperature = c.temperature.unwrap_or(1.0);
    // No seed: a fresh one per request, as OpenAI's API samples; a given seed reproduces.
    let seed = c.seed.unwrap_or_else(|| app.fresh_seed());
    let sampling = SamplingParams {
        temperature,
        top_k,
        top_p: c.top_p.unwrap_or(1.0),
        min_p: c.min_p.unwrap_or(0.0),
        seed,
    };
    sampling.validate().map_err(|msg| ApiError::new(StatusCode::BAD_REQUEST, msg))?;
    let stop = c.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > 16 || stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::bad("stop", "`stop` takes up to 16 non-empty strings"));
    }
    if !stop.is_empty() {
        tokenizer(app, "stop")?;
    }
    Ok(Plan {
        kind,
        prompt,
        n: n as usize,
        max_tokens,
        sampling,
        stop,
        logprobs,
        stream: c.stream,
        include_usage: c.stream_options.is_some_and(|o| o.include_usage),
        return_token_ids: c.return_token_ids,
        ignore_eos: c.ignore_eos,
    })
}

/// Hands one job per choice to the engine thread (choice `i` samples with seed + i) and
/// waits until each is admitted to the queue. The returned slots are held until the
/// response (or stream) ends, however it ends; a refusal gives them back at once.
async fn submit(
    app: &Arc<AppState>,
    plan: &Plan,
) -> Result<(Vec<mpsc::UnboundedReceiver<Update>>, PendingSlots), ApiError> {
    let pending = app.pending.fetch_add(plan.n, Ordering::SeqCst);
    let slots = PendingSlots { app: app.clone(), n: plan.n };
    if pending + plan.n > app.max_pending {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("the server holds {pending} requests, its limit is {}; retry later", app.max_pending),
        ));
    }
    let mut receivers = Vec::with_capacity(plan.n);
    let mut admissions = Vec::with_capacity(plan.n);
    for i in 0..plan.n {
        let (tx, rx) = mpsc::unbounded_channel();
        let (atx, arx) = oneshot::channel();
        let id = app.next_id.fetch_add(1, Ordering::Relaxed);
        let request = Request {
            id: format!("req-{id}"),
            prompt: plan.prompt.clone(),
            max_tokens: plan.max_tokens,
            ignore_eos: plan.ignore_eos,
            stop: plan.stop.clone(),
            sampling: SamplingParams { seed: plan.sampling.seed.wrapping_add(i as u64), ..plan.sampling },
            top_logprobs: plan.logprobs.unwrap_or(0),
            constraint: None,
        };
        let sent = app.jobs.send(Job { request, updates: tx, accepted: atx });
        if sent.is_err() {
            return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine is not running"));
        }
        receivers.push(rx);
        admissions.push(arx);
    }
    for a in admissions {
        match a.await {
            Ok(Ok(())) => {}
            Ok(Err(msg)) => return Err(ApiError::new(StatusCode::BAD_REQUEST, msg)),
            Err(_) => {
                return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine is not running"))
            }
        }
    }
    Ok((receivers, slots))
}

/// A request's share of `--max-pending`, given back when dropped.
pub(crate) struct PendingSlots {
    app: Arc<AppState>,
    n: usize,
}

impl Drop for PendingSlots {
    fn drop(&mut self) {
        self.app.pending.fetch_sub(self.n, Ordering::SeqCst);
    }
}
