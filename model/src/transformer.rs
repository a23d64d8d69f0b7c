//! The dense decoder shared by Llama/Mistral, Qwen2 and Qwen3:
//! `x += o(attn(rope(norm_qk(q(n(x)))), rope(norm_qk(k(n(x)))), v(n(x))))`,
//! `x += down(silu(gate(n(x))) * up(n(x)))`, logits = `lm_head(norm(x))`.
//! The three families differ only in q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3).

use std::path::Path;

use mtp_cache::{KvView, RowCache};
use rayon::prelude::*;

use crate::checkpoint::Checkpoint;
use crate::config::{Arch, Config};
use crate::error::{Error, Result};
use crate::kernels::{attend, linear, rms_norm, rms_norm_inplace, swiglu, RopeTable};
use crate::negative_control;
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

/// One decoder layer: attention and SwiGLU MLP, each pre-normed with a residual add.
pub(crate) struct Block {
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

/// Where each token of a batched forward sits: its row and logical position.
pub(crate) struct Slot {
    pub row: usize,
    pub pos: usize,
    /// Position used for RoPE: `pos`, unless a test turns on the physical-slot fault.
    pub rope_pos: usize,
}

impl Block {
    /// Loads the layer whose tensors start with `p` (e.g. `model.layers.3`).
    pub(crate) fn load(ck: &Checkpoint, p: &str, c: &Config) -> Result<Block> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qd, kvd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let qk_norm = c.arch == Arch::Qwen3;
        let a = format!("{p}.self_attn");
        Ok(Block {
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
    }

    /// Runs the layer over `x` (one `hidden_size` row per slot), writing each row's new
    /// K/V into layer `li` of its cache window and attending over its own logical prefix.
    pub(crate) fn forward(
        &self,
        c: &Config,
        rope: &RopeTable,
        x: &mut [f32],
        slots: &[Slot],
        caches: &mut [&mut RowCache],
        li: usize,
    ) {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let m = slots.len();
        let mut normed = vec![0.0f32; m * h];
        rms_norm(x, &self.input_norm, c.rms_norm_eps, &mut normed);
        let mut q = self.q.forward(&normed, m);
        let mut k = self.k.forward(&normed, m);
        let v = self.v.forward(&normed, m);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            rms_norm_inplace(&mut q, qn, c.rms_norm_eps);
            rms_norm_inplace(&mut k, kn, c.rms_norm_eps);
        }
        for (i, s) in slots.iter().enumerate() {
            rope.apply(&mut q[i * qd..(i + 1) * qd], s.rope_pos);
            rope.apply(&mut k[i * kvd..(i + 1) * kvd], s.rope_pos);
        }
        let mut off = 0;
        for (r, cache) in caches.iter_mut().enumerate() {
            let t = slots[off..].iter().take_while(|s| s.row == r).count();
            cache.write_window(li, &k[off * kvd..(off + t) * kvd], &v[off * kvd..(off + t) * kvd]);
            off += t;
        }
        let views: Vec<KvView> = caches.iter().map(|c| c.view(li)).collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let mut attn = vec![0.0f32; m * qd];
        // One task per (token, head): a single decode token still uses every core.
        attn.par_chunks_mut(hd).zip(q.par_chunks(hd)).enumerate().for_each(|(i, (o, qh))| {
            let (s, head) = (&slots[i / nh], i % nh);
            attend(qh, &views[s.row], s.pos + 1, (head / (nh / nkv)) * hd, scale, o);
        });
        add(x, &self.o.forward(&attn, m));
        rms_norm(x, &self.post_norm, c.rms_norm_eps, &mut normed);
        let mut g = self.gate.forward(&normed, m);
        swiglu(&mut g, &self.up.forward(&normed, m));
        add(x, &self.down.forward(&g, m));
    }
}

/// Token slots of a batched forward over rows of `t` new tokens each, at logical
/// positions `[len, len + t)` of their caches. Refuses a row that would pass `context`.
pub(crate) fn slots_for(rows: &[(&RowCache, usize)], context: usize) -> Result<Vec<Slot>> {
    let physical = negative_control::physical_rope();
    let mut slots = Vec::new();
    for (r, &(cache, t)) in rows.iter().enumerate() {
        let (start, base) = (cache.len(), cache.window_base());
        if start + t > context || base + t > context {
            return Err(Error::Request {
                request: format!("row {r}"),
                msg: format!("{} positions exceed the model's context of {context}", start + t),
            });
        }
        slots.extend((0..t).map(|i| Slot {
            row: r,
            pos: start + i,
            rope_pos: if physical { base + i } else { start + i },
        }));
    }
    Ok(slots)
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
    /// The last layer's output after the final norm, one `hidden_size` row per input
    /// token: the hidden state MTP heads read.
    pub hidden: Vec<f32>,
}

pub struct Model {
    pub config: Config,
    embed: Weight,
    layers: Vec<Block>,
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
        let h = c.hidden_size;
        let layers = (0..c.num_hidden_layers)
            .map(|i| Block::load(ck, &format!("model.layers.{i}"), c))
            .collect::<Result<Vec<_>>>()?;
        let embed = ck.get("model.embed_tokens.weight", &[c.vocab_size, h])?;
        // Some tied checkpoints still ship lm_head.weight; prefer it when present.
        let lm_head = if ck.contains("lm_head.weight") || !c.tie_word_embeddings {
            ck.get("lm_head.weight", &[c.vocab_size, h])?
        } else {
            embed.clone()
        };
        let rope =
            RopeTable::new(c.head_dim, c.rope_theta, c.rope_scaling.as_ref(), c.max_position_embeddings);
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

