//! The row-invariant CPU matmul on a checkpoint's own weights: every layer's copy of each
//! Qwen3 projection (and the LM head) in turn, so the caches never hold the weight being
//! timed, at M in {1, 8, 64, 512}: microseconds per call (median of the repetitions) and
//! GB/s of weights read. Works for bf16, f16, f32 and MLX-quantized checkpoints.
//!
//! `cargo run --release --example cpu_matmul -- --checkpoint DIR [--m 1,8] [--reps R]
//! [--activations bf16]` (bf16: the bf16-activation matmul, for the weights it takes: bf16,
//! and MLX 4-bit with bf16 scales)
//! (`mtp synth --like qwen3 --out DIR` makes a Qwen3-0.6B-shaped one).

use std::path::PathBuf;
use std::time::Instant;

use mtp::base::{Checkpoint, Config};
use mtp::kernels::ops::{linear, linear_bf16};
use mtp::kernels::Activations;

fn main() -> anyhow::Result<()> {
    mtp::init_threads();
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let dir =
        PathBuf::from(arg("--checkpoint").ok_or_else(|| anyhow::anyhow!("--checkpoint DIR is required"))?);
    let ms: Vec<usize> = match arg("--m") {
        Some(s) => s.split(',').map(|v| v.parse()).collect::<Result<_, _>>()?,
        None => vec![1, 8, 64, 512],
    };
    let reps: usize = arg("--reps").map(|s| s.parse()).transpose()?.unwrap_or(5).max(1);
    let bf16 = match arg("--activations").as_deref() {
        None | Some("f32") => false,
        Some("bf16") => true,
        Some(other) => anyhow::bail!("--activations {other}: f32 or bf16"),
    };
    let cfg = Config::from_dir(&dir)?;
    let ck = Checkpoint::open(&dir)?;
    let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
    let qd = cfg.num_attention_heads * cfg.head_dim;
    let layers = cfg.num_hidden_layers;
    let shapes = [
        ("self_attn.q_proj", qd, h),
        ("self_attn.o_proj", h, qd),
        ("mlp.gate_proj", f, h),
        ("mlp.down_proj", h, f),
    ];
    let mode = if bf16 { "bf16" } else { "f32" };
    println!("{} threads, {}, {mode} activations", rayon::current_num_threads(), dir.display());
    println!("| weight (N x K) | M | µs per call | GB/s of weights |");
    println!("| --- | --- | --- | --- |");
    let mut sets: Vec<(String, Vec<mtp::base::Weight>)> = Vec::new();
    for (name, n, k) in shapes {
        let ws = (0..layers)
            .map(|l| ck.get(&format!("model.layers.{l}.{name}.weight"), &[n, k]))
            .collect::<Result<Vec<_>, _>>()?;
        sets.push((format!("{name} ({n} x {k})"), ws));
    }
    let head = if ck.contains("lm_head.weight") { "lm_head.weight" } else { "model.embed_tokens.weight" };
    sets.push((format!("LM head ({} x {h})", cfg.vocab_size), vec![ck.get(head, &[cfg.vocab_size, h])?]));
    for (label, ws) in &sets {
        let (n, k) = (ws[0].rows, ws[0].cols);
        let bytes: usize = ws.iter().map(|w| w.bytes().len() + quant_bytes(w)).sum();
        for &m in &ms {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 1000.0).collect();
            let mut out = vec![0.0f32; m * n];
            let mut times = Vec::new();
            for _ in 0..=reps {
                let t = Instant::now();
                for w in ws {
                    if bf16 && Activations::Bf16.for_weight(w) == Activations::Bf16 {
                        linear_bf16(&x, m, w, None, &mut out);
                    } else {
                        linear(&x, m, w, None, &mut out);
                    }
                }
                times.push(t.elapsed().as_secs_f64());
            }
            times.remove(0);
            times.sort_by(f64::total_cmp);
            let t = times[times.len() / 2];
            println!("| {label} | {m} | {:.0} | {:.1} |", t / ws.len() as f64 * 1e6, bytes as f64 / t / 1e9);
        }
    }
    Ok(())
}

/// Bytes of a quantized weight's scales and biases.
fn quant_bytes(w: &mtp::base::Weight) -> usize {
    w.quant().map_or(0, |q| q.scales.bytes().len() + q.biases.as_ref().map_or(0, |b| b.bytes().len()))
}
