//! `mtp-bench`: plain decoding and every drafter x k x batch x sampling setting on one
//! workload, with an identity check of every row: against plain decoding (greedy and
//! exact sampling) or against the same drafter at the first batch size (rejection
//! sampling, whose promise is batch invariance).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mtp_base::Tokenizer;
use mtp_drafter::{
    AssistantDrafter, DraftModelDrafter, Drafter, Eagle3Drafter, MtpDrafter, NgramDrafter, OracleDrafter,
};
use mtp_engine::{generate, Completion, Constraint, Engine, EngineOptions, Learned, Request, SpecStats};
use mtp_model::Model;
use serde::Serialize;

/// One `--drafters` entry.
#[derive(Clone, Debug, PartialEq)]
pub enum DrafterSpec {
    DraftModel(PathBuf),
    /// An MTP head from this directory, or from the target's own checkpoint.
    Mtp(Option<PathBuf>),
    /// An EAGLE-3 head from this directory (it reads the target's tapped layers).
    Eagle3(PathBuf),
    /// Gemma 4's assistant from this directory (it reads the target's K/V).
    Assistant(PathBuf),
    Ngram,
    /// Replays plain decoding's output, each token kept with probability `alpha`.
    Oracle(f64),
}

impl DrafterSpec {
    /// Parses `draft-model:DIR,mtp[:DIR],eagle3:DIR,assistant:DIR,ngram,oracle:ALPHA`.
    pub fn parse_list(list: &str) -> Result<Vec<DrafterSpec>> {
        list.split(',').map(str::trim).filter(|s| !s.is_empty()).map(DrafterSpec::parse).collect()
    }

    fn parse(s: &str) -> Result<DrafterSpec> {
        let (kind, arg) = match s.split_once(':') {
            Some((k, a)) => (k, Some(a)),
            None => (s, None),
        };
        Ok(match (kind, arg) {
            ("draft-model", Some(dir)) => DrafterSpec::DraftModel(dir.into()),
            ("draft-model", None) => bail!("`draft-model` needs a directory: draft-model:DIR"),
            ("mtp", dir) => DrafterSpec::Mtp(dir.map(PathBuf::from)),
            ("eagle3", Some(dir)) => DrafterSpec::Eagle3(dir.into()),
            ("eagle3", None) => bail!("`eagle3` needs a directory: eagle3:DIR"),
            ("assistant", Some(dir)) => DrafterSpec::Assistant(dir.into()),
            ("assistant", None) => bail!("`assistant` needs a directory: assistant:DIR"),
            ("ngram", None) => DrafterSpec::Ngram,
            ("oracle", Some(a)) => {
                let alpha: f64 = a.parse().with_context(|| format!("oracle:{a}: ALPHA must be a number"))?;
                if !(0.0..=1.0).contains(&alpha) {
                    bail!("oracle:{a}: ALPHA must be in [0, 1]");
                }
                DrafterSpec::Oracle(alpha)
            }
            ("oracle", None) => bail!("`oracle` needs an acceptance probability: oracle:ALPHA"),
            _ => bail!(
                "unknown drafter `{s}` (draft-model:DIR, mtp[:DIR], eagle3:DIR, assistant:DIR, ngram, oracle:ALPHA)"
            ),
        })
    }

    /// The name in tables and JSON.
    pub fn label(&self) -> String {
        match self {
            DrafterSpec::DraftModel(_) => "draft-model".into(),
            DrafterSpec::Mtp(_) => "mtp".into(),
            DrafterSpec::Eagle3(_) => "eagle3".into(),
            DrafterSpec::Assistant(_) => "assistant".into(),
            DrafterSpec::Ngram => "ngram".into(),
            DrafterSpec::Oracle(a) => format!("oracle:{a}"),
        }
    }
}

/// Builds drafters once per spec (weights loaded once, state fresh per run).
pub struct DrafterFactory {
    spec: DrafterSpec,
    draft: Option<Arc<Model>>,
    target_dir: PathBuf,
}

impl DrafterFactory {
    pub fn new(spec: DrafterSpec, target_dir: &Path, target: &Model) -> Result<DrafterFactory> {
        let draft = match &spec {
            // Loads and checks the draft model once; every run reuses the weights.
            DrafterSpec::DraftModel(dir) => Some(DraftModelDrafter::load(dir, target_dir, target)?.model()),
            _ => None,
        };
        Ok(DrafterFactory { spec, draft, target_dir: target_dir.to_path_buf() })
    }

