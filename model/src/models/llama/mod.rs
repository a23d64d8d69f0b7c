//! The dense decoder shared by Llama/Mistral, Qwen2 and Qwen3:
//! `x += o(attn(rope(norm_qk(q(n(x)))), rope(norm_qk(k(n(x)))), v(n(x))))`,
//! `x += down(silu(gate(n(x))) * up(n(x)))`, logits = `lm_head(norm(x))`.
//! The three families differ only in q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3).
//! Written once over [`Kernels`]: every backend runs this forward. Its MTP head ([`mtp`])
//! is one more of these layers; an EAGLE-3 head's ([`eagle3`]) is one whose q/k/v read two
//! normed inputs side by side. Rows may ask for the residual stream entering chosen layers
//! ([`Hidden::Taps`]); such a forward runs launched, never as a recorded replay.

mod eagle3;
mod mtp;

use std::sync::{Arc, Mutex};

use mtp_base::config::{Arch, Config};
use mtp_base::error::{Error, Result};
use mtp_base::Checkpoint;
use mtp_cache::RowCache;
use mtp_kernels::ops::RopeTable;
use mtp_kernels::{
    negative_control, summaries_from, Activations, Backend, Heads, Kernels, KvDtype, Out, Plane,
    SUMMARY_VALUES,
};

use crate::eagle3::{Eagle3Net, Eagle3Spec};
use crate::forward::{
    check_tokens, head_outputs, padding_rows, row_outputs, slots_for, wanted_tokens, Head, Hidden, LmHead,
    Net, Proj, RowInput, RowOutput,
};
use crate::mtp::{MtpLayout, MtpNet};
use crate::tensor_parallel::{check_split, Shard};

/// Loads a Llama, Mistral, Qwen2 or Qwen3 checkpoint's decoder onto `be`.
pub(crate) fn load<B: Kernels>(
    be: Arc<B>,
    config: Config,
    ck: &Checkpoint,
    kv: KvDtype,
) -> Result<Box<dyn Net>> {
    Ok(Box::new(Decoder::load(be, config, ck, kv, None)?))
}

/// Loads rank `shard.rank` of the decoder split between `shard.ranks` ranks (see
/// `crate::tensor_parallel`): its heads, MLP columns and vocabulary rows.
pub(crate) fn load_rank<B: Kernels>(
    be: Arc<B>,
    config: Config,
    ck: &Checkpoint,
    kv: KvDtype,
    shard: Shard<B>,
) -> Result<Box<dyn Net>> {
    let c = &config;
    check_split(
        shard.ranks,
        &[
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", c.num_key_value_heads),
            ("intermediate_size", c.intermediate_size),
            ("vocab_size", c.vocab_size),
        ],
    )?;
    Ok(Box::new(Decoder::load(be, config, ck, kv, Some(Arc::new(shard)))?))
}

/// A layer's intermediate activations for `m` tokens, allocated once a forward and reused
/// by every layer (each is written whole before it is read): 7 allocations a forward, not
/// 7 a layer, and on the GPU no memory nodes between a recorded forward's kernels.
pub(crate) struct Scratch<B: Kernels> {
    normed: B::Act,
    q: B::Act,
    k: B::Act,
    v: B::Act,
    attn: B::Act,
    gate: B::Act,
    up: B::Act,
    /// A tensor-parallel rank's partial sum of o or down (`m x hidden`), and every rank's
    /// (`ranks x m x hidden`).
    part: Option<(B::Act, B::Act)>,
}

/// One decoder layer: attention and SwiGLU MLP, each pre-normed with a residual add.
pub(crate) struct Block<B: Kernels> {
    input_norm: B::Vec,
    post_norm: B::Vec,
    q: Proj<B>,
    k: Proj<B>,
    v: Proj<B>,
    o: Proj<B>,
    qk_norm: Option<(B::Vec, B::Vec)>,
    gate: Proj<B>,
    up: Proj<B>,
    down: Proj<B>,
    /// The rank this layer's slice belongs to, when split between ranks.
    shard: Option<Arc<Shard<B>>>,
}

