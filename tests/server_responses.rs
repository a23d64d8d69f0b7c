//! `POST /v1/responses` over HTTP on the trained family (Hermes calls, its MTP head, batch
//! 8): a text reply is the same request's reply through `/v1/chat/completions` (text,
//! token counts, finish), greedy and seeded, with `instructions` as the system message;
//! `tool_choice` required and named give function calls valid for their schema; a
//! `function_call` / `function_call_output` round trip answers as the chat conversation
//! it means; streamed events come in the Responses order, numbered, their deltas
//! concatenating to the unstreamed reply and `response.completed` restating it;
//! `text.format` json_schema gives a valid document; 15 staggered tool-calling requests
//! each as alone; bad requests are refused naming the Responses field; and the official
//! `openai` Python client drives it (`responses.create`, `responses.stream`, `parse`).

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::http::{http, post};
use common::server::{trained_server, MODEL};
use common::trained;
use mtp::server::ServerOptions;
use serde_json::{json, Value};

/// A server on the trained family ([`common::server::trained_server`]), the chat template
/// from `template_dir` (the checkpoint's own when `None`).
fn start(template_dir: Option<&Path>) -> SocketAddr {
    trained_server(template_dir, ServerOptions::default())
}

/// Responses' flat function tools.
fn tools() -> Value {
    json!([
        {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": true,
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                        "required": ["city"], "additionalProperties": false}},
        {"type": "function", "name": "get_time",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                        "required": ["zone"], "additionalProperties": false}}
    ])
}

/// The same tools in chat's shape.
fn chat_tools() -> Value {
    let list = tools()
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let mut f = t.clone();
            f.as_object_mut().unwrap().remove("type");
            json!({"type": "function", "function": f})
        })
        .collect();
    Value::Array(list)
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

/// One output item without its id: (type, status, text or name, arguments, call id
/// present).
type Item = (String, String, String, String);

/// What a `Response` came to, ids and times aside.
#[derive(Debug, PartialEq, Clone)]
struct Reply {
    status: String,
    items: Vec<Item>,
    input_tokens: u64,
    output_tokens: u64,
}

impl Reply {
    fn text(&self) -> String {
        self.items.iter().filter(|i| i.0 == "message").map(|i| i.2.clone()).collect()
    }
    fn calls(&self) -> Vec<(String, String)> {
        self.items.iter().filter(|i| i.0 == "function_call").map(|i| (i.2.clone(), i.3.clone())).collect()
    }
}

fn item(v: &Value) -> Item {
    let kind = v["type"].as_str().unwrap().to_string();
    assert!(v["id"].as_str().is_some_and(|id| !id.is_empty()), "an item without id: {v}");
    let status = v["status"].as_str().unwrap().to_string();
    match kind.as_str() {
        "message" => {
            assert_eq!(v["role"], "assistant", "{v}");
            let parts = v["content"].as_array().unwrap();
            assert_eq!(parts.len(), 1, "{v}");
            assert_eq!(
                (&parts[0]["type"], &parts[0]["annotations"]),
                (&json!("output_text"), &json!([])),
                "{v}"
            );
            (kind, status, parts[0]["text"].as_str().unwrap().to_string(), String::new())
        }
        "function_call" => {
            assert!(v["call_id"].as_str().is_some_and(|c| c.starts_with("call_")), "{v}");
            (
                kind,
                status,
                v["name"].as_str().unwrap().to_string(),
                v["arguments"].as_str().unwrap().to_string(),
            )
        }
        "reasoning" => {
            let text: String =
                v["content"].as_array().unwrap().iter().map(|p| p["text"].as_str().unwrap()).collect();
            (kind, status, text, String::new())
        }
        other => panic!("unexpected item type {other}: {v}"),
    }
}

