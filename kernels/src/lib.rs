//! The backend seam. The model, the MTP head, the verifier, rollback and the engine exist
//! once; a backend is the set of kernels behind [`Kernels`] and the place where its
//! buffers live. [`cpu::Cpu`] is the reference (f32 activations and KV in host memory, over
//! the row-invariant kernels of [`ops`]); `mtp_cuda::Cuda` runs the same forward on an
//! NVIDIA GPU, `mtp_metal::Metal` on an Apple GPU or on its CPU emulator. Each GPU backend
//! is its own crate over this one; `mtp_model::registry` lists the backends a build has.
//!
//! Why a trait over buffers rather than candle tensors with custom ops: every op of the
//! forward must be a row-invariant kernel of ours, the KV cache has its own window and
//! compaction contract, and the forward needs no autograd, broadcasting or layout logic.
//! A handful of associated types (activations, weights, vectors, the RoPE table, one
//! forward's batch layout) keeps each backend's buffers its own and the forward generic.

pub mod collective;
pub mod cpu;
pub mod negative_control;
pub mod ops;

use std::sync::Arc;

use mtp_cache::{KvStore, RowCache, SlotMap};

use mtp_base::error::{Error, Result};
use mtp_base::logits::LogitSummary;
use mtp_base::weights::{Weight, WeightDtype};

use crate::ops::RopeTable;

/// Where a model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    #[default]
    Cpu,
    Cuda,
    Metal,
    /// The Metal kernels on the CPU, through the emulator that runs them in CI.
    MetalEmulated,
}

impl std::str::FromStr for Backend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Backend> {
        match s {
            "cpu" => Ok(Backend::Cpu),
            "cuda" => Ok(Backend::Cuda),
            "metal" => Ok(Backend::Metal),
            "metal-emulated" => Ok(Backend::MetalEmulated),
            other => {
                Err(Error::Backend(format!("unknown backend `{other}` (cpu, cuda, metal, metal-emulated)")))
            }
        }
    }
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Metal => "metal",
            Backend::MetalEmulated => "metal-emulated",
        }
    }
}

/// How K/V are stored. `Auto`, on every backend: bf16 for 16-bit checkpoints (half the
/// memory; logits move by about 1e-2) and f32 for f32 ones.
/// `Q8` / `Q4` (`--kv-bits 8|4`, every backend): each position's K or V of one KV head
/// quantized as one group with an f32 scale and bias (`mtp_cache::QuantLayout`, one format
/// on every backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    #[default]
    Auto,
    F32,
    Bf16,
    Q8,
    Q4,
}

impl std::str::FromStr for KvDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<KvDtype> {
        match s {
            "auto" => Ok(KvDtype::Auto),
            "f32" => Ok(KvDtype::F32),
            "bf16" => Ok(KvDtype::Bf16),
            "q8" => Ok(KvDtype::Q8),
            "q4" => Ok(KvDtype::Q4),
            other => Err(Error::Backend(format!("unknown KV dtype `{other}` (auto, f32, bf16, q8, q4)"))),
        }
    }
}

impl KvDtype {
    /// Bytes per stored value of a dense dtype (`Auto` counts as f32; quantized dtypes have
    /// no per-value size: see [`KvDtype::slot_bytes`]).
    pub fn size(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::Auto | KvDtype::F32 | KvDtype::Q8 | KvDtype::Q4 => 4,
        }
    }

    /// Bits per value of a quantized dtype.
    pub fn bits(self) -> Option<usize> {
        match self {
            KvDtype::Q8 => Some(8),
            KvDtype::Q4 => Some(4),
            _ => None,
        }
    }

    /// Bytes of one position's K (or V) for one layer.
    pub fn slot_bytes(self, kv_heads: usize, head_dim: usize) -> usize {
        match self.bits() {
            Some(bits) => mtp_cache::QuantLayout { heads: kv_heads, head_dim, bits }.slot_bytes(),
            None => kv_heads * head_dim * self.size(),
        }
    }

    /// Bytes of the unit a GPU store addresses (and moves) K/V in: the element of a dense
    /// dtype, a 32-bit word of a quantized one.
    pub fn unit_bytes(self) -> usize {
        match self.bits() {
            Some(_) => 4,
            None => self.size(),
        }
    }

    /// Units of one position's K (or V) for one layer in a GPU store (a quantized slot is
    /// whole words where [`check_gpu_kv`] admits its heads).
    pub fn slot_units(self, kv_heads: usize, head_dim: usize) -> usize {
        self.slot_bytes(kv_heads, head_dim).div_ceil(self.unit_bytes())
    }
}

