//! The parity gate. For every hf-tiny target and the trained family, every drafter kind,
//! k in {1, 3, 5} and max batch in {1, 3, 8}, with staggered arrivals: tokens and logprobs
//! are bitwise those of plain decoding of each request alone, greedy and sampled (exact
//! mode; the sampled workload mixes temperatures, top-k, top-p, min-p, seeds and greedy
//! rows). In rejection mode each row is bitwise the same alone and in batches. Decode
//! equals prefill: a fresh prefill of prompt + tokens so far gives each token's logprob bit
//! for bit. Negative controls: a rollback that skips compaction, RoPE at physical slots and
//! a stream (draw-count keyed) random generator must each break the gate.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{bits, fixture, plain, request, run, trained};
use mtp::bench::same;
use mtp::drafter::{DraftModelDrafter, Drafter, MtpDrafter, NgramDrafter};
use mtp::engine::{
    prefill, Completion, DraftLen, EngineOptions, Request, SamplingMode, SamplingParams, WindowLayout,
};
use mtp::kernels::{Activations, Backend, KvDtype, Numerics};
use mtp::model::{Model, MtpLayout};
use mtp::synth::SynthSpec;

const TARGETS: [(&str, &str); 3] =
    [("llama-target", "llama-draft"), ("qwen2-target", "qwen2-draft"), ("qwen3-target", "qwen3-draft")];
const DRAFTERS: [&str; 5] = ["draft-model", "mtp-mimo", "mtp-deepseek", "ngram", "oracle"];

/// Eight requests of different lengths; some stop at EOS, so rows retire at different
/// rounds. Returns them with their arrival rounds. `sampled` gives each request its own
/// sampling parameters and seed (one row stays greedy).
fn workload(sampled: bool) -> (Vec<Request>, Vec<u64>) {
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("qwen3-target").join("golden.json")).unwrap())
            .unwrap();
    let mut prompts: Vec<Vec<u32>> = golden["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect())
        .collect();
    prompts.push(vec![7, 8, 9, 7, 8, 9, 7, 8]);
    prompts.push((0..40).map(|i| 3 + (i * 37) % 500).collect());
    prompts.push(vec![300]);
    prompts.push(vec![11, 12, 13, 14, 11, 12]);
    let requests = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| Request {
            ignore_eos: i % 3 != 2,
            sampling: if sampled { sampling_for(i) } else { SamplingParams::default() },
            ..request(&format!("r{i}"), p, 10 + 3 * i)
        })
        .collect();
    (requests, vec![0, 0, 1, 2, 3, 5, 8, 13])
}

/// Request `i`'s sampling: temperatures 0.7 to 1.5 with each filter on in some rows.
fn sampling_for(i: usize) -> SamplingParams {
    let temperature = [0.7, 1.0, 1.5, 0.0][i % 4];
    SamplingParams {
        temperature,
        top_k: [0, 40, 0, 5][i % 4],
        top_p: [1.0, 0.9, 0.95, 1.0][(i / 2) % 4],
        min_p: if i % 3 == 1 { 0.05 } else { 0.0 },
        seed: 1000 + i as u64,
    }
}

/// A fresh random MTP head for `target`, in a directory no other test uses (the loader
/// mmaps it).
fn mtp_dir(tag: &str, target: &Path, layout: MtpLayout) -> PathBuf {
    let name = target.file_name().unwrap().to_string_lossy();
    let name = format!("mtp-parity-{}-{tag}-{name}-{}", std::process::id(), layout.name());
    let dir = std::env::temp_dir().join(name);
    SynthSpec::write_mtp_head(target, layout, &dir, 5).unwrap();
    dir
}

struct Target {
    model: Arc<Model>,
    draft: Arc<Model>,
    mimo: PathBuf,
    deepseek: PathBuf,
    /// Head directories this test wrote (removed by `clean_up`).
    written: Vec<PathBuf>,
    requests: Vec<Request>,
    arrive_at: Vec<u64>,
    reference: Vec<Completion>,
}

impl Target {
    /// An hf-tiny target with its draft model and random MTP heads in both layouts.
    fn load(tag: &str, name: &str, draft: &str, sampled: bool) -> Target {
        let (mimo, deepseek) = (
            mtp_dir(tag, &fixture(name), MtpLayout::MiMo),
            mtp_dir(tag, &fixture(name), MtpLayout::DeepSeek),
        );
        let written = vec![mimo.clone(), deepseek.clone()];
        Target::from_dirs(&fixture(name), &fixture(draft), mimo, deepseek, written, sampled, KvDtype::Auto)
    }

