//! Hugging Face repo ids as checkpoint directories: `--target Qwen/Qwen3-0.6B[@revision]`.
//!
//! [`resolve`] turns a `--target`/`--draft` argument into a directory. A path that exists is
//! taken as it is, always. Anything else shaped like `org/name[@revision]` (no leading `/`,
//! `.` or `~`; one `/` before the `@`) is a repo id, looked up in the standard Hugging Face
//! cache ([`HubCache::from_env`]: `models--org--name/refs/<revision>` holds a commit hash,
//! `models--org--name/snapshots/<commit>/` the files; a 40-hex revision names the snapshot
//! directly). A cached snapshot with `config.json` and its safetensors weights is returned
//! without touching the network. Otherwise, unless offline (`HF_HUB_OFFLINE`), the files a
//! checkpoint needs are downloaded into that cache with `hf-hub` (progress bar; an interrupted
//! download resumes): `config.json`, the weights (`model.safetensors`, or the index and
//! every shard it names) and, when the repo has them, `generation_config.json`,
//! `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`. Every failure is an
//! [`Error::Hub`] naming the id, and where it looked. Any other argument comes back as a
//! path unchanged, so the loader reports it as before.
//!
//! `org/name/FILE.gguf[@revision]` names one GGUF file of a repo (llama.cpp's repos hold
//! several quantizations side by side): the file of the cached snapshot, else that file
//! alone downloaded into the cache (offline: an error naming it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::config::read_json;
use crate::error::{Error, Result};

const CONFIG: &str = "config.json";
const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";
/// Fetched when the repo has them; the loader and the server read each if present.
#[cfg_attr(not(feature = "download"), allow(dead_code))]
const OPTIONAL: [&str; 4] =
    ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"];

/// The Hugging Face hub cache directory (the one holding `models--org--name` folders).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubCache {
    dir: PathBuf,
}

impl HubCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        HubCache { dir: dir.into() }
    }

    /// `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`HubCache::from_env`] over any variable lookup (empty values count as unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let var = |k: &str| var(k).filter(|v| !v.is_empty());
        if let Some(dir) = var("HF_HUB_CACHE") {
            return Self::new(dir);
        }
        if let Some(home) = var("HF_HOME") {
            return Self::new(Path::new(&home).join("hub"));
        }
        let home = var("HOME").or_else(|| var("USERPROFILE")).unwrap_or_else(|| ".".into());
        Self::new(Path::new(&home).join(".cache/huggingface/hub"))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn repo_dir(&self, repo: &RepoId) -> PathBuf {
        self.dir.join(format!("models--{}", repo.id.replace('/', "--")))
    }

    /// Where `repo`'s revision is recorded: `snapshots/<commit>` for a commit hash, else
    /// `refs/<revision>` (a file holding the commit).
    fn revision_path(&self, repo: &RepoId) -> PathBuf {
        let dir = self.repo_dir(repo);
        match is_commit(&repo.revision) {
            true => dir.join("snapshots").join(&repo.revision),
            false => dir.join("refs").join(&repo.revision),
        }
    }

    /// The cached snapshot folder `repo` names, or what is missing: its ref, a commit in
    /// the ref (a ref holding anything else was reported as absent), or the folder.
    fn snapshot(&self, repo: &RepoId) -> std::result::Result<PathBuf, String> {
        let at = self.revision_path(repo);
        let snap = match is_commit(&repo.revision) {
            true => at,
            false => {
                let bytes = crate::files::read_bounded(&at, 4096)
                    .map_err(|_| format!("looked for {}", at.display()))?;
                let text = String::from_utf8_lossy(&bytes);
                let commit = text.trim();
                if !is_commit(commit) {
                    let shown: String = commit.chars().take(60).collect();
                    return Err(format!("{} holds `{shown}`, not a 40-hex commit", at.display()));
                }
                self.repo_dir(repo).join("snapshots").join(commit)
            }
        };
        match snap.is_dir() {
            true => Ok(snap),
            false => Err(format!("looked for {}", snap.display())),
        }
    }
}

/// A parsed `org/name[@revision]` (revision `main` when none is given).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoId {
    pub id: String,
    pub revision: String,
}

