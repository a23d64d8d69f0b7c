//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod http;
pub mod invariance;
pub mod server;

use std::path::{Path, PathBuf};

use mtp::base::Error;
use mtp::drafter::Drafter;
use mtp::engine::{generate, Completion, Engine, EngineOptions, Request};
use mtp::kernels::{Activations, Backend, KvDtype, Numerics};
use mtp::model::Model;

/// The backend the model-level tests run on: the CPU, or what `MTP_TEST_BACKEND` names
/// (`scripts/gpu-run.sh tests` sets `cuda`). The same test proves the same property on each.
pub fn backend() -> Backend {
    match std::env::var("MTP_TEST_BACKEND") {
        Ok(name) => name.parse().unwrap_or_else(|e| panic!("MTP_TEST_BACKEND: {e}")),
        Err(_) => Backend::Cpu,
    }
}

/// The K/V dtype the model-level tests load with: the backend's default, or what
/// `MTP_TEST_KV` names (`scripts/gpu-run.sh tests` runs some suites again with `bf16`, so
/// the f32 fixtures take CUDA's tensor-core attention too).
pub fn test_kv() -> KvDtype {
    match std::env::var("MTP_TEST_KV") {
        Ok(name) => name.parse().unwrap_or_else(|e| panic!("MTP_TEST_KV: {e}")),
        Err(_) => KvDtype::Auto,
    }
}

/// The matmul activations the model-level tests load with: the backend's default, or what
/// `MTP_TEST_ACTIVATIONS` names (`bf16` runs a suite's bf16 checkpoints, the trained family,
/// through the bf16-activation matmul on the CPU too).
pub fn test_activations() -> Activations {
    match std::env::var("MTP_TEST_ACTIVATIONS") {
        Ok(name) => name.parse().unwrap_or_else(|e| panic!("MTP_TEST_ACTIVATIONS: {e}")),
        Err(_) => Activations::Auto,
    }
}

/// Loads a checkpoint on the test backend.
pub fn load(dir: &Path) -> Model {
    let numerics = Numerics { kv: test_kv(), activations: test_activations() };
    Model::load_with(dir, backend(), numerics).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Whether a test runs its whole matrix of settings. `MTP_TEST_MATRIX` says: `full` (the
/// default on the CPU and CUDA) or `rotated` (the default on the Metal emulator, which runs
/// a kernel's threads one after another, about 100x the CPU's time): a subset that still
/// takes every setting through the emulated kernels once. The CPU's full run of the same
/// test proves the engine's logic at every combination; `scripts/ci-slow.sh` runs the
/// emulator's with `MTP_TEST_MATRIX=full`.
pub fn full_matrix() -> bool {
    match std::env::var("MTP_TEST_MATRIX").as_deref() {
        Ok("full") => true,
        Ok("rotated") => false,
        Ok(other) => panic!("MTP_TEST_MATRIX: `{other}` is neither `full` nor `rotated`"),
        Err(_) => backend() != Backend::MetalEmulated,
    }
}

/// The (k, max batch) settings a parity gate runs for its `drafter`-th drafter: every `k`
/// at max batch 1, 3 and 8, or, rotated ([`full_matrix`]), two of them: max batch 8 (shared
/// slots) and 3 (row tails), with k rotating between drafters, so each drafter, each k and
/// both window layouts still meet the kernels with mixed accepts in one batch.
pub fn gate_settings<K: Copy>(drafter: usize, ks: &[K]) -> Vec<(K, usize)> {
    match full_matrix() {
        true => ks.iter().flat_map(|&k| [1, 3, 8].map(|b| (k, b))).collect(),
        false => vec![(ks[(drafter + 1) % ks.len()], 8), (ks[drafter % ks.len()], 3)],
    }
}

pub const FAMILIES: [&str; 6] =
    ["llama-target", "llama-draft", "qwen2-target", "qwen2-draft", "qwen3-target", "qwen3-draft"];

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny").join(name)
}

/// The EAGLE-3 head for the trained target, with random weights and numpy goldens
/// (`tests/fixtures/eagle3/make_fixture.py`).
pub fn eagle3_head() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/eagle3")
}

/// The trained family (`target`, with its MTP head inside, and `draft`), written by
/// `training/export.py`.
pub fn trained(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trained").join(name)
}

/// The adversarial oracle of the parity gates: each request's reference continuation, every
/// token corrupted with probability 0.4, so rows of one batch accept different lengths
/// every round.
pub fn oracle(requests: &[Request], reference: &[Completion], vocab: usize) -> mtp::drafter::OracleDrafter {
    let refs = requests.iter().zip(reference).map(|(r, c)| (r.prompt.clone(), c.tokens.clone()));
    mtp::drafter::OracleDrafter::new(refs, 0.6, 11, vocab).unwrap()
}

