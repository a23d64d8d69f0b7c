//! `mtp serve` over HTTP on 127.0.0.1: concurrent staggered streams (greedy and seeded
//! sampling, stop strings, completions and chat, a shared prefix through the prefix cache)
//! each equal to the same request run alone; a client that disconnects is cancelled and
//! its K/V freed while another stream runs on; bad input gets OpenAI-style errors with the
//! right status; `/metrics`' latency histograms count every request and its K/V block
//! gauges return to idle; the official `openai` Python client drives it too.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bits, trained};
use mtp::base::Tokenizer;
use mtp::drafter::{Drafter, MtpDrafter};
use mtp::engine::{generate, Engine, EngineOptions, Request, SamplingParams};
use mtp::kernels::negative_control;
use mtp::model::Model;
use mtp::server::chat::{ChatTemplate, Conversation};
use mtp::server::{Server, ServerOptions};
use serde_json::{json, Value};

const MODEL: &str = "mtp-trained";

/// Starts a server on the trained family with its MTP head and the prefix cache.
fn start(max_batch: usize, max_pending: usize) -> SocketAddr {
    start_with(max_batch, max_pending, false)
}

/// `stock_matmul`: the engine thread runs candle's stock matmul (the negative control).
fn start_with(max_batch: usize, max_pending: usize, stock_matmul: bool) -> SocketAddr {
    let opts = EngineOptions { max_batch, prefix_cache_bytes: 64 << 20, ..EngineOptions::default() };
    start_engine(opts, max_pending, stock_matmul)
}

fn start_engine(opts: EngineOptions, max_pending: usize, stock_matmul: bool) -> SocketAddr {
    let dir = trained("target");
    let model = Arc::new(common::load(&dir));
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let (d, m) = (dir.clone(), model.clone());
    // The drafter is built on the engine thread, where the switch must be set.
    let make = Box::new(move || {
        negative_control::set_stock_matmul(stock_matmul);
        Ok(Some(Box::new(MtpDrafter::load(&d, m)?) as Box<dyn Drafter>))
    });
    let server = Server::start(
        &dir,
        model,
        Some(tok),
        make,
        opts,
        ServerOptions { model_name: MODEL.into(), max_pending, ..ServerOptions::default() },
    )
    .unwrap();
    server.spawn("127.0.0.1:0".parse().unwrap()).unwrap()
}

/// Sends one HTTP/1.1 request; returns the status and the (de-chunked) body.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a header");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    (status, String::from_utf8(body).unwrap())
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").expect("chunk size line");
        let size = usize::from_str_radix(std::str::from_utf8(&b[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 2 + size + 2..];
    }
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, &body.to_string());
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

/// The `data:` payloads of a streamed response, `[DONE]` last.
fn stream(addr: SocketAddr, path: &str, body: &Value) -> Vec<String> {
    let (status, text) = http(addr, "POST", path, &body.to_string());
    assert_eq!(status, 200, "{text}");
    text.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

/// A streamed choice put back together: text, token ids, logprob bits, finish reason.
#[derive(Debug, PartialEq)]
struct Streamed {
    text: String,
    tokens: Vec<u32>,
    logprobs: Vec<u32>,
    finish: String,
    prompt: Vec<u32>,
}

fn assemble(chunks: &[String], chat: bool) -> Streamed {
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
    let mut s = Streamed {
        text: String::new(),
        tokens: vec![],
        logprobs: vec![],
        finish: String::new(),
        prompt: vec![],
    };
    for c in &chunks[..chunks.len() - 1] {
        let v: Value = serde_json::from_str(c).unwrap();
        if let Some(p) = v.get("prompt_token_ids") {
            s.prompt = serde_json::from_value(p.clone()).unwrap();
        }
        let Some(choice) = v["choices"].get(0) else { continue };
        let text = if chat { &choice["delta"]["content"] } else { &choice["text"] };
        s.text += text.as_str().unwrap_or("");
        if let Some(ids) = choice.get("token_ids") {
            s.tokens.extend(ids.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32));
        }
        let lps = if chat { &choice["logprobs"]["content"] } else { &choice["logprobs"]["token_logprobs"] };
        for lp in lps.as_array().into_iter().flatten() {
            let x = if chat { &lp["logprob"] } else { lp };
            // JSON carries the f32 widened to f64, exactly; narrowing gives the bits back.
            s.logprobs.push((x.as_f64().unwrap() as f32).to_bits());
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            s.finish = f.into();
        }
    }
    s
}

