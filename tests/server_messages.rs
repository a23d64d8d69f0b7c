//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the trained
//! family (Hermes calls, its MTP head, batch 8): a text reply is the same request's reply
//! through `/v1/chat/completions` (text, token counts, seeded sampling, stop sequences);
//! `tool_choice: any` gives a `tool_use` block valid for its schema; streamed events come
//! in Anthropic's order and concatenate to the unstreamed message (tools and thinking
//! too); count_tokens is `usage.input_tokens`; 15 staggered tool requests are each the
//! same as alone; refusals are Anthropic's error bodies naming the field; `x-api-key`
//! authenticates; and the official `anthropic` Python client drives it all.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use common::http::{dechunk, http, post};
use common::server::{trained_server, MODEL};
use common::trained;
use mtp::server::access::Access;
use mtp::server::ServerOptions;
use serde_json::{json, Value};

/// A server on the trained family ([`common::server::trained_server`]), the chat template
/// from `template_dir` (the checkpoint's own when `None`), `api_key` required when given.
fn start(template_dir: Option<&Path>, api_key: Option<&str>) -> SocketAddr {
    let access = Access { api_key: api_key.map(String::from), ..Access::default() };
    trained_server(template_dir, ServerOptions { access, ..ServerOptions::default() })
}

fn tools() -> Value {
    json!([
        {"name": "get_weather", "description": "The weather in a city",
         "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city"], "additionalProperties": false}},
        {"name": "get_time",
         "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                          "required": ["zone"], "additionalProperties": false}}
    ])
}

/// Whether `input` is valid for tool `name` of [`tools`].
fn valid_input(name: &str, input: &Value) -> bool {
    let Some(a) = input.as_object() else { return false };
    match name {
        "get_weather" => {
            a.get("city").and_then(Value::as_str).is_some_and(|c| c.chars().count() <= 8)
                && a.get("days").is_none_or(|d| d.as_u64().is_some_and(|d| (1..=7).contains(&d)))
                && a.keys().all(|k| k == "city" || k == "days")
        }
        "get_time" => {
            a.len() == 1 && a.get("zone").and_then(Value::as_str).is_some_and(|z| z == "utc" || z == "cet")
        }
        _ => false,
    }
}

/// A message with its ids blanked (each request gets fresh ones), after checking their
/// form: `msg_...` for the message, `toolu_...` for each call.
fn normalized(mut m: Value) -> Value {
    assert!(m["id"].as_str().is_some_and(|id| id.starts_with("msg_")), "{m}");
    m["id"] = json!("");
    for b in m["content"].as_array_mut().into_iter().flatten() {
        if b["type"] == "tool_use" {
            assert!(b["id"].as_str().is_some_and(|id| id.starts_with("toolu_")), "{b}");
            b["id"] = json!("");
        }
    }
    m
}

/// The SSE events of a body: (event name, data), each name checked against its data's
/// `type`.
fn events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: ")).unwrap_or_else(|| panic!("{e}"));
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap_or_else(|| panic!("{e}"));
            let v: Value = serde_json::from_str(data).unwrap_or_else(|err| panic!("{err}: {data}"));
            assert_eq!(v["type"], name, "{e}");
            (name.to_string(), v)
        })
        .collect()
}

