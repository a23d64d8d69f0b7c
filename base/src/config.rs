//! `config.json` and `generation_config.json`, as written by older and current
//! transformers (`rope_theta` or `rope_parameters`, `eos_token_id` number or list).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

/// The longest context a config may declare: the RoPE table holds every position (2^22
/// positions of a 128-wide head are 2 GiB), so a larger or garbage value is refused at load.
pub const MAX_POSITIONS: usize = 1 << 22;

/// The most decoder layers a config may declare (more than any model has): loaders size
/// per-layer tables from it before a tensor is read.
pub const MAX_LAYERS: usize = 1 << 16;

/// The most values one tensor a config implies may hold (2^40, thousands of times any
/// model's): below it, every size and byte count the loaders and the engine derive fits a
/// `usize` without overflow.
pub const MAX_TENSOR: usize = 1 << 40;

/// The product of `dims` (config.json keys and their values), or an error naming every key
/// when it is over [`MAX_TENSOR`] (so over any real model's tensor).
pub fn tensor_size(path: &Path, dims: &[(&str, usize)]) -> Result<usize> {
    let n = dims.iter().try_fold(1usize, |a, &(_, d)| a.checked_mul(d)).filter(|&n| n <= MAX_TENSOR);
    n.ok_or_else(|| {
        let named: Vec<String> = dims.iter().map(|(k, d)| format!("{k} {d}")).collect();
        Error::config(path, dims[0].0, format!("{} is over 2^40 values in one tensor", named.join(" x ")))
    })
}

/// The dense decoder families this crate runs; they differ only in a few switches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `LlamaForCausalLM`, also Mistral-style dense models.
    Llama,
    /// `Qwen2ForCausalLM`: q/k/v biases.
    Qwen2,
    /// `Qwen3ForCausalLM`: per-head RMSNorm on q and k.
    Qwen3,
    /// `Gemma4ForCausalLM`, or the text part of `Gemma4ForConditionalGeneration`: its own
    /// forward (`mtp_model::models::gemma4`).
    Gemma4,
}

impl Arch {
    pub fn from_hf(name: &str) -> Option<Arch> {
        match name {
            "LlamaForCausalLM" | "MistralForCausalLM" => Some(Arch::Llama),
            // MiMo is a Qwen2 decoder plus MTP layers (`model.mtp_layers.*`).
            "Qwen2ForCausalLM" | "MiMoForCausalLM" => Some(Arch::Qwen2),
            "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            "Gemma4ForCausalLM" | "Gemma4ForConditionalGeneration" => Some(Arch::Gemma4),
            _ => None,
        }
    }

    pub fn hf_name(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Gemma4 => "Gemma4ForCausalLM",
        }
    }
}

/// Llama-3 style frequency-dependent RoPE scaling (`rope_type: llama3`).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: f32,
}

impl RopeScaling {
    /// Scales one inverse frequency the way transformers' `_compute_llama3_parameters` does.
    pub fn adjust(&self, inv_freq: f32) -> f32 {
        let low_wavelen = self.original_max_position_embeddings / self.low_freq_factor;
        let high_wavelen = self.original_max_position_embeddings / self.high_freq_factor;
        let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
        if wavelen < high_wavelen {
            inv_freq
        } else if wavelen > low_wavelen {
            inv_freq / self.factor
        } else {
            let smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    /// Bias on q, k, v (and o for Llama/Qwen3 `attention_bias`).
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub tie_word_embeddings: bool,
    /// Every id that ends a generation: config.json's plus generation_config.json's.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// MTP modules shipped with the checkpoint (DeepSeek-V3 / MiMo); 0 when none.
    pub num_nextn_predict_layers: usize,
}

struct Keys<'a> {
    path: &'a Path,
    v: &'a Value,
}

impl Keys<'_> {
    fn opt(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }
    fn usize(&self, key: &str) -> Result<usize> {
        match self.opt(key) {
            Some(v) => self.as_usize(key, v),
            None => Err(Error::config(self.path, key, "missing")),
        }
    }
    fn as_usize(&self, key: &str, v: &Value) -> Result<usize> {
        v.as_u64()
            .filter(|&n| n > 0)
            .map(|n| n as usize)
            .ok_or_else(|| Error::config(self.path, key, format!("expected a positive integer, got {v}")))
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        self.opt(key).map_or(Ok(default), |v| self.as_usize(key, v))
    }
    /// A count that may be 0 (absent: `default`).
    fn count_or(&self, key: &str, default: usize) -> Result<usize> {
        Ok(count_key(self.path, self.v, key)?.unwrap_or(default))
    }
    fn f32_or(&self, key: &str, default: f32) -> Result<f32> {
        match self.opt(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|f| f as f32)
                .ok_or_else(|| Error::config(self.path, key, format!("expected a number, got {v}"))),
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.opt(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| Error::config(self.path, key, format!("expected true or false, got {v}"))),
        }
    }
}

