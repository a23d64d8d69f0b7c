//! Tensor parallelism (`--tensor-parallel N`): the model split between N ranks (threads on
//! the CPU; GPUs over NCCL with `MTP_TEST_BACKEND=cuda`, `scripts/gpu-run.sh tp`) computes
//! the whole model's function up to float rounding, and within one rank count every row
//! stays invariant, bit for bit: batched == alone, decode == prefill of
//! any chunking, speculative == plain after mixed accepts. The negative controls prove the
//! checks can fail: a reduction whose order follows the token count breaks batched ==
//! alone, and a rollback that skips compaction in the ranks' stores breaks speculative ==
//! plain.

mod common;

use std::sync::Arc;

use common::invariance::{cache_bytes, last_logits, prompts, run_chunked};
use common::{bits, first_difference, fixture, plain, request, run, trained, Lcg};
use mtp::drafter::{DraftModelDrafter, Drafter, NgramDrafter};
use mtp::engine::{DraftLen, EngineOptions, Request, WindowLayout};
use mtp::kernels::{negative_control, Activations, Backend, Kernels, KvDtype, Numerics};
use mtp::model::{Logits, Model, RowInput};

/// The Gemma 4 fixtures that split between 2 ranks: sliding windows, KV-shared layers and
/// per-layer inputs (E), routed experts (MoE). (The dense fixture's full layers have one
/// K/V head: refused below.)
const GEMMA4: [&str; 2] = ["gemma4-e-target", "gemma4-moe-target"];

fn gemma4(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4").join(name)
}

/// `dir` on `ranks` ranks of the test backend, in its default numerics.
fn load(dir: &std::path::Path, ranks: usize) -> Model {
    load_with(dir, ranks, KvDtype::Auto.into())
}

fn load_with(dir: &std::path::Path, ranks: usize, numerics: Numerics) -> Model {
    Model::load_parallel(dir, common::backend(), numerics, ranks)
        .unwrap_or_else(|e| panic!("{} on {ranks} ranks: {e}", dir.display()))
}

/// Every token's logits of `seq` fed in pieces of `chunks` (cycled), and the final K/V.
fn chunked(model: &Model, seq: &[u32], chunks: &[usize]) -> (Vec<Vec<u32>>, Vec<u8>) {
    let (logits, cache) = run_chunked(model, seq, chunks);
    (logits, cache_bytes(&cache))
}

/// Whether `prompts`' last logits are the same alone and in one batch: on the model as it
/// is, then with the reduction ordered by the token count (the control).
fn batch_invariance_and_control(model: &Model, prompts: &[Vec<u32>]) -> (bool, bool) {
    let check = || last_logits(model, prompts, false) == last_logits(model, prompts, true);
    let ours = check();
    negative_control::set_token_ordered_reduction(true);
    let control = check();
    negative_control::set_token_ordered_reduction(false);
    (ours, control)
}

/// The largest difference between the last logits of `whole` and `split` on `prompts`, the
/// logits' scale, and whether any bit differs.
fn split_vs_whole(whole: &Model, split: &Model, prompts: &[Vec<u32>]) -> (f32, f32, bool) {
    let (a, b) = (last_logits(whole, prompts, true), last_logits(split, prompts, true));
    let (mut worst, mut scale, mut differ) = (0f32, 0f32, false);
    for (&x, &y) in a.iter().flatten().zip(b.iter().flatten()) {
        let (x, y) = (f32::from_bits(x), f32::from_bits(y));
        worst = worst.max((x - y).abs());
        scale = scale.max(x.abs());
        differ |= x.to_bits() != y.to_bits();
    }
    (worst, scale, differ)
}

#[test]
fn ranks_compute_the_whole_models_function() {
    let mut dirs =
        vec![fixture("llama-target"), fixture("qwen2-target"), fixture("qwen3-target"), trained("target")];
    dirs.extend(GEMMA4.map(gemma4));
    for dir in dirs {
        // f32 everywhere (on CUDA too), so rounding is the reduction's alone.
        let exact = Numerics { kv: KvDtype::F32, activations: Activations::F32 };
        let whole = load_with(&dir, 1, exact);
        let split = load_with(&dir, 2, exact);
        assert_eq!(split.tensor_parallel(), 2);
        let (worst, scale, differ) = split_vs_whole(&whole, &split, &prompts(&whole, 5));
        // The ranks' partial sums round differently from one whole sum, and only that.
        assert!(worst <= 1e-5 * scale.max(1.0), "{}: off by {worst} at scale {scale}", dir.display());
        assert!(
            differ,
            "{}: two ranks gave the whole model's bits: is the model split at all?",
            dir.display()
        );
    }
}

