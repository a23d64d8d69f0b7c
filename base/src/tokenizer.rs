//! `tokenizer.json` through the tokenizers crate, checked against the model it serves
//! ([`Tokenizer::for_model`]): its ids must lie inside the model's embedding and hold the
//! EOS and BOS ids config.json names. A vocabulary padded above the tokenizer (Qwen's 151,936
//! rows for 151,665 tokens) is fine, but decoding an id the tokenizer lacks is an error
//! naming the id, never text with the token silently left out.

use std::path::{Path, PathBuf};

use crate::config::Config;
use crate::error::{Error, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// One past the largest id, added tokens included.
    id_end: usize,
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::io(&path, std::io::Error::new(std::io::ErrorKind::NotFound, "not found")));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::Tokenizer { path: path.clone(), msg: e.to_string() })?;
        let id_end = inner.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1);
        Ok(Tokenizer { inner, path, id_end })
    }

    /// The tokenizer of `dir` when it has one, checked against the model `config` describes:
    /// an id past the embedding (`vocab_size`), or an EOS or BOS id the tokenizer lacks, is
    /// an error naming tokenizer.json and both sides.
    pub fn for_model(dir: &Path, config: &Config) -> Result<Option<Tokenizer>> {
        let Some(tok) = Tokenizer::from_dir_if_present(dir)? else { return Ok(None) };
        let bad = |msg: String| Err(Error::Tokenizer { path: tok.path.clone(), msg });
        if tok.id_end > config.vocab_size {
            return bad(format!(
                "holds ids up to {} ({} tokens) but config.json's vocab_size is {}: the model has no \
                 embedding for ids {} and up",
                tok.id_end - 1,
                tok.vocab_size(),
                config.vocab_size,
                config.vocab_size
            ));
        }
        let named = config.eos_token_ids.iter().map(|&id| ("eos_token_id", id));
        for (key, id) in named.chain(config.bos_token_id.map(|id| ("bos_token_id", id))) {
            if tok.inner.id_to_token(id).is_none() {
                return bad(format!(
                    "has no token with id {id}, which config.json or generation_config.json names as \
                     {key}: the tokenizer and the model do not belong together"
                ));
            }
        }
        Ok(Some(tok))
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

    /// Decodes ids to text, leaving out special tokens; an id the tokenizer lacks (one of
    /// the padding rows of a vocabulary larger than the tokenizer) is an error naming it.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(Error::Tokenizer {
                path: self.path.clone(),
                msg: format!(
                    "decode: token id {id} has no text in this tokenizer (its largest id is {}; the \
                     model's vocabulary is padded past it)",
                    self.id_end.saturating_sub(1)
                ),
            });
        }
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer { path: self.path.clone(), msg: format!("decode: {e}") })
    }
}