/// `v[key]` as a count (a non-negative integer), `None` when absent or null; anything else
/// is an error naming `key` in `path`.
pub fn count_key(path: &Path, v: &Value, key: &str) -> Result<Option<usize>> {
    match v.get(key).filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(x) => x
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| Error::config(path, key, format!("expected a non-negative integer, got {x}"))),
    }
}

/// The JSON object of the regular file `path` (anything else is an error naming it), at most [`MAX_JSON_BYTES`](crate::files::MAX_JSON_BYTES).
pub fn read_json(path: &Path) -> Result<Value> {
    let bytes = crate::files::read_bounded(path, crate::files::MAX_JSON_BYTES)?;
    let v: Value =
        serde_json::from_slice(&bytes).map_err(|source| Error::Json { path: path.to_path_buf(), source })?;
    // Every file read here (config.json, generation_config.json, tokenizer_config.json,
    // an index) is an object; anything else would read as a file of no keys.
    let got = match v {
        Value::Object(_) => return Ok(v),
        Value::Array(_) => "an array",
        Value::String(_) => "a string",
        Value::Number(_) => "a number",
        Value::Bool(_) => "true or false",
        Value::Null => "null",
    };
    Err(Error::NotAnObject { path: path.to_path_buf(), got })
}

/// `key` (`eos_token_id`, `bos_token_id`) as a token id or a list of them, each an id of the
/// vocabulary of `vocab` tokens: an id the model cannot emit is an error, not an EOS that
/// never comes.
fn token_ids(path: &Path, key: &str, v: Option<&Value>, vocab: usize) -> Result<Vec<u32>> {
    let one = |x: &Value| match x.as_u64() {
        // Below the vocabulary, which is below 2^24: the id fits a u32.
        Some(id) if id < vocab as u64 => Ok(id as u32),
        Some(id) => Err(Error::config(
            path,
            key,
            format!("token id {id} is outside the vocabulary of {vocab} tokens (vocab_size)"),
        )),
        None => Err(Error::config(path, key, format!("expected a token id or a list of token ids, got {x}"))),
    };
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a.iter().map(one).collect(),
        Some(x) => Ok(vec![one(x)?]),
    }
}

impl Config {
    /// Weights one decoder layer multiplies per token (attention and MLP projections).
    pub fn layer_params(&self) -> usize {
        let (h, hd) = (self.hidden_size, self.head_dim);
        let attention = h * hd * (2 * self.num_attention_heads + 2 * self.num_key_value_heads);
        attention + 3 * h * self.intermediate_size
    }

    /// Weights a forward multiplies per token, LM head included: what a decode step costs
    /// relative to another model's on the same machine, roughly.
    pub fn params_per_token(&self) -> usize {
        self.num_hidden_layers * self.layer_params() + self.hidden_size * self.vocab_size
    }

