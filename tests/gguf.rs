//! GGUF files made by llama.cpp's own converter and quantizer
//! (`tests/fixtures/gguf/make_gguf_fixtures.py`): greedy tokens against llama.cpp's on the
//! same file, K-quant blocks dequantized against gguf-py's reference bit for bit, the
//! tokenizer from the metadata against the original tokenizer.json, and corrupt files
//! refused by name. Negative controls: llama's q/k permutation left in place, and a
//! K-quant scale unpacking done wrong, each break their test.

mod common;

use std::path::PathBuf;

use mtp::base::gguf::{self, reader::GgufFile, types};
use mtp::base::{Config, Tokenizer};
use mtp::engine::EngineOptions;
use mtp::kernels::{Activations, Backend, KvDtype, Numerics};
use mtp::model::Model;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf").join(name)
}

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("golden.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Where a step's top-1 minus top-2 margin in llama.cpp is below this, another correct
/// implementation may pick the other token, and from there the continuations part. On
/// llama.cpp's quantized file its Q4_0 and Q8_0 matmuls round the activations to 8 bits
/// (`vec_dot_q4_0_q8_0`), ours keep f32: logits move by up to a few 1e-2 (`QUANT_TIE`). On
/// the F32 file of the same weight values both compute in f32 (`F32_TIE`).
const QUANT_TIE: f64 = 0.05;
const F32_TIE: f64 = 1e-3;

/// Per golden prompt of `file`: (tokens of `model` agreeing with llama.cpp's `key` from the
/// start, steps before llama.cpp's first margin under `tie` in `margins`), and our tokens.
fn agreement(model: &Model, file: &str, key: &str, margins: &str, tie: f64) -> Vec<(usize, usize)> {
    let g = golden();
    let runs = g["files"][file].as_array().unwrap();
    let steps = g["steps"].as_u64().unwrap() as usize;
    let requests: Vec<_> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| common::request(&i.to_string(), ids(&r["prompt"]), steps))
        .collect();
    let opts = EngineOptions { max_batch: 2, prefill_chunk: 4, ..EngineOptions::default() };
    let out = common::run(model, None, opts, &requests, &[]);
    out.into_iter()
        .zip(runs)
        .map(|(res, r)| {
            let got = res.unwrap().tokens;
            let want = ids(&r[key]);
            let agree = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            let m = r[margins].as_array().unwrap();
            let trusted = m.iter().position(|m| m.as_f64().unwrap() < tie).unwrap_or(m.len());
            (agree, trusted)
        })
        .collect()
}

/// Both fixtures (llama Q4_0 with a Q8_0 tensor; qwen3 Q4_0 with BF16, F16 and Q8_0
/// tensors) give llama.cpp's greedy tokens up to its first near-tie on every prompt: on the
/// F32 file of the same weight values, and on the quantized file itself.
#[test]
fn greedy_tokens_match_llama_cpp() {
    // f32 K/V and activations, as llama_greedy keeps them.
    let f32 = Numerics { kv: KvDtype::F32, activations: Activations::F32 };
    for file in ["llama-q4_0.gguf", "qwen3-mixed.gguf"] {
        let model = Model::load_with(&fixture(file), common::backend(), f32).unwrap();
        for (key, margins, tie) in [("f32_greedy", "f32_margins", F32_TIE), ("greedy", "margins", QUANT_TIE)]
        {
            let got = agreement(&model, file, key, margins, tie);
            println!("{file} against llama.cpp's {key}: (tokens agreeing, steps before its first near-tie) {got:?}");
            for (i, (agree, trusted)) in got.into_iter().enumerate() {
                assert!(
                    agree >= trusted,
                    "{file} prompt {i}: {agree} tokens agree, {trusted} before a near-tie"
                );
            }
        }
    }
}

/// Control: llama's q/k rows left in llama.cpp's permuted order rotate the wrong pairs,
/// and the greedy tokens part from llama.cpp's early.
#[test]
fn greedy_tokens_differ_with_the_qk_permutation_left_in() {
    let path = fixture("llama-q4_0.gguf");
    let ck = gguf::checkpoint_with(&path, false).unwrap();
    let f32 = Numerics { kv: KvDtype::F32, activations: Activations::F32 };
    let model = Model::from_checkpoint(Config::from_dir(&path).unwrap(), &ck, Backend::Cpu, f32).unwrap();
    let got = agreement(&model, "llama-q4_0.gguf", "f32_greedy", "f32_margins", F32_TIE);
    println!("permutation left in: {got:?}");
    assert!(got.iter().any(|(agree, trusted)| agree < trusted), "{got:?}");
}

