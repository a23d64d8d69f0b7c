//! The HTTP endpoints: requests become engine jobs (one per choice), updates become
//! OpenAI response bodies or SSE chunks.
//!
//! Contract: a request is vetted field by field ([`crate::api::audit`]), every cheap check
//! runs before its prompt is tokenized ([`prompt`], off the async workers), and a refusal
//! names the field to blame.

pub(crate) mod prompt;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mtp_engine::{Constraint, Request, SamplingParams};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use crate::api::{self, audit, ApiError, ChatRequest, Common, CompletionRequest};
use crate::body::LimitedBody;
use crate::chat::Conversation;
use crate::output::{collect, response_id, stream_response, stream_several};
use crate::reasoning::Reasoning;
use crate::request_log::RequestLog;
use crate::tools::{self, ToolChoice};
use crate::worker::{Job, Update};
use crate::AppState;
use prompt::Source;

pub(crate) type Shared = State<Arc<AppState>>;

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
    /// A completion's text and logprobs start with its prompt's.
    pub(crate) echo: bool,
    /// vLLM's `prompt_logprobs`: each prompt token's logprob with k alternatives.
    pub(crate) prompt_logprobs: Option<usize>,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) return_token_ids: bool,
    pub(crate) ignore_eos: bool,
    /// What `response_format` or the tools ask the output to be (none: free text).
    pub(crate) constraint: Option<Constraint>,
    /// Whether the output is parsed for tool calls (chat with tools and a choice other
    /// than `none`).
    pub(crate) tool_calls: bool,
    /// How a chat reply's reasoning is split from its content, and whether the prompt
    /// left the reasoning block open (the reply starts inside it).
    pub(crate) reasoning: Option<(Reasoning, bool)>,
}

/// Logprobs a request's scored prompts may report (a position's own and its
/// alternatives'): what bounds the memory and the body of an answer. lm-eval's requests
/// (`logprobs: 1`, 8 prompts of 2,048 tokens) take a quarter of it.
const MOST_SCORED_ENTRIES: usize = 1 << 17;

fn too_many_scores(entries: usize) -> ApiError {
    ApiError::bad(
        "prompt_logprobs",
        format!(
            "scoring these prompts reports {entries} logprobs (prompt tokens x choices x (1 + alternatives)); \
             a request may report at most {MOST_SCORED_ENTRIES}: send fewer or shorter prompts, or fewer alternatives"
        ),
    )
}

impl Plan {
    /// The logprobs its scored prompts report: each scoring choice's prompt tokens, each
    /// with its own logprob and its alternatives.
    fn scored_entries(&self) -> usize {
        (0..self.n)
            .filter_map(|i| self.scores(i))
            .map(|k| self.prompt.len().saturating_mul(k + 1))
            .fold(0, usize::saturating_add)
    }

    /// The prompt scoring choice `i` asks the engine for: every choice echoing logprobs
    /// and every choice of 0 tokens scores; `prompt_logprobs` (the same for every
    /// choice) is read from the first.
    pub(crate) fn scores(&self, i: usize) -> Option<usize> {
        let echoed = self.logprobs.filter(|_| self.echo);
        let reported = self.prompt_logprobs.filter(|_| i == 0);
        match (echoed, reported) {
            (None, None) if self.max_tokens == 0 => Some(0),
            (a, b) => a.max(b),
        }
    }
}

pub(crate) fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// An error answered in the shape of the API `path` belongs to: Anthropic's under
/// `/v1/messages`, OpenAI's elsewhere.
pub(crate) fn error_for(path: &str, e: &ApiError) -> Response {
    if path.starts_with("/v1/messages") {
        return crate::anthropic::error_response(e);
    }
    (e.status, Json(e.body())).into_response()
}