    /// Reads `dir/config.json` and, if present, `dir/generation_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Config> {
        if crate::gguf::is_gguf(dir) {
            return crate::gguf::config(dir);
        }
        let path = dir.join("config.json");
        let v = read_json(&path)?;
        let mut cfg = Config::from_value(&path, &v)?;
        let gen_path = dir.join("generation_config.json");
        if crate::files::present(&gen_path) {
            let g = read_json(&gen_path)?;
            for id in token_ids(&gen_path, "eos_token_id", g.get("eos_token_id"), cfg.vocab_size)? {
                if !cfg.eos_token_ids.contains(&id) {
                    cfg.eos_token_ids.push(id);
                }
            }
            // generation_config.json's BOS, when it names one, is the one generation uses.
            if let Some(&id) =
                token_ids(&gen_path, "bos_token_id", g.get("bos_token_id"), cfg.vocab_size)?.first()
            {
                cfg.bos_token_id = Some(id);
            }
        }
        Ok(cfg)
    }

    pub fn from_value(path: &Path, v: &Value) -> Result<Config> {
        let k = Keys { path, v };
        if !v.is_object() {
            return Err(Error::config(path, "", "expected a JSON object"));
        }
        let arch_name = k
            .opt("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .ok_or_else(|| Error::config(path, "architectures", "missing or not a list of names"))?;
        let arch = Arch::from_hf(arch_name).ok_or_else(|| Error::UnknownArchitecture {
            path: PathBuf::from(path),
            arch: arch_name.to_string(),
        })?;
        // MLX quantization (weights found by their `.scales`; mlx-lm writes it at the root): the
        // affine and mxfp4 modes. `Checkpoint` checks the tensors against it.
        let quantization = k.opt("quantization");
        if let Some(q) = quantization.filter(|q| !q.is_object()) {
            return Err(Error::config(
                path,
                "quantization",
                format!("expected an object of group_size, bits and mode, got {}", short(q)),
            ));
        }
        if let Some(mode) = quantization.and_then(|q| q.get("mode")).and_then(|m| m.as_str()) {
            if mode != "affine" && mode != "mxfp4" {
                return Err(Error::config(
                    path,
                    "quantization.mode",
                    format!("`{mode}` is not supported (affine and mxfp4, as `mlx_lm.convert -q` writes them, are)"),
                ));
            }
        }
        // Pre-quantized checkpoints' `quantization_config`: an unknown method or setting is
        // refused here, by name, before any tensor is read.
        crate::quant_config::parse(path, v)?;
        // A multimodal Gemma 4 keeps its decoder's settings under `text_config`.
        if arch_name == "Gemma4ForConditionalGeneration" {
            let text = v
                .get("text_config")
                .filter(|t| t.is_object())
                .ok_or_else(|| Error::config(path, "text_config", "missing or not an object"))?;
            return Config::from_text(path, arch, text, v).map_err(|e| e.under("text_config"));
        }
        Config::from_text(path, arch, v, v)
    }

    /// The settings of `text` (config.json's root `v`, or its `text_config`) for `arch`;
    /// EOS and BOS ids may sit in either.
    fn from_text(path: &Path, arch: Arch, text: &Value, v: &Value) -> Result<Config> {
        let k = Keys { path, v: text };
        let hidden_size = k.usize("hidden_size")?;
        let heads = k.usize("num_attention_heads")?;
        if hidden_size % heads != 0 && k.opt("head_dim").is_none() {
            return Err(Error::config(
                path,
                "num_attention_heads",
                "does not divide hidden_size and no head_dim",
            ));
        }
        let kv_heads = k.usize_or("num_key_value_heads", heads)?;
        if heads % kv_heads != 0 {
            return Err(Error::config(
                path,
                "num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads {heads}"),
            ));
        }
        let head_dim = k.usize_or("head_dim", hidden_size / heads)?;
        if head_dim % 2 != 0 {
            return Err(Error::config(path, "head_dim", "must be even for RoPE"));
        }
        // transformers 5 moved rope settings into `rope_parameters`; older files use
        // `rope_theta` + `rope_scaling`.
        // Gemma 4 keeps RoPE per layer type (read by `gemma4::Gemma4Config`).
        let rope_params = if arch == Arch::Gemma4 {
            None
        } else {
            ["rope_parameters", "rope_scaling"].into_iter().find_map(|key| k.opt(key).map(|p| (key, p)))
        };
        if let Some((key, p)) = rope_params.filter(|(_, p)| !p.is_object()) {
            return Err(Error::config(
                path,
                key,
                format!("expected an object such as {{\"rope_type\": \"llama3\", ...}}, got {}", short(p)),
            ));
        }
        // `rope_parameters` wins over the older keys beside it, as in transformers; one that
        // contradicts it is said, not silently dropped.
        if let (Some(("rope_parameters", p)), Some(s)) = (rope_params, k.opt("rope_scaling")) {
            if s != p {
                tracing::warn!(
                    "{}: `rope_scaling` {} is ignored: `rope_parameters` {} is read",
                    path.display(),
                    short(s),
                    short(p)
                );
            }
        }
        // Gemma 4's RoPE, per layer type, has its own reader.
        let top_factor = k.opt("partial_rotary_factor").filter(|_| arch != Arch::Gemma4);
        for (at, factor) in [("partial_rotary_factor".to_string(), top_factor)].into_iter().chain(
            rope_params
                .map(|(key, p)| (format!("{key}.partial_rotary_factor"), p.get("partial_rotary_factor"))),
        ) {
            if let Some(f) = factor.filter(|f| !f.is_null() && f.as_f64() != Some(1.0)) {
                return Err(Error::config(
                    path,
                    &at,
                    format!(
                        "{}: RoPE over part of each head is not supported for {arch:?} (only 1.0)",
                        short(f)
                    ),
                ));
            }
        }
        let (rope_theta, theta_key) = match rope_params.and_then(|(key, p)| Some((key, p.get("rope_theta")?)))
        {
            Some((key, t)) => {
                let at = format!("{key}.rope_theta");
                let theta = t.as_f64().ok_or_else(|| Error::config(path, &at, "not a number"))?;
                if let Some(top) = k.opt("rope_theta").filter(|top| top.as_f64() != Some(theta)) {
                    tracing::warn!(
                        "{}: `rope_theta` {} is ignored: `{at}` {theta} is read",
                        path.display(),
                        short(top)
                    );
                }
                (theta as f32, at)
            }
            None => (k.f32_or("rope_theta", 10000.0)?, "rope_theta".to_string()),
        };
        let rope_scaling = match rope_params {
            Some((key, p)) => rope_scaling(path, key, p)?,
            None => None,
        };
        let attention_bias = k.bool_or("attention_bias", false)?;
        let (qkv_bias, o_bias) = match arch {
            Arch::Qwen2 => (true, false),
            _ => (attention_bias, attention_bias),
        };
        let rms_norm_eps = k.f32_or("rms_norm_eps", 1e-6)?;
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(Error::config(
                path,
                "rms_norm_eps",
                format!("{rms_norm_eps} is not a positive number"),
            ));
        }
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(Error::config(path, &theta_key, format!("{rope_theta} is not a positive number")));
        }
        let max_position_embeddings = k.usize_or("max_position_embeddings", 4096)?;
        if max_position_embeddings == 0 || max_position_embeddings > MAX_POSITIONS {
            return Err(Error::config(
                path,
                "max_position_embeddings",
                format!("{max_position_embeddings} is outside 1..={MAX_POSITIONS} (the RoPE table is precomputed)"),
            ));
        }
        let vocab_size = k.usize("vocab_size")?;
        // A logit summary carries its argmax as an f32 (exact below 2^24).
        if vocab_size >= 1 << 24 {
            return Err(Error::config(path, "vocab_size", format!("{vocab_size} is over 2^24 tokens")));
        }
        let num_hidden_layers = k.usize("num_hidden_layers")?;
        if num_hidden_layers > MAX_LAYERS {
            return Err(Error::config(
                path,
                "num_hidden_layers",
                format!("{num_hidden_layers} is over {MAX_LAYERS} layers"),
            ));
        }
        if arch != Arch::Gemma4 {
            dense_family_switches(&k, num_hidden_layers)?;
        }
        let intermediate_size = k.usize("intermediate_size")?;
        // Every weight and table the loaders shape from these keys, checked once here.
        let h = ("hidden_size", hidden_size);
        tensor_size(path, &[("vocab_size", vocab_size), h])?;
        tensor_size(path, &[("num_attention_heads", heads), ("head_dim", head_dim), h])?;
        tensor_size(path, &[("num_key_value_heads", kv_heads), ("head_dim", head_dim), h])?;
        tensor_size(path, &[("intermediate_size", intermediate_size), h])?;
        tensor_size(path, &[("max_position_embeddings", max_position_embeddings), ("head_dim", head_dim)])?;
        Ok(Config {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            qkv_bias,
            o_bias,
            tie_word_embeddings: k.bool_or("tie_word_embeddings", arch == Arch::Gemma4)?,
            eos_token_ids: token_ids(
                path,
                "eos_token_id",
                k.opt("eos_token_id").or(v.get("eos_token_id")),
                vocab_size,
            )?,
            bos_token_id: token_ids(
                path,
                "bos_token_id",
                k.opt("bos_token_id").or(v.get("bos_token_id")),
                vocab_size,
            )?
            .first()
            .copied(),
            // 0: no MTP head.
            num_nextn_predict_layers: k.count_or("num_nextn_predict_layers", 0)?,
        })
    }
}

