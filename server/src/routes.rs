//! The HTTP endpoints: requests become engine jobs (one per choice), updates become
//! OpenAI response bodies or SSE chunks.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use mtp_engine::{FinishReason, Request, SamplingParams};
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::api::{self, ApiError, ChatRequest, Common, CompletionRequest, Prompt};
use crate::text::TextState;
use crate::worker::{Job, Update};
use crate::AppState;

type Shared = State<Arc<AppState>>;

/// Which endpoint a request came through (they differ only in their bodies).
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

/// Everything a validated request needs to run and be answered.
struct Plan {
    kind: Kind,
    prompt: Vec<u32>,
    n: usize,
    max_tokens: usize,
    sampling: SamplingParams,
    stop: Vec<String>,
    /// `None`: no logprobs; `Some(k)`: logprobs with k alternatives.
    logprobs: Option<usize>,
    stream: bool,
    include_usage: bool,
    return_token_ids: bool,
    ignore_eos: bool,
}

fn now() -> u64 {
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

pub async fn completions(State(app): Shared, body: Bytes) -> Response {
    respond(&app, Kind::Completion, &body).await.unwrap_or_else(|e| app.refuse(e))
}

pub async fn chat(State(app): Shared, body: Bytes) -> Response {
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
    let receivers = submit(app, &plan).await?;
    if plan.stream {
        Ok(stream_response(app.clone(), plan, receivers).into_response())
    } else {
        collect(app, &plan, receivers).await.map(|v| Json(v).into_response())
    }
}

fn tokenizer(app: &AppState, what: &str) -> Result<Arc<mtp_model::Tokenizer>, ApiError> {
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
/// waits until each is admitted to the queue.
async fn submit(app: &AppState, plan: &Plan) -> Result<Vec<mpsc::UnboundedReceiver<Update>>, ApiError> {
    let pending = app.pending.fetch_add(plan.n, Ordering::SeqCst);
    let guard = PendingGuard { app, n: plan.n };
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
    std::mem::forget(guard);
    // From here each choice's stream releases its own pending slot when it ends.
    Ok(receivers)
}

/// Gives back pending slots taken by a request that was refused before it ran.
struct PendingGuard<'a> {
    app: &'a AppState,
    n: usize,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.app.pending.fetch_sub(self.n, Ordering::SeqCst);
    }
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
    }
}

/// One choice's output so far.
struct Choice {
    text: TextState,
    logprobs: Vec<f32>,
    top: Vec<Vec<(u32, f32)>>,
    finish: Option<FinishReason>,
}

impl Choice {
    fn new(stop: &[String]) -> Choice {
        Choice { text: TextState::new(stop.to_vec()), logprobs: Vec::new(), top: Vec::new(), finish: None }
    }
}

/// A token as text (special tokens decode to nothing).
fn token_text(app: &AppState, t: u32) -> String {
    app.tokenizer.as_ref().and_then(|tok| tok.decode(&[t]).ok()).unwrap_or_default()
}

/// The logprobs object for tokens `tokens` with their logprobs and alternatives.
fn logprobs_json(
    app: &AppState,
    kind: Kind,
    k: usize,
    tokens: &[u32],
    lps: &[f32],
    top: &[Vec<(u32, f32)>],
) -> Value {
    match kind {
        Kind::Chat => {
            let content: Vec<Value> = tokens
                .iter()
                .zip(lps)
                .zip(top)
                .map(|((&t, &lp), alts)| {
                    let s = token_text(app, t);
                    let alts: Vec<Value> = alts
                        .iter()
                        .map(|&(a, alp)| {
                            let s = token_text(app, a);
                            json!({"token": s, "logprob": alp, "bytes": s.as_bytes(), "id": a})
                        })
                        .collect();
                    json!({"token": s, "logprob": lp, "bytes": s.as_bytes(), "id": t, "top_logprobs": alts})
                })
                .collect();
            json!({"content": content})
        }
        Kind::Completion => {
            let strings: Vec<String> = tokens.iter().map(|&t| token_text(app, t)).collect();
            let mut offset = 0;
            let offsets: Vec<usize> = strings
                .iter()
                .map(|s| {
                    let o = offset;
                    offset += s.len();
                    o
                })
                .collect();
            let top: Value = if k == 0 {
                Value::Null
            } else {
                top.iter()
                    .map(|alts| {
                        let m: Map<String, Value> =
                            alts.iter().map(|&(a, alp)| (token_text(app, a), json!(alp))).collect();
                        Value::Object(m)
                    })
                    .collect()
            };
            json!({"tokens": strings, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets})
        }
    }
}

