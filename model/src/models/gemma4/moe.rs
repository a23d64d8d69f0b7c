//! Gemma 4's routed experts (26B-A4B style), beside the dense MLP of every layer:
//! `router(x) -> top-k experts and weights`, `y = sum_e w_e * down_e(gelu(gate_e(x)) * up_e(x))`.
//!
//! Row invariance: the router is per token (its softmax and top-k run on the host, ties to
//! the lowest expert id), each expert's matmuls are the M-invariant `linear` over the
//! tokens routed to it, and a token's terms are added in ascending expert id. So a token's
//! result never depends on which other tokens share its experts.

use mtp_base::error::{Error, Result};
use mtp_base::weights::Weight;
use mtp_base::Checkpoint;
use mtp_kernels::{Kernels, Out};

use crate::forward::Proj;
use crate::tensor_parallel::Shard;

use super::config::Moe;

struct Expert<B: Kernels> {
    gate: Proj<B>,
    up: Proj<B>,
    down: Proj<B>,
}

pub(crate) struct MoeBlock<B: Kernels> {
    moe: Moe,
    router_scale: B::Vec,
    router: Proj<B>,
    per_expert_scale: Vec<f32>,
    /// `hidden_size^-0.5`.
    root: f32,
    pub(crate) pre_norm: B::Vec,
    pub(crate) post_norm_dense: B::Vec,
    pub(crate) post_norm: B::Vec,
    experts: Vec<Expert<B>>,
}