/// Settings the dense families' one forward (SiLU-gated MLP without biases, full attention)
/// cannot honour, refused rather than ignored.
fn dense_family_switches(k: &Keys, layers: usize) -> Result<()> {
    match k.opt("hidden_act") {
        None => {}
        Some(Value::String(a)) if a == "silu" => {}
        Some(other) => {
            return Err(Error::config(k.path, "hidden_act", format!("{other} is not supported (silu)")))
        }
    }
    if k.bool_or("mlp_bias", false)? {
        return Err(Error::config(k.path, "mlp_bias", "MLP biases are not supported"));
    }
    if k.bool_or("use_sliding_window", false)? {
        return Err(Error::config(k.path, "use_sliding_window", "sliding-window attention is not supported"));
    }
    // What transformers' `layer_type_validation` refuses. Any known type is accepted: only
    // `use_sliding_window` (refused above) gives these families' sliding layers a window.
    if let Some(types) = k.opt("layer_types") {
        let list = types.as_array().filter(|a| a.len() == layers).ok_or_else(|| {
            Error::config(
                k.path,
                "layer_types",
                format!("expected a list of num_hidden_layers ({layers}) layer types, got {}", short(types)),
            )
        })?;
        if let Some((i, t)) =
            list.iter().enumerate().find(|(_, t)| !t.as_str().is_some_and(|t| LAYER_TYPES.contains(&t)))
        {
            return Err(Error::config(
                k.path,
                &format!("layer_types[{i}]"),
                format!("unknown layer type {t} (expected one of {})", LAYER_TYPES.join(", ")),
            ));
        }
    }
    Ok(())
}

