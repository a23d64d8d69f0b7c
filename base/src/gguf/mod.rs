//! llama.cpp's GGUF files as checkpoints: `--target model.gguf` loads the way a checkpoint
//! directory does, through the same three seams: [`config`] (the `config.json` the
//! metadata describes), [`checkpoint`] (the tensors under transformers' names) and
//! [`tokenizer_json`] (the `tokenizer.json` the metadata's vocabulary makes).
//!
//! Contract:
//! - Architectures `llama`, `qwen2` and `qwen3`; anything else is refused naming
//!   `general.architecture`.
//! - Tensor types F32, F16 and BF16 stay in the file's memory map (except llama's q/k,
//!   whose rows are put back in transformers' order, copied); Q4_0, Q8_0, Q4_K, Q5_K and
//!   Q6_K are repacked at load into MLX's affine layout ([`types`]), whose dequantized
//!   values are bit for bit llama.cpp's. Every other type is refused naming the tensor and
//!   its type.
//! - A truncated or corrupt file is an error naming the file, and the key or tensor at
//!   fault ([`reader`]); no input panics.

mod arch;
pub mod reader;
mod tokenizer;
pub mod types;

use std::path::Path;
use std::sync::Arc;

use memmap2::{Mmap, MmapMut};
use safetensors::Dtype;

pub use arch::Family;
use reader::GgufFile;
use types::GgmlType;

use crate::checkpoint::{Built, Checkpoint};
use crate::config::Config;
use crate::error::{Error, Result};

/// Whether `path` names a GGUF file (`*.gguf`, not a directory) rather than a checkpoint
/// directory; one that is missing or not a regular file is then an error naming it.
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) && !path.is_dir()
}

/// The model's settings, from the metadata.
pub fn config(path: &Path) -> Result<Config> {
    let g = GgufFile::open(path)?;
    // A setting refused is named by the GGUF key it came from.
    Config::from_value(path, &arch::config_json(&g)?).map_err(|e| match e {
        Error::Config { key, msg, .. } => {
            let name = arch::gguf_key(&g, &key).unwrap_or(key);
            g.err(format!("metadata `{name}`: {msg}"))
        }
        e => e,
    })
}

/// The tokenizer the metadata describes, as `tokenizer.json` bytes.
pub fn tokenizer_json(path: &Path) -> Result<Vec<u8>> {
    let g = GgufFile::open(path)?;
    let v = tokenizer::tokenizer_json(&g)?;
    serde_json::to_vec(&v).map_err(|e| g.err(format!("tokenizer: {e}")))
}

/// What `tokenizer_config.json` would say for the chat template: `chat_template` (from
/// `tokenizer.chat_template`, absent when the file has none) and the BOS and EOS texts.
pub fn tokenizer_config(path: &Path) -> Result<serde_json::Value> {
    let g = GgufFile::open(path)?;
    let mut out = serde_json::Map::new();
    if g.get("tokenizer.chat_template").is_some() {
        out.insert("chat_template".into(), g.str("tokenizer.chat_template")?.into());
    }
    let tokens = g.get("tokenizer.ggml.tokens").and_then(|t| t.as_array());
    for (key, id) in
        [("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id")]
    {
        let text = g.opt_u64(id)?.and_then(|i| tokens?.get(usize::try_from(i).ok()?)?.as_str());
        if let Some(t) = text {
            out.insert(key.into(), t.into());
        }
    }
    Ok(out.into())
}

/// The file's tensors under transformers' names, quantized ones repacked.
pub fn checkpoint(path: &Path) -> Result<Checkpoint> {
    checkpoint_with(path, true)
}

