//! Test-only fault injection for the parity tests' negative controls. Nothing in the
//! library turns these on; each is a thread-local switch read on the forward's calling
//! thread.

use std::cell::Cell;

thread_local! {
    static STOCK_MATMUL: Cell<bool> = const { Cell::new(false) };
    static PHYSICAL_ROPE: Cell<bool> = const { Cell::new(false) };
}

/// When on, `linear` runs candle's stock matmul, whose kernel choice depends on M.
pub fn set_stock_matmul(on: bool) {
    STOCK_MATMUL.with(|c| c.set(on));
}

pub(crate) fn stock_matmul() -> bool {
    STOCK_MATMUL.with(|c| c.get())
}

/// When on, new tokens are rotated at the physical slot they are written to instead of
/// their logical position (the bug that inflates RoPE distances after mixed accepts).
pub fn set_physical_rope(on: bool) {
    PHYSICAL_ROPE.with(|c| c.set(on));
}

pub(crate) fn physical_rope() -> bool {
    PHYSICAL_ROPE.with(|c| c.get())
}
