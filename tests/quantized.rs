//! MLX-quantized checkpoints (`mlx_lm.convert -q`, written by mlx-lm itself by
//! `scripts/make_mlx_fixtures.py`): golden outputs against mlx-lm, the quantized matmul's
//! row invariance (with its negative control), and clear errors for what is not supported.
//! And quantized K/V (`--kv-bits`): every backend's entries are the CPU's format of the f32
//! K/V its model computed.

mod common;

use std::path::{Path, PathBuf};

use common::{bits, Lcg};
use mtp::base::weights::Quant;
use mtp::base::{Checkpoint, Weight, WeightDtype};
use mtp::cache::QuantLayout;
use mtp::engine::{prefill, EngineOptions, Request};
use mtp::kernels::ops::{linear, linear_bf16};
use mtp::kernels::{negative_control, Activations, KvDtype, Numerics};
use mtp::model::Model;
use serde_json::Value;

const FIXTURES: [&str; 11] = [
    "qwen3-q4g32",
    "qwen3-q8g64",
    "llama-q4g32",
    "synth-q4g128",
    "qwen2-q4g32-mixed",
    "trained-q4g64",
    "qwen3-mxfp4",
    "gemma4-dense-q4g32",
    "gemma4-e-q4g32",
    "gemma4-moe-mm-q4g32-mixed",
    "gemma4-dense-mm-q4g64",
];

/// A matmul entry: `linear` (f32 activations) or `linear_bf16`.
type MatmulFn = fn(&[f32], usize, &Weight, Option<&[f32]>, &mut [f32]);

/// How far our logits may sit from mlx-lm's: both dequantize `scale * q + bias` in f32,
/// but mlx's quantized matmul sums in its own order.
const TOL: f32 = 2e-4;

fn mlx(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx").join(name)
}