/// [`checkpoint`], with llama's q/k rows left in the file's order when `unpermute` is
/// false: the golden test's negative control, never a way to load a model.
#[doc(hidden)]
pub fn checkpoint_with(path: &Path, unpermute: bool) -> Result<Checkpoint> {
    let g = GgufFile::open(path)?;
    let fam = Family::of(&g)?;
    let cfg = arch::config_json(&g)?;
    let count = |k: &str| cfg[k].as_u64().unwrap_or(0) as usize;
    let (heads, kv_heads) = (count("num_attention_heads"), count("num_key_value_heads"));
    let mut built = Vec::with_capacity(g.tensors.len());
    for t in &g.tensors {
        let bad = |msg: String| g.err(format!("tensor `{}` ({}): {msg}", t.name, t.ty.name()));
        let name = arch::hf_name(fam, &t.name)
            .ok_or_else(|| bad(format!("not a tensor of a {fam:?} model this loader reads")))?;
        let (rows, cols) = match t.dims.as_slice() {
            [c] => (1, *c),
            [c, r] => (*r, *c),
            d => return Err(bad(format!("{} dimensions ({d:?}): 1 or 2 expected", d.len()))),
        };
        let shape = if t.dims.len() == 1 { vec![cols] } else { vec![rows, cols] };
        let raw = g.bytes(t);
        // llama's q/k rows (and biases) back in transformers' order.
        let unpermuted = match arch::permuted_heads(fam, &t.name, heads, kv_heads).filter(|_| unpermute) {
            Some(h) => {
                // A bias's "rows" are its values.
                let n = if t.dims.len() == 1 { cols } else { rows };
                let row_bytes = raw.len().checked_div(n).unwrap_or(0);
                Some(arch::unpermute_rows(raw, row_bytes, h).ok_or_else(|| {
                    bad(format!("its {n} rows do not split into {h} heads of an even size"))
                })?)
            }
            None => None,
        };
        let data: &[u8] = unpermuted.as_deref().unwrap_or(raw);
        let float = match t.ty {
            GgmlType::F32 => Some(Dtype::F32),
            GgmlType::F16 => Some(Dtype::F16),
            GgmlType::Bf16 => Some(Dtype::BF16),
            _ => None,
        };
        if let Some(dtype) = float {
            let (map, range) = match &unpermuted {
                None => (g.map.clone(), t.range.clone()),
                Some(v) => (anon(path, v)?, 0..v.len()),
            };
            built.push(Built { name, map, range, dtype, shape });
            continue;
        }
        if t.ty.mlx_layout().is_none() {
            return Err(bad(
                "this type is not supported (F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q5_K and Q6_K are)".into(),
            ));
        }
        if t.dims.len() != 2 {
            return Err(bad("a quantized tensor must be 2-D".into()));
        }
        let r = types::repack(t.ty, data, rows, cols);
        let stem = name.strip_suffix(".weight").ok_or_else(|| bad("only weights may be quantized".into()))?;
        let words = cols * r.bits / 32;
        built.push(Built {
            name: name.clone(),
            map: anon(path, &r.packed)?,
            range: 0..r.packed.len(),
            dtype: Dtype::U32,
            shape: vec![rows, words],
        });
        let groups = cols / r.group;
        let (dtype, scales, biases) = side_bytes(&r.scales, &r.biases);
        for (suffix, bytes) in [("scales", scales), ("biases", biases)] {
            built.push(Built {
                name: format!("{stem}.{suffix}"),
                map: anon(path, &bytes)?,
                range: 0..bytes.len(),
                dtype,
                shape: vec![rows, groups],
            });
        }
    }
    Ok(Checkpoint::from_built(path, built))
}

/// Scales and biases as f16 when every one is exactly an f16 (Q4_0's and Q8_0's: the
/// block's f16 `d` and a power-of-two multiple of it), else as f32.
fn side_bytes(scales: &[f32], biases: &[f32]) -> (Dtype, Vec<u8>, Vec<u8>) {
    let exact = |v: &f32| half::f16::from_f32(*v).to_f32().to_bits() == v.to_bits();
    if scales.iter().chain(biases).all(exact) {
        let h = |v: &[f32]| v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect();
        (Dtype::F16, h(scales), h(biases))
    } else {
        let f = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect();
        (Dtype::F32, f(scales), f(biases))
    }
}

/// `bytes` in an anonymous read-only memory map (what a [`Checkpoint`] holds tensors in).
fn anon(path: &Path, bytes: &[u8]) -> Result<Arc<Mmap>> {
    let mut m = MmapMut::map_anon(bytes.len().max(1)).map_err(|e| Error::io(path, e))?;
    m[..bytes.len()].copy_from_slice(bytes);
    Ok(Arc::new(m.make_read_only().map_err(|e| Error::io(path, e))?))
}
