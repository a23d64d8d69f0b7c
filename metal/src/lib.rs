//! The Metal backend: the kernels of `kernels.metal`, run through a [`Dispatch`] — Apple's
//! Metal API through candle's Metal device (`apple`, macOS, this crate's feature `apple`:
//! `mtp`'s `--features metal`), or the emulator (`emulated`, `--backend metal-emulated`,
//! feature `emulator`: `mtp`'s `--features metal-emulator`, everywhere but macOS; it
//! compiles `kernels.metal` as C++, so only that feature needs a C++17 compiler). Everything
//! above the dispatch (buffers, bindings, grids, the K/V layout, the negative controls) is
//! this one file, so CI runs all of it but Apple's API calls.
//!
//! Activations are f32 buffers; weights stay in their checkpoint dtype, wrapped without a
//! copy where the memory map allows it; K/V live in a [`MetalKv`] per row (bf16 for 16-bit
//! checkpoints, f32 for f32 ones, or as chosen: `--kv-dtype`, or `--kv-bits 8|4` for
//! quantized K/V in the CPU's format, quantized on store and dequantized on load), in
//! blocks of a pool per shape that rows and the prefix cache share (`kv.rs`, `pool.rs`).
//! K/V stores and attention run one dispatch per row over that row's block table: a row's
//! work is the same dispatch alone or in any batch.

#[cfg(all(feature = "apple", target_os = "macos"))]
pub mod apple;
mod dispatch;
#[cfg(mtp_metal_emulator)]
pub mod emulated;
mod kv;
mod pool;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use mtp_cache::{KvStore, RowCache, SlotMap};

pub use dispatch::{Arg, Dispatch};
pub use kv::MetalKv;

use mtp_base::error::{Error, Result};
use mtp_base::weights::{Weight, WeightDtype};
use mtp_kernels::negative_control;
use mtp_kernels::ops::RopeTable;
use mtp_kernels::{
    auto_kv_dtype, check_gpu_heads, check_gpu_kv, held_keys, open_windows, AssistantKernels, Backend, Heads,
    Kernels, KeyRange, KvDtype, Out, Plane, Slot,
};

/// Output columns per matmul threadgroup (4 SIMD-groups of 4: see kernels.metal).
const LINEAR_COLS_PER_GROUP: usize = 16;

/// A K/V store's shape: layers, slot units, dtype.
type PoolShape = (usize, usize, usize);

/// The Metal kernels on one device.
pub struct Metal<D: Dispatch> {
    d: D,
    backend: Backend,
    /// K/V block pools by shape (layers, slot units, dtype): weak, so a shape's memory
    /// goes when its last block does.
    kv_pools: Mutex<HashMap<PoolShape, Weak<pool::MetalPool<D>>>>,
}

impl<D: Dispatch> Metal<D> {
    pub fn new(d: D, backend: Backend) -> Metal<D> {
        tracing::info!("Metal backend on {}", d.device_name());
        Metal { d, backend, kv_pools: Mutex::new(HashMap::new()) }
    }

    /// What runs the kernels.
    pub fn dispatch(&self) -> &D {
        &self.d
    }

