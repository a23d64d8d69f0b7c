//! Writes HF-layout checkpoints with random weights, so speed can be measured on real
//! model shapes without downloads (`mtp synth`).
//!
//! Nothing is written until the shape is known to load: the config.json about to be written
//! passes the validation `mtp generate` applies ([`Config::from_value`]), every tensor's
//! bytes are counted with checked arithmetic, and the total must stay under the spec's
//! `max_bytes` (`--max-gib`) and the free space of the output's file system. A write that
//! fails halfway removes its partial safetensors file.

pub mod gemma4;

use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::json;

use mtp_base::config::{Arch, Config};
use mtp_base::error::{Error, Result};
use mtp_base::weights::WeightDtype;
use mtp_model::MtpLayout;

/// The shape of a synthetic checkpoint.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f32,
    pub tie_word_embeddings: bool,
    pub dtype: WeightDtype,
    /// MLX-quantized matrices (`--q-bits`), or all in `dtype`.
    pub quant: Option<SynthQuant>,
    pub seed: u64,
    /// The most bytes of weights a write may produce.
    pub max_bytes: u64,
}

/// The default of `max_bytes`: every preset but Gemma 4 31B fits (`--max-gib` raises it).
pub const DEFAULT_MAX_BYTES: u64 = 16 << 30;

/// MLX affine quantization of a synthesized checkpoint's matrices, as `mlx_lm.convert -q
/// --q-bits B --q-group-size G` stores them: every 2-D `*.weight` whose rows G divides
/// becomes packed u32 codes with `scales` and `biases` (in the checkpoint's dtype) beside
/// it; norms and anything G does not divide stay as they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthQuant {
    pub bits: usize,
    pub group: usize,
}

impl SynthQuant {
    /// `bits` of 2, 4 or 8 and a `group` of 32, 64 or 128 (mlx-lm's affine choices).
    pub fn new(bits: usize, group: usize) -> Result<SynthQuant> {
        if ![2, 4, 8].contains(&bits) {
            return Err(Error::InvalidOption(format!("--q-bits {bits}: 2, 4 or 8")));
        }
        if ![32, 64, 128].contains(&group) {
            return Err(Error::InvalidOption(format!("--q-group-size {group}: 32, 64 or 128")));
        }
        Ok(SynthQuant { bits, group })
    }

    /// Whether tensor `name` of `shape` is stored quantized.
    fn applies(&self, name: &str, shape: &[usize]) -> bool {
        name.ends_with(".weight") && matches!(shape, [_, cols] if cols % self.group == 0)
    }

    /// config.json's `quantization` (and `quantization_config`, as mlx-lm writes both).
    pub fn config(&self) -> serde_json::Value {
        json!({"group_size": self.group, "bits": self.bits, "mode": "affine"})
    }
}

/// How a synthesized checkpoint stores its tensors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Storage {
    pub dtype: WeightDtype,
    pub quant: Option<SynthQuant>,
}

/// What one stored tensor holds.
#[derive(Clone, Copy)]
enum Fill {
    /// Uniform in `[-a, a]`, `a = sqrt(3 / fan_in)` (norm weights: 1.0).
    Random { fan_in: usize, norm: bool },
    /// Random `bits`-bit codes packed into u32 words.
    Codes,
    /// One value everywhere (a quantized weight's scales and biases).
    Const(f32),
}

/// The tensors as stored: name, shape, safetensors dtype name, bytes per element, fill.
fn stored(
    tensors: &[(String, Vec<usize>)],
    s: Storage,
) -> Vec<(String, Vec<usize>, &'static str, usize, Fill)> {
    let (name, size) = (s.dtype.name(), s.dtype.size());
    let mut out = Vec::with_capacity(tensors.len());
    for (n, shape) in tensors {
        let fan_in = *shape.last().unwrap_or(&1);
        match s.quant {
            Some(q) if q.applies(n, shape) => {
                let stem = n.strip_suffix(".weight").expect("applies() checked the suffix");
                let (rows, groups) = (shape[0], fan_in / q.group);
                // Codes 0 ..= 2^bits - 1 spread evenly over [-a, a].
                let a = (3.0 / fan_in as f32).sqrt();
                let scale = 2.0 * a / ((1usize << q.bits) - 1) as f32;
                out.push((n.clone(), vec![rows, fan_in * q.bits / 32], "U32", 4, Fill::Codes));
                out.push((format!("{stem}.scales"), vec![rows, groups], name, size, Fill::Const(scale)));
                out.push((format!("{stem}.biases"), vec![rows, groups], name, size, Fill::Const(-a)));
            }
            _ => {
                let norm = shape.len() == 1 && !n.ends_with(".bias");
                out.push((n.clone(), shape.clone(), name, size, Fill::Random { fan_in, norm }));
            }
        }
    }
    out
}

