//! A long prompt arriving while other rows decode: how long the decoding rows' rounds take
//! while it goes in, and the prompt's time to its first token.
//!
//! `B` rows decode plainly (greedy, 32-token prompts); after `--warm-rounds` rounds one more
//! request arrives with a `--prompt-tokens` prompt. Reported: the mean round before it
//! arrived, the rounds it spans until its first token (count, mean and longest), and that
//! time to first token, median over `--repeats` arrivals (a fresh engine each).
//!
//! `cargo run --release --example staggered_prompt -- --target DIR [--backend cuda]
//! [--batch 8] [--prompt-tokens 16384] [--chunk 2048]` (numbers in docs/benchmarks.md).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mtp::engine::{Engine, EngineOptions, Event, Request};
use mtp::kernels::Backend;
use mtp::model::Model;

struct Args {
    target: PathBuf,
    backend: String,
    batch: usize,
    prompt_tokens: usize,
    chunk: Option<usize>,
    warm_rounds: usize,
    repeats: usize,
}

fn args() -> Result<Args> {
    let mut a = Args {
        target: PathBuf::new(),
        backend: "cpu".into(),
        batch: 8,
        prompt_tokens: 2048,
        chunk: None,
        warm_rounds: 8,
        repeats: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        let count = || value.parse::<usize>().with_context(|| format!("{flag} {value}: not a count"));
        match flag.as_str() {
            "--target" => a.target = value.into(),
            "--backend" => a.backend = value,
            "--batch" => a.batch = count()?,
            "--prompt-tokens" => a.prompt_tokens = count()?,
            "--chunk" => a.chunk = Some(count()?),
            "--warm-rounds" => a.warm_rounds = count()?,
            "--repeats" => a.repeats = count()?,
            _ => bail!("unknown flag {flag}"),
        }
    }
    if a.target.as_os_str().is_empty() {
        bail!("--target DIR is required");
    }
    if a.batch < 2 || a.prompt_tokens == 0 || a.repeats == 0 {
        bail!("--batch must be at least 2 (one row arrives late), --prompt-tokens and --repeats at least 1");
    }
    Ok(a)
}

/// One arrival: (mean round before, rounds until the first token, their mean and longest,
/// time to first token), in seconds.
fn arrival(model: &Model, a: &Args, chunk: usize, seed: u32) -> Result<(f64, usize, f64, f64, f64)> {
    let vocab = model.config.vocab_size as u32;
    let token = |i: usize| (seed.wrapping_mul(7919).wrapping_add(i as u32 * 104_729)) % vocab;
    let opts = EngineOptions { max_batch: a.batch, prefill_chunk: chunk, ..EngineOptions::default() };
    let mut engine = Engine::new(model, None, opts)?;
    let long_max = 4;
    let rounds_needed = a.warm_rounds + a.prompt_tokens.div_ceil(chunk) + long_max + 4;
    for r in 0..a.batch - 1 {
        engine.submit(Request {
            id: format!("short{r}"),
            prompt: (0..32).map(|i| token(r * 32 + i)).collect(),
            max_tokens: rounds_needed,
            ignore_eos: true,
            ..Request::default()
        })?;
    }
    engine.step(); // the short prompts, alone
    let mut before = Vec::new();
    for _ in 0..a.warm_rounds {
        let t = Instant::now();
        engine.step();
        before.push(t.elapsed().as_secs_f64());
    }
    let long = engine.submit(Request {
        id: "long".into(),
        prompt: (0..a.prompt_tokens).map(|i| token(10_000 + i)).collect(),
        max_tokens: long_max,
        ignore_eos: true,
        ..Request::default()
    })?;
    let arrived = Instant::now();
    let mut during = Vec::new();
    loop {
        let t = Instant::now();
        let events = engine.step();
        during.push(t.elapsed().as_secs_f64());
        if let Some(e) = events.iter().find_map(|e| match e {
            Event::Failed { error, .. } => Some(error.to_string()),
            _ => None,
        }) {
            bail!("a request failed: {e}");
        }
        if events.iter().any(|e| matches!(e, Event::Token { request, .. } if *request == long)) {
            break;
        }
        if during.len() > rounds_needed {
            bail!("the long prompt never started");
        }
    }
    let ttft = arrived.elapsed().as_secs_f64();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let longest = during.iter().cloned().fold(0.0, f64::max);
    Ok((mean(&before), during.len(), mean(&during), longest, ttft))
}

fn main() -> Result<()> {
    let a = args()?;
    let backend: Backend = a.backend.parse()?;
    let model = Model::load_with(&a.target, backend, mtp::numerics("auto", None, "auto")?)?;
    let chunk = a.chunk.unwrap_or(if backend == Backend::Cuda { 2048 } else { 64 });
    arrival(&model, &a, chunk, 0)?; // warm-up: first forwards, allocations
    let mut runs: Vec<_> =
        (1..=a.repeats as u32).map(|s| arrival(&model, &a, chunk, s)).collect::<Result<_>>()?;
    runs.sort_by(|x, y| x.4.total_cmp(&y.4));
    let (before, rounds, mean, longest, ttft) = runs[runs.len() / 2];
    println!(
        "batch {} (+1 arriving), prompt {} tokens, chunk {chunk}: round before {:.2} ms; \
         while it goes in {rounds} rounds, mean {:.2} ms, longest {:.2} ms; time to first token {:.3} s \
         (median of {}; all: {})",
        a.batch - 1,
        a.prompt_tokens,
        before * 1e3,
        mean * 1e3,
        longest * 1e3,
        ttft,
        a.repeats,
        runs.iter().map(|r| format!("{:.3}", r.4)).collect::<Vec<_>>().join(", ")
    );
    Ok(())
}