/// Per token: its experts in ascending id with their weights (softmax over all experts,
/// top-k with ties to the lowest id, renormalized over the k, times the expert's scale).
pub(crate) fn route(scores: &[f32], moe: Moe, per_expert_scale: &[f32]) -> Vec<Vec<(usize, f32)>> {
    scores
        .chunks(moe.experts)
        .map(|s| {
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = s.iter().map(|&v| (v - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            let probs: Vec<f32> = exps.iter().map(|&e| e / sum).collect();
            let mut order: Vec<usize> = (0..moe.experts).collect();
            // Stable sort: equal probabilities keep the lower expert id first.
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
            let top = &order[..moe.top_k];
            let total: f32 = top.iter().map(|&e| probs[e]).sum();
            let mut picked: Vec<(usize, f32)> =
                top.iter().map(|&e| (e, probs[e] / total * per_expert_scale[e])).collect();
            picked.sort_by_key(|&(e, _)| e);
            picked
        })
        .collect()
}

impl<B: Kernels> MoeBlock<B> {
    /// Loads `{p}.router.*`, `{p}.experts.*` and the block's three extra norms; on a
    /// tensor-parallel rank (`shard`), its columns of every expert (the router whole).
    pub(crate) fn load(
        be: &B,
        ck: &Checkpoint,
        p: &str,
        h: usize,
        moe: Moe,
        shard: Option<&Shard<B>>,
    ) -> Result<MoeBlock<B>> {
        let (e, i) = (moe.experts, moe.intermediate);
        // A rank's part of an expert's intermediate columns (of `i`).
        let part = shard.map_or(0..i, |s| s.even(i));
        let cols = |w: Weight| -> Result<Weight> {
            w.slice_cols(part.clone()).map_err(|err| Error::Backend(format!("{p}.experts.down_proj: {err}")))
        };
        let norm =
            |name: &str, n: usize| -> Result<B::Vec> { be.vector(&ck.get_f32(&format!("{p}.{name}"), n)?) };
        let slice = |w: &Weight, rows: std::ops::Range<usize>, name: &str| {
            w.slice_rows(rows).map_err(|err| Error::Backend(format!("{p}.experts.{name}: {err}")))
        };
        // transformers fuses gate and up (`experts.gate_up_proj`, `[e, 2i, h]`: each
        // expert's gate rows, then its up rows); mlx-lm splits them
        // (`experts.switch_glu.{gate,up,down}_proj.weight`, quantized or not).
        let mlx = format!("{p}.experts.switch_glu");
        let (gate_w, up_w, stride, up_at, down_w) = if ck.contains(&format!("{mlx}.gate_proj.weight")) {
            let get = |name: &str, shape| ck.get_stacked(&format!("{mlx}.{name}.weight"), shape);
            (get("gate_proj", [e, i, h])?, get("up_proj", [e, i, h])?, i, 0, get("down_proj", [e, h, i])?)
        } else {
            let fused = ck.get_stacked(&format!("{p}.experts.gate_up_proj"), [e, 2 * i, h])?;
            let down = ck.get_stacked(&format!("{p}.experts.down_proj"), [e, h, i])?;
            (fused.clone(), fused, 2 * i, i, down)
        };
        // Expert x's rows (of this rank's part) in a stacked gate or up tensor.
        let rows = |x: usize, at: usize| x * stride + at + part.start..x * stride + at + part.end;
        let experts = (0..e)
            .map(|x| {
                Ok(Expert {
                    gate: Proj::from_weight(be, &slice(&gate_w, rows(x, 0), "gate")?)?,
                    up: Proj::from_weight(be, &slice(&up_w, rows(x, up_at), "up")?)?,
                    down: Proj::from_weight(be, &cols(slice(&down_w, x * h..(x + 1) * h, "down")?)?)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MoeBlock {
            moe,
            router_scale: norm("router.scale", h)?,
            router: Proj::load(be, ck, &format!("{p}.router.proj"), e, h, false)?,
            per_expert_scale: ck.get_f32(&format!("{p}.router.per_expert_scale"), e)?,
            root: (h as f32).powf(-0.5),
            pre_norm: norm("pre_feedforward_layernorm_2.weight", h)?,
            post_norm_dense: norm("post_feedforward_layernorm_1.weight", h)?,
            post_norm: norm("post_feedforward_layernorm_2.weight", h)?,
            experts,
        })
    }

    /// The experts' sum for each of the `m` tokens of `x` (the residual stream before the
    /// MLP), before `post_norm`.
    pub(crate) fn forward(&self, be: &B, x: &B::Act, m: usize, h: usize, eps: f32) -> Result<B::Act> {
        let mut r = be.alloc(m * h)?;
        be.rms_norm(x, &self.router_scale, eps, &mut r, h, 0)?;
        be.scale(&mut r, self.root)?;
        let scores = be.download(self.router.forward(be, &r, m)?)?;
        let routes = route(&scores, self.moe, &self.per_expert_scale);
        let mut normed = be.alloc(m * h)?;
        be.rms_norm(x, &self.pre_norm, eps, &mut normed, h, 0)?;
        let mut out = be.upload(&vec![0.0; m * h])?;
        for (e, expert) in self.experts.iter().enumerate() {
            let (tokens, weights): (Vec<usize>, Vec<f32>) = routes
                .iter()
                .enumerate()
                .filter_map(|(t, picked)| picked.iter().find(|&&(x, _)| x == e).map(|&(_, w)| (t, w)))
                .unzip();
            if tokens.is_empty() {
                continue;
            }
            let xe = be.gather(&normed, h, &tokens)?;
            let n = tokens.len();
            let mut g = expert.gate.forward(be, &xe, n)?;
            be.gelu_tanh_mul(&mut g, &expert.up.forward(be, &xe, n)?)?;
            let mut y = be.alloc(n * h)?;
            be.linear(&g, n, &expert.down.w, None, &mut y, Out::Write)?;
            be.add_rows_scaled(&mut out, h, &y, &tokens, &weights)?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_to_the_lowest_expert_and_weights_renormalize() {
        let moe = Moe { experts: 4, top_k: 2, intermediate: 1 };
        let r = route(&[1.0, 2.0, 2.0, 2.0], moe, &[1.0, 1.0, 1.0, 3.0]);
        assert_eq!(r[0].iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((r[0][0].1 - 0.5).abs() < 1e-6 && (r[0][1].1 - 0.5).abs() < 1e-6);
        let r = route(&[0.0, 0.0, 5.0, 1.0], moe, &[1.0, 1.0, 1.0, 3.0]);
        assert_eq!(r[0][0].0, 2);
        assert_eq!(r[0][1].0, 3);
        // Renormalized over the two picked, then times expert 3's scale of 3.
        let (p2, p3) = (5f32.exp(), 1f32.exp());
        assert!(
            (r[0][1].1 - 3.0 * p3 / (p2 + p3)).abs() < 1e-6,
            "the per-expert scale multiplies the weight"
        );
        assert!((r[0][0].1 - p2 / (p2 + p3)).abs() < 1e-6);
    }
}
