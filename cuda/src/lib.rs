//! The CUDA backend: the kernels of `kernels.cu` (compiled to PTX by `build.rs`), launched
//! through cudarc on one stream of GPU 0. Activations are f32 device buffers, rounded to
//! bf16 where they meet a bf16 weight (or, `--activations f32`, split exactly into three
//! bf16 terms: [`Activations`]); weights stay in their checkpoint dtype on the device, K/V
//! live in a [`CudaKv`] per row (bf16 for 16-bit checkpoints, f32 for f32 ones). The driver is loaded at run time, so a binary
//! built with `--features cuda` starts (and reports a clear error) on a machine without one.
//!
//! Each op family's kernels sit in one `.cuh` that `kernels.cu` includes, and its host side
//! in the Rust module of the same name beside it (`matmul_tc.cuh` and `matmul_tc.rs`,
//! `attention.cuh` and `attention.rs`, ...); this file holds the device setup, the loaded
//! kernels and the [`Kernels`] impl, whose methods launch the families that need no more.
//!
//! The crate compiles to nothing without its `cuda` feature, so `cargo test --workspace`
//! needs no nvcc; `mtp`'s `--features cuda` turns it on.
#![cfg(feature = "cuda")]

/// Launches kernel `$f` on a `$grid` of blocks of `$block` threads with the named
/// arguments (locals, so they outlive the launch builder).
macro_rules! launch {
    ($cuda:expr, $f:expr, $grid:expr, $block:expr, $what:expr, [$($arg:ident),*]) => {
        launch!($cuda, $f, $grid, $block, 0, $what, [$($arg),*])
    };
    ($cuda:expr, $f:expr, $grid:expr, $block:expr, $smem:expr, $what:expr, [$($arg:ident),*]) => {{
        let (grid, block): ((u32, u32), u32) = ($grid, $block);
        if grid.0 == 0 || grid.1 == 0 {
            Ok(())
        } else {
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (grid.0, grid.1, 1),
                block_dim: (block, 1, 1),
                shared_mem_bytes: $smem,
            };
            let mut b = $cuda.stream.launch_builder($f);
            $( cudarc::driver::PushKernelArg::arg(&mut b, &$arg); )*
            // SAFETY: every kernel checks its bounds against the sizes passed with it, and
            // the buffers behind the pointers outlive the launch (freed later on the same
            // stream).
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(|e| mtp_base::error::Error::Backend(format!("CUDA {}: {e:?}", $what)))
        }
    }};
}

mod attention;
mod embed;
mod flash;
mod forward;
mod graphs;
mod hopper;
mod kv;
mod matmul;
mod matmul_tc;
mod matmul_tcq;
mod matmul_tt;
mod nccl;
mod pool;
mod scratch;
mod stock;

use std::sync::{Arc, OnceLock};

use attention::AttentionKeys;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError};
use forward::ROW_FIELDS; // graphs.rs's `super::ROW_FIELDS`
use matmul::{
    bits_index, tensor_core_path, weight_index, CudaQuant, LINEAR_COLS_PER_BLOCK, LINEAR_TC_COLS_PER_BLOCK,
    LINEAR_THREADS,
};
use matmul_tc::{activation_terms, wide_pass, TcParts, PARTS_TILES};
use matmul_tcq::{group_words, quant_tensor_cores, repack_codes, tcq_stackable};
use mtp_cache::{KvStore, RowCache};

pub use forward::CudaBatch;
pub use graphs::CudaGraphs;
pub use kv::CudaKv;
pub use matmul::CudaMat;
pub use matmul_tc::TcKernel;
pub use nccl::NcclCollective;

use mtp_base::error::{Error, Result};
use mtp_base::weights::{Weight, WeightDtype};
use mtp_kernels::negative_control;
use mtp_kernels::ops::RopeTable;
use mtp_kernels::{
    auto_kv_dtype, check_gpu_heads, check_gpu_kv, linear_each, open_windows, Activations, Backend,
    ForwardBody, Heads, Kernels, KvDtype, Out, Plane, Slot,
};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

fn driver(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Backend(format!("CUDA {what}: {e:?}"))
}

/// Kernel variant for a K/V dtype: f32, bf16, 8-bit, 4-bit.
fn kv_index(kv: KvDtype) -> usize {
    match kv {
        KvDtype::Auto | KvDtype::F32 => 0,
        KvDtype::Bf16 => 1,
        KvDtype::Q8 => 2,
        KvDtype::Q4 => 3,
    }
}

/// The store-maintenance variant (moves, copies) for a K/V dtype: 4-byte units (f32
/// elements, quantized words), 2-byte (bf16).
fn kv_unit_index(kv: KvDtype) -> usize {
    (kv.unit_bytes() == 2) as usize
}

