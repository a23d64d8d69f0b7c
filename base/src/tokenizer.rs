//! `tokenizer.json` through the tokenizers crate, checked against the model it serves
//! ([`Tokenizer::for_model`]): its ids must lie inside the model's embedding and hold the
//! EOS and BOS ids config.json names. A vocabulary padded above the tokenizer (Qwen's 151,936
//! rows for 151,665 tokens) is fine, but decoding an id the tokenizer lacks is an error
//! naming the id, never text with the token silently left out.
//!
//! Contract: [`Tokenizer::encode`] and [`Tokenizer::encode_plain`] tokenize exactly as HF
//! does (special-token text becomes the special token); [`Tokenizer::encode_literal`]
//! tokenizes special-token text as ordinary text, so text from an untrusted source can
//! never produce a control token; [`Tokenizer::max_bytes_per_token`] bounds how many bytes
//! of text one token can stand for, so a text too long for a context is known without
//! tokenizing it.

mod bound;
mod specials;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use specials::Specials;

use crate::config::Config;
use crate::error::{Error, Result};

/// Every `added_tokens` entry got the id the file gives it: the tokenizers crate gives an
/// added token whose id the vocabulary already uses a fresh id past the end, which a later
/// check then reported as an id the file never names.
fn check_added_ids(bytes: &[u8], inner: &tokenizers::Tokenizer) -> std::result::Result<(), String> {
    #[derive(serde::Deserialize)]
    struct Added {
        id: u32,
        content: String,
    }
    #[derive(serde::Deserialize)]
    struct File {
        #[serde(default)]
        added_tokens: Vec<Added>,
    }
    // The crate parsed the same bytes, so a parse error here cannot happen; none is reported.
    let Ok(file) = serde_json::from_slice::<File>(bytes) else { return Ok(()) };
    for t in &file.added_tokens {
        let got = inner.token_to_id(&t.content);
        if got != Some(t.id) {
            let holder = inner.id_to_token(t.id).map_or("nothing".into(), |h| format!("`{h}`"));
            let loaded = got.map_or("no id".into(), |g| format!("id {g}"));
            return Err(format!(
                "added token `{}` declares id {}, which the vocabulary gives to {holder}; it loads as {loaded}: \
                 an id must not be reused",
                t.content, t.id
            ));
        }
    }
    Ok(())
}

/// The most bytes a text may take after the normalizer, at its worst case: real
/// normalizers grow text at most a few dozen times, so only texts of megabytes (far past
/// any context) meet it; a normalizer that multiplies text meets it on short ones.
const MAX_NORMALIZED_BYTES: usize = 256 << 20;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with special-token text encoded as text; built on first use (a second copy
    /// of a large vocabulary is only worth its memory once someone needs it).
    literal: OnceLock<tokenizers::Tokenizer>,
    specials: Specials,
    max_bytes_per_token: Option<usize>,
    /// How many times longer the normalizer may make a text ([`bound::max_growth`]).
    max_growth: usize,
    path: PathBuf,
    /// One past the largest id, added tokens included.
    id_end: usize,
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        // A GGUF's vocabulary is in its metadata.
        if crate::gguf::is_gguf(dir) {
            return Tokenizer::from_bytes(dir.to_path_buf(), &crate::gguf::tokenizer_json(dir)?);
        }
        let path = dir.join("tokenizer.json");
        if !crate::files::present(&path) {
            return Err(Error::io(&path, std::io::Error::new(std::io::ErrorKind::NotFound, "not found")));
        }
        let bytes = crate::files::read_bounded(&path, crate::files::MAX_TOKENIZER_BYTES)?;
        Tokenizer::from_bytes(path, &bytes)
    }

    /// A tokenizer from `tokenizer.json` bytes; `path` is where they came from, for errors.
    fn from_bytes(path: PathBuf, bytes: &[u8]) -> Result<Tokenizer> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| Error::Tokenizer { path: path.clone(), msg: e.to_string() })?;
        check_added_ids(bytes, &inner).map_err(|msg| Error::Tokenizer { path: path.clone(), msg })?;
        let specials = Specials::new(
            inner
                .get_added_tokens_decoder()
                .into_iter()
                .filter(|(_, t)| t.special)
                .map(|(id, t)| (t.content, id)),
        );
        let max_bytes_per_token = bound::max_bytes_per_token(&inner);
        let max_growth = bound::max_growth(&inner);
        let id_end = inner.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1);
        Ok(Tokenizer {
            inner,
            literal: OnceLock::new(),
            specials,
            max_bytes_per_token,
            max_growth,
            path,
            id_end,
        })
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
        if crate::files::present(&dir.join("tokenizer.json")) || crate::gguf::is_gguf(dir) {
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

    /// The special (control) tokens' texts and ids.
    pub fn specials(&self) -> &Specials {
        &self.specials
    }

    /// At most how many bytes of text one token stands for, or `None` when this tokenizer
    /// may drop or fuse text without bound (a whitespace-splitting pre-tokenizer, a
    /// normalizer that strips, WordPiece's unknown words). A text of more than
    /// `context * max_bytes_per_token` bytes cannot fit `context` tokens.
    pub fn max_bytes_per_token(&self) -> Option<usize> {
        self.max_bytes_per_token
    }

    /// Encodes text the way HF does by default (with the tokenizer's special tokens).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.run(&self.inner, text, true)
    }

    /// Encodes text without adding the tokenizer's special tokens (a rendered chat template
    /// already holds them, as `apply_chat_template` assumes).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.run(&self.inner, text, false)
    }

    /// Encodes text as [`Tokenizer::encode_plain`] does, except that the text of a special
    /// token is tokenized as ordinary text: no control token can come out.
    pub fn encode_literal(&self, text: &str) -> Result<Vec<u32>> {
        let literal = self.literal.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        self.run(literal, text, false)
    }

    fn run(&self, t: &tokenizers::Tokenizer, text: &str, add_special: bool) -> Result<Vec<u32>> {
        if text.len().saturating_mul(self.max_growth) > MAX_NORMALIZED_BYTES {
            return Err(Error::Tokenizer {
                path: self.path.clone(),
                msg: format!(
                    "encode: the text is {} bytes and this tokenizer's normalizer may make a text {} times \
                     longer, past the {} MiB a normalized text may take",
                    text.len(),
                    self.max_growth,
                    MAX_NORMALIZED_BYTES >> 20
                ),
            });
        }
        t.encode(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::Tokenizer { path: self.path.clone(), msg: format!("encode: {e}") })
    }

    /// Whether `id` has a token (ids of a vocabulary padded past the tokenizer do not).
    pub fn has_id(&self, id: u32) -> bool {
        self.inner.id_to_token(id).is_some()
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

    /// Decodes ids as [`Tokenizer::decode`] does, except that the special tokens in `keep`
    /// come out as their text (a tool-call or reasoning marker a parser must see); the
    /// other special tokens are left out. One decode of the whole sequence, so a decoder
    /// that treats the first token apart does so once.
    pub fn decode_keeping(&self, ids: &[u32], keep: &[u32]) -> Result<String> {
        if keep.is_empty() {
            return self.decode(ids);
        }
        if let Some(id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return self.decode(&[*id]);
        }
        let kept: Vec<u32> =
            ids.iter().copied().filter(|&id| !self.specials.has_id(id) || keep.contains(&id)).collect();
        self.inner
            .decode(&kept, false)
            .map_err(|e| Error::Tokenizer { path: self.path.clone(), msg: format!("decode: {e}") })
    }
}
