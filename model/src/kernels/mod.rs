//! Row-invariant CPU kernels (see design.md, "Rules for every kernel").
//!
//! Every reduction uses the canonical 16-lane order of [`simd`], which depends only on
//! the reduced length; no kernel looks at M, batch size, padding or thread count.

pub mod attention;
pub mod matmul;
pub mod norm;
pub mod quant;
pub mod rope;
pub mod simd;

pub use attention::{attend, attend_from};
pub use matmul::linear;
pub use norm::{
    argmax, gelu_tanh_mul, log_softmax, rms_norm, rms_norm_inplace, swiglu, top_logprobs, LogitSummary,
};
pub use rope::RopeTable;
