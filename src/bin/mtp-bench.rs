//! `mtp-bench`: acceptance and speed of every drafter x k x batch x sampling setting
//! against plain decoding, with a bitwise identity check of every row. Exits non-zero on
//! any mismatch.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use mtp::base::Tokenizer;
use mtp::bench::{
    markdown, median_tps, parse_constraint, prompts_from_dir, run, tps_range, DrafterFactory, DrafterSpec,
    Row, Run, Setting,
};
use mtp::engine::{Completion, DraftLen, EngineOptions, Request, SamplingMode, SamplingParams};
use mtp::kernels::Backend;
use mtp::model::Model;

const BENCH_HELP: &str = concat!(
    "Examples:
  mtp-bench                                   # the shipped family: draft model, MTP head, ngram
  mtp-bench --drafters mtp,ngram --k 2,4,auto --batch 1,8 --temperatures 0 --repeats 3
  mtp-bench --target /models/qwen3-8b --backend cuda --drafters oracle:0.7 \\
      --prompts-dir ~/src --num-prompts 64 --prompt-tokens 256 --batch 64 --json out.json

Progress goes to stderr (a bar on a terminal, a line per run otherwise); the table to stdout.
Every request arrives at once (`arrive_at` is not read here).

",
    mtp::prompts_format!()
);

#[derive(Parser)]
#[command(
    name = "mtp-bench",
    version,
    about = "Compare drafters' acceptance and speed; check every row is identical",
    after_long_help = BENCH_HELP
)]
struct Cli {
    /// Target checkpoint: directory or Hugging Face repo id (org/name[@revision]), taken from the
    /// Hugging Face cache or downloaded into it (default: the trained family shipped in the
    /// repository).
    #[arg(long)]
    target: Option<PathBuf>,
    /// Comma-separated: draft-model:DIR, mtp[:DIR], eagle3:DIR (directory or repo id),
    /// assistant:DIR (Gemma 4), ngram, oracle:ALPHA (default: the shipped draft model and MTP
    /// head of the default target, and ngram).
    #[arg(long)]
    drafters: Option<String>,
    /// Draft lengths to try: auto (adaptive, up to --max-k) and/or fixed counts.
    #[arg(long, default_value = "auto", value_delimiter = ',', value_parser = mtp::parse_k)]
    k: Vec<mtp::KArg>,
    /// The most drafts `auto` gives a row in one round.
    #[arg(long, default_value_t = 8, value_parser = mtp::draft_count)]
    max_k: usize,
    /// Max batch sizes to try (every request arrives at once).
    #[arg(long, default_value = "1,4", value_delimiter = ',', value_parser = mtp::at_least_one)]
    batch: Vec<usize>,
    /// Temperatures to try (0 is greedy); request i samples with seed i.
    #[arg(long, default_value = "0,0.7,1.0", value_delimiter = ',', allow_negative_numbers = true)]
    temperatures: Vec<f32>,
    /// Sampling modes to try at temperature > 0: exact (bitwise plain sampling) and/or
    /// rejection (same distribution, rows identical across batch sizes).
    #[arg(long, default_value = "exact,rejection", value_delimiter = ',')]
    sampling: Vec<String>,
    /// Prompts JSONL (as for `mtp generate`; default: examples/heldout-prompts.jsonl, cut
    /// from this repository's sources, which the shipped family never saw in training).
    #[arg(long, conflicts_with = "prompts_dir")]
    prompts: Option<PathBuf>,
    /// Cut prompts from the text files in this folder instead.
    #[arg(long)]
    prompts_dir: Option<PathBuf>,
    /// How many prompts --prompts-dir cuts (only with --prompts-dir).
    #[arg(long, default_value_t = 8, value_parser = mtp::at_least_one, requires = "prompts_dir")]
    num_prompts: usize,
    /// Tokens of each prompt --prompts-dir cuts.
    #[arg(long, default_value_t = 64, value_parser = mtp::at_least_one, requires = "prompts_dir")]
    prompt_tokens: usize,
    /// New tokens per request (EOS is ignored so every run generates the same count).
    #[arg(long, default_value_t = 32, value_parser = mtp::at_least_one)]
    max_tokens: usize,
    /// Where the models run: cpu, cuda (a build with `--features cuda`), metal (macOS,
    /// `--features metal`) or metal-emulated (the Metal kernels on the CPU emulator).
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// How K/V are stored: auto, f32, bf16, q8, q4 (as for `mtp generate`).
    #[arg(long, default_value = "auto")]
    kv_dtype: String,
    /// Quantized K/V: 8 or 4 bits (as for `mtp generate`).
    #[arg(long)]
    kv_bits: Option<usize>,
    /// Matmul activations: auto (bf16 on CUDA and on CPUs with AVX512-BF16, f32 elsewhere),
    /// bf16 or f32 (as for `mtp generate`).
    #[arg(long, default_value = "auto")]
    activations: String,
    /// Tokens per prefill forward (as for `mtp generate`; default 2048 on cuda, 64 elsewhere).
    #[arg(long, value_parser = mtp::at_least_one)]
    prefill_chunk: Option<usize>,
    /// Split the target between N tensor-parallel ranks (as for `mtp generate`).
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
    /// Runs of every setting, taken in turn; the table shows the median (the machine is
    /// noisy) and every run must be identical. A setting's adaptive k (`auto`) starts each
    /// run from what it learned in the run before (as a server's engine carries it from one
    /// request to the next); its first run starts from priors (see --cold-k).
    #[arg(long, default_value_t = 3, value_parser = mtp::repeat_count)]
    repeats: usize,
    /// Start every run's adaptive k from its priors, as a freshly started server would
    /// for its first requests, instead of from the setting's run before.
    #[arg(long)]
    cold_k: bool,
    /// Output constraints to try, each on every request: none, json_object,
    /// json_schema:FILE, regex:RX (grammar masks through llguidance; the plain rows of
    /// each give the masks' cost per token beside `none`'s).
    #[arg(long, default_value = "none", value_delimiter = ',')]
    constraint: Vec<String>,
    /// Also write every number and per-request details here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Launch every CUDA kernel from the host each step instead of replaying decode and
    /// verify forwards from CUDA graphs (the same bits; for comparing their speed).
    #[arg(long)]
    no_cuda_graphs: bool,
}

