//! The prompts JSONL format: one request per line,
//! `{"id": "a", "prompt": "text"}` or `{"id": "a", "prompt_ids": [1, 2]}`,
//! optional `"max_tokens"`, `"stop"` (a list of strings), `"arrive_at"` (submit the
//! request once the engine has completed that many rounds) and the sampling fields
//! `"temperature"`, `"top_k"`, `"top_p"`, `"min_p"`, `"seed"` (each overrides the
//! command line's value for that request) and `"top_logprobs"` (report that many most
//! likely alternatives with each token). A constraint on the output, at most one of
//! `"json_schema"` (a schema), `"regex"`, `"grammar"` (Lark) and `"response_format"`
//! (`{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": ...}}`).

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use mtp_base::Tokenizer;
use mtp_engine::{Constraint, Request, SamplingParams};
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    id: Option<String>,
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    max_tokens: Option<usize>,
    stop: Option<Vec<String>>,
    arrive_at: Option<u64>,
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    seed: Option<u64>,
    top_logprobs: Option<usize>,
    json_schema: Option<Value>,
    regex: Option<String>,
    grammar: Option<String>,
    response_format: Option<Value>,
}

/// The requests of a prompts file and the round each one arrives at.
pub struct Prompts {
    pub requests: Vec<Request>,
    pub arrive_at: Vec<u64>,
}

/// Parses every line of `path`, tokenizing text prompts with `tokenizer`; fields a line
/// leaves out come from `defaults`. A malformed line is an error naming the file and
/// line; nothing runs until all lines parse.
pub fn read(path: &Path, tokenizer: Option<&Tokenizer>, defaults: &Request) -> Result<Prompts> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("{}: cannot read prompts", path.display()))?;
    let mut out = Vec::new();
    let mut arrive_at = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), n + 1);
        let l: Line = serde_json::from_str(line).with_context(|| format!("{}: invalid request", at()))?;
        let id = l.id.unwrap_or_else(|| format!("line{}", n + 1));
        let prompt = match (l.prompt, l.prompt_ids) {
            (Some(_), Some(_)) => bail!("{}: request {id}: give `prompt` or `prompt_ids`, not both", at()),
            (None, None) => bail!("{}: request {id}: needs `prompt` or `prompt_ids`", at()),
            (None, Some(ids)) => ids,
            (Some(text), None) => {
                let tok = tokenizer.ok_or_else(|| {
                    anyhow!("{}: request {id}: text prompt but the target has no tokenizer.json", at())
                })?;
                tok.encode(&text).with_context(|| format!("{}: request {id}", at()))?
            }
        };
        if out.iter().any(|r: &Request| r.id == id) {
            bail!("{}: duplicate request id `{id}`", at());
        }
        let d = defaults.sampling;
        let sampling = SamplingParams {
            temperature: l.temperature.unwrap_or(d.temperature),
            top_k: l.top_k.unwrap_or(d.top_k),
            top_p: l.top_p.unwrap_or(d.top_p),
            min_p: l.min_p.unwrap_or(d.min_p),
            seed: l.seed.unwrap_or(d.seed),
        };
        sampling.validate().map_err(|msg| anyhow!("{}: request {id}: {msg}", at()))?;
        let constraint = constraint(l.json_schema, l.regex, l.grammar, l.response_format)
            .map_err(|msg| anyhow!("{}: request {id}: {msg}", at()))?;
        out.push(Request {
            id,
            prompt,
            max_tokens: l.max_tokens.unwrap_or(defaults.max_tokens),
            ignore_eos: defaults.ignore_eos,
            stop: l.stop.unwrap_or_else(|| defaults.stop.clone()),
            sampling,
            top_logprobs: l.top_logprobs.unwrap_or(defaults.top_logprobs),
            constraint,
        });
        arrive_at.push(l.arrive_at.unwrap_or(0));
    }
    Ok(Prompts { requests: out, arrive_at })
}

/// The line's output constraint: at most one of its constraint fields.
fn constraint(
    json_schema: Option<Value>,
    regex: Option<String>,
    grammar: Option<String>,
    response_format: Option<Value>,
) -> std::result::Result<Option<Constraint>, String> {
    let format = response_format
        .map(|f| match f["type"].as_str() {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(Constraint::JsonObject)),
            Some("json_schema") => match f["json_schema"].get("schema") {
                Some(schema) => Ok(Some(Constraint::JsonSchema(schema.clone()))),
                None => Err("`response_format` of type json_schema needs `json_schema.schema`".to_string()),
            },
            _ => Err(format!("`response_format` needs `type` text, json_object or json_schema, got {f}")),
        })
        .transpose()?
        .flatten();
    let all = [
        json_schema.map(Constraint::JsonSchema),
        regex.map(Constraint::Regex),
        grammar.map(Constraint::Lark),
        format,
    ];
    let mut given = all.into_iter().flatten();
    let first = given.next();
    if given.next().is_some() {
        return Err("give at most one of `json_schema`, `regex`, `grammar` and `response_format`".into());
    }
    Ok(first)
}
