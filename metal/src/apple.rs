//! Apple's Metal API behind [`Dispatch`]: candle's Metal device (its command queue,
//! command buffers and hazard tracking between dispatches), a library compiled at start from
//! `kernels.metal` with fast math off, and shared (unified) memory buffers. Memory-mapped
//! weights are wrapped without a copy on Apple Silicon (`newBufferWithBytesNoCopy` over the
//! 16 KiB pages that hold them).
//!
//! Not run in CI (no Mac there): it type-checks for aarch64-apple-darwin, and
//! `scripts/metal-test.sh` runs the test suites on a Mac.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendDevice;
use candle_core::MetalDevice;
use candle_metal_kernels::metal::{Buffer, ComputePipeline, Library};
use objc2_metal::{MTLCompileOptions, MTLComputePipelineState, MTLDevice, MTLSize};

use super::dispatch::{Arg, Dispatch};
use super::Metal;
use mtp_base::error::{Error, Result};
use mtp_base::weights::Weight;
use mtp_kernels::Backend;

const SOURCE: &str = include_str!("kernels.metal");
/// The VM page size of Apple Silicon, which `newBufferWithBytesNoCopy` aligns to.
const PAGE: usize = 16384;

fn metal_err(what: &str) -> impl Fn(candle_core::Error) -> Error + '_ {
    move |e| Error::Backend(format!("Metal {what}: {e}"))
}

/// The default Metal device and the kernels' library.
pub struct Apple {
    device: MetalDevice,
    library: Library,
    pipelines: Mutex<HashMap<&'static str, ComputePipeline>>,
    name: String,
}

/// A shared-storage Metal buffer; a wrapped weight keeps its memory map alive.
pub struct AppleBuffer {
    buf: Buffer,
    _weight: Option<Weight>,
}

impl Apple {
    /// The process's Metal backend on the default device, started on first use.
    pub fn shared() -> Result<Arc<Metal<Apple>>> {
        static SHARED: OnceLock<std::result::Result<Arc<Metal<Apple>>, String>> = OnceLock::new();
        SHARED
            .get_or_init(|| {
                Apple::start().map(|a| Arc::new(Metal::new(a, Backend::Metal))).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::Backend)
    }

    fn start() -> Result<Apple> {
        if candle_metal_kernels::metal::Device::all().is_empty() {
            return Err(Error::Backend("no Metal device found".into()));
        }
        let device = MetalDevice::new(0).map_err(metal_err("device"))?;
        let options = MTLCompileOptions::new();
        // Fast math off: precise exp/tanh/sqrt and no reassociation (see kernels.metal).
        #[allow(deprecated)]
        options.setFastMathEnabled(false);
        let library = device
            .device()
            .new_library_with_source(SOURCE, Some(&options))
            .map_err(|e| Error::Backend(format!("Metal could not compile kernels.metal: {e}")))?;
        let name = device.device().as_ref().name().to_string();
        Ok(Apple { device, library, pipelines: Mutex::new(HashMap::new()), name })
    }

    /// The pipeline of kernel `name`, built on first use.
    fn pipeline(&self, name: &'static str) -> Result<ComputePipeline> {
        let mut pipelines =
            self.pipelines.lock().map_err(|_| Error::Backend("Metal pipelines poisoned".into()))?;
        if let Some(p) = pipelines.get(name) {
            return Ok(p.clone());
        }
        let function = self
            .library
            .get_function(name, None)
            .map_err(|e| Error::Backend(format!("Metal kernel {name}: {e}")))?;
        let pipeline = self
            .device
            .device()
            .new_compute_pipeline_state_with_function(&function)
            .map_err(|e| Error::Backend(format!("Metal kernel {name}: {e}")))?;
        let width = pipeline.as_ref().threadExecutionWidth();
        if width != 32 {
            return Err(Error::Backend(format!(
                "Metal kernel {name}: SIMD-groups of {width} threads (the kernels assume 32)"
            )));
        }
        pipelines.insert(name, pipeline.clone());
        Ok(pipeline)
    }

    fn wait(&self) -> Result<()> {
        self.device.wait_until_completed().map_err(metal_err("wait"))
    }
}

impl Dispatch for Apple {
    type Buffer = AppleBuffer;

    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn alloc(&self, bytes: usize) -> Result<AppleBuffer> {
        let buf = self
            .device
            .device()
            .new_buffer(bytes.max(4), candle_metal_kernels::RESOURCE_OPTIONS)
            .map_err(|e| Error::Backend(format!("out of Metal memory for {bytes} bytes: {e}")))?;
        Ok(AppleBuffer { buf, _weight: None })
    }