    /// The trained family: its own draft model and MTP head (MiMo, inside the target), and
    /// a random DeepSeek-layout head.
    fn trained(tag: &str, sampled: bool) -> Target {
        let target = trained("target");
        let deepseek = mtp_dir(tag, &target, MtpLayout::DeepSeek);
        let written = vec![deepseek.clone()];
        Target::from_dirs(
            &target,
            &trained("draft"),
            target.clone(),
            deepseek,
            written,
            sampled,
            KvDtype::Auto,
        )
    }

    /// An MLX-quantized target (`tests/fixtures/mlx`): `draft` and `mimo` given (the trained
    /// family's own bf16 head reads a 4-bit target), a random DeepSeek-layout head.
    fn quantized(
        tag: &str,
        target: &Path,
        draft: &Path,
        mimo: Option<PathBuf>,
        sampled: bool,
        kv: KvDtype,
    ) -> Target {
        let target = target.to_path_buf();
        let deepseek = mtp_dir(tag, &target, MtpLayout::DeepSeek);
        let mut written = vec![deepseek.clone()];
        let mimo = mimo.unwrap_or_else(|| {
            let dir = mtp_dir(tag, &target, MtpLayout::MiMo);
            written.push(dir.clone());
            dir
        });
        Target::from_dirs(&target, draft, mimo, deepseek, written, sampled, kv)
    }

    fn from_dirs(
        target: &Path,
        draft: &Path,
        mimo: PathBuf,
        deepseek: PathBuf,
        written: Vec<PathBuf>,
        sampled: bool,
        kv: KvDtype,
    ) -> Target {
        let numerics = Numerics { kv, activations: common::test_activations() };
        let model = Arc::new(Model::load_with(target, common::backend(), numerics).unwrap());
        let (requests, arrive_at) = workload(sampled);
        // The reference: plain decoding, each request alone.
        let reference = plain(&model, &requests, 1).into_iter().map(|r| r.unwrap()).collect();
        Target {
            draft: Arc::new(common::load(draft)),
            mimo,
            deepseek,
            written,
            model,
            requests,
            arrive_at,
            reference,
        }
    }

    fn drafter(&self, kind: &str) -> Box<dyn Drafter + 'static> {
        match kind {
            "draft-model" => Box::new(DraftModelDrafter::new(self.draft.clone(), &self.model).unwrap()),
            "mtp-mimo" => Box::new(MtpDrafter::load(&self.mimo, self.model.clone()).unwrap()),
            "mtp-deepseek" => Box::new(MtpDrafter::load(&self.deepseek, self.model.clone()).unwrap()),
            "ngram" => Box::new(NgramDrafter::new(1, 3).unwrap()),
            "oracle" => {
                Box::new(common::oracle(&self.requests, &self.reference, self.model.config.vocab_size))
            }
            other => panic!("unknown drafter {other}"),
        }
    }

    /// Runs the workload with staggered arrivals; returns the first difference from the
    /// reference, if any, and the engine's (drafted, accepted) counts.
    fn check(&self, drafter: Option<&str>, opts: EngineOptions) -> (Option<String>, (u64, u64)) {
        let (got, counts) = self.generate(drafter, opts);
        (first_difference(got, &self.reference), counts)
    }

    fn clean_up(&self) {
        for p in &self.written {
            std::fs::remove_dir_all(p).ok();
        }
    }

    fn generate(&self, drafter: Option<&str>, opts: EngineOptions) -> (Vec<Completion>, (u64, u64)) {
        let mut engine =
            mtp::engine::Engine::new(&self.model, drafter.map(|d| self.drafter(d)), opts).unwrap();
        let got = mtp::engine::generate(&mut engine, &self.requests, &self.arrive_at, |_, _| {});
        let got = got.into_iter().map(|g| g.expect("no request fails")).collect();
        (got, (engine.stats().drafted, engine.stats().accepted))
    }
}

/// The first request whose tokens, logprob bits or finish reason differ, if any.
fn first_difference(got: Vec<Completion>, reference: &[Completion]) -> Option<String> {
    let i = got.iter().zip(reference).position(|(g, want)| !same(g, want))?;
    let (g, want) = (&got[i], &reference[i]);
    Some(format!("request {i}: got {:?} {:?}, want {:?} {:?}", g.tokens, g.finish, want.tokens, want.finish))
}

