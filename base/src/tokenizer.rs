//! `tokenizer.json` through the tokenizers crate.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::io(&path, std::io::Error::new(std::io::ErrorKind::NotFound, "not found")));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer { path: path.clone(), msg: e.to_string() })?;
        Ok(Tokenizer { inner, path })
    }

    /// The tokenizer of `dir`, or `None` when it has no `tokenizer.json`; a file that is
    /// there but cannot be read or parsed is an error naming it.
    pub fn from_dir_if_present(dir: &Path) -> Result<Option<Tokenizer>> {
        if dir.join("tokenizer.json").exists() {
            Tokenizer::from_dir(dir).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The `tokenizer.json` it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The underlying Hugging Face tokenizer (for adapters such as grammar masks).
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token string -> id, added tokens included (to compare two tokenizers).
    pub fn vocab(&self) -> std::collections::HashMap<String, u32> {
        self.inner.get_vocab(true)
    }

    /// Encodes text the way HF does by default (with the tokenizer's special tokens).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.inner
            .encode(text, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::Tokenizer { path: self.path.clone(), msg: format!("encode: {e}") })
    }

    /// Encodes text without adding the tokenizer's special tokens (a rendered chat template
    /// already holds them, as `apply_chat_template` assumes).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::Tokenizer { path: self.path.clone(), msg: format!("encode: {e}") })
    }

    /// Decodes ids to text, leaving out special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer { path: self.path.clone(), msg: format!("decode: {e}") })
    }
}
