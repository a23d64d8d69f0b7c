//! The CUDA kernels, bit for bit, each check beside a negative control that must fail it:
//! every row of a matmul gets the same bits whatever M is, in both activation modes (bf16,
//! f32: `Activations`) (cuBLAS does not), and a query
//! gets the same attention bits alone as in a batch of eight (a split-KV kernel whose split
//! count follows the batch does not). Built with `--features cuda`; run on a GPU by
//! `scripts/gpu-run.sh tests`.
#![cfg(feature = "cuda")]

mod common;

use std::path::{Path, PathBuf};

use common::invariance::{
    attention_batch_invariant_and_control, last_logits, logits_vs_cpu, quantized_weight,
    rows_invariant_and_control, weight, with_split_attention_control,
};
use common::{bits, fixture, trained, Lcg};
use mtp::base::config::Config;
use mtp::base::WeightDtype;
use mtp::cuda::{Cuda, TcKernel};
use mtp::kernels::{Activations, Backend, Kernels, KvDtype, Numerics, Out};
use mtp::model::{Logits, Model, RowInput};
use mtp::synth::SynthSpec;

/// Both activation modes' kernel sets.
const MODES: [Activations; 2] = [Activations::Bf16, Activations::F32];

#[test]
fn matmul_rows_do_not_depend_on_m_and_cublas_rows_do() {
    for mode in MODES {
        rows_do_not_depend_on_m(&Cuda::shared_with(mode).unwrap(), mode);
    }
}

fn rows_do_not_depend_on_m(cuda: &Cuda, mode: Activations) {
    let mut rng = Lcg(3);
    // Every variant of both matmuls the host picks by shape (CUDA cores: 4, 8, 16 rows a
    // pass; tensor cores: passes of 8 to 64 tokens, shared-memory tiles), several passes
    // and partial tiles.
    let ms = [1, 2, 3, 8, 9, 17, 40, 64, 100, 129, 512];
    // Qwen3-8B's attention and MLP shapes (bf16, K % 32 == 0: tensor cores), and a K that
    // is not a multiple of 8 (CUDA cores, the scalar path).
    for (n, k) in [(4096, 4096), (12288, 4096), (4096, 12288), (200, 1056), (96, 100)] {
        let w = weight(&mut rng, WeightDtype::Bf16, n, k);
        let x = rng.vec(512 * k);
        let (ours, stock) = rows_invariant_and_control(cuda, &w, &x, &ms);
        assert!(ours, "{n}x{k}, {mode:?} activations: a row's bits depend on M");
        assert!(
            !stock,
            "{n}x{k}: cuBLAS gave every M the same bits: the check cannot see shape-dependent kernels"
        );
    }
}

/// MLX 4- and 8-bit weights with bf16 scales: on the tensor cores in bf16 mode
/// (`linear_tcq`, passes of 8 to 64 tokens), on the CUDA cores in f32 mode, each row's bits
/// are the same at every M, on shapes with several passes, partial 16-column blocks, a
/// partial last chunk (K = 1056) and idle warps (K < 1024), each group size. Control:
/// cuBLAS over the dequantized weights must vary with M.
#[test]
fn quantized_rows_do_not_depend_on_m_in_either_mode() {
    let mut rng = Lcg(29);
    let ms = [1, 2, 3, 8, 9, 17, 33, 64, 65, 100, 129];
    for (n, k, bits, group) in
        [(4096, 4096, 4, 64), (200, 1056, 8, 32), (100, 640, 4, 128), (300, 2048, 8, 64)]
    {
        let w = quantized_weight(&mut rng, n, k, bits, group);
        let x = rng.vec(129 * k);
        for mode in MODES {
            let cuda = Cuda::shared_with(mode).unwrap();
            assert_eq!(
                cuda.activations_for(&w),
                mode,
                "{n}x{k} {bits}-bit g{group}: the path of {mode:?} mode"
            );
            let (ours, stock) = rows_invariant_and_control(&*cuda, &w, &x, &ms);
            assert!(ours, "{n}x{k} {bits}-bit g{group}, {mode:?}: a row's bits depend on M");
            assert!(!stock, "{n}x{k} {bits}-bit g{group}: cuBLAS gave every M the same bits");
        }
    }
}

/// The quantized tensor-core matmul computes, per group, scale * sum(bf16(x) q) + bias *
/// sum(bf16(x)): within f32 accumulation error of that sum in f64 and far from the f64 sum
/// of x (scale q + bias); the f32 mode the other way round. Wrongly paired codes or
/// activations, a lost bias or an unrounded activation fail it.
#[test]
fn quantized_modes_compute_their_own_functions() {
    let mut rng = Lcg(31);
    for (n, k, bits, group) in [(200, 1056, 8, 32), (300, 2048, 4, 64), (64, 1024, 4, 128)] {
        // w = scale q + bias, widened to f32 exactly as the kernels see it.
        let w = quantized_weight(&mut rng, n, k, bits, group);
        for m in [1, 40, 129] {
            each_mode_near_its_own_function(&format!("{n}x{k} {bits}-bit g{group}"), &w, &rng.vec(m * k), m);
        }
    }
}