    fn upload_as<T: Copy>(&self, x: &[T]) -> Result<MetalBuf<D>> {
        // SAFETY: plain numbers (f32, i32, u32, i64) viewed as their bytes.
        let bytes = unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) };
        let buf = if bytes.is_empty() { self.d.alloc(4)? } else { self.d.upload(bytes)? };
        Ok(MetalBuf { buf, len: x.len() })
    }

    /// The values of `x`, read back after every queued kernel ran.
    fn read_f32(&self, x: &MetalBuf<D>) -> Result<Vec<f32>> {
        let mut bytes = vec![0u8; 4 * x.len];
        self.d.read(&x.buf, 0, &mut bytes)?;
        Ok(bytes.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    /// A weight's bytes on the device: wrapped in place when the platform allows and they
    /// sit at an address fit for 4-byte reads, copied otherwise.
    fn weight_bytes(&self, w: &Weight) -> Result<(D::Buffer, usize)> {
        if (w.bytes().as_ptr() as usize).is_multiple_of(4) {
            if let Some(wrapped) = self.d.wrap(w)? {
                return Ok(wrapped);
            }
        }
        Ok((self.d.upload(w.bytes())?, 0))
    }

    fn run(
        &self,
        name: &'static str,
        grid: (u32, u32),
        threads: u32,
        args: &[Arg<'_, D::Buffer>],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 {
            return Ok(());
        }
        self.d.run(name, grid, threads, args)
    }

    /// The negative control's matmul: a split-K kernel whose split count follows M, over an
    /// f32 copy of the weights.
    fn stock_linear(
        &self,
        x: &MetalBuf<D>,
        m: usize,
        w: &MetalMat<D>,
        bias: Option<&MetalBuf<D>>,
        out: &mut MetalBuf<D>,
        mode: Out,
    ) -> Result<()> {
        let wf = self.upload_as(&w.host.to_f32())?;
        let y = self.alloc(m * w.rows)?;
        let (mi, k, n) = (m as i32, w.cols as i32, w.rows as i32);
        let grid = (w.rows.div_ceil(LINEAR_COLS_PER_GROUP) as u32, 1);
        self.run(
            "linear_split_k",
            grid,
            128,
            &[
                Arg::In(&x.buf, 0),
                Arg::I32(mi),
                Arg::I32(k),
                Arg::In(&wf.buf, 0),
                Arg::I32(n),
                Arg::Out(&y.buf, 0),
            ],
        )?;
        let (bias_buf, has_bias) = bias.map_or((&y.buf, 0), |b| (&b.buf, 1));
        self.run(
            "add_into",
            (m as u32, 1),
            256,
            &[
                Arg::Out(&out.buf, 0),
                Arg::In(&y.buf, 0),
                Arg::In(bias_buf, 0),
                Arg::I32(has_bias),
                Arg::I32(n),
                Arg::I32((mode == Out::Add) as i32),
            ],
        )
    }

    /// The K/V buffer and layout of `plane` of row `r`.
    fn row_kv<'a>(&self, cache: &'a RowCache, r: usize, plane: Plane) -> Result<(&'a MetalKv<D>, RowKv)> {
        let store = plane.store(cache).ok_or_else(|| Error::Request {
            request: format!("row {r}"),
            msg: format!("its cache has no {plane:?} K/V"),
        })?;
        let kv = store.as_any().downcast_ref::<MetalKv<D>>().ok_or_else(|| Error::Request {
            request: format!("row {r}"),
            msg: "its KV cache is not on this Metal device (made by a model on another backend)".into(),
        })?;
        let map = plane.map(cache).ok_or_else(|| Error::Request {
            request: format!("row {r}"),
            msg: format!("its {plane:?} K/V have no slot map"),
        })?;
        Ok((kv, RowKv::new(kv, map)))
    }

    /// The attention kernel for a K/V dtype and head size.
    fn attention_kernel(kv: KvDtype, head_dim: usize) -> &'static str {
        match (kv, head_dim > 256) {
            (KvDtype::Bf16, false) => "attention_bf16",
            (KvDtype::Bf16, true) => "attention_bf16_512",
            (KvDtype::Q8, false) => "attention_q8",
            (KvDtype::Q8, true) => "attention_q8_512",
            (KvDtype::Q4, false) => "attention_q4",
            (KvDtype::Q4, true) => "attention_q4_512",
            (KvDtype::Auto | KvDtype::F32, false) => "attention_f32",
            (KvDtype::Auto | KvDtype::F32, true) => "attention_f32_512",
        }
    }

    /// The K/V store kernel for a K/V dtype.
    fn store_kernel(kv: KvDtype) -> &'static str {
        match kv {
            KvDtype::Bf16 => "qk_rope_store_bf16",
            KvDtype::Q8 => "qk_rope_store_q8",
            KvDtype::Q4 => "qk_rope_store_q4",
            KvDtype::Auto | KvDtype::F32 => "qk_rope_store_f32",
        }
    }
}

/// A device buffer of `len` f32 (or other 4-byte) values.
pub struct MetalBuf<D: Dispatch> {
    buf: D::Buffer,
    len: usize,
}

/// A weight matrix on the device, in its checkpoint dtype.
pub struct MetalMat<D: Dispatch> {
    buf: D::Buffer,
    offset: usize,
    dtype: WeightDtype,
    rows: usize,
    cols: usize,
    quant: Option<MetalQuant<D>>,
    /// The weight as loaded, for the negative control's f32 copy.
    host: Weight,
}

/// Scales and biases of a quantized matrix, widened to f32, and its layout.
struct MetalQuant<D: Dispatch> {
    scales: MetalBuf<D>,
    biases: Option<MetalBuf<D>>,
    bits: usize,
    group: usize,
}

