//! Which requests of a connection came with both `Content-Length` and `Transfer-Encoding`.
//! hyper frames such a body by `Transfer-Encoding` alone, drops `Content-Length` and closes
//! the connection after answering (RFC 9112, 6.3), so the handlers never see that both
//! were sent; yet the pair is how requests are smuggled past a proxy that reads the other
//! one, and "ought to be handled as an error". A [`Tap`] reads the bytes of the connection
//! as hyper reads them, frames each request as hyper does (a head up to its blank line,
//! then a chunked body or `Content-Length` bytes), and queues one flag per head; each
//! request takes the first flag off the queue ([`Heads::next`]) as its [`Framing`].
//!
//! Contract: fail-safe. The tap judges nothing it cannot frame: a head it cannot read (too
//! long, a malformed length or chunk, an upgrade) turns it off for the rest of the
//! connection, and a request finding the queue empty is not judged (hyper refuses or
//! closes the connection on most of those). It never changes, delays or holds the bytes.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// A request's framing headers, as its head carried them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Framing {
    /// Both `Content-Length` and `Transfer-Encoding` were sent.
    pub(crate) length_and_chunked: bool,
}

/// The flags of the heads read so far and not yet taken by their requests.
#[derive(Default)]
pub(crate) struct Heads(Mutex<VecDeque<Framing>>);

impl Heads {
    /// The next request's framing (`None`: not known).
    pub(crate) fn next(&self) -> Option<Framing> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pop_front()
    }

    /// Queues a head's flag; `false` when too many wait (a pipelining flood).
    fn push(&self, f: Framing) -> bool {
        let mut q = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= MOST_QUEUED {
            return false;
        }
        q.push_back(f);
        true
    }
}

/// Heads queued at most (hyper reads ahead only as far as its buffer).
const MOST_QUEUED: usize = 1024;
/// The longest head framed (hyper's own limit on a head is below it).
const MOST_HEAD_BYTES: usize = 1 << 20;

/// Where the tap is in the connection's bytes.
enum State {
    /// In a head: the bytes so far (leading blank lines skipped, as hyper skips them).
    Head(Vec<u8>),
    /// In a body of this many bytes still to come.
    Sized(u64),
    /// In a chunked body.
    Chunk(Chunk),
    /// Lost: judging nothing more.
    Off,
}

enum Chunk {
    /// A chunk's size line: the size so far, and whether past its extensions' `;`.
    Size { size: u64, digits: usize, ext: bool },
    /// This many bytes of chunk data to come.
    Data(u64),
    /// The line end after a chunk's data.
    DataEnd,
    /// After the last chunk: a trailer line of this many bytes so far.
    Trailer(usize),
}

/// One connection's framer, fed what hyper reads.
pub(crate) struct Tap {
    state: State,
    heads: Arc<Heads>,
}

impl Tap {
    pub(crate) fn new(heads: Arc<Heads>) -> Tap {
        Tap { state: State::Head(Vec::new()), heads }
    }

    /// Frames `bytes`, the next ones read from the connection.
    pub(crate) fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let used = match &mut self.state {
                State::Off => return,
                State::Head(head) => {
                    let mut used = 0;
                    let mut done = false;
                    for &b in bytes {
                        used += 1;
                        if head.is_empty() && (b == b'\r' || b == b'\n') {
                            continue;
                        }
                        head.push(b);
                        if head.ends_with(b"\n\n") || head.ends_with(b"\n\r\n") {
                            done = true;
                            break;
                        }
                    }
                    if done {
                        let head = std::mem::take(head);
                        self.state = self.headed(&head);
                    } else if head.len() > MOST_HEAD_BYTES {
                        self.state = State::Off;
                    }
                    used
                }
                State::Sized(left) => {
                    let n = (*left).min(bytes.len() as u64);
                    *left -= n;
                    if *left == 0 {
                        self.state = State::Head(Vec::new());
                    }
                    n as usize
                }
                State::Chunk(c) => match chunk(c, bytes) {
                    Some((used, false)) => used,
                    Some((used, true)) => {
                        self.state = State::Head(Vec::new());
                        used
                    }
                    None => {
                        self.state = State::Off;
                        return;
                    }
                },
            };
            bytes = &bytes[used..];
        }
    }

    /// The state after a whole head: its flag queued, then its body's framing.
    fn headed(&self, head: &[u8]) -> State {
        let Ok(text) = std::str::from_utf8(head) else { return State::Off };
        let (mut lengths, mut chunked, mut te, mut upgrade) = (Vec::new(), false, false, false);
        for line in text.lines().skip(1) {
            let Some((name, value)) = line.split_once(':') else { continue };
            let value = value.trim();
            match name.to_ascii_lowercase().as_str() {
                "content-length" => lengths.push(value),
                // As hyper reads it: the last header's last coding says chunked.
                "transfer-encoding" => {
                    te = true;
                    chunked =
                        value.rsplit(',').next().is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"));
                }
                "upgrade" => upgrade = true,
                _ => {}
            }
        }
        // Without Transfer-Encoding the length frames the body: every one the same number.
        let length = match lengths.first().map(|l| l.parse::<u64>()) {
            _ if te => None,
            None => None,
            Some(Ok(n)) if lengths.iter().all(|l| l.parse::<u64>().ok() == Some(n)) => Some(n),
            Some(_) => return State::Off,
        };
        let connect = text.starts_with("CONNECT ");
        if upgrade || connect || (te && !chunked) {
            return State::Off;
        }
        if !self.heads.push(Framing { length_and_chunked: te && !lengths.is_empty() }) {
            return State::Off;
        }
        match (te, length) {
            (true, _) => State::Chunk(Chunk::Size { size: 0, digits: 0, ext: false }),
            (false, Some(n)) if n > 0 => State::Sized(n),
            _ => State::Head(Vec::new()),
        }
    }
}

