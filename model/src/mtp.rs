//! Multi-token-prediction head (DeepSeek-V3 / MiMo style):
//! `h' = Block(Proj([Norm(embed(next_token)); Norm(h)]))`, `logits = head(FinalNorm(h'))`.
//!
//! `h` is the target's final-normed hidden state at position `i` and `next_token` the
//! token at `i + 1`; the output predicts the token at `i + 2`. For more than one draft
//! the head runs again on its own output `h'` (before the final norm) and its own draft.
//! The block is a decoder layer of the target's architecture with its own per-row cache.
//!
//! Two weight layouts, detected from the tensor names:
//! - MiMo: `model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj,
//!   final_layernorm}` plus the layer; concatenates `[hidden; embed]`; embedding and LM
//!   head are the target's.
//! - DeepSeek-V3: `model.layers.{num_hidden_layers + i}.{enorm, hnorm, eh_proj,
//!   shared_head.norm, shared_head.head}` plus the layer; concatenates `[embed; hidden]`;
//!   its own `embed_tokens` and `shared_head.head` when present, else the target's.
//!
//! Only module 0 is loaded: further modules (`num_nextn_predict_layers > 1`) are unused,
//! since drafting applies module 0 recursively.

use std::path::Path;

use mtp_cache::RowCache;

use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::kernels::{linear, rms_norm};
use crate::transformer::{slots_for, Block, Model};
use crate::weights::Weight;

/// Which naming scheme the head's tensors use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MtpLayout {
    MiMo,
    DeepSeek,
}

impl MtpLayout {
    pub fn name(self) -> &'static str {
        match self {
            MtpLayout::MiMo => "mimo",
            MtpLayout::DeepSeek => "deepseek",
        }
    }

    /// Tensor-name prefix of module `i` for a target with `n_layers` layers.
    pub fn prefix(self, n_layers: usize, i: usize) -> String {
        match self {
            MtpLayout::MiMo => format!("model.mtp_layers.{i}"),
            MtpLayout::DeepSeek => format!("model.layers.{}", n_layers + i),
        }
    }

    /// Names of (token norm, hidden norm, projection, final norm) under `prefix`.
    pub fn names(self, p: &str) -> [String; 4] {
        let n = match self {
            MtpLayout::MiMo => ["token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"],
            MtpLayout::DeepSeek => ["enorm", "hnorm", "eh_proj", "shared_head.norm"],
        };
        n.map(|s| format!("{p}.{s}.weight"))
    }
}

/// One row of an MTP forward: `t` (hidden, next token) pairs at the row's next positions.
pub struct MtpInput<'a> {
    /// `t * hidden_size` floats.
    pub hidden: &'a [f32],
    pub tokens: &'a [u32],
    pub cache: &'a mut RowCache,
}

/// What one row gets back: the prediction after its last pair.
#[derive(Debug)]
pub struct MtpOutput {
    pub logits: Vec<f32>,
    /// The block's output before the final norm: the `h` of the next recursive step.
    pub hidden: Vec<f32>,
}

pub struct MtpHead {
    pub layout: MtpLayout,
    config: Config,
    token_norm: Vec<f32>,
    hidden_norm: Vec<f32>,
    proj: Weight,
    final_norm: Vec<f32>,
    block: Block,
    embed: Option<Weight>,
    head: Option<Weight>,
}

