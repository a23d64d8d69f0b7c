//! The engine's request lifecycle: event stream, stop strings, cancellation, the KV
//! budget and preemption, and per-request errors that leave other rows running.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{bits, fixture, plain, request};
use mtp::base::Tokenizer;
use mtp::drafter::{Drafter, MtpDrafter, NgramDrafter, OracleDrafter};
use mtp::engine::{
    generate, Completion, DraftLen, Engine, EngineOptions, Event, FinishReason, Request, SamplingParams,
};
use mtp::model::{Model, MtpLayout};
use mtp::synth::SynthSpec;

/// The tokens streamed for `id`, in order.
fn tokens_of(events: &[Event], id: u64) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token { request, token, .. } if *request == id => Some(*token),
            _ => None,
        })
        .collect()
}

fn requests() -> Vec<Request> {
    (0..5)
        .map(|i| request(&format!("q{i}"), (0..3 + 4 * i as u32).map(|t| 30 + t * 11).collect(), 14))
        .collect()
}

#[test]
fn events_stream_every_token_then_the_finish() {
    let model = common::load(&fixture("qwen2-target"));
    let reqs = requests();
    let want = plain(&model, &reqs, 1);
    let mut engine =
        Engine::new(&model, Some(Box::new(NgramDrafter::default())), EngineOptions::default()).unwrap();
    let ids: Vec<u64> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    let mut streamed: Vec<Vec<(u32, f32)>> = vec![Vec::new(); reqs.len()];
    let mut finished = vec![None; reqs.len()];
    while !engine.is_idle() {
        for e in engine.step() {
            match e {
                Event::Token { request, token, logprob, .. } => {
                    let i = ids.iter().position(|&x| x == request).unwrap();
                    assert!(finished[i].is_none(), "token after finish");
                    streamed[i].push((token, logprob));
                }
                Event::Finished { request, reason } => {
                    finished[ids.iter().position(|&x| x == request).unwrap()] = Some(reason);
                }
                Event::Failed { error, .. } => panic!("{error}"),
                Event::Admitted { .. } | Event::PromptScored { .. } | Event::Verified { .. } => {}
            }
        }
    }
    for (i, w) in want.into_iter().enumerate() {
        let w = w.unwrap();
        let (t, l): (Vec<u32>, Vec<f32>) = streamed[i].iter().copied().unzip();
        assert_eq!((t, bits(&l), finished[i]), (w.tokens, bits(&w.logprobs), Some(w.finish)));
    }
}

#[test]
fn stop_strings_end_speculative_rows_where_plain_decoding_ends() {
    let dir = fixture("qwen3-target");
    let model = common::load(&dir);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let reqs = requests();
    let full = plain(&model, &reqs, 1);
    // A stop string taken from the middle of request 2's output.
    let out = &full[2].as_ref().unwrap().tokens;
    let stop = tok.decode(&out[6..8]).unwrap();
    assert!(!stop.is_empty());
    let reqs: Vec<Request> = reqs.into_iter().map(|r| Request { stop: vec![stop.clone()], ..r }).collect();
    let mut plain_engine = Engine::new(&model, None, EngineOptions::default()).unwrap().with_tokenizer(&tok);
    let want = generate(&mut plain_engine, &reqs, &[], |_, _| {});
    let w2 = want[2].as_ref().unwrap();
    assert_eq!(w2.finish, FinishReason::Stop);
    assert!(w2.tokens.len() <= 8 && tok.decode(&w2.tokens).unwrap().contains(&stop));
    assert!(!tok.decode(&w2.tokens[..w2.tokens.len() - 1]).unwrap().contains(&stop), "stopped late");
    // The oracle accepts whole blocks; the stop must still cut at the same token.
    let refs = reqs.iter().zip(&full).map(|(r, c)| (r.prompt.clone(), c.as_ref().unwrap().tokens.clone()));
    let oracle = OracleDrafter::new(refs, 1.0, 0, 512).unwrap();
    let mut spec = Engine::new(
        &model,
        Some(Box::new(oracle)),
        EngineOptions { k: DraftLen::Fixed(5), ..EngineOptions::default() },
    )
    .unwrap()
    .with_tokenizer(&tok);
    let got = generate(&mut spec, &reqs, &[], |_, _| {});
    assert!(spec.stats().acceptance_rate() > 0.9);
    for (g, w) in got.iter().zip(&want) {
        let (g, w) = (g.as_ref().unwrap(), w.as_ref().unwrap());
        assert_eq!((&g.tokens, bits(&g.logprobs), g.finish), (&w.tokens, bits(&w.logprobs), w.finish));
    }
    // Without a tokenizer a stop string cannot be honoured: refused, not ignored.
    let mut bare = Engine::new(&model, None, EngineOptions::default()).unwrap();
    assert!(bare.submit(reqs[0].clone()).unwrap_err().to_string().contains("tokenizer"));
}

