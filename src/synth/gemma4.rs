//! Gemma 4 text checkpoints (`Gemma4ForCausalLM`) with random weights in real models'
//! shapes, for speed measurements (`mtp synth --like gemma4-31b|gemma4-e2b`).

use std::path::Path;

use serde_json::{json, Map, Value};

use mtp_base::config::Config;
use mtp_base::error::{Error, Result};
use mtp_base::weights::WeightDtype;
use mtp_model::models::gemma4::config::{Gemma4Config, LayerKind};

use super::{
    check_free_space, checked_bytes, synth_tokenizer, write_random_safetensors, Storage, SynthQuant,
    DEFAULT_MAX_BYTES,
};

/// The preset names [`Gemma4Spec::preset`] knows.
pub const PRESETS: [&str; 2] = ["gemma4-31b", "gemma4-e2b"];

/// The shape of a synthetic Gemma 4 text checkpoint.
#[derive(Clone, Debug)]
pub struct Gemma4Spec {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// KV heads of the sliding layers (and of the full ones without K = V).
    pub num_key_value_heads: usize,
    /// Head size of the sliding layers.
    pub head_dim: usize,
    /// Head size of the full layers.
    pub global_head_dim: usize,
    /// KV heads of the full layers when `attention_k_eq_v` (0: `num_key_value_heads`).
    pub num_global_key_value_heads: usize,
    pub attention_k_eq_v: bool,
    pub intermediate_size: usize,
    /// KV-shared layers get twice `intermediate_size`.
    pub use_double_wide_mlp: bool,
    /// Sliding layers before each full one; the last layer is always full.
    pub sliding_per_full: usize,
    pub sliding_window: usize,
    /// The last layers, which read the K/V of an earlier layer of their type.
    pub num_kv_shared_layers: usize,
    /// Per-layer inputs width (E models), 0 for none.
    pub hidden_size_per_layer_input: usize,
    pub max_position_embeddings: usize,
    pub final_logit_softcapping: f32,
    pub dtype: WeightDtype,
    /// MLX-quantized matrices (`--q-bits`; MoE experts, 3-D, stay in `dtype`).
    pub quant: Option<SynthQuant>,
    pub seed: u64,
    /// The most bytes of weights a write may produce.
    pub max_bytes: u64,
}

impl Gemma4Spec {
    /// `gemma4-31b` (google/gemma-4-31B) or `gemma4-e2b` (google/gemma-4-E2B), text only.
    pub fn preset(name: &str) -> Option<Gemma4Spec> {
        let e2b = Gemma4Spec {
            vocab_size: 262144,
            hidden_size: 1536,
            num_hidden_layers: 35,
            num_attention_heads: 8,
            num_key_value_heads: 1,
            head_dim: 256,
            global_head_dim: 512,
            num_global_key_value_heads: 0,
            attention_k_eq_v: false,
            intermediate_size: 6144,
            use_double_wide_mlp: true,
            sliding_per_full: 4,
            sliding_window: 512,
            num_kv_shared_layers: 20,
            hidden_size_per_layer_input: 256,
            max_position_embeddings: 131072,
            final_logit_softcapping: 30.0,
            dtype: WeightDtype::Bf16,
            quant: None,
            seed: 0,
            max_bytes: DEFAULT_MAX_BYTES,
        };
        match name {
            "gemma4-e2b" => Some(e2b),
            "gemma4-31b" => Some(Gemma4Spec {
                hidden_size: 5376,
                num_hidden_layers: 60,
                num_attention_heads: 32,
                num_key_value_heads: 16,
                num_global_key_value_heads: 4,
                attention_k_eq_v: true,
                intermediate_size: 21504,
                use_double_wide_mlp: false,
                sliding_per_full: 5,
                sliding_window: 1024,
                num_kv_shared_layers: 0,
                hidden_size_per_layer_input: 0,
                max_position_embeddings: 262144,
                ..e2b
            }),
            _ => None,
        }
    }

    /// Sets the layer count keeping the sliding/full pattern (the last layer full) and the
    /// share of KV-shared layers, fewer where the layers before them would lack a layer of
    /// each shared type (so none below two full layers).
    pub fn set_layers(&mut self, n: usize) {
        let old = self.num_hidden_layers.max(1);
        let want = (2 * self.num_kv_shared_layers * n + old) / (2 * old);
        self.num_hidden_layers = n;
        let kinds = self.layer_kinds();
        self.num_kv_shared_layers = (0..=want.min(n.saturating_sub(1)))
            .rev()
            .find(|&s| {
                let (own, shared) = kinds.split_at(n - s);
                shared.iter().all(|k| own.contains(k))
            })
            .unwrap_or(0);
    }

    fn layer_kinds(&self) -> Vec<LayerKind> {
        let (n, period) = (self.num_hidden_layers, self.sliding_per_full + 1);
        (0..n)
            .map(|i| if (i + 1) % period == 0 || i + 1 == n { LayerKind::Full } else { LayerKind::Sliding })
            .collect()
    }

    fn storage(&self) -> Storage {
        Storage { dtype: self.dtype, quant: self.quant }
    }