/// The request run alone through the engine, plain decoding, one row: what `mtp generate`
/// prints for it.
fn alone(
    model: &Model,
    tok: &Tokenizer,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
    stop: &[String],
) -> (Vec<u32>, Vec<u32>, String) {
    let mut engine = Engine::new(model, None, EngineOptions { max_batch: 1, ..EngineOptions::default() })
        .unwrap()
        .with_tokenizer(tok);
    let r = Request {
        id: "alone".into(),
        prompt: prompt.to_vec(),
        max_tokens,
        stop: stop.to_vec(),
        sampling,
        ..Request::default()
    };
    let c = generate(&mut engine, &[r], &[], |_, _| {}).remove(0).unwrap();
    let text = tok.decode(&c.tokens).unwrap();
    let cut = stop.iter().filter_map(|s| text.find(s.as_str())).min().unwrap_or(text.len());
    let reason = match c.finish {
        mtp::engine::FinishReason::Length => "length",
        _ => "stop",
    };
    (c.tokens, bits(&c.logprobs), format!("{}|{reason}", &text[..cut]))
}

/// A sample of `/metrics` (0 when the labelled series has not appeared yet).
fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (status, text) = http(addr, "GET", "/metrics", "");
    assert_eq!(status, 200);
    let family = name.split('{').next().unwrap();
    assert!(text.contains(&format!("# TYPE {family} ")), "no metric {family}");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .map_or(0.0, |v| v.parse().unwrap())
}

/// Histogram `family` in a `/metrics` text: its buckets (bound, cumulative count), `+Inf`
/// last, and its `_count`.
fn histogram(text: &str, family: &str) -> (Vec<(f64, f64)>, f64) {
    assert!(text.contains(&format!("# TYPE {family} histogram\n")), "no histogram {family}");
    let buckets = text
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("{family}_bucket{{le=\"")))
        .map(|r| {
            let (le, v) = r.split_once("\"} ").unwrap();
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap() };
            (le, v.parse().unwrap())
        })
        .collect();
    let count = text.lines().find_map(|l| l.strip_prefix(&format!("{family}_count "))).unwrap();
    (buckets, count.parse().unwrap())
}

const SYSTEM: &str = "You write small, careful Rust functions with doc comments and tests.";

fn body(i: usize) -> (bool, Value, SamplingParams, Vec<String>) {
    let chat = i % 3 == 2;
    let sampling = if i % 2 == 1 {
        SamplingParams {
            temperature: 0.7 + 0.05 * (i % 4) as f32,
            top_p: 0.95,
            top_k: 40 * (i % 3),
            min_p: 0.0,
            seed: 1000 + i as u64,
        }
    } else {
        SamplingParams::default()
    };
    let stop: Vec<String> = if i % 4 == 3 { vec!["{\n".into(), "\n//".into()] } else { vec![] };
    let mut b = json!({
        "model": MODEL, "max_tokens": 10 + (i % 5) * 6, "stream": true, "return_token_ids": true,
        "temperature": sampling.temperature, "seed": sampling.seed, "top_p": sampling.top_p,
        "top_k": sampling.top_k, "stop": stop,
    });
    if chat {
        b["messages"] = json!([{"role": "system", "content": SYSTEM}, {"role": "user", "content": format!("task {i}: parse a list of numbers")}]);
        b["logprobs"] = json!(true);
    } else {
        b["prompt"] = json!(format!("// {SYSTEM}\n// task {i}\nfn task_{i}("));
        b["logprobs"] = json!(0);
    }
    (chat, b, sampling, stop)
}

