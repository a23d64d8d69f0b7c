//! One module per model family, each written once over the kernel seam. `crate::registry`
//! maps an architecture to its family.

pub mod gemma4;
pub mod llama;
