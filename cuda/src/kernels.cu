// Row-invariant CUDA kernels (design.md, "Rules for every kernel", on the GPU).
//
// Every reduction has one order that depends only on the reduced length and fixed
// constants (a warp of 32 lanes, chunks of 8 elements per lane, key chunks of 32 anchored
// at position 0), never on how many tokens or rows share a launch. Activations are f32;
// weights are read in their checkpoint dtype and widened in registers (bf16 weights go to
// the tensor cores with each activation either rounded to bf16, the default, or split
// exactly into three bf16 terms, `--activations f32`); K/V are stored in the model's KV
// dtype (f32, bf16, or 8- or 4-bit codes, `QKv`). No headers: bf16/f16 are widened by hand.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#include "walk.cuh"

// One file per op family, included in this order as one compilation unit (build.rs compiles
// this file alone to PTX); a family's host side is the Rust module of its name (matmul.cuh:
// matmul.rs), or its `Kernels` methods in lib.rs.
#include "common.cuh"
#include "matmul.cuh"
#include "matmul_tc.cuh"
#include "matmul_tcq.cuh"
#include "matmul_tt.cuh"
#include "embed.cuh"
#include "norm.cuh"
#include "summaries.cuh"
#include "qk_rope_store.cuh"
#include "attention.cuh"
#include "kv.cuh"
#include "stock.cuh"
#include "elementwise.cuh"
#include "flash_kernels.cuh"
