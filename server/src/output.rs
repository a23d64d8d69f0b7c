//! Engine updates into OpenAI bodies: a whole response, or SSE chunks as tokens arrive.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use mtp_engine::{FinishReason, PromptToken};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::api::ApiError;
use crate::reasoning::ReasoningStream;
use crate::request_log::RequestLog;
use crate::routes::{now, Kind, PendingSlots, Plan};
use crate::text::TextState;
use crate::tools::{self, stream::CallStream};
use crate::worker::Update;
use crate::AppState;

/// The finish reason a client sees: a reply that made calls ends with `tool_calls`.
pub(crate) fn finish_reason(r: FinishReason, made_calls: bool) -> &'static str {
    match r {
        FinishReason::Eos | FinishReason::Stop | FinishReason::Grammar if made_calls => "tool_calls",
        FinishReason::Eos | FinishReason::Stop | FinishReason::Grammar => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
    }
}

/// One choice's output so far.
struct Choice {
    text: TextState,
    logprobs: Vec<f32>,
    top: Vec<Vec<(u32, f32)>>,
    /// The prompt's scores, when the choice asked for them.
    prompt: Vec<PromptToken>,
    finish: Option<FinishReason>,
}

impl Choice {
    fn new(stop: &[String], keep: Vec<u32>) -> Choice {
        Choice {
            text: TextState::new(stop.to_vec()).keeping(keep),
            logprobs: Vec::new(),
            top: Vec::new(),
            prompt: Vec::new(),
            finish: None,
        }
    }
}

/// The prompt as an echoed completion starts with it.
fn prompt_text(app: &AppState, plan: &Plan) -> String {
    app.tokenizer.as_ref().and_then(|t| t.decode(&plan.prompt).ok()).unwrap_or_default()
}

/// vLLM's `prompt_logprobs`: null for the first token, then per token a map from token id
/// to `{logprob, rank, decoded_token}` holding the token and its `k` most likely
/// alternatives.
fn prompt_logprobs_json(app: &AppState, k: usize, scores: &[PromptToken]) -> Value {
    let entry = |id: u32, logprob: f32, rank: u32| json!({"logprob": logprob, "rank": rank, "decoded_token": token_text(app, id)});
    let per_token = scores.iter().map(|s| {
        let mut m = Map::new();
        m.insert(s.token.to_string(), entry(s.token, s.logprob, s.rank));
        for (r, &(id, lp)) in s.top.iter().take(k).enumerate() {
            m.insert(id.to_string(), entry(id, lp, r as u32 + 1));
        }
        Value::Object(m)
    });
    Value::Array(std::iter::once(Value::Null).chain(per_token).collect())
}

/// An echoing completion's logprobs before its own: the prompt's tokens, the first with
/// null (nothing came before it).
pub(crate) struct Echoed<'a> {
    tokens: &'a [u32],
    scores: &'a [PromptToken],
}

/// The special tokens a plan's parsers must see as text.
pub(crate) fn kept(app: &AppState, plan: &Plan) -> Vec<u32> {
    if plan.tool_calls || plan.reasoning.is_some() {
        app.markers.clone()
    } else {
        Vec::new()
    }
}

/// A tool call's id: unique in this server's life (a conversation matches results to
/// calls by it), not part of what the model generated.
pub(crate) fn call_id(app: &AppState) -> String {
    format!("call_{}", app.next_id.fetch_add(1, Ordering::Relaxed))
}

