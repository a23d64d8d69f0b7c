//! Side-by-side speed of the row-invariant CPU kernels against candle's stock ops, on
//! Qwen3-0.6B shapes (bf16 weights): matmul, attention; then one decode step, one verify
//! step for k in {1, 2, 3, 4, 8} and rollback; then B=1 decode against candle-transformers' qwen3.
//!
//! `cargo bench --bench kernels [--features candle-reference] [-- --checkpoint DIR] [--reps N]
//! [--skip-decode]` (the decode comparison needs the feature: candle-transformers).
//! Without `--checkpoint` it synthesizes a Qwen3-0.6B-shaped bf16 checkpoint (random
//! weights) under target/bench-qwen3-0.6b once. Each pair is timed alternately in one run;
//! the table shows medians.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use mtp::base::Checkpoint;
use mtp::kernels::ops::linear;
use mtp::model::{Hidden, Logits, Model, RowInput};
use mtp::synth::SynthSpec;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Times `a` and `b` alternately `reps` times and returns their median seconds.
fn side_by_side(reps: usize, mut a: impl FnMut(), mut b: impl FnMut()) -> (f64, f64) {
    a();
    b();
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t = Instant::now();
        a();
        ta.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        b();
        tb.push(t.elapsed().as_secs_f64());
    }
    (median(ta), median(tb))
}

fn main() -> anyhow::Result<()> {
    mtp::init_threads();
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let reps: usize = arg("--reps").map(|s| s.parse()).transpose()?.unwrap_or(7);
    let dir = match arg("--checkpoint") {
        Some(d) => PathBuf::from(d),
        None => {
            let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-qwen3-0.6b");
            if !d.join("model.safetensors").exists() {
                eprintln!("synthesizing Qwen3-0.6B-shaped bf16 checkpoint in {} ...", d.display());
                SynthSpec::preset("qwen3-0.6b").unwrap().write(&d)?;
            }
            d
        }
    };
    let cfg = mtp::base::Config::from_dir(&dir)?;
    let ck = Checkpoint::open(&dir)?;
    let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
    let qd = cfg.num_attention_heads * cfg.head_dim;
    let kvd = cfg.num_key_value_heads * cfg.head_dim;
    let shapes = [
        ("q_proj", "model.layers.0.self_attn.q_proj.weight", qd, h),
        ("k_proj", "model.layers.0.self_attn.k_proj.weight", kvd, h),
        ("o_proj", "model.layers.0.self_attn.o_proj.weight", h, qd),
        ("gate_proj", "model.layers.0.mlp.gate_proj.weight", f, h),
        ("down_proj", "model.layers.0.mlp.down_proj.weight", h, f),
    ];
    println!("## Matmul, Qwen3-0.6B shapes, bf16 weights ({} threads)\n", rayon::current_num_threads());
    println!("| weight (N x K) | M | row-invariant (bf16 in place) µs | candle f32 µs | candle bf16 µs | ratio vs f32 | ratio vs best |");
    println!("|---|---|---|---|---|---|---|");
    for (label, name, n, k) in shapes {
        let w = ck.get(name, &[n, k])?;
        let wf = Tensor::from_vec(w.to_f32(), (n, k), &Device::Cpu)?;
        let wb = wf.to_dtype(DType::BF16)?;
        let wft = wf.t()?;
        let wbt = wb.t()?;
        for m in [1usize, 5, 20, 64, 512] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 1000.0).collect();
            let xt = Tensor::from_slice(&x, (m, k), &Device::Cpu)?;
            let xb = xt.to_dtype(DType::BF16)?;
            let mut out = vec![0.0f32; m * n];
            let (ours, stock) = side_by_side(
                reps,
                || linear(&x, m, &w, None, &mut out),
                || {
                    xt.matmul(&wft).unwrap();
                },
            );
            let (_, stock_bf16) = side_by_side(
                reps.min(3),
                || {},
                || {
                    xb.matmul(&wbt).unwrap();
                },
            );
            let best = stock.min(stock_bf16);
            println!(
                "| {label} ({n} x {k}) | {m} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |",
                ours * 1e6,
                stock * 1e6,
                stock_bf16 * 1e6,
                ours / stock,
                ours / best
            );
        }
    }
    attention(&cfg, reps)?;
    steps(&dir, reps)?;
    if args.iter().any(|a| a == "--skip-decode") {
        return Ok(());
    }
    decode(&dir, reps.clamp(1, 3))
}