/// The RoPE table on the device.
pub struct MetalRope<D: Dispatch> {
    cos: MetalBuf<D>,
    sin: MetalBuf<D>,
}

/// One forward's layout: every token's (position, RoPE position, first key, 0), listed row
/// by row, and where each row's tokens start.
pub struct MetalBatch<D: Dispatch> {
    toks: MetalBuf<D>,
    /// Each slot's token id.
    tokens: Vec<u32>,
    /// Row r's tokens are `[first_token[r], first_token[r + 1])`.
    first_token: Vec<usize>,
    kv: KvDtype,
    splits: i32,
}

// The kernels' block (KV_BLOCK in kernels.metal) is the cache's.
const _: () = assert!(mtp_cache::BLOCK_POSITIONS == 64);

/// A row's K/V layout as the kernels read it (`RowKv` in kernels.metal).
#[repr(C)]
#[derive(Clone, Copy)]
struct RowKv {
    plane: i64,
    committed: i64,
    window_base: i64,
    ring: i64,
    block_slots: i64,
}

impl RowKv {
    fn new<D: Dispatch>(kv: &MetalKv<D>, map: SlotMap) -> RowKv {
        RowKv {
            plane: kv.plane() as i64,
            committed: map.committed as i64,
            window_base: map.base as i64,
            ring: map.ring as i64,
            block_slots: kv.block_slots() as i64,
        }
    }

    fn bytes(&self) -> [u8; 40] {
        let mut b = [0u8; 40];
        let fields = [self.plane, self.committed, self.window_base, self.ring, self.block_slots];
        for (i, v) in fields.iter().enumerate() {
            b[8 * i..8 * i + 8].copy_from_slice(&v.to_ne_bytes());
        }
        b
    }
}

/// Whether the kernels take this attention shape with K/V of `kv` (quantized K/V need
/// head_dim a multiple of 8: a head is whole words).
fn check_heads(h: Heads, kv: KvDtype) -> Result<()> {
    check_gpu_heads(h, "Metal")?;
    check_gpu_kv(kv, h.head_dim, "Metal")
}

/// Threadgroups of 256 threads covering `n` values.
fn grid256(n: usize) -> (u32, u32) {
    (n.div_ceil(256) as u32, 1)
}

impl<D: Dispatch> Kernels for Metal<D> {
    type Act = MetalBuf<D>;
    type Mat = MetalMat<D>;
    type Vec = MetalBuf<D>;
    type Rope = MetalRope<D>;
    type Batch = MetalBatch<D>;
    type Recordings = ();

    fn backend(&self) -> Backend {
        self.backend
    }

    fn verify_token_cost(&self) -> f64 {
        // An Apple GPU's decode step streams the weights (the emulator computes the same
        // bits, so it prices drafts as the GPU would).
        0.2
    }

    fn matrix(&self, w: &Weight) -> Result<MetalMat<D>> {
        let quant = match w.quant() {
            Some(q) => Some(MetalQuant {
                scales: self.upload_as(&q.scales.to_f32())?,
                biases: match &q.biases {
                    Some(b) => Some(self.upload_as(&b.to_f32())?),
                    None => None,
                },
                bits: q.bits,
                group: q.group,
            }),
            None => None,
        };
        let (buf, offset) = self.weight_bytes(w).map_err(|e| {
            Error::Backend(format!(
                "cannot place a {} x {} {} weight on the device: {e}",
                w.rows,
                w.cols,
                w.dtype.name()
            ))
        })?;
        Ok(MetalMat { buf, offset, dtype: w.dtype, rows: w.rows, cols: w.cols, quant, host: w.clone() })
    }

    fn vector(&self, v: &[f32]) -> Result<MetalBuf<D>> {
        self.upload_as(v)
    }

    fn rope_table(&self, table: RopeTable) -> Result<MetalRope<D>> {
        let (cos, sin) = table.cos_sin();
        Ok(MetalRope { cos: self.upload_as(cos)?, sin: self.upload_as(sin)? })
    }

    fn kv_dtype(&self, kv: KvDtype, weights: WeightDtype) -> Result<KvDtype> {
        auto_kv_dtype(kv, weights)
    }