/// A path no endpoint serves: `404` with an error body (OpenAI's words), not an empty one.
pub async fn not_found(method: Method, uri: Uri) -> Response {
    let path = api::quote(uri.path());
    let e = ApiError::new(StatusCode::NOT_FOUND, format!("Invalid URL ({method} {path}): no endpoint here"));
    error_for(uri.path(), &e)
}

/// An endpoint asked with a method it does not take: `405` with an error body (the
/// router adds the `Allow` header).
pub async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let path = api::quote(uri.path());
    let e = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {path} (the Allow header lists the methods that are)"),
    );
    error_for(uri.path(), &e)
}

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn models(State(app): Shared) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_entry(&app)]}))
}

/// The served model as `/v1/models` lists it.
pub(crate) fn model_entry(app: &AppState) -> Value {
    json!({"id": app.model_name, "object": "model", "created": app.started, "owned_by": "mtp",
           "max_model_len": app.context})
}

pub async fn metrics(State(app): Shared) -> Response {
    let text = crate::metrics::render(&app);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

pub async fn completions(State(app): Shared, LimitedBody(body): LimitedBody) -> Response {
    answer(&app, Kind::Completion, body).await
}

pub async fn chat(State(app): Shared, LimitedBody(body): LimitedBody) -> Response {
    answer(&app, Kind::Chat, body).await
}

/// Answers a generation request; its access-log line is written when it ends.
async fn answer(app: &Arc<AppState>, kind: Kind, body: Bytes) -> Response {
    let mut log = RequestLog::new(response_id(app, kind), kind);
    match respond(app, kind, body, &mut log).await {
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

/// Bodies up to this size are parsed on the async worker (it takes microseconds).
pub(crate) const INLINE_PARSE_BYTES: usize = 64 << 10;

/// A request body parsed into JSON; a large one off the async workers, as its prompt will
/// be tokenized.
pub(crate) async fn parse(body: Bytes) -> Result<Value, ApiError> {
    if body.len() > INLINE_PARSE_BYTES {
        prompt::off_workers(move || api::parse_body(&body)).await
    } else {
        api::parse_body(&body)
    }
}

async fn respond(
    app: &Arc<AppState>,
    kind: Kind,
    body: Bytes,
    log: &mut RequestLog,
) -> Result<Response, ApiError> {
    app.requests.fetch_add(1, Ordering::Relaxed);
    let body = parse(body).await?;
    if kind == Kind::Completion {
        if let Some(prompts) = prompt_list(app, &body)? {
            let started = start_several(app, &body, prompts, log).await?;
            if body.get("stream") == Some(&json!(true)) {
                return Ok(stream_several(app.clone(), started, log.hand_off()).into_response());
            }
            return several(app, started, log).await.map(|v| Json(v).into_response());
        }
    }
    let (plan, receivers, slots) = start(app, kind, &body, log).await?;
    if plan.stream {
        Ok(stream_response(app.clone(), plan, receivers, slots, log.hand_off()).into_response())
    } else {
        collect(app, &plan, receivers, slots, log).await.map(|v| Json(v).into_response())
    }
}

/// Most prompts one completions request may list.
const MOST_PROMPTS: usize = 64;

/// A completions `prompt` that lists several prompts (strings, or lists of token ids), or
/// `None` for one prompt (a string, or one list of ids).
fn prompt_list(app: &AppState, body: &Value) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(Value::Array(items)) = body.get("prompt") else { return Ok(None) };
    if items.is_empty()
        || items.iter().all(Value::is_number)
        || !items.iter().all(|v| v.is_string() || v.is_array())
    {
        return Ok(None);
    }
    if items.len() > MOST_PROMPTS {
        return Err(ApiError::bad(
            "prompt",
            format!("at most {MOST_PROMPTS} prompts a request; got {}", items.len()),
        ));
    }
    // More choices than the server ever holds can never be admitted: retrying cannot help.
    let n = body.get("n").and_then(Value::as_u64).unwrap_or(1);
    let choices = n.saturating_mul(items.len() as u64);
    if choices > app.max_pending as u64 {
        return Err(ApiError::bad(
            "n",
            format!(
                "{} prompts of `n` {n} make {choices} choices; this server holds at most {} requests at once (--max-pending)",
                items.len(),
                app.max_pending
            ),
        ));
    }
    Ok(Some(items.clone()))
}

/// A completions request's several prompts, each submitted (so they run together); a
/// prompt's refusal names `prompt[i]`.
async fn start_several(
    app: &Arc<AppState>,
    body: &Value,
    prompts: Vec<Value>,
    log: &mut RequestLog,
) -> Result<Vec<Started>, ApiError> {
    let mut started = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.into_iter().enumerate() {
        let mut one = body.clone();
        one["prompt"] = p;
        let at = |mut e: ApiError| {
            if let Some(param) = e.param.as_mut().filter(|p| p.starts_with("prompt")) {
                *param = format!("prompt[{i}]{}", &param["prompt".len()..]);
                e.message = e.message.replace("prompt[", &format!("prompt[{i}]["));
            }
            e
        };
        started.push(start(app, Kind::Completion, &one, log).await.map_err(at)?);
        let entries = started.iter().map(|(p, ..)| p.scored_entries()).fold(0, usize::saturating_add);
        if entries > MOST_SCORED_ENTRIES {
            return Err(too_many_scores(entries));
        }
    }
    Ok(started)
}

/// Several prompts answered as OpenAI does: prompt `i`'s choice `j` at index `i * n + j`,
/// usage summed, and `prompt_token_ids` (when asked) one list a prompt.
async fn several(
    app: &Arc<AppState>,
    started: Vec<Started>,
    log: &mut RequestLog,
) -> Result<Value, ApiError> {
    let mut out: Option<Value> = None;
    let mut prompt_ids = Vec::new();
    for (i, (plan, receivers, slots)) in started.into_iter().enumerate() {
        let mut v = collect(app, &plan, receivers, slots, log).await?;
        for c in v["choices"].as_array_mut().into_iter().flatten() {
            c["index"] = json!(i * plan.n + c["index"].as_u64().unwrap_or(0) as usize);
        }
        prompt_ids.push(v.as_object_mut().and_then(|m| m.remove("prompt_token_ids")));
        match out.as_mut() {
            None => out = Some(v),
            Some(all) => {
                let more = v["choices"].as_array().cloned().unwrap_or_default();
                if let Some(c) = all["choices"].as_array_mut() {
                    c.extend(more);
                }
                for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
                    let sum = all["usage"][key].as_u64().unwrap_or(0) + v["usage"][key].as_u64().unwrap_or(0);
                    all["usage"][key] = json!(sum);
                }
            }
        }
    }
    let mut out = out.unwrap_or_else(|| json!({}));
    if prompt_ids.iter().all(Option::is_some) && !prompt_ids.is_empty() {
        out["prompt_token_ids"] = json!(prompt_ids);
    }
    Ok(out)
}

/// A running request: its plan, each choice's updates, its share of `--max-pending`.
pub(crate) type Started = (Plan, Vec<mpsc::UnboundedReceiver<Update>>, PendingSlots);

/// Vets a completions or chat body, tokenizes its prompt and hands it to the engine (the
/// path every generation endpoint takes; `/v1/responses` sends a chat body).
pub(crate) async fn start(
    app: &Arc<AppState>,
    kind: Kind,
    body: &Value,
    log: &mut RequestLog,
) -> Result<Started, ApiError> {
    match kind {
        Kind::Completion => audit::check_completion(body)?,
        Kind::Chat => audit::check_chat(body)?,
    }
    let common: Common = api::fields(body)?;
    let sourced = match kind {
        Kind::Completion => completion_source(app, api::fields(body)?)?,
        Kind::Chat => chat_source(app, api::fields(body)?)?,
    };
    run(app, kind, common, sourced, log).await
}

/// A vetted request's jobs on the engine, from its shared fields and its prompt: planned
/// (everything cheap checked before the prompt is tokenized), tokenized, fitted to the
/// context and submitted. `/v1/messages` ([`crate::anthropic`]) converts its body into
/// these and comes in here too.
pub(crate) async fn run(
    app: &Arc<AppState>,
    kind: Kind,
    common: Common,
    sourced: Sourced,
    log: &mut RequestLog,
) -> Result<Started, ApiError> {
    log.set_stream(common.stream == Some(true));
    let Sourced { source, max_completion_tokens, logprobs, tool_grammar, echo } = sourced;
    // Everything cheap is checked before the prompt is tokenized.
    let (mut plan, asked) = plan(app, kind, common, max_completion_tokens, logprobs, tool_grammar)?;
    plan.echo = echo;
    let param = if kind == Kind::Chat { "messages" } else { "prompt" };
    let prompt = prompt::tokenize(app, source, param).await?;
    fit(app, &mut plan, prompt, asked)?;
    if plan.scored_entries() > MOST_SCORED_ENTRIES {
        return Err(too_many_scores(plan.scored_entries()));
    }
    log.planned(plan.prompt.len(), plan.n);
    if let (Kind::Chat, Some(r), Some(tok)) = (kind, app.reasoning, &app.tokenizer) {
        // The prompt's end tells whether the template opened the reasoning block.
        let tail = &plan.prompt[plan.prompt.len().saturating_sub(32)..];
        let text = tok.decode_keeping(tail, &app.markers).unwrap_or_default();
        plan.reasoning = Some((r, r.opened_by(&text)));
    }
    let (receivers, slots) = submit(app, &plan).await?;
    Ok((plan, receivers, slots))
}

/// A completion's prompt, max_completion_tokens (none) and logprobs.
fn completion_source(app: &AppState, r: CompletionRequest) -> Result<Sourced, ApiError> {
    let source = match r.prompt {
        Value::String(t) => Source::Text(t),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            Source::Ids(token_ids(app, &items, "prompt")?)
        }
        Value::Array(items) => {
            let i = items.iter().position(|v| !v.is_number()).unwrap_or(0);
            return Err(ApiError::bad(
                "prompt",
                format!("a list of token ids holds only integers; prompt[{i}] is not one"),
            ));
        }
        Value::Null => return Err(ApiError::bad("prompt", "missing field `prompt`")),
        _ => return Err(ApiError::bad("prompt", "`prompt` must be a string or a list of token ids")),
    };
    let logprobs = match r.logprobs {
        None => None,
        Some(k) if k <= 20 => Some(k as usize),
        Some(_) => return Err(ApiError::bad("logprobs", "`logprobs` must be between 0 and 20")),
    };
    let echo = r.echo.unwrap_or(false);
    Ok(Sourced { source, max_completion_tokens: None, logprobs, tool_grammar: None, echo })
}