impl<B: Kernels> Block<B> {
    /// Loads the layer whose tensors start with `p` (e.g. `model.layers.3`) of a model
    /// shaped `c`, whole or (`shard`) the slice one rank holds.
    pub(crate) fn load(
        be: &B,
        ck: &Checkpoint,
        p: &str,
        c: &Config,
        shard: Option<Arc<Shard<B>>>,
    ) -> Result<Block<B>> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qd, kvd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        // A rank's output rows of `n` (heads whole: `n` is a multiple of head_dim x ranks),
        // or its input columns.
        let rows = |n: usize| Shard::rows_cut(shard.as_deref(), n);
        let cols = |n: usize| Shard::cols_cut(shard.as_deref(), n);
        let i = c.intermediate_size;
        let a = format!("{p}.self_attn");
        let norm = |name: String, n: usize| -> Result<B::Vec> { be.vector(&ck.get_f32(&name, n)?) };
        let qk_norm = if c.arch == Arch::Qwen3 {
            Some((norm(format!("{a}.q_norm.weight"), hd)?, norm(format!("{a}.k_norm.weight"), hd)?))
        } else {
            None
        };
        Ok(Block {
            input_norm: norm(format!("{p}.input_layernorm.weight"), h)?,
            post_norm: norm(format!("{p}.post_attention_layernorm.weight"), h)?,
            q: Proj::load_cut(be, ck, &format!("{a}.q_proj"), qd, h, c.qkv_bias, rows(qd))?,
            k: Proj::load_cut(be, ck, &format!("{a}.k_proj"), kvd, h, c.qkv_bias, rows(kvd))?,
            v: Proj::load_cut(be, ck, &format!("{a}.v_proj"), kvd, h, c.qkv_bias, rows(kvd))?,
            o: Proj::load_cut(be, ck, &format!("{a}.o_proj"), h, qd, c.o_bias, cols(qd))?,
            qk_norm,
            gate: Proj::load_cut(be, ck, &format!("{p}.mlp.gate_proj"), i, h, false, rows(i))?,
            up: Proj::load_cut(be, ck, &format!("{p}.mlp.up_proj"), i, h, false, rows(i))?,
            down: Proj::load_cut(be, ck, &format!("{p}.mlp.down_proj"), h, i, false, cols(i))?,
            shard,
        })
    }

    /// Activations for this layer (and every layer of its shape) over `m` tokens.
    pub(crate) fn scratch(&self, be: &B, c: &Config, m: usize) -> Result<Scratch<B>> {
        Ok(Scratch {
            normed: be.alloc(m * c.hidden_size)?,
            q: be.alloc(m * self.q.out)?,
            k: be.alloc(m * self.k.out)?,
            v: be.alloc(m * self.v.out)?,
            attn: be.alloc(m * self.q.out)?,
            gate: be.alloc(m * self.gate.out)?,
            up: be.alloc(m * self.up.out)?,
            part: match &self.shard {
                Some(s) => Some((be.alloc(m * c.hidden_size)?, be.alloc(s.ranks * m * c.hidden_size)?)),
                None => None,
            },
        })
    }

    /// Runs the layer over `x` (`m` tokens of `hidden_size`), writing each row's new K/V
    /// into layer `li` of its cache window and attending over its own logical prefix;
    /// `s` from [`Block::scratch`] for `m` tokens.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        be: &B,
        c: &Config,
        rope: &B::Rope,
        x: &mut B::Act,
        m: usize,
        batch: &B::Batch,
        caches: &mut [&mut RowCache],
        li: usize,
        s: &mut Scratch<B>,
    ) -> Result<()> {
        let h = c.hidden_size;
        let hd = c.head_dim;
        let heads = Heads { heads: self.q.out / hd, kv_heads: self.k.out / hd, head_dim: hd };
        let Scratch { normed, q, k, v, attn, gate, up, part } = s;
        be.rms_norm(x, &self.input_norm, c.rms_norm_eps, normed, h, 0)?;
        let qkv = [self.q.part(), self.k.part(), self.v.part()];
        be.linear_parts(normed, m, &qkv, &mut [q, k, v])?;
        let norms = self.qk_norm.as_ref().map(|(qn, kn)| (qn, kn, c.rms_norm_eps));
        be.qk_rope_store(q, Some((k, v)), norms, rope, batch, caches, Plane::Main(li), heads)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        be.attention(q, batch, caches, Plane::Main(li), heads, scale, None, attn)?;
        self.residual(be, &self.o, attn, m, x, part)?;
        be.rms_norm(x, &self.post_norm, c.rms_norm_eps, normed, h, 0)?;
        be.linear_swiglu(normed, m, self.gate.part(), self.up.part(), gate, up)?;
        self.residual(be, &self.down, gate, m, x, part)
    }

    /// `x += proj(y)`; on a tensor-parallel rank, `proj(y)` is this rank's partial sum and
    /// every rank's are added in rank order.
    fn residual(
        &self,
        be: &B,
        proj: &Proj<B>,
        y: &B::Act,
        m: usize,
        x: &mut B::Act,
        part: &mut Option<(B::Act, B::Act)>,
    ) -> Result<()> {
        match (&self.shard, part) {
            (Some(shard), Some((part, gathered))) => {
                let (w, bias) = proj.part();
                be.linear(y, m, w, bias, part, Out::Write)?;
                shard.reduce(be, part, gathered, x, m)
            }
            _ => proj.add_to(be, y, m, x),
        }
    }
}