    fn kv_store(
        self: &Arc<Self>,
        n_layers: usize,
        heads: usize,
        head_dim: usize,
        kv: KvDtype,
    ) -> Box<dyn KvStore> {
        let stride = kv.slot_units(heads, head_dim);
        let mut pools = self.kv_pools.lock().unwrap_or_else(|p| p.into_inner());
        pools.retain(|_, p| p.strong_count() > 0);
        let key = (n_layers, stride, kv as usize);
        let pool = match pools.get(&key).and_then(Weak::upgrade) {
            Some(pool) => pool,
            None => {
                let bytes = MetalKv::<D>::block_bytes(n_layers, stride, kv);
                let pool = Arc::new(pool::MetalPool::new(self.clone(), bytes, kv.unit_bytes()));
                pools.insert(key, Arc::downgrade(&pool));
                pool
            }
        };
        Box::new(MetalKv::new(pool, n_layers, stride, kv))
    }

    fn alloc(&self, len: usize) -> Result<MetalBuf<D>> {
        Ok(MetalBuf { buf: self.d.alloc(4 * len.max(1))?, len })
    }

    fn upload(&self, x: &[f32]) -> Result<MetalBuf<D>> {
        self.upload_as(x)
    }

    fn download(&self, x: MetalBuf<D>) -> Result<Vec<f32>> {
        self.read_f32(&x)
    }

    // On the host: a decode step's logits are read back whole on Metal anyway (unified
    // memory), and one implementation keeps the CPU's bits.
    fn logit_summaries(
        &self,
        logits: &MetalBuf<D>,
        rows: usize,
        vocab: usize,
        out: &mut MetalBuf<D>,
    ) -> Result<()> {
        mtp_kernels::check_summary_lens(logits.len, out.len, rows, vocab)?;
        let mut values = vec![0.0f32; mtp_kernels::SUMMARY_VALUES * rows];
        mtp_kernels::host_summaries(&self.read_f32(logits)?, rows, vocab, &mut values)?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
        self.d.write(&out.buf, 0, &bytes)
    }

    fn batch(&self, slots: &[Slot], tokens: &[u32], caches: &mut [&mut RowCache]) -> Result<MetalBatch<D>> {
        open_windows(slots, caches)?;
        let mut kv = None;
        for (r, c) in caches.iter().enumerate() {
            let (store, _) = self.row_kv(c, r, Plane::Main(0))?;
            if *kv.get_or_insert(store.dtype()) != store.dtype() {
                return Err(Error::Backend("rows of one forward hold K/V in different dtypes".into()));
            }
        }
        let mut first_token = vec![0usize; caches.len() + 1];
        for s in slots {
            first_token[s.row + 1] += 1;
        }
        for r in 0..caches.len() {
            first_token[r + 1] += first_token[r];
        }
        let toks: Vec<i32> = slots.iter().flat_map(|s| [s.pos as i32, s.rope_pos as i32, 0, 0]).collect();
        let splits = if negative_control::split_attention() { (16 / caches.len().max(1)).max(1) } else { 1 };
        Ok(MetalBatch {
            toks: self.upload_as(&toks)?,
            tokens: tokens.to_vec(),
            first_token,
            kv: kv.unwrap_or(KvDtype::F32),
            splits: splits as i32,
        })
    }

    fn embed_batch(&self, table: &MetalMat<D>, batch: &MetalBatch<D>, out: &mut MetalBuf<D>) -> Result<()> {
        self.embed(table, &batch.tokens, out)
    }

    fn embed(&self, table: &MetalMat<D>, tokens: &[u32], out: &mut MetalBuf<D>) -> Result<()> {
        let toks = self.upload_as(tokens)?;
        let (grid, cols) = ((tokens.len() as u32, 1), table.cols as i32);
        let t = Arg::In(&table.buf, table.offset);
        if let Some(q) = &table.quant {
            let (bias, has_bias) = q.biases.as_ref().map_or((&q.scales, 0), |b| (b, 1));
            let name = match q.bits {
                2 => "embed_q2",
                4 => "embed_q4",
                _ => "embed_q8",
            };
            return self.run(
                name,
                grid,
                256,
                &[
                    t,
                    Arg::In(&q.scales.buf, 0),
                    Arg::In(&bias.buf, 0),
                    Arg::I32(has_bias),
                    Arg::I32(q.group as i32),
                    Arg::In(&toks.buf, 0),
                    Arg::I32(cols),
                    Arg::Out(&out.buf, 0),
                ],
            );
        }
        let name = match table.dtype {
            WeightDtype::F32 => "embed_f32",
            WeightDtype::Bf16 => "embed_bf16",
            WeightDtype::F16 => "embed_f16",
        };
        self.run(name, grid, 256, &[t, Arg::In(&toks.buf, 0), Arg::I32(cols), Arg::Out(&out.buf, 0)])
    }