#[test]
fn cancel_removes_waiting_and_running_requests_only() {
    let model = common::load(&fixture("llama-target"));
    let reqs = requests();
    let want = plain(&model, &reqs, 1);
    let opts = EngineOptions { max_batch: 2, ..EngineOptions::default() };
    let mut engine = Engine::new(&model, Some(Box::new(NgramDrafter::default())), opts).unwrap();
    let ids: Vec<u64> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    let mut events = engine.step();
    assert_eq!((engine.running(), engine.waiting()), (2, 3));
    assert!(engine.cancel(ids[0]) && engine.cancel(ids[4]));
    assert!(!engine.cancel(ids[4]) && !engine.cancel(999));
    while !engine.is_idle() {
        events.extend(engine.step());
    }
    for (i, id) in ids.iter().enumerate() {
        let tokens = tokens_of(&events, *id);
        let reason = events.iter().find_map(|e| match e {
            Event::Finished { request, reason } if request == id => Some(*reason),
            _ => None,
        });
        let w = want[i].as_ref().unwrap();
        match i {
            0 => assert_eq!(reason, Some(FinishReason::Cancelled)),
            4 => assert_eq!((reason, tokens.len()), (Some(FinishReason::Cancelled), 0)),
            _ => assert_eq!((tokens, reason), (w.tokens.clone(), Some(w.finish))),
        }
    }
}

#[test]
fn kv_budget_admits_by_blocks_held_and_refuses_what_never_fits() {
    let model = common::load(&fixture("qwen2-target"));
    let reqs = requests();
    let want = plain(&model, &reqs, 1);
    // Every request's prompt, tokens and verify window fit one block: room for three rows.
    let block = model.kv_bytes_per_token() * model.new_cache().block_positions();
    let opts = EngineOptions {
        max_batch: 8,
        k: DraftLen::Fixed(4),
        kv_budget_bytes: Some(3 * block),
        ..EngineOptions::default()
    };
    let mut engine = Engine::new(&model, Some(Box::new(NgramDrafter::default())), opts).unwrap();
    let huge = request("huge", vec![5; 400], 400);
    let e = engine.submit(huge).unwrap_err().to_string();
    assert!(e.contains("huge") && e.contains("budget"), "{e}");
    let ids: Vec<u64> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    let mut most_running = 0;
    let mut events = Vec::new();
    while !engine.is_idle() {
        events.extend(engine.step());
        most_running = most_running.max(engine.running());
        assert!(engine.kv_bytes() <= 3 * block, "{} bytes held", engine.kv_bytes());
    }
    assert_eq!(most_running, 3, "the budget holds three one-block rows");
    assert_eq!(engine.stats().preemptions, 0);
    for (id, w) in ids.iter().zip(want) {
        let tokens = tokens_of(&events, *id);
        assert_eq!(tokens, w.unwrap().tokens);
    }
}

