//! config.json's `quantization_config` (how transformers, AutoAWQ, GPTQ writers, llm-compressor
//! and Qwen/DeepSeek's FP8 releases describe a pre-quantized checkpoint), read into the one
//! [`Scheme`] the loader implements, or refused naming the key and its value.
//!
//! Contract: every key is either checked (its value must be one this crate computes
//! exactly) or on a short list of keys that do not change the math (calibration settings,
//! provenance); any other key is refused by name, so a config is never half-read. A
//! `quantization_config` without `quant_method` beside MLX's `quantization` is mlx-lm's copy
//! of it (mlx-lm reads `quantization` first), and [`crate::Checkpoint`] checks the tensors
//! against `quantization`.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::weights::WeightDtype;

/// The layouts [`crate::Checkpoint`] imports (docs/quantization.md says how each maps).
#[derive(Clone, Debug, PartialEq)]
pub enum Scheme {
    /// AutoAWQ's GEMM packing: `qweight` [in, out/8] with AWQ's nibble order, `qzeros`,
    /// `scales` [in/group, out].
    Awq { group: usize },
    /// GPTQ: `qweight` [in/pack, out], `qzeros` [groups, out/pack], `scales`, `g_idx`.
    /// `group` `None` is one group per row (`group_size: -1`); `zero_offset` is 1 for the
    /// `gptq` (v1) checkpoint format, which stores each zero less one, 0 for `gptq_v2`.
    Gptq { bits: usize, group: Option<usize>, zero_offset: u32 },
    /// compressed-tensors `pack-quantized`: `weight_packed` [out, in/pack], `weight_scale`
    /// [out, groups], `weight_zero_point` (asymmetric), `weight_shape`.
    CtInt { bits: usize, group: Option<usize>, symmetric: bool },
    /// FP8 E4M3 `weight` with `weight_scale_inv` per `[rows, cols]` block (Qwen, DeepSeek).
    Fp8Block { block: [usize; 2] },
    /// compressed-tensors `float-quantized` FP8: `weight` with `weight_scale` per tensor,
    /// output channel or `[rows, cols]` block.
    CtFp8 { strategy: Fp8Strategy },
}

/// How a compressed-tensors FP8 weight's scales are laid out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fp8Strategy {
    Tensor,
    Channel,
    Block([usize; 2]),
}

/// A checkpoint's declared scheme, with where it was declared and the dtype FP8 weights
/// dequantize to (the config's `torch_dtype`/`dtype`: bf16 unless it names f16 or f32).
#[derive(Clone, Debug)]
pub struct Declared {
    pub path: PathBuf,
    pub scheme: Scheme,
    pub dense: WeightDtype,
}

impl Scheme {
    /// The name the config gives it, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Scheme::Awq { .. } => "awq",
            Scheme::Gptq { .. } => "gptq",
            Scheme::CtInt { .. } => "compressed-tensors pack-quantized",
            Scheme::Fp8Block { .. } => "fp8",
            Scheme::CtFp8 { .. } => "compressed-tensors float-quantized",
        }
    }
}

/// One JSON object under `at` (a dotted key path) of `path`.
struct Obj<'a> {
    path: &'a Path,
    at: String,
    m: &'a Map<String, Value>,
}

impl<'a> Obj<'a> {
    fn new(path: &'a Path, at: String, v: &'a Value) -> Result<Obj<'a>> {
        let m =
            v.as_object().ok_or_else(|| Error::config(path, &at, format!("expected an object, got {v}")))?;
        Ok(Obj { path, at, m })
    }
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.at)
    }
    fn err(&self, k: &str, msg: impl Into<String>) -> Error {
        Error::config(self.path, &self.key(k), msg)
    }
    /// `k` when present and not null.
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.m.get(k).filter(|v| !v.is_null())
    }
    fn str(&self, k: &str) -> Result<Option<&'a str>> {
        self.get(k)
            .map(|v| v.as_str().ok_or_else(|| self.err(k, format!("expected a string, got {v}"))))
            .transpose()
    }
    fn int(&self, k: &str) -> Result<Option<i64>> {
        self.get(k)
            .map(|v| v.as_i64().ok_or_else(|| self.err(k, format!("expected an integer, got {v}"))))
            .transpose()
    }
    fn bool(&self, k: &str) -> Result<Option<bool>> {
        self.get(k)
            .map(|v| v.as_bool().ok_or_else(|| self.err(k, format!("expected true or false, got {v}"))))
            .transpose()
    }
    /// Refuses any key outside `known` (checked by the caller) and `inert` (keys that do
    /// not change the math).
    fn only(&self, known: &[&str], inert: &[&str]) -> Result<()> {
        match self.m.keys().find(|k| !known.contains(&k.as_str()) && !inert.contains(&k.as_str())) {
            Some(k) => Err(self.err(
                k,
                format!(
                    "is not a key this loader knows (value {}); it may change the math, so it is refused",
                    self.m[k]
                ),
            )),
            None => Ok(()),
        }
    }
    /// `k` must be absent, null, or one of `ok` (`{}`/`[]`/false count as absent when given).
    fn absent_or(&self, k: &str, ok: &[Value], why: &str) -> Result<()> {
        match self.get(k) {
            Some(v) if !ok.contains(v) => Err(self.err(k, format!("{v} is not supported: {why}"))),
            _ => Ok(()),
        }
    }
    /// A positive `bits` among `allowed`.
    fn bits(&self, k: &str, allowed: &[usize]) -> Result<usize> {
        let b = self.int(k)?.ok_or_else(|| self.err(k, "missing"))?;
        match usize::try_from(b).ok().filter(|b| allowed.contains(b)) {
            Some(b) => Ok(b),
            None => Err(self.err(k, format!("{b} is not supported (supported: {allowed:?})"))),
        }
    }
}

