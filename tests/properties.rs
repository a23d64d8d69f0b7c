//! Property tests over random inputs (seeded, so a failure reproduces; bounded, a few
//! seconds each): tool and response schemas built from JSON Schema's keywords at random
//! compile or are refused with a message, never a panic, and an endless one is always
//! refused before compiling; random chat conversations (roles, content, calls, results,
//! special-token text) through `/v1/chat/completions` get 200 or a 4xx naming a
//! `messages` field or another request field, never a 5xx; valid bodies of every POST
//! endpoint with random fields set to careless or hostile values get 200 or a 4xx, never a
//! 5xx. (Configs get the same treatment
//! field by field in `tests/loading.rs`; request fields in `tests/server_requests.rs`.)

mod common;

use std::time::{Duration, Instant};

use common::http::http;
use common::server::{trained_server, MODEL};
use common::trained;
use mtp::base::Tokenizer;
use mtp::engine::{Constraint, Grammars};
use mtp::server::ServerOptions;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};

/// A random schema `depth` levels deep at most, from JSON Schema's keywords (some of them
/// contradictory, recursive or malformed on purpose).
fn schema(rng: &mut StdRng, depth: u32) -> Value {
    let leaf = depth == 0 || rng.random_bool(0.3);
    let pick = |rng: &mut StdRng, xs: &[&str]| xs[rng.random_range(0..xs.len())].to_string();
    if leaf {
        return match rng.random_range(0..8) {
            0 => json!({"type": pick(rng, &["string", "integer", "number", "boolean", "null"])}),
            1 => {
                json!({"type": "string", "maxLength": rng.random_range(0..5), "minLength": rng.random_range(0..5)})
            }
            2 => {
                json!({"type": "integer", "minimum": rng.random_range(-3..3), "maximum": rng.random_range(-3..3)})
            }
            3 => json!({"enum": ["a", 1, null]}),
            4 => json!({"$ref": pick(rng, &["#", "#/$defs/n", "#/$defs/missing", "#/properties/a"])}),
            5 => json!(rng.random_bool(0.5)),
            6 => json!({"type": "string", "pattern": pick(rng, &["^[a-z]+$", "(", "a{2,3}", "\\d*"])}),
            _ => json!({"const": "x"}),
        };
    }
    let mut m = Map::new();
    match rng.random_range(0..5) {
        0 | 1 => {
            let n = rng.random_range(0..4);
            let props: Map<String, Value> =
                (0..n).map(|i| (["a", "b", "c", "d"][i].to_string(), schema(rng, depth - 1))).collect();
            let required: Vec<Value> =
                props.keys().filter(|_| rng.random_bool(0.6)).map(|k| json!(k)).collect();
            m.insert("type".into(), json!("object"));
            m.insert("properties".into(), Value::Object(props));
            m.insert("required".into(), Value::Array(required));
            if rng.random_bool(0.3) {
                m.insert("additionalProperties".into(), schema(rng, depth - 1));
            }
        }
        2 => {
            m.insert("type".into(), json!("array"));
            m.insert("items".into(), schema(rng, depth - 1));
            m.insert("minItems".into(), json!(rng.random_range(0..3)));
        }
        3 => {
            let key = pick(rng, &["anyOf", "oneOf", "allOf"]);
            let n = rng.random_range(0..3);
            m.insert(key, Value::Array((0..n).map(|_| schema(rng, depth - 1)).collect()));
        }
        _ => {
            m.insert("type".into(), json!(["object", "null"]));
            m.insert("properties".into(), json!({"a": schema(rng, depth - 1)}));
            m.insert("required".into(), json!(["a"]));
        }
    }
    if rng.random_bool(0.3) {
        m.insert("$defs".into(), json!({"n": schema(rng, depth - 1)}));
    }
    Value::Object(m)
}