impl RepoId {
    /// `None` when `spec` is shaped like a path rather than an id; an error when it is
    /// shaped like an id but holds characters or parts the Hub refuses.
    pub fn parse(spec: &str) -> Option<Result<RepoId>> {
        let (id, revision) = match spec.split_once('@') {
            Some((id, rev)) => (id, Some(rev)),
            None => (spec, None),
        };
        if id.starts_with(['/', '.', '~']) || id.contains('\\') || id.matches('/').count() != 1 {
            return None;
        }
        let bad = |msg: &str| Some(Err(Error::Hub { id: spec.to_string(), msg: msg.to_string() }));
        if !id.split('/').all(valid_part) || id.len() > 96 {
            return bad("no such directory, and not a valid repo id (org/name[@revision]; names use letters, \
                        digits, `-`, `_` and `.`, not `--` or `..`, and neither start nor end with `-` or `.`)");
        }
        let revision = revision.unwrap_or("main");
        if revision.is_empty() {
            return bad("empty revision after `@` (write org/name, or org/name@<branch, tag or commit>)");
        }
        if revision.contains("..")
            || revision.starts_with('/')
            || revision.contains(|c: char| c.is_whitespace() || c.is_control() || c == '\\')
        {
            return bad(&format!("invalid revision `{revision}`"));
        }
        Some(Ok(RepoId { id: id.to_string(), revision: revision.to_string() }))
    }

    fn error(&self, msg: impl Into<String>) -> Error {
        Error::Hub { id: self.id.clone(), msg: msg.into() }
    }
}

fn valid_part(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.'])
        && !s.contains("--")
        && !s.contains("..")
}

fn is_commit(rev: &str) -> bool {
    rev.len() == 40 && rev.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
}

/// Whether `HF_HUB_OFFLINE` forbids downloads: set to anything but empty, `0`, `false`,
/// `no` or `off`.
pub fn offline_from_env() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| !["", "0", "false", "no", "off"].contains(&v.trim().to_ascii_lowercase().as_str()))
}

/// [`resolve`] with the cache and offline flag the environment names.
pub fn resolve_from_env(spec: impl AsRef<Path>) -> Result<PathBuf> {
    resolve(spec, &HubCache::from_env(), offline_from_env())
}

/// The checkpoint directory `spec` names: an existing path as is; a repo id from `cache`,
/// downloading what is missing unless `offline`; anything else as a path.
pub fn resolve(spec: impl AsRef<Path>, cache: &HubCache, offline: bool) -> Result<PathBuf> {
    let path = spec.as_ref();
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    if let Some((repo_spec, file)) = path.to_str().and_then(gguf_in_repo) {
        return match RepoId::parse(&repo_spec) {
            None => Ok(path.to_path_buf()),
            Some(repo) => resolve_file(&repo?, file, cache, offline),
        };
    }
    let repo = match path.to_str().and_then(RepoId::parse) {
        None => return Ok(path.to_path_buf()),
        Some(parsed) => parsed?,
    };
    let missing = match cache.snapshot(&repo) {
        Ok(snap) => match missing_file(&snap)? {
            None => return Ok(snap),
            Some(file) => format!("the cached snapshot {} has no {file}", snap.display()),
        },
        Err(why) => format!(
            "no such directory, and revision `{}` is not in the Hugging Face cache {} ({why})",
            repo.revision,
            cache.dir.display(),
        ),
    };
    if offline {
        return Err(repo.error(format!("{missing}; HF_HUB_OFFLINE is set: unset it to download the repo")));
    }
    download(&repo, cache).map_err(|e| repo.error(format!("{missing}, and downloading failed: {e}")))
}

/// `org/name/FILE.gguf[@revision]` split into the repo's spec (`org/name[@revision]`) and
/// the file's name; `None` for anything else.
fn gguf_in_repo(spec: &str) -> Option<(String, &str)> {
    let (id, revision) = match spec.split_once('@') {
        Some((id, rev)) => (id, Some(rev)),
        None => (spec, None),
    };
    let (repo, file) = id.rsplit_once('/')?;
    let gguf = file.len() > 5 && file[file.len() - 5..].eq_ignore_ascii_case(".gguf");
    if !gguf || !valid_part(file) || repo.matches('/').count() != 1 {
        return None;
    }
    Some((revision.map_or_else(|| repo.to_string(), |r| format!("{repo}@{r}")), file))
}

