//! A real `mtp serve` on 127.0.0.1 against slow, idle, half-open, oversized and
//! unauthorised clients: normal requests still finish, bitwise equal to the same request
//! alone, `/health` answers within a second throughout, hostile connections are closed
//! within their timeouts, and memory returns near its baseline.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A running `mtp serve`, killed when dropped.
struct Served {
    child: Child,
    addr: SocketAddr,
    /// What it printed on stderr before it listened.
    log: Vec<String>,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `mtp serve --port 0 <args>` (the trained family, its MTP head) and waits until
/// it listens.
fn serve(args: &[&str], env: &[(&str, &str)]) -> Served {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mtp"));
    cmd.args(["serve", "--port", "0"]).args(args).stderr(Stdio::piped()).stdout(Stdio::null());
    cmd.env_remove("MTP_API_KEY");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let (tx, lines) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut log = Vec::new();
    loop {
        let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("mtp serve did not listen: {log:?}");
        };
        if let Some(a) = line.strip_prefix("listening on http://") {
            return Served { addr: a.trim().parse().unwrap(), child, log };
        }
        log.push(line);
    }
}

/// One HTTP/1.1 exchange with extra header lines; returns status, lowercase head, body.
fn exchange(addr: SocketAddr, method: &str, path: &str, headers: &str, body: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n",
        body.len()
    );
    // The server may answer (413) before taking the whole body: a failed write is fine.
    let _ = s.write_all(head.as_bytes()).and_then(|_| s.write_all(body));
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or_else(|| panic!("no answer: {raw:?}"));
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head, String::from_utf8_lossy(&raw[split + 4..]).into_owned())
}