// candle-transformers is a feature of its own: a dev-dependency would be built (and
// linted three times) by every `cargo test` and CI run for this one comparison.
#[cfg(not(feature = "candle-reference"))]
fn decode(_: &std::path::Path, _: usize) -> anyhow::Result<()> {
    println!("\nB=1 decode against candle-transformers: run with `--features candle-reference`");
    Ok(())
}

/// One query row, all heads, against `ctx` cached keys: ours vs candle's stock
/// `softmax(q k^T / sqrt(d)) v`.
fn attention(cfg: &mtp::base::Config, reps: usize) -> anyhow::Result<()> {
    use mtp::cache::KvView;
    use mtp::kernels::ops::attend;
    let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    println!("\n## Attention, one query, {nh} heads / {nkv} KV heads x {hd}\n");
    println!("| context | row-invariant µs | candle stock µs | ratio |\n|---|---|---|---|");
    for ctx in [128usize, 512, 1024, 4096] {
        let kvd = nkv * hd;
        let gen = |n: usize, s: usize| -> Vec<f32> {
            (0..n).map(|i| (((i * s) % 997) as f32 - 498.0) / 700.0).collect()
        };
        let (q, k, v) = (gen(nh * hd, 31), gen(ctx * kvd, 17), gen(ctx * kvd, 13));
        let view = KvView::contiguous(&k, &v, kvd);
        let mut out = vec![0.0f32; nh * hd];
        let scale = 1.0 / (hd as f32).sqrt();
        let qt = Tensor::from_slice(&q, (nh, 1, hd), &Device::Cpu)?;
        // Stock path: GQA by repeating KV heads, as candle-transformers does.
        let kt = Tensor::from_slice(&k, (ctx, nkv, hd), &Device::Cpu)?.transpose(0, 1)?.contiguous()?;
        let vt = Tensor::from_slice(&v, (ctx, nkv, hd), &Device::Cpu)?.transpose(0, 1)?.contiguous()?;
        let rep = nh / nkv;
        let kt = Tensor::cat(&vec![&kt; rep], 1)?.reshape((nh, ctx, hd))?;
        let vt = Tensor::cat(&vec![&vt; rep], 1)?.reshape((nh, ctx, hd))?;
        let (ours, stock) = side_by_side(
            reps,
            || {
                for h in 0..nh {
                    let o = &mut out[h * hd..(h + 1) * hd];
                    attend(&q[h * hd..(h + 1) * hd], &view, ctx, (h / rep) * hd, scale, o);
                }
            },
            || {
                let s = (qt.matmul(&kt.t().unwrap()).unwrap() * scale as f64).unwrap();
                let p = candle_nn::ops::softmax_last_dim(&s).unwrap();
                p.matmul(&vt).unwrap();
            },
        );
        println!("| {ctx} | {:.0} | {:.0} | {:.2} |", ours * 1e6, stock * 1e6, ours / stock);
    }
    Ok(())
}

/// One decode step, one verify step of 1 + k tokens, and the rollback after it (B = 1,
/// 64 cached positions), on the real checkpoint.
fn steps(dir: &std::path::Path, reps: usize) -> anyhow::Result<()> {
    use mtp::sampling::SamplingMode;
    use mtp::verifier::{verify, VerifyRow, WindowLayout};
    let model = Model::load(dir)?;
    let prompt: Vec<u32> = (0..64u32).map(|i| 100 + i * 37).collect();
    let mut base = model.new_cache();
    mtp::engine::prefill(&model, &mut base, &prompt, 64, false, true)?;
    println!("\n## Steps, B=1, 64 cached positions ({} threads)\n", rayon::current_num_threads());
    println!("| step | ms (median of {reps}) | per token vs decode |\n|---|---|---|");
    let time = |f: &mut dyn FnMut()| {
        f();
        median(
            (0..reps)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .collect(),
        )
    };
    let decode = time(&mut || {
        let mut c = base.try_clone().unwrap();
        let mut rows = [RowInput {
            tokens: &[7],
            cache: &mut c,
            logits: Logits::Last,
            full_logits: true,
            hidden: Hidden::Final,
        }];
        model.forward(&mut rows).unwrap();
    });
    println!("| decode (1 token) | {:.1} | 1.00 |", decode * 1e3);
    for k in [1usize, 2, 3, 4, 8] {
        let draft: Vec<u32> = (0..k as u32).map(|i| 200 + i).collect();
        let t = time(&mut || {
            let mut c = base.try_clone().unwrap();
            let mut rows = [VerifyRow::greedy(&mut c, 7, &draft)];
            verify(&model, &mut rows, WindowLayout::RowTail, SamplingMode::Exact);
        });
        println!("| verify k={k} ({} tokens) | {:.1} | {:.2} |", k + 1, t * 1e3, t / decode / (k + 1) as f64);
    }
    // Rollback alone: compact an 8-position window written 40 slots past the row's end.
    let mut c = base.try_clone()?;
    let kvd = model.config.num_key_value_heads * model.config.head_dim;
    let window = vec![0.5f32; 8 * kvd];
    let t = time(&mut || {
        c.truncate(64);
        c.begin_window(104);
        for l in 0..c.n_layers() {
            c.write_window(l, &window, &window);
        }
        c.commit_window(5);
    });
    println!("| rollback (write 8-position window over a hole, keep 5, compact) | {:.3} | - |", t * 1e3);
    Ok(())
}