struct Functions {
    /// By weight dtype (f32, bf16, f16), then rows per pass (4, 8, 16).
    linear: [[CudaFunction; 3]; 3],
    /// MLX-quantized weights by bits (2, 4, 8), then rows per pass.
    linear_q: [[CudaFunction; 3]; 3],
    /// Quantized weights on tensor cores (bf16 mode), up to 3 a launch: by bits (4, 8),
    /// then tokens per pass (8, 16, 32, 64); over activations made by `prep_q_acts`.
    linear_tcq: [[CudaFunction; 4]; 2],
    prep_q_acts: CudaFunction,
    /// Tensor cores, bf16 weights with K % 32 == 0, by tokens per pass (8, 16, 32, 64), then
    /// the wide passes (8, 16): `TcKernel`'s first six, in order; the variants of this
    /// instance's [`Activations`] (kernels.cu's `_x1` or `_x3`), as every tensor-core
    /// function below.
    linear_tc: [CudaFunction; 6],
    /// The same, up to 3 weights in one launch, by tokens per pass (8, 16, 32).
    linear_tc_parts: [CudaFunction; 3],
    /// Gate and up then SwiGLU, by tokens per pass (8, 16, 32), then the wide passes (8, 16).
    linear_tc_swiglu: [CudaFunction; 5],
    /// The same, tiled in shared memory, on activations split (or rounded) by
    /// `split_activations`: by
    /// [`TcKernel::tile`]'s index, unphased and phase-split.
    linear_tt: [CudaFunction; 4],
    linear_tt_phases: [CudaFunction; 5],
    /// Phase-split tiles over up to 3 weights, as `PARTS_TILES`.
    linear_tt_parts: [CudaFunction; 3],
    /// wgmma tiles (`hopper.cu`): on compute capability 9.0 with bf16 activations only;
    /// 128x128, then the phase-split 128x64 and 128x128, then the phase-split 128x64 over
    /// up to 3 weights.
    linear_wg: Option<[CudaFunction; 5]>,
    split_activations: CudaFunction,
    /// bf16 activations in MMA-step order, for wgmma.
    split_activations_steps: CudaFunction,
    linear_merge_phases: CudaFunction,
    linear_merge_phases_parts: CudaFunction,
    linear_merge_phases_swiglu: CudaFunction,
    embed: [CudaFunction; 3],
    embed_q: [CudaFunction; 3],
    /// The same over codes in `linear_tcq`'s order ([`repack_codes`]), by bits (4, 8).
    embed_tcq: [CudaFunction; 2],
    widen: [CudaFunction; 2],
    rms_norm: CudaFunction,
    swiglu: CudaFunction,
    gather: CudaFunction,
    add_into: CudaFunction,
    /// By K/V dtype ([`kv_index`]).
    qk_rope_store: [CudaFunction; 4],
    /// By K/V dtype ([`kv_index`]), then head size 128 serving 1, 2 or 4 query heads a
    /// block, 256, 512.
    attention: [[CudaFunction; 5]; 4],
    attention_merge: CudaFunction,
    /// Tensor-core attention (flash.cuh) by head-size tier: any head size of the tier, and
    /// the tier's own (sizes known at compile time); and its merge.
    flash: [[CudaFunction; 2]; 3],
    /// The full-width head-size-128 kernel by wgmma (`hopper.cu`), on compute capability 9.0.
    flash_wg: Option<CudaFunction>,
    flash_merge: CudaFunction,
    /// By unit ([`kv_unit_index`]).
    kv_move: [CudaFunction; 2],
    kv_copy: [CudaFunction; 2],
    gelu_tanh_mul: CudaFunction,
    scale_by: CudaFunction,
    add_to: CudaFunction,
    add_parts: CudaFunction,
    concat_columns: CudaFunction,
    add_rows_scaled: CudaFunction,
    rope_rows: CudaFunction,
    logit_summaries: CudaFunction,
}

/// A GPU, its stream and the loaded kernels. One per GPU and [`Activations`] mode
/// ([`Cuda::on_device`]; GPU 0 is [`Cuda::shared_with`]'s); both modes share the GPU's one
/// stream, so every model's and cache's work on it is ordered without events.
pub struct Cuda {
    stream: Arc<CudaStream>,
    f: Functions,
    /// `Bf16` or `F32`, never `Auto`: which tensor-core kernels `f` holds.
    activations: Activations,
    device: String,
    /// cuBLAS, loaded only for the negative control.
    blas: OnceLock<std::result::Result<cudarc::cublas::CudaBlas, String>>,
    /// Page-locked host memory every download lands in first ([`Cuda::to_host`]), grown to
    /// the largest download so far.
    staging: std::sync::Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
    /// Matmul scratch kept between launches of recordable size ([`scratch`]).
    scratch: scratch::Pools,
    /// K/V block pools, one per store shape (layers, slot units, dtype).
    kv_pools: std::sync::Mutex<std::collections::HashMap<(usize, usize, usize), Arc<pool::BlockPool>>>,
}

/// A GPU's stream, the module of every kernel, and the Hopper module on compute
/// capability 9.0.
type Device = (Arc<CudaStream>, Arc<cudarc::driver::CudaModule>, Option<Arc<cudarc::driver::CudaModule>>);

/// The most GPUs one process drives (tensor-parallel ranks).
pub const MAX_GPUS: usize = 8;

// SAFETY: the cuBLAS handle is used only from the thread running a forward, behind &self,
// and cuBLAS handles may be shared between host threads that do not call it concurrently
// on the same stream; every other field is Send + Sync.
unsafe impl Sync for Cuda {}
unsafe impl Send for Cuda {}

/// One device pointer as a kernel argument.
fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

impl Cuda {
    /// The process's CUDA backend on GPU 0 in the default numerics (bf16 activations),
    /// started on first use. Fails with a clear message when there is no driver, no GPU, or
    /// the kernels cannot be loaded.
    pub fn shared() -> Result<Arc<Cuda>> {
        Cuda::shared_with(Activations::Auto)
    }

    /// The same, with activations as `activations` says (`Auto`: bf16).
    pub fn shared_with(activations: Activations) -> Result<Arc<Cuda>> {
        Cuda::on_device(0, activations)
    }

    /// The backend on GPU `ordinal` (a tensor-parallel rank's), activations as
    /// `activations` says: one per GPU and mode, each GPU with its own stream.
    pub fn on_device(ordinal: usize, activations: Activations) -> Result<Arc<Cuda>> {
        type Slot = OnceLock<std::result::Result<Arc<Cuda>, String>>;
        static SHARED: [[Slot; 2]; MAX_GPUS] = [const { [const { OnceLock::new() }; 2] }; MAX_GPUS];
        let activations = match activations {
            Activations::F32 => Activations::F32,
            Activations::Auto | Activations::Bf16 => Activations::Bf16,
        };
        let slots = SHARED.get(ordinal).ok_or_else(|| {
            Error::Backend(format!("GPU {ordinal}: this build drives at most {MAX_GPUS} GPUs"))
        })?;
        slots[(activations == Activations::Bf16) as usize]
            .get_or_init(|| Cuda::start(ordinal, activations).map(Arc::new))
            .clone()
            .map_err(Error::Backend)
    }

