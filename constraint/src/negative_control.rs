//! Test-only fault switches for the constrained parity tests' negative controls. Nothing
//! in the library turns them on; each is a thread-local read on the engine's thread.

use std::cell::Cell;

thread_local! {
    static SKIP_ROLLBACK: Cell<bool> = const { Cell::new(false) };
    static FOREIGN_MASKS: Cell<bool> = const { Cell::new(false) };
}

/// When on, [`crate::Guide::settle`] leaves rejected drafts consumed in the matcher (the
/// bug of a matcher not rolled back after verification).
pub fn set_skip_rollback(on: bool) {
    SKIP_ROLLBACK.with(|c| c.set(on));
}

pub fn skip_rollback() -> bool {
    SKIP_ROLLBACK.with(|c| c.get())
}

/// When on, the engine hands each constrained row the masks computed from the state of
/// the next constrained row of the batch (itself when it is the only one): a mask that
/// depends on the batch.
pub fn set_foreign_masks(on: bool) {
    FOREIGN_MASKS.with(|c| c.set(on));
}

pub fn foreign_masks() -> bool {
    FOREIGN_MASKS.with(|c| c.get())
}