/// Every tensor-core kernel (passes of 8 to 64 tokens, shared-memory tiles of 256x16 to
/// 128x64, the phase-split tiles, and on an H100 or H200 with bf16 activations wgmma) gives
/// the same bits at every M, with a bias and accumulating into the output, on shapes that
/// leave partial tiles (an odd count of column tiles, the last partial: 300 x 640), a
/// partial last 128-wide chunk (K = 1056) and phases without chunks (K < 1024). Control:
/// cuBLAS's product, compared the same way, must differ.
#[test]
fn every_tensor_core_kernel_gives_the_same_bits() {
    for mode in MODES {
        every_kernel_same_bits(&Cuda::shared_with(mode).unwrap(), mode);
    }
}

fn every_kernel_same_bits(cuda: &Cuda, mode: Activations) {
    let mut rng = Lcg(11);
    // wgmma runs where the GPU is a Hopper and activations are bf16 (K % 128 == 0).
    let hopper = ["H100", "H200"].iter().any(|name| cuda.device_name().contains(name));
    assert_eq!(
        cuda.runs(TcKernel::Wgmma128x128, 4096),
        hopper && mode == Activations::Bf16,
        "{}: wgmma should run exactly on a Hopper GPU with bf16 activations",
        cuda.device_name()
    );
    for (n, k) in [(200, 1056), (100, 96), (300, 640), (4096, 4096)] {
        let w = weight(&mut rng, WeightDtype::Bf16, n, k);
        let mat = cuda.matrix(&w).unwrap();
        let bias = cuda.upload(&rng.vec(n)).unwrap();
        for m in [1, 7, 16, 33, 64, 100, 129, 300] {
            let x = cuda.upload(&rng.vec(m * k)).unwrap();
            let start = rng.vec(m * n);
            let run = |kernel: TcKernel| {
                let mut out = cuda.upload(&start).unwrap();
                cuda.linear_tc_with(kernel, &x, m, &mat, Some(&bias), &mut out, Out::Add).unwrap();
                bits(&cuda.download(out).unwrap())
            };
            let reference = run(TcKernel::Pass8);
            for kernel in TcKernel::ALL.into_iter().filter(|kernel| cuda.runs(*kernel, k)) {
                assert!(run(kernel) == reference, "{n}x{k}, M={m}, {mode:?}: {kernel:?} differs from Pass8");
            }
            if m == 64 {
                mtp::kernels::negative_control::set_stock_matmul(true);
                let mut out = cuda.upload(&start).unwrap();
                cuda.linear(&x, m, &mat, Some(&bias), &mut out, Out::Add).unwrap();
                mtp::kernels::negative_control::set_stock_matmul(false);
                let stock = bits(&cuda.download(out).unwrap());
                assert!(
                    stock != reference,
                    "{n}x{k}: cuBLAS matched bit for bit: the check cannot see an order change"
                );
            }
        }
    }
}

/// Several weights over the same activations in one launch (q/k/v, gate/up:
/// `linear_parts`) give each output the bits of its own `linear` launch: three weights of
/// different widths (partial 16-column blocks), with and without a bias, at every pass size
/// (1 to 32 tokens) and past it (40, 64: one phase-split 128x32 tile launch for all three),
/// and a set 4,272 wide together that takes one phase-split tile launch from 32 tokens on
/// (128x32 at 32, 128x48 at 33 and 40, 128x64 at 64); at K = 1,056 and at 1,152, where on
/// a Hopper past 16 tokens (24, 32, ...) the three take one launch of the wgmma phases
/// (`linear_wg_phases_parts`). Control: the same comparison
/// against cuBLAS's products (the stock-matmul control) must differ at some M.
#[test]
fn stacked_projections_give_each_weight_its_own_bits() {
    for mode in MODES {
        stacked_own_bits(&Cuda::shared_with(mode).unwrap());
    }
}

fn stacked_own_bits(cuda: &Cuda) {
    let mut rng = Lcg(29);
    let mut control_differs = false;
    let sets = [([200, 72, 40], [1, 7, 16, 24, 32, 40, 64]), ([4000, 72, 200], [1, 8, 24, 32, 33, 40, 64])];
    for (k, (widths, ms)) in [1056, 1152].into_iter().flat_map(|k| sets.map(|set| (k, set))) {
        let ws: Vec<_> = widths.iter().map(|&n| weight(&mut rng, WeightDtype::Bf16, n, k)).collect();
        let mats: Vec<_> = ws.iter().map(|w| cuda.matrix(w).unwrap()).collect();
        let bias = cuda.upload(&rng.vec(72)).unwrap();
        let biases = [None, Some(&bias), None];
        for m in ms {
            let x = cuda.upload(&rng.vec(m * k)).unwrap();
            let apart = |stock: bool| -> Vec<Vec<u32>> {
                mtp::kernels::negative_control::set_stock_matmul(stock);
                let outs = mats
                    .iter()
                    .zip(&ws)
                    .zip(biases)
                    .map(|((mat, w), b)| {
                        let mut out = cuda.alloc(m * w.rows).unwrap();
                        cuda.linear(&x, m, mat, b, &mut out, Out::Write).unwrap();
                        bits(&cuda.download(out).unwrap())
                    })
                    .collect();
                mtp::kernels::negative_control::set_stock_matmul(false);
                outs
            };
            let mut outs: Vec<_> = ws.iter().map(|w| cuda.alloc(m * w.rows).unwrap()).collect();
            let parts: Vec<_> = mats.iter().zip(biases).collect();
            let [a, b, c] = &mut outs[..] else { unreachable!() };
            cuda.linear_parts(&x, m, &parts, &mut [a, b, c]).unwrap();
            let together: Vec<Vec<u32>> =
                outs.into_iter().map(|o| bits(&cuda.download(o).unwrap())).collect();
            assert!(
                together == apart(false),
                "{widths:?}, M={m}: a stacked launch changed some output's bits"
            );
            control_differs |= together != apart(true);
        }
    }
    assert!(control_differs, "cuBLAS matched bit for bit at every M: the check cannot see a change");
}