    fn linear(
        &self,
        x: &MetalBuf<D>,
        m: usize,
        w: &MetalMat<D>,
        bias: Option<&MetalBuf<D>>,
        out: &mut MetalBuf<D>,
        mode: Out,
    ) -> Result<()> {
        if negative_control::stock_matmul() {
            return self.stock_linear(x, m, w, bias, out, mode);
        }
        let (mi, k, n) = (m as i32, w.cols as i32, w.rows as i32);
        let grid = (w.rows.div_ceil(LINEAR_COLS_PER_GROUP) as u32, 1);
        // Rows per pass over the weights; every variant sums each output in the same order.
        let rows_per_pass = match m {
            0..=4 => 4,
            5..=8 => 8,
            _ => 16,
        };
        let (bias_buf, has_bias) = bias.map_or((&out.buf, 0), |b| (&b.buf, 1));
        let acc = (mode == Out::Add) as i32;
        let wp = Arg::In(&w.buf, w.offset);
        if let Some(q) = &w.quant {
            let (qbias, has_qbias) = q.biases.as_ref().map_or((&q.scales, 0), |b| (b, 1));
            let name = linear_q_name(q.bits, rows_per_pass);
            return self.run(
                name,
                grid,
                128,
                &[
                    Arg::In(&x.buf, 0),
                    Arg::I32(mi),
                    Arg::I32(k),
                    wp,
                    Arg::In(&q.scales.buf, 0),
                    Arg::In(&qbias.buf, 0),
                    Arg::I32(has_qbias),
                    Arg::I32(q.group as i32),
                    Arg::I32(n),
                    Arg::In(bias_buf, 0),
                    Arg::I32(has_bias),
                    Arg::Out(&out.buf, 0),
                    Arg::I32(acc),
                ],
            );
        }
        let name = linear_name(w.dtype, rows_per_pass);
        self.run(
            name,
            grid,
            128,
            &[
                Arg::In(&x.buf, 0),
                Arg::I32(mi),
                Arg::I32(k),
                wp,
                Arg::I32(n),
                Arg::In(bias_buf, 0),
                Arg::I32(has_bias),
                Arg::Out(&out.buf, 0),
                Arg::I32(acc),
            ],
        )
    }

    fn rms_norm(
        &self,
        x: &MetalBuf<D>,
        w: &MetalBuf<D>,
        eps: f32,
        out: &mut MetalBuf<D>,
        out_width: usize,
        col: usize,
    ) -> Result<()> {
        let n = w.len;
        let rows = (x.len / n.max(1)) as u32;
        self.run(
            "rms_norm",
            (rows, 1),
            32,
            &[
                Arg::In(&x.buf, 0),
                Arg::In(&w.buf, 0),
                Arg::I32(n as i32),
                Arg::F32(eps),
                Arg::Out(&out.buf, 0),
                Arg::I32(out_width as i32),
                Arg::I32(col as i32),
            ],
        )
    }

    fn swiglu(&self, gate: &mut MetalBuf<D>, up: &MetalBuf<D>) -> Result<()> {
        let n = gate.len.min(up.len);
        self.run(
            "swiglu",
            grid256(n),
            256,
            &[Arg::Out(&gate.buf, 0), Arg::In(&up.buf, 0), Arg::I64(n as i64)],
        )
    }

