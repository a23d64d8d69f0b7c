//! The row-invariant CUDA matmul on Qwen3-8B's shapes (bf16 weights) at M in {1, 8, 40, 64,
//! 128, 512, 4096} (40: a verify of 8 rows x 5 tokens), in both activation modes side by
//! side (bf16: rounded, one MMA a product; f32: three exact terms): median milliseconds of
//! GPU time (events around the launches, as torch's numbers beside it) and weight bandwidth.
//! Each repetition reads another of 4 weight copies, so the 50 MB L2 never holds the
//! weights being timed. `scripts/gpu-run.sh` prints torch.matmul (cuBLAS) on the same
//! shapes beside it.
//!
//! `gpu_matmul [--shapes NxK,..] [--m M,..] [--reps R] [--kernels [--only NAME,..]]` narrows
//! it (for a profiler: `scripts/gpu-run.sh profile-matmul`); `--kernels` times every
//! tensor-core kernel at every M, not only the one the host picks (which `kernel` names),
//! or with `--only` the kernels named (as `TcKernel` spells them: `Wgmma128x192`); `--stacked`
//! times the 8B layer's q/k/v and gate/up as a launch each against one `linear_parts`
//! launch, at M = 1 and 8.

use std::time::Instant;

use mtp::base::{Weight, WeightDtype};
use mtp::cuda::{Cuda, TcKernel};
use mtp::kernels::{Activations, Kernels, Out};

/// The comma-separated list after `name`, each item parsed by `parse`, or `default`.
fn list<T>(
    args: &[String],
    name: &str,
    parse: impl Fn(&str) -> Option<T>,
    default: Vec<T>,
) -> anyhow::Result<Vec<T>> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => {
            let v = args.get(i + 1).ok_or_else(|| anyhow::anyhow!("{name} needs a value"))?;
            v.split(',')
                .map(|s| parse(s).ok_or_else(|| anyhow::anyhow!("{name}: cannot read {s:?}")))
                .collect()
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let shapes = list(
        &args,
        "--shapes",
        |s| s.split_once('x').and_then(|(n, k)| Some((n.parse().ok()?, k.parse().ok()?))),
        vec![(4096usize, 4096usize), (12288, 4096), (4096, 12288)],
    )?;
    let ms = list(&args, "--m", |s| s.parse().ok(), vec![1usize, 8, 40, 64, 128, 512, 4096])?;
    let reps = list(&args, "--reps", |s| s.parse().ok(), vec![20usize])?[0].max(1);
    let only = list(&args, "--only", |s| Some(s.to_string()), Vec::new())?;
    let all: Vec<TcKernel> =
        TcKernel::ALL.into_iter().filter(|k| only.is_empty() || only.contains(&format!("{k:?}"))).collect();
    if let Some(unknown) = only.iter().find(|name| !all.iter().any(|k| format!("{k:?}") == **name)) {
        anyhow::bail!(
            "--only: no tensor-core kernel is named {unknown:?} (see TcKernel in cuda/src/matmul_tc.rs)"
        );
    }
    let cuda = Cuda::shared()?;
    println!("device: {}", cuda.device_name());
    if args.iter().any(|a| a == "--stacked") {
        return stacked(&cuda, reps);
    }
    let every_kernel = args.iter().any(|a| a == "--kernels");
    // Both modes' kernel sets (one stream): a matrix loaded by one serves the other.
    let modes = [cuda.clone(), Cuda::shared_with(Activations::F32)?];
    println!("| N x K | M | kernel | bf16 activations, ms (median of {reps}) | f32 activations, ms | bf16 GB/s of weights |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (n, k) in shapes {
        let weight = bf16_weight(n, k);
        let copies = (0..4).map(|_| cuda.matrix(&weight)).collect::<Result<Vec<_>, _>>()?;
        for &m in &ms {
            let x = cuda.upload(&activations(m, k))?;
            let mut out = cuda.alloc(m * n)?;
            let picked = cuda.pick(m, n, k);
            let kernels = if every_kernel { all.clone() } else { vec![picked] };
            for kernel in kernels {
                // A kernel a mode cannot run (wgmma with f32 activations): that mode's own
                // pick when timing the picks, else nothing ("-").
                let own = |cuda: &Cuda| match cuda.runs(kernel, k) {
                    true => Some(kernel),
                    false if !every_kernel => Some(cuda.pick(m, n, k)),
                    false => None,
                };
                let mut times = [Vec::new(), Vec::new()];
                for rep in 0..reps + 3 {
                    for (i, (cuda, times)) in modes.iter().zip(&mut times).enumerate() {
                        let Some(kernel) = own(cuda) else { continue };
                        cuda.synchronize()?;
                        // Every launch reads another copy than the one before it (the modes
                        // alternate), so neither mode finds its weights in L2.
                        let w = &copies[(2 * rep + i) % 4];
                        let ms = cuda.gpu_time_ms(|| {
                            cuda.linear_tc_with(kernel, &x, m, w, None, &mut out, Out::Write)
                        })?;
                        if rep >= 3 {
                            times.push(ms / 1e3);
                        }
                    }
                }
                let [t16, t32] = times.map(|mut t| median(&mut t));
                let mark = if kernel == picked && every_kernel { " (picked)" } else { "" };
                let ms = |t: f64| if t.is_nan() { "-".to_string() } else { format!("{:.3}", t * 1e3) };
                println!(
                    "| {n} x {k} | {m} | {kernel:?}{mark} | {} | {} | {:.0} |",
                    ms(t16),
                    ms(t32),
                    (n * k * 2) as f64 / t16 / 1e9
                );
            }
        }
    }
    Ok(())
}

