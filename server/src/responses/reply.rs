//! The `Response` object, in OpenAI's shape, and its output items.
//!
//! Contract: one reply's output is, in order, a `reasoning` item (when the reply had
//! reasoning), a `message` item with one `output_text` part (when it has text, or makes
//! no call: a reply says something, if only ""), then a `function_call` item per call.
//! The whole reply ([`from_chat`], from the chat endpoint's body) and the streamed one
//! ([`super::stream`], item by item) build the same items with these functions, so
//! `response.completed` restates exactly what the unstreamed request returns (ids and
//! times aside). A reply cut by its length is `incomplete` (`incomplete_details.reason`
//! `max_output_tokens`), its last item `incomplete` too.

use serde_json::{json, Map, Value};

use crate::routes::now;

/// Where a reply ended, as a `Response` says it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Status {
    Completed,
    /// Cut by `max_output_tokens` (or the context's end).
    Incomplete,
    /// Its client went away.
    Cancelled,
    Failed,
}

impl Status {
    /// From the chat endpoint's finish reason.
    pub(crate) fn from_finish(reason: &str) -> Status {
        match reason {
            "length" => Status::Incomplete,
            "abort" => Status::Cancelled,
            _ => Status::Completed,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            Status::Incomplete => "incomplete",
            Status::Cancelled => "cancelled",
            Status::Failed => "failed",
        }
    }
}

pub(crate) fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    json!({"id": id, "type": "reasoning", "summary": [],
           "content": [{"type": "reasoning_text", "text": text}], "status": status})
}

pub(crate) fn output_text(text: &str, logprobs: &[Value]) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
}

pub(crate) fn message_item(id: &str, text: &str, logprobs: &[Value], status: &str) -> Value {
    json!({"id": id, "type": "message", "status": status, "role": "assistant",
           "content": [output_text(text, logprobs)]})
}

/// A token's logprob as the Responses API writes it: the chat format's entry (and its
/// alternatives) without the token id.
pub(crate) fn text_logprob(chat_entry: &Value) -> Value {
    let strip = |e: &Value| json!({"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]});
    let mut v = strip(chat_entry);
    let top: Vec<Value> =
        chat_entry["top_logprobs"].as_array().map_or(Vec::new(), |t| t.iter().map(strip).collect());
    v["top_logprobs"] = Value::Array(top);
    v
}

pub(crate) fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"id": id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
           "arguments": arguments})
}

/// Marks the last item of an incomplete reply `incomplete`.
pub(crate) fn mark_last(items: &mut [Value], status: Status) {
    if let (Status::Incomplete, Some(last)) = (status, items.last_mut()) {
        last["status"] = json!("incomplete");
    }
}

/// Token counts, in OpenAI's shape.
pub(crate) fn usage(input: usize, output: usize) -> Value {
    json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
           "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": input + output})
}

/// A `Response`: `echo` restates the request's settings ([`super::request::Converted`]).
pub(crate) fn response(
    id: &str,
    created_at: u64,
    model: &str,
    status: &str,
    output: Vec<Value>,
    usage: Value,
    echo: &Map<String, Value>,
) -> Value {
    let mut r = Map::new();
    r.insert("id".into(), json!(id));
    r.insert("object".into(), json!("response"));
    r.insert("created_at".into(), json!(created_at));
    r.insert("status".into(), json!(status));
    r.insert("background".into(), json!(false));
    r.insert("completed_at".into(), if status == "completed" { json!(now()) } else { Value::Null });
    r.insert("error".into(), Value::Null);
    let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
    r.insert("incomplete_details".into(), incomplete.unwrap_or(Value::Null));
    r.insert("model".into(), json!(model));
    r.insert("output".into(), Value::Array(output));
    r.insert("usage".into(), usage);
    for (k, v) in echo {
        r.insert(k.clone(), v.clone());
    }
    Value::Object(r)
}

/// The `Response` for the chat endpoint's whole body `chat` (one choice); `fresh` names
/// each new item (`msg`, `rs`, `fc`).
pub(crate) fn from_chat(
    id: &str,
    created_at: u64,
    model: &str,
    chat: &Value,
    echo: &Map<String, Value>,
    fresh: &mut dyn FnMut(&str) -> String,
) -> Value {
    let choice = &chat["choices"][0];
    let message = &choice["message"];
    let status = Status::from_finish(choice["finish_reason"].as_str().unwrap_or_default());
    let mut items = Vec::new();
    if let Some(r) = message["reasoning_content"].as_str() {
        items.push(reasoning_item(&fresh("rs"), r, "completed"));
    }
    let calls = message["tool_calls"].as_array().map_or(&[][..], Vec::as_slice);
    let text = message["content"].as_str().unwrap_or_default();
    if !text.is_empty() || calls.is_empty() {
        // Asked only of replies that are text alone: every token's is the text's.
        let logprobs = choice["logprobs"]["content"].as_array();
        let logprobs: Vec<Value> = logprobs.map_or(Vec::new(), |l| l.iter().map(text_logprob).collect());
        items.push(message_item(&fresh("msg"), text, &logprobs, "completed"));
    }
    for c in calls {
        let f = &c["function"];
        let (call_id, name) = (c["id"].as_str().unwrap_or_default(), f["name"].as_str().unwrap_or_default());
        let arguments = f["arguments"].as_str().unwrap_or_default();
        items.push(call_item(&fresh("fc"), call_id, name, arguments, "completed"));
    }
    mark_last(&mut items, status);
    let u = &chat["usage"];
    let tokens = |k: &str| u[k].as_u64().unwrap_or(0) as usize;
    let usage = usage(tokens("prompt_tokens"), tokens("completion_tokens"));
    response(id, created_at, model, status.name(), items, usage, echo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_body_becomes_items_in_order() {
        let chat = json!({"choices": [{"index": 0, "finish_reason": "length", "message": {
            "role": "assistant", "content": "x", "reasoning_content": "r",
            "tool_calls": [{"id": "call_4", "type": "function", "function": {"name": "f", "arguments": "{\"a\""}}]}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}});
        let mut n = 0;
        let r = from_chat("resp_1", 7, "m", &chat, &Map::new(), &mut |p| {
            n += 1;
            format!("{p}_{n}")
        });
        let types: Vec<&str> =
            r["output"].as_array().unwrap().iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["reasoning", "message", "function_call"]);
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(r["output"][2]["status"], "incomplete");
        assert_eq!(r["output"][1]["status"], "completed");
        assert_eq!(r["output"][2]["call_id"], "call_4");
        assert_eq!(r["usage"]["total_tokens"], 8);
        // A reply of calls only has no message; one of nothing has an empty one.
        let calls_only = json!({"choices": [{"finish_reason": "tool_calls", "message": {"content": null,
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}}]});
        let r = from_chat("r", 0, "m", &calls_only, &Map::new(), &mut |p| p.to_string());
        assert_eq!(r["output"].as_array().unwrap().len(), 1);
        let nothing = json!({"choices": [{"finish_reason": "stop", "message": {"content": ""}}]});
        let r = from_chat("r", 0, "m", &nothing, &Map::new(), &mut |p| p.to_string());
        assert_eq!(r["output"][0]["content"][0]["text"], "");
        assert_eq!(r["status"], "completed");
    }
}