fn post(addr: SocketAddr, body: &Value) -> (u16, Value) {
    let (status, _, text) = exchange(
        addr,
        "POST",
        "/v1/completions",
        "Content-Type: application/json\r\n",
        body.to_string().as_bytes(),
    );
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

/// What must match bitwise between a request under load and alone: text, token ids,
/// logprobs (f32 printed shortest, so equal text is equal bits), finish reason.
fn answer(addr: SocketAddr, i: usize) -> Value {
    let prompts = ["fn main() {", "// sort a list\nfn sort(", "struct Point {", "impl Display for"];
    let body = json!({"prompt": prompts[i % 4], "max_tokens": 24, "temperature": 0, "logprobs": 2,
                      "return_token_ids": true, "ignore_eos": true});
    let (status, v) = post(addr, &body);
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    json!([c["text"], c["token_ids"], c["logprobs"], c["finish_reason"]])
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Whether the server closed `s` (EOF or reset) within `within`.
fn closed_within(mut s: TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut sink = [0u8; 1024];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn hostile_clients_cannot_stall_the_server() {
    let timeouts = ["--header-timeout", "2", "--body-timeout", "4", "--write-timeout", "3"];
    let limits = ["--max-connections", "64", "--max-body-mib", "1", "--max-pending", "16"];
    let served = serve(&[&timeouts[..], &limits[..]].concat(), &[]);
    let addr = served.addr;
    let alone: Vec<Value> = (0..4).map(|i| answer(addr, i)).collect();
    let baseline = rss_kib(served.child.id());

    // /health, probed every 100 ms with a fresh connection throughout.
    let storm_over = Arc::new(AtomicBool::new(false));
    let prober = {
        let over = storm_over.clone();
        thread::spawn(move || {
            let mut slowest = Duration::ZERO;
            while !over.load(Ordering::Relaxed) {
                let t = Instant::now();
                let (status, _, _) = exchange(addr, "GET", "/health", "", b"");
                assert_eq!(status, 200);
                slowest = slowest.max(t.elapsed());
                thread::sleep(Duration::from_millis(100));
            }
            slowest
        })
    };
    let mut hostile = Vec::new();
    // Half-open: connect, send nothing.
    let idle: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Slow loris: a header byte every 300 ms, never finishing.
    for _ in 0..4 {
        hostile.push(thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let start = Instant::now();
            let _ = s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n");
            while start.elapsed() < Duration::from_secs(8) {
                if s.write_all(b"X").is_err() {
                    return Some(start.elapsed());
                }
                thread::sleep(Duration::from_millis(300));
            }
            None
        }));
    }
    // A body shorter than its Content-Length: 408 once the body timeout passes.
    let short: Vec<_> = (0..3)
        .map(|_| {
            thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let head = format!(
                    "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 1000\r\n\r\n{{\"pro"
                );
                s.write_all(head.as_bytes()).unwrap();
                let mut raw = Vec::new();
                let _ = s.read_to_end(&mut raw);
                String::from_utf8_lossy(&raw).into_owned()
            })
        })
        .collect();
    // Bodies over the limit (3 MB and 10 MB): a 413 with the OpenAI error JSON.
    let big: Vec<_> = [3usize << 20, 10 << 20]
        .into_iter()
        .map(|n| {
            thread::spawn(move || {
                let body = json!({"prompt": "a".repeat(n), "max_tokens": 1}).to_string();
                exchange(
                    addr,
                    "POST",
                    "/v1/completions",
                    "Content-Type: application/json\r\n",
                    body.as_bytes(),
                )
            })
        })
        .collect();
    // Prompts under the body limit but far over the context: refused quickly.
    let over_context: Vec<_> = (0..8)
        .map(|i| {
            thread::spawn(move || {
                let t = Instant::now();
                let text = format!("{i} fn main() {{ let x = 1; }}\n").repeat(30_000);
                let (status, v) = post(addr, &json!({"prompt": text, "max_tokens": 4}));
                (status, v, t.elapsed())
            })
        })
        .collect();
    // Normal traffic, concurrent with all of it.
    let normal: Vec<_> = (0..8).map(|i| thread::spawn(move || (i, answer(addr, i)))).collect();

    for h in normal {
        let (i, got) = h.join().unwrap();
        assert_eq!(got, alone[i % 4], "request {i} under load differs from alone");
    }
    for h in over_context {
        let (status, v, took) = h.join().unwrap();
        assert!(status == 400 || status == 413, "{status} {v}");
        assert_eq!(v["error"]["param"], "prompt", "{v}");
        assert!(took < Duration::from_secs(10), "an over-context prompt took {took:?} to refuse");
    }
    for h in big {
        let (status, head, body) = h.join().unwrap();
        assert_eq!(status, 413, "{head}");
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert!(v["error"]["message"].as_str().unwrap().contains("--max-body-mib"), "{v}");
    }
    for h in short {
        let raw = h.join().unwrap();
        assert!(raw.starts_with("HTTP/1.1 408"), "{raw}");
        assert!(raw.contains("--body-timeout"), "{raw}");
    }
    for h in hostile {
        let cut = h.join().unwrap().expect("the slow loris was cut off");
        assert!(cut < Duration::from_secs(6), "the slow loris held on for {cut:?}");
    }
    for s in idle {
        assert!(
            closed_within(s, Duration::from_secs(5)),
            "a half-open connection outlived the header timeout"
        );
    }
    storm_over.store(true, Ordering::Relaxed);
    let slowest = prober.join().unwrap();
    assert!(slowest < Duration::from_secs(1), "/health took {slowest:?} under load");

    // Connections over the limit are answered 503 at once (/health still served); the idle
    // ones holding the limit are closed by the header timeout, and the server serves again.
    let holders: Vec<TcpStream> = (0..64).map(|_| TcpStream::connect(addr).unwrap()).collect();
    thread::sleep(Duration::from_millis(200));
    let (status, _, body) = exchange(addr, "POST", "/v1/completions", "", b"{}");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("--max-connections"), "{body}");
    assert_eq!(exchange(addr, "GET", "/health", "", b"").0, 200, "/health past the limit");
    for s in holders {
        assert!(closed_within(s, Duration::from_secs(5)));
    }
    thread::sleep(Duration::from_millis(200));
    assert_eq!(exchange(addr, "GET", "/health", "", b"").0, 200);
    for (i, want) in alone.iter().enumerate() {
        assert_eq!(&answer(addr, i), want);
    }
    let after = rss_kib(served.child.id());
    assert!(after < baseline + 150 * 1024, "RSS went from {baseline} KiB to {after} KiB and stayed");
    eprintln!("RSS {baseline} KiB before the storm, {after} KiB after; slowest /health {slowest:?}");
}

