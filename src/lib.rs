//! `mtp`: lossless speculative generation with row-invariant numerics.
//!
//! This facade re-exports the workspace crates (docs/architecture.md draws their map); the
//! binaries live in `src/bin`, and [`synth`] writes random-weight checkpoints for tests and
//! benchmarks.

pub use mtp_base as base;
pub use mtp_cache as cache;
#[cfg(feature = "cuda")]
pub use mtp_cuda as cuda;
pub use mtp_drafter as drafter;
pub use mtp_engine as engine;
pub use mtp_kernels as kernels;
#[cfg(any(feature = "metal", feature = "metal-emulator"))]
pub use mtp_metal as metal;
pub use mtp_model as model;
pub use mtp_sampling as sampling;
pub use mtp_server as server;
pub use mtp_verifier as verifier;

pub mod bench;
pub mod load;
pub mod synth;

/// `e` and its causes as one line for the user, outermost first: a cause whose text the
/// line already holds is left out (the workspace's errors print their source inside their
/// own message, so anyhow's `{:#}` said "No such file or directory (os error 2)" twice).
pub fn error_report(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Logs to stderr; `RUST_LOG` overrides `default_level`. Colour only when stderr is a
/// terminal and `NO_COLOR` is unset or empty (no escape codes in files or supervisors' logs).
pub fn init_logging(default_level: &str) {
    use std::io::IsTerminal;
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_level.into()),
        )
        .init();
}

pub mod prompts;

/// Makes the calling thread one of rayon's global workers (the binaries' main thread):
/// the engine's many small parallel kernels then start with a work-stealing hand-off
/// instead of waking a sleeping pool and blocking on a latch each time. Call once, first.
pub fn init_threads() {
    // An error means a pool already exists (a second call): kernels still run on it.
    let _ = rayon::ThreadPoolBuilder::new().use_current_thread().build_global();
}

/// Keeps freed host memory for reuse (glibc): by default glibc hands blocks over ~128 KiB
/// back to the kernel and takes fresh zeroed pages for the next, so every step's logits
/// (600 KB a token of a 151,936-word vocabulary, tens of MB a verify step) fault their
/// pages in again; whether that happens depends on the heap's history, and it cost up to
/// ~30 ms a B=8 verify step on the GPU host. The binaries call this first; a program
/// embedding the library may too (it sets process-wide malloc options).
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets glibc's thresholds; called before any other thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// The K/V budget a server on a GPU takes when `--kv-budget-mib` is not given: the device
/// memory free once the target is loaded, less a margin for activations, CUDA graphs, the
/// matmul scratch and a drafter's weights (a tenth of the GPU, at least 8 GiB). Logged at
/// info. None on the CPU (no budget: host memory is the limit).
pub fn default_kv_budget(model: &mtp_model::Model) -> Option<usize> {
    let (free, total) = model.device_memory()?;
    let margin = (total / 10).max(8 << 30);
    let budget = if free > margin { free - margin } else { free / 2 };
    tracing::info!(
        free_mib = free >> 20,
        total_mib = total >> 20,
        kv_budget_mib = budget >> 20,
        "K/V budget: free device memory less a margin (--kv-budget-mib to set it)"
    );
    Some(budget)
}

/// Parses a command-line count that cannot be zero (batch sizes, token counts, sizes):
/// clap names the flag in the error.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// A `top_p` as the f32 sampling uses, refused where the f32 would differ from what was
/// written in kind: a positive value under f32's range would become 0 and be refused as
/// "got 0", which the user never wrote.
pub fn top_p_f32(x: f64) -> Result<f32, String> {
    if x > 0.0 && x as f32 == 0.0 {
        return Err(format!("top_p must be in (0, 1], got {x:e}, 0 as an f32"));
    }
    Ok(x as f32)
}

/// Parses `--top-p` through [`top_p_f32`] (the range itself is checked with the other
/// sampling settings).
pub fn top_p_arg(s: &str) -> Result<f32, String> {
    top_p_f32(s.parse::<f64>().map_err(|e| e.to_string())?)
}

/// The most runs of each setting `mtp-bench --repeats` takes (each is the whole workload).
pub const MAX_REPEATS: usize = 1000;

/// Parses `--repeats`: 1 to [`MAX_REPEATS`].
pub fn repeat_count(s: &str) -> Result<usize, String> {
    let n = at_least_one(s)?;
    if n > MAX_REPEATS {
        return Err(format!("{n} is more than the {MAX_REPEATS} runs a setting may repeat"));
    }
    Ok(n)
}

/// Parses a size in MiB (0 allowed) whose byte count fits a `usize`: clap names the flag
/// when it does not, instead of the size wrapping when shifted to bytes.
pub fn mib(s: &str) -> Result<usize, String> {
    let m = s.parse::<usize>().map_err(|e| e.to_string())?;
    m.checked_mul(1 << 20)
        .map(|_| m)
        .ok_or_else(|| format!("{m} MiB is more bytes than this machine can address"))
}

