//! Requests in, completions out: batched plain greedy decoding over the row-invariant
//! model. Each row's tokens and logprobs are identical whatever else shares the batch.

use std::collections::VecDeque;

use mtp_cache::RowCache;
use mtp_model::kernels::{argmax, logprob};
use mtp_model::{Error, Logits, Model, RowInput};

/// One generation request.
#[derive(Clone, Debug)]
pub struct Request {
    pub id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Keep going past EOS ids (benchmarks, golden comparisons).
    pub ignore_eos: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// Emitted an EOS id (config.json or generation_config.json).
    Eos,
    /// Reached `max_tokens` or the model's context.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Completion {
    pub id: String,
    pub tokens: Vec<u32>,
    /// Natural-log probability of each token under the target (temperature 1).
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Rows decoded together; further requests wait in a queue.
    pub max_batch: usize,
    /// Prompt tokens per prefill forward.
    pub prefill_chunk: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions { max_batch: 8, prefill_chunk: 64 }
    }
}

struct Row {
    index: usize,
    cache: RowCache,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    max_tokens: usize,
    ignore_eos: bool,
    done: Option<FinishReason>,
}

impl Row {
    /// Records the greedy choice from `logits` and decides whether the row is finished.
    fn emit(&mut self, logits: &[f32], eos: &[u32], context: usize) {
        let t = argmax(logits);
        self.tokens.push(t);
        self.logprobs.push(logprob(logits, t));
        if !self.ignore_eos && eos.contains(&t) {
            self.done = Some(FinishReason::Eos);
        } else if self.tokens.len() >= self.max_tokens || self.cache.len() >= context {
            self.done = Some(FinishReason::Length);
        }
    }
}

/// Checks a request against the model before it joins a batch, so a bad request fails
/// alone.
pub fn validate(model: &Model, r: &Request) -> Result<(), Error> {
    let err = |msg: String| Err(Error::Request { request: r.id.clone(), msg });
    if r.prompt.is_empty() {
        return err("empty prompt".into());
    }
    if r.max_tokens == 0 {
        return err("max_tokens must be at least 1".into());
    }
    let vocab = model.config.vocab_size;
    if let Some(t) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
        return err(format!("prompt token id {t} is outside the vocabulary of {vocab}"));
    }
    if r.prompt.len() > model.max_positions() {
        return err(format!(
            "prompt of {} tokens does not fit the model's context of {}",
            r.prompt.len(),
            model.max_positions()
        ));
    }
    Ok(())
}

/// Greedy-decodes every request, at most `max_batch` rows at a time, and returns one
/// result per request in input order. `progress(done, total)` is called as rows finish.
pub fn generate(
    model: &Model,
    requests: &[Request],
    opts: &GenerateOptions,
    mut progress: impl FnMut(usize, usize),
) -> Vec<Result<Completion, Error>> {
    let mut results: Vec<Option<Result<Completion, Error>>> = requests.iter().map(|_| None).collect();
    let mut queue: VecDeque<usize> = VecDeque::new();
    for (i, r) in requests.iter().enumerate() {
        match validate(model, r) {
            Ok(()) => queue.push_back(i),
            Err(e) => results[i] = Some(Err(e)),
        }
    }
    let eos = &model.config.eos_token_ids;
    let context = model.max_positions();
    let mut active: Vec<Row> = Vec::new();
    let mut finished = results.iter().filter(|r| r.is_some()).count();
    while !queue.is_empty() || !active.is_empty() {
        while active.len() < opts.max_batch.max(1) {
            let Some(i) = queue.pop_front() else { break };
            let mut row = Row {
                index: i,
                cache: model.new_cache(),
                tokens: Vec::new(),
                logprobs: Vec::new(),
                max_tokens: requests[i].max_tokens,
                ignore_eos: requests[i].ignore_eos,
                done: None,
            };
            match prefill(model, &mut row.cache, &requests[i].prompt, opts.prefill_chunk) {
                Ok(logits) => {
                    row.emit(&logits, eos, context);
                    active.push(row);
                }
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let mut decoding: Vec<&mut Row> = active.iter_mut().filter(|r| r.done.is_none()).collect();
        if !decoding.is_empty() {
            let last: Vec<[u32; 1]> = decoding.iter().map(|r| [*r.tokens.last().expect("emitted")]).collect();
            let mut inputs: Vec<RowInput> = decoding
                .iter_mut()
                .zip(&last)
                .map(|(row, t)| RowInput { tokens: t, cache: &mut row.cache, logits: Logits::Last })
                .collect();
            let result = model.forward(&mut inputs);
            drop(inputs);
            match result {
                Ok(outs) => {
                    for (row, out) in decoding.iter_mut().zip(outs) {
                        row.emit(&out.logits[0], eos, context);
                    }
                }
                Err(e) => {
                    // validate() rules out per-row errors; anything here ends these rows.
                    for row in decoding.iter_mut() {
                        let id = requests[row.index].id.clone();
                        results[row.index] = Some(Err(Error::Request { request: id, msg: e.to_string() }));
                        row.done = Some(FinishReason::Length);
                    }
                }
            }
        }
        active.retain_mut(|row| {
            let Some(finish) = row.done else { return true };
            let slot = &mut results[row.index];
            if slot.is_none() {
                *slot = Some(Ok(Completion {
                    id: requests[row.index].id.clone(),
                    tokens: std::mem::take(&mut row.tokens),
                    logprobs: std::mem::take(&mut row.logprobs),
                    finish,
                }));
            }
            finished += 1;
            progress(finished, requests.len());
            false
        });
    }
    results.into_iter().map(|r| r.expect("every request ends with a result")).collect()
}

/// Runs `prompt` through `cache` in chunks and returns the logits after its last token.
pub fn prefill(model: &Model, cache: &mut RowCache, prompt: &[u32], chunk: usize) -> Result<Vec<f32>, Error> {
    let chunk = chunk.max(1);
    let mut logits = Vec::new();
    let n_chunks = prompt.len().div_ceil(chunk);
    for (i, piece) in prompt.chunks(chunk).enumerate() {
        let want = if i + 1 == n_chunks { Logits::Last } else { Logits::None };
        let mut rows = [RowInput { tokens: piece, cache: &mut *cache, logits: want }];
        let mut out = model.forward(&mut rows)?;
        if let Some(l) = out.pop().and_then(|o| o.logits.into_iter().next()) {
            logits = l;
        }
    }
    Ok(logits)
}
