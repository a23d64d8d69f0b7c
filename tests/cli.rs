//! `mtp generate` end to end: JSONL in, JSONL out in input order, errors per request.

mod common;

use std::process::Command;

fn mtp(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mtp")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn write_prompts(tag: &str, text: &str) -> String {
    let p = std::env::temp_dir().join(format!("mtp-cli-{tag}-{}.jsonl", std::process::id()));
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().into_owned()
}

#[test]
fn generate_is_identical_alone_and_batched() {
    let prompts = write_prompts(
        "batch",
        "{\"id\": \"a\", \"prompt\": \"def f(x):\"}\n{\"id\": \"b\", \"prompt_ids\": [5, 9, 200], \"max_tokens\": 7}\n\
         {\"id\": \"c\", \"prompt\": \"import os\\nimport sys\"}\n",
    );
    let target = common::fixture("llama-target");
    let t = target.to_str().unwrap();
    let (c1, alone, _) = mtp(&[
        "generate",
        "--target",
        t,
        "--prompts",
        &prompts,
        "--max-batch",
        "1",
        "--ignore-eos",
        "--max-tokens",
        "12",
    ]);
    let (c8, batched, _) = mtp(&[
        "generate",
        "--target",
        t,
        "--prompts",
        &prompts,
        "--max-batch",
        "8",
        "--prefill-chunk",
        "3",
        "--ignore-eos",
        "--max-tokens",
        "12",
    ]);
    assert_eq!((c1, c8), (0, 0));
    assert_eq!(alone, batched, "stdout differs between --max-batch 1 and 8");
    let lines: Vec<serde_json::Value> = alone.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let ids: Vec<&str> = lines.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["a", "b", "c"]);
    assert_eq!(lines[1]["tokens"].as_array().unwrap().len(), 7);
    assert_eq!(lines[0]["logprobs"].as_array().unwrap().len(), 12);
    // Logprobs are printed as f32 shortest round-trip: parsing as f32 and printing again
    // gives the same text.
    let first = alone.split("\"logprobs\":[").nth(1).unwrap().split([',', ']']).next().unwrap();
    assert_eq!(first.parse::<f32>().unwrap().to_string(), first);
}

#[test]
fn bad_requests_fail_alone_and_bad_files_are_named() {
    let prompts = write_prompts(
        "bad",
        &format!(
            "{{\"id\": \"ok\", \"prompt_ids\": [3, 4]}}\n{{\"id\": \"huge\", \"prompt_ids\": [{}]}}\n",
            vec!["3"; 1100].join(",")
        ),
    );
    let (code, out, err) = mtp(&["generate", "--prompts", &prompts, "--max-tokens", "3"]);
    assert_eq!(code, 2, "{err}");
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["tokens"].as_array().unwrap().len(), 3);
    assert!(lines[1]["error"].as_str().unwrap().contains("context"));

    let broken = write_prompts("broken", "{\"id\": \"x\", \"prompt_ids\": [1]}\n{\"id\": \"y\"\n");
    let (code, out, err) = mtp(&["generate", "--prompts", &broken]);
    assert_eq!(code, 1);
    assert!(out.is_empty());
    assert!(err.contains(":2") && err.contains("invalid request"), "{err}");

    let (code, _, err) = mtp(&["generate", "--target", "/nonexistent/model"]);
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent/model/config.json"), "{err}");
}

#[test]
fn every_drafter_prints_what_plain_decoding_prints() {
    let prompts = write_prompts(
        "drafters",
        "{\"id\": \"a\", \"prompt\": \"fn main() {\", \"arrive_at\": 2}\n\
         {\"id\": \"b\", \"prompt_ids\": [7, 8, 9, 7, 8, 9, 7], \"max_tokens\": 9}\n\
         {\"id\": \"c\", \"prompt\": \"let x = 1;\\nlet y = 2;\", \"arrive_at\": 5}\n",
    );
    let target = common::fixture("qwen3-target");
    let mtp_dir = std::env::temp_dir().join(format!("mtp-cli-head-{}", std::process::id()));
    let (t, head) = (target.to_str().unwrap(), mtp_dir.to_str().unwrap());
    let (code, _, err) = mtp(&["synth-mtp", "--target", t, "--layout", "deepseek", "--out", head]);
    assert_eq!(code, 0, "{err}");
    let draft = common::fixture("qwen3-draft");
    let base = ["generate", "--target", t, "--prompts", &prompts, "--ignore-eos", "--max-tokens", "14"];
    let (code, want, err) = mtp(&base);
    assert_eq!(code, 0, "{err}");
    for extra in [
        vec!["--drafter", "ngram", "--k", "3", "--max-batch", "2"],
        vec!["--drafter", "draft-model", "--draft", draft.to_str().unwrap(), "--k", "5"],
        vec!["--drafter", "mtp", "--draft", head, "--k", "2", "--max-batch", "1"],
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (code, got, err) = mtp(&args);
        assert_eq!(code, 0, "{extra:?}: {err}");
        assert_eq!(got, want, "{extra:?} changed the output");
    }
    let (code, _, err) = mtp(&[&base[..], &["--drafter", "draft-model"]].concat());
    assert!(code == 1 && err.contains("--draft"), "{err}");
    let (code, _, err) = mtp(&[&base[..], &["--drafter", "medusa"]].concat());
    assert!(code == 1 && err.contains("unknown --drafter `medusa`"), "{err}");
    let (code, _, err) = mtp(&[&base[..], &["--drafter", "mtp"]].concat());
    assert!(code == 1 && err.contains("num_nextn_predict_layers"), "{err}");
    std::fs::remove_dir_all(mtp_dir).ok();
}

#[test]
fn default_family_drafters_print_what_plain_decoding_prints() {
    // No --target and no --prompts: the trained family on examples/prompts.jsonl. Its MTP
    // head ships inside the target, so `--drafter mtp` needs no --draft.
    let base = ["generate", "--max-tokens", "24"];
    let (code, want, err) = mtp(&base);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("tests/fixtures/trained/target"), "{err}");
    let lines: Vec<serde_json::Value> = want.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    assert!(lines.iter().all(|l| !l["text"].as_str().unwrap().is_empty()));
    for extra in [
        vec!["--drafter", "mtp", "--k", "3"],
        vec!["--drafter", "draft-model", "--draft", mtp::DEFAULT_DRAFT, "--max-batch", "1"],
        vec!["--drafter", "ngram", "--k", "5", "--max-batch", "2"],
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (code, got, err) = mtp(&args);
        assert_eq!(code, 0, "{extra:?}: {err}");
        assert_eq!(got, want, "{extra:?} changed the output");
        assert!(err.contains("acceptance_rate"), "{err}");
    }
}
