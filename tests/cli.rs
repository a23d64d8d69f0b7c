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
            "{{\"id\": \"ok\", \"prompt_ids\": [3, 4]}}\n{{\"id\": \"huge\", \"prompt_ids\": [{}]}}\n\
             {{\"id\": \"alts\", \"prompt_ids\": [3], \"top_logprobs\": 1000000}}\n\
             {{\"id\": \"scored\", \"prompt_ids\": [3], \"prompt_logprobs\": 1000000}}\n\
             {{\"id\": \"all\", \"prompt_ids\": [3], \"top_logprobs\": 8192}}\n",
            vec!["3"; 1100].join(",")
        ),
    );
    let (code, out, err) = mtp(&["generate", "--prompts", &prompts, "--max-tokens", "3"]);
    assert_eq!(code, 2, "{err}");
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["tokens"].as_array().unwrap().len(), 3);
    assert!(lines[1]["error"].as_str().unwrap().contains("context"));
    // More alternatives than the vocabulary holds are refused naming the field, not clamped.
    for (line, key) in [(2, "top_logprobs"), (3, "prompt_logprobs")] {
        let e = lines[line]["error"].as_str().unwrap();
        assert!(e.contains(key) && e.contains("1000000") && e.contains("8192 tokens"), "{e}");
    }
    // Control: the whole vocabulary is a valid ask.
    assert_eq!(lines[4]["top_logprobs"][0].as_array().unwrap().len(), 8192, "{}", lines[4]);

    let broken = write_prompts("broken", "{\"id\": \"x\", \"prompt_ids\": [1]}\n{\"id\": \"y\"\n");
    let (code, out, err) = mtp(&["generate", "--prompts", &broken]);
    assert_eq!(code, 1);
    assert!(out.is_empty());
    assert!(err.contains(":2") && err.contains("invalid request"), "{err}");
    // A key given twice is refused naming it (the last value won).
    let twice = write_prompts(
        "twice",
        "{\"id\": \"a\", \"prompt_ids\": [1], \"max_tokens\": 2, \"max_tokens\": 5}\n",
    );
    let (code, out, err) = mtp(&["generate", "--prompts", &twice]);
    assert_eq!((code, out.as_str()), (1, ""), "{err}");
    assert!(err.contains(":1") && err.contains("`max_tokens` is given twice"), "{err}");

    let (code, _, err) = mtp(&["generate", "--target", "/nonexistent/model"]);
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent/model/config.json"), "{err}");
    // The cause is said once (the error's own message already holds its source).
    assert_eq!(err.matches("os error 2").count(), 1, "{err}");
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
    // Greedy, then sampled in exact mode (also bitwise plain decoding's output).
    for sampling in [vec![], vec!["--temperature", "0.8", "--top-p", "0.95", "--seed", "3"]] {
        let plain: Vec<&str> = base.iter().chain(&sampling).copied().collect();
        let (code, want, err) = mtp(&plain);
        assert_eq!(code, 0, "{err}");
        for extra in [
            vec!["--drafter", "ngram", "--k", "3", "--max-batch", "2"],
            vec!["--drafter", "draft-model", "--draft", draft.to_str().unwrap(), "--k", "5"],
            vec!["--drafter", "mtp", "--draft", head, "--k", "2", "--max-batch", "1"],
        ] {
            let args: Vec<&str> = plain.iter().chain(&extra).copied().collect();
            let (code, got, err) = mtp(&args);
            assert_eq!(code, 0, "{extra:?}: {err}");
            assert_eq!(got, want, "{extra:?} {sampling:?} changed the output");
        }
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
    // head ships inside the target, so the default `--drafter auto` drafts with it, and
    // `--drafter mtp` needs no --draft.
    let base = ["generate", "--max-tokens", "24"];
    let plain: Vec<&str> = base.iter().copied().chain(["--drafter", "none"]).collect();
    let (code, want, err) = mtp(&plain);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("tests/fixtures/trained/target"), "{err}");
    assert_eq!(err.lines().last(), Some("plain decoding (--drafter none)"), "{err}");
    let lines: Vec<serde_json::Value> = want.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    assert!(lines.iter().all(|l| !l["text"].as_str().unwrap().is_empty()));
    for extra in [
        vec![],
        vec!["--k", "auto", "--max-k", "3", "--max-batch", "2"],
        vec!["--drafter", "mtp", "--k", "3"],
        vec![
            "--drafter",
            "draft-model",
            "--draft",
            concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/trained/draft"),
            "--max-batch",
            "1",
        ],
        vec!["--drafter", "ngram", "--k", "5", "--max-batch", "2"],
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        let (code, got, err) = mtp(&args);
        assert_eq!(code, 0, "{extra:?}: {err}");
        assert_eq!(got, want, "{extra:?} changed the output");
        assert!(err.contains("acceptance_rate"), "{err}");
        let last = err.lines().last().unwrap();
        assert!(last.starts_with("drafter "), "{extra:?}: the last line says which drafter ran: {last}");
        if extra.is_empty() {
            assert!(
                last.starts_with("drafter the MTP head"),
                "--drafter auto picks the target's head: {last}"
            );
        }
    }
}

