//! Who may use the server: an API key, browser origins, and Host names.
//!
//! - With an API key, every endpoint but `/health` wants `Authorization: Bearer <key>` or
//!   Anthropic's `x-api-key: <key>` (compared in constant time); otherwise `401`. Refusals
//!   of `/v1/messages` requests take Anthropic's error shape.
//! - A request carrying an `Origin` header comes from a web page. It is refused (`403`)
//!   unless the origin is allowed, because a page can send a `text/plain` POST to any
//!   address without a CORS preflight. Allowed origins get CORS headers and preflights.
//! - On a loopback address the `Host` must name loopback (`localhost`, `127.0.0.1`,
//!   `[::1]`) or an allowed host: a DNS-rebinding page reaches 127.0.0.1 under its own
//!   name, and is refused (`403`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::api::ApiError;

/// Who may use the server (the `serve` flags `--api-key`, `--allowed-origins`,
/// `--allowed-hosts`).
#[derive(Clone, Debug, Default)]
pub struct Access {
    pub api_key: Option<String>,
    /// Origins (`https://app.example`) whose pages may call the server; `*`: any.
    pub allowed_origins: Vec<String>,
    /// Host names accepted besides loopback's on a loopback bind; `*`: any. On other binds
    /// they are the only ones accepted, when given.
    pub allowed_hosts: Vec<String>,
}

/// [`Access`] for one bound address.
pub(crate) struct Gate {
    access: Access,
    /// Host names accepted (lowercase, no port); empty: any.
    hosts: Vec<String>,
}

impl Gate {
    pub(crate) fn new(access: Access, bound: SocketAddr) -> Gate {
        let mut hosts: Vec<String> = access.allowed_hosts.iter().map(|h| h.to_ascii_lowercase()).collect();
        if hosts.iter().any(|h| h == "*") {
            hosts.clear();
        } else if bound.ip().is_loopback() {
            hosts.extend(["localhost", "127.0.0.1", "[::1]"].map(String::from));
        }
        Gate { access, hosts }
    }

    fn any_origin(&self) -> bool {
        self.access.allowed_origins.iter().any(|o| o == "*")
    }

    /// CORS headers and preflight answers for the allowed origins (none without any).
    pub(crate) fn cors(&self) -> Option<CorsLayer> {
        if self.access.allowed_origins.is_empty() {
            return None;
        }
        let origins = if self.any_origin() {
            AllowOrigin::any()
        } else {
            AllowOrigin::list(
                self.access.allowed_origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()),
            )
        };
        Some(
            CorsLayer::new()
                .allow_origin(origins)
                .allow_methods([Method::GET, Method::POST])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    header::HeaderName::from_static("x-api-key"),
                    header::HeaderName::from_static("anthropic-version"),
                    header::HeaderName::from_static("anthropic-beta"),
                ])
                .max_age(Duration::from_secs(600)),
        )
    }

    /// Why `req` may not be served, if it may not.
    fn refusal(&self, req: &Request) -> Option<ApiError> {
        let headers = req.headers();
        // Two Hosts were refused before ([`crate::net::head`]).
        if !self.hosts.is_empty() {
            let host = req.uri().authority().map(|a| a.as_str()).or_else(|| header_str(req, header::HOST));
            let name = host.map(host_name).unwrap_or_default();
            if !self.hosts.contains(&name) {
                return Some(ApiError::new(
                    StatusCode::FORBIDDEN,
                    format!("Host `{}` is not served here (--allowed-hosts)", host.unwrap_or("")),
                ));
            }
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let allowed = self.any_origin()
                || self.access.allowed_origins.iter().any(|o| o.as_bytes() == origin.as_bytes());
            if !allowed {
                return Some(ApiError::new(
                    StatusCode::FORBIDDEN,
                    format!(
                        "requests from web pages at {} are not allowed (--allowed-origins)",
                        String::from_utf8_lossy(origin.as_bytes())
                    ),
                ));
            }
        }
        // Preflights carry no credentials; the request they clear will.
        let open = req.uri().path() == "/health" || req.method() == Method::OPTIONS;
        if let (Some(key), false) = (&self.access.api_key, open) {
            let bearer = header_str(req, header::AUTHORIZATION).and_then(|v| v.strip_prefix("Bearer "));
            let x_api_key = header_str(req, header::HeaderName::from_static("x-api-key"));
            let matches = |g: &str| bool::from(g.trim().as_bytes().ct_eq(key.as_bytes()));
            if !bearer.is_some_and(matches) && !x_api_key.is_some_and(matches) {
                return Some(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "a missing or wrong API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                ));
            }
        }
        None
    }
}

fn header_str(req: &Request, name: header::HeaderName) -> Option<&str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

/// `host[:port]` or `[v6]:port` without its port, lowercase.
fn host_name(host: &str) -> String {
    let name = match host.rfind(':') {
        Some(i) if !host[i..].contains(']') => &host[..i],
        _ => host,
    };
    name.to_ascii_lowercase()
}

/// The middleware: refuses a malformed head ([`crate::net::head`]) and what [`Gate`]
/// refuses, passes the rest on.
pub(crate) async fn check(State(gate): State<Arc<Gate>>, req: Request, next: Next) -> Response {
    match crate::net::head::refusal(&req).or_else(|| gate.refusal(&req)) {
        Some(e) => {
            tracing::debug!(status = e.status.as_u16(), "{}", e.message);
            crate::routes::error_for(req.uri().path(), &e)
        }
        None => next.run(req).await,
    }
}

#[cfg(test)]
mod tests {
    use super::host_name;

    #[test]
    fn host_names_lose_their_port() {
        assert_eq!(host_name("LocalHost:8000"), "localhost");
        assert_eq!(host_name("127.0.0.1"), "127.0.0.1");
        assert_eq!(host_name("[::1]:80"), "[::1]");
        assert_eq!(host_name("[::1]"), "[::1]");
        assert_eq!(host_name("evil.example:8000"), "evil.example");
    }
}
