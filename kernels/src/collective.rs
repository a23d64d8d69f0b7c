//! Moving partial results between tensor-parallel ranks: the [`Collective`] a backend
//! provides (threads of this process exchanging through host memory here; NCCL on CUDA),
//! and the two kernels that consume what it gathers ([`Kernels::add_parts`],
//! [`Kernels::concat_columns`]). A gather moves bytes only; every addition happens in a
//! kernel, in rank order, so the order of a hidden element's additions is fixed by the
//! rank count alone.

use std::sync::{Condvar, Mutex};

use mtp_base::error::{Error, Result};

use crate::Kernels;

/// Moves partial results between the ranks of one forward.
pub trait Collective<B: Kernels>: RankSync {
    /// Every rank's `part` (the same length on each), in rank order, into `gathered`
    /// (`ranks x part.len()`).
    fn all_gather(&self, rank: usize, part: &B::Act, gathered: &mut B::Act) -> Result<()>;
}

/// What the forward's driver needs of a collective whatever the backend.
pub trait RankSync: Send + Sync {
    /// Wakes every rank waiting on the others with an error: one of them failed.
    fn abort(&self);
    /// Forgets an abort and any half-finished exchange, before a forward.
    fn reset(&self);
}

/// The error a rank gets when another rank of its forward failed.
pub const ABORTED: &str = "another tensor-parallel rank failed";

/// The host-memory collective: ranks are threads of this process and exchange through a
/// shared table of slots, two generations deep (a rank may start exchange `g + 1` while
/// another still reads `g`; none can reach `g + 2` before every rank finished `g`).
pub struct HostCollective {
    ranks: usize,
    state: Mutex<HostState>,
    changed: Condvar,
}

struct HostState {
    /// `slots[g % 2][rank]`: rank's part of exchange `g`.
    slots: [Vec<Vec<f32>>; 2],
    /// Parts deposited for the exchange in `generation[g % 2]`.
    arrived: [usize; 2],
    generation: [u64; 2],
    /// Exchanges each rank has started this forward.
    calls: Vec<u64>,
    aborted: bool,
}

impl HostState {
    /// No exchange started, for `ranks` ranks.
    fn fresh(ranks: usize) -> HostState {
        HostState {
            slots: [vec![Vec::new(); ranks], vec![Vec::new(); ranks]],
            arrived: [0; 2],
            generation: [0, 1],
            calls: vec![0; ranks],
            aborted: false,
        }
    }
}

impl HostCollective {
    pub fn new(ranks: usize) -> HostCollective {
        HostCollective { ranks, state: Mutex::new(HostState::fresh(ranks)), changed: Condvar::new() }
    }

    fn exchange(&self, rank: usize, part: &[f32], gathered: &mut [f32]) -> Result<()> {
        let aborted = || Error::Backend(ABORTED.into());
        let mut s = self.state.lock().map_err(|_| aborted())?;
        if s.aborted {
            return Err(aborted());
        }
        let g = s.calls[rank];
        s.calls[rank] += 1;
        let p = (g % 2) as usize;
        if s.generation[p] != g {
            s.generation[p] = g;
            s.arrived[p] = 0;
        }
        s.slots[p][rank].clear();
        s.slots[p][rank].extend_from_slice(part);
        s.arrived[p] += 1;
        self.changed.notify_all();
        while s.arrived[p] < self.ranks && !s.aborted {
            s = self.changed.wait(s).map_err(|_| aborted())?;
        }
        if s.aborted {
            return Err(aborted());
        }
        for (dst, src) in gathered.chunks_mut(part.len().max(1)).zip(&s.slots[p]) {
            if dst.len() != src.len() {
                return Err(Error::Backend(format!(
                    "tensor-parallel exchange: a part of {} values for {} of another rank",
                    part.len(),
                    src.len()
                )));
            }
            dst.copy_from_slice(src);
        }
        Ok(())
    }
}

impl RankSync for HostCollective {
    fn abort(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.aborted = true;
        }
        self.changed.notify_all();
    }

    fn reset(&self) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = HostState::fresh(self.ranks);
    }
}

impl<B: Kernels<Act = Vec<f32>>> Collective<B> for HostCollective {
    fn all_gather(&self, rank: usize, part: &Vec<f32>, gathered: &mut Vec<f32>) -> Result<()> {
        if gathered.len() != self.ranks * part.len() || rank >= self.ranks {
            return Err(Error::Backend(format!(
                "tensor-parallel exchange: rank {rank} of {} gathers {} values into {}",
                self.ranks,
                part.len(),
                gathered.len()
            )));
        }
        self.exchange(rank, part, gathered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// The host exchange gives every rank every part in rank order, many times over with
    /// ranks racing ahead, and an abort wakes the ranks still waiting.
    #[test]
    fn host_exchanges_deliver_every_part_in_rank_order() {
        let ranks = 3;
        let c = Arc::new(HostCollective::new(ranks));
        std::thread::scope(|s| {
            for rank in 0..ranks {
                let c = c.clone();
                s.spawn(move || {
                    for g in 0..200u32 {
                        let part = vec![(rank as f32) * 1000.0 + g as f32; 5];
                        let mut gathered = vec![0.0; 5 * ranks];
                        c.exchange(rank, &part, &mut gathered).unwrap();
                        for (r, p) in gathered.chunks(5).enumerate() {
                            assert_eq!(p, vec![(r as f32) * 1000.0 + g as f32; 5], "exchange {g}");
                        }
                    }
                });
            }
        });
        c.reset();
        let waiting = {
            let c = c.clone();
            std::thread::spawn(move || c.exchange(0, &[1.0], &mut [0.0; 3]))
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.abort();
        let err = waiting.join().unwrap().unwrap_err();
        assert!(err.to_string().contains(ABORTED), "{err}");
    }
}
