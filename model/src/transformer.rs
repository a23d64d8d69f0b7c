//! The dense decoder shared by Llama/Mistral, Qwen2 and Qwen3:
//! `x += o(attn(rope(norm_qk(q(n(x)))), rope(norm_qk(k(n(x)))), v(n(x))))`,
//! `x += down(silu(gate(n(x))) * up(n(x)))`, logits = `lm_head(norm(x))`.
//! The three families differ only in q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3).
//! Written once over [`Kernels`]: every backend runs this forward.

use std::path::Path;
use std::sync::Arc;

use mtp_cache::RowCache;

use crate::backend::{
    host_summaries, summaries_from, Backend, Heads, Kernels, KvDtype, Out, Plane, Slot, SUMMARY_VALUES,
};
use crate::checkpoint::Checkpoint;
use crate::config::{Arch, Config};
use crate::error::{Error, Result};
use crate::kernels::{LogitSummary, RopeTable};
use crate::mtp::{MtpLayout, MtpNet};
use crate::negative_control;

pub(crate) struct Proj<B: Kernels> {
    pub(crate) w: B::Mat,
    bias: Option<B::Vec>,
    pub(crate) out: usize,
}

impl<B: Kernels> Proj<B> {
    /// A projection of `out` outputs over an already loaded weight (no bias).
    pub(crate) fn from_weight(be: &B, w: &crate::weights::Weight) -> Result<Proj<B>> {
        Ok(Proj { w: be.matrix(w)?, bias: None, out: w.rows })
    }
}

impl<B: Kernels> Proj<B> {
    pub(crate) fn load(
        be: &B,
        ck: &Checkpoint,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Proj<B>> {
        let bias = if bias { Some(be.vector(&ck.get_f32(&format!("{name}.bias"), out)?)?) } else { None };
        Ok(Proj { w: be.matrix(&ck.get(&format!("{name}.weight"), &[out, inp])?)?, bias, out })
    }

    pub(crate) fn forward(&self, be: &B, x: &B::Act, m: usize) -> Result<B::Act> {
        let mut y = be.alloc(m * self.out)?;
        be.linear(x, m, &self.w, self.bias.as_ref(), &mut y, Out::Write)?;
        Ok(y)
    }

    /// The weight and bias, as [`Kernels::linear_parts`] takes them.
    pub(crate) fn part(&self) -> (&B::Mat, Option<&B::Vec>) {
        (&self.w, self.bias.as_ref())
    }

    /// `acc += self(x)`: the residual add.
    pub(crate) fn add_to(&self, be: &B, x: &B::Act, m: usize, acc: &mut B::Act) -> Result<()> {
        be.linear(x, m, &self.w, self.bias.as_ref(), acc, Out::Add)
    }
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
}

impl<B: Kernels> Block<B> {
    /// Loads the layer whose tensors start with `p` (e.g. `model.layers.3`).
    pub(crate) fn load(be: &B, ck: &Checkpoint, p: &str, c: &Config) -> Result<Block<B>> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qd, kvd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
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
            q: Proj::load(be, ck, &format!("{a}.q_proj"), qd, h, c.qkv_bias)?,
            k: Proj::load(be, ck, &format!("{a}.k_proj"), kvd, h, c.qkv_bias)?,
            v: Proj::load(be, ck, &format!("{a}.v_proj"), kvd, h, c.qkv_bias)?,
            o: Proj::load(be, ck, &format!("{a}.o_proj"), h, qd, c.o_bias)?,
            qk_norm,
            gate: Proj::load(be, ck, &format!("{p}.mlp.gate_proj"), c.intermediate_size, h, false)?,
            up: Proj::load(be, ck, &format!("{p}.mlp.up_proj"), c.intermediate_size, h, false)?,
            down: Proj::load(be, ck, &format!("{p}.mlp.down_proj"), h, c.intermediate_size, false)?,
        })
    }

    /// Activations for this layer (and every layer of its shape) over `m` tokens.
    pub(crate) fn scratch(&self, be: &B, c: &Config, m: usize) -> Result<Scratch<B>> {
        Ok(Scratch {
            normed: be.alloc(m * c.hidden_size)?,
            q: be.alloc(m * self.q.out)?,
            k: be.alloc(m * self.k.out)?,
            v: be.alloc(m * self.v.out)?,
            attn: be.alloc(m * c.num_attention_heads * c.head_dim)?,
            gate: be.alloc(m * self.gate.out)?,
            up: be.alloc(m * self.up.out)?,
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
        let heads =
            Heads { heads: c.num_attention_heads, kv_heads: c.num_key_value_heads, head_dim: c.head_dim };
        let Scratch { normed, q, k, v, attn, gate, up } = s;
        be.rms_norm(x, &self.input_norm, c.rms_norm_eps, normed, h, 0)?;
        let qkv = [self.q.part(), self.k.part(), self.v.part()];
        be.linear_parts(normed, m, &qkv, &mut [q, k, v])?;
        let norms = self.qk_norm.as_ref().map(|(qn, kn)| (qn, kn, c.rms_norm_eps));
        be.qk_rope_store(q, Some((k, v)), norms, rope, batch, caches, Plane::Main(li), heads)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        be.attention(q, batch, caches, Plane::Main(li), heads, scale, None, attn)?;
        self.o.add_to(be, attn, m, x)?;
        be.rms_norm(x, &self.post_norm, c.rms_norm_eps, normed, h, 0)?;
        be.linear_parts(normed, m, &[self.gate.part(), self.up.part()], &mut [gate, up])?;
        be.swiglu(gate, up)?;
        self.down.add_to(be, gate, m, x)
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

/// Refuses a token outside the vocabulary, naming the row.
pub(crate) fn check_tokens<'a>(
    rows: impl Iterator<Item = &'a [u32]>,
    vocab: usize,
    what: &str,
) -> Result<()> {
    for (r, tokens) in rows.enumerate() {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Request {
                request: format!("{what} {r}"),
                msg: format!("token id {bad} is outside the vocabulary of {vocab}"),
            });
        }
    }
    Ok(())
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
    /// Which tokens' logits the row wants.
    pub logits: Logits,
    /// Whether it wants those logits whole, or their [`LogitSummary`] is enough (greedy
    /// rows: the logits then stay where they were computed).
    pub full_logits: bool,
}