/// The precision of activations at the input of a matmul. `Auto` is each backend's
/// default: on CUDA, `Bf16`; on the CPU, `Bf16` where it has bf16 dot products
/// (AVX512-BF16), else `F32`; on Metal, `F32`. `Bf16` rounds each activation to
/// bf16 (nearest even) where it meets a bf16 weight, one tensor-core MMA a product with f32
/// accumulation, as transformers, vLLM and SGLang compute bf16 models. `F32` keeps f32
/// activations (CUDA splits each exactly into three bf16 terms: three MMAs a product).
/// f32 and f16 weights take f32 activations in every mode, and so do quantized weights
/// except MLX 4-bit ones with bf16 scales and biases, which follow the mode on the CPU
/// ([`ops::q4_bf16`]) and CUDA, and 8-bit ones with bf16 scales, which follow it on CUDA's
/// tensor cores ([`Kernels::activations_for`]). Within a mode every
/// guarantee holds for every M (batched == alone, speculative == plain, decode ==
/// prefill); the two modes give different bits, as two backends do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Activations {
    #[default]
    Auto,
    F32,
    Bf16,
}

impl std::str::FromStr for Activations {
    type Err = Error;
    fn from_str(s: &str) -> Result<Activations> {
        Activations::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| Error::Backend(format!("unknown activation precision `{s}` (auto, f32, bf16)")))
    }
}

impl Activations {
    const ALL: [Activations; 3] = [Activations::Auto, Activations::F32, Activations::Bf16];

    pub fn name(self) -> &'static str {
        match self {
            Activations::Auto => "auto",
            Activations::F32 => "f32",
            Activations::Bf16 => "bf16",
        }
    }

    /// What a kernel set in mode `self` (resolved) does where it meets `w`: `Bf16` for
    /// unquantized bf16 weights and MLX 4-bit weights with bf16 scales and biases in groups
    /// of 32, 64 or 128 ([`ops::q4_bf16::takes`]).
    pub fn for_weight(self, w: &Weight) -> Activations {
        let plain = w.dtype == WeightDtype::Bf16 && w.quant().is_none();
        match self {
            Activations::Bf16 if plain || ops::q4_bf16::takes(w) => Activations::Bf16,
            _ => Activations::F32,
        }
    }

    /// Refuses `Bf16`, by name, on a backend that computes activations in f32 only (Metal),
    /// where `Auto` means `F32`.
    pub fn f32_only(self, backend: Backend) -> Result<()> {
        if self != Activations::Bf16 {
            return Ok(());
        }
        Err(Error::Backend(format!(
            "--activations bf16: the {} backend computes matmul activations in f32 only \
             (bf16 activations are CUDA's and the CPU's; use --activations auto or f32)",
            backend.name()
        )))
    }
}

/// How a model computes on its backend: the K/V format and the matmuls' activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Numerics {
    pub kv: KvDtype,
    pub activations: Activations,
}

impl From<KvDtype> for Numerics {
    fn from(kv: KvDtype) -> Numerics {
        Numerics { kv, activations: Activations::Auto }
    }
}

/// Where each token of a batched forward sits: its row and logical position.
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    pub row: usize,
    pub pos: usize,
    /// Position used for RoPE: `pos`, unless a test turns on the physical-slot fault.
    pub rope_pos: usize,
}

/// Attention shape of a layer.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Whether a matmul overwrites its output or adds to it (a residual connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    Write,
    Add,
}

/// What a backend without the tensor-parallel kernels answers.
fn no_tensor_parallel(backend: Backend) -> Error {
    Error::Backend(format!("tensor parallelism is not built for the {} backend", backend.name()))
}

