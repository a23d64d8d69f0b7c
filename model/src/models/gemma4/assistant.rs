//! Gemma 4's assistant (`Gemma4AssistantForCausalLM`): a small decoder with no K/V of its
//! own. Each draft step feeds `pre_projection([target_embed(token); hidden])` through its
//! layers, which attend to the target's K/V (the last stored target layer of the same
//! type); `post_projection` of its output is the next step's `hidden`, and its logits come
//! from the tied LM head, or the centroid-masked one (`use_ordered_embeddings`). Every
//! step of one proposal queries at the same logical position, the row's next one.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use mtp_cache::RowCache;
use serde_json::Value;

use mtp_base::config::{count_key, read_json, Config};
use mtp_base::error::{Error, Result};
use mtp_base::Checkpoint;
use mtp_kernels::{AssistantKernels, KeyRange, Out, Plane};

use crate::forward::{check_tokens, Model, Proj};

use super::config::{Gemma4Config, LayerKind};
use super::layer::Layer;
use super::Gemma4;

/// The centroid-masked LM head: only the tokens of the `top_k` best centroids get logits.
struct Ordered<B: AssistantKernels> {
    centroids: Proj<B>,
    /// `[centroid][token]`: the tokens each centroid owns.
    ordering: Vec<u32>,
    top_k: usize,
}