    pub fn spec(&self) -> &DrafterSpec {
        &self.spec
    }

    /// A fresh drafter; `reference` is plain decoding's output (for the oracle).
    pub fn make(
        &self,
        target: &Arc<Model>,
        requests: &[Request],
        reference: &[Completion],
    ) -> Result<Box<dyn Drafter>> {
        Ok(match &self.spec {
            DrafterSpec::DraftModel(_) => {
                Box::new(DraftModelDrafter::new(self.draft.clone().expect("loaded in new"), target)?)
            }
            DrafterSpec::Mtp(dir) => {
                Box::new(MtpDrafter::load(dir.as_deref().unwrap_or(&self.target_dir), target.clone())?)
            }
            // A directory, or a Hugging Face repo id's snapshot.
            DrafterSpec::Eagle3(dir) => {
                Box::new(Eagle3Drafter::load(&mtp_base::hub::resolve_from_env(dir)?, target.clone())?)
            }
            DrafterSpec::Assistant(dir) => Box::new(AssistantDrafter::load(dir, target.clone())?),
            DrafterSpec::Ngram => Box::new(NgramDrafter::default()),
            DrafterSpec::Oracle(alpha) => {
                let refs = requests.iter().zip(reference).map(|(r, c)| (r.prompt.clone(), c.tokens.clone()));
                Box::new(OracleDrafter::new(refs, *alpha, 0x5eed, target.config.vocab_size)?)
            }
        })
    }
}

/// One run's measurements.
pub struct Run {
    pub completions: Vec<Completion>,
    pub stats: SpecStats,
    pub seconds: f64,
    /// What adaptive k learned by the run's end (the next run of the setting may start there).
    pub learned: Learned,
}

impl Run {
    pub fn tokens(&self) -> usize {
        self.completions.iter().map(|c| c.tokens.len()).sum()
    }

    /// Decode throughput: generated tokens over the run's wall time minus prefill time
    /// (prompt processing is the same work for every drafter and is reported apart).
    pub fn tokens_per_second(&self) -> f64 {
        let decode = self.seconds - self.stats.prefill_time.as_secs_f64();
        self.tokens() as f64 / decode.max(1e-9)
    }
}

/// A `--constraint` value: `none`, `json_object`, `json_schema:FILE` or `regex:RX`, as
/// (label, constraint).
pub fn parse_constraint(spec: &str) -> Result<(String, Option<Constraint>)> {
    let c = match spec.split_once(':') {
        None if spec == "none" => None,
        None if spec == "json_object" => Some(Constraint::JsonObject),
        Some(("regex", rx)) => Some(Constraint::Regex(rx.to_string())),
        Some(("json_schema", file)) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("--constraint {spec}: cannot read {file}"))?;
            let schema = serde_json::from_str(&text)
                .with_context(|| format!("--constraint {spec}: {file} is not JSON"))?;
            Some(Constraint::JsonSchema(schema))
        }
        _ => bail!("--constraint {spec}: not none, json_object, json_schema:FILE or regex:RX"),
    };
    Ok((spec.to_string(), c))
}

/// Runs every request to completion (all arriving at once) and times the whole run.
/// `tokenizer` compiles the requests' constraints (when they have any); without
/// constraints the engine runs without it, as ids alone, so a synthesized checkpoint whose
/// random weights pick ids past its small tokenizer still runs every token. Adaptive k
/// starts from `learned` where given (an earlier run's), else from its priors.
pub fn run(
    model: &Model,
    tokenizer: Option<&Tokenizer>,
    drafter: Option<Box<dyn Drafter + '_>>,
    requests: &[Request],
    opts: EngineOptions,
    learned: Option<Learned>,
) -> Result<Run> {
    let mut engine = Engine::new(model, drafter, opts)?;
    if let Some(learned) = learned {
        engine = engine.with_learned(learned);
    }
    if let Some(tok) = tokenizer.filter(|_| requests.iter().any(|r| r.constraint.is_some())) {
        engine = engine.with_tokenizer(tok);
    }
    let t0 = Instant::now();
    let results = generate(&mut engine, requests, &[], |_, _| {});
    let seconds = t0.elapsed().as_secs_f64();
    let completions = results.into_iter().collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(Run { completions, stats: engine.stats().clone(), seconds, learned: engine.learned() })
}

/// Per-request detail in the JSON report.
#[derive(Serialize)]
pub struct RequestDetail {
    pub id: String,
    pub tokens: usize,
    /// None where the row has nothing to be identical to.
    pub identical: Option<bool>,
}