/// Keys of an optional module list (which modules stay unquantized): the loader reads each
/// tensor as stored, so they need no check beyond being a list.
fn module_list(o: &Obj, k: &str) -> Result<()> {
    match o.get(k) {
        Some(Value::Array(_)) | None => Ok(()),
        Some(v) => Err(o.err(k, format!("expected a list of module names, got {v}"))),
    }
}

/// The dtype FP8 weights dequantize to: the config's own (`torch_dtype`, transformers 5's
/// `dtype`), bf16 when it names none or another.
fn dense_dtype(root: &Value) -> WeightDtype {
    match root.get("torch_dtype").or_else(|| root.get("dtype")).and_then(Value::as_str) {
        Some("float16") => WeightDtype::F16,
        Some("float32") => WeightDtype::F32,
        _ => WeightDtype::Bf16,
    }
}

/// The scheme `root` (a config.json) declares in `quantization_config`, `None` when it
/// declares none (or MLX's copy of `quantization`), else an error naming the key.
pub fn parse(path: &Path, root: &Value) -> Result<Option<Declared>> {
    let Some(q) = root.get("quantization_config").filter(|q| !q.is_null()) else { return Ok(None) };
    let o = Obj::new(path, "quantization_config".into(), q)?;
    let scheme = match o.str("quant_method")? {
        // mlx-lm writes its `quantization` twice and reads `quantization` first: the
        // tensors are checked against that one.
        None if root.get("quantization").is_some_and(Value::is_object) => return Ok(None),
        None => {
            return Err(o.err(
                "quant_method",
                "missing, and no MLX `quantization` beside it: the loader cannot tell how the weights are quantized",
            ))
        }
        Some("awq") => awq(&o)?,
        Some("gptq") => gptq(&o)?,
        Some("compressed-tensors") => compressed(&o)?,
        Some("fp8") => fp8(&o)?,
        Some(m) => {
            return Err(o.err(
                "quant_method",
                format!("`{m}` is not supported (supported: awq, gptq, compressed-tensors, fp8, and MLX's `quantization`)"),
            ))
        }
    };
    Ok(Some(Declared { path: path.to_path_buf(), scheme, dense: dense_dtype(root) }))
}

/// A `group_size`: positive, or -1 (one group a row) where `per_row` allows it.
fn group(o: &Obj, k: &str, per_row: bool) -> Result<Option<usize>> {
    match o.int(k)? {
        Some(g) if g > 0 => Ok(Some(g as usize)),
        Some(-1) if per_row => Ok(None),
        Some(g) => Err(o.err(
            k,
            format!("{g} is not a group size (a positive number{})", if per_row { " or -1" } else { "" }),
        )),
        None => Err(o.err(k, "missing")),
    }
}

fn awq(o: &Obj) -> Result<Scheme> {
    o.only(
        &[
            "quant_method",
            "bits",
            "w_bit",
            "group_size",
            "q_group_size",
            "zero_point",
            "version",
            "modules_to_not_convert",
        ],
        &["backend", "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config"],
    )?;
    let bits_key = if o.get("w_bit").is_some() { "w_bit" } else { "bits" };
    o.bits(bits_key, &[4])?;
    let group_key = if o.get("q_group_size").is_some() { "q_group_size" } else { "group_size" };
    let group = group(o, group_key, false)?.unwrap_or(0);
    if o.bool("zero_point")? == Some(false) {
        return Err(
            o.err("zero_point", "false is not supported (AWQ's GEMM checkpoints with zero points are)")
        );
    }
    match o.str("version")? {
        None => {}
        Some(v) if v.eq_ignore_ascii_case("gemm") => {}
        Some(v) => {
            return Err(o.err("version", format!("`{v}` is not supported (the GEMM packing, `gemm`, is)")))
        }
    }
    module_list(o, "modules_to_not_convert")?;
    Ok(Scheme::Awq { group })
}

