//! The exact prefix cache: requests that share a prefix load its K/V (and the hidden
//! states an MTP head reads) instead of recomputing them, and every output bit stays what
//! the request gives alone with the cache off: cold, warm, and with blocks evicted.

mod common;

use common::{bits, trained};
use mtp::drafter::MtpDrafter;
use mtp::engine::{generate, Completion, Engine, EngineOptions, Request, SamplingParams};
use mtp::kernels::negative_control;
use mtp::model::Model;
use std::sync::Arc;

/// Tokens of the shared prefix: two full K/V blocks of 64 and a partial one.
const SHARED: usize = 150;

/// Requests sharing a 150-token prefix, with suffixes of 0..=20 tokens, greedy and
/// sampled; one is the bare prefix, one ends on a block edge (192 tokens).
fn requests() -> Vec<Request> {
    let shared: Vec<u32> = (0..SHARED as u32).map(|i| 100 + (i * 37) % 900).collect();
    [0usize, 1, 7, 42, 20]
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
    let block_bytes = model.new_cache().block_positions() * model.kv_bytes_per_token();
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
    let budget = (SHARED + 42 + 12 + 1 + 4 * model.new_cache().block_positions()) * per_token;
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

/// Runs `reqs` through `e`, request `i` submitted before step `arrive[i]`, and returns each
/// one's output (in order) with the most K/V bytes the engine held after any step.
fn run_tracking_kv(e: &mut Engine, reqs: &[Request], arrive: &[u64]) -> (Vec<Output>, usize) {
    use mtp::engine::Event;
    let mut ids = Vec::new();
    let mut out: Vec<Output> = vec![(Vec::new(), Vec::new()); reqs.len()];
    let (mut step, mut peak) = (0u64, 0usize);
    while ids.len() < reqs.len() || !e.is_idle() {
        for (r, _) in reqs.iter().zip(arrive).filter(|(_, &a)| a == step) {
            ids.push(e.submit(r.clone()).unwrap());
        }
        for ev in e.step() {
            match ev {
                Event::Token { request, token, logprob, .. } => {
                    let i = ids.iter().position(|&id| id == request).unwrap();
                    out[i].0.push(token);
                    out[i].1.push(logprob.to_bits());
                }
                Event::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
        peak = peak.max(e.kv_bytes());
        step += 1;
    }
    (out, peak)
}

/// `rows` greedy requests named `{name}{i}`, each `shared` then `own` tokens of its own
/// (`own_token(i, t)`), `max_tokens` new tokens each.
fn sharing(
    shared: &[u32],
    rows: u32,
    own: u32,
    own_token: impl Fn(u32, u32) -> u32,
    max_tokens: usize,
    name: &str,
) -> Vec<Request> {
    (0..rows)
        .map(|i| {
            let mut prompt = shared.to_vec();
            prompt.extend((0..own).map(|t| own_token(i, t)));
            Request { id: format!("{name}{i}"), prompt, max_tokens, ignore_eos: true, ..Request::default() }
        })
        .collect()
}

/// Does this backend's K/V store page (so rows share a prefix's blocks), or copy a cached
/// prefix into each row (tensor-parallel ranks, for now)?
fn pages(model: &Model) -> bool {
    model.new_cache().store().block_positions().is_some()
}

/// The CPU goal of docs/serving.md: 16 requests sharing a 768-token prefix hold its K/V
/// once. The first request runs alone; the other 15 arrive once its blocks are cached and
/// adopt them. Every output keeps the bits of the request alone, and the rows' physical
/// K/V peaks at the prefix once plus one block a row (its own last block); with the cache
/// off (the control) every row holds the prefix. The emulator's rotated matrix runs 4 rows
/// sharing 192 tokens (its kernels run a thousand times slower than the CPU's).
#[test]
fn a_prefix_shared_by_16_rows_is_held_once() {
    let model = Arc::new(common::load(&trained("target")));
    if !pages(&model) {
        eprintln!("skipped: the {:?} backend copies cached prefixes into each row", model.backend());
        return;
    }
    let (rows, prefix) = if common::full_matrix() { (16, 768) } else { (4, 192) };
    let shared: Vec<u32> = (0..prefix).map(|i| 50 + (i * 53) % 1800).collect();
    let reqs = sharing(&shared, rows, 16, |i, t| 3 + (i * 131 + t * 17) % 1900, 24, "r");
    let want = alone(&model, &reqs);
    let block = model.new_cache().block_positions();
    let block_bytes = block * model.kv_bytes_per_token();
    let arrive: Vec<u64> = (0..rows).map(|i| u64::from(i > 0)).collect();
    // Whole prompts a round, so that without the cache the rows overlap as they do with it.
    let opts = |cache: usize| EngineOptions {
        max_batch: 16,
        prefill_chunk: 1024,
        prefix_cache_bytes: cache,
        ..EngineOptions::default()
    };
    let mut e = Engine::new(&model, None, opts(64 << 20)).unwrap();
    let (got, peak) = run_tracking_kv(&mut e, &reqs, &arrive);
    assert_eq!(got, want, "a row reading shared blocks differs from the request alone");
    let (rows, prefix) = (rows as usize, prefix as usize);
    let cached = e.stats().prompt_tokens_cached;
    assert_eq!(cached, ((rows - 1) * prefix) as u64, "every later row adopts the whole prefix");
    let once = (prefix / block + rows) * block_bytes;
    assert!(peak <= once, "peak K/V {peak} bytes, over the prefix once and a block a row ({once})");
    eprintln!("K/V peak shared: {peak} bytes (bound {once})");
    let mut control = Engine::new(&model, None, opts(0)).unwrap();
    let (got, unshared) = run_tracking_kv(&mut control, &reqs, &arrive);
    assert_eq!(got, want);
    eprintln!("K/V peak unshared: {unshared} bytes");
    assert!(
        unshared >= rows * (prefix / block) * block_bytes && unshared > once,
        "control: rows without a shared prefix hold {unshared} bytes, not the prefix each ({} blocks)",
        rows * (prefix / block)
    );
}

/// Two 576-token prefixes (a whole attention segment of 512 keys and more), three requests
/// each, in the batch's row order A0 B0 A1 A2 B1 B2: A1 and A2 adopt A0's blocks, B1 and B2
/// B0's, so CUDA's attention reads each pair's shared segment once for both, beside rows that
/// hold other keys. Every output keeps the bits of the request alone. Negative control (CUDA,
/// whose attention groups rows by their block tables): rows grouped by committed length
/// alone read another prefix's keys and the bits break.
#[test]
fn rows_sharing_a_segment_beside_rows_of_another_prefix_keep_their_bits() {
    let model = Arc::new(common::load(&trained("target")));
    if !pages(&model) || !common::full_matrix() {
        eprintln!("skipped: the {:?} backend does not page, or runs the rotated matrix", model.backend());
        return;
    }
    let prefix = |p: u32| (0..576u32).map(|i| 40 + (i * 61 + p * 7) % 1850).collect::<Vec<u32>>();
    let (a, b) = (prefix(0), prefix(1));
    let reqs: Vec<Request> = [(&a, 0u32), (&b, 1), (&a, 2), (&a, 3), (&b, 4), (&b, 5)]
        .iter()
        .map(|&(p, i)| {
            let prompt = [p.clone(), (0..16).map(|t| 7 + (i * 113 + t * 19) % 1900).collect()].concat();
            Request { id: format!("s{i}"), prompt, max_tokens: 20, ignore_eos: true, ..Request::default() }
        })
        .collect();
    let want = alone(&model, &reqs);
    let arrive = [0, 0, 1, 1, 2, 2];
    let run = || {
        let opts = EngineOptions {
            max_batch: 8,
            prefill_chunk: 1024,
            prefix_cache_bytes: 64 << 20,
            ..EngineOptions::default()
        };
        let mut e = Engine::new(&model, None, opts).unwrap();
        let (got, _) = run_tracking_kv(&mut e, &reqs, &arrive);
        (got, e.stats().prompt_tokens_cached)
    };
    let (got, cached) = run();
    assert_eq!(got, want, "a row reading a shared segment differs from the request alone");
    assert_eq!(cached, 4 * 576, "the later rows adopt their prefix's blocks");
    if model.backend() != mtp::kernels::Backend::Cuda {
        eprintln!("control skipped: the {:?} backend reads each row's keys on its own", model.backend());
        return;
    }
    negative_control::set_share_by_length(true);
    let (by_length, _) = run();
    negative_control::set_share_by_length(false);
    assert_ne!(by_length, want, "control: rows grouped by length alone must break the bits");
}

/// The same prompt sent four times (sampled, four seeds), the last three after the first
/// has started: each adopts the first's blocks, the last partly filled one included, and
/// copies that one at its first write. Negative controls: a shared block written in place
/// (no copy-on-write), and a block table out of logical order, each break the bits.
#[test]
fn a_repeated_prompt_copies_its_shared_last_block_on_write() {
    use mtp::cache::negative_control as cache_faults;
    let model = Arc::new(common::load(&trained("target")));
    if !pages(&model) {
        // A copying store's partial blocks are covered by the suffixes of `requests()`.
        eprintln!("skipped: the {:?} backend copies cached prefixes into each row", model.backend());
        return;
    }
    let prompt = requests()[0].prompt.clone();
    let reqs: Vec<Request> = (0..4u64)
        .map(|i| Request {
            id: format!("same{i}"),
            prompt: prompt.clone(),
            max_tokens: 10,
            ignore_eos: true,
            sampling: SamplingParams { temperature: 1.0, seed: 40 + i, ..SamplingParams::default() },
            ..Request::default()
        })
        .collect();
    let want = alone(&model, &reqs);
    assert!(want.iter().any(|w| w.0 != want[0].0), "the seeds must give different continuations");
    let arrive = [0, 1, 1, 2];
    let run = || {
        let opts = EngineOptions { max_batch: 4, prefix_cache_bytes: 64 << 20, ..EngineOptions::default() };
        let mut e = Engine::new(&model, None, opts).unwrap();
        let (got, _) = run_tracking_kv(&mut e, &reqs, &arrive);
        (got, e.stats().prompt_tokens_cached)
    };
    let (got, cached) = run();
    assert_eq!(got, want, "a row sharing a partly filled block differs from the request alone");
    assert_eq!(cached, 3 * (prompt.len() as u64 - 1), "each repeat recomputes only the last token");
    cache_faults::set_write_shared_in_place(true);
    let (in_place, _) = run();
    cache_faults::set_write_shared_in_place(false);
    assert_ne!(in_place, want, "control: writing a shared block in place must break the bits");
    cache_faults::set_adopt_out_of_order(true);
    let (reordered, _) = run();
    cache_faults::set_adopt_out_of_order(false);
    assert_ne!(reordered, want, "control: a block table out of logical order must break the bits");
}

/// Eight requests arriving at once with a 256-token prefix no one has computed: the first
/// computes it and the other seven wait for its blocks and load them, so the prefix is
/// computed once (not eight times), with every output the request's alone.
#[test]
fn a_burst_sharing_an_uncached_prefix_computes_it_once() {
    let model = Arc::new(common::load(&trained("target")));
    let shared: Vec<u32> = (0..256u32).map(|i| 70 + (i * 29) % 1700).collect();
    let reqs = sharing(&shared, 8, 8, |i, t| 5 + (i * 97 + t * 11) % 1900, 8, "b");
    let want = alone(&model, &reqs);
    let opts = EngineOptions { max_batch: 8, prefix_cache_bytes: 64 << 20, ..EngineOptions::default() };
    let mut e = Engine::new(&model, None, opts).unwrap();
    let (got, _) = run_tracking_kv(&mut e, &reqs, &[0; 8]);
    assert_eq!(got, want, "a row that waited for a shared prefix differs from the request alone");
    let s = e.stats();
    assert_eq!(s.prompt_tokens_cached, 7 * 256, "each later request loads the whole shared prefix");
    assert_eq!(s.prompt_tokens - s.prompt_tokens_cached, 256 + 8 * 8, "the prefix is computed once");
}
