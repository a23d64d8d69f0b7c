//! The token environment llguidance masks over, built from a `tokenizer.json` and our own
//! tokenizer (not `toktrie_hf_tokenizers`, which pins another `tokenizers` version).
//!
//! Contract: the trie has one entry per model token id `0..vocab_size` (ids the tokenizer
//! lacks become unreachable special tokens, so a mask's bit `t` is the model's token `t`),
//! and its EOS set is the model's EOS ids (config.json and generation_config.json), so a
//! completed grammar allows exactly what ends a row.

use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::ParserFactory;
use mtp_base::{Error, Tokenizer};

use crate::panics::guarded;

/// Byte strings of the model's tokens and the tokenizer that re-tokenizes forced text.
struct Env {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Valid UTF-8 through the tokenizer, anything else byte by byte through the trie.
        self.trie.tokenize_with_greedy_fallback(s, |text| match self.tokenizer.encode(text, false) {
            Ok(e) => e.get_ids().to_vec(),
            Err(_) => self.trie.greedy_tokenize(text.as_bytes()),
        })
    }
}

/// Compiles constraints for one model's vocabulary (built once, shared by every row).
pub struct Grammars {
    factory: ParserFactory,
    vocab_size: usize,
}

impl Grammars {
    /// The environment of `tokenizer` over a model vocabulary of `vocab_size` ids whose EOS
    /// ids are `eos` (at least one). Errors name the tokenizer file.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<Grammars, Error> {
        let path = tokenizer.path().to_path_buf();
        let fail =
            |msg: String| Error::Tokenizer { path: path.clone(), msg: format!("grammar masks: {msg}") };
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::Json { path: path.clone(), source: e })?;
        let mut words = guarded(|| llguidance::token_bytes_from_tokenizer_json(&json)).map_err(fail)?;
        if words.len() > vocab_size {
            // Tokens past the model's vocabulary can never be emitted: drop them.
            words.truncate(vocab_size);
        }
        while words.len() < vocab_size {
            // An id the tokenizer lacks: a special token no grammar reaches.
            let mut w = format!(".<[{}]>", words.len()).into_bytes();
            w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(w);
        }
        let Some((&first, _)) = eos.split_first() else {
            return Err(fail("the model has no EOS id to end a completed grammar".into()));
        };
        if let Some(&bad) = eos.iter().find(|&&e| e as usize >= vocab_size) {
            return Err(fail(format!("EOS id {bad} is outside the vocabulary of {vocab_size}")));
        }
        let info = TokRxInfo::new(vocab_size as u32, first);
        let tokenizer = tokenizer.hf().clone();
        let factory = guarded(move || {
            let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
            let env: TokEnv = Arc::new(Env { trie, tokenizer });
            let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
            factory.quiet();
            // Errors name the failing token and byte, without a dump of the parser state.
            factory.limits_mut().verbose_errors = false;
            Ok::<_, String>(factory)
        })
        .map_err(fail)?;
        Ok(Grammars { factory, vocab_size })
    }

    pub(crate) fn factory(&self) -> &ParserFactory {
        &self.factory
    }

    /// Model token ids the masks cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}