fn gptq(o: &Obj) -> Result<Scheme> {
    o.only(
        &[
            "quant_method",
            "bits",
            "group_size",
            "desc_act",
            "sym",
            "checkpoint_format",
            "format",
            "pack_dtype",
            "dynamic",
            "lm_head",
            "modules_in_block_to_quantize",
        ],
        &[
            "damp_percent",
            "damp_auto_increment",
            "static_groups",
            "true_sequential",
            "model_name_or_path",
            "model_file_base_name",
            "meta",
            "tokenizer",
            "dataset",
            "use_exllama",
            "exllama_config",
            "cache_block_outputs",
            "batch_size",
            "use_cuda_fp16",
            "module_name_preceding_first_block",
            "block_name_to_quantize",
            "max_input_length",
            "backend",
            "mse",
            "quantizer",
            "v2",
            "act_group_aware",
        ],
    )?;
    let bits = o.bits("bits", &[4, 8])?;
    let group = group(o, "group_size", true)?;
    // `desc_act` is checked against each weight's `g_idx`: act-order groups that are the
    // plain contiguous ones compute the same function; any other order is refused there.
    o.bool("desc_act")?;
    o.bool("sym")?;
    o.bool("lm_head")?;
    let fmt_key = if o.get("checkpoint_format").is_some() { "checkpoint_format" } else { "format" };
    let zero_offset = match o.str(fmt_key)? {
        None | Some("gptq") => 1,
        Some("gptq_v2") => 0,
        Some(f) => return Err(o.err(fmt_key, format!("`{f}` is not supported (gptq and gptq_v2 are)"))),
    };
    o.absent_or("pack_dtype", &["int32".into()], "codes are read packed in int32 words")?;
    o.absent_or("dynamic", &[Value::Object(Map::new())], "per-module overrides of bits or group size")?;
    module_list(o, "modules_in_block_to_quantize")?;
    Ok(Scheme::Gptq { bits, group, zero_offset })
}

fn fp8(o: &Obj) -> Result<Scheme> {
    o.only(
        &[
            "quant_method",
            "fmt",
            "activation_scheme",
            "weight_block_size",
            "modules_to_not_convert",
            "ignored_layers",
        ],
        &["dequantize"],
    )?;
    if let Some(f) = o.str("fmt")? {
        if f != "e4m3" {
            return Err(o.err("fmt", format!("`{f}` is not supported (e4m3 is)")));
        }
    }
    match o.str("activation_scheme")? {
        None | Some("dynamic") => {}
        Some(s) => {
            return Err(o.err(
                "activation_scheme",
                format!("`{s}` is not supported (dynamic is: the weights are dequantized and activations stay 16-bit)"),
            ))
        }
    }
    module_list(o, "modules_to_not_convert")?;
    module_list(o, "ignored_layers")?;
    let block = block_size(o, "weight_block_size")?.ok_or_else(|| {
        o.err("weight_block_size", "missing (per-block scales `weight_scale_inv` are read by it)")
    })?;
    Ok(Scheme::Fp8Block { block })
}

/// A `[rows, cols]` block of positive sizes under `k`.
fn block_size(o: &Obj, k: &str) -> Result<Option<[usize; 2]>> {
    let Some(v) = o.get(k) else { return Ok(None) };
    let dims: Option<Vec<usize>> = v
        .as_array()
        .and_then(|a| a.iter().map(|d| d.as_u64().filter(|&d| d > 0).map(|d| d as usize)).collect());
    match dims.as_deref() {
        Some(&[r, c]) => Ok(Some([r, c])),
        _ => Err(o.err(k, format!("{v} is not a block size (two positive numbers, rows then columns)"))),
    }
}

