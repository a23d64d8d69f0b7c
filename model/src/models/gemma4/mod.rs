//! Gemma 4 text decoders (`Gemma4ForCausalLM`, and the text part of
//! `Gemma4ForConditionalGeneration`), written once over [`Kernels`]:
//!
//! ```text
//! x = embed(t) * sqrt(hidden)                       (+ per-layer inputs, E models)
//! per layer:  a = o(attn(rope(q_norm(q(n(x)))), rope(k_norm(k(n(x)))), v_norm(v(n(x)))))
//!             x += post_attn_norm(a)
//!             f = down(gelu_tanh(gate(n(x))) * up(n(x)))  (+ routed experts, MoE models)
//!             x += post_ff_norm(f)
//!             x += post_ple_norm(proj(gelu_tanh(ple_gate(x)) * ple_input))   (E models)
//!             x *= layer_scalar
//! logits = softcap(lm_head(norm(x)))
//! ```
//!
//! Attention scale is 1 (the q/k norms set it). Sliding layers attend to keys
//! `(p - window, p]` and keep only the window in the row's ring; full layers keep every
//! position. KV-shared layers read the K/V of the last earlier layer of their type and
//! store none. `attention_k_eq_v` full layers take V from K's projection before its norm.

pub mod assistant;
pub mod config;
mod layer;
mod moe;

use std::sync::Arc;

use mtp_cache::RowCache;

use mtp_base::config::{read_json, Config};
use mtp_base::error::{Error, Result};
use mtp_base::Checkpoint;
use mtp_kernels::{Activations, Backend, Kernels, KvDtype, Plane};

use crate::forward::{check_tokens, head_outputs, slots_for, LmHead, Net, Proj, RowInput, RowOutput};
use crate::mtp::{MtpLayout, MtpNet};
use crate::tensor_parallel::{check_split, embed_tokens, Shard};

pub use config::{Gemma4Config, LayerKind, LayerSpec};
use layer::Layer;

/// The model-level half of the per-layer inputs (E models).
struct PerLayerInputs<B: Kernels> {
    embed: B::Mat,
    embed_scale: f32,
    projection: Proj<B>,
    norm: B::Vec,
    width: usize,
}

/// How a row's K/V are laid out: full layers that store K/V in the main store, sliding
/// ones in the ring (absent when no layer slides).
#[derive(Clone, Copy, Debug)]
struct Layout {
    main_layers: usize,
    main: (usize, usize),
    ring_layers: usize,
    ring: (usize, usize),
}

pub(crate) struct Gemma4<B: Kernels> {
    be: Arc<B>,
    config: Config,
    g: Gemma4Config,
    embed: B::Mat,
    embed_scale: f32,
    layers: Vec<Layer<B>>,
    norm: B::Vec,
    lm_head: Option<B::Mat>,
    rope_sliding: B::Rope,
    rope_full: B::Rope,
    inputs: Option<PerLayerInputs<B>>,
    layout: Layout,
    max_positions: usize,
    kv: KvDtype,
    /// How the matmuls take activations (resolved for this checkpoint's weights).
    activations: Activations,
    /// This rank, when the model is split between ranks (each layer knows its heads and
    /// widths on the rank; `config` stays the checkpoint's).
    shard: Option<Arc<Shard<B>>>,
}

/// The one head shape every layer of `kind` must share (one RoPE table and one store).
fn kind_shape(g: &Gemma4Config, kind: LayerKind, path: &std::path::Path) -> Result<Option<(usize, usize)>> {
    let mut shapes = g.layers.iter().filter(|l| l.kind == kind).map(|l| (l.kv_heads, l.head_dim));
    let first = shapes.next();
    if let Some(other) = shapes.find(|s| Some(*s) != first) {
        return Err(Error::config(
            path,
            "per_layer_config",
            format!("layers of one type have different head shapes {first:?} and {other:?} (not supported)"),
        ));
    }
    Ok(first)
}