/// Runs 32 staggered streams against `addr` and compares each with the request run alone
/// (with the stock matmul when `stock_matmul`); returns how many differ and how many ended
/// at a stop string.
fn staggered_streams(addr: SocketAddr, stock_matmul: bool) -> (usize, usize) {
    let handles: Vec<_> = (0..32)
        .map(|i| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(40 * i as u64));
                let (chat, b, _, _) = body(i);
                let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
                assemble(&stream(addr, path, &b), chat)
            })
        })
        .collect();
    let got: Vec<Streamed> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let dir = trained("target");
    let model = common::load(&dir);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let template = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    let (mut differ, mut stopped) = (0, 0);
    negative_control::set_stock_matmul(stock_matmul);
    for (i, g) in got.iter().enumerate() {
        let (chat, b, sampling, stop) = body(i);
        let prompt = if chat {
            let msgs = Conversation {
                messages: b["messages"].as_array().unwrap().clone(),
                ..Conversation::default()
            };
            tok.encode_plain(&template.render(&msgs).unwrap()).unwrap()
        } else {
            tok.encode(b["prompt"].as_str().unwrap()).unwrap()
        };
        assert_eq!(g.prompt, prompt, "request {i}: prompt tokens");
        assert!(
            !g.tokens.is_empty() && g.logprobs.len() == g.tokens.len(),
            "request {i}: tokens and logprobs"
        );
        let max = b["max_tokens"].as_u64().unwrap() as usize;
        let (tokens, logprobs, text) = alone(&model, &tok, &prompt, max, sampling, &stop);
        let same = g.tokens == tokens && g.logprobs == logprobs && format!("{}|{}", g.text, g.finish) == text;
        if !same && !stock_matmul {
            eprintln!("request {i}: server {g:?}\nalone: {tokens:?} {text:?}");
        }
        differ += usize::from(!same);
        stopped += usize::from(!stop.is_empty() && g.finish == "stop");
    }
    negative_control::set_stock_matmul(false);
    (differ, stopped)
}

#[test]
fn concurrent_staggered_streams_equal_each_request_alone() {
    let addr = start(8, 256);
    let (differ, stopped) = staggered_streams(addr, false);
    assert_eq!(differ, 0, "responses differ from their requests run alone");
    assert!(stopped >= 3, "only {stopped} requests ended at a stop string: the test does not exercise them");
    // Every request shares the system prompt: the prefix cache supplied part of them.
    assert!(metric(addr, "mtp_prompt_tokens_cached_total") > 0.0);
    assert_eq!(metric(addr, "mtp_requests_finished_total{reason=\"error\"}"), 0.0);
}

/// Negative control: with a matmul whose bits depend on how many rows it multiplies, the
/// same comparison finds batched, speculative responses that differ from the requests alone.
#[test]
fn negative_control_stock_matmul_makes_server_responses_differ() {
    let addr = start_with(8, 256, true);
    let (differ, _) = staggered_streams(addr, true);
    assert!(differ > 0, "the stock matmul should make some responses differ from their requests alone");
}