/// B=1 greedy decode tokens/s: this engine vs candle-transformers' qwen3 on one checkpoint.
#[cfg(feature = "candle-reference")]
fn decode(dir: &std::path::Path, reps: usize) -> anyhow::Result<()> {
    use candle_transformers::models::qwen3;
    let (prompt_len, steps) = (16usize, 32usize);
    let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| 100 + i * 37).collect();
    let model = Model::load(dir)?;
    let ours = || {
        let mut cache = model.new_cache();
        let mtp::engine::Prefilled { logits: l, .. } =
            mtp::engine::prefill(&model, &mut cache, &prompt, 64, false, true).unwrap();
        let mut t = mtp::base::logits::argmax(&l);
        let start = Instant::now();
        for _ in 0..steps {
            let mut rows = [RowInput {
                tokens: &[t],
                cache: &mut cache,
                logits: Logits::Last,
                full_logits: true,
                hidden: Hidden::Final,
            }];
            let out = model.forward(&mut rows).unwrap();
            cache.commit_window(1);
            t = mtp::base::logits::argmax(&out[0].logits[0]);
        }
        steps as f64 / start.elapsed().as_secs_f64()
    };
    let cfg: qwen3::Config = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let files = vec![dir.join("model.safetensors")];
    println!(
        "\n## B=1 greedy decode, {} (prompt {prompt_len}, {steps} new tokens, {} threads)\n",
        dir.display(),
        rayon::current_num_threads()
    );
    println!("| engine | tokens/s (median of {reps}) |\n|---|---|");
    let mut rows = vec![(
        "mtp (row-invariant, bf16 weights in place)".to_string(),
        median((0..reps).map(|_| ours()).collect()),
    )];
    for dtype in [DType::F32, DType::BF16] {
        let vb = unsafe { candle_nn::VarBuilder::from_mmaped_safetensors(&files, dtype, &Device::Cpu)? };
        let mut m = qwen3::ModelForCausalLM::new(&cfg, vb)?;
        let mut theirs = || -> anyhow::Result<f64> {
            m.clear_kv_cache();
            let input = Tensor::new(prompt.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
            let l = m.forward(&input, 0)?;
            let mut t = l.flatten_all()?.to_dtype(DType::F32)?.argmax(0)?.to_scalar::<u32>()?;
            let start = Instant::now();
            for i in 0..steps {
                let input = Tensor::new(&[t], &Device::Cpu)?.unsqueeze(0)?;
                let l = m.forward(&input, prompt_len + i)?;
                t = l.flatten_all()?.to_dtype(DType::F32)?.argmax(0)?.to_scalar::<u32>()?;
            }
            Ok(steps as f64 / start.elapsed().as_secs_f64())
        };
        let mut v = Vec::new();
        for _ in 0..reps {
            v.push(theirs()?);
        }
        rows.push((format!("candle-transformers qwen3, {dtype:?} weights"), median(v)));
    }
    for (name, tps) in &rows {
        println!("| {name} | {tps:.2} |");
    }
    println!(
        "\nspeedup vs candle-transformers f32: {:.2}x, vs bf16: {:.2}x",
        rows[0].1 / rows[1].1,
        rows[0].1 / rows[2].1
    );
    Ok(())
}