/// One table row.
#[derive(Serialize)]
pub struct Row {
    /// What every request's output is constrained to (`none`: free text).
    pub constraint: String,
    pub drafter: String,
    /// `auto` (adaptive) or the fixed draft length; `0` for plain decoding.
    pub k: String,
    /// Drafts per row per round, on average (what `auto` chose).
    pub mean_k: f64,
    pub batch: usize,
    /// As given on the command line (the f32's shortest decimal, not its binary value).
    pub temperature: f64,
    /// greedy, plain (no drafter, sampled), exact or rejection.
    pub sampling: String,
    pub acceptance_rate: f64,
    pub mean_accepted_length: f64,
    pub per_position_acceptance: Vec<f64>,
    pub tokens: usize,
    /// Wall time of the whole run, prefill included.
    pub seconds: f64,
    pub prefill_seconds: f64,
    /// Generated tokens per second of decoding (prefill excluded).
    pub tokens_per_second: f64,
    /// The slowest and fastest of the repeats (tokens/s).
    pub tokens_per_second_min: f64,
    pub tokens_per_second_max: f64,
    pub speedup: f64,
    /// The speedup's spread: this row's slowest run over plain's fastest, its fastest over
    /// plain's slowest.
    pub speedup_min: f64,
    pub speedup_max: f64,
    /// The spread includes 1.0: this row cannot be told from plain decoding on this host.
    pub within_noise: bool,
    pub draft_ms_per_round: f64,
    pub verify_ms_per_round: f64,
    pub rounds: u64,
    /// Every request bitwise equal to its reference; None for rows that are their own
    /// reference (rejection sampling at the first batch size).
    pub identical: Option<bool>,
    /// This row is the reference later batch sizes are compared with.
    pub reference: bool,
    pub requests: Vec<RequestDetail>,
}

/// What a row is compared with and how it sampled.
pub struct Setting<'a> {
    pub constraint: &'a str,
    pub temperature: f32,
    pub sampling: &'a str,
    pub reference: Option<&'a [Completion]>,
    pub plain_tps: f64,
    /// The slowest and fastest plain-decoding run (tokens/s) of the same setting.
    pub plain_range: (f64, f64),
}

impl Row {
    /// Measurements of the median of `runs` (by tokens/s) against plain decoding's, with
    /// every run checked against the setting's reference (or, for a row that is its own
    /// reference, against its first run).
    pub fn new(drafter: &str, k: &str, batch: usize, runs: &[Run], setting: &Setting) -> Row {
        let run = median_run(runs);
        let reference = setting.reference.unwrap_or(&runs[0].completions);
        // Per request: every run equals the reference there.
        let matches: Vec<bool> = (0..run.completions.len())
            .map(|i| {
                runs.iter()
                    .all(|r| r.completions.get(i).zip(reference.get(i)).is_some_and(|(a, b)| same(a, b)))
            })
            .collect();
        let all_same =
            matches.iter().all(|&m| m) && runs.iter().all(|r| r.completions.len() == reference.len());
        let requests: Vec<RequestDetail> = run
            .completions
            .iter()
            .zip(&matches)
            .map(|(c, &m)| RequestDetail {
                id: c.id.clone(),
                tokens: c.tokens.len(),
                identical: setting.reference.map(|_| m),
            })
            .collect();
        let (lo, hi) = tps_range(runs);
        let (plain_lo, plain_hi) = setting.plain_range;
        let (speedup_min, speedup_max) = (lo / plain_hi.max(1e-9), hi / plain_lo.max(1e-9));
        let s = &run.stats;
        let per_round = |d: std::time::Duration| d.as_secs_f64() * 1e3 / s.rounds.max(1) as f64;
        Row {
            constraint: setting.constraint.to_string(),
            drafter: drafter.to_string(),
            k: k.to_string(),
            mean_k: s.mean_drafted(),
            batch,
            temperature: setting.temperature.to_string().parse().unwrap_or(setting.temperature as f64),
            sampling: setting.sampling.to_string(),
            acceptance_rate: s.acceptance_rate(),
            mean_accepted_length: s.mean_accepted_length(),
            per_position_acceptance: s.per_position_acceptance(),
            tokens: run.tokens(),
            seconds: run.seconds,
            prefill_seconds: s.prefill_time.as_secs_f64(),
            tokens_per_second: run.tokens_per_second(),
            tokens_per_second_min: lo,
            tokens_per_second_max: hi,
            speedup: run.tokens_per_second() / setting.plain_tps.max(1e-9),
            speedup_min,
            speedup_max,
            within_noise: drafter != "none" && speedup_min <= 1.0 && 1.0 <= speedup_max,
            draft_ms_per_round: per_round(s.draft_time),
            verify_ms_per_round: per_round(s.verify_time),
            rounds: s.rounds,
            // A row that is its own reference is still checked run against run.
            identical: match (setting.reference, all_same) {
                (Some(_), same) => Some(same),
                (None, true) => None,
                (None, false) => Some(false),
            },
            reference: setting.reference.is_none(),
            requests,
        }
    }
}

