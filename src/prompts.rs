//! The prompts JSONL format: one request per line,
//! `{"id": "a", "prompt": "text"}` or `{"id": "a", "prompt_ids": [1, 2]}`,
//! optional `"max_tokens"`, `"stop"` (a list of strings), `"arrive_at"` (submit the
//! request once the engine has completed that many rounds) and the sampling fields
//! `"temperature"`, `"top_k"`, `"top_p"`, `"min_p"`, `"seed"` (each overrides the
//! command line's value for that request), `"top_logprobs"` (report that many most
//! likely alternatives with each token) and `"prompt_logprobs"` (score the prompt's tokens,
//! with that many alternatives each; `"max_tokens": 0` then generates nothing). A constraint on the output, at most one of
//! `"json_schema"` (a schema), `"regex"`, `"grammar"` (Lark) and `"response_format"`
//! (`{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": ...}}`).
//!
//! Reading is bounded: a line over [`MAX_LINE_BYTES`] or a file over [`MAX_FILE_BYTES`] is
//! an error naming the file and line, as are a NUL byte or bytes that are not UTF-8 (a
//! binary file), a line that is JSON but not an object, and a field of the wrong type.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use mtp_base::Tokenizer;
use mtp_engine::{Constraint, Request, SamplingParams};
use serde::Deserialize;
use serde_json::Value;

/// The longest line read: a request of millions of tokens of text still fits.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// The most bytes read from one prompts file.
pub const MAX_FILE_BYTES: u64 = 1 << 30;

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
    /// Read as f64 so that a value under f32's range is refused as written.
    top_p: Option<f64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    top_logprobs: Option<usize>,
    prompt_logprobs: Option<usize>,
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
    read_bounded(path, tokenizer, defaults, MAX_LINE_BYTES, MAX_FILE_BYTES)
}

/// [`read`] with lines of at most `max_line` bytes (line ending included) and at most
/// `max_file` bytes in all.
pub fn read_bounded(
    path: &Path,
    tokenizer: Option<&Tokenizer>,
    defaults: &Request,
    max_line: usize,
    max_file: u64,
) -> Result<Prompts> {
    let file =
        std::fs::File::open(path).with_context(|| format!("{}: cannot read prompts", path.display()))?;
    let mut reader = BufReader::new(file);
    let mut out = Vec::new();
    let mut arrive_at = Vec::new();
    let (mut buf, mut total) = (Vec::new(), 0u64);
    let mut ids = std::collections::HashSet::new();
    for n in 1.. {
        let at = || format!("{}:{n}", path.display());
        buf.clear();
        // One byte past the limit tells a line at the limit from a longer one.
        let got = (&mut reader)
            .take(max_line as u64 + 1)
            .read_until(b'\n', &mut buf)
            .with_context(|| format!("{}: cannot read prompts", at()))?;
        if got == 0 {
            break;
        }
        total += got as u64;
        if total > max_file {
            bail!("{}: the prompts file goes past {max_file} bytes, the most read from one file", at());
        }
        let line = text_line(&buf, max_line).map_err(|msg| anyhow!("{}: {msg}", at()))?;
        if line.trim().is_empty() {
            continue;
        }
        let (request, arrives) =
            parse_request(line, &format!("line{n}"), tokenizer, defaults).map_err(|e| e.context(at()))?;
        if !ids.insert(request.id.clone()) {
            bail!("{}: duplicate request id `{}`", at(), request.id);
        }
        out.push(request);
        arrive_at.push(arrives);
    }
    Ok(Prompts { requests: out, arrive_at })
}