    /// GPUs the driver sees (0 without a driver).
    pub fn device_count() -> usize {
        // SAFETY: only probes whether the driver library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    }

    /// GPU `ordinal`'s one stream and the loaded kernels, shared by both modes.
    fn device(ordinal: usize) -> std::result::Result<Device, String> {
        type Slot = OnceLock<std::result::Result<Device, String>>;
        static DEVICE: [Slot; MAX_GPUS] = [const { OnceLock::new() }; MAX_GPUS];
        DEVICE[ordinal]
            .get_or_init(|| {
                // SAFETY: only probes whether the driver library can be loaded.
                if !unsafe { cudarc::driver::sys::is_culib_present() } {
                    return Err("no NVIDIA driver found (libcuda.so could not be loaded): \
                                this machine has no GPU driver, or LD_LIBRARY_PATH does not reach it"
                        .into());
                }
                let ctx = cudarc::driver::CudaContext::new(ordinal)
                    .map_err(|e| format!("cannot open GPU {ordinal}: {e:?}"))?;
                // One stream for everything: no cross-stream events needed.
                // SAFETY: every buffer is used on `stream` only.
                unsafe { ctx.disable_event_tracking() };
                let stream = ctx.new_stream().map_err(|e| format!("cannot create a stream: {e:?}"))?;
                let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(PTX)).map_err(|e| {
                    format!("cannot load the kernels' PTX (driver too old for CUDA 13 PTX?): {e:?}")
                })?;
                Ok((stream, module, hopper::load(&ctx)?))
            })
            .clone()
    }

    fn start(ordinal: usize, activations: Activations) -> std::result::Result<Cuda, String> {
        let (stream, module, hopper) = Cuda::device(ordinal)?;
        let ctx = stream.context();
        let get = |name: &str| module.load_function(name).map_err(|e| format!("kernel {name}: {e:?}"));
        // The tensor-core kernels of this mode: activations as 1 or 3 bf16 terms.
        let terms = activation_terms(activations);
        let tc = |name: &str| get(&format!("{name}_x{terms}"));
        let f = Functions {
            linear: [
                [get("linear_f32_4")?, get("linear_f32_8")?, get("linear_f32_16")?],
                [get("linear_bf16_4")?, get("linear_bf16_8")?, get("linear_bf16_16")?],
                [get("linear_f16_4")?, get("linear_f16_8")?, get("linear_f16_16")?],
            ],
            linear_q: [
                [get("linear_q2_4")?, get("linear_q2_8")?, get("linear_q2_16")?],
                [get("linear_q4_4")?, get("linear_q4_8")?, get("linear_q4_16")?],
                [get("linear_q8_4")?, get("linear_q8_8")?, get("linear_q8_16")?],
            ],
            linear_tcq: [
                [
                    get("linear_tcq4_8")?,
                    get("linear_tcq4_16")?,
                    get("linear_tcq4_32")?,
                    get("linear_tcq4_64")?,
                ],
                [
                    get("linear_tcq8_8")?,
                    get("linear_tcq8_16")?,
                    get("linear_tcq8_32")?,
                    get("linear_tcq8_64")?,
                ],
            ],
            prep_q_acts: get("prep_q_acts")?,
            linear_tc: [
                tc("linear_tc_bf16_8")?,
                tc("linear_tc_bf16_16")?,
                tc("linear_tc_bf16_32")?,
                tc("linear_tc_bf16_64")?,
                tc("linear_tc_wide_bf16_8")?,
                tc("linear_tc_wide_bf16_16")?,
            ],
            linear_tc_swiglu: [
                tc("linear_tc_swiglu_bf16_8")?,
                tc("linear_tc_swiglu_bf16_16")?,
                tc("linear_tc_swiglu_bf16_32")?,
                tc("linear_tc_swiglu_wide_bf16_8")?,
                tc("linear_tc_swiglu_wide_bf16_16")?,
            ],
            linear_tc_parts: [
                tc("linear_tc_parts_bf16_8")?,
                tc("linear_tc_parts_bf16_16")?,
                tc("linear_tc_parts_bf16_32")?,
            ],
            linear_tt: [
                tc("linear_tt_bf16_256x16")?,
                tc("linear_tt_bf16_128x32")?,
                tc("linear_tt_bf16_64x64")?,
                tc("linear_tt_bf16_128x64")?,
            ],
            linear_tt_phases: [
                tc("linear_tt_phases_bf16_256x16")?,
                tc("linear_tt_phases_bf16_128x32")?,
                tc("linear_tt_phases_bf16_64x64")?,
                tc("linear_tt_phases_bf16_128x64")?,
                tc("linear_tt_phases_bf16_128x48")?,
            ],
            linear_tt_parts: [
                tc("linear_tt_parts_bf16_128x32")?,
                tc("linear_tt_parts_bf16_128x64")?,
                tc("linear_tt_parts_bf16_128x48")?,
            ],
            linear_wg: match &hopper {
                Some(h) if terms == 1 => {
                    let f = |name: &str| h.load_function(name).map_err(|e| format!("kernel {name}: {e:?}"));
                    Some([
                        f("linear_wg_bf16_128x128_x1")?,
                        f("linear_wg_phases_bf16_128x64_x1")?,
                        f("linear_wg_phases_bf16_128x128_x1")?,
                        f("linear_wg_phases_parts_bf16_128x64_x1")?,
                        f("linear_wg_bf16_128x192_x1")?,
                    ])
                }
                _ => None,
            },
            split_activations: tc("split_activations")?,
            split_activations_steps: get("split_activations_steps")?,
            linear_merge_phases: get("linear_merge_phases")?,
            linear_merge_phases_parts: get("linear_merge_phases_parts")?,
            linear_merge_phases_swiglu: get("linear_merge_phases_swiglu")?,
            embed: [get("embed_f32")?, get("embed_bf16")?, get("embed_f16")?],
            embed_q: [get("embed_q2")?, get("embed_q4")?, get("embed_q8")?],
            embed_tcq: [get("embed_tcq4")?, get("embed_tcq8")?],
            widen: [get("widen_bf16")?, get("widen_f16")?],
            rms_norm: get("rms_norm")?,
            swiglu: get("swiglu")?,
            gather: get("gather_rows")?,
            add_into: get("add_into")?,
            qk_rope_store: [
                get("qk_rope_store_f32")?,
                get("qk_rope_store_bf16")?,
                get("qk_rope_store_q8")?,
                get("qk_rope_store_q4")?,
            ],
            attention: [
                [
                    get("attention_f32_128")?,
                    get("attention_f32_128_g2")?,
                    get("attention_f32_128_g4")?,
                    get("attention_f32_256")?,
                    get("attention_f32_512")?,
                ],
                [
                    get("attention_bf16_128")?,
                    get("attention_bf16_128_g2")?,
                    get("attention_bf16_128_g4")?,
                    get("attention_bf16_256")?,
                    get("attention_bf16_512")?,
                ],
                [
                    get("attention_q8_128")?,
                    get("attention_q8_128_g2")?,
                    get("attention_q8_128_g4")?,
                    get("attention_q8_256")?,
                    get("attention_q8_512")?,
                ],
                [
                    get("attention_q4_128")?,
                    get("attention_q4_128_g2")?,
                    get("attention_q4_128_g4")?,
                    get("attention_q4_256")?,
                    get("attention_q4_512")?,
                ],
            ],
            attention_merge: get("attention_merge")?,
            flash: [
                [get("flash_attention_32")?, get("flash_attention_32_full")?],
                [get("flash_attention_64")?, get("flash_attention_64_full")?],
                [get("flash_attention_128")?, get("flash_attention_128_full")?],
            ],
            flash_wg: match &hopper {
                Some(h) => Some(
                    h.load_function("flash_attention_128_wg")
                        .map_err(|e| format!("kernel flash_attention_128_wg: {e:?}"))?,
                ),
                None => None,
            },
            flash_merge: get("flash_merge")?,
            kv_move: [get("kv_move_4")?, get("kv_move_2")?],
            kv_copy: [get("kv_copy_4")?, get("kv_copy_2")?],
            gelu_tanh_mul: get("gelu_tanh_mul")?,
            scale_by: get("scale_by")?,
            add_to: get("add_to")?,
            add_parts: get("add_parts")?,
            concat_columns: get("concat_columns")?,
            add_rows_scaled: get("add_rows_scaled")?,
            rope_rows: get("rope_rows")?,
            logit_summaries: get("logit_summaries")?,
        };
        // The tiles take their stages as dynamic shared memory, past 48 KB only when allowed.
        for kernel in TcKernel::ALL {
            let Some((i, tile)) = kernel.tile() else { continue };
            let single = if tile.phased { &f.linear_tt_phases[i] } else { &f.linear_tt[i] };
            let parts = PARTS_TILES.iter().position(|k| *k == kernel).map(|p| &f.linear_tt_parts[p]);
            for func in std::iter::once(single).chain(parts) {
                use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX;
                let bytes = tile.smem_bytes(terms);
                func.set_attribute(MAX, bytes as i32)
                    .map_err(|e| format!("shared memory for {kernel:?} ({bytes} bytes): {e:?}"))?;
            }
        }
        let flash_funcs = f
            .flash
            .iter()
            .zip(flash::TIERS)
            .flat_map(|(funcs, max_hd)| funcs.iter().map(move |f| (f, max_hd)));
        for (func, max_hd) in flash_funcs.chain(f.flash_wg.iter().map(|f| (f, 128))) {
            use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX;
            let bytes = flash::most_smem_bytes(max_hd);
            func.set_attribute(MAX, bytes as i32)
                .map_err(|e| format!("shared memory for the tensor-core attention ({bytes} bytes): {e:?}"))?;
        }
        for (func, bytes) in f.linear_wg.iter().flatten().zip(hopper::SMEM_BYTES) {
            use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX;
            func.set_attribute(MAX, bytes as i32)
                .map_err(|e| format!("shared memory for the wgmma matmul ({bytes} bytes): {e:?}"))?;
        }
        let device = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        tracing::info!("CUDA backend on {device}");
        Ok(Cuda {
            stream,
            f,
            activations,
            device,
            blas: OnceLock::new(),
            staging: std::sync::Mutex::new(None),
            scratch: scratch::Pools::default(),
            kv_pools: Default::default(),
        })
    }

