//! EAGLE-3 draft heads (Li et al., 2025), as vLLM, SGLang and SafeAILab's EAGLE run them.
//!
//! The head reads the target's residual stream entering three of its layers (the *taps*,
//! [`crate::Hidden::Taps`]) at every position `i`, beside the token at `i + 1`, and predicts
//! the token at `i + 2`:
//!
//! ```text
//! g   = fc(cat(tap_a, tap_b, tap_c))                 first step only (target states)
//! r   = g, or hidden_norm(g) with norm_before_residual
//! x   = r + o(attn(q, k, v of cat(input_layernorm(embed(t)), hidden_norm(g))))
//! x   = x + down(silu(gate(n(x))) * up(n(x)))        n: post_attention_layernorm
//! out = lm_head(norm(x)) over the draft vocabulary;  draft d is target token d + d2t[d]
//! ```
//!
//! For a further draft the head runs again on its own `x` (before `norm`) in place of `g`,
//! without `fc`, and its own draft token. Entry `i` sits at logical (and RoPE) position
//! `i` of the head's one-layer per-row cache, recursive entries after the target's, and
//! attends over every earlier entry of its row.
//!
//! Taps: the config's `eagle_aux_hidden_state_layer_ids` (vLLM and speculators: the id of
//! the layer whose *input* is tapped), or SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`
//! (the id of the layer whose *output* is tapped: the input of id + 1), else the published
//! default, inputs of layers `(2, n / 2, n - 3)` of an `n`-layer target. `fc` reads them
//! in ascending layer order (the order those forwards append them in).
//!
//! Layouts, told apart by config.json:
//! - SafeAILab / SGLang (`LlamaForCausalLMEagle3`, `Eagle3LlamaForCausalLM`): the layer's
//!   settings at the root, tensors `midlayer.*` (or `layers.0.*`), `fc`, `norm`, `lm_head`,
//!   `d2t`, optional `t2d` and `embed_tokens` (else the target's embedding).
//! - speculators (`Eagle3Speculator`, `speculators_model_type: eagle3`): the layer's settings
//!   under `transformer_layer_config`, tensors `layers.0.*`; `norm_before_residual` must be
//!   stated (speculators defaults it to false, vLLM's reader of its configs to true).
//!
//! A head that does not fit its target is refused naming the key ([`Eagle3Spec::read`]);
//! `crate::registry` loads it onto the target's backend.

use std::path::{Path, PathBuf};

use mtp_base::config::{count_key, read_json, Config, MAX_LAYERS};
use mtp_base::error::{Error, Result};
use mtp_cache::RowCache;
use serde_json::Value;

/// Which naming scheme the head's config and tensors use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eagle3Layout {
    SafeAiLab,
    Speculators,
}

impl Eagle3Layout {
    pub fn name(self) -> &'static str {
        match self {
            Eagle3Layout::SafeAiLab => "safeailab",
            Eagle3Layout::Speculators => "speculators",
        }
    }
}

/// What a head's config.json says, checked against its target.
#[derive(Clone, Debug)]
pub struct Eagle3Spec {
    pub layout: Eagle3Layout,
    /// The decoder layer's settings (read as a Llama layer).
    pub config: Config,
    /// Target layers whose input is tapped, ascending: `fc`'s order.
    pub taps: Vec<usize>,
    pub draft_vocab: usize,
    pub norm_before_residual: bool,
    /// The config's path, for errors.
    pub path: PathBuf,
}

/// `v[key]` as true or false (`default` when absent).
fn flag(path: &Path, v: &Value, key: &str, default: Option<bool>) -> Result<bool> {
    match (v.get(key).filter(|x| !x.is_null()), default) {
        (Some(x), _) => {
            x.as_bool().ok_or_else(|| Error::config(path, key, format!("expected true or false, got {x}")))
        }
        (None, Some(d)) => Ok(d),
        (None, None) => Err(Error::config(
            path,
            key,
            "missing: speculators defaults it to false and vLLM's reader to true, so it must be stated",
        )),
    }
}

/// `v[key]` as a list of layer ids, None when absent.
fn layer_ids(path: &Path, v: &Value, key: &str) -> Result<Option<Vec<usize>>> {
    let Some(x) = v.get(key).filter(|x| !x.is_null()) else { return Ok(None) };
    let bad = || Error::config(path, key, format!("expected a list of layer ids, got {x}"));
    let list = x.as_array().ok_or_else(bad)?;
    list.iter()
        .map(|i| i.as_u64().and_then(|i| usize::try_from(i).ok()).ok_or_else(bad))
        .collect::<Result<_>>()
        .map(Some)
}

