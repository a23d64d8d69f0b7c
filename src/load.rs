//! The target, its tokenizer and the drafter, as `mtp generate`, `mtp serve` and the Python
//! binding name them: one place turns the flags (or the binding's arguments) into a loaded
//! model and a drafter, so every entry point refuses the same things with the same words.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use mtp_base::{hub, Tokenizer};
use mtp_drafter::{AssistantDrafter, DraftModelDrafter, Drafter, Eagle3Drafter, MtpDrafter, NgramDrafter};
use mtp_kernels::Backend;
use mtp_model::Model;

/// How the target is loaded (`--target`, `--backend`, `--kv-dtype`, `--kv-bits`,
/// `--activations`, `--tensor-parallel`).
#[derive(Clone, Debug)]
pub struct TargetOptions {
    /// A directory, a `.gguf` file or a Hugging Face repo id (none: the shipped family).
    pub target: Option<PathBuf>,
    pub backend: String,
    pub kv_dtype: String,
    pub kv_bits: Option<usize>,
    pub activations: String,
    pub tensor_parallel: usize,
}

impl Default for TargetOptions {
    fn default() -> Self {
        TargetOptions {
            target: None,
            backend: "cpu".into(),
            kv_dtype: "auto".into(),
            kv_bits: None,
            activations: "auto".into(),
            tensor_parallel: 1,
        }
    }
}

/// A loaded target: where it came from, the model, and its tokenizer when it has one.
pub struct Loaded {
    pub dir: PathBuf,
    pub model: Arc<Model>,
    pub tokenizer: Option<Tokenizer>,
}

impl TargetOptions {
    /// The target checkpoint, loaded on the backend, and its tokenizer when it has one.
    pub fn load(&self) -> Result<Loaded> {
        let backend = self.backend.parse::<Backend>()?;
        mtp_model::registry::check(backend)?;
        let dir = crate::target_dir(self.target.as_deref())?;
        let model = Arc::new(Model::load_parallel(
            &dir,
            backend,
            crate::numerics(&self.kv_dtype, self.kv_bits, &self.activations)?,
            self.tensor_parallel,
        )?);
        let tokenizer = Tokenizer::for_model(&dir, &model.config)?;
        if tokenizer.is_none() {
            tracing::warn!(
                "{}: no tokenizer.json; text prompts, stop strings and output text are unavailable",
                dir.display()
            );
        }
        Ok(Loaded { dir, model, tokenizer })
    }
}

/// Which drafter runs (`--drafter`, `--draft`, `--ngram-min`, `--ngram-max`).
#[derive(Clone, Debug)]
pub struct DrafterOptions {
    /// auto, none, draft-model, mtp, eagle3, assistant or ngram.
    pub drafter: String,
    /// The draft checkpoint: a directory or a Hugging Face repo id.
    pub draft: Option<PathBuf>,
    pub ngram_min: usize,
    pub ngram_max: usize,
}

impl Default for DrafterOptions {
    fn default() -> Self {
        DrafterOptions { drafter: "auto".into(), draft: None, ngram_min: 1, ngram_max: 4 }
    }
}

impl DrafterOptions {
    /// The drafter named, for the target loaded from `target_dir` (none: plain decoding).
    pub fn make(&self, target_dir: &Path, target: &Arc<Model>) -> Result<Option<Box<dyn Drafter>>> {
        let drafter = self.drafter.as_str();
        if self.draft.is_some() && ["none", "auto", "ngram"].contains(&drafter) {
            bail!("--draft goes with --drafter draft-model, mtp, eagle3 or assistant; --drafter {drafter} reads no checkpoint");
        }
        Ok(match drafter {
            "none" => None,
            "auto" => {
                if target.config.num_nextn_predict_layers == 0 {
                    None
                } else {
                    Some(Box::new(MtpDrafter::load(target_dir, target.clone())?))
                }
            }
            "ngram" => {
                Some(Box::new(NgramDrafter::new(self.ngram_min, self.ngram_max).with_context(|| {
                    format!("--ngram-min {} --ngram-max {}", self.ngram_min, self.ngram_max)
                })?))
            }
            "draft-model" => {
                let dir = self.draft_dir()?.context("--drafter draft-model needs --draft DIR")?;
                Some(Box::new(DraftModelDrafter::load(&dir, target_dir, target)?))
            }
            "mtp" => {
                let dir = self.draft_dir()?.unwrap_or_else(|| target_dir.to_path_buf());
                Some(Box::new(MtpDrafter::load(&dir, target.clone())?))
            }
            "eagle3" => {
                let dir =
                    self.draft_dir()?.context("--drafter eagle3 needs --draft DIR (the EAGLE-3 head)")?;
                Some(Box::new(Eagle3Drafter::load(&dir, target.clone())?))
            }
            "assistant" => {
                let dir = self
                    .draft_dir()?
                    .context("--drafter assistant needs --draft DIR (the assistant checkpoint)")?;
                Some(Box::new(AssistantDrafter::load(&dir, target.clone())?))
            }
            other => {
                bail!("unknown --drafter `{other}` (auto, none, draft-model, mtp, eagle3, assistant, ngram)")
            }
        })
    }

    /// `--draft`: a directory as is, a Hugging Face repo id as its snapshot in the cache.
    fn draft_dir(&self) -> Result<Option<PathBuf>> {
        Ok(self.draft.as_deref().map(hub::resolve_from_env).transpose()?)
    }
}

/// How the engine batches and drafts (`--max-batch`, `--k`, `--max-k`, `--kv-budget-mib`,
/// `--prefill-chunk`).
#[derive(Clone, Debug)]
pub struct BatchOptions {
    pub max_batch: usize,
    pub k: crate::KArg,
    pub max_k: usize,
    pub kv_budget_mib: Option<usize>,
    /// Prompt tokens per forward (none: 2048 on cuda, 64 elsewhere).
    pub prefill_chunk: Option<usize>,
}

impl BatchOptions {
    /// The engine's options for a target on `backend` (the rest at their defaults).
    pub fn engine_options(&self, backend: &str) -> mtp_engine::EngineOptions {
        mtp_engine::EngineOptions {
            max_batch: self.max_batch,
            prefill_chunk: self.prefill_chunk.unwrap_or(if backend == "cuda" { 2048 } else { 64 }),
            k: self.k.with_max(self.max_k),
            kv_budget_bytes: self.kv_budget_mib.map(|m| m << 20),
            ..mtp_engine::EngineOptions::default()
        }
    }
}