fn opts(k: usize, max_batch: usize, layout: WindowLayout) -> EngineOptions {
    with_k(DraftLen::Fixed(k), max_batch, layout)
}

fn with_k(k: DraftLen, max_batch: usize, layout: WindowLayout) -> EngineOptions {
    EngineOptions { k, max_batch, prefill_chunk: 4, layout, ..EngineOptions::default() }
}

fn gate(target: &str, draft: &str, sampled: bool) {
    let t = Target::load(if sampled { "sampled" } else { "gate" }, target, draft, sampled);
    gate_on(&t, target);
}

fn gate_on(t: &Target, target: &str) {
    assert!(
        t.reference.iter().any(|c| c.tokens.len() >= 10),
        "{target}: reference too short to test anything"
    );
    for max_batch in [3, 8] {
        let (diff, _) = t.check(None, opts(0, max_batch, WindowLayout::RowTail));
        assert_eq!(diff, None, "{target}: plain decoding, max batch {max_batch}");
    }
    // Adaptive k changes k per row and round (from timings, so differently every run).
    let ks = [DraftLen::Fixed(1), DraftLen::Fixed(3), DraftLen::Fixed(5), DraftLen::Adaptive(5)];
    for (i, kind) in DRAFTERS.into_iter().enumerate() {
        let mut totals = (0, 0);
        for (k, max_batch) in common::gate_settings(i, &ks) {
            let layout = if max_batch == 8 { WindowLayout::SharedSlots } else { WindowLayout::RowTail };
            let (diff, (d, a)) = t.check(Some(kind), with_k(k, max_batch, layout));
            assert_eq!(diff, None, "{target}: drafter {kind}, k {k:?}, max batch {max_batch}");
            totals = (totals.0 + d, totals.1 + a);
        }
        eprintln!("{target} {kind}: drafted {}, accepted {}", totals.0, totals.1);
        assert!(totals.0 > 0 || kind == "ngram", "{target} {kind}: nothing was drafted");
        if kind == "oracle" {
            assert!(totals.1 > 0 && totals.1 < totals.0, "{target}: the oracle must force mixed accepts");
        }
    }
    t.clean_up();
}

#[test]
fn gate_llama() {
    gate(TARGETS[0].0, TARGETS[0].1, false);
}

#[test]
fn gate_llama_sampled() {
    gate(TARGETS[0].0, TARGETS[0].1, true);
}

#[test]
fn gate_qwen2() {
    gate(TARGETS[1].0, TARGETS[1].1, false);
}

#[test]
fn gate_qwen2_sampled() {
    gate(TARGETS[1].0, TARGETS[1].1, true);
}

#[test]
fn gate_qwen3() {
    gate(TARGETS[2].0, TARGETS[2].1, false);
}

#[test]
fn gate_qwen3_sampled() {
    gate(TARGETS[2].0, TARGETS[2].1, true);
}

#[test]
fn gate_trained_family() {
    gate_on(&Target::trained("gate", false), "trained");
}

#[test]
fn gate_trained_family_sampled() {
    gate_on(&Target::trained("sampled", true), "trained");
}

fn mlx(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name)
}

#[test]
fn gate_qwen3_4bit() {
    let t = Target::quantized("q4", &mlx("qwen3-q4g32"), &fixture("qwen3-draft"), None, false, KvDtype::Auto);
    gate_on(&t, "qwen3-q4g32");
}

#[test]
fn gate_qwen3_4bit_sampled() {
    let t = Target::quantized("q4s", &mlx("qwen3-q4g32"), &fixture("qwen3-draft"), None, true, KvDtype::Auto);
    gate_on(&t, "qwen3-q4g32");
}

/// A llama.cpp GGUF (hf-tiny's qwen3 at Q4_0 with BF16, F16 and Q8_0 tensors, repacked at
/// load); its MTP heads are made for hf-tiny's qwen3, whose shape it has.
#[test]
fn gate_qwen3_gguf() {
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/qwen3-mixed.gguf");
    let shape = fixture("qwen3-target");
    let (mimo, deepseek) =
        (mtp_dir("gguf", &shape, MtpLayout::MiMo), mtp_dir("gguf", &shape, MtpLayout::DeepSeek));
    let written = vec![mimo.clone(), deepseek.clone()];
    let t = Target::from_dirs(&file, &fixture("qwen3-draft"), mimo, deepseek, written, false, KvDtype::Auto);
    gate_on(&t, "qwen3-mixed.gguf");
}