    /// `x` in host memory: copied into page-locked staging memory (a pageable destination
    /// makes the driver stage it in small pieces, at a fraction of the link's speed), then
    /// out into a new vector on the host's threads. Waits for the stream.
    fn to_host(&self, x: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.first_to_host(x, x.len())
    }

    /// The first `n` values of `x` in host memory ([`Cuda::to_host`]).
    fn first_to_host(&self, x: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        use rayon::prelude::*;
        const PIECE: usize = 1 << 16;
        let n = n.min(x.len());
        let x = x.slice(..n);
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let buf = match &mut *staging {
            Some(buf) if buf.len() >= n => buf,
            slot => {
                // The old buffer goes before a larger one comes.
                *slot = None;
                // SAFETY: every element read below is written by the copy before it.
                let buf = unsafe { self.stream.context().alloc_pinned_with_flags::<f32>(n.max(1), 0) };
                slot.insert(buf.map_err(driver("page-locked host memory for downloads"))?)
            }
        };
        // Event tracking is off (one stream), so the buffer's own event says nothing: the
        // copy takes exactly n elements and the stream is waited for by hand.
        let host = &mut buf.as_mut_slice().map_err(driver("download"))?[..n];
        self.stream.memcpy_dtoh(&x, host).map_err(driver("download"))?;
        self.stream.synchronize().map_err(driver("download"))?;
        let host = &*host;
        let mut out: Vec<f32> = Vec::with_capacity(n);
        out.spare_capacity_mut()[..n].par_chunks_mut(PIECE).zip(host.par_chunks(PIECE)).for_each(|(d, s)| {
            d.iter_mut().zip(s).for_each(|(d, &v)| {
                d.write(v);
            })
        });
        // SAFETY: the loop above wrote all n elements.
        unsafe { out.set_len(n) };
        Ok(out)
    }

    /// The GPU's name, as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for every queued kernel (for timing).
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    /// The GPU time, in milliseconds, of the work `queue` puts on the stream (events
    /// recorded around it; the host's launch time left out). Waits for the stream.
    pub fn gpu_time_ms(&self, queue: impl FnOnce() -> Result<()>) -> Result<f64> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let start = self.stream.record_event(Some(CU_EVENT_DEFAULT)).map_err(driver("event"))?;
        queue()?;
        let end = self.stream.record_event(Some(CU_EVENT_DEFAULT)).map_err(driver("event"))?;
        Ok(start.elapsed_ms(&end).map_err(driver("event"))? as f64)
    }

    fn upload_as<T: cudarc::driver::DeviceRepr>(&self, x: &[T], what: &str) -> Result<CudaSlice<T>> {
        if x.is_empty() {
            // SAFETY: one element, never read.
            return unsafe { self.stream.alloc::<T>(1) }.map_err(driver(what));
        }
        self.stream.clone_htod(x).map_err(driver(what))
    }
}