/// The weights of one model on one backend; the MTP head shares the embedding, the LM
/// head and the RoPE table.
pub(crate) struct Decoder<B: Kernels> {
    pub(crate) be: Arc<B>,
    pub(crate) config: Config,
    pub(crate) embed: Arc<B::Mat>,
    layers: Vec<Block<B>>,
    norm: B::Vec,
    pub(crate) lm_head: Arc<B::Mat>,
    pub(crate) rope: Arc<B::Rope>,
    pub(crate) max_positions: usize,
    /// How this model's K/V are stored (resolved, never `Auto`).
    pub(crate) kv: KvDtype,
    /// How the matmuls take activations (resolved for this checkpoint's weights).
    activations: Activations,
    /// Decode and verify forwards recorded by the backend (CUDA graphs), one per shape.
    recordings: B::Recordings,
    /// This rank, when the model is split between ranks (its `config` is then the
    /// rank's: its heads and MLP columns; `whole_config` the checkpoint's).
    pub(crate) shard: Option<Arc<Shard<B>>>,
    pub(crate) whole_config: Config,
    /// The padding rows of recorded forwards ([`Kernels::recorded_shape`]): their windows
    /// reopen at position 0 each forward and are never committed.
    pad_rows: Mutex<Vec<RowCache>>,
}

