//! Test-only fault injection for the parity tests' negative controls. Nothing in the
//! library turns these on; each is a thread-local switch read on the forward's calling
//! thread (the readers are public for the backend crates).

use std::cell::Cell;

thread_local! {
    static STOCK_MATMUL: Cell<bool> = const { Cell::new(false) };
    static PHYSICAL_ROPE: Cell<bool> = const { Cell::new(false) };
    static SPLIT_ATTENTION: Cell<bool> = const { Cell::new(false) };
    static STALE_REPLAY: Cell<bool> = const { Cell::new(false) };
}

/// When on, `linear` runs a stock matmul whose kernel choice depends on M: candle's on
/// the CPU, cuBLAS on CUDA.
pub fn set_stock_matmul(on: bool) {
    STOCK_MATMUL.with(|c| c.set(on));
}

pub fn stock_matmul() -> bool {
    STOCK_MATMUL.with(|c| c.get())
}

/// When on, new tokens are rotated at the physical slot they are written to instead of
/// their logical position (the bug that inflates RoPE distances after mixed accepts).
pub fn set_physical_rope(on: bool) {
    PHYSICAL_ROPE.with(|c| c.set(on));
}

pub fn physical_rope() -> bool {
    PHYSICAL_ROPE.with(|c| c.get())
}

/// When on, GPU attention cuts each query's keys into a number of segments chosen from the
/// batch size (as split-KV decode kernels do), each with its own softmax, merged at the end.
pub fn set_split_attention(on: bool) {
    SPLIT_ATTENTION.with(|c| c.set(on));
}

pub fn split_attention() -> bool {
    SPLIT_ATTENTION.with(|c| c.get())
}

/// When on, a recorded forward (a CUDA graph) is replayed without copying the step's
/// tables (tokens, positions, K/V addresses) into the buffers it reads: it recomputes the
/// step it was recorded at.
pub fn set_stale_replay(on: bool) {
    STALE_REPLAY.with(|c| c.set(on));
}

pub fn stale_replay() -> bool {
    STALE_REPLAY.with(|c| c.get())
}