/// A connection to `addr` from the loopback address `from` (another client, as the server
/// counts them).
fn connect_from(from: [u8; 4], addr: SocketAddr) -> TcpStream {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&SocketAddr::from((from, 0)).into()).unwrap();
    s.connect(&addr.into()).unwrap();
    s.into()
}

/// One exchange from the loopback address `from`; returns status and body.
fn exchange_from(from: [u8; 4], addr: SocketAddr, request: &str) -> (u16, String) {
    let mut s = connect_from(from, addr);
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, text)
}

/// One client (127.0.0.1) holding all it may of 16 connections (14: all but an eighth)
/// cannot take the last two: its next request is answered 503 naming
/// --max-connections-per-client while another client (127.0.0.2) is served. Once the
/// other client fills the server, a third gets 503 naming --max-connections. /health and
/// /metrics are answered past either limit.
/// HTTP/2 is not served: a connection that sends its preface and an empty SETTINGS frame,
/// then nothing, is closed within the header timeout (it was held open: hyper's
/// upgrade-capable connection sniffed for HTTP/2 past `http1_only`), while HTTP/1.1 is
/// answered.
#[test]
fn an_http2_connection_does_not_escape_the_header_timeout() {
    let served = serve(&["--header-timeout", "2"], &[]);
    let addr = served.addr;
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00").unwrap();
    assert!(closed_within(s, Duration::from_secs(6)), "an HTTP/2 preface held its connection");
    let (status, _, body) = exchange(addr, "GET", "/health", "", b"");
    assert_eq!(status, 200, "{body}");
}

#[test]
fn one_client_cannot_take_every_connection() {
    let served = serve(&["--max-connections", "16"], &[]);
    let addr = served.addr;
    let (one, two, three) = ([127, 0, 0, 1], [127, 0, 0, 2], [127, 0, 0, 3]);
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let body = r#"{"prompt": "fn main() {", "max_tokens": 2}"#;
    let completion = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // Holders send a request's first byte, so they stay until the header timeout (30 s).
    let hold = |from| {
        let mut s = connect_from(from, addr);
        s.write_all(b"P").unwrap();
        s
    };
    let held: Vec<TcpStream> = (0..14).map(|_| hold(one)).collect();
    thread::sleep(Duration::from_millis(200));
    let (status, text) = exchange_from(one, addr, &completion);
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("--max-connections-per-client"), "{text}");
    for path in ["/health", "/metrics"] {
        assert_eq!(exchange_from(one, addr, &get(path)).0, 200, "{path} of the client at its limit");
    }
    // Control: another client is served beside it.
    let (status, text) = exchange_from(two, addr, &completion);
    assert_eq!(status, 200, "{text}");
    // The other client takes the last two: now the server is full for everyone. (A
    // connection made before the server freed the last request's slot is refused, after
    // the second a refused connection has to ask for /health: made again.)
    let mut also: Vec<TcpStream> = Vec::new();
    for _ in 0..5 {
        while also.len() < 2 {
            also.push(hold(two));
        }
        thread::sleep(Duration::from_millis(1500));
        also.retain(|s| {
            s.set_nonblocking(true).unwrap();
            let answered =
                s.peek(&mut [0u8; 1]).map_or_else(|e| e.kind() != std::io::ErrorKind::WouldBlock, |_| true);
            s.set_nonblocking(false).unwrap();
            !answered
        });
        if also.len() == 2 {
            break;
        }
    }
    assert_eq!(also.len(), 2, "the last two slots taken");
    let (status, text) = exchange_from(three, addr, &completion);
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("(--max-connections)"), "{text}");
    assert_eq!(exchange_from(three, addr, &get("/health")).0, 200, "/health of a full server");
    drop((held, also));
}

