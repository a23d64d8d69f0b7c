//! One Gemma 4 decoder layer, split where attention reads K/V: [`Layer::qkv`] before it,
//! [`Layer::finish`] after it. The target's forward and the assistant's steps run the
//! same two halves around different attention reads.

use std::sync::Arc;

use mtp_base::config::Config;
use mtp_base::error::Result;
use mtp_base::Checkpoint;
use mtp_kernels::{Heads, Kernels, Plane};

use crate::forward::Proj;
use crate::tensor_parallel::Shard;

use super::config::{Gemma4Config, LayerSpec};
use super::moe::MoeBlock;

/// The per-layer input path of a layer (E models).
struct LayerInput<B: Kernels> {
    gate: Proj<B>,
    proj: Proj<B>,
    post_norm: B::Vec,
}

/// `k_proj`, `v_proj` (absent with K = V: V is K's projection) and `k_norm`.
struct OwnKv<B: Kernels> {
    k: Proj<B>,
    v: Option<Proj<B>>,
    k_norm: B::Vec,
}

pub(crate) struct Layer<B: Kernels> {
    pub(crate) spec: LayerSpec,
    pub(crate) plane: Plane,
    input_norm: B::Vec,
    post_attn_norm: B::Vec,
    pre_ff_norm: B::Vec,
    post_ff_norm: B::Vec,
    q: Proj<B>,
    q_norm: B::Vec,
    /// The K/V projections, when the layer stores K/V.
    kv: Option<OwnKv<B>>,
    /// Ones of `head_dim`: V's norm has no scale.
    ones: B::Vec,
    o: Proj<B>,
    gate: Proj<B>,
    up: Proj<B>,
    down: Proj<B>,
    moe: Option<MoeBlock<B>>,
    input: Option<LayerInput<B>>,
    scalar: f32,
    /// The rank this layer's slice belongs to, when split between ranks (its `spec` then
    /// holds the rank's K/V heads and MLP columns).
    shard: Option<Arc<Shard<B>>>,
}

