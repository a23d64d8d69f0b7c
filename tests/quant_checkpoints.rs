//! Pre-quantized checkpoints that are not MLX's: AWQ, GPTQ, compressed-tensors INT4 and
//! FP8, Qwen/DeepSeek FP8 (`tests/fixtures/quant`, written by its `make_quant_fixtures.py`).
//! Each format's loaded weights are bit for bit the script's own numpy dequantization, a
//! greedy generation equals the dequantized checkpoint's, negative controls show the
//! comparison catches a wrong nibble order, zero offset or scale orientation, and every
//! setting not implemented is refused naming its key.

mod common;

use std::path::{Path, PathBuf};

use mtp::base::{Checkpoint, Config};
use mtp::engine::{prefill, Request};
use mtp::model::Model;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};

const STEMS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// Each format and the reference its dequantization must equal.
const FORMATS: [(&str, &str); 5] = [
    ("awq", "int4-dequant"),
    ("gptq", "int4-dequant"),
    ("ct-int4", "int4-dequant"),
    ("fp8", "fp8-dequant"),
    ("ct-fp8", "ct-fp8-dequant"),
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant")
}

/// A temporary directory, removed when dropped.
struct Tmp(PathBuf);

impl std::ops::Deref for Tmp {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Tmp {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// A fresh directory holding format `fmt`'s checkpoint: its config, index and shard, the
/// shared base shard, and hf-tiny's tokenizer (`tag` names the copy; each call gets its own
/// directory, since tests running at once assemble the same tags and remove theirs when done).
fn assemble(fmt: &str, tag: &str) -> Tmp {
    static COPIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("mtp-quant-{tag}-{}-{n}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixtures().join(fmt)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    std::fs::copy(fixtures().join("base.safetensors"), dir.join("model-00001-of-00002.safetensors")).unwrap();
    let tiny = common::fixture("qwen3-draft");
    for f in ["tokenizer.json", "generation_config.json"] {
        std::fs::copy(tiny.join(f), dir.join(f)).unwrap();
    }
    Tmp(dir)
}

/// A checkpoint of the base shard and reference `name`'s dequantized projections, with
/// hf-tiny's plain config (`dtype` as given).
fn reference(name: &str, dtype: &str) -> Tmp {
    let dir = assemble("awq", &format!("ref-{name}"));
    let shard = dir.join("model-00002-of-00002.safetensors");
    std::fs::copy(fixtures().join(format!("{name}.safetensors")), &shard).unwrap();
    let mut map = serde_json::Map::new();
    for (shard, names) in [
        ("model-00001-of-00002.safetensors", tensor_names(&fixtures().join("base.safetensors"))),
        ("model-00002-of-00002.safetensors", tensor_names(&shard)),
    ] {
        for n in names {
            map.insert(n, json!(shard));
        }
    }
    write_json(&dir.join("model.safetensors.index.json"), &json!({"metadata": {}, "weight_map": map}));
    edit_config(&dir, |c| {
        c.as_object_mut().unwrap().remove("quantization_config");
        c["dtype"] = json!(dtype);
    });
    dir
}

fn tensor_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    safetensors::SafeTensors::deserialize(&bytes).unwrap().names().into_iter().map(String::from).collect()
}

fn write_json(path: &Path, v: &Value) {
    std::fs::write(path, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut c);
    write_json(&path, &c);
}

/// Rewrites tensor `name` of `dir`'s quantized shard with `f` applied to its bytes.
fn edit_tensor(dir: &Path, name: &str, f: impl FnOnce(&[usize], &mut Vec<u8>)) {
    let path = dir.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let t = tensors.iter_mut().find(|t| t.0 == name).unwrap_or_else(|| panic!("no tensor {name}"));
    f(&t.2.clone(), &mut t.3);
    let views: Vec<(String, TensorView)> =
        tensors.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

/// Reference `name`'s projections, as f32 values.
fn reference_weights(name: &str) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(fixtures().join(format!("{name}.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    STEMS
        .iter()
        .map(|s| {
            let n = format!("model.layers.0.{s}.weight");
            let v = st.tensor(&n).unwrap();
            let vals = match v.dtype() {
                Dtype::F32 => {
                    v.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
                }
                Dtype::BF16 => v
                    .data()
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32())
                    .collect(),
                d => panic!("{n}: {d:?}"),
            };
            (n, v.shape().to_vec(), vals)
        })
        .collect()
}

/// The first projection of `dir` whose loaded values differ from reference `name`'s, bit
/// for bit, or `Ok(())`; a load error as it is.
fn compare(dir: &Path, name: &str) -> Result<Result<(), String>, String> {
    let ck = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    for (n, shape, want) in reference_weights(name) {
        let w = ck.get(&n, &shape).map_err(|e| e.to_string())?;
        let got = w.to_f32();
        if let Some(i) = (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            return Ok(Err(format!("{n}: value {i} is {} against the reference's {}", got[i], want[i])));
        }
    }
    Ok(Ok(()))
}

#[test]
fn loaded_weights_are_the_reference_dequantization_bit_for_bit() {
    for (fmt, want) in FORMATS {
        let dir = assemble(fmt, fmt);
        assert_eq!(compare(&dir, want), Ok(Ok(())), "{fmt}");
        // The whole checkpoint loads, every tensor accounted for.
        Model::load(&dir).unwrap_or_else(|e| panic!("{fmt}: {e}"));
    }
}

/// Each control changes one thing a wrong loader would get wrong; the comparison must
/// catch it (so a loader with that mistake fails the test above).
#[test]
fn negative_controls_differ_from_the_reference() {
    let q = "model.layers.0.self_attn.q_proj";
    // AWQ's words with their nibbles in plain order: what reading AWQ's order as GPTQ's gives.
    let dir = assemble("awq", "control-awq");
    edit_tensor(&dir, &format!("{q}.qweight"), |_, b| {
        for w in b.chunks_exact_mut(4) {
            let v = u32::from_le_bytes(w.try_into().unwrap());
            let order = [0, 4, 1, 5, 2, 6, 3, 7];
            let plain = (0..8).fold(0u32, |acc, j| acc | ((v >> (4 * order[j])) & 15) << (4 * j));
            w.copy_from_slice(&plain.to_le_bytes());
        }
    });
    assert!(
        matches!(compare(&dir, "int4-dequant"), Ok(Err(_))),
        "AWQ's nibble order read as sequential passed"
    );
    // GPTQ v1's zeros read without their offset of one.
    let dir = assemble("gptq", "control-gptq");
    edit_config(&dir, |c| c["quantization_config"]["checkpoint_format"] = json!("gptq_v2"));
    assert!(matches!(compare(&dir, "int4-dequant"), Ok(Err(_))), "GPTQ zeros without the +1 passed");
    // FP8 scales with their block grid transposed (q_proj's is 2 x 2).
    let dir = assemble("fp8", "control-fp8");
    edit_tensor(&dir, &format!("{q}.weight_scale_inv"), |shape, b| {
        assert_eq!(shape, [2, 2]);
        let s: Vec<[u8; 4]> = b.chunks_exact(4).map(|c| c.try_into().unwrap()).collect();
        *b = [s[0], s[2], s[1], s[3]].concat();
    });
    assert!(matches!(compare(&dir, "fp8-dequant"), Ok(Err(_))), "a transposed block grid passed");
    // compressed-tensors' zero points read as symmetric ones.
    let dir = assemble("ct-int4", "control-ct");
    edit_tensor(&dir, &format!("{q}.weight_zero_point"), |_, b| {
        b.iter_mut().for_each(|x| *x = 0x88);
    });
    assert!(matches!(compare(&dir, "int4-dequant"), Ok(Err(_))), "zero points of 8 passed");
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 9, 200, 31, 7], vec![300, 12, 44, 45, 46, 47, 100, 101, 2, 3, 480]]
}

/// Prefill logits of each prompt, and greedy tokens of all of them batched.
fn run(dir: &Path) -> (Vec<Vec<f32>>, Vec<Vec<u32>>) {
    let model = common::load(dir);
    let logits = prompts()
        .iter()
        .map(|p| {
            let mut cache = model.new_cache();
            prefill(&model, &mut cache, p, 4, false, true).unwrap().logits
        })
        .collect();
    let requests: Vec<Request> =
        prompts().into_iter().enumerate().map(|(i, p)| common::request(&i.to_string(), p, 24)).collect();
    let tokens = common::plain(&model, &requests, 2).into_iter().map(|r| r.unwrap().tokens).collect();
    (logits, tokens)
}

/// FP8 dequantizes at load into the bf16 the reference holds: the same model, the same
/// bits. INT4 runs the quantized matmul over the reference's values: on the CPU the
/// fixtures' groups of 16 dequantize each row (exactly) and take the f32 tiles, so the bits
/// are the reference's too (measured: 0 difference, and on the Metal emulator, which
/// dequantizes each value as it loads it); groups of 32 and up take the CPU's fused
/// kernel, `scale * dot(x, q) + bias * sum(x)` a group, another order of the same sums, and
/// the GPUs' quantized matmuls theirs: there the logits agree to rounding (asserted within
/// 1e-4) and the greedy tokens are equal.
#[test]
fn generation_equals_the_dequantized_checkpoints() {
    for (fmt, want) in FORMATS {
        let dtype = if fmt.contains("fp8") { "bfloat16" } else { "float32" };
        let (got, want) = (run(&assemble(fmt, &format!("gen-{fmt}"))), run(&reference(want, dtype)));
        assert_eq!(got.1, want.1, "{fmt}: greedy tokens");
        let worst = got
            .0
            .iter()
            .flatten()
            .zip(want.0.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("{fmt}: prefill logits within {worst:e} of the dequantized checkpoint's");
        if fmt.contains("fp8") {
            assert_eq!(worst, 0.0, "{fmt}: logits differ from the bf16 reference");
        } else {
            assert!(worst < 1e-4, "{fmt}: logits differ by {worst}");
        }
    }
}

/// `config` with `quantization_config` replaced by `qc`, parsed: the error's text.
fn refusal(fmt: &str, qc: impl FnOnce(&mut Value)) -> String {
    let path = fixtures().join(fmt).join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    qc(&mut c["quantization_config"]);
    match Config::from_value(&path, &c) {
        Ok(_) => panic!("{fmt}: {} was accepted", c["quantization_config"]),
        Err(e) => e.to_string(),
    }
}

#[test]
fn settings_not_implemented_are_refused_by_key() {
    type Edit = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "awq",
            Box::new(|q| q["quant_method"] = json!("bitsandbytes")),
            "`quantization_config.quant_method`",
        ),
        ("awq", Box::new(|q| q["bits"] = json!(3)), "`quantization_config.bits`"),
        ("awq", Box::new(|q| q["version"] = json!("gemv")), "`quantization_config.version`"),
        ("awq", Box::new(|q| q["zero_point"] = json!(false)), "`quantization_config.zero_point`"),
        ("awq", Box::new(|q| q["new_knob"] = json!(1)), "`quantization_config.new_knob`"),
        ("gptq", Box::new(|q| q["bits"] = json!(3)), "`quantization_config.bits`"),
        (
            "gptq",
            Box::new(|q| q["checkpoint_format"] = json!("marlin")),
            "`quantization_config.checkpoint_format`",
        ),
        (
            "gptq",
            Box::new(|q| q["dynamic"] = json!({"layers.0": {"bits": 8}})),
            "`quantization_config.dynamic`",
        ),
        ("gptq", Box::new(|q| q["group_size"] = json!(0)), "`quantization_config.group_size`"),
        (
            "fp8",
            Box::new(|q| q["activation_scheme"] = json!("static")),
            "`quantization_config.activation_scheme`",
        ),
        ("fp8", Box::new(|q| q["fmt"] = json!("e5m2")), "`quantization_config.fmt`"),
        (
            "fp8",
            Box::new(|q| q["weight_block_size"] = json!([128])),
            "`quantization_config.weight_block_size`",
        ),
        (
            "fp8",
            Box::new(|q| {
                q.as_object_mut().unwrap().remove("weight_block_size");
            }),
            "`quantization_config.weight_block_size`",
        ),
        ("ct-int4", Box::new(|q| q["format"] = json!("marlin-24")), "`quantization_config.format`"),
        (
            "ct-int4",
            Box::new(|q| q["config_groups"]["group_0"]["weights"]["num_bits"] = json!(2)),
            "`quantization_config.config_groups.group_0.weights.num_bits`",
        ),
        (
            "ct-int4",
            Box::new(|q| q["config_groups"]["group_0"]["weights"]["actorder"] = json!("group")),
            "`quantization_config.config_groups.group_0.weights.actorder`",
        ),
        (
            "ct-int4",
            Box::new(|q| q["config_groups"]["group_0"]["weights"]["strategy"] = json!("block")),
            "`quantization_config.config_groups.group_0.weights.strategy`",
        ),
        (
            "ct-int4",
            Box::new(|q| q["kv_cache_scheme"] = json!({"num_bits": 8})),
            "`quantization_config.kv_cache_scheme`",
        ),
        (
            "ct-fp8",
            Box::new(|q| q["config_groups"]["group_0"]["input_activations"]["dynamic"] = json!(false)),
            "`quantization_config.config_groups.group_0.input_activations.dynamic`",
        ),
    ];
    for (fmt, edit, key) in cases {
        let e = refusal(fmt, edit);
        assert!(e.contains(key), "{fmt}: expected {key} in: {e}");
    }
    // MLX's copy of `quantization` is MLX's; anything else without a method is refused.
    let path = fixtures().join("awq/config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mlx = json!({"group_size": 64, "bits": 4});
    c["quantization_config"] = mlx.clone();
    assert!(Config::from_value(&path, &c).unwrap_err().to_string().contains("quant_method"));
    c["quantization"] = mlx;
    Config::from_value(&path, &c).unwrap();
}

/// Refusals only the tensors can tell: act-order groups, a group size the kernels do not
/// take, a 16-bit checkpoint carrying a quantization config (it was loaded ignoring it).
#[test]
fn loads_that_cannot_be_exact_are_refused_by_key() {
    let load_err = |dir: &Path| Model::load(dir).err().map(|e| e.to_string()).unwrap_or_default();
    let g_idx = "model.layers.0.self_attn.q_proj.g_idx";
    let dir = assemble("gptq", "desc-act-trivial");
    edit_config(&dir, |c| c["quantization_config"]["desc_act"] = json!(true));
    assert_eq!(compare(&dir, "int4-dequant"), Ok(Ok(())), "desc_act with the contiguous g_idx");
    edit_tensor(&dir, g_idx, |_, b| b.swap(0, 4 * 20));
    let e = load_err(&dir);
    assert!(e.contains("`quantization_config.desc_act`") && e.contains(g_idx), "{e}");
    let dir = assemble("gptq", "group-12");
    edit_config(&dir, |c| c["quantization_config"]["group_size"] = json!(12));
    let e = load_err(&dir);
    assert!(e.contains("`quantization_config.group_size`") && e.contains("groups of 12"), "{e}");
    for (method, qc) in [
        (
            "fp8",
            json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
        ),
        (
            "awq",
            json!({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}),
        ),
    ] {
        let dir = reference("fp8-dequant", "bfloat16");
        edit_config(&dir, |c| c["quantization_config"] = qc);
        let e = load_err(&dir);
        assert!(e.contains("`quantization_config.quant_method`") && e.contains("no weight"), "{method}: {e}");
    }
}

#[test]
fn cli_generates_from_an_awq_checkpoint() {
    let dir = assemble("awq", "cli");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mtp"))
        .args(["generate", "--target", dir.to_str().unwrap(), "--drafter", "none", "--max-tokens", "8"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.lines().count() > 0 && stdout.contains("\"tokens\""), "{stdout}");
}