#[test]
fn the_key_the_origin_and_the_host_are_checked() {
    let served = serve(&["--allowed-origins", "https://ok.example"], &[("MTP_API_KEY", "sesame-0123")]);
    let addr = served.addr;
    let get = |headers: &str| exchange(addr, "GET", "/v1/models", headers, b"");
    let key = "Authorization: Bearer sesame-0123\r\n";
    assert_eq!(exchange(addr, "GET", "/health", "", b"").0, 200, "/health stays open");
    for wrong in [
        "",
        "Authorization: Bearer sesame\r\n",
        "Authorization: Bearer sesame-01234\r\n",
        "Authorization: sesame-0123\r\n",
    ] {
        let (status, _, body) = get(wrong);
        assert_eq!(status, 401, "{wrong:?}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("API key"), "{v}");
    }
    assert_eq!(get(key).0, 200);

    // A page elsewhere: refused before it runs, whatever its content type.
    let metric = |name: &str| -> String {
        let (_, _, m) = exchange(addr, "GET", "/metrics", key, b"");
        m.lines().find(|l| l.starts_with(name)).unwrap_or("").to_string()
    };
    let before = metric("mtp_http_requests_total");
    let body = br#"{"prompt": "fn main() {", "max_tokens": 2}"#;
    let evil = format!("{key}Origin: https://evil.example\r\nContent-Type: text/plain\r\n");
    let (status, _, text) = exchange(addr, "POST", "/v1/completions", &evil, body);
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("--allowed-origins"), "{text}");
    assert_eq!(metric("mtp_http_requests_total"), before, "the refused request did not run");
    // The allowed page gets its answer and the CORS headers, and a preflight.
    let ok = format!("{key}Origin: https://ok.example\r\nContent-Type: application/json\r\n");
    let (status, head, text) = exchange(addr, "POST", "/v1/completions", &ok, body);
    assert_eq!(status, 200, "{text}");
    assert!(head.contains("access-control-allow-origin: https://ok.example"), "{head}");
    let preflight = "Origin: https://ok.example\r\nAccess-Control-Request-Method: POST\r\n\
                     Access-Control-Request-Headers: authorization, content-type\r\n";
    let (status, head, _) = exchange(addr, "OPTIONS", "/v1/completions", preflight, b"");
    assert_eq!(status, 200, "{head}");
    assert!(head.contains("access-control-allow-methods") && head.contains("post"), "{head}");

    // DNS rebinding: a loopback server under another name is refused.
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET /v1/models HTTP/1.1\r\nHost: evil.example:{}\r\n{key}Connection: close\r\n\r\n",
        addr.port()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    assert!(raw.starts_with("HTTP/1.1 403") && raw.contains("--allowed-hosts"), "{raw}");
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET /v1/models HTTP/1.1\r\nHost: localhost:{}\r\n{key}Connection: close\r\n\r\n", addr.port())
        .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    // Two Host headers, even two allowed ones, are a 400 (RFC 9112); each alone is served.
    let mut s = TcpStream::connect(addr).unwrap();
    let p = addr.port();
    write!(s, "GET /v1/models HTTP/1.1\r\nHost: localhost:{p}\r\nHost: 127.0.0.1:{p}\r\n{key}Connection: close\r\n\r\n")
        .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    assert!(raw.starts_with("HTTP/1.1 400") && raw.contains("more than one Host"), "{raw}");
}

