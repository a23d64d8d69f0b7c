//! EAGLE-3 heads (`tests/fixtures/eagle3`, for the trained target): the target's taps and
//! the head's logits against an independent numpy forward (`make_fixture.py`); taps that
//! are a pure function of the row's prefix; the speculators layout computing the same bits
//! as the SafeAILab one; `--drafter eagle3` bitwise equal to plain decoding, greedy and
//! sampled, alone and batched with staggered arrivals (and the gate's physical-RoPE
//! negative control breaking it); a head that does not fit its target refused by key.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{bits, eagle3_head, first_difference, request, run, trained};
use mtp::drafter::{Commit, DraftAsk, Drafter, Eagle3Drafter};
use mtp::engine::{Completion, DraftLen, EngineOptions, Request, SamplingMode, SamplingParams, WindowLayout};
use mtp::kernels::{Activations, Backend, KvDtype, Numerics};
use mtp::model::{Eagle3Feed, Eagle3Head, Eagle3Input, Eagle3Layout, Hidden, Logits, Model, RowInput, Taps};

fn golden() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(eagle3_head().join("golden.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// `seq`'s hidden states of `kind`, one forward (`chunk` tokens a piece) beside `others`.
fn tapped(model: &Model, seq: &[u32], kind: Hidden, chunk: usize, others: &[&[u32]]) -> Vec<f32> {
    let mut cache = model.new_cache();
    let mut side: Vec<_> = others.iter().map(|_| model.new_cache()).collect();
    let mut out = Vec::new();
    for (i, piece) in seq.chunks(chunk).enumerate() {
        let mut rows = vec![RowInput {
            tokens: piece,
            cache: &mut cache,
            logits: Logits::All,
            full_logits: false,
            hidden: kind,
        }];
        if i == 0 {
            for (o, c) in others.iter().zip(side.iter_mut()) {
                rows.push(RowInput {
                    tokens: o,
                    cache: c,
                    logits: Logits::Last,
                    full_logits: true,
                    hidden: kind,
                });
            }
        }
        out.extend(model.forward(&mut rows).unwrap().remove(0).hidden);
        cache.commit_window(piece.len());
    }
    out
}

fn close(got: f64, want: f64, what: &str) {
    assert!((got - want).abs() <= 2e-4 * (1.0 + want.abs()), "{what}: got {got}, numpy {want}");
}

/// f32 activations and K/V, so the comparison with numpy's f64 is tight.
fn f32_target() -> Model {
    let numerics = Numerics { kv: KvDtype::F32, activations: Activations::F32 };
    Model::load_with(&trained("target"), Backend::Cpu, numerics).unwrap()
}

#[test]
fn taps_and_head_match_numpy() {
    let g = golden();
    let model = f32_target();
    let head = Eagle3Head::load(&eagle3_head(), &model).unwrap();
    assert_eq!(head.spec.layout, Eagle3Layout::SafeAiLab);
    // SGLang's eagle_config ids name layer outputs: [3, 0, 2] taps the inputs of 4, 1, 3.
    assert_eq!(head.spec.taps, [1, 3, 4]);
    let (seq, th) = (ids(&g["sequence"]), model.config.hidden_size);
    let taps = tapped(&model, &seq, head.hidden(), seq.len(), &[]);
    assert_eq!(taps.len(), seq.len() * 3 * th);
    for (p, want) in g["taps"].as_array().unwrap().iter().enumerate() {
        for (j, w) in want.as_array().unwrap().iter().enumerate() {
            let t = &taps[(p * 3 + j) * th..(p * 3 + j + 1) * th];
            let what = format!("position {p}, tap {j}");
            for (i, want) in floats(&w["head"]).into_iter().enumerate() {
                close(t[i] as f64, want, &what);
            }
            close(t.iter().map(|&x| x as f64).sum(), w["sum"].as_f64().unwrap(), &what);
            close(
                t.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt(),
                w["norm"].as_f64().unwrap(),
                &what,
            );
        }
    }
    // Three draft steps: the sequence's taps through fc, then the head's own state twice.
    let mut cache = head.new_cache();
    let (mut states, mut tokens) =
        (taps, seq[1..].iter().copied().chain([g["next"].as_u64().unwrap() as u32]).collect::<Vec<_>>());
    for (step, want) in g["steps"].as_array().unwrap().iter().enumerate() {
        let feed = if step == 0 { Eagle3Feed::Taps } else { Eagle3Feed::Own };
        let mut rows = [Eagle3Input { states: &states, tokens: &tokens, cache: &mut cache }];
        let out = head.forward(&mut rows, feed).unwrap().remove(0);
        cache.commit_window(tokens.len());
        let top = ids(&want["top_ids"]);
        for (&id, z) in top.iter().zip(floats(&want["top_logits"])) {
            close(out.logits[id as usize] as f64, z, &format!("step {step}, logit of {id}"));
        }
        let finite: Vec<f64> = out.logits.iter().filter(|z| z.is_finite()).map(|&z| z as f64).collect();
        assert_eq!(finite.len(), head.spec.draft_vocab, "step {step}: one finite logit per draft token");
        let max = finite.iter().cloned().fold(f64::MIN, f64::max);
        let lse = max + finite.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
        close(lse, want["logsumexp"].as_f64().unwrap(), &format!("step {step}, logsumexp"));
        assert_eq!(mtp::base::logits::argmax(&out.logits), top[0], "step {step}: the draft");
        (states, tokens) = (out.hidden, vec![top[0]]);
    }
}

#[test]
fn taps_are_a_function_of_the_rows_prefix() {
    let model = common::load(&trained("target"));
    let seq: Vec<u32> = (0..37).map(|i| 5 + (i * 131) % 8000).collect();
    let kind = Hidden::Taps(Taps::new(&[0, 2, 5]).unwrap());
    let alone = tapped(&model, &seq, kind, seq.len(), &[]);
    assert_eq!(bits(&alone), bits(&tapped(&model, &seq, kind, 5, &[])), "chunked prefill");
    let others: [&[u32]; 2] = [&[9, 8, 7], &[400; 12]];
    assert_eq!(bits(&alone), bits(&tapped(&model, &seq, kind, 37, &others)), "batched");
    // Layer 0's input is the embedding; the final states are another kind, and mixing
    // kinds in one forward is refused.
    let first = tapped(&model, &seq[..1], Hidden::Taps(Taps::new(&[0]).unwrap()), 1, &[]);
    assert_eq!(bits(&first), bits(&alone[..model.config.hidden_size]));
    let (mut a, mut b) = (model.new_cache(), model.new_cache());
    let mut rows = [
        RowInput { tokens: &seq[..2], cache: &mut a, logits: Logits::All, full_logits: false, hidden: kind },
        RowInput {
            tokens: &seq[..2],
            cache: &mut b,
            logits: Logits::All,
            full_logits: false,
            hidden: Hidden::Final,
        },
    ];
    assert!(model.forward(&mut rows).unwrap_err().to_string().contains("different hidden states"));
    let past = Hidden::Taps(Taps::new(&[6]).unwrap());
    assert!(tapped_err(&model, past).contains("past the model's 6 layers"));
}

fn tapped_err(model: &Model, kind: Hidden) -> String {
    let mut c = model.new_cache();
    let mut rows =
        [RowInput { tokens: &[1], cache: &mut c, logits: Logits::Last, full_logits: false, hidden: kind }];
    model.forward(&mut rows).unwrap_err().to_string()
}

/// A copy of the fixture in a fresh directory with `edit` applied to its config.json and
/// each tensor stored under the names `rename` gives it (none: dropped), `d2t` replaced
/// by `d2t` when given.
fn variant(
    tag: &str,
    edit: impl Fn(&mut serde_json::Value),
    rename: impl Fn(&str) -> Vec<String>,
    d2t: Option<Vec<i64>>,
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mtp-eagle3-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(eagle3_head().join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
    let bytes = std::fs::read(eagle3_head().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let d2t: Option<Vec<u8>> = d2t.map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect());
    let mut kept: Vec<(String, safetensors::tensor::TensorView)> = Vec::new();
    for (name, t) in st.tensors() {
        let t = match (&d2t, name.as_str()) {
            (Some(b), "d2t") => {
                safetensors::tensor::TensorView::new(t.dtype(), t.shape().to_vec(), b).unwrap()
            }
            _ => t,
        };
        kept.extend(rename(&name).into_iter().map(|n| (n, t.clone())));
    }
    safetensors::serialize_to_file(kept, None, &dir.join("model.safetensors")).unwrap();
    dir
}

/// The same head in the speculators layout: `layers.0.*`, the layer's settings under
/// `transformer_layer_config`, vLLM's layer ids.
fn speculators(tag: &str) -> PathBuf {
    variant(
        tag,
        |cfg| {
            let layer = cfg.clone();
            *cfg = serde_json::json!({
                "architectures": ["Eagle3Speculator"],
                "speculators_model_type": "eagle3",
                "transformer_layer_config": layer,
                "draft_vocab_size": layer["draft_vocab_size"],
                "target_hidden_size": layer["target_hidden_size"],
                "norm_before_residual": false,
                "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]},
            });
        },
        |name| vec![name.replace("midlayer.", "layers.0.")],
        None,
    )
}

#[test]
fn speculators_layout_computes_the_same_bits() {
    let model = Arc::new(common::load(&trained("target")));
    let dir = speculators("same");
    let head = Eagle3Head::load(&dir, &model).unwrap();
    assert_eq!((head.spec.layout, head.spec.taps.as_slice()), (Eagle3Layout::Speculators, &[1, 3, 4][..]));
    let seq: Vec<u32> = (0..20).map(|i| 30 + i * 11).collect();
    let taps = tapped(&model, &seq, head.hidden(), seq.len(), &[]);
    let sampling = SamplingParams { temperature: 0.9, seed: 3, ..SamplingParams::default() };
    let drafts = |dir: &Path| {
        let mut d = Eagle3Drafter::load(dir, model.clone()).unwrap();
        d.commit(1, Commit { start: 0, tokens: &seq, hidden: &taps, next: 77 }).unwrap();
        let greedy = d.propose(&[DraftAsk::greedy(1, 4)]).unwrap();
        // A commit from position 0 again rolls every entry back.
        d.commit(1, Commit { start: 0, tokens: &seq, hidden: &taps, next: 77 }).unwrap();
        (greedy, d.propose(&[DraftAsk { row: 1, k: 4, sampling }]).unwrap())
    };
    let (a, b) = (drafts(&eagle3_head()), drafts(&dir));
    assert_eq!(a.0[0].tokens.len(), 4);
    assert_eq!(a, b, "speculators and SafeAILab layouts of one head");
    std::fs::remove_dir_all(&dir).ok();
}

/// Staggered requests of mixed lengths; `sampled` gives each its own sampling and seed.
fn workload(sampled: bool) -> (Vec<Request>, Vec<u64>) {
    let prompts: Vec<Vec<u32>> = vec![
        (0..24).map(|i| 40 + (i * 97) % 3000).collect(),
        vec![7, 8, 9, 7, 8, 9, 7, 8],
        vec![300],
        (0..9).map(|i| 1000 + i).collect(),
        vec![11, 12, 13, 14, 11, 12],
    ];
    let requests = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| Request {
            sampling: match sampled {
                true => SamplingParams {
                    temperature: [0.8, 1.2, 0.0][i % 3],
                    top_k: [0, 20, 0][i % 3],
                    seed: 50 + i as u64,
                    ..SamplingParams::default()
                },
                false => SamplingParams::default(),
            },
            ..request(&format!("r{i}"), p, 8 + 3 * i)
        })
        .collect();
    (requests, vec![0, 0, 1, 3, 4])
}

/// The workload through `--drafter eagle3` at fixed `k`, in `mode` (`Exact`: plain
/// decoding's tokens).
fn eagle3_run(
    model: &Arc<Model>,
    mode: SamplingMode,
    k: usize,
    max_batch: usize,
    layout: WindowLayout,
    req: &[Request],
    at: &[u64],
) -> Vec<Result<Completion, mtp::base::Error>> {
    let d: Box<dyn Drafter> = Box::new(Eagle3Drafter::load(&eagle3_head(), model.clone()).unwrap());
    let opts = EngineOptions {
        k: DraftLen::Fixed(k),
        max_batch,
        prefill_chunk: 4,
        layout,
        sampling_mode: mode,
        ..EngineOptions::default()
    };
    run(model, Some(d), opts, req, at)
}

#[test]
fn drafting_with_eagle3_is_bitwise_plain_decoding() {
    let model = Arc::new(common::load(&trained("target")));
    for sampled in [false, true] {
        let (requests, at) = workload(sampled);
        let reference: Vec<Completion> =
            common::plain(&model, &requests, 1).into_iter().map(|r| r.unwrap()).collect();
        for (k, max_batch) in [(1, 1), (3, 3), (4, 5)] {
            let layout = if max_batch == 5 { WindowLayout::SharedSlots } else { WindowLayout::RowTail };
            let got = eagle3_run(&model, SamplingMode::Exact, k, max_batch, layout, &requests, &at);
            assert_eq!(
                first_difference(&got, &reference),
                None,
                "sampled {sampled}, k {k}, max batch {max_batch}"
            );
        }
    }
    // Rejection sampling keeps the distribution, not plain decoding's tokens: each row is
    // bitwise the same alone and batched.
    let (requests, at) = workload(true);
    let rejection =
        |max_batch, layout| eagle3_run(&model, SamplingMode::Rejection, 3, max_batch, layout, &requests, &at);
    let alone: Vec<Completion> =
        rejection(1, WindowLayout::RowTail).into_iter().map(|r| r.unwrap()).collect();
    let batched = rejection(5, WindowLayout::SharedSlots);
    assert_eq!(first_difference(&batched, &alone), None, "rejection mode, batched against alone");
    // The gate sees a fault: RoPE at physical slots breaks shared-slot batches.
    let (requests, at) = workload(false);
    let reference: Vec<Completion> =
        common::plain(&model, &requests, 1).into_iter().map(|r| r.unwrap()).collect();
    mtp::kernels::negative_control::set_physical_rope(true);
    let broken = eagle3_run(&model, SamplingMode::Exact, 3, 5, WindowLayout::SharedSlots, &requests, &at);
    mtp::kernels::negative_control::set_physical_rope(false);
    assert!(first_difference(&broken, &reference).is_some(), "physical RoPE went unnoticed");
}

#[test]
fn heads_that_do_not_fit_are_refused_by_key() {
    let model = common::load(&trained("target"));
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("arch", Box::new(|c| c["architectures"] = serde_json::json!(["MedusaModel"])), "architectures"),
        ("vocab", Box::new(|c| c["vocab_size"] = 8000.into()), "vocab_size"),
        ("th", Box::new(|c| c["target_hidden_size"] = 256.into()), "target_hidden_size"),
        ("dv", Box::new(|c| c["draft_vocab_size"] = 9000.into()), "draft_vocab_size"),
        ("layers", Box::new(|c| c["num_hidden_layers"] = 2.into()), "num_hidden_layers"),
        (
            "tap",
            Box::new(|c| {
                c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([0, 2, 5])
            }),
            "eagle_config.eagle_aux_hidden_state_layer_ids",
        ),
        (
            "two",
            Box::new(|c| c["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([1, 3])),
            "eagle_aux_hidden_state_layer_ids",
        ),
        (
            "twice",
            Box::new(|c| c["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([1, 3, 3])),
            "eagle_aux_hidden_state_layer_ids",
        ),
        // A 6-layer target's default (2, 3, 3) repeats a layer: it must be named.
        (
            "default",
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("eagle_config");
            }),
            "eagle_aux_hidden_state_layer_ids",
        ),
        (
            "aux",
            Box::new(|c| c["eagle_config"]["use_aux_hidden_state"] = false.into()),
            "use_aux_hidden_state",
        ),
        ("fcnorm", Box::new(|c| c["norm_before_fc"] = true.into()), "norm_before_fc"),
    ];
    for (tag, edit, key) in cases {
        let dir = variant(tag, edit, |n| vec![n.to_string()], None);
        let e = Eagle3Head::load(&dir, &model).err().unwrap_or_else(|| panic!("{tag}: loaded")).to_string();
        assert!(e.contains(key) && e.contains("config.json"), "{tag}: {e}");
        std::fs::remove_dir_all(&dir).ok();
    }
    // Tensors: a missing own embedding (hidden 8 is not the target's 384), one the head
    // does not read, no d2t for a smaller draft vocabulary, d2t leaving the vocabulary or
    // mapping two draft ids to one target id.
    fn keep(n: &str) -> Vec<String> {
        vec![n.to_string()]
    }
    type Rename = Box<dyn Fn(&str) -> Vec<String>>;
    let tensor_cases: Vec<(&str, Rename, Option<Vec<i64>>, &str)> = vec![
        (
            "embed",
            Box::new(|n| if n == "embed_tokens.weight" { vec![] } else { keep(n) }),
            None,
            "embed_tokens.weight",
        ),
        (
            "extra",
            Box::new(
                |n| if n == "fc.weight" { vec![keep(n)[0].clone(), "fc2.weight".into()] } else { keep(n) },
            ),
            None,
            "fc2.weight",
        ),
        (
            "no-d2t",
            Box::new(|n| if n == "d2t" || n == "t2d" { vec![] } else { keep(n) }),
            None,
            "draft_vocab_size",
        ),
        ("d2t-out", Box::new(keep), Some((0..512).map(|d| if d == 511 { 8000 } else { 0 }).collect()), "d2t"),
        ("d2t-dup", Box::new(keep), Some((0..512).map(|d| if d == 0 { 1 } else { 0 }).collect()), "d2t"),
    ];
    for (tag, rename, d2t, key) in tensor_cases {
        let dir = variant(tag, |_| {}, rename, d2t);
        let e = Eagle3Head::load(&dir, &model).err().unwrap_or_else(|| panic!("{tag}: loaded")).to_string();
        assert!(e.contains(key), "{tag}: {e}");
        std::fs::remove_dir_all(&dir).ok();
    }
    // speculators: norm_before_residual must be stated (its defaults disagree).
    let dir = speculators("nbr");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("norm_before_residual");
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    assert!(Eagle3Head::load(&dir, &model).err().unwrap().to_string().contains("norm_before_residual"));
    std::fs::remove_dir_all(&dir).ok();
}

/// The held-out prompts (`examples/heldout-prompts.jsonl`, text the family never trained
/// on), `max_tokens` new tokens each, greedy.
fn heldout(model_dir: &Path, max_tokens: usize) -> Vec<Request> {
    let config = mtp::base::Config::from_dir(model_dir).unwrap();
    let tok = mtp::base::Tokenizer::for_model(model_dir, &config).unwrap().unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/heldout-prompts.jsonl");
    let defaults = Request { max_tokens, ignore_eos: true, ..Request::default() };
    mtp::prompts::read(&path, Some(&tok), &defaults).unwrap().requests
}

/// Greedy decoding of `requests` with the head in `head` at k = 3, 4 rows at a time: the
/// completions and the acceptance rate at each draft position.
fn accepted_by_position(
    model: &Arc<Model>,
    head: &Path,
    requests: &[Request],
) -> (Vec<Completion>, Vec<f64>) {
    let d: Box<dyn Drafter> = Box::new(Eagle3Drafter::load(head, model.clone()).unwrap());
    let opts = EngineOptions { k: DraftLen::Fixed(3), max_batch: 4, ..EngineOptions::default() };
    let mut engine = mtp::engine::Engine::new(model, Some(d), opts).unwrap();
    let out = mtp::engine::generate(&mut engine, requests, &[], |_, _| {});
    (out.into_iter().map(|r| r.unwrap()).collect(), engine.stats().per_position_acceptance())
}

#[test]
fn the_trained_head_drafts_what_its_target_accepts() {
    // training/eagle3.py's head for the shipped target: its drafts are accepted on text it
    // never saw, and its output is still plain decoding's, bit for bit.
    let target = trained("target");
    let model = Arc::new(common::load(&target));
    let requests = heldout(&target, 24);
    let reference: Vec<Completion> =
        common::plain(&model, &requests, 4).into_iter().map(|r| r.unwrap()).collect();
    let (got, by_position) = accepted_by_position(&model, &trained("eagle3"), &requests);
    assert_eq!(first_difference(&got.into_iter().map(Ok).collect::<Vec<_>>(), &reference), None);
    assert!(by_position[0] >= 0.45, "first-position acceptance {by_position:?}");
    assert!(by_position[1] >= 0.25, "second-position acceptance {by_position:?}");
    // Negative controls: the same head with the residual after `hidden_norm` (vLLM's
    // `norm_before_residual`, the one place the published readers differ), and the random
    // test head, both accept far less, so the bars above measure the head's training and
    // this reading of its semantics, not the workload. (Tapping the layers next to the
    // trained ones costs less: residual streams change slowly from layer to layer.)
    let dir = std::env::temp_dir().join(format!("mtp-eagle3-{}-norm-before-residual", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(trained("eagle3").join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trained("eagle3").join("config.json")).unwrap())
            .unwrap();
    cfg["norm_before_residual"] = serde_json::json!(true);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let (_, moved) = accepted_by_position(&model, &dir, &requests);
    assert!(moved[0] < by_position[0] / 2.0, "norm before residual {moved:?} against {by_position:?}");
    std::fs::remove_dir_all(&dir).ok();
    let (_, random) = accepted_by_position(&model, &eagle3_head(), &requests);
    assert!(random[0] < 0.1, "the random head {random:?}");
}