/// A request's prompt and the fields its endpoint alone reads.
pub(crate) struct Sourced {
    pub(crate) source: Source,
    pub(crate) max_completion_tokens: Option<u64>,
    /// `None`: no logprobs; `Some(k)`: logprobs with k alternatives.
    pub(crate) logprobs: Option<usize>,
    /// The grammar a chat's tool calls are generated under (none without tools or with
    /// `tool_choice: none`).
    pub(crate) tool_grammar: Option<String>,
    /// A completion's `echo`.
    pub(crate) echo: bool,
}

/// Token ids from JSON numbers: integers in `0..vocab`, else a refusal naming `param` and
/// the index.
pub(crate) fn token_ids(app: &AppState, items: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64().filter(|&t| t < app.vocab as u64).map(|t| t as u32).ok_or_else(|| {
                ApiError::bad(
                    param,
                    format!(
                        "token ids must be integers between 0 and {} (the vocabulary's last id); {param}[{i}] is {}",
                        app.vocab.saturating_sub(1),
                        api::quote(&v.to_string())
                    ),
                )
            })
        })
        .collect()
}

/// Every `tool` message answers a call an earlier assistant message made (by its
/// `tool_call_id` where both carry ids), as OpenAI requires: a result of no call is
/// refused naming the message.
fn answered_calls(messages: &[api::Message]) -> Result<(), ApiError> {
    let mut ids: Vec<&str> = Vec::new();
    let mut any_call = false;
    for (i, m) in messages.iter().enumerate() {
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| m.role == "assistant" && !c.is_empty()) {
            any_call = true;
            ids.extend(calls.iter().filter_map(|c| c.get("id")?.as_str()));
        }
        if m.role != "tool" {
            continue;
        }
        if !any_call {
            return Err(ApiError::bad(
                &format!("messages[{i}].role"),
                "a `tool` message must answer a tool call of an earlier assistant message; none came before it",
            ));
        }
        if let Some(id) = m.tool_call_id.as_deref().filter(|_| !ids.is_empty()) {
            if !ids.contains(&id) {
                return Err(ApiError::bad(
                    &format!("messages[{i}].tool_call_id"),
                    format!("`{}` is the id of no earlier tool call", api::quote(id)),
                ));
            }
        }
    }
    Ok(())
}

