//! With the `cuda` feature, compiles `src/kernels.cu` to PTX with nvcc (PTX for compute
//! capability 8.0, which the driver compiles for the GPU it finds: A100, H100 and later),
//! and `src/hopper.cu` to PTX for sm_90a (wgmma and TMA: H100, H200).
//! nvcc comes from `NVCC`, `CUDA_HOME`/`CUDA_PATH`, or `PATH`; `scripts/install-nvcc.sh`
//! installs the pinned one from PyPI. No GPU is needed to build.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        cuda();
    }
}

fn cuda() {
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-changed=src/walk.cuh");
    println!("cargo:rerun-if-changed=src/flash.cuh");
    println!("cargo:rerun-if-changed=src/forward.cuh");
    // kernels.cu's op families, which it includes.
    println!("cargo:rerun-if-changed=src/common.cuh");
    println!("cargo:rerun-if-changed=src/matmul.cuh");
    println!("cargo:rerun-if-changed=src/matmul_tc.cuh");
    println!("cargo:rerun-if-changed=src/matmul_tcq.cuh");
    println!("cargo:rerun-if-changed=src/matmul_tt.cuh");
    println!("cargo:rerun-if-changed=src/embed.cuh");
    println!("cargo:rerun-if-changed=src/norm.cuh");
    println!("cargo:rerun-if-changed=src/summaries.cuh");
    println!("cargo:rerun-if-changed=src/qk_rope_store.cuh");
    println!("cargo:rerun-if-changed=src/attention.cuh");
    println!("cargo:rerun-if-changed=src/kv.cuh");
    println!("cargo:rerun-if-changed=src/stock.cuh");
    println!("cargo:rerun-if-changed=src/elementwise.cuh");
    println!("cargo:rerun-if-changed=src/flash_kernels.cuh");
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| {
            ["CUDA_HOME", "CUDA_PATH"]
                .iter()
                .filter_map(std::env::var_os)
                .map(|h| PathBuf::from(h).join("bin/nvcc"))
                .find(|p| p.exists())
        })
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    // Every kernel as PTX for compute capability 8.0; the Hopper module (wgmma, TMA) as
    // PTX for sm_90a, loaded only on such a GPU.
    ptx(&nvcc, "src/kernels.cu", "kernels.ptx", "compute_80");
    ptx(&nvcc, "src/hopper.cu", "hopper.ptx", "compute_90a");
}

fn ptx(nvcc: &Path, src: &str, name: &str, arch: &str) {
    println!("cargo:rerun-if-changed={src}");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join(name);
    let status =
        Command::new(nvcc).args(["--ptx", &format!("-arch={arch}"), "-O3", "-o"]).arg(&out).arg(src).status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{} failed on {src} ({s})", nvcc.display()),
        Err(e) => panic!(
            "the cuda feature needs nvcc to compile {src}: cannot run `{}`: {e}. \
             Run scripts/install-nvcc.sh and set NVCC to the path it prints (or put a CUDA 13 \
             nvcc on PATH).",
            nvcc.display()
        ),
    }
}
