//! What the tensor-parallel reduction costs beside NCCL's own all-reduce, on the GPUs of
//! this machine: for the hidden state of M tokens of the 8B shape (M x 4,096 f32 values:
//! M = 1 and 8 decode, 40 a verify, 512 and 2,048 prefill chunks), each rank's
//! `x += sum of every rank's partial`, done as ours (an NCCL all-gather, then one
//! `add_parts` kernel adding the parts in rank order) and as NCCL's sum all-reduce in
//! place followed by `add`. Wall time per reduction, each rank's thread issuing `--reps`
//! of them back to back (median of 5 such runs).
//!
//! `gpu_collective [--ranks N] [--reps R]` (default: every GPU, 200).

use std::sync::Arc;
use std::time::Instant;

use mtp::cuda::{Cuda, NcclCollective};
use mtp::kernels::collective::Collective;
use mtp::kernels::{Activations, Kernels};

fn arg(args: &[String], name: &str, default: usize) -> anyhow::Result<usize> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => Ok(args.get(i + 1).ok_or_else(|| anyhow::anyhow!("{name} needs a value"))?.parse()?),
    }
}

/// Seconds per reduction of `len` values on every rank, ours or NCCL's all-reduce.
fn time(
    gpus: &[Arc<Cuda>],
    nccl: &NcclCollective,
    len: usize,
    reps: usize,
    ours: bool,
) -> anyhow::Result<f64> {
    let n = gpus.len();
    let runs: Vec<anyhow::Result<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = gpus
            .iter()
            .enumerate()
            .map(|(rank, cuda)| {
                s.spawn(move || -> anyhow::Result<f64> {
                    let mut x = cuda.upload(&vec![1.0; len])?;
                    let mut part = cuda.upload(&vec![0.5 + rank as f32; len])?;
                    let mut gathered = cuda.alloc(n * len)?;
                    let sync = || -> anyhow::Result<()> {
                        cuda.download(cuda.alloc(1)?).map(|_| ()).map_err(Into::into)
                    };
                    let one = |x: &mut _, part: &mut _, gathered: &mut _| -> anyhow::Result<()> {
                        if ours {
                            Collective::<Cuda>::all_gather(nccl, rank, part, gathered)?;
                            cuda.add_parts(x, gathered, n, false)?;
                        } else {
                            nccl.stock_all_reduce(rank, part)?;
                            cuda.add(x, part)?;
                        }
                        Ok(())
                    };
                    for _ in 0..10 {
                        one(&mut x, &mut part, &mut gathered)?;
                    }
                    sync()?;
                    let start = Instant::now();
                    for _ in 0..reps {
                        one(&mut x, &mut part, &mut gathered)?;
                    }
                    sync()?;
                    Ok(start.elapsed().as_secs_f64() / reps as f64)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a rank panicked"))))
            .collect()
    });
    let mut worst: f64 = 0.0;
    for r in runs {
        worst = worst.max(r?);
    }
    Ok(worst)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let ranks = arg(&args, "--ranks", Cuda::device_count())?;
    let reps = arg(&args, "--reps", 200)?;
    anyhow::ensure!(ranks >= 2, "needs at least 2 GPUs ({} here)", Cuda::device_count());
    let gpus = (0..ranks).map(|g| Cuda::on_device(g, Activations::Auto)).collect::<Result<Vec<_>, _>>()?;
    let nccl = NcclCollective::new(&gpus)?;
    println!(
        "{ranks} x {}: x += the ranks' partial sums of M x 4096 f32, us per reduction (median of 5)",
        gpus[0].device_name()
    );
    println!("| M | ours: all-gather + add_parts | NCCL all-reduce + add | ours / NCCL |");
    println!("| --- | --- | --- | --- |");
    for m in [1usize, 8, 40, 512, 2048] {
        let median = |ours: bool| -> anyhow::Result<f64> {
            let mut t = (0..5)
                .map(|_| time(&gpus, &nccl, m * 4096, reps, ours))
                .collect::<anyhow::Result<Vec<_>>>()?;
            t.sort_by(f64::total_cmp);
            Ok(t[2])
        };
        let (a, b) = (median(true)?, median(false)?);
        println!("| {m} | {:.1} | {:.1} | {:.2} |", a * 1e6, b * 1e6, a / b);
    }
    Ok(())
}
