//! Request latencies measured on the engine thread, every clock started when the thread
//! takes the job (its HTTP parsing and tokenizing come before and are not counted).
//!
//! Contract, per request:
//! - queue time: taken to its first `Admitted` (a resumed row's later ones are not timed);
//! - time to first token: taken to the step that brought its first token;
//! - inter-token latency: one sample per token after the first. The engine brings a row
//!   several tokens per step (the accepted drafts), all at once, so the gap since the
//!   request's previous step is spread evenly over the tokens this step brought: the
//!   samples' sum is last-token time minus first-token time, their count tokens minus one
//!   (tokens that came in the first token's own step get 0);
//! - end to end: taken to its `Finished` or `Failed`, cancelled ones included.
//!
//! A request that ends before a clock's event (cancelled in the queue, say) records
//! nothing there.

use std::time::Instant;

use crate::histogram::{Histogram, ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS};

/// The four latency histograms (`/metrics` renders them).
#[derive(Clone, Debug)]
pub struct Latencies {
    pub time_to_first_token: Histogram,
    pub inter_token: Histogram,
    pub queue: Histogram,
    pub end_to_end: Histogram,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies {
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token: Histogram::new(ITL_BUCKETS),
            queue: Histogram::new(REQUEST_BUCKETS),
            end_to_end: Histogram::new(REQUEST_BUCKETS),
        }
    }
}

/// One live request's timestamps.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    taken: Instant,
    admitted: bool,
    last_token: Option<Instant>,
}

impl Clock {
    /// The clock of a job the engine thread takes at `now`.
    pub fn start(now: Instant) -> Clock {
        Clock { taken: now, admitted: false, last_token: None }
    }

    pub fn admitted(&mut self, now: Instant, l: &mut Latencies) {
        if !self.admitted {
            self.admitted = true;
            l.queue.observe(now.saturating_duration_since(self.taken).as_secs_f64());
        }
    }

    /// `tokens` tokens of this request came in the step that ended at `now`.
    pub fn tokens(&mut self, now: Instant, tokens: usize, l: &mut Latencies) {
        let (gap, spread) = match self.last_token {
            None if tokens > 0 => {
                l.time_to_first_token.observe(now.saturating_duration_since(self.taken).as_secs_f64());
                (0.0, tokens - 1)
            }
            None => return,
            Some(prev) => (now.saturating_duration_since(prev).as_secs_f64(), tokens),
        };
        for _ in 0..spread {
            l.inter_token.observe(gap / spread as f64);
        }
        self.last_token = Some(now);
    }

    pub fn ended(&self, now: Instant, l: &mut Latencies) {
        l.end_to_end.observe(now.saturating_duration_since(self.taken).as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_steps_gap_is_spread_over_its_tokens() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut l = Latencies::default();
        let mut c = Clock::start(t0);
        c.admitted(at(100), &mut l);
        c.admitted(at(900), &mut l); // a resumed row: not timed again
        c.tokens(at(400), 3, &mut l); // the first token and two more with it
        c.tokens(at(1000), 4, &mut l); // 600 ms over four tokens
        c.ended(at(1000), &mut l);
        assert_eq!((l.queue.count(), l.time_to_first_token.count(), l.end_to_end.count()), (1, 1, 1));
        assert_eq!(l.inter_token.count(), 3 + 4 - 1);
        let mut out = String::new();
        l.inter_token.render(&mut out, "itl", "ITL.");
        // Two zeros, then four samples of 150 ms each (the 0.15 bucket and above).
        assert!(out.contains("itl_bucket{le=\"0.1\"} 2\n"), "{out}");
        assert!(out.contains("itl_bucket{le=\"0.15\"} 6\n"), "{out}");
        let mut out = String::new();
        l.queue.render(&mut out, "q", "Queue.");
        assert!(out.contains("q_bucket{le=\"0.3\"} 1\n"), "{out}");
    }

    #[test]
    fn a_request_without_tokens_has_no_first_token() {
        let mut l = Latencies::default();
        let t0 = Instant::now();
        let mut c = Clock::start(t0);
        c.tokens(t0, 0, &mut l);
        c.ended(t0, &mut l);
        assert_eq!((l.time_to_first_token.count(), l.inter_token.count(), l.end_to_end.count()), (0, 0, 1));
    }
}