impl SynthSpec {
    /// Presets named like the models whose shapes they copy.
    pub fn preset(name: &str) -> Option<SynthSpec> {
        let base = SynthSpec {
            arch: Arch::Qwen3,
            vocab_size: 151936,
            hidden_size: 1024,
            num_hidden_layers: 28,
            num_attention_heads: 16,
            num_key_value_heads: 8,
            head_dim: 128,
            intermediate_size: 3072,
            max_position_embeddings: 40960,
            rope_theta: 1_000_000.0,
            tie_word_embeddings: true,
            dtype: WeightDtype::Bf16,
            quant: None,
            seed: 0,
            max_bytes: DEFAULT_MAX_BYTES,
        };
        match name {
            "qwen3" | "qwen3-0.6b" => Some(base),
            "qwen3-8b" => Some(SynthSpec {
                hidden_size: 4096,
                num_hidden_layers: 36,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                intermediate_size: 12288,
                tie_word_embeddings: false,
                ..base
            }),
            "qwen2" | "qwen2.5-0.5b" => Some(SynthSpec {
                arch: Arch::Qwen2,
                hidden_size: 896,
                num_hidden_layers: 24,
                num_attention_heads: 14,
                num_key_value_heads: 2,
                head_dim: 64,
                intermediate_size: 4864,
                max_position_embeddings: 32768,
                ..base
            }),
            "llama" | "llama-3.2-1b" => Some(SynthSpec {
                arch: Arch::Llama,
                vocab_size: 128256,
                hidden_size: 2048,
                num_hidden_layers: 16,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                head_dim: 64,
                intermediate_size: 8192,
                max_position_embeddings: 131072,
                rope_theta: 500_000.0,
                ..base
            }),
            _ => None,
        }
    }