impl<B: Kernels> Gemma4<B> {
    fn load(
        be: Arc<B>,
        config: Config,
        g: Gemma4Config,
        ck: &Checkpoint,
        prefix: &str,
        kv: KvDtype,
        shard: Option<Arc<Shard<B>>>,
    ) -> Result<Self> {
        let c = &config;
        let ranks = shard.as_ref().map_or(1, |s| s.ranks);
        let h = c.hidden_size;
        let path = ck.dir().join("config.json");
        let full = kind_shape(&g, LayerKind::Full, &path)?.expect("the last layer is full");
        let sliding = kind_shape(&g, LayerKind::Sliding, &path)?.unwrap_or(full);
        let index = |kind: LayerKind, i: usize| g.stored(kind).position(|j| j == i);
        // Where layer i's K/V lives: its own, or the earlier layer it shares. A config whose
        // every layer shares (an assistant's, which reads its target's) stores none.
        let plane_of = |i: usize| -> Result<Plane> {
            let src = g.layers[i].kv_source.unwrap_or(i);
            let kind = g.layers[src].kind;
            let stored = index(kind, src).ok_or_else(|| {
                Error::config(
                    &path,
                    "num_kv_shared_layers",
                    format!(
                        "layer {i} reads K/V no layer of this model stores ({} of {} layers share;                          only an assistant, loaded beside its target, may share every layer)",
                        g.layers.iter().filter(|l| !l.own_kv).count(),
                        g.layers.len()
                    ),
                )
            })?;
            Ok(match kind {
                LayerKind::Full => Plane::Main(stored),
                LayerKind::Sliding => Plane::Ring(stored),
            })
        };
        // A rank stores its own K/V heads.
        let layout = Layout {
            main_layers: g.stored(LayerKind::Full).count(),
            main: (full.0 / ranks, full.1),
            ring_layers: g.stored(LayerKind::Sliding).count(),
            ring: (sliding.0 / ranks, sliding.1),
        };
        let mut layers = Vec::with_capacity(g.layers.len());
        for (i, &spec) in g.layers.iter().enumerate() {
            let p = format!("{prefix}layers.{i}");
            layers.push(Layer::load(&*be, ck, &p, spec, plane_of(i)?, c, &g, shard.clone())?);
        }
        let embed_w = ck.get(&format!("{prefix}embed_tokens.weight"), &[c.vocab_size, h])?;
        let kv = be.kv_dtype(kv, embed_w.dtype)?;
        let activations = be.activations_for(&embed_w);
        if kv == KvDtype::Q4 && (full.1 % 2 == 1 || sliding.1 % 2 == 1) {
            return Err(Error::Backend("4-bit K/V packs two values a byte: a head_dim is odd".into()));
        }
        // transformers casts the scale to the weights' dtype before multiplying.
        let embed_scale = embed_w.dtype.round((h as f32).sqrt());
        let inputs = if g.per_layer_input > 0 {
            let (w, n) = (g.per_layer_input, g.layers.len());
            let table =
                ck.get(&format!("{prefix}embed_tokens_per_layer.weight"), &[g.per_layer_vocab, n * w])?;
            Some(PerLayerInputs {
                embed_scale: table.dtype.round((w as f32).sqrt()),
                embed: be.matrix(&table)?,
                projection: Proj::load(
                    &*be,
                    ck,
                    &format!("{prefix}per_layer_model_projection"),
                    n * w,
                    h,
                    false,
                )?,
                norm: be.vector(&ck.get_f32(&format!("{prefix}per_layer_projection_norm.weight"), w)?)?,
                width: w,
            })
        } else {
            None
        };
        // mlx-lm keeps a multimodal model's untied head beside its decoder.
        let head = if prefix == "language_model.model." {
            "language_model.lm_head.weight"
        } else {
            "lm_head.weight"
        };
        let lm_head_w = if c.tie_word_embeddings {
            crate::forward::ignore_tied_head(ck, head);
            None
        } else {
            Some(ck.get(head, &[c.vocab_size, h])?)
        };
        let lm_head = match (&shard, lm_head_w) {
            (None, w) => w.map(|w| be.matrix(&w)).transpose()?,
            // A rank's vocabulary rows of the head (tied: of the embedding).
            (Some(s), w) => Some(be.matrix(&s.vocab_rows(w.as_ref().unwrap_or(&embed_w), "lm_head")?)?),
        };
        let max_positions = c.max_position_embeddings;
        Ok(Gemma4 {
            rope_sliding: be.rope_table(g.rope_sliding.table(sliding.1, max_positions))?,
            rope_full: be.rope_table(g.rope_full.table(full.1, max_positions))?,
            embed: match &shard {
                None => be.matrix(&embed_w)?,
                Some(s) => be.matrix(&s.embedding_rows(&embed_w, "embed_tokens.weight")?)?,
            },
            embed_scale,
            norm: be.vector(&ck.get_f32(&format!("{prefix}norm.weight"), h)?)?,
            be,
            config,
            g,
            layers,
            lm_head,
            inputs,
            layout,
            max_positions,
            kv,
            activations,
            shard,
        })
    }

