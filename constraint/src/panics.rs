//! One place where llguidance calls run: a panic inside it becomes an error naming the
//! panic, never an unwinding engine thread.

use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `f`, turning its error or its panic into a message.
pub(crate) fn guarded<T, E: Display>(f: impl FnOnce() -> Result<T, E>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("internal error in the grammar engine: {msg}"))
        }
    }
}