/// `n` requests (some sharing a prefix longer than a block, greedy and sampled) under a
/// K/V budget of 6 blocks with max batch 16: rows are admitted as their prompts fit, then
/// outgrow the budget and are preempted, recomputed and resumed, over and over. With the
/// adversarial oracle rows accept different lengths each round; an MTP head reads the
/// hidden states a resumed row recomputes. Returns the requests whose tokens or logprob
/// bits differ from the same request alone, and the preemptions.
fn preemption_storm(model: &Arc<Model>, n: usize, mtp_head: Option<&Path>) -> (Vec<usize>, u64) {
    let shared: Vec<u32> = (0..70).map(|i| 1 + (i * 29) % 500).collect();
    let reqs: Vec<Request> = (0..n)
        .map(|i| {
            let own: Vec<u32> = (0..3 + i % 9).map(|j| 2 + ((i * 13 + j * 7) % 500) as u32).collect();
            let prompt = if i % 2 == 0 { [shared.clone(), own].concat() } else { own };
            let sampling = if i % 3 == 1 {
                SamplingParams { temperature: 0.9, seed: 7 + i as u64, ..Default::default() }
            } else {
                Default::default()
            };
            Request { sampling, ..request(&format!("s{i}"), prompt, 70 + i % 30) }
        })
        .collect();
    let reference: Vec<_> = plain(model, &reqs, 1).into_iter().map(|c| c.unwrap()).collect();
    let block = model.kv_bytes_per_token() * model.new_cache().block_positions();
    let opts = EngineOptions {
        max_batch: 16,
        k: DraftLen::Fixed(3),
        kv_budget_bytes: Some(6 * block),
        prefix_cache_bytes: 1 << 20,
        ..EngineOptions::default()
    };
    let drafter: Box<dyn Drafter> = match mtp_head {
        Some(dir) => Box::new(MtpDrafter::load(dir, model.clone()).unwrap()),
        None => Box::new(common::oracle(&reqs, &reference, model.config.vocab_size)),
    };
    let mut engine = Engine::new(model, Some(drafter), opts).unwrap();
    let ids: Vec<u64> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    let mut out = vec![Vec::new(); n];
    let mut finished = 0;
    while !engine.is_idle() {
        for e in engine.step() {
            match e {
                Event::Token { request, token, logprob, .. } => {
                    out[ids.iter().position(|&x| x == request).unwrap()].push((token, logprob.to_bits()))
                }
                Event::Finished { .. } => finished += 1,
                Event::Failed { error, .. } => panic!("{error}"),
                Event::Admitted { .. } | Event::PromptScored { .. } | Event::Verified { .. } => {}
            }
        }
        let held = engine.kv_bytes();
        assert!(held <= 6 * block, "{held} bytes held over a budget of 6 blocks of {block} bytes");
    }
    assert_eq!(finished, n, "every request finishes");
    let differ = (0..n)
        .filter(|&i| {
            let want: Vec<(u32, u32)> =
                reference[i].tokens.iter().copied().zip(bits(&reference[i].logprobs)).collect();
            out[i] != want
        })
        .collect();
    (differ, engine.stats().preemptions)
}

/// Admission leaves headroom (a block a row, 1-10% of the budget): the same storm preempts
/// less than admission filling the budget to its last block (the control), and every
/// request keeps its bits either way.
#[test]
fn admission_headroom_cuts_preemptions() {
    let model = Arc::new(common::load(&fixture("qwen2-target")));
    let n = if common::full_matrix() { 32 } else { 8 };
    let (differ, with) = preemption_storm(&model, n, None);
    assert!(differ.is_empty(), "with headroom: {differ:?} differ");
    mtp::engine::negative_control::set_no_watermark(true);
    let (differ, without) = preemption_storm(&model, n, None);
    mtp::engine::negative_control::set_no_watermark(false);
    assert!(differ.is_empty(), "without headroom: {differ:?} differ");
    eprintln!("preemptions: {with} with headroom, {without} without");
    assert!(with < without, "{with} preemptions with headroom, {without} without");
}

