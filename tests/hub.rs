//! `--target` / `--draft` as Hugging Face repo ids, resolved from a Hugging Face cache laid
//! out as the Hub client writes it (offline: nothing here reaches the network).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

const COMMIT: &str = "3f1c2a9e8b7d6c5f4a3b2c1d0e9f8a7b6c5d4e3f";

/// A fresh cache dir holding `models--org--<name>` for each (name, fixture): the fixture's
/// files as blobs/, snapshots/COMMIT/<file> symlinks into them (copies off unix), refs/main.
fn hf_cache(tag: &str, repos: &[(&str, &str)]) -> PathBuf {
    let cache = std::env::temp_dir().join(format!("mtp-hub-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&cache).ok();
    for (name, fixture) in repos {
        let repo = cache.join(format!("models--org--{name}"));
        let snap = repo.join("snapshots").join(COMMIT);
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
        for f in std::fs::read_dir(common::fixture(fixture)).unwrap() {
            let f = f.unwrap().path();
            let file = f.file_name().unwrap().to_str().unwrap();
            let blob = format!("etag-{file}");
            std::fs::copy(&f, repo.join("blobs").join(&blob)).unwrap();
            link(&Path::new("../../blobs").join(&blob), &snap.join(file));
        }
    }
    cache
}

#[cfg(unix)]
fn link(blob: &Path, at: &Path) {
    std::os::unix::fs::symlink(blob, at).unwrap();
}

#[cfg(not(unix))]
fn link(blob: &Path, at: &Path) {
    std::fs::copy(at.parent().unwrap().join(blob), at).unwrap();
}

/// Runs `mtp` with `HF_HUB_CACHE=cache` and `HF_HUB_OFFLINE=1` (or unset, `online`), in `cwd`.
fn mtp(cache: &Path, online: bool, cwd: Option<&Path>, args: &[&str]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mtp"));
    cmd.args(args).env("HF_HUB_CACHE", cache).env_remove("RUST_LOG");
    if online {
        cmd.env_remove("HF_HUB_OFFLINE");
    } else {
        cmd.env("HF_HUB_OFFLINE", "1");
    }
    if let Some(dir) = cwd {
        cmd.current_dir(dir);
    }
    let out = cmd.output().unwrap();
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
    (out.status.code().unwrap_or(-1), text(out.stdout), text(out.stderr))
}

fn prompts(tag: &str) -> String {
    let p = std::env::temp_dir().join(format!("mtp-hub-{tag}-{}.jsonl", std::process::id()));
    std::fs::write(
        &p,
        "{\"id\": \"a\", \"prompt\": \"def f(x):\"}\n{\"id\": \"b\", \"prompt_ids\": [5, 9, 200]}\n",
    )
    .unwrap();
    p.to_string_lossy().into_owned()
}

/// An id prints what its fixture directory prints, as --target and as --draft, by branch and
/// by commit. Catches ids not resolved (load errors), resolved to the wrong snapshot or
/// repo (other output), or broken by the blob symlinks the real cache uses.
#[test]
fn a_cached_repo_id_generates_what_its_directory_generates() {
    let cache = hf_cache("ids", &[("tiny-target", "qwen3-target"), ("tiny-draft", "qwen3-draft")]);
    let p = prompts("ids");
    let dir = common::fixture("qwen3-target");
    let run = |target: &str, extra: &[&str]| {
        let base = ["generate", "--target", target, "--prompts", &p, "--max-tokens", "5", "--ignore-eos"];
        let (code, out, err) = mtp(&cache, false, None, &[&base[..], extra].concat());
        assert_eq!(code, 0, "{target} {extra:?}: {err}");
        (out, err)
    };
    let (want, _) = run(dir.to_str().unwrap(), &["--drafter", "none"]);
    assert_eq!(want.lines().count(), 2);
    let (got, _) = run("org/tiny-target", &["--drafter", "none"]);
    assert_eq!(got, want, "org/tiny-target printed other lines than its directory");
    let draft = format!("org/tiny-draft@{COMMIT}");
    let (got, err) =
        run("org/tiny-target@main", &["--drafter", "draft-model", "--draft", &draft, "--k", "3"]);
    assert_eq!(got, want, "--draft {draft} changed the output");
    assert!(err.lines().last().unwrap().starts_with("drafter the draft model"), "{err}");
    std::fs::remove_dir_all(cache).ok();
}

/// A folder `org/tiny` in the current directory wins over the cached repo `org/tiny`.
/// Catches the cache consulted before the disk.
#[test]
fn a_local_folder_named_like_the_id_wins() {
    let cache = hf_cache("local", &[("tiny", "qwen3-target")]);
    let cwd = cache.join("cwd");
    std::fs::create_dir_all(cwd.join("org")).unwrap();
    let local = cwd.join("org/tiny");
    std::fs::create_dir_all(&local).unwrap();
    for f in std::fs::read_dir(common::fixture("qwen3-draft")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, local.join(f.file_name().unwrap())).unwrap();
    }
    let p = prompts("local");
    let args = ["generate", "--target", "org/tiny", "--prompts", &p, "--max-tokens", "5", "--ignore-eos"];
    let (c1, from_cache, e1) = mtp(&cache, false, None, &args);
    let (c2, from_disk, e2) = mtp(&cache, false, Some(&cwd), &args);
    assert_eq!((c1, c2), (0, 0), "{e1}\n{e2}");
    assert_ne!(from_cache, from_disk, "the folder and the cached repo hold different models");
    let draft = common::fixture("qwen3-draft");
    let (_, want, _) =
        mtp(&cache, false, None, &[&["generate", "--target", draft.to_str().unwrap()], &args[3..]].concat());
    assert_eq!(from_disk, want, "org/tiny in the current directory was not the checkpoint used");
    std::fs::remove_dir_all(cache).ok();
}

/// Misses are one-line errors naming the id, the revision and the cache: offline (saying how
/// to download), online with the Hub unreachable, and malformed ids. Catches a silent
/// fallback to a path error (`org/absent/config.json`), a panic, or a hang on the network.
#[test]
fn a_missing_id_is_a_clear_error() {
    let cache = hf_cache("missing", &[]);
    std::fs::create_dir_all(&cache).unwrap();
    let c = cache.to_str().unwrap();
    let (code, out, err) = mtp(&cache, false, None, &["generate", "--target", "org/absent"]);
    assert_eq!(code, 1, "{err}");
    assert!(out.is_empty());
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("`org/absent`") && err.contains("`main`") && err.contains(c), "{err}");
    assert!(err.contains("unset it to download"), "{err}");

    // Online, against an endpoint nothing listens on: the download fails fast and says so.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mtp"));
    cmd.args(["generate", "--target", "org/absent@v1"]).env("HF_HUB_CACHE", &cache);
    let out = cmd.env_remove("HF_HUB_OFFLINE").env("HF_ENDPOINT", "http://127.0.0.1:1").output().unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap();
    assert!(last.contains("`org/absent`") && last.contains("`v1`") && last.contains(c), "{err}");
    assert!(last.contains("downloading failed"), "{err}");

    for (spec, says) in [("org/tiny@", "empty revision"), ("org/ti..ny", "not a valid repo id")] {
        let (code, _, err) = mtp(&cache, false, None, &["generate", "--target", spec]);
        assert!(code == 1 && err.contains(spec) && err.contains(says), "{spec}: {err}");
    }
    std::fs::remove_dir_all(cache).ok();
}
