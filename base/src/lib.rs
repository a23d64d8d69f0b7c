//! The base every other crate builds on: the error type, `config.json` and safetensors
//! checkpoint reading, weights and their dtypes, the tokenizer, and the host's logit math.
//! Nothing here knows about backends or architectures' forwards.

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod files;
pub mod gguf;
pub mod hub;
pub mod isa;
pub mod json;
pub mod logits;
pub mod quant;
pub mod quant_config;
pub mod tokenizer;
pub mod weights;

pub use checkpoint::Checkpoint;
pub use config::{Arch, Config};
pub use error::{Error, Result};
pub use logits::LogitSummary;
pub use tokenizer::Tokenizer;
pub use weights::{Weight, WeightDtype};
