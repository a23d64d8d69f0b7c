//! The Gemma 4 text config (`model_type: gemma4_text`, or the `text_config` of a
//! `Gemma4ForConditionalGeneration` / assistant checkpoint): what [`mtp_base::Config`] does not
//! say about the family, resolved per layer.

use std::path::Path;

use serde_json::Value;

use mtp_base::config::{tensor_size, MAX_LAYERS, MAX_POSITIONS};
use mtp_base::error::{Error, Result};
use mtp_kernels::ops::RopeTable;

/// Attention kind of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Keys `(p - sliding_window, p]`.
    Sliding,
    /// Keys `[0, p]`.
    Full,
}

/// One decoder layer's attention shape, resolved from `layer_types` and `per_layer_config`.
#[derive(Clone, Copy, Debug)]
pub struct LayerSpec {
    pub kind: LayerKind,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// The earlier layer whose K/V this one reads (`num_kv_shared_layers`); `None` when it
    /// stores its own or (an assistant's layer) reads another model's.
    pub kv_source: Option<usize>,
    /// Whether the layer has K/V projections of its own (false on KV-shared layers and on
    /// every layer of an assistant, whose layers all read the target's K/V).
    pub own_kv: bool,
    /// `attention_k_eq_v` on a full layer: no `v_proj`, V is K before its norm.
    pub k_eq_v: bool,
    pub intermediate: usize,
}

/// RoPE of one layer kind: `default` (every frequency) or `proportional` (the first
/// `partial_rotary_factor` of the frequencies; the rest rotate by zero).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    pub theta: f32,
    pub partial: f32,
}

impl Rope {
    /// The cos/sin table for heads of `head_dim`, as transformers computes the inverse
    /// frequencies (`1 / theta^(2i / head_dim)` for the rotated pairs).
    pub fn table(&self, head_dim: usize, max_pos: usize) -> RopeTable {
        let half = head_dim / 2;
        let rotated = ((self.partial * head_dim as f32) as usize / 2).min(half);
        let inv_freq = (0..half)
            .map(|i| if i < rotated { 1.0 / self.theta.powf((2 * i) as f32 / head_dim as f32) } else { 0.0 })
            .collect();
        RopeTable::from_inv_freq(inv_freq, max_pos)
    }
}

/// The MoE block of every layer (`enable_moe_block`).
#[derive(Clone, Copy, Debug)]
pub struct Moe {
    pub experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
}

#[derive(Clone, Debug)]
pub struct Gemma4Config {
    pub layers: Vec<LayerSpec>,
    pub sliding_window: usize,
    pub rope_sliding: Rope,
    pub rope_full: Rope,
    pub final_logit_softcapping: Option<f32>,
    /// Per-layer inputs width (`hidden_size_per_layer_input`), 0 when absent.
    pub per_layer_input: usize,
    pub per_layer_vocab: usize,
    pub moe: Option<Moe>,
}

fn num(path: &Path, v: &Value, key: &str) -> Result<Option<f64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| Error::config(path, key, format!("expected a number, got {x}"))),
    }
}

fn count(path: &Path, v: &Value, key: &str, default: usize) -> Result<usize> {
    match num(path, v, key)? {
        None => Ok(default),
        Some(f) if f >= 0.0 && f.fract() == 0.0 => Ok(f as usize),
        Some(f) => Err(Error::config(path, key, format!("expected a non-negative integer, got {f}"))),
    }
}

fn flag(path: &Path, v: &Value, key: &str) -> Result<bool> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(x) => Err(Error::config(path, key, format!("expected true or false, got {x}"))),
    }
}

fn rope(path: &Path, v: &Value, kind: &str, default: Rope) -> Result<Rope> {
    let key = format!("rope_parameters.{kind}");
    let Some(p) = v.get("rope_parameters").and_then(|p| p.get(kind)).filter(|p| !p.is_null()) else {
        return Ok(default);
    };
    let theta = num(path, p, "rope_theta")?.map_or(default.theta, |t| t as f32);
    if !(theta.is_finite() && theta > 0.0) {
        return Err(Error::config(
            path,
            &format!("{key}.rope_theta"),
            format!("{theta} is not a positive number"),
        ));
    }
    match p.get("rope_type").and_then(|t| t.as_str()).unwrap_or("default") {
        "default" => Ok(Rope { theta, partial: 1.0 }),
        "proportional" => {
            if num(path, p, "factor")?.is_some_and(|f| f != 1.0) {
                return Err(Error::config(path, &format!("{key}.factor"), "only 1.0 is supported"));
            }
            let partial = num(path, p, "partial_rotary_factor")?.unwrap_or(1.0) as f32;
            if !(partial > 0.0 && partial <= 1.0) {
                return Err(Error::config(
                    path,
                    &format!("{key}.partial_rotary_factor"),
                    "must be in (0, 1]",
                ));
            }
            Ok(Rope { theta, partial })
        }
        other => Err(Error::config(
            path,
            &format!("{key}.rope_type"),
            format!("`{other}` is not supported for Gemma 4 (default, proportional)"),
        )),
    }
}

