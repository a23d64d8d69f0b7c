//! Per-request sampling parameters and the engine-wide sampling mode.

/// How a request picks its tokens. Temperature 0 is greedy (the other fields are then
/// ignored). Filters apply in the order temperature, top-k, top-p, min-p.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: no limit).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass reaches `top_p` (1: off).
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the most likely one (0: off).
    pub min_p: f32,
    /// Keys every random number the request draws, with the token's position.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Refuses values no distribution can follow, naming the field.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        let bad = |param: &'static str, message: String| Err(InvalidParam { param, message });
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(
                "temperature",
                format!("temperature must be a finite number >= 0, got {}", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        Ok(())
    }
}

/// A sampling value [`SamplingParams::validate`] refuses: which field, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidParam {
    /// The field's name as requests spell it (`temperature`, `top_p`, `min_p`).
    pub param: &'static str,
    pub message: String,
}

impl std::fmt::Display for InvalidParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for InvalidParam {}

/// How speculative rows sample at temperature > 0 (the engine's choice, for all rows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SamplingMode {
    /// Each position's token is the one plain sampled decoding picks with the same seed
    /// (Gumbel-max with keyed noise); a draft is accepted iff it equals it. Outputs are
    /// bitwise identical to plain decoding.
    #[default]
    Exact,
    /// Modified rejection sampling (accept with min(1, p/q), resample from max(0, p - q)):
    /// the same distribution as plain decoding, more drafts accepted, not the same bits.
    Rejection,
}

impl SamplingMode {
    pub fn name(self) -> &'static str {
        match self {
            SamplingMode::Exact => "exact",
            SamplingMode::Rejection => "rejection",
        }
    }

    pub fn parse(s: &str) -> Result<SamplingMode, String> {
        match s {
            "exact" => Ok(SamplingMode::Exact),
            "rejection" => Ok(SamplingMode::Rejection),
            other => Err(format!("unknown sampling mode `{other}` (exact, rejection)")),
        }
    }
}