    /// Each token's per-layer inputs, `[token][layer][width]`: the projection of its
    /// embedding, normed, plus its own per-layer embedding, over sqrt(2).
    fn layer_inputs(&self, p: &PerLayerInputs<B>, x: &B::Act, tokens: &[u32], m: usize) -> Result<B::Act> {
        let be = &*self.be;
        let n = self.layers.len() * p.width;
        let mut ids = be.alloc(m * n)?;
        be.embed(&p.embed, tokens, &mut ids)?;
        be.scale(&mut ids, p.embed_scale)?;
        let mut proj = p.projection.forward(be, x, m)?;
        be.scale(&mut proj, (self.config.hidden_size as f32).powf(-0.5))?;
        let mut normed = be.alloc(m * n)?;
        be.rms_norm(&proj, &p.norm, self.config.rms_norm_eps, &mut normed, p.width, 0)?;
        be.add(&mut normed, &ids)?;
        be.scale(&mut normed, 2f32.powf(-0.5))?;
        Ok(normed)
    }

    fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>> {
        let (be, c) = (&*self.be, &self.config);
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let sizes: Vec<(&RowCache, usize)> = rows.iter().map(|r| (&*r.cache, r.tokens.len())).collect();
        let slots = slots_for(&sizes, self.max_positions)?;
        check_tokens(rows.iter().map(|r| r.tokens), c.vocab_size, "row")?;
        let m = slots.len();
        let tokens: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
        let mut x = embed_tokens(be, self.shard.as_deref(), &self.embed, &tokens, c.vocab_size, h)?;
        be.scale(&mut x, self.embed_scale)?;
        let inputs = match &self.inputs {
            Some(p) => {
                check_tokens(rows.iter().map(|r| r.tokens), self.g.per_layer_vocab, "row")?;
                Some((p, self.layer_inputs(p, &x, &tokens, m)?))
            }
            None => None,
        };
        let mut caches: Vec<&mut RowCache> = rows.iter_mut().map(|r| &mut *r.cache).collect();
        let batch = be.batch(&slots, &tokens, &mut caches)?;
        let n_layers = self.layers.len();
        for (li, layer) in self.layers.iter().enumerate() {
            let input = match &inputs {
                Some((p, all)) => {
                    let picks: Vec<usize> = (0..m).map(|t| t * n_layers + li).collect();
                    Some(be.gather(all, p.width, &picks)?)
                }
                None => None,
            };
            self.layer_forward(layer, &mut x, m, &batch, &mut caches, input.as_ref())?;
        }
        drop(caches);
        let mut normed = be.alloc(m * h)?;
        be.rms_norm(&x, &self.norm, eps, &mut normed, h, 0)?;
        let head = LmHead { w: self.lm_head.as_ref().unwrap_or(&self.embed), shard: self.shard.as_deref() };
        head_outputs(be, rows, normed, head, c.vocab_size, h, self.g.final_logit_softcapping, None)
    }

    fn layer_forward(
        &self,
        l: &Layer<B>,
        x: &mut B::Act,
        m: usize,
        batch: &B::Batch,
        caches: &mut [&mut RowCache],
        input: Option<&B::Act>,
    ) -> Result<()> {
        let (be, c) = (&*self.be, &self.config);
        let heads = l.heads();
        let (mut q, mut kv) = l.qkv(be, c, x, m)?;
        let (rope, window) = self.rope_of(l.spec.kind);
        let kv = kv.as_mut().map(|(k, v)| (k, &*v));
        be.qk_rope_store(&mut q, kv, None, rope, batch, caches, l.plane, heads)?;
        let mut attn = be.alloc(m * heads.heads * heads.head_dim)?;
        be.attention(&q, batch, caches, l.plane, heads, 1.0, window, &mut attn)?;
        l.finish(be, c, x, &attn, m, input)
    }

    /// The RoPE table and attention window of layers of `kind`.
    fn rope_of(&self, kind: LayerKind) -> (&B::Rope, Option<usize>) {
        match kind {
            LayerKind::Sliding => (&self.rope_sliding, Some(self.g.sliding_window)),
            LayerKind::Full => (&self.rope_full, None),
        }
    }
}

impl<B: Kernels> Net for Gemma4<B> {
    fn forward(&self, rows: &mut [RowInput]) -> Result<Vec<RowOutput>> {
        Gemma4::forward(self, rows)
    }