    fn qk_rope_store(
        &self,
        q: &mut MetalBuf<D>,
        kv: Option<(&mut MetalBuf<D>, &MetalBuf<D>)>,
        norms: Option<(&MetalBuf<D>, &MetalBuf<D>, f32)>,
        rope: &MetalRope<D>,
        batch: &MetalBatch<D>,
        caches: &mut [&mut RowCache],
        plane: Plane,
        heads: Heads,
    ) -> Result<()> {
        check_heads(heads, batch.kv)?;
        let name = Self::store_kernel(batch.kv);
        let (qn, kn, has_norm, eps) =
            norms.map_or((&q.buf, &q.buf, 0, 0.0), |(a, b, e)| (&a.buf, &b.buf, 1, e));
        let (kp, vp) = match &kv {
            Some((k, v)) => (&k.buf, &v.buf),
            None => (&q.buf, &q.buf),
        };
        let blocks = if kv.is_some() { heads.heads + 2 * heads.kv_heads } else { heads.heads };
        for (r, cache) in caches.iter().enumerate() {
            let (tok0, count) = (batch.first_token[r], batch.first_token[r + 1] - batch.first_token[r]);
            let (store, row) = self.row_kv(cache, r, plane)?;
            let row = row.bytes();
            let (pool, table) = store.buffers()?;
            self.run(
                name,
                (count as u32, blocks as u32),
                32,
                &[
                    Arg::Out(&q.buf, 0),
                    Arg::In(kp, 0),
                    Arg::In(vp, 0),
                    Arg::In(qn, 0),
                    Arg::In(kn, 0),
                    Arg::I32(has_norm),
                    Arg::F32(eps),
                    Arg::In(&rope.cos.buf, 0),
                    Arg::In(&rope.sin.buf, 0),
                    Arg::In(&batch.toks.buf, 0),
                    Arg::I32(tok0 as i32),
                    Arg::Out(&*pool, 0),
                    Arg::Bytes(&row),
                    Arg::I32(plane.layer() as i32),
                    Arg::I32(heads.heads as i32),
                    Arg::I32(heads.kv_heads as i32),
                    Arg::I32(heads.head_dim as i32),
                    Arg::In(table, 0),
                ],
            )?;
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &MetalBuf<D>,
        batch: &MetalBatch<D>,
        caches: &[&mut RowCache],
        plane: Plane,
        heads: Heads,
        scale: f32,
        window: Option<usize>,
        out: &mut MetalBuf<D>,
    ) -> Result<()> {
        check_heads(heads, batch.kv)?;
        let name = Self::attention_kernel(batch.kv, heads.head_dim);
        for (r, cache) in caches.iter().enumerate() {
            let (tok0, count) = (batch.first_token[r], batch.first_token[r + 1] - batch.first_token[r]);
            let (store, row) = self.row_kv(cache, r, plane)?;
            self.attend(
                name,
                q,
                &batch.toks,
                tok0,
                count,
                store,
                row,
                plane,
                heads,
                scale,
                batch.splits,
                window,
                out,
            )?;
        }
        Ok(())
    }

    fn gather(&self, x: &MetalBuf<D>, width: usize, rows: &[usize]) -> Result<MetalBuf<D>> {
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let idx = self.upload_as(&idx)?;
        let out = self.alloc(rows.len() * width)?;
        self.run(
            "gather_rows",
            (rows.len() as u32, 1),
            256,
            &[Arg::In(&x.buf, 0), Arg::In(&idx.buf, 0), Arg::I32(width as i32), Arg::Out(&out.buf, 0)],
        )?;
        Ok(out)
    }

    fn gelu_tanh_mul(&self, gate: &mut MetalBuf<D>, up: &MetalBuf<D>) -> Result<()> {
        let n = gate.len.min(up.len);
        self.run(
            "gelu_tanh_mul",
            grid256(n),
            256,
            &[Arg::Out(&gate.buf, 0), Arg::In(&up.buf, 0), Arg::I64(n as i64)],
        )
    }

    fn scale(&self, x: &mut MetalBuf<D>, by: f32) -> Result<()> {
        self.run(
            "scale_by",
            grid256(x.len),
            256,
            &[Arg::Out(&x.buf, 0), Arg::F32(by), Arg::I64(x.len as i64)],
        )
    }

    fn add(&self, x: &mut MetalBuf<D>, y: &MetalBuf<D>) -> Result<()> {
        let n = x.len.min(y.len);
        self.run("add_to", grid256(n), 256, &[Arg::Out(&x.buf, 0), Arg::In(&y.buf, 0), Arg::I64(n as i64)])
    }

    fn add_rows_scaled(
        &self,
        out: &mut MetalBuf<D>,
        width: usize,
        src: &MetalBuf<D>,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()> {
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let (idx, w) = (self.upload_as(&idx)?, self.upload_as(weights)?);
        self.run(
            "add_rows_scaled",
            (rows.len() as u32, 1),
            256,
            &[
                Arg::Out(&out.buf, 0),
                Arg::In(&src.buf, 0),
                Arg::In(&idx.buf, 0),
                Arg::In(&w.buf, 0),
                Arg::I32(width as i32),
            ],
        )
    }
}

impl<D: Dispatch> Metal<D> {
    /// Attention of `count` queries (tokens `[tok0, tok0 + count)` of `toks`) over one row's
    /// K/V.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        name: &'static str,
        q: &MetalBuf<D>,
        toks: &MetalBuf<D>,
        tok0: usize,
        count: usize,
        store: &MetalKv<D>,
        row: RowKv,
        plane: Plane,
        heads: Heads,
        scale: f32,
        splits: i32,
        window: Option<usize>,
        out: &mut MetalBuf<D>,
    ) -> Result<()> {
        let row = row.bytes();
        let (pool, table) = store.buffers()?;
        self.run(
            name,
            (count as u32, heads.heads as u32),
            32,
            &[
                Arg::In(&q.buf, 0),
                Arg::Out(&out.buf, 0),
                Arg::In(&toks.buf, 0),
                Arg::I32(tok0 as i32),
                Arg::In(&*pool, 0),
                Arg::Bytes(&row),
                Arg::I32(plane.layer() as i32),
                Arg::I32(heads.heads as i32),
                Arg::I32(heads.kv_heads as i32),
                Arg::I32(heads.head_dim as i32),
                Arg::F32(scale),
                Arg::I32(splits),
                Arg::I32(window.map_or(0, |w| w as i32)),
                Arg::In(table, 0),
            ],
        )
    }
}

fn linear_name(d: WeightDtype, rows_per_pass: usize) -> &'static str {
    match (d, rows_per_pass) {
        (WeightDtype::F32, 4) => "linear_f32_4",
        (WeightDtype::F32, 8) => "linear_f32_8",
        (WeightDtype::F32, _) => "linear_f32_16",
        (WeightDtype::Bf16, 4) => "linear_bf16_4",
        (WeightDtype::Bf16, 8) => "linear_bf16_8",
        (WeightDtype::Bf16, _) => "linear_bf16_16",
        (WeightDtype::F16, 4) => "linear_f16_4",
        (WeightDtype::F16, 8) => "linear_f16_8",
        (WeightDtype::F16, _) => "linear_f16_16",
    }
}

