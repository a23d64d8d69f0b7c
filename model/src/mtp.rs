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

use std::sync::Arc;

use mtp_cache::RowCache;

use crate::backend::{Kernels, KvDtype, Out};
use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::transformer::{check_tokens, slots_for, Block, Decoder, Model};

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

/// An MTP head on its target's backend.
pub(crate) trait MtpNet: Send + Sync {
    fn forward(&self, rows: &mut [MtpInput]) -> Result<Vec<MtpOutput>>;
    fn new_cache(&self) -> RowCache;
    fn kv_bytes_per_token(&self) -> usize;
}

pub struct MtpHead {
    pub layout: MtpLayout,
    net: Box<dyn MtpNet>,
}

impl MtpHead {
    /// Loads module 0 from `dir` (a separate MTP checkpoint, or the target's own
    /// directory when the weights ship inside it), shaped like `target` and on its backend.
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
        let net = target.net().load_mtp(&ck, layout, &layout.prefix(n_layers, 0))?;
        Ok(MtpHead { layout, net })
    }

    /// An empty per-row cache for the head's block.
    pub fn new_cache(&self) -> RowCache {
        self.net.new_cache()
    }

    /// KV bytes one position costs.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.net.kv_bytes_per_token()
    }

    /// Runs every row's pairs at its next logical positions and returns the prediction
    /// after each row's last pair. Like [`Model::forward`], the new K/V stay in each
    /// row's open window for the caller to commit.
    pub fn forward(&self, rows: &mut [MtpInput]) -> Result<Vec<MtpOutput>> {
        self.net.forward(rows)
    }
}

/// Module 0's weights on backend `B`, with the target's shared parts.
pub(crate) struct MtpBlock<B: Kernels> {
    be: Arc<B>,
    config: Config,
    layout: MtpLayout,
    token_norm: B::Vec,
    hidden_norm: B::Vec,
    proj: B::Mat,
    final_norm: B::Vec,
    block: Block<B>,
    embed: Arc<B::Mat>,
    head: Arc<B::Mat>,
    rope: Arc<B::Rope>,
    max_positions: usize,
    kv: KvDtype,
}

impl<B: Kernels> MtpBlock<B> {
    pub(crate) fn load(
        target: &Decoder<B>,
        ck: &Checkpoint,
        layout: MtpLayout,
        p: &str,
    ) -> Result<MtpBlock<B>> {
        let (be, tc) = (&*target.be, &target.config);
        let [tn, hn, proj, fnorm] = layout.names(p);
        let h = tc.hidden_size;
        // DeepSeek-V3 heads may carry their own embedding and LM head.
        let own = |name: String, shared: &Arc<B::Mat>| -> Result<Arc<B::Mat>> {
            if layout == MtpLayout::DeepSeek && ck.contains(&name) {
                Ok(Arc::new(be.matrix(&ck.get(&name, &[tc.vocab_size, h])?)?))
            } else {
                Ok(shared.clone())
            }
        };
        let norm = |name: &str| -> Result<B::Vec> { be.vector(&ck.get_f32(name, h)?) };
        Ok(MtpBlock {
            be: target.be.clone(),
            layout,
            token_norm: norm(&tn)?,
            hidden_norm: norm(&hn)?,
            proj: be.matrix(&ck.get(&proj, &[h, 2 * h])?)?,
            final_norm: norm(&fnorm)?,
            block: Block::load(be, ck, p, tc)?,
            embed: own(format!("{p}.embed_tokens.weight"), &target.embed)?,
            head: own(format!("{p}.shared_head.head.weight"), &target.lm_head)?,
            rope: target.rope.clone(),
            max_positions: target.max_positions,
            kv: target.kv,
            config: tc.clone(),
        })
    }
}

impl<B: Kernels> MtpNet for MtpBlock<B> {
    fn new_cache(&self) -> RowCache {
        let stride = self.config.num_key_value_heads * self.config.head_dim;
        let (heads, hd) = (self.config.num_key_value_heads, self.config.head_dim);
        RowCache::with_store(self.be.kv_store(1, heads, hd, self.kv), 1, stride)
    }

    fn kv_bytes_per_token(&self) -> usize {
        2 * self.kv.slot_bytes(self.config.num_key_value_heads, self.config.head_dim)
    }

    fn forward(&self, rows: &mut [MtpInput]) -> Result<Vec<MtpOutput>> {
        let (be, c) = (&*self.be, &self.config);
        let h = c.hidden_size;
        if let Some(r) = rows.iter().position(|r| r.tokens.is_empty() || r.hidden.len() != r.tokens.len() * h)
        {
            return Err(Error::Request {
                request: format!("mtp row {r}"),
                msg: "needs at least one (hidden, token) pair and one hidden row per token".into(),
            });
        }
        check_tokens(rows.iter().map(|r| r.tokens), c.vocab_size, "mtp row")?;
        let sizes: Vec<(&RowCache, usize)> = rows.iter().map(|r| (&*r.cache, r.tokens.len())).collect();
        let slots = slots_for(&sizes, self.max_positions)?;
        let m = slots.len();
        let tokens: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let hidden: Vec<f32> = rows.iter().flat_map(|r| r.hidden.iter().copied()).collect();
        let (emb_at, hid_at) = match self.layout {
            MtpLayout::MiMo => (h, 0),
            MtpLayout::DeepSeek => (0, h),
        };
        let mut e = be.alloc(m * h)?;
        be.embed(&self.embed, &tokens, &mut e)?;
        let mut cat = be.alloc(m * 2 * h)?;
        be.rms_norm(&e, &self.token_norm, c.rms_norm_eps, &mut cat, 2 * h, emb_at)?;
        be.rms_norm(&be.upload(&hidden)?, &self.hidden_norm, c.rms_norm_eps, &mut cat, 2 * h, hid_at)?;
        let mut x = be.alloc(m * h)?;
        be.linear(&cat, m, &self.proj, None, &mut x, Out::Write)?;
        let mut caches: Vec<&mut RowCache> = rows.iter_mut().map(|r| &mut *r.cache).collect();
        let batch = be.batch(&slots, &tokens, &mut caches)?;
        let mut scratch = self.block.scratch(be, c, m)?;
        self.block.forward(be, c, &self.rope, &mut x, m, &batch, &mut caches, 0, &mut scratch)?;
        drop(caches);
        // Each row's last pair predicts its next token.
        let mut last = Vec::with_capacity(rows.len());
        let mut end = 0;
        for row in rows.iter() {
            end += row.tokens.len();
            last.push(end - 1);
        }
        let n = last.len();
        let lasts = be.gather(&x, h, &last)?;
        let mut normed = be.alloc(n * h)?;
        be.rms_norm(&lasts, &self.final_norm, c.rms_norm_eps, &mut normed, h, 0)?;
        let mut logits = be.alloc(n * c.vocab_size)?;
        be.linear(&normed, n, &self.head, None, &mut logits, Out::Write)?;
        let (logits, lasts) = (be.download(logits)?, be.download(lasts)?);
        Ok(logits
            .chunks(c.vocab_size)
            .zip(lasts.chunks(h))
            .map(|(l, x)| MtpOutput { logits: l.to_vec(), hidden: x.to_vec() })
            .collect())
    }
}