    fn new_cache(&self) -> RowCache {
        let lay = &self.layout;
        let (mh, md) = lay.main;
        let store = self.be.kv_store(lay.main_layers, mh, md, self.kv);
        let cache = RowCache::with_store(store, lay.main_layers, mh * md);
        if lay.ring_layers == 0 {
            return cache;
        }
        let (rh, rd) = lay.ring;
        let ring = self.be.kv_store(lay.ring_layers, rh, rd, self.kv);
        // The window plus one: a layer reads keys (p - W, p], the assistant W + 1 keys
        // ending at the last committed position (transformers' flipped sliding mask).
        cache.with_ring(ring, lay.ring_layers, rh * rd, self.g.sliding_window + 1)
    }

    /// K/V bytes per position of the full layers (the sliding layers' ring is per row).
    fn kv_bytes_per_token(&self) -> usize {
        let (h, d) = self.layout.main;
        2 * self.layout.main_layers * self.kv.slot_bytes(h, d)
    }

    fn kv_bytes_per_row(&self) -> usize {
        let (h, d) = self.layout.ring;
        2 * self.layout.ring_layers * self.kv.slot_bytes(h, d) * (self.g.sliding_window + 1)
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

    fn max_positions(&self) -> usize {
        self.max_positions
    }

    fn load_mtp(&self, ck: &Checkpoint, _layout: MtpLayout, _prefix: &str) -> Result<Box<dyn MtpNet>> {
        Err(Error::config(
            ck.dir().join("config.json"),
            "architectures",
            "Gemma 4 has no built-in MTP head: draft with its assistant (--drafter assistant --draft DIR)",
        ))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Loads a Gemma 4 checkpoint's decoder onto `be`.
pub(crate) fn load<B: Kernels>(
    be: Arc<B>,
    config: Config,
    ck: &Checkpoint,
    kv: KvDtype,
) -> Result<Box<dyn Net>> {
    load_split(be, config, ck, kv, None)
}

/// Loads rank `shard.rank` of a Gemma 4 decoder split between `shard.ranks` ranks (see
/// `crate::tensor_parallel`): its query and K/V heads of every layer, MLP and expert
/// columns, vocabulary rows; the router, the per-layer inputs and the norms whole.
pub(crate) fn load_rank<B: Kernels>(
    be: Arc<B>,
    config: Config,
    ck: &Checkpoint,
    kv: KvDtype,
    shard: Shard<B>,
) -> Result<Box<dyn Net>> {
    load_split(be, config, ck, kv, Some(Arc::new(shard)))
}

fn load_split<B: Kernels>(
    be: Arc<B>,
    config: Config,
    ck: &Checkpoint,
    kv: KvDtype,
    shard: Option<Arc<Shard<B>>>,
) -> Result<Box<dyn Net>> {
    let path = ck.dir().join("config.json");
    let v = read_json(&path)?;
    let wrapped = v.get("text_config").is_some_and(|t| t.is_object());
    let text = if wrapped { &v["text_config"] } else { &v };
    let g =
        Gemma4Config::from_value(&path, text)
            .map_err(|e| if wrapped { e.under("text_config") } else { e })?;
    // transformers saves the multimodal model's text decoder under `model.language_model.`;
    // mlx-lm and mlx-vlm under `language_model.model.`.
    let prefix = match wrapped {
        false => "model.",
        true if ck.contains("language_model.model.embed_tokens.weight") => "language_model.model.",
        true => "model.language_model.",
    };
    if let Some(s) = &shard {
        let mut sizes = vec![
            ("num_attention_heads".into(), config.num_attention_heads),
            ("vocab_size".into(), config.vocab_size),
        ];
        for (i, l) in g.layers.iter().enumerate() {
            sizes.push((format!("layer {i}'s K/V heads"), l.kv_heads));
            sizes.push((format!("layer {i}'s MLP width"), l.intermediate));
        }
        if let Some(m) = g.moe {
            sizes.push(("moe_intermediate_size".into(), m.intermediate));
        }
        check_split::<String>(s.ranks, &sizes)?;
    }
    if wrapped {
        let towers = ck.names_with_prefix("").filter(|n| crate::accounting::other_modality(n)).count();
        tracing::info!(
            "{}: loading the text decoder of a multimodal Gemma 4; its vision and audio towers ({towers} tensors) are not loaded (text only)",
            ck.dir().display()
        );
    }
    Ok(Box::new(Gemma4::load(be, config, g, ck, prefix, kv, shard)?))
}