fn linear_q_name(bits: usize, rows_per_pass: usize) -> &'static str {
    match (bits, rows_per_pass) {
        (2, 4) => "linear_q2_4",
        (2, 8) => "linear_q2_8",
        (2, _) => "linear_q2_16",
        (4, 4) => "linear_q4_4",
        (4, 8) => "linear_q4_8",
        (4, _) => "linear_q4_16",
        (_, 4) => "linear_q8_4",
        (_, 8) => "linear_q8_8",
        (_, _) => "linear_q8_16",
    }
}

impl<D: Dispatch> AssistantKernels for Metal<D> {
    fn rope_at(
        &self,
        x: &mut MetalBuf<D>,
        width: usize,
        head_dim: usize,
        positions: &[usize],
        rope: &MetalRope<D>,
    ) -> Result<()> {
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let pos = self.upload_as(&pos)?;
        let grid = (positions.len() as u32, (width / head_dim.max(1)) as u32);
        self.run(
            "rope_rows",
            grid,
            32,
            &[
                Arg::Out(&x.buf, 0),
                Arg::I32(width as i32),
                Arg::I32(head_dim as i32),
                Arg::In(&pos.buf, 0),
                Arg::In(&rope.cos.buf, 0),
                Arg::In(&rope.sin.buf, 0),
            ],
        )
    }

    fn attention_over(
        &self,
        q: &MetalBuf<D>,
        keys: &[KeyRange],
        caches: &[&RowCache],
        plane: Plane,
        heads: Heads,
        scale: f32,
        out: &mut MetalBuf<D>,
    ) -> Result<()> {
        check_gpu_heads(heads, "Metal")?;
        // Query i sits at the last key it reads, with its own first key.
        let toks: Vec<i32> = keys.iter().flat_map(|k| [k.end as i32 - 1, 0, k.first as i32, 0]).collect();
        let toks = self.upload_as(&toks)?;
        for (r, (cache, k)) in caches.iter().zip(keys).enumerate() {
            let map = held_keys(cache, r, plane, *k)?;
            let (store, _) = self.row_kv(cache, r, plane)?;
            check_gpu_kv(store.dtype(), heads.head_dim, "Metal")?;
            let row = RowKv::new(store, map);
            let name = Self::attention_kernel(store.dtype(), heads.head_dim);
            self.attend(name, q, &toks, r, 1, store, row, plane, heads, scale, 1, None, out)?;
        }
        Ok(())
    }
}
