//! A GGUF's model settings and tensors in the Hugging Face shapes the loaders read: the
//! `{arch}.*` metadata of `llama`, `qwen2` and `qwen3` as a `config.json` object, and
//! llama.cpp's tensor names (`blk.N.attn_q.weight`) as transformers' (`model.layers.N.
//! self_attn.q_proj.weight`), with the q/k row permutation llama.cpp's converter applies to
//! the `llama` architecture undone.
//!
//! Contract: an architecture other than these three is refused by name; a missing or
//! mistyped key is an error naming the GGUF key; RoPE scaling (any
//! `{arch}.rope.scaling.type` but `none`, or a `rope_freqs` tensor) is refused, not ignored.

use serde_json::{json, Value as Json};

use super::reader::GgufFile;
use crate::error::Result;

/// The families this loader maps, by `general.architecture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
}

impl Family {
    pub fn of(g: &GgufFile) -> Result<Family> {
        match g.str("general.architecture")? {
            "llama" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            other => Err(g.err(format!(
                "metadata `general.architecture` is `{other}`: supported are llama, qwen2 and qwen3"
            ))),
        }
    }

    fn key(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }

    fn hf(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

/// The model's settings as a transformers `config.json` object.
pub fn config_json(g: &GgufFile) -> Result<Json> {
    let fam = Family::of(g)?;
    let a = fam.key();
    let need = |k: &str| -> Result<u64> {
        let key = format!("{a}.{k}");
        g.opt_u64(&key)?.ok_or_else(|| g.err(format!("metadata `{key}` is missing")))
    };
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    if heads == 0 {
        return Err(g.err(format!("metadata `{a}.attention.head_count` is 0")));
    }
    let kv_heads = g.opt_u64(&format!("{a}.attention.head_count_kv"))?.unwrap_or(heads);
    let head_dim = match g.opt_u64(&format!("{a}.attention.key_length"))? {
        Some(k) => k,
        None => hidden / heads,
    };
    if let Some(v) = g.opt_u64(&format!("{a}.attention.value_length"))?.filter(|&v| v != head_dim) {
        return Err(g.err(format!(
            "metadata `{a}.attention.value_length` is {v}, unlike the key length {head_dim}: not supported"
        )));
    }
    if let Some(n) = g.opt_u64(&format!("{a}.rope.dimension_count"))?.filter(|&n| n != head_dim) {
        return Err(g.err(format!(
            "metadata `{a}.rope.dimension_count` is {n}: RoPE over part of each head ({head_dim}) is not supported"
        )));
    }
    let scaling_key = format!("{a}.rope.scaling.type");
    if let Some(s) = g.get(&scaling_key) {
        if s.as_str() != Some("none") {
            return Err(g.err(format!(
                "metadata `{scaling_key}` is {s:?}: RoPE scaling is not supported for GGUF yet"
            )));
        }
    }
    if g.tensor("rope_freqs.weight").is_some() {
        return Err(g.err(
            "tensor `rope_freqs.weight` (llama3-style RoPE frequency factors) is not supported for GGUF yet",
        ));
    }
    let embd = g.tensor("token_embd.weight").ok_or_else(|| g.err("tensor `token_embd.weight` is missing"))?;
    let vocab = match embd.dims.as_slice() {
        [_, v] => *v,
        d => return Err(g.err(format!("tensor `token_embd.weight` has dimensions {d:?}, expected 2"))),
    };
    let mut cfg = json!({
        "architectures": [fam.hf()],
        "model_type": a,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length")?,
        "num_hidden_layers": need("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "tie_word_embeddings": g.tensor("output.weight").is_none(),
        "attention_bias": fam == Family::Llama && g.tensor("blk.0.attn_q.bias").is_some(),
    });
    let o = cfg.as_object_mut().expect("an object");
    let num = |k: &str| g.opt_f64(&format!("{a}.{k}"));
    if let Some(t) = num("rope.freq_base")? {
        o.insert("rope_theta".into(), json!(t));
    }
    if let Some(e) = num("attention.layer_norm_rms_epsilon")? {
        o.insert("rms_norm_eps".into(), json!(e));
    }
    if let Some(c) = g.opt_u64(&format!("{a}.context_length"))? {
        o.insert("max_position_embeddings".into(), json!(c));
    }
    // llama.cpp ends a generation at EOS and at EOT / EOM where the file names them.
    let mut eos = Vec::new();
    for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = g.opt_u64(k)?.filter(|id| !eos.contains(id)) {
            eos.push(id);
        }
    }
    o.insert("eos_token_id".into(), json!(eos));
    if let Some(b) = g.opt_u64("tokenizer.ggml.bos_token_id")? {
        o.insert("bos_token_id".into(), json!(b));
    }
    Ok(cfg)
}

/// The GGUF metadata key `config_json` fills transformers' `key` from, to name it in
/// errors; `None` for keys it derives otherwise.
pub fn gguf_key(g: &GgufFile, key: &str) -> Option<String> {
    let a = Family::of(g).ok()?.key();
    let k = match key {
        "hidden_size" => "embedding_length",
        "intermediate_size" => "feed_forward_length",
        "num_hidden_layers" => "block_count",
        "num_attention_heads" => "attention.head_count",
        "num_key_value_heads" => "attention.head_count_kv",
        "head_dim" => "attention.key_length",
        "rope_theta" => "rope.freq_base",
        "rms_norm_eps" => "attention.layer_norm_rms_epsilon",
        "max_position_embeddings" => "context_length",
        "eos_token_id" => return Some("tokenizer.ggml.eos_token_id".into()),
        "bos_token_id" => return Some("tokenizer.ggml.bos_token_id".into()),
        _ => return None,
    };
    Some(format!("{a}.{k}"))
}

/// The transformers name of llama.cpp tensor `name`, or `None` for a name this family
/// does not have.
pub fn hf_name(fam: Family, name: &str) -> Option<String> {
    let global = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(g) = global {
        return Some(g.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok().filter(|_| !layer.starts_with('+'))?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" if fam == Family::Qwen3 => "self_attn.q_norm",
        "attn_k_norm" if fam == Family::Qwen3 => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    matches!(suffix, "weight" | "bias").then(|| format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// The head count whose rows llama.cpp's converter permuted in tensor `name` (q: the
/// attention heads, k: the KV heads), for the `llama` family; `None` for every other.
pub fn permuted_heads(fam: Family, name: &str, heads: usize, kv_heads: usize) -> Option<usize> {
    if fam != Family::Llama {
        return None;
    }
    let module = name.strip_prefix("blk.")?.split_once('.')?.1.rsplit_once('.')?.0;
    match module {
        "attn_q" => Some(heads),
        "attn_k" => Some(kv_heads),
        _ => None,
    }
}

/// Rows of `data` (`row_bytes` each, `heads` heads of equal size) back in transformers'
/// order. llama.cpp's converter stores a head's rows `[half, pair]` as `[pair, half]`: its
/// row `2i + j` is transformers' row `j * hd / 2 + i` (`hd` the head's rows). `None` when
/// the rows do not split into heads of an even size.
pub fn unpermute_rows(data: &[u8], row_bytes: usize, heads: usize) -> Option<Vec<u8>> {
    let rows = data.len().checked_div(row_bytes)?;
    if heads == 0
        || !rows.is_multiple_of(heads)
        || !(rows / heads).is_multiple_of(2)
        || rows * row_bytes != data.len()
    {
        return None;
    }
    let (hd, half) = (rows / heads, rows / heads / 2);
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let from = h * hd + 2 * i + j;
                let to = h * hd + j * half + i;
                out[to * row_bytes..][..row_bytes].copy_from_slice(&data[from * row_bytes..][..row_bytes]);
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        // 2 heads of 4 rows, one byte a row: transformers order 0..8; llama.cpp writes head
        // rows [0, 2, 1, 3] (pairs of the two halves interleaved).
        let stored = [0u8, 2, 1, 3, 4, 6, 5, 7];
        assert_eq!(unpermute_rows(&stored, 1, 2).unwrap(), (0..8).collect::<Vec<u8>>());
        assert!(unpermute_rows(&stored, 1, 3).is_none());
    }

    #[test]
    fn names_map_to_transformers() {
        let f = Family::Qwen3;
        assert_eq!(hf_name(f, "blk.2.attn_k_norm.weight").unwrap(), "model.layers.2.self_attn.k_norm.weight");
        assert_eq!(hf_name(f, "blk.0.attn_q.bias").unwrap(), "model.layers.0.self_attn.q_proj.bias");
        assert_eq!(hf_name(Family::Llama, "blk.0.attn_q_norm.weight"), None);
        assert_eq!(hf_name(f, "blk.x.ffn_up.weight"), None);
        assert_eq!(hf_name(f, "rope_freqs.weight"), None);
    }
}