/// The RoPE table on the device.
pub struct CudaRope {
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

impl Kernels for Cuda {
    type Act = CudaSlice<f32>;
    type Mat = CudaMat;
    type Vec = CudaSlice<f32>;
    type Rope = CudaRope;
    type Batch = CudaBatch;
    type Recordings = CudaGraphs;

    fn backend(&self) -> Backend {
        Backend::Cuda
    }

    fn activations(&self) -> Activations {
        self.activations
    }

    fn activations_for(&self, w: &Weight) -> Activations {
        match self.activations == Activations::Bf16 && quant_tensor_cores(w) {
            true => Activations::Bf16,
            false => self.activations.for_weight(w),
        }
    }

    fn matrix(&self, w: &Weight) -> Result<CudaMat> {
        let quant = match w.quant() {
            Some(q) => Some(CudaQuant {
                scales: self.upload_as(&q.scales.to_f32(), "quantization scales")?,
                biases: match &q.biases {
                    Some(b) => Some(self.upload_as(&b.to_f32(), "quantization biases")?),
                    None => None,
                },
                bits: q.bits,
                group: q.group,
                tensor_cores: match self.activations_for(w) == Activations::Bf16 {
                    true => Some(self.upload_as(&group_words(q), "quantization group words")?),
                    false => None,
                },
                host: w.clone(),
            }),
            None => None,
        };
        let copy_err = |e| {
            Error::Backend(format!(
                "cannot copy a {} x {} {} weight to the GPU: {e:?}",
                w.rows,
                w.cols,
                w.dtype.name()
            ))
        };
        let buf = match quant.as_ref().filter(|q| q.tensor_cores.is_some()) {
            Some(q) => self.stream.clone_htod(&repack_codes(w.bytes(), w.cols, q.bits)).map_err(copy_err)?,
            None => self.stream.clone_htod(w.bytes()).map_err(copy_err)?,
        };
        Ok(CudaMat { buf, dtype: w.dtype, rows: w.rows, cols: w.cols, quant })
    }

    fn vector(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        self.upload_as(v, "vector upload")
    }

    fn rope_table(&self, table: RopeTable) -> Result<CudaRope> {
        let (cos, sin) = table.cos_sin();
        Ok(CudaRope { cos: self.upload_as(cos, "RoPE table")?, sin: self.upload_as(sin, "RoPE table")? })
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
        let pool = self
            .kv_pools
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((n_layers, stride, kv_index(kv)))
            .or_insert_with(|| {
                let bytes = CudaKv::block_bytes(n_layers, stride, kv);
                Arc::new(pool::BlockPool::new(self.stream.clone(), bytes))
            })
            .clone();
        Box::new(CudaKv::new(self.clone(), pool, n_layers, stride, kv))
    }

    fn alloc(&self, len: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: every op writes its whole output before anything reads it.
        unsafe { self.stream.alloc::<f32>(len.max(1)) }.map_err(driver("out of GPU memory for activations"))
    }

    fn upload(&self, x: &[f32]) -> Result<CudaSlice<f32>> {
        self.upload_as(x, "upload")
    }

    fn zeros(&self, len: usize) -> Result<CudaSlice<f32>> {
        // An allocation and a memset on the stream: both recordable into a CUDA graph.
        self.stream.alloc_zeros::<f32>(len.max(1)).map_err(driver("out of GPU memory for activations"))
    }

    fn download(&self, x: CudaSlice<f32>) -> Result<Vec<f32>> {
        self.to_host(&x)
    }

    fn logit_summaries(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        mtp_kernels::check_summary_lens(logits.len(), out.len(), rows, vocab)?;
        let s = &self.stream;
        let (lp, op, v) = (ptr(logits, s), ptr(out, s), vocab as i32);
        launch!(self, &self.f.logit_summaries, (rows as u32, 1), 1024, "logit_summaries", [lp, v, op])
    }

    fn batch(&self, slots: &[Slot], tokens: &[u32], caches: &mut [&mut RowCache]) -> Result<CudaBatch> {
        if tokens.len() != slots.len() {
            return Err(Error::Backend(format!("{} token ids for {} slots", tokens.len(), slots.len())));
        }
        let maps = open_windows(slots, caches)?;
        let mut kv = None;
        let foreign = |r: usize| Error::Request {
            request: format!("row {r}"),
            msg: "its KV cache is not on the GPU (made by a model on another backend)".into(),
        };
        let (mut stores, mut ring_stores) = (Vec::with_capacity(caches.len()), Vec::new());
        for (r, c) in caches.iter().enumerate() {
            let store = c.store().as_any().downcast_ref::<CudaKv>().ok_or_else(|| foreign(r))?;
            if *kv.get_or_insert(store.dtype()) != store.dtype() {
                return Err(Error::Backend("rows of one forward hold K/V in different dtypes".into()));
            }
            stores.push((store, maps[r]));
            if let (Some(ring), Some(map)) = (c.ring_store(), c.ring_map()) {
                let ring = ring.as_any().downcast_ref::<CudaKv>().ok_or_else(|| foreign(r))?;
                ring_stores.push((ring, map));
            }
        }
        let (rows, ring_rows, tables) = self.row_layouts(&stores, &ring_stores)?;
        // (row, position, RoPE position, first key: 0, the window is the kernel's argument).
        let toks: Vec<i32> =
            slots.iter().flat_map(|s| [s.row as i32, s.pos as i32, s.rope_pos as i32, 0]).collect();
        let ring_rows = if !caches.is_empty() && ring_stores.len() == caches.len() {
            Some(self.upload_as(&ring_rows, "batch layout")?)
        } else {
            None
        };
        let splits = if negative_control::split_attention() { (16 / caches.len().max(1)).max(1) } else { 1 };
        let token_rows: Vec<usize> = slots.iter().map(|s| s.row).collect();
        let tiles = self.flash_tiles(&token_rows)?;
        // (The split control moves the chunks' anchor: a shared tile's segments would not be
        // its rows'. A row alone shares with nobody: its table is not copied.)
        let held = || -> Vec<flash::HeldBlocks> {
            stores
                .iter()
                .map(|(store, map)| flash::HeldBlocks {
                    pool: store.base(),
                    table: store.table().collect(),
                    committed: map.committed,
                    ring: map.ring != 0,
                })
                .collect()
        };
        let grouped = (splits == 1 && stores.len() > 1).then(|| flash::share(&token_rows, &held())).flatten();
        let shared = match grouped {
            Some((shared, own, segments)) => Some(flash::SharedTiles {
                shared: self.tiles_on_device(shared, "shared tiles")?,
                own: self.tiles_on_device(own, "batch layout")?,
                segments,
            }),
            None => None,
        };
        Ok(CudaBatch {
            toks: self.upload_as(&toks, "batch layout")?,
            rows: self.upload_as(&rows, "batch layout")?,
            ring_rows,
            _tables: tables,
            tokens: self.upload_as(tokens, "tokens")?,
            m: slots.len(),
            most_keys: slots.iter().map(|s| s.pos + 1).max().unwrap_or(0),
            kv: kv.unwrap_or(KvDtype::F32),
            splits: splits as i32,
            tiles,
            shared,
        })
    }

