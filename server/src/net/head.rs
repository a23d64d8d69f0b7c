//! A request head's own headers, vetted before access is checked or any endpoint runs:
//! those whose doubles or oddities a proxy in front of the server and the server itself
//! could each read differently, and a body coding the server cannot read.
//!
//! Contract: [`refusal`] answers, in this order, `400` for a request that carried both
//! `Content-Length` and `Transfer-Encoding` (seen by [`super::framing`]; hyper hides the
//! pair), more than one `Host` (RFC 9112, 3.2), a `Host` whose port is not a number from 1
//! to 65535, more than one `Content-Type`; and `415` for a body sent with a
//! `Content-Encoding` other than `identity`, naming it. Each error's `param` is the header.

use axum::extract::Request;
use axum::http::{header, HeaderName, StatusCode};

use super::framing::Framing;
use crate::api::{quote, ApiError};

/// Why `req`'s head is refused, if it is.
pub(crate) fn refusal(req: &Request) -> Option<ApiError> {
    let headers = req.headers();
    if req.extensions().get::<Framing>().is_some_and(|f| f.length_and_chunked) {
        return Some(ApiError::bad(
            "Transfer-Encoding",
            "the request carries both Content-Length and Transfer-Encoding: send one (RFC 9112, 6.3; \
             a proxy reading the other one would see another request)",
        ));
    }
    let count = |name: HeaderName| headers.get_all(name).iter().count();
    // Which one a proxy and this server each read would differ.
    if count(header::HOST) > 1 {
        return Some(ApiError::bad("Host", "more than one Host header"));
    }
    let hosts = [
        req.uri().authority().map(|a| a.as_str().as_bytes()),
        headers.get(header::HOST).map(|h| h.as_bytes()),
    ];
    for host in hosts.into_iter().flatten() {
        if let Err(why) = check_host(host) {
            let shown = quote(&String::from_utf8_lossy(host));
            return Some(ApiError::bad("Host", format!("Host `{shown}` is not valid: {why}")));
        }
    }
    if count(header::CONTENT_TYPE) > 1 {
        return Some(ApiError::bad("Content-Type", "more than one Content-Type header"));
    }
    let has_body = headers.contains_key(header::TRANSFER_ENCODING)
        || headers.get(header::CONTENT_LENGTH).is_some_and(|v| v.as_bytes() != b"0");
    let codings = headers.get_all(header::CONTENT_ENCODING).iter();
    let coded = codings
        .flat_map(|v| {
            String::from_utf8_lossy(v.as_bytes()).split(',').map(|c| c.trim().to_string()).collect::<Vec<_>>()
        })
        .find(|c| !c.is_empty() && !c.eq_ignore_ascii_case("identity"));
    if let (true, Some(c)) = (has_body, coded) {
        return Some(
            ApiError::bad(
                "Content-Encoding",
                format!("Content-Encoding `{}` is not supported: send the body uncompressed", quote(&c)),
            )
            .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE),
        );
    }
    None
}

/// `Ok` for `name`, `name:port`, `[v6]` or `[v6]:port` with a port from 1 to 65535.
fn check_host(host: &[u8]) -> Result<(), &'static str> {
    let host = std::str::from_utf8(host).map_err(|_| "not ASCII")?;
    let port = match host.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((_, "")) => None,
            Some((_, rest)) => Some(rest.strip_prefix(':').ok_or("text after the IPv6 address")?),
            None => return Err("an unclosed `[`"),
        },
        None => match host.split_once(':') {
            Some((_, port)) if port.contains(':') => {
                return Err("more than one `:` (an IPv6 address goes in [])")
            }
            Some((_, port)) => Some(port),
            None => None,
        },
    };
    match port {
        None => Ok(()),
        Some(p) if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) => {
            Err("its port must be a number from 1 to 65535")
        }
        Some(p) => match p.parse::<u32>() {
            Ok(1..=65535) => Ok(()),
            _ => Err("its port must be a number from 1 to 65535"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::check_host;

    #[test]
    fn host_ports_are_numbers_in_range() {
        for ok in ["localhost", "localhost:8000", "127.0.0.1:1", "[::1]", "[::1]:65535", "a.example:443"] {
            assert_eq!(check_host(ok.as_bytes()), Ok(()), "{ok}");
        }
        for bad in [
            "localhost:",
            "localhost:x",
            "localhost:80x",
            "localhost:0",
            "localhost:65536",
            "h:99999999999",
            "[::1",
            "[::1]x",
            "::1",
            "h:+80",
        ] {
            assert!(check_host(bad.as_bytes()).is_err(), "{bad}");
        }
    }
}
