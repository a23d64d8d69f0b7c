//! The one error type of the workspace: each variant names the file, key, tensor, flag or
//! request at fault.

use std::path::PathBuf;

/// Everything that can go wrong loading or running a model. Each variant names the file,
/// key, tensor or request involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: invalid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: expected a JSON object, got {got}")]
    NotAnObject { path: PathBuf, got: &'static str },
    #[error("{path}: key `{key}`: {msg}")]
    Config { path: PathBuf, key: String, msg: String },
    #[error("{path}: key `architectures`: unknown architecture `{arch}` (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma4ForCausalLM, Gemma4ForConditionalGeneration)")]
    UnknownArchitecture { path: PathBuf, arch: String },
    #[error("{path}: invalid safetensors file: {msg}")]
    Safetensors { path: PathBuf, msg: String },
    #[error("{path}: invalid GGUF file: {msg}")]
    Gguf { path: PathBuf, msg: String },
    #[error("{dir}: missing tensor `{name}`")]
    MissingTensor { dir: PathBuf, name: String },
    /// Tensors a checkpoint holds that the loaded architecture never read: the checkpoint
    /// and its config.json describe different models.
    #[error("{dir}: {count} tensor(s) that {reader} does not read: {names}; {hint}")]
    UnreadTensors { dir: PathBuf, reader: String, count: usize, names: String, hint: String },
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape { path: PathBuf, name: String, got: Vec<usize>, expected: Vec<usize> },
    #[error("{path}: tensor `{name}` has dtype {dtype}, supported: F32, BF16, F16")]
    TensorDtype { path: PathBuf, name: String, dtype: String },
    #[error("{path}: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    #[error("request {request}: {msg}")]
    Request { request: String, msg: String },
    #[error("backend: {0}")]
    Backend(String),
    /// A Hugging Face repo id that could not be resolved to a checkpoint directory.
    #[error("Hugging Face repo `{id}`: {msg}")]
    Hub { id: String, msg: String },
    /// An option or argument outside what it can mean (a batch of zero rows, say).
    #[error("{0}")]
    InvalidOption(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    pub fn config(path: impl Into<PathBuf>, key: &str, msg: impl Into<String>) -> Self {
        Error::Config { path: path.into(), key: key.to_string(), msg: msg.into() }
    }

    /// This error with its config key (if any) put under `prefix` (`text_config`), for
    /// settings read from a nested object.
    pub fn under(self, prefix: &str) -> Self {
        match self {
            Error::Config { path, key, msg } => Error::Config { path, key: format!("{prefix}.{key}"), msg },
            other => other,
        }
    }
}
