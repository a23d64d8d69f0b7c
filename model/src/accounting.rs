//! Tensor accounting: once a load is done, every tensor of the checkpoint it did not read is
//! an error naming them (the first few with their files, and the count), so a checkpoint
//! that does not match its config.json never loads silently: a `num_hidden_layers` below
//! the layers shipped, another family's tensors (Qwen3's q/k norms under
//! `LlamaForCausalLM`), biases `attention_bias` does not declare, an MTP head the config
//! does not declare. Tensors a load needs but lacks are errors of `Checkpoint::get`.
//!
//! Who accounts for what:
//! - The target's load: every tensor, except the modules of the MTP head config.json
//!   declares (`num_nextn_predict_layers`), which belong to the head's own load; so a plain
//!   target load never reads or fails on its head.
//! - The MTP head's load (a separate directory or the target's own): every tensor of an
//!   MTP module (`model.mtp_layers.*`, or `model.layers.{N}.*` past the decoder's layers);
//!   it reads module 0 and checks that each further declared module holds the same tensors.
//! - Gemma 4's assistant: every tensor of its checkpoint.
//!
//! Nobody reads, by design: other modalities' towers and projectors, and the RoPE
//! `inv_freq` buffers older transformers saved.

use std::path::Path;

use mtp_base::{Checkpoint, Config, Error, Result};

use crate::mtp::MtpLayout;

/// Prefixes (after an optional `model.`) of tensors a text decoder never reads.
const OTHER_MODALITIES: [&str; 5] =
    ["vision_tower.", "audio_tower.", "multi_modal_projector.", "embed_vision.", "embed_audio."];

/// How many unread tensors an error lists by name.
const SHOWN: usize = 4;

/// Whether `name` belongs to another modality's tower or projector (transformers'
/// `model.vision_tower.*`, mlx-vlm's `vision_tower.*`, ...).
pub(crate) fn other_modality(name: &str) -> bool {
    let rest = name.strip_prefix("model.").unwrap_or(name);
    OTHER_MODALITIES.iter().any(|p| rest.starts_with(p))
}

/// Whether no load reads `name`, by design.
pub(crate) fn ignorable(name: &str) -> bool {
    other_modality(name) || name.ends_with("inv_freq")
}

/// The number after `prefix` in `name` (`model.layers.` + `3.mlp...` gives 3).
fn index_after(name: &str, prefix: &str) -> Option<usize> {
    name.strip_prefix(prefix)?.split_once('.')?.0.parse().ok()
}

/// The MTP module `name` belongs to, and its layout, for a decoder of `n_layers` layers:
/// under MiMo's `model.mtp_layers.{i}.`, or under DeepSeek-V3's `model.layers.{n_layers + i}.`
/// when that module holds DeepSeek's projection (else it is a decoder layer).
fn head_module(ck: &Checkpoint, name: &str, n_layers: usize) -> Option<(usize, MtpLayout)> {
    if let Some(i) = index_after(name, "model.mtp_layers.") {
        return Some((i, MtpLayout::MiMo));
    }
    let k = index_after(name, "model.layers.")?;
    let i = k.checked_sub(n_layers)?;
    let l = MtpLayout::DeepSeek;
    ck.contains(&l.names(&format!("model.layers.{k}"))[2]).then_some((i, l))
}

/// The error for `unread` (empty: fine): what `reader` is, the first names and files, and
/// `hint` on what in config.json disagrees.
fn refuse(ck: &Checkpoint, reader: String, unread: &[&str], hint: String) -> Result<()> {
    if unread.is_empty() {
        return Ok(());
    }
    let file = |n: &str| {
        ck.file_of(n).and_then(Path::file_name).map_or(String::new(), |f| f.to_string_lossy().into_owned())
    };
    let mut names: Vec<String> = unread.iter().take(SHOWN).map(|n| format!("`{n}` ({})", file(n))).collect();
    if unread.len() > SHOWN {
        names.push(format!("and {} more", unread.len() - SHOWN));
    }
    Err(Error::UnreadTensors {
        dir: ck.dir().to_path_buf(),
        reader,
        count: unread.len(),
        names: names.join(", "),
        hint,
    })
}

/// After a target model is built from `ck`: every tensor it did not read, apart from the
/// declared MTP modules and [`ignorable`] ones, is an error.
pub(crate) fn check_target(ck: &Checkpoint, c: &Config) -> Result<()> {
    let n = c.num_hidden_layers;
    let unread: Vec<&str> = ck
        .unread()
        .into_iter()
        .filter(|name| !ignorable(name))
        .filter(|name| head_module(ck, name, n).is_none_or(|(i, _)| i >= c.num_nextn_predict_layers))
        .collect();
    let reader = format!("a {} of {n} layers (config.json)", c.arch.hf_name());
    refuse(ck, reader, &unread, target_hint(ck, c, &unread))?;
    ck.check_declared_used()
}

