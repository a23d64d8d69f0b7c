//! The one seam between the Metal backend and what runs its kernels: Apple's Metal API
//! ([`super::apple`], macOS) or the emulator ([`super::emulated`], everywhere else). Buffer
//! bindings, grid and threadgroup sizes are decided once, above this trait, so everything
//! but Apple's API calls runs in CI on the emulator.

use mtp_base::error::Result;
use mtp_base::weights::Weight;

/// One kernel argument, in parameter order (`[[buffer(i)]]` is argument i): a buffer at a
/// byte offset, read or written by the kernel, or a constant's bytes.
pub enum Arg<'a, B> {
    In(&'a B, usize),
    Out(&'a B, usize),
    I32(i32),
    I64(i64),
    F32(f32),
    /// A `#[repr(C)]` struct's bytes (`constant RowKv&`).
    Bytes(&'a [u8]),
}

/// Runs kernels of `kernels.metal` on some device, in submission order.
pub trait Dispatch: Send + Sync + Sized + 'static {
    /// A device buffer: unified memory on Apple Silicon, host memory in the emulator.
    type Buffer: Send + Sync;

    /// The device's name, for logs and errors.
    fn device_name(&self) -> String;
    /// A buffer of `bytes` whose contents are undefined until written.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;
    /// A buffer holding a copy of `bytes`.
    fn upload(&self, bytes: &[u8]) -> Result<Self::Buffer>;
    /// A buffer over a weight's bytes without copying them (memory-mapped checkpoints), and
    /// the offset of the weight's first byte in it; `None` where the platform cannot wrap
    /// that memory (the caller then uploads). The buffer keeps `weight` alive.
    fn wrap(&self, weight: &Weight) -> Result<Option<(Self::Buffer, usize)>>;
    /// Copies `out.len()` bytes from `offset` of `buf` after every queued kernel ran.
    fn read(&self, buf: &Self::Buffer, offset: usize, out: &mut [u8]) -> Result<()>;
    /// Writes `bytes` at `offset` of `buf` after every queued kernel ran.
    fn write(&self, buf: &Self::Buffer, offset: usize, bytes: &[u8]) -> Result<()>;
    /// Queues kernel `name` over `grid` threadgroups of `threads` threads (1-D, a multiple
    /// of 32).
    fn run(
        &self,
        name: &'static str,
        grid: (u32, u32),
        threads: u32,
        args: &[Arg<'_, Self::Buffer>],
    ) -> Result<()>;
}
