//! What loads a model, an MTP head or Gemma 4's assistant onto a backend: the one `match`
//! from an architecture to its family (`crate::models`), and the one list of the backends
//! this build has ([`on_backend!`]). Adding a family is a folder under `models/` and an arm
//! here; adding a backend is a crate behind `mtp_kernels::Kernels`, a feature and an arm in
//! [`on_backend!`].

use std::path::Path;
use std::sync::Arc;

use mtp_base::config::{count_key, read_json, Arch, Config, MAX_LAYERS};
use mtp_base::error::{Error, Result};
use mtp_base::Checkpoint;
use mtp_kernels::{Activations, Backend, Kernels, KvDtype, Numerics};

use crate::accounting;
use crate::eagle3::{Eagle3Head, Eagle3Spec};
use crate::forward::{Model, Net};
use crate::models::gemma4::assistant::Gemma4Assistant;
use crate::models::{gemma4, llama};
use crate::mtp::{MtpHead, MtpLayout};
use crate::tensor_parallel::{Shard, TensorParallel};
use mtp_kernels::collective::{Collective, HostCollective};

/// The most tensor-parallel ranks a model is split between (GPUs of one host).
pub const MAX_RANKS: usize = 8;

/// Runs `$body` with `$be` bound to the `Arc` of `$backend`'s kernel set computing
/// activations as `$activations` says (each backend this build has), or returns an error
/// naming what is missing or refused.
macro_rules! on_backend {
    ($backend:expr, $activations:expr, $be:ident => $body:expr) => {{
        let activations: Activations = $activations;
        match $backend {
            Backend::Cpu => {
                let $be = Arc::new(mtp_kernels::cpu::Cpu::with_activations(activations));
                $body
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda => {
                let $be = mtp_cuda::Cuda::shared_with(activations)?;
                $body
            }
            #[cfg(all(feature = "metal", target_os = "macos"))]
            Backend::Metal => {
                activations.f32_only(Backend::Metal)?;
                let $be = mtp_metal::apple::Apple::shared()?;
                $body
            }
            #[cfg(all(feature = "metal-emulator", not(target_os = "macos")))]
            Backend::MetalEmulated => {
                activations.f32_only(Backend::MetalEmulated)?;
                let $be = mtp_metal::emulated::Emulator::shared();
                $body
            }
            #[allow(unreachable_patterns)]
            other => {
                check(other)?;
                Err(Error::Backend(format!("no {} kernels in this build", other.name())))
            }
        }
    }};
}

/// Checks that this build can run `backend`, with a clear error when it cannot (not
/// compiled in, no GPU, no driver).
pub fn check(backend: Backend) -> Result<()> {
    match backend {
        Backend::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        Backend::Cuda => mtp_cuda::Cuda::shared().map(|_| ()),
        #[cfg(all(feature = "metal", target_os = "macos"))]
        Backend::Metal => mtp_metal::apple::Apple::shared().map(|_| ()),
        #[cfg(not(target_os = "macos"))]
        Backend::Metal => Err(Error::Backend(
            "the Metal backend runs on macOS (Apple GPUs); here `--backend metal-emulated` runs the same \
             kernels on the CPU emulator (slow: for testing; a build with --features metal-emulator)"
                .into(),
        )),
        #[cfg(all(feature = "metal-emulator", not(target_os = "macos")))]
        Backend::MetalEmulated => Ok(()),
        #[cfg(target_os = "macos")]
        Backend::MetalEmulated => Err(Error::Backend(
            "the Metal emulator is built everywhere but macOS, where the real device runs".into(),
        )),
        #[allow(unreachable_patterns)]
        other => Err(Error::Backend(format!(
            "this binary was not built with the {other:?} backend (rebuild with --features {})",
            feature_of(other)
        ))),
    }
}

/// The `mtp` feature that builds `backend` in.
fn feature_of(backend: Backend) -> &'static str {
    match backend {
        Backend::Cpu => "",
        Backend::Cuda => "cuda",
        Backend::Metal => "metal",
        Backend::MetalEmulated => "metal-emulator",
    }
}