impl<B: Kernels> Decoder<B> {
    pub(crate) fn load(
        be: Arc<B>,
        mut config: Config,
        ck: &Checkpoint,
        kv: KvDtype,
        shard: Option<Arc<Shard<B>>>,
    ) -> Result<Decoder<B>> {
        let c = &config;
        let h = c.hidden_size;
        let layers = (0..c.num_hidden_layers)
            .map(|i| Block::load(&*be, ck, &format!("model.layers.{i}"), c, shard.clone()))
            .collect::<Result<Vec<_>>>()?;
        let embed_w = ck.get("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let kv = be.kv_dtype(kv, embed_w.dtype)?;
        if kv == KvDtype::Q4 && c.head_dim % 2 == 1 {
            return Err(Error::Backend(format!(
                "4-bit K/V packs two values a byte: head_dim {} is odd",
                c.head_dim
            )));
        }
        let be_activations = be.activations_for(&embed_w);
        let embed = match &shard {
            None => Arc::new(be.matrix(&embed_w)?),
            Some(s) => Arc::new(be.matrix(&s.embedding_rows(&embed_w, "model.embed_tokens.weight")?)?),
        };
        let lm_head_w = if c.tie_word_embeddings {
            crate::forward::ignore_tied_head(ck, "lm_head.weight");
            None
        } else {
            Some(ck.get("lm_head.weight", &[c.vocab_size, h])?)
        };
        let lm_head = match (&shard, lm_head_w) {
            (None, Some(w)) => Arc::new(be.matrix(&w)?),
            (None, None) => embed.clone(),
            (Some(s), w) => Arc::new(be.matrix(&s.vocab_rows(w.as_ref().unwrap_or(&embed_w), "lm_head")?)?),
        };
        let table =
            RopeTable::new(c.head_dim, c.rope_theta, c.rope_scaling.as_ref(), c.max_position_embeddings);
        let max_positions = table.max_positions();
        let whole_config = config.clone();
        if let Some(s) = &shard {
            config.num_attention_heads /= s.ranks;
            config.num_key_value_heads /= s.ranks;
            config.intermediate_size /= s.ranks;
        }
        // Every layer attends with this rank's heads.
        let heads = Heads {
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        };
        let recordings = be.recordings(heads);
        Ok(Decoder {
            norm: be.vector(&ck.get_f32("model.norm.weight", h)?)?,
            rope: Arc::new(be.rope_table(table)?),
            be,
            config,
            embed,
            layers,
            lm_head,
            max_positions,
            kv,
            activations: be_activations,
            recordings,
            shard,
            whole_config,
            pad_rows: Mutex::new(Vec::new()),
        })
    }

    fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>> {
        let (be, c) = (&*self.be, &self.config);
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        check_tokens(rows.iter().map(|r| r.tokens), vocab, "row")?;
        let kind = Hidden::of_rows(rows)?;
        let taps: Vec<usize> = match kind {
            Hidden::Taps(t) => t.layers().collect(),
            _ => Vec::new(),
        };
        if let Some(&bad) = taps.iter().find(|&&l| l >= self.layers.len()) {
            return Err(Error::Request {
                request: "forward".into(),
                msg: format!("tapped layer {bad} is past the model's {} layers", self.layers.len()),
            });
        }
        let real = rows.iter().map(|r| r.tokens.len()).sum::<usize>();
        // A tapping forward copies states out between layers: it runs launched, so that
        // no recording (CUDA graph) needs those copies.
        let every_logit = wanted_tokens(rows).len() == real && taps.is_empty();
        // A forward the backend may record runs in the shape it records (padding rows of
        // token 0 added), so that few recordings serve every batch.
        let pads = match real > 0 && every_logit {
            true => padding_rows(be.recorded_shape(real, rows.len()), real, rows.len())?,
            false => Vec::new(),
        };
        // Locked only where padding runs (CUDA's recorded forwards, one thread a GPU), so
        // other backends' forwards of one model never wait on each other.
        let mut held = (!pads.is_empty()).then(|| self.pad_rows.lock().unwrap_or_else(|e| e.into_inner()));
        let pad_rows: &mut [RowCache] = match held.as_mut() {
            Some(held) => {
                while held.len() < pads.len() {
                    held.push(self.new_cache());
                }
                &mut held[..pads.len()]
            }
            None => &mut [],
        };
        // The batch's own rows, then the padding's (before them under the negative control).
        let first = negative_control::pad_rows_first();
        fn in_order<T>(first: bool, own: Vec<T>, padding: Vec<T>) -> Vec<T> {
            if first { [padding, own] } else { [own, padding] }.into_iter().flatten().collect()
        }
        let sizes: Vec<(&RowCache, usize)> = in_order(
            first,
            rows.iter().map(|r| (&*r.cache, r.tokens.len())).collect(),
            pad_rows.iter().zip(pads.iter().copied()).collect(),
        );
        let slots = slots_for(&sizes, self.max_positions)?;
        let m = slots.len();
        let mut tokens: Vec<u32> =
            in_order(first, rows.iter().flat_map(|r| r.tokens.iter().copied()).collect(), vec![0; m - real]);
        if let Some(s) = &self.shard {
            // The batch's token ids are only the embedding's: a rank's rows of it.
            tokens = s.local_tokens(&tokens, vocab);
        }
        // The hidden states, the summaries and the logits: how many of each come back to
        // the host (the batch's own tokens', never the padding's).
        let fetch = [
            if kind == Hidden::Final { real * h } else { 0 },
            SUMMARY_VALUES * real,
            if rows.iter().any(|r| r.full_logits) { real * vocab } else { 0 },
        ];
        let mut caches: Vec<&mut RowCache> =
            in_order(first, rows.iter_mut().map(|r| &mut *r.cache).collect(), pad_rows.iter_mut().collect());
        let batch = be.batch(&slots, &tokens, &mut caches)?;
        let lm_head = LmHead { w: &*self.lm_head, shard: self.shard.as_deref() };
        // Each tap's copy of the residual stream (`m x h`), in the taps' order.
        let mut tapped: Vec<Vec<f32>> = vec![Vec::new(); taps.len()];
        let every_row: Vec<usize> = if taps.is_empty() { Vec::new() } else { (0..m).collect() };
        // The embedding, the layers and the final norm, into `normed`.
        let mut hidden_states = |batch: &B::Batch, normed: &mut B::Act| -> Result<()> {
            let mut x = be.alloc(m * h)?;
            be.embed_batch(&self.embed, batch, &mut x)?;
            if let Some(s) = &self.shard {
                x = s.sum(be, &x, m, h)?;
            }
            if let Some(first) = self.layers.first() {
                // Every layer has the first's shape.
                let mut s = first.scratch(be, c, m)?;
                for (li, layer) in self.layers.iter().enumerate() {
                    for (j, _) in taps.iter().enumerate().filter(|&(_, &l)| l == li) {
                        tapped[j] = be.download(be.gather(&x, h, &every_row)?)?;
                    }
                    layer.forward(be, c, &self.rope, &mut x, m, batch, &mut caches, li, &mut s)?;
                }
            }
            be.rms_norm(&x, &self.norm, c.rms_norm_eps, normed, h, 0)
        };
        if m > 0 && every_logit {
            // Decode and verify: with the LM head over every token, the whole forward's
            // launches follow the batch's shape, so the backend may record and replay it.
            // The logits come back only when some row wants them whole, the hidden states
            // when some row wants them.
            let lens = [m * h, SUMMARY_VALUES * m, m * vocab];
            let outs = be.run_recorded(&self.recordings, batch, &lens, &fetch, &mut |batch, outs| {
                let [normed, summaries, logits] = outs else {
                    return Err(Error::Backend("a recorded forward got the wrong outputs".into()));
                };
                hidden_states(batch, normed)?;
                lm_head.logits(be, normed, m, vocab, logits)?;
                be.logit_summaries(logits, m, vocab, summaries)
            })?;
            drop(caches);
            let [hidden, summaries, logits]: [Vec<f32>; 3] =
                outs.try_into().map_err(|_| Error::Backend("a recorded forward lost its outputs".into()))?;
            let head = Head { summaries: summaries_from(&summaries), logits };
            return Ok(row_outputs(rows, &head, &hidden, vocab, h));
        }
        let mut normed = be.alloc(m * h)?;
        hidden_states(&batch, &mut normed)?;
        drop(caches);
        // Token by token, each tap's state beside the others'.
        let tapped = (!taps.is_empty()).then(|| {
            let mut out = Vec::with_capacity(m * h * taps.len());
            for t in 0..m {
                for tap in &tapped {
                    out.extend_from_slice(&tap[t * h..(t + 1) * h]);
                }
            }
            out
        });
        head_outputs(be, rows, normed, lm_head, vocab, h, None, tapped)
    }
}

impl<B: Kernels> Net for Decoder<B> {
    fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>> {
        Decoder::forward(self, rows)
    }