#[derive(Debug, Default)]
pub struct RowOutput {
    /// One vocab-sized row per wanted token when the row asked for full logits; empty
    /// otherwise.
    pub logits: Vec<Vec<f32>>,
    /// One summary per wanted token, always.
    pub summaries: Vec<LogitSummary>,
    /// The last layer's output after the final norm, one `hidden_size` row per input
    /// token: the hidden state MTP heads read.
    pub hidden: Vec<f32>,
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
    /// Decode and verify forwards recorded by the backend (CUDA graphs), one per shape.
    recordings: B::Recordings,
}

impl<B: Kernels> Decoder<B> {
    fn load(be: Arc<B>, config: Config, ck: &Checkpoint, kv: KvDtype) -> Result<Decoder<B>> {
        let c = &config;
        let h = c.hidden_size;
        let layers = (0..c.num_hidden_layers)
            .map(|i| Block::load(&*be, ck, &format!("model.layers.{i}"), c))
            .collect::<Result<Vec<_>>>()?;
        let embed_w = ck.get("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let kv = be.kv_dtype(kv, embed_w.dtype)?;
        if kv == KvDtype::Q4 && c.head_dim % 2 == 1 {
            return Err(Error::Backend(format!(
                "4-bit K/V packs two values a byte: head_dim {} is odd",
                c.head_dim
            )));
        }
        let embed = Arc::new(be.matrix(&embed_w)?);
        // Some tied checkpoints still ship lm_head.weight; prefer it when present.
        let lm_head = if ck.contains("lm_head.weight") || !c.tie_word_embeddings {
            Arc::new(be.matrix(&ck.get("lm_head.weight", &[c.vocab_size, h])?)?)
        } else {
            embed.clone()
        };
        let table =
            RopeTable::new(c.head_dim, c.rope_theta, c.rope_scaling.as_ref(), c.max_position_embeddings);
        let max_positions = table.max_positions();
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
            recordings: B::Recordings::default(),
        })
    }

    fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>> {
        let (be, c) = (&*self.be, &self.config);
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let sizes: Vec<(&RowCache, usize)> = rows.iter().map(|r| (&*r.cache, r.tokens.len())).collect();
        let slots = slots_for(&sizes, self.max_positions)?;
        check_tokens(rows.iter().map(|r| r.tokens), vocab, "row")?;
        let m = slots.len();
        let tokens: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let every_logit = wanted_tokens(rows).len() == m;
        let fetch = if rows.iter().any(|r| r.full_logits) { 3 } else { 2 };
        let mut caches: Vec<&mut RowCache> = rows.iter_mut().map(|r| &mut *r.cache).collect();
        let batch = be.batch(&slots, &tokens, &mut caches)?;
        // The embedding, the layers and the final norm, into `normed`.
        let mut hidden_states = |batch: &B::Batch, normed: &mut B::Act| -> Result<()> {
            let mut x = be.alloc(m * h)?;
            be.embed_batch(&self.embed, batch, &mut x)?;
            if let Some(first) = self.layers.first() {
                // Every layer has the first's shape.
                let mut s = first.scratch(be, c, m)?;
                for (li, layer) in self.layers.iter().enumerate() {
                    layer.forward(be, c, &self.rope, &mut x, m, batch, &mut caches, li, &mut s)?;
                }
            }
            be.rms_norm(&x, &self.norm, c.rms_norm_eps, normed, h, 0)
        };
        if m > 0 && every_logit {
            // Decode and verify: with the LM head over every token, the whole forward's
            // launches follow the batch's shape, so the backend may record and replay it.
            // The logits come back only when some row wants them whole.
            let lens = [m * h, SUMMARY_VALUES * m, m * vocab];
            let mut outs = be.run_recorded(&self.recordings, batch, &lens, fetch, &mut |batch, outs| {
                let [normed, summaries, logits] = outs else {
                    return Err(Error::Backend("a recorded forward got the wrong outputs".into()));
                };
                hidden_states(batch, normed)?;
                be.linear(normed, m, &self.lm_head, None, logits, Out::Write)?;
                be.logit_summaries(logits, m, vocab, summaries)
            })?;
            drop(caches);
            let logits = if fetch == 3 { outs.pop() } else { None };
            let [hidden, summaries]: [Vec<f32>; 2] =
                outs.try_into().map_err(|_| Error::Backend("a recorded forward lost its outputs".into()))?;
            let head = Head { summaries: summaries_from(&summaries), logits: logits.unwrap_or_default() };
            return Ok(row_outputs(rows, &head, &hidden, vocab, h));
        }
        let mut normed = be.alloc(m * h)?;
        hidden_states(&batch, &mut normed)?;
        drop(caches);
        head_outputs(be, rows, normed, &self.lm_head, vocab, h, None)
    }
}