/// What in config.json the unread tensors of a target load suggest is wrong: an MTP head
/// it does not declare, layers past `num_hidden_layers`, or, within the declared layers,
/// another family's q/k norms or biases.
fn target_hint(ck: &Checkpoint, c: &Config, unread: &[&str]) -> String {
    let n = c.num_hidden_layers;
    let layer = |name: &str| {
        ["model.layers.", "model.language_model.layers.", "language_model.model.layers."]
            .iter()
            .find_map(|p| index_after(name, p))
    };
    let mut hints = Vec::new();
    let (head, rest): (Vec<&str>, Vec<&str>) =
        unread.iter().partition(|name| head_module(ck, name, n).is_some());
    if let Some(top) = head.iter().filter_map(|name| head_module(ck, name, n)).map(|(i, _)| i).max() {
        hints.push(format!(
            "they hold {} MTP module(s) but config.json's num_nextn_predict_layers is {}",
            top + 1,
            c.num_nextn_predict_layers
        ));
    }
    let (beyond, within): (Vec<&str>, Vec<&str>) =
        rest.iter().partition(|name| layer(name).is_some_and(|k| k >= n));
    let beyond: Vec<usize> = beyond.iter().filter_map(|name| layer(name)).collect();
    if let (Some(lo), Some(hi)) = (beyond.iter().min(), beyond.iter().max()) {
        hints.push(format!("layers {lo} to {hi} are beyond config.json's num_hidden_layers {n}"));
    }
    let norm = |name: &&str| name.ends_with("q_norm.weight") || name.ends_with("k_norm.weight");
    if within.iter().any(norm) {
        hints.push(format!(
            "per-head q/k norms are Qwen3's, and config.json's architectures names {}",
            c.arch.hf_name()
        ));
    }
    let bias = |name: &&str| name.ends_with(".bias");
    if within.iter().any(bias) {
        hints.push("biases config.json does not declare (attention_bias, architectures)".into());
    }
    if within.iter().any(|name| !norm(name) && !bias(name)) {
        hints.push("config.json describes no such tensor".into());
    }
    hints.join("; ")
}

/// After an MTP head's module 0 is read from `ck`: each further module config.json declares
/// (`n_mtp` in all) must hold the same tensors in the same shapes (drafting applies module 0
/// only), and no tensor of any MTP module may be left unread.
pub(crate) fn check_mtp(
    ck: &Checkpoint,
    cfg_path: &Path,
    layout: MtpLayout,
    n_layers: usize,
    n_mtp: usize,
) -> Result<()> {
    let p0 = format!("{}.", layout.prefix(n_layers, 0));
    let module0 = ck.read_with_prefix(&p0);
    // Stops at the first module that is missing, so a huge count costs nothing.
    for i in 1..n_mtp {
        let pi = format!("{}.", layout.prefix(n_layers, i));
        let mut missing = Vec::new();
        for name in &module0 {
            let twin = format!("{pi}{}", &name[p0.len()..]);
            match (ck.shape(name), ck.shape(&twin)) {
                (want, Some(got)) if want == Some(got) => ck.mark_read(&twin),
                (want, Some(got)) => {
                    return Err(Error::TensorShape {
                        path: ck.file_of(&twin).unwrap_or(ck.dir()).to_path_buf(),
                        name: twin.clone(),
                        got: got.to_vec(),
                        expected: want.unwrap_or_default().to_vec(),
                    })
                }
                (_, None) => missing.push(format!("`{twin}`")),
            }
        }
        if !missing.is_empty() {
            let more = missing.len().saturating_sub(SHOWN);
            missing.truncate(SHOWN);
            let tail = if more > 0 { format!(" and {more} more") } else { String::new() };
            return Err(Error::config(
                cfg_path,
                "num_nextn_predict_layers",
                format!(
                    "declares {n_mtp} MTP modules, but {} lacks module {i}'s tensors: {}{tail} missing",
                    ck.dir().display(),
                    missing.join(", ")
                ),
            ));
        }
    }
    let unread: Vec<&str> = ck
        .unread()
        .into_iter()
        .filter(|name| !ignorable(name) && head_module(ck, name, n_layers).is_some())
        .collect();
    let reader = format!("the MTP head ({} layout, {n_mtp} module(s) declared)", layout.name());
    let hint =
        "tensors of MTP modules beyond those config.json declares, or that the head's layer does not have"
            .to_string();
    refuse(ck, reader, &unread, hint)
}

/// After Gemma 4's assistant is read from `ck`: every tensor must have been read.
pub(crate) fn check_all(ck: &Checkpoint, reader: &str) -> Result<()> {
    let unread: Vec<&str> = ck.unread().into_iter().filter(|name| !ignorable(name)).collect();
    refuse(ck, reader.to_string(), &unread, "the checkpoint does not match its config.json".into())
}
