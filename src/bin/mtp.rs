//! `mtp generate`, `mtp synth` and `mtp synth-mtp`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::Path;
use std::sync::Arc;

use mtp::base::{Tokenizer, WeightDtype};
use mtp::drafter::Drafter;
use mtp::engine::{generate, Engine, EngineOptions, Request, SamplingMode, SamplingParams};
use mtp::model::{Model, MtpLayout};
use mtp::server::access::Access;
use mtp::server::net::Limits;
use mtp::server::worker::MakeDrafter;
use mtp::server::{Server, ServerOptions};
use mtp::synth::gemma4::{Gemma4Spec, PRESETS as GEMMA4_PRESETS};
use mtp::synth::{SynthQuant, SynthSpec};
use serde_json::json;
use std::net::ToSocketAddrs;

const GENERATE_HELP: &str = concat!(
    "Examples:
  mtp generate --prompts my.jsonl --max-batch 8 > out.jsonl
  mtp generate --target Qwen/Qwen3-0.6B --drafter ngram --temperature 0.7 --seed 1

",
    mtp::prompts_format!()
);

const SERVE_HELP: &str = "Examples:
  mtp serve --target Qwen/Qwen3-8B --backend cuda --max-batch 64
  mtp serve --host 0.0.0.0 --port 8080 --api-key \"$KEY\" --drafter ngram

Then: curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{\"model\": \"mtp-trained\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'";

#[derive(Parser)]
#[command(name = "mtp", version, about = "Lossless speculative generation with row-invariant numerics")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the serve variant's size costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Generation (plain or speculative, greedy or sampled) for every request of a
    /// prompts JSONL; one JSON line per request on stdout, in input order. Greedy and
    /// exact-sampled output is bitwise the same whatever the drafter, k, batch size and
    /// arrival order.
    #[command(after_long_help = GENERATE_HELP)]
    Generate {
        #[command(flatten)]
        model: ModelArgs,
        /// Prompts JSONL (default: examples/prompts.jsonl).
        #[arg(long)]
        prompts: Option<PathBuf>,
        /// Tokens per request unless the request says otherwise.
        #[arg(long, default_value_t = 32, value_parser = mtp::at_least_one)]
        max_tokens: usize,
        /// Do not stop at EOS ids.
        #[arg(long)]
        ignore_eos: bool,
        /// Then decode the same requests again without a drafter, and say how long each run
        /// took and whether every token and logprob was plain decoding's, bit for bit (exit
        /// status 1 if not).
        #[arg(long)]
        compare_plain: bool,
        #[command(flatten)]
        sampling: SamplingArgs,
    },
    /// An OpenAI-compatible HTTP server (`/v1/completions`, `/v1/chat/completions`,
    /// streaming or not, `/v1/models`, `/health`, `/metrics`) over the same engine: every
    /// response's tokens and logprobs are those of the request run alone.
    #[command(after_long_help = SERVE_HELP)]
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        /// Address to listen on: an IP or a host name (0.0.0.0: every interface; off
        /// loopback, give --api-key).
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// TCP port to listen on.
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// Bytes of K/V the exact prefix cache may hold, in MiB (0: off).
        #[arg(long, default_value_t = 256, value_parser = mtp::mib)]
        prefix_cache_mib: usize,
        /// Requests (choices) held at once, running and queued; more are answered 429.
        #[arg(long, default_value_t = 256, value_parser = mtp::at_least_one)]
        max_pending: usize,
        /// The model name clients see (default: the repo id, or the checkpoint directory's name).
        #[arg(long)]
        served_model_name: Option<String>,
        #[command(flatten)]
        http: HttpArgs,
        /// exact: bitwise the tokens plain sampling picks; rejection: modified rejection
        /// sampling, the same distribution with more drafts accepted.
        #[arg(long, default_value = "exact")]
        sampling: String,
        /// How the model writes tool calls: auto (from the chat template's markup), none
        /// (tool calls off), hermes (Qwen 2.5/3, Hermes), llama3-json, gemma4.
        #[arg(long, default_value = "auto")]
        tool_parser: String,
        /// How replies mark their reasoning (split into `reasoning_content`): auto (from the
        /// chat template's markup), none, qwen3 (`<think>`), gemma4 (`<|channel>`).
        #[arg(long, default_value = "auto")]
        reasoning_parser: String,
        /// A Jinja chat template file to use instead of the checkpoint's (its BOS and EOS
        /// texts still the checkpoint's).
        #[arg(long)]
        chat_template: Option<std::path::PathBuf>,
    },
    /// Writes an HF-layout checkpoint with random weights in the shape of a known model.
    /// For Gemma 4, --layers keeps the sliding/full pattern and the share of KV-shared
    /// layers, --kv-heads and --head-dim set the sliding layers' (full layers keep the
    /// preset's head size ratio).
    Synth {
        /// Preset shape: qwen3 (Qwen3-0.6B), qwen3-8b, qwen2 (Qwen2.5-0.5B), llama (Llama-3.2-1B),
        /// gemma4-31b (Gemma 4 31B), gemma4-e2b (Gemma 4 E2B); Gemma 4 text decoders only.
        #[arg(long)]
        like: String,
        /// Hidden size (default: the preset's).
        #[arg(long, value_parser = mtp::at_least_one)]
        hidden: Option<usize>,
        /// Decoder layers (default: the preset's).
        #[arg(long, value_parser = mtp::at_least_one)]
        layers: Option<usize>,
        /// Attention heads (default: the preset's).
        #[arg(long, value_parser = mtp::at_least_one)]
        heads: Option<usize>,
        /// Key/value heads (default: the preset's).
        #[arg(long, value_parser = mtp::at_least_one)]
        kv_heads: Option<usize>,
        /// Size of one attention head (default: the preset's).
        #[arg(long, value_parser = mtp::at_least_one)]
        head_dim: Option<usize>,
        /// MLP intermediate size (default: the preset's).
        #[arg(long, value_parser = mtp::at_least_one)]
        intermediate: Option<usize>,
        /// Vocabulary size (default: the preset's; the tokenizer written covers it).
        #[arg(long, value_parser = mtp::at_least_one)]
        vocab: Option<usize>,
        /// bf16, f16 or f32.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        /// Store every matrix MLX-quantized at this many bits (2, 4 or 8; affine, as
        /// `mlx_lm.convert -q` writes it, scales and biases in --dtype). Default: unquantized.
        #[arg(long)]
        q_bits: Option<usize>,
        /// Values per quantization group with --q-bits: 32, 64 or 128.
        #[arg(long, default_value_t = 64)]
        q_group_size: usize,
        /// Seed of the random weights (the same seed writes the same bytes).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// The most GiB of weights to write: a bigger shape is refused before anything is
        /// written (the file system's free space is checked too).
        #[arg(long, default_value_t = 16, value_parser = mtp::at_least_one)]
        max_gib: usize,
        /// Directory to write (config.json, model.safetensors, tokenizer.json).
        #[arg(long)]
        out: PathBuf,
    },
    /// Writes a random MTP head for a checkpoint, in MiMo or DeepSeek-V3 tensor layout.
    SynthMtp {
        /// The target checkpoint the head belongs to.
        #[arg(long)]
        target: PathBuf,
        /// mimo (`model.mtp_layers.0.*`) or deepseek (`model.layers.{N}.*`).
        #[arg(long, default_value = "mimo")]
        layout: String,
        /// Seed of the random weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Directory to write the head's config.json and model.safetensors.
        #[arg(long)]
        out: PathBuf,
    },
}