#[test]
fn a_preemption_storm_loses_nothing_and_resumed_rows_keep_their_bits() {
    let model = Arc::new(common::load(&fixture("qwen2-target")));
    let head = std::env::temp_dir().join(format!("mtp-storm-head-{}", std::process::id()));
    SynthSpec::write_mtp_head(&fixture("qwen2-target"), MtpLayout::MiMo, &head, 3).unwrap();
    // The emulator's rotated matrix: a smaller storm through the same kernels (the
    // scheduling is the host's, proven in full on the CPU).
    let (n, drafters) = if common::full_matrix() { (64, 2) } else { (12, 1) };
    // Admission without headroom fills the budget to its last block, so rows preempt each
    // other over and over (the headroom's own test is `admission_headroom_cuts_preemptions`).
    mtp::engine::negative_control::set_no_watermark(true);
    for (name, dir) in [("oracle", None), ("mtp", Some(head.as_path()))].into_iter().take(drafters) {
        let (differ, preemptions) = preemption_storm(&model, n, dir);
        assert!(
            preemptions >= n as u64 / 4,
            "{name}: only {preemptions} preemptions: the storm did not storm"
        );
        assert!(
            differ.is_empty(),
            "{name}: requests {differ:?} differ from alone after {preemptions} preemptions"
        );
    }
    // Negative control: resuming one position early must break the same check.
    mtp::engine::negative_control::set_resume_one_position_short(true);
    let (differ, _) = preemption_storm(&model, n.min(24), None);
    mtp::engine::negative_control::set_resume_one_position_short(false);
    mtp::engine::negative_control::set_no_watermark(false);
    assert!(!differ.is_empty(), "a row resumed at a wrong position went unnoticed");
}

#[test]
fn top_logprobs_list_the_most_likely_tokens_without_changing_the_output() {
    let model = common::load(&fixture("qwen3-target"));
    let reqs = requests();
    let want = plain(&model, &reqs, 1);
    let asked: Vec<Request> = reqs.iter().map(|r| Request { top_logprobs: 5, ..r.clone() }).collect();
    let got =
        common::run(&model, Some(Box::new(NgramDrafter::default())), EngineOptions::default(), &asked, &[]);
    for (w, g) in want.iter().zip(&got) {
        let (w, g) = (w.as_ref().unwrap(), g.as_ref().unwrap());
        assert_eq!((&g.tokens, bits(&g.logprobs)), (&w.tokens, bits(&w.logprobs)));
        assert!(w.top_logprobs.iter().all(|t| t.is_empty()), "nothing asked, nothing listed");
        assert_eq!(g.top_logprobs.len(), g.tokens.len());
        for ((top, &token), &lp) in g.top_logprobs.iter().zip(&g.tokens).zip(&g.logprobs) {
            assert_eq!(top.len(), 5);
            // Greedy: the emitted token is the most likely one, with its own logprob bits.
            assert_eq!((top[0].0, top[0].1.to_bits()), (token, lp.to_bits()));
            assert!(top.windows(2).all(|p| p[0].1 >= p[1].1), "most likely first");
        }
    }
}

/// Whether every scored prompt (a request's prompt and its plain continuation) carries, for
/// each continuation token, the token, logprob bits, rank 1 and alternatives that plain
/// decoding reported generating it, and nothing else came out of a request of 0 tokens.
fn scores_match(generated: &[Request], plain_out: &[Completion], scored: &[Completion]) -> bool {
    generated.iter().zip(plain_out).zip(scored).all(|((r, g), s)| {
        let start = r.prompt.len() - 1;
        let own = &s.prompt_logprobs[start.min(s.prompt_logprobs.len())..];
        s.prompt_logprobs.len() == r.prompt.len() + g.tokens.len() - 1
            && own.len() == g.tokens.len()
            && own.iter().zip(&g.tokens).zip(&g.logprobs).zip(&g.top_logprobs).all(|(((p, &t), &lp), top)| {
                p.token == t
                    && p.logprob.to_bits() == lp.to_bits()
                    && p.rank == 1
                    && p.top
                        .iter()
                        .map(|&(a, l)| (a, l.to_bits()))
                        .eq(top.iter().map(|&(a, l)| (a, l.to_bits())))
            })
    })
}

