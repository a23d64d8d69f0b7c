//! Kernel-level invariance checks shared by the GPU and Metal-emulator tests: the same
//! property, asserted on each backend's kernels.

use mtp::base::weights::Quant;
use mtp::base::{Weight, WeightDtype};
use mtp::kernels::{Activations, Backend, Kernels, KvDtype, Numerics, Out};
use mtp::model::{Logits, Model, RowInput};

use super::{bits, fixture, Lcg};

/// A random `n x k` weight in `dtype` (values in +-0.05).
pub fn weight(rng: &mut Lcg, dtype: WeightDtype, n: usize, k: usize) -> Weight {
    let values: Vec<f32> = (0..n * k).map(|_| rng.f32() * 0.05).collect();
    let bytes = match dtype {
        WeightDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        WeightDtype::Bf16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        WeightDtype::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
    };
    Weight::from_le_bytes(bytes, dtype, n, k)
}

/// A random MLX-quantized `n x k` weight: affine `bits`-bit codes in groups of `group`,
/// bf16 scales and biases (what `mlx_lm.convert -q` writes for a bf16 model), values
/// within about +-0.05.
pub fn quantized_weight(rng: &mut Lcg, n: usize, k: usize, bits: usize, group: usize) -> Weight {
    let words: Vec<u8> = (0..n * k * bits / 32).flat_map(|_| rng.next_u32().to_le_bytes()).collect();
    let groups = n * k / group;
    let top = ((1u32 << bits) - 1) as f32;
    let bf16 = |v: f32| half::bf16::from_f32(v).to_le_bytes();
    let scales: Vec<u8> = (0..groups).flat_map(|_| bf16((0.5 + 0.5 * rng.f32().abs()) * 0.1 / top)).collect();
    let biases: Vec<u8> = (0..groups).flat_map(|_| bf16(-0.05 + 0.01 * rng.f32())).collect();
    let quant = Quant {
        bits,
        group,
        scales: Weight::from_le_bytes(scales, WeightDtype::Bf16, n, k / group),
        biases: Some(Weight::from_le_bytes(biases, WeightDtype::Bf16, n, k / group)),
    };
    Weight::quantized(Weight::from_le_bytes(words, WeightDtype::F32, n, k * bits / 32), n, k, quant)
}

/// `x (m x k) . w^T` on `kernels` (`w` made by its `matrix`).
pub fn product<K: Kernels>(kernels: &K, w: &K::Mat, n: usize, x: &[f32], m: usize) -> Vec<f32> {
    let xs = kernels.upload(x).unwrap();
    let mut out = kernels.alloc(m * n).unwrap();
    kernels.linear(&xs, m, w, None, &mut out, Out::Write).unwrap();
    kernels.download(out).unwrap()
}

/// Whether the rows of `x . w^T` computed `m` at a time equal the same rows computed one
/// by one, for every `m` in `ms`.
pub fn rows_invariant<K: Kernels>(kernels: &K, w: &Weight, x: &[f32], ms: &[usize]) -> bool {
    let (n, k) = (w.rows, w.cols);
    let mat = kernels.matrix(w).unwrap();
    let max_m = *ms.iter().max().unwrap();
    let alone: Vec<Vec<u32>> =
        (0..max_m).map(|r| bits(&product(kernels, &mat, n, &x[r * k..(r + 1) * k], 1))).collect();
    ms.iter().all(|&m| {
        let together = product(kernels, &mat, n, &x[..m * k], m);
        (0..m).all(|r| bits(&together[r * n..(r + 1) * n]) == alone[r])
    })
}

/// [`rows_invariant`] on `kernels`, then with the stock-matmul negative control switched on:
/// (ours invariant, the control's invariant).
pub fn rows_invariant_and_control<K: Kernels>(
    kernels: &K,
    w: &Weight,
    x: &[f32],
    ms: &[usize],
) -> (bool, bool) {
    let ours = rows_invariant(kernels, w, x, ms);
    mtp::kernels::negative_control::set_stock_matmul(true);
    let stock = rows_invariant(kernels, w, x, ms);
    mtp::kernels::negative_control::set_stock_matmul(false);
    (ours, stock)
}

/// Runs `seq` through a fresh cache in pieces of the given sizes (cycled) and returns the
/// logits after every token plus the final cache.
pub fn run_chunked(model: &Model, seq: &[u32], chunks: &[usize]) -> (Vec<Vec<u32>>, mtp::cache::RowCache) {
    let mut cache = model.new_cache();
    let mut logits = Vec::new();
    let mut at = 0;
    for &c in chunks.iter().cycle() {
        if at >= seq.len() {
            break;
        }
        let piece = &seq[at..(at + c).min(seq.len())];
        let mut rows = [RowInput {
            tokens: piece,
            cache: &mut cache,
            logits: Logits::All,
            full_logits: true,
            hidden: true.into(),
        }];
        let out = model.forward(&mut rows).unwrap();
        cache.commit_window(piece.len());
        logits.extend(out[0].logits.iter().map(|l| bits(l)));
        at += piece.len();
    }
    (logits, cache)
}

