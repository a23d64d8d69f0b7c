//! Batched verification: one forward over B rows x (1 + k_r) tokens, each row at its own
//! logical positions; greedy acceptance; rollback of every row's cache to its accepted
//! prefix.

mod acceptance;
mod verify;

pub use acceptance::accepted_len;
pub use verify::{verify, Verified, VerifyRow, WindowLayout};
