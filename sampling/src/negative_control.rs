//! Test-only fault switch: key each pick's random numbers by a per-thread count of picks
//! instead of the token's position, as a stream generator whose state advances per draw
//! would. Speculative and plain decoding then draw
//! different numbers and the parity gate must fail.

use std::cell::Cell;

thread_local! {
    static STREAM: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Turns the stream-generator fault on or off for this thread.
pub fn set_stream_rng(on: bool) {
    STREAM.with(|s| s.set(if on { Some(0) } else { None }));
}

pub(crate) fn position_for(position: u64) -> u64 {
    STREAM.with(|s| match s.get() {
        None => position,
        Some(n) => {
            s.set(Some(n + 1));
            n
        }
    })
}

thread_local! {
    static BIASED: Cell<bool> = const { Cell::new(false) };
}

/// Makes rejected drafts resample from `p` instead of `max(0, p - q)` on this thread: a
/// biased acceptor that the distribution tests must catch.
pub fn set_biased_rejection(on: bool) {
    BIASED.with(|b| b.set(on));
}

pub(crate) fn biased_rejection() -> bool {
    BIASED.with(|b| b.get())
}

/// The fault switches of the calling thread, to carry onto worker threads.
#[derive(Clone, Copy, Debug)]
pub struct Faults {
    stream: Option<u64>,
    biased: bool,
}

/// This thread's switches.
pub fn current() -> Faults {
    Faults { stream: STREAM.with(|s| s.get()), biased: biased_rejection() }
}

impl Faults {
    /// Runs `f` with these switches on the current thread, then restores its own.
    pub fn apply<T>(self, f: impl FnOnce() -> T) -> T {
        let saved = current();
        self.install();
        let out = f();
        saved.install();
        out
    }

    fn install(self) {
        STREAM.with(|s| s.set(self.stream));
        BIASED.with(|b| b.set(self.biased));
    }
}
