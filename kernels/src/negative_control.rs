//! Test-only fault injection for the parity tests' negative controls. Nothing in the
//! library turns these on; each is a thread-local switch read on the forward's calling
//! thread (the readers are public for the backend crates).

use std::cell::Cell;

thread_local! {
    static STOCK_MATMUL: Cell<bool> = const { Cell::new(false) };
    static PHYSICAL_ROPE: Cell<bool> = const { Cell::new(false) };
    static SPLIT_ATTENTION: Cell<bool> = const { Cell::new(false) };
    static STALE_REPLAY: Cell<bool> = const { Cell::new(false) };
    static TOKEN_ORDERED_REDUCTION: Cell<bool> = const { Cell::new(false) };
    static PAD_ROWS_FIRST: Cell<bool> = const { Cell::new(false) };
    static SHARE_BY_LENGTH: Cell<bool> = const { Cell::new(false) };
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

/// When on, tensor-parallel ranks' partial sums are added in an order chosen from the
/// forward's token count (as all-reduce algorithms picked by message size do).
pub fn set_token_ordered_reduction(on: bool) {
    TOKEN_ORDERED_REDUCTION.with(|c| c.set(on));
}

pub fn token_ordered_reduction() -> bool {
    TOKEN_ORDERED_REDUCTION.with(|c| c.get())
}

/// When on, the padding rows a recorded forward takes ([`crate::Kernels::recorded_shape`])
/// come before the batch's own rows, whose outputs are still read from the front.
pub fn set_pad_rows_first(on: bool) {
    PAD_ROWS_FIRST.with(|c| c.set(on));
}

pub fn pad_rows_first() -> bool {
    PAD_ROWS_FIRST.with(|c| c.get())
}

/// When on, CUDA's attention takes rows of a batch as sharing their leading K/V blocks by
/// their committed lengths alone, without comparing their block tables: a row then reads
/// another's keys.
pub fn set_share_by_length(on: bool) {
    SHARE_BY_LENGTH.with(|c| c.set(on));
}

pub fn share_by_length() -> bool {
    SHARE_BY_LENGTH.with(|c| c.get())
}

/// Every switch of the calling thread, to carry into the threads a forward spawns (the
/// tensor-parallel ranks).
#[derive(Clone, Copy, Debug, Default)]
pub struct Switches([bool; 7]);

impl Switches {
    pub fn current() -> Switches {
        Switches([
            stock_matmul(),
            physical_rope(),
            split_attention(),
            stale_replay(),
            token_ordered_reduction(),
            pad_rows_first(),
            share_by_length(),
        ])
    }

    /// Sets the calling thread's switches to these.
    pub fn apply(self) {
        let [a, b, c, d, e, f, g] = self.0;
        set_stock_matmul(a);
        set_physical_rope(b);
        set_split_attention(c);
        set_stale_replay(d);
        set_token_ordered_reduction(e);
        set_pad_rows_first(f);
        set_share_by_length(g);
    }
}
