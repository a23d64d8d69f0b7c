//! Faults the engine's tests switch on to prove their checks can fail (off by default, per
//! thread).

use std::cell::Cell;

thread_local! {
    static RESUME_ONE_POSITION_SHORT: Cell<bool> = const { Cell::new(false) };
    static NO_WATERMARK: Cell<bool> = const { Cell::new(false) };
    static SCORE_UNSHIFTED: Cell<bool> = const { Cell::new(false) };
}

/// When on, a scored prompt pairs the reading after each token with that token itself
/// instead of the next one.
pub fn set_score_unshifted(on: bool) {
    SCORE_UNSHIFTED.with(|c| c.set(on));
}

pub(crate) fn score_unshifted() -> bool {
    SCORE_UNSHIFTED.with(|c| c.get())
}

/// When on, admission fills the K/V budget to the last block (no headroom for the
/// admitted rows' growth).
pub fn set_no_watermark(on: bool) {
    NO_WATERMARK.with(|c| c.set(on));
}

pub(crate) fn no_watermark() -> bool {
    NO_WATERMARK.with(|c| c.get())
}

/// When on, a preempted row recomputes one token fewer than it emitted before its last, so
/// it resumes one logical position early.
pub fn set_resume_one_position_short(on: bool) {
    RESUME_ONE_POSITION_SHORT.with(|c| c.set(on));
}

pub(crate) fn resume_one_position_short() -> bool {
    RESUME_ONE_POSITION_SHORT.with(|c| c.get())
}
