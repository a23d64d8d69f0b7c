//! A streamed `Response`: the Responses API's server-sent events, each `event:` named by
//! its `type` and numbered by `sequence_number` from 0.
//!
//! Contract: `response.created` and `response.in_progress` first; then each output item
//! as it comes: `response.output_item.added`, its content (a message's
//! `response.content_part.added`, `response.output_text.delta`s, `.done`,
//! `response.content_part.done`; a reasoning item's the same with `reasoning_text`; a
//! call's `response.function_call_arguments.delta`s and `.done`), then
//! `response.output_item.done`. An item is done when the next one is added or the reply
//! ends; its deltas concatenate to its text. Last, `response.completed` (or
//! `response.incomplete`, cut by its length; `response.failed`, the engine failed) with
//! the whole `Response`, whose items are those sent, built as [`super::reply`] builds the
//! unstreamed one. The deltas come from the chat stream's own parsers
//! ([`crate::output::deltas`]), so the text, reasoning and calls are the chat endpoint's.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::reply::{self, Status};
use crate::output::{deltas, finish_reason, kept, Delta};
use crate::reasoning::ReasoningStream;
use crate::request_log::RequestLog;
use crate::routes::{PendingSlots, Plan};
use crate::text::TextState;
use crate::tools::stream::CallStream;
use crate::worker::Update;
use crate::AppState;

/// The item being streamed.
enum Open {
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
    Call { id: String, call_id: String, name: String, arguments: String },
}

/// What the stream holds between events.
struct Events {
    app: Arc<AppState>,
    plan: Plan,
    updates: mpsc::UnboundedReceiver<Update>,
    text: TextState,
    reasoning: (Option<ReasoningStream>, String),
    calls: CallStream,
    /// Calls begun (each call's index in the chat wire format).
    calls_begun: usize,
    open: Option<Open>,
    /// The items done, in output order.
    items: Vec<Value>,
    seq: u64,
    id: String,
    created_at: u64,
    echo: Map<String, Value>,
    /// Logprobs of tokens whose text no delta has carried yet (when asked for).
    pending: Vec<Value>,
    /// Those the open message's deltas carried.
    carried: Vec<Value>,
    done: bool,
    log: RequestLog,
    _slots: PendingSlots,
}