/// A scored prompt reads the logprob of each of its tokens after the ones before it: for a
/// prompt that is a request's prompt and its greedy continuation, bitwise what plain
/// decoding reported for each continuation token, whether the scored prompt runs alone or
/// among decoding rows, in pieces of any size, with the prefix cache holding its start (it
/// is computed whole) or under speculation. A scored request may ask for 0 tokens; one
/// asking for more generates what the unscored request does. Negative control: the scores
/// paired with the token each reading follows, not the next.
#[test]
fn scored_prompts_carry_the_logprobs_plain_decoding_gave_their_tokens() {
    let model = common::load(&fixture("qwen3-target"));
    let asked: Vec<Request> = requests().into_iter().map(|r| Request { top_logprobs: 3, ..r }).collect();
    let plain_out: Vec<Completion> = plain(&model, &asked, 1).into_iter().map(Result::unwrap).collect();
    let scored: Vec<Request> = asked
        .iter()
        .zip(&plain_out)
        .map(|(r, g)| Request {
            id: format!("scored-{}", r.id),
            prompt: [r.prompt.clone(), g.tokens.clone()].concat(),
            max_tokens: 0,
            top_logprobs: 0,
            prompt_logprobs: Some(3),
            ..r.clone()
        })
        .collect();
    let alone = plain(&model, &scored, 1);
    let alone: Vec<Completion> = alone.into_iter().map(Result::unwrap).collect();
    assert!(alone.iter().all(|c| c.tokens.is_empty() && c.finish == FinishReason::Length));
    assert!(scores_match(&asked, &plain_out, &alone));
    // Among decoding rows (the same prompts unscored, asking for tokens), pieces of 5
    // tokens, the prefix cache warm with the unscored prompts, an n-gram drafter.
    let mut mixed = asked.clone();
    mixed.extend(scored.iter().cloned());
    let continued = Request { id: "continued".into(), max_tokens: 4, ..scored[2].clone() };
    mixed.push(continued.clone());
    let opts = EngineOptions {
        max_batch: 4,
        prefill_chunk: 5,
        prefix_cache_bytes: 8 << 20,
        ..EngineOptions::default()
    };
    let run = |reqs: &[Request]| -> Vec<Completion> {
        let drafter: Box<dyn Drafter> = Box::new(NgramDrafter::default());
        common::run(&model, Some(drafter), opts.clone(), reqs, &[]).into_iter().map(Result::unwrap).collect()
    };
    let got = run(&mixed);
    let n = asked.len();
    assert!(scores_match(&asked, &plain_out, &got[n..2 * n]));
    for (a, g) in alone.iter().zip(&got[n..2 * n]) {
        assert_eq!(a.prompt_logprobs, g.prompt_logprobs, "{}: the same alone and among others", a.id);
    }
    let unscored = Request { prompt_logprobs: None, ..continued };
    let want = plain(&model, &[unscored], 1).pop().unwrap().unwrap();
    let last = &got[2 * n];
    assert_eq!((&last.tokens, bits(&last.logprobs)), (&want.tokens, bits(&want.logprobs)));
    assert_eq!(last.prompt_logprobs, alone[2].prompt_logprobs);
    mtp::engine::negative_control::set_score_unshifted(true);
    let broken = plain(&model, &scored, 1);
    mtp::engine::negative_control::set_score_unshifted(false);
    let broken: Vec<Completion> = broken.into_iter().map(Result::unwrap).collect();
    assert!(!scores_match(&asked, &plain_out, &broken), "the control must break the check");
}