/// A small deterministic generator for test data (no global RNG state).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next_u32(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    pub fn below(&mut self, n: usize) -> usize {
        self.next_u32() as usize % n
    }
    pub fn f32(&mut self) -> f32 {
        self.next_u32() as f32 / (1u64 << 31) as f32 * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs `requests` through an engine with `drafter` and returns one result per request.
pub fn run<'a>(
    model: &'a Model,
    drafter: Option<Box<dyn Drafter + 'a>>,
    opts: EngineOptions,
    requests: &[Request],
    arrive_at: &[u64],
) -> Vec<Result<Completion, Error>> {
    let mut engine = Engine::new(model, drafter, opts).unwrap();
    generate(&mut engine, requests, arrive_at, |_, _| {})
}

/// Plain greedy decoding, `max_batch` rows at a time.
pub fn plain(model: &Model, requests: &[Request], max_batch: usize) -> Vec<Result<Completion, Error>> {
    run(model, None, EngineOptions { max_batch, ..EngineOptions::default() }, requests, &[])
}

pub fn request(id: &str, prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request { id: id.into(), prompt, max_tokens, ignore_eos: true, ..Request::default() }
}

/// The Python that `MTP_PYTHON` names (else `python3`) when it can import `module`; `None`
/// (the test skips) when it cannot, unless `MTP_REQUIRE_OPENAI` is set (as `.ci/run` sets
/// it, having installed the packages), where that is a failure.
pub fn python_with(module: &str) -> Option<String> {
    let python = std::env::var("MTP_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = std::process::Command::new(&python).args(["-c", &format!("import {module}")]).output();
    if has.is_ok_and(|o| o.status.success()) {
        return Some(python);
    }
    assert!(std::env::var_os("MTP_REQUIRE_OPENAI").is_none(), "{python} has no `{module}` package");
    eprintln!("skipped: {python} has no `{module}` package (.ci/run installs it; or set MTP_PYTHON)");
    None
}

/// Runs `scripts/{script}` with `python` and `args`, asserts it succeeded (its stderr
/// otherwise), and returns its output, one JSON value a line.
pub fn script_lines<T: serde::de::DeserializeOwned>(python: &str, script: &str, args: &[&str]) -> Vec<T> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts").join(script);
    let out = std::process::Command::new(python).arg(&path).args(args).output().unwrap();
    assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// The first row of `got` that differs from `want` (tokens, logprobs and top alternatives
/// by bits), or failed.
pub fn first_difference(got: &[Result<Completion, Error>], want: &[Completion]) -> Option<String> {
    let tops = |c: &Completion| -> Vec<Vec<(u32, u32)>> {
        c.top_logprobs.iter().map(|t| t.iter().map(|&(id, l)| (id, l.to_bits())).collect()).collect()
    };
    got.iter().zip(want).enumerate().find_map(|(i, (g, w))| match g {
        Ok(g) if mtp::bench::same(g, w) && tops(g) == tops(w) => None,
        Ok(g) => Some(format!(
            "request {i}: got {:?} {:?}, want {:?} {:?}",
            g.tokens, g.finish, w.tokens, w.finish
        )),
        Err(e) => Some(format!("request {i}: failed: {e}")),
    })
}

/// A copy of the MLX checkpoint at `src` in a fresh temporary directory (`tag` names it)
/// whose f32 quantization scales and biases are rounded to bf16, as mlx-lm writes them for
/// a bf16 model (a different model, the same layout).
pub fn with_bf16_scales(src: &Path, tag: &str) -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let dir = std::env::temp_dir().join(format!("mtp-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_owned();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
            for (tname, view) in st.tensors() {
                let rounds =
                    (tname.ends_with(".scales") || tname.ends_with(".biases")) && view.dtype() == Dtype::F32;
                let (dtype, data) = match rounds {
                    true => (
                        Dtype::BF16,
                        view.data()
                            .chunks_exact(4)
                            .flat_map(|c| {
                                half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
                            })
                            .collect(),
                    ),
                    false => (view.dtype(), view.data().to_vec()),
                };
                tensors.push((tname, dtype, view.shape().to_vec(), data));
            }
            let views: Vec<(String, TensorView)> = tensors
                .iter()
                .map(|(n, d, shape, data)| (n.clone(), TensorView::new(*d, shape.clone(), data).unwrap()))
                .collect();
            safetensors::serialize_to_file(views, metadata.metadata().clone(), &dir.join(&name)).unwrap();
        } else if path.is_file() {
            std::fs::copy(&path, dir.join(&name)).unwrap();
        }
    }
    dir
}