#[test]
fn rows_on_ranks_are_batch_and_chunking_invariant() {
    let dirs = [fixture("llama-target"), fixture("qwen3-target")].into_iter().chain(GEMMA4.map(gemma4));
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let model = load(&dir, 2);
        let (ours, control) = batch_invariance_and_control(&model, &prompts(&model, 17));
        assert!(ours, "{name}: a row's logits changed with the batch on 2 ranks");
        if name.starts_with("gemma4") {
            // Gemma 4 norms o's and down's outputs before the residual, so two ranks' parts
            // are summed from zero: p0 + p1 == p1 + p0 in any order, and the control cannot
            // bite at 2 ranks (the Llama path adds them into the residual, where it does).
            assert!(control, "{name}: two parts summed from zero differ by order");
        } else {
            assert!(!control, "{name}: a reduction ordered by token count went unnoticed");
        }

        let mut rng = Lcg(3);
        let seq: Vec<u32> = (0..37).map(|_| rng.below(model.config.vocab_size) as u32).collect();
        let one_by_one = chunked(&model, &seq, &[1]);
        for chunks in [&[37][..], &[5], &[3, 17, 2]] {
            assert!(chunked(&model, &seq, chunks) == one_by_one, "{name}: chunks {chunks:?} changed bits");
        }
    }
}