    /// The spec of an existing checkpoint's config (random weights, same shapes).
    pub fn from_config(c: &Config) -> SynthSpec {
        SynthSpec {
            arch: c.arch,
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            num_hidden_layers: c.num_hidden_layers,
            num_attention_heads: c.num_attention_heads,
            num_key_value_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            intermediate_size: c.intermediate_size,
            max_position_embeddings: c.max_position_embeddings,
            rope_theta: c.rope_theta,
            tie_word_embeddings: c.tie_word_embeddings,
            dtype: WeightDtype::F32,
            quant: None,
            seed: 0,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }

    /// Tensors of one decoder layer whose names start with `p`.
    fn layer_tensors(&self, p: &str) -> Vec<(String, Vec<usize>)> {
        let (h, hd) = (self.hidden_size, self.head_dim);
        let (qd, kvd, f) =
            (self.num_attention_heads * hd, self.num_key_value_heads * hd, self.intermediate_size);
        let mut t = vec![
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
        ];
        for (n, o, inp) in [("q_proj", qd, h), ("k_proj", kvd, h), ("v_proj", kvd, h), ("o_proj", h, qd)] {
            t.push((format!("{p}.self_attn.{n}.weight"), vec![o, inp]));
        }
        if self.arch == Arch::Qwen2 {
            t.push((format!("{p}.self_attn.q_proj.bias"), vec![qd]));
            t.push((format!("{p}.self_attn.k_proj.bias"), vec![kvd]));
            t.push((format!("{p}.self_attn.v_proj.bias"), vec![kvd]));
        }
        if self.arch == Arch::Qwen3 {
            t.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            t.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        }
        t.push((format!("{p}.mlp.gate_proj.weight"), vec![f, h]));
        t.push((format!("{p}.mlp.up_proj.weight"), vec![f, h]));
        t.push((format!("{p}.mlp.down_proj.weight"), vec![h, f]));
        t
    }

    fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden_size;
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab_size, h])];
        for i in 0..self.num_hidden_layers {
            t.extend(self.layer_tensors(&format!("model.layers.{i}")));
        }
        t.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            t.push(("lm_head.weight".to_string(), vec![self.vocab_size, h]));
        }
        t
    }

    /// Tensors of one MTP module in `layout` (DeepSeek: with its own `shared_head.head`,
    /// sharing the target's embedding).
    fn mtp_tensors(&self, layout: MtpLayout) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden_size;
        let p = layout.prefix(self.num_hidden_layers, 0);
        let [tn, hn, proj, fnorm] = layout.names(&p);
        let mut t = vec![(tn, vec![h]), (hn, vec![h]), (proj, vec![h, 2 * h]), (fnorm, vec![h])];
        if layout == MtpLayout::DeepSeek {
            t.push((format!("{p}.shared_head.head.weight"), vec![self.vocab_size, h]));
        }
        t.extend(self.layer_tensors(&p));
        t
    }

    /// Writes a random MTP head for the checkpoint in `target` into `out`: config.json
    /// (the target's, plus `num_nextn_predict_layers: 1`), model.safetensors with only the
    /// head's tensors in `layout`, and the target's tokenizer.json when it has one.
    pub fn write_mtp_head(target: &Path, layout: MtpLayout, out: &Path, seed: u64) -> Result<()> {
        let cfg_path = target.join("config.json");
        let spec = SynthSpec { seed, ..SynthSpec::from_config(&Config::from_dir(target)?) };
        let mut cfg = mtp_base::config::read_json(&cfg_path)?;
        cfg["num_nextn_predict_layers"] = json!(1);
        let tensors = spec.mtp_tensors(layout);
        let bytes = checked_bytes(&tensors, spec.storage(), spec.max_bytes)?;
        std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
        check_free_space(out, bytes)?;
        let p = out.join("config.json");
        std::fs::write(&p, serde_json::to_string_pretty(&cfg).expect("json"))
            .map_err(|e| Error::io(&p, e))?;
        let tok = target.join("tokenizer.json");
        if tok.exists() {
            std::fs::copy(&tok, out.join("tokenizer.json")).map_err(|e| Error::io(&tok, e))?;
        }
        write_random_safetensors(&out.join("model.safetensors"), &tensors, spec.storage(), seed)
    }

    fn storage(&self) -> Storage {
        Storage { dtype: self.dtype, quant: self.quant }
    }

    fn config_json(&self) -> serde_json::Value {
        let mut v = json!({
            "architectures": [self.arch.hf_name()],
            "model_type": match self.arch {
                Arch::Llama => "llama",
                Arch::Qwen2 => "qwen2",
                Arch::Qwen3 => "qwen3",
                Arch::Gemma4 => "gemma4_text",
            },
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "attention_bias": false,
            "sliding_window": null,
            "use_sliding_window": false,
            "max_window_layers": self.num_hidden_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": 1,
            "eos_token_id": 0,
            "torch_dtype": match self.dtype { WeightDtype::F32 => "float32", WeightDtype::Bf16 => "bfloat16", WeightDtype::F16 => "float16" },
        });
        if let Some(q) = self.quant {
            v["quantization"] = q.config();
            v["quantization_config"] = q.config();
        }
        v
    }

    /// The config.json this spec writes, checked as `mtp generate` checks it (`path` names
    /// it in errors).
    pub fn validated_config(&self, path: &Path) -> Result<serde_json::Value> {
        let v = self.config_json();
        Config::from_value(path, &v)?;
        Ok(v)
    }

    /// Writes config.json, generation_config.json, model.safetensors and tokenizer.json; a
    /// shape that would not load or does not fit is refused before anything is written.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let config = self.validated_config(&dir.join("config.json"))?;
        let tensors = self.tensors();
        let bytes = checked_bytes(&tensors, self.storage(), self.max_bytes)?;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        check_free_space(dir, bytes)?;
        let write_json = |name: &str, v: serde_json::Value| {
            let p = dir.join(name);
            std::fs::write(&p, serde_json::to_string_pretty(&v).expect("json")).map_err(|e| Error::io(&p, e))
        };
        write_json("config.json", config)?;
        write_json("generation_config.json", json!({"bos_token_id": 1, "eos_token_id": [0, 2]}))?;
        if self.vocab_size >= 512 {
            let p = dir.join("tokenizer.json");
            std::fs::write(&p, synth_tokenizer(self.vocab_size)).map_err(|e| Error::io(&p, e))?;
        }
        write_random_safetensors(&dir.join("model.safetensors"), &tensors, self.storage(), self.seed)
    }
}

/// The 512-token byte-level BPE tokenizer synthetic checkpoints ship.
const BYTE_BPE_512: &str = include_str!("assets/byte-bpe-512.tokenizer.json");

/// [`BYTE_BPE_512`] with its vocabulary extended to `vocab_size` ids by tokens no text
/// encodes to (`<synth_512>`, ...): random weights pick any id, and a padding id without
/// text would end the request (a real checkpoint's padding rows are never picked), so
/// `mtp generate` on a synthesized checkpoint runs every token it is asked for.
pub(crate) fn synth_tokenizer(vocab_size: usize) -> String {
    let mut t: serde_json::Value = serde_json::from_str(BYTE_BPE_512).expect("the shipped tokenizer is JSON");
    let vocab = t["model"]["vocab"].as_object_mut().expect("a BPE vocabulary");
    for id in vocab.len()..vocab_size {
        vocab.insert(format!("<synth_{id}>"), id.into());
    }
    serde_json::to_string(&t).expect("json")
}