/// 400 random schemas: each is refused as endless, or compiles, or is refused by the
/// grammar compiler with a message; never a panic, each within a second. The endless check
/// agrees with itself under closing (what the server compiles). Control: the known endless
/// and finite shapes are told apart.
#[test]
fn random_schemas_compile_or_are_refused_never_panic() {
    let dir = trained("target");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let grammars = Grammars::new(&tok, 2048, &[0]).unwrap();
    let mut rng = StdRng::seed_from_u64(76);
    let (mut endless, mut compiled, mut refused) = (0, 0, 0);
    for case in 0..400 {
        let s = schema(&mut rng, 3);
        let t = Instant::now();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let finite = mtp::engine::check_finite_schema(&s);
            let closed = mtp::engine::closed_schema(&s);
            assert_eq!(
                finite.is_ok(),
                mtp::engine::check_finite_schema(&closed).is_ok(),
                "closing changed it"
            );
            if finite.is_err() {
                return 0;
            }
            match grammars.compile(&Constraint::JsonSchema(closed)) {
                Ok(_) => 1,
                Err(e) => {
                    assert!(!e.is_empty());
                    2
                }
            }
        }));
        match outcome {
            Ok(0) => endless += 1,
            Ok(1) => compiled += 1,
            Ok(_) => refused += 1,
            Err(_) => panic!("case {case}: panicked on {s}"),
        }
        assert!(t.elapsed() < Duration::from_secs(1), "case {case} took {:?}: {s}", t.elapsed());
    }
    eprintln!("{endless} endless, {compiled} compiled, {refused} refused by the compiler");
    assert!(endless > 0 && compiled > 0, "the generator reaches both kinds");
    assert!(mtp::engine::check_finite_schema(
        &json!({"type": "array", "items": {"$ref": "#"}, "minItems": 1})
    )
    .is_err());
    assert!(mtp::engine::check_finite_schema(&json!({"type": "array", "items": {"$ref": "#"}})).is_ok());
}

/// A random chat message: any of the roles (and unknown ones), content as text, parts or
/// null, with special-token text, long or unicode strings, calls and results.
fn message(rng: &mut StdRng, i: usize) -> Value {
    let texts = ["hi", "", "<|im_start|>system", "<|endoftext|>", "é\u{0}ü", "{\"a\": 1}", "<tool_call>"];
    let text = |rng: &mut StdRng| match rng.random_range(0..10) {
        0 => "x".repeat(rng.random_range(0..3000)),
        _ => texts[rng.random_range(0..texts.len())].to_string(),
    };
    let role = ["user", "system", "assistant", "tool", "developer", "robot"][rng.random_range(0..6)];
    let mut m = json!({"role": role});
    match rng.random_range(0..5) {
        0 => m["content"] = Value::Null,
        1 => {
            let kind = ["text", "image_url"][rng.random_range(0..2)];
            m["content"] = json!([{"type": "text", "text": text(rng)}, {"type": kind, "text": "t"}]);
        }
        _ => m["content"] = json!(text(rng)),
    }
    if role == "assistant" && rng.random_bool(0.4) {
        let arguments = ["{}", "{\"city\": \"Paris\"}", "not json", "[1]"][rng.random_range(0..4)];
        let name = ["get_weather", "nope", ""][rng.random_range(0..3)];
        m["tool_calls"] = json!([{"id": format!("c{i}"), "type": "function",
                                   "function": {"name": name, "arguments": arguments}}]);
    }
    if role == "tool" {
        m["tool_call_id"] = json!(format!("c{}", rng.random_range(0..i.max(1))));
    }
    m
}

/// 150 random conversations (1-6 messages, sometimes with tools and tool_choice) through
/// the chat endpoint: 200, or a 400 whose `param` names a field of the request; never a
/// 5xx. Control: a plain user message is answered 200.
#[test]
fn random_conversations_are_answered_or_refused_by_field() {
    let addr = trained_server(None, ServerOptions::default());
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]);
    let mut rng = StdRng::seed_from_u64(7600);
    let send = |body: &Value| {
        http(addr, "POST", "/v1/chat/completions", &body.to_string(), Duration::from_secs(60)).unwrap()
    };
    let plain = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    assert_eq!(send(&plain).0, 200, "control");
    let (mut ok, mut refused) = (0, 0);
    for case in 0..150 {
        let n = rng.random_range(1..7);
        let messages: Vec<Value> = (0..n).map(|i| message(&mut rng, i)).collect();
        let mut body = json!({"model": MODEL, "messages": messages, "max_tokens": 2});
        if rng.random_bool(0.4) {
            body["tools"] = tools.clone();
            body["tool_choice"] = json!(["auto", "required", "none"][rng.random_range(0..3)]);
        }
        let (status, text) = send(&body);
        match status {
            200 => ok += 1,
            400 | 413 => {
                let v: Value =
                    serde_json::from_str(&text).unwrap_or_else(|e| panic!("case {case}: {e}: {text}"));
                let param = v["error"]["param"].as_str().unwrap_or_default();
                assert!(
                    ["messages", "tools", "tool_choice"].iter().any(|p| param.starts_with(p)),
                    "case {case}: {status} names `{param}`: {text}\n{body}"
                );
                refused += 1;
            }
            _ => panic!("case {case}: {status} {text}\n{body}"),
        }
    }
    eprintln!("{ok} answered, {refused} refused");
    assert!(ok > 0 && refused > 0, "the generator reaches both");
}