/// The published default taps of an `n`-layer target: inputs of layers 2, n / 2, n - 3.
pub fn default_taps(n: usize) -> Option<Vec<usize>> {
    Some(vec![2, n / 2, n.checked_sub(3)?])
}

impl Eagle3Spec {
    /// Reads `dir/config.json` for a target shaped `target` and refuses, naming the key,
    /// whatever the head and target disagree on.
    pub fn read(dir: &Path, target: &Config) -> Result<Eagle3Spec> {
        let path = dir.join("config.json");
        let v = read_json(&path)?;
        let arch = v.get("architectures").and_then(|a| a.get(0)).and_then(|a| a.as_str()).unwrap_or("");
        let speculators = v.get("speculators_model_type").and_then(|t| t.as_str());
        let layout = match (arch, speculators) {
            ("LlamaForCausalLMEagle3" | "Eagle3LlamaForCausalLM", _) => Eagle3Layout::SafeAiLab,
            (_, Some("eagle3")) | ("Eagle3Speculator", None) => Eagle3Layout::Speculators,
            (_, Some(other)) => {
                return Err(Error::config(&path, "speculators_model_type", format!("`{other}` is not an EAGLE-3 head (eagle3)")))
            }
            _ => {
                return Err(Error::config(
                    &path,
                    "architectures",
                    format!(
                        "`{arch}` is not an EAGLE-3 head (LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM or Eagle3Speculator)"
                    ),
                ))
            }
        };
        // The layer's settings, read as a Llama decoder's.
        let (layer, under) = match layout {
            Eagle3Layout::SafeAiLab => (v.clone(), None),
            Eagle3Layout::Speculators => {
                let t = v.get("transformer_layer_config").filter(|t| t.is_object()).ok_or_else(|| {
                    Error::config(&path, "transformer_layer_config", "missing or not an object")
                })?;
                (t.clone(), Some("transformer_layer_config"))
            }
        };
        let mut as_llama = layer;
        as_llama["architectures"] = Value::from(vec!["LlamaForCausalLM"]);
        let config = Config::from_value(&path, &as_llama).map_err(|e| match under {
            Some(u) => e.under(u),
            None => e,
        })?;
        let key = |k: &str| under.map_or(k.to_string(), |u| format!("{u}.{k}"));
        if config.num_hidden_layers != 1 {
            return Err(Error::config(
                &path,
                &key("num_hidden_layers"),
                format!("{}: an EAGLE-3 head has one decoder layer", config.num_hidden_layers),
            ));
        }
        if config.vocab_size != target.vocab_size {
            return Err(Error::config(
                &path,
                &key("vocab_size"),
                format!("{} differs from the target's {}", config.vocab_size, target.vocab_size),
            ));
        }
        let (th_key, th) = match count_key(&path, &v, "target_hidden_size")? {
            Some(n) => ("target_hidden_size".to_string(), n),
            None => (key("hidden_size"), config.hidden_size),
        };
        if th != target.hidden_size {
            return Err(Error::config(
                &path,
                &th_key,
                format!("{th} differs from the target's hidden size {}", target.hidden_size),
            ));
        }
        let draft_vocab = count_key(&path, &v, "draft_vocab_size")?.unwrap_or(config.vocab_size);
        if draft_vocab == 0 || draft_vocab > config.vocab_size {
            return Err(Error::config(
                &path,
                "draft_vocab_size",
                format!("{draft_vocab} is outside 1..={} (the target's vocabulary)", config.vocab_size),
            ));
        }
        let eagle_config = v.get("eagle_config").filter(|e| !e.is_null());
        if let Some(e) = eagle_config {
            if !e.is_object() {
                return Err(Error::config(&path, "eagle_config", "expected an object"));
            }
            if !flag(&path, e, "use_aux_hidden_state", Some(true)).map_err(|e| e.under("eagle_config"))? {
                return Err(Error::config(
                    &path,
                    "eagle_config.use_aux_hidden_state",
                    "false: an EAGLE-1/2 style head reading one hidden state is not supported",
                ));
            }
        }
        if flag(&path, &v, "norm_before_fc", Some(false))? {
            return Err(Error::config(&path, "norm_before_fc", "true is not supported (a norm before fc)"));
        }
        let norm_before_residual =
            flag(&path, &v, "norm_before_residual", (layout == Eagle3Layout::SafeAiLab).then_some(false))?;
        let n = target.num_hidden_layers;
        // vLLM's and speculators' ids name the tapped layer's input; SGLang's its output.
        let (ids_key, taps) = match (
            layer_ids(&path, &v, "eagle_aux_hidden_state_layer_ids")?,
            eagle_config
                .map(|e| {
                    layer_ids(&path, e, "eagle_aux_hidden_state_layer_ids")
                        .map_err(|e| e.under("eagle_config"))
                })
                .transpose()?
                .flatten(),
        ) {
            (Some(ids), sglang) => {
                // vLLM reads the root's; SGLang's `eagle_config` would tap other layers.
                if let Some(other) =
                    sglang.filter(|o| o.iter().map(|i| i.saturating_add(1)).ne(ids.iter().copied()))
                {
                    tracing::warn!(
                        "{}: eagle_aux_hidden_state_layer_ids {ids:?} (layer inputs, vLLM's reading) is used; \
                         eagle_config.eagle_aux_hidden_state_layer_ids {other:?} (layer outputs, SGLang's) disagrees",
                        path.display()
                    );
                }
                ("eagle_aux_hidden_state_layer_ids", ids)
            }
            (None, Some(ids)) => (
                "eagle_config.eagle_aux_hidden_state_layer_ids",
                ids.into_iter().map(|i| i.saturating_add(1)).collect(),
            ),
            (None, None) => (
                "eagle_aux_hidden_state_layer_ids",
                default_taps(n).ok_or_else(|| {
                    Error::config(
                        &path,
                        "eagle_aux_hidden_state_layer_ids",
                        format!("absent, and the default needs 3 or more target layers, not {n}"),
                    )
                })?,
            ),
        };
        if taps.len() != 3 {
            return Err(Error::config(
                &path,
                ids_key,
                format!("{} layers: an EAGLE-3 head reads 3", taps.len()),
            ));
        }
        if let Some(&bad) = taps.iter().find(|&&l| l >= n.min(MAX_LAYERS)) {
            return Err(Error::config(
                &path,
                ids_key,
                format!("taps the input of layer {bad}, past the target's {n} layers (num_hidden_layers)"),
            ));
        }
        if taps.iter().enumerate().any(|(i, l)| taps[..i].contains(l)) {
            return Err(Error::config(
                &path,
                ids_key,
                format!("taps layer inputs {taps:?}, one twice (the default repeats one for a {n}-layer target: name them)"),
            ));
        }
        // vLLM and SGLang append each tap as their forward passes its layer: `fc` reads them
        // in ascending layer order, whatever order the config lists them in.
        let mut taps = taps;
        taps.sort_unstable();
        Ok(Eagle3Spec { layout, config, taps, draft_vocab, norm_before_residual, path })
    }
}