/// `serve`'s connection limits and access control (see docs/serving.md).
#[derive(Args, Debug)]
struct HttpArgs {
    /// Every endpoint but /health wants `Authorization: Bearer <key>`. Prefer the
    /// environment variable: a flag shows in the process list.
    #[arg(long, env = "MTP_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Origins whose web pages may call the server (comma-separated, `*`: any); requests
    /// from other pages (they carry `Origin`) are refused.
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// Host names accepted besides loopback's when bound to loopback (comma-separated,
    /// `*`: any); other Host headers are refused (DNS rebinding).
    #[arg(long, value_delimiter = ',')]
    allowed_hosts: Vec<String>,
    /// Connections served at once; more are answered 503.
    #[arg(long, default_value_t = 512, value_parser = mtp::at_least_one)]
    max_connections: usize,
    /// Of those, the most one client address may hold (default: all but an eighth of
    /// --max-connections); more are answered 503, /health and /metrics still served.
    #[arg(long, value_parser = mtp::at_least_one)]
    max_connections_per_client: Option<usize>,
    /// Seconds a connection has to send a request head (also its keep-alive idle time).
    #[arg(long, default_value = "30", value_parser = mtp::seconds)]
    header_timeout: std::time::Duration,
    /// Seconds a request body has to arrive.
    #[arg(long, default_value = "30", value_parser = mtp::seconds)]
    body_timeout: std::time::Duration,
    /// Seconds a response write may wait on a client that reads nothing.
    #[arg(long, default_value = "60", value_parser = mtp::seconds)]
    write_timeout: std::time::Duration,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = 8, value_parser = mtp::mib_at_least_one)]
    max_body_mib: usize,
}

