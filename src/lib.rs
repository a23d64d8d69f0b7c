//! `mtp`: lossless speculative generation with row-invariant numerics.
//!
//! This facade re-exports the workspace crates; the binaries live in `src/bin`.

pub use mtp_cache as cache;
pub use mtp_drafter as drafter;
pub use mtp_engine as engine;
pub use mtp_model as model;
pub use mtp_sampling as sampling;
pub use mtp_verifier as verifier;

pub mod bench;

/// Logs to stderr; `RUST_LOG` overrides `default_level`.
pub fn init_logging(default_level: &str) {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_level.into()),
        )
        .init();
}

pub mod prompts;

/// The checkpoint `mtp generate` runs when no `--target` is given: shipped in the
/// repository, so the command needs no download.
pub const DEFAULT_TARGET: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-tiny/qwen3-target");

/// The draft model shipped for [`DEFAULT_TARGET`] (same tokenizer, smaller).
pub const DEFAULT_DRAFT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf-tiny/qwen3-draft");

/// An MTP head (MiMo layout, random weights, written by `mtp synth-mtp`) for
/// [`DEFAULT_TARGET`].
pub const DEFAULT_MTP: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/mtp-heads/qwen3-target-mimo");