/// A row-invariant kernel set and the buffers it works on. Every op treats each token
/// (row of an activation matrix) on its own, with a reduction order that depends only on
/// the reduced length, never on how many tokens or rows share the call.
pub trait Kernels: Send + Sync + Sized + 'static {
    /// A row-major f32 activation matrix.
    type Act: Send + Sync;
    /// A weight matrix (`rows x cols`, HF `Linear` layout) in its checkpoint dtype.
    type Mat: Send + Sync;
    /// A small f32 vector: norm weights, biases.
    type Vec: Send + Sync;
    /// The RoPE cos/sin table.
    type Rope: Send + Sync;
    /// One forward's token slots and row slot maps, prepared once for every layer.
    type Batch;
    /// A model's recorded forwards, replayed by [`Kernels::run_recorded`] (CUDA graphs);
    /// `()` where launching each kernel costs little.
    type Recordings: Default + Send + Sync;

    fn backend(&self) -> Backend;
    /// How this kernel set's matmuls take activations where they meet bf16 weights
    /// (resolved: `F32` or `Bf16`).
    fn activations(&self) -> Activations {
        Activations::F32
    }
    /// How this kernel set's matmuls take activations where they meet `w`: by default
    /// [`Activations::for_weight`] (bf16 for bf16 weights and MLX 4-bit ones with bf16
    /// scales); CUDA adds the 8-bit weights its tensor cores take.
    fn activations_for(&self, w: &Weight) -> Activations {
        self.activations().for_weight(w)
    }

    fn matrix(&self, w: &Weight) -> Result<Self::Mat>;
    fn vector(&self, v: &[f32]) -> Result<Self::Vec>;
    fn rope_table(&self, table: RopeTable) -> Result<Self::Rope>;
    /// The K/V dtype this backend uses for `kv` with weights of dtype `weights` (never
    /// `Auto`), or an error when it cannot store that dtype.
    fn kv_dtype(&self, kv: KvDtype, weights: WeightDtype) -> Result<KvDtype>;
    /// An empty KV store for one row of `n_layers` layers of `heads` KV heads of `head_dim`
    /// values per position, holding `kv` (as [`Kernels::kv_dtype`] resolved it).
    fn kv_store(
        self: &Arc<Self>,
        n_layers: usize,
        heads: usize,
        head_dim: usize,
        kv: KvDtype,
    ) -> Box<dyn KvStore>;

    /// An activation of `len` values, each to be written before it is read.
    fn alloc(&self, len: usize) -> Result<Self::Act>;
    fn upload(&self, x: &[f32]) -> Result<Self::Act>;
    /// `len` zeros, made on the device where the backend has one: unlike an upload, safe
    /// inside a recorded forward (whose host buffers are gone when it is replayed).
    fn zeros(&self, len: usize) -> Result<Self::Act> {
        self.upload(&vec![0.0; len])
    }
    /// The values of `x` in host memory.
    fn download(&self, x: Self::Act) -> Result<Vec<f32>>;
    /// The [`LogitSummary`] of each of the `rows` `vocab`-wide rows of `logits`, written to
    /// `out` as three values a row ([`summaries_from`] reads them back): one
    /// implementation a backend, its order fixed by `vocab` alone.
    fn logit_summaries(
        &self,
        logits: &Self::Act,
        rows: usize,
        vocab: usize,
        out: &mut Self::Act,
    ) -> Result<()>;

    /// Lays out a forward: opens each row's window for `t_r` new positions and records
    /// every token's slot and id (`tokens[i]` is slot `i`'s). `slots` lists the tokens row
    /// by row.
    fn batch(&self, slots: &[Slot], tokens: &[u32], caches: &mut [&mut RowCache]) -> Result<Self::Batch>;

    /// `out[i] = table[tokens[i]]`, widened to f32.
    fn embed(&self, table: &Self::Mat, tokens: &[u32], out: &mut Self::Act) -> Result<()>;
    /// [`Kernels::embed`] of the batch's own tokens (read where the batch keeps them, so a
    /// recorded forward reads each replay's tokens).
    fn embed_batch(&self, table: &Self::Mat, batch: &Self::Batch, out: &mut Self::Act) -> Result<()>;

    /// Runs `body`, a forward's device work over `batch` writing one activation of each
    /// length in `out_lens`, and returns the first `fetch[i]` values of output `i` in host
    /// memory (one count an output, as many as `out_lens`; 0: an empty vector, never
    /// copied). The caller promises
    /// that `body`'s launches and their arguments depend only on the batch's shape (its
    /// token and row counts and the most keys a token reads) and that everything else it
    /// reads comes from the batch's device tables; a backend may then record `body` once
    /// per shape in `recordings` and replay it with each step's tables, the same launches
    /// in the same order (so the same bits). By default it simply runs `body`.
    fn run_recorded(
        &self,
        _recordings: &Self::Recordings,
        batch: Self::Batch,
        out_lens: &[usize],
        fetch: &[usize],
        body: &mut ForwardBody<'_, Self>,
    ) -> Result<Vec<Vec<f32>>> {
        run_body(self, batch, out_lens, fetch, body)
    }
    /// The tokens and rows a forward of `tokens` tokens over `rows` rows runs as when
    /// [`Kernels::run_recorded`] may record it: more of each where one recording then
    /// serves many batches. The caller adds the difference as padding rows after its
    /// own (each at least one token, the first taking what the others leave) and drops
    /// their outputs; a row's bits never depend on the rows beside it. Exactly
    /// `(tokens, rows)` by default (nothing is recorded).
    fn recorded_shape(&self, tokens: usize, rows: usize) -> (usize, usize) {
        (tokens, rows)
    }
    /// Tokens a forward's matmuls compute as one group: a forward of a partial group costs
    /// about as much as the whole group (CUDA: 8, an MMA's token width). 1 where each token
    /// costs its own share.
    fn token_group(&self) -> usize {
        1
    }
    /// One more verify token's cost, in decode steps of one row, as a fixed figure for
    /// this backend (rows whose k may not depend on timings price drafts by it). 1 here:
    /// the CPU's matmuls are compute-bound at these sizes (a verify of two tokens costs
    /// about two decode steps), so a draft pays only if it is always accepted.
    fn verify_token_cost(&self) -> f64 {
        1.0
    }
    /// A new model's recordings, for its layers' attention `heads` (what a recorded
    /// attention launch depends on beside the batch).
    fn recordings(&self, _heads: Heads) -> Self::Recordings {
        Self::Recordings::default()
    }
    /// Forwards of `recordings` so far that paid a one-time cost (a shape's first run or
    /// its recording): a timing of one of them says little about the next (adaptive k
    /// does not learn from it). None where nothing is recorded.
    fn one_time_forwards(&self, _recordings: &Self::Recordings) -> u64 {
        0
    }
    /// The device's free and total memory in bytes, where the kernels run on one with
    /// memory of its own (None on the host).
    fn device_memory(&self) -> Option<(usize, usize)> {
        None
    }
    /// `out (m x n) = x (m x k) . w^T + bias`, or `out +=` that (`Out::Add`).
    fn linear(
        &self,
        x: &Self::Act,
        m: usize,
        w: &Self::Mat,
        bias: Option<&Self::Vec>,
        out: &mut Self::Act,
        mode: Out,
    ) -> Result<()>;
    /// `outs[i] = x . w_i^T + bias_i` for the weights `parts[i] = (w_i, bias_i)` over the
    /// same `m` rows of `x` (q/k/v, gate/up), each output exactly as [`Kernels::linear`]
    /// writes it; a backend may run them as one launch.
    fn linear_parts(
        &self,
        x: &Self::Act,
        m: usize,
        parts: &[(&Self::Mat, Option<&Self::Vec>)],
        outs: &mut [&mut Self::Act],
    ) -> Result<()> {
        linear_each(self, x, m, parts, outs)
    }
    /// RMSNorm of each `w.len()`-wide row of `x`, written to columns `[col, col + n)` of
    /// the rows of `out` (rows `out_width` wide).
    fn rms_norm(
        &self,
        x: &Self::Act,
        w: &Self::Vec,
        eps: f32,
        out: &mut Self::Act,
        out_width: usize,
        col: usize,
    ) -> Result<()>;
    /// `gate <- silu(gate) * up`.
    fn swiglu(&self, gate: &mut Self::Act, up: &Self::Act) -> Result<()>;
    /// The gate and up projections of `m` rows of `x`, then SwiGLU: `gate_out` ends as
    /// [`Kernels::linear_parts`] then [`Kernels::swiglu`] leave it, bit for bit; `up_out` is
    /// scratch (a backend that fuses the three may leave it unwritten).
    fn linear_swiglu(
        &self,
        x: &Self::Act,
        m: usize,
        gate: (&Self::Mat, Option<&Self::Vec>),
        up: (&Self::Mat, Option<&Self::Vec>),
        gate_out: &mut Self::Act,
        up_out: &mut Self::Act,
    ) -> Result<()> {
        self.linear_parts(x, m, &[gate, up], &mut [&mut *gate_out, &mut *up_out])?;
        self.swiglu(gate_out, up_out)
    }
    /// Per-head RMSNorm of q and k (when `norms` is given), RoPE at each token's position,
    /// and the window's K and V stored into `plane` of each row's cache (q alone, no
    /// store, without `kv`: a layer that reads another layer's K/V).
    #[allow(clippy::too_many_arguments)]
    fn qk_rope_store(
        &self,
        q: &mut Self::Act,
        kv: Option<(&mut Self::Act, &Self::Act)>,
        norms: Option<(&Self::Vec, &Self::Vec, f32)>,
        rope: &Self::Rope,
        batch: &Self::Batch,
        caches: &mut [&mut RowCache],
        plane: Plane,
        heads: Heads,
    ) -> Result<()>;
    /// Causal attention of every query over its own row's keys in `plane`: `[0, pos]`, or
    /// `(pos - window, pos]` on a sliding-window layer.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Act,
        batch: &Self::Batch,
        caches: &[&mut RowCache],
        plane: Plane,
        heads: Heads,
        scale: f32,
        window: Option<usize>,
        out: &mut Self::Act,
    ) -> Result<()>;
    /// Rows `rows` of `x` (each `width` wide), in that order.
    fn gather(&self, x: &Self::Act, width: usize, rows: &[usize]) -> Result<Self::Act>;
    /// `x += parts[0] + parts[1] + ... + parts[n - 1]`, added one part after another in
    /// that order (reversed when `reversed`: the negative control's order), where `parts`
    /// holds `n` blocks of `x`'s length (tensor-parallel ranks' partial sums).
    fn add_parts(&self, x: &mut Self::Act, parts: &Self::Act, n: usize, reversed: bool) -> Result<()> {
        let _ = (x, parts, n, reversed);
        Err(no_tensor_parallel(self.backend()))
    }
    /// `out[t][r * width + j] = parts[r][t][j]`: `n` blocks of `m x width` side by side
    /// (a tensor-parallel LM head's vocabulary shards), `out` being `m x n * width`.
    fn concat_columns(
        &self,
        parts: &Self::Act,
        n: usize,
        width: usize,
        m: usize,
        out: &mut Self::Act,
    ) -> Result<()> {
        let _ = (parts, n, width, m, out);
        Err(no_tensor_parallel(self.backend()))
    }
    /// `gate <- gelu_tanh(gate) * up`.
    fn gelu_tanh_mul(&self, gate: &mut Self::Act, up: &Self::Act) -> Result<()>;
    /// `x <- x * s`.
    fn scale(&self, x: &mut Self::Act, s: f32) -> Result<()>;
    /// `x <- x + y`.
    fn add(&self, x: &mut Self::Act, y: &Self::Act) -> Result<()>;
    /// `out[rows[i]] += weights[i] * src[i]` for each `width`-wide row `i` of `src`, in
    /// order (the rows of one call are distinct).
    fn add_rows_scaled(
        &self,
        out: &mut Self::Act,
        width: usize,
        src: &Self::Act,
        rows: &[usize],
        weights: &[f32],
    ) -> Result<()>;
}