/// A `Response` object's reply, after checking its shape.
fn reply(v: &Value) -> Reply {
    assert_eq!(v["object"], "response", "{v}");
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("resp_")), "{v}");
    assert!(v["created_at"].as_u64().is_some_and(|t| t > 1_600_000_000), "{v}");
    assert_eq!((&v["model"], &v["store"], &v["error"]), (&json!(MODEL), &json!(false), &Value::Null), "{v}");
    let status = v["status"].as_str().unwrap().to_string();
    let reason = if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null };
    assert_eq!(v["incomplete_details"], reason, "{v}");
    let u = &v["usage"];
    let (input, output) = (u["input_tokens"].as_u64().unwrap(), u["output_tokens"].as_u64().unwrap());
    assert_eq!(u["total_tokens"].as_u64(), Some(input + output), "{v}");
    Reply {
        status,
        items: v["output"].as_array().unwrap().iter().map(item).collect(),
        input_tokens: input,
        output_tokens: output,
    }
}

/// Sends a Responses body (not streamed) and reads its reply.
fn ask(addr: SocketAddr, body: &Value) -> Reply {
    let (status, v) = post(addr, "/v1/responses", body);
    assert_eq!(status, 200, "{v}");
    reply(&v)
}

/// The events of a Responses stream, checked: each `event:` line names its data's
/// `type`, `sequence_number` counts from 0, nothing follows the last event.
fn events(body: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for block in body.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let line = |p: &str| block.lines().find_map(|l| l.strip_prefix(p)).map(str::to_string);
        let (name, data) = (line("event: ").expect(block), line("data: ").expect(block));
        let v: Value = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"));
        assert_eq!(v["type"], json!(name), "{block}");
        assert_eq!(v["sequence_number"], json!(out.len()), "{block}");
        out.push(v);
    }
    out
}

/// A streamed reply: checks the events' order (created, in_progress, each item added,
/// its content, done; the end), that every delta concatenates to its item's text and that
/// each item as `.done` and in the final `Response` is what its deltas built; returns the
/// final `Response`'s reply.
fn streamed(addr: SocketAddr, body: &Value) -> Reply {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let (status, text) =
        http(addr, "POST", "/v1/responses", &body.to_string(), Duration::from_secs(600)).unwrap();
    assert_eq!(status, 200, "{text}");
    let ev = events(&text);
    let kinds: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds[..2], ["response.created", "response.in_progress"], "{kinds:?}");
    assert_eq!(ev[0]["response"]["status"], "in_progress");
    let last = ev.last().unwrap();
    let end = last["type"].as_str().unwrap();
    assert!(end == "response.completed" || end == "response.incomplete", "{kinds:?}");
    let final_reply = reply(&last["response"]);
    assert_eq!(end, format!("response.{}", final_reply.status));
    // Each item: added, its content's events, done, before the next is added.
    let mut built: Vec<Value> = Vec::new();
    let mut open: Option<(usize, String, String)> = None; // index, id, text so far
    for e in &ev[2..ev.len() - 1] {
        let kind = e["type"].as_str().unwrap();
        let index = e["output_index"].as_u64().unwrap() as usize;
        match kind {
            "response.output_item.added" => {
                assert!(open.is_none(), "an item added before the last was done: {e}");
                assert_eq!(index, built.len(), "{e}");
                assert_eq!(e["item"]["status"], "in_progress", "{e}");
                open = Some((index, e["item"]["id"].as_str().unwrap().to_string(), String::new()));
            }
            "response.output_item.done" => {
                let (i, id, text) = open.take().expect("done without added");
                assert_eq!((index, e["item"]["id"].as_str().unwrap()), (i, id.as_str()), "{e}");
                let it = item(&e["item"]);
                let whole = if it.0 == "function_call" { &it.3 } else { &it.2 };
                assert_eq!(*whole, text, "the deltas of item {i} do not make its text");
                built.push(e["item"].clone());
            }
            _ => {
                let (i, id, text) = open.as_mut().expect("content outside an item");
                assert_eq!((index, e["item_id"].as_str().unwrap()), (*i, id.as_str()), "{e}");
                match kind {
                    "response.output_text.delta" | "response.reasoning_text.delta" => {
                        assert_eq!(e["content_index"], 0, "{e}");
                        text.push_str(e["delta"].as_str().unwrap())
                    }
                    "response.function_call_arguments.delta" => text.push_str(e["delta"].as_str().unwrap()),
                    "response.output_text.done" | "response.reasoning_text.done" => {
                        assert_eq!(e["text"].as_str().unwrap(), text, "{e}")
                    }
                    "response.function_call_arguments.done" => {
                        assert_eq!(e["arguments"].as_str().unwrap(), text, "{e}")
                    }
                    "response.content_part.added" | "response.content_part.done" => {
                        assert_eq!(e["content_index"], 0, "{e}")
                    }
                    other => panic!("unexpected event {other}: {e}"),
                }
            }
        }
    }
    assert!(open.is_none(), "an item never done: {kinds:?}");
    assert_eq!(
        last["response"]["output"],
        Value::Array(built),
        "the final response's items are not those sent"
    );
    final_reply
}