/// The LM head's results for a forward's wanted tokens, in order: every token's summary,
/// and the logits (`vocab` wide) when some row wanted them whole (empty otherwise).
struct Head {
    summaries: Vec<LogitSummary>,
    logits: Vec<f32>,
}

/// Indices (among all the rows' tokens, in order) of the tokens whose logits are wanted.
fn wanted_tokens(rows: &[RowInput]) -> Vec<usize> {
    let mut want: Vec<usize> = Vec::new();
    let mut off = 0;
    for row in rows.iter() {
        let t = row.tokens.len();
        want.extend(row.logits.wanted(t).map(|i| off + i));
        off += t;
    }
    want
}

/// Each row's outputs from the wanted tokens' `head` results and every token's
/// final-normed `hidden` state (`h` wide).
fn row_outputs(rows: &[RowInput], head: &Head, hidden: &[f32], vocab: usize, h: usize) -> Vec<RowOutput> {
    use rayon::prelude::*;
    let vocab = vocab.max(1);
    let mut outs = Vec::with_capacity(rows.len());
    let (mut off, mut wanted) = (0, 0);
    for row in rows.iter() {
        let t = row.tokens.len();
        let n = row.logits.wanted(t).len();
        let logits = match head.logits.get(wanted * vocab..(wanted + n) * vocab) {
            // Copied on the host's threads: a verify's logits are tens of MB.
            Some(l) if row.full_logits => l.par_chunks(vocab).map(|l| l.to_vec()).collect(),
            _ => Vec::new(),
        };
        outs.push(RowOutput {
            logits,
            summaries: head.summaries[wanted..wanted + n].to_vec(),
            hidden: hidden[off * h..(off + t) * h].to_vec(),
        });
        off += t;
        wanted += n;
    }
    outs
}

/// Each row's outputs from the final-normed hidden states `normed` (one `h`-wide row per
/// token): `lm_head` only for the tokens whose logits were asked for, soft-capped
/// (`cap * tanh(l / cap)`, on the host) when `softcap` is given.
pub(crate) fn head_outputs<B: Kernels>(
    be: &B,
    rows: &[RowInput],
    normed: B::Act,
    lm_head: &B::Mat,
    vocab: usize,
    h: usize,
    softcap: Option<f32>,
) -> Result<Vec<RowOutput>> {
    let want = wanted_tokens(rows);
    let all = rows.iter().map(|r| r.tokens.len()).sum::<usize>();
    let mut head = Head { summaries: Vec::new(), logits: Vec::new() };
    if !want.is_empty() {
        // Every token wanted (decode, verify): the rows are already in order.
        let gathered = if want.len() == all { None } else { Some(be.gather(&normed, h, &want)?) };
        let mut logits = be.alloc(want.len() * vocab)?;
        be.linear(gathered.as_ref().unwrap_or(&normed), want.len(), lm_head, None, &mut logits, Out::Write)?;
        if let Some(cap) = softcap {
            // Capped on the host, so summarised there.
            head.logits = be.download(logits)?;
            head.logits.iter_mut().for_each(|l| *l = (*l / cap).tanh() * cap);
            let mut values = vec![0.0; SUMMARY_VALUES * want.len()];
            host_summaries(&head.logits, want.len(), vocab, &mut values)?;
            head.summaries = summaries_from(&values);
        } else {
            let mut summaries = be.alloc(SUMMARY_VALUES * want.len())?;
            be.logit_summaries(&logits, want.len(), vocab, &mut summaries)?;
            head.summaries = summaries_from(&be.download(summaries)?);
            if rows.iter().any(|r| r.full_logits) {
                head.logits = be.download(logits)?;
            }
        }
    }
    let hidden = be.download(normed)?;
    Ok(row_outputs(rows, &head, &hidden, vocab, h))
}

