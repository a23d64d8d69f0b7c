//! A Prometheus histogram with fixed buckets: per-bucket counts, a sum and a count, written
//! in the text exposition format (`_bucket{le="..."}` cumulative, `+Inf` last and equal to
//! `_count`, then `_sum` and `_count`).
//!
//! Contract: a value counts in the first bucket whose upper bound it does not exceed (a
//! value on an edge counts in that edge's bucket); values above every bound count only in
//! `+Inf`; a NaN is not recorded. Counts saturate instead of wrapping.

use std::fmt::Write;

/// Upper bounds of `mtp_time_to_first_token_seconds`, as vLLM's.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
];

/// Upper bounds of `mtp_inter_token_latency_seconds`, as vLLM's.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// Upper bounds of the request-latency histograms (queue time, end to end), as vLLM's.
pub const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
];

/// Observations in fixed buckets (upper bounds increasing).
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket, not cumulative; one more than `bounds`: the last is above every bound.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    pub fn observe(&mut self, value: f64) {
        if value.is_nan() {
            return;
        }
        let at = self.bounds.iter().position(|&b| value <= b).unwrap_or(self.bounds.len());
        if let Some(c) = self.counts.get_mut(at) {
            *c = c.saturating_add(1);
        }
        self.sum += value;
        self.count = self.count.saturating_add(1);
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// Appends the histogram's `# HELP`, `# TYPE` and samples to `out`.
    pub fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut below = 0u64;
        for (bound, n) in self.bounds.iter().zip(&self.counts) {
            below = below.saturating_add(*n);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {below}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `(le, value)` pairs of the rendered buckets.
    fn buckets(text: &str) -> Vec<(String, u64)> {
        text.lines()
            .filter_map(|l| l.strip_prefix("h_bucket{le=\""))
            .map(|r| {
                let (le, v) = r.split_once("\"} ").unwrap();
                (le.to_string(), v.parse().unwrap())
            })
            .collect()
    }

    #[test]
    fn buckets_are_cumulative_and_inf_equals_the_count() {
        let mut h = Histogram::new(&[1.0, 2.0, 5.0]);
        for v in [0.5, 1.5, 1.75, 3.0, 9.0, 100.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "h", "A test.");
        assert!(out.starts_with("# HELP h A test.\n# TYPE h histogram\n"));
        let want = [("1", 1), ("2", 3), ("5", 4), ("+Inf", 6)].map(|(l, v)| (l.to_string(), v));
        assert_eq!(buckets(&out), want);
        assert!(out.contains("\nh_sum 115.75\n"), "{out}");
        assert!(out.ends_with("\nh_count 6\n"), "{out}");
    }

    #[test]
    fn a_value_on_an_edge_counts_in_that_edge() {
        let mut h = Histogram::new(&[0.1, 0.25]);
        h.observe(0.1);
        h.observe(0.25);
        let mut out = String::new();
        h.render(&mut out, "h", "Edges.");
        let want = [("0.1", 1), ("0.25", 2), ("+Inf", 2)].map(|(l, v)| (l.to_string(), v));
        assert_eq!(buckets(&out), want);
    }

    #[test]
    fn nan_is_not_recorded_and_empty_renders_zeros() {
        let mut h = Histogram::new(&[1.0]);
        h.observe(f64::NAN);
        assert_eq!(h.count(), 0);
        let mut out = String::new();
        h.render(&mut out, "h", "Empty.");
        assert!(
            out.ends_with("h_bucket{le=\"1\"} 0\nh_bucket{le=\"+Inf\"} 0\nh_sum 0\nh_count 0\n"),
            "{out}"
        );
    }

    #[test]
    fn the_bucket_bounds_increase() {
        for b in [TTFT_BUCKETS, ITL_BUCKETS, REQUEST_BUCKETS] {
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
        }
    }
}
