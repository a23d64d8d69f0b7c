//! The access log: one `info` line (target `mtp::access`) per generation request, written
//! when the request ends however it ends: answered, refused, failed, or its client gone
//! (the line is written when the request's [`RequestLog`] is dropped).
//!
//! Fields: `id` (the response id the client sees, `cmpl-N` / `chatcmpl-N`), `route`
//! (`completions` or `chat`), `status` (the HTTP status sent, `-` for none; a stream's is
//! 200 once it starts), `outcome` (`ok`, `refused`: a 4xx, `error`: a 5xx or a stream the
//! engine failed mid-way, `disconnected`: the client went away first), `prompt_tokens`,
//! `completion_tokens` (all choices'), `finish` (each choice's finish reason as the client
//! sees it, comma-separated, `-` for one that did not finish), `ttft_ms` (from the request
//! reaching its handler to its first token reaching the HTTP side; `-` without a token),
//! `total_ms` (from reaching the handler to the end), `stream`.
//! `/v1/responses` writes route `responses`, its ids `resp_N`.

use std::fmt;
use std::time::{Duration, Instant};

use crate::routes::Kind;

/// A request's access-log line, filled in as it runs and written when dropped.
pub(crate) struct RequestLog(Option<Entry>);

struct Entry {
    id: String,
    route: &'static str,
    started: Instant,
    stream: bool,
    status: Option<u16>,
    outcome: &'static str,
    prompt_tokens: usize,
    completion_tokens: usize,
    first_token: Option<Duration>,
    total: Option<Duration>,
    finish: Vec<Option<&'static str>>,
}

impl RequestLog {
    /// The log of a request that reached its handler now, answered under the response id
    /// `id`.
    pub(crate) fn new(id: String, kind: Kind) -> RequestLog {
        RequestLog::for_route(id, if kind == Kind::Chat { "chat" } else { "completions" })
    }

    /// [`RequestLog::new`] under a route of another name (`messages`).
    pub(crate) fn for_route(id: String, route: &'static str) -> RequestLog {
        RequestLog(Some(Entry {
            id,
            route,
            started: Instant::now(),
            stream: false,
            status: None,
            outcome: "disconnected",
            prompt_tokens: 0,
            completion_tokens: 0,
            first_token: None,
            total: None,
            finish: Vec::new(),
        }))
    }

    /// The line's `route`, for an endpoint that runs as another's `kind` (`/v1/responses`
    /// runs as chat).
    pub(crate) fn on_route(mut self, route: &'static str) -> RequestLog {
        if let Some(e) = &mut self.0 {
            e.route = route;
        }
        self
    }

    /// The response id (empty once handed off).
    pub(crate) fn id(&self) -> &str {
        self.0.as_ref().map_or("", |e| e.id.as_str())
    }

    /// Moves the line into a new log (a stream's, which outlives its handler); this one
    /// then writes nothing.
    /// A log that writes nothing (a part of a request whose line another log writes).
    pub(crate) fn none() -> RequestLog {
        RequestLog(None)
    }

    pub(crate) fn hand_off(&mut self) -> RequestLog {
        RequestLog(self.0.take())
    }

    pub(crate) fn set_stream(&mut self, stream: bool) {
        if let Some(e) = &mut self.0 {
            e.stream = stream;
        }
    }

    /// The request's prompt length and number of choices, once known.
    pub(crate) fn planned(&mut self, prompt_tokens: usize, choices: usize) {
        if let Some(e) = &mut self.0 {
            e.prompt_tokens = prompt_tokens;
            e.finish = vec![None; choices];
        }
    }

    /// A token of any choice reached the HTTP side.
    pub(crate) fn token(&mut self) {
        if let Some(e) = &mut self.0 {
            e.completion_tokens = e.completion_tokens.saturating_add(1);
            e.first_token.get_or_insert_with(|| e.started.elapsed());
        }
    }

    /// Choice `choice` finished with `reason` (as the client sees it).
    pub(crate) fn finished(&mut self, choice: usize, reason: &'static str) {
        if let Some(slot) = self.0.as_mut().and_then(|e| e.finish.get_mut(choice)) {
            *slot = Some(reason);
        }
    }

    /// A stream began: its status is sent.
    pub(crate) fn started_stream(&mut self) {
        if let Some(e) = &mut self.0 {
            e.status = Some(200);
        }
    }

    /// The request ended with `outcome` (the status already sent, for a stream); the first
    /// end recorded stands.
    pub(crate) fn ended(&mut self, outcome: &'static str) {
        if let Some(e) = self.0.as_mut().filter(|e| e.total.is_none()) {
            e.outcome = outcome;
            e.total = Some(e.started.elapsed());
        }
    }

    /// The request was answered with `status` (a whole body or a refusal).
    pub(crate) fn answered(&mut self, status: u16) {
        if let Some(e) = &mut self.0 {
            e.status = Some(status);
        }
        self.ended(match status {
            400..=499 => "refused",
            500.. => "error",
            _ => "ok",
        });
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let Some(e) = self.0.take() else { return };
        let total = e.total.unwrap_or_else(|| e.started.elapsed());
        let finish = Finish(&e.finish);
        tracing::info!(
            target: "mtp::access",
            id = %e.id,
            route = %e.route,
            status = %Or(e.status),
            outcome = %e.outcome,
            prompt_tokens = e.prompt_tokens,
            completion_tokens = e.completion_tokens,
            finish = %finish,
            ttft_ms = %Or(e.first_token.map(Ms)),
            total_ms = %Ms(total),
            stream = e.stream,
            "request"
        );
    }
}

/// A value, or `-` for none.
struct Or<T>(Option<T>);

impl<T: fmt::Display> fmt::Display for Or<T> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match &self.0 {
            Some(v) => v.fmt(f),
            None => f.write_str("-"),
        }
    }
}

/// A duration in milliseconds, to a tenth.
struct Ms(Duration);

impl fmt::Display for Ms {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{:.1}", self.0.as_secs_f64() * 1e3)
    }
}

/// The choices' finish reasons, comma-separated (`-` for none at all).
struct Finish<'a>(&'a [Option<&'static str>]);

impl fmt::Display for Finish<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("-");
        }
        for (i, r) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            write!(f, "{sep}{}", r.unwrap_or("-"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_print_a_dash_for_none() {
        assert_eq!(Or::<u16>(None).to_string(), "-");
        assert_eq!(Or(Some(200)).to_string(), "200");
        assert_eq!(Ms(Duration::from_micros(12_345)).to_string(), "12.3");
        assert_eq!(Finish(&[]).to_string(), "-");
        assert_eq!(Finish(&[Some("stop"), None, Some("length")]).to_string(), "stop,-,length");
    }

    #[test]
    fn a_handed_off_log_keeps_the_line() {
        let mut log = RequestLog::new("cmpl-7".into(), Kind::Completion);
        log.planned(5, 1);
        log.token();
        let mut moved = log.hand_off();
        assert_eq!((log.id(), moved.id()), ("", "cmpl-7"));
        moved.finished(0, "stop");
        moved.finished(3, "stop"); // no such choice: ignored
        let e = moved.0.as_ref().unwrap();
        assert_eq!((e.prompt_tokens, e.completion_tokens, e.finish.as_slice()), (5, 1, &[Some("stop")][..]));
        assert!(e.first_token.is_some());
    }
}
