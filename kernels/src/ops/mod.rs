//! Row-invariant CPU kernels (see docs/design.md, "Rules for every kernel").
//!
//! Every reduction uses the canonical 16-lane order of [`simd`], which depends only on
//! the reduced length; no kernel looks at M, batch size, padding or thread count.

pub mod attention;
pub mod bf16_matmul;
pub mod matmul;
pub mod norm;
pub mod q4_bf16;
pub mod quant_matmul;
pub mod rope;
pub mod simd;

pub use attention::{attend, attend_from, attend_heads, attend_rows};
pub use matmul::{linear, linear_bf16};
pub use norm::{gelu_tanh_mul, rms_norm, rms_norm_inplace, swiglu};
pub use rope::RopeTable;