/// The message a stream comes to, assembled as the SDK assembles it, after checking the
/// order of Anthropic's events: `message_start`, pings anywhere, each block's start, its
/// deltas of its own kind and its stop (indices 0, 1, ... one after another), then
/// `message_delta` and `message_stop` last.
fn assembled(body: &str) -> Value {
    let mut message = Value::Null;
    let mut partial_json: Vec<String> = Vec::new();
    let mut open: Option<usize> = None;
    let mut state = "start";
    for (name, v) in events(body) {
        match (state, name.as_str()) {
            (_, "ping") => {}
            ("start", "message_start") => {
                message = v["message"].clone();
                assert_eq!(message["content"], json!([]), "{v}");
                state = "blocks";
            }
            ("blocks", "content_block_start") => {
                let i = v["index"].as_u64().unwrap() as usize;
                assert!(open.is_none() && i == partial_json.len(), "block {i} started out of order: {v}");
                message["content"].as_array_mut().unwrap().push(v["content_block"].clone());
                partial_json.push(String::new());
                open = Some(i);
            }
            ("blocks", "content_block_delta") => {
                let i = v["index"].as_u64().unwrap() as usize;
                assert_eq!(open, Some(i), "a delta outside its block: {v}");
                let block = &mut message["content"][i];
                let d = &v["delta"];
                match (block["type"].as_str().unwrap(), d["type"].as_str().unwrap()) {
                    ("text", "text_delta") => {
                        block["text"] = json!(format!(
                            "{}{}",
                            block["text"].as_str().unwrap(),
                            d["text"].as_str().unwrap()
                        ))
                    }
                    ("thinking", "thinking_delta") => {
                        block["thinking"] = json!(format!(
                            "{}{}",
                            block["thinking"].as_str().unwrap(),
                            d["thinking"].as_str().unwrap()
                        ))
                    }
                    ("tool_use", "input_json_delta") => {
                        partial_json[i].push_str(d["partial_json"].as_str().unwrap())
                    }
                    (b, d) => panic!("a {d} in a {b} block"),
                }
            }
            ("blocks", "content_block_stop") => {
                let i = v["index"].as_u64().unwrap() as usize;
                assert_eq!(open, Some(i), "{v}");
                open = None;
                let block = &mut message["content"][i];
                if block["type"] == "tool_use" && !partial_json[i].is_empty() {
                    block["input"] = serde_json::from_str(&partial_json[i]).unwrap_or(json!({}));
                }
            }
            ("blocks", "message_delta") => {
                assert!(open.is_none(), "message_delta inside a block");
                message["stop_reason"] = v["delta"]["stop_reason"].clone();
                message["stop_sequence"] = v["delta"]["stop_sequence"].clone();
                message["usage"]["output_tokens"] = v["usage"]["output_tokens"].clone();
                state = "delta";
            }
            ("delta", "message_stop") => state = "stopped",
            (s, n) => panic!("event {n} in state {s}: {v}"),
        }
    }
    assert_eq!(state, "stopped", "the stream did not end with message_stop");
    message
}

/// Sends `body` to `/v1/messages` (streamed or not) and reads the message, normalized.
fn ask(addr: SocketAddr, body: &Value) -> Value {
    if body["stream"] == true {
        let (status, text) =
            http(addr, "POST", "/v1/messages", &body.to_string(), Duration::from_secs(600)).unwrap();
        assert_eq!(status, 200, "{text}");
        normalized(assembled(&text))
    } else {
        let (status, v) = post(addr, "/v1/messages", body);
        assert_eq!(status, 200, "{v}");
        assert_eq!((v["type"].as_str(), v["role"].as_str()), (Some("message"), Some("assistant")), "{v}");
        normalized(v)
    }
}