    fn new_cache(&self) -> RowCache {
        let c = &self.config;
        let stride = c.num_key_value_heads * c.head_dim;
        let store = self.be.kv_store(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.kv);
        RowCache::with_store(store, c.num_hidden_layers, stride)
    }

    fn kv_bytes_per_token(&self) -> usize {
        let c = &self.config;
        2 * c.num_hidden_layers * self.kv.slot_bytes(c.num_key_value_heads, c.head_dim)
    }

    fn backend(&self) -> Backend {
        self.be.backend()
    }

    fn device_memory(&self) -> Option<(usize, usize)> {
        self.be.device_memory()
    }

    fn kv_dtype(&self) -> KvDtype {
        self.kv
    }

    fn activations(&self) -> Activations {
        self.activations
    }

    fn verify_token_group(&self) -> usize {
        self.be.token_group()
    }

    fn verify_token_cost(&self) -> f64 {
        self.be.verify_token_cost()
    }

    fn one_time_forwards(&self) -> u64 {
        self.be.one_time_forwards(&self.recordings)
    }

    fn max_positions(&self) -> usize {
        self.max_positions
    }

    fn load_mtp(&self, ck: &Checkpoint, layout: MtpLayout, prefix: &str) -> Result<Box<dyn MtpNet>> {
        Ok(Box::new(mtp::MtpBlock::load(self, ck, layout, prefix)?))
    }

    fn load_eagle3(&self, ck: &Checkpoint, spec: &Eagle3Spec) -> Result<Box<dyn Eagle3Net>> {
        Ok(Box::new(eagle3::Eagle3Block::load(self, ck, spec)?))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