/// The layer types transformers knows (`ALLOWED_LAYER_TYPES`).
const LAYER_TYPES: [&str; 4] =
    ["full_attention", "sliding_attention", "chunked_attention", "linear_attention"];

/// `v` as JSON, cut to 80 characters for an error message.
fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s,
    }
}

fn rope_scaling(path: &Path, key: &str, p: &Value) -> Result<Option<RopeScaling>> {
    let kind = match p.get("rope_type").or_else(|| p.get("type")).filter(|t| !t.is_null()) {
        None => "default",
        Some(Value::String(t)) => t.as_str(),
        Some(t) => {
            return Err(Error::config(
                path,
                &format!("{key}.rope_type"),
                format!("expected a name, got {}", short(t)),
            ))
        }
    };
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let num = |name: &str| match p.get(name).and_then(|v| v.as_f64()).map(|f| f as f32) {
                Some(f) if f.is_finite() && f > 0.0 => Ok(f),
                _ => Err(Error::config(path, &format!("{key}.{name}"), "missing or not a positive number")),
            };
            let s = RopeScaling {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            };
            // The formula divides by their difference; transformers warns unless high is above low.
            if s.high_freq_factor <= s.low_freq_factor {
                return Err(Error::config(
                    path,
                    &format!("{key}.high_freq_factor"),
                    format!(
                        "{} must be greater than low_freq_factor {} (llama3 scaling divides by their difference)",
                        s.high_freq_factor, s.low_freq_factor
                    ),
                ));
            }
            Ok(Some(s))
        }
        other => Err(Error::config(
            path,
            &format!("{key}.rope_type"),
            format!("`{other}` is not supported (default, llama3)"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A three-layer Llama config.json, valid as it is.
    fn llama() -> Value {
        json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "num_attention_heads": 2,
            "num_hidden_layers": 3, "intermediate_size": 32, "vocab_size": 64})
    }

    /// The error `v` gets (or "loaded"), which must name config.json.
    fn err(v: &Value) -> String {
        let e = Config::from_value(Path::new("config.json"), v).map(|_| ()).err();
        let e = e.map_or("loaded".to_string(), |e| e.to_string());
        assert!(e.contains("config.json"), "{e}");
        e
    }

    fn with(key: &str, x: Value) -> Value {
        let mut v = llama();
        v[key] = x;
        v
    }

    #[test]
    fn layer_types_must_list_every_layer_by_a_known_type() {
        let ok = |x: Value| Config::from_value(Path::new("config.json"), &with("layer_types", x)).unwrap();
        ok(json!(["full_attention", "full_attention", "full_attention"]));
        // A known type is accepted: without `use_sliding_window` transformers gives it no window.
        ok(json!(["full_attention", "sliding_attention", "full_attention"]));
        let e = err(&with("layer_types", json!(["full_attention", "full_attention"])));
        assert!(e.contains("`layer_types`") && e.contains("num_hidden_layers (3)"), "{e}");
        let e = err(&with("layer_types", json!("full_attention")));
        assert!(e.contains("`layer_types`") && e.contains("\"full_attention\""), "{e}");
        let e = err(&with("layer_types", json!(["full_attention", "local_attention", "full_attention"])));
        assert!(
            e.contains("`layer_types[1]`")
                && e.contains("local_attention")
                && e.contains("sliding_attention"),
            "{e}"
        );
        let e = err(&with("layer_types", json!(["full_attention", 7, "full_attention"])));
        assert!(e.contains("`layer_types[1]`") && e.contains("7"), "{e}");
    }

    /// `partial_rotary_factor`, which these families do not implement, was ignored: it is
    /// refused by name, top-level or in `rope_parameters` (a factor of 1 loads); a bad
    /// `rope_parameters.rope_theta` is named by its path. (`rope_scaling` or `rope_theta`
    /// beside `rope_parameters` are ignored as transformers ignores them, with a warning.)
    #[test]
    fn unsupported_rope_settings_are_refused_by_name() {
        let load = |v: &Value| Config::from_value(Path::new("config.json"), v);
        let e = err(&with("rope_parameters", json!({"rope_type": "default", "rope_theta": -1.0})));
        assert!(e.contains("`rope_parameters.rope_theta`"), "{e}");
        let e = err(&with("partial_rotary_factor", json!(0.5)));
        assert!(e.contains("`partial_rotary_factor`") && e.contains("not supported"), "{e}");
        let e = err(&with("rope_parameters", json!({"rope_type": "default", "partial_rotary_factor": 0.5})));
        assert!(e.contains("`rope_parameters.partial_rotary_factor`"), "{e}");
        load(&with("partial_rotary_factor", json!(1.0))).unwrap();
    }

    #[test]
    fn rope_settings_must_be_objects() {
        for key in ["rope_scaling", "rope_parameters"] {
            let e = err(&with(key, json!("llama3")));
            assert!(e.contains(&format!("`{key}`")) && e.contains("expected an object"), "{e}");
            let e = err(&with(key, json!({"rope_type": 3})));
            assert!(e.contains(&format!("`{key}.rope_type`")) && e.contains("expected a name"), "{e}");
            // Control: the object, and null (absent).
            let v = with(key, json!({"rope_type": "default", "rope_theta": 500000.0}));
            assert_eq!(Config::from_value(Path::new("config.json"), &v).unwrap().rope_theta, 500000.0);
            Config::from_value(Path::new("config.json"), &with(key, Value::Null)).unwrap();
        }
        let e = err(&with("quantization", json!("4bit")));
        assert!(e.contains("`quantization`") && e.contains("expected an object"), "{e}");
    }

    #[test]
    fn llama3_scaling_needs_high_freq_factor_above_low() {
        let scaling = |low: f64, high: f64| {
            with(
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": 8192}),
            )
        };
        let s =
            Config::from_value(Path::new("config.json"), &scaling(1.0, 4.0)).unwrap().rope_scaling.unwrap();
        assert!(s.adjust(0.01).is_finite());
        for (low, high) in [(2.0, 2.0), (4.0, 1.0)] {
            let e = err(&scaling(low, high));
            assert!(
                e.contains("`rope_scaling.high_freq_factor`") && e.contains("greater than low_freq_factor"),
                "{e}"
            );
        }
        // Both 0 is not a positive number.
        assert!(err(&scaling(0.0, 0.0)).contains("`rope_scaling.low_freq_factor`"));
    }

    #[test]
    fn generation_config_bos_must_be_in_the_vocabulary() {
        let dir = std::env::temp_dir().join(format!("mtp-config-bos-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), with("bos_token_id", 1.into()).to_string()).unwrap();
        let generation =
            |g: Value| std::fs::write(dir.join("generation_config.json"), g.to_string()).unwrap();
        generation(json!({"bos_token_id": 5}));
        assert_eq!(Config::from_dir(&dir).unwrap().bos_token_id, Some(5));
        generation(json!({"bos_token_id": 64}));
        let e = Config::from_dir(&dir).unwrap_err().to_string();
        assert!(
            e.contains("generation_config.json") && e.contains("`bos_token_id`") && e.contains("64"),
            "{e}"
        );
        generation(json!({"bos_token_id": "<s>"}));
        assert!(Config::from_dir(&dir).unwrap_err().to_string().contains("`bos_token_id`"));
        generation(json!({"eos_token_id": 2}));
        assert_eq!(Config::from_dir(&dir).unwrap().bos_token_id, Some(1));
        std::fs::remove_dir_all(&dir).ok();
    }
}