/// File `file` of `repo`: the cached snapshot's, else downloaded unless `offline`.
fn resolve_file(repo: &RepoId, file: &str, cache: &HubCache, offline: bool) -> Result<PathBuf> {
    let missing = match cache.snapshot(repo) {
        Ok(snap) if snap.join(file).is_file() => return Ok(snap.join(file)),
        Ok(snap) => format!("the cached snapshot {} has no {file}", snap.display()),
        Err(why) => format!(
            "revision `{}` is not in the Hugging Face cache {} ({why})",
            repo.revision,
            cache.dir.display()
        ),
    };
    if offline {
        return Err(repo.error(format!("{missing}; HF_HUB_OFFLINE is set: unset it to download {file}")));
    }
    download_file(repo, cache, file)
        .map_err(|e| repo.error(format!("{missing}, and downloading {file} failed: {e}")))
}

/// The first file a checkpoint needs that `dir` lacks (`config.json`, then the weights).
fn missing_file(dir: &Path) -> Result<Option<String>> {
    let has = |name: &str| dir.join(name).exists();
    if !has(CONFIG) {
        return Ok(Some(CONFIG.into()));
    }
    if !has(INDEX) {
        return Ok((!has(SINGLE)).then(|| format!("{SINGLE} (or {INDEX})")));
    }
    Ok(shards(&dir.join(INDEX))?.into_iter().find(|s| !has(s)))
}

/// The shard files an index's `weight_map` names, each once.
fn shards(index: &Path) -> Result<BTreeSet<String>> {
    let v = read_json(index)?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::config(index, "weight_map", "missing or not an object"))?;
    map.iter()
        .map(|(tensor, f)| match f.as_str() {
            Some(f) if !f.is_empty() && !f.starts_with('/') && !f.contains("..") => Ok(f.to_string()),
            _ => Err(Error::config(index, &format!("weight_map.{tensor}"), "not a file name in the repo")),
        })
        .collect()
}

/// Without the `download` feature: says so (the cache still resolves ids).
#[cfg(not(feature = "download"))]
fn download(_repo: &RepoId, _cache: &HubCache) -> std::result::Result<PathBuf, String> {
    Err("this build has no downloader (built without the `download` feature): fetch the repo with \
         `huggingface-cli download`, or pass its folder"
        .into())
}

#[cfg(not(feature = "download"))]
fn download_file(repo: &RepoId, cache: &HubCache, _file: &str) -> std::result::Result<PathBuf, String> {
    download(repo, cache)
}

/// The Hub's API for `repo`, caching into `cache`. Reads `HF_TOKEN` (else the cache's
/// `token` file) and `HF_ENDPOINT`.
#[cfg(feature = "download")]
fn hub_repo(repo: &RepoId, cache: &HubCache) -> std::result::Result<hf_hub::api::sync::ApiRepo, String> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Cache, Repo, RepoType};
    let mut builder =
        ApiBuilder::from_cache(Cache::new(cache.dir.clone())).with_progress(true).with_retries(3);
    if let Some(token) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        builder = builder.with_token(Some(token));
    }
    if let Some(endpoint) = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()) {
        builder = builder.with_endpoint(endpoint);
    }
    let api = builder.build().map_err(|e| e.to_string())?;
    eprintln!(
        "{}@{}: fetching from the Hugging Face Hub into {}",
        repo.id,
        repo.revision,
        cache.dir.display()
    );
    Ok(api.repo(Repo::with_revision(repo.id.clone(), RepoType::Model, repo.revision.clone())))
}

/// Fetches one file of `repo` (a GGUF) into `cache`; its path in the snapshot.
#[cfg(feature = "download")]
fn download_file(repo: &RepoId, cache: &HubCache, file: &str) -> std::result::Result<PathBuf, String> {
    hub_repo(repo, cache)?
        .download(file)
        .map_err(|e| format!("{e} (is the id and file name right, is the Hub reachable, and for a gated repo, is HF_TOKEN set?)"))
}

