//! Rejection mode is distribution-lossless, end to end: over thousands of seeds, the
//! token the engine emits at a draft-judged position follows the target's sampling
//! distribution there, within a Hoeffding bound for the sample count; a biased acceptor
//! (resampling rejected drafts from p instead of max(0, p - q)) fails the same bound.

mod common;

use common::{fixture, plain, request};
use mtp::drafter::OracleDrafter;
use mtp::engine::{
    generate, prefill, DraftLen, Engine, EngineOptions, Request, SamplingMode, SamplingParams,
};
use mtp::model::Model;
use mtp::sampling::{Dist, Filtered};

const SEEDS: u64 = 6000;

/// Largest |empirical - p| over p's support and the bound it must stay under
/// (Hoeffding, union over the support, failure probability 1e-9).
fn deviation(counts: &[u64], p: &Dist) -> (f64, f64) {
    let n: u64 = counts.iter().sum();
    let worst = p
        .ids
        .iter()
        .zip(&p.probs)
        .map(|(&t, &pt)| (counts[t as usize] as f64 / n as f64 - pt as f64).abs())
        .fold(0.0, f64::max);
    let outside: u64 =
        (0..counts.len() as u32).filter(|t| p.prob(*t) == 0.0).map(|t| counts[t as usize]).sum();
    assert_eq!(outside, 0, "tokens outside the filtered support were emitted");
    (worst, ((2.0 * p.ids.len() as f64 / 1e-9).ln() / (2.0 * n as f64)).sqrt())
}

struct Setup {
    model: Model,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    /// The greedy continuation the oracle proposes.
    greedy: Vec<u32>,
    /// The sampling distribution at output index 1 after greedy[0].
    p1: Dist,
}

fn setup() -> Setup {
    let model = common::load(&fixture("qwen3-target"));
    let prompt = vec![17, 230, 45, 301, 88];
    let greedy = plain(&model, &[request("g", prompt.clone(), 3)], 1).remove(0).unwrap().tokens;
    let sampling = SamplingParams { temperature: 0.6, top_k: 4, ..SamplingParams::default() };
    let mut cache = model.new_cache();
    let seq: Vec<u32> = prompt.iter().chain(&greedy[..1]).copied().collect();
    let mtp::engine::Prefilled { logits, .. } = prefill(&model, &mut cache, &seq, 64, false, true).unwrap();
    let p1 = Filtered::new(&logits, &sampling).dist();
    Setup { model, prompt, sampling, greedy, p1 }
}

/// Token counts at output index 1 (of 3, so one draft fits) over the seeds whose first token was greedy[0] (the
/// rows where the oracle's one-hot draft of greedy[1] was judged), and (drafted, accepted).
fn second_tokens(s: &Setup, seeds: std::ops::Range<u64>, speculative: bool) -> (Vec<u64>, (u64, u64)) {
    let requests: Vec<Request> = seeds
        .map(|seed| Request {
            sampling: SamplingParams { seed, ..s.sampling },
            ..request(&format!("s{seed}"), s.prompt.clone(), 3)
        })
        .collect();
    let drafter = speculative.then(|| {
        let refs = [(s.prompt.clone(), s.greedy.clone())];
        Box::new(OracleDrafter::new(refs, 1.0, 0, s.model.config.vocab_size).unwrap()) as _
    });
    let opts = EngineOptions {
        k: DraftLen::Fixed(1),
        max_batch: 64,
        sampling_mode: SamplingMode::Rejection,
        ..Default::default()
    };
    let mut engine = Engine::new(&s.model, drafter, opts).unwrap();
    let out = generate(&mut engine, &requests, &[], |_, _| {});
    let mut counts = vec![0u64; s.model.config.vocab_size];
    for c in out {
        let c = c.unwrap();
        if c.tokens[0] == s.greedy[0] {
            counts[c.tokens[1] as usize] += 1;
        }
    }
    (counts, (engine.stats().drafted, engine.stats().accepted))
}

#[test]
fn rejection_sampling_matches_the_target_distribution() {
    let s = setup();
    let p_draft = s.p1.prob(s.greedy[1]);
    assert!(p_draft > 0.2 && p_draft < 0.8, "the draft must be neither sure nor hopeless: p = {p_draft}");

    let (plain_counts, _) = second_tokens(&s, 0..SEEDS, false);
    let (dev, bound) = deviation(&plain_counts, &s.p1);
    assert!(dev < bound, "plain sampling itself: {dev:.4} >= {bound:.4}");

    let (spec_counts, (drafted, accepted)) = second_tokens(&s, SEEDS..2 * SEEDS, true);
    assert!(drafted > 1000 && accepted > 0 && accepted < drafted, "drafted {drafted}, accepted {accepted}");
    let (dev, bound) = deviation(&spec_counts, &s.p1);
    eprintln!("p = {:?} over {:?}; speculative deviation {dev:.4}, bound {bound:.4}", s.p1.probs, s.p1.ids);
    assert!(dev < bound, "speculative sampling: {dev:.4} >= {bound:.4}");

    // The same test with a biased acceptor must fail.
    mtp::sampling::negative_control::set_biased_rejection(true);
    let (biased_counts, _) = second_tokens(&s, SEEDS..2 * SEEDS, true);
    mtp::sampling::negative_control::set_biased_rejection(false);
    let (dev, bound) = deviation(&biased_counts, &s.p1);
    eprintln!("biased acceptor deviation {dev:.4}, bound {bound:.4}");
    assert!(dev > bound, "the biased acceptor passed: {dev:.4} <= {bound:.4}");
}