impl Gemma4Config {
    /// Reads the text config `v` (already the `text_config` of a wrapper) of `path`.
    pub fn from_value(path: &Path, v: &Value) -> Result<Gemma4Config> {
        let n_layers = count(path, v, "num_hidden_layers", 0)?;
        let heads = count(path, v, "num_attention_heads", 0)?;
        let head_dim = count(path, v, "head_dim", 256)?;
        let kv_heads = count(path, v, "num_key_value_heads", heads)?;
        let intermediate = count(path, v, "intermediate_size", 0)?;
        if n_layers == 0 || heads == 0 || intermediate == 0 {
            return Err(Error::config(path, "num_hidden_layers", "Gemma 4 needs layers, heads and an MLP"));
        }
        if n_layers > MAX_LAYERS {
            return Err(Error::config(
                path,
                "num_hidden_layers",
                format!("{n_layers} is over {MAX_LAYERS} layers"),
            ));
        }
        match v.get("hidden_activation").and_then(|a| a.as_str()) {
            None | Some("gelu_pytorch_tanh") => {}
            Some(other) => {
                return Err(Error::config(
                    path,
                    "hidden_activation",
                    format!("`{other}` is not supported (gelu_pytorch_tanh)"),
                ))
            }
        }
        if v.get("use_bidirectional_attention").and_then(|b| b.as_str()).is_some() {
            return Err(Error::config(
                path,
                "use_bidirectional_attention",
                "only causal text attention is supported",
            ));
        }
        let mut kinds: Vec<LayerKind> = match v.get("layer_types").filter(|t| !t.is_null()) {
            Some(Value::Array(a)) if a.len() == n_layers => a
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    Some("full_attention") => Ok(LayerKind::Full),
                    _ => Err(Error::config(
                        path,
                        &format!("layer_types[{i}]"),
                        format!("unknown layer type {t} (full_attention, sliding_attention)"),
                    )),
                })
                .collect::<Result<_>>()?,
            Some(other) => {
                let got: String = other.to_string().chars().take(80).collect();
                return Err(Error::config(
                    path,
                    "layer_types",
                    format!("expected a list of num_hidden_layers ({n_layers}) layer types, got {got}"),
                ));
            }
            // transformers' default: five sliding layers, then a full one.
            None => (0..n_layers)
                .map(|i| if (i + 1) % 6 == 0 { LayerKind::Full } else { LayerKind::Sliding })
                .collect(),
        };
        // transformers forces the last layer to full attention.
        kinds[n_layers - 1] = LayerKind::Full;
        let k_eq_v = flag(path, v, "attention_k_eq_v")?;
        let global_head_dim = count(path, v, "global_head_dim", 512)?;
        let global_kv = count(path, v, "num_global_key_value_heads", 0)?;
        let overrides = v.get("per_layer_config").filter(|p| !p.is_null());
        if let Some(o) = overrides {
            let Some(map) = o.as_object() else {
                return Err(Error::config(
                    path,
                    "per_layer_config",
                    "expected an object of layer index to settings",
                ));
            };
            // A key that names no layer was ignored: its settings applied nowhere.
            let names_a_layer =
                |k: &str| k.parse::<usize>().is_ok_and(|i| i < n_layers && i.to_string() == k);
            if let Some(k) = map.keys().find(|k| !names_a_layer(k)) {
                return Err(Error::config(
                    path,
                    &format!("per_layer_config.{k}"),
                    format!("names no layer of the {n_layers} (0 to {})", n_layers - 1),
                ));
            }
        }
        let shared = count(path, v, "num_kv_shared_layers", 0)?;
        // An assistant shares every layer: it reads its target's K/V.
        if shared > n_layers {
            return Err(Error::config(
                path,
                "num_kv_shared_layers",
                format!("{shared} of {n_layers} layers"),
            ));
        }
        let first_shared = n_layers - shared;
        let double_wide = flag(path, v, "use_double_wide_mlp")?;
        let mut layers = Vec::with_capacity(n_layers);
        for (i, &kind) in kinds.iter().enumerate() {
            let (mut hd, mut kvh) = (head_dim, kv_heads);
            match overrides {
                Some(o) => {
                    if let Some(l) = o.get(i.to_string()).filter(|l| !l.is_null()) {
                        let key = format!("per_layer_config.{i}");
                        hd = count(path, l, "head_dim", hd)
                            .map_err(|_| Error::config(path, &key, "bad head_dim"))?;
                        kvh = count(path, l, "num_key_value_heads", kvh)
                            .map_err(|_| Error::config(path, &key, "bad num_key_value_heads"))?;
                    }
                }
                None if kind == LayerKind::Full => {
                    hd = global_head_dim;
                    if k_eq_v && global_kv > 0 {
                        kvh = global_kv;
                    }
                }
                None => {}
            }
            if hd == 0 || hd % 2 != 0 || kvh == 0 || heads % kvh != 0 {
                return Err(Error::config(
                    path,
                    &format!("per_layer_config.{i}"),
                    format!(
                        "head_dim {hd} must be even and num_key_value_heads {kvh} must divide \
                         num_attention_heads {heads}"
                    ),
                ));
            }
            tensor_size(path, &[("num_attention_heads", heads), ("head_dim", hd)])
                .map_err(|e| e.under(&format!("per_layer_config.{i}")))?;
            let kv_source = if i >= first_shared && first_shared > 0 {
                let src = (0..first_shared).rev().find(|&j| kinds[j] == kind).ok_or_else(|| {
                    Error::config(
                        path,
                        "num_kv_shared_layers",
                        format!("layer {i} shares K/V but no earlier layer has its type in layer_types"),
                    )
                })?;
                Some(src)
            } else {
                None
            };
            let wide = double_wide && kv_source.is_some();
            let width = if wide { 2 } else { 1 };
            tensor_size(path, &[("intermediate_size", intermediate), ("use_double_wide_mlp", width)])?;
            layers.push(LayerSpec {
                kind,
                head_dim: hd,
                kv_heads: kvh,
                kv_source,
                own_kv: i < first_shared,
                k_eq_v: k_eq_v && kind == LayerKind::Full,
                intermediate: intermediate * width,
            });
        }
        for (i, l) in layers.iter().enumerate() {
            if let Some(src) = l.kv_source {
                let s = &layers[src];
                if (s.head_dim, s.kv_heads) != (l.head_dim, l.kv_heads) {
                    return Err(Error::config(
                        path,
                        "per_layer_config",
                        format!(
                            "layer {i} shares layer {src}'s K/V but their head_dim or num_key_value_heads differ"
                        ),
                    ));
                }
            }
        }
        let moe = if flag(path, v, "enable_moe_block")? {
            let experts = count(path, v, "num_experts", 0)?;
            let top_k = count(path, v, "top_k_experts", 0)?;
            let inter = count(path, v, "moe_intermediate_size", 0)?;
            if experts == 0 || top_k == 0 || top_k > experts || inter == 0 {
                return Err(Error::config(
                    path,
                    "num_experts",
                    "enable_moe_block needs num_experts, top_k_experts <= num_experts and moe_intermediate_size",
                ));
            }
            let dims = [("num_experts", experts), ("moe_intermediate_size", inter), ("gate and up", 2)];
            tensor_size(path, &dims)?;
            Some(Moe { experts, top_k, intermediate: inter })
        } else {
            None
        };
        let per_layer_input = count(path, v, "hidden_size_per_layer_input", 0)?;
        let per_layer_vocab =
            if per_layer_input > 0 { count(path, v, "vocab_size_per_layer_input", 0)? } else { 0 };
        let layer_inputs =
            [("hidden_size_per_layer_input", per_layer_input), ("num_hidden_layers", n_layers)];
        tensor_size(path, &[&[("vocab_size_per_layer_input", per_layer_vocab)][..], &layer_inputs].concat())?;
        tensor_size(path, &layer_inputs)?;
        // Absent means transformers' default, 512; null would make transformers' sliding
        // layers attend to everything, a model this engine does not run.
        if v.get("sliding_window").is_some_and(Value::is_null) && kinds.contains(&LayerKind::Sliding) {
            return Err(Error::config(
                path,
                "sliding_window",
                "is null, but layer_types has sliding_attention layers: give their window",
            ));
        }
        let sliding_window = count(path, v, "sliding_window", 512)?;
        if sliding_window == 0 || sliding_window > MAX_POSITIONS {
            return Err(Error::config(
                path,
                "sliding_window",
                format!("{sliding_window} is outside 1..={MAX_POSITIONS}"),
            ));
        }
        let final_logit_softcapping = num(path, v, "final_logit_softcapping")?.map(|c| c as f32);
        if final_logit_softcapping.is_some_and(|c| !c.is_finite() || c == 0.0) {
            // An infinite cap makes every logit inf * tanh(0) = NaN; a zero one 0 * tanh(x / 0).
            return Err(Error::config(
                path,
                "final_logit_softcapping",
                "must be a finite, nonzero f32 (null turns the cap off)",
            ));
        }
        // c tanh(x / c) is odd in c: transformers' cap of -30 is the cap of 30.
        let final_logit_softcapping = final_logit_softcapping.map(f32::abs);
        Ok(Gemma4Config {
            layers,
            sliding_window,
            rope_sliding: rope(path, v, "sliding_attention", Rope { theta: 10_000.0, partial: 1.0 })?,
            rope_full: rope(path, v, "full_attention", Rope { theta: 1_000_000.0, partial: 0.25 })?,
            final_logit_softcapping,
            per_layer_input,
            per_layer_vocab,
            moe,
        })
    }

    /// The layers of `kind` that store their own K/V, in order.
    pub fn stored(&self, kind: LayerKind) -> impl Iterator<Item = usize> + '_ {
        self.layers.iter().enumerate().filter(move |(_, l)| l.kind == kind && l.own_kv).map(|(i, _)| i)
    }
}