    fn embed(&self, table: &CudaMat, tokens: &[u32], out: &mut CudaSlice<f32>) -> Result<()> {
        let toks = self.upload_as(tokens, "tokens")?;
        self.embed_ids(table, &toks, tokens.len(), out)
    }

    fn embed_batch(&self, table: &CudaMat, batch: &CudaBatch, out: &mut CudaSlice<f32>) -> Result<()> {
        self.embed_ids(table, &batch.tokens, batch.m, out)
    }

    fn run_recorded(
        &self,
        recordings: &CudaGraphs,
        batch: CudaBatch,
        out_lens: &[usize],
        fetch: &[usize],
        body: &mut ForwardBody<'_, Cuda>,
    ) -> Result<Vec<Vec<f32>>> {
        recordings.run(self, batch, out_lens, fetch, body)
    }

    fn recorded_shape(&self, tokens: usize, rows: usize) -> (usize, usize) {
        graphs::recorded_shape(tokens, rows)
    }

    fn token_group(&self) -> usize {
        // Every tensor-core matmul takes tokens 8 at a time (mma m16n8k16's n).
        8
    }

    fn verify_token_cost(&self) -> f64 {
        // A decode step streams the weights; tokens within a group ride along (the
        // figure adaptive k used for every backend before the CPU's was measured).
        0.2
    }

    fn recordings(&self, heads: Heads) -> CudaGraphs {
        CudaGraphs::for_heads(heads)
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        self.stream.context().bind_to_thread().ok()?;
        cudarc::driver::result::mem_get_info().ok()
    }

    fn one_time_forwards(&self, recordings: &CudaGraphs) -> u64 {
        recordings.one_time_forwards()
    }

    fn linear(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        w: &CudaMat,
        bias: Option<&CudaSlice<f32>>,
        out: &mut CudaSlice<f32>,
        mode: Out,
    ) -> Result<()> {
        let s = &self.stream;
        let acc = (mode == Out::Add) as i32;
        let bp = bias.map_or(0, |b| ptr(b, s));
        if negative_control::stock_matmul() {
            let mut y = self.alloc(m * w.rows)?;
            self.stock_linear(x, m, w, &mut y)?;
            let (yp, op, n, mi) = (ptr(&y, s), ptr(out, s), w.rows as i32, m as i32);
            return launch!(self, &self.f.add_into, (m as u32, 1), 256, "add", [op, yp, bp, mi, n, acc]);
        }
        if tensor_core_path(w) {
            return self.linear_tc_with(self.pick(m, w.rows, w.cols), x, m, w, bias, out, mode);
        }
        let (xp, wp, op) = (ptr(x, s), ptr(&w.buf, s), ptr(out, s));
        let (mi, k, n) = (m as i32, w.cols as i32, w.rows as i32);
        let grid = w.rows.div_ceil(LINEAR_COLS_PER_BLOCK) as u32;
        // Rows per pass over the weights; every variant sums each output in the same order.
        let rows_per_pass = match m {
            0..=4 => 0,
            5..=8 => 1,
            _ => 2,
        };
        if let Some(q) = &w.quant {
            if q.tensor_cores.is_some() {
                return self.linear_tcq(x, m, &[(w, bias)], &mut [out], mode);
            }
            let (sc, bi, g) = (ptr(&q.scales, s), q.biases.as_ref().map_or(0, |b| ptr(b, s)), q.group as i32);
            let f = &self.f.linear_q[bits_index(q.bits)][rows_per_pass];
            return launch!(
                self,
                f,
                (grid, 1),
                LINEAR_THREADS,
                "linear",
                [xp, mi, k, wp, sc, bi, g, n, bp, op, acc]
            );
        }
        let f = &self.f.linear[weight_index(w.dtype)][rows_per_pass];
        launch!(self, f, (grid, 1), LINEAR_THREADS, "linear", [xp, mi, k, wp, n, bp, op, acc])
    }