/// The run with the median tokens/s.
fn median_run(runs: &[Run]) -> &Run {
    let mut order: Vec<&Run> = runs.iter().collect();
    order.sort_by(|a, b| a.tokens_per_second().total_cmp(&b.tokens_per_second()));
    order[order.len() / 2]
}

/// The slowest and fastest of `runs` (tokens/s).
pub fn tps_range(runs: &[Run]) -> (f64, f64) {
    let tps = runs.iter().map(Run::tokens_per_second);
    (tps.clone().fold(f64::INFINITY, f64::min), tps.fold(0.0, f64::max))
}

/// The median tokens/s of `runs`.
pub fn median_tps(runs: &[Run]) -> f64 {
    median_run(runs).tokens_per_second()
}

/// Same tokens, same logprob bits, same finish.
pub fn same(a: &Completion, b: &Completion) -> bool {
    a.tokens == b.tokens
        && a.finish == b.finish
        && a.logprobs.len() == b.logprobs.len()
        && a.logprobs.iter().zip(&b.logprobs).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The Markdown table of all rows.
pub fn markdown(rows: &[Row]) -> String {
    let mut s = String::from(
        "| constraint | sampling | drafter | k (mean) | batch | acceptance | mean accepted length | per-position acceptance | tokens/s | speedup | draft ms/round | verify ms/round | identical |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let pos: Vec<String> = r.per_position_acceptance.iter().map(|p| format!("{p:.2}")).collect();
        let dash = r.drafter == "none";
        s += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.1} ({:.0}-{:.0}) | {} | {:.2} | {:.2} | {} |\n",
            r.constraint,
            if r.sampling == "greedy" {
                "greedy".to_string()
            } else {
                format!("T={} {}", r.temperature, r.sampling)
            },
            r.drafter,
            if dash { "-".into() } else { format!("{} ({:.2})", r.k, r.mean_k) },
            r.batch,
            if dash { "-".into() } else { format!("{:.3}", r.acceptance_rate) },
            if dash { "1.00".into() } else { format!("{:.2}", r.mean_accepted_length) },
            if dash { "-".into() } else { pos.join(" ") },
            r.tokens_per_second,
            r.tokens_per_second_min,
            r.tokens_per_second_max,
            if dash {
                "1.00x".to_string()
            } else {
                format!(
                    "{:.2}x ({:.2}-{:.2}){}",
                    r.speedup,
                    r.speedup_min,
                    r.speedup_max,
                    if r.within_noise { " ~" } else { "" }
                )
            },
            r.draft_ms_per_round,
            r.verify_ms_per_round,
            match r.identical {
                Some(true) => "yes",
                Some(false) => "**NO**",
                None => "reference",
            },
        );
    }
    s += "\ntokens/s and speedup: the median run (the slowest-fastest of the repeats); a speedup's spread is\n\
          the row's slowest run over plain's fastest to its fastest over plain's slowest; ~: the spread\n\
          includes 1.00x, so the row cannot be told from plain decoding on this host.\n";
    s
}

