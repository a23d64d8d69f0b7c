//! `mtp-bench` end to end: the default run (the trained family on held-out prompts,
//! adaptive k), fixed k's quality bars, the JSON report, the oracle drafter's acceptance,
//! prompts cut from a folder, and errors.

use std::process::Command;

fn bench(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mtp-bench")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn tmp(name: &str) -> String {
    std::env::temp_dir()
        .join(format!("mtp-bench-{name}-{}", std::process::id()))
        .to_string_lossy()
        .into_owned()
}

/// The row of `drafter` at `k` and `batch` with the same temperature and sampling as `like`.
fn row<'a>(
    rows: &'a [serde_json::Value],
    drafter: &str,
    k: &str,
    batch: u64,
    like: &serde_json::Value,
) -> &'a serde_json::Value {
    rows.iter()
        .find(|r| {
            r["drafter"] == drafter
                && r["k"] == k
                && r["batch"] == batch
                && r["temperature"] == like["temperature"]
                && r["sampling"] == like["sampling"]
        })
        .unwrap()
}

fn read_json(path: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The default run (adaptive k), with one repeat instead of three to keep CI short.
#[test]
fn default_run_covers_every_drafter_and_is_identical() {
    let json = tmp("default.json");
    let (code, out, err) = bench(&["--repeats", "1", "--json", &json]);
    assert_eq!(code, 0, "{err}");
    for drafter in ["| none |", "| draft-model |", "| mtp |", "| ngram |"] {
        assert!(out.contains(drafter), "missing {drafter} in\n{out}");
    }
    assert!(!out.contains("**NO**"));
    assert!(out.contains("| reference |"), "rows that are their own reference say so:\n{out}");
    let doc = read_json(&json);
    let rows = doc["rows"].as_array().unwrap();
    // 2 batch sizes x 3 temperatures x plain, then 3 drafters at k=auto for each of greedy,
    // T=0.7 exact and rejection, T=1 exact and rejection.
    assert_eq!(rows.len(), 2 * (3 + 5 * 3));
    for r in rows {
        for key in [
            "drafter",
            "k",
            "mean_k",
            "batch",
            "temperature",
            "sampling",
            "acceptance_rate",
            "mean_accepted_length",
            "per_position_acceptance",
        ] {
            assert!(!r[key].is_null(), "{key} missing in {r}");
        }
        assert!(r["drafter"] == "none" || r["k"] == "auto", "{r}");
        assert!(r["tokens_per_second"].as_f64().unwrap() > 0.0 && r["speedup"].as_f64().unwrap() > 0.0);
        // The median lies within the repeats' spread, and so does the speedup.
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {r}"));
        assert!(
            f("tokens_per_second_min") <= f("tokens_per_second")
                && f("tokens_per_second") <= f("tokens_per_second_max"),
            "{r}"
        );
        assert!(f("speedup_min") <= f("speedup") && f("speedup") <= f("speedup_max"), "{r}");
        let spans_one = f("speedup_min") <= 1.0 && 1.0 <= f("speedup_max");
        assert_eq!(r["within_noise"], r["drafter"] != "none" && spans_one, "{r}");
        // Rejection rows at the first batch size are the reference of later ones.
        let own_reference = r["sampling"] == "rejection" && r["batch"] == 1;
        assert_eq!(r["reference"], own_reference, "{r}");
        let want = if own_reference { serde_json::Value::Null } else { true.into() };
        assert_eq!(r["identical"], want, "{r}");
        assert!(r["requests"].as_array().unwrap().iter().all(|q| q["identical"] == want));
    }
    for (sampling, temperature) in [("greedy", 0.0), ("exact", 0.7), ("rejection", 0.7), ("exact", 1.0)] {
        assert!(
            rows.iter().any(|r| r["sampling"] == sampling && r["temperature"].as_f64() == Some(temperature)),
            "no {sampling} row at T={temperature}"
        );
    }
    assert!(doc["target"].as_str().unwrap().ends_with("tests/fixtures/trained/target"));
    assert_eq!(doc["requests"], 16);
    std::fs::remove_file(json).ok();
}

/// Fixed k on the default workload: the trained family must show real drafting (the
/// quality bars of docs/trained-family.md), and acceptance depends only on each row's
/// tokens, never on the batch size.
#[test]
fn fixed_k_shows_real_drafting() {
    let json = tmp("fixed.json");
    let (code, _, err) = bench(&[
        "--k",
        "1,4",
        "--temperatures",
        "0,1",
        "--sampling",
        "exact",
        "--repeats",
        "1",
        "--json",
        &json,
    ]);
    assert_eq!(code, 0, "{err}");
    let doc = read_json(&json);
    let rows = doc["rows"].as_array().unwrap();
    assert!(rows.iter().all(|r| r["identical"] == true), "every row equals plain decoding");
    // The MTP head accepts at least 60% at k=1; the best drafter averages at least 2
    // tokens per verify at k=4.
    let greedy = serde_json::json!({"temperature": 0.0, "sampling": "greedy"});
    let mtp1 = row(rows, "mtp", "1", 1, &greedy)["acceptance_rate"].as_f64().unwrap();
    assert!(mtp1 >= 0.6, "MTP acceptance at k=1: {mtp1}");
    let best4 = ["draft-model", "mtp", "ngram"]
        .map(|d| row(rows, d, "4", 1, &greedy)["mean_accepted_length"].as_f64().unwrap())
        .into_iter()
        .fold(0.0, f64::max);
    assert!(best4 >= 2.0, "best mean accepted length at k=4: {best4}");
    for r in rows.iter().filter(|r| r["drafter"] != "none") {
        assert!(r["mean_k"].as_f64().unwrap() <= r["k"].as_str().unwrap().parse::<f64>().unwrap(), "{r}");
        let alone = row(rows, r["drafter"].as_str().unwrap(), r["k"].as_str().unwrap(), 1, r);
        assert_eq!(r["acceptance_rate"], alone["acceptance_rate"], "{r}");
    }
    std::fs::remove_file(json).ok();
}

#[test]
fn oracle_sets_the_acceptance_rate() {
    let json = tmp("oracle.json");
    let (code, _, err) = bench(&[
        "--drafters",
        "oracle:1.0,oracle:0.0,oracle:0.5",
        "--k",
        "3",
        "--batch",
        "2",
        "--temperatures",
        "0",
        "--repeats",
        "1",
        "--json",
        &json,
    ]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rate = |name: &str| {
        let r = doc["rows"].as_array().unwrap().iter().find(|r| r["drafter"] == name).unwrap().clone();
        (r["acceptance_rate"].as_f64().unwrap(), r["mean_accepted_length"].as_f64().unwrap())
    };
    let (a1, len1) = rate("oracle:1");
    assert_eq!(a1, 1.0);
    assert!(len1 > 3.0, "k=3 with every draft accepted: {len1}");
    assert_eq!(rate("oracle:0").0, 0.0);
    let (a5, _) = rate("oracle:0.5");
    assert!(a5 > 0.1 && a5 < 0.9, "{a5}");
    std::fs::remove_file(json).ok();
}

#[test]
fn prompts_dir_is_cut_deterministically() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
    let args = [
        "--drafters",
        "ngram",
        "--k",
        "2",
        "--batch",
        "1",
        "--temperatures",
        "0",
        "--prompts-dir",
        dir,
        "--num-prompts",
        "3",
        "--repeats",
        "1",
    ];
    let (j1, j2) = (tmp("dir1.json"), tmp("dir2.json"));
    let a: Vec<&str> =
        args.iter().copied().chain(["--prompt-tokens", "20", "--max-tokens", "6", "--json", &j1]).collect();
    let b: Vec<&str> =
        args.iter().copied().chain(["--prompt-tokens", "20", "--max-tokens", "6", "--json", &j2]).collect();
    assert_eq!(bench(&a).0, 0);
    assert_eq!(bench(&b).0, 0);
    let tokens = |p: &str| {
        let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        (doc["requests"].clone(), doc["rows"][0]["tokens"].clone())
    };
    assert_eq!(tokens(&j1), tokens(&j2));
    assert_eq!(tokens(&j1).0, 3);
}

#[test]
fn bad_arguments_are_refused() {
    let (code, _, err) = bench(&["--drafters", "medusa"]);
    assert!(code == 1 && err.contains("unknown drafter `medusa`"), "{err}");
    let (code, _, err) = bench(&["--drafters", "oracle:1.5"]);
    assert!(code == 1 && err.contains("[0, 1]"), "{err}");
    // Counts of zero are usage errors (clap's exit code 2), naming the flag.
    let (code, _, err) = bench(&["--k", "0"]);
    assert!(code == 2 && err.contains("--k") && err.contains("at least 1"), "{err}");
    let (code, _, err) = bench(&["--sampling", "typical"]);
    assert!(code == 1 && err.contains("unknown sampling mode `typical`"), "{err}");
    let (code, _, err) = bench(&["--temperatures=-1"]);
    assert!(code == 1 && err.contains("temperature"), "{err}");
    let (code, _, err) = bench(&["--prompts-dir", "/nonexistent/dir"]);
    assert!(code == 1 && err.contains("/nonexistent/dir"), "{err}");
    // Sizes past their bounds are refused by name before anything is allocated (these
    // aborted allocating 32 GiB and 219 TB); the same folder with sane counts cuts prompts
    // (`prompts_dir_is_cut_deterministically`).
    let (code, _, err) = bench(&["--max-k", "4294967296"]);
    assert!(code == 2 && err.contains("--max-k") && err.contains("at most 64"), "{err}");
    let (code, _, err) = bench(&["--k", "1,65"]);
    assert!(code == 2 && err.contains("--k") && err.contains("at most 64"), "{err}");
    let (code, _, err) = bench(&["--prompts-dir", "src", "--num-prompts", "1099511627776"]);
    assert!(code == 1 && err.contains("--num-prompts 1099511627776") && err.contains("at most"), "{err}");
    // Read only by --prompts-dir: without it they were silently ignored.
    let (code, _, err) = bench(&["--num-prompts", "3"]);
    assert!(code == 2 && err.contains("--prompts-dir"), "{err}");
    let (code, _, err) = bench(&["--prompts-dir", "src", "--prompt-tokens", "18446744073709551615"]);
    assert!(code == 1 && err.contains("--prompt-tokens") && err.contains("at most"), "{err}");
    // A repeat count past the bound is refused by name (each run is the whole workload).
    let (code, _, err) = bench(&["--repeats", "18446744073709551615"]);
    assert!(code == 2 && err.contains("--repeats") && err.contains("1000 runs"), "{err}");
}