/// SwiGLU's gate and up projections with silu(gate) * up in one launch (`linear_swiglu`,
/// the pass kernel up to 32 tokens) leave the gate's output with the bits of
/// `linear_parts` then `swiglu`: partial 8-column blocks, with and without biases, at 1-32
/// tokens and past them (on a Hopper the phase launches, stacked (1024 x 4096 at 40 and
/// 64 tokens) or not (4352 x 1024 at 40, 64; 128-token tiles at 100), with the merges
/// and SwiGLU in one launch; elsewhere the three launches, unfused). Controls: the
/// projections by cuBLAS must differ at some M, and so must gate and up swapped.
#[test]
fn swiglu_in_the_projection_keeps_the_bits_of_three_launches() {
    for mode in MODES {
        swiglu_fused_bits(&Cuda::shared_with(mode).unwrap(), mode);
    }
}

fn swiglu_fused_bits(cuda: &Cuda, mode: Activations) {
    let mut rng = Lcg(31);
    let (mut stock_differs, mut swap_differs) = (false, false);
    for (n, k, with_bias) in [(203, 1056, true), (100, 96, false), (1024, 4096, false), (4352, 1024, true)] {
        let (gw, uw) = (weight(&mut rng, WeightDtype::Bf16, n, k), weight(&mut rng, WeightDtype::Bf16, n, k));
        let (gm, um) = (cuda.matrix(&gw).unwrap(), cuda.matrix(&uw).unwrap());
        let (gb, ub) = (cuda.upload(&rng.vec(n)).unwrap(), cuda.upload(&rng.vec(n)).unwrap());
        let (gb, ub) = if with_bias { (Some(&gb), Some(&ub)) } else { (None, None) };
        for m in [1, 3, 8, 9, 16, 17, 32, 40, 64, 100] {
            let x = cuda.upload(&rng.vec(m * k)).unwrap();
            let apart = |gate: (&_, _), up: (&_, _), stock: bool| {
                mtp::kernels::negative_control::set_stock_matmul(stock);
                let (mut g, mut u) = (cuda.alloc(m * n).unwrap(), cuda.alloc(m * n).unwrap());
                cuda.linear_parts(&x, m, &[gate, up], &mut [&mut g, &mut u]).unwrap();
                cuda.swiglu(&mut g, &u).unwrap();
                mtp::kernels::negative_control::set_stock_matmul(false);
                bits(&cuda.download(g).unwrap())
            };
            let (mut g, mut u) = (cuda.alloc(m * n).unwrap(), cuda.alloc(m * n).unwrap());
            cuda.linear_swiglu(&x, m, (&gm, gb), (&um, ub), &mut g, &mut u).unwrap();
            let fused = bits(&cuda.download(g).unwrap());
            assert!(
                fused == apart((&gm, gb), (&um, ub), false),
                "{n}x{k}, M={m}, {mode:?}: the fused launch changed some value's bits"
            );
            stock_differs |= fused != apart((&gm, gb), (&um, ub), true);
            swap_differs |= fused != apart((&um, ub), (&gm, gb), false);
        }
    }
    assert!(stock_differs, "{mode:?}: cuBLAS matched bit for bit at every M: the check cannot see a change");
    assert!(swap_differs, "{mode:?}: gate and up swapped went unseen");
}

#[test]
fn attention_alone_equals_batched_and_batch_sized_splits_do_not() {
    let (ours, control) = attention_batch_invariant_and_control(Backend::Cuda);
    assert!(ours, "a query's attention bits depend on the batch");
    assert!(!control, "a split count chosen from the batch went unnoticed");
}

/// Past one warp's chunks and past one 512-key segment, a query's bits are the same alone,
/// beside other rows, and decoded after a prefill as inside the prefill's block. The
/// prefills run a block per (token, head) walking the segments; the decode steps at 530 and
/// 700 keys a block per segment and the merge launch: the same order, so the same bits.
/// Control: attention split by batch size (one row: 16 splits, three: 5) must fail both.
#[test]
fn long_context_attention_is_batch_and_block_invariant() {
    let model = Model::load_on(&fixture("qwen3-target"), Backend::Cuda).unwrap();
    let mut rng = Lcg(23);
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<u32>> =
        [300usize, 530, 700].iter().map(|&n| (0..n).map(|_| rng.below(vocab) as u32).collect()).collect();
    let (ours, control) = with_split_attention_control(|| alone_batched_decoded(&model, &prompts));
    assert_eq!(ours, (true, true), "(alone == batched, decode == prefill) at 300-700 keys");
    assert_eq!(control, (false, false), "batch-sized attention splits went unseen at 300-700 keys");
}

/// Whether `prompts` get the same last logits alone as batched, and whether decoding each
/// prompt's last token after a prefill of the rest gives the batched prefill's bits.
fn alone_batched_decoded(model: &Model, prompts: &[Vec<u32>]) -> (bool, bool) {
    let batched = last_logits(model, prompts, true);
    let decoded = prompts.iter().zip(&batched).all(|(p, want)| bits(&prefill_then_decode(model, p)) == *want);
    (last_logits(model, prompts, false) == batched, decoded)
}