/// A model on some backend, as the engine sees it.
pub(crate) trait Net: Send + Sync {
    fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>>;
    fn new_cache(&self) -> RowCache;
    fn kv_bytes_per_token(&self) -> usize;
    /// K/V bytes a row holds whatever its length (a sliding-window ring).
    fn kv_bytes_per_row(&self) -> usize {
        0
    }
    fn backend(&self) -> Backend;
    fn kv_dtype(&self) -> KvDtype;
    fn max_positions(&self) -> usize;
    /// Loads MTP module `prefix` of `ck` onto this model's backend, sharing its weights.
    fn load_mtp(&self, ck: &Checkpoint, layout: MtpLayout, prefix: &str) -> Result<Box<dyn MtpNet>>;
    /// The concrete net, for drafters that share a family's internals (Gemma 4's assistant).
    fn as_any(&self) -> &dyn std::any::Any;
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

    fn kv_dtype(&self) -> KvDtype {
        self.kv
    }

    fn max_positions(&self) -> usize {
        self.max_positions
    }

    fn load_mtp(&self, ck: &Checkpoint, layout: MtpLayout, prefix: &str) -> Result<Box<dyn MtpNet>> {
        Ok(Box::new(crate::mtp::MtpBlock::load(self, ck, layout, prefix)?))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

pub struct Model {
    pub config: Config,
    net: Box<dyn Net>,
}

impl Model {
    /// Loads `config.json` (+ `generation_config.json`) and the safetensors weights of
    /// `dir` for the CPU.
    pub fn load(dir: &Path) -> Result<Model> {
        Model::load_on(dir, Backend::Cpu)
    }

    /// Loads `dir` onto `backend` (weights copied to the device for a GPU backend), K/V
    /// in the backend's default dtype.
    pub fn load_on(dir: &Path, backend: Backend) -> Result<Model> {
        Model::load_with(dir, backend, KvDtype::Auto)
    }

    /// Loads `dir` onto `backend` with K/V stored as `kv`.
    pub fn load_with(dir: &Path, backend: Backend, kv: KvDtype) -> Result<Model> {
        let config = Config::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        Model::from_checkpoint(config, &ck, backend, kv)
    }

    pub fn from_checkpoint(config: Config, ck: &Checkpoint, backend: Backend, kv: KvDtype) -> Result<Model> {
        if config.arch == Arch::Gemma4 {
            let net = crate::gemma4::load(config.clone(), ck, backend, kv)?;
            return Ok(Model { config, net });
        }
        let net: Box<dyn Net> = crate::on_backend!(backend, be => Ok(Box::new(Decoder::load(be, config.clone(), ck, kv)?) as Box<dyn Net>))?;
        Ok(Model { config, net })
    }

    /// Where this model runs.
    pub fn backend(&self) -> Backend {
        self.net.backend()
    }

    /// How this model stores K/V (resolved: `F32` or `Bf16`).
    pub fn kv_dtype(&self) -> KvDtype {
        self.net.kv_dtype()
    }

    /// An empty cache for one row of this model, on its backend.
    pub fn new_cache(&self) -> RowCache {
        self.net.new_cache()
    }

    /// KV bytes one position costs (device bytes on a GPU backend).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.net.kv_bytes_per_token()
    }

    /// K/V bytes a row holds whatever its length, besides [`Model::kv_bytes_per_token`]
    /// per position: Gemma 4's sliding-window rings (0 for other models).
    pub fn kv_bytes_per_row(&self) -> usize {
        self.net.kv_bytes_per_row()
    }

    /// The longest sequence (prompt + output) a row may reach.
    pub fn max_positions(&self) -> usize {
        self.net.max_positions()
    }

    /// Runs every row's tokens at its own logical positions `[len, len + t)` and returns
    /// the requested logits and the final-normed hidden state of every token. The new
    /// K/V are left in each row's open window (at the slot the caller chose with
    /// `RowCache::begin_window`, the row's tail by default); the caller commits what it
    /// keeps with `RowCache::commit_window`. Every value a row gets back is a function of
    /// its own prefix only: batch composition and chunking change no bit.
    pub fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>> {
        self.net.forward(rows)
    }

    pub(crate) fn net(&self) -> &dyn Net {
        &*self.net
    }
}