/// compressed-tensors: one weights scheme for every config group.
fn compressed(o: &Obj) -> Result<Scheme> {
    o.only(
        &[
            "quant_method",
            "format",
            "config_groups",
            "ignore",
            "kv_cache_scheme",
            "sparsity_config",
            "transform_config",
            "quantization_status",
        ],
        &["global_compression_ratio", "version", "provider"],
    )?;
    o.absent_or("kv_cache_scheme", &[], "quantized K/V scales from the checkpoint (use --kv-bits)")?;
    o.absent_or("sparsity_config", &[Value::Object(Map::new())], "sparse weights")?;
    o.absent_or("transform_config", &[Value::Object(Map::new())], "weight transforms")?;
    o.absent_or(
        "quantization_status",
        &["compressed".into(), "frozen".into()],
        "weights not stored compressed",
    )?;
    module_list(o, "ignore")?;
    let top_format = o.str("format")?;
    let groups = o.get("config_groups").ok_or_else(|| o.err("config_groups", "missing"))?;
    let groups = Obj::new(o.path, o.key("config_groups"), groups)?;
    let mut found: Option<(Scheme, String)> = None;
    for name in groups.m.keys() {
        let g = Obj::new(o.path, groups.key(name), &groups.m[name])?;
        let s = ct_group(&g, top_format)?;
        match &found {
            Some((first, at)) if *first != s => {
                return Err(g.err(
                    "weights",
                    format!("differs from {at}'s scheme: one scheme for every group is supported"),
                ))
            }
            Some(_) => {}
            None => found = Some((s, g.at.clone())),
        }
    }
    found.map(|f| f.0).ok_or_else(|| o.err("config_groups", "is empty"))
}

/// One config group's scheme, in the checkpoint's `format` (or the group's own).
fn ct_group(g: &Obj, top_format: Option<&str>) -> Result<Scheme> {
    g.only(&["targets", "weights", "input_activations", "output_activations", "format"], &[])?;
    let format = match g.str("format")? {
        Some(f) => (f, g.key("format")),
        None => (top_format.unwrap_or("<none>"), "quantization_config.format".to_string()),
    };
    g.absent_or("output_activations", &[], "quantized outputs")?;
    let w = Obj::new(g.path, g.key("weights"), g.get("weights").ok_or_else(|| g.err("weights", "missing"))?)?;
    w.only(
        &[
            "num_bits",
            "type",
            "symmetric",
            "group_size",
            "strategy",
            "block_structure",
            "dynamic",
            "actorder",
            "zp_dtype",
            "scale_dtype",
        ],
        &["observer", "observer_kwargs"],
    )?;
    if w.bool("dynamic")? == Some(true) {
        return Err(w.err("dynamic", "true is not supported (weights stored with their scales are)"));
    }
    // `weight` act-order only changes the order GPTQ quantized in; `group` stores a g_idx.
    w.absent_or(
        "actorder",
        &["weight".into(), false.into()],
        "activation-ordered groups (a `weight_g_idx`)",
    )?;
    let typ = w.str("type")?.unwrap_or("int");
    let strategy = w.str("strategy")?.unwrap_or("tensor");
    let symmetric = w.bool("symmetric")?.unwrap_or(true);
    let bad_strategy =
        |ok: &str| w.err("strategy", format!("`{strategy}` is not supported for these weights ({ok} are)"));
    match (format.0, typ) {
        ("pack-quantized", "int") => {
            let bits = w.bits("num_bits", &[4, 8])?;
            let group = match strategy {
                "group" => Some(group(&w, "group_size", false)?.unwrap_or(0)),
                "channel" => None,
                _ => return Err(bad_strategy("group and channel")),
            };
            // W4A16: activations stay 16-bit.
            g.absent_or("input_activations", &[], "quantized activations with int weights")?;
            Ok(Scheme::CtInt { bits, group, symmetric })
        }
        ("float-quantized", "float") => {
            w.bits("num_bits", &[8])?;
            if !symmetric {
                return Err(w.err("symmetric", "false is not supported for FP8 weights"));
            }
            let strategy = match strategy {
                "tensor" => Fp8Strategy::Tensor,
                "channel" => Fp8Strategy::Channel,
                "block" => Fp8Strategy::Block(
                    block_size(&w, "block_structure")?.ok_or_else(|| w.err("block_structure", "missing"))?,
                ),
                _ => return Err(bad_strategy("tensor, channel and block")),
            };
            if let Some(a) = g.get("input_activations") {
                let a = Obj::new(g.path, g.key("input_activations"), a)?;
                if a.bool("dynamic")? != Some(true) {
                    return Err(a.err(
                        "dynamic",
                        "static activation scales (`input_scale`) are not supported (dynamic ones are: the weights \
                         are dequantized and activations stay 16-bit)",
                    ));
                }
            }
            Ok(Scheme::CtFp8 { strategy })
        }
        (f, t) => Err(Error::config(
            g.path,
            &format.1,
            format!("`{f}` with `{t}` weights is not supported (pack-quantized int and float-quantized float are)"),
        )),
    }
}