/// The logits of `prompt`'s last token, its last `tail` tokens one forward after a prefill of
/// the rest (a prompt continued past a cached prefix).
fn prefill_in_two(model: &Model, prompt: &[u32], tail: usize) -> Vec<f32> {
    let (head, rest) = prompt.split_at(prompt.len() - tail);
    let mut cache = model.new_cache();
    let mut rows = [RowInput {
        tokens: head,
        cache: &mut cache,
        logits: Logits::Last,
        full_logits: true,
        hidden: false.into(),
    }];
    model.forward(&mut rows).unwrap();
    cache.commit_window(head.len());
    let mut rows = [RowInput {
        tokens: rest,
        cache: &mut cache,
        logits: Logits::Last,
        full_logits: true,
        hidden: false.into(),
    }];
    model.forward(&mut rows).unwrap().remove(0).logits.remove(0)
}

/// The logits of `prompt`'s last token, decoded alone after a prefill of the rest.
fn prefill_then_decode(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let (head, last) = prompt.split_at(prompt.len() - 1);
    let mut cache = model.new_cache();
    let mut rows = [RowInput {
        tokens: head,
        cache: &mut cache,
        logits: Logits::Last,
        full_logits: true,
        hidden: true.into(),
    }];
    model.forward(&mut rows).unwrap();
    cache.commit_window(head.len());
    let mut rows = [RowInput {
        tokens: last,
        cache: &mut cache,
        logits: Logits::Last,
        full_logits: true,
        hidden: true.into(),
    }];
    model.forward(&mut rows).unwrap().remove(0).logits.remove(0)
}

