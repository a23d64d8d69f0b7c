//! Test-only fault injection for the parity tests' negative controls. Nothing in the
//! library turns these on; each is a thread-local switch read on the forward's calling
//! thread.

use std::cell::Cell;

pub use crate::kernels::matmul::negative_control::set_stock_matmul;

thread_local! {
    static PHYSICAL_ROPE: Cell<bool> = const { Cell::new(false) };
}

/// When on, new tokens are rotated at the physical slot they are written to instead of
/// their logical position (the bug that inflates RoPE distances after mixed accepts).
pub fn set_physical_rope(on: bool) {
    PHYSICAL_ROPE.with(|c| c.set(on));
}

pub(crate) fn physical_rope() -> bool {
    PHYSICAL_ROPE.with(|c| c.get())
}
