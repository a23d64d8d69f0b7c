//! The dense decoder shared by Llama/Mistral, Qwen2 and Qwen3:
//! `x += o(attn(rope(norm_qk(q(n(x)))), rope(norm_qk(k(n(x)))), v(n(x))))`,
//! `x += down(silu(gate(n(x))) * up(n(x)))`, logits = `lm_head(norm(x))`.
//! The three families differ only in q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3).

use std::path::Path;

use mtp_cache::RowCache;
use rayon::prelude::*;

use crate::checkpoint::Checkpoint;
use crate::config::{Arch, Config};
use crate::error::{Error, Result};
use crate::kernels::{attend, linear, rms_norm, rms_norm_inplace, swiglu, RopeTable};
use crate::weights::Weight;

struct Proj {
    w: Weight,
    bias: Option<Vec<f32>>,
}

impl Proj {
    fn load(ck: &Checkpoint, name: &str, out: usize, inp: usize, bias: bool) -> Result<Proj> {
        Ok(Proj {
            w: ck.get(&format!("{name}.weight"), &[out, inp])?,
            bias: if bias { Some(ck.get_f32(&format!("{name}.bias"), out)?) } else { None },
        })
    }

    fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * self.w.rows];
        linear(x, m, &self.w, self.bias.as_deref(), &mut out);
        out
    }
}

struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    gate: Proj,
    up: Proj,
    down: Proj,
}

/// Which logits a row wants back from a forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    /// Only after the row's last token (prefill).
    Last,
    /// After every token (verification).
    All,
}

impl Logits {
    /// Indices, within a window of `t` tokens, of the tokens whose logits are wanted.
    fn wanted(self, t: usize) -> std::ops::Range<usize> {
        match self {
            Logits::None => t..t,
            Logits::Last => t.saturating_sub(1)..t,
            Logits::All => 0..t,
        }
    }
}

/// One row of a batched forward: new tokens appended after the row's cache.
pub struct RowInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut RowCache,
    pub logits: Logits,
}

#[derive(Debug, Default)]
pub struct RowOutput {
    /// One vocab-sized row per requested token.
    pub logits: Vec<Vec<f32>>,
    /// The residual stream after the last layer (before the final norm), one
    /// `hidden_size` row per input token: what MTP heads read.
    pub hidden: Vec<f32>,
}

pub struct Model {
    pub config: Config,
    embed: Weight,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Weight,
    rope: RopeTable,
}

impl Model {
    /// Loads `config.json` (+ `generation_config.json`) and the safetensors weights of `dir`.
    pub fn load(dir: &Path) -> Result<Model> {
        let config = Config::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        Model::from_checkpoint(config, &ck)
    }