/// A random JSON value from values careless and hostile clients send.
fn hostile(rng: &mut StdRng, depth: u32) -> Value {
    match rng.random_range(0..14) {
        0 => Value::Null,
        1 => json!(rng.random_bool(0.5)),
        2 => json!(-1),
        3 => json!(0),
        4 => json!(1e308),
        5 => json!(u64::MAX),
        6 => json!(rng.random_range(0..40)),
        7 => json!("<|im_start|>"),
        8 => json!("x".repeat(rng.random_range(0..200))),
        9 => json!(MODEL),
        10 if depth > 0 => {
            Value::Array((0..rng.random_range(0..4)).map(|_| hostile(rng, depth - 1)).collect())
        }
        11 if depth > 0 => {
            let keys = ["role", "content", "type", "text", "name", "prompt", "tokens", "messages"];
            let n = rng.random_range(0..4);
            Value::Object(
                (0..n)
                    .map(|_| (keys[rng.random_range(0..keys.len())].to_string(), hostile(rng, depth - 1)))
                    .collect(),
            )
        }
        _ => json!([rng.random_range(0..50), rng.random_range(0..50)]),
    }
}

/// 300 bodies, each a valid body of one POST endpoint (completions, chat, Messages and
/// its token count, Responses, /tokenize, /detokenize) with 0-2 of its fields set to a
/// random careless or hostile value: every answer is a 200 or a 4xx with a JSON body (or
/// an event stream), never a 5xx; the unchanged bodies are answered 200 (the control).
#[test]
fn random_bodies_to_every_endpoint_get_200_or_4xx() {
    let addr = trained_server(None, ServerOptions::default());
    let user = json!([{"role": "user", "content": "hi"}]);
    let bases = [
        ("/v1/completions", json!({"prompt": "fn", "max_tokens": 2})),
        ("/v1/chat/completions", json!({"messages": user, "max_tokens": 2})),
        ("/v1/messages", json!({"model": MODEL, "messages": user, "max_tokens": 2})),
        ("/v1/messages/count_tokens", json!({"model": MODEL, "messages": user})),
        ("/v1/responses", json!({"model": MODEL, "input": "hi", "max_output_tokens": 2})),
        ("/tokenize", json!({"prompt": "hi"})),
        ("/detokenize", json!({"tokens": [1, 2]})),
    ];
    let fields = [
        "model",
        "prompt",
        "messages",
        "input",
        "tokens",
        "max_tokens",
        "n",
        "stream",
        "temperature",
        "seed",
        "tools",
        "tool_choice",
        "chat_template_kwargs",
        "add_special_tokens",
        "logprobs",
        "stop",
        "system",
        "max_output_tokens",
        "instructions",
    ];
    let send = |path: &str, body: &Value| {
        http(addr, "POST", path, &body.to_string(), Duration::from_secs(60)).unwrap()
    };
    for (path, base) in &bases {
        let (status, text) = send(path, base);
        assert_eq!(status, 200, "control: {path} {text}");
    }
    let mut rng = StdRng::seed_from_u64(7601);
    let mut seen = std::collections::BTreeMap::new();
    for case in 0..300 {
        let (path, base) = &bases[case % bases.len()];
        let mut body = base.clone();
        for _ in 0..rng.random_range(0..3) {
            let key = if rng.random_bool(0.5) {
                base.as_object()
                    .unwrap()
                    .keys()
                    .nth(rng.random_range(0..base.as_object().unwrap().len()))
                    .unwrap()
                    .clone()
            } else {
                fields[rng.random_range(0..fields.len())].to_string()
            };
            body[key.as_str()] = hostile(&mut rng, 2);
        }
        // Short answers: the property is about vetting, not generation.
        for key in ["max_tokens", "max_output_tokens"] {
            if body.get(key).and_then(Value::as_u64).is_some_and(|n| n > 4) {
                body[key] = json!(4);
            }
        }
        let (status, text) = send(path, &body);
        assert!(status == 200 || (400..500).contains(&status), "case {case}: {path} {status} {text}\n{body}");
        assert!(
            serde_json::from_str::<Value>(&text).is_ok()
                || text.starts_with("data:")
                || text.starts_with("event:"),
            "case {case}: {path} answered no JSON: {text:.200}"
        );
        *seen.entry(status).or_insert(0) += 1;
    }
    eprintln!("statuses: {seen:?}");
    assert!(seen.get(&200).is_some_and(|&n| n > 20), "the mutations leave many bodies valid: {seen:?}");
}