    /// Runs every row's tokens at its own logical positions `[len, len + t)` and returns
    /// the requested logits and the final-normed hidden state of every token. The new
    /// K/V are left in each row's open window (at the slot the caller chose with
    /// `RowCache::begin_window`, the row's tail by default); the caller commits what it
    /// keeps with `RowCache::commit_window`. Every value a row gets back is a function of
    /// its own prefix only: batch composition and chunking change no bit.
    pub fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>> {
        let c = &self.config;
        let h = c.hidden_size;
        let sizes: Vec<(&RowCache, usize)> = rows.iter().map(|r| (&*r.cache, r.tokens.len())).collect();
        let slots = slots_for(&sizes, self.max_positions())?;
        for (r, row) in rows.iter().enumerate() {
            if let Some(&bad) = row.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(Error::Request {
                    request: format!("row {r}"),
                    msg: format!("token id {bad} is outside the vocabulary of {}", c.vocab_size),
                });
            }
        }
        let m = slots.len();
        let mut x = vec![0.0f32; m * h];
        let tokens = rows.iter().flat_map(|r| r.tokens.iter());
        for (xr, &t) in x.chunks_mut(h).zip(tokens) {
            self.embed.row_f32(t as usize, xr);
        }
        let mut caches: Vec<&mut RowCache> = rows.iter_mut().map(|r| &mut *r.cache).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            layer.forward(c, &self.rope, &mut x, &slots, &mut caches, li);
        }
        drop(caches);
        let mut normed = vec![0.0f32; m * h];
        rms_norm(&x, &self.norm, c.rms_norm_eps, &mut normed);
        // lm_head only for the tokens whose logits were asked for.
        let mut want: Vec<usize> = Vec::new();
        let mut off = 0;
        for row in rows.iter() {
            let t = row.tokens.len();
            want.extend(row.logits.wanted(t).map(|i| off + i));
            off += t;
        }
        let sel: Vec<f32> = want.iter().flat_map(|&i| normed[i * h..(i + 1) * h].iter().copied()).collect();
        let logits = self.head_logits(&sel, want.len());
        let vocab = c.vocab_size;
        let mut logit_rows = logits.chunks(vocab).map(|l| l.to_vec());
        let mut outs = Vec::with_capacity(rows.len());
        let mut off = 0;
        for row in rows.iter() {
            let t = row.tokens.len();
            let n = row.logits.wanted(t).len();
            outs.push(RowOutput {
                logits: logit_rows.by_ref().take(n).collect(),
                hidden: normed[off * h..(off + t) * h].to_vec(),
            });
            off += t;
        }
        Ok(outs)
    }

    /// Logits of `m` final-normed hidden rows through the LM head.
    pub fn head_logits(&self, normed: &[f32], m: usize) -> Vec<f32> {
        let mut logits = vec![0.0f32; m * self.config.vocab_size];
        linear(normed, m, &self.lm_head, None, &mut logits);
        logits
    }

    /// The embedding row of `token`, widened to f32.
    pub fn embed(&self, token: u32, out: &mut [f32]) {
        self.embed.row_f32(token as usize, out);
    }

    pub(crate) fn rope(&self) -> &RopeTable {
        &self.rope
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
