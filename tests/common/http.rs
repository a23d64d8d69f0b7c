//! HTTP/1.1 by hand for the server tests: exact control of what is sent and read.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::Value;

/// One HTTP/1.1 exchange: the status and the (de-chunked) body, or what went wrong (no
/// answer within `timeout`, a dropped connection, a malformed response).
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    timeout: Duration,
) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| format!("send: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(|e| format!("receive ({} bytes so far): {e}", raw.len()))?;
    let split =
        raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or("the connection closed without a response")?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or("no status line")?;
    let mut body = raw[split + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body).ok_or("a malformed chunked body")?;
    }
    String::from_utf8(body).map(|b| (status, b)).map_err(|e| e.to_string())
}

pub fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&b[..eol]).ok()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(eol + 2..eol + 2 + size)?);
        b = b.get(eol + 2 + size + 2..)?;
    }
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, &body.to_string(), Duration::from_secs(300)).unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

/// The JSON events of an SSE body (`data: {...}` lines), `[DONE]` left out.
pub fn sse_events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}