/// `n` prompts of `len` tokens cut from the text files under `dir` (sorted by path,
/// concatenated, tokenized; cuts evenly spaced), so the same folder always gives the same
/// prompts.
pub fn prompts_from_dir(
    dir: &Path,
    tok: &Tokenizer,
    n: usize,
    len: usize,
    max_tokens: usize,
) -> Result<Vec<Request>> {
    if n == 0 || len == 0 {
        bail!("--num-prompts and --prompt-tokens must be at least 1");
    }
    // The prompts are held at once: bound their count and tokens before cutting any.
    let total = n.checked_mul(len).filter(|&t| n <= MAX_CUT_PROMPTS && t <= MAX_CUT_TOKENS);
    let Some(total) = total else {
        bail!(
            "--num-prompts {n} x --prompt-tokens {len}: at most {MAX_CUT_PROMPTS} prompts and \
             {MAX_CUT_TOKENS} tokens in all"
        );
    };
    let mut files = Vec::new();
    collect_files(dir, &mut files)?;
    files.sort();
    let mut ids = Vec::new();
    for f in &files {
        // Binary files are skipped; only text is cut into prompts, and only a file's first
        // bytes (a corpus file of gigabytes needs no more).
        if let Some(text) = read_text_head(f) {
            ids.extend(tok.encode(&text).with_context(|| format!("tokenizing {}", f.display()))?);
        }
        if ids.len() >= total.saturating_mul(64) {
            break; // plenty to cut from
        }
    }
    if ids.len() < len {
        bail!("{}: {} tokens of text, fewer than --prompt-tokens {len}", dir.display(), ids.len());
    }
    let span = ids.len() - len;
    Ok((0..n)
        .map(|i| {
            let at = if n == 1 { 0 } else { span * i / (n - 1) };
            Request {
                id: format!("p{i}"),
                prompt: ids[at..at + len].to_vec(),
                max_tokens,
                ignore_eos: true,
                ..Request::default()
            }
        })
        .collect())
}

/// The most prompts `--prompts-dir` cuts, and the most tokens they hold in all.
pub const MAX_CUT_PROMPTS: usize = 1 << 16;
pub const MAX_CUT_TOKENS: usize = 1 << 26;

/// Bytes of one file read for `--prompts-dir`.
const HEAD_BYTES: u64 = 16 << 20;

/// The first [`HEAD_BYTES`] of `f` when they are UTF-8 text (cut back to a whole character).
fn read_text_head(f: &Path) -> Option<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(f).ok()?.take(HEAD_BYTES).read_to_end(&mut bytes).ok()?;
    match String::from_utf8(bytes) {
        Ok(text) => Some(text),
        // A character cut by the limit is fine; anything else is binary.
        Err(e) if e.utf8_error().error_len().is_none() => {
            let valid = e.utf8_error().valid_up_to();
            let mut bytes = e.into_bytes();
            bytes.truncate(valid);
            String::from_utf8(bytes).ok()
        }
        Err(_) => None,
    }
}

/// Regular files under `dir`, recursively; symbolic links (which may loop), pipes and
/// devices (which may never end) are skipped.
fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("{}: cannot read folder", dir.display()))?;
    for e in entries {
        let e = e.with_context(|| format!("{}: cannot list", dir.display()))?;
        let kind = e.file_type().with_context(|| format!("{}: cannot stat", e.path().display()))?;
        if kind.is_dir() {
            collect_files(&e.path(), out)?;
        } else if kind.is_file() {
            out.push(e.path());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A symbolic link back up the tree and a pipe no one writes would hang the walk or the
    /// read; both are skipped, and a text file's head is read. Negative control: the walk
    /// finds the text file.
    #[cfg(unix)]
    #[test]
    fn prompt_folders_skip_links_pipes_and_binary() {
        let dir = std::env::temp_dir().join(format!("mtp-bench-dir-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("sub/a.rs"), "fn main() {}\n").unwrap();
        std::fs::write(dir.join("b.bin"), [0xffu8, 0xfe, 0x00, 0x80]).unwrap();
        std::os::unix::fs::symlink(&dir, dir.join("sub/loop")).unwrap();
        let fifo = std::process::Command::new("mkfifo").arg(dir.join("pipe")).status();
        let mut files = Vec::new();
        collect_files(&dir, &mut files).unwrap();
        files.sort();
        assert_eq!(files, vec![dir.join("b.bin"), dir.join("sub/a.rs")], "fifo made: {fifo:?}");
        assert_eq!(read_text_head(&dir.join("sub/a.rs")).as_deref(), Some("fn main() {}\n"));
        assert_eq!(read_text_head(&dir.join("b.bin")), None);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn parses_drafter_lists() {
        let l = DrafterSpec::parse_list("draft-model:/m, mtp,mtp:/h,eagle3:/e,ngram,oracle:0.7").unwrap();
        assert_eq!(
            l,
            vec![
                DrafterSpec::DraftModel("/m".into()),
                DrafterSpec::Mtp(None),
                DrafterSpec::Mtp(Some("/h".into())),
                DrafterSpec::Eagle3("/e".into()),
                DrafterSpec::Ngram,
                DrafterSpec::Oracle(0.7)
            ]
        );
        for bad in ["draft-model", "eagle3", "oracle", "oracle:2", "oracle:x", "medusa", "ngram:3"] {
            assert!(DrafterSpec::parse_list(bad).is_err(), "{bad}");
        }
    }
}