/// One row's draft step: the query at logical position `pos` (the row's next), from
/// `token` (at `pos`) and `hidden` (the target's, or the previous step's projection).
pub struct AssistantRow<'a> {
    pub token: u32,
    pub hidden: &'a [f32],
    pub pos: usize,
    /// The target row's cache and the committed keys full-attention layers read.
    pub full: (&'a RowCache, Range<usize>),
    /// The cache and keys sliding layers read (`None` when the target has no sliding layer).
    pub sliding: Option<(&'a RowCache, Range<usize>)>,
}

/// What one step gives a row: logits over the vocabulary and the next step's hidden.
#[derive(Clone, Debug)]
pub struct AssistantStep {
    pub logits: Vec<f32>,
    pub hidden: Vec<f32>,
}

pub struct Gemma4Assistant {
    config: Config,
    target: Arc<Model>,
    backbone: usize,
    window: usize,
    net: Box<dyn Steps>,
}

/// The assistant's weights on the target's backend.
struct Weights<B: AssistantKernels> {
    be: Arc<B>,
    layers: Vec<Layer<B>>,
    norm: B::Vec,
    pre_projection: Proj<B>,
    post_projection: Proj<B>,
    lm_head: B::Mat,
    ordered: Option<Ordered<B>>,
    rope_sliding: B::Rope,
    rope_full: B::Rope,
}

/// One draft step, whatever the backend.
trait Steps: Send + Sync {
    fn step(&self, a: &Gemma4Assistant, rows: &[AssistantRow]) -> Result<Vec<AssistantStep>>;
}

fn bad(path: &Path, key: &str, msg: impl Into<String>) -> Error {
    Error::config(path, key, msg)
}

impl Gemma4Assistant {
    /// [`Gemma4Assistant::load`] (in `crate::registry`) on the target's backend `be`.
    pub(crate) fn load_on<B: AssistantKernels>(
        dir: &Path,
        target: Arc<Model>,
        be: Arc<B>,
    ) -> Result<Gemma4Assistant> {
        let path = dir.join("config.json");
        let v = read_json(&path)?;
        let arch = v.get("architectures").and_then(|a| a.get(0)).and_then(|a| a.as_str()).unwrap_or("");
        if arch != "Gemma4AssistantForCausalLM" {
            return Err(bad(&path, "architectures", format!("`{arch}` is not a Gemma4AssistantForCausalLM")));
        }
        let t = target.net().as_any().downcast_ref::<Gemma4<B>>().ok_or_else(|| {
            Error::InvalidOption(format!(
                "the Gemma 4 assistant in {} drafts for a Gemma 4 target (this one is a {})",
                dir.display(),
                target.config.arch.hf_name()
            ))
        })?;
        let mut text = v
            .get("text_config")
            .filter(|t| t.is_object())
            .cloned()
            .ok_or_else(|| bad(&path, "text_config", "missing or not an object"))?;
        text["architectures"] = Value::from(vec!["Gemma4ForCausalLM"]);
        let c = Config::from_value(&path, &text).map_err(|e| e.under("text_config"))?;
        let g = Gemma4Config::from_value(&path, &text).map_err(|e| e.under("text_config"))?;
        let backbone = count_key(&path, &v, "backbone_hidden_size")?.unwrap_or(0);
        if backbone != t.config.hidden_size {
            return Err(bad(
                &path,
                "backbone_hidden_size",
                format!("{backbone}, but the target's hidden size is {}", t.config.hidden_size),
            ));
        }
        if c.vocab_size != t.config.vocab_size {
            return Err(bad(
                &path,
                "text_config.vocab_size",
                format!(
                    "{} tokens, the target has {}: they must share the vocabulary",
                    c.vocab_size, t.config.vocab_size
                ),
            ));
        }
        let lay = &t.layout;
        let plane_of = |kind: LayerKind| -> Option<(Plane, (usize, usize))> {
            match kind {
                LayerKind::Full => Some((Plane::Main(lay.main_layers - 1), lay.main)),
                LayerKind::Sliding if lay.ring_layers > 0 => {
                    Some((Plane::Ring(lay.ring_layers - 1), lay.ring))
                }
                LayerKind::Sliding => None,
            }
        };
        let ck = Checkpoint::open(dir)?;
        let mut layers = Vec::with_capacity(g.layers.len());
        for (i, &spec) in g.layers.iter().enumerate() {
            let (plane, shape) = plane_of(spec.kind).ok_or_else(|| {
                bad(
                    &path,
                    "text_config.layer_types",
                    format!("layer {i} slides but the target has no sliding layer"),
                )
            })?;
            if shape != (spec.kv_heads, spec.head_dim) {
                return Err(bad(
                    &path,
                    &format!("text_config.per_layer_config.{i}"),
                    format!(
                        "layer {i} reads num_key_value_heads {} of head_dim {}, but the target stores {} of {}",
                        spec.kv_heads, spec.head_dim, shape.0, shape.1
                    ),
                ));
            }
            layers.push(Layer::load(&*be, &ck, &format!("model.layers.{i}"), spec, plane, &c, &g, None)?);
        }
        let h = c.hidden_size;
        let embed = ck.get("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let lm_head = be.matrix(&if ck.contains("lm_head.weight") {
            ck.get("lm_head.weight", &[c.vocab_size, h])?
        } else {
            embed
        })?;
        let ordered_flag = match v.get("use_ordered_embeddings") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(x) => {
                return Err(bad(&path, "use_ordered_embeddings", format!("expected true or false, got {x}")))
            }
        };
        let ordered = if ordered_flag {
            let n = count_key(&path, &v, "num_centroids")?.unwrap_or(0);
            let top_k = count_key(&path, &v, "centroid_intermediate_top_k")?.unwrap_or(0);
            if n == 0 || c.vocab_size % n != 0 || top_k == 0 || top_k > n {
                return Err(bad(
                    &path,
                    "num_centroids",
                    format!("{n} centroids (top {top_k}) must divide the vocabulary of {}", c.vocab_size),
                ));
            }
            let ordering = ck.get_ids("masked_embedding.token_ordering", c.vocab_size)?;
            let mut seen = vec![false; c.vocab_size];
            for &id in &ordering {
                if id < 0 || id as usize >= c.vocab_size || std::mem::replace(&mut seen[id as usize], true) {
                    return Err(bad(
                        &path,
                        "masked_embedding.token_ordering",
                        "is not a permutation of the vocabulary",
                    ));
                }
            }
            Some(Ordered {
                centroids: Proj::load(&*be, &ck, "masked_embedding.centroids", n, h, false)?,
                ordering: ordering.into_iter().map(|id| id as u32).collect(),
                top_k,
            })
        } else {
            None
        };
        let max_pos = t.max_positions;
        let head_dim = |kind: LayerKind| g.layers.iter().find(|l| l.kind == kind).map_or(2, |l| l.head_dim);
        let net = Weights {
            norm: be.vector(&ck.get_f32("model.norm.weight", h)?)?,
            pre_projection: Proj::load(&*be, &ck, "pre_projection", h, 2 * backbone, false)?,
            post_projection: Proj::load(&*be, &ck, "post_projection", backbone, h, false)?,
            rope_sliding: be.rope_table(g.rope_sliding.table(head_dim(LayerKind::Sliding), max_pos))?,
            rope_full: be.rope_table(g.rope_full.table(head_dim(LayerKind::Full), max_pos))?,
            layers,
            lm_head,
            ordered,
            be,
        };
        crate::accounting::check_all(&ck, "Gemma 4's assistant (config.json)")?;
        Ok(Gemma4Assistant {
            window: t.g.sliding_window,
            config: c,
            backbone,
            target: target.clone(),
            net: Box::new(net),
        })
    }

    /// The keys a row reads when its target cache holds `len` committed positions and the
    /// query sits at `len`: every position for full layers, the last `window + 1` for
    /// sliding ones (transformers' assistant mask).
    pub fn key_ranges(&self, len: usize) -> (Range<usize>, Range<usize>) {
        (0..len, len.saturating_sub(self.window + 1)..len)
    }

    /// Weights one draft step multiplies (for the engine's cost model).
    pub fn params_per_step(&self) -> usize {
        let c = &self.config;
        c.num_hidden_layers * c.layer_params()
            + 2 * self.backbone * c.hidden_size * 2
            + c.hidden_size * c.vocab_size
    }

    /// The target's hidden size (the width of `hidden`).
    pub fn backbone_hidden(&self) -> usize {
        self.backbone
    }

    /// One draft step for every row.
    pub fn step(&self, rows: &[AssistantRow]) -> Result<Vec<AssistantStep>> {
        self.net.step(self, rows)
    }
}

