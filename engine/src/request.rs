//! What goes in (requests) and what comes out (events, completions).

use mtp_base::Error;
pub use mtp_constraint::Constraint;
use mtp_sampling::SamplingParams;

/// The engine's handle for a submitted request.
pub type RequestId = u64;

/// One generation request.
#[derive(Clone, Debug, Default)]
pub struct Request {
    /// The caller's name for it (echoed in errors and output).
    pub id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Keep going past EOS ids (benchmarks, golden comparisons).
    pub ignore_eos: bool,
    /// Finish once the decoded output contains one of these (needs a tokenizer). The
    /// token that completes the string is the last one emitted.
    pub stop: Vec<String>,
    /// Greedy by default; see [`SamplingParams`].
    pub sampling: SamplingParams,
    /// Report this many most-likely alternatives with each token (0: none).
    pub top_logprobs: usize,
    /// Score the prompt: each prompt token's logprob after the tokens before it, with
    /// this many alternatives ([`Event::PromptScored`]; `None`: not scored). A scored
    /// prompt is computed whole (never loaded from the prefix cache: its positions'
    /// logits are read) and may ask for `max_tokens` 0.
    pub prompt_logprobs: Option<usize>,
    /// What the output must match (JSON schema, any JSON object, regex, Lark grammar);
    /// compiled at submit (needs a tokenizer), where a bad one is a request error.
    pub constraint: Option<Constraint>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// Emitted an EOS id (config.json or generation_config.json).
    Eos,
    /// Reached `max_tokens` or the model's context.
    Length,
    /// The output contains a stop string.
    Stop,
    /// The output completed the request's constraint (nothing but EOS could follow).
    Grammar,
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Grammar => "grammar",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// What the engine reports, in order, from [`crate::Engine::step`].
#[derive(Debug)]
pub enum Event {
    /// The request left the queue: its prompt starts going into its cache (reported once:
    /// not again when a preempted request resumes).
    Admitted {
        request: RequestId,
    },
    /// A scored prompt's tokens after the first ([`Request::prompt_logprobs`]), in order,
    /// sent once before its first token.
    PromptScored {
        request: RequestId,
        scores: Vec<PromptToken>,
    },
    /// One generated token and its natural-log probability under the target.
    Token {
        request: RequestId,
        token: u32,
        logprob: f32,
        /// The request's `top_logprobs` most likely tokens at this position, most likely
        /// first (empty when it asked for none).
        top: Vec<(u32, f32)>,
    },
    /// One verify of the request's row: `drafted` draft tokens checked (0 in a plain
    /// round), `accepted` of them kept; the round's tokens follow. Per-request speculation
    /// statistics are these summed.
    Verified {
        request: RequestId,
        drafted: usize,
        accepted: usize,
    },
    Finished {
        request: RequestId,
        reason: FinishReason,
    },
    /// The request ended with an error; other requests are unaffected.
    Failed {
        request: RequestId,
        error: Error,
    },
}

/// A prompt token under the target, after the prompt's tokens before it: bitwise what plain
/// decoding reports for that token had it generated it.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptToken {
    pub token: u32,
    pub logprob: f32,
    /// 1 + how many tokens are more likely (vLLM's `rank`).
    pub rank: u32,
    /// The most likely tokens there, most likely first (as many as asked for).
    pub top: Vec<(u32, f32)>,
}

/// A finished request, assembled from its events.
#[derive(Clone, Debug)]
pub struct Completion {
    pub id: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// Per token, the alternatives the request asked for (empty lists when none).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// The prompt's scores, when it asked for them (empty otherwise).
    pub prompt_logprobs: Vec<PromptToken>,
    pub finish: FinishReason,
}
