//! The Metal emulator: `kernels.metal` compiled as C++ through a shim of the Metal standard
//! library (build.rs, `emulator/`), run on the CPU with every threadgroup's threads as
//! fibers that meet at real barriers and SIMD-group exchanges. Dispatches run at once, their
//! threadgroups on the calling thread and a helper per further host core. Buffers are host memory: fresh ones are filled with NaN bytes (a
//! kernel that reads what nothing wrote gets NaN) and followed by a guard band that every
//! dispatch checks (a kernel that writes past a buffer's end is an error naming it).
//!
//! What it cannot tell: whether Apple's compiler accepts every line, what fast math would
//! change, and anything about speed.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr};
use std::sync::{Arc, OnceLock};

use super::dispatch::{Arg, Dispatch};
use mtp_base::error::{Error, Result};
use mtp_base::weights::Weight;

type Invoker = unsafe extern "C" fn(args: *const *mut c_void);

#[repr(C)]
struct KernelEntry {
    name: *const c_char,
    invoke: Invoker,
    params: usize,
}

extern "C" {
    fn mtp_emu_kernels(count: *mut usize) -> *const KernelEntry;
    fn mtp_emu_dispatch(
        invoke: Invoker,
        args: *const *mut c_void,
        gx: u32,
        gy: u32,
        threads: u32,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
}

/// Bytes after every allocation that kernels must not touch.
const GUARD: usize = 64;
const GUARD_BYTE: u8 = 0xa5;
const ALIGN: usize = 64;

/// Host memory standing in for a device buffer: owned (with a guard band), or a weight's
/// memory-mapped bytes.
pub struct EmuBuffer {
    ptr: *mut u8,
    len: usize,
    /// `Some` for memory of our own (freed on drop), `None` for a wrapped weight.
    layout: Option<Layout>,
    _weight: Option<Weight>,
}

// SAFETY: the memory is only reached through kernels and `read`/`write`, which the backend
// orders like device work on one queue; the pointer is never shared outside.
unsafe impl Send for EmuBuffer {}
unsafe impl Sync for EmuBuffer {}

impl Drop for EmuBuffer {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: allocated with this layout in `Emulator::alloc`.
            unsafe { std::alloc::dealloc(self.ptr, layout) }
        }
    }
}

impl EmuBuffer {
    fn guard_intact(&self) -> bool {
        self.layout.is_none()
            // SAFETY: the guard band follows the buffer's `len` bytes inside its allocation.
            || unsafe { std::slice::from_raw_parts(self.ptr.add(self.len), GUARD) }.iter().all(|&b| b == GUARD_BYTE)
    }

    fn check_range(&self, offset: usize, n: usize, what: &str) -> Result<()> {
        if offset.checked_add(n).is_none_or(|end| end > self.len) {
            return Err(Error::Backend(format!(
                "Metal emulator: {what} of {n} bytes at {offset} in a buffer of {}",
                self.len
            )));
        }
        Ok(())
    }
}

/// The emulated device.
pub struct Emulator {
    /// Each kernel's invoker and how many arguments it binds.
    kernels: HashMap<&'static str, (Invoker, usize)>,
}

impl Emulator {
    /// The process's emulator (the kernel table is read once).
    pub fn shared() -> Arc<super::Metal<Emulator>> {
        static SHARED: OnceLock<Arc<super::Metal<Emulator>>> = OnceLock::new();
        SHARED
            .get_or_init(|| Arc::new(super::Metal::new(Emulator::new(), mtp_kernels::Backend::MetalEmulated)))
            .clone()
    }

    fn new() -> Emulator {
        let mut count = 0usize;
        // SAFETY: returns a static table of `count` entries with static C strings.
        let table = unsafe { std::slice::from_raw_parts(mtp_emu_kernels(&mut count), count) };
        let kernels = table
            .iter()
            .map(|e| {
                // SAFETY: names are string literals of the compiled table.
                let name = unsafe { CStr::from_ptr(e.name) }.to_str().expect("ASCII kernel name");
                (name, (e.invoke, e.params))
            })
            .collect();
        Emulator { kernels }
    }
}

impl Dispatch for Emulator {
    type Buffer = EmuBuffer;

    fn device_name(&self) -> String {
        "Metal emulator (CPU)".into()
    }