/// A model split between `ranks` ranks of `backend` (CPU threads, or GPUs over NCCL).
fn split_on(
    backend: Backend,
    config: &Config,
    ck: &Checkpoint,
    numerics: Numerics,
    ranks: usize,
) -> Result<TensorParallel> {
    let (kv, act) = (numerics.kv, numerics.activations);
    match backend {
        Backend::Cpu => {
            let backends =
                (0..ranks).map(|_| Arc::new(mtp_kernels::cpu::Cpu::with_activations(act))).collect();
            split(config, ck, kv, backends, Arc::new(HostCollective::new(ranks)))
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda => {
            let gpus = mtp_cuda::Cuda::device_count();
            if ranks > gpus {
                return Err(Error::InvalidOption(format!(
                    "--tensor-parallel {ranks}: this machine has {gpus} GPU(s) (one rank a GPU)"
                )));
            }
            let backends =
                (0..ranks).map(|gpu| mtp_cuda::Cuda::on_device(gpu, act)).collect::<Result<Vec<_>>>()?;
            let nccl = Arc::new(mtp_cuda::NcclCollective::new(&backends)?);
            split(config, ck, kv, backends, nccl)
        }
        other => Err(Error::InvalidOption(format!(
            "--tensor-parallel {ranks}: not built for the {} backend (cpu, cuda)",
            other.name()
        ))),
    }
}

/// A model split between one rank per backend in `backends`, exchanging
/// partial sums through `collective`.
fn split<B: Kernels, C: Collective<B> + 'static>(
    config: &Config,
    ck: &Checkpoint,
    kv: KvDtype,
    backends: Vec<Arc<B>>,
    collective: Arc<C>,
) -> Result<TensorParallel> {
    let ranks = backends.len();
    let nets = backends
        .into_iter()
        .enumerate()
        .map(|(rank, be)| {
            let shard = Shard { rank, ranks, collective: collective.clone() };
            match config.arch {
                Arch::Llama | Arch::Qwen2 | Arch::Qwen3 => {
                    llama::load_rank(be, config.clone(), ck, kv, shard)
                }
                Arch::Gemma4 => gemma4::load_rank(be, config.clone(), ck, kv, shard),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(TensorParallel::new(nets, collective, config))
}

impl Model {
    /// Loads `config.json` (+ `generation_config.json`) and the safetensors weights of
    /// `dir` for the CPU.
    pub fn load(dir: &Path) -> Result<Model> {
        Model::load_on(dir, Backend::Cpu)
    }

    /// Loads `dir` onto `backend` (weights copied to the device for a GPU backend), K/V
    /// and activations in the backend's defaults.
    pub fn load_on(dir: &Path, backend: Backend) -> Result<Model> {
        Model::load_with(dir, backend, KvDtype::Auto)
    }

    /// Loads `dir` onto `backend` computing as `numerics` says (a [`KvDtype`] alone: K/V
    /// stored so, activations in the backend's default).
    pub fn load_with(dir: &Path, backend: Backend, numerics: impl Into<Numerics>) -> Result<Model> {
        Model::load_parallel(dir, backend, numerics, 1)
    }

    /// Loads `dir` split between `ranks` tensor-parallel ranks (`--tensor-parallel`): on the
    /// CPU, `ranks` threads. Every row stays invariant for a given rank count; different
    /// counts add the ranks' partial sums differently (see `crate::tensor_parallel`).
    pub fn load_parallel(
        dir: &Path,
        backend: Backend,
        numerics: impl Into<Numerics>,
        ranks: usize,
    ) -> Result<Model> {
        let config = Config::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        Model::from_checkpoint_parallel(config, &ck, backend, numerics.into(), ranks)
    }

    /// Loads `ck` (whose `config.json` gave `config`) onto `backend`: the one place that
    /// maps an architecture to its family.
    pub fn from_checkpoint(
        config: Config,
        ck: &Checkpoint,
        backend: Backend,
        numerics: Numerics,
    ) -> Result<Model> {
        Model::from_checkpoint_parallel(config, ck, backend, numerics, 1)
    }

    /// [`Model::from_checkpoint`] split between `ranks` tensor-parallel ranks.
    pub fn from_checkpoint_parallel(
        config: Config,
        ck: &Checkpoint,
        backend: Backend,
        numerics: Numerics,
        ranks: usize,
    ) -> Result<Model> {
        let (c, kv, act) = (config.clone(), numerics.kv, numerics.activations);
        if ranks == 0 || ranks > MAX_RANKS {
            return Err(Error::InvalidOption(format!(
                "--tensor-parallel {ranks}: give 1 to {MAX_RANKS} ranks"
            )));
        }
        let net: Box<dyn Net> = match (ranks, config.arch) {
            (1, Arch::Llama | Arch::Qwen2 | Arch::Qwen3) => {
                on_backend!(backend, act, be => llama::load(be, c, ck, kv))?
            }
            (1, Arch::Gemma4) => on_backend!(backend, act, be => gemma4::load(be, c, ck, kv))?,
            _ => Box::new(split_on(backend, &config, ck, numerics, ranks)?),
        };
        accounting::check_target(ck, &config)?;
        Ok(Model { config, net, forwards: Default::default() })
    }
}

impl MtpHead {
    /// Loads module 0 from `dir` (a separate MTP checkpoint, or the target's own
    /// directory when the weights ship inside it), shaped like `target` and on its backend.
    pub fn load(dir: &Path, target: &Model) -> Result<MtpHead> {
        let cfg_path = dir.join("config.json");
        let raw = read_json(&cfg_path)?;
        let tc = &target.config;
        let get = |key: &str| count_key(&cfg_path, &raw, key);
        let n_mtp = get("num_nextn_predict_layers")?.unwrap_or(0);
        if n_mtp == 0 {
            return Err(Error::config(
                &cfg_path,
                "num_nextn_predict_layers",
                "is 0 or absent: this checkpoint declares no MTP head",
            ));
        }
        for (key, want) in [("hidden_size", tc.hidden_size), ("vocab_size", tc.vocab_size)] {
            if let Some(have) = get(key)? {
                if have != want {
                    return Err(Error::config(
                        &cfg_path,
                        key,
                        format!("{have} differs from the target's {want}"),
                    ));
                }
            }
        }
        let n_layers = get("num_hidden_layers")?.unwrap_or(tc.num_hidden_layers);
        if n_layers > MAX_LAYERS {
            return Err(Error::config(
                &cfg_path,
                "num_hidden_layers",
                format!("{n_layers} is over {MAX_LAYERS}"),
            ));
        }
        let ck = Checkpoint::open(dir)?;
        let layout = [MtpLayout::MiMo, MtpLayout::DeepSeek]
            .into_iter()
            .find(|l| ck.contains(&l.names(&l.prefix(n_layers, 0))[2]))
            .ok_or_else(|| Error::MissingTensor {
                dir: dir.to_path_buf(),
                name: format!(
                    "{} (MiMo) or {} (DeepSeek-V3)",
                    MtpLayout::MiMo.names(&MtpLayout::MiMo.prefix(n_layers, 0))[2],
                    MtpLayout::DeepSeek.names(&MtpLayout::DeepSeek.prefix(n_layers, 0))[2]
                ),
            })?;
        let net = target.net().load_mtp(&ck, layout, &layout.prefix(n_layers, 0))?;
        accounting::check_mtp(&ck, &cfg_path, layout, n_layers, n_mtp)?;
        if n_mtp > 1 {
            tracing::info!("{n_mtp} MTP modules in {}; drafting uses module 0 recursively", dir.display());
        }
        Ok(MtpHead { layout, net })
    }
}

impl Eagle3Head {
    /// Loads the EAGLE-3 head in `dir` to draft for `target`, on the target's backend;
    /// refuses a head that does not fit it, naming the key or tensor, and any tensor the
    /// load leaves unread.
    pub fn load(dir: &Path, target: &Model) -> Result<Eagle3Head> {
        let spec = Eagle3Spec::read(dir, &target.config)?;
        let ck = Checkpoint::open(dir)?;
        let net = target.net().load_eagle3(&ck, &spec)?;
        accounting::check_all(&ck, "the EAGLE-3 head")?;
        Ok(Eagle3Head { spec, net })
    }
}

impl Gemma4Assistant {
    /// Loads the assistant in `dir` to draft for `target` (a Gemma 4 model), on the
    /// target's backend.
    pub fn load(dir: &Path, target: Arc<Model>) -> Result<Gemma4Assistant> {
        if target.tensor_parallel() > 1 {
            return Err(Error::InvalidOption(format!(
                "--tensor-parallel {}: Gemma 4's assistant does not draft for a target split between ranks yet \
                 (draft with --drafter ngram, or run the target whole)",
                target.tensor_parallel()
            )));
        }
        on_backend!(target.backend(), target.numerics().activations, be => Gemma4Assistant::load_on(dir, target, be))
    }
}