#[test]
fn compare_plain_times_both_runs_and_checks_the_bits() {
    // The README's run command: the speculative run, then the same requests without a drafter.
    for extra in [vec![], vec!["--k", "4", "--max-batch", "2"]] {
        let args: Vec<&str> =
            ["generate", "--compare-plain"].into_iter().chain(extra.iter().copied()).collect();
        let (code, out, err) = mtp(&args);
        assert_eq!(code, 0, "{extra:?}: {err}");
        assert_eq!(out.lines().count(), 3, "stdout holds the speculative run's lines only");
        let mut last = err.lines().rev();
        let (compared, summary) = (last.next().unwrap(), last.next().unwrap());
        assert!(summary.starts_with("drafter the MTP head"), "{summary}");
        assert!(
            compared.starts_with("beside plain decoding of the same 3 requests (--compare-plain): ")
                && compared.contains("x its speed")
                && compared.ends_with("every token and logprob bitwise plain decoding's"),
            "{extra:?}: {compared}"
        );
    }
    let (code, _, err) = mtp(&["generate", "--compare-plain", "--drafter", "none", "--max-tokens", "2"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(err.lines().last(), Some("--compare-plain: this run was plain decoding already"));
    let (code, _, err) = mtp(&[
        "generate",
        "--compare-plain",
        "--k",
        "2",
        "--temperature",
        "0.8",
        "--sampling",
        "rejection",
        "--max-tokens",
        "4",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.lines().last().unwrap().contains("outputs not compared: rejection sampling"), "{err}");
}

#[test]
fn auto_drafter_without_a_head_decodes_plainly_and_says_so() {
    let target = common::fixture("qwen3-target");
    let (code, out, err) =
        mtp(&["generate", "--target", target.to_str().unwrap(), "--max-tokens", "4", "--ignore-eos"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.is_empty());
    let last = err.lines().last().unwrap();
    assert!(last.contains("plain decoding") && last.contains("no MTP head"), "{last}");
    let (code, _, err) = mtp(&["generate", "--target", target.to_str().unwrap(), "--draft", "/x"]);
    assert!(code != 0 && err.contains("--drafter auto"), "{err}");
    let (code, _, err) = mtp(&["generate", "--target", target.to_str().unwrap(), "--k", "many"]);
    assert!(code == 2 && err.contains("--k") && err.contains("auto"), "{err}");
}

#[test]
fn sampling_flags_seeds_and_per_request_overrides() {
    let prompts = write_prompts(
        "sampling",
        "{\"id\": \"a\", \"prompt_ids\": [5, 9, 200]}\n\
         {\"id\": \"b\", \"prompt_ids\": [5, 9, 200], \"temperature\": 0}\n\
         {\"id\": \"c\", \"prompt_ids\": [5, 9, 200], \"seed\": 77, \"top_k\": 50}\n",
    );
    let target = common::fixture("qwen3-target");
    let t = target.to_str().unwrap();
    let base = ["generate", "--target", t, "--prompts", &prompts, "--ignore-eos", "--max-tokens", "12"];
    let tokens = |args: &[&str]| -> Vec<serde_json::Value> {
        let all: Vec<&str> = base.iter().chain(args).copied().collect();
        let (code, out, err) = mtp(&all);
        assert_eq!(code, 0, "{args:?}: {err}");
        out.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["tokens"].clone()).collect()
    };
    let greedy = tokens(&[]);
    let seed1 = tokens(&["--temperature", "1.0", "--seed", "1"]);
    assert_eq!(seed1, tokens(&["--temperature", "1.0", "--seed", "1"]), "same seed, same output");
    let seed2 = tokens(&["--temperature", "1.0", "--seed", "2"]);
    assert_ne!(seed1[0], greedy[0], "temperature 1 sampled the greedy continuation");
    assert_ne!(seed1[0], seed2[0], "different seeds gave the same sample");
    assert_eq!(seed1[1], greedy[0], "a request's temperature 0 overrides the flag");
    assert_ne!(seed1[2], seed1[0], "a request's seed and top_k override the flags");

    // Rejection mode: not plain decoding's bits, but each row the same alone and batched.
    let draft = common::fixture("qwen3-draft");
    let rejection = ["--temperature", "1.0", "--sampling", "rejection", "--drafter", "draft-model"];
    let with_draft: Vec<&str> =
        rejection.iter().copied().chain(["--draft", draft.to_str().unwrap()]).collect();
    let alone = tokens(&[&with_draft[..], &["--max-batch", "1", "--k", "3"]].concat());
    let batched = tokens(&[&with_draft[..], &["--max-batch", "3", "--k", "3"]].concat());
    assert_eq!(alone, batched);

    for (bad, says) in [
        (vec!["--top-p", "0"], "top_p"),
        (vec!["--temperature=-0.5"], "temperature"),
        (vec!["--temperature", "1", "--sampling", "typical"], "unknown sampling mode"),
    ] {
        let all: Vec<&str> = base.iter().chain(&bad).copied().collect();
        let (code, _, err) = mtp(&all);
        assert!(code == 1 && err.contains(says), "{bad:?}: {err}");
    }
    let broken = write_prompts(
        "bad-min-p",
        "{\"id\": \"x\", \"prompt_ids\": [1]}\n{\"id\": \"y\", \"prompt_ids\": [1], \"min_p\": 2}\n",
    );
    let (code, _, err) = mtp(&["generate", "--target", t, "--prompts", &broken]);
    assert!(code == 1 && err.contains(":2") && err.contains("min_p"), "{err}");
    // A top_p under f32's range is refused as written, not as the "got 0" it rounds to.
    let all: Vec<&str> = base.iter().chain(&["--top-p", "1e-300"]).copied().collect();
    let (code, _, err) = mtp(&all);
    assert!(code == 2 && err.contains("--top-p") && err.contains("got 1e-300"), "{err}");
    let tiny = write_prompts("tiny-top-p", "{\"id\": \"y\", \"prompt_ids\": [1], \"top_p\": 1e-300}\n");
    let (code, _, err) = mtp(&["generate", "--target", t, "--prompts", &tiny]);
    assert!(code == 1 && err.contains(":1") && err.contains("got 1e-300"), "{err}");
}

fn mtp_bench(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mtp-bench")).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8(out.stderr).unwrap())
}

#[test]
fn counts_of_zero_are_refused_naming_the_flag() {
    let t = common::fixture("qwen3-draft");
    let t = t.to_str().unwrap();
    for flag in ["--max-batch", "--max-tokens", "--prefill-chunk", "--ngram-min", "--kv-budget-mib"] {
        let (code, _, err) = mtp(&["generate", "--target", t, flag, "0"]);
        assert_ne!(code, 0, "{flag} 0 was accepted");
        assert!(err.contains(flag) && err.contains("at least 1"), "{flag}: {err}");
    }
    let (code, _, err) = mtp(&["synth", "--like", "qwen3", "--hidden", "0", "--out", "/nonexistent"]);
    assert!(code != 0 && err.contains("--hidden"), "{err}");
    for flag in ["--num-prompts", "--max-tokens", "--k", "--batch"] {
        let (code, err) = mtp_bench(&["--target", t, flag, "0"]);
        assert!(code != 0 && err.contains(flag) && err.contains("at least 1"), "{flag}: {err}");
    }
}

/// mtp-bench refuses what it could not report truly: requests the context would cut short
/// (the report said 8 tokens a request where each generated 1, at a meaningless speed),
/// and a `--json` it cannot write, before anything runs (it failed after the whole run).
/// Control: the same run with room, and a writable report.
#[test]
fn mtp_bench_refuses_runs_it_could_not_report_truly() {
    let t = common::fixture("qwen3-draft");
    let t = t.to_str().unwrap();
    let prompts = write_prompts("bench-context", "{\"id\": \"a\", \"prompt_ids\": [5, 9, 11]}\n");
    let base =
        ["--target", t, "--prompts", &prompts, "--drafters", "ngram", "--batch", "1", "--temperatures", "0"];
    let run = |extra: &[&str]| mtp_bench(&[&base[..], extra].concat());
    let (code, err) = run(&["--max-tokens", "100000000"]);
    assert!(code != 0 && err.contains("--max-tokens") && err.contains("context"), "{err}");
    let (code, err) = run(&["--max-tokens", "2", "--json", "/nonexistent/dir/report.json"]);
    assert!(code != 0 && err.contains("--json") && !err.contains("runs"), "{err}");
    let report = std::env::temp_dir().join(format!("mtp-bench-report-{}.json", std::process::id()));
    let (code, err) = run(&["--max-tokens", "2", "--json", report.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(std::fs::read_to_string(&report).unwrap().contains("\"rows\""));
    // Off a terminal, progress is a line per run (plain and ngram, --repeats 3: 6 runs).
    assert!(
        err.contains("run 1/6: ")
            && err.contains("run 6/6: ngram, k auto, batch 1")
            && err.contains("s left)"),
        "{err}"
    );
    std::fs::remove_file(report).ok();
}

/// Sizes whose bytes would wrap, negative sampling values, crossed n-gram bounds and a
/// `--draft` no drafter reads are refused naming the flags. Before: 2^44 MiB wrapped to 0
/// bytes (2^44+1 to 1 MiB), `--temperature -0.5` was clap's "unexpected argument '-0'",
/// `--drafter none --draft DIR` ignored the directory. Control: the largest size that fits
/// (and a temperature of 0.5) still runs.
#[test]
fn wrapping_sizes_negative_values_and_unread_flags_are_named() {
    let t = common::fixture("qwen3-draft");
    let t = t.to_str().unwrap();
    let prompts = write_prompts("flags", "{\"id\": \"a\", \"prompt_ids\": [5, 9]}\n");
    let run = |extra: &[&str]| {
        let base = ["generate", "--target", t, "--prompts", &prompts, "--max-tokens", "2"];
        mtp(&[&base[..], extra].concat())
    };
    for huge in ["17592186044416", "17592186044417", "18446744073709551615"] {
        let (code, _, err) = run(&["--kv-budget-mib", huge]);
        assert!(code != 0 && err.contains("--kv-budget-mib") && err.contains("MiB"), "{huge}: {err}");
    }
    let fits = ((usize::MAX >> 20) - 1).to_string();
    let (code, _, err) = run(&["--kv-budget-mib", &fits]);
    assert_eq!(code, 0, "the largest budget that fits was refused: {err}");
    for (flag, value) in [("--temperature", "-0.5"), ("--top-p", "-1"), ("--min-p", "-0.1")] {
        let (code, _, err) = run(&[flag, value]);
        assert!(code != 0 && !err.contains("unexpected argument"), "{flag} {value}: {err}");
        assert!(err.contains(&flag[2..].replace('-', "_")) || err.contains(flag), "{flag} {value}: {err}");
    }
    let (code, _, err) = run(&["--temperature", "0.5"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&["--drafter", "ngram", "--ngram-min", "5", "--ngram-max", "2"]);
    assert!(code != 0 && err.contains("--ngram-min 5") && err.contains("--ngram-max 2"), "{err}");
    for drafter in ["none", "ngram"] {
        let (code, _, err) = run(&["--drafter", drafter, "--draft", t]);
        assert!(code != 0 && err.contains("--draft") && err.contains(drafter), "{drafter}: {err}");
    }
    // Draft lengths past the bound (`--max-k 2^32` aborted allocating 32 GiB); the bound
    // itself runs.
    for (flag, value) in [("--max-k", "4294967296"), ("--max-k", "65"), ("--k", "65")] {
        let (code, _, err) = run(&["--drafter", "ngram", flag, value]);
        assert!(code == 2 && err.contains(flag) && err.contains("at most 64"), "{flag} {value}: {err}");
    }
    let (code, _, err) = run(&["--drafter", "ngram", "--max-k", "64"]);
    assert_eq!(code, 0, "{err}");
}

/// `--activations`: an unknown value is refused naming the choices (`mtp generate` and
/// `mtp-bench`); `bf16` (the CPU's bf16-activation matmul), `f32` and `auto` run.
#[test]
fn activations_are_checked_by_name() {
    let t = common::fixture("qwen3-draft");
    let t = t.to_str().unwrap();
    let prompts = write_prompts("activations", "{\"id\": \"a\", \"prompt_ids\": [5, 9]}\n");
    let run = |value: &str| {
        mtp(&["generate", "--target", t, "--prompts", &prompts, "--max-tokens", "2", "--activations", value])
    };
    let (code, _, err) = run("f16");
    assert!(code != 0 && err.contains("`f16`") && err.contains("auto, f32, bf16"), "{err}");
    for ok in ["bf16", "f32", "auto"] {
        let (code, _, err) = run(ok);
        assert_eq!(code, 0, "--activations {ok}: {err}");
    }
    let (code, err) = mtp_bench(&["--target", t, "--activations", "f16"]);
    assert!(code != 0 && err.contains("`f16`"), "{err}");
}

#[test]
fn k_of_zero_with_a_drafter_is_refused() {
    let t = common::fixture("qwen3-draft");
    let (code, _, err) =
        mtp(&["generate", "--target", t.to_str().unwrap(), "--drafter", "ngram", "--k", "0"]);
    assert_ne!(code, 0);
    assert!(err.contains("--k 0") && err.contains("--drafter none"), "{err}");
}

#[test]
fn an_empty_prompts_file_says_so() {
    let prompts = write_prompts("empty", "\n\n");
    let t = common::fixture("qwen3-draft");
    let (code, out, err) = mtp(&["generate", "--target", t.to_str().unwrap(), "--prompts", &prompts]);
    assert_eq!(code, 0, "{err}");
    assert!(out.is_empty());
    assert!(err.contains("holds no requests"), "{err}");
}

#[test]
fn a_broken_tokenizer_json_fails_at_load_naming_the_file() {
    let dir = std::env::temp_dir().join(format!("mtp-cli-badtok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(common::fixture("qwen3-draft")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    let (code, _, err) = mtp(&["generate", "--target", dir.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("tokenizer.json") && !err.contains("text prompt"), "{err}");
}

#[test]
fn logs_carry_no_colour_codes_off_a_terminal() {
    let prompts = write_prompts("colour", "{\"id\": \"a\", \"prompt_ids\": [5, 9]}\n");
    let t = common::fixture("qwen3-draft");
    let out = Command::new(env!("CARGO_BIN_EXE_mtp"))
        .args(["generate", "--target", t.to_str().unwrap(), "--prompts", &prompts, "--max-tokens", "2"])
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("INFO"), "no log lines to check: {err}");
    assert!(!err.contains('\u{1b}'), "escape codes in piped logs: {err:?}");
}

/// `--drafter assistant` on a Gemma 4 target prints what plain decoding prints (greedy and
/// exact-sampled, batched); without `--draft` it is refused naming the flag, and a Gemma 4
/// target refuses `--drafter draft-model` with a sliding-window model.
#[test]
fn gemma4_assistant_prints_what_plain_decoding_prints() {
    let prompts = write_prompts(
        "gemma4",
        "{\"id\": \"a\", \"prompt\": \"def main():\\n    return\", \"arrive_at\": 1}\n\
         {\"id\": \"b\", \"prompt_ids\": [2, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7], \"max_tokens\": 12}\n\
         {\"id\": \"c\", \"prompt\": \"import os\", \"arrive_at\": 3}\n",
    );
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4");
    let (target, assistant) = (dir.join("gemma4-e-target"), dir.join("gemma4-e-assistant-ordered"));
    let (t, a) = (target.to_str().unwrap(), assistant.to_str().unwrap());
    let base = ["generate", "--target", t, "--prompts", &prompts, "--ignore-eos", "--max-tokens", "20"];
    for sampling in [vec![], vec!["--temperature", "0.9", "--seed", "5"]] {
        let plain: Vec<&str> = base.iter().chain(&sampling).copied().collect();
        let (code, want, err) = mtp(&[&plain[..], &["--drafter", "none"]].concat());
        assert_eq!(code, 0, "{err}");
        let args =
            [&plain[..], &["--drafter", "assistant", "--draft", a, "--k", "3", "--max-batch", "3"]].concat();
        let (code, got, err) = mtp(&args);
        assert_eq!(code, 0, "{err}");
        assert_eq!(got, want, "the assistant changed the output ({sampling:?})");
        assert!(err.contains("the assistant"), "{err}");
    }
    let (code, _, err) = mtp(&[&base[..], &["--drafter", "assistant"]].concat());
    assert!(code == 1 && err.contains("--draft"), "{err}");
    let (code, _, err) = mtp(&[&base[..], &["--drafter", "draft-model", "--draft", t]].concat());
    assert!(code == 1 && err.contains("sliding-window"), "{err}");
}

/// `--backend metal-emulated`: the Metal kernels on the emulator print the same lines alone
/// and batched; `--backend metal` off macOS is a one-line error that names the emulator.
/// (A build with `--features metal-emulator`: `.ci/run` runs it.)
#[cfg(all(feature = "metal-emulator", not(target_os = "macos")))]
#[test]
fn metal_emulated_backend_is_identical_alone_and_batched() {
    let prompts = write_prompts(
        "metal",
        "{\"id\": \"a\", \"prompt\": \"def f(x):\"}\n{\"id\": \"b\", \"prompt_ids\": [5, 9, 200]}\n",
    );
    let target = common::fixture("qwen3-target");
    let t = target.to_str().unwrap();
    let run = |batch: &str, chunk: &str| {
        mtp(&[
            "generate",
            "--target",
            t,
            "--prompts",
            &prompts,
            "--backend",
            "metal-emulated",
            "--max-batch",
            batch,
            "--prefill-chunk",
            chunk,
            "--ignore-eos",
            "--max-tokens",
            "10",
        ])
    };
    let ((c1, alone, _), (c8, batched, _)) = (run("1", "64"), run("8", "3"));
    assert_eq!((c1, c8), (0, 0));
    assert_eq!(alone, batched, "metal-emulated stdout differs between --max-batch 1 and 8");
    assert_eq!(alone.lines().count(), 2);
    let (code, _, err) = mtp(&["generate", "--target", t, "--prompts", &prompts, "--backend", "metal"]);
    assert_ne!(code, 0);
    assert!(err.contains("metal-emulated"), "{err}");
}

/// A vocabulary padded above the tokenizer runs, but a request whose output holds a padding
/// id gets an error line naming the id (exit 2) instead of text with the token left out; a
/// draft model without tokenizer.json is used with a warning naming its directory (before,
/// the token-map check was skipped silently). Controls: the fixture, whose vocabulary is its
/// tokenizer's, prints text and exits 0, and so does the synthesized checkpoint with the
/// tokenizer synth wrote (covering its vocabulary); its draft model with a tokenizer gets no
/// warning.
#[test]
fn padding_ids_and_a_draft_without_a_tokenizer_are_named() {
    let prompts = write_prompts("padded", "{\"id\": \"a\", \"prompt_ids\": [5, 9, 7]}\n");
    let dir = std::env::temp_dir().join(format!("mtp-cli-padded-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let shape = ["--hidden", "48", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16"];
    let synth =
        [&["synth", "--like", "qwen3", "--intermediate", "96", "--dtype", "f32"][..], &shape].concat();
    let (code, _, err) = mtp(&[&synth[..], &["--vocab", "4096", "--out", d]].concat());
    assert_eq!(code, 0, "{err}");
    let run = |t: &str| {
        mtp(&["generate", "--target", t, "--prompts", &prompts, "--max-tokens", "8", "--ignore-eos"])
    };
    let (code, out, err) = run(d);
    assert_eq!(code, 0, "synth's tokenizer covers its vocabulary: {out} {err}");
    // The 512-token tokenizer of a 512-id synth over the 4,096 rows: padded.
    let small = dir.join("small");
    let (code, _, err) = mtp(&[&synth[..], &["--vocab", "512", "--out", small.to_str().unwrap()]].concat());
    assert_eq!(code, 0, "{err}");
    std::fs::copy(small.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let (code, out, _) = run(d);
    assert_eq!(code, 2, "{out}");
    let line: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let e = line["error"].as_str().unwrap();
    assert!(e.contains("token id") && e.contains("tokenizer.json") && e.contains("request a"), "{e}");
    let fixture = common::fixture("qwen3-target");
    let (code, out, err) = run(fixture.to_str().unwrap());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"text\""), "{out}");
    std::fs::remove_dir_all(&dir).ok();

    let draft = std::env::temp_dir().join(format!("mtp-cli-draft-notok-{}", std::process::id()));
    std::fs::create_dir_all(&draft).unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(common::fixture("qwen3-draft").join(f), draft.join(f)).unwrap();
    }
    let with_draft = |dr: &str| {
        let t = fixture.to_str().unwrap();
        mtp(&[
            "generate",
            "--target",
            t,
            "--prompts",
            &prompts,
            "--max-tokens",
            "4",
            "--drafter",
            "draft-model",
            "--draft",
            dr,
        ])
    };
    let (code, _, err) = with_draft(draft.to_str().unwrap());
    assert!(code == 0 && !err.contains("WARN"), "{err}");
    std::fs::remove_file(draft.join("tokenizer.json")).unwrap();
    let (code, _, err) = with_draft(draft.to_str().unwrap());
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("WARN") && err.contains(draft.to_str().unwrap()) && err.contains("tokenizer.json"),
        "{err}"
    );
    std::fs::remove_dir_all(&draft).ok();
}

/// Prompts files are read within bounds, and a line that is not a request says why, naming
/// the file and line. Before, `--prompts /dev/zero` read until memory ran out, a binary file
/// was "stream did not contain valid UTF-8" with no line, and `[1,2,3]` was "expected struct
/// Line". Control: a well-formed file exactly at both limits is read.
#[test]
fn prompts_files_are_bounded_and_bad_lines_are_named() {
    let t = common::fixture("qwen3-draft");
    let t = t.to_str().unwrap();
    let run = |p: &str| mtp(&["generate", "--target", t, "--prompts", p, "--max-tokens", "2"]);
    #[cfg(unix)]
    {
        let (code, _, err) = run("/dev/zero");
        assert!(code == 1 && err.contains("/dev/zero:1") && err.contains("NUL"), "{err}");
    }
    let good = "{\"id\": \"a\", \"prompt_ids\": [5, 9]}\n";
    let cases: [(&str, &[u8], &str); 6] = [
        ("array", b"[1,2,3]\n", ":1: invalid request: expected a JSON object"),
        (
            "text",
            b"hello world\n",
            ":1: invalid request: not JSON (expected value at line 1 column 1): each line is one JSON object",
        ),
        ("binary", b"\x7fELF\x02\x01\x01\x00\x00", ":1: a NUL byte at byte 8"),
        ("latin1", b"{\"id\": \"a\", \"prompt_ids\": [5]}\n{\"prompt\": \"caf\xe9\"}\n", ":2: not UTF-8"),
        ("type", b"\n{\"id\": \"x\", \"prompt_ids\": \"5 9\"}\n", ":2: invalid request: field `prompt_ids`"),
        ("id", b"{\"prompt_ids\": [4294967296]}\n", ":1: invalid request: field `prompt_ids`"),
    ];
    for (tag, bytes, want) in cases {
        let p = std::env::temp_dir().join(format!("mtp-cli-bad-{tag}-{}.jsonl", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        let (code, out, err) = run(p.to_str().unwrap());
        assert!(code == 1 && out.is_empty(), "{tag}: {err}");
        assert!(err.contains(&format!("{}{want}", p.display())), "{tag}: {err}");
    }
    let p = write_prompts("good", good);
    let (code, _, err) = run(&p);
    assert_eq!(code, 0, "{err}");

    let read = |max_line: usize, max_file: u64| {
        let defaults = mtp::engine::Request::default();
        mtp::prompts::read_bounded(std::path::Path::new(&p), None, &defaults, max_line, max_file)
    };
    let (line, file) = (good.len(), good.len() as u64);
    assert_eq!(read(line, file).unwrap().requests.len(), 1, "a file exactly at both limits is read");
    let e = format!("{:#}", read(line - 1, file).err().expect("a longer line"));
    assert!(e.contains(":1: the line is longer than") && e.contains(&(line - 1).to_string()), "{e}");
    let e = format!("{:#}", read(line, file - 1).err().expect("a larger file"));
    assert!(e.contains(":1: the prompts file goes past") && e.contains(&(file - 1).to_string()), "{e}");
}

/// `mtp synth` refuses, before writing anything, a shape that would not load (naming the
/// flag) or that is too large (naming `--max-gib`), with checked byte counts. Before,
/// `--hidden 4000000000 --layers 1` wrote until the disk filled, 2^62 wrapped the byte
/// count, and `--head-dim 7` wrote a checkpoint `generate` then refused. Control: a small
/// shape whose heads do not divide the hidden size (as Qwen3's) is written and runs.
#[test]
fn synth_refuses_shapes_that_would_not_load_or_fit_before_writing() {
    let out = std::env::temp_dir().join(format!("mtp-cli-synth-{}", std::process::id()));
    let o = out.to_str().unwrap();
    let cases: [(&[&str], &str); 10] = [
        (
            &["--like", "qwen3", "--hidden", "4000000000", "--layers", "1"],
            "--vocab 151936 x --hidden 4000000000",
        ),
        (
            &["--like", "qwen3", "--hidden", "100000", "--layers", "1"],
            "GiB of BF16 weights is over the limit of 16.0 GiB (--max-gib",
        ),
        (&["--like", "qwen3", "--hidden", "4611686018427387904", "--layers", "1"], "over 2^40 values"),
        (&["--like", "qwen3", "--head-dim", "7"], "--head-dim: must be even"),
        (
            &["--like", "qwen3", "--heads", "16", "--kv-heads", "5"],
            "--kv-heads: 5 does not divide --heads 16",
        ),
        (&["--like", "qwen3", "--vocab", "20000000"], "--vocab"),
        (&["--like", "gemma4-e2b", "--head-dim", "9223372036854775807"], "--head-dim"),
        (&["--like", "qwen3-8b", "--max-gib", "1"], "over the limit of 1.0 GiB (--max-gib"),
        (&["--like", "qwen3", "--q-bits", "3"], "--q-bits 3: 2, 4 or 8"),
        (&["--like", "qwen3", "--q-bits", "4", "--q-group-size", "48"], "--q-group-size 48"),
    ];
    for (args, want) in cases {
        let (code, _, err) = mtp(&[&["synth", "--out", o][..], args].concat());
        assert!(code == 1 && err.contains(want), "{args:?}: {err}");
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
    let small = ["--hidden", "48", "--layers", "1", "--heads", "5", "--kv-heads", "1", "--head-dim", "16"];
    let args =
        [&["synth", "--like", "qwen3", "--out", o, "--intermediate", "96", "--vocab", "512"][..], &small];
    let (code, _, err) = mtp(&args.concat());
    assert_eq!(code, 0, "{err}");
    let prompts = write_prompts("synth", "{\"id\": \"a\", \"prompt_ids\": [5, 9]}\n");
    let (code, out_lines, err) =
        mtp(&["generate", "--target", o, "--prompts", &prompts, "--max-tokens", "3"]);
    assert!(code == 0 && out_lines.contains("\"tokens\""), "{err}");
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn constrained_prompt_lines_match_and_bad_ones_fail_alone() {
    let prompts = write_prompts(
        "constrained",
        concat!(
            r#"{"id": "s", "prompt": "As JSON:", "json_schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"], "additionalProperties": false}}"#,
            "\n",
            r#"{"id": "r", "prompt": "pets:", "regex": "(cat|dog) [0-9]"}"#,
            "\n",
            r#"{"id": "g", "prompt": "x", "grammar": "start: \"ok\" | \"no\""}"#,
            "\n",
            r#"{"id": "o", "prompt": "obj", "response_format": {"type": "json_object"}, "max_tokens": 60}"#,
            "\n",
            r#"{"id": "bad", "prompt": "x", "regex": "(oops"}"#,
            "\n"
        ),
    );
    let run = |extra: &[&str]| {
        let mut args = vec!["generate", "--prompts", &prompts, "--max-tokens", "30"];
        args.extend_from_slice(extra);
        mtp(&args)
    };
    let (code, plain, err) = run(&["--drafter", "none", "--max-batch", "1"]);
    assert_eq!(code, 2, "{err}");
    let (_, spec, _) = run(&["--drafter", "mtp", "--k", "3"]);
    assert_eq!(plain, spec, "constrained output differs with the MTP head batched");
    let lines: Vec<serde_json::Value> = plain.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let text = |i: usize| lines[i]["text"].as_str().unwrap().to_string();
    let v: serde_json::Value = serde_json::from_str(&text(0)).unwrap();
    assert!(v["n"].as_i64().is_some_and(|n| (0..=99).contains(&n)), "{}", text(0));
    assert!(["cat ", "dog "].iter().any(|p| text(1).starts_with(p)) && text(1).len() == 5, "{}", text(1));
    assert!(text(2) == "ok" || text(2) == "no", "{}", text(2));
    assert!(serde_json::from_str::<serde_json::Value>(&text(3)).unwrap().is_object(), "{}", text(3));
    for l in &lines[..4] {
        assert_eq!(l["finish_reason"], "grammar", "{l}");
    }
    assert!(lines[4]["error"].as_str().unwrap().contains("invalid regex"), "{}", lines[4]);
    // Two constraints on one line are refused before anything runs.
    let both = write_prompts("both", r#"{"prompt": "x", "regex": "a", "grammar": "start: \"a\""}"#);
    let (code, _, err) = mtp(&["generate", "--prompts", &both]);
    assert_ne!(code, 0);
    assert!(err.contains("at most one"), "{err}");
}

/// `"prompt_logprobs"` on a prompts line scores the prompt: for a prompt that is a prompt
/// and its greedy continuation, the continuation's scores are the logprobs `mtp generate`
/// printed generating it (the same f32 text), rank 1 each; `"max_tokens": 0` generates
/// nothing, and is refused for a line that scores nothing.
#[test]
fn prompt_logprobs_score_a_prompt_as_generation_scored_it() {
    let target = common::fixture("llama-target");
    let t = target.to_str().unwrap();
    let first =
        write_prompts("score-1", "{\"id\": \"g\", \"prompt_ids\": [5, 9, 200, 31], \"max_tokens\": 5}\n");
    let (code, out, err) = mtp(&["generate", "--target", t, "--prompts", &first, "--ignore-eos"]);
    assert_eq!(code, 0, "{err}");
    let g: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let mut ids = vec![5, 9, 200, 31];
    ids.extend(g["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()));
    let lines = format!(
        "{{\"id\": \"s\", \"prompt_ids\": {ids:?}, \"max_tokens\": 0, \"prompt_logprobs\": 0}}\n\
         {{\"id\": \"z\", \"prompt_ids\": [5, 9], \"max_tokens\": 0}}\n"
    );
    let second = write_prompts("score-2", &lines);
    let (_, out, err) = mtp(&["generate", "--target", t, "--prompts", &second]);
    let mut lines = out.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
    let s = lines.next().unwrap_or_else(|| panic!("{err}"));
    assert_eq!(s["tokens"], serde_json::json!([]), "{s}");
    let scored = s["prompt_logprobs"].as_array().unwrap();
    assert_eq!(scored.len(), ids.len() - 1, "{s}");
    for (j, p) in scored[3..].iter().enumerate() {
        assert_eq!(
            (&p["token"], &p["logprob"], &p["rank"]),
            (&g["tokens"][j], &g["logprobs"][j], &serde_json::json!(1))
        );
    }
    let z = lines.next().unwrap();
    assert!(z["error"].as_str().is_some_and(|e| e.contains("max_tokens")), "{z}");
}

/// A copy of the binary outside any checkout, run from another directory, still finds the
/// default model and prompts (in the tree it was built from).
#[test]
fn a_copied_binary_runs_from_another_directory() {
    let dir = std::env::temp_dir().join(format!("mtp-copied-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("mtp");
    std::fs::copy(env!("CARGO_BIN_EXE_mtp"), &exe).unwrap();
    let out = Command::new(&exe)
        .args(["generate", "--drafter", "none", "--max-tokens", "4"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 3, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every flag of every command says what it does in `--help`, and the commands that read
/// prompts end their help with examples and the JSONL format.
#[test]
fn every_flag_has_help_text() {
    let help = |bin: &str, args: &[&str]| {
        let out = Command::new(bin).args(args).arg("--help").output().unwrap();
        assert_eq!(out.status.code(), Some(0));
        String::from_utf8(out.stdout).unwrap()
    };
    let mtp = env!("CARGO_BIN_EXE_mtp");
    let pages = [
        ("generate", help(mtp, &["generate"])),
        ("serve", help(mtp, &["serve"])),
        ("synth", help(mtp, &["synth"])),
        ("synth-mtp", help(mtp, &["synth-mtp"])),
        ("mtp-bench", help(env!("CARGO_BIN_EXE_mtp-bench"), &[])),
    ];
    for (name, page) in &pages {
        // The options, up to the examples after them.
        let lines: Vec<&str> = page.lines().take_while(|l| *l != "Examples:").collect();
        let mut flags = 0;
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            // Option lines are indented at most six spaces (`  -h, --help`, `      --flag <X>`),
            // their help ten.
            if !t.starts_with('-') || line.len() - t.len() > 6 {
                continue;
            }
            flags += 1;
            // Short pages put the help on the flag's line, after two spaces or more.
            if t.split_once("  ")
                .is_some_and(|(_, help)| !help.trim().is_empty() && !help.trim().starts_with('['))
            {
                continue;
            }
            let next = lines.get(i + 1).map(|l| l.trim()).unwrap_or("");
            assert!(
                !next.is_empty() && !next.starts_with('[') && !next.starts_with('-'),
                "{name}: `{t}` has no help text (next line: {next:?})"
            );
        }
        assert!(flags >= 4, "{name}: read {flags} flags from its help: the format changed?\n{page}");
        if ["generate", "serve", "mtp-bench"].contains(name) {
            assert!(page.contains("Examples:\n"), "{name}: no examples");
        }
        if ["generate", "mtp-bench"].contains(name) {
            assert!(page.contains("Prompts JSONL: one JSON object per line"), "{name}: no JSONL format");
        }
    }
}
