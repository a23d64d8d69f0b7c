//! An EAGLE-3 head's layer on backend `B` (the math and layouts: `crate::eagle3`): `fc`,
//! one decoder layer whose q/k/v read the normed embedding beside the normed state, its
//! final norm and draft-vocabulary LM head, with its own RoPE table and one-layer cache.
//! The embedding is the head's own or the target's.

use std::sync::Arc;

use mtp_base::config::Config;
use mtp_base::error::{Error, Result};
use mtp_base::Checkpoint;
use mtp_cache::RowCache;
use mtp_kernels::ops::RopeTable;
use mtp_kernels::{Heads, Kernels, KvDtype, Out, Plane};

use super::Decoder;
use crate::eagle3::{Eagle3Feed, Eagle3Input, Eagle3Net, Eagle3Output, Eagle3Spec};
use crate::forward::{check_tokens, slots_for, Proj};

pub(crate) struct Eagle3Block<B: Kernels> {
    be: Arc<B>,
    c: Config,
    target_hidden: usize,
    taps: usize,
    norm_before_residual: bool,
    fc: Proj<B>,
    input_norm: B::Vec,
    hidden_norm: B::Vec,
    post_norm: B::Vec,
    q: Proj<B>,
    k: Proj<B>,
    v: Proj<B>,
    o: Proj<B>,
    gate: Proj<B>,
    up: Proj<B>,
    down: Proj<B>,
    norm: B::Vec,
    lm_head: B::Mat,
    embed: Arc<B::Mat>,
    rope: B::Rope,
    /// Target id of each draft id.
    to_target: Vec<u32>,
    max_positions: usize,
    kv: KvDtype,
}

/// The target id of each draft id from `d2t` offsets, refused (naming `d2t`) where one
/// leaves the vocabulary or two draft ids meet.
fn draft_to_target(ck: &Checkpoint, spec: &Eagle3Spec, vocab: usize) -> Result<Vec<u32>> {
    let dv = spec.draft_vocab;
    if !ck.contains("d2t") {
        if dv != vocab {
            return Err(Error::config(
                &spec.path,
                "draft_vocab_size",
                format!("{dv} is smaller than the vocabulary of {vocab} and the checkpoint has no d2t map"),
            ));
        }
        return Ok((0..vocab as u32).collect());
    }
    let offsets = ck.get_ids("d2t", dv)?;
    let mut seen = vec![false; vocab];
    let mut map = Vec::with_capacity(dv);
    for (d, &off) in offsets.iter().enumerate() {
        let t = (d as i64).checked_add(off).filter(|&t| t >= 0 && (t as usize) < vocab).ok_or_else(|| {
            Error::config(
                &spec.path,
                "d2t",
                format!("draft id {d} + offset {off} is outside the vocabulary of {vocab}"),
            )
        })? as usize;
        if std::mem::replace(&mut seen[t], true) {
            return Err(Error::config(&spec.path, "d2t", format!("two draft ids map to target id {t}")));
        }
        map.push(t as u32);
    }
    if let Some(shape) = ck.shape("t2d") {
        if shape != [vocab] {
            return Err(Error::config(&spec.path, "t2d", format!("shape {shape:?}, not [{vocab}]")));
        }
        // A mask of `map`'s image; nothing reads it.
        ck.mark_read("t2d");
    }
    Ok(map)
}