/// [`Kernels::run_recorded`] without recording: `body` run once, its outputs downloaded.
pub fn run_body<B: Kernels>(
    be: &B,
    batch: B::Batch,
    out_lens: &[usize],
    fetch: &[usize],
    body: &mut ForwardBody<'_, B>,
) -> Result<Vec<Vec<f32>>> {
    let mut outs = out_lens.iter().map(|&n| be.alloc(n)).collect::<Result<Vec<_>>>()?;
    body(&batch, &mut outs)?;
    fetched(outs, fetch, |o, n| {
        let mut host = be.download(o)?;
        host.truncate(n);
        Ok(host)
    })
}

/// The first `fetch[i]` values of each output `i` in host memory by `get` (an empty vector
/// where the count is 0, `get` not called): what [`Kernels::run_recorded`] returns.
pub fn fetched<T>(
    outs: impl IntoIterator<Item = T>,
    fetch: &[usize],
    mut get: impl FnMut(T, usize) -> Result<Vec<f32>>,
) -> Result<Vec<Vec<f32>>> {
    outs.into_iter().zip(fetch).map(|(o, &n)| if n > 0 { get(o, n) } else { Ok(Vec::new()) }).collect()
}

/// Values a [`LogitSummary`] takes in a backend's buffer: argmax (as f32), max, lse.
pub const SUMMARY_VALUES: usize = 3;

