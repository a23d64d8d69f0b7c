//! A row's K/V in device memory: one allocation of `2 * layers` planes (`[layer][K, V]`),
//! each `capacity` slots of `stride` units in the model's KV dtype (elements of f32 or
//! bf16; 32-bit words of quantized K/V, a slot the CPU's bytes: `KvDtype::slot_units`). Capacity grows by half
//! again when a window needs more (so memory follows the row's own length), moves and
//! copies run as kernels on the backend's stream.

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::CudaSlice;
use mtp_cache::{KvError, KvStore};

use super::{kv_unit_index, ptr, Cuda, KvDtype};

pub struct CudaKv {
    cuda: Arc<Cuda>,
    buf: Option<CudaSlice<u8>>,
    dtype: KvDtype,
    planes: usize,
    stride: usize,
    capacity: usize,
    held: usize,
}

impl CudaKv {
    pub fn new(cuda: Arc<Cuda>, n_layers: usize, stride: usize, dtype: KvDtype) -> CudaKv {
        CudaKv { cuda, buf: None, dtype, planes: 2 * n_layers, stride, capacity: 0, held: 0 }
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Device address of the buffer (0 while nothing is allocated).
    pub fn base(&self) -> i64 {
        self.buf.as_ref().map_or(0, |b| ptr(b, self.cuda.stream()) as i64)
    }

    /// Units per plane.
    pub fn plane(&self) -> usize {
        self.capacity * self.stride
    }

    fn plane_bytes(&self, capacity: usize) -> usize {
        capacity * self.slot_bytes()
    }

    /// Bytes of one slot.
    fn slot_bytes(&self) -> usize {
        self.stride * self.dtype.unit_bytes()
    }

    fn err(what: &str, e: impl std::fmt::Debug) -> KvError {
        KvError(format!("GPU KV cache: {what}: {e:?}"))
    }

    /// Copies the first `n` elements of every plane of `src` (planes of `src_plane`) into
    /// `dst` (planes of `dst_plane`) and zeroes `dst` elements `[zero_from, zero_to)`.
    #[allow(clippy::too_many_arguments)]
    fn copy_planes(
        &self,
        src: u64,
        src_plane: usize,
        dst: u64,
        dst_plane: usize,
        n: usize,
        zero_from: usize,
        zero_to: usize,
    ) -> Result<(), KvError> {
        let f = &self.cuda.f.kv_copy[kv_unit_index(self.dtype)];
        let work = n + zero_to.saturating_sub(zero_from);
        let blocks = work.div_ceil(256).clamp(1, 1024) as u32;
        let (sp, dp, n, z0, z1) =
            (src_plane as i64, dst_plane as i64, n as i64, zero_from as i64, zero_to as i64);
        launch!(self.cuda, f, (blocks, self.planes as u32), 256, "KV copy", [src, sp, dst, dp, n, z0, z1])
            .map_err(|e: mtp_base::error::Error| KvError(e.to_string()))
    }

    /// Moves to a buffer of `capacity` slots, keeping the held slots.
    fn reallocate(&mut self, capacity: usize) -> Result<(), KvError> {
        let bytes = self.planes * self.plane_bytes(capacity);
        // SAFETY: the held slots are copied in below; the rest is written before it is read.
        let new = unsafe { self.cuda.stream().alloc::<u8>(bytes.max(1)) }.map_err(|e| {
            KvError(format!("out of GPU memory: cannot allocate {bytes} bytes of KV cache ({e:?})"))
        })?;
        if let Some(old) = &self.buf {
            let s = self.cuda.stream();
            let n = self.held * self.stride;
            self.copy_planes(ptr(old, s), self.plane(), ptr(&new, s), capacity * self.stride, n, n, n)?;
        }
        self.buf = Some(new);
        self.capacity = capacity;
        Ok(())
    }
}

impl KvStore for CudaKv {
    fn grow(&mut self, slots: usize) -> Result<(), KvError> {
        if slots <= self.held {
            return Ok(());
        }
        self.reserve(slots)?;
        let (b, plane) = (self.base() as u64, self.plane());
        self.copy_planes(b, plane, b, plane, 0, self.held * self.stride, slots * self.stride)?;
        self.held = slots;
        Ok(())
    }

    fn truncate(&mut self, slots: usize) {
        self.held = self.held.min(slots);
    }

    fn reserve(&mut self, slots: usize) -> Result<(), KvError> {
        if slots <= self.capacity {
            return Ok(());
        }
        self.reallocate(mtp_kernels::grown_capacity(self.capacity, slots))
    }

    fn move_down(&mut self, from: usize, to: usize, n: usize) {
        let Some(buf) = &self.buf else { return };
        let f = &self.cuda.f.kv_move[kv_unit_index(self.dtype)];
        let base = ptr(buf, self.cuda.stream());
        let (plane, from, to, n) = (
            (self.plane()) as i64,
            (from * self.stride) as i64,
            (to * self.stride) as i64,
            (n * self.stride) as i64,
        );
        let launched =
            launch!(self.cuda, f, (self.planes as u32, 1), 256, "KV move", [base, plane, from, to, n]);
        // A launch fails only on a broken context, whose error every later call reports.
        if let Err(e) = launched {
            tracing::error!("{e}");
        }
    }

    fn bytes(&self) -> usize {
        self.planes * self.plane_bytes(self.capacity)
    }

    fn read(&self, layer: usize, n: usize) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        let Some(buf) = &self.buf else { return Ok((Vec::new(), Vec::new())) };
        let (pb, len) = (self.plane_bytes(self.capacity), n * self.slot_bytes());
        let s = self.cuda.stream();
        let k = s
            .clone_dtoh(&buf.slice(2 * layer * pb..2 * layer * pb + len))
            .map_err(|e| Self::err("read", e))?;
        let v = s
            .clone_dtoh(&buf.slice((2 * layer + 1) * pb..(2 * layer + 1) * pb + len))
            .map_err(|e| Self::err("read", e))?;
        Ok((k, v))
    }

    fn write_bytes(&mut self, layer: usize, slot: usize, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        let pb = self.plane_bytes(self.capacity);
        let at = slot * self.slot_bytes();
        if k.len() != v.len() || at + k.len() > self.held * self.slot_bytes() {
            return Err(KvError(format!(
                "GPU KV cache: cannot write {} bytes at slot {slot} of {} held slots",
                k.len(),
                self.held
            )));
        }
        let s = self.cuda.stream().clone();
        let Some(buf) = self.buf.as_mut() else { return Ok(()) };
        for (plane, bytes) in [(2 * layer, k), (2 * layer + 1, v)] {
            let start = plane * pb + at;
            s.memcpy_htod(bytes, &mut buf.slice_mut(start..start + bytes.len()))
                .map_err(|e| Self::err("write", e))?;
        }
        Ok(())
    }

    fn try_clone(&self) -> Result<Box<dyn KvStore>, KvError> {
        let buf = match &self.buf {
            Some(b) => Some(self.cuda.stream().clone_dtod(b).map_err(|e| Self::err("copy", e))?),
            None => None,
        };
        Ok(Box::new(CudaKv { cuda: self.cuda.clone(), buf, ..*self }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