/// One request from one JSON object of the prompts format (`line` without its line
/// ending), named `default_id` when it gives no `id`, and the round it arrives at. What is
/// wrong is said without a place: [`read`] adds the file and line, the Python binding the
/// prompt's index.
pub fn parse_request(
    line: &str,
    default_id: &str,
    tokenizer: Option<&Tokenizer>,
    defaults: &Request,
) -> Result<(Request, u64)> {
    let l = parse_line(line).context("invalid request")?;
    let id = l.id.unwrap_or_else(|| default_id.to_string());
    let prompt = match (l.prompt, l.prompt_ids) {
        (Some(_), Some(_)) => bail!("request {id}: give `prompt` or `prompt_ids`, not both"),
        (None, None) => bail!("request {id}: needs `prompt` or `prompt_ids`"),
        (None, Some(ids)) => ids,
        (Some(text), None) => {
            let tok = tokenizer
                .ok_or_else(|| anyhow!("request {id}: text prompt but the target has no tokenizer.json"))?;
            tok.encode(&text).with_context(|| format!("request {id}"))?
        }
    };
    let d = defaults.sampling;
    let top_p = l.top_p.map(crate::top_p_f32).transpose().map_err(|msg| anyhow!("request {id}: {msg}"))?;
    let sampling = SamplingParams {
        temperature: l.temperature.unwrap_or(d.temperature),
        top_k: l.top_k.unwrap_or(d.top_k),
        top_p: top_p.unwrap_or(d.top_p),
        min_p: l.min_p.unwrap_or(d.min_p),
        seed: l.seed.unwrap_or(d.seed),
    };
    sampling.validate().map_err(|msg| anyhow!("request {id}: {msg}"))?;
    let constraint = constraint(l.json_schema, l.regex, l.grammar, l.response_format)
        .map_err(|msg| anyhow!("request {id}: {msg}"))?;
    let request = Request {
        id,
        prompt,
        max_tokens: l.max_tokens.unwrap_or(defaults.max_tokens),
        ignore_eos: defaults.ignore_eos,
        stop: l.stop.unwrap_or_else(|| defaults.stop.clone()),
        sampling,
        top_logprobs: l.top_logprobs.unwrap_or(defaults.top_logprobs),
        prompt_logprobs: l.prompt_logprobs,
        constraint,
    };
    Ok((request, l.arrive_at.unwrap_or(0)))
}

/// One line of the file as text without its line ending, or what is wrong with it.
fn text_line(buf: &[u8], max_line: usize) -> std::result::Result<&str, String> {
    const FORMAT: &str = "a prompts file is UTF-8 JSON, one request per line";
    if let Some(at) = buf.iter().position(|&b| b == 0) {
        return Err(format!("a NUL byte at byte {} of the line: {FORMAT}, and this looks binary", at + 1));
    }
    if buf.len() > max_line {
        return Err(format!("the line is longer than {max_line} bytes, the longest read"));
    }
    let text = std::str::from_utf8(buf)
        .map_err(|e| format!("not UTF-8 (byte {} of the line): {FORMAT}", e.valid_up_to() + 1))?;
    Ok(text.strip_suffix('\n').map_or(text, |t| t.strip_suffix('\r').unwrap_or(t)))
}

/// A request line: a JSON object of known fields, each of its type; an error says which
/// field is wrong or what the line is instead of an object.
fn parse_line(line: &str) -> Result<Line> {
    // A key given twice is refused (the last value won), as the server refuses it.
    let v: Value = mtp_base::json::parse(line.as_bytes()).map_err(|e| match e.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => anyhow!(
            "not JSON ({e}): each line is one JSON object such as {{\"id\": \"a\", \"prompt\": \"text\"}}"
        ),
        _ => anyhow!(e),
    })?;
    let Value::Object(fields) = &v else {
        let got = match v {
            Value::Array(_) => "an array",
            Value::String(_) => "a string",
            Value::Number(_) => "a number",
            Value::Bool(_) => "true or false",
            _ => "null",
        };
        bail!("expected a JSON object such as {{\"id\": \"a\", \"prompt\": \"text\"}}, got {got}");
    };
    serde_json::from_value(v.clone()).map_err(|e| {
        // Each field alone parses unless it is the culprit (every field is optional).
        let culprit = fields.iter().find_map(|(k, x)| {
            let alone = Value::Object([(k.clone(), x.clone())].into_iter().collect());
            serde_json::from_value::<Line>(alone).err().map(|e| anyhow!("field `{k}`: {e}"))
        });
        culprit.unwrap_or_else(|| e.into())
    })
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