#[test]
fn a_server_beyond_loopback_without_a_key_warns() {
    let served = serve(&["--host", "0.0.0.0"], &[]);
    let warned = served.log.iter().any(|l| l.contains("no API key"));
    assert!(warned, "no warning for a keyless server on 0.0.0.0");
    // Negative control: on loopback there is nothing to warn about.
    let quiet = serve(&[], &[]);
    assert!(!quiet.log.iter().any(|l| l.contains("no API key")), "{:?}", quiet.log);
}

/// `--chat-template FILE` replaces the checkpoint's template (its BOS and EOS texts kept):
/// a chat's prompt is the file's rendering. A file that is not there, or not valid Jinja,
/// stops the server at start with an error naming it.
#[test]
fn a_chat_template_file_replaces_the_checkpoints() {
    let dir = std::env::temp_dir().join(format!("mtp-chat-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("t.jinja");
    std::fs::write(&file, "FROM-THE-FILE {% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    let served = serve(&["--chat-template", file.to_str().unwrap()], &[]);
    let body = json!({"messages": [{"role": "user", "content": "hello"}]}).to_string();
    let (status, _, text) =
        exchange(served.addr, "POST", "/tokenize", "Content-Type: application/json\r\n", body.as_bytes());
    assert_eq!(status, 200, "{text}");
    let ids = serde_json::from_str::<Value>(&text).unwrap()["tokens"].to_string();
    let (_, _, back) =
        exchange(served.addr, "POST", "/detokenize", "", format!("{{\"tokens\": {ids}}}").as_bytes());
    assert!(back.contains("FROM-THE-FILE hello"), "{back}");
    // Control: the checkpoint's own template renders something else.
    let own = serve(&[], &[]);
    let (_, _, text) = exchange(own.addr, "POST", "/tokenize", "", body.as_bytes());
    assert_ne!(serde_json::from_str::<Value>(&text).unwrap()["tokens"].to_string(), ids);
    for (bad, content) in [("missing.jinja", None), ("broken.jinja", Some("{% for %}"))] {
        let path = dir.join(bad);
        if let Some(c) = content {
            std::fs::write(&path, c).unwrap();
        }
        let out = Command::new(env!("CARGO_BIN_EXE_mtp"))
            .args(["serve", "--port", "0", "--chat-template", path.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(bad), "{bad}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// What the server answers to `request` sent as is, whole (every response on the
/// connection until it closes).
fn raw_answer(addr: SocketAddr, request: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let _ = s.write_all(request.as_bytes());
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    String::from_utf8_lossy(&raw).into_owned()
}

/// The error body of a whole answer (its head and body split at the blank line).
fn error_body(answer: &str) -> Value {
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"))
}

/// `POST /v1/completions` sent as is with `headers` and `payload`; the whole answer.
fn post_raw(addr: SocketAddr, headers: &str, payload: &str) -> String {
    raw_answer(
        addr,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\n{headers}Connection: close\r\n\r\n{payload}"
        ),
    )
}

const BODY: &str = r#"{"prompt": "fn main() {", "max_tokens": 1}"#;

/// Both `Content-Length` and `Transfer-Encoding`, in either order, are a 400 naming
/// `Transfer-Encoding`, and the request smuggled behind the chunked body is never answered
/// (hyper framed the body as chunked, hid the pair and answered 200). Control: chunked
/// alone is served.
#[test]
fn both_content_length_and_transfer_encoding_are_refused_and_nothing_is_smuggled() {
    let served = serve(&[], &[]);
    let addr = served.addr;
    let chunked = format!("{:x}\r\n{BODY}\r\n0\r\n\r\n", BODY.len());
    let smuggled = format!("GET /v1/models HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    let answer = post_raw(addr, "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n", &chunked);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let length = chunked.len() + smuggled.len();
    for framing in [
        format!("Content-Length: {length}\r\nTransfer-Encoding: chunked\r\n"),
        format!("Transfer-Encoding: chunked\r\nContent-Length: {length}\r\n"),
    ] {
        let answer = post_raw(addr, &framing, &format!("{chunked}{smuggled}"));
        assert!(answer.starts_with("HTTP/1.1 400"), "{framing:?}: {answer}");
        assert_eq!(error_body(&answer)["error"]["param"], "Transfer-Encoding", "{answer}");
        assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "the smuggled request was answered: {answer}");
    }
}

/// Two `Content-Type`s (400), a `Content-Encoding` other than identity (415 naming it; the
/// gzip body was read as JSON) and a `Host` port that is no port (400) are refused, each
/// naming its header; one `Content-Type`, `identity`, and good ports are served.
#[test]
fn a_second_content_type_a_coded_body_and_a_bad_host_port_are_refused() {
    let served = serve(&[], &[]);
    let addr = served.addr;
    let sized = |headers: &str| post_raw(addr, &format!("{headers}Content-Length: {}\r\n", BODY.len()), BODY);
    for (headers, status, param, words) in [
        (
            "Content-Type: application/json\r\nContent-Type: text/plain\r\n",
            400,
            "Content-Type",
            "more than one",
        ),
        ("Content-Encoding: gzip\r\n", 415, "Content-Encoding", "`gzip` is not supported"),
        ("Content-Encoding: identity, br\r\n", 415, "Content-Encoding", "`br` is not supported"),
    ] {
        let answer = sized(headers);
        assert!(answer.starts_with(&format!("HTTP/1.1 {status}")), "{headers:?}: {answer}");
        let e = &error_body(&answer)["error"];
        assert_eq!(e["param"], param, "{answer}");
        assert!(e["message"].as_str().unwrap().contains(words), "{answer}");
    }
    for control in ["Content-Type: application/json\r\n", "Content-Encoding: identity\r\n", ""] {
        let answer = sized(control);
        assert!(answer.starts_with("HTTP/1.1 200"), "{control:?}: {answer}");
    }
    let get = |host: &str| {
        raw_answer(addr, &format!("GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"))
    };
    for host in ["localhost:abc", "localhost:70000", "localhost:", "127.0.0.1:80:80"] {
        let answer = get(host);
        assert!(answer.starts_with("HTTP/1.1 400"), "{host}: {answer}");
        assert_eq!(error_body(&answer)["error"]["param"], "Host", "{answer}");
    }
    assert!(get(&format!("localhost:{}", addr.port())).starts_with("HTTP/1.1 200"));
    assert!(get("localhost").starts_with("HTTP/1.1 200"));
}

/// A path no endpoint serves is a 404 and a method an endpoint does not take a 405
/// (keeping its `Allow`), each with an error body in its API's shape (they were empty).
#[test]
fn unknown_paths_and_methods_get_error_bodies() {
    let served = serve(&[], &[]);
    let addr = served.addr;
    let (status, _, text) = exchange(addr, "GET", "/v1/nowhere", "", b"");
    assert_eq!(status, 404, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert_eq!(v["error"]["type"], "not_found_error", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("GET /v1/nowhere"), "{v}");
    let (status, _, text) = exchange(addr, "POST", "/v1/messages/batches", "", b"{}");
    assert_eq!(status, 404, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert_eq!(
        (&v["type"], &v["error"]["type"]),
        (&json!("error"), &json!("not_found_error")),
        "Anthropic's shape: {v}"
    );
    for (method, path, allow) in [("GET", "/v1/chat/completions", "post"), ("DELETE", "/v1/models", "get")] {
        let (status, head, text) = exchange(addr, method, path, "", b"");
        assert_eq!(status, 405, "{method} {path}: {head}");
        assert!(head.contains(&format!("allow: {allow}")), "{head}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert_eq!(v["error"]["code"], 405, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(method), "{v}");
    }
    let (status, _, _) = exchange(addr, "GET", "/v1/models", "", b"");
    assert_eq!(status, 200, "control");
}