    /// config.json as transformers 5.17 writes a `Gemma4ForCausalLM`'s (full layers'
    /// head shapes in `per_layer_config`).
    pub fn config_json(&self) -> Value {
        let kinds = self.layer_kinds();
        let mut per_layer = Map::new();
        for (i, _) in kinds.iter().enumerate().filter(|(_, k)| **k == LayerKind::Full) {
            let mut l = json!({"head_dim": self.global_head_dim});
            if self.attention_k_eq_v && self.num_global_key_value_heads > 0 {
                l["num_key_value_heads"] = json!(self.num_global_key_value_heads);
            }
            per_layer.insert(i.to_string(), l);
        }
        let w = self.hidden_size_per_layer_input;
        let mut v = json!({
            "architectures": ["Gemma4ForCausalLM"],
            "model_type": "gemma4_text",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "attention_k_eq_v": self.attention_k_eq_v,
            "bos_token_id": 2,
            "dtype": dtype_name(self.dtype),
            "enable_moe_block": false,
            "eos_token_id": [1],
            "final_logit_softcapping": self.final_logit_softcapping,
            "head_dim": self.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": self.hidden_size,
            "hidden_size_per_layer_input": w,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": kinds.iter().map(|k| match k {
                LayerKind::Sliding => "sliding_attention",
                LayerKind::Full => "full_attention",
            }).collect::<Vec<_>>(),
            "max_position_embeddings": self.max_position_embeddings,
            "moe_intermediate_size": null,
            "num_attention_heads": self.num_attention_heads,
            "num_experts": null,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_kv_shared_layers": self.num_kv_shared_layers,
            "pad_token_id": 0,
            "per_layer_config": per_layer,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
            },
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": true,
            "top_k_experts": null,
            "use_bidirectional_attention": null,
            "use_cache": true,
            "use_double_wide_mlp": self.use_double_wide_mlp,
            "vocab_size": self.vocab_size,
            "vocab_size_per_layer_input": if w > 0 { self.vocab_size } else { 0 },
        });
        if let Some(q) = self.quant {
            v["quantization"] = q.config();
            v["quantization_config"] = q.config();
        }
        v
    }

    /// Every tensor the loader reads, named and shaped from the config it resolves
    /// (`path` only names config.json in errors).
    pub fn tensors(&self, path: &Path) -> Result<Vec<(String, Vec<usize>)>> {
        let v = self.config_json();
        let c = Config::from_value(path, &v)?;
        let g = Gemma4Config::from_value(path, &v)?;
        let (h, heads, w, n) = (c.hidden_size, c.num_attention_heads, g.per_layer_input, g.layers.len());
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![c.vocab_size, h])];
        if w > 0 {
            t.push(("model.embed_tokens_per_layer.weight".into(), vec![g.per_layer_vocab, n * w]));
            t.push(("model.per_layer_model_projection.weight".into(), vec![n * w, h]));
            t.push(("model.per_layer_projection_norm.weight".into(), vec![w]));
        }
        for (i, l) in g.layers.iter().enumerate() {
            let (p, hd, f) = (format!("model.layers.{i}"), l.head_dim, l.intermediate);
            let (qd, kvd) = (heads * hd, l.kv_heads * hd);
            for norm in ["input", "post_attention", "pre_feedforward", "post_feedforward"] {
                t.push((format!("{p}.{norm}_layernorm.weight"), vec![h]));
            }
            t.push((format!("{p}.self_attn.q_proj.weight"), vec![qd, h]));
            t.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            if l.own_kv {
                t.push((format!("{p}.self_attn.k_proj.weight"), vec![kvd, h]));
                if !l.k_eq_v {
                    t.push((format!("{p}.self_attn.v_proj.weight"), vec![kvd, h]));
                }
                t.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
            }
            t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, qd]));
            t.push((format!("{p}.mlp.gate_proj.weight"), vec![f, h]));
            t.push((format!("{p}.mlp.up_proj.weight"), vec![f, h]));
            t.push((format!("{p}.mlp.down_proj.weight"), vec![h, f]));
            if w > 0 {
                t.push((format!("{p}.per_layer_input_gate.weight"), vec![w, h]));
                t.push((format!("{p}.per_layer_projection.weight"), vec![h, w]));
                t.push((format!("{p}.post_per_layer_input_norm.weight"), vec![h]));
            }
            t.push((format!("{p}.layer_scalar"), vec![1]));
        }
        t.push(("model.norm.weight".into(), vec![h]));
        Ok(t)
    }

    /// Writes config.json, generation_config.json, tokenizer.json (a 512-token byte BPE,
    /// when the vocabulary holds it) and model.safetensors, streamed; norms and layer
    /// scalars are 1. A shape that would not load or does not fit (`max_bytes`, the free
    /// space) is refused before anything is written.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let cfg_path = dir.join("config.json");
        let tensors = self.tensors(&cfg_path)?;
        let bytes = checked_bytes(&tensors, self.storage(), self.max_bytes)?;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        check_free_space(dir, bytes)?;
        let write = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).map_err(|e| Error::io(&p, e))
        };
        let pretty = |v: Value| serde_json::to_string_pretty(&v).expect("json");
        write("config.json", &pretty(self.config_json()))?;
        let generation = json!({"bos_token_id": 2, "eos_token_id": [1], "pad_token_id": 0});
        write("generation_config.json", &pretty(generation))?;
        if self.vocab_size >= 512 {
            write("tokenizer.json", &synth_tokenizer(self.vocab_size))?;
        }
        write_random_safetensors(&dir.join("model.safetensors"), &tensors, self.storage(), self.seed)
    }
}

fn dtype_name(d: WeightDtype) -> &'static str {
    match d {
        WeightDtype::F32 => "float32",
        WeightDtype::Bf16 => "bfloat16",
        WeightDtype::F16 => "float16",
    }
}