    fn upload(&self, bytes: &[u8]) -> Result<AppleBuffer> {
        let buf = self.alloc(bytes.len())?;
        // SAFETY: a fresh shared buffer of at least `bytes.len()` bytes, not yet used by the GPU.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.buf.contents(), bytes.len()) };
        Ok(buf)
    }

    fn wrap(&self, weight: &Weight) -> Result<Option<(AppleBuffer, usize)>> {
        if !cfg!(target_arch = "aarch64") || !weight.is_mapped() {
            return Ok(None);
        }
        let bytes = weight.bytes();
        let start = bytes.as_ptr() as usize & !(PAGE - 1);
        let end = (bytes.as_ptr() as usize + bytes.len()).div_ceil(PAGE) * PAGE;
        let Some(pointer) = NonNull::new(start as *mut c_void) else { return Ok(None) };
        // SAFETY: the pages [start, end) hold the weight and belong to its memory map (a map
        // covers whole pages), which `_weight` keeps alive as long as the buffer; the GPU
        // only reads them.
        let raw = unsafe {
            self.device.device().as_ref().newBufferWithBytesNoCopy_length_options_deallocator(
                pointer,
                end - start,
                candle_metal_kernels::RESOURCE_OPTIONS,
                None,
            )
        };
        Ok(raw.map(|raw| {
            let buf = AppleBuffer { buf: Buffer::new(raw), _weight: Some(weight.clone()) };
            (buf, bytes.as_ptr() as usize - start)
        }))
    }

    fn read(&self, buf: &AppleBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        if offset + out.len() > buf.buf.length() {
            return Err(Error::Backend(format!(
                "Metal read of {} bytes at {offset} past a buffer's end",
                out.len()
            )));
        }
        self.wait()?;
        // SAFETY: in range (checked) of a shared buffer no queued kernel writes any more.
        unsafe { std::ptr::copy_nonoverlapping(buf.buf.contents().add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn write(&self, buf: &AppleBuffer, offset: usize, bytes: &[u8]) -> Result<()> {
        if offset + bytes.len() > buf.buf.length() {
            return Err(Error::Backend(format!(
                "Metal write of {} bytes at {offset} past a buffer's end",
                bytes.len()
            )));
        }
        self.wait()?;
        // SAFETY: in range (checked) of a shared buffer no queued kernel reads any more.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.buf.contents().add(offset), bytes.len()) };
        Ok(())
    }

    fn run(
        &self,
        name: &'static str,
        grid: (u32, u32),
        threads: u32,
        args: &[Arg<'_, AppleBuffer>],
    ) -> Result<()> {
        let pipeline = self.pipeline(name)?;
        let guard = self.device.command_encoder().map_err(metal_err("encoder"))?;
        let encoder = guard.as_ref();
        encoder.set_compute_pipeline_state(&pipeline);
        for (i, arg) in args.iter().enumerate() {
            match arg {
                Arg::In(b, offset) => encoder.set_input_buffer(i, Some(&b.buf), *offset),
                Arg::Out(b, offset) => encoder.set_output_buffer(i, Some(&b.buf), *offset),
                Arg::I32(v) => encoder.set_bytes(i, v),
                Arg::I64(v) => encoder.set_bytes(i, v),
                Arg::F32(v) => encoder.set_bytes(i, v),
                Arg::Bytes(b) => encoder.set_bytes_directly(i, b.len(), b.as_ptr() as *const c_void),
            }
        }
        let groups = MTLSize { width: grid.0 as usize, height: grid.1 as usize, depth: 1 };
        let per_group = MTLSize { width: threads as usize, height: 1, depth: 1 };
        encoder.dispatch_thread_groups(groups, per_group);
        Ok(())
    }
}
