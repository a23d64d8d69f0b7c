//! Gemma 4: the three tiny targets written by transformers 5.17 (dense with K = V global
//! layers; E-style with per-layer inputs, KV-shared layers and double-wide MLPs; MoE)
//! against their golden outputs, and the engine's guarantees across the sliding window.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use mtp::bench::same;
use mtp::drafter::{AssistantDrafter, Drafter, NgramDrafter};
use mtp::engine::{
    prefill, Completion, DraftLen, Engine, EngineOptions, Request, SamplingParams, WindowLayout,
};
use mtp::kernels::{KvDtype, Numerics};
use mtp::model::Model;
use serde_json::Value;

const TARGETS: [&str; 3] = ["gemma4-dense-target", "gemma4-e-target", "gemma4-moe-target"];

fn gemma(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4").join(name)
}

/// mlx-lm's conversions of the Gemma 4 targets (`scripts/make_mlx_fixtures.py`).
fn mlx(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name)
}

fn golden(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Steps before the first whose top-2 margin is below 1e-4.
fn trusted_steps(margins: &Value) -> usize {
    let m = margins.as_array().unwrap();
    m.iter().position(|m| m.as_f64().unwrap() < 1e-4).unwrap_or(m.len())
}

#[test]
fn prefill_logits_match_transformers() {
    for name in TARGETS {
        let dir = gemma(name);
        let model = common::load(&dir);
        let g = golden(&dir);
        for (p, want) in
            g["prompts"].as_array().unwrap().iter().zip(g["prefill_last_logits"].as_array().unwrap())
        {
            let mut cache = model.new_cache();
            let mtp::engine::Prefilled { logits: got, .. } =
                prefill(&model, &mut cache, &ids(p), 5, false, true).unwrap();
            let want: Vec<f32> =
                want.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            println!("{name}: prefill logits within {worst:e} of transformers");
            assert!(worst < 1e-4, "{name}: prefill logits differ by {worst}");
        }
    }
}

#[test]
fn greedy_tokens_match_transformers() {
    for name in TARGETS {
        let dir = gemma(name);
        let model = common::load(&dir);
        let g = golden(&dir);
        let prompts = g["prompts"].as_array().unwrap();
        let n = g["greedy"][0].as_array().unwrap().len();
        let requests: Vec<Request> =
            prompts.iter().enumerate().map(|(i, p)| common::request(&i.to_string(), ids(p), n)).collect();
        let opts = EngineOptions { max_batch: 3, prefill_chunk: 5, ..EngineOptions::default() };
        let out = common::run(&model, None, opts, &requests, &[]);
        for (i, res) in out.into_iter().enumerate() {
            let got = res.unwrap().tokens;
            let want = ids(&g["greedy"][i]);
            let upto = trusted_steps(&g["margins"][i]);
            println!("{name} prompt {i}: {upto} trusted steps");
            assert_eq!(got[..upto], want[..upto], "{name} prompt {i}: greedy tokens differ");
        }
    }
}

const ASSISTANTS: [&str; 4] = [
    "gemma4-dense-assistant",
    "gemma4-dense-assistant-ordered",
    "gemma4-e-assistant",
    "gemma4-e-assistant-ordered",
];

/// Every round transformers' assisted generation recorded, reproduced draft for draft.
///
/// transformers feeds its assistant more than the accepted history, and the test rebuilds
/// exactly that: the target's K/V come from the last verify pass over the previous history
/// and *all* its drafts (`S`), so a full layer also sees position `L - 1` (a rejected
/// draft) and a sliding layer the last `W + 1` of `[s, e]` with `s = max(0, L' - W)` and
/// `e = min(|S| - 1, s + L - 1)` (its cropped cache sliced from the start); the first
/// round after the prompt starts from the hidden state at position 0, later rounds from
/// position `L - 2`. Every step queries at `L - 1`. The engine itself reads only the
/// committed prefix (`Gemma4Assistant::key_ranges`); the step math is the same.
#[test]
fn assistant_drafts_match_transformers_rounds() {
    use mtp::base::logits::argmax;
    use mtp::model::models::gemma4::assistant::{AssistantRow, Gemma4Assistant};
    use std::sync::Arc;
    for name in ASSISTANTS {
        let dir = gemma(name);
        let g = golden(&dir);
        let target = Arc::new(common::load(&gemma(g["target"].as_str().unwrap())));
        let assistant = Gemma4Assistant::load(&dir, target.clone()).unwrap();
        let w = 8;
        let (mut rounds, mut steps, mut trusted_rounds) = (0, 0, 0);
        // Rotated (the emulator): every fifth round (each round starts from the recorded
        // history, so any subset is a check of its own).
        let stride = if common::full_matrix() { 1 } else { 5 };
        for run in g["runs"].as_array().unwrap() {
            let mut prev: Option<(Vec<u32>, Vec<u32>)> = None;
            for (i, round) in run["rounds"].as_array().unwrap().iter().enumerate() {
                let history = ids(&round["history"]);
                let drafts = ids(&round["drafts"]);
                if i % stride != 0 {
                    prev = Some((history, drafts));
                    continue;
                }
                let l = history.len();
                let (seq, s) = match &prev {
                    None => (history[..l - 1].to_vec(), 0),
                    Some((h, d)) => ([h.clone(), d.clone()].concat(), h.len().saturating_sub(w)),
                };
                let e = (seq.len() - 1).min(s + l - 1);
                let mut cache = target.new_cache();
                let mtp::engine::Prefilled { hidden, .. } =
                    prefill(&target, &mut cache, &seq[..e + 1], 7, true, true).unwrap();
                let hb = assistant.backbone_hidden();
                let at = if prev.is_none() { 0 } else { l - 2 };
                let mut hid = hidden[at * hb..(at + 1) * hb].to_vec();
                let mut token = history[l - 1];
                let margins = round["draft_margins"].as_array().unwrap();
                let trusted = margins.iter().position(|m| m.as_f64().unwrap() < 1e-4).unwrap_or(drafts.len());
                for (j, &want) in drafts.iter().enumerate().take(trusted) {
                    let row = AssistantRow {
                        token,
                        hidden: &hid,
                        pos: l - 1,
                        full: (&cache, 0..l.min(seq.len())),
                        sliding: Some((&cache, e.saturating_sub(w).max(s)..e + 1)),
                    };
                    let out = assistant.step(&[row]).unwrap().pop().unwrap();
                    token = argmax(&out.logits);
                    assert_eq!(token, want, "{name}: round with history {l}, draft {j}");
                    hid = out.hidden;
                    steps += 1;
                }
                rounds += 1;
                trusted_rounds += usize::from(trusted == drafts.len());
                prev = Some((history, drafts));
            }
        }
        println!("{name}: {rounds} rounds ({trusted_rounds} without a near-tie), {steps} drafts equal to transformers'");
        assert!(steps > rounds, "{name}: too few drafts compared");
    }
}

/// Fifteen requests arriving one per round, prompts of 1 to 29 tokens and outputs of 6 to
/// 34: most cross the sliding window of 8 (some in the prompt, some while decoding), and
/// rows retire at different rounds. `sampled` mixes temperatures, filters and seeds.
fn window_workload(sampled: bool) -> (Vec<Request>, Vec<u64>) {
    let requests = (0..15)
        .map(|i| {
            let prompt: Vec<u32> =
                [2].into_iter().chain((0..2 * i).map(|j| 3 + ((i * 31 + j * 17) % 500) as u32)).collect();
            let sampling = if sampled && i % 4 != 3 {
                SamplingParams {
                    temperature: [0.7, 1.0, 1.3][i % 3],
                    top_k: [0, 20, 0][i % 3],
                    top_p: [1.0, 0.95, 0.9][(i / 2) % 3],
                    min_p: if i % 5 == 1 { 0.05 } else { 0.0 },
                    seed: 77 + i as u64,
                }
            } else {
                SamplingParams::default()
            };
            Request { sampling, ..common::request(&format!("g{i}"), prompt, 6 + 2 * i) }
        })
        .collect();
    (requests, (0..15).collect())
}

struct Gate {
    name: &'static str,
    model: Arc<Model>,
    assistant: Option<PathBuf>,
    requests: Vec<Request>,
    arrive_at: Vec<u64>,
    /// Plain decoding, each request alone.
    reference: Vec<Completion>,
}

impl Gate {
    fn new(name: &'static str, assistant: Option<&str>, sampled: bool) -> Gate {
        Gate::with_model(name, common::load(&gemma(name)), assistant, sampled)
    }

    /// The gate on `model` (loaded from anywhere, with any K/V dtype), named `name`.
    fn with_model(name: &'static str, model: Model, assistant: Option<&str>, sampled: bool) -> Gate {
        let model = Arc::new(model);
        let (requests, arrive_at) = window_workload(sampled);
        let reference = common::plain(&model, &requests, 1).into_iter().map(|r| r.unwrap()).collect();
        Gate { name, model, assistant: assistant.map(gemma), requests, arrive_at, reference }
    }

    fn drafter(&self, kind: &str) -> Box<dyn Drafter> {
        match kind {
            "assistant" => Box::new(
                AssistantDrafter::load(self.assistant.as_ref().unwrap(), self.model.clone()).unwrap(),
            ),
            "ngram" => Box::new(NgramDrafter::new(1, 3).unwrap()),
            "oracle" => {
                Box::new(common::oracle(&self.requests, &self.reference, self.model.config.vocab_size))
            }
            other => panic!("unknown drafter {other}"),
        }
    }

    /// The first request that differs from plain decoding alone, and (drafted, accepted).
    fn check(&self, kind: Option<&str>, k: DraftLen, max_batch: usize) -> (Option<String>, (u64, u64)) {
        let layout = if max_batch == 8 { WindowLayout::SharedSlots } else { WindowLayout::RowTail };
        let opts = EngineOptions { k, max_batch, prefill_chunk: 5, layout, ..EngineOptions::default() };
        let mut engine = Engine::new(&self.model, kind.map(|d| self.drafter(d)), opts).unwrap();
        let got = mtp::engine::generate(&mut engine, &self.requests, &self.arrive_at, |_, _| {});
        let counts = (engine.stats().drafted, engine.stats().accepted);
        let diff = got.into_iter().zip(&self.reference).enumerate().find_map(|(i, (g, want))| {
            let g = g.expect("no request fails");
            (!same(&g, want)).then(|| format!("request {i}: got {:?}, want {:?}", g.tokens, want.tokens))
        });
        (diff, counts)
    }

    fn run(&self) {
        let crossing =
            self.requests.iter().zip(&self.reference).filter(|(r, c)| r.prompt.len() + c.tokens.len() > 9);
        assert!(crossing.count() >= 10, "{}: the workload must cross the sliding window", self.name);
        for max_batch in [3, 8] {
            assert_eq!(
                self.check(None, DraftLen::Fixed(0), max_batch).0,
                None,
                "{}: plain, batch {max_batch}",
                self.name
            );
        }
        let kinds: &[&str] =
            if self.assistant.is_some() { &["assistant", "ngram", "oracle"] } else { &["ngram", "oracle"] };
        let ks = [DraftLen::Fixed(1), DraftLen::Fixed(3), DraftLen::Fixed(5), DraftLen::Adaptive(5)];
        for (i, &kind) in kinds.iter().enumerate() {
            let mut totals = (0, 0);
            for (k, max_batch) in common::gate_settings(i, &ks) {
                let (diff, (d, a)) = self.check(Some(kind), k, max_batch);
                assert_eq!(diff, None, "{}: drafter {kind}, k {k:?}, max batch {max_batch}", self.name);
                totals = (totals.0 + d, totals.1 + a);
            }
            eprintln!("{} {kind}: drafted {}, accepted {}", self.name, totals.0, totals.1);
            assert!(totals.0 > 0 || kind == "ngram", "{} {kind}: nothing was drafted", self.name);
            if kind == "oracle" {
                assert!(
                    totals.1 > 0 && totals.1 < totals.0,
                    "{}: the oracle must force mixed accepts",
                    self.name
                );
            }
        }
    }
}

/// The parity gate on Gemma 4: every drafter (the assistant where one exists, n-gram, the
/// adversarial oracle), k in {1, 3, 5} and adaptive, max batch {1, 3, 8}, fifteen
/// staggered requests across the sliding window: every row bitwise equal to plain
/// decoding of the request alone, greedy and exact-sampled.
/// Rotated ([`common::full_matrix`], the emulator) each family runs one of its two gates:
/// sampling runs on the host, so the other adds no kernel; every assistant layout still runs
/// (here, in the 4-bit gate and in `assistant_drafts_match_transformers_rounds`).
#[test]
fn gate_gemma4_dense() {
    Gate::new("gemma4-dense-target", Some("gemma4-dense-assistant-ordered"), false).run();
    if common::full_matrix() {
        Gate::new("gemma4-dense-target", Some("gemma4-dense-assistant"), true).run();
    }
}

#[test]
fn gate_gemma4_e() {
    if common::full_matrix() {
        Gate::new("gemma4-e-target", Some("gemma4-e-assistant"), false).run();
    }
    Gate::new("gemma4-e-target", Some("gemma4-e-assistant-ordered"), true).run();
}

#[test]
fn gate_gemma4_moe() {
    Gate::new("gemma4-moe-target", None, false).run();
    if common::full_matrix() {
        Gate::new("gemma4-moe-target", None, true).run();
    }
}

/// The gate on mlx-lm's 4-bit conversions: multimodal names (`language_model.model.`)
/// and stacked quantized experts, each target with the assistant of its source checkpoint
/// (the assistant reads the quantized target's embedding and K/V).
#[test]
fn gate_gemma4_mlx_4bit() {
    let load = |name| common::load(&mlx(name));
    Gate::with_model(
        "gemma4-dense-mm-q4g64",
        load("gemma4-dense-mm-q4g64"),
        Some("gemma4-dense-assistant"),
        false,
    )
    .run();
    Gate::with_model("gemma4-moe-mm-q4g32-mixed", load("gemma4-moe-mm-q4g32-mixed"), None, true).run();
}

/// The same with 4-bit K/V (`--kv-bits 4`): the E-style 4-bit target and its assistant.
#[test]
fn gate_gemma4_mlx_4bit_with_4bit_kv() {
    let numerics = Numerics { kv: KvDtype::Q4, activations: common::test_activations() };
    let model = Model::load_with(&mlx("gemma4-e-q4g32"), common::backend(), numerics).unwrap();
    assert_eq!(model.kv_dtype(), KvDtype::Q4);
    Gate::with_model("gemma4-e-q4g32 kv4", model, Some("gemma4-e-assistant"), true).run();
}

/// With rollback skipping compaction (the ring's copy into its slots included) the gate
/// fails; without the fault the same run passes.
#[test]
fn gemma4_gate_catches_a_rollback_without_compaction() {
    let g = Gate::new("gemma4-e-target", Some("gemma4-e-assistant"), false);
    assert_eq!(g.check(Some("oracle"), DraftLen::Fixed(3), 3).0, None);
    mtp::cache::negative_control::set_skip_compaction(true);
    let (diff, _) = g.check(Some("oracle"), DraftLen::Fixed(3), 3);
    mtp::cache::negative_control::set_skip_compaction(false);
    assert!(diff.is_some(), "the gate missed a rollback that leaves the ring uncompacted");
}

/// A row alone and in a batch holds the same sliding-window ring and full-layer bytes
/// after every request of the workload, and a row's ring never outgrows the window.
#[test]
fn gemma4_ring_bytes_equal_plain_decoding() {
    let model = common::load(&gemma("gemma4-dense-target"));
    let (requests, _) = window_workload(false);
    // 16 values of f32 or bf16 (CUDA's K/V for 16-bit checkpoints) per KV head.
    let slot = 2 * 16 * if model.kv_dtype() == mtp::kernels::KvDtype::Bf16 { 2 } else { 4 };
    for r in requests.iter().take(8) {
        let reference = common::plain(&model, std::slice::from_ref(r), 1).pop().unwrap().unwrap();
        let seq: Vec<u32> = r.prompt.iter().chain(&reference.tokens).copied().collect();
        // One token at a time vs chunks of 5: the same bytes.
        let mut a = model.new_cache();
        prefill(&model, &mut a, &seq, 1, false, true).unwrap();
        let mut b = model.new_cache();
        prefill(&model, &mut b, &seq, 5, false, true).unwrap();
        for l in 0..a.ring_layers() {
            assert_eq!(a.ring_bytes(l).unwrap(), b.ring_bytes(l).unwrap(), "ring layer {l}");
        }
        for l in 0..a.n_layers() {
            assert_eq!(a.committed_bytes(l).unwrap(), b.committed_bytes(l).unwrap(), "main layer {l}");
        }
        let ring_bytes = a.ring_bytes(0).unwrap().0.len();
        assert!(ring_bytes <= 9 * slot, "the ring holds {ring_bytes} bytes per layer");
        // What the engine reserves per row for the rings is what a long row holds.
        let held: usize = (0..a.ring_layers()).map(|l| 2 * a.ring_bytes(l).unwrap().0.len()).sum();
        if seq.len() >= 9 {
            assert_eq!(held, model.kv_bytes_per_row());
        }
    }
}

/// A multimodal checkpoint (`Gemma4ForConditionalGeneration`: settings under
/// `text_config`, the decoder under `model.language_model.`, vision tensors beside it)
/// loads its text part and computes the same bits as the text-only checkpoint.
#[test]
fn conditional_generation_checkpoint_loads_its_text_part() {
    let src = gemma("gemma4-dense-target");
    let dir = std::env::temp_dir().join(format!("gemma4-multimodal-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The same tensors renamed, plus a vision tensor the loader must leave alone.
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut data = bytes[8 + n..].to_vec();
    let mut renamed = serde_json::Map::new();
    for (name, v) in header {
        let name = match name.strip_prefix("model.") {
            Some(rest) => format!("model.language_model.{rest}"),
            None => name,
        };
        renamed.insert(name, v);
    }
    let at = data.len();
    data.extend_from_slice(&[0u8; 16]);
    renamed.insert(
        "model.vision_tower.patch_embedder.weight".into(),
        serde_json::json!({"dtype": "F32", "shape": [2, 2], "data_offsets": [at, at + 16]}),
    );
    let header = serde_json::to_vec(&renamed).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    let text: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let config = serde_json::json!({
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 2},
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string(&config).unwrap()).unwrap();

    let (a, b) = (common::load(&src), common::load(&dir));
    let prompt = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49];
    let (mut ca, mut cb) = (a.new_cache(), b.new_cache());
    let mtp::engine::Prefilled { logits: la, .. } = prefill(&a, &mut ca, &prompt, 4, false, true).unwrap();
    let mtp::engine::Prefilled { logits: lb, .. } = prefill(&b, &mut cb, &prompt, 4, false, true).unwrap();
    assert_eq!(common::bits(&la), common::bits(&lb));
    assert_eq!(b.config.eos_token_ids, vec![1]);
    std::fs::remove_dir_all(&dir).ok();
}

/// Bad Gemma 4 configs are refused naming the key.
#[test]
fn bad_gemma4_configs_name_the_key() {
    let src = gemma("gemma4-e-target");
    let base: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let cases: [(&str, Value, &str); 8] = [
        // A layer that does not exist: its settings applied nowhere, without a word.
        ("per_layer_config", serde_json::json!({"99": {"head_dim": 16}}), "per_layer_config.99"),
        // A cap of 0 (0 * tanh(x / 0)) and a null window for sliding layers (transformers
        // then attends to everything) were run as "no cap" and a window of 512.
        ("final_logit_softcapping", Value::from(0.0), "final_logit_softcapping"),
        ("sliding_window", Value::Null, "sliding_window"),
        ("hidden_activation", Value::from("relu"), "hidden_activation"),
        ("num_kv_shared_layers", Value::from(9), "num_kv_shared_layers"),
        // Every layer shared (an assistant's setting) in a target: no layer stores K/V.
        ("num_kv_shared_layers", base["num_hidden_layers"].clone(), "num_kv_shared_layers"),
        ("layer_types", Value::from(vec!["sliding_attention"]), "layer_types"),
        ("rope_parameters", serde_json::json!({"full_attention": {"rope_type": "yarn"}}), "rope_type"),
    ];
    for (key, value, named) in cases {
        let dir = std::env::temp_dir().join(format!("gemma4-bad-{key}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = base.clone();
        c[key] = value;
        std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
        std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
        let err = Model::load(&dir).err().unwrap_or_else(|| panic!("{key}: loaded")).to_string();
        assert!(err.contains(named) && err.contains("config.json"), "{key}: {err}");
        std::fs::remove_dir_all(&dir).ok();
    }
    // A negative cap is transformers' cap of its magnitude (c tanh(x / c) is odd in c), not
    // "off" (control: the same prompt's logits, bit for bit).
    let dir = std::env::temp_dir().join(format!("gemma4-negative-cap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = base.clone();
    c["final_logit_softcapping"] = Value::from(-base["final_logit_softcapping"].as_f64().unwrap());
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let logits = |d: &Path| {
        let m = common::load(d);
        let mut cache = m.new_cache();
        common::bits(&prefill(&m, &mut cache, &[2, 40, 41, 42], 4, false, true).unwrap().logits)
    };
    assert_eq!(logits(&dir), logits(&src), "a cap of -30 is not transformers' (that of 30)");
    std::fs::remove_dir_all(&dir).ok();
    // An assistant whose target is not Gemma 4 is refused.
    let llama = Arc::new(Model::load(&common::fixture("llama-target")).unwrap());
    let err = AssistantDrafter::load(&gemma("gemma4-e-assistant"), llama).err().unwrap().to_string();
    assert!(err.contains("Gemma 4"), "{err}");
}

/// A prefix cache asked for is left off for ring rows (their evicted positions cannot be
/// shared), and the outputs stay those of plain decoding alone.
#[test]
fn gemma4_runs_with_the_prefix_cache_switched_off() {
    let g = Gate::new("gemma4-dense-target", Some("gemma4-dense-assistant"), false);
    let opts = EngineOptions { max_batch: 4, prefix_cache_bytes: 1 << 20, ..EngineOptions::default() };
    let mut engine = Engine::new(&g.model, Some(g.drafter("assistant")), opts).unwrap();
    let got = mtp::engine::generate(&mut engine, &g.requests, &g.arrive_at, |_, _| {});
    assert_eq!(engine.prefix_cache_bytes(), 0);
    for (i, (r, want)) in got.into_iter().zip(&g.reference).enumerate() {
        assert!(same(&r.unwrap(), want), "request {i}");
    }
}
