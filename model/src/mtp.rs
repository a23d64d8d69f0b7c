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
//! The head's block is the dense family's (`crate::models::llama`); `crate::registry` loads
//! it. Only module 0 is loaded: further modules (`num_nextn_predict_layers > 1`) are unused,
//! since drafting applies module 0 recursively.

use mtp_base::error::Result;
use mtp_cache::RowCache;

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

/// An MTP head loaded for a target ([`MtpHead::load`], in `crate::registry`).
pub struct MtpHead {
    pub layout: MtpLayout,
    pub(crate) net: Box<dyn MtpNet>,
}

impl MtpHead {
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
