//! The CUDA kernels, bit for bit, each check beside a negative control that must fail it:
//! every row of a matmul gets the same bits whatever M is (cuBLAS does not), and a query
//! gets the same attention bits alone as in a batch of eight (a split-KV kernel whose split
//! count follows the batch does not). Built with `--features cuda`; run on a GPU by
//! `scripts/gpu-run.sh tests`.
#![cfg(feature = "cuda")]

mod common;

use common::{fixture, Lcg};
use mtp::model::backend::cuda::Cuda;
use mtp::model::backend::{Backend, Kernels, Out};
use mtp::model::{negative_control, Logits, Model, RowInput, Weight, WeightDtype};

fn bf16_weight(rng: &mut Lcg, n: usize, k: usize) -> Weight {
    let bytes = (0..n * k).flat_map(|_| half::bf16::from_f32(rng.f32() * 0.05).to_le_bytes()).collect();
    Weight::from_le_bytes(bytes, WeightDtype::Bf16, n, k)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Whether the rows of `x . w^T` computed `m` at a time equal the same rows computed one
/// by one, for every `m` in `ms`.
fn rows_invariant(cuda: &Cuda, w: &Weight, x: &[f32], ms: &[usize]) -> bool {
    let (n, k) = (w.rows, w.cols);
    let mat = cuda.matrix(w).unwrap();
    let product = |rows: &[f32], m: usize| {
        let xs = cuda.upload(rows).unwrap();
        let mut out = cuda.alloc(m * n).unwrap();
        cuda.linear(&xs, m, &mat, None, &mut out, Out::Write).unwrap();
        cuda.download(out).unwrap()
    };
    let max_m = *ms.iter().max().unwrap();
    let alone: Vec<Vec<u32>> = (0..max_m).map(|r| bits(&product(&x[r * k..(r + 1) * k], 1))).collect();
    ms.iter().all(|&m| {
        let together = product(&x[..m * k], m);
        (0..m).all(|r| bits(&together[r * n..(r + 1) * n]) == alone[r])
    })
}

#[test]
fn matmul_rows_do_not_depend_on_m_and_cublas_rows_do() {
    let cuda = Cuda::shared().unwrap();
    let mut rng = Lcg(3);
    let ms = [1, 2, 3, 8, 64, 512];
    // Qwen3-8B's attention and MLP shapes, and a K that is not a multiple of 8 (the
    // kernels' scalar path).
    for (n, k) in [(4096, 4096), (12288, 4096), (4096, 12288), (96, 100)] {
        let w = bf16_weight(&mut rng, n, k);
        let x = rng.vec(512 * k);
        assert!(rows_invariant(&cuda, &w, &x, &ms), "{n}x{k}: a row's bits depend on M");
        negative_control::set_stock_matmul(true);
        let stock = rows_invariant(&cuda, &w, &x, &ms);
        negative_control::set_stock_matmul(false);
        assert!(
            !stock,
            "{n}x{k}: cuBLAS gave every M the same bits: the check cannot see shape-dependent kernels"
        );
    }
}

/// Logits after each prompt, run alone or all in one forward.
fn last_logits(model: &Model, prompts: &[Vec<u32>], together: bool) -> Vec<Vec<u32>> {
    let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let run = |idx: &[usize], caches: &mut [mtp::cache::RowCache]| {
        let mut rows: Vec<RowInput> = idx
            .iter()
            .zip(caches.iter_mut())
            .map(|(&i, c)| RowInput { tokens: &prompts[i], cache: c, logits: Logits::Last })
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

#[test]
fn attention_alone_equals_batched_and_batch_sized_splits_do_not() {
    let model = Model::load_on(&fixture("qwen3-target"), Backend::Cuda).unwrap();
    let mut rng = Lcg(17);
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| (0..40 + 11 * i).map(|_| rng.below(model.config.vocab_size) as u32).collect())
        .collect();
    assert_eq!(last_logits(&model, &prompts, false), last_logits(&model, &prompts, true));
    negative_control::set_split_attention(true);
    let (alone, together) = (last_logits(&model, &prompts, false), last_logits(&model, &prompts, true));
    negative_control::set_split_attention(false);
    assert_ne!(alone, together, "a split count chosen from the batch went unnoticed");
}

/// Running out of device memory for K/V is an error naming the bytes, never a crash, and
/// the cache stays usable.
#[test]
fn device_out_of_memory_is_a_clear_error() {
    let model = Model::load_on(&fixture("qwen3-target"), Backend::Cuda).unwrap();
    let mut cache = model.new_cache();
    let err = cache.try_reserve_window(0, 1 << 40).unwrap_err();
    assert!(err.to_string().contains("out of GPU memory"), "{err}");
    let mut rows = [RowInput { tokens: &[5, 6, 7], cache: &mut cache, logits: Logits::Last }];
    assert_eq!(model.forward(&mut rows).unwrap()[0].logits.len(), 1);
}

/// The GPU computes the CPU's function: for f32, bf16 and f16 weights (every widening path
/// of the kernels) and f32 K/V, the logits after a prompt agree within 1e-4 of their scale.
#[test]
fn gpu_logits_agree_with_the_cpu_for_every_weight_dtype() {
    use mtp::model::backend::KvDtype;
    use mtp::model::synth::SynthSpec;
    let base = common::load(&fixture("qwen3-target")).config;
    let prompt: Vec<u32> = (0..37).map(|i| (i * 13 + 5) % base.vocab_size as u32).collect();
    for dtype in [WeightDtype::F32, WeightDtype::Bf16, WeightDtype::F16] {
        let dir = std::env::temp_dir().join(format!("mtp-gpu-{}-{}", dtype.name(), std::process::id()));
        SynthSpec { dtype, seed: 5, ..SynthSpec::from_config(&base) }.write(&dir).unwrap();
        let logits = |backend: Backend| {
            let model = Model::load_with(&dir, backend, KvDtype::F32).unwrap();
            let mut cache = model.new_cache();
            mtp::engine::prefill(&model, &mut cache, &prompt, 16, false).unwrap().0
        };
        let (cpu, gpu) = (logits(Backend::Cpu), logits(Backend::Cuda));
        let scale = cpu.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let worst = cpu.iter().zip(&gpu).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        println!("{}: GPU logits within {worst:e} of the CPU's (scale {scale})", dtype.name());
        assert!(worst <= 1e-4 * scale.max(1.0), "{}: GPU and CPU logits differ by {worst}", dtype.name());
        std::fs::remove_dir_all(&dir).ok();
    }
}
