//! Sampling keyed by position. A row's random numbers are functions of (request seed,
//! absolute token position, purpose), so sampled rows give the same tokens alone or in
//! any batch, with any drafter, k or arrival pattern.

mod dist;
pub mod negative_control;
mod params;
mod rejection;
mod rng;

pub use dist::{pick, sample_residual, Dist, Filtered};
pub use params::{InvalidParam, SamplingMode, SamplingParams};
pub use rejection::{judge_draft, Judgement};
pub use rng::{philox4x32_10, uniform, uniform_pair, Purpose};