/// Every attention kernel: head size up to 128 serving 4, 2 or 1 query heads a block (each
/// key and value loaded once for the group), 256 and 512, each with whole-vector value
/// loads and (head size not a multiple of the lane's dims) element loads, on a synthesized
/// model of that head shape, at 37 to 600 keys (decode past 512 keys takes the split launch,
/// the prefill the walking one). The decoded logits agree with the CPU's (f32 K/V within
/// 1e-4 of their scale; bf16 K/V within 2e-2 of the CPU's f32, 8- and 4-bit K/V within 2e-2
/// of the CPU's with the same K/V: a wrong head, dim or code would be off by the logits'
/// scale; quantized K/V refused by name where head size is not a multiple of 8), and with
/// 16-bit or quantized K/V a query's bits are the same alone, batched and decoded after a
/// prefill. Control: batch-sized splits must break the latter.
#[test]
fn every_attention_kernel_agrees_with_the_cpu_and_with_itself() {
    let base = common::load(&fixture("qwen3-target")).config;
    // (query heads, KV heads, head size): the kernel it takes.
    let shapes = [
        (8, 2, 32),  // 128, 4 heads a block
        (8, 2, 6),   // 128, 4 heads a block, element loads
        (4, 2, 16),  // 128, 2 heads a block
        (3, 1, 12),  // 128, a head a block
        (2, 1, 136), // 256
        (2, 1, 132), // 256, element loads
        (2, 1, 272), // 512
        (2, 1, 264), // 512, element loads
    ];
    let mut rng = Lcg(41);
    for (heads, kv_heads, head_dim) in shapes {
        let (dir, prompts) =
            attention_checkpoint(&base, (heads, kv_heads, head_dim), 7, None, "att", &mut rng);
        let cpu_decoded = |kv: KvDtype| -> Vec<Vec<f32>> {
            let exact = Numerics { kv, activations: Activations::F32 };
            let cpu = Model::load_with(&dir, Backend::Cpu, exact).unwrap();
            prompts.iter().map(|p| prefill_then_decode(&cpu, p)).collect()
        };
        let cpu_f32 = cpu_decoded(KvDtype::F32);
        let shape = format!("{heads} heads, {kv_heads} KV heads, head size {head_dim}");
        for (kv, tolerance) in
            [(KvDtype::F32, 1e-4), (KvDtype::Bf16, 2e-2), (KvDtype::Q8, 2e-2), (KvDtype::Q4, 2e-2)]
        {
            // f32 activations: the CPU's function exactly, so the bound sees attention alone.
            let model = Model::load_with(&dir, Backend::Cuda, Numerics { kv, activations: Activations::F32 })
                .unwrap();
            if kv.bits().is_some() && !head_dim.is_multiple_of(8) {
                let mut cache = model.new_cache();
                let mut rows = [RowInput {
                    tokens: &prompts[1],
                    cache: &mut cache,
                    logits: Logits::Last,
                    full_logits: true,
                    hidden: true.into(),
                }];
                let err = model.forward(&mut rows).err().map(|e| e.to_string()).unwrap_or_default();
                assert!(
                    err.contains("multiple of 8"),
                    "{shape}, {kv:?} K/V: want a clear refusal, got `{err}`"
                );
                continue;
            }
            // Quantized K/V against the CPU's of the same format (codes from f32 K/V that
            // agree to rounding); f32 and bf16 against the CPU's f32.
            let want = if kv.bits().is_some() { cpu_decoded(kv) } else { cpu_f32.clone() };
            for (p, want) in prompts.iter().zip(&want) {
                let got = prefill_then_decode(&model, p);
                let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1.0);
                let worst = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                println!(
                    "{shape}, {kv:?} K/V, {} keys: within {worst:e} of the CPU (scale {scale})",
                    p.len()
                );
                assert!(
                    worst <= tolerance * scale,
                    "{shape}, {kv:?} K/V, {} keys: off the CPU by {worst}",
                    p.len()
                );
            }
            if kv != KvDtype::F32 {
                let (ours, control) =
                    with_split_attention_control(|| alone_batched_decoded(&model, &prompts));
                assert_eq!(ours, (true, true), "{shape}, {kv:?} K/V: (alone == batched, decode == prefill)");
                assert_eq!(control, (false, false), "{shape}, {kv:?} K/V: batch-sized splits went unseen");
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// A two-layer checkpoint of `base`'s family with the head shape (query heads, KV heads,
/// head size), weights in `dtype` (else `base`'s), written to a temporary folder named by
/// `tag`, and three prompts of 600, 37 and 530 tokens for it: the attention kernels' tests.
fn attention_checkpoint(
    base: &Config,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    seed: u64,
    dtype: Option<WeightDtype>,
    tag: &str,
    rng: &mut Lcg,
) -> (PathBuf, Vec<Vec<u32>>) {
    let spec = SynthSpec {
        vocab_size: 256,
        hidden_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        intermediate_size: 96,
        seed,
        ..SynthSpec::from_config(base)
    };
    let spec = SynthSpec { dtype: dtype.unwrap_or(spec.dtype), ..spec };
    let dir =
        std::env::temp_dir().join(format!("mtp-{tag}-{heads}-{kv_heads}-{head_dim}-{}", std::process::id()));
    spec.write(&dir).unwrap();
    let prompts = [600usize, 37, 530]
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(spec.vocab_size) as u32).collect())
        .collect();
    (dir, prompts)
}

/// The tensor-core attention (bf16 activations and bf16 K/V), for every head-size tier and
/// group size it takes: head size 16 to 128 (24 and 120: dims padded to the 16-wide MMA
/// step; 80: a row of 10 16-byte pieces, not a power of two, which 128 threads do not split
/// evenly), 1 to 8 query heads per KV head (one warp to eight a block). f32 weights, so the
/// matmuls are the CPU's exactly and the bound sees attention's roundings alone (q, K, V
/// and the probabilities in bf16): decoded logits within 2e-2 of the CPU's f32 scale (a
/// wrong head, dim or key would be off by the scale). At 37 to 600 keys a query's bits are
/// the same alone, batched, and decoded after a prefill (the decode past 512 keys takes
/// the split launch and the merge, the prefill the walking one), and as the last of 40
/// tokens continuing a prompt (the split launch of a prompt's tiles). At head size 128 with
/// 4 or more query heads per KV head a prompt's tiles take the wgmma kernel on Hopper, and
/// decode the mma.sync one. Control: a chunk anchor that follows the batch must break the
/// first two.
#[test]
fn tensor_core_attention_agrees_with_the_cpu_and_with_itself() {
    let base = common::load(&fixture("qwen3-target")).config;
    // (query heads, KV heads, head size): tier, warps a 16-token tile.
    let shapes = [
        (8, 2, 32),   // 32, 4 warps
        (6, 2, 24),   // 32, 3 warps, padded dims
        (4, 4, 16),   // 32, 1 warp
        (16, 2, 64),  // 64, 8 warps
        (4, 2, 128),  // 128, 2 warps
        (8, 2, 128),  // 128, 4 warps: a warpgroup (wgmma on Hopper)
        (16, 2, 128), // 128, 8 warps: two warpgroups
        (6, 1, 128),  // 128, 6 warps: two warpgroups, the second half padding
        (4, 1, 120),  // 128, 4 warps, padded dims
        (8, 2, 80),   // 128, 4 warps: a thread's K/V pieces change dims from key to key
    ];
    let mut rng = Lcg(43);
    for (heads, kv_heads, head_dim) in shapes {
        let (dir, prompts) = attention_checkpoint(
            &base,
            (heads, kv_heads, head_dim),
            9,
            Some(WeightDtype::F32),
            "flash",
            &mut rng,
        );
        let exact = Numerics { kv: KvDtype::F32, activations: Activations::F32 };
        let cpu = Model::load_with(&dir, Backend::Cpu, exact).unwrap();
        let numerics = Numerics { kv: KvDtype::Bf16, activations: Activations::Bf16 };
        let model = Model::load_with(&dir, Backend::Cuda, numerics).unwrap();
        let shape = format!("{heads} heads, {kv_heads} KV heads, head size {head_dim}");
        for p in &prompts {
            let want = prefill_then_decode(&cpu, p);
            let got = prefill_then_decode(&model, p);
            let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1.0);
            let worst = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            println!("{shape}, tensor cores, {} keys: within {worst:e} of the CPU (scale {scale})", p.len());
            assert!(worst <= 2e-2 * scale, "{shape}, tensor cores, {} keys: off the CPU by {worst}", p.len());
        }
        let continued = bits(&prefill_in_two(&model, &prompts[0], 40));
        assert!(continued == bits(&prefill_then_decode(&model, &prompts[0])), "{shape}: a continued prompt");
        let (ours, control) = with_split_attention_control(|| alone_batched_decoded(&model, &prompts));
        assert_eq!(ours, (true, true), "{shape}, tensor cores: (alone == batched, decode == prefill)");
        assert_eq!(control, (false, false), "{shape}, tensor cores: a batch-sized chunk anchor went unseen");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The same on a fixture written by transformers (qwen3-target, loaded with bf16 K/V in the
/// bf16 mode): eight prompts of 40 to 117 tokens alone as in one forward; the control breaks
/// it.
#[test]
fn tensor_core_attention_alone_equals_batched() {
    let numerics = Numerics { kv: KvDtype::Bf16, activations: Activations::Bf16 };
    let model = Model::load_with(&fixture("qwen3-target"), Backend::Cuda, numerics).unwrap();
    let prompts = common::invariance::prompts(&model, 19);
    let (ours, control) = with_split_attention_control(|| {
        last_logits(&model, &prompts, false) == last_logits(&model, &prompts, true)
    });
    assert!(ours, "a query's tensor-core attention bits depend on the batch");
    assert!(!control, "a batch-sized chunk anchor went unnoticed");
}

/// The GPU's logit summaries: each row's argmax and max are the host's exactly (ties to the
/// lowest id, NaN never wins, 0 when nothing beats -inf), its ln-sum-exp within 1e-6 of the
/// host's, and a row's summary bits are the same alone as among 40 rows. Control: the host's
/// ln-sum-exp, summed in another order, must differ from the GPU's in some row's bits (so
/// the bit comparison can see an order change).
#[test]
fn logit_summaries_match_the_host_and_do_not_depend_on_the_batch() {
    use mtp::base::LogitSummary;
    let cuda = Cuda::shared().unwrap();
    let mut rng = Lcg(17);
    let summaries = |x: &[f32], rows: usize, vocab: usize| -> Vec<[u32; 3]> {
        let logits = cuda.upload(x).unwrap();
        let mut out = cuda.alloc(3 * rows).unwrap();
        cuda.logit_summaries(&logits, rows, vocab, &mut out).unwrap();
        cuda.download(out).unwrap().chunks(3).map(|v| [v[0] as u32, v[1].to_bits(), v[2].to_bits()]).collect()
    };
    let mut lse_differs = false;
    for vocab in [151_936usize, 1000, 7] {
        let mut rows: Vec<Vec<f32>> =
            (0..40).map(|_| rng.vec(vocab).iter().map(|v| v * 8.0).collect()).collect();
        let top = rows[1].iter().copied().fold(f32::NEG_INFINITY, f32::max) + 1.0;
        rows[1][vocab / 2] = top; // a tie: the lower id wins
        rows[1][vocab - 1] = top;
        rows[2][0] = f32::NAN; // NaN never wins
        rows[3].iter_mut().for_each(|v| *v = f32::NEG_INFINITY); // nothing beats -inf: id 0
        rows[4][vocab - 1] = top; // the last id
        let flat: Vec<f32> = rows.concat();
        let batched = summaries(&flat, rows.len(), vocab);
        for (r, row) in rows.iter().enumerate() {
            let host = LogitSummary::of(row);
            let [argmax, max, lse] = batched[r];
            let lse = f32::from_bits(lse);
            assert_eq!(
                (argmax, max),
                (host.argmax, host.max.to_bits()),
                "vocab {vocab}, row {r}: argmax, max"
            );
            if r == 2 || r == 3 {
                // A NaN logit, or nothing above -inf: no distribution, on both.
                assert!(
                    lse.is_nan() && host.lse.is_nan(),
                    "vocab {vocab}, row {r}: lse {lse} vs {}",
                    host.lse
                );
                continue;
            }
            assert!(
                (lse - host.lse).abs() <= 1e-6 * host.lse.abs().max(1.0),
                "vocab {vocab}, row {r}: {lse} vs {}",
                host.lse
            );
            lse_differs |= lse.to_bits() != host.lse.to_bits();
            assert_eq!(summaries(row, 1, vocab)[0], batched[r], "vocab {vocab}, row {r}: alone vs among 40");
        }
    }
    assert!(
        lse_differs,
        "the host's sums matched the GPU's bits in every row: the check cannot see an order"
    );
}

/// Running out of device memory for K/V is an error naming the bytes, never a crash, and
/// the cache stays usable.
#[test]
fn device_out_of_memory_is_a_clear_error() {
    let model = Model::load_on(&fixture("qwen3-target"), Backend::Cuda).unwrap();
    let mut cache = model.new_cache();
    let err = cache.try_reserve_window(0, 1 << 40).unwrap_err();
    assert!(err.to_string().contains("out of GPU memory"), "{err}");
    let mut rows = [RowInput {
        tokens: &[5, 6, 7],
        cache: &mut cache,
        logits: Logits::Last,
        full_logits: true,
        hidden: true.into(),
    }];
    assert_eq!(model.forward(&mut rows).unwrap()[0].logits.len(), 1);
}

/// With f32 activations the GPU computes the CPU's function: for f32, bf16 and f16 weights
/// (every widening path of the kernels) and f32 K/V, the logits after a prompt agree within
/// 1e-4 of their scale. With bf16 activations (the default) f32 and f16 weights still do,
/// and bf16 weights' logits move by the rounding: more than 1e-4 of their scale (the
/// rounding happened) and less than 3e-2 (nothing else changed).
#[test]
fn gpu_logits_agree_with_the_cpu_for_every_weight_dtype() {
    for (dtype, worst, scale) in logits_vs_cpu(Backend::Cuda, Activations::F32) {
        assert!(worst <= 1e-4 * scale.max(1.0), "{}: GPU and CPU logits differ by {worst}", dtype.name());
    }
    for (dtype, worst, scale) in logits_vs_cpu(Backend::Cuda, Activations::Bf16) {
        let scale = scale.max(1.0);
        if dtype == WeightDtype::Bf16 {
            assert!(
                worst > 1e-4 * scale && worst <= 3e-2 * scale,
                "bf16 weights, bf16 activations: logits {worst} off the CPU's (scale {scale})"
            );
        } else {
            assert!(worst <= 1e-4 * scale, "{}: bf16 activations changed f32 math by {worst}", dtype.name());
        }
    }
}

/// Each mode computes what it says, on every path (passes, tiles, phase splits): with bf16
/// activations every output is within f32 accumulation error of the f64 sum of
/// bf16(x) w, and far from that of x w; with f32 activations the other way round. So a
/// kernel that skipped the rounding, or rounded in the exact mode, fails.
#[test]
fn each_activation_mode_computes_its_own_function() {
    let mut rng = Lcg(53);
    for (n, k) in [(200, 1056), (4096, 4096)] {
        let w = weight(&mut rng, WeightDtype::Bf16, n, k);
        for m in [1, 40, 129] {
            each_mode_near_its_own_function(&format!("{n}x{k}"), &w, &rng.vec(m * k), m);
        }
    }
}

/// `x (m rows) . w^T` in each mode: within 2e-5 of its own f64 reference (the sum of
/// bf16(x) w with bf16 activations, of x w with f32), relative to the sum of |x w|, and more
/// than 4x as far from the other's.
fn each_mode_near_its_own_function(what: &str, w: &mtp::base::Weight, x: &[f32], m: usize) {
    let (n, k) = (w.rows, w.cols);
    let wf = w.to_f32();
    let round = |v: f32| half::bf16::from_f32(v).to_f32() as f64;
    // Per output: (f64 sum of bf16(x) w, of x w, of |x w|).
    let refs: Vec<(f64, f64, f64)> = (0..m * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            let (xr, wr) = (&x[r * k..(r + 1) * k], &wf[c * k..(c + 1) * k]);
            xr.iter().zip(wr).fold((0.0, 0.0, 0.0), |(a, b, s), (&xv, &wv)| {
                let wv = wv as f64;
                (a + round(xv) * wv, b + xv as f64 * wv, s + (xv as f64 * wv).abs())
            })
        })
        .collect();
    for mode in MODES {
        let cuda = Cuda::shared_with(mode).unwrap();
        let mat = cuda.matrix(w).unwrap();
        let got = common::invariance::product(&*cuda, &mat, n, x, m);
        // The worst distance from each reference, relative to the sum of |terms|.
        let worst = |f: fn(&(f64, f64, f64)) -> f64| {
            got.iter().zip(&refs).map(|(&g, r)| (g as f64 - f(r)).abs() / r.2.max(1e-30)).fold(0.0, f64::max)
        };
        let (to_rounded, to_exact) = (worst(|r| r.0), worst(|r| r.1));
        println!("{what}, M={m}, {mode:?}: {to_rounded:e} from bf16(x) w, {to_exact:e} from x w");
        let (near, far) =
            if mode == Activations::Bf16 { (to_rounded, to_exact) } else { (to_exact, to_rounded) };
        assert!(near < 2e-5, "{what}, M={m}, {mode:?}: {near:e} off its own function");
        assert!(far > 4.0 * near, "{what}, M={m}, {mode:?}: cannot tell the modes apart ({far:e})");
    }
}

/// Every logit of a fixed run of decode and verify steps of the checkpoint at `dir`, as
/// bits: three rows prefilled to 20, 40 and 530 tokens (the last past a 512-key segment, so
/// its decode steps take the split attention launch), six greedy decode steps of all three,
/// four of the first row alone, then three verify steps of `block` tokens a row keeping
/// two (mixed accepts, the window rewritten); if `uneven`, the steps' 3 x `block` tokens
/// split among the rows as block, block, block, then block + 2, block - 1, block - 1, then
/// block + 1, block + 1, block - 2. Each decode and verify shape runs at least three times:
/// eagerly the first time, recorded the second, replayed after. With graphs on, the
/// three-row steps run padded to four rows (the recorded shape), the one-row ones as they are.
fn decode_and_verify_bits(
    dir: &Path,
    batch: usize,
    block: usize,
    uneven: bool,
    graphs: bool,
    control: Control,
) -> Vec<Vec<u32>> {
    Cuda::set_graphs(graphs);
    let model = Model::load_on(dir, Backend::Cuda).unwrap();
    let vocab = model.config.vocab_size;
    let mut rng = Lcg(41);
    let mut caches: Vec<_> = (0..batch).map(|_| model.new_cache()).collect();
    let mut next = Vec::new();
    for (cache, n) in caches.iter_mut().zip([20, 40, 530].into_iter().cycle()) {
        let prompt: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
        let mut rows = [RowInput {
            tokens: &prompt,
            cache,
            logits: Logits::Last,
            full_logits: true,
            hidden: true.into(),
        }];
        next.push(argmax(&model.forward(&mut rows).unwrap()[0].logits[0]));
        cache.commit_window(n);
    }
    mtp::kernels::negative_control::set_stale_replay(control == Control::StaleTables);
    mtp::kernels::negative_control::set_pad_rows_first(control == Control::PadRowsFirst);
    let mut seen = Vec::new();
    for rows_now in [batch, batch, batch, batch, batch, batch, 1, 1, 1, 1] {
        let tokens: Vec<[u32; 1]> = next[..rows_now].iter().map(|&t| [t]).collect();
        let mut rows: Vec<RowInput> = caches[..rows_now]
            .iter_mut()
            .zip(&tokens)
            .map(|(cache, t)| RowInput {
                tokens: t,
                cache,
                logits: Logits::Last,
                full_logits: true,
                hidden: true.into(),
            })
            .collect();
        for (r, out) in model.forward(&mut rows).unwrap().into_iter().enumerate() {
            next[r] = argmax(&out.logits[0]);
            seen.push(common::bits(&out.logits[0]));
            seen.extend(out.summaries.iter().map(summary_bits));
        }
        caches[..rows_now].iter_mut().for_each(|c| c.commit_window(1));
    }
    // Uneven: each step's tokens split differently among the rows (the most a row holds
    // changes; up to 8, one recording serves them all), in threes of rows.
    for spread in spreads(uneven) {
        let blocks: Vec<Vec<u32>> = (0..batch)
            .map(|r| {
                (0..block.checked_add_signed(spread[r % 3]).unwrap())
                    .map(|_| rng.below(vocab) as u32)
                    .collect()
            })
            .collect();
        let mut rows: Vec<RowInput> = caches
            .iter_mut()
            .zip(&blocks)
            .map(|(cache, b)| RowInput {
                tokens: b,
                cache,
                logits: Logits::All,
                full_logits: true,
                hidden: true.into(),
            })
            .collect();
        for out in model.forward(&mut rows).unwrap() {
            seen.extend(out.logits.iter().map(|l| common::bits(l)));
            seen.extend(out.summaries.iter().map(summary_bits));
        }
        caches.iter_mut().for_each(|c| c.commit_window(2));
    }
    mtp::kernels::negative_control::set_stale_replay(false);
    mtp::kernels::negative_control::set_pad_rows_first(false);
    Cuda::set_graphs(true);
    seen
}

/// How [`decode_and_verify_bits`]'s three verify steps move tokens between the rows of
/// each three (none where not `uneven`).
fn spreads(uneven: bool) -> [[isize; 3]; 3] {
    if uneven {
        [[0, 0, 0], [2, -1, -1], [1, 1, -2]]
    } else {
        [[0; 3]; 3]
    }
}

/// The fault [`decode_and_verify_bits`] runs with, if any.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Control {
    None,
    StaleTables,
    PadRowsFirst,
}

fn summary_bits(s: &mtp::base::LogitSummary) -> Vec<u32> {
    vec![s.argmax, s.max.to_bits(), s.lse.to_bits()]
}

fn argmax(logits: &[f32]) -> u32 {
    (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap_or(0) as u32
}

/// A decode or verify forward replayed from its CUDA graph gives every row the bits of the
/// same forward launched kernel by kernel (decode of 3 rows and of 1, the split attention
/// launch past 512 keys, verify blocks after mixed accepts): on the f32 hf-tiny target
/// (CUDA-core matmuls; 15-token verify steps) and on the trained bf16 target (tensor cores;
/// 24-token verify steps, whose 8,192-wide LM head takes a phase-split tile, its scratch
/// allocated inside the recording; 42-token ones, whose matmuls take wgmma on a Hopper, the
/// TMA descriptors naming that scratch; 66-token ones, the most a recording took before was
/// 48; and 15-token ones whose rows' 5-7 tokens share one
/// recording of the tensor-core attention), each three-row step recorded padded to four rows
/// and a multiple of four tokens; 120-token verifies (past the 80 a recording took before
/// the batch buckets); and batches of 10 and 16 rows (decode and verify padded to a
/// multiple of 8 rows, or one more: 98 tokens over 16 rows recorded as 104 over 17),
/// whose recordings write the output set the 3-row ones grew. Controls: replays that do
/// not copy each step's tables into the recording recompute the recorded step, and must
/// differ; so must forwards whose padding rows come before the batch's own.
#[test]
fn graph_replays_give_the_eager_bits_and_stale_tables_do_not() {
    let cases = [
        (fixture("qwen3-target"), 3, 5, false),
        (trained("target"), 3, 5, true),
        (trained("target"), 3, 8, false),
        (trained("target"), 3, 14, false),
        (trained("target"), 3, 22, false),
        (trained("target"), 3, 40, false),
        (trained("target"), 10, 9, true),
        (trained("target"), 16, 6, true),
    ];
    for (dir, batch, block, uneven) in cases {
        let eager = decode_and_verify_bits(&dir, batch, block, uneven, false, Control::None);
        // Each decode step's rows and each verified token give a logits and a summary entry.
        let verified: usize = spreads(uneven)
            .iter()
            .map(|spread| (0..batch).map(|r| block.checked_add_signed(spread[r % 3]).unwrap()).sum::<usize>())
            .sum();
        assert_eq!(eager.len(), 2 * (6 * batch + 4 + verified));
        let name = format!("{} at {batch} rows, {block}-token blocks", dir.display());
        assert!(
            decode_and_verify_bits(&dir, batch, block, uneven, true, Control::None) == eager,
            "{name}: a replayed forward changed some row's bits"
        );
        assert!(
            decode_and_verify_bits(&dir, batch, block, uneven, true, Control::StaleTables) != eager,
            "{name}: replays with stale tables went unnoticed"
        );
        assert!(
            decode_and_verify_bits(&dir, batch, block, uneven, true, Control::PadRowsFirst) != eager,
            "{name}: padding rows before the batch's own went unnoticed"
        );
    }
}