/// A synthesized Qwen3 of 8 query and 4 K/V heads (bf16, 2 layers), whole and on 4 ranks,
/// where the partial sums of four ranks are added in rank order. CPU threads on every
/// backend's run: no machine with 4 GPUs was lent.
#[test]
fn four_ranks_keep_rows_invariant() {
    let load =
        |dir: &std::path::Path, ranks| Model::load_parallel(dir, Backend::Cpu, KvDtype::F32, ranks).unwrap();
    let load_with = |dir: &std::path::Path, ranks, numerics: Numerics| {
        Model::load_parallel(dir, Backend::Cpu, numerics, ranks).unwrap()
    };
    let dir = std::env::temp_dir().join(format!("mtp-tp4-{}", std::process::id()));
    let mut s = mtp::synth::SynthSpec::preset("qwen3").unwrap();
    (s.vocab_size, s.hidden_size, s.num_hidden_layers) = (512, 256, 2);
    (s.num_attention_heads, s.num_key_value_heads, s.head_dim, s.intermediate_size) = (8, 4, 32, 512);
    (s.max_position_embeddings, s.dtype, s.seed) = (256, mtp::base::WeightDtype::Bf16, 9);
    s.write(&dir).unwrap();
    // f32 activations for the control: bf16 mode (the default where the CPU has AVX512-BF16)
    // rounds every matmul's input to 8 bits, which can hide a reordered sum's last bits.
    let exact = Numerics { kv: KvDtype::F32, activations: Activations::F32 };
    let model = load_with(&dir, 4, exact);
    let prompts = prompts(&model, 29);
    let (ours, control) = batch_invariance_and_control(&model, &prompts);
    assert!(ours, "a row's logits changed with the batch on 4 ranks");
    assert!(!control, "a reduction ordered by token count went unnoticed on 4 ranks");
    let (ours, _) = batch_invariance_and_control(&load(&dir, 4), &prompts);
    assert!(ours, "a row's logits changed with the batch on 4 ranks (default activations)");
    let (whole, split) = (load_with(&dir, 1, exact), load_with(&dir, 4, exact));
    let (worst, scale, _) = split_vs_whole(&whole, &split, &prompts);
    assert!(worst <= 1e-5 * scale.max(1.0), "4 ranks off by {worst} at scale {scale}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `add_parts` is the rank-ordered reference, bit for bit: `x + p0 + p1 + ...` folded one
/// rank after another on the host, on every backend; the control's reversed order is the
/// reversed fold, and the two differ (the order is visible in the bits). `concat_columns`
/// lays the ranks' vocabulary blocks side by side.
fn reduction_is_the_rank_ordered_fold<K: Kernels>(k: &K) {
    let mut rng = Lcg(41);
    let (n, len) = (4, 3000);
    let x: Vec<f32> = rng.vec(len).iter().map(|v| v * 1e3).collect();
    let parts: Vec<f32> = (0..n * len).map(|i| rng.f32() * 10f32.powi((i % 7) as i32 - 3)).collect();
    let fold = |order: &[usize]| -> Vec<f32> {
        (0..len).map(|i| order.iter().fold(x[i], |a, &r| a + parts[r * len + i])).collect()
    };
    let mut got = Vec::new();
    for (reversed, order) in [(false, [0, 1, 2, 3]), (true, [3, 2, 1, 0])] {
        let mut xd = k.upload(&x).unwrap();
        k.add_parts(&mut xd, &k.upload(&parts).unwrap(), n, reversed).unwrap();
        let sum = k.download(xd).unwrap();
        assert_eq!(bits(&sum), bits(&fold(&order)), "add_parts (reversed: {reversed}) is not the fold");
        got.push(sum);
    }
    assert_ne!(bits(&got[0]), bits(&got[1]), "the order of the parts left no trace: the test cannot tell");
    let (m, w) = (3, 5);
    let blocks: Vec<f32> = (0..n * m * w).map(|i| i as f32).collect();
    let mut out = k.alloc(m * n * w).unwrap();
    k.concat_columns(&k.upload(&blocks).unwrap(), n, w, m, &mut out).unwrap();
    let out = k.download(out).unwrap();
    for t in 0..m {
        for r in 0..n {
            for j in 0..w {
                assert_eq!(out[t * n * w + r * w + j], blocks[(r * m + t) * w + j]);
            }
        }
    }
}

#[test]
fn the_reduction_is_the_rank_ordered_reference() {
    reduction_is_the_rank_ordered_fold(&mtp::kernels::cpu::Cpu::default());
    #[cfg(feature = "cuda")]
    if common::backend() == Backend::Cuda {
        reduction_is_the_rank_ordered_fold(&*mtp::cuda::Cuda::shared().unwrap());
    }
}

fn workload(vocab: usize) -> (Vec<Request>, Vec<u64>) {
    let mut rng = Lcg(23);
    let requests = (0..6)
        .map(|i| {
            // Repetitive prompts, so n-gram lookup drafts too.
            let base: Vec<u32> = (0..5).map(|_| rng.below(vocab) as u32).collect();
            let prompt = base.iter().cycle().take(9 + 4 * i).copied().collect();
            request(&format!("r{i}"), prompt, 12 + 3 * i)
        })
        .collect();
    (requests, vec![0, 0, 1, 3, 3, 6])
}

#[test]
fn speculation_on_ranks_equals_plain_decoding() {
    let model = Arc::new(load(&fixture("qwen3-target"), 2));
    let draft =
        Arc::new(Model::load_with(&fixture("qwen3-draft"), common::backend(), model.numerics()).unwrap());
    let vocab = model.config.vocab_size;
    let (requests, arrive_at) = workload(vocab);
    let reference: Vec<_> = plain(&model, &requests, 1).into_iter().map(|r| r.unwrap()).collect();
    // Prompts go in beside verifies (at least 4 tokens a round), so rows of different
    // lengths verify together: shared window slots leave holes.
    let opts = |layout| EngineOptions {
        k: DraftLen::Fixed(3),
        max_batch: 4,
        prefill_chunk: 8,
        layout,
        ..EngineOptions::default()
    };
    let drafter = |kind: &str| -> Box<dyn Drafter> {
        match kind {
            "draft-model" => Box::new(DraftModelDrafter::new(draft.clone(), &model).unwrap()),
            "ngram" => Box::new(NgramDrafter::new(1, 3).unwrap()),
            _ => Box::new(common::oracle(&requests, &reference, vocab)),
        }
    };
    for kind in ["oracle", "draft-model", "ngram"] {
        for layout in [WindowLayout::RowTail, WindowLayout::SharedSlots] {
            let got = run(&model, Some(drafter(kind)), opts(layout), &requests, &arrive_at);
            assert_eq!(first_difference(&got, &reference), None, "{kind} {layout:?} on 2 ranks");
        }
    }
    mtp::cache::negative_control::set_skip_compaction(true);
    let got = run(&model, Some(drafter("oracle")), opts(WindowLayout::SharedSlots), &requests, &arrive_at);
    mtp::cache::negative_control::set_skip_compaction(false);
    assert!(first_difference(&got, &reference).is_some(), "ranks that skip compaction went unnoticed");
}

/// Gemma 4 on two ranks: rollback after mixed accepts in the sliding layers' rings and the
/// full layers' stores of both ranks, routed experts split by columns.
#[test]
fn gemma4_speculation_on_ranks_equals_plain_decoding() {
    for name in GEMMA4 {
        let model = load(&gemma4(name), 2);
        let vocab = model.config.vocab_size;
        let (requests, arrive_at) = workload(vocab);
        let reference: Vec<_> = plain(&model, &requests, 1).into_iter().map(|r| r.unwrap()).collect();
        for layout in [WindowLayout::RowTail, WindowLayout::SharedSlots] {
            let opts = EngineOptions {
                k: DraftLen::Fixed(3),
                max_batch: 4,
                prefill_chunk: 4,
                layout,
                ..EngineOptions::default()
            };
            let oracle = Box::new(common::oracle(&requests, &reference, vocab));
            let got = run(&model, Some(oracle), opts, &requests, &arrive_at);
            assert_eq!(first_difference(&got, &reference), None, "{name} {layout:?} on 2 ranks");
        }
    }
}

/// The trained target's own MTP head (MiMo layout), split with its target: drafting with
/// it on two ranks gives plain decoding's bits on two ranks.
#[test]
fn an_mtp_head_on_ranks_drafts_losslessly() {
    let model = Arc::new(load(&trained("target"), 2));
    let vocab = model.config.vocab_size;
    let (requests, arrive_at) = workload(vocab);
    let reference: Vec<_> = plain(&model, &requests, 1).into_iter().map(|r| r.unwrap()).collect();
    let opts =
        EngineOptions { k: DraftLen::Fixed(3), max_batch: 4, prefill_chunk: 4, ..EngineOptions::default() };
    let head = mtp::drafter::MtpDrafter::load(&trained("target"), model.clone()).unwrap();
    let mut engine = mtp::engine::Engine::new(&model, Some(Box::new(head)), opts).unwrap();
    let got = mtp::engine::generate(&mut engine, &requests, &arrive_at, |_, _| {});
    assert_eq!(first_difference(&got, &reference), None, "the MTP head on 2 ranks");
    assert!(engine.stats().accepted > 0, "the head's drafts were never accepted: did it draft at all?");
}

#[test]
fn splits_the_model_cannot_take_are_refused_by_name() {
    let err = |dir: std::path::PathBuf, ranks: usize| {
        Model::load_parallel(&dir, Backend::Cpu, KvDtype::F32, ranks).err().expect("refused").to_string()
    };
    let e = err(fixture("qwen3-target"), 3);
    assert!(e.contains("--tensor-parallel 3") && e.contains("num_attention_heads"), "{e}");
    let e = err(fixture("qwen3-target"), 4);
    assert!(e.contains("num_key_value_heads (2)"), "{e}");
    let e = err(fixture("qwen3-target"), 0);
    assert!(e.contains("--tensor-parallel 0"), "{e}");
    let e = err(gemma4("gemma4-dense-target"), 2);
    assert!(e.contains("layer 2's K/V heads (1)"), "{e}");
    // Gemma 4's assistant reads its target's K/V whole: refused on a split target.
    let target = Arc::new(load(&gemma4("gemma4-e-target"), 2));
    let e =
        mtp::model::models::gemma4::assistant::Gemma4Assistant::load(&gemma4("gemma4-e-assistant"), target)
            .err()
            .expect("refused")
            .to_string();
    assert!(e.contains("assistant does not draft for a target split"), "{e}");
    // A bad request fails alone, before any rank waits on another: the model goes on.
    let model = load(&fixture("qwen3-target"), 2);
    let mut cache = model.new_cache();
    let bad = [model.config.vocab_size as u32];
    let mut rows = [RowInput {
        tokens: &bad,
        cache: &mut cache,
        logits: Logits::Last,
        full_logits: true,
        hidden: true.into(),
    }];
    let e = model.forward(&mut rows).expect_err("refused").to_string();
    assert!(e.contains("row 0") && e.contains("outside the vocabulary"), "{e}");
    let mut rows = [RowInput {
        tokens: &[1, 2, 3],
        cache: &mut cache,
        logits: Logits::Last,
        full_logits: true,
        hidden: true.into(),
    }];
    assert_eq!(model.forward(&mut rows).unwrap()[0].logits[0].len(), model.config.vocab_size);
    // A cache another model made is refused by name.
    let mut foreign = Model::load_on(&fixture("qwen3-target"), common::backend()).unwrap().new_cache();
    let mut rows = [RowInput {
        tokens: &[1],
        cache: &mut foreign,
        logits: Logits::Last,
        full_logits: true,
        hidden: true.into(),
    }];
    let e = model.forward(&mut rows).expect_err("refused").to_string();
    assert!(e.contains("not made by this 2-rank model"), "{e}");
}