/// Q4_K, Q5_K and Q6_K blocks written by llama-quantize dequantize, through the repacking
/// into MLX's affine layout, to gguf-py's dequantization bit for bit (every scale, code
/// and bias exact: see `types`); a wrong unpacking of the 6-bit scales and mins does not.
#[test]
fn k_quant_blocks_dequantize_to_llama_cpp_bits() {
    let g = GgufFile::open(&fixture("kquants.gguf")).unwrap();
    for name in ["q4_k", "q5_k", "q6_k"] {
        let t = g.tensor(name).unwrap();
        let want = g.tensor(&format!("{name}.expected")).unwrap();
        let want: Vec<u32> =
            g.bytes(want).chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
        let (rows, cols) = (t.dims[1], t.dims[0]);
        let r = types::repack(t.ty, g.bytes(t), rows, cols);
        let got: Vec<u32> = types::dequantize(&r).iter().map(|v| v.to_bits()).collect();
        assert_eq!(got.len(), rows * cols);
        // Equal bits, but for the sign of a zero: llama.cpp's `d * 0` is -0 where `d` is
        // negative, `scale * q + bias` is +0 (`x + -x`); the matmul cannot tell them apart.
        let zero = |b: u32| b & 0x7fff_ffff == 0;
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b && !(zero(**a) && zero(**b))).count();
        assert_eq!(differ, 0, "{name}: {differ} of {} values differ from gguf-py's", got.len());
        if name != "q6_k" {
            // Control: sub-blocks 4-7 read like 0-3 (no high bits from the earlier bytes).
            let wrong = |j: usize, s: &[u8]| (s[j % 4 + 4 * (j / 4)] & 63, s[(j + 4) % 12] & 63);
            let r = types::repack_with(t.ty, g.bytes(t), rows, cols, wrong);
            let bad = types::dequantize(&r).iter().zip(&want).filter(|(a, b)| a.to_bits() != **b).count();
            assert!(bad > 0, "{name}: the wrong scale unpacking went unnoticed");
            println!("{name}: exact; with the wrong scale unpacking {bad} of {} values differ", got.len());
        }
    }
}

/// The tokenizer built from the GGUF's metadata encodes text, special tokens included, to
/// the ids the checkpoint's own tokenizer.json gives, and decodes them back alike.
#[test]
fn tokenizer_from_metadata_matches_tokenizer_json() {
    let hf = Tokenizer::from_dir(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny/qwen3-target"),
    )
    .unwrap();
    for file in ["llama-q4_0.gguf", "qwen3-mixed.gguf"] {
        let ours = Tokenizer::from_dir(&fixture(file)).unwrap();
        for text in [
            "Hello, world! fn main() { let x = 42; }",
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
            "  spaces   and\ttabs\n\nnewlines 12345 héllo wörld 日本語 🙂",
            "",
        ] {
            let want = hf.encode(text).unwrap();
            assert_eq!(ours.encode(text).unwrap(), want, "{file}: {text:?}");
            assert_eq!(
                ours.encode_literal(text).unwrap(),
                hf.encode_literal(text).unwrap(),
                "{file}: {text:?}"
            );
            assert_eq!(ours.decode(&want).unwrap(), hf.decode(&want).unwrap());
        }
        assert_eq!(ours.vocab(), hf.vocab(), "{file}: vocabularies differ");
        let cfg = Config::from_dir(&fixture(file)).unwrap();
        assert_eq!((cfg.eos_token_ids.clone(), cfg.bos_token_id), (vec![0], Some(1)), "{file}");
    }
}

