//! A launch's scratch (the matmuls' bf16 activation planes and phase partials, the quantized
//! matmul's rounded activations and group sums, attention's segment partials), kept
//! between launches for forwards small enough to be recorded ([`graphs`]). Allocated inside
//! a CUDA graph's capture, each piece of scratch is a pair of graph memory nodes: some 300
//! a forward on the wgmma phases, most of the 6-11 ms its instantiation costs (notes v32).
//! Taken from this pool, it is plain device memory the recording only names: the first
//! (eager) run of a shape fills the pool, its recording finds what it needs there. The pool
//! gives each launch whole buffers it alone holds until it drops them, on the one stream
//! every launch runs on, and every launch writes its scratch before reading it; so a
//! buffer's last user never sees another's values, nor a replay another forward's.
//! Nothing in the pool is ever freed while its backend lives (a recording may name it).

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use mtp_base::error::Result;

use super::graphs::MOST_RECORDED_TOKENS;
use super::{driver, Cuda};

/// Free buffers of one element type.
#[derive(Default)]
pub(crate) struct Pool<T> {
    free: Mutex<Vec<CudaSlice<T>>>,
}

impl<T> Pool<T> {
    /// The smallest free buffer of at least `len` elements, taken out of the pool.
    fn take(&self, len: usize) -> Option<CudaSlice<T>> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let best = (0..free.len()).filter(|&i| free[i].len() >= len).min_by_key(|&i| free[i].len())?;
        Some(free.swap_remove(best))
    }

    fn put(&self, buf: CudaSlice<T>) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).push(buf);
    }
}

/// Scratch held by one launch: back to its pool when dropped, or freed where it came from
/// none (a forward too large to be recorded, or a capture that found no buffer to take).
pub(crate) struct Scratch<'a, T> {
    buf: Option<CudaSlice<T>>,
    home: Option<&'a Pool<T>>,
}

impl<T> Deref for Scratch<'_, T> {
    type Target = CudaSlice<T>;

    fn deref(&self) -> &CudaSlice<T> {
        self.buf.as_ref().expect("scratch is held until it drops")
    }
}

impl<T> Drop for Scratch<'_, T> {
    fn drop(&mut self) {
        if let (Some(buf), Some(home)) = (self.buf.take(), self.home) {
            home.put(buf);
        }
    }
}

/// The backend's pools, and whether its stream is being captured into a recording.
#[derive(Default)]
pub(crate) struct Pools {
    pub(crate) u16s: Pool<u16>,
    pub(crate) f32s: Pool<f32>,
    capturing: AtomicBool,
}

impl Pools {
    /// Marks the stream as captured (`true`) or not: a capture takes pooled buffers but
    /// never adds one (what it allocates is the recording's own memory).
    pub(crate) fn set_capturing(&self, on: bool) {
        self.capturing.store(on, Ordering::Relaxed);
    }

    /// `len` elements of scratch for a launch over `m` tokens: pooled where a forward of `m`
    /// tokens may be recorded (new buffers a power of two long, so a few serve every such
    /// forward), allocated for this launch alone otherwise.
    pub(crate) fn take<'a, T: DeviceRepr>(
        &self,
        pool: &'a Pool<T>,
        stream: &Arc<CudaStream>,
        len: usize,
        m: usize,
        what: &'static str,
    ) -> Result<Scratch<'a, T>> {
        let pooled = m <= MOST_RECORDED_TOKENS;
        if pooled {
            if let Some(buf) = pool.take(len) {
                return Ok(Scratch { buf: Some(buf), home: Some(pool) });
            }
        }
        let keep = pooled && !self.capturing.load(Ordering::Relaxed);
        let n = if keep { len.max(1).next_power_of_two() } else { len.max(1) };
        // SAFETY: a launch's scratch is written before it is read (see the module's doc).
        let buf = unsafe { stream.alloc::<T>(n) }.map_err(driver(what))?;
        Ok(Scratch { buf: Some(buf), home: keep.then_some(pool) })
    }
}

impl Cuda {
    /// `len` f32 of a launch's scratch over `m` tokens ([`scratch`]).
    ///
    /// [`scratch`]: crate::scratch
    pub(crate) fn scratch_f32(&self, len: usize, m: usize, what: &'static str) -> Result<Scratch<'_, f32>> {
        let pools = &self.scratch;
        pools.take(&pools.f32s, &self.stream, len, m, what)
    }

    /// `len` bf16 of a launch's scratch over `m` tokens ([`scratch`]).
    ///
    /// [`scratch`]: crate::scratch
    pub(crate) fn scratch_u16(&self, len: usize, m: usize, what: &'static str) -> Result<Scratch<'_, u16>> {
        let pools = &self.scratch;
        pools.take(&pools.u16s, &self.stream, len, m, what)
    }
}