async fn collect(
    app: &Arc<AppState>,
    plan: &Plan,
    receivers: Vec<mpsc::UnboundedReceiver<Update>>,
) -> Result<Value, ApiError> {
    let _release = Release { app: app.clone(), n: plan.n };
    let mut choices = Vec::with_capacity(plan.n);
    for mut rx in receivers {
        let mut c = Choice::new(&plan.stop);
        while let Some(u) = rx.recv().await {
            match u {
                Update::Token { token, logprob, top } => {
                    c.text.push(token);
                    c.logprobs.push(logprob);
                    c.top.push(top);
                }
                Update::Finished(r) => {
                    c.finish = Some(r);
                    break;
                }
                Update::Failed(msg) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg)),
            }
        }
        if c.finish.is_none() {
            return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped"));
        }
        choices.push(c);
    }
    let completion_tokens: usize = choices.iter().map(|c| c.text.tokens().len()).sum();
    let tok = app.tokenizer.clone();
    let body: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let text = tok.as_ref().map(|t| c.text.final_text(t)).unwrap_or_default();
            let logprobs = plan.logprobs.map_or(Value::Null, |k| {
                logprobs_json(app, plan.kind, k, c.text.tokens(), &c.logprobs, &c.top)
            });
            let mut v = match plan.kind {
                Kind::Completion => json!({"index": i, "text": text, "logprobs": logprobs}),
                Kind::Chat => json!({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs}),
            };
            v["finish_reason"] = json!(finish_reason(c.finish.expect("checked above")));
            if plan.return_token_ids {
                v["token_ids"] = json!(c.text.tokens());
            }
            v
        })
        .collect();
    let (id, object) = match plan.kind {
        Kind::Completion => {
            (format!("cmpl-{}", app.next_id.fetch_add(1, Ordering::Relaxed)), "text_completion")
        }
        Kind::Chat => {
            (format!("chatcmpl-{}", app.next_id.fetch_add(1, Ordering::Relaxed)), "chat.completion")
        }
    };
    let mut out = json!({
        "id": id, "object": object, "created": now(), "model": app.model_name, "choices": body,
        "usage": {"prompt_tokens": plan.prompt.len(), "completion_tokens": completion_tokens,
                  "total_tokens": plan.prompt.len() + completion_tokens},
    });
    if plan.return_token_ids {
        out["prompt_token_ids"] = json!(plan.prompt);
    }
    Ok(out)
}

/// Gives back a request's pending slots when its response (or stream) ends, however it ends.
struct Release {
    app: Arc<AppState>,
    n: usize,
}

impl Drop for Release {
    fn drop(&mut self) {
        self.app.pending.fetch_sub(self.n, Ordering::SeqCst);
    }
}

/// What the SSE stream holds between chunks.
struct Streaming {
    app: Arc<AppState>,
    plan: Plan,
    updates: stream::SelectAll<stream::BoxStream<'static, (usize, Update)>>,
    choices: Vec<Choice>,
    open: usize,
    id: String,
    created: u64,
    done: bool,
    /// Whether a chunk has carried `prompt_token_ids` (asked with `return_token_ids`).
    sent_prompt: bool,
    _release: Release,
}