/// A chat's messages and tools, max_completion_tokens and logprobs.
pub(crate) fn chat_source(app: &AppState, r: ChatRequest) -> Result<Sourced, ApiError> {
    if r.messages.is_empty() {
        return Err(ApiError::bad("messages", "`messages` is empty"));
    }
    let messages = r.messages.iter().enumerate().map(|(i, m)| m.read(i)).collect::<Result<Vec<_>, _>>()?;
    answered_calls(&r.messages)?;
    let kwargs =
        Conversation::kwargs(r.chat_template_kwargs.as_ref()).map_err(|(at, why)| ApiError::bad(&at, why))?;
    let logprobs = match (r.logprobs.unwrap_or(false), r.top_logprobs) {
        (_, Some(k)) if k > 20 => {
            return Err(ApiError::bad("top_logprobs", "`top_logprobs` must be between 0 and 20"))
        }
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::bad("top_logprobs", "`top_logprobs` needs `logprobs: true`"))
        }
        (true, k) => Some(k.unwrap_or(0) as usize),
        (false, _) => None,
    };
    let tools = match &r.tools {
        None => Vec::new(),
        Some(v) => tools::read_tools(v)?,
    };
    let choice = tools::read_choice(r.tool_choice.as_ref(), &tools)?;
    let grammar = match (&choice, &app.tool_syntax) {
        (ToolChoice::None, _) => None,
        _ if tools.is_empty() => None,
        (_, None) => {
            return Err(ApiError::bad(
                "tools",
                "this model's chat template writes no tool calls this server can read; start it with \
                 --tool-parser (hermes, llama3-json, gemma4) to name the syntax, or send tool_choice none",
            ))
        }
        (choice, Some(syntax)) => {
            let tok = app.tokenizer.as_ref();
            let lit = |text: &str| match tok.and_then(|t| tools::special_id(t, text)) {
                Some(id) => format!("<[{id}]>"),
                None => tools::quoted(text),
            };
            let parallel = r.parallel_tool_calls.unwrap_or(true);
            Some(syntax.grammar(&tools, choice, parallel, &lit).map_err(|e| ApiError::bad("tools", e))?)
        }
    };
    let raw_tools = match r.tools {
        Some(Value::Array(list)) => list,
        _ => Vec::new(),
    };
    Ok(Sourced {
        source: Source::Chat(Conversation { messages, tools: raw_tools, kwargs }),
        max_completion_tokens: r.max_completion_tokens,
        logprobs,
        tool_grammar: grammar,
        echo: false,
    })
}