fn main() -> ExitCode {
    mtp::keep_freed_memory();
    mtp::init_logging("warn");
    mtp::init_threads();
    match bench(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("error: some rows differ from plain decoding (see `identical`): this is a bug");
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("error: {}", mtp::error_report(&e));
            ExitCode::FAILURE
        }
    }
}

fn bench(cli: Cli) -> Result<bool> {
    let default_target = cli.target.is_none();
    let target_dir = mtp::target_dir(cli.target.as_deref())?;
    let backend: Backend = cli.backend.parse()?;
    mtp::model::registry::check(backend)?;
    #[cfg(feature = "cuda")]
    mtp::cuda::Cuda::set_graphs(!cli.no_cuda_graphs);
    let model = Arc::new(Model::load_parallel(
        &target_dir,
        backend,
        mtp::numerics(&cli.kv_dtype, cli.kv_bits, &cli.activations)?,
        cli.tensor_parallel,
    )?);
    let tokenizer = Tokenizer::for_model(&target_dir, &model.config)?;
    let drafters = match (&cli.drafters, default_target) {
        (Some(list), _) => DrafterSpec::parse_list(list)?,
        (None, true) => vec![
            DrafterSpec::DraftModel(mtp::shipped(mtp::shipped_files::DRAFT, "--drafters")?),
            DrafterSpec::Mtp(Some(target_dir.clone())),
            DrafterSpec::Ngram,
        ],
        // Another target: its own MTP head if it has one, and n-gram lookup.
        (None, false) if model.config.num_nextn_predict_layers > 0 => {
            vec![DrafterSpec::Mtp(None), DrafterSpec::Ngram]
        }
        (None, false) => vec![DrafterSpec::Ngram],
    };
    let modes = cli
        .sampling
        .iter()
        .map(|m| SamplingMode::parse(m).map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()?;
    for &temperature in &cli.temperatures {
        SamplingParams { temperature, ..SamplingParams::default() }.validate().map_err(anyhow::Error::msg)?;
    }
    let requests = match &cli.prompts_dir {
        Some(dir) => {
            let tok = tokenizer.as_ref().context("--prompts-dir needs the target's tokenizer.json")?;
            prompts_from_dir(dir, tok, cli.num_prompts, cli.prompt_tokens, cli.max_tokens)?
        }
        None => {
            let path = match &cli.prompts {
                Some(p) => p.clone(),
                None => mtp::shipped(mtp::shipped_files::HELDOUT_PROMPTS, "--prompts")?,
            };
            let defaults = Request { max_tokens: cli.max_tokens, ignore_eos: true, ..Request::default() };
            let mut reqs = mtp::prompts::read(&path, tokenizer.as_ref(), &defaults)?.requests;
            if reqs.is_empty() {
                bail!("{}: holds no requests; nothing to measure", path.display());
            }
            for r in &mut reqs {
                r.max_tokens = cli.max_tokens;
            }
            reqs
        }
    };
    // A request the context cuts short would time fewer tokens than the report says.
    let context = model.max_positions();
    if let Some(r) =
        requests.iter().find(|r| r.prompt.len().saturating_add(cli.max_tokens) > context.saturating_add(1))
    {
        bail!(
            "request {}: {} prompt tokens and --max-tokens {} pass the model's context of {context} positions, \
             so it would generate fewer tokens than the run reports: lower --max-tokens (or --prompt-tokens)",
            r.id,
            r.prompt.len(),
            cli.max_tokens
        );
    }
    // A report that cannot be written fails now, not after the whole run.
    if let Some(path) = &cli.json {
        std::fs::File::create(path).with_context(|| format!("--json {}: cannot write", path.display()))?;
    }
    let factories = drafters
        .into_iter()
        .map(|d| DrafterFactory::new(d, &target_dir, &model))
        .collect::<Result<Vec<_>>>()?;
    let constraints = cli.constraint.iter().map(|c| parse_constraint(c)).collect::<Result<Vec<_>>>()?;
    if constraints.iter().any(|(_, c)| c.is_some()) && tokenizer.is_none() {
        bail!("--constraint needs the target's tokenizer.json");
    }
    let settings: usize = cli.temperatures.iter().map(|&t| if t == 0.0 { 1 } else { modes.len() }).sum();
    // Each list is bounded by its command line, but their product need not fit.
    let per_batch = settings
        .checked_mul(factories.len())
        .and_then(|n| n.checked_mul(cli.k.len()))
        .and_then(|n| n.checked_add(cli.temperatures.len()));
    let runs = [Some(constraints.len()), Some(cli.repeats), Some(cli.batch.len()), per_batch]
        .into_iter()
        .try_fold(1usize, |n, x| n.checked_mul(x?));
    let Some(runs) = runs else {
        bail!("the runs asked for (settings x --repeats x --batch) are too many to count")
    };
    let mut bar = Progress::new(runs);
    let numerics = model.numerics();
    eprintln!(
        "target {} ({:?}, {} layers), {} requests x {} tokens; {} backend, {:?} K/V, {} activations{}",
        target_dir.display(),
        model.config.arch,
        model.config.num_hidden_layers,
        requests.len(),
        cli.max_tokens,
        backend.name(),
        numerics.kv,
        numerics.activations.name(),
        match model.tensor_parallel() {
            1 => String::new(),
            n => format!(", tensor parallel over {n} ranks"),
        }
    );
    let mut rows = Vec::new();
    let tok = tokenizer.as_ref();
    // Warm-up, untimed: the first timed run would otherwise pay for cold caches and pages.
    bar.start("warm-up (untimed)".into());
    let prefill_chunk = cli.prefill_chunk.unwrap_or(if cli.backend == "cuda" { 2048 } else { 64 });
    let opts = |max_batch: usize, k: DraftLen, sampling_mode: SamplingMode| EngineOptions {
        max_batch,
        k,
        sampling_mode,
        prefill_chunk,
        ..EngineOptions::default()
    };
    run(&model, tok, None, &requests, opts(cli.batch[0], DraftLen::Fixed(0), SamplingMode::Exact), None)?;
    for ((label, constraint), &temperature) in
        constraints.iter().flat_map(|c| cli.temperatures.iter().map(move |t| (c, t)))
    {
        let requests: Vec<Request> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| Request {
                sampling: SamplingParams { temperature, seed: i as u64, ..SamplingParams::default() },
                constraint: constraint.clone(),
                ..r.clone()
            })
            .collect();
        let modes = if temperature == 0.0 { &[SamplingMode::Exact][..] } else { &modes[..] };
        let mut configs: Vec<(SamplingMode, &DrafterFactory, mtp::KArg)> = Vec::new();
        for &m in modes {
            for f in &factories {
                configs.extend(cli.k.iter().map(|&k| (m, f, k)));
            }
        }
        let name = |mode: SamplingMode| if temperature == 0.0 { "greedy" } else { mode.name() };
        // Plain decoding at the first batch size: what greedy and exact rows must equal.
        let mut reference: Option<Vec<Completion>> = None;
        // Rejection rows at the first batch size, per config: what later batch sizes must equal.
        let mut rejection_alone: Vec<Option<Vec<Completion>>> = vec![None; configs.len()];
        for (b, &batch) in cli.batch.iter().enumerate() {
            // Every config runs once per repeat, in turn, so slow spells hit all alike.
            let mut plain_runs = Vec::new();
            let mut runs: Vec<Vec<Run>> = configs.iter().map(|_| Vec::new()).collect();
            let plain = || {
                run(&model, tok, None, &requests, opts(batch, DraftLen::Fixed(0), SamplingMode::Exact), None)
            };
            for rep in 0..cli.repeats {
                // Slot 0 is plain decoding; each repeat starts one slot later, so no setting
                // always runs first (a noisy machine drifts within a repeat too).
                let slots = configs.len() + 1;
                for slot in (0..slots).map(|i| (i + rep) % slots) {
                    let Some(c) = slot.checked_sub(1) else {
                        bar.start(format!("plain, T={temperature}, batch {batch}, repeat {}", rep + 1));
                        plain_runs.push(plain()?);
                        bar.done();
                        continue;
                    };
                    let (mode, f, k) = configs[c];
                    bar.start(format!(
                        "{}, k {}, batch {batch}, T={temperature} {}, repeat {}",
                        f.spec().label(),
                        k.label(),
                        name(mode),
                        rep + 1
                    ));
                    // Repeat 0 starts with slot 0, so plain decoding (which the oracle
                    // replays) has run before any drafter.
                    let reference = reference.as_deref().unwrap_or(&plain_runs[0].completions);
                    let drafter = f.make(&model, &requests, reference)?;
                    let learned = runs[c].last().filter(|_| !cli.cold_k).map(|r: &Run| r.learned.clone());
                    runs[c].push(run(
                        &model,
                        tok,
                        Some(drafter),
                        &requests,
                        opts(batch, k.with_max(cli.max_k), mode),
                        learned,
                    )?);
                    bar.done();
                }
            }
            let reference = &*reference.get_or_insert_with(|| plain_runs[0].completions.clone());
            let plain_label = if temperature == 0.0 { "greedy" } else { "plain" };
            let plain_tps = median_tps(&plain_runs);
            let plain_range = tps_range(&plain_runs);
            let setting = Setting {
                constraint: label,
                temperature,
                sampling: plain_label,
                reference: Some(reference),
                plain_tps,
                plain_range,
            };
            rows.push(Row::new("none", "0", batch, &plain_runs, &setting));
            for (((mode, f, k), r), alone) in configs.iter().zip(&runs).zip(&mut rejection_alone) {
                let rejection = *mode == SamplingMode::Rejection && temperature != 0.0;
                let against = match (rejection, b) {
                    (true, 0) => None,
                    (true, _) => alone.as_deref(),
                    (false, _) => Some(reference.as_slice()),
                };
                let setting = Setting {
                    constraint: label,
                    temperature,
                    sampling: name(*mode),
                    reference: against,
                    plain_tps,
                    plain_range,
                };
                rows.push(Row::new(&f.spec().label(), &k.label(), batch, r, &setting));
                if rejection && b == 0 {
                    *alone = Some(r[0].completions.clone());
                }
            }
        }
    }
    bar.finish();
    println!("{}", markdown(&rows));
    // The masks' cost: plain decoding per token under each constraint beside `none`.
    for r in rows.iter().filter(|r| r.drafter == "none" && r.constraint != "none") {
        let free = rows.iter().find(|f| {
            f.drafter == "none"
                && f.constraint == "none"
                && f.batch == r.batch
                && f.temperature == r.temperature
        });
        if let Some(f) = free {
            let us = (1.0 / r.tokens_per_second - 1.0 / f.tokens_per_second) * 1e6;
            println!(
                "{}: plain decoding, batch {}, T={}: {:.1} vs {:.1} tokens/s free ({us:+.0} us per token)",
                r.constraint, r.batch, r.temperature, r.tokens_per_second, f.tokens_per_second
            );
        }
    }
    let all_identical = rows.iter().all(|r| r.identical != Some(false));
    if let Some(path) = &cli.json {
        let doc = serde_json::json!({
            "target": target_dir,
            "requests": requests.len(),
            "max_tokens": cli.max_tokens,
            "repeats": cli.repeats,
            "threads": rayon_threads(),
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("{}: cannot write", path.display()))?;
    }
    Ok(all_identical)
}

/// Progress on stderr: a bar with an ETA on a terminal; otherwise (a log, CI) one line per
/// finished run, so a long benchmark never sits silent.
struct Progress {
    bar: ProgressBar,
    terminal: bool,
    total: usize,
    finished: usize,
    what: String,
    run_started: std::time::Instant,
    /// Seconds the finished runs took.
    timed: f64,
}

impl Progress {
    fn new(total: usize) -> Progress {
        let bar = ProgressBar::new(total as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} runs, ETA {eta} {msg} [{elapsed}]")
                .expect("template"),
        );
        let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let run_started = std::time::Instant::now();
        Progress { bar, terminal, total, finished: 0, what: String::new(), run_started, timed: 0.0 }
    }

    fn start(&mut self, what: String) {
        self.bar.set_message(what.clone());
        self.what = what;
        self.run_started = std::time::Instant::now();
    }

    /// One timed run finished (the warm-up is not counted).
    fn done(&mut self) {
        self.finished += 1;
        self.bar.inc(1);
        let took = self.run_started.elapsed().as_secs_f64();
        self.timed += took;
        if !self.terminal {
            let left = self.timed / self.finished as f64 * self.total.saturating_sub(self.finished) as f64;
            eprintln!(
                "run {}/{}: {}: {took:.2} s (about {left:.0} s left)",
                self.finished, self.total, self.what
            );
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