/// [`mib`] that cannot be zero.
pub fn mib_at_least_one(s: &str) -> Result<usize, String> {
    match mib(s)? {
        0 => Err("must be at least 1".into()),
        m => Ok(m),
    }
}

/// Parses a positive duration in seconds (fractions allowed, at most a day): a timeout
/// of 0 or of years would turn the limit off.
pub fn seconds(s: &str) -> Result<std::time::Duration, String> {
    let v = s.parse::<f64>().map_err(|e| e.to_string())?;
    if !(v > 0.0 && v <= 86_400.0) {
        return Err(format!("{s} s: must be more than 0 and at most 86400 (a day)"));
    }
    Ok(std::time::Duration::from_secs_f64(v))
}

/// The numerics from `--kv-dtype` and `--kv-bits` (which cannot both be given) and
/// `--activations`.
pub fn numerics(
    kv_dtype: &str,
    kv_bits: Option<usize>,
    activations: &str,
) -> anyhow::Result<kernels::Numerics> {
    let activations = activations.parse::<kernels::Activations>()?;
    Ok(kernels::Numerics { kv: kv_format(kv_dtype, kv_bits)?, activations })
}

/// The K/V format from `--kv-dtype` and `--kv-bits` (which cannot both be given).
fn kv_format(kv_dtype: &str, kv_bits: Option<usize>) -> anyhow::Result<kernels::KvDtype> {
    use kernels::KvDtype;
    Ok(match (kv_bits, kv_dtype) {
        (None, d) => d.parse::<KvDtype>()?,
        (Some(8), "auto") => KvDtype::Q8,
        (Some(4), "auto") => KvDtype::Q4,
        (Some(b), "auto") => anyhow::bail!("--kv-bits {b}: quantized K/V take 8 or 4 bits"),
        (Some(_), d) => anyhow::bail!("--kv-bits and --kv-dtype {d} both set the K/V format: give one"),
    })
}

/// `--k`: `auto` (the engine chooses each row's k every round, up to `--max-k`) or a fixed
/// count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KArg {
    Auto,
    Fixed(usize),
}

impl KArg {
    pub fn with_max(self, max_k: usize) -> engine::DraftLen {
        match self {
            KArg::Auto => engine::DraftLen::Adaptive(max_k),
            KArg::Fixed(k) => engine::DraftLen::Fixed(k),
        }
    }

    /// `auto` or the number, as the tables print it.
    pub fn label(self) -> String {
        match self {
            KArg::Auto => "auto".into(),
            KArg::Fixed(k) => k.to_string(),
        }
    }
}

/// Parses `--k`: `auto` or a count of at least 1 (0 drafts nothing: that is plain decoding).
pub fn parse_k(s: &str) -> Result<KArg, String> {
    match s {
        "auto" => Ok(KArg::Auto),
        "0" => Err("must be at least 1 (--k 0 drafts nothing: use --drafter none for plain decoding)".into()),
        n => match n.parse::<usize>() {
            Ok(k) => draft_count(n).map(|_| KArg::Fixed(k)),
            Err(_) => Err(format!("`{n}` is neither `auto` nor a count")),
        },
    }
}

/// Parses a count of drafts a round (`--max-k`): 1 to [`engine::MAX_DRAFT_TOKENS`].
pub fn draft_count(s: &str) -> Result<usize, String> {
    match at_least_one(s)? {
        k if k > engine::MAX_DRAFT_TOKENS => {
            Err(format!("{k} drafts a round: at most {} allowed", engine::MAX_DRAFT_TOKENS))
        }
        k => Ok(k),
    }
}