/// The output length asked for (none: the endpoint's default).
type Asked = Option<u64>;

/// The plan of a request, all but its prompt and output length ([`fit`] sets them).
fn plan(
    app: &AppState,
    kind: Kind,
    c: Common,
    max_completion_tokens: Option<u64>,
    logprobs: Option<usize>,
    tool_grammar: Option<String>,
) -> Result<(Plan, Asked), ApiError> {
    if let Some(m) = &c.model {
        if *m != app.model_name {
            return Err(ApiError::unknown_model(&app.model_name, m));
        }
    }
    let n = c.n.unwrap_or(1);
    if !(1..=16).contains(&n) {
        return Err(ApiError::bad("n", "`n` must be between 1 and 16"));
    }
    // More choices than the server ever holds can never be admitted: retrying cannot help.
    if n > app.max_pending as u64 {
        return Err(ApiError::bad(
            "n",
            format!(
                "`n` is {n}; this server holds at most {} requests at once (--max-pending)",
                app.max_pending
            ),
        ));
    }
    // A completion of 0 tokens scores (or echoes) its prompt, as OpenAI's legacy API did.
    for (name, m) in [("max_tokens", c.max_tokens), ("max_completion_tokens", max_completion_tokens)] {
        if m == Some(0) && kind == Kind::Chat {
            return Err(ApiError::bad(name, format!("`{name}` must be at least 1")));
        }
    }
    let prompt_logprobs = match c.prompt_logprobs {
        None => None,
        Some(k @ 0..=20) => Some(k as usize),
        Some(_) => {
            return Err(ApiError::bad("prompt_logprobs", "`prompt_logprobs` must be between 0 and 20"))
        }
    };
    // Chat's newer name wins over the older one.
    let asked = max_completion_tokens.or(c.max_tokens);
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(_) => return Err(ApiError::bad("top_k", "`top_k` must be positive (or -1 / 0: off)")),
    };
    // No seed: a fresh one per request, as OpenAI's API samples; a given seed reproduces.
    let seed = c.seed.unwrap_or_else(|| app.fresh_seed());
    let sampling = SamplingParams {
        temperature: c.temperature.unwrap_or(1.0),
        top_k,
        top_p: c.top_p.unwrap_or(1.0),
        min_p: c.min_p.unwrap_or(0.0),
        seed,
    };
    sampling.validate().map_err(|e| ApiError::bad(e.param, e.message))?;
    let stop = c.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > 16 || stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad(
            "stop",
            format!("`stop` takes up to 16 non-empty strings of at most {MAX_STOP_BYTES} bytes"),
        ));
    }
    if !stop.is_empty() && app.tokenizer.is_none() {
        return Err(ApiError::bad("stop", "`stop` needs a tokenizer and the target has no tokenizer.json"));
    }
    let plan = Plan {
        kind,
        prompt: Vec::new(),
        n: n as usize,
        max_tokens: 0,
        sampling,
        stop,
        logprobs,
        echo: false,
        prompt_logprobs,
        stream: c.stream.unwrap_or(false),
        include_usage: c.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
        return_token_ids: c.return_token_ids.unwrap_or(false),
        ignore_eos: c.ignore_eos.unwrap_or(false),
        constraint: c.response_format.as_ref().map(response_format).transpose()?.flatten(),
        tool_calls: false,
        reasoning: None,
    };
    let mut plan = plan;
    if let Some(g) = tool_grammar {
        if plan.constraint.is_some() {
            return Err(ApiError::bad(
                "response_format",
                "`response_format` cannot constrain a reply that may be tool calls; send tool_choice none",
            ));
        }
        plan.constraint = Some(Constraint::Lark(g));
        plan.tool_calls = true;
    }
    Ok((plan, asked))
}