impl HttpArgs {
    fn limits(&self) -> Limits {
        Limits {
            max_connections: self.max_connections,
            max_connections_per_client: self
                .max_connections_per_client
                .unwrap_or_else(|| Limits::per_client_share(self.max_connections)),
            header_timeout: self.header_timeout,
            body_timeout: self.body_timeout,
            write_timeout: self.write_timeout,
            max_body_bytes: self.max_body_mib << 20,
        }
    }

    fn access(&self) -> anyhow::Result<Access> {
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            anyhow::bail!("--api-key (or MTP_API_KEY) is empty");
        }
        for o in &self.allowed_origins {
            if o != "*" && (!o.contains("://") || o.ends_with('/')) {
                anyhow::bail!(
                    "--allowed-origins {o}: an origin is scheme://host[:port], with no path (or `*`)"
                );
            }
        }
        Ok(Access {
            api_key: self.api_key.as_ref().map(|k| k.trim().to_string()),
            allowed_origins: self.allowed_origins.clone(),
            allowed_hosts: self.allowed_hosts.clone(),
        })
    }
}

/// The model, drafter and engine flags `generate` and `serve` share.
#[derive(Args)]
struct ModelArgs {
    /// Target checkpoint: directory or Hugging Face repo id (org/name[@revision]), taken from
    /// the Hugging Face cache or downloaded into it (default: the trained family shipped in
    /// the repo).
    #[arg(long)]
    target: Option<PathBuf>,
    /// Rows decoded together; later requests wait in a queue.
    #[arg(long, default_value_t = 8, value_parser = mtp::at_least_one)]
    max_batch: usize,
    /// auto (the target's own MTP head when its checkpoint has one, else none), none,
    /// draft-model (needs --draft), mtp (--draft, or the target's own MTP weights),
    /// eagle3 (an EAGLE-3 head in --draft, reading the target's tapped layers), assistant
    /// (Gemma 4's assistant in --draft, reading the target's K/V) or ngram (prompt lookup).
    #[arg(long, default_value = "auto")]
    drafter: String,
    /// Draft model, MTP head, EAGLE-3 head or assistant checkpoint: directory or Hugging Face repo id
    /// (org/name[@revision]).
    #[arg(long)]
    draft: Option<PathBuf>,
    /// Draft tokens per row per round: auto (chosen per row every round from measured
    /// acceptance and costs, up to --max-k; none when speculation cannot pay) or a
    /// fixed count of at least 1.
    #[arg(long, default_value = "auto", value_parser = mtp::parse_k)]
    k: mtp::KArg,
    /// The most drafts --k auto gives a row in one round.
    #[arg(long, default_value_t = 8, value_parser = mtp::draft_count)]
    max_k: usize,
    /// Shortest n-gram the ngram drafter matches.
    #[arg(long, default_value_t = 1, value_parser = mtp::at_least_one)]
    ngram_min: usize,
    /// Longest n-gram the ngram drafter matches (it tries the longest first).
    #[arg(long, default_value_t = 4, value_parser = mtp::at_least_one)]
    ngram_max: usize,
    /// K/V cache budget in MiB (target and drafter, prefix cache included): requests are
    /// admitted as their prompts fit, the newest is preempted (and resumes with the same
    /// bits) when rows outgrow it, and one whose worst case cannot fit is refused
    /// (default: none; `serve` on a GPU: the free device memory less a margin).
    #[arg(long, value_parser = mtp::mib_at_least_one)]
    kv_budget_mib: Option<usize>,
    /// Prompt tokens per forward, a token budget that pieces of several waiting prompts share
    /// (default: 2048 on cuda, 64 elsewhere). While other rows decode, new prompts fill each
    /// round's forward up to it (at least half of it prompt), so this is also the most
    /// prompts delay their next token.
    #[arg(long, value_parser = mtp::at_least_one)]
    prefill_chunk: Option<usize>,
    /// Where the model runs: cpu; cuda (a build with `--features cuda` and an NVIDIA GPU;
    /// weights go to GPU 0, or GPUs 0 to N-1 with --tensor-parallel N; K/V stay there);
    /// metal (macOS, `--features metal`, Apple GPU); metal-emulated (the Metal kernels on
    /// the CPU emulator: slow, for testing).
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// How K/V are stored: auto (bf16 for 16-bit checkpoints, f32 for f32 ones), f32,
    /// bf16, or q8 / q4 (the same as --kv-bits 8 / 4).
    #[arg(long, default_value = "auto")]
    kv_dtype: String,
    /// Quantize K/V to 8 or 4 bits (CPU; per position and KV head: an f32 scale and bias
    /// per head_dim values). Rollback and batching stay exact.
    #[arg(long)]
    kv_bits: Option<usize>,
    /// Matmul activations where they meet bf16 weights (and MLX 4-bit ones with bf16
    /// scales): auto (bf16 on CUDA and on CPUs with AVX512-BF16; f32 on other CPUs and
    /// Metal), bf16 (rounded to bf16, exact products, f32 sums, as transformers computes
    /// bf16 models: one tensor-core MMA a product on CUDA, where with bf16 K/V attention
    /// runs on the tensor cores too; `vdpbf16ps` or its emulation on the CPU), or f32 (CUDA:
    /// exact, three MMAs a product; attention in f32). Every guarantee holds in each; the two
    /// give different bits, and each gives the same bits on every CPU.
    #[arg(long, default_value = "auto")]
    activations: String,
    /// Split the target between N ranks (tensor parallelism: N GPUs on CUDA, N threads on
    /// the CPU): attention heads, MLP columns and the LM head's vocabulary are divided, and
    /// the ranks' partial sums are added in rank order, so every row stays invariant for a
    /// given N (different N give different bits).
    #[arg(long, default_value_t = 1)]
    tensor_parallel: usize,
}

