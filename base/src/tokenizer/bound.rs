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
//!
//! [`max_growth`] bounds the other way: how many times longer a normalizer may make a text
//! (a `Replace` of `a` by a 100,000-byte string would turn a short prompt into gigabytes
//! before any token is counted).

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

/// At most how many times longer than its input the normalizer's output may be, in bytes
/// (saturating; 1 without a normalizer). Per part: NFKC/NFKD (and, generously, NFC/NFD and
/// a precompiled SentencePiece map, an NFKC variant) 11 (U+FDFA: 3 bytes to 33); a
/// lowercase or a byte-level spelling 2; BERT's normalizer 3 (spaces around each CJK
/// character); a `Replace` the replacement's length over the pattern's, or one more than
/// the replacement's for a regex (which may match an empty string); a `Prepend` one more
/// than its text (it prepends to each piece the added tokens leave); stripping parts 1.
pub(super) fn max_growth(t: &tokenizers::Tokenizer) -> usize {
    match t.get_normalizer().map(serde_json::to_value) {
        Some(Ok(n)) => normalizer_growth(&n),
        None => 1,
        Some(Err(_)) => usize::MAX,
    }
}

fn normalizer_growth(v: &Value) -> usize {
    let text_len = |key: &str| v.get(key).and_then(Value::as_str).map_or(usize::MAX, str::len);
    match kind(v) {
        "Sequence" => v
            .get("normalizers")
            .and_then(Value::as_array)
            .map_or(usize::MAX, |a| a.iter().fold(1usize, |g, n| g.saturating_mul(normalizer_growth(n)))),
        "NFC" | "NFD" | "NFKC" | "NFKD" | "Precompiled" => 11,
        "Lowercase" | "ByteLevel" => 2,
        "BertNormalizer" => 3,
        "Strip" | "StripAccents" => 1,
        "Prepend" => text_len("prepend").saturating_add(1),
        "Replace" => {
            let content = text_len("content");
            match v.get("pattern").and_then(|p| p.get("String")).and_then(Value::as_str) {
                Some(pattern) if !pattern.is_empty() => content.div_ceil(pattern.len()).max(1),
                _ => content.saturating_add(1),
            }
        }
        _ => usize::MAX,
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

    use super::{byte_level_char, max_bytes_per_token, max_growth};
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

    /// Real normalizers grow text a few times at most; a `Replace` by a long string, or
    /// replacements chained, grow it by their product.
    #[test]
    fn growth_multiplies_along_a_sequence() {
        let growth = |normalizer: &str| {
            let json = format!(
                r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
                "normalizer":{normalizer},"pre_tokenizer":null,"post_processor":null,"decoder":null,
                "model":{{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,
                "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"vocab":{{"a":0}},"merges":[]}}}}"#
            );
            max_growth(&json.parse::<tokenizers::Tokenizer>().unwrap())
        };
        let replace = |from: &str, to: &str| {
            format!(r#"{{"type":"Replace","pattern":{{"String":"{from}"}},"content":"{to}"}}"#)
        };
        assert_eq!(growth("null"), 1);
        // Llama's SentencePiece normalizer: a `▁` before each piece, spaces as `▁`.
        let llama = format!(
            r#"{{"type":"Sequence","normalizers":[{{"type":"Prepend","prepend":"▁"}},{}]}}"#,
            replace(" ", "▁")
        );
        assert_eq!(growth(&llama), 12);
        assert_eq!(growth(&replace("a", &"b".repeat(100_000))), 100_000);
        let doubling =
            format!(r#"{{"type":"Sequence","normalizers":[{}]}}"#, vec![replace("a", "aa"); 40].join(","));
        assert_eq!(growth(&doubling), 1 << 40);
        assert_eq!(growth(r#"{"type":"NFKC"}"#), 11);
    }
}
