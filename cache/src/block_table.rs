//! What every paged store does with its block table alike (the host's `paged::Paged`, CUDA's
//! device store): lend blocks out as [`KvBlock`]s and append lent blocks after the held
//! slots. A table is `Vec<Arc<B>>` in logical order, slot `s` in block `s / block`.

use std::any::Any;
use std::sync::Arc;

use crate::store::{KvBlock, KvError};

/// Blocks `[first, first + n)` of `table` (the last may be held in part), each `bytes`
/// bytes, as handles another table of the same shape can [`adopt`]. `store` names the
/// store in errors; `held` is its held slots.
pub fn share<B: Any + Send + Sync>(
    table: &[Arc<B>],
    first: usize,
    n: usize,
    bytes: usize,
    held: usize,
    store: &str,
) -> Result<Vec<KvBlock>, KvError> {
    if first.saturating_add(n) > table.len() {
        return Err(KvError(format!("{store}: blocks [{first}, {}) are not held ({held} slots)", first + n)));
    }
    Ok(table[first..first + n].iter().map(|b| KvBlock::new(b.clone(), bytes)).collect())
}

/// Appends `blocks` (from [`share`] of a table of this shape: `fits` says which are) after
/// the `held` slots of `table`, which must end on a block boundary of `block` slots; the
/// first `slots` of them become held (the last block may be held in part: its first write
/// copies it). Returns the slots held after.
pub fn adopt<B: Any + Send + Sync>(
    table: &mut Vec<Arc<B>>,
    held: usize,
    block: usize,
    blocks: &[KvBlock],
    slots: usize,
    fits: impl Fn(&Arc<B>) -> bool,
    store: &str,
) -> Result<usize, KvError> {
    let whole = blocks.len() * block;
    if !held.is_multiple_of(block) || table.len() * block != held || slots > whole || slots + block <= whole {
        return Err(KvError(format!(
            "{store}: cannot append {} blocks holding {slots} slots after {held} slots",
            blocks.len()
        )));
    }
    let mut adopted = Vec::with_capacity(blocks.len());
    for b in blocks {
        match b.downcast::<B>() {
            Some(block) if fits(&block) => adopted.push(block),
            _ => return Err(KvError(format!("{store}: a shared block of another store's shape"))),
        }
    }
    if crate::negative_control::adopt_out_of_order() {
        adopted.reverse();
    }
    table.extend(adopted);
    Ok(held + slots)
}

/// Whether the table's last block is held elsewhere too (its next write copies it).
pub fn last_shared<B>(table: &[Arc<B>]) -> bool {
    table.last().is_some_and(|b| Arc::strong_count(b) > 1)
}

/// Calls `f(id, bytes)` for each block: the same id wherever a block is shared.
pub fn for_each<B>(table: &[Arc<B>], bytes: usize, f: &mut dyn FnMut(usize, usize)) {
    table.iter().for_each(|b| f(Arc::as_ptr(b) as *const () as usize, bytes));
}
