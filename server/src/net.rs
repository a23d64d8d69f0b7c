//! Connections: accepted up to a limit, and each bounded in time, so slow, idle or
//! half-open clients cannot hold the server.
//!
//! - At most [`Limits::max_connections`] are served at once, at most
//!   [`Limits::max_connections_per_client`] of them for one client address; a connection
//!   over either limit is answered `503` and closed (a few at a time; past that it is closed
//!   unanswered), so a flood cannot exhaust file descriptors, nor one peer every slot. A
//!   refused connection that asks for `/health` or `/metrics` is served all the same
//!   ([`admit`]).
//! - A connection must send its first byte within [`FIRST_BYTE`] (or the header timeout,
//!   if shorter), deliver a complete request head within [`Limits::header_timeout`] of
//!   opening, and again within it of its previous response (keep-alive idle time).
//! - A response write that makes no progress for [`Limits::write_timeout`] (a client that
//!   stopped reading) closes the connection.
//! - Request bodies have their own size and time limits ([`crate::body`]).
//! - Each request is told whether its head carried both `Content-Length` and
//!   `Transfer-Encoding` ([`framing`]), which hyper hides; [`head`] refuses that pair and
//!   the other heads a proxy could read otherwise.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::StatusCode;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::{sleep, timeout, Sleep};

use crate::api::ApiError;

mod admit;
pub(crate) mod framing;
pub(crate) mod head;

/// How much of the server one client may take, and for how long.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Of those, the most one client address holds.
    pub max_connections_per_client: usize,
    /// From opening (or the previous response) to a complete request head.
    pub header_timeout: Duration,
    /// For a whole request body.
    pub body_timeout: Duration,
    /// How long a response write may make no progress.
    pub write_timeout: Duration,
    /// Largest request body.
    pub max_body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 512,
            max_connections_per_client: Limits::per_client_share(512),
            header_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(60),
            max_body_bytes: 8 << 20,
        }
    }
}

impl Limits {
    /// One client's default share of `max_connections`: all but an eighth (at least one
    /// slot left to the others where there are two).
    pub fn per_client_share(max_connections: usize) -> usize {
        max_connections.saturating_sub((max_connections / 8).max(1)).max(1)
    }
}

/// The longest a new connection may wait before its first byte (a real client sends its
/// request at once; a half-open one holds a slot until then).
pub const FIRST_BYTE: Duration = Duration::from_secs(10);

/// Connections over the limit answered at once; more than this are closed unanswered.
const REFUSALS_AT_ONCE: usize = 64;
/// How long connections get to finish after shutdown is asked.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Serves `app` on `listener` until `shutdown` completes, then gives open connections
/// [`SHUTDOWN_GRACE`] to finish.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    if let Some(files) = open_file_limit() {
        // Model files, the listener and refusals need descriptors beyond the connections.
        if limits.max_connections.saturating_add(REFUSALS_AT_ONCE + 64) as u64 > files {
            tracing::warn!(
                "--max-connections {} is near this process's open-file limit of {files}: raise it (ulimit -n) or lower the flag",
                limits.max_connections
            );
        }
    }
    let open = Arc::new(Semaphore::new(limits.max_connections));
    let per_client = admit::PerClient::new(limits.max_connections_per_client);
    let refusing = Arc::new(Semaphore::new(REFUSALS_AT_ONCE));
    let graceful = GracefulShutdown::new();
    // HTTP/1.1 only: sniffing for HTTP/2 would wait on a silent client with no timeout.
    let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    // A probe served past the limits: its one request, then closed.
    let mut probes = auto::Builder::new(TokioExecutor::new()).http1_only();
    probes.http1().timer(TokioTimer::new()).header_read_timeout(Duration::from_secs(1)).keep_alive(false);
    let probes = Arc::new(probes);
    let service = TowerToHyperService::new(app);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors (or a connection reset before accept): wait, don't spin.
                    tracing::warn!("accept: {e}");
                    sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let client = per_client.take(peer.ip());
        let permit = client.as_ref().and_then(|_| open.clone().try_acquire_owned().ok());
        let why = match client {
            None => Refusal::Client(limits.max_connections_per_client),
            Some(_) => Refusal::Server(limits.max_connections),
        };
        let (Some(client), Some(permit)) = (client, permit) else {
            if let Ok(slot) = refusing.clone().try_acquire_owned() {
                let (probes, service) = (probes.clone(), service.clone());
                tokio::spawn(async move {
                    let mut stream = stream;
                    match admit::probe(&mut stream).await {
                        Some(read) => {
                            let io = TokioIo::new(admit::rejoined(read, stream));
                            let _ =
                                timeout(Duration::from_secs(5), probes.serve_connection(io, service)).await;
                        }
                        None => refuse(stream, why).await,
                    }
                    drop(slot);
                });
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let first_byte = limits.header_timeout.min(FIRST_BYTE);
        let heads = Arc::new(framing::Heads::default());
        let mut io = Timed::new(stream, first_byte, limits.write_timeout);
        io.tap = Some(framing::Tap::new(heads.clone()));
        let io = TokioIo::new(io);
        // Each request carries its head's framing, as the tap read it.
        let inner = service.clone();
        let tagged =
            hyper::service::service_fn(move |mut req: axum::http::Request<hyper::body::Incoming>| {
                if let Some(f) = heads.next() {
                    req.extensions_mut().insert(f);
                }
                hyper::service::Service::call(&inner, req)
            });
        // Not `serve_connection_with_upgrades`: it sniffs for HTTP/2 whatever `http1_only` says,
        // and an HTTP/2 connection escapes the header timeout.
        let conn = builder.serve_connection(io, tagged).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection: {e}");
            }
            drop((permit, client));
        });
    }
    drop(listener);
    if timeout(SHUTDOWN_GRACE, graceful.shutdown()).await.is_err() {
        tracing::info!("shutdown: closing connections still open after {SHUTDOWN_GRACE:?}");
    }
}