/// Every cut of a GGUF short of its end, and every single corrupted count or length in its
/// header, is an error naming the file (and the tensor, for a tensor cut short), never a
/// panic or a silent load.
#[test]
fn truncated_and_corrupt_files_are_refused_by_name() {
    let src = fixture("qwen3-mixed.gguf");
    let bytes = std::fs::read(&src).unwrap();
    let dir = std::env::temp_dir().join(format!("mtp-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cut.gguf");
    let data_start = GgufFile::open(&src).unwrap().tensors.iter().map(|t| t.range.start).min().unwrap();
    let cuts = (0..data_start).step_by(331).chain([data_start + 1000, bytes.len() - 1]);
    for cut in cuts {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = match GgufFile::open(&path) {
            Ok(_) => panic!("a file cut at {cut} of {} bytes opened", bytes.len()),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("cut.gguf"), "cut at {cut}: {err}");
        if cut > data_start {
            assert!(err.contains("tensor `") && err.contains("truncated"), "{err}");
        }
    }
    // Counts and lengths set to huge values, one at a time (8-byte fields at 8, 16, 24 and
    // the first key's length).
    for at in [8usize, 16, 24] {
        let mut b = bytes.clone();
        b[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&path, &b).unwrap();
        let err = GgufFile::open(&path).err().expect("a corrupt count opened").to_string();
        assert!(err.contains("cut.gguf"), "{err}");
    }
    let missing = dir.join("missing.gguf");
    let err = Model::load(&missing).err().unwrap().to_string();
    assert!(err.contains("missing.gguf") && !err.contains("config.json"), "{err}");
    for bad in [&b"GGUG"[..], &[b'G', b'G', b'U', b'F', 1, 0, 0, 0]] {
        let mut b = bytes.clone();
        b[..bad.len()].copy_from_slice(bad);
        std::fs::write(&path, &b).unwrap();
        assert!(GgufFile::open(&path).is_err());
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The chat template comes from `tokenizer.chat_template`, with the BOS and EOS texts of
/// the ids the metadata names; a file without one has none.
#[test]
fn chat_template_from_metadata() {
    use mtp::server::chat::{ChatTemplate, Conversation};
    let t = ChatTemplate::from_dir(&fixture("qwen3-mixed.gguf")).unwrap().expect("a template");
    let source = std::fs::read_to_string(common::trained("target").join("chat_template.jinja")).unwrap();
    assert_eq!(t.source(), source);
    assert_eq!(t.special_texts(), [("bos_token", "<|im_start|>"), ("eos_token", "<|endoftext|>")]);
    let chat = Conversation {
        messages: vec![serde_json::json!({"role": "user", "content": "add two numbers"})],
        ..Conversation::default()
    };
    let want = ChatTemplate::from_source(source, "<|im_start|>".into(), "<|endoftext|>".into()).unwrap();
    assert_eq!(t.render(&chat).unwrap(), want.render(&chat).unwrap());
    assert!(ChatTemplate::from_dir(&fixture("llama-q4_0.gguf")).unwrap().is_none());
}

/// What the loader does not implement is refused naming the key or tensor: an unknown
/// architecture, a tensor type outside the supported ones (IQ4_NL: Q4_0's block size, so
/// the file stays well-formed), a tokenizer model or pre-tokenizer it cannot reproduce.
#[test]
fn unsupported_architectures_types_and_tokenizers_are_refused_by_name() {
    let bytes = std::fs::read(fixture("qwen3-mixed.gguf")).unwrap();
    let dir = std::env::temp_dir().join(format!("mtp-gguf-refused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The position just past string `s` (its u64 length, then its bytes) in the header.
    let after = |s: &str| {
        let mut pat = (s.len() as u64).to_le_bytes().to_vec();
        pat.extend_from_slice(s.as_bytes());
        bytes.windows(pat.len()).position(|w| w == pat).unwrap() + pat.len()
    };
    let patched = |name: &str, at: usize, new: &[u8]| {
        let mut b = bytes.clone();
        b[at..at + new.len()].copy_from_slice(new);
        let path = dir.join(name);
        std::fs::write(&path, b).unwrap();
        path
    };
    // general.architecture: the key, a u32 type, then the value string's length and text.
    let arch = patched("arch.gguf", after("general.architecture") + 4 + 8, b"qwen9");
    let err = Config::from_dir(&arch).err().unwrap().to_string();
    assert!(
        err.contains("general.architecture") && err.contains("qwen9") && err.contains("arch.gguf"),
        "{err}"
    );
    // qwen3.attention.head_count_kv: the key, a u32 type, then the u32 value.
    let kv = patched("kv.gguf", after("qwen3.attention.head_count_kv") + 4, &0u32.to_le_bytes());
    let err = Config::from_dir(&kv).err().unwrap().to_string();
    assert!(err.contains("metadata `qwen3.attention.head_count_kv`") && err.contains("positive"), "{err}");
    // blk.0.attn_q.weight's info: 2 dims (u32), dims (2 x u64), then its type.
    let ty = patched("type.gguf", after("blk.0.attn_q.weight") + 4 + 16, &20u32.to_le_bytes());
    let err = Model::load(&ty).err().unwrap().to_string();
    assert!(
        err.contains("blk.0.attn_q.weight") && err.contains("IQ4_NL") && err.contains("not supported"),
        "{err}"
    );
    for (key, value) in [("tokenizer.ggml.model", &b"gpt3"[..]), ("tokenizer.ggml.pre", b"gpt-3")] {
        let path = patched("tok.gguf", after(key) + 4 + 8, value);
        let err = Tokenizer::from_dir(&path).err().unwrap().to_string();
        assert!(err.contains(key) && err.contains(std::str::from_utf8(value).unwrap()), "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