impl<B: Kernels> Eagle3Block<B> {
    pub(crate) fn load(target: &Decoder<B>, ck: &Checkpoint, spec: &Eagle3Spec) -> Result<Eagle3Block<B>> {
        if target.shard.is_some() {
            return Err(Error::InvalidOption(
                "EAGLE-3 heads do not draft for a target split between ranks yet (run the target whole)"
                    .into(),
            ));
        }
        let (be, c, tc) = (&*target.be, &spec.config, &target.config);
        let (h, hd, th) = (c.hidden_size, c.head_dim, tc.hidden_size);
        let (qd, kvd, i) = (c.num_attention_heads * hd, c.num_key_value_heads * hd, c.intermediate_size);
        let p = ["midlayer", "layers.0"]
            .into_iter()
            .find(|p| ck.contains(&format!("{p}.self_attn.q_proj.weight")))
            .ok_or_else(|| Error::MissingTensor {
                dir: ck.dir().to_path_buf(),
                name: "midlayer.self_attn.q_proj.weight (or layers.0.self_attn.q_proj.weight)".into(),
            })?;
        let a = format!("{p}.self_attn");
        let norm = |name: &str, n: usize| -> Result<B::Vec> { be.vector(&ck.get_f32(name, n)?) };
        let embed = if ck.contains("embed_tokens.weight") {
            Arc::new(be.matrix(&ck.get("embed_tokens.weight", &[c.vocab_size, h])?)?)
        } else if h == th {
            target.embed.clone()
        } else {
            return Err(Error::MissingTensor {
                dir: ck.dir().to_path_buf(),
                name: format!("embed_tokens.weight (hidden_size {h} differs from the target's {th}, so its embedding cannot serve)"),
            });
        };
        let table = RopeTable::new(hd, c.rope_theta, c.rope_scaling.as_ref(), target.max_positions);
        let taps = spec.taps.len();
        Ok(Eagle3Block {
            fc: Proj::load(be, ck, "fc", h, taps * th, ck.contains("fc.bias"))?,
            input_norm: norm(&format!("{p}.input_layernorm.weight"), h)?,
            hidden_norm: norm(&format!("{p}.hidden_norm.weight"), h)?,
            post_norm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            q: Proj::load(be, ck, &format!("{a}.q_proj"), qd, 2 * h, c.qkv_bias)?,
            k: Proj::load(be, ck, &format!("{a}.k_proj"), kvd, 2 * h, c.qkv_bias)?,
            v: Proj::load(be, ck, &format!("{a}.v_proj"), kvd, 2 * h, c.qkv_bias)?,
            o: Proj::load(be, ck, &format!("{a}.o_proj"), h, qd, c.o_bias)?,
            gate: Proj::load(be, ck, &format!("{p}.mlp.gate_proj"), i, h, false)?,
            up: Proj::load(be, ck, &format!("{p}.mlp.up_proj"), i, h, false)?,
            down: Proj::load(be, ck, &format!("{p}.mlp.down_proj"), h, i, false)?,
            norm: norm("norm.weight", h)?,
            lm_head: be.matrix(&ck.get("lm_head.weight", &[spec.draft_vocab, h])?)?,
            to_target: draft_to_target(ck, spec, c.vocab_size)?,
            rope: be.rope_table(table)?,
            embed,
            max_positions: target.max_positions,
            kv: target.kv,
            be: target.be.clone(),
            c: c.clone(),
            target_hidden: th,
            taps,
            norm_before_residual: spec.norm_before_residual,
        })
    }
}

impl<B: Kernels> Eagle3Net for Eagle3Block<B> {
    fn new_cache(&self) -> RowCache {
        let (heads, hd) = (self.c.num_key_value_heads, self.c.head_dim);
        RowCache::with_store(self.be.kv_store(1, heads, hd, self.kv), 1, heads * hd)
    }

    fn kv_bytes_per_token(&self) -> usize {
        2 * self.kv.slot_bytes(self.c.num_key_value_heads, self.c.head_dim)
    }