impl<B: Kernels> Layer<B> {
    /// Loads layer `p` (e.g. `model.layers.3`) whose K/V live in `plane`, whole or
    /// (`shard`) the slice one rank holds: its query and K/V heads, MLP and expert columns.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load(
        be: &B,
        ck: &Checkpoint,
        p: &str,
        spec: LayerSpec,
        plane: Plane,
        c: &Config,
        g: &Gemma4Config,
        shard: Option<Arc<Shard<B>>>,
    ) -> Result<Layer<B>> {
        let h = c.hidden_size;
        let rows = |n: usize| Shard::rows_cut(shard.as_deref(), n);
        let cols = |n: usize| Shard::cols_cut(shard.as_deref(), n);
        let a = format!("{p}.self_attn");
        let norm = |name: String, n: usize| -> Result<B::Vec> { be.vector(&ck.get_f32(&name, n)?) };
        let (hd, kvd) = (spec.head_dim, spec.kv_heads * spec.head_dim);
        let qd = c.num_attention_heads * hd;
        let kv = if spec.own_kv {
            let v = if spec.k_eq_v {
                None
            } else {
                Some(Proj::load_cut(be, ck, &format!("{a}.v_proj"), kvd, h, c.qkv_bias, rows(kvd))?)
            };
            Some(OwnKv {
                k: Proj::load_cut(be, ck, &format!("{a}.k_proj"), kvd, h, c.qkv_bias, rows(kvd))?,
                v,
                k_norm: norm(format!("{a}.k_norm.weight"), hd)?,
            })
        } else {
            None
        };
        let input = if g.per_layer_input > 0 {
            let w = g.per_layer_input;
            Some(LayerInput {
                gate: Proj::load(be, ck, &format!("{p}.per_layer_input_gate"), w, h, false)?,
                proj: Proj::load(be, ck, &format!("{p}.per_layer_projection"), h, w, false)?,
                post_norm: norm(format!("{p}.post_per_layer_input_norm.weight"), h)?,
            })
        } else {
            None
        };
        let moe = match g.moe {
            Some(m) => Some(MoeBlock::load(be, ck, p, h, m, shard.as_deref())?),
            None => None,
        };
        let i = spec.intermediate;
        let ranks = shard.as_ref().map_or(1, |s| s.ranks);
        Ok(Layer {
            spec: LayerSpec { kv_heads: spec.kv_heads / ranks, intermediate: i / ranks, ..spec },
            plane,
            input_norm: norm(format!("{p}.input_layernorm.weight"), h)?,
            post_attn_norm: norm(format!("{p}.post_attention_layernorm.weight"), h)?,
            pre_ff_norm: norm(format!("{p}.pre_feedforward_layernorm.weight"), h)?,
            post_ff_norm: norm(format!("{p}.post_feedforward_layernorm.weight"), h)?,
            q: Proj::load_cut(be, ck, &format!("{a}.q_proj"), qd, h, c.qkv_bias, rows(qd))?,
            q_norm: norm(format!("{a}.q_norm.weight"), hd)?,
            kv,
            ones: be.vector(&vec![1.0; hd])?,
            o: Proj::load_cut(be, ck, &format!("{a}.o_proj"), h, qd, c.o_bias, cols(qd))?,
            gate: Proj::load_cut(be, ck, &format!("{p}.mlp.gate_proj"), i, h, false, rows(i))?,
            up: Proj::load_cut(be, ck, &format!("{p}.mlp.up_proj"), i, h, false, rows(i))?,
            down: Proj::load_cut(be, ck, &format!("{p}.mlp.down_proj"), h, i, false, cols(i))?,
            moe,
            input,
            scalar: ck.get_f32(&format!("{p}.layer_scalar"), 1)?[0],
            shard,
        })
    }

    pub(crate) fn heads(&self) -> Heads {
        let hd = self.spec.head_dim;
        Heads { heads: self.q.out / hd, kv_heads: self.spec.kv_heads, head_dim: hd }
    }

    /// `y` summed over the ranks in rank order (`y` itself on a whole model): what a
    /// column-split projection gives before a norm may read it.
    fn reduced(&self, be: &B, y: B::Act, m: usize, h: usize) -> Result<B::Act> {
        match &self.shard {
            Some(shard) => shard.sum(be, &y, m, h),
            None => Ok(y),
        }
    }

    /// `q_norm(q(n(x)))`, and `(k_norm(k(n(x))), v_norm(v(n(x))))` when the layer stores
    /// K/V (V from K's projection before its norm with K = V). No RoPE yet.
    #[allow(clippy::type_complexity)]
    pub(crate) fn qkv(
        &self,
        be: &B,
        c: &Config,
        x: &B::Act,
        m: usize,
    ) -> Result<(B::Act, Option<(B::Act, B::Act)>)> {
        let (h, eps, hd) = (c.hidden_size, c.rms_norm_eps, self.spec.head_dim);
        let mut normed = be.alloc(m * h)?;
        be.rms_norm(x, &self.input_norm, eps, &mut normed, h, 0)?;
        let q_raw = self.q.forward(be, &normed, m)?;
        let mut q = be.alloc(m * self.q.out)?;
        be.rms_norm(&q_raw, &self.q_norm, eps, &mut q, hd, 0)?;
        let Some(OwnKv { k: k_proj, v: v_proj, k_norm }) = &self.kv else { return Ok((q, None)) };
        let k_raw = k_proj.forward(be, &normed, m)?;
        let v_own = match v_proj {
            Some(v) => Some(v.forward(be, &normed, m)?),
            None => None,
        };
        let kvd = m * self.spec.kv_heads * hd;
        let (mut k, mut v) = (be.alloc(kvd)?, be.alloc(kvd)?);
        be.rms_norm(v_own.as_ref().unwrap_or(&k_raw), &self.ones, eps, &mut v, hd, 0)?;
        be.rms_norm(&k_raw, k_norm, eps, &mut k, hd, 0)?;
        Ok((q, Some((k, v))))
    }

    /// Everything after attention: `x += post_attn_norm(o(attn))`, the MLP (and experts),
    /// the per-layer input, the layer scalar.
    pub(crate) fn finish(
        &self,
        be: &B,
        c: &Config,
        x: &mut B::Act,
        attn: &B::Act,
        m: usize,
        input: Option<&B::Act>,
    ) -> Result<()> {
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let mut normed = be.alloc(m * h)?;
        let a = self.reduced(be, self.o.forward(be, attn, m)?, m, h)?;
        be.rms_norm(&a, &self.post_attn_norm, eps, &mut normed, h, 0)?;
        be.add(x, &normed)?;
        be.rms_norm(x, &self.pre_ff_norm, eps, &mut normed, h, 0)?;
        let mut g = self.gate.forward(be, &normed, m)?;
        be.gelu_tanh_mul(&mut g, &self.up.forward(be, &normed, m)?)?;
        let mut f = self.reduced(be, self.down.forward(be, &g, m)?, m, h)?;
        if let Some(moe) = &self.moe {
            let mut dense = be.alloc(m * h)?;
            be.rms_norm(&f, &moe.post_norm_dense, eps, &mut dense, h, 0)?;
            let experts = self.reduced(be, moe.forward(be, x, m, h, eps)?, m, h)?;
            be.rms_norm(&experts, &moe.post_norm, eps, &mut f, h, 0)?;
            be.add(&mut f, &dense)?;
        }
        be.rms_norm(&f, &self.post_ff_norm, eps, &mut normed, h, 0)?;
        be.add(x, &normed)?;
        if let (Some(li), Some(input)) = (&self.input, input) {
            let mut g = li.gate.forward(be, x, m)?;
            be.gelu_tanh_mul(&mut g, input)?;
            let p = li.proj.forward(be, &g, m)?;
            be.rms_norm(&p, &li.post_norm, eps, &mut normed, h, 0)?;
            be.add(x, &normed)?;
        }
        be.scale(x, self.scalar)
    }
}
