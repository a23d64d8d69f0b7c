//! Property tests over random inputs (seeded, so a failure reproduces; bounded, a few
//! seconds each): tool and response schemas built from JSON Schema's keywords at random
//! compile or are refused with a message, never a panic, and an endless one is always
//! refused before compiling; random chat conversations (roles, content, calls, results,
//! special-token text) through `/v1/chat/completions` get 200 or a 4xx naming a
//! `messages` field or another request field, never a 5xx. (Configs get the same treatment
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