/// The soft limit on open files, where the system says (Linux).
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Which limit a refused connection met.
#[derive(Clone, Copy)]
enum Refusal {
    /// Its client holds this many connections.
    Client(usize),
    /// The server holds this many.
    Server(usize),
}

/// Answers a connection over a limit with a 503 (OpenAI error JSON) and closes it.
async fn refuse(mut stream: TcpStream, why: Refusal) {
    let message = match why {
        Refusal::Client(n) => format!(
            "this client holds its limit of {n} connections (--max-connections-per-client); retry later"
        ),
        Refusal::Server(n) => {
            format!("the server holds its limit of {n} connections (--max-connections); retry later")
        }
    };
    let body = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message).body().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nretry-after: 1\r\n\r\n",
        body.len()
    );
    let answer = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        // Read what the client sent, so closing does not reset the connection before it
        // has read the answer.
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        io::Result::Ok(())
    };
    let _ = timeout(Duration::from_secs(1), answer).await;
}

/// A TCP stream whose writes fail once they have been blocked for `limit`, and whose
/// reads fail if no first byte comes within the header timeout (hyper's own header timeout
/// starts with the first byte; after that, and between keep-alive requests, it applies).
struct Timed {
    inner: TcpStream,
    limit: Duration,
    blocked: Option<Pin<Box<Sleep>>>,
    first_byte: Option<Pin<Box<Sleep>>>,
    /// Reads what is read, framing its requests.
    tap: Option<framing::Tap>,
}

impl Timed {
    fn new(inner: TcpStream, header_timeout: Duration, limit: Duration) -> Self {
        let first_byte = Some(Box::pin(sleep(header_timeout)));
        Timed { inner, limit, blocked: None, first_byte, tap: None }
    }

    /// Passes `poll` through, starting the stall clock when it is pending and failing
    /// once the clock runs out.
    fn watch<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.blocked = None;
            return poll;
        }
        let limit = self.limit;
        let clock = self.blocked.get_or_insert_with(|| Box::pin(sleep(limit)));
        match clock.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Timed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let (Poll::Ready(Ok(())), Some(tap)) = (&poll, self.tap.as_mut()) {
            tap.feed(&buf.filled()[before..]);
        }
        let Some(deadline) = self.first_byte.as_mut() else { return poll };
        match poll {
            Poll::Ready(Ok(())) if buf.filled().len() == before => poll, // closed before a byte
            Poll::Ready(_) => {
                self.first_byte = None;
                poll
            }
            Poll::Pending => match deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client sent nothing within the header timeout",
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for Timed {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected pair: the server's end wrapped, the client's end raw.
    async fn pair(header_timeout: Duration, write_timeout: Duration) -> (Timed, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (Timed::new(server, header_timeout, write_timeout), client)
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_fails_the_write() {
        let (mut server, _client) = pair(Duration::from_secs(60), Duration::from_millis(200)).await;
        let chunk = vec![0u8; 1 << 16];
        let t = std::time::Instant::now();
        let mut written = 0usize;
        let err = loop {
            match server.write_all(&chunk).await {
                Ok(()) => written += chunk.len(),
                Err(e) => break e,
            }
            assert!(written < 1 << 30, "a client that reads nothing took a GiB");
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[tokio::test]
    async fn a_client_that_sends_nothing_fails_the_read_but_one_that_sends_is_read() {
        let (mut silent, _client) = pair(Duration::from_millis(200), Duration::from_secs(60)).await;
        let mut buf = [0u8; 16];
        let err = silent.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // Negative control: a byte before the deadline clears it for good.
        let (mut talker, mut client) = pair(Duration::from_millis(200), Duration::from_secs(60)).await;
        client.write_all(b"G").await.unwrap();
        assert_eq!(talker.read(&mut buf).await.unwrap(), 1);
        let later = timeout(Duration::from_millis(500), talker.read(&mut buf)).await;
        assert!(later.is_err(), "after the first byte, waiting is hyper's business: {later:?}");
    }
}
