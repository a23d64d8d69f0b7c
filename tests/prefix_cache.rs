//! The exact prefix cache: requests that share a prefix load its K/V (and the hidden
//! states an MTP head reads) instead of recomputing them, and every output bit stays what
//! the request gives alone with the cache off: cold, warm, and with blocks evicted.

mod common;

use common::{bits, trained};
use mtp::drafter::MtpDrafter;
use mtp::engine::{generate, Completion, Engine, EngineOptions, Request, SamplingParams, BLOCK_TOKENS};
use mtp::kernels::negative_control;
use mtp::model::Model;
use std::sync::Arc;

/// Requests sharing a 40-token prefix (two full blocks and a partial one), with suffixes
/// of 0..=20 tokens, greedy and sampled; one is the bare prefix, one ends on a block edge.
fn requests() -> Vec<Request> {
    let shared: Vec<u32> = (0..40).map(|i| 100 + (i * 37) % 900).collect();
    [0usize, 1, 7, 8, 20]
        .iter()
        .enumerate()
        .map(|(i, &extra)| {
            let mut prompt = shared.clone();
            prompt.extend((0..extra as u32).map(|t| 1000 + t * 13 + i as u32));
            let sampling = if i % 2 == 1 {
                SamplingParams {
                    temperature: 0.8,
                    top_p: 0.95,
                    seed: 7 + i as u64,
                    ..SamplingParams::default()
                }
            } else {
                SamplingParams::default()
            };
            Request {
                id: format!("r{i}"),
                prompt,
                max_tokens: 12,
                ignore_eos: true,
                sampling,
                ..Request::default()
            }
        })
        .collect()
}

/// A completion's tokens and logprob bits.
type Output = (Vec<u32>, Vec<u32>);

fn key(c: &Completion) -> Output {
    (c.tokens.clone(), bits(&c.logprobs))
}

/// Each request alone, no cache, plain decoding.
fn alone(model: &Model, reqs: &[Request]) -> Vec<Output> {
    reqs.iter()
        .map(|r| {
            let mut e =
                Engine::new(model, None, EngineOptions { max_batch: 1, ..EngineOptions::default() }).unwrap();
            key(generate(&mut e, std::slice::from_ref(r), &[], |_, _| {})[0].as_ref().unwrap())
        })
        .collect()
}

/// Runs the requests twice through one engine with the cache (cold, then warm), one
/// admission per round so later requests find earlier ones' blocks; returns both passes
/// and the prompt tokens the cache supplied.
fn cached_twice(model: &Arc<Model>, reqs: &[Request], budget: usize, mtp: bool) -> (Vec<Vec<Output>>, u64) {
    let drafter = mtp.then(|| Box::new(MtpDrafter::load(&trained("target"), model.clone()).unwrap()) as _);
    let opts = EngineOptions {
        max_batch: 3,
        prefill_chunk: 16,
        prefix_cache_bytes: budget,
        ..EngineOptions::default()
    };
    let mut e = Engine::new(model, drafter, opts).unwrap();
    let arrive: Vec<u64> = (0..reqs.len() as u64).collect();
    let passes = (0..2)
        .map(|_| {
            generate(&mut e, reqs, &arrive, |_, _| {}).iter().map(|c| key(c.as_ref().unwrap())).collect()
        })
        .collect();
    (passes, e.stats().prompt_tokens_cached)
}

#[test]
fn cached_prefixes_give_the_bits_of_recomputing_them() {
    let model = Arc::new(common::load(&trained("target")));
    let reqs = requests();
    let want = alone(&model, &reqs);
    let block_bytes = BLOCK_TOKENS * model.kv_bytes_per_token();
    // Unlimited, then room for about three blocks (the shared prefix's two blocks and the
    // suffix blocks keep evicting each other), then no room for even one block.
    let budgets = [(64 << 20, true), (3 * block_bytes + block_bytes / 2, true), (1, false)];
    for (i, (budget, expect_hits)) in budgets.into_iter().enumerate() {
        // Rotated (the emulator), each budget once, with and without the head in turn.
        let heads = if common::full_matrix() { vec![false, true] } else { vec![i % 2 == 0] };
        for mtp in heads {
            let (passes, cached) = cached_twice(&model, &reqs, budget, mtp);
            for (pass, got) in passes.iter().enumerate() {
                assert_eq!(
                    got, &want,
                    "budget {budget}, mtp {mtp}, pass {pass}: output differs from the request alone"
                );
            }
            assert_eq!(
                cached > 0,
                expect_hits,
                "budget {budget}, mtp {mtp}: {cached} prompt tokens from the cache"
            );
        }
    }
}

/// Negative control: with a matmul whose result depends on how many rows it multiplies
/// (candle's stock kernel), a prefix computed inside one chunk and reused under another
/// gives different bits, and the comparison above catches it.
#[test]
fn negative_control_stock_matmul_makes_cached_prefixes_differ() {
    let model = Arc::new(common::load(&trained("target")));
    let reqs = requests();
    negative_control::set_stock_matmul(true);
    let want = alone(&model, &reqs);
    let (passes, cached) = cached_twice(&model, &reqs, 64 << 20, false);
    negative_control::set_stock_matmul(false);
    assert!(cached > 0);
    assert_ne!(passes[1], want, "the stock matmul should make a cached prefix differ from recomputing it");
}

/// With a KV budget, cached prefixes fit in what running rows' reservations leave and give
/// way to them: a budget of about one request's worst case still runs every request, with
/// the same bits, and the cache never holds more than the budget.
#[test]
fn cached_prefixes_yield_to_rows_within_the_kv_budget() {
    let model = Arc::new(common::load(&trained("target")));
    let reqs = requests();
    let want = alone(&model, &reqs);
    let per_token = model.kv_bytes_per_token();
    // The longest request's worst case (prompt + max_tokens + 1) and four blocks more.
    let budget = (60 + 12 + 1 + 4 * BLOCK_TOKENS) * per_token;
    let opts = EngineOptions {
        max_batch: 2,
        prefill_chunk: 16,
        prefix_cache_bytes: 64 << 20,
        kv_budget_bytes: Some(budget),
        ..EngineOptions::default()
    };
    let mut e = Engine::new(&model, None, opts).unwrap();
    for pass in 0..2 {
        let got: Vec<Output> =
            generate(&mut e, &reqs, &[], |_, _| {}).iter().map(|c| key(c.as_ref().unwrap())).collect();
        assert_eq!(got, want, "pass {pass}");
        assert!(e.prefix_cache_bytes() <= budget);
    }
    assert!(e.stats().prompt_tokens_cached > 0, "the cache never had room: the test exercises nothing");
}
