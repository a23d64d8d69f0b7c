//! Tool calls and reasoning over HTTP on the trained family (Hermes calls, its MTP head,
//! batch 8): 15 staggered tool-calling requests, streamed and not, greedy and seeded, each
//! bitwise the same request alone (content, calls, reasoning, token ids, logprobs) with
//! 15/15 calls valid for their schema; streamed calls in OpenAI's format (a call's first
//! chunk carries its `id`, `type` and `function.name`, later chunks its index and
//! arguments only) assembled as the SDK assembles them, parallel calls included; schemas
//! closed by default; named and `none` choices, a multi-turn conversation with tool
//! results, reasoning split from content (streamed and not, the same); and the official
//! `openai` Python client driving tools (streamed through its `chat.completions.stream`
//! helper), `response_format` and reasoning.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::http::{http, post, sse_events};
use common::server::{trained_server, MODEL};
use common::trained;
use mtp::server::ServerOptions;
use serde_json::{json, Value};

/// A server on the trained family ([`common::server::trained_server`]), the chat template
/// from `template_dir` (the checkpoint's own when `None`).
fn start(template_dir: Option<&Path>) -> SocketAddr {
    trained_server(template_dir, ServerOptions::default())
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                           "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                           "required": ["zone"], "additionalProperties": false}}}
    ])
}

/// Whether `args` (JSON text) is valid for tool `name` of [`tools`].
fn valid_call(name: &str, args: &str) -> bool {
    let Ok(Value::Object(a)) = serde_json::from_str::<Value>(args) else { return false };
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

/// What a reply came to, however it was delivered: content, reasoning, calls (name and
/// arguments), finish reason, token ids, logprob bits.
#[derive(Debug, PartialEq, Clone)]
struct Reply {
    content: String,
    reasoning: String,
    calls: Vec<(String, String)>,
    finish: String,
    tokens: Vec<u64>,
    logprobs: Vec<u32>,
}

fn logprob_bits(lp: &Value) -> Vec<u32> {
    lp["content"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|x| (x["logprob"].as_f64().unwrap() as f32).to_bits())
        .collect()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().into_iter().flatten().map(|x| x.as_u64().unwrap()).collect()
}

/// A non-streamed chat response's reply.
fn reply(v: &Value) -> Reply {
    let c = &v["choices"][0];
    let m = &c["message"];
    Reply {
        content: m["content"].as_str().unwrap_or_default().to_string(),
        reasoning: m["reasoning_content"].as_str().unwrap_or_default().to_string(),
        calls: m["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                assert_eq!(t["type"], "function", "{t}");
                assert!(t["id"].as_str().is_some_and(|i| !i.is_empty()), "{t}");
                (
                    t["function"]["name"].as_str().unwrap().to_string(),
                    t["function"]["arguments"].as_str().unwrap().to_string(),
                )
            })
            .collect(),
        finish: c["finish_reason"].as_str().unwrap().to_string(),
        tokens: ids(&c["token_ids"]),
        logprobs: logprob_bits(&c["logprobs"]),
    }
}

/// A streamed chat response's reply, assembled as the openai SDK assembles it (each
/// index's `arguments` concatenated, id and name from the call's first chunk), after
/// checking OpenAI's format: a call's first chunk carries its index, id, type and
/// function name, later chunks its index and arguments only (the SDK would concatenate a
/// repeated name into `get_weatherget_weather`).
fn streamed_reply(body: &str) -> Reply {
    let mut r = Reply {
        content: String::new(),
        reasoning: String::new(),
        calls: Vec::new(),
        finish: String::new(),
        tokens: Vec::new(),
        logprobs: Vec::new(),
    };
    for e in sse_events(body) {
        assert!(e.get("error").is_none(), "{e}");
        for c in e["choices"].as_array().into_iter().flatten() {
            let d = &c["delta"];
            r.content.push_str(d["content"].as_str().unwrap_or_default());
            r.reasoning.push_str(d["reasoning_content"].as_str().unwrap_or_default());
            for t in d["tool_calls"].as_array().into_iter().flatten() {
                let k = t["index"].as_u64().unwrap() as usize;
                let f = &t["function"];
                if k == r.calls.len() {
                    assert_eq!(t["type"], "function", "{t}");
                    assert!(t["id"].as_str().is_some_and(|id| !id.is_empty()), "{t}");
                    r.calls.push((f["name"].as_str().unwrap().to_string(), String::new()));
                } else {
                    assert!(k < r.calls.len(), "call {k} before its head: {t}");
                    let mut keys: Vec<&String> = t.as_object().unwrap().keys().collect();
                    keys.sort();
                    assert_eq!(
                        keys,
                        ["function", "index"],
                        "a later chunk with more than index and arguments: {t}"
                    );
                    assert_eq!(f.as_object().unwrap().keys().collect::<Vec<_>>(), ["arguments"], "{t}");
                }
                r.calls[k].1.push_str(f["arguments"].as_str().unwrap());
            }
            if let Some(f) = c["finish_reason"].as_str() {
                r.finish = f.to_string();
            }
            r.tokens.extend(ids(&c["token_ids"]));
            r.logprobs.extend(logprob_bits(&c["logprobs"]));
        }
    }
    r
}