    pub fn from_checkpoint(config: Config, ck: &Checkpoint) -> Result<Model> {
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qd, kvd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let qk_norm = c.arch == Arch::Qwen3;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                let a = format!("{p}.self_attn");
                Ok(Layer {
                    input_norm: ck.get_f32(&format!("{p}.input_layernorm.weight"), h)?,
                    post_norm: ck.get_f32(&format!("{p}.post_attention_layernorm.weight"), h)?,
                    q: Proj::load(ck, &format!("{a}.q_proj"), qd, h, c.qkv_bias)?,
                    k: Proj::load(ck, &format!("{a}.k_proj"), kvd, h, c.qkv_bias)?,
                    v: Proj::load(ck, &format!("{a}.v_proj"), kvd, h, c.qkv_bias)?,
                    o: Proj::load(ck, &format!("{a}.o_proj"), h, qd, c.o_bias)?,
                    q_norm: if qk_norm { Some(ck.get_f32(&format!("{a}.q_norm.weight"), hd)?) } else { None },
                    k_norm: if qk_norm { Some(ck.get_f32(&format!("{a}.k_norm.weight"), hd)?) } else { None },
                    gate: Proj::load(ck, &format!("{p}.mlp.gate_proj"), c.intermediate_size, h, false)?,
                    up: Proj::load(ck, &format!("{p}.mlp.up_proj"), c.intermediate_size, h, false)?,
                    down: Proj::load(ck, &format!("{p}.mlp.down_proj"), h, c.intermediate_size, false)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = ck.get("model.embed_tokens.weight", &[c.vocab_size, h])?;
        // Some tied checkpoints still ship lm_head.weight; prefer it when present.
        let lm_head = if ck.contains("lm_head.weight") || !c.tie_word_embeddings {
            ck.get("lm_head.weight", &[c.vocab_size, h])?
        } else {
            embed.clone()
        };
        let rope = RopeTable::new(hd, c.rope_theta, c.rope_scaling.as_ref(), c.max_position_embeddings);
        Ok(Model { norm: ck.get_f32("model.norm.weight", h)?, config, embed, layers, lm_head, rope })
    }

    /// An empty cache for one row of this model.
    pub fn new_cache(&self) -> RowCache {
        RowCache::new(self.config.num_hidden_layers, self.config.num_key_value_heads * self.config.head_dim)
    }

    /// KV bytes one position costs.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * 4 * self.config.num_hidden_layers * self.config.num_key_value_heads * self.config.head_dim
    }

    /// The longest sequence (prompt + output) a row may reach.
    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    /// Appends every row's tokens at its own logical positions `[len, len + t)` and
    /// returns the requested logits. Every value a row gets back is a function of its own
    /// prefix only: batch composition and chunking change no bit.
    pub fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>> {
        let c = &self.config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let (qd, kvd) = (nh * hd, nkv * hd);
        // token -> (row, logical position)
        let mut slots: Vec<(usize, usize)> = Vec::new();
        for (r, row) in rows.iter().enumerate() {
            let start = row.cache.len();
            if start + row.tokens.len() > self.max_positions() {
                return Err(Error::Request {
                    request: format!("row {r}"),
                    msg: format!(
                        "{} positions exceed the model's context of {}",
                        start + row.tokens.len(),
                        self.max_positions()
                    ),
                });
            }
            if let Some(&bad) = row.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(Error::Request {
                    request: format!("row {r}"),
                    msg: format!("token id {bad} is outside the vocabulary of {}", c.vocab_size),
                });
            }
            slots.extend((0..row.tokens.len()).map(|i| (r, start + i)));
        }
        let m = slots.len();
        let mut x = vec![0.0f32; m * h];
        let tokens = rows.iter().flat_map(|r| r.tokens.iter());
        for (xr, &t) in x.chunks_mut(h).zip(tokens) {
            self.embed.row_f32(t as usize, xr);
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut normed = vec![0.0f32; m * h];
        let mut attn = vec![0.0f32; m * qd];
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.input_norm, c.rms_norm_eps, &mut normed);
            let mut q = layer.q.forward(&normed, m);
            let mut k = layer.k.forward(&normed, m);
            let v = layer.v.forward(&normed, m);
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                rms_norm_inplace(&mut q, qn, c.rms_norm_eps);
                rms_norm_inplace(&mut k, kn, c.rms_norm_eps);
            }
            for (i, &(_, pos)) in slots.iter().enumerate() {
                self.rope.apply(&mut q[i * qd..(i + 1) * qd], pos);
                self.rope.apply(&mut k[i * kvd..(i + 1) * kvd], pos);
            }
            let mut off = 0;
            for row in rows.iter_mut() {
                let t = row.tokens.len();
                row.cache.append(li, &k[off * kvd..(off + t) * kvd], &v[off * kvd..(off + t) * kvd]);
                off += t;
            }
            let caches: Vec<&RowCache> = rows.iter().map(|r| &*r.cache).collect();
            attn.par_chunks_mut(qd).zip(q.par_chunks(qd)).enumerate().for_each(|(i, (out, qt))| {
                let (r, pos) = slots[i];
                let (ks, vs) = caches[r].layer(li);
                for head in 0..nh {
                    let kv_off = (head / (nh / nkv)) * hd;
                    let o = &mut out[head * hd..(head + 1) * hd];
                    attend(&qt[head * hd..(head + 1) * hd], ks, vs, pos + 1, kvd, kv_off, scale, o);
                }
            });
            add(&mut x, &layer.o.forward(&attn, m));
            rms_norm(&x, &layer.post_norm, c.rms_norm_eps, &mut normed);
            let mut g = layer.gate.forward(&normed, m);
            swiglu(&mut g, &layer.up.forward(&normed, m));
            add(&mut x, &layer.down.forward(&g, m));
        }
        for row in rows.iter_mut() {
            row.cache.advance(row.tokens.len());
        }
        // Final norm and lm_head only for the tokens whose logits were asked for.
        let mut want: Vec<usize> = Vec::new();
        let mut off = 0;
        for row in rows.iter() {
            let t = row.tokens.len();
            want.extend(row.logits.wanted(t).map(|i| off + i));
            off += t;
        }
        let mut sel = vec![0.0f32; want.len() * h];
        for (dst, &i) in sel.chunks_mut(h).zip(&want) {
            rms_norm(&x[i * h..(i + 1) * h], &self.norm, c.rms_norm_eps, dst);
        }
        let vocab = c.vocab_size;
        let mut logits = vec![0.0f32; want.len() * vocab];
        linear(&sel, want.len(), &self.lm_head, None, &mut logits);
        let mut logit_rows = logits.chunks(vocab).map(|l| l.to_vec());
        let mut outs = Vec::with_capacity(rows.len());
        let mut off = 0;
        for row in rows.iter() {
            let t = row.tokens.len();
            let n = row.logits.wanted(t).len();
            outs.push(RowOutput {
                logits: logit_rows.by_ref().take(n).collect(),
                hidden: x[off * h..(off + t) * h].to_vec(),
            });
            off += t;
        }
        Ok(outs)
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