/// [`Kernels::logit_summaries`] computed on the host (`out` holds `3 * rows` values).
pub fn host_summaries(logits: &[f32], rows: usize, vocab: usize, out: &mut [f32]) -> Result<()> {
    use rayon::prelude::*;
    check_summary_lens(logits.len(), out.len(), rows, vocab)?;
    out.par_chunks_mut(SUMMARY_VALUES).zip(logits.par_chunks(vocab)).take(rows).for_each(|(o, l)| {
        let s = LogitSummary::of(l);
        o.copy_from_slice(&[s.argmax as f32, s.max, s.lse]);
    });
    Ok(())
}

/// [`Kernels::logit_summaries`]'s arguments: `rows` rows of `vocab` logits, room for their
/// summaries.
pub fn check_summary_lens(logits: usize, out: usize, rows: usize, vocab: usize) -> Result<()> {
    if logits < rows * vocab || out < SUMMARY_VALUES * rows || vocab == 0 {
        return Err(Error::Backend(format!(
            "logit summaries of {rows} rows of {vocab}: {logits} logits, room for {out} values"
        )));
    }
    Ok(())
}

/// The summaries [`Kernels::logit_summaries`] wrote, read back from host memory.
pub fn summaries_from(values: &[f32]) -> Vec<LogitSummary> {
    values
        .chunks_exact(SUMMARY_VALUES)
        .map(|v| LogitSummary { argmax: v[0] as u32, max: v[1], lse: v[2] })
        .collect()
}