/// The constraint `response_format` asks for: none for `text`, any JSON object for
/// `json_object`, a document valid under `json_schema.schema` (of known keywords:
/// [`mtp_engine::check_schema_keywords`]) for `json_schema`, with its objects closed
/// ([`mtp_engine::closed_schema`]; OpenAI's `strict: true` schemas are closed already). TGI's form, as huggingface_hub sends it, `{"type": "json_object" | "json",
/// "value": schema}`, is the same as `json_schema` with that schema. Its keys were vetted
/// by [`crate::api::audit`].
fn response_format(v: &Value) -> Result<Option<Constraint>, ApiError> {
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::bad(
            "response_format.type",
            "`response_format.type` must be text, json_object or json_schema",
        )
    })?;
    let schema = |s: Option<&Value>, at: &str| match s {
        Some(schema) if schema.is_object() || schema.is_boolean() => {
            mtp_engine::check_schema_keywords(schema)
                .map_err(|(k, e)| ApiError::bad(&format!("{at}.{k}"), e))?;
            mtp_engine::check_finite_schema(schema).map_err(|e| ApiError::bad(at, e))?;
            Ok(Some(Constraint::JsonSchema(mtp_engine::closed_schema(schema))))
        }
        _ => Err(ApiError::bad(at, format!("`{at}` must be a JSON Schema (an object or a boolean)"))),
    };
    let value = v.get("value").filter(|s| !s.is_null());
    match kind {
        "text" => Ok(None),
        "json_object" | "json" if value.is_some() => schema(value, "response_format.value"),
        "json_object" => Ok(Some(Constraint::JsonObject)),
        "json_schema" => match v.get("json_schema").and_then(|j| j.get("schema")) {
            None | Some(Value::Null) => Err(ApiError::bad(
                "response_format.json_schema.schema",
                "`response_format` of type json_schema needs `json_schema.schema`, a JSON Schema object",
            )),
            s => schema(s, "response_format.json_schema.schema"),
        },
        other => Err(ApiError::bad(
            "response_format",
            format!(
                "`response_format.type` {:?} is not one of text, json_object, json_schema",
                api::quote(other)
            ),
        )),
    }
}