    fn alloc(&self, bytes: usize) -> Result<EmuBuffer> {
        let layout = Layout::from_size_align(bytes + GUARD, ALIGN)
            .map_err(|e| Error::Backend(format!("Metal emulator: {bytes} bytes: {e}")))?;
        // SAFETY: a non-zero size (the guard band).
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(Error::Backend(format!("Metal emulator: out of memory for {bytes} bytes")));
        }
        // SAFETY: `bytes + GUARD` bytes were just allocated.
        unsafe {
            std::ptr::write_bytes(ptr, 0xff, bytes);
            std::ptr::write_bytes(ptr.add(bytes), GUARD_BYTE, GUARD);
        }
        Ok(EmuBuffer { ptr, len: bytes, layout: Some(layout), _weight: None })
    }

    fn upload(&self, bytes: &[u8]) -> Result<EmuBuffer> {
        let buf = self.alloc(bytes.len())?;
        self.write(&buf, 0, bytes)?;
        Ok(buf)
    }

    fn wrap(&self, weight: &Weight) -> Result<Option<(EmuBuffer, usize)>> {
        let bytes = weight.bytes();
        let buf = EmuBuffer {
            ptr: bytes.as_ptr() as *mut u8,
            len: bytes.len(),
            layout: None,
            _weight: Some(weight.clone()),
        };
        Ok(Some((buf, 0)))
    }

    fn read(&self, buf: &EmuBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        buf.check_range(offset, out.len(), "read")?;
        // SAFETY: in range (checked); dispatches have all finished (they run at once).
        unsafe { std::ptr::copy_nonoverlapping(buf.ptr.add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn write(&self, buf: &EmuBuffer, offset: usize, bytes: &[u8]) -> Result<()> {
        buf.check_range(offset, bytes.len(), "write")?;
        if buf.layout.is_none() {
            return Err(Error::Backend("Metal emulator: a write into a weight's mapped bytes".into()));
        }
        // SAFETY: in range of memory we own; no kernel is running.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.ptr.add(offset), bytes.len()) };
        Ok(())
    }

    fn run(
        &self,
        name: &'static str,
        grid: (u32, u32),
        threads: u32,
        args: &[Arg<'_, EmuBuffer>],
    ) -> Result<()> {
        let (invoke, params) = *self
            .kernels
            .get(name)
            .ok_or_else(|| Error::Backend(format!("Metal emulator: no kernel `{name}` in kernels.metal")))?;
        if args.len() != params {
            return Err(Error::Backend(format!(
                "Metal kernel {name} takes {params} arguments, the dispatch bound {}",
                args.len()
            )));
        }
        if !threads.is_multiple_of(32) {
            return Err(Error::Backend(format!(
                "Metal kernel {name}: a threadgroup of {threads} threads is not a whole number of SIMD-groups"
            )));
        }
        // Constants live in `scalars` for the duration of the call.
        let mut scalars = vec![[0u8; 8]; args.len()];
        let mut ptrs: Vec<*mut c_void> = Vec::with_capacity(args.len());
        for (arg, slot) in args.iter().zip(scalars.iter_mut()) {
            let p = match arg {
                Arg::In(b, off) | Arg::Out(b, off) => {
                    b.check_range(*off, 0, name)?;
                    // SAFETY: `off` is within the buffer (checked).
                    unsafe { b.ptr.add(*off) as *mut c_void }
                }
                Arg::I32(v) => {
                    slot[..4].copy_from_slice(&v.to_ne_bytes());
                    slot.as_mut_ptr() as *mut c_void
                }
                Arg::I64(v) => {
                    *slot = v.to_ne_bytes();
                    slot.as_mut_ptr() as *mut c_void
                }
                Arg::F32(v) => {
                    slot[..4].copy_from_slice(&v.to_ne_bytes());
                    slot.as_mut_ptr() as *mut c_void
                }
                Arg::Bytes(b) => b.as_ptr() as *mut c_void,
            };
            ptrs.push(p);
        }
        let mut err = [0 as c_char; 512];
        // SAFETY: `ptrs` holds one valid pointer per kernel parameter in order (the
        // kernels' bounds come with their arguments); the memory outlives the call.
        let rc = unsafe {
            mtp_emu_dispatch(invoke, ptrs.as_ptr(), grid.0, grid.1, threads, err.as_mut_ptr(), err.len())
        };
        if rc != 0 {
            // SAFETY: the scheduler wrote a NUL-terminated message.
            let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
            return Err(Error::Backend(format!("Metal kernel {name}: {msg}")));
        }
        for (i, arg) in args.iter().enumerate() {
            if let Arg::Out(b, _) = arg {
                if !b.guard_intact() {
                    return Err(Error::Backend(format!(
                        "Metal kernel {name} wrote past the end of argument {i} ({} bytes)",
                        b.len
                    )));
                }
            }
        }
        Ok(())
    }
}