#[test]
fn gate_qwen3_mxfp4() {
    let t =
        Target::quantized("mx4", &mlx("qwen3-mxfp4"), &fixture("qwen3-draft"), None, false, KvDtype::Auto);
    gate_on(&t, "qwen3-mxfp4");
}

#[test]
fn gate_qwen2_mixed_bits() {
    let t = Target::quantized(
        "q4m",
        &mlx("qwen2-q4g32-mixed"),
        &fixture("qwen2-draft"),
        None,
        false,
        KvDtype::Auto,
    );
    gate_on(&t, "qwen2-mixed");
}

#[test]
fn gate_trained_family_4bit_target_8bit_kv() {
    let t = Target::quantized(
        "q4t",
        &mlx("trained-q4g64"),
        &trained("draft"),
        Some(trained("target")),
        false,
        KvDtype::Q8,
    );
    gate_on(&t, "trained-q4g64");
}

/// MLX 4- and 8-bit targets with their scales and biases in bf16, as mlx-lm writes a bf16
/// model's: on CUDA in bf16 mode (the default) their matmuls take the tensor cores
/// (`linear_tcq`), elsewhere the f32 path; the gate holds on each.
#[test]
fn gate_qwen3_bf16_scales() {
    for name in ["qwen3-q4g32", "qwen3-q8g64"] {
        let dir = common::with_bf16_scales(&mlx(name), &format!("parity-{name}-bf16-scales"));
        let t = Target::quantized("qb", &dir, &fixture("qwen3-draft"), None, false, KvDtype::Auto);
        // The model reports its embedding's path; qwen3-q8g64's embedding (K = 96, not a
        // multiple of its group) stays unquantized, its down projections take the tensor cores.
        let embedding_quantized = name == "qwen3-q4g32";
        if embedding_quantized
            && common::backend() == Backend::Cuda
            && common::test_activations() != Activations::F32
        {
            assert_eq!(
                t.model.numerics().activations,
                Activations::Bf16,
                "{name}: bf16-scaled weights should take CUDA's tensor cores"
            );
        }
        gate_on(&t, &format!("{name}, bf16 scales"));
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// bf16 K/V on request (on the GPUs also the default for 16-bit checkpoints; this fixture
/// is f32, so the test backend's default would keep f32).
#[test]
fn gate_qwen3_bf16_kv() {
    let t = Target::quantized(
        "kvbf",
        &fixture("qwen3-target"),
        &fixture("qwen3-draft"),
        None,
        false,
        KvDtype::Bf16,
    );
    gate_on(&t, "qwen3 bf16 kv");
}

#[test]
fn gate_qwen3_4bit_kv() {
    let t =
        Target::quantized("kv4", &fixture("qwen3-target"), &fixture("qwen3-draft"), None, false, KvDtype::Q4);
    gate_on(&t, "qwen3 kv4");
}

#[test]
fn gate_llama_8bit_kv_sampled() {
    let t =
        Target::quantized("kv8s", &fixture("llama-target"), &fixture("llama-draft"), None, true, KvDtype::Q8);
    gate_on(&t, "llama kv8");
}

#[test]
fn decode_equals_prefill() {
    for (name, _) in TARGETS {
        let model = common::load(&fixture(name));
        let (requests, _) = workload(true);
        for (r, c) in requests.iter().zip(plain(&model, &requests, 8)) {
            let c = c.unwrap();
            for j in 0..c.tokens.len() {
                let seq: Vec<u32> = r.prompt.iter().chain(&c.tokens[..j]).copied().collect();
                let mut cache = model.new_cache();
                let p = prefill(&model, &mut cache, &seq, 7, false, true).unwrap();
                assert_eq!(
                    p.summary.logprob(p.logits[c.tokens[j] as usize]).to_bits(),
                    c.logprobs[j].to_bits(),
                    "{name} {}: token {j} logprob differs between decode and prefill",
                    r.id
                );
            }
        }
    }
}

/// The gate run with each fault turned on must fail; with shared slots and no fault it
/// passes, so the compaction it exercises is real.
#[test]
fn negative_controls_break_the_gate() {
    let t = Target::load("controls", "qwen3-target", "qwen3-draft", false);
    let shared = opts(3, 8, WindowLayout::SharedSlots);
    assert_eq!(t.check(Some("oracle"), shared.clone()).0, None, "shared slots with compaction must pass");

    mtp::cache::negative_control::set_skip_compaction(true);
    let (no_compaction, _) = t.check(Some("oracle"), shared.clone());
    mtp::cache::negative_control::set_skip_compaction(false);
    assert!(no_compaction.is_some(), "the gate missed a rollback that leaves holes uncompacted");

    mtp::kernels::negative_control::set_physical_rope(true);
    let (physical, _) = t.check(Some("oracle"), shared);
    mtp::kernels::negative_control::set_physical_rope(false);
    assert!(physical.is_some(), "the gate missed RoPE at physical slots");
    eprintln!("no compaction: {}\nphysical rope: {}", no_compaction.unwrap(), physical.unwrap());
    t.clean_up();
}

#[test]
fn plain_run_helper_matches_engine() {
    // `run` with no drafter is the same loop as `plain`: a sanity check of the helpers.
    let model = common::load(&fixture("llama-draft"));
    let (requests, arrive_at) = workload(false);
    let a = plain(&model, &requests, 2);
    let b = run(&model, None, opts(4, 5, WindowLayout::SharedSlots), &requests, &arrive_at);
    for (x, y) in a.iter().zip(&b) {
        let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
        assert_eq!((&x.tokens, bits(&x.logprobs)), (&y.tokens, bits(&y.logprobs)));
    }
}

/// Rejection mode: every row alone equals the same row in batches of 3 and 8 (both
/// layouts), for every drafter and k; greedy rows equal plain decoding.
#[test]
fn rejection_rows_are_batch_invariant() {
    let t = Target::load("rejection", "qwen3-target", "qwen3-draft", true);
    // The GPUs' verify token cost: on the CPU's own (a token a decode step) adaptive rows
    // would not draft, and their invariance would go untested.
    let rejection = |k, max_batch, layout| EngineOptions {
        sampling_mode: SamplingMode::Rejection,
        verify_token_cost: Some(0.2),
        ..with_k(k, max_batch, layout)
    };
    let mut judged = 0;
    for kind in DRAFTERS {
        // Adaptive k for rejection rows follows each row's own history only.
        for k in [DraftLen::Fixed(1), DraftLen::Fixed(4), DraftLen::Adaptive(4)] {
            let (alone, (drafted, _)) = t.generate(Some(kind), rejection(k, 1, WindowLayout::RowTail));
            judged += drafted;
            for (i, (a, want)) in alone.iter().zip(&t.reference).enumerate() {
                if t.requests[i].sampling.is_greedy() {
                    assert_eq!(
                        first_difference(vec![a.clone()], std::slice::from_ref(want)),
                        None,
                        "{kind} k {k:?}: greedy row {i}"
                    );
                }
            }
            for (max_batch, layout) in [(3, WindowLayout::RowTail), (8, WindowLayout::SharedSlots)] {
                let (batched, _) = t.generate(Some(kind), rejection(k, max_batch, layout));
                assert_eq!(first_difference(batched, &alone), None, "{kind}, k {k:?}, max batch {max_batch}");
            }
        }
    }
    assert!(judged > 0, "no draft was judged");
    t.clean_up();
}

/// Exact mode with a stream generator (numbers keyed by how many picks came before, not
/// by position): speculative rows no longer match plain decoding under the same fault.
#[test]
fn stream_rng_breaks_the_sampled_gate() {
    let t = Target::load("stream", "qwen3-target", "qwen3-draft", true);
    let run = |drafter, opts| {
        mtp::sampling::negative_control::set_stream_rng(true);
        let (got, _) = t.generate(drafter, opts);
        mtp::sampling::negative_control::set_stream_rng(false);
        got
    };
    let reference = run(None, opts(0, 1, WindowLayout::RowTail));
    let diff = first_difference(run(Some("oracle"), opts(3, 3, WindowLayout::RowTail)), &reference);
    assert!(diff.is_some(), "the gate missed a stream random generator");
    eprintln!("stream rng: {}", diff.unwrap());
    assert_eq!(t.check(Some("oracle"), opts(3, 3, WindowLayout::RowTail)).0, None, "keyed noise passes");
    t.clean_up();
}
