//! The chat endpoint's whole reply as an Anthropic message: thinking, text and `tool_use`
//! blocks, in that order, `stop_reason`, `stop_sequence` and `usage`.
//!
//! Contract: the blocks hold exactly the chat reply's `reasoning_content`, `content` and
//! tool calls (a call's `input` is its arguments parsed; a call cut short by `max_tokens`,
//! whose arguments do not parse, has `input` `{}`), so the same request streamed
//! ([`super::events`]) concatenates to the same message. `stop_sequence` is the stop
//! string the output was cut at, found in its tokens as the chat endpoint cut it.

use serde_json::{json, Value};

use crate::output::kept;
use crate::routes::Plan;
use crate::text::TextState;
use crate::AppState;

/// A reply's tokens as the chat endpoint cuts them at stop strings (fed its tokens, it
/// tells which one ended it).
pub(super) fn stop_watch(app: &AppState, plan: &Plan) -> TextState {
    TextState::new(plan.stop.clone()).keeping(kept(app, plan))
}

/// The stop string the reply `text` was cut at, if any.
pub(super) fn stopped_by(app: &AppState, text: &TextState) -> Option<String> {
    text.stopped_by(app.tokenizer.as_ref()?).map(str::to_string)
}

/// Anthropic's `stop_reason` for the chat endpoint's finish reason, given the stop string
/// that ended the reply (if one did).
pub(super) fn stop_reason(finish: &str, stop: Option<&str>) -> &'static str {
    match (finish, stop) {
        (_, Some(_)) => "stop_sequence",
        ("tool_calls", _) => "tool_use",
        ("length", _) => "max_tokens",
        _ => "end_turn",
    }
}

/// A tool call's id in Anthropic's style (`toolu_N` for the chat endpoint's `call_N`).
pub(super) fn tool_use_id(id: &str) -> String {
    format!("toolu_{}", id.strip_prefix("call_").unwrap_or(id))
}

/// A call's `input`: its arguments' object (`{}` for arguments cut short).
fn input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({}),
    }
}

pub(super) fn ids(v: &Value) -> Vec<u32> {
    v.as_array().into_iter().flatten().filter_map(Value::as_u64).map(|t| t as u32).collect()
}

/// The message for `chat`, the chat endpoint's response to the converted request.
pub(super) fn message(app: &AppState, plan: &Plan, id: &str, chat: &Value) -> Value {
    let choice = &chat["choices"][0];
    let m = &choice["message"];
    let mut content = Vec::new();
    if let Some(r) = m["reasoning_content"].as_str().filter(|r| !r.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if let Some(t) = m["content"].as_str().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": t}));
    }
    for c in m["tool_calls"].as_array().into_iter().flatten() {
        let f = &c["function"];
        content.push(json!({"type": "tool_use", "id": tool_use_id(c["id"].as_str().unwrap_or_default()),
                            "name": f["name"], "input": input(f["arguments"].as_str().unwrap_or_default())}));
    }
    let mut watch = stop_watch(app, plan);
    ids(&choice["token_ids"]).into_iter().for_each(|t| watch.push(t));
    let stop = stopped_by(app, &watch);
    let finish = choice["finish_reason"].as_str().unwrap_or_default();
    json!({
        "id": id, "type": "message", "role": "assistant", "model": app.model_name, "content": content,
        "stop_reason": stop_reason(finish, stop.as_deref()), "stop_sequence": stop,
        "usage": {"input_tokens": chat["usage"]["prompt_tokens"], "output_tokens": chat["usage"]["completion_tokens"]},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_reasons_and_inputs() {
        assert_eq!(stop_reason("stop", None), "end_turn");
        assert_eq!(stop_reason("stop", Some("\n")), "stop_sequence");
        assert_eq!(stop_reason("tool_calls", None), "tool_use");
        assert_eq!(stop_reason("length", None), "max_tokens");
        assert_eq!(input("{\"city\": \"Oslo\"}"), json!({"city": "Oslo"}));
        assert_eq!(input("{\"city\": \"Os"), json!({}));
        assert_eq!(tool_use_id("call_12"), "toolu_12");
    }
}