/// Every committed K/V byte of a row: each layer of its main store, then of its ring.
pub fn cache_bytes(c: &mtp::cache::RowCache) -> Vec<u8> {
    let main = (0..c.n_layers()).map(|l| c.committed_bytes(l).unwrap());
    let ring = (0..c.ring_layers()).map(|l| c.ring_bytes(l).unwrap());
    main.chain(ring).flat_map(|(k, v)| k.into_iter().chain(v)).collect()
}

/// Logits after each prompt, run alone or all in one forward.
pub fn last_logits(model: &Model, prompts: &[Vec<u32>], together: bool) -> Vec<Vec<u32>> {
    let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let run = |idx: &[usize], caches: &mut [mtp::cache::RowCache]| {
        let mut rows: Vec<RowInput> = idx
            .iter()
            .zip(caches.iter_mut())
            .map(|(&i, c)| RowInput {
                tokens: &prompts[i],
                cache: c,
                logits: Logits::Last,
                full_logits: true,
                hidden: true.into(),
            })
            .collect();
        model.forward(&mut rows).unwrap().into_iter().map(|o| bits(&o.logits[0])).collect::<Vec<_>>()
    };
    if together {
        let idx: Vec<usize> = (0..prompts.len()).collect();
        run(&idx, &mut caches)
    } else {
        (0..prompts.len()).flat_map(|i| run(&[i], &mut caches[i..i + 1])).collect()
    }
}

/// `check()` on our kernels, then with the batch-sized split-attention negative control
/// switched on: (ours, the control's).
pub fn with_split_attention_control<T>(check: impl Fn() -> T) -> (T, T) {
    let ours = check();
    mtp::kernels::negative_control::set_split_attention(true);
    let control = check();
    mtp::kernels::negative_control::set_split_attention(false);
    (ours, control)
}

/// Whether the qwen3-target fixture on `backend` gives eight prompts the same last logits
/// alone as in one forward, then the same with the batch-sized split-attention negative
/// control switched on: (ours invariant, the control's invariant).
pub fn attention_batch_invariant_and_control(backend: Backend) -> (bool, bool) {
    let model = Model::load_on(&fixture("qwen3-target"), backend).unwrap();
    let prompts = prompts(&model, 17);
    with_split_attention_control(|| {
        last_logits(&model, &prompts, false) == last_logits(&model, &prompts, true)
    })
}

/// Eight prompts of different lengths (40 to 117 tokens) for `model`.
pub fn prompts(model: &Model, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = Lcg(seed);
    (0..8).map(|i| (0..40 + 11 * i).map(|_| rng.below(model.config.vocab_size) as u32).collect()).collect()
}

/// For f32, bf16 and f16 weights (every widening path of the kernels) and f32 K/V, the
/// largest difference between `backend`'s logits after a prompt (its kernels in mode
/// `activations`) and the CPU's, with the logits' scale: (dtype, worst, scale).
pub fn logits_vs_cpu(backend: Backend, activations: Activations) -> Vec<(WeightDtype, f32, f32)> {
    use mtp::synth::SynthSpec;
    let base = super::load(&fixture("qwen3-target")).config;
    let prompt: Vec<u32> = (0..37).map(|i| (i * 13 + 5) % base.vocab_size as u32).collect();
    let mut out = Vec::new();
    for dtype in [WeightDtype::F32, WeightDtype::Bf16, WeightDtype::F16] {
        let dir = std::env::temp_dir().join(format!(
            "mtp-{}-{}-{}",
            backend.name(),
            dtype.name(),
            std::process::id()
        ));
        SynthSpec { dtype, seed: 5, ..SynthSpec::from_config(&base) }.write(&dir).unwrap();
        let logits = |backend: Backend, activations| {
            let model = Model::load_with(&dir, backend, Numerics { kv: KvDtype::F32, activations }).unwrap();
            let mut cache = model.new_cache();
            mtp::engine::prefill(&model, &mut cache, &prompt, 16, false, true).unwrap().logits
        };
        // The CPU's f32 activations: the reference (its `auto` is bf16 on CPUs with AVX512-BF16).
        let (cpu, other) = (logits(Backend::Cpu, Activations::F32), logits(backend, activations));
        let scale = cpu.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let worst = cpu.iter().zip(&other).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        println!(
            "{}: {} logits ({} activations) within {worst:e} of the CPU's (scale {scale})",
            dtype.name(),
            backend.name(),
            activations.name()
        );
        out.push((dtype, worst, scale));
        std::fs::remove_dir_all(&dir).ok();
    }
    out
}