#[test]
fn a_disconnected_stream_is_cancelled_and_frees_its_kv() {
    let addr = start(4, 64);
    let long = json!({"prompt": "fn main() {", "max_tokens": 900, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut s = TcpStream::connect(addr).unwrap();
    let text = long.to_string();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}", text.len()).unwrap();
    // Another stream that runs alongside and must be unaffected.
    let other = std::thread::spawn(move || {
        let b = json!({"prompt": "fn parse(", "max_tokens": 40, "temperature": 0, "stream": true, "return_token_ids": true, "logprobs": 0});
        assemble(&stream(addr, "/v1/completions", &b), false)
    });
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while seen.windows(5).filter(|w| w == b"data:").count() < 5 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    drop(s);
    let g = other.join().unwrap();
    let dir = trained("target");
    let model = common::load(&dir);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let (tokens, logprobs, _) = alone(&model, &tok, &g.prompt, 40, SamplingParams::default(), &[]);
    assert_eq!((g.tokens, g.logprobs), (tokens, logprobs), "the other stream changed");
    let t0 = Instant::now();
    while metric(addr, "mtp_requests_cancelled_by_disconnect_total") < 1.0
        || metric(addr, "mtp_kv_bytes") > 0.0
    {
        assert!(t0.elapsed() < Duration::from_secs(60), "the disconnected request was not cancelled");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(metric(addr, "mtp_running_rows"), 0.0);
    assert_eq!(metric(addr, "mtp_pending_requests"), 0.0);
    // No KV budget: the free-blocks gauge has no sample.
    let text = http(addr, "GET", "/metrics", "").1;
    assert!(text.contains("# TYPE mtp_kv_blocks_free gauge") && !text.contains("\nmtp_kv_blocks_free "));
    assert_eq!(metric(addr, "mtp_requests_finished_total{reason=\"cancelled\"}"), 1.0);
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let addr = start(2, 1);
    let expect = |path: &str, body: &str, status: u16, param: Value| {
        let (got, text) = http(addr, "POST", path, body);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!((got, &v["error"]["param"]), (status, &param), "{body}: {text}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    };
    expect("/v1/completions", "{\"prompt\": \"fn\",", 400, Value::Null);
    expect("/v1/completions", "[1, 2]", 400, Value::Null);
    expect("/v1/completions", r#"{"prompt": "fn", "max_tokens": "ten"}"#, 400, json!("max_tokens"));
    expect("/v1/completions", r#"{"prompt": "fn", "temperature": -1}"#, 400, json!("temperature"));
    expect("/v1/completions", r#"{"max_tokens": 3}"#, 400, json!("prompt"));
    expect("/v1/completions", r#"{"prompt": [1, 99999]}"#, 400, json!("prompt"));
    expect("/v1/completions", r#"{"prompt": "fn", "model": "other"}"#, 404, json!("model"));
    expect(
        "/v1/chat/completions",
        r#"{"messages": [{"role": "user", "content": 5}]}"#,
        400,
        json!("messages[0].content"),
    );
    let long: Vec<u32> = vec![300; 1500];
    expect("/v1/completions", &json!({"prompt": long}).to_string(), 413, json!("prompt"));
    // max_pending 1: a running request leaves no room for a second.
    let running = std::thread::spawn(move || {
        post(
            addr,
            "/v1/completions",
            &json!({"prompt": "fn main() {", "max_tokens": 300, "ignore_eos": true, "temperature": 0}),
        )
    });
    let t0 = Instant::now();
    while metric(addr, "mtp_pending_requests") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(5));
    }
    expect("/v1/completions", r#"{"prompt": "fn", "max_tokens": 2}"#, 429, Value::Null);
    let (status, v) = running.join().unwrap();
    assert_eq!((status, v["choices"][0]["finish_reason"].as_str()), (200, Some("length")));
    assert_eq!(v["usage"]["completion_tokens"], json!(300));
    // Still serving, and the models list names the model.
    let (status, text) = http(addr, "GET", "/v1/models", "");
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["data"][0]["id"], json!(MODEL));
    assert_eq!(http(addr, "GET", "/health", "").0, 200);
    assert!(metric(addr, "mtp_http_refused_total{status=\"400\"}") >= 7.0);
}

/// The official `openai` Python client (installed by `.ci/run` into `.venv-ci`; set
/// `MTP_PYTHON` to a Python that has it) against the server: streamed and unstreamed
/// completions and chats, each equal to the request alone.
#[test]
fn the_openai_python_client_gets_each_request_alone() {
    let Some(python) = common::python_with("openai") else { return };
    let addr = start(8, 256);
    let url = format!("http://{addr}/v1");
    let lines: Vec<Value> =
        common::script_lines(&python, "openai_client_check.py", &["--base-url", &url, "--model", MODEL]);
    let dir = trained("target");
    let model = common::load(&dir);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert!(lines.len() >= 8, "the script reported {} requests", lines.len());
    for l in &lines {
        let ids = |k: &str| -> Vec<u32> { serde_json::from_value(l[k].clone()).unwrap() };
        let sampling = SamplingParams {
            temperature: l["temperature"].as_f64().unwrap() as f32,
            seed: l["seed"].as_u64().unwrap(),
            ..SamplingParams::default()
        };
        let stop: Vec<String> = serde_json::from_value(l["stop"].clone()).unwrap();
        let max = l["max_tokens"].as_u64().unwrap() as usize;
        let (tokens, logprobs, text) = alone(&model, &tok, &ids("prompt_token_ids"), max, sampling, &stop);
        let got_lps: Vec<u32> = l["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| (x.as_f64().unwrap() as f32).to_bits())
            .collect();
        assert_eq!((ids("token_ids"), got_lps), (tokens, logprobs), "{}", l["name"]);
        assert_eq!(
            format!("{}|{}", l["text"].as_str().unwrap(), l["finish_reason"].as_str().unwrap()),
            text,
            "{}",
            l["name"]
        );
    }
}

/// After N requests (streamed and not, completions and chat) each request-latency histogram
/// counts N, inter-token latency counts generated tokens minus N (the first token of each
/// is its time to first token), and with no prefix cache the K/V blocks are all given back.
/// The K/V gauges are read mid-stream too, so their idle values are not vacuous.
#[test]
fn latency_histograms_count_every_request_and_kv_blocks_return_to_idle() {
    let opts = EngineOptions { max_batch: 4, kv_budget_bytes: Some(64 << 20), ..EngineOptions::default() };
    let addr = start_engine(opts, 64, false);
    let idle_free = metric(addr, "mtp_kv_blocks_free");
    assert!(idle_free > 0.0, "a KV budget shows its free blocks");
    // A long stream read until its first token: the gauges published before it count its row.
    let long = json!({"prompt": "fn main() {", "max_tokens": 60, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut s = TcpStream::connect(addr).unwrap();
    let text = long.to_string();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}", text.len()).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !seen.windows(5).any(|w| w == b"data:") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(metric(addr, "mtp_kv_blocks_used") > 0.0, "a running row holds K/V blocks");
    assert!(metric(addr, "mtp_kv_blocks_free") < idle_free);
    let others: Vec<_> = (0..3)
        .map(|i| {
            std::thread::spawn(move || {
                let mut b =
                    json!({"max_tokens": 8 + 4 * i, "ignore_eos": true, "temperature": 0, "stream": i == 1});
                if i == 2 {
                    b["messages"] = json!([{"role": "user", "content": "parse a list"}]);
                    assert_eq!(post(addr, "/v1/chat/completions", &b).0, 200);
                } else if i == 1 {
                    b["prompt"] = json!("fn sum(");
                    assemble(&stream(addr, "/v1/completions", &b), false);
                } else {
                    b["prompt"] = json!("fn parse(");
                    assert_eq!(post(addr, "/v1/completions", &b).0, 200);
                }
            })
        })
        .collect();
    others.into_iter().for_each(|h| h.join().unwrap());
    s.read_to_end(&mut seen).unwrap();
    assert!(String::from_utf8_lossy(&seen).contains("data: [DONE]"));
    const N: f64 = 4.0;
    let (_, text) = http(addr, "GET", "/metrics", "");
    let generated = metric(addr, "mtp_generation_tokens_total");
    assert_eq!(generated, 60.0 + 8.0 + 12.0 + 16.0);
    for (family, want) in [
        ("mtp_time_to_first_token_seconds", N),
        ("mtp_request_queue_time_seconds", N),
        ("mtp_e2e_request_latency_seconds", N),
        ("mtp_inter_token_latency_seconds", generated - N),
    ] {
        let (buckets, count) = histogram(&text, family);
        assert_eq!(count, want, "{family}_count");
        assert_eq!(buckets.last(), Some(&(f64::INFINITY, count)), "{family}: +Inf is the count");
        assert!(buckets.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1), "{family}: {buckets:?}");
    }
    assert_eq!(metric(addr, "mtp_kv_blocks_used"), 0.0, "blocks left held when idle");
    assert_eq!(metric(addr, "mtp_kv_blocks_free"), idle_free);
    assert_eq!(metric(addr, "mtp_preemptions_total"), 0.0);
}

/// `/tokenize` and `/detokenize` as vLLM spells them, and `/v1/models/{id}`: a prompt's
/// ids are the tokenizer's (and those a completion reports), detokenizing gives the text
/// back, a chat's count is its `usage.prompt_tokens`; a wrong model is 404, an unknown key
/// 400 by name, an id past the vocabulary 400 naming its index.
#[test]
fn tokenize_detokenize_and_the_model_entry() {
    let addr = start(8, 256);
    let tok = Tokenizer::from_dir(&trained("target")).unwrap();
    let text = "fn main() { println!(\"hi\"); }";
    let (status, v) = post(addr, "/tokenize", &json!({"model": MODEL, "prompt": text}));
    assert_eq!(status, 200, "{v}");
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(ids, tok.encode(text).unwrap());
    assert_eq!(v["count"], ids.len());
    assert!(v["max_model_len"].as_u64().unwrap() > 0 && v["token_strs"].is_null(), "{v}");
    let (_, c) =
        post(addr, "/v1/completions", &json!({"prompt": text, "max_tokens": 1, "return_token_ids": true}));
    assert_eq!(c["usage"]["prompt_tokens"], ids.len(), "{c}");
    let (_, plain) = post(addr, "/tokenize", &json!({"prompt": text, "add_special_tokens": false}));
    assert_eq!(plain["tokens"], json!(tok.encode_plain(text).unwrap()));
    let (status, d) = post(addr, "/detokenize", &json!({"tokens": ids}));
    assert_eq!((status, d["prompt"].as_str().unwrap()), (200, text), "{d}");
    // A field given as null is the field left out (it was refused as not a boolean).
    let (status, nulls) = post(addr, "/tokenize", &json!({"prompt": text, "add_special_tokens": null}));
    assert_eq!((status, &nulls["tokens"]), (200, &v["tokens"]), "{nulls}");

    let messages =
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list."}]);
    let (status, t) = post(addr, "/tokenize", &json!({"messages": messages}));
    assert_eq!(status, 200, "{t}");
    let (_, with_null) =
        post(addr, "/tokenize", &json!({"messages": messages, "add_generation_prompt": null}));
    assert_eq!(with_null["tokens"], t["tokens"], "{with_null}");
    let (_, chat) = post(addr, "/v1/chat/completions", &json!({"messages": messages, "max_tokens": 1}));
    assert_eq!(t["count"], chat["usage"]["prompt_tokens"], "{t} {chat}");

    for (path, body, status, param) in [
        ("/tokenize", json!({"model": "other", "prompt": "x"}), 404, "model"),
        ("/tokenize", json!({"prompt": "x", "echo": true}), 400, "echo"),
        ("/tokenize", json!({"prompt": "x", "messages": []}), 400, "messages"),
        ("/tokenize", json!({"messages": [{"role": "robot", "content": "x"}]}), 400, "messages[0].role"),
        ("/detokenize", json!({"tokens": [1, 1 << 30]}), 400, "tokens"),
        // Without the tokenizer's own tokens, the byte bound holds too (it skipped it).
        ("/tokenize", json!({"prompt": "ab ".repeat(2_500_000), "add_special_tokens": false}), 413, "prompt"),
    ] {
        let (got, v) = post(addr, path, &body);
        assert_eq!((got, v["error"]["param"].as_str().unwrap_or("")), (status, param), "{body}: {v}");
    }
    let (status, m) = http(addr, "GET", &format!("/v1/models/{MODEL}"), "");
    assert_eq!(status, 200, "{m}");
    assert_eq!(serde_json::from_str::<Value>(&m).unwrap()["id"], MODEL);
    let (status, m) = http(addr, "GET", "/v1/models/nope", "");
    assert_eq!(status, 404, "{m}");
    assert!(m.contains("not served here"), "{m}");
}

/// A completions `prompt` listing several prompts (texts or token-id lists, as lm-eval
/// sends them) is answered as OpenAI does: prompt `i`'s choice `j` at index `i * n + j`,
/// each bitwise the same prompt sent alone, usage summed, streamed or not. More than 64
/// prompts are refused by field; a bad prompt of the list is named by its index.
#[test]
fn a_list_of_prompts_gets_each_prompts_choices_in_order() {
    let addr = start(8, 256);
    let tok = Tokenizer::from_dir(&trained("target")).unwrap();
    let prompts = ["fn main() {", "struct Point {", "// sort a list\n"];
    let one = |p: Value| {
        let (status, v) = post(
            addr,
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 6, "n": 2, "temperature": 0.7,
                                                                "seed": 3, "logprobs": 1, "ignore_eos": true}),
        );
        assert_eq!(status, 200, "{v}");
        v
    };
    let alone: Vec<Value> = prompts.iter().map(|p| one(json!(p))).collect();
    let ids: Vec<Value> = prompts.iter().map(|p| json!(tok.encode(p).unwrap())).collect();
    for list in [json!(prompts), json!(ids)] {
        let v = one(list.clone());
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 6, "{v}");
        for (k, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], k, "{v}");
            let want = &alone[k / 2]["choices"][k % 2];
            assert_eq!(
                (&c["text"], &c["logprobs"]),
                (&want["text"], &want["logprobs"]),
                "prompt {}, choice {}",
                k / 2,
                k % 2
            );
        }
        let summed: u64 = alone.iter().map(|a| a["usage"]["total_tokens"].as_u64().unwrap()).sum();
        assert_eq!(v["usage"]["total_tokens"], summed, "{v}");
    }
    // Streamed: each choice's chunks (renumbered) put together are its unstreamed text
    // and logprobs, every chunk under one id, one usage chunk at the end, summed.
    let body = json!({"prompt": prompts, "max_tokens": 6, "n": 2, "temperature": 0.7, "seed": 3, "logprobs": 1,
                      "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    let chunks = stream(addr, "/v1/completions", &body);
    let parsed: Vec<Value> =
        chunks[..chunks.len() - 1].iter().map(|c| serde_json::from_str(c).unwrap()).collect();
    let ids: std::collections::BTreeSet<&str> = parsed.iter().map(|v| v["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 1, "{chunks:?}");
    let usage: Vec<&Value> = parsed.iter().filter(|v| v.get("usage").is_some_and(|u| !u.is_null())).collect();
    let summed: u64 = alone.iter().map(|a| a["usage"]["completion_tokens"].as_u64().unwrap()).sum();
    assert_eq!(usage.len(), 1, "{chunks:?}");
    assert_eq!(usage[0]["usage"]["completion_tokens"], summed, "{chunks:?}");
    for k in 0..6 {
        let mut text = String::new();
        let mut lps = Vec::new();
        for v in &parsed {
            for c in v["choices"].as_array().unwrap().iter().filter(|c| c["index"] == k) {
                text += c["text"].as_str().unwrap_or("");
                lps.extend(c["logprobs"]["token_logprobs"].as_array().into_iter().flatten().cloned());
            }
        }
        let want = &alone[k / 2]["choices"][k % 2];
        assert_eq!(
            (json!(text), json!(lps)),
            (want["text"].clone(), want["logprobs"]["token_logprobs"].clone())
        );
    }
    for (body, param) in
        [(json!({"prompt": vec!["a"; 65]}), "prompt"), (json!({"prompt": ["a", []]}), "prompt[1]")]
    {
        let (status, v) = post(addr, "/v1/completions", &body);
        assert_eq!((status, v["error"]["param"].as_str().unwrap_or("")), (400, param), "{v}");
    }
}

/// What lm-eval's loglikelihood requests ask (token-id prompts in a list, `echo`,
/// `logprobs: 1`, `max_tokens` 0 or 1) scores a prompt as decoding scored its tokens: for a
/// prompt that is a prompt and its greedy continuation, the echoed logprobs and
/// alternatives of the continuation are those the continuation was generated with (the
/// same JSON numbers), the first token's are null, and the text is the prompt's and then
/// the completion's. vLLM's `prompt_logprobs` report the same numbers with ranks, on a
/// completion's choice and atop a chat; a streamed echo opens with the prompt;
/// `/tokenizer_info` names the EOS token (lm-eval tokenizes through the server with it); a
/// chat of 0 tokens is refused.
#[test]
fn echo_and_prompt_logprobs_score_a_prompt_as_decoding_scored_its_tokens() {
    let addr = start(8, 256);
    let tok = Tokenizer::from_dir(&trained("target")).unwrap();
    let prompt = tok.encode("fn main() {").unwrap();
    let (status, generated) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1, "ignore_eos": true,
                "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{generated}");
    let g = &generated["choices"][0];
    let g_ids: Vec<u32> = serde_json::from_value(g["token_ids"].clone()).unwrap();
    let whole = [prompt.clone(), g_ids.clone()].concat();
    let (n, w) = (prompt.len(), whole.len());
    for max_tokens in [0usize, 1] {
        let (status, v) = post(
            addr,
            "/v1/completions",
            &json!({"prompt": [whole, prompt], "echo": true, "logprobs": 1, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": true}),
        );
        assert_eq!(status, 200, "{v}");
        let (c, lp) = (&v["choices"][0], &v["choices"][0]["logprobs"]);
        assert_eq!(lp["tokens"].as_array().unwrap().len(), w + max_tokens, "{v}");
        assert_eq!((&lp["token_logprobs"][0], &lp["top_logprobs"][0]), (&Value::Null, &Value::Null), "{v}");
        for key in ["token_logprobs", "top_logprobs"] {
            let scored = &lp[key].as_array().unwrap()[n..w];
            assert_eq!(scored, g["logprobs"][key].as_array().unwrap().as_slice(), "{key}: {v}");
        }
        let text = c["text"].as_str().unwrap();
        assert!(text.starts_with(&tok.decode(&whole).unwrap()), "{text:?}");
        if max_tokens == 0 {
            assert_eq!(text, tok.decode(&whole).unwrap());
        }
        // The second prompt's generated token is the continuation's first.
        let second = &v["choices"][1]["logprobs"]["token_logprobs"];
        assert_eq!(second.as_array().unwrap().len(), n + max_tokens, "{v}");
        if max_tokens == 1 {
            assert_eq!(second[n], g["logprobs"]["token_logprobs"][0], "{v}");
        }
        assert_eq!(v["usage"]["completion_tokens"], json!(2 * max_tokens), "{v}");
    }
    // vLLM's prompt_logprobs: null, then a map holding each token (with its rank) and the
    // most likely alternatives.
    let (status, v) = post(
        addr,
        "/v1/completions",
        &json!({"prompt": whole, "prompt_logprobs": 2, "max_tokens": 1, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let reported = v["choices"][0]["prompt_logprobs"].as_array().unwrap().clone();
    assert_eq!((reported.len(), &reported[0]), (w, &Value::Null), "{v}");
    for (j, &t) in g_ids.iter().enumerate() {
        let entry = &reported[n + j][t.to_string()];
        assert_eq!(
            (&entry["logprob"], &entry["rank"]),
            (&g["logprobs"]["token_logprobs"][j], &json!(1)),
            "{v}"
        );
    }
    assert!(reported[1..].iter().all(|m| (1..=3).contains(&m.as_object().unwrap().len())), "{v}");
    let chat = json!({"messages": [{"role": "user", "content": "sort a list"}], "prompt_logprobs": 0,
                      "max_tokens": 2, "temperature": 0});
    let (status, v) = post(addr, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{v}");
    let reported = v["prompt_logprobs"].as_array().unwrap();
    assert_eq!(reported.len() as u64, v["usage"]["prompt_tokens"].as_u64().unwrap(), "{v}");
    assert!(reported[1..].iter().all(|m| m.as_object().unwrap().len() == 1), "{v}");
    // A streamed echo opens with the prompt; with logprobs, with the prompt's too.
    for logprobs in [Value::Null, json!(1)] {
        let chunks = stream(
            addr,
            "/v1/completions",
            &json!({"prompt": prompt, "echo": true, "logprobs": logprobs, "max_tokens": 2, "stream": true,
                    "temperature": 0}),
        );
        let first: Value = serde_json::from_str(&chunks[0]).unwrap();
        assert_eq!(first["choices"][0]["text"], json!(tok.decode(&prompt).unwrap()), "{first}");
        let echoed = first["choices"][0]["logprobs"]["tokens"].as_array().map_or(0, Vec::len);
        assert_eq!(echoed, if logprobs.is_null() { 0 } else { n }, "{first}");
    }
    let (status, info) = http(addr, "GET", "/tokenizer_info", "");
    assert_eq!(status, 200, "{info}");
    let info: Value = serde_json::from_str(&info).unwrap();
    assert!(info["eos_token"].as_str().is_some_and(|e| !e.is_empty()), "{info}");
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0});
    let (status, v) = post(addr, "/v1/chat/completions", &chat);
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("max_tokens")), "{v}");
    // Bounds: the logprobs a request's scores report (64 prompts of 1,000 tokens with 20
    // alternatives: 1.3 M; one of them: 21 k, answered), and a list's choices within
    // --max-pending (20 prompts of n 16 are 320 of 256).
    let long: Vec<u32> = (0..1000).map(|i| 100 + i % 500).collect();
    let scored = |prompt: Value| {
        post(
            addr,
            "/v1/completions",
            &json!({"prompt": prompt, "echo": true, "logprobs": 20, "max_tokens": 0}),
        )
    };
    let (status, v) = scored(json!(vec![long.clone(); 64]));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("prompt_logprobs")), "{v}");
    assert_eq!(scored(json!(long)).0, 200);
    let (status, v) =
        post(addr, "/v1/completions", &json!({"prompt": vec!["a"; 20], "n": 16, "max_tokens": 1}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("n")), "{v}");
}
