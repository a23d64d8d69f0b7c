//! Greedy tokens and prefill logits against HF transformers (golden.json of hf-tiny).

mod common;

use common::{fixture, FAMILIES};
use mtp::engine::{prefill, EngineOptions, Request};
use mtp::model::Model;
use serde_json::Value;

fn golden(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn prefill_logits_match_transformers() {
    for name in FAMILIES {
        let model = Model::load(&fixture(name)).unwrap();
        let g = golden(name);
        for (p, want) in
            g["prompts"].as_array().unwrap().iter().zip(g["prefill_last_logits"].as_array().unwrap())
        {
            let mut cache = model.new_cache();
            let (got, _) = prefill(&model, &mut cache, &ids(p), 4, false).unwrap();
            let want: Vec<f32> =
                want.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
            assert_eq!(got.len(), want.len());
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst < 1e-4, "{name}: prefill logits differ by {worst}");
        }
    }
}

#[test]
fn greedy_tokens_match_transformers() {
    for name in FAMILIES {
        let model = Model::load(&fixture(name)).unwrap();
        let g = golden(name);
        let prompts = g["prompts"].as_array().unwrap();
        let requests: Vec<Request> =
            prompts.iter().enumerate().map(|(i, p)| common::request(&i.to_string(), ids(p), 40)).collect();
        let opts = EngineOptions { max_batch: 3, prefill_chunk: 5, ..EngineOptions::default() };
        let out = common::run(&model, None, opts, &requests, &[]);
        for (i, res) in out.into_iter().enumerate() {
            let got = res.unwrap().tokens;
            let want = ids(&g["greedy"][i]);
            let margins = g["margins"][i].as_array().unwrap();
            // Compare up to the first step where a correct f32 implementation may
            // legitimately pick the other token.
            let upto = margins.iter().position(|m| m.as_f64().unwrap() < 1e-4).unwrap_or(want.len());
            assert!(upto > 0);
            assert_eq!(got[..upto], want[..upto], "{name} prompt {i}: greedy tokens differ");
        }
    }
}