/// Fetches what a checkpoint needs into `cache` and returns its snapshot folder. Reads
/// `HF_TOKEN` (else the cache's `token` file) and `HF_ENDPOINT`.
#[cfg(feature = "download")]
fn download(repo: &RepoId, cache: &HubCache) -> std::result::Result<PathBuf, String> {
    let hub = hub_repo(repo, cache)?;
    let info = hub.info().map_err(|e| {
        format!("{e} (is the id right, is the Hub reachable, and for a gated repo, is HF_TOKEN set?)")
    })?;
    let listed: BTreeSet<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let snap = cache.repo_dir(repo).join("snapshots").join(&info.sha);
    // Files already in the snapshot are kept; `download` resumes a partial one.
    let fetch = |name: &str| -> std::result::Result<PathBuf, String> {
        let local = snap.join(name);
        if local.exists() {
            return Ok(local);
        }
        hub.download(name).map_err(|e| format!("{name}: {e}"))
    };
    if !listed.contains(CONFIG) {
        return Err(format!("the repo has no {CONFIG} at revision `{}`", repo.revision));
    }
    let dir = fetch(CONFIG)?.parent().expect("a file in a snapshot").to_path_buf();
    for name in OPTIONAL.into_iter().filter(|n| listed.contains(n)) {
        fetch(name)?;
    }
    let weights = if listed.contains(INDEX) {
        shards(&fetch(INDEX)?).map_err(|e| e.to_string())?
    } else if listed.contains(SINGLE) {
        BTreeSet::from([SINGLE.to_string()])
    } else {
        return Err(format!("the repo has no {SINGLE} or {INDEX} (only safetensors checkpoints load)"));
    };
    for name in &weights {
        fetch(name)?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "0123456789abcdef0123456789abcdef01234567";
    const OTHER: &str = "fedcba9876543210fedcba9876543210fedcba98";

    /// A fresh cache holding `models--org--tiny` with snapshots HASH (refs/main) and OTHER
    /// (refs/dev), each with a config.json and model.safetensors.
    fn cache(tag: &str) -> HubCache {
        let dir = std::env::temp_dir().join(format!("mtp-hub-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        let repo = dir.join("models--org--tiny");
        for (rev, commit) in [("main", HASH), ("dev", OTHER)] {
            let snap = repo.join("snapshots").join(commit);
            std::fs::create_dir_all(&snap).unwrap();
            std::fs::write(snap.join(CONFIG), "{}").unwrap();
            std::fs::write(snap.join(SINGLE), "").unwrap();
            std::fs::create_dir_all(repo.join("refs")).unwrap();
            std::fs::write(repo.join("refs").join(rev), format!("{commit}\n")).unwrap();
        }
        HubCache::new(dir)
    }

    fn snap(c: &HubCache, commit: &str) -> PathBuf {
        c.dir().join("models--org--tiny/snapshots").join(commit)
    }

    fn err(spec: &str, c: &HubCache) -> String {
        resolve(spec, c, true).unwrap_err().to_string()
    }

    /// Catches a wrong folder name (`models--org--tiny`), refs not followed, a trailing
    /// newline in a ref kept, or a commit-hash revision looked up in refs/.
    #[test]
    fn ids_resolve_to_their_snapshot() {
        let c = cache("ids");
        assert_eq!(resolve("org/tiny", &c, true).unwrap(), snap(&c, HASH));
        assert_eq!(resolve("org/tiny@main", &c, true).unwrap(), snap(&c, HASH));
        assert_eq!(resolve("org/tiny@dev", &c, true).unwrap(), snap(&c, OTHER));
        assert_eq!(resolve(format!("org/tiny@{OTHER}"), &c, true).unwrap(), snap(&c, OTHER));
        std::fs::remove_dir_all(c.dir()).ok();
    }

    /// Catches an offline miss that does not say what, which revision and where it looked,
    /// and an incomplete snapshot returned as if whole.
    #[test]
    fn offline_misses_name_the_id_revision_and_cache() {
        let c = cache("miss");
        let e = err("org/absent", &c);
        assert!(e.contains("`org/absent`") && e.contains("`main`"), "{e}");
        assert!(e.contains(&c.dir().display().to_string()) && e.contains("HF_HUB_OFFLINE"), "{e}");
        let e = err("org/tiny@v2", &c);
        assert!(e.contains("`v2`") && e.contains("refs/v2"), "{e}");
        let e = err(&format!("org/tiny@{}", "a".repeat(40)), &c);
        assert!(e.contains(&format!("snapshots/{}", "a".repeat(40))), "{e}");
        // A ref that holds no commit says so (it said it looked for the ref, which is there).
        let dev = c.dir().join("models--org--tiny/refs/dev");
        std::fs::write(&dev, "not-a-commit\n").unwrap();
        let e = err("org/tiny@dev", &c);
        assert!(e.contains("refs/dev holds `not-a-commit`, not a 40-hex commit"), "{e}");
        std::fs::write(&dev, format!("{OTHER}\n")).unwrap();
        assert_eq!(resolve("org/tiny@dev", &c, true).unwrap(), snap(&c, OTHER));

        std::fs::remove_file(snap(&c, HASH).join(CONFIG)).unwrap();
        let e = err("org/tiny", &c);
        assert!(e.contains("no config.json") && e.contains(HASH), "{e}");
        std::fs::write(snap(&c, HASH).join(CONFIG), "{}").unwrap();
        let index = r#"{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}"#;
        std::fs::write(snap(&c, HASH).join(INDEX), index).unwrap();
        std::fs::write(snap(&c, HASH).join("model-1.safetensors"), "").unwrap();
        assert!(err("org/tiny", &c).contains("no model-2.safetensors"));
        std::fs::write(snap(&c, HASH).join("model-2.safetensors"), "").unwrap();
        assert_eq!(resolve("org/tiny", &c, true).unwrap(), snap(&c, HASH));
        std::fs::remove_dir_all(c.dir()).ok();
    }

    /// Catches malformed ids accepted (and sent to the Hub) or paths taken for ids.
    #[test]
    fn bad_ids_are_refused_and_paths_pass_through() {
        let c = cache("bad");
        for (spec, says) in [
            ("org/na me", "not a valid repo id"),
            ("org/-tiny", "not a valid repo id"),
            ("org/ti--ny", "not a valid repo id"),
            ("or%g/tiny", "not a valid repo id"),
            ("org/tiny@", "empty revision"),
            ("org/tiny@a b", "invalid revision"),
            ("org/tiny@../x", "invalid revision"),
        ] {
            let e = err(spec, &c);
            assert!(e.contains(spec) && e.contains(says), "{spec}: {e}");
        }
        for path in ["/nonexistent/model", "./org/tiny", "../org/tiny", "model", "a/b/c", "~/org/tiny"] {
            assert_eq!(resolve(path, &c, true).unwrap(), PathBuf::from(path), "{path}");
        }
        std::fs::remove_dir_all(c.dir()).ok();
    }

    /// Catches a GGUF file of a repo taken for a path, looked up in the wrong snapshot, or
    /// reported missing without its name.
    #[test]
    fn a_gguf_file_of_a_repo_resolves_in_its_snapshot() {
        let c = cache("gguf");
        std::fs::write(snap(&c, HASH).join("m-Q4_K_M.gguf"), b"GGUF").unwrap();
        assert_eq!(
            resolve("org/tiny/m-Q4_K_M.gguf", &c, true).unwrap(),
            snap(&c, HASH).join("m-Q4_K_M.gguf")
        );
        let e = err("org/tiny/m-Q4_K_M.gguf@dev", &c);
        assert!(e.contains("has no m-Q4_K_M.gguf") && e.contains("HF_HUB_OFFLINE"), "{e}");
        assert_eq!(resolve("a/b/c/d.gguf", &c, true).unwrap(), PathBuf::from("a/b/c/d.gguf"));
        std::fs::remove_dir_all(c.dir()).ok();
    }

    /// Catches an id looked up in the cache when a file or folder of that name exists.
    #[test]
    fn an_existing_path_wins() {
        let c = cache("path");
        // Shaped like an id, relative to the crate root (where cargo runs unit tests).
        assert!(Path::new("src/hub.rs").exists());
        assert_eq!(resolve("src/hub.rs", &c, true).unwrap(), PathBuf::from("src/hub.rs"));
        std::fs::remove_dir_all(c.dir()).ok();
    }

    /// Catches the variables read in the wrong order or empty values taken as set.
    #[test]
    fn the_cache_follows_the_environment() {
        fn vars<'a>(pairs: &'a [(&str, &str)]) -> impl Fn(&str) -> Option<String> + 'a {
            move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        }
        let all = [("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h"), ("HOME", "/u")];
        assert_eq!(HubCache::from_vars(vars(&all)).dir(), Path::new("/c"));
        assert_eq!(HubCache::from_vars(vars(&all[1..])).dir(), Path::new("/h/hub"));
        let empty = [("HF_HUB_CACHE", ""), ("HF_HOME", ""), ("HOME", "/u")];
        assert_eq!(HubCache::from_vars(vars(&empty)).dir(), Path::new("/u/.cache/huggingface/hub"));
    }
}
