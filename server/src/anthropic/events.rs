//! The chat endpoint's stream as Anthropic's SSE events: `message_start`, a `ping`, then
//! per content block `content_block_start`, its `content_block_delta`s (`thinking_delta`,
//! `text_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta` (stop
//! reason, stop sequence, output tokens) and `message_stop`; an engine failure ends the
//! stream with an `error` event.
//!
//! Contract: the chat chunks' reasoning, content and tool-call deltas become blocks in
//! the order they come (reasoning, then text, then each call: the chat stream's own
//! order), a block opened at its first non-empty delta and closed when another begins or
//! the reply finishes. Concatenated per block, the deltas equal the blocks of the same
//! request unstreamed ([`super::reply`]), a call's partial JSON its arguments.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, Sse};
use futures_util::future::ready;
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};

use super::reply::{ids, stop_reason, stop_watch, stopped_by, tool_use_id};
use crate::routes::Plan;
use crate::text::TextState;
use crate::AppState;

/// The kind of the block open now.
#[derive(Clone, Copy, PartialEq)]
enum Block {
    Thinking,
    Text,
    /// A call, by its index among the chat stream's calls.
    Tool(u64),
}

/// What the event stream holds between chunks.
pub(super) struct Encoder {
    app: Arc<AppState>,
    id: String,
    prompt_tokens: usize,
    /// The reply's tokens, for the stop sequence that ended it.
    watch: TextState,
    /// The block open now and its index.
    open: Option<(Block, usize)>,
    blocks: usize,
    finish: String,
    ended: bool,
}

fn event(v: Value) -> SseEvent {
    SseEvent::default().event(v["type"].as_str().unwrap_or("error")).data(v.to_string())
}

impl Encoder {
    pub(super) fn new(app: &Arc<AppState>, plan: &Plan, id: String) -> Encoder {
        Encoder {
            app: app.clone(),
            id,
            prompt_tokens: plan.prompt.len(),
            watch: stop_watch(app, plan),
            open: None,
            blocks: 0,
            finish: String::new(),
            ended: false,
        }
    }

    /// The SSE response over `chunks`, the chat endpoint's stream of the request.
    pub(super) fn respond(
        self,
        chunks: impl Stream<Item = Value> + Send + 'static,
    ) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
        let start = json!({"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.app.model_name,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}});
        let opening = stream::iter([event(start), event(json!({"type": "ping"}))]);
        let body =
            chunks.scan(self, |enc, chunk| ready((!enc.ended).then(|| stream::iter(enc.events(&chunk)))));
        Sse::new(opening.chain(body.flatten()).map(Ok))
    }

    /// Closes the open block, if any.
    fn close(&mut self, out: &mut Vec<SseEvent>) {
        if let Some((_, index)) = self.open.take() {
            out.push(event(json!({"type": "content_block_stop", "index": index})));
        }
    }

    /// Opens a block of `kind` starting as `block` unless it is open already; its index.
    fn ensure(&mut self, kind: Block, block: Value, out: &mut Vec<SseEvent>) -> usize {
        match self.open {
            Some((open, index)) if open == kind => index,
            _ => {
                self.close(out);
                let index = self.blocks;
                self.blocks += 1;
                self.open = Some((kind, index));
                out.push(event(
                    json!({"type": "content_block_start", "index": index, "content_block": block}),
                ));
                index
            }
        }
    }

    fn delta(index: usize, delta: Value) -> SseEvent {
        event(json!({"type": "content_block_delta", "index": index, "delta": delta}))
    }

    /// The events for one chat chunk.
    fn events(&mut self, chunk: &Value) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if let Some(e) = chunk.get("error") {
            self.ended = true;
            let message = e["message"].as_str().unwrap_or("the engine failed");
            out.push(event(json!({"type": "error", "error": {"type": "api_error", "message": message}})));
            return out;
        }
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            // The last chunk: the reply has finished.
            self.ended = true;
            self.close(&mut out);
            let stop = stopped_by(&self.app, &self.watch);
            let reason = stop_reason(&self.finish, stop.as_deref());
            out.push(event(json!({"type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop},
                "usage": {"output_tokens": usage["completion_tokens"]}})));
            out.push(event(json!({"type": "message_stop"})));
            return out;
        }
        let Some(c) = chunk["choices"].get(0) else { return out };
        ids(&c["token_ids"]).into_iter().for_each(|t| self.watch.push(t));
        let d = &c["delta"];
        if let Some(r) = d["reasoning_content"].as_str().filter(|r| !r.is_empty()) {
            let start = json!({"type": "thinking", "thinking": "", "signature": ""});
            let index = self.ensure(Block::Thinking, start, &mut out);
            out.push(Self::delta(index, json!({"type": "thinking_delta", "thinking": r})));
        }
        if let Some(t) = d["content"].as_str().filter(|t| !t.is_empty()) {
            let index = self.ensure(Block::Text, json!({"type": "text", "text": ""}), &mut out);
            out.push(Self::delta(index, json!({"type": "text_delta", "text": t})));
        }
        for call in d["tool_calls"].as_array().into_iter().flatten() {
            let k = call["index"].as_u64().unwrap_or_default();
            let f = &call["function"];
            let index = match (call.get("id").and_then(Value::as_str), self.open) {
                // A call's head opens its block.
                (Some(id), _) => {
                    self.close(&mut out);
                    let start =
                        json!({"type": "tool_use", "id": tool_use_id(id), "name": f["name"], "input": {}});
                    self.ensure(Block::Tool(k), start, &mut out)
                }
                (None, Some((Block::Tool(open), index))) if open == k => index,
                // The chat stream sends a call's arguments only while it is the last call.
                (None, _) => continue,
            };
            if let Some(a) = f["arguments"].as_str().filter(|a| !a.is_empty()) {
                out.push(Self::delta(index, json!({"type": "input_json_delta", "partial_json": a})));
            }
        }
        if let Some(f) = c["finish_reason"].as_str() {
            self.finish = f.to_string();
            self.close(&mut out);
        }
        out
    }
}