fn golden(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn prefill_logits_match_mlx_lm() {
    for name in FIXTURES {
        let dir = mlx(name);
        let model = common::load(&dir);
        let g = golden(&dir);
        for (p, want) in
            g["prompts"].as_array().unwrap().iter().zip(g["prefill_last_logits"].as_array().unwrap())
        {
            let mut cache = model.new_cache();
            let mtp::engine::Prefilled { logits: got, .. } =
                prefill(&model, &mut cache, &ids(p), 3, false, true).unwrap();
            let want: Vec<f32> =
                want.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
            assert_eq!(got.len(), want.len());
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            println!("{name}: prefill logits within {worst:e} of mlx-lm");
            assert!(worst < TOL, "{name}: prefill logits differ from mlx-lm's by {worst}");
        }
    }
}

#[test]
fn greedy_tokens_match_mlx_lm() {
    for name in FIXTURES {
        let dir = mlx(name);
        let model = common::load(&dir);
        let g = golden(&dir);
        let n = g["new_tokens"].as_u64().unwrap() as usize;
        let prompts = g["prompts"].as_array().unwrap();
        let requests: Vec<Request> =
            prompts.iter().enumerate().map(|(i, p)| common::request(&i.to_string(), ids(p), n)).collect();
        let opts = EngineOptions { max_batch: 2, prefill_chunk: 3, ..EngineOptions::default() };
        for (i, res) in common::run(&model, None, opts, &requests, &[]).into_iter().enumerate() {
            let got = res.unwrap().tokens;
            let margins = g["margins"][i].as_array().unwrap();
            // Up to the first near-tie, where a correct implementation may pick the other token.
            let upto = margins.iter().position(|m| m.as_f64().unwrap() < 2.0 * TOL as f64).unwrap_or(n);
            assert!(upto > 0, "{name} prompt {i}: the first step is already a near-tie");
            assert_eq!(
                got[..upto],
                ids(&g["greedy"][i])[..upto],
                "{name} prompt {i}: greedy tokens differ from mlx-lm's"
            );
        }
    }
}

/// Quantized projections of every fixture (and one expert of each stacked MoE tensor),
/// at M in {1, 2, 3, 5, 17, 40}: each row of the product has the bits it has alone.
#[test]
fn quantized_matmul_rows_do_not_depend_on_m() {
    let mut rng = Lcg(7);
    let mut bf16_checked = 0;
    for name in FIXTURES {
        let ck = Checkpoint::open(&mlx(name)).unwrap();
        let model = Model::load(&mlx(name)).unwrap();
        let (h, i) = (model.config.hidden_size, model.config.intermediate_size);
        // mlx-lm and mlx-vlm name a multimodal model's decoder `language_model.model.`.
        let p = if ck.contains("language_model.model.embed_tokens.weight") {
            "language_model.model."
        } else {
            "model."
        };
        let mut weights: Vec<_> = [
            (format!("{p}layers.0.mlp.down_proj.weight"), [h, i]),
            (format!("{p}layers.1.mlp.up_proj.weight"), [i, h]),
        ]
        .iter()
        .map(|(w, shape)| ck.get(w, shape).unwrap())
        .collect();
        let experts = format!("{p}layers.0.experts.switch_glu");
        if let (Some(&[e, n, _]), Some(&[_, _, mi])) = (
            ck.shape(&format!("{experts}.gate_proj.weight")),
            ck.shape(&format!("{experts}.down_proj.weight")),
        ) {
            let gate = ck.get_stacked(&format!("{experts}.gate_proj.weight"), [e, n, h]).unwrap();
            let down = ck.get_stacked(&format!("{experts}.down_proj.weight"), [e, h, n]).unwrap();
            assert_eq!(mi * 32 / down.quant().unwrap().bits, n, "{name}: expert down_proj's packed width");
            weights.push(gate.slice_rows(n..2 * n).unwrap());
            weights.push(down.slice_rows(h..2 * h).unwrap());
        }
        // mlx-lm leaves a matrix whose rows its group size does not divide unquantized.
        weights.retain(|w| w.quant().is_some());
        assert!(!weights.is_empty(), "{name}: no quantized projection to test");
        for w in weights {
            let x = rng.vec(40 * w.cols);
            // f32 activations; bf16 ones on the weight with its scales and biases in bf16 (as
            // mlx-lm writes a bf16 model's), where that mode takes it (4-bit).
            let mut kernels: Vec<(&str, MatmulFn, Weight)> = vec![("f32", linear, w.clone())];
            let w16 = with_bf16_scales(&w);
            if Activations::Bf16.for_weight(&w16) == Activations::Bf16 {
                kernels.push(("bf16", linear_bf16, w16));
                bf16_checked += 1;
            }
            for (mode, matmul, w) in kernels {
                let mut alone = vec![0.0; 40 * w.rows];
                for (r, o) in alone.chunks_mut(w.rows).enumerate() {
                    matmul(&x[r * w.cols..(r + 1) * w.cols], 1, &w, None, o);
                }
                for m in [1, 2, 3, 5, 17, 40] {
                    let mut out = vec![0.0; m * w.rows];
                    matmul(&x[..m * w.cols], m, &w, None, &mut out);
                    assert_eq!(bits(&out), bits(&alone[..m * w.rows]), "{name}, {mode} activations: M = {m}");
                }
            }
        }
    }
    assert!(bf16_checked >= 8, "only {bf16_checked} weights went through the bf16 mode");
}

/// `w` (quantized, f32 scales and biases) with its scales and biases rounded to bf16.
fn with_bf16_scales(w: &Weight) -> Weight {
    let q = w.quant().unwrap();
    let round = |t: &Weight| {
        let bytes = t.to_f32().iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        Weight::from_le_bytes(bytes, WeightDtype::Bf16, t.rows, t.cols)
    };
    let quant = Quant {
        bits: q.bits,
        group: q.group,
        scales: round(&q.scales),
        biases: q.biases.as_ref().map(round),
    };
    let packed =
        Weight::from_le_bytes(w.bytes().to_vec(), WeightDtype::F32, w.rows, w.bytes().len() / w.rows / 4);
    Weight::quantized(packed, w.rows, w.cols, quant)
}

/// Negative control: candle's stock matmul over the same dequantized weights, in place of
/// either activation mode's kernel, gives rows whose bits depend on M.
#[test]
fn negative_control_stock_matmul_of_quantized_weights_depends_on_m() {
    let ck = Checkpoint::open(&mlx("trained-q4g64")).unwrap();
    let w = with_bf16_scales(&ck.get("model.layers.0.mlp.up_proj.weight", &[1024, 384]).unwrap());
    assert_eq!(Activations::Bf16.for_weight(&w), Activations::Bf16, "the bf16 mode takes this weight");
    let x = Lcg(3).vec(40 * w.cols);
    for matmul in [linear as MatmulFn, linear_bf16] {
        negative_control::set_stock_matmul(true);
        let mut alone = vec![0.0; w.rows];
        matmul(&x[..w.cols], 1, &w, None, &mut alone);
        let mut batched = vec![0.0; 40 * w.rows];
        matmul(&x, 40, &w, None, &mut batched);
        negative_control::set_stock_matmul(false);
        assert_ne!(bits(&alone), bits(&batched[..w.rows]), "the stock matmul should vary with M");
    }
}

/// A copy of a quantized fixture in a temporary directory, with `edit` applied.
fn edited(tag: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mtp-quantized-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(mlx("qwen3-q4g32").join(f), dir.join(f)).unwrap();
    }
    edit(&dir);
    dir
}

