//! Who gets a connection: each client address holds at most its share of the server's
//! connections, and a connection refused (its client at its share, or the server at its
//! limit) is still answered when it asks for `/health` or `/metrics`, so a load balancer's
//! probe and the operator's scrape get through a flood.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::timeout;

/// Connections held per client address, against one limit.
pub(super) struct PerClient {
    held: Mutex<HashMap<IpAddr, usize>>,
    pub(super) limit: usize,
}

/// One connection of a client, counted until dropped.
pub(super) struct ClientSlot {
    table: Arc<PerClient>,
    ip: IpAddr,
}

impl PerClient {
    pub(super) fn new(limit: usize) -> Arc<PerClient> {
        Arc::new(PerClient { held: Mutex::new(HashMap::new()), limit })
    }

    /// A slot for `ip`, or `None` where it holds its limit already.
    pub(super) fn take(self: &Arc<Self>, ip: IpAddr) -> Option<ClientSlot> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let n = held.entry(ip).or_insert(0);
        if *n >= self.limit {
            return None;
        }
        *n += 1;
        Some(ClientSlot { table: self.clone(), ip })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut held = self.table.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = held.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

/// How long a refused connection has to show its request line.
const PROBE_WAIT: Duration = Duration::from_secs(1);
/// The most of a request line read to tell a probe (`GET /metrics?x HTTP/1.1`).
const PROBE_LINE: usize = 256;

/// Reads the start of a refused connection's first request: `Some(bytes read)` when it is
/// `GET` or `HEAD` of `/health` or `/metrics` (to be served), `None` otherwise.
pub(super) async fn probe(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut line = Vec::new();
    let read = async {
        let mut buf = [0u8; PROBE_LINE];
        while !line.contains(&b'\n') && line.len() < PROBE_LINE {
            let n = stream.read(&mut buf[..PROBE_LINE - line.len()]).await?;
            if n == 0 {
                break;
            }
            line.extend_from_slice(&buf[..n]);
        }
        io::Result::Ok(())
    };
    timeout(PROBE_WAIT, read).await.ok()?.ok()?;
    is_probe(&line).then_some(line)
}

/// Whether `line` starts a `GET`/`HEAD` of `/health` or `/metrics` (a query allowed).
fn is_probe(line: &[u8]) -> bool {
    let Some(end) = line.iter().position(|&b| b == b'\n') else { return false };
    let text = String::from_utf8_lossy(&line[..end]);
    let mut parts = text.split_ascii_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    matches!(method, "GET" | "HEAD") && matches!(path, "/health" | "/metrics")
}

/// `stream` as one connection again, its first reads the bytes [`probe`] took from it.
pub(super) fn rejoined(read: Vec<u8>, stream: TcpStream) -> impl AsyncRead + AsyncWrite + Unpin {
    let (reader, writer) = stream.into_split();
    tokio::io::join(io::Cursor::new(read).chain(reader), writer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_holds_at_most_its_limit_and_gets_it_back() {
        let table = PerClient::new(2);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let first = table.take(a).unwrap();
        let _second = table.take(a).unwrap();
        assert!(table.take(a).is_none(), "a third connection of one client");
        assert!(table.take(b).is_some(), "another client is unaffected");
        drop(first);
        assert!(table.take(a).is_some(), "a closed connection frees its slot");
    }

    #[test]
    fn probes_are_health_and_metrics_reads() {
        for yes in ["GET /health HTTP/1.1\r\n", "HEAD /metrics HTTP/1.1\r\n", "GET /metrics?x=1 HTTP/1.1\n"] {
            assert!(is_probe(yes.as_bytes()), "{yes:?}");
        }
        for no in [
            "POST /health HTTP/1.1\r\n",
            "GET /v1/models HTTP/1.1\r\n",
            "GET /healthz HTTP/1.1\r\n",
            "GET /health",
        ] {
            assert!(!is_probe(no.as_bytes()), "{no:?}");
        }
    }
}