fn stream_response(
    app: Arc<AppState>,
    plan: Plan,
    receivers: Vec<mpsc::UnboundedReceiver<Update>>,
) -> Sse<impl Stream<Item = Result<SseEvent, std::convert::Infallible>>> {
    let updates = stream::select_all(
        receivers
            .into_iter()
            .enumerate()
            .map(|(i, rx)| UnboundedReceiverStream::new(rx).map(move |u| (i, u)).boxed()),
    );
    let prefix = if plan.kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let state = Streaming {
        id: format!("{prefix}-{}", app.next_id.fetch_add(1, Ordering::Relaxed)),
        created: now(),
        choices: (0..plan.n).map(|_| Choice::new(&plan.stop)).collect(),
        open: plan.n,
        _release: Release { app: app.clone(), n: plan.n },
        app,
        plan,
        updates,
        done: false,
        sent_prompt: false,
    };
    // The chat format opens every choice with its role.
    let mut state = state;
    let opening: Vec<Value> = if state.plan.kind == Kind::Chat {
        (0..state.plan.n)
            .map(|i| state.chunk(json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])))
            .collect()
    } else {
        Vec::new()
    };
    let body = stream::iter(opening.into_iter().map(|v| Ok(SseEvent::default().data(v.to_string())))).chain(
        stream::unfold(state, |mut s| async move {
            if s.done {
                return None;
            }
            let events = s.next_events().await;
            Some((stream::iter(events.into_iter().map(Ok)), s))
        })
        .flatten(),
    );
    Sse::new(body)
}

impl Streaming {
    fn chunk(&mut self, choices: Value) -> Value {
        let object = if self.plan.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.app.model_name, "choices": choices});
        if self.plan.return_token_ids && !self.sent_prompt {
            v["prompt_token_ids"] = json!(self.plan.prompt);
            self.sent_prompt = true;
        }
        v
    }

    fn choice_delta(
        &self,
        i: usize,
        text: String,
        tokens: &[u32],
        lps: &[f32],
        top: &[Vec<(u32, f32)>],
        finish: Option<&str>,
    ) -> Value {
        let logprobs = self
            .plan
            .logprobs
            .filter(|_| !tokens.is_empty())
            .map_or(Value::Null, |k| logprobs_json(&self.app, self.plan.kind, k, tokens, lps, top));
        let mut v = match self.plan.kind {
            Kind::Completion => {
                json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Chat => {
                let delta =
                    if text.is_empty() && finish.is_some() { json!({}) } else { json!({"content": text}) };
                json!({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        if self.plan.return_token_ids {
            v["token_ids"] = json!(tokens);
        }
        v
    }

    /// The SSE events for the next update (several at the end of the stream).
    async fn next_events(&mut self) -> Vec<SseEvent> {
        let data = |v: Value| SseEvent::default().data(v.to_string());
        let tok = self.app.tokenizer.clone();
        let Some((i, update)) = self.updates.next().await else {
            self.done = true;
            let err = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped");
            return vec![data(err.body()), SseEvent::default().data("[DONE]")];
        };
        let mut out = Vec::new();
        match update {
            Update::Token { token, logprob, top } => {
                let c = &mut self.choices[i];
                c.text.push(token);
                c.logprobs.push(logprob);
                c.top.push(top.clone());
                let text = tok.as_ref().map(|t| c.text.delta(t, false)).unwrap_or_default();
                let choice = self.choice_delta(i, text, &[token], &[logprob], &[top], None);
                out.push(data(self.chunk(json!([choice]))));
            }
            Update::Finished(reason) => {
                let c = &mut self.choices[i];
                c.finish = Some(reason);
                let text = tok.as_ref().map(|t| c.text.delta(t, true)).unwrap_or_default();
                let choice = self.choice_delta(i, text, &[], &[], &[], Some(finish_reason(reason)));
                out.push(data(self.chunk(json!([choice]))));
                self.open -= 1;
            }
            Update::Failed(msg) => {
                out.push(data(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg).body()));
                self.open = 0;
            }
        }
        if self.open == 0 {
            self.done = true;
            if self.plan.include_usage {
                let completion: usize = self.choices.iter().map(|c| c.text.tokens().len()).sum();
                let mut v = self.chunk(json!([]));
                v["usage"] = json!({"prompt_tokens": self.plan.prompt.len(), "completion_tokens": completion,
                                    "total_tokens": self.plan.prompt.len() + completion});
                out.push(data(v));
            }
            out.push(SseEvent::default().data("[DONE]"));
        }
        out
    }
}