/// The prompts JSONL format, for `--help` of the commands that read one (a macro so that
/// `concat!` can put it after their examples).
#[macro_export]
macro_rules! prompts_format {
    () => {
        "\
Prompts JSONL: one JSON object per line, e.g.
  {\"id\": \"a\", \"prompt\": \"fn main() {\", \"max_tokens\": 16}
  {\"id\": \"b\", \"prompt_ids\": [200, 620, 1266], \"temperature\": 0.8, \"seed\": 7, \"stop\": [\"}\"]}
`prompt` (text) or `prompt_ids` (token ids); optional: id, max_tokens, stop, temperature,
top_k, top_p, min_p, seed, top_logprobs, prompt_logprobs, arrive_at (R: submitted once the
engine has completed R rounds), and one constraint: json_schema, regex, grammar (Lark) or
response_format. Output: one JSON line per request (id, tokens, text, logprobs,
finish_reason), in input order. Blank lines are skipped."
    };
}

/// Files the repository ships for the commands' defaults, by path from its root: the
/// trained family (a small Qwen3 code model trained on Rust sources, recipe in `training/`;
/// its MTP head inside the target checkpoint) and the example prompts. [`shipped`] finds them.
pub mod shipped_files {
    /// The checkpoint `mtp generate`, `serve` and `mtp-bench` run when no `--target` is given.
    pub const TARGET: &str = "tests/fixtures/trained/target";
    /// The draft model trained for [`TARGET`] (same tokenizer, smaller).
    pub const DRAFT: &str = "tests/fixtures/trained/draft";
    /// `mtp generate`'s prompts when no `--prompts` is given.
    pub const PROMPTS: &str = "examples/prompts.jsonl";
    /// `mtp-bench`'s prompts when neither `--prompts` nor `--prompts-dir` is given: cut from
    /// this repository's own sources, which the trained family never saw in training.
    pub const HELDOUT_PROMPTS: &str = "examples/heldout-prompts.jsonl";
}

/// The source tree this binary was built from.
const BUILT_FROM: &str = env!("CARGO_MANIFEST_DIR");

/// Where a file the repository ships ([`shipped_files`]) is: in the checkout that holds the
/// running executable (`target/release/mtp` or `target/debug/deps/...`, wherever the clone
/// now is), else in the source tree the binary was built from (`cargo install --path .`
/// leaves it there). A binary copied away from both finds neither: the error names the flag
/// that replaces the default.
pub fn shipped(rel: &str, flag: &str) -> anyhow::Result<std::path::PathBuf> {
    let exe = std::env::current_exe().ok();
    shipped_from(rel, flag, exe.as_deref(), std::path::Path::new(BUILT_FROM))
}

/// [`shipped`] with the executable's path and the build tree given.
fn shipped_from(
    rel: &str,
    flag: &str,
    exe: Option<&std::path::Path>,
    built_from: &std::path::Path,
) -> anyhow::Result<std::path::PathBuf> {
    let beside_exe = exe.into_iter().flat_map(|e| e.ancestors().skip(1)).map(|dir| dir.join(rel));
    let mut looked = Vec::new();
    for path in beside_exe.chain([built_from.join(rel)]) {
        if path.exists() {
            return Ok(path);
        }
        looked.push(path);
    }
    anyhow::bail!(
        "no {flag} given, and the default it stands for ({rel}, shipped in the mtp repository) is not \
         beside this executable or in the tree it was built from ({}): give {flag}, or run the binary \
         from a checkout of the repository",
        built_from.display()
    )
}

/// The default target checkpoint ([`shipped_files::TARGET`]).
pub fn default_target() -> anyhow::Result<std::path::PathBuf> {
    shipped(shipped_files::TARGET, "--target")
}

/// The target checkpoint `--target` names: a directory, or a Hugging Face repo id resolved
/// to its cached (or downloaded) snapshot; [`default_target`] without one.
pub fn target_dir(target: Option<&std::path::Path>) -> anyhow::Result<std::path::PathBuf> {
    match target {
        Some(t) => Ok(base::hub::resolve_from_env(t)?),
        None => default_target(),
    }
}

#[cfg(test)]
mod shipped_tests {
    use super::*;
    use std::path::Path;

    /// A scratch directory holding the given files.
    fn tree(tag: &str, files: &[&str]) -> std::path::PathBuf {
        let root = std::env::temp_dir().join(format!("mtp-shipped-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for f in files {
            let p = root.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, "").unwrap();
        }
        root
    }

    #[test]
    fn a_moved_checkout_finds_its_own_files_first() {
        let moved = tree("moved", &["examples/prompts.jsonl", "target/release/mtp"]);
        let built = tree("built", &["examples/prompts.jsonl"]);
        let exe = moved.join("target/release/mtp");
        let got = shipped_from("examples/prompts.jsonl", "--prompts", Some(&exe), &built).unwrap();
        assert_eq!(got, moved.join("examples/prompts.jsonl"));
        // Without the file beside the executable, the build tree's.
        let bare = tree("bare", &["bin/mtp"]);
        let got =
            shipped_from("examples/prompts.jsonl", "--prompts", Some(&bare.join("bin/mtp")), &built).unwrap();
        assert_eq!(got, built.join("examples/prompts.jsonl"));
    }

    #[test]
    fn a_binary_away_from_both_names_the_flag() {
        let bare = tree("away", &["bin/mtp"]);
        let gone = Path::new("/nonexistent/mtp-source");
        let e =
            shipped_from(shipped_files::TARGET, "--target", Some(&bare.join("bin/mtp")), gone).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("give --target") && e.contains(shipped_files::TARGET) && e.contains("/nonexistent"),
            "{e}"
        );
        // No executable path at all (current_exe failed): the build tree alone decides.
        assert!(shipped_from(shipped_files::TARGET, "--target", None, gone).is_err());
    }
}