impl ModelArgs {
    /// The target checkpoint (default: the trained family), loaded on the backend, and its
    /// tokenizer when it has one.
    fn load(&self) -> Result<(PathBuf, Arc<Model>, Option<Tokenizer>)> {
        let opts = mtp::load::TargetOptions {
            target: self.target.clone(),
            backend: self.backend.clone(),
            kv_dtype: self.kv_dtype.clone(),
            kv_bits: self.kv_bits,
            activations: self.activations.clone(),
            tensor_parallel: self.tensor_parallel,
        };
        let mtp::load::Loaded { dir, model, tokenizer } = opts.load()?;
        Ok((dir, model, tokenizer))
    }

    /// The drafter `--drafter` names, for the target loaded from `target_dir`.
    fn make_drafter(&self, target_dir: &Path, target: &Arc<Model>) -> Result<Option<Box<dyn Drafter>>> {
        let opts = mtp::load::DrafterOptions {
            drafter: self.drafter.clone(),
            draft: self.draft.clone(),
            ngram_min: self.ngram_min,
            ngram_max: self.ngram_max,
        };
        opts.make(target_dir, target)
    }

    fn engine_options(&self) -> EngineOptions {
        let opts = mtp::load::BatchOptions {
            max_batch: self.max_batch,
            k: self.k,
            max_k: self.max_k,
            kv_budget_mib: self.kv_budget_mib,
            prefill_chunk: self.prefill_chunk,
        };
        opts.engine_options(&self.backend)
    }
}

/// Sampling defaults for every request (a prompts line may override each).
#[derive(Args)]
struct SamplingArgs {
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the most likely tokens up to this much probability mass (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = mtp::top_p_arg)]
    top_p: f32,
    /// Keep tokens at least this fraction as likely as the most likely one (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Keys the random numbers (with each token's position): same seed, same output.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// exact: bitwise the tokens plain sampling picks; rejection: modified rejection
    /// sampling, the same distribution with more drafts accepted.
    #[arg(long, default_value = "exact")]
    sampling: String,
}

impl SamplingArgs {
    fn params(&self) -> Result<(SamplingParams, SamplingMode)> {
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
        };
        p.validate().map_err(anyhow::Error::msg)?;
        Ok((p, SamplingMode::parse(&self.sampling).map_err(anyhow::Error::msg)?))
    }
}

/// Each request's tokens and logprobs' bits (None: the request failed).
type Bits = Vec<Option<(Vec<u32>, Vec<u32>)>>;

fn bits(results: &[Result<mtp::engine::Completion, mtp::base::Error>]) -> Bits {
    results
        .iter()
        .map(|r| {
            r.as_ref().ok().map(|c| (c.tokens.clone(), c.logprobs.iter().map(|x| x.to_bits()).collect()))
        })
        .collect()
}