/// A bf16 weight of `n x k` with small varied values.
fn bf16_weight(n: usize, k: usize) -> Weight {
    let bytes: Vec<u8> = (0..n * k)
        .flat_map(|i| half::bf16::from_f32(((i % 97) as f32 - 48.0) * 1e-3).to_le_bytes())
        .collect();
    Weight::from_le_bytes(bytes, WeightDtype::Bf16, n, k)
}

/// `m x k` activations with small varied values.
fn activations(m: usize, k: usize) -> Vec<f32> {
    (0..m * k).map(|i| ((i % 89) as f32 - 44.0) * 1e-2).collect()
}

/// The median, NaN for no times.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The 8B layer's projections over one input: a launch each, then one `linear_parts`
/// launch, alternated in every repetition (each on another of 4 weight copies).
fn stacked(cuda: &Cuda, reps: usize) -> anyhow::Result<()> {
    println!("| projections | M | a launch each, ms | one launch, ms | ratio |");
    println!("| --- | --- | --- | --- | --- |");
    for (name, widths) in [("q/k/v", vec![4096usize, 1024, 1024]), ("gate/up", vec![12288, 12288])] {
        let k = 4096;
        let weights: Vec<Weight> = widths.iter().map(|&n| bf16_weight(n, k)).collect();
        let copies = (0..4)
            .map(|_| weights.iter().map(|w| cuda.matrix(w)).collect::<Result<Vec<_>, _>>())
            .collect::<Result<Vec<_>, _>>()?;
        for m in [1usize, 8] {
            let x = cuda.upload(&activations(m, k))?;
            let mut outs = widths.iter().map(|&n| cuda.alloc(m * n)).collect::<Result<Vec<_>, _>>()?;
            let (mut apart, mut together) = (Vec::new(), Vec::new());
            for rep in 0..reps + 3 {
                let mats = &copies[rep % 4];
                cuda.synchronize()?;
                let t0 = Instant::now();
                for (w, out) in mats.iter().zip(outs.iter_mut()) {
                    cuda.linear(&x, m, w, None, out, Out::Write)?;
                }
                cuda.synchronize()?;
                let t1 = Instant::now();
                let parts: Vec<_> = mats.iter().map(|w| (w, None)).collect();
                let mut refs: Vec<_> = outs.iter_mut().collect();
                cuda.linear_parts(&x, m, &parts, &mut refs)?;
                cuda.synchronize()?;
                if rep >= 3 {
                    apart.push((t1 - t0).as_secs_f64());
                    together.push(t1.elapsed().as_secs_f64());
                }
            }
            let (a, t) = (median(&mut apart), median(&mut together));
            println!("| {name} | {m} | {:.3} | {:.3} | {:.2}x |", a * 1e3, t * 1e3, a / t);
        }
    }
    Ok(())
}