/// A finished chat reply: its message and whether it made calls.
fn chat_message(app: &AppState, plan: &Plan, text: String) -> (Value, bool) {
    let (reasoning, text) = match plan.reasoning {
        Some((r, opened)) => r.split_reply(&text, opened),
        None => (None, text),
    };
    let syntax = app.tool_syntax.as_deref().filter(|_| plan.tool_calls);
    let parsed = match syntax {
        Some(s) => tools::parse(s, &text),
        None => tools::Parsed { content: text, calls: Vec::new() },
    };
    let mut message = json!({"role": "assistant", "content": parsed.content});
    if let Some(r) = reasoning {
        message["reasoning_content"] = json!(r);
    }
    if parsed.calls.is_empty() {
        return (message, false);
    }
    if parsed.content.is_empty() {
        message["content"] = Value::Null;
    }
    let calls: Vec<Value> = parsed
        .calls
        .iter()
        .map(|c| json!({"id": call_id(app), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect();
    message["tool_calls"] = Value::Array(calls);
    (message, true)
}

/// A token as text (special tokens decode to nothing).
fn token_text(app: &AppState, t: u32) -> String {
    app.tokenizer.as_ref().and_then(|tok| tok.decode(&[t]).ok()).unwrap_or_default()
}

/// The logprobs object for tokens `tokens` with their logprobs and alternatives.
pub(crate) fn logprobs_json(
    app: &AppState,
    kind: Kind,
    k: usize,
    echoed: Option<Echoed>,
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
            let e = echoed.unwrap_or(Echoed { tokens: &[], scores: &[] });
            let strings: Vec<String> = e.tokens.iter().chain(tokens).map(|&t| token_text(app, t)).collect();
            let mut offset = 0;
            let offsets: Vec<usize> = strings
                .iter()
                .map(|s| {
                    let o = offset;
                    offset += s.len();
                    o
                })
                .collect();
            let first = e.tokens.first().map(|_| Value::Null);
            let lps: Vec<Value> = first
                .clone()
                .into_iter()
                .chain(e.scores.iter().map(|s| json!(s.logprob)))
                .chain(lps.iter().map(|&l| json!(l)))
                .collect();
            let alts = |alts: &[(u32, f32)]| {
                let m: Map<String, Value> =
                    alts.iter().take(k).map(|&(a, alp)| (token_text(app, a), json!(alp))).collect();
                Value::Object(m)
            };
            let top: Value = if k == 0 {
                Value::Null
            } else {
                first
                    .into_iter()
                    .chain(e.scores.iter().map(|s| alts(&s.top)))
                    .chain(top.iter().map(|t| alts(t)))
                    .collect()
            };
            json!({"tokens": strings, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets})
        }
    }
}

pub(crate) async fn collect(
    app: &Arc<AppState>,
    plan: &Plan,
    receivers: Vec<mpsc::UnboundedReceiver<Update>>,
    _slots: PendingSlots,
    log: &mut RequestLog,
) -> Result<Value, ApiError> {
    let mut choices = Vec::with_capacity(plan.n);
    for mut rx in receivers {
        let mut c = Choice::new(&plan.stop, kept(app, plan));
        while let Some(u) = rx.recv().await {
            match u {
                Update::Prompt(scores) => c.prompt = scores,
                Update::Verified { .. } => {}
                Update::Token { token, logprob, top } => {
                    log.token();
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
    let echo = plan.echo.then(|| prompt_text(app, plan));
    let reported = |c: &Choice| plan.prompt_logprobs.map(|k| prompt_logprobs_json(app, k, &c.prompt));
    let body: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut text = tok.as_ref().map(|t| c.text.final_text(t)).unwrap_or_default();
            if let Some(e) = &echo {
                text.insert_str(0, e);
            }
            let logprobs = plan.logprobs.map_or(Value::Null, |k| {
                let echoed = plan.echo.then_some(Echoed { tokens: &plan.prompt, scores: &c.prompt });
                logprobs_json(app, plan.kind, k, echoed, c.text.tokens(), &c.logprobs, &c.top)
            });
            let (mut v, made_calls) = match plan.kind {
                Kind::Completion => {
                    let mut v = json!({"index": i, "text": text, "logprobs": logprobs});
                    if let Some(p) = choices.first().and_then(reported) {
                        v["prompt_logprobs"] = p;
                    }
                    (v, false)
                }
                Kind::Chat => {
                    let (message, calls) = chat_message(app, plan, text);
                    (json!({"index": i, "message": message, "logprobs": logprobs}), calls)
                }
            };
            let finish = c.finish.map_or("-", |r| finish_reason(r, made_calls));
            log.finished(i, finish);
            v["finish_reason"] = json!(finish);
            if plan.return_token_ids {
                v["token_ids"] = json!(c.text.tokens());
            }
            v
        })
        .collect();
    let object = if plan.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
    let mut out = json!({
        "id": log.id(), "object": object, "created": now(), "model": app.model_name, "choices": body,
        "usage": {"prompt_tokens": plan.prompt.len(), "completion_tokens": completion_tokens,
                  "total_tokens": plan.prompt.len() + completion_tokens},
    });
    if plan.return_token_ids {
        out["prompt_token_ids"] = json!(plan.prompt);
    }
    if let (Kind::Chat, Some(p)) = (plan.kind, choices.first().and_then(reported)) {
        out["prompt_logprobs"] = p;
    }
    Ok(out)
}

/// A fresh response id in OpenAI's style (`cmpl-N`, `chatcmpl-N`).
pub(crate) fn response_id(app: &AppState, kind: Kind) -> String {
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    format!("{prefix}-{}", app.next_id.fetch_add(1, Ordering::Relaxed))
}

/// A choice's new output for one chunk.
#[derive(Default)]
pub(crate) struct Delta {
    pub(crate) reasoning: String,
    pub(crate) text: String,
    /// In the chat stream's wire format ([`CallStream`]).
    pub(crate) calls: Vec<Value>,
}

/// A choice's new reasoning, content and tool-call deltas, from its text so far, its
/// reasoning split (with the content it has handed out) and its calls: the chat stream's
/// per choice, the Responses stream's for its one.
pub(crate) fn deltas(
    app: &Arc<AppState>,
    plan: &Plan,
    text: &mut TextState,
    (stream, content): &mut (Option<ReasoningStream>, String),
    calls: &mut CallStream,
    finished: bool,
) -> Delta {
    let Some(tok) = app.tokenizer.clone() else { return Default::default() };
    let syntax = app.tool_syntax.as_deref().filter(|_| plan.tool_calls);
    if syntax.is_none() && stream.is_none() {
        return Delta { text: text.delta(&tok, finished), ..Delta::default() };
    }
    let (text, safe) = text.visible(&tok, finished);
    let (reasoning, new) = match stream {
        Some(s) => s.push(&text[..safe], finished),
        None => {
            // No reasoning: the content is the text so far.
            content.clear();
            (String::new(), text[..safe].to_string())
        }
    };
    content.push_str(&new);
    let Some(syntax) = syntax else { return Delta { reasoning, text: new, calls: Vec::new() } };
    let (text, calls) = calls.push(syntax, content, finished, &mut || call_id(app));
    Delta { reasoning, text, calls }
}

/// What the SSE stream holds between chunks.
struct Streaming {
    app: Arc<AppState>,
    plan: Plan,
    updates: stream::SelectAll<stream::BoxStream<'static, (usize, Update)>>,
    /// Each choice's text so far (a stream sends logprobs with their token, keeps none).
    texts: Vec<TextState>,
    /// Each choice's tool calls so far (when the plan parses them).
    calls: Vec<CallStream>,
    /// Each choice's reasoning split and the content it has handed out (when the plan
    /// splits reasoning).
    reasoning: Vec<(Option<ReasoningStream>, String)>,
    open: usize,
    id: String,
    created: u64,
    done: bool,
    /// Whether a chunk has carried `prompt_token_ids` (asked with `return_token_ids`).
    sent_prompt: bool,
    /// Written when the stream ends or its client goes away.
    log: RequestLog,
    _slots: PendingSlots,
}

pub(crate) fn stream_response(
    app: Arc<AppState>,
    plan: Plan,
    receivers: Vec<mpsc::UnboundedReceiver<Update>>,
    slots: PendingSlots,
    log: RequestLog,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let data = |v: Value| Ok(SseEvent::default().data(v.to_string()));
    let done = stream::once(async { Ok(SseEvent::default().data("[DONE]")) });
    Sse::new(chunks(app, plan, receivers, slots, log).map(data).chain(done))
}

/// Several prompts of one completions request streamed together: each prompt's chunks as
/// they come, prompt `i`'s choice `j` renumbered `i * n + j`, every chunk under the first
/// prompt's id, and (with `include_usage`) one usage chunk at the end, summed.
pub(crate) fn stream_several(
    app: Arc<AppState>,
    started: Vec<crate::routes::Started>,
    mut log: RequestLog,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let id = log.id().to_string();
    let include_usage = started.first().is_some_and(|(p, ..)| p.include_usage);
    let usage = Arc::new(std::sync::Mutex::new([0u64; 3]));
    let merged = stream::select_all(started.into_iter().enumerate().map(|(i, (plan, receivers, slots))| {
        let n = plan.n;
        // The access-log line is the first prompt's.
        let log = if i == 0 { log.hand_off() } else { RequestLog::none() };
        chunks(app.clone(), plan, receivers, slots, log).map(move |v| (i * n, v)).boxed()
    }));
    let (id_all, sums) = (id.clone(), usage.clone());
    let renumbered = merged.filter_map(move |(first, mut v)| {
        let kept = if let Some(u) = v.get("usage").filter(|_| v["choices"] == json!([])) {
            let mut s = sums.lock().unwrap_or_else(|p| p.into_inner());
            for (k, key) in ["prompt_tokens", "completion_tokens", "total_tokens"].iter().enumerate() {
                s[k] = s[k].saturating_add(u[key].as_u64().unwrap_or(0));
            }
            None
        } else {
            if v.get("choices").is_some() {
                v["id"] = json!(id_all);
            }
            for c in v["choices"].as_array_mut().into_iter().flatten() {
                c["index"] = json!(first + c["index"].as_u64().unwrap_or(0) as usize);
            }
            Some(v)
        };
        std::future::ready(kept)
    });
    let model = app.model_name.clone();
    let last = stream::once(async move {
        let s = *usage.lock().unwrap_or_else(|p| p.into_inner());
        include_usage.then(|| {
            json!({"id": id, "object": "text_completion", "created": now(), "model": model, "choices": [],
                   "usage": {"prompt_tokens": s[0], "completion_tokens": s[1], "total_tokens": s[2]}})
        })
    })
    .filter_map(std::future::ready);
    let data = |v: Value| Ok(SseEvent::default().data(v.to_string()));
    let done = stream::once(async { Ok(SseEvent::default().data("[DONE]")) });
    Sse::new(renumbered.chain(last).map(data).chain(done))
}

/// A chat or completion stream's chunks as JSON, in order (an error body, `{"error":
/// ...}`, ends it if the engine fails): what [`stream_response`] sends as SSE data before
/// `[DONE]`, and what `/v1/messages` ([`crate::anthropic`]) re-encodes as its events.
pub(crate) fn chunks(
    app: Arc<AppState>,
    plan: Plan,
    receivers: Vec<mpsc::UnboundedReceiver<Update>>,
    slots: PendingSlots,
    mut log: RequestLog,
) -> impl Stream<Item = Value> {
    let updates = stream::select_all(
        receivers
            .into_iter()
            .enumerate()
            .map(|(i, rx)| UnboundedReceiverStream::new(rx).map(move |u| (i, u)).boxed()),
    );
    log.started_stream();
    let mut state = Streaming {
        id: log.id().to_string(),
        log,
        created: now(),
        texts: (0..plan.n).map(|_| TextState::new(plan.stop.clone()).keeping(kept(&app, &plan))).collect(),
        calls: (0..plan.n).map(|_| CallStream::default()).collect(),
        reasoning: (0..plan.n)
            .map(|_| {
                (plan.reasoning.map(|(r, opened)| ReasoningStream::new(r).opened(opened)), String::new())
            })
            .collect(),
        open: plan.n,
        _slots: slots,
        app,
        plan,
        updates,
        done: false,
        sent_prompt: false,
    };
    // The chat format opens every choice with its role; an echoing completion's choice
    // opens with its prompt (with the prompt's scores, when it asked for them).
    let opening: Vec<Value> = if state.plan.kind == Kind::Chat {
        (0..state.plan.n)
            .map(|i| state.chunk(json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}])))
            .collect()
    } else if state.plan.echo {
        let text = prompt_text(&state.app, &state.plan);
        let unscored: Vec<usize> = (0..state.plan.n).filter(|&i| state.plan.scores(i).is_none()).collect();
        unscored
            .into_iter()
            .map(|i| {
                state.chunk(json!([{"index": i, "text": text, "logprobs": null, "finish_reason": null}]))
            })
            .collect()
    } else {
        Vec::new()
    };
    stream::iter(opening).chain(
        stream::unfold(state, |mut s| async move {
            if s.done {
                return None;
            }
            let events = s.next_events().await;
            Some((stream::iter(events), s))
        })
        .flatten(),
    )
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
        d: Delta,
        tokens: &[u32],
        lps: &[f32],
        top: &[Vec<(u32, f32)>],
        finish: Option<&str>,
    ) -> Value {
        let logprobs = self
            .plan
            .logprobs
            .filter(|_| !tokens.is_empty())
            .map_or(Value::Null, |k| logprobs_json(&self.app, self.plan.kind, k, None, tokens, lps, top));
        let mut v = match self.plan.kind {
            Kind::Completion => {
                json!({"index": i, "text": d.text, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Chat => {
                let mut delta = json!({});
                if !d.reasoning.is_empty() {
                    delta["reasoning_content"] = json!(d.reasoning);
                }
                if !d.text.is_empty() || (finish.is_none() && d.calls.is_empty()) {
                    delta["content"] = json!(d.text);
                }
                if !d.calls.is_empty() {
                    delta["tool_calls"] = Value::Array(d.calls);
                }
                json!({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        if self.plan.return_token_ids {
            v["token_ids"] = json!(tokens);
        }
        v
    }

    /// The chunk choice `i`'s prompt scores make, if any: an echoing completion's prompt
    /// and its logprobs, and `prompt_logprobs` (on the choice, or the chat chunk's top).
    fn prompt_chunk(&mut self, i: usize, scores: &[PromptToken]) -> Option<Value> {
        let reported = self.plan.prompt_logprobs.filter(|_| i == 0);
        let reported = reported.map(|k| prompt_logprobs_json(&self.app, k, scores));
        if self.plan.kind == Kind::Chat {
            let mut v = self.chunk(json!([]));
            v["prompt_logprobs"] = reported?;
            return Some(v);
        }
        if !self.plan.echo && reported.is_none() {
            return None;
        }
        let text = if self.plan.echo { prompt_text(&self.app, &self.plan) } else { String::new() };
        let logprobs = self.plan.logprobs.filter(|_| self.plan.echo).map_or(Value::Null, |k| {
            let echoed = Echoed { tokens: &self.plan.prompt, scores };
            logprobs_json(&self.app, Kind::Completion, k, Some(echoed), &[], &[], &[])
        });
        let mut choice = json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": null});
        if let Some(p) = reported {
            choice["prompt_logprobs"] = p;
        }
        Some(self.chunk(json!([choice])))
    }

    /// Choice `i`'s new reasoning, content and tool-call deltas.
    fn deltas(&mut self, i: usize, finished: bool) -> Delta {
        let s = self;
        deltas(&s.app, &s.plan, &mut s.texts[i], &mut s.reasoning[i], &mut s.calls[i], finished)
    }

    /// The chunks for the next update (several at the end of the stream).
    async fn next_events(&mut self) -> Vec<Value> {
        let Some((i, update)) = self.updates.next().await else {
            self.done = true;
            self.log.ended("error");
            let err = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped");
            return vec![err.body()];
        };
        let mut out = Vec::new();
        match update {
            Update::Verified { .. } => {}
            Update::Prompt(scores) => {
                if let Some(v) = self.prompt_chunk(i, &scores) {
                    out.push(v);
                }
            }
            Update::Token { token, logprob, top } => {
                self.log.token();
                self.texts[i].push(token);
                let d = self.deltas(i, false);
                let choice = self.choice_delta(i, d, &[token], &[logprob], &[top], None);
                out.push(self.chunk(json!([choice])));
            }
            Update::Finished(reason) => {
                let d = self.deltas(i, true);
                let reason = finish_reason(reason, self.calls[i].made_calls());
                self.log.finished(i, reason);
                let finish = Some(reason);
                // The last reasoning and calls on a chunk of their own, then the finish.
                let last = if d.reasoning.is_empty() && d.calls.is_empty() {
                    Some(d)
                } else {
                    let choice = self.choice_delta(i, d, &[], &[], &[], None);
                    out.push(self.chunk(json!([choice])));
                    None
                };
                let choice = self.choice_delta(i, last.unwrap_or_default(), &[], &[], &[], finish);
                out.push(self.chunk(json!([choice])));
                self.open -= 1;
            }
            Update::Failed(msg) => {
                out.push(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg).body());
                self.log.ended("error");
                self.open = 0;
            }
        }
        if self.open == 0 {
            self.done = true;
            // After a failure this changes nothing: the first end recorded stands.
            self.log.ended("ok");
            if self.plan.include_usage {
                let completion: usize = self.texts.iter().map(|t| t.tokens().len()).sum();
                let mut v = self.chunk(json!([]));
                v["usage"] = json!({"prompt_tokens": self.plan.prompt.len(), "completion_tokens": completion,
                                    "total_tokens": self.plan.prompt.len() + completion});
                out.push(v);
            }
        }
        out
    }
}