/// `--compare-plain`: the same requests decoded again with no drafter, on the same target
/// and engine options.
struct Plain<'a> {
    model: &'a Arc<Model>,
    tokenizer: Option<&'a Tokenizer>,
    opts: EngineOptions,
    requests: &'a [Request],
    arrive_at: &'a [u64],
}

impl Plain<'_> {
    /// The line that compares the run that took `spec_secs` with plain decoding, and
    /// whether every request's tokens and logprobs were plain decoding's bits.
    fn compare(&self, drafter: &str, spec: &Bits, spec_secs: f64) -> Result<(String, bool)> {
        if drafter == "none" {
            return Ok(("--compare-plain: this run was plain decoding already".into(), true));
        }
        tracing::info!("--compare-plain: decoding the same requests again with --drafter none");
        let t = std::time::Instant::now();
        let mut engine = Engine::new(self.model, None, self.opts.clone())?;
        if let Some(tok) = self.tokenizer {
            engine = engine.with_tokenizer(tok);
        }
        let plain = bits(&generate(&mut engine, self.requests, self.arrive_at, |_, _| {}));
        let plain_secs = t.elapsed().as_secs_f64();
        let timing = format!(
            "beside plain decoding of the same {} requests (--compare-plain): {:.1} ms against plain's {:.1} ms, \
             {:.2}x its speed",
            self.requests.len(),
            spec_secs * 1e3,
            plain_secs * 1e3,
            plain_secs / spec_secs,
        );
        if self.opts.sampling_mode == SamplingMode::Rejection {
            return Ok((
                format!("{timing}; outputs not compared: rejection sampling keeps plain sampling's distribution, not its draws"),
                true,
            ));
        }
        let first_difference = first_difference(self.requests.iter().map(|r| r.id.as_str()), spec, &plain);
        Ok(match first_difference {
            None => (format!("{timing}; every token and logprob bitwise plain decoding's"), true),
            Some(d) => (format!("{timing}; {d}: the exactness guarantee is broken, please report it"), false),
        })
    }
}

/// The first request whose tokens or logprobs' bits differ between two runs, and where.
fn first_difference<'a>(ids: impl Iterator<Item = &'a str>, a: &Bits, b: &Bits) -> Option<String> {
    ids.zip(a.iter().zip(b)).find_map(|(id, (x, y))| {
        let at = match (x, y) {
            (Some((xt, xl)), Some((yt, yl))) => {
                (0..xt.len().max(yt.len())).find(|&i| xt.get(i) != yt.get(i) || xl.get(i) != yl.get(i))
            }
            // The same failure in both runs is no difference.
            (None, None) => None,
            _ => Some(0),
        }?;
        Some(format!("request {id} differs from plain decoding at output token {at}"))
    })
}

/// The last stderr line of `mtp generate`: what speculation did, in plain words.
fn summary(
    drafter: &str,
    auto: bool,
    auto_k: bool,
    compare_plain: bool,
    s: &mtp::engine::SpecStats,
) -> String {
    match (drafter, auto) {
        ("none", true) => {
            return "plain decoding: the target has no MTP head for --drafter auto (try --drafter ngram, or \
                    draft-model with --draft DIR)"
                .into()
        }
        ("none", false) => return "plain decoding (--drafter none)".into(),
        _ => {}
    }
    let what = match drafter {
        "mtp" => "the MTP head",
        "eagle3" => "the EAGLE-3 head",
        "draft-model" => "the draft model",
        "assistant" => "the assistant",
        "ngram" => "n-gram prompt lookup",
        other => other,
    };
    if s.drafted == 0 {
        return format!(
            "drafter {what} proposed nothing: speculation did not pay here, so every round decoded plainly"
        );
    }
    // Adaptive k that drafted in under one round in twenty: say so before the counts.
    if auto_k && (s.drafted as f64) < 0.05 * s.verifies as f64 {
        return format!(
            "drafter {what}, adaptive k: {} draft tokens in {} row verifies ({} accepted): it found that drafts \
             do not pay for their cost on this backend and model, so nearly every round decoded plainly \
             (--k 4 drafts anyway)",
            s.drafted, s.verifies, s.accepted
        );
    }
    let speed = if compare_plain { "" } else { "; --compare-plain times it beside plain decoding" };
    format!(
        "drafter {what}: {:.0}% of {} draft tokens accepted, {:.2} tokens per target forward per request \
         (plain decoding: 1), {:.1} drafts per request per round on average{speed}",
        100.0 * s.acceptance_rate(),
        s.drafted,
        s.mean_accepted_length(),
        s.mean_drafted(),
    )
}

