//! Batched verification: one forward over B rows x (1 + k_r) tokens, each row at its own
//! logical positions; acceptance (greedy, exact sampled or rejection sampled); rollback
//! of every row's cache to its accepted prefix.

mod acceptance;
mod verify;

pub use acceptance::{accepted_len, decide, decide_greedy};
pub use verify::{verify, verify_beside, Verified, VerifiedBeside, VerifyRow, WindowLayout};