/// [`Kernels::linear_parts`] as one [`Kernels::linear`] per weight.
pub fn linear_each<B: Kernels>(
    be: &B,
    x: &B::Act,
    m: usize,
    parts: &[(&B::Mat, Option<&B::Vec>)],
    outs: &mut [&mut B::Act],
) -> Result<()> {
    if parts.len() != outs.len() {
        return Err(Error::Backend(format!("{} weights for {} outputs", parts.len(), outs.len())));
    }
    for ((w, bias), out) in parts.iter().zip(outs.iter_mut()) {
        be.linear(x, m, w, *bias, out, Out::Write)?;
    }
    Ok(())
}

/// A forward's device work for [`Kernels::run_recorded`]: over a batch, into its outputs.
pub type ForwardBody<'a, B> =
    dyn FnMut(&<B as Kernels>::Batch, &mut [<B as Kernels>::Act]) -> Result<()> + 'a;

/// Which K/V of a row a layer reads and writes: layer `l` of the row's main store (every
/// position) or of its ring (sliding-window layers: the last positions only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plane {
    Main(usize),
    Ring(usize),
}

impl Plane {
    /// The layer within its store.
    pub fn layer(self) -> usize {
        match self {
            Plane::Main(l) | Plane::Ring(l) => l,
        }
    }

    /// The store of `cache` this plane lives in (`None`: the row has no ring).
    pub fn store(self, cache: &RowCache) -> Option<&dyn KvStore> {
        match self {
            Plane::Main(_) => Some(cache.store()),
            Plane::Ring(_) => cache.ring_store(),
        }
    }

    pub fn store_mut(self, cache: &mut RowCache) -> Option<&mut dyn KvStore> {
        match self {
            Plane::Main(_) => Some(cache.store_mut()),
            Plane::Ring(_) => cache.ring_store_mut(),
        }
    }

    /// Where this plane of `cache` holds its committed positions and open window.
    pub fn map(self, cache: &RowCache) -> Option<SlotMap> {
        match self {
            Plane::Main(_) => Some(cache.slot_map()),
            Plane::Ring(_) => cache.ring_map(),
        }
    }
}

