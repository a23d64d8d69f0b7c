//! Gemma 4: the three tiny targets written by transformers 5.17 (dense with K = V global
//! layers; E-style with per-layer inputs, KV-shared layers and double-wide MLPs; MoE)
//! against their golden outputs, and the engine's guarantees across the sliding window.

mod common;

use std::path::{Path, PathBuf};

use mtp::engine::{prefill, EngineOptions, Request};
use mtp::model::Model;
use serde_json::Value;

const TARGETS: [&str; 3] = ["gemma4-dense-target", "gemma4-e-target", "gemma4-moe-target"];

fn gemma(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4").join(name)
}

fn golden(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Steps before the first whose top-2 margin is below 1e-4.
fn trusted_steps(margins: &Value) -> usize {
    let m = margins.as_array().unwrap();
    m.iter().position(|m| m.as_f64().unwrap() < 1e-4).unwrap_or(m.len())
}

#[test]
fn prefill_logits_match_transformers() {
    for name in TARGETS {
        let dir = gemma(name);
        let model = common::load(&dir);
        let g = golden(&dir);
        for (p, want) in
            g["prompts"].as_array().unwrap().iter().zip(g["prefill_last_logits"].as_array().unwrap())
        {
            let mut cache = model.new_cache();
            let (got, _) = prefill(&model, &mut cache, &ids(p), 5, false).unwrap();
            let want: Vec<f32> =
                want.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            println!("{name}: prefill logits within {worst:e} of transformers");
            assert!(worst < 1e-4, "{name}: prefill logits differ by {worst}");
        }
    }
}

#[test]
fn greedy_tokens_match_transformers() {
    for name in TARGETS {
        let dir = gemma(name);
        let model = common::load(&dir);
        let g = golden(&dir);
        let prompts = g["prompts"].as_array().unwrap();
        let n = g["greedy"][0].as_array().unwrap().len();
        let requests: Vec<Request> =
            prompts.iter().enumerate().map(|(i, p)| common::request(&i.to_string(), ids(p), n)).collect();
        let opts = EngineOptions { max_batch: 3, prefill_chunk: 5, ..EngineOptions::default() };
        let out = common::run(&model, None, opts, &requests, &[]);
        for (i, res) in out.into_iter().enumerate() {
            let got = res.unwrap().tokens;
            let want = ids(&g["greedy"][i]);
            let upto = trusted_steps(&g["margins"][i]);
            println!("{name} prompt {i}: {upto} trusted steps");
            assert_eq!(got[..upto], want[..upto], "{name} prompt {i}: greedy tokens differ");
        }
    }
}

#[allow(dead_code)]
fn unused(_: &Model) {}
