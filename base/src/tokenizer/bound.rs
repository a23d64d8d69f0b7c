//! How many bytes of text one token can stand for at most, read off the tokenizer's
//! parts; `None` when some part may drop text or fuse unboundedly much of it into one
//! token, so that no byte bound holds.
//!
//! Why the bound holds: every byte of text reaches the model (byte-level BPE with every
//! byte in the vocabulary, byte fallback with every `<0xNN>`, or an unknown token per
//! character), and a vocabulary entry's UTF-8 length is at least the bytes it stands for
//! (byte-level entries spell a byte as one character of 1 or 2 bytes, SentencePiece's `▁`
//! of 3 bytes is one space, `<0x41>` one byte). A normalizer may shrink text, at most 4
//! to 1 (NFC/NFKC and lowercase map one character of up to 4 bytes to at least 1 byte);
//! `Replace` is kept only where its replacement is no shorter than its pattern.

use serde_json::Value;
use tokenizers::models::ModelWrapper;

pub(super) fn max_bytes_per_token(t: &tokenizers::Tokenizer) -> Option<usize> {
    let normalizer = t.get_normalizer().map(serde_json::to_value).transpose().ok()?;
    let pre = t.get_pre_tokenizer().map(serde_json::to_value).transpose().ok()?;
    let shrink = match &normalizer {
        None => 1,
        Some(n) => normalizer_shrink(n)?,
    };
    if !pre.as_ref().is_none_or(keeps_text) {
        return None;
    }
    let vocab = t.get_vocab(true);
    let has_bytes = |f: &dyn Fn(u8) -> String| (0..=255u8).all(|b| vocab.contains_key(&f(b)));
    let byte_level = [&normalizer, &pre].iter().any(|p| p.as_ref().is_some_and(mentions_byte_level));
    let every_byte_reaches = match t.get_model() {
        ModelWrapper::BPE(b) => {
            (b.byte_fallback && has_bytes(&|b| format!("<{b:#04X}>")))
                || (byte_level && has_bytes(&|b| byte_level_char(b).to_string()))
                || (b.unk_token.is_some() && !b.fuse_unk)
        }
        ModelWrapper::Unigram(u) => u.byte_fallback() && has_bytes(&|b| format!("<{b:#04X}>")),
        // WordPiece makes one unknown token of a long word, WordLevel of any unknown word.
        _ => false,
    };
    if !every_byte_reaches {
        return None;
    }
    // An unknown character (up to 4 bytes) may be one unknown token.
    let longest = vocab.keys().map(String::len).max()?.max(4);
    longest.checked_mul(shrink)
}

/// The character byte-level BPE spells byte `b` with (GPT-2's table: printable bytes as
/// themselves, the others shifted past U+0100 in order).
fn byte_level_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return b as char;
    }
    let shift = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shift).unwrap_or('\u{FFFD}')
}

fn kind(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("")
}

fn mentions_byte_level(v: &Value) -> bool {
    kind(v) == "ByteLevel"
        || ["normalizers", "pretokenizers"]
            .iter()
            .any(|k| v.get(k).and_then(Value::as_array).is_some_and(|a| a.iter().any(mentions_byte_level)))
}

/// How much a normalizer may shrink text (1: never), or `None` when it may drop text.
fn normalizer_shrink(v: &Value) -> Option<usize> {
    match kind(v) {
        "Sequence" => v
            .get("normalizers")?
            .as_array()?
            .iter()
            .try_fold(1usize, |s, n| s.checked_mul(normalizer_shrink(n)?)),
        "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" => Some(4),
        "Prepend" | "ByteLevel" => Some(1),
        "Replace" => {
            let pattern = v.get("pattern")?.get("String")?.as_str()?;
            let content = v.get("content")?.as_str()?;
            (content.len() >= pattern.len()).then_some(1)
        }
        // Strip, StripAccents, BertNormalizer, Precompiled, regex Replace: may drop text.
        _ => None,
    }
}

/// Whether a pre-tokenizer keeps every byte of its input.
fn keeps_text(v: &Value) -> bool {
    match kind(v) {
        "Sequence" => {
            v.get("pretokenizers").and_then(Value::as_array).is_some_and(|a| a.iter().all(keeps_text))
        }
        "ByteLevel" | "Metaspace" | "Digits" | "UnicodeScripts" => true,
        "Split" | "Punctuation" => v.get("behavior").and_then(Value::as_str) != Some("Removed"),
        // Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop separators.
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{byte_level_char, max_bytes_per_token};
    use crate::Tokenizer;

    #[test]
    fn byte_level_table_is_gpt2s() {
        assert_eq!(byte_level_char(b'A'), 'A');
        assert_eq!(byte_level_char(0), '\u{100}');
        assert_eq!(byte_level_char(b' '), '\u{120}'); // `Ġ`
        assert_eq!(byte_level_char(b'\n'), '\u{10A}'); // `Ċ`
        assert_eq!(byte_level_char(0xAD), '\u{143}');
    }

    /// The trained family's byte-level BPE has a bound, and no token of its vocabulary
    /// decodes to more bytes than it.
    #[test]
    fn trained_tokenizer_is_bounded() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/trained/target");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let bound = tok.max_bytes_per_token().expect("byte-level BPE keeps every byte");
        let longest = (0..tok.vocab_size() as u32).map(|i| tok.decode(&[i]).unwrap().len()).max().unwrap();
        assert!(longest <= bound && bound <= 4 * longest.max(48), "longest {longest}, bound {bound}");
    }

    /// Parts that drop text (a whitespace-splitting pre-tokenizer, WordLevel's unknown
    /// words, a stripping normalizer) leave no bound.
    #[test]
    fn lossy_tokenizers_have_no_bound() {
        let make = |normalizer: &str, pre: &str, model: &str| {
            let json = format!(
                r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
                "normalizer":{normalizer},"pre_tokenizer":{pre},"post_processor":null,"decoder":null,
                "model":{model}}}"#
            );
            max_bytes_per_token(&json.parse::<tokenizers::Tokenizer>().unwrap())
        };
        let word_level = r#"{"type":"WordLevel","vocab":{"a":0,"[UNK]":1},"unk_token":"[UNK]"}"#;
        let bpe_unk = r#"{"type":"BPE","dropout":null,"unk_token":"[UNK]","continuing_subword_prefix":null,
            "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"vocab":{"a":0,"[UNK]":1},"merges":[]}"#;
        let split = r#"{"type":"Split","pattern":{"String":" "},"behavior":"Isolated","invert":false}"#;
        assert_eq!(make("null", r#"{"type":"Whitespace"}"#, word_level), None);
        assert_eq!(make("null", split, word_level), None);
        assert_eq!(make("null", split, bpe_unk), Some(5));
        assert_eq!(make(r#"{"type":"NFKC"}"#, split, bpe_unk), Some(20));
        assert_eq!(make(r#"{"type":"Strip","strip_left":true,"strip_right":true}"#, split, bpe_unk), None);
        assert_eq!(make("null", r#"{"type":"WhitespaceSplit"}"#, bpe_unk), None);
        let fused = bpe_unk.replace(r#""fuse_unk":false"#, r#""fuse_unk":true"#);
        assert_eq!(make("null", split, &fused), None);
    }
}