/// What Gemma 4's assistant adds: reading another model's K/V without writing any.
pub trait AssistantKernels: Kernels {
    /// RoPE of every `head_dim`-wide head of each `width`-wide row `i` of `x` at
    /// `positions[i]`.
    fn rope_at(
        &self,
        x: &mut Self::Act,
        width: usize,
        head_dim: usize,
        positions: &[usize],
        rope: &Self::Rope,
    ) -> Result<()>;
    /// Attention of query `i` (one token) over keys `keys[i]` of `plane` in `caches[i]`,
    /// which are read, not written: how an assistant reads its target's K/V.
    #[allow(clippy::too_many_arguments)]
    fn attention_over(
        &self,
        q: &Self::Act,
        keys: &[KeyRange],
        caches: &[&RowCache],
        plane: Plane,
        heads: Heads,
        scale: f32,
        out: &mut Self::Act,
    ) -> Result<()>;
}

/// Keys `[first, end)` (logical positions, committed) that query `i` of
/// [`AssistantKernels::attention_over`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRange {
    pub first: usize,
    pub end: usize,
}

/// Where `plane` of row `r`'s cache holds its committed positions, once checked that they
/// include `keys` (an assistant reads only what is held).
pub fn held_keys(cache: &RowCache, r: usize, plane: Plane, keys: KeyRange) -> Result<SlotMap> {
    match plane.map(cache) {
        Some(m) if keys.first < keys.end && keys.first >= m.first_held() && keys.end <= m.committed => Ok(m),
        _ => Err(Error::Request {
            request: format!("row {r}"),
            msg: format!("keys [{}, {}) are not held in its {plane:?} K/V", keys.first, keys.end),
        }),
    }
}

/// Every backend's K/V dtype: f32 for f32 weights and bf16 for 16-bit ones by default (half
/// the memory), or as chosen (quantized included).
pub fn auto_kv_dtype(kv: KvDtype, weights: WeightDtype) -> Result<KvDtype> {
    Ok(match (kv, weights) {
        (KvDtype::Auto, WeightDtype::F32) => KvDtype::F32,
        (KvDtype::Auto, _) => KvDtype::Bf16,
        (chosen, _) => chosen,
    })
}

/// Largest head dimension the GPU attention kernels hold in registers.
pub const GPU_MAX_HEAD_DIM: usize = 512;

/// Whether the GPU attention kernels of `backend` take this attention shape.
pub fn check_gpu_heads(h: Heads, backend: &str) -> Result<()> {
    if h.head_dim > GPU_MAX_HEAD_DIM || h.kv_heads == 0 || !h.heads.is_multiple_of(h.kv_heads) {
        return Err(Error::Backend(format!(
            "{backend} attention supports head_dim up to {GPU_MAX_HEAD_DIM} and heads divisible by KV heads \
             (got head_dim {}, {} heads, {} KV heads)",
            h.head_dim, h.heads, h.kv_heads
        )));
    }
    Ok(())
}

/// Whether the GPU kernels of `backend` store K/V of `kv` for heads of `head_dim`: a
/// quantized head's codes must fill whole 32-bit words, with every lane's share of them
/// starting on a whole code byte (head_dim a multiple of 8).
pub fn check_gpu_kv(kv: KvDtype, head_dim: usize, backend: &str) -> Result<()> {
    match kv.bits() {
        Some(bits) if !head_dim.is_multiple_of(8) => Err(Error::Backend(format!(
            "{backend}: {bits}-bit K/V (--kv-bits {bits}) need head_dim a multiple of 8 (got {head_dim}); \
             use --kv-dtype instead"
        ))),
        _ => Ok(()),
    }
}

/// The capacity a device K/V store grows to when a window needs `slots`: by half again, at
/// least 64 slots (so decoding does not reallocate every token), at least `slots`.
pub fn grown_capacity(capacity: usize, slots: usize) -> usize {
    slots.max((capacity + capacity / 2).max(capacity + 64))
}

/// The slot map of every row, after [`Kernels::batch`] opened their windows.
pub fn open_windows(slots: &[Slot], caches: &mut [&mut RowCache]) -> Result<Vec<SlotMap>> {
    let mut tokens = vec![0usize; caches.len()];
    for s in slots {
        tokens[s.row] += 1;
    }
    let mut maps = Vec::with_capacity(caches.len());
    for (r, (cache, &t)) in caches.iter_mut().zip(&tokens).enumerate() {
        maps.push(cache.open_window(t).map_err(|e| Error::Request {
            request: format!("row {r}"),
            msg: format!("out of memory for the KV window: {e}"),
        })?);
    }
    Ok(maps)
}