/// A copy of `name` whose embedding row for `token` is NaN.
fn with_nan_embedding(name: &str, token: usize) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("mtp-nan-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(fixture(name)).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header["model.embed_tokens.weight"];
    assert_eq!(t["dtype"], "F32");
    let hidden = t["shape"][1].as_u64().unwrap() as usize;
    let start = 8 + n + t["data_offsets"][0].as_u64().unwrap() as usize + token * hidden * 4;
    for v in bytes[start..start + hidden * 4].chunks_mut(4) {
        v.copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(&path, bytes).unwrap();
    dir
}

/// NaN weights reached by one row end that row with an error naming the cause (not token
/// 0 with a NaN logprob and an EOS); the other rows of its batches run on, bitwise as on
/// the clean checkpoint. Negative control: on the clean checkpoint every row completes.
#[test]
fn a_row_whose_logits_are_not_finite_fails_alone() {
    // llama-draft: untied embeddings, so a NaN input row leaves every row's logits clean.
    let clean = common::load(&fixture("llama-draft"));
    let reqs = requests();
    let want: Vec<_> = plain(&clean, &reqs, 1).into_iter().map(|r| r.unwrap()).collect();
    let used_by = |i: usize| -> std::collections::BTreeSet<u32> {
        let rows = reqs.iter().zip(&want).enumerate().filter(|&(j, _)| j != i);
        rows.flat_map(|(_, (r, w))| r.prompt.iter().chain(&w.tokens).copied().collect::<Vec<_>>()).collect()
    };
    // A row that generates a token no other row meets: poisoned, that row fails mid-run
    // (in the verify path), the others never touch it.
    let (late, poison) = (0..reqs.len())
        .find_map(|i| {
            let others = used_by(i);
            let t =
                want[i].tokens[1..].iter().find(|t| !others.contains(t) && !reqs[i].prompt.contains(t))?;
            Some((i, *t))
        })
        .expect("some row generates a token of its own");
    // And a row with the token in its prompt fails at once (in the prefill path).
    let mut all = reqs.clone();
    all.push(request("sick-prompt", vec![40, poison, 52], 14));
    let sick_rows = [late, reqs.len()];
    let on_clean = plain(&clean, &all, 1);
    assert!(on_clean.iter().all(|r| r.is_ok()), "the clean checkpoint runs every row");

    let dir = with_nan_embedding("llama-draft", poison as usize);
    let sick = common::load(&dir);
    for drafter in [false, true] {
        let d: Option<Box<dyn mtp::drafter::Drafter>> =
            drafter.then(|| Box::new(NgramDrafter::default()) as Box<dyn mtp::drafter::Drafter>);
        let got = common::run(&sick, d, EngineOptions::default(), &all, &[]);
        for (i, g) in got.iter().enumerate() {
            if sick_rows.contains(&i) {
                let e = g.as_ref().expect_err(&all[i].id).to_string();
                assert!(e.contains(&all[i].id) && e.contains("not finite"), "{e}");
            } else {
                let (w, g) = (&want[i], g.as_ref().unwrap());
                assert_eq!((&g.tokens, bits(&g.logprobs)), (&w.tokens, bits(&w.logprobs)));
            }
        }
    }
    std::fs::remove_dir_all(dir).ok();
}

/// The tokens and logprob bits streamed for `id`, in order.
fn stream_of(events: &[Event], id: u64) -> Vec<(u32, u32)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token { request, token, logprob, .. } if *request == id => {
                Some((*token, logprob.to_bits()))
            }
            _ => None,
        })
        .collect()
}

/// A prompt admitted while another row decodes goes in one prefill chunk a round, in the
/// same forward as the round's verify (the chunk less the verify's tokens): the decoding
/// row streams a token in every round of it, each round runs one forward, and both rows
/// stream the tokens and logprobs of each request alone. Control: a chunk as long as the prompt takes it in the round it arrives
/// (no round waits on it).
#[test]
fn a_long_prompt_goes_in_a_chunk_a_round_while_others_decode() {
    let model = common::load(&fixture("qwen2-target"));
    let short = request("short", vec![30, 41, 52], 24);
    let long = request("long", (0..40).map(|t| 20 + t * 7).collect(), 6);
    let want: Vec<Vec<(u32, u32)>> = plain(&model, &[short.clone(), long.clone()], 1)
        .into_iter()
        .map(|c| {
            let c = c.unwrap();
            c.tokens.into_iter().zip(c.logprobs.iter().map(|l| l.to_bits())).collect()
        })
        .collect();
    // Rounds stepped before the long prompt's first token, the short row's tokens in them,
    // and both rows' whole streams.
    let run = |chunk: usize| {
        let opts = EngineOptions { max_batch: 2, prefill_chunk: chunk, ..EngineOptions::default() };
        let mut engine = Engine::new(&model, None, opts).unwrap();
        let a = engine.submit(short.clone()).unwrap();
        let mut events = engine.step();
        let b = engine.submit(long.clone()).unwrap();
        let (mut waited, mut meanwhile) = (0, 0);
        loop {
            let forwards = model.forwards();
            let step = engine.step();
            assert_eq!(
                model.forwards() - forwards,
                1,
                "the prompt's chunk should run in the round's forward"
            );
            let started = !stream_of(&step, b).is_empty();
            if !started {
                waited += 1;
                meanwhile += stream_of(&step, a).len();
            }
            events.extend(step);
            if started {
                break;
            }
        }
        while !engine.is_idle() {
            events.extend(engine.step());
        }
        (waited, meanwhile, stream_of(&events, a), stream_of(&events, b))
    };
    // 40 prompt tokens, 7 a round beside the short row's one (a chunk of 8): five rounds go
    // by, the sixth piece starts the row.
    let (waited, meanwhile, a, b) = run(8);
    assert_eq!((waited, meanwhile), (5, 5), "the short row should stream a token in each of 5 rounds");
    assert_eq!([a, b], [want[0].clone(), want[1].clone()]);
    let (waited, _, a, b) = run(64);
    assert_eq!(waited, 0, "a prompt within one chunk starts in the round it arrives");
    assert_eq!([a, b], [want[0].clone(), want[1].clone()]);
}

