//! `mtp generate` and `mtp synth`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use mtp::engine::{generate, GenerateOptions};
use mtp::model::backend::Backend;
use mtp::model::synth::SynthSpec;
use mtp::model::{Model, Tokenizer, WeightDtype};
use serde_json::json;

#[derive(Parser)]
#[command(name = "mtp", version, about = "Lossless speculative generation with row-invariant numerics")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Greedy generation for every request of a prompts JSONL; one JSON line per request
    /// on stdout, in input order.
    Generate {
        /// Hugging Face checkpoint directory (default: the tiny checkpoint shipped in the repo).
        #[arg(long)]
        target: Option<PathBuf>,
        /// Prompts JSONL (default: examples/prompts.jsonl).
        #[arg(long)]
        prompts: Option<PathBuf>,
        /// Tokens per request unless the request says otherwise.
        #[arg(long, default_value_t = 32)]
        max_tokens: usize,
        /// Do not stop at EOS ids.
        #[arg(long)]
        ignore_eos: bool,
        /// Rows decoded together.
        #[arg(long, default_value_t = 8)]
        max_batch: usize,
        /// Prompt tokens per prefill forward.
        #[arg(long, default_value_t = 64)]
        prefill_chunk: usize,
        #[arg(long, default_value = "cpu")]
        backend: String,
    },
    /// Writes an HF-layout checkpoint with random weights in the shape of a known model.
    Synth {
        /// Preset shape: qwen3 (Qwen3-0.6B), qwen2 (Qwen2.5-0.5B), llama (Llama-3.2-1B).
        #[arg(long)]
        like: String,
        #[arg(long)]
        hidden: Option<usize>,
        #[arg(long)]
        layers: Option<usize>,
        #[arg(long)]
        heads: Option<usize>,
        #[arg(long)]
        kv_heads: Option<usize>,
        #[arg(long)]
        head_dim: Option<usize>,
        #[arg(long)]
        intermediate: Option<usize>,
        #[arg(long)]
        vocab: Option<usize>,
        /// bf16, f16 or f32.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long)]
        out: PathBuf,
    },
}

/// One stdout line. Logprobs serialize as f32 (shortest round-trip), so equal text means
/// equal bits.
#[derive(serde::Serialize)]
struct OutputLine<'a> {
    id: &'a str,
    tokens: &'a [u32],
    text: String,
    logprobs: &'a [f32],
    finish_reason: &'static str,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Generate { target, prompts, max_tokens, ignore_eos, max_batch, prefill_chunk, backend } => {
            backend.parse::<Backend>()?.check()?;
            let target = target.unwrap_or_else(|| PathBuf::from(mtp::DEFAULT_TARGET));
            let prompts = prompts.unwrap_or_else(|| {
                PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/prompts.jsonl"))
            });
            let t0 = std::time::Instant::now();
            let model = Model::load(&target)?;
            let tokenizer = match Tokenizer::from_dir(&target) {
                Ok(t) => Some(t),
                Err(e) => {
                    tracing::warn!("{e}; text prompts and output text are unavailable");
                    None
                }
            };
            let requests = mtp::prompts::read(&prompts, tokenizer.as_ref(), max_tokens, ignore_eos)?;
            tracing::info!(
                target = %target.display(),
                arch = ?model.config.arch,
                requests = requests.len(),
                load_ms = t0.elapsed().as_millis() as u64,
                "loaded"
            );
            let t1 = std::time::Instant::now();
            let opts = GenerateOptions { max_batch, prefill_chunk };
            let results = generate(&model, &requests, &opts, |done, total| {
                tracing::info!("finished {done}/{total} requests");
            });
            let mut stdout = std::io::stdout().lock();
            let mut failed = 0;
            let mut generated = 0;
            for (req, res) in requests.iter().zip(results) {
                let line = match res {
                    Ok(c) => {
                        generated += c.tokens.len();
                        let text = match &tokenizer {
                            Some(t) => t.decode(&c.tokens)?,
                            None => String::new(),
                        };
                        serde_json::to_string(&OutputLine {
                            id: &c.id,
                            tokens: &c.tokens,
                            text,
                            logprobs: &c.logprobs,
                            finish_reason: c.finish.as_str(),
                        })?
                    }
                    Err(e) => {
                        failed += 1;
                        tracing::error!("{e}");
                        json!({"id": req.id, "error": e.to_string()}).to_string()
                    }
                };
                writeln!(stdout, "{line}")?;
            }
            let secs = t1.elapsed().as_secs_f64();
            tracing::info!(
                tokens = generated,
                seconds = secs,
                tokens_per_second = generated as f64 / secs,
                "done"
            );
            Ok(if failed > 0 { ExitCode::from(2) } else { ExitCode::SUCCESS })
        }
        Command::Synth {
            like,
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            vocab,
            dtype,
            seed,
            out,
        } => {
            let Some(mut s) = SynthSpec::preset(&like) else {
                bail!("unknown --like `{like}` (qwen3, qwen2, llama)");
            };
            s.hidden_size = hidden.unwrap_or(s.hidden_size);
            s.num_hidden_layers = layers.unwrap_or(s.num_hidden_layers);
            s.num_attention_heads = heads.unwrap_or(s.num_attention_heads);
            s.num_key_value_heads = kv_heads.unwrap_or(s.num_key_value_heads);
            s.head_dim = head_dim.unwrap_or(s.head_dim);
            s.intermediate_size = intermediate.unwrap_or(s.intermediate_size);
            s.vocab_size = vocab.unwrap_or(s.vocab_size);
            s.seed = seed;
            s.dtype = match dtype.as_str() {
                "bf16" => WeightDtype::Bf16,
                "f16" => WeightDtype::F16,
                "f32" => WeightDtype::F32,
                other => bail!("unknown --dtype `{other}` (bf16, f16, f32)"),
            };
            if s.num_attention_heads % s.num_key_value_heads != 0 {
                bail!("--kv-heads {} must divide --heads {}", s.num_key_value_heads, s.num_attention_heads);
            }
            tracing::info!(arch = ?s.arch, "writing {}", out.display());
            s.write(&out).with_context(|| format!("writing {}", out.display()))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