/// The bytes `tensors` take stored as `storage` says, counted without overflow, and at
/// most `max_bytes`.
pub(crate) fn checked_bytes(
    tensors: &[(String, Vec<usize>)],
    storage: Storage,
    max_bytes: u64,
) -> Result<u64> {
    let mut total = 0u64;
    for (name, shape, _, size, _) in stored(tensors, storage) {
        let bytes = shape.iter().try_fold(size as u64, |a, &d| a.checked_mul(d as u64));
        total = bytes.and_then(|b| total.checked_add(b)).ok_or_else(|| {
            Error::InvalidOption(format!("tensor `{name}` of shape {shape:?} overflows a byte count"))
        })?;
    }
    if total > max_bytes {
        return Err(Error::InvalidOption(format!(
            "{:.1} GiB of {} weights is over the limit of {:.1} GiB (--max-gib raises it)",
            total as f64 / (1u64 << 30) as f64,
            storage.dtype.name(),
            max_bytes as f64 / (1u64 << 30) as f64
        )));
    }
    Ok(total)
}

/// Refuses to start a write of `bytes` that the file system of `dir` has no room for.
pub(crate) fn check_free_space(dir: &Path, bytes: u64) -> Result<()> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| Error::InvalidOption(format!("{}: a NUL in the path", dir.display())))?;
        // SAFETY: `c` is a NUL-terminated path and `st` a statvfs the call fills.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0 {
            let free = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
            if bytes > free {
                return Err(Error::InvalidOption(format!(
                    "{}: {bytes} bytes of weights would not fit the {free} bytes free there",
                    dir.display()
                )));
            }
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = (dir, bytes);
    Ok(())
}

/// Streams `tensors` with uniform random values (norm weights 1.0; quantized matrices
/// random codes over the same range) into `path` (their sizes already counted by
/// [`checked_bytes`]); a failed write removes the partial file.
pub(crate) fn write_random_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>)],
    storage: Storage,
    seed: u64,
) -> Result<()> {
    let written = stream_random_safetensors(path, tensors, storage, seed);
    if written.is_err() {
        let _ = std::fs::remove_file(path);
    }
    written
}

fn stream_random_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>)],
    storage: Storage,
    seed: u64,
) -> Result<()> {
    let entries = stored(tensors, storage);
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut off = 0usize;
    for (name, shape, dtype, size, _) in &entries {
        let n: usize = shape.iter().product::<usize>() * size;
        header.insert(name.clone(), json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}));
        off += n;
    }
    let mut h = serde_json::to_string(&header).expect("json");
    while !h.len().is_multiple_of(8) {
        h.push(' ');
    }
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let io = |e| Error::io(path, e);
    w.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(h.as_bytes()).map_err(io)?;
    let float = |v: f32, buf: &mut Vec<u8>| match storage.dtype {
        WeightDtype::F32 => buf.extend_from_slice(&v.to_le_bytes()),
        WeightDtype::Bf16 => buf.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        WeightDtype::F16 => buf.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
    };
    // Tensor i's generator is seeded by i among the logical tensors, quantized or not.
    let mut logical = 0u64;
    for (name, shape, _, _, fill) in &entries {
        if !name.ends_with(".scales") && !name.ends_with(".biases") {
            logical += 1;
        }
        let mut rng = SplitMix(seed.wrapping_mul(0x9E37_79B9).wrapping_add(logical - 1));
        let mut buf = Vec::with_capacity(1 << 16);
        let count: usize = shape.iter().product();
        for j in 0..count {
            match *fill {
                Fill::Random { norm: true, .. } => float(1.0, &mut buf),
                Fill::Random { fan_in, norm: false } => {
                    let a = (3.0 / fan_in as f32).sqrt();
                    float(a * (2.0 * rng.next_f32() - 1.0), &mut buf)
                }
                Fill::Codes => buf.extend_from_slice(&rng.next_u32().to_le_bytes()),
                Fill::Const(v) => float(v, &mut buf),
            }
            if buf.len() >= 1 << 16 || j + 1 == count {
                w.write_all(&buf).map_err(io)?;
                buf.clear();
            }
        }
    }
    w.flush().map_err(io)
}
/// SplitMix64: a tiny, seedable generator (no dependency needed for weights).
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
}