impl<B: AssistantKernels> Steps for Weights<B> {
    fn step(&self, a: &Gemma4Assistant, rows: &[AssistantRow]) -> Result<Vec<AssistantStep>> {
        let t = a.target.net().as_any().downcast_ref::<Gemma4<B>>().expect("checked at load");
        let (be, c) = (&*self.be, &a.config);
        let (m, hb, h) = (rows.len(), a.backbone, c.hidden_size);
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        check_tokens(std::iter::once(tokens.as_slice()), c.vocab_size, "assistant row")?;
        let mut emb = be.alloc(m * hb)?;
        be.embed(&t.embed, &tokens, &mut emb)?;
        be.scale(&mut emb, t.embed_scale)?;
        let emb = be.download(emb)?;
        let mut input = vec![0.0f32; m * 2 * hb];
        for (i, r) in rows.iter().enumerate() {
            if r.hidden.len() != hb {
                return Err(Error::Request {
                    request: format!("assistant row {i}"),
                    msg: format!("hidden state of {} values, the target's is {hb}", r.hidden.len()),
                });
            }
            input[i * 2 * hb..i * 2 * hb + hb].copy_from_slice(&emb[i * hb..(i + 1) * hb]);
            input[i * 2 * hb + hb..(i + 1) * 2 * hb].copy_from_slice(r.hidden);
        }
        let mut x = self.pre_projection.forward(be, &be.upload(&input)?, m)?;
        let positions: Vec<usize> = rows.iter().map(|r| r.pos).collect();
        for l in &self.layers {
            let heads = l.heads();
            let (mut q, _) = l.qkv(be, c, &x, m)?;
            let rope = match l.spec.kind {
                LayerKind::Sliding => &self.rope_sliding,
                LayerKind::Full => &self.rope_full,
            };
            be.rope_at(&mut q, heads.heads * heads.head_dim, heads.head_dim, &positions, rope)?;
            let mut caches = Vec::with_capacity(m);
            let mut keys = Vec::with_capacity(m);
            for (i, r) in rows.iter().enumerate() {
                let (cache, range) = match l.spec.kind {
                    LayerKind::Full => Some(&r.full),
                    LayerKind::Sliding => r.sliding.as_ref(),
                }
                .ok_or_else(|| Error::Request {
                    request: format!("assistant row {i}"),
                    msg: "no keys given for its sliding layers".into(),
                })?;
                caches.push(*cache);
                keys.push(KeyRange { first: range.start, end: range.end });
            }
            let mut attn = be.alloc(m * heads.heads * heads.head_dim)?;
            be.attention_over(&q, &keys, &caches, l.plane, heads, 1.0, &mut attn)?;
            l.finish(be, c, &mut x, &attn, m, None)?;
        }
        let mut normed = be.alloc(m * h)?;
        be.rms_norm(&x, &self.norm, c.rms_norm_eps, &mut normed, h, 0)?;
        let hidden = be.download(self.post_projection.forward(be, &normed, m)?)?;
        let mut logits = be.alloc(m * c.vocab_size)?;
        be.linear(&normed, m, &self.lm_head, None, &mut logits, Out::Write)?;
        let mut logits = be.download(logits)?;
        if let Some(o) = &self.ordered {
            let scores = be.download(o.centroids.forward(be, &normed, m)?)?;
            for (row, s) in logits.chunks_mut(c.vocab_size).zip(scores.chunks(o.centroids.out)) {
                mask_to_centroids(row, s, &o.ordering, o.top_k);
            }
        }
        Ok(logits
            .chunks(c.vocab_size)
            .zip(hidden.chunks(hb))
            .map(|(l, h)| AssistantStep { logits: l.to_vec(), hidden: h.to_vec() })
            .collect())
    }
}

/// Keeps the logits of the tokens owned by the `top_k` best centroids (ties to the lower
/// centroid) and sets every other to the smallest kept logit minus one.
fn mask_to_centroids(logits: &mut [f32], scores: &[f32], ordering: &[u32], top_k: usize) {
    let per = logits.len() / scores.len();
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let kept: Vec<u32> = order[..top_k]
        .iter()
        .flat_map(|&cent| ordering[cent * per..(cent + 1) * per].iter().copied())
        .collect();
    let floor = kept.iter().map(|&t| logits[t as usize]).fold(f32::INFINITY, f32::min) - 1.0;
    let mut out = vec![floor; logits.len()];
    for &t in &kept {
        out[t as usize] = logits[t as usize];
    }
    logits.copy_from_slice(&out);
}