fn text_of(m: &Value) -> String {
    m["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap())
        .collect()
}

fn count_tokens(addr: SocketAddr, body: &Value) -> u64 {
    let mut b = body.clone();
    for key in ["max_tokens", "stream", "temperature", "seed", "stop_sequences"] {
        b.as_object_mut().unwrap().remove(key);
    }
    let (status, v) = post(addr, "/v1/messages/count_tokens", &b);
    assert_eq!(status, 200, "{v}");
    v["input_tokens"].as_u64().unwrap()
}

#[test]
fn text_replies_equal_the_chat_endpoints() {
    let addr = start(None, None);
    for (temperature, seed) in [(0.0, 1), (0.9, 7)] {
        let body = json!({"model": MODEL, "max_tokens": 24, "system": "You are terse.",
                          "messages": [{"role": "user", "content": "write a function that adds two numbers"}],
                          "temperature": temperature, "seed": seed});
        let m = ask(addr, &body);
        let chat = json!({"model": MODEL, "max_tokens": 24, "temperature": temperature, "seed": seed,
                          "messages": [{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": "write a function that adds two numbers"}]});
        let (status, c) = post(addr, "/v1/chat/completions", &chat);
        assert_eq!(status, 200, "{c}");
        let want = c["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(!want.is_empty());
        assert_eq!(text_of(&m), want, "temperature {temperature}");
        assert_eq!(m["usage"]["output_tokens"], c["usage"]["completion_tokens"]);
        assert_eq!(m["usage"]["input_tokens"], c["usage"]["prompt_tokens"]);
        let finish = c["choices"][0]["finish_reason"].as_str().unwrap();
        assert_eq!(m["stop_reason"], if finish == "length" { "max_tokens" } else { "end_turn" }, "{m}");
        assert_eq!(m["stop_sequence"], Value::Null);
        assert_eq!(count_tokens(addr, &body), m["usage"]["input_tokens"].as_u64().unwrap());
        // A stop sequence from the middle of the reply cuts it there, and is named.
        let stop: String = want.chars().skip(want.chars().count() / 2).take(3).collect();
        let mut stopped = body.clone();
        stopped["stop_sequences"] = json!(["never in the reply", stop]);
        let s = ask(addr, &stopped);
        assert_eq!(
            (s["stop_reason"].as_str(), s["stop_sequence"].as_str()),
            (Some("stop_sequence"), Some(stop.as_str())),
            "{s}"
        );
        assert_eq!(text_of(&s), want[..want.find(&stop).unwrap()]);
        // Streamed, the same message.
        for b in [body, stopped] {
            let mut streamed = b.clone();
            streamed["stream"] = json!(true);
            assert_eq!(ask(addr, &streamed), ask(addr, &b));
        }
    }
}

#[test]
fn tool_use_under_any_is_valid_and_streams_as_the_whole_message() {
    let addr = start(None, None);
    for (i, choice) in [
        json!({"type": "any", "disable_parallel_tool_use": true}),
        json!({"type": "tool", "name": "get_time"}),
    ]
    .into_iter()
    .enumerate()
    {
        let body = json!({"model": MODEL, "max_tokens": 96, "tools": tools(), "tool_choice": choice,
                          "messages": [{"role": "user", "content": "what is the weather in Oslo, and the time?"}],
                          "temperature": if i == 1 { 0.8 } else { 0.0 }, "seed": 3});
        let m = ask(addr, &body);
        assert_eq!(m["stop_reason"], "tool_use", "{m}");
        let calls: Vec<&Value> =
            m["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").collect();
        assert_eq!(calls.len(), 1, "{m}");
        let name = calls[0]["name"].as_str().unwrap();
        assert!(valid_input(name, &calls[0]["input"]), "{m}");
        if i == 1 {
            assert_eq!(name, "get_time");
        }
        assert_eq!(count_tokens(addr, &body), m["usage"]["input_tokens"].as_u64().unwrap());
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        assert_eq!(ask(addr, &streamed), m);
        // The call and its result go back; the template renders both.
        let turn = json!({"model": MODEL, "max_tokens": 8, "tools": tools(), "temperature": 0, "messages": [
            {"role": "user", "content": "what is the weather in Oslo, and the time?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": name, "input": calls[0]["input"]}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"}]}]});
        let r = ask(addr, &turn);
        assert!(
            r["usage"]["input_tokens"].as_u64().unwrap() > m["usage"]["input_tokens"].as_u64().unwrap(),
            "{r}"
        );
    }
}

/// A template that opens the think block in the prompt: the reply is a thinking block,
/// streamed and whole the same.
#[test]
fn reasoning_comes_as_a_thinking_block() {
    let dir = std::env::temp_dir().join(format!("mtp-server-messages-think-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = std::fs::read_to_string(trained("target").join("chat_template.jinja")).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), format!("{source}<think>\n")).unwrap();
    let addr = start(Some(&dir), None);
    let body = json!({"model": MODEL, "max_tokens": 24, "temperature": 0,
                      "messages": [{"role": "user", "content": "add two numbers"}]});
    let m = ask(addr, &body);
    let block = &m["content"][0];
    assert!(block["type"] == "thinking" && !block["thinking"].as_str().unwrap().is_empty(), "{m}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    assert_eq!(ask(addr, &streamed), m);
}

/// Request `i` of the scenario: tools, `tool_choice: any`, one call per reply, streamed
/// for odd `i`, sampled with a seed for `i % 4 >= 2`.
fn scenario_request(i: usize) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("Request {i}: the weather in Oslo for {} days?", i % 7 + 1)}],
        "tools": tools(), "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "max_tokens": 96, "temperature": if i % 4 >= 2 { 0.9 } else { 0.0 }, "seed": 77 + i,
        "stream": i % 2 == 1,
    })
}

#[test]
fn staggered_tool_calls_through_messages_are_valid_and_each_as_alone() {
    let addr = start(None, None);
    let alone: Vec<Value> = (0..15).map(|i| ask(addr, &scenario_request(i))).collect();
    for (i, m) in alone.iter().enumerate() {
        assert_eq!(m["stop_reason"], "tool_use", "request {i}: {m}");
        let blocks = m["content"].as_array().unwrap();
        assert_eq!(blocks.len(), 1, "request {i}: {m}");
        assert!(valid_input(blocks[0]["name"].as_str().unwrap(), &blocks[0]["input"]), "request {i}: {m}");
    }
    let together: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..15)
            .map(|i| {
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(5 * i as u64));
                    ask(addr, &scenario_request(i))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (got, want)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(got, want, "request {i} differs from the same request alone");
    }
}

/// One request with extra headers; the status and body.
fn with_headers(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut b = raw[split + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        b = dechunk(&b).unwrap();
    }
    (status, serde_json::from_slice(&b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&b))))
}

/// An Anthropic error body: its status, type and message (which leads with the field).
fn error_of(status: u16, v: &Value) -> (u16, String, String) {
    assert_eq!(v["type"], "error", "{v}");
    (
        status,
        v["error"]["type"].as_str().unwrap().to_string(),
        v["error"]["message"].as_str().unwrap().to_string(),
    )
}

#[test]
fn refusals_are_anthropic_errors_naming_the_field() {
    let addr = start(None, None);
    let ok = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let with = |key: &str, v: Value| {
        let mut b = ok.clone();
        b[key] = v;
        b
    };
    let mut no_max = ok.clone();
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let cases = [
        (no_max, 400, "invalid_request_error", "max_tokens: "),
        (with("temprature", json!(0.2)), 400, "invalid_request_error", "temprature: "),
        (with("max_tokens", json!(0)), 400, "invalid_request_error", "max_tokens: "),
        (with("model", json!("claude-opus")), 404, "not_found_error", "model: "),
        (
            with("stop_sequences", json!([""])),
            400,
            "invalid_request_error",
            "stop_sequences: `stop_sequences`",
        ),
        (
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]),
            ),
            400,
            "invalid_request_error",
            "messages.0.content.0.type: ",
        ),
        (
            with("tool_choice", json!({"type": "tool", "name": "nope"})),
            400,
            "invalid_request_error",
            "tool_choice",
        ),
        (
            with("tools", json!([{"name": "a b", "input_schema": {"type": "object"}}])),
            400,
            "invalid_request_error",
            "tools.0.name: ",
        ),
        (with("top_k", json!(-3)), 400, "invalid_request_error", "top_k: "),
        // Anthropic's temperature is 0 to 1 (1.5 sampled hotter than the API allows).
        (
            with("temperature", json!(1.5)),
            400,
            "invalid_request_error",
            "temperature: `temperature` must be between 0 and 1",
        ),
        // A block's unknown key is refused as a field is (`cache_control` is Anthropic's: below).
        (
            with(
                "messages",
                json!([{"role": "user", "content": [{"type": "text", "text": "hi", "cache_ctrl": {}}]}]),
            ),
            400,
            "invalid_request_error",
            "messages.0.content.0.cache_ctrl: ",
        ),
        // A misspelt schema keyword, named by its Anthropic path.
        (
            with("tools", json!([{"name": "f", "input_schema": {"type": "object", "proprties": {}}}])),
            400,
            "invalid_request_error",
            "tools.0.input_schema.proprties: `proprties` is not a JSON Schema keyword",
        ),
        (
            with(
                "output_config",
                json!({"format": {"type": "json_schema", "schema": {"type": "object", "requred": []}}}),
            ),
            400,
            "invalid_request_error",
            "output_config.format.schema.requred: ",
        ),
        // An assistant's calls have distinct ids.
        (
            with(
                "messages",
                json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "get_time", "input": {}},
                    {"type": "tool_use", "id": "t1", "name": "get_time", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "12:00"}]}]),
            ),
            400,
            "invalid_request_error",
            "messages.1.content.1.id: ",
        ),
    ];
    for (body, status, kind, lead) in cases {
        let (s, v) = post(addr, "/v1/messages", &body);
        let (s, k, message) = error_of(s, &v);
        assert_eq!((s, k.as_str()), (status, kind), "{body}: {message}");
        assert!(message.starts_with(lead), "{body}: {message}");
    }
    // Naming a tool that is not there, and a malformed body.
    let mut named = with("tool_choice", json!({"type": "tool", "name": "nope"}));
    named["tools"] = tools();
    let (s, v) = post(addr, "/v1/messages", &named);
    assert!(error_of(s, &v).2.starts_with("tool_choice.name: "), "{v}");
    let (s, v) = with_headers(addr, "/v1/messages", &[], "{not json");
    assert_eq!(error_of(s, &v).1, "invalid_request_error");
    // The SDK's metadata and headers are accepted.
    let (s, v) = with_headers(
        addr,
        "/v1/messages",
        &[("anthropic-version", "2023-06-01"), ("anthropic-beta", "tools-2024-04-04")],
        &with("metadata", json!({"user_id": "u-1"})).to_string(),
    );
    assert_eq!(s, 200, "{v}");
    // The controls: temperature 1, `cache_control` on blocks (ignored), schemas of standard
    // keywords and annotations.
    let mut cached = with("temperature", json!(1.0));
    cached["system"] = json!([{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]);
    cached["messages"] = json!([{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "5m"}}]}]);
    cached["tools"] = json!([{"name": "f", "input_schema": {"type": "object", "title": "F", "$schema":
        "https://json-schema.org/draft/2020-12/schema", "properties": {"a": {"type": "string", "x-hint": "h"}}}}]);
    let (s, v) = post(addr, "/v1/messages", &cached);
    assert_eq!(s, 200, "{v}");
}