    fn forward(&self, rows: &mut [Eagle3Input], feed: Eagle3Feed) -> Result<Vec<Eagle3Output>> {
        let (be, c) = (&*self.be, &self.c);
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let width = match feed {
            Eagle3Feed::Taps => self.taps * self.target_hidden,
            Eagle3Feed::Own => h,
        };
        if let Some(r) =
            rows.iter().position(|r| r.tokens.is_empty() || r.states.len() != r.tokens.len() * width)
        {
            return Err(Error::Request {
                request: format!("eagle3 row {r}"),
                msg: format!("needs at least one (state, token) pair and {width} state floats per token"),
            });
        }
        check_tokens(rows.iter().map(|r| r.tokens), c.vocab_size, "eagle3 row")?;
        let sizes: Vec<(&RowCache, usize)> = rows.iter().map(|r| (&*r.cache, r.tokens.len())).collect();
        let slots = slots_for(&sizes, self.max_positions)?;
        let m = slots.len();
        let tokens: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let states: Vec<f32> = rows.iter().flat_map(|r| r.states.iter().copied()).collect();
        let mut x = match feed {
            Eagle3Feed::Taps => self.fc.forward(be, &be.upload(&states)?, m)?,
            Eagle3Feed::Own => be.upload(&states)?,
        };
        let mut e = be.alloc(m * h)?;
        be.embed(&self.embed, &tokens, &mut e)?;
        let mut cat = be.alloc(m * 2 * h)?;
        be.rms_norm(&e, &self.input_norm, eps, &mut cat, 2 * h, 0)?;
        be.rms_norm(&x, &self.hidden_norm, eps, &mut cat, 2 * h, h)?;
        if self.norm_before_residual {
            let mut normed = be.alloc(m * h)?;
            be.rms_norm(&x, &self.hidden_norm, eps, &mut normed, h, 0)?;
            x = normed;
        }
        let (mut q, mut k, mut v) =
            (be.alloc(m * self.q.out)?, be.alloc(m * self.k.out)?, be.alloc(m * self.v.out)?);
        be.linear_parts(
            &cat,
            m,
            &[self.q.part(), self.k.part(), self.v.part()],
            &mut [&mut q, &mut k, &mut v],
        )?;
        let mut caches: Vec<&mut RowCache> = rows.iter_mut().map(|r| &mut *r.cache).collect();
        let batch = be.batch(&slots, &tokens, &mut caches)?;
        let heads =
            Heads { heads: c.num_attention_heads, kv_heads: c.num_key_value_heads, head_dim: c.head_dim };
        be.qk_rope_store(
            &mut q,
            Some((&mut k, &v)),
            None,
            &self.rope,
            &batch,
            &mut caches,
            Plane::Main(0),
            heads,
        )?;
        let mut attn = be.alloc(m * self.q.out)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        be.attention(&q, &batch, &caches, Plane::Main(0), heads, scale, None, &mut attn)?;
        drop(caches);
        self.o.add_to(be, &attn, m, &mut x)?;
        let mut normed = be.alloc(m * h)?;
        be.rms_norm(&x, &self.post_norm, eps, &mut normed, h, 0)?;
        let (mut gate, mut up) = (be.alloc(m * self.gate.out)?, be.alloc(m * self.up.out)?);
        be.linear_swiglu(&normed, m, self.gate.part(), self.up.part(), &mut gate, &mut up)?;
        self.down.add_to(be, &gate, m, &mut x)?;
        // Each row's last pair predicts its next token.
        let last: Vec<usize> = rows
            .iter()
            .scan(0, |end, r| {
                *end += r.tokens.len();
                Some(*end - 1)
            })
            .collect();
        let n = last.len();
        let lasts = be.gather(&x, h, &last)?;
        let mut out = be.alloc(n * h)?;
        be.rms_norm(&lasts, &self.norm, eps, &mut out, h, 0)?;
        let dv = self.to_target.len();
        let mut logits = be.alloc(n * dv)?;
        be.linear(&out, n, &self.lm_head, None, &mut logits, Out::Write)?;
        let (logits, lasts) = (be.download(logits)?, be.download(lasts)?);
        Ok(logits
            .chunks(dv)
            .zip(lasts.chunks(h))
            .map(|(l, x)| {
                let mut full = vec![f32::NEG_INFINITY; c.vocab_size];
                for (&t, &z) in self.to_target.iter().zip(l) {
                    full[t as usize] = z;
                }
                Eagle3Output { logits: full, hidden: x.to_vec() }
            })
            .collect())
    }
}
