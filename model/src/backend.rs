//! The backend seam. The CPU kernels in [`crate::kernels`] are the reference; CUDA and
//! Metal builds name their backend here until their row-invariant kernels land.

use crate::error::{Error, Result};

/// Where a model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    #[default]
    Cpu,
    Cuda,
    Metal,
}

impl std::str::FromStr for Backend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Backend> {
        match s {
            "cpu" => Ok(Backend::Cpu),
            "cuda" => Ok(Backend::Cuda),
            "metal" => Ok(Backend::Metal),
            other => Err(Error::Backend(format!("unknown backend `{other}` (cpu, cuda, metal)"))),
        }
    }
}

impl Backend {
    /// Checks that this build can run the backend, with a clear error when it cannot.
    pub fn check(self) -> Result<()> {
        match self {
            Backend::Cpu => Ok(()),
            Backend::Cuda if cfg!(feature = "cuda") => Err(Error::Backend(
                "the CUDA row-invariant kernels are not implemented yet; use --backend cpu".into(),
            )),
            Backend::Metal if cfg!(feature = "metal") => Err(Error::Backend(
                "the Metal row-invariant kernels are not implemented yet; use --backend cpu".into(),
            )),
            other => Err(Error::Backend(format!(
                "this binary was not built with the {other:?} backend (rebuild with --features {})",
                format!("{other:?}").to_lowercase()
            ))),
        }
    }
}
