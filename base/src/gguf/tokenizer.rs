//! A GGUF's vocabulary (`tokenizer.ggml.*`) as the `tokenizer.json` transformers would
//! load: byte-level BPE (`tokenizer.ggml.model` = `gpt2`) with the pre-tokenizer that
//! `tokenizer.ggml.pre` names, control tokens as special added tokens, user-defined ones as
//! plain added tokens, BOS prepended where `tokenizer.ggml.add_bos_token` says; `qwen2`
//! text is NFC-normalized first, as Qwen's tokenizer.json says.
//!
//! Contract: the result encodes text to the ids the original `tokenizer.json` gives, for
//! the pre-tokenizers named here (`gpt-2`, `qwen2`, `llama-bpe`); another pre-tokenizer, or
//! SentencePiece's `llama` model, is refused by name rather than tokenized differently.

use std::collections::HashSet;

use serde_json::{json, Map, Value as Json};

use super::reader::{GgufFile, Value};
use crate::error::Result;

/// Qwen2's (and Qwen3's) split regex, as its tokenizer.json spells it.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's split regex, as its tokenizer.json spells it.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's token types (`llama_token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const UNUSED: i64 = 5;

fn strings<'a>(g: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    let a = g
        .get(key)
        .ok_or_else(|| g.err(format!("metadata `{key}` is missing")))?
        .as_array()
        .ok_or_else(|| g.err(format!("metadata `{key}` is not an array")))?;
    a.iter()
        .enumerate()
        .map(|(i, v)| v.as_str().ok_or_else(|| g.err(format!("metadata `{key}`[{i}] is not a string"))))
        .collect()
}

pub fn tokenizer_json(g: &GgufFile) -> Result<Json> {
    let model = g.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(g.err(format!(
            "metadata `tokenizer.ggml.model` is `{model}`: only `gpt2` (byte-level BPE) is supported for GGUF yet"
        )));
    }
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let merges = strings(g, "tokenizer.ggml.merges")?;
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::I32(t) => Ok(i64::from(*t)),
                v => v.as_u64().map(|t| t as i64).ok_or_else(|| {
                    g.err(format!("metadata `tokenizer.ggml.token_type`[{i}] is not an integer"))
                }),
            })
            .collect::<Result<_>>()?,
        Some(_) => return Err(g.err("metadata `tokenizer.ggml.token_type` is not an array")),
    };
    if types.len() != tokens.len() {
        return Err(g.err(format!(
            "metadata `tokenizer.ggml.token_type` has {} entries for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let pre = match g.get("tokenizer.ggml.pre") {
        None => "gpt-2",
        Some(_) => g.str("tokenizer.ggml.pre")?,
    };
    let split = |regex: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})
    };
    let pre_tokenizer = match pre {
        "gpt-2" => json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
        "qwen2" => split(QWEN2_REGEX),
        "llama-bpe" => split(LLAMA3_REGEX),
        other => {
            return Err(g.err(format!(
                "metadata `tokenizer.ggml.pre` is `{other}`: supported pre-tokenizers are gpt-2, qwen2 and llama-bpe"
            )))
        }
    };
    let mut vocab = Map::new();
    let mut added = Vec::new();
    let mut seen = HashSet::new();
    for (id, (&text, &ty)) in tokens.iter().zip(&types).enumerate() {
        if ty == UNUSED || !seen.insert(text) {
            continue;
        }
        if ty == CONTROL || ty == USER_DEFINED {
            added.push(json!({"id": id, "content": text, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == CONTROL}));
        }
        vocab.insert(text.to_string(), json!(id));
    }
    let add_bos = matches!(g.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(true)));
    let post_processor = match (add_bos, g.opt_u64("tokenizer.ggml.bos_token_id")?) {
        (true, Some(bos)) => {
            let text = usize::try_from(bos).ok().and_then(|b| tokens.get(b)).ok_or_else(|| {
                g.err(format!("metadata `tokenizer.ggml.bos_token_id` {bos} is not a token"))
            })?;
            json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": text, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": text, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {*text: {"id": text, "ids": [bos], "tokens": [text]}}})
        }
        _ => Json::Null,
    };
    let merges: Vec<Json> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| match m.split_once(' ') {
            Some((a, b)) if !b.contains(' ') => Ok(json!([a, b])),
            _ => Err(
                g.err(format!("metadata `tokenizer.ggml.merges`[{i}] `{m}` is not two tokens and a space"))
            ),
        })
        .collect::<Result<_>>()?;
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        // Qwen2's tokenizer.json composes text to NFC first.
        "normalizer": if pre == "qwen2" { json!({"type": "NFC"}) } else { Json::Null },
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": pre == "llama-bpe", "vocab": vocab, "merges": merges},
    }))
}