/// One stdout line. Logprobs serialize as f32 (shortest round-trip), so equal text means
/// equal bits.
#[derive(serde::Serialize)]
struct OutputLine<'a> {
    id: &'a str,
    tokens: &'a [u32],
    text: String,
    logprobs: &'a [f32],
    /// Per token, `[id, logprob]` of the most likely alternatives, when the request asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logprobs: Option<&'a [Vec<(u32, f32)>]>,
    /// Per prompt token after the first, its logprob after the ones before it, when the
    /// request asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Vec<PromptLogprob<'a>>>,
    finish_reason: &'static str,
}

/// A scored prompt token: its id, logprob, rank and most likely alternatives there.
#[derive(serde::Serialize)]
struct PromptLogprob<'a> {
    token: u32,
    logprob: f32,
    rank: u32,
    top: &'a [(u32, f32)],
}

/// An error of `mtp synth`: a config.json key it would have written wrongly is named by the
/// flag that sets it.
fn synth_error(e: mtp::base::Error, out: &Path) -> anyhow::Error {
    const FLAGS: [(&str, &str); 8] = [
        ("hidden_size", "--hidden"),
        ("num_hidden_layers", "--layers"),
        ("num_attention_heads", "--heads"),
        ("num_key_value_heads", "--kv-heads"),
        ("head_dim", "--head-dim"),
        ("intermediate_size", "--intermediate"),
        ("vocab_size", "--vocab"),
        ("per_layer_config", "--head-dim or --kv-heads"),
    ];
    let flag_of = |key: &str| FLAGS.iter().find(|(k, _)| *k == key).map(|(_, f)| *f);
    if let mtp::base::Error::Config { key, msg, .. } = &e {
        if let Some(flag) = key.split('.').next().and_then(flag_of) {
            // Keys the message names in passing (a product of sizes) become flags too.
            let msg: Vec<&str> = msg.split(' ').map(|w| flag_of(w).unwrap_or(w)).collect();
            return anyhow::anyhow!(
                "{flag}: {} (config.json's `{key}` would not load; nothing written to {})",
                msg.join(" "),
                out.display()
            );
        }
    }
    anyhow::Error::from(e).context(format!("writing {}", out.display()))
}

