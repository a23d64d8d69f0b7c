//! Run a list of requests to completion (the CLI's and the tests' entry point).

use mtp_base::Error;

use crate::engine::Engine;
use crate::request::{Completion, Event, FinishReason, Request};

/// Submits `requests[i]` once the engine has completed `arrive_at[i]` rounds (all at
/// round 0 when `arrive_at` is empty; a request is submitted early only when the engine
/// would otherwise sit idle) and steps until every request ends. Returns one result per
/// request, in input order; `progress(finished, total)` is called as requests end.
pub fn generate(
    engine: &mut Engine,
    requests: &[Request],
    arrive_at: &[u64],
    mut progress: impl FnMut(usize, usize),
) -> Vec<Result<Completion, Error>> {
    let n = requests.len();
    let due = |i: usize| arrive_at.get(i).copied().unwrap_or(0);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| due(i));
    let mut order = order.into_iter().peekable();
    let mut index_of = std::collections::HashMap::new();
    let mut partial: Vec<Partial> = (0..n).map(|_| Partial::default()).collect();
    let mut results: Vec<Option<Result<Completion, Error>>> = (0..n).map(|_| None).collect();
    let mut finished = 0;
    while finished < n {
        while let Some(&i) = order.peek() {
            if due(i) > engine.rounds() && !engine.is_idle() {
                break;
            }
            order.next();
            match engine.submit(requests[i].clone()) {
                Ok(id) => {
                    index_of.insert(id, i);
                }
                Err(e) => {
                    results[i] = Some(Err(e));
                    finished += 1;
                    progress(finished, n);
                }
            }
        }
        for event in engine.step() {
            let (request, end) = match event {
                Event::Token { request, token, logprob, top } => {
                    let p = &mut partial[index_of[&request]];
                    p.tokens.push(token);
                    p.logprobs.push(logprob);
                    p.top_logprobs.push(top);
                    continue;
                }
                Event::PromptScored { request, scores } => {
                    partial[index_of[&request]].prompt_logprobs = scores;
                    continue;
                }
                Event::Admitted { .. } | Event::Verified { .. } => continue,
                Event::Finished { request, reason } => (request, Ok(reason)),
                Event::Failed { request, error } => (request, Err(error)),
            };
            let i = index_of[&request];
            let p = std::mem::take(&mut partial[i]);
            results[i] = Some(end.map(|finish: FinishReason| Completion {
                id: requests[i].id.clone(),
                tokens: p.tokens,
                logprobs: p.logprobs,
                top_logprobs: p.top_logprobs,
                prompt_logprobs: p.prompt_logprobs,
                finish,
            }));
            finished += 1;
            progress(finished, n);
        }
    }
    results.into_iter().map(|r| r.expect("every request ends")).collect()
}

/// A request's output so far.
#[derive(Default)]
struct Partial {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
    prompt_logprobs: Vec<crate::request::PromptToken>,
}