#[test]
fn x_api_key_authenticates() {
    let addr = start(None, Some("sekret"));
    let body =
        json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let (s, v) = with_headers(addr, "/v1/messages", &[], &body);
    assert_eq!((s, error_of(s, &v).1.as_str()), (401, "authentication_error"));
    let (s, v) = with_headers(addr, "/v1/messages", &[("x-api-key", "wrong")], &body);
    assert_eq!((s, error_of(s, &v).1.as_str()), (401, "authentication_error"));
    for h in [("x-api-key", "sekret"), ("Authorization", "Bearer sekret")] {
        let (s, v) = with_headers(addr, "/v1/messages", &[h, ("anthropic-version", "2023-06-01")], &body);
        assert_eq!((s, v["type"].as_str()), (200, Some("message")), "{h:?}: {v}");
    }
    // The OpenAI endpoints take the same key either way.
    let chat =
        json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let (s, v) = with_headers(addr, "/v1/chat/completions", &[("x-api-key", "sekret")], &chat);
    assert_eq!(s, 200, "{v}");
}

fn without_nulls(v: &Value) -> Value {
    match v {
        Value::Object(o) => Value::Object(
            o.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), without_nulls(v))).collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

/// The official `anthropic` Python client (installed by `.ci/run`; set `MTP_PYTHON` to a
/// Python that has it): `messages.create` for text and tools, `messages.stream` with
/// `get_final_message()`, and `count_tokens`; each message equals the same request sent
/// here, each count its `usage.input_tokens`.
#[test]
fn the_anthropic_python_client_drives_messages() {
    let Some(python) = common::python_with("anthropic") else { return };
    let addr = start(None, Some("sekret"));
    let url = format!("http://{addr}");
    let args = ["--base-url", &url, "--model", MODEL, "--api-key", "sekret"];
    let lines: Vec<Value> = common::script_lines(&python, "anthropic_client_check.py", &args);
    assert!(lines.len() >= 6, "the script reported {} requests", lines.len());
    let authed = |path: &str, body: &Value| {
        let (s, v) = with_headers(addr, path, &[("x-api-key", "sekret")], &body.to_string());
        assert_eq!(s, 200, "{v}");
        v
    };
    let (mut tools_seen, mut streamed_seen) = (false, false);
    for l in &lines {
        let name = l["name"].as_str().unwrap();
        let mut request = l["request"].clone();
        request["model"] = json!(MODEL);
        if let Some(n) = l.get("input_tokens") {
            request["max_tokens"] = json!(1);
            let m = authed("/v1/messages", &request);
            assert_eq!(*n, m["usage"]["input_tokens"], "{name}");
            continue;
        }
        request["stream"] = json!(false);
        let want = normalized(authed("/v1/messages", &request));
        // The client's dump leaves out what is null.
        assert_eq!(normalized(l["message"].clone()), without_nulls(&want), "{name}");
        if request.get("tools").is_some() {
            tools_seen = true;
            let b = &want["content"][0];
            assert!(
                b["type"] == "tool_use" && valid_input(b["name"].as_str().unwrap(), &b["input"]),
                "{name}: {want}"
            );
        }
        streamed_seen |= l["streamed"] == true;
    }
    assert!(tools_seen && streamed_seen);
}
