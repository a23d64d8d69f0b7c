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

const ASSISTANTS: [&str; 4] = [
    "gemma4-dense-assistant",
    "gemma4-dense-assistant-ordered",
    "gemma4-e-assistant",
    "gemma4-e-assistant-ordered",
];

/// Every round transformers' assisted generation recorded, reproduced draft for draft.
///
/// transformers feeds its assistant more than the accepted history, and the test rebuilds
/// exactly that: the target's K/V come from the last verify pass over the previous history
/// and *all* its drafts (`S`), so a full layer also sees position `L - 1` (a rejected
/// draft) and a sliding layer the last `W + 1` of `[s, e]` with `s = max(0, L' - W)` and
/// `e = min(|S| - 1, s + L - 1)` (its cropped cache sliced from the start); the first
/// round after the prompt starts from the hidden state at position 0, later rounds from
/// position `L - 2`. Every step queries at `L - 1`. The engine itself reads only the
/// committed prefix (`Gemma4Assistant::key_ranges`); the step math is the same.
#[test]
fn assistant_drafts_match_transformers_rounds() {
    use mtp::model::gemma4::assistant::{AssistantRow, Gemma4Assistant};
    use mtp::model::kernels::argmax;
    use std::sync::Arc;
    for name in ASSISTANTS {
        let dir = gemma(name);
        let g = golden(&dir);
        let target = Arc::new(common::load(&gemma(g["target"].as_str().unwrap())));
        let assistant = Gemma4Assistant::load(&dir, target.clone()).unwrap();
        let w = 8;
        let (mut rounds, mut steps, mut trusted_rounds) = (0, 0, 0);
        for run in g["runs"].as_array().unwrap() {
            let mut prev: Option<(Vec<u32>, Vec<u32>)> = None;
            for round in run["rounds"].as_array().unwrap() {
                let history = ids(&round["history"]);
                let drafts = ids(&round["drafts"]);
                let l = history.len();
                let (seq, s) = match &prev {
                    None => (history[..l - 1].to_vec(), 0),
                    Some((h, d)) => ([h.clone(), d.clone()].concat(), h.len().saturating_sub(w)),
                };
                let e = (seq.len() - 1).min(s + l - 1);
                let mut cache = target.new_cache();
                let (_, hidden) = prefill(&target, &mut cache, &seq[..e + 1], 7, true).unwrap();
                let hb = assistant.backbone_hidden();
                let at = if prev.is_none() { 0 } else { l - 2 };
                let mut hid = hidden[at * hb..(at + 1) * hb].to_vec();
                let mut token = history[l - 1];
                let margins = round["draft_margins"].as_array().unwrap();
                let trusted = margins.iter().position(|m| m.as_f64().unwrap() < 1e-4).unwrap_or(drafts.len());
                for (j, &want) in drafts.iter().enumerate().take(trusted) {
                    let row = AssistantRow {
                        token,
                        hidden: &hid,
                        pos: l - 1,
                        full: (&cache, 0..l.min(seq.len())),
                        sliding: Some((&cache, e.saturating_sub(w).max(s)..e + 1)),
                    };
                    let out = assistant.step(&[row]).unwrap().pop().unwrap();
                    token = argmax(&out.logits);
                    assert_eq!(token, want, "{name}: round with history {l}, draft {j}");
                    hid = out.hidden;
                    steps += 1;
                }
                rounds += 1;
                trusted_rounds += usize::from(trusted == drafts.len());
                prev = Some((history, drafts));
            }
        }
        println!("{name}: {rounds} rounds ({trusted_rounds} without a near-tie), {steps} drafts equal to transformers'");
        assert!(steps > rounds, "{name}: too few drafts compared");
    }
}