    fn linear_parts(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        parts: &[(&CudaMat, Option<&CudaSlice<f32>>)],
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<()> {
        // Tensor cores over the same K: one launch for up to 3 parts (a phase-split tile
        // where they together take one, else up to 32 tokens the pass kernel); past 32
        // tokens otherwise a tile launch each over activations split once. Else a launch each.
        let k = parts.first().map_or(0, |(w, _)| w.cols);
        if m > 0 && parts.len() == outs.len() && tcq_stackable(parts) && !negative_control::stock_matmul() {
            return self.linear_tcq(x, m, parts, outs, Out::Write);
        }
        if let Some(pass) = self.parts_pass(m, parts).filter(|_| parts.len() == outs.len()) {
            let s = &self.stream;
            let mut p = TcParts { parts: parts.len() as i32, ..TcParts::default() };
            let mut blocks = 0;
            for (i, ((w, bias), out)) in parts.iter().zip(outs.iter()).enumerate() {
                p.w[i] = ptr(&w.buf, s);
                p.bias[i] = bias.map_or(0, |b| ptr(b, s));
                p.out[i] = ptr(&**out, s);
                p.n[i] = w.rows as i32;
                p.first_block[i] = blocks as i32;
                blocks += w.rows.div_ceil(LINEAR_TC_COLS_PER_BLOCK);
            }
            let (xp, mi, ki) = (ptr(x, s), m as i32, k as i32);
            let f = &self.f.linear_tc_parts[pass];
            return launch!(self, f, (blocks as u32, 1), LINEAR_THREADS, "linear", [xp, mi, ki, p]);
        }
        let tensor_cores = parts.len() == outs.len()
            && !negative_control::stock_matmul()
            && parts.iter().all(|(w, _)| tensor_core_path(w) && w.cols == k);
        let stackable =
            tensor_cores && (1..=3).contains(&parts.len()) && parts.iter().all(|(w, _)| w.rows > 0);
        if m == 0 || !tensor_cores || (m <= 32 && !stackable) {
            return linear_each(self, x, m, parts, outs);
        }
        let kernel = self.pick(m, parts.iter().map(|(w, _)| w.rows).sum(), k);
        if stackable && PARTS_TILES.contains(&kernel) {
            let split = self.split_activations(x, m, k)?;
            return self.linear_tile_parts(kernel, &split, m, parts, outs);
        }
        // Where each part would take the 64-token wgmma phases and some would stack
        // (`hopper::stacks_64`), one launch for all.
        if stackable
            && parts.iter().all(|(w, _)| self.pick(m, w.rows, k) == TcKernel::WgmmaPhases128x64)
            && parts.iter().any(|(w, _)| hopper::stacks_64(w.rows, m))
        {
            let steps = self.split_steps(x, m, k)?;
            return self.linear_wgmma_parts(&steps, m, parts, outs);
        }
        // Past 32 tokens (fewer took the pass kernel or a tile above) every width takes a
        // tile kernel or wgmma, each kind's split made once.
        let (mut split, mut steps) = (None, None);
        for ((w, bias), out) in parts.iter().zip(outs.iter_mut()) {
            if w.rows == 0 {
                continue;
            }
            let kernel = self.pick(m, w.rows, k);
            if kernel.is_wgmma() {
                let steps = match &steps {
                    Some(s) => s,
                    None => steps.insert(self.split_steps(x, m, k)?),
                };
                self.linear_wgmma(kernel, steps, m, w, *bias, out, Out::Write)?;
            } else {
                let split = match &split {
                    Some(s) => s,
                    None => split.insert(self.split_activations(x, m, k)?),
                };
                self.linear_tile(kernel, split, m, w, *bias, out, Out::Write)?;
            }
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
        out_width: usize,
        col: usize,
    ) -> Result<()> {
        let s = &self.stream;
        let n = w.len();
        let rows = (x.len() / n) as u32;
        let (xp, wp, op, ni, ow, c) =
            (ptr(x, s), ptr(w, s), ptr(out, s), n as i32, out_width as i32, col as i32);
        launch!(self, &self.f.rms_norm, (rows, 1), 256, "rms_norm", [xp, wp, ni, eps, op, ow, c])
    }

    /// One launch (`linear_tc_swiglu`) where [`Kernels::linear_parts`] would take the pass
    /// kernel for the pair (bf16 weights of one shape, up to 32 tokens, no tile picked):
    /// decode and small verifies. Elsewhere `linear_parts` then `swiglu`.
    fn linear_swiglu(
        &self,
        x: &CudaSlice<f32>,
        m: usize,
        gate: (&CudaMat, Option<&CudaSlice<f32>>),
        up: (&CudaMat, Option<&CudaSlice<f32>>),
        gate_out: &mut CudaSlice<f32>,
        up_out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let ((gw, gb), (uw, ub)) = (gate, up);
        let (n, k) = (gw.rows, gw.cols);
        if let Some(kernel) = self.phased_wgmma_pair(m, gw, uw) {
            // Past 32 tokens on a Hopper: the two phase launches (one where they stack, as
            // linear_parts would), then their merges and SwiGLU in one launch.
            let steps = self.split_steps(x, m, k)?;
            if kernel == TcKernel::WgmmaPhases128x64 && hopper::stacks_64(n, m) {
                let (partials, at) = self.wgmma_parts_partials(&steps, m, &[gw, uw])?;
                self.merge_phases_swiglu(m, n, (at[0], gb), (at[1], ub), gate_out)?;
                drop(partials);
            } else {
                let (gp, upp) = (
                    self.wgmma_partials(kernel, &steps, m, gw)?,
                    self.wgmma_partials(kernel, &steps, m, uw)?,
                );
                let s = &self.stream;
                self.merge_phases_swiglu(m, n, (ptr(&gp, s), gb), (ptr(&upp, s), ub), gate_out)?;
            }
            return Ok(());
        }
        let pass = self.parts_pass(m, &[gate, up]).filter(|_| (uw.rows, uw.cols) == (n, k));
        let Some(pass) = pass else {
            self.linear_parts(x, m, &[gate, up], &mut [&mut *gate_out, &mut *up_out])?;
            return self.swiglu(gate_out, up_out);
        };
        let s = &self.stream;
        let (xp, gp, upp, op) = (ptr(x, s), ptr(&gw.buf, s), ptr(&uw.buf, s), ptr(gate_out, s));
        let (gbp, ubp) = (gb.map_or(0, |b| ptr(b, s)), ub.map_or(0, |b| ptr(b, s)));
        let (mi, ki, ni) = (m as i32, k as i32, n as i32);
        // A block's 16-column groups each take 8 gate and 8 up columns.
        let groups = n.div_ceil(LINEAR_TC_COLS_PER_BLOCK / 2);
        let (f, blocks) = match pass {
            0 | 1 if wide_pass(m, groups) => {
                (&self.f.linear_tc_swiglu[3 + pass], groups.div_ceil(TcKernel::Pass8Wide.groups_per_block()))
            }
            _ => (&self.f.linear_tc_swiglu[pass], groups),
        };
        launch!(
            self,
            f,
            (blocks as u32, 1),
            LINEAR_THREADS,
            "linear_swiglu",
            [xp, mi, ki, gp, upp, ni, gbp, ubp, op]
        )
    }

    fn swiglu(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>) -> Result<()> {
        let s = &self.stream;
        let n = gate.len().min(up.len()) as i64;
        let (g, u) = (ptr(gate, s), ptr(up, s));
        launch!(self, &self.f.swiglu, ((n as usize).div_ceil(256) as u32, 1), 256, "swiglu", [g, u, n])
    }

    fn qk_rope_store(
        &self,
        q: &mut CudaSlice<f32>,
        kv: Option<(&mut CudaSlice<f32>, &CudaSlice<f32>)>,
        norms: Option<(&CudaSlice<f32>, &CudaSlice<f32>, f32)>,
        rope: &CudaRope,
        batch: &CudaBatch,
        _caches: &mut [&mut RowCache],
        plane: Plane,
        heads: Heads,
    ) -> Result<()> {
        check_heads(heads)?;
        check_gpu_kv(batch.kv, heads.head_dim, "CUDA")?;
        let s = &self.stream;
        let (rows, li) = self.plane_rows(batch, plane)?;
        let (qn, kn, eps) = norms.map_or((0, 0, 0.0), |(a, b, e)| (ptr(a, s), ptr(b, s), e));
        let blocks = if kv.is_some() { heads.heads + 2 * heads.kv_heads } else { heads.heads };
        let (kp, vp) = kv.map_or((0, 0), |(k, v)| (ptr(k, s), ptr(v, s)));
        let qp = ptr(q, s);
        let (cp, sp, tp, rp) = (ptr(&rope.cos, s), ptr(&rope.sin, s), ptr(&batch.toks, s), ptr(rows, s));
        let (nh, nkv, hd) = (heads.heads as i32, heads.kv_heads as i32, heads.head_dim as i32);
        let grid = (batch.m as u32, blocks as u32);
        launch!(
            self,
            &self.f.qk_rope_store[kv_index(batch.kv)],
            grid,
            128,
            "qk_rope_store",
            [qp, kp, vp, qn, kn, eps, cp, sp, tp, rp, li, nh, nkv, hd]
        )
    }

    fn attention(
        &self,
        q: &CudaSlice<f32>,
        batch: &CudaBatch,
        _caches: &[&mut RowCache],
        plane: Plane,
        heads: Heads,
        scale: f32,
        window: Option<usize>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_heads(heads)?;
        let (rows, li) = self.plane_rows(batch, plane)?;
        let win = window.map_or(0, |w| w as i32);
        let keys =
            AttentionKeys { tokens: batch.m, most: batch.most_keys, splits: batch.splits, window: win };
        // Shared blocks are the main store's, read in full (no window).
        let shared = batch.shared.as_ref().filter(|_| win == 0 && matches!(plane, Plane::Main(_)));
        self.launch_attention(
            q,
            out,
            &batch.toks,
            rows,
            &batch.tiles,
            shared,
            li,
            heads,
            scale,
            batch.kv,
            keys,
        )
    }

    fn gather(&self, x: &CudaSlice<f32>, width: usize, rows: &[usize]) -> Result<CudaSlice<f32>> {
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let idx = self.upload_as(&idx, "row selection")?;
        let out = self.alloc(rows.len() * width)?;
        let s = &self.stream;
        let (xp, ip, w, op) = (ptr(x, s), ptr(&idx, s), width as i32, ptr(&out, s));
        launch!(self, &self.f.gather, (rows.len() as u32, 1), 256, "gather", [xp, ip, w, op])?;
        Ok(out)
    }

    fn gelu_tanh_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>) -> Result<()> {
        let n = gate.len().min(up.len());
        let (g, u, n64) = (ptr(gate, &self.stream), ptr(up, &self.stream), n as i64);
        launch!(self, &self.f.gelu_tanh_mul, grid256(n), 256, "gelu", [g, u, n64])
    }

    fn scale(&self, x: &mut CudaSlice<f32>, by: f32) -> Result<()> {
        let (xp, n64) = (ptr(x, &self.stream), x.len() as i64);
        launch!(self, &self.f.scale_by, grid256(x.len()), 256, "scale", [xp, by, n64])
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<()> {
        let n = x.len().min(y.len());
        let (xp, yp, n64) = (ptr(x, &self.stream), ptr(y, &self.stream), n as i64);
        launch!(self, &self.f.add_to, grid256(n), 256, "add", [xp, yp, n64])
    }

    fn add_parts(
        &self,
        x: &mut CudaSlice<f32>,
        parts: &CudaSlice<f32>,
        n: usize,
        reversed: bool,
    ) -> Result<()> {
        let len = x.len();
        if parts.len() != n * len {
            return Err(Error::Backend(format!("add_parts: {n} parts of {len} in {} values", parts.len())));
        }
        let (xp, pp, len64, n32, rev) =
            (ptr(x, &self.stream), ptr(parts, &self.stream), len as i64, n as i32, reversed as i32);
        launch!(self, &self.f.add_parts, grid256(len), 256, "add_parts", [xp, pp, len64, n32, rev])
    }

    fn concat_columns(
        &self,
        parts: &CudaSlice<f32>,
        n: usize,
        width: usize,
        m: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let total = n * m * width;
        if parts.len() < total || out.len() < total {
            return Err(Error::Backend(format!(
                "concat_columns: {n} parts of {m} x {width} in {} values into {}",
                parts.len(),
                out.len()
            )));
        }
        let (op, pp, n32, w64, m64) =
            (ptr(out, &self.stream), ptr(parts, &self.stream), n as i32, width as i64, m as i64);
        launch!(self, &self.f.concat_columns, grid256(total), 256, "concat_columns", [op, pp, n32, w64, m64])
    }

    fn add_rows_scaled(
        &self,
        out: &mut CudaSlice<f32>,
        width: usize,
        src: &CudaSlice<f32>,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()> {
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let (idx, w) = (self.upload_as(&idx, "expert rows")?, self.upload_as(weights, "expert weights")?);
        let s = &self.stream;
        let (op, sp, ip, wp, wd) = (ptr(out, s), ptr(src, s), ptr(&idx, s), ptr(&w, s), width as i32);
        launch!(
            self,
            &self.f.add_rows_scaled,
            (rows.len() as u32, 1),
            256,
            "add_rows_scaled",
            [op, sp, ip, wp, wd]
        )
    }
}

/// Blocks of 256 threads covering `n` values.
fn grid256(n: usize) -> (u32, u32) {
    (n.div_ceil(256) as u32, 1)
}

fn check_heads(h: Heads) -> Result<()> {
    check_gpu_heads(h, "CUDA")
}