/// Sends `body` (streamed or not) and reads the reply.
fn ask(addr: SocketAddr, body: &Value) -> Reply {
    if body["stream"] == true {
        let (status, text) =
            http(addr, "POST", "/v1/chat/completions", &body.to_string(), Duration::from_secs(600)).unwrap();
        assert_eq!(status, 200, "{text}");
        streamed_reply(&text)
    } else {
        let (status, v) = post(addr, "/v1/chat/completions", body);
        assert_eq!(status, 200, "{v}");
        reply(&v)
    }
}

/// Request `i` of the scenario: tools, `tool_choice: required`, one call per reply,
/// streamed for odd `i`, sampled with a seed for `i % 4 >= 2`.
fn scenario_request(i: usize) -> Value {
    json!({
        "messages": [{"role": "user", "content": format!("Request {i}: the weather in Oslo for {} days?", i % 7 + 1)}],
        "tools": tools(), "tool_choice": "required", "parallel_tool_calls": false,
        "max_tokens": 96, "logprobs": true, "return_token_ids": true,
        "temperature": if i % 4 >= 2 { 0.9 } else { 0.0 }, "seed": 77 + i,
        "stream": i % 2 == 1,
    })
}

#[test]
fn staggered_tool_calls_are_valid_and_each_as_alone() {
    let addr = start(None);
    let alone: Vec<Reply> = (0..15).map(|i| ask(addr, &scenario_request(i))).collect();
    for (i, r) in alone.iter().enumerate() {
        assert_eq!(r.finish, "tool_calls", "request {i}: {r:?}");
        assert_eq!(r.calls.len(), 1, "request {i}: {r:?}");
        assert!(valid_call(&r.calls[0].0, &r.calls[0].1), "request {i}: {r:?}");
        assert!(r.content.is_empty() && !r.tokens.is_empty() && r.logprobs.len() == r.tokens.len(), "{r:?}");
    }
    // The same requests at once, arriving a few milliseconds apart.
    let together: Vec<Reply> = std::thread::scope(|s| {
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
    // Streamed and not, the same request gives the same reply.
    for i in [0, 2] {
        let mut streamed = scenario_request(i);
        streamed["stream"] = json!(true);
        assert_eq!(ask(addr, &streamed), alone[i], "request {i} streamed");
    }
}

#[test]
fn named_none_and_multi_turn_tool_conversations() {
    let addr = start(None);
    let user = json!([{"role": "user", "content": "what time is it in Paris?"}]);
    let named = json!({"messages": user, "tools": tools(), "max_tokens": 64, "temperature": 0,
                       "tool_choice": {"type": "function", "function": {"name": "get_time"}}});
    let r = ask(addr, &named);
    assert_eq!(
        (r.calls.len(), r.calls[0].0.as_str(), r.finish.as_str()),
        (1, "get_time", "tool_calls"),
        "{r:?}"
    );
    assert!(valid_call("get_time", &r.calls[0].1), "{r:?}");
    // `none`: the tools are shown, no call is parsed.
    let none = json!({"messages": user, "tools": tools(), "tool_choice": "none", "max_tokens": 16, "temperature": 0});
    let r = ask(addr, &none);
    assert!(r.calls.is_empty() && r.finish != "tool_calls", "{r:?}");
    // The call and its result go back to the model; the template renders both.
    let turn = json!({"messages": [
        {"role": "user", "content": "what time is it in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\": \"cet\"}"}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "14:05"}
    ], "tools": tools(), "max_tokens": 8, "temperature": 0});
    let (status, v) = post(addr, "/v1/chat/completions", &turn);
    assert_eq!(status, 200, "{v}");
    // `auto` on a code model: free text (it never writes the trigger), not a 5xx.
    let auto = json!({"messages": user, "tools": tools(), "max_tokens": 12, "temperature": 0});
    let r = ask(addr, &auto);
    assert!(r.finish == "length" || r.finish == "stop" || r.finish == "tool_calls", "{r:?}");
}

/// Parallel calls: replies of several calls (the trained family repeats calls until
/// `max_tokens`, the last cut inside its arguments), streamed and not, the same: each
/// index's concatenated arguments equal the whole reply's, greedy and seeded.
#[test]
fn parallel_calls_stream_as_the_whole_reply() {
    let addr = start(None);
    for (i, prompt) in
        ["the weather in Oslo and the time in utc?", "weather in Lima, Quito and Bogota"].iter().enumerate()
    {
        for temperature in [0.0, 0.9] {
            let body = json!({"messages": [{"role": "user", "content": prompt}], "tools": tools(),
                              "tool_choice": "required", "max_tokens": 120, "logprobs": true,
                              "return_token_ids": true, "temperature": temperature, "seed": 5 + i});
            let whole = ask(addr, &body);
            assert!(whole.calls.len() >= 2, "{prompt:?}: {whole:?}");
            // All whole but the last, which `max_tokens` may cut.
            let done = whole.calls.len() - usize::from(whole.finish == "length");
            assert!(whole.calls[..done].iter().all(|(n, a)| valid_call(n, a)), "{prompt:?}: {whole:?}");
            let mut streamed = body.clone();
            streamed["stream"] = json!(true);
            assert_eq!(ask(addr, &streamed), whole, "{prompt:?} streamed");
        }
    }
}

/// Schemas that say nothing of undeclared keys are closed: `required` calls on the
/// trained family carry only declared keys, each once, and end (the same model loops
/// adding keys until `max_tokens` when the grammar admits them; the constraint crate's
/// test is the negative control, with the schema opened explicitly).
#[test]
fn open_by_default_schemas_yield_only_declared_keys() {
    let addr = start(None);
    let mut open = tools();
    for t in open.as_array_mut().unwrap() {
        t["function"]["parameters"].as_object_mut().unwrap().remove("additionalProperties");
    }
    for i in 0..4 {
        let body = json!({"messages": [{"role": "user", "content": format!("Closed {i}: the weather in Oslo?")}],
                          "tools": open, "tool_choice": "required", "parallel_tool_calls": false,
                          "max_tokens": 96, "temperature": if i % 2 == 1 { 0.9 } else { 0.0 }, "seed": 40 + i,
                          "stream": i >= 2});
        let r = ask(addr, &body);
        assert_eq!((r.finish.as_str(), r.calls.len()), ("tool_calls", 1), "{i}: {r:?}");
        assert!(valid_call(&r.calls[0].0, &r.calls[0].1), "{i}: {r:?}");
    }
}

/// A template that opens the think block in the prompt (as R1 and Qwen3 thinking models'
/// do): the reply starts as reasoning; streamed and whole, the same split.
#[test]
fn reasoning_is_split_from_content_streamed_and_not() {
    let dir = tempdir("reasoning");
    let source = std::fs::read_to_string(trained("target").join("chat_template.jinja")).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), format!("{source}<think>\n")).unwrap();
    let addr = start(Some(&dir));
    let body = json!({"messages": [{"role": "user", "content": "add two numbers"}], "max_tokens": 24,
                      "temperature": 0, "logprobs": true, "return_token_ids": true});
    let whole = ask(addr, &body);
    assert!(!whole.reasoning.is_empty() && whole.content.is_empty(), "{whole:?}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    assert_eq!(ask(addr, &streamed), whole);
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("mtp-server-tools-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The official `openai` Python client (installed by `.ci/run`; set `MTP_PYTHON` to a
/// Python that has it) drives tool calls streamed and not, `response_format` and reasoning;
/// each reply it assembles equals the same request sent here alone.
#[test]
fn the_openai_python_client_drives_tools_and_reasoning() {
    let Some(python) = common::python_with("openai") else { return };
    let think = tempdir("client");
    let source = std::fs::read_to_string(trained("target").join("chat_template.jinja")).unwrap();
    std::fs::write(think.join("chat_template.jinja"), format!("{source}<think>\n")).unwrap();
    for (template, extra) in [(None, None), (Some(think.as_path()), Some("--reasoning"))] {
        let addr = start(template);
        let url = format!("http://{addr}/v1");
        let mut args = vec!["--base-url", &url, "--model", MODEL];
        args.extend(extra);
        let lines: Vec<Value> = common::script_lines(&python, "openai_tools_check.py", &args);
        assert!(lines.len() >= 6, "the script reported {} requests", lines.len());
        for l in &lines {
            let mut request = l["request"].clone();
            request["stream"] = json!(false);
            let want = ask(addr, &request);
            let got = &l["reply"];
            let calls: Vec<(String, String)> = serde_json::from_value(got["calls"].clone()).unwrap();
            let name = &l["name"];
            assert_eq!(calls, want.calls, "{name}");
            assert_eq!(got["content"].as_str().unwrap_or_default(), want.content, "{name}");
            assert_eq!(got["reasoning"].as_str().unwrap_or_default(), want.reasoning, "{name}");
            assert_eq!(got["finish_reason"].as_str().unwrap(), want.finish, "{name}");
            if request.get("parallel_tool_calls") == Some(&json!(true)) {
                let done = calls.len() - usize::from(want.finish == "length");
                assert!(
                    calls.len() >= 2 && calls[..done].iter().all(|(n, a)| valid_call(n, a)),
                    "{name}: {calls:?}"
                );
            } else if request.get("tools").is_some() {
                assert!(calls.len() == 1 && valid_call(&calls[0].0, &calls[0].1), "{name}: {calls:?}");
            }
            if request.get("response_format").is_some() {
                assert!(valid_call("get_weather", &want.content), "{name}: {:?}", want.content);
            }
            if extra.is_some() {
                assert!(!want.reasoning.is_empty(), "{name}: no reasoning came back");
            }
        }
    }
}

/// The bounded load run: 500 tool-calling requests (50 distinct bodies, each sent 10
/// times, half of them streamed) at concurrency 64 on loopback. 0 malformed calls (every
/// reply is one call valid for its schema, every streamed chunk complete), 0 leaks
/// (every reply equals its own body's reply alone, and the bodies' replies differ).
#[test]
fn five_hundred_tool_calls_at_concurrency_64() {
    let addr = start(None);
    let body = |j: usize, stream: bool| -> Value {
        let mut b = scenario_request(j);
        b["messages"][0]["content"] = json!(format!("Load {j}: the weather in city {j}?"));
        b["stream"] = json!(stream);
        b["max_tokens"] = json!(64);
        b
    };
    let alone: Vec<Reply> = (0..50).map(|j| ask(addr, &body(j, false))).collect();
    let distinct: std::collections::HashSet<String> =
        alone.iter().map(|r| format!("{:?}", r.tokens)).collect();
    assert!(distinct.len() > 25, "the bodies' replies are too alike to show a leak: {}", distinct.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..64)
            .map(|_| {
                s.spawn(|| {
                    let mut bad = Vec::new();
                    loop {
                        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if n >= 500 {
                            return bad;
                        }
                        let (j, stream) = (n % 50, n % 2 == 1);
                        let got = ask(addr, &body(j, stream));
                        let valid = got.calls.len() == 1 && valid_call(&got.calls[0].0, &got.calls[0].1);
                        if !valid || got != alone[j] {
                            bad.push(format!("request {n} (body {j}, stream {stream}): {got:?}"));
                        }
                    }
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    });
    assert!(
        failures.is_empty(),
        "{} of 500 differ or are malformed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