impl MtpHead {
    /// Loads module 0 from `dir` (a separate MTP checkpoint, or the target's own
    /// directory when the weights ship inside it), shaped like `target`.
    pub fn load(dir: &Path, target: &Model) -> Result<MtpHead> {
        let cfg_path = dir.join("config.json");
        let raw = crate::config::read_json(&cfg_path)?;
        let tc = &target.config;
        let get = |key: &str| raw.get(key).and_then(|v| v.as_u64()).map(|v| v as usize);
        let n_mtp = get("num_nextn_predict_layers").unwrap_or(0);
        if n_mtp == 0 {
            return Err(Error::config(
                &cfg_path,
                "num_nextn_predict_layers",
                "missing or 0: this checkpoint declares no MTP head",
            ));
        }
        for (key, want) in [("hidden_size", tc.hidden_size), ("vocab_size", tc.vocab_size)] {
            if let Some(have) = get(key) {
                if have != want {
                    return Err(Error::config(
                        &cfg_path,
                        key,
                        format!("{have} differs from the target's {want}"),
                    ));
                }
            }
        }
        let n_layers = get("num_hidden_layers").unwrap_or(tc.num_hidden_layers);
        let ck = Checkpoint::open(dir)?;
        let layout = [MtpLayout::MiMo, MtpLayout::DeepSeek]
            .into_iter()
            .find(|l| ck.contains(&l.names(&l.prefix(n_layers, 0))[2]))
            .ok_or_else(|| Error::MissingTensor {
                dir: dir.to_path_buf(),
                name: format!(
                    "{} (MiMo) or {} (DeepSeek-V3)",
                    MtpLayout::MiMo.names(&MtpLayout::MiMo.prefix(n_layers, 0))[2],
                    MtpLayout::DeepSeek.names(&MtpLayout::DeepSeek.prefix(n_layers, 0))[2]
                ),
            })?;
        if n_mtp > 1 {
            tracing::info!("{n_mtp} MTP modules in {}; drafting uses module 0 recursively", dir.display());
        }
        let p = layout.prefix(n_layers, 0);
        let [tn, hn, proj, fnorm] = layout.names(&p);
        let h = tc.hidden_size;
        let own = |name: String| -> Result<Option<Weight>> {
            if layout == MtpLayout::DeepSeek && ck.contains(&name) {
                Ok(Some(ck.get(&name, &[tc.vocab_size, h])?))
            } else {
                Ok(None)
            }
        };
        Ok(MtpHead {
            layout,
            token_norm: ck.get_f32(&tn, h)?,
            hidden_norm: ck.get_f32(&hn, h)?,
            proj: ck.get(&proj, &[h, 2 * h])?,
            final_norm: ck.get_f32(&fnorm, h)?,
            block: Block::load(&ck, &p, tc)?,
            embed: own(format!("{p}.embed_tokens.weight"))?,
            head: own(format!("{p}.shared_head.head.weight"))?,
            config: tc.clone(),
        })
    }

    /// An empty per-row cache for the head's block.
    pub fn new_cache(&self) -> RowCache {
        RowCache::new(1, self.config.num_key_value_heads * self.config.head_dim)
    }

    /// KV bytes one position costs.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * 4 * self.config.num_key_value_heads * self.config.head_dim
    }

    /// Runs every row's pairs at its next logical positions and returns the prediction
    /// after each row's last pair. Like [`Model::forward`], the new K/V stay in each
    /// row's open window for the caller to commit.
    pub fn forward(&self, target: &Model, rows: &mut [MtpInput]) -> Result<Vec<MtpOutput>> {
        let c = &self.config;
        let h = c.hidden_size;
        if let Some(r) = rows.iter().position(|r| r.tokens.is_empty() || r.hidden.len() != r.tokens.len() * h)
        {
            return Err(Error::Request {
                request: format!("mtp row {r}"),
                msg: "needs at least one (hidden, token) pair and one hidden row per token".into(),
            });
        }
        let sizes: Vec<(&RowCache, usize)> = rows.iter().map(|r| (&*r.cache, r.tokens.len())).collect();
        let slots = slots_for(&sizes, target.max_positions())?;
        let m = slots.len();
        let mut cat = vec![0.0f32; m * 2 * h];
        let mut e = vec![0.0f32; h];
        let (emb_at, hid_at) = match self.layout {
            MtpLayout::MiMo => (h, 0),
            MtpLayout::DeepSeek => (0, h),
        };
        let pairs = rows.iter().flat_map(|r| r.tokens.iter().zip(r.hidden.chunks(h)));
        for (dst, (&tok, hid)) in cat.chunks_mut(2 * h).zip(pairs) {
            if tok as usize >= c.vocab_size {
                return Err(Error::Request {
                    request: "mtp".into(),
                    msg: format!("token id {tok} is outside the vocabulary of {}", c.vocab_size),
                });
            }
            match &self.embed {
                Some(w) => w.row_f32(tok as usize, &mut e),
                None => target.embed(tok, &mut e),
            }
            rms_norm(&e, &self.token_norm, c.rms_norm_eps, &mut dst[emb_at..emb_at + h]);
            rms_norm(hid, &self.hidden_norm, c.rms_norm_eps, &mut dst[hid_at..hid_at + h]);
        }
        let mut x = vec![0.0f32; m * h];
        linear(&cat, m, &self.proj, None, &mut x);
        let mut caches: Vec<&mut RowCache> = rows.iter_mut().map(|r| &mut *r.cache).collect();
        self.block.forward(c, target.rope(), &mut x, &slots, &mut caches, 0);
        let mut outs = Vec::with_capacity(rows.len());
        let mut end = 0;
        for row in rows.iter() {
            end += row.tokens.len();
            let last = &x[(end - 1) * h..end * h];
            let mut normed = vec![0.0f32; h];
            rms_norm(last, &self.final_norm, c.rms_norm_eps, &mut normed);
            let logits = match &self.head {
                Some(w) => {
                    let mut l = vec![0.0f32; c.vocab_size];
                    linear(&normed, 1, w, None, &mut l);
                    l
                }
                None => target.head_logits(&normed, 1),
            };
            outs.push(MtpOutput { logits, hidden: last.to_vec() });
        }
        Ok(outs)
    }
}