fn chat(addr: SocketAddr, body: &Value) -> Value {
    let (status, v) = post(addr, "/v1/chat/completions", body);
    assert_eq!(status, 200, "{v}");
    v
}

/// Refuses `body` with 400 naming `param`.
fn refused(addr: SocketAddr, body: Value, param: &str) {
    let (status, v) = post(addr, "/v1/responses", &body);
    assert_eq!(status, 400, "{body} -> {v}");
    assert_eq!(v["error"]["param"], json!(param), "{body} -> {v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body} -> {v}");
}

/// Text replies are the chat endpoint's for the same request: text, prompt and output
/// token counts, finish; greedy and seeded; `instructions` is the system message; the
/// stream's deltas concatenate to the same reply.
#[test]
fn text_replies_are_the_chat_replies() {
    let addr = start(None);
    for (i, (temperature, instructions)) in
        [(0.0, None), (0.9, Some("Answer in French.")), (0.0, Some("Be brief."))].into_iter().enumerate()
    {
        let prompt = format!("Case {i}: write a function that adds two numbers");
        let mut body = json!({"model": MODEL, "input": prompt, "max_output_tokens": 24,
                              "temperature": temperature, "seed": 11 + i, "store": false,
                              "metadata": {"case": format!("{i}")}});
        let mut messages = vec![json!({"role": "user", "content": prompt})];
        if let Some(s) = instructions {
            body["instructions"] = json!(s);
            messages.insert(0, json!({"role": "system", "content": s}));
        }
        let (status, v) = post(addr, "/v1/responses", &body);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["metadata"], json!({"case": format!("{i}")}));
        assert_eq!(v["instructions"], json!(instructions));
        let r = reply(&v);
        let c = chat(
            addr,
            &json!({"messages": messages, "max_completion_tokens": 24,
                                   "temperature": temperature, "seed": 11 + i}),
        );
        let want_status =
            if c["choices"][0]["finish_reason"] == "length" { "incomplete" } else { "completed" };
        assert_eq!(r.status, want_status, "{r:?}");
        assert_eq!(r.text(), c["choices"][0]["message"]["content"].as_str().unwrap(), "case {i}");
        assert!(!r.text().is_empty(), "{r:?}");
        assert_eq!(r.input_tokens, c["usage"]["prompt_tokens"].as_u64().unwrap());
        assert_eq!(r.output_tokens, c["usage"]["completion_tokens"].as_u64().unwrap());
        assert_eq!(r.items.len(), 1, "{r:?}");
        assert_eq!(streamed(addr, &body), r, "case {i} streamed");
    }
    // The input as a list of message items, content as parts, says the same.
    let as_items = json!({"input": [{"type": "message", "role": "user",
                                     "content": [{"type": "input_text", "text": "Case 0: write a function "},
                                                 {"type": "input_text", "text": "that adds two numbers"}]}],
                          "max_output_tokens": 24, "temperature": 0});
    let plain = json!({"input": "Case 0: write a function that adds two numbers", "max_output_tokens": 24,
                       "temperature": 0});
    assert_eq!(ask(addr, &as_items), ask(addr, &plain));
}