/// Frames chunked-body bytes: how many it used and whether the body ended there; `None`
/// where the body is malformed.
fn chunk(c: &mut Chunk, bytes: &[u8]) -> Option<(usize, bool)> {
    let mut used = 0;
    while used < bytes.len() {
        let b = bytes[used];
        match c {
            Chunk::Size { size, digits, ext } => {
                used += 1;
                match b {
                    b'\n' if *digits == 0 => return None,
                    b'\n' if *size == 0 => *c = Chunk::Trailer(0),
                    b'\n' => *c = Chunk::Data(*size),
                    b'\r' => {}
                    _ if *ext => {}
                    b';' | b' ' | b'\t' => *ext = true,
                    _ => {
                        let d = (b as char).to_digit(16)? as u64;
                        *digits += 1;
                        *size = size.checked_mul(16)?.checked_add(d)?;
                    }
                }
            }
            Chunk::Data(left) => {
                let n = (*left).min((bytes.len() - used) as u64);
                *left -= n;
                used += n as usize;
                if *left == 0 {
                    *c = Chunk::DataEnd;
                }
            }
            Chunk::DataEnd => {
                used += 1;
                match b {
                    b'\r' => {}
                    b'\n' => *c = Chunk::Size { size: 0, digits: 0, ext: false },
                    _ => return None,
                }
            }
            Chunk::Trailer(n) => {
                used += 1;
                match b {
                    b'\n' if *n == 0 => return Some((used, true)),
                    b'\n' => *n = 0,
                    b'\r' => {}
                    _ => *n += 1,
                }
            }
        }
    }
    Some((used, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags of the heads in `stream`, fed in pieces of `step` bytes.
    fn flags(stream: &str, step: usize) -> Vec<bool> {
        let heads = Arc::new(Heads::default());
        let mut tap = Tap::new(heads.clone());
        for piece in stream.as_bytes().chunks(step) {
            tap.feed(piece);
        }
        std::iter::from_fn(|| heads.next()).map(|f| f.length_and_chunked).collect()
    }

    #[test]
    fn heads_are_framed_as_hyper_frames_them() {
        // A body holding what looks like a head is skipped by its length.
        let body =
            "{\"x\": \"\r\n\r\nGET / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n\"}";
        let sized = format!("POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        let chunked = "POST /b HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n4;ext=1\r\nab\r\n\r\n0\r\nT: 1\r\n\r\n";
        let both = "POST /c HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        let both_te_first = "POST /d HTTP/1.1\ntransfer-encoding: chunked\ncontent-length: 5\n\n0\r\n\r\n";
        let get = "\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n";
        let stream = [sized.as_str(), chunked, both, get, both_te_first, get].concat();
        for step in [1, 3, 7, stream.len()] {
            assert_eq!(flags(&stream, step), [false, false, true, false, true, false], "step {step}");
        }
        // Lost on what it cannot frame: nothing more is judged.
        assert_eq!(
            flags(&format!("POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n{both}"), 5),
            Vec::<bool>::new()
        );
        assert_eq!(
            flags(&format!("{both}POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{both}"), 4),
            [true, false]
        );
        // With Transfer-Encoding a length counts whatever it holds (hyper ignores it).
        let garbled = "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: x\r\n\r\n0\r\n\r\n";
        assert_eq!(flags(&format!("{garbled}{get}"), 2), [true, false]);
    }
}
