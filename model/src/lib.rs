//! Architectures, checkpoint loading and row-invariant kernels.
//!
//! The promise every function here keeps: each logit computed for a row is a pure
//! function of the weights and that row's own token prefix (see `design.md`).

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod gemma4;
pub mod kernels;
pub mod mtp;
pub mod negative_control;
pub mod synth;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

pub use checkpoint::Checkpoint;
pub use config::{Arch, Config};
pub use error::{Error, Result};
pub use kernels::LogitSummary;
pub use mtp::{MtpHead, MtpInput, MtpLayout, MtpOutput};
pub use tokenizer::Tokenizer;
pub use transformer::{Logits, Model, RowInput, RowOutput};
pub use weights::{Weight, WeightDtype};