/// `tool_choice` required and named give one function call valid for its schema (the
/// chat endpoint's call for the same request), streamed the same; the call and its
/// output sent back answer as the chat conversation they mean.
#[test]
fn function_calls_and_their_outputs_round_trip() {
    let addr = start(None);
    let user = "what is the weather in Oslo?";
    for (choice, chat_choice, name) in [
        (json!("required"), json!("required"), None),
        (
            json!({"type": "function", "name": "get_time"}),
            json!({"type": "function", "function": {"name": "get_time"}}),
            Some("get_time"),
        ),
    ] {
        let body = json!({"input": user, "tools": tools(), "tool_choice": choice, "parallel_tool_calls": false,
                          "max_output_tokens": 96, "temperature": 0});
        let r = ask(addr, &body);
        assert_eq!(r.status, "completed", "{r:?}");
        let calls = r.calls();
        assert_eq!(calls.len(), 1, "{r:?}");
        assert!(valid_call(&calls[0].0, &calls[0].1), "{r:?}");
        if let Some(n) = name {
            assert_eq!(calls[0].0, n);
        }
        let c = chat(
            addr,
            &json!({"messages": [{"role": "user", "content": user}], "tools": chat_tools(),
                                   "tool_choice": chat_choice, "parallel_tool_calls": false,
                                   "max_completion_tokens": 96, "temperature": 0}),
        );
        let call = &c["choices"][0]["message"]["tool_calls"][0]["function"];
        assert_eq!(
            (call["name"].as_str().unwrap(), call["arguments"].as_str().unwrap()),
            (calls[0].0.as_str(), calls[0].1.as_str())
        );
        assert_eq!(r.output_tokens, c["usage"]["completion_tokens"].as_u64().unwrap());
        assert_eq!(streamed(addr, &body), r, "{choice} streamed");
    }
    // The round trip: the call and its output go back to the model, as chat's assistant
    // tool_calls and tool message.
    let first = {
        let (status, v) = post(
            addr,
            "/v1/responses",
            &json!({"input": user, "tools": tools(), "tool_choice": "required",
                                                             "parallel_tool_calls": false, "max_output_tokens": 96, "temperature": 0}),
        );
        assert_eq!(status, 200, "{v}");
        v["output"][0].clone()
    };
    assert_eq!(first["type"], "function_call", "{first}");
    let call_id = first["call_id"].as_str().unwrap();
    let mut input = vec![json!({"role": "user", "content": user})];
    input.push(first.clone()); // as the SDK sends it back: id and status included
    input.push(json!({"type": "function_call_output", "call_id": call_id, "output": "{\"temp_c\": 4}"}));
    let body = json!({"input": input, "tools": tools(), "max_output_tokens": 16, "temperature": 0});
    let r = ask(addr, &body);
    let c = chat(
        addr,
        &json!({"messages": [
        {"role": "user", "content": user},
        {"role": "assistant", "content": null, "tool_calls": [{"id": call_id, "type": "function",
            "function": {"name": first["name"], "arguments": first["arguments"]}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "{\"temp_c\": 4}"}
    ], "tools": chat_tools(), "max_completion_tokens": 16, "temperature": 0}),
    );
    assert_eq!(
        r.input_tokens,
        c["usage"]["prompt_tokens"].as_u64().unwrap(),
        "the conversation renders differently"
    );
    assert_eq!(r.output_tokens, c["usage"]["completion_tokens"].as_u64().unwrap());
    let m = &c["choices"][0]["message"];
    assert_eq!(r.text(), m["content"].as_str().unwrap_or_default());
    let chat_calls: Vec<(String, String)> = m["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            (
                t["function"]["name"].as_str().unwrap().to_string(),
                t["function"]["arguments"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(r.calls(), chat_calls);
    // Without the tool's output the prompt is shorter: the output item was rendered.
    let mut without = body.clone();
    without["input"].as_array_mut().unwrap().pop();
    assert!(ask(addr, &without).input_tokens < r.input_tokens);
}

/// `text.format` json_schema: the output text is a document valid for the schema
/// (streamed the same); json_object: a JSON object.
#[test]
fn text_format_json_schema_gives_a_valid_document() {
    let addr = start(None);
    let schema = tools()[0]["parameters"].clone();
    for (i, temperature) in [0.0, 0.8].into_iter().enumerate() {
        let body = json!({"input": format!("Doc {i}: the weather in Lima as JSON"), "max_output_tokens": 64,
                          "temperature": temperature, "seed": 3 + i,
                          "text": {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": true}}});
        let (status, v) = post(addr, "/v1/responses", &body);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["text"]["format"]["name"], "weather");
        let r = reply(&v);
        assert_eq!(r.status, "completed", "{r:?}");
        assert!(valid_call("get_weather", &r.text()), "{r:?}");
        assert_eq!(streamed(addr, &body), r);
    }
    let body = json!({"input": "a JSON object please", "max_output_tokens": 48, "temperature": 0,
                      "text": {"format": {"type": "json_object"}}});
    let r = ask(addr, &body);
    if r.status == "completed" {
        assert!(serde_json::from_str::<Value>(&r.text()).is_ok_and(|v| v.is_object()), "{r:?}");
    } else {
        assert!(r.text().trim_start().starts_with('{'), "{r:?}");
    }
}

/// A template that opens the think block: the reply starts as a reasoning item, streamed
/// and whole the same, its text the chat endpoint's `reasoning_content`.
#[test]
fn reasoning_becomes_a_reasoning_item() {
    let dir = std::env::temp_dir().join(format!("mtp-server-responses-think-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = std::fs::read_to_string(trained("target").join("chat_template.jinja")).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), format!("{source}<think>\n")).unwrap();
    let addr = start(Some(&dir));
    let body = json!({"input": "add two numbers", "max_output_tokens": 24, "temperature": 0});
    let r = ask(addr, &body);
    assert_eq!(r.items[0].0, "reasoning", "{r:?}");
    assert!(!r.items[0].2.is_empty(), "{r:?}");
    let c = chat(
        addr,
        &json!({"messages": [{"role": "user", "content": "add two numbers"}], "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(r.items[0].2, c["choices"][0]["message"]["reasoning_content"].as_str().unwrap());
    assert_eq!(streamed(addr, &body), r);
}

/// Request `i` of the scenario: tools, `tool_choice: required`, one call per reply,
/// streamed for odd `i`, sampled with a seed for `i % 4 >= 2`.
fn scenario_request(i: usize) -> Value {
    json!({
        "input": format!("Request {i}: the weather in Oslo for {} days?", i % 7 + 1),
        "tools": tools(), "tool_choice": "required", "parallel_tool_calls": false, "max_output_tokens": 96,
        "temperature": if i % 4 >= 2 { 0.9 } else { 0.0 }, "seed": 77 + i,
    })
}

fn scenario_ask(addr: SocketAddr, i: usize) -> Reply {
    if i % 2 == 1 {
        streamed(addr, &scenario_request(i))
    } else {
        ask(addr, &scenario_request(i))
    }
}

#[test]
fn staggered_tool_calls_are_valid_and_each_as_alone() {
    let addr = start(None);
    let alone: Vec<Reply> = (0..15).map(|i| scenario_ask(addr, i)).collect();
    for (i, r) in alone.iter().enumerate() {
        let calls = r.calls();
        assert_eq!((r.status.as_str(), calls.len()), ("completed", 1), "request {i}: {r:?}");
        assert!(valid_call(&calls[0].0, &calls[0].1), "request {i}: {r:?}");
        assert_eq!(r.items.len(), 1, "request {i}: {r:?}");
    }
    let together: Vec<Reply> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..15)
            .map(|i| {
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(5 * i as u64));
                    scenario_ask(addr, i)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (got, want)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(got, want, "request {i} differs from the same request alone");
    }
    for i in [0, 2] {
        assert_eq!(streamed(addr, &scenario_request(i)), alone[i], "request {i} streamed");
    }
}

#[test]
fn bad_requests_are_refused_naming_the_field() {
    let addr = start(None);
    let hi = |extra: Value| {
        let mut b = json!({"input": "hi", "max_output_tokens": 4});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    refused(addr, hi(json!({"previous_response_id": "resp_1"})), "previous_response_id");
    refused(addr, hi(json!({"temprature": 0.5})), "temprature");
    refused(addr, hi(json!({"store": true})), "store");
    refused(addr, hi(json!({"max_output_tokens": 0})), "max_output_tokens");
    refused(addr, hi(json!({"temperature": -1})), "temperature");
    refused(addr, hi(json!({"tools": [{"type": "function", "name": "a b"}]})), "tools[0].name");
    refused(addr, hi(json!({"tools": [{"type": "web_search_preview"}]})), "tools[0].type");
    refused(
        addr,
        hi(json!({"tools": tools(), "tool_choice": {"type": "function", "name": "nope"}})),
        "tool_choice.name",
    );
    refused(
        addr,
        hi(json!({"text": {"format": {"type": "json_schema", "name": "x"}}})),
        "text.format.schema",
    );
    refused(
        addr,
        hi(json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}})),
        "text.format.schema",
    );
    let (status, v) = post(addr, "/v1/responses", &hi(json!({"model": "gpt-5"})));
    assert_eq!((status, &v["error"]["param"]), (404, &json!("model")), "{v}");
    refused(addr, json!({"max_output_tokens": 4}), "input");
    refused(
        addr,
        json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
        "input[0].content[0].type",
    );
    refused(addr, json!({"input": [{"role": "user", "content": "hi", "colour": 1}]}), "input[0].colour");
    refused(
        addr,
        json!({"input": [{"role": "user", "content": "hi"},
                                   {"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]}),
        "input[1].arguments",
    );
    refused(addr, json!({"input": [{"type": "item_reference", "id": "msg_1"}]}), "input[0].type");
    let (status, text) = http(addr, "POST", "/v1/responses", "{", Duration::from_secs(10)).unwrap();
    assert_eq!(status, 400, "{text}");
    // Neutral values of what is refused pass.
    let (status, v) = post(
        addr,
        "/v1/responses",
        &hi(json!({"store": false, "include": [], "truncation": "disabled",
                                                          "reasoning": {"effort": null}, "background": false,
                                                          "user": "u", "service_tier": "auto"})),
    );
    assert_eq!(status, 200, "{v}");
}

/// The official `openai` Python client drives `/v1/responses`
/// (scripts/openai_responses_check.py): each reply it reads equals the same request sent
/// here, and what it checks itself (streams assembled by its helper, `parse` into a
/// pydantic model) passes.
#[test]
fn the_openai_python_client_drives_responses() {
    let Some(python) = common::python_with("openai") else { return };
    let addr = start(None);
    let url = format!("http://{addr}/v1");
    let lines: Vec<Value> =
        common::script_lines(&python, "openai_responses_check.py", &["--base-url", &url, "--model", MODEL]);
    assert!(lines.len() >= 10, "the script reported {} requests", lines.len());
    for l in &lines {
        if l["name"] == "agents" {
            // The Agents SDK's run (when the Python has `openai-agents`): the tool was called.
            assert!(l["tool_calls"].as_array().is_some_and(|c| !c.is_empty()), "{l}");
            continue;
        }
        let want = ask(addr, &l["request"]);
        let name = &l["name"];
        let got = &l["reply"];
        assert_eq!(got["status"].as_str().unwrap(), want.status, "{name}");
        assert_eq!(got["text"].as_str().unwrap(), want.text(), "{name}");
        let calls: Vec<(String, String)> = serde_json::from_value(got["calls"].clone()).unwrap();
        assert_eq!(calls, want.calls(), "{name}");
        assert_eq!(got["output_tokens"].as_u64().unwrap(), want.output_tokens, "{name}");
        if l["request"].get("tool_choice").is_some() {
            assert!(calls.len() == 1 && valid_call(&calls[0].0, &calls[0].1), "{name}: {calls:?}");
        }
    }
}

/// `include: ["message.output_text.logprobs"]` with `top_logprobs` gives the message text
/// the chat endpoint's logprobs for the same request (token, logprob, bytes and the
/// alternatives, without ids), unstreamed and streamed (each text delta carrying its
/// tokens', the `.done` event and the final `Response` all of them); another `include`
/// entry, `top_logprobs` over 20 and logprobs beside tools are refused by name.
#[test]
fn text_logprobs_are_the_chat_replys() {
    let addr = start(None);
    let body = json!({"input": "write a sort", "max_output_tokens": 12, "temperature": 0,
                      "include": ["message.output_text.logprobs"], "top_logprobs": 2});
    let c = chat(
        addr,
        &json!({"messages": [{"role": "user", "content": "write a sort"}], "max_tokens": 12, "temperature": 0,
                "logprobs": true, "top_logprobs": 2}),
    );
    let strip = |e: &Value| json!({"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]});
    let want: Vec<Value> = c["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let mut v = strip(e);
            v["top_logprobs"] = e["top_logprobs"].as_array().unwrap().iter().map(strip).collect();
            v
        })
        .collect();
    assert_eq!(want.len(), 12, "{c}");
    let message = |r: &Value| -> Value {
        let items = r["output"].as_array().unwrap();
        items.iter().find(|i| i["type"] == "message").unwrap()["content"][0]["logprobs"].clone()
    };
    let (status, v) = post(addr, "/v1/responses", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!((message(&v), &v["top_logprobs"]), (json!(want), &json!(2)), "{v}");
    let mut asked = body.clone();
    asked["stream"] = json!(true);
    let (status, text) =
        http(addr, "POST", "/v1/responses", &asked.to_string(), Duration::from_secs(600)).unwrap();
    assert_eq!(status, 200, "{text}");
    let ev = events(&text);
    let of = |kind: &'static str| ev.iter().filter(move |e| e["type"] == kind);
    let carried: Vec<Value> =
        of("response.output_text.delta").flat_map(|e| e["logprobs"].as_array().unwrap().clone()).collect();
    assert_eq!(carried, want, "the deltas' logprobs");
    let done = of("response.output_text.done").next().unwrap();
    assert_eq!(done["logprobs"], json!(want));
    assert_eq!(message(&ev.last().unwrap()["response"]), json!(want));
    // Unasked, none.
    let (_, plain) = post(addr, "/v1/responses", &json!({"input": "write a sort", "max_output_tokens": 4}));
    assert_eq!(message(&plain), json!([]), "{plain}");
    refused(addr, json!({"input": "hi", "include": ["reasoning.encrypted_content"]}), "include[0]");
    refused(addr, json!({"input": "hi", "include": "x"}), "include");
    refused(addr, json!({"input": "hi", "top_logprobs": 21}), "top_logprobs");
    refused(
        addr,
        json!({"input": "hi", "tools": tools(), "include": ["message.output_text.logprobs"]}),
        "include",
    );
}