/// A stop string's longest length: the engine decodes that many tokens back at every step.
const MAX_STOP_BYTES: usize = 1024;

/// Sets the plan's prompt and output length: the prompt must be non-empty and fit the
/// context; the output is cut to the room the context leaves.
fn fit(app: &AppState, plan: &mut Plan, prompt: Vec<u32>, asked: Asked) -> Result<(), ApiError> {
    let param = if plan.kind == Kind::Chat { "messages" } else { "prompt" };
    if prompt.is_empty() {
        return Err(ApiError::bad(param, "the prompt is empty"));
    }
    if let Some(t) = prompt.iter().find(|&&t| t as usize >= app.vocab) {
        // Only a tokenizer larger than the model's vocabulary gets here.
        return Err(ApiError::bad(param, format!("token id {t} is outside the vocabulary of {}", app.vocab)));
    }
    if prompt.len() > app.context {
        return Err(ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "the prompt has {} tokens; the model's context is {}",
                prompt.len(),
                app.context
            ),
            param: Some(param.into()),
        });
    }
    let room = app.context - prompt.len() + 1;
    plan.max_tokens = match (asked, plan.kind) {
        (Some(m), _) => usize::try_from(m).unwrap_or(usize::MAX).min(room),
        (None, Kind::Completion) => 16.min(room),
        (None, Kind::Chat) => room,
    };
    plan.prompt = prompt;
    Ok(())
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
            prompt_logprobs: plan.scores(i),
            constraint: plan.constraint.clone(),
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
            // The engine compiles the constraint: its refusals are the response format's.
            Ok(Err(msg)) if plan.constraint.as_ref().is_some_and(|c| msg.contains(c.kind())) => {
                let param = if plan.tool_calls { "tools" } else { "response_format" };
                return Err(ApiError::bad(param, msg));
            }
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
