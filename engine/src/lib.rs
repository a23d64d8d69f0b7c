//! Continuous-batching speculative generation over the row-invariant model.
//!
//! Submit [`Request`]s to an [`Engine`] (optionally with a drafter), call
//! [`Engine::step`] and read the [`Event`]s; or run a whole list with [`generate`].
//! Every row's tokens and logprobs are bitwise those of plain decoding of that request
//! alone, whatever the drafter, k, batch or arrival order.

mod adaptive;
mod engine;
mod generate;
mod guided;
mod metrics;
pub mod negative_control;
mod prefill;
mod prefix_cache;
mod request;

pub use adaptive::{DraftLen, Learned, MAX_DRAFT_TOKENS};
pub use engine::{Engine, EngineOptions, KvUsage};
pub use generate::generate;
pub use metrics::SpecStats;
pub use mtp_constraint::{
    check_finite as check_finite_schema, check_keywords as check_schema_keywords, closed as closed_schema,
    lark_json, negative_control as constraint_negative_control, Grammars, Guide, TokenMask,
};
pub use mtp_sampling::{SamplingMode, SamplingParams};
pub use mtp_verifier::WindowLayout;
pub use prefill::{prefill, Prefilled};
pub use prefix_cache::PrefixCache;
pub use request::{Completion, Constraint, Event, FinishReason, PromptToken, Request, RequestId};
