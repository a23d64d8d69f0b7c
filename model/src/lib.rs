//! Architectures over the kernel seam: the forward plumbing every family shares
//! ([`forward`]), one file or folder per family ([`models`]), the MTP head's interface
//! ([`mtp`]), the [`registry`] that loads a checkpoint onto a backend and the accounting
//! that refuses tensors a load left unread (`accounting`).
//!
//! The promise every function here keeps: each logit computed for a row is a pure
//! function of the weights and that row's own token prefix (see docs/design.md).

mod accounting;
pub mod eagle3;
pub mod forward;
pub mod models;
pub mod mtp;
pub mod registry;
mod tensor_parallel;

pub use eagle3::{Eagle3Feed, Eagle3Head, Eagle3Input, Eagle3Layout, Eagle3Output, Eagle3Spec};
pub use forward::{Hidden, Logits, Model, RowInput, RowOutput, Taps};
pub use mtp::{MtpHead, MtpInput, MtpLayout, MtpOutput};