/// What a forward's rows feed the head with, after their tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eagle3Feed {
    /// The target's taps, `3 * target hidden` floats a token: the first step, through `fc`.
    Taps,
    /// The head's own output before its final norm, `hidden_size` floats a token.
    Own,
}

/// One row of a head forward: `tokens.len()` (state, next token) pairs at the row's next
/// positions.
pub struct Eagle3Input<'a> {
    pub states: &'a [f32],
    pub tokens: &'a [u32],
    pub cache: &'a mut RowCache,
}

/// What one row gets back: the prediction after its last pair.
#[derive(Debug)]
pub struct Eagle3Output {
    /// Over the target's vocabulary: each draft token's logit at its target id, -inf at the
    /// ids the draft vocabulary lacks (vLLM's and speculators' mapping).
    pub logits: Vec<f32>,
    /// The layer's output before the final norm: the next recursive step's state.
    pub hidden: Vec<f32>,
}

/// An EAGLE-3 head on its target's backend.
pub(crate) trait Eagle3Net: Send + Sync {
    fn forward(&self, rows: &mut [Eagle3Input], feed: Eagle3Feed) -> Result<Vec<Eagle3Output>>;
    fn new_cache(&self) -> RowCache;
    fn kv_bytes_per_token(&self) -> usize;
}

/// An EAGLE-3 head loaded for a target ([`Eagle3Head::load`], in `crate::registry`).
pub struct Eagle3Head {
    pub spec: Eagle3Spec,
    pub(crate) net: Box<dyn Eagle3Net>,
}

impl Eagle3Head {
    /// An empty per-row cache for the head's layer.
    pub fn new_cache(&self) -> RowCache {
        self.net.new_cache()
    }

    /// KV bytes one position costs.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.net.kv_bytes_per_token()
    }

    /// The hidden states the target's forwards must return for this head.
    pub fn hidden(&self) -> crate::Hidden {
        crate::Taps::new(&self.spec.taps).map_or(crate::Hidden::None, crate::Hidden::Taps)
    }

    /// Runs every row's pairs at its next logical positions and returns the prediction
    /// after each row's last pair; the new K/V stay in each row's open window for the
    /// caller to commit, as with [`crate::Model::forward`].
    pub fn forward(&self, rows: &mut [Eagle3Input], feed: Eagle3Feed) -> Result<Vec<Eagle3Output>> {
        self.net.forward(rows, feed)
    }
}
