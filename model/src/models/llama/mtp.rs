//! The MTP head's module on backend `B` (the layouts: `crate::mtp`): the target's dense
//! layer plus the input norms and projection, sharing the target's embedding, LM head and
//! RoPE table.

use std::sync::Arc;

use mtp_base::config::Config;
use mtp_base::error::{Error, Result};
use mtp_base::Checkpoint;
use mtp_cache::RowCache;
use mtp_kernels::{Kernels, KvDtype, Out};

use super::{Block, Decoder};
use crate::forward::{check_tokens, slots_for, LmHead};
use crate::mtp::{MtpInput, MtpLayout, MtpNet, MtpOutput};
use crate::tensor_parallel::{embed_tokens, Shard};

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
    /// The target's rank, when it is split between ranks.
    shard: Option<Arc<Shard<B>>>,
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
        // DeepSeek-V3 heads may carry their own embedding and LM head (on a tensor-parallel
        // rank, its vocabulary rows of the head, as the target's).
        let own = |name: String, shared: &Arc<B::Mat>, embedding: bool| -> Result<Arc<B::Mat>> {
            if layout == MtpLayout::DeepSeek && ck.contains(&name) {
                let w = ck.get(&name, &[tc.vocab_size, h])?;
                let w = match (&target.shard, embedding) {
                    (None, _) => w,
                    (Some(s), true) => s.embedding_rows(&w, &name)?,
                    (Some(s), false) => s.vocab_rows(&w, &name)?,
                };
                Ok(Arc::new(be.matrix(&w)?))
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
            block: Block::load(be, ck, p, &target.whole_config, target.shard.clone())?,
            embed: own(format!("{p}.embed_tokens.weight"), &target.embed, true)?,
            head: own(format!("{p}.shared_head.head.weight"), &target.lm_head, false)?,
            shard: target.shard.clone(),
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
        // On a rank, its target's embedding rows (or its own DeepSeek-V3 ones).
        let e = embed_tokens(be, self.shard.as_deref(), &self.embed, &tokens, c.vocab_size, h)?;
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
        LmHead { w: &*self.head, shard: self.shard.as_deref() }.logits(
            be,
            &normed,
            n,
            c.vocab_size,
            &mut logits,
        )?;
        let (logits, lasts) = (be.download(logits)?, be.download(lasts)?);
        Ok(logits
            .chunks(c.vocab_size)
            .zip(lasts.chunks(h))
            .map(|(l, x)| MtpOutput { logits: l.to_vec(), hidden: x.to_vec() })
            .collect())
    }
}
