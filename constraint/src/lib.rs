//! Grammar-constrained decoding through llguidance: a request's [`Constraint`] (JSON
//! schema, any JSON object, regex, Lark grammar) compiles into a per-row [`Guide`] whose
//! [`TokenMask`]s restrict what the row may emit.
//!
//! Contract: a row's masks depend on that row's own tokens alone (its guide has consumed
//! exactly them between rounds), so constrained rows keep the engine's promise: bitwise
//! the same alone, batched and with any drafter. Masks along a draft are computed by
//! consuming the draft ([`Guide::walk`]); after verification [`Guide::settle`] rolls the
//! matcher back to the accepted prefix and consumes the bonus token. Nothing here panics on
//! input: llguidance's own panics come back as errors.
//!
//! Imports `mtp-base` only; the verifier applies the masks, the engine drives the guides.

pub mod closed;
mod finite;
mod guide;
mod keywords;
pub mod negative_control;
mod panics;
mod vocab;

pub use closed::closed;
pub use finite::check_finite;
pub use guide::{lark_json, Constraint, Guide, TokenMask};
pub use keywords::check_keywords;
pub use vocab::Grammars;