/// A draft length past `MAX_DRAFT_TOKENS`, fixed or adaptive, is refused naming `k` (an
/// adaptive bound of 2^32 aborted allocating the chooser's tables); the bound itself runs.
#[test]
fn draft_lengths_past_the_bound_are_refused() {
    let model = common::load(&fixture("qwen2-target"));
    let max = mtp::engine::MAX_DRAFT_TOKENS;
    for k in [DraftLen::Fixed(max + 1), DraftLen::Adaptive(max + 1), DraftLen::Adaptive(1 << 32)] {
        let opts = EngineOptions { k, ..EngineOptions::default() };
        let err = Engine::new(&model, Some(Box::new(NgramDrafter::default())), opts).err().unwrap();
        assert!(err.to_string().contains("`k`"), "{k:?}: {err}");
    }
    let opts = EngineOptions { k: DraftLen::Adaptive(max), ..EngineOptions::default() };
    let mut engine = Engine::new(&model, Some(Box::new(NgramDrafter::default())), opts).unwrap();
    let got = generate(&mut engine, &requests(), &[], |_, _| {});
    for (g, w) in got.iter().zip(plain(&model, &requests(), 1)) {
        assert_eq!(g.as_ref().unwrap().tokens, w.unwrap().tokens);
    }
}

/// A verify token cost that is no figure (negative, NaN, infinite) is refused naming the
/// option; a figure runs, and a row's tokens do not depend on it (greedy: exact either way).
#[test]
fn a_verify_token_cost_must_be_a_figure() {
    let model = common::load(&fixture("qwen2-target"));
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let opts = EngineOptions { verify_token_cost: Some(bad), ..EngineOptions::default() };
        let err = Engine::new(&model, Some(Box::new(NgramDrafter::default())), opts).err().unwrap();
        assert!(err.to_string().contains("`verify_token_cost`"), "{bad}: {err}");
    }
    for cost in [Some(0.0), Some(0.2), None] {
        let opts = EngineOptions { verify_token_cost: cost, ..EngineOptions::default() };
        let mut engine = Engine::new(&model, Some(Box::new(NgramDrafter::default())), opts).unwrap();
        let got = generate(&mut engine, &requests(), &[], |_, _| {});
        for (g, w) in got.iter().zip(plain(&model, &requests(), 1)) {
            assert_eq!(g.as_ref().unwrap().tokens, w.unwrap().tokens, "{cost:?}");
        }
    }
}

/// A token budget per forward: prompts that arrive while a row decodes go in together, as
/// many as the budget (`prefill_chunk`) holds beside the verify, not one prompt a round.
#[test]
fn prompts_arriving_together_share_a_rounds_token_budget() {
    let model = common::load(&common::trained("target"));
    let opts = EngineOptions { max_batch: 8, prefill_chunk: 64, ..EngineOptions::default() };
    let mut e = Engine::new(&model, None, opts).unwrap();
    let req = |i: u32, len: u32, max_tokens: usize| Request {
        id: format!("t{i}"),
        prompt: (0..len).map(|t| 10 + (i * 41 + t * 7) % 1500).collect(),
        max_tokens,
        ignore_eos: true,
        ..Request::default()
    };
    e.submit(req(0, 12, 40)).unwrap();
    e.step();
    // Four prompts of 12 tokens and one decoding row: 52 tokens, one forward's budget.
    let ids: Vec<_> = (1..5).map(|i| e.submit(req(i, 12, 4)).unwrap()).collect();
    let firsts = e
        .step()
        .into_iter()
        .filter(|ev| matches!(ev, Event::Token { request, .. } if ids.contains(request)))
        .count();
    assert_eq!(firsts, 4, "every prompt that fits the budget starts in the same round");
}
