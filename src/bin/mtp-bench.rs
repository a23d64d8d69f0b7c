//! `mtp-bench`: acceptance and speed of every drafter x k x batch x sampling setting
//! against plain decoding, with a bitwise identity check of every row. Exits non-zero on
//! any mismatch.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use mtp::bench::{markdown, prompts_from_dir, run, DrafterFactory, DrafterSpec, Row, Setting};
use mtp::engine::{Completion, Request, SamplingMode, SamplingParams};
use mtp::model::backend::{Backend, KvDtype};
use mtp::model::{Model, Tokenizer};

#[derive(Parser)]
#[command(
    name = "mtp-bench",
    version,
    about = "Compare drafters' acceptance and speed; check every row is identical"
)]
struct Cli {
    /// Target checkpoint (default: the trained family shipped in the repository).
    #[arg(long)]
    target: Option<PathBuf>,
    /// Comma-separated: draft-model:DIR, mtp[:DIR], ngram, oracle:ALPHA (default: the
    /// shipped draft model and MTP head of the default target, and ngram).
    #[arg(long)]
    drafters: Option<String>,
    /// Draft lengths to try.
    #[arg(long, default_value = "1,2,4", value_delimiter = ',', value_parser = mtp::at_least_one)]
    k: Vec<usize>,
    /// Max batch sizes to try (every request arrives at once).
    #[arg(long, default_value = "1,4", value_delimiter = ',', value_parser = mtp::at_least_one)]
    batch: Vec<usize>,
    /// Temperatures to try (0 is greedy); request i samples with seed i.
    #[arg(long, default_value = "0,0.7,1.0", value_delimiter = ',')]
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
    #[arg(long, default_value_t = 8, value_parser = mtp::at_least_one)]
    num_prompts: usize,
    #[arg(long, default_value_t = 64, value_parser = mtp::at_least_one)]
    prompt_tokens: usize,
    /// New tokens per request (EOS is ignored so every run generates the same count).
    #[arg(long, default_value_t = 32, value_parser = mtp::at_least_one)]
    max_tokens: usize,
    /// Where the models run: cpu, or cuda (a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// How K/V are stored: auto, f32, bf16 (as for `mtp generate`).
    #[arg(long, default_value = "auto")]
    kv_dtype: String,
    /// Also write every number and per-request details here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> ExitCode {
    mtp::init_logging("warn");
    match bench(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("error: some rows differ from plain decoding (see `identical`): this is a bug");
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn bench(cli: Cli) -> Result<bool> {
    let default_target = cli.target.is_none();
    let target_dir = cli.target.unwrap_or_else(|| PathBuf::from(mtp::DEFAULT_TARGET));
    let backend: Backend = cli.backend.parse()?;
    backend.check()?;
    let model = Arc::new(Model::load_with(&target_dir, backend, cli.kv_dtype.parse::<KvDtype>()?)?);
    let tokenizer = Tokenizer::from_dir_if_present(&target_dir)?;
    let drafters = match (&cli.drafters, default_target) {
        (Some(list), _) => DrafterSpec::parse_list(list)?,
        (None, true) => vec![
            DrafterSpec::DraftModel(mtp::DEFAULT_DRAFT.into()),
            DrafterSpec::Mtp(Some(mtp::DEFAULT_MTP.into())),
            DrafterSpec::Ngram,
        ],
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
            let path = cli.prompts.clone().unwrap_or_else(|| PathBuf::from(mtp::HELDOUT_PROMPTS));
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
    let factories = drafters
        .into_iter()
        .map(|d| DrafterFactory::new(d, &target_dir, &model))
        .collect::<Result<Vec<_>>>()?;
    let settings: usize = cli.temperatures.iter().map(|&t| if t == 0.0 { 1 } else { modes.len() }).sum();
    let runs = cli.batch.len() * (cli.temperatures.len() + settings * factories.len() * cli.k.len());
    let bar = ProgressBar::new(runs as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} runs {msg} [{elapsed}]").expect("template"),
    );
    eprintln!(
        "target {} ({:?}, {} layers), {} requests x {} tokens",
        target_dir.display(),
        model.config.arch,
        model.config.num_hidden_layers,
        requests.len(),
        cli.max_tokens
    );
    let mut rows = Vec::new();
    for &temperature in &cli.temperatures {
        let requests: Vec<Request> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| Request {
                sampling: SamplingParams { temperature, seed: i as u64, ..SamplingParams::default() },
                ..r.clone()
            })
            .collect();
        let modes = if temperature == 0.0 { &[SamplingMode::Exact][..] } else { &modes[..] };
        // Plain decoding at the first batch size: what greedy and exact rows must equal.
        let mut reference: Option<Vec<Completion>> = None;
        // Rejection rows at the first batch size, per (drafter, k): what later batch sizes must equal.
        let mut rejection_alone: Vec<Vec<Completion>> = Vec::new();
        for (b, &batch) in cli.batch.iter().enumerate() {
            bar.set_message(format!("plain, T={temperature}, batch {batch}"));
            let plain = run(&model, None, &requests, batch, 0, SamplingMode::Exact)?;
            let reference = &*reference.get_or_insert_with(|| plain.completions.clone());
            let label = if temperature == 0.0 { "greedy" } else { "plain" };
            let plain_tps = plain.tokens_per_second();
            let setting = Setting { temperature, sampling: label, reference: Some(reference), plain_tps };
            rows.push(Row::new("none", 0, batch, &plain, &setting));
            bar.inc(1);
            let mut alone_at = 0;
            for &mode in modes {
                for f in &factories {
                    for &k in &cli.k {
                        let name = if temperature == 0.0 { "greedy" } else { mode.name() };
                        bar.set_message(format!(
                            "{}, k {k}, batch {batch}, T={temperature} {name}",
                            f.spec().label()
                        ));
                        let drafter = f.make(&model, &requests, reference)?;
                        let r = run(&model, Some(drafter), &requests, batch, k, mode)?;
                        let rejection = mode == SamplingMode::Rejection && temperature != 0.0;
                        let against = match (rejection, b) {
                            (true, 0) => None,
                            (true, _) => {
                                alone_at += 1;
                                rejection_alone.get(alone_at - 1).map(|c| c.as_slice())
                            }
                            (false, _) => Some(reference.as_slice()),
                        };
                        let setting = Setting { temperature, sampling: name, reference: against, plain_tps };
                        rows.push(Row::new(&f.spec().label(), k, batch, &r, &setting));
                        if rejection && b == 0 {
                            rejection_alone.push(r.completions);
                        }
                        bar.inc(1);
                    }
                }
            }
        }
    }
    bar.finish_and_clear();
    println!("{}", markdown(&rows));
    let all_identical = rows.iter().all(|r| r.identical != Some(false));
    if let Some(path) = &cli.json {
        let doc = serde_json::json!({
            "target": target_dir,
            "requests": requests.len(),
            "max_tokens": cli.max_tokens,
            "threads": rayon_threads(),
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("{}: cannot write", path.display()))?;
    }
    Ok(all_identical)
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