#[test]
fn unsupported_quantization_is_refused_by_name() {
    let dir = edited("mode", |d| {
        let path = d.join("config.json");
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        c["quantization"]["mode"] = "nvfp4".into();
        std::fs::write(&path, c.to_string()).unwrap();
    });
    let err = Model::load(&dir).err().expect("an unknown mode is refused").to_string();
    assert!(err.contains("quantization.mode") && err.contains("nvfp4"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
    // A scales tensor whose groups do not fit the row (a damaged or foreign file).
    let dir = edited("scales", |d| {
        // The same bytes declared as 144 rows of 4 groups instead of 192 rows of 3 (an
        // edit of equal length inside the safetensors header).
        let path = d.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let (from, to) = (
            r#""model.layers.0.mlp.up_proj.scales":{"data_offsets":[32352,34656],"dtype":"F32","shape":[192,3]}"#,
            r#""model.layers.0.mlp.up_proj.scales":{"data_offsets":[32352,34656],"dtype":"F32","shape":[144,4]}"#,
        );
        let at =
            bytes.windows(from.len()).position(|w| w == from.as_bytes()).expect("the fixture's header entry");
        let mut out = bytes.clone();
        out[at..at + to.len()].copy_from_slice(to.as_bytes());
        std::fs::write(&path, out).unwrap();
    });
    let err = Model::load(&dir).err().expect("misshapen scales are refused").to_string();
    assert!(err.contains("up_proj.scales"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A copy of every file of MLX fixture `name` in a temporary directory, its config.json's
/// `quantization` edited by `edit`.
fn with_quantization(name: &str, tag: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mtp-quantized-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(mlx(name)).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let path = dir.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut c["quantization"]);
    std::fs::write(&path, c.to_string()).unwrap();
    dir
}

/// config.json's `quantization` must describe the stored tensors (mlx-lm builds its layers
/// from it): bits, group size or mode the packed words and scales contradict are refused
/// naming the key, the tensor and both values; a module's own entry (mixed precision)
/// overrides the top-level values, and no mode is affine. Control: each copy untouched loads.
#[test]
fn quantization_contradicting_the_tensors_is_refused() {
    let down1 = "model.layers.1.mlp.down_proj";
    // Fixture, edit, the key and value named, the stored layout named.
    type Case = (&'static str, fn(&mut Value), &'static str, &'static str);
    let cases: [Case; 6] = [
        ("qwen3-q4g32", |q| q["bits"] = 8.into(), "`quantization.bits`: 8,", "bits 4"),
        ("qwen3-q4g32", |q| q["group_size"] = 64.into(), "`quantization.group_size`: 64,", "group_size 32"),
        ("qwen3-q4g32", |q| q["mode"] = "mxfp4".into(), "`quantization.mode`: \"mxfp4\",", "mode \"affine\""),
        (
            "qwen3-mxfp4",
            |q| drop(q.as_object_mut().unwrap().remove("mode")),
            "`quantization.mode`: \"affine\",",
            "mode \"mxfp4\"",
        ),
        (
            "qwen2-q4g32-mixed",
            |q| q["model.layers.1.mlp.down_proj"]["bits"] = 4.into(),
            "`quantization.model.layers.1.mlp.down_proj.bits`: 4,",
            "bits 8",
        ),
        (
            "qwen2-q4g32-mixed",
            |q| drop(q.as_object_mut().unwrap().remove("model.layers.1.mlp.down_proj")),
            "`quantization.bits`: 4,",
            "bits 8",
        ),
    ];
    for (i, (name, edit, key, stored)) in cases.into_iter().enumerate() {
        let dir = with_quantization(name, &format!("declared-{i}"), |_| {});
        Model::load(&dir).unwrap_or_else(|e| panic!("the untouched {name} does not load: {e}"));
        let dir = with_quantization(name, &format!("declared-{i}"), edit);
        let err = Model::load(&dir).err().unwrap_or_else(|| panic!("case {i}: loaded")).to_string();
        assert!(err.contains("config.json") && err.contains(key) && err.contains(stored), "case {i}: {err}");
        assert!(
            err.contains("tensor `") && (i < 4 || err.contains(&format!("`{down1}.weight`"))),
            "case {i}: {err}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The qwen3-target fixture on the test backend with K/V in `kv`.
fn qwen3_with_kv(kv: KvDtype) -> Model {
    let numerics = Numerics { kv, activations: common::test_activations() };
    Model::load_with(&common::fixture("qwen3-target"), common::backend(), numerics).unwrap()
}

/// Layer `layer`'s committed K and V bytes after a prefill of `prompt` (chunks of 16).
fn committed_after_prefill(model: &Model, prompt: &[u32], layer: usize) -> (Vec<u8>, Vec<u8>) {
    let mut cache = model.new_cache();
    prefill(model, &mut cache, prompt, 16, false, true).unwrap();
    cache.committed_bytes(layer).unwrap()
}

/// As `quantized_kv_entries_are_the_cpu_format_of_the_f32_kv` below, for bf16 K/V
/// (`--kv-dtype bf16`, every backend): layer 0's entries are the f32
/// K/V rounded to nearest-even bf16, little-endian, as the CPU's `Bf16Kv` stores them.
/// Control: layer 1 differs from the same recipe.
#[test]
fn bf16_kv_entries_are_the_f32_kv_rounded() {
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 5) % 200).collect();
    let committed = |model: &Model, layer| committed_after_prefill(model, &prompt, layer);
    let (f32_model, bf16_model) = (qwen3_with_kv(KvDtype::F32), qwen3_with_kv(KvDtype::Bf16));
    let recipe = |layer| {
        let (k, v) = committed(&f32_model, layer);
        [k, v].map(|plane| -> Vec<u8> {
            plane
                .chunks_exact(4)
                .flat_map(|b| {
                    half::bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes()
                })
                .collect()
        })
    };
    let [k, v] = recipe(0);
    let kvd = f32_model.config.num_key_value_heads * f32_model.config.head_dim;
    assert_eq!(k.len(), prompt.len() * kvd * 2);
    let (bk, bv) = committed(&bf16_model, 0);
    assert!(bk == k, "layer 0's bf16 K are not the f32 K rounded");
    assert!(bv == v, "layer 0's bf16 V are not the f32 V rounded");
    let [k1, _] = recipe(1);
    assert!(committed(&bf16_model, 1).0 != k1, "control: layer 1 should differ");
}

/// Layer 0's quantized K and V after a prefill equal, byte for byte, the CPU quantizer
/// (`QuantLayout::quantize_head`) applied to the f32 K/V the same backend stores with
/// `--kv-dtype f32` (layer 0's K/V do not depend on the K/V format): the backend quantizes
/// on store from the f32 values alone, in the CPU's format. Control: layer 1, whose inputs
/// passed through attention over quantized K/V, differs from the same recipe.
#[test]
fn quantized_kv_entries_are_the_cpu_format_of_the_f32_kv() {
    let prompt: Vec<u32> = (0..37).map(|i| (i * 11 + 3) % 200).collect();
    let committed = |model: &Model, layer| committed_after_prefill(model, &prompt, layer);
    let f32_model = qwen3_with_kv(KvDtype::F32);
    let (heads, head_dim) = (f32_model.config.num_key_value_heads, f32_model.config.head_dim);
    for (kv, bits) in [(KvDtype::Q8, 8), (KvDtype::Q4, 4)] {
        let layout = QuantLayout { heads, head_dim, bits };
        let quantized = qwen3_with_kv(kv);
        let recipe = |layer| {
            let (k, v) = committed(&f32_model, layer);
            [k, v].map(|plane| {
                let values: Vec<f32> =
                    plane.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                let mut out = vec![0u8; values.len() / head_dim * layout.head_bytes()];
                for (x, g) in values.chunks_exact(head_dim).zip(out.chunks_exact_mut(layout.head_bytes())) {
                    layout.quantize_head(x, g);
                }
                out
            })
        };
        let [k, v] = recipe(0);
        assert_eq!(k.len(), prompt.len() * layout.slot_bytes());
        let (qk, qv) = committed(&quantized, 0);
        assert!(qk == k, "{kv:?}: layer 0's K entries are not the CPU's quantization of the f32 K");
        assert!(qv == v, "{kv:?}: layer 0's V entries are not the CPU's quantization of the f32 V");
        let [k1, _] = recipe(1);
        assert!(committed(&quantized, 1).0 != k1, "{kv:?}: control: layer 1 should differ");
    }
}