/// The stream of a started request (its plan asks for one choice).
pub(crate) fn respond(
    app: Arc<AppState>,
    plan: Plan,
    updates: mpsc::UnboundedReceiver<Update>,
    slots: PendingSlots,
    mut log: RequestLog,
    echo: Map<String, Value>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    log.started_stream();
    let mut s = Events {
        text: TextState::new(plan.stop.clone()).keeping(kept(&app, &plan)),
        reasoning: (plan.reasoning.map(|(r, opened)| ReasoningStream::new(r).opened(opened)), String::new()),
        calls: CallStream::default(),
        calls_begun: 0,
        open: None,
        items: Vec::new(),
        seq: 0,
        id: log.id().to_string(),
        created_at: crate::routes::now(),
        echo,
        pending: Vec::new(),
        carried: Vec::new(),
        done: false,
        log,
        _slots: slots,
        app,
        plan,
        updates,
    };
    let mut opening = Vec::new();
    for kind in ["response.created", "response.in_progress"] {
        let r = s.response("in_progress", Value::Null);
        opening.push(s.event(kind, json!({"response": r})));
    }
    let body = stream::iter(opening.into_iter().map(Ok)).chain(
        stream::unfold(s, |mut s| async move {
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

impl Events {
    /// The next event: `fields` with its `type` and `sequence_number`.
    fn event(&mut self, kind: &str, fields: Value) -> SseEvent {
        let mut v = json!({"type": kind, "sequence_number": self.seq});
        if let (Some(o), Value::Object(f)) = (v.as_object_mut(), fields) {
            o.extend(f);
        }
        self.seq += 1;
        SseEvent::default().event(kind).data(v.to_string())
    }

    fn response(&self, status: &str, usage: Value) -> Value {
        let items = self.items.clone();
        reply::response(&self.id, self.created_at, &self.app.model_name, status, items, usage, &self.echo)
    }

    fn fresh(&self, prefix: &str) -> String {
        super::fresh_id(&self.app, prefix)
    }

    /// The events for the next update (several at the end).
    async fn next_events(&mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        match self.updates.recv().await {
            Some(Update::Token { token, logprob, top }) => {
                self.log.token();
                self.text.push(token);
                if let Some(k) = self.plan.logprobs {
                    let chat = crate::output::logprobs_json(
                        &self.app,
                        self.plan.kind,
                        k,
                        None,
                        &[token],
                        &[logprob],
                        &[top],
                    );
                    self.pending
                        .extend(chat["content"].as_array().into_iter().flatten().map(reply::text_logprob));
                }
                let d = self.delta(false);
                self.apply(d, &mut out);
            }
            Some(Update::Finished(reason)) => {
                let d = self.delta(true);
                self.apply(d, &mut out);
                let reason = finish_reason(reason, self.calls.made_calls());
                self.log.finished(0, reason);
                let status = Status::from_finish(reason);
                if self.calls_begun == 0 && !self.items.iter().any(|i| i["type"] == "message") {
                    let is_message = matches!(self.open, Some(Open::Message { .. }));
                    if !is_message {
                        // A reply says something, if only "".
                        self.begin(Open::Message { id: self.fresh("msg"), text: String::new() }, &mut out);
                    }
                }
                self.close(status, &mut out);
                let completion = self.text.tokens().len();
                let usage = reply::usage(self.plan.prompt.len(), completion);
                let r = self.response(status.name(), usage);
                let kind = match status {
                    Status::Incomplete => "response.incomplete",
                    Status::Failed => "response.failed",
                    _ => "response.completed",
                };
                out.push(self.event(kind, json!({"response": r})));
                self.log.ended("ok");
                self.done = true;
            }
            Some(Update::Failed(msg)) => self.fail(&msg, &mut out),
            // A response's plan never scores its prompt.
            Some(Update::Prompt(_)) => {}
            Some(Update::Verified { .. }) => {}
            None => self.fail("the engine stopped", &mut out),
        }
        out
    }

    /// Ends the stream with `response.failed`.
    fn fail(&mut self, message: &str, out: &mut Vec<SseEvent>) {
        self.close(Status::Failed, out);
        let mut r = self.response("failed", Value::Null);
        r["error"] = json!({"code": "server_error", "message": message});
        out.push(self.event("response.failed", json!({"response": r})));
        self.log.ended("error");
        self.done = true;
    }

    fn delta(&mut self, finished: bool) -> Delta {
        let s = self;
        deltas(&s.app, &s.plan, &mut s.text, &mut s.reasoning, &mut s.calls, finished)
    }

    /// The events of one delta: its reasoning, then its text, then its calls.
    fn apply(&mut self, d: Delta, out: &mut Vec<SseEvent>) {
        if !d.reasoning.is_empty() {
            if !matches!(self.open, Some(Open::Reasoning { .. })) {
                self.begin(Open::Reasoning { id: self.fresh("rs"), text: String::new() }, out);
            }
            self.extend(&d.reasoning, out);
        }
        if !d.text.is_empty() {
            if !matches!(self.open, Some(Open::Message { .. })) {
                self.begin(Open::Message { id: self.fresh("msg"), text: String::new() }, out);
            }
            self.extend(&d.text, out);
        }
        for c in d.calls {
            let f = &c["function"];
            let arguments = f["arguments"].as_str().unwrap_or_default();
            if c["index"].as_u64() == Some(self.calls_begun as u64) {
                let call = Open::Call {
                    id: self.fresh("fc"),
                    call_id: c["id"].as_str().unwrap_or_default().to_string(),
                    name: f["name"].as_str().unwrap_or_default().to_string(),
                    arguments: String::new(),
                };
                self.calls_begun += 1;
                self.begin(call, out);
            }
            // A call's deltas come before the next call's head (CallStream's order).
            if !arguments.is_empty()
                && c["index"].as_u64() == self.calls_begun.checked_sub(1).map(|k| k as u64)
            {
                self.extend(arguments, out);
            }
        }
    }

    /// Closes the open item and adds `item`.
    fn begin(&mut self, item: Open, out: &mut Vec<SseEvent>) {
        self.close(Status::Completed, out);
        let index = self.items.len();
        let (added, part) = match &item {
            Open::Reasoning { id, .. } => (
                json!({"id": id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}),
                Some((id.clone(), json!({"type": "reasoning_text", "text": ""}))),
            ),
            Open::Message { id, .. } => (
                json!({"id": id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}),
                Some((id.clone(), reply::output_text("", &[]))),
            ),
            Open::Call { id, call_id, name, .. } => {
                (reply::call_item(id, call_id, name, "", "in_progress"), None)
            }
        };
        out.push(self.event("response.output_item.added", json!({"output_index": index, "item": added})));
        if let Some((id, part)) = part {
            let fields = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
            out.push(self.event("response.content_part.added", fields));
        }
        self.open = Some(item);
    }

    /// Appends `delta` to the open item.
    fn extend(&mut self, delta: &str, out: &mut Vec<SseEvent>) {
        let index = self.items.len();
        let (kind, id) = match &mut self.open {
            Some(Open::Reasoning { id, text }) => {
                text.push_str(delta);
                ("response.reasoning_text.delta", id.clone())
            }
            Some(Open::Message { id, text }) => {
                text.push_str(delta);
                ("response.output_text.delta", id.clone())
            }
            Some(Open::Call { id, arguments, .. }) => {
                arguments.push_str(delta);
                let fields = json!({"item_id": id, "output_index": index, "delta": delta});
                out.push(self.event("response.function_call_arguments.delta", fields));
                return;
            }
            None => return,
        };
        let mut fields = json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta});
        if kind == "response.output_text.delta" {
            let carried = std::mem::take(&mut self.pending);
            fields["logprobs"] = json!(carried);
            self.carried.extend(carried);
        }
        out.push(self.event(kind, fields));
    }

    /// Ends the open item (if any): its `.done` events, and it joins the items.
    fn close(&mut self, status: Status, out: &mut Vec<SseEvent>) {
        let Some(open) = self.open.take() else { return };
        let index = self.items.len();
        let status = if status == Status::Incomplete { "incomplete" } else { "completed" };
        let item = match open {
            Open::Reasoning { id, text } => {
                let fields = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text});
                out.push(self.event("response.reasoning_text.done", fields));
                let part = json!({"type": "reasoning_text", "text": text});
                let fields = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
                out.push(self.event("response.content_part.done", fields));
                reply::reasoning_item(&id, &text, status)
            }
            Open::Message { id, text } => {
                // Tokens whose text a stop string cut are the message's too, as unstreamed.
                let mut logprobs = std::mem::take(&mut self.carried);
                logprobs.append(&mut self.pending);
                let fields = json!({"item_id": id, "output_index": index, "content_index": 0, "text": text,
                                    "logprobs": logprobs});
                out.push(self.event("response.output_text.done", fields));
                let fields = json!({"item_id": id, "output_index": index, "content_index": 0,
                                    "part": reply::output_text(&text, &logprobs)});
                out.push(self.event("response.content_part.done", fields));
                reply::message_item(&id, &text, &logprobs, status)
            }
            Open::Call { id, call_id, name, arguments } => {
                let fields =
                    json!({"item_id": id, "output_index": index, "name": name, "arguments": arguments});
                out.push(self.event("response.function_call_arguments.done", fields));
                reply::call_item(&id, &call_id, &name, &arguments, status)
            }
        };
        out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
        self.items.push(item);
    }
}
