//! A row's K/V in one device buffer of `2 * layers` planes (`[layer][K, V]`), each
//! `capacity` slots of `stride` units in the model's KV dtype: elements of f32 or bf16 K/V,
//! 32-bit words of quantized K/V, whose slot is the CPU's bytes (`[head][scale, bias,
//! codes]`, `mtp_cache::QuantLayout`; `KvDtype::slot_units`), so [`KvStore::read`] and
//! [`KvStore::write_bytes`] take the CPU's format. Capacity grows by half again when a window
//! needs more (memory follows the row's own length); moves, copies and zeroing run as kernels
//! in order with the forward's.

use std::any::Any;
use std::sync::Arc;

use mtp_cache::{KvError, KvStore};

use super::{Arg, Dispatch, KvDtype, Metal};
use mtp_base::error::Error;

pub struct MetalKv<D: Dispatch> {
    metal: Arc<Metal<D>>,
    buf: Option<D::Buffer>,
    dtype: KvDtype,
    planes: usize,
    stride: usize,
    capacity: usize,
    held: usize,
}

fn kv_err(e: Error) -> KvError {
    KvError(format!("Metal KV cache: {e}"))
}

impl<D: Dispatch> MetalKv<D> {
    /// An empty store of `n_layers` layers, `stride` units a slot (`KvDtype::slot_units`).
    pub fn new(metal: Arc<Metal<D>>, n_layers: usize, stride: usize, dtype: KvDtype) -> MetalKv<D> {
        MetalKv { metal, buf: None, dtype, planes: 2 * n_layers, stride, capacity: 0, held: 0 }
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Units per plane (elements; words of quantized K/V).
    pub fn plane(&self) -> usize {
        self.capacity * self.stride
    }

    /// The buffer (an error while nothing is allocated: no forward opened a window).
    pub(super) fn buffer(&self) -> mtp_base::error::Result<&D::Buffer> {
        self.buf
            .as_ref()
            .ok_or_else(|| Error::Backend("a Metal KV store was read before any window opened".into()))
    }

    fn plane_bytes(&self, capacity: usize) -> usize {
        capacity * self.stride * self.dtype.unit_bytes()
    }

    /// Bytes of one slot.
    fn slot_bytes(&self) -> usize {
        self.stride * self.dtype.unit_bytes()
    }

    /// Kernel variant by unit: 4-byte words (f32, quantized) or 2-byte (bf16).
    fn kernel(&self, four: &'static str, two: &'static str) -> &'static str {
        if self.dtype.unit_bytes() == 2 {
            two
        } else {
            four
        }
    }

    /// Copies the first `n` units of every plane of `src` (planes of `src_plane`) into
    /// `dst` (planes of `dst_plane`) and zeroes `dst` units `[zero_from, zero_to)`.
    #[allow(clippy::too_many_arguments)]
    fn copy_planes(
        &self,
        src: &D::Buffer,
        src_plane: usize,
        dst: &D::Buffer,
        dst_plane: usize,
        n: usize,
        zero_from: usize,
        zero_to: usize,
    ) -> Result<(), KvError> {
        let work = n + zero_to.saturating_sub(zero_from);
        let blocks = work.div_ceil(256).clamp(1, 1024);
        self.metal
            .run(
                self.kernel("kv_copy_4", "kv_copy_2"),
                (blocks as u32, self.planes as u32),
                256,
                &[
                    Arg::In(src, 0),
                    Arg::I64(src_plane as i64),
                    Arg::Out(dst, 0),
                    Arg::I64(dst_plane as i64),
                    Arg::I64(n as i64),
                    Arg::I64(zero_from as i64),
                    Arg::I64(zero_to as i64),
                    Arg::I64(blocks as i64),
                ],
            )
            .map_err(kv_err)
    }

    /// Moves to a buffer of `capacity` slots, keeping the held slots.
    fn reallocate(&mut self, capacity: usize) -> Result<(), KvError> {
        let bytes = self.planes * self.plane_bytes(capacity);
        let new = self.metal.dispatch().alloc(bytes.max(4)).map_err(|e| {
            KvError(format!("out of device memory: cannot allocate {bytes} bytes of KV cache ({e})"))
        })?;
        if let Some(old) = &self.buf {
            let n = self.held * self.stride;
            self.copy_planes(old, self.plane(), &new, capacity * self.stride, n, n, n)?;
        }
        self.buf = Some(new);
        self.capacity = capacity;
        Ok(())
    }
}

impl<D: Dispatch> KvStore for MetalKv<D> {
    fn grow(&mut self, slots: usize) -> Result<(), KvError> {
        if slots <= self.held {
            return Ok(());
        }
        self.reserve(slots)?;
        let buf = self.buf.as_ref().expect("reserved");
        let plane = self.plane();
        self.copy_planes(buf, plane, buf, plane, 0, self.held * self.stride, slots * self.stride)?;
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
        let moved = self.metal.run(
            self.kernel("kv_move_4", "kv_move_2"),
            (self.planes as u32, 1),
            256,
            &[
                Arg::Out(buf, 0),
                Arg::I64(self.plane() as i64),
                Arg::I64((from * self.stride) as i64),
                Arg::I64((to * self.stride) as i64),
                Arg::I64((n * self.stride) as i64),
            ],
        );
        // A dispatch fails only on a broken device, whose error every later call reports.
        if let Err(e) = moved {
            tracing::error!("{e}");
        }
    }

    fn bytes(&self) -> usize {
        self.planes * self.plane_bytes(self.capacity)
    }

    fn read(&self, layer: usize, n: usize) -> Result<(Vec<u8>, Vec<u8>), KvError> {
        let Some(buf) = &self.buf else { return Ok((Vec::new(), Vec::new())) };
        let (pb, len) = (self.plane_bytes(self.capacity), n * self.slot_bytes());
        let (mut k, mut v) = (vec![0u8; len], vec![0u8; len]);
        let d = self.metal.dispatch();
        d.read(buf, 2 * layer * pb, &mut k).map_err(kv_err)?;
        d.read(buf, (2 * layer + 1) * pb, &mut v).map_err(kv_err)?;
        Ok((k, v))
    }

    fn write_bytes(&mut self, layer: usize, slot: usize, k: &[u8], v: &[u8]) -> Result<(), KvError> {
        let pb = self.plane_bytes(self.capacity);
        let at = slot * self.slot_bytes();
        if k.len() != v.len()
            || !k.len().is_multiple_of(self.slot_bytes().max(1))
            || at + k.len() > self.held * self.slot_bytes()
        {
            return Err(KvError(format!(
                "Metal KV cache: cannot write {} bytes at slot {slot} of {} held slots",
                k.len(),
                self.held
            )));
        }
        let Some(buf) = &self.buf else { return Ok(()) };
        let d = self.metal.dispatch();
        d.write(buf, 2 * layer * pb + at, k).map_err(kv_err)?;
        d.write(buf, (2 * layer + 1) * pb + at, v).map_err(kv_err)
    }

    fn try_clone(&self) -> Result<Box<dyn KvStore>, KvError> {
        let mut copy = MetalKv { buf: None, capacity: 0, held: 0, metal: self.metal.clone(), ..*self };
        if let Some(buf) = &self.buf {
            copy.reallocate(self.capacity)?;
            let n = self.held * self.stride;
            copy.copy_planes(
                buf,
                self.plane(),
                copy.buf.as_ref().expect("allocated"),
                self.plane(),
                n,
                n,
                n,
            )?;
            copy.held = self.held;
        }
        Ok(Box::new(copy))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