fn main() -> ExitCode {
    mtp::keep_freed_memory();
    mtp::init_logging("info");
    mtp::init_threads();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", mtp::error_report(&e));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Generate { model: margs, prompts, max_tokens, ignore_eos, compare_plain, sampling } => {
            let (sampling, sampling_mode) = sampling.params()?;
            let prompts = match prompts {
                Some(p) => p,
                None => mtp::shipped(mtp::shipped_files::PROMPTS, "--prompts")?,
            };
            let t0 = std::time::Instant::now();
            let (target, model, tokenizer) = margs.load()?;
            let defaults = Request { max_tokens, ignore_eos, sampling, ..Request::default() };
            let mtp::prompts::Prompts { requests, arrive_at } =
                mtp::prompts::read(&prompts, tokenizer.as_ref(), &defaults)?;
            if requests.is_empty() {
                eprintln!("{}: holds no requests; nothing to generate", prompts.display());
                return Ok(ExitCode::SUCCESS);
            }
            let asked_auto = margs.drafter == "auto";
            let drafter = margs.make_drafter(&target, &model)?;
            let drafter_name = drafter.as_ref().map_or("none", |d| d.name()).to_string();
            tracing::info!(
                target = %target.display(),
                arch = ?model.config.arch,
                drafter = drafter.as_ref().map_or("none", |d| d.name()),
                requests = requests.len(),
                load_ms = t0.elapsed().as_millis() as u64,
                "loaded"
            );
            let t1 = std::time::Instant::now();
            let opts = EngineOptions { sampling_mode, ..margs.engine_options() };
            let mut engine = Engine::new(&model, drafter, opts.clone())?;
            if let Some(t) = &tokenizer {
                engine = engine.with_tokenizer(t);
            }
            let results = generate(&mut engine, &requests, &arrive_at, |done, total| {
                tracing::info!("finished {done}/{total} requests");
            });
            let decode_secs = t1.elapsed().as_secs_f64();
            let spec_bits = compare_plain.then(|| bits(&results));
            let mut stdout = std::io::stdout().lock();
            let mut failed = 0;
            let mut generated = 0;
            for (req, res) in requests.iter().zip(results) {
                // Text the tokenizer cannot give (an id of a padded vocabulary) fails the request.
                let text = |c: &mtp::engine::Completion| {
                    tokenizer
                        .as_ref()
                        .map_or(Ok(String::new()), |t| t.decode(&c.tokens))
                        .map_err(|e| mtp::base::Error::Request { request: c.id.clone(), msg: e.to_string() })
                };
                let line = match res.and_then(|c| text(&c).map(|t| (c, t))) {
                    Ok((c, text)) => {
                        generated += c.tokens.len();
                        serde_json::to_string(&OutputLine {
                            id: &c.id,
                            tokens: &c.tokens,
                            text,
                            logprobs: &c.logprobs,
                            top_logprobs: (req.top_logprobs > 0).then_some(&c.top_logprobs[..]),
                            prompt_logprobs: req.prompt_logprobs.map(|_| {
                                c.prompt_logprobs
                                    .iter()
                                    .map(|p| PromptLogprob {
                                        token: p.token,
                                        logprob: p.logprob,
                                        rank: p.rank,
                                        top: &p.top,
                                    })
                                    .collect()
                            }),
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
            let stats = engine.stats();
            tracing::info!(
                tokens = generated,
                seconds = secs,
                tokens_per_second = generated as f64 / secs,
                rounds = stats.rounds,
                acceptance_rate = stats.acceptance_rate(),
                mean_accepted_length = stats.mean_accepted_length(),
                "done"
            );
            let auto_k = matches!(margs.k, mtp::KArg::Auto);
            let line = summary(&drafter_name, asked_auto, auto_k, compare_plain, stats);
            let comparison = match spec_bits {
                Some(spec) => {
                    let plain = Plain {
                        model: &model,
                        tokenizer: tokenizer.as_ref(),
                        opts,
                        requests: &requests,
                        arrive_at: &arrive_at,
                    };
                    Some(plain.compare(&drafter_name, &spec, decode_secs)?)
                }
                None => None,
            };
            // What speculation did, then how it compares: the last lines on stderr.
            eprintln!("{line}");
            let mut differs = false;
            if let Some((line, same)) = comparison {
                eprintln!("{line}");
                differs = !same;
            }
            Ok(if failed > 0 {
                ExitCode::from(2)
            } else if differs {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }
        Command::Serve {
            model: margs,
            host,
            port,
            prefix_cache_mib,
            max_pending,
            served_model_name,
            http,
            sampling,
            tool_parser,
            reasoning_parser,
            chat_template,
        } => {
            let sampling_mode = SamplingMode::parse(&sampling).map_err(anyhow::Error::msg)?;
            let access = http.access()?;
            let addr: std::net::SocketAddr = match format!("{host}:{port}").parse() {
                Ok(a) => a,
                Err(_) => (host.as_str(), port)
                    .to_socket_addrs()
                    .with_context(|| format!("--host {host} --port {port}: not an address to listen on"))?
                    .next()
                    .with_context(|| format!("--host {host}: resolves to no address"))?,
            };
            let (target, model, tokenizer) = margs.load()?;
            let model_name = served_model_name.unwrap_or_else(|| match &margs.target {
                // A repo id resolved to a snapshot: serve it under the id.
                Some(arg) if *arg != target => arg.to_string_lossy().into_owned(),
                None => "mtp-trained".into(),
                _ => target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            });
            let mut opts = EngineOptions {
                sampling_mode,
                prefix_cache_bytes: prefix_cache_mib << 20,
                ..margs.engine_options()
            };
            if opts.kv_budget_bytes.is_none() {
                opts.kv_budget_bytes = mtp::default_kv_budget(&model);
            }
            let (dir, m) = (target.clone(), model.clone());
            // Built on the engine thread, which is also made one of rayon's workers.
            let make: MakeDrafter = Box::new(move || {
                mtp::init_threads();
                margs.make_drafter(&dir, &m)
            });
            tracing::info!(target = %target.display(), arch = ?model.config.arch, model = %model_name, "loaded");
            let server = Server::start(
                &target,
                model,
                tokenizer.map(Arc::new),
                make,
                opts,
                ServerOptions {
                    model_name,
                    max_pending,
                    limits: http.limits(),
                    access,
                    tool_parser,
                    reasoning_parser,
                    chat_template,
                },
            )?;
            server.run_blocking(addr)?;
            Ok(ExitCode::SUCCESS)
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
            q_bits,
            q_group_size,
            seed,
            max_gib,
            out,
        } => {
            let quant = q_bits.map(|b| SynthQuant::new(b, q_group_size)).transpose()?;
            let dtype = match dtype.as_str() {
                "bf16" => WeightDtype::Bf16,
                "f16" => WeightDtype::F16,
                "f32" => WeightDtype::F32,
                other => bail!("unknown --dtype `{other}` (bf16, f16, f32)"),
            };
            let max_bytes = (max_gib as u64)
                .checked_mul(1 << 30)
                .with_context(|| format!("--max-gib {max_gib}: more bytes than a u64 counts"))?;
            if let Some(mut g) = Gemma4Spec::preset(&like) {
                if let Some(n) = layers {
                    g.set_layers(n);
                }
                if let Some(d) = head_dim {
                    // Full layers keep the preset's ratio of head sizes.
                    g.global_head_dim = d
                        .checked_mul(g.global_head_dim)
                        .with_context(|| format!("--head-dim {d}: the full layers' head size overflows"))?
                        / g.head_dim;
                    g.head_dim = d;
                }
                g.hidden_size = hidden.unwrap_or(g.hidden_size);
                g.num_attention_heads = heads.unwrap_or(g.num_attention_heads);
                g.num_key_value_heads = kv_heads.unwrap_or(g.num_key_value_heads);
                g.intermediate_size = intermediate.unwrap_or(g.intermediate_size);
                g.vocab_size = vocab.unwrap_or(g.vocab_size);
                (g.dtype, g.quant, g.seed, g.max_bytes) = (dtype, quant, seed, max_bytes);
                let (n, shared) = (g.num_hidden_layers, g.num_kv_shared_layers);
                tracing::info!(like, layers = n, kv_shared = shared, "writing {}", out.display());
                g.write(&out).map_err(|e| synth_error(e, &out))?;
                return Ok(ExitCode::SUCCESS);
            }
            let Some(mut s) = SynthSpec::preset(&like) else {
                bail!(
                    "unknown --like `{like}` (qwen3, qwen3-8b, qwen2, llama, {})",
                    GEMMA4_PRESETS.join(", ")
                );
            };
            s.hidden_size = hidden.unwrap_or(s.hidden_size);
            s.num_hidden_layers = layers.unwrap_or(s.num_hidden_layers);
            s.num_attention_heads = heads.unwrap_or(s.num_attention_heads);
            s.num_key_value_heads = kv_heads.unwrap_or(s.num_key_value_heads);
            s.head_dim = head_dim.unwrap_or(s.head_dim);
            s.intermediate_size = intermediate.unwrap_or(s.intermediate_size);
            s.vocab_size = vocab.unwrap_or(s.vocab_size);
            (s.seed, s.dtype, s.quant, s.max_bytes) = (seed, dtype, quant, max_bytes);
            tracing::info!(arch = ?s.arch, "writing {}", out.display());
            s.write(&out).map_err(|e| synth_error(e, &out))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::SynthMtp { target, layout, seed, out } => {
            let layout = match layout.as_str() {
                "mimo" => MtpLayout::MiMo,
                "deepseek" => MtpLayout::DeepSeek,
                other => bail!("unknown --layout `{other}` (mimo, deepseek)"),
            };
            tracing::info!(layout = layout.name(), "writing {}", out.display());
            SynthSpec::write_mtp_head(&target, layout, &out, seed)
                .with_context(|| format!("writing {}", out.display()))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{first_difference, Bits};

    fn run(rows: &[Option<(&[u32], &[f32])>]) -> Bits {
        rows.iter().map(|r| r.map(|(t, l)| (t.to_vec(), l.iter().map(|x| x.to_bits()).collect()))).collect()
    }

    #[test]
    fn a_difference_in_one_logprob_bit_or_one_token_is_named() {
        let ids = || ["a", "b"].into_iter();
        let same = run(&[Some((&[1, 2], &[-0.5, -1.25])), None]);
        assert_eq!(first_difference(ids(), &same, &same.clone()), None);
        // Negative controls: the last ulp of one logprob, one token more, one failure.
        let ulp = run(&[Some((&[1, 2], &[-0.5, f32::from_bits((-1.25f32).to_bits() + 1)])), None]);
        assert_eq!(
            first_difference(ids(), &same, &ulp).as_deref(),
            Some("request a differs from plain decoding at output token 1")
        );
        let longer = run(&[Some((&[1, 2, 3], &[-0.5, -1.25, -2.0])), None]);
        assert!(first_difference(ids(), &same, &longer).unwrap().contains("token 2"));
        let failed = run(&[Some((&[1, 2], &[-0.5, -1.25])), Some((&[], &[]))]);
        assert!(first_difference(ids(), &same, &failed).unwrap().starts_with("request b"));
    }
}
