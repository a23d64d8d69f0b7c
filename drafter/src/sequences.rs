//! Per-row token sequences as the target committed them.

use std::collections::HashMap;

use mtp_base::Error;

use crate::{Commit, RowId};

/// Each row's prompt + emitted tokens (the last one not yet run by the target).
#[derive(Debug, Default)]
pub(crate) struct Sequences(HashMap<RowId, Vec<u32>>);

impl Sequences {
    /// Applies a commit: the sequence becomes `seq[..start] + tokens + [next]`.
    pub(crate) fn apply(&mut self, row: RowId, c: &Commit) -> Result<&[u32], Error> {
        let seq = self.0.entry(row).or_default();
        if c.start > seq.len() {
            return Err(Error::Request {
                request: format!("row {row}"),
                msg: format!("commit at position {} leaves a gap after {} known tokens", c.start, seq.len()),
            });
        }
        seq.truncate(c.start);
        seq.extend_from_slice(c.tokens);
        seq.push(c.next);
        Ok(seq)
    }

    pub(crate) fn get(&self, row: RowId) -> Option<&[u32]> {
        self.0.get(&row).map(|s| s.as_slice())
    }

    pub(crate) fn remove(&mut self, row: RowId) {
        self.0.remove(&row);
    }
}
