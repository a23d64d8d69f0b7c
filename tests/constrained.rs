//! Grammar-constrained decoding on the trained family. Outputs under a JSON schema, a
//! regex and a Lark grammar match them; every constrained row, batched with other
//! constrained and unconstrained rows, staggered, with every drafter (n-gram, the MTP
//! head, the draft model, the adversarial oracle) at fixed and adaptive k, greedy and
//! seeded sampling, is bitwise the same request alone with plain decoding. Negative
//! controls: a mask taken from another row's state and a matcher not rolled back after a
//! rejected draft each break that comparison. A bad schema, regex or grammar is a request
//! error naming it, and the other rows run on unchanged.

mod common;

use std::sync::Arc;

use common::{first_difference, trained};
use mtp::base::{Error, Tokenizer};
use mtp::drafter::{DraftModelDrafter, Drafter, MtpDrafter, NgramDrafter};
use mtp::engine::{
    constraint_negative_control as faults, generate, Completion, Constraint, DraftLen, Engine, EngineOptions,
    FinishReason, Request, SamplingMode, SamplingParams, WindowLayout,
};
use mtp::model::Model;
use serde_json::{json, Value};

const REGEX: &str = r"(cat|dog)s? [0-9]{1,3}";
const LARK: &str = r#"start: "x=" NUM ("," NUM)? ("," NUM)? ";"
NUM: /[0-9]{1,2}/"#;

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    })
}

struct Family {
    model: Arc<Model>,
    draft: Arc<Model>,
    tok: Tokenizer,
}

fn family() -> Family {
    Family {
        model: Arc::new(common::load(&trained("target"))),
        draft: Arc::new(common::load(&trained("draft"))),
        tok: Tokenizer::from_dir(&trained("target")).unwrap(),
    }
}

impl Family {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.tok.encode(text).unwrap()
    }

    fn drafter(
        &self,
        kind: &str,
        requests: &[Request],
        reference: &[Completion],
    ) -> Box<dyn Drafter + 'static> {
        match kind {
            "ngram" => Box::new(NgramDrafter::new(1, 3).unwrap()),
            "mtp" => Box::new(MtpDrafter::load(&trained("target"), self.model.clone()).unwrap()),
            "draft-model" => Box::new(DraftModelDrafter::new(self.draft.clone(), &self.model).unwrap()),
            "oracle" => Box::new(common::oracle(requests, reference, self.model.config.vocab_size)),
            other => panic!("unknown drafter {other}"),
        }
    }

    /// Runs `requests` with the tokenizer set (grammars need it).
    fn run(
        &self,
        drafter: Option<Box<dyn Drafter + '_>>,
        opts: EngineOptions,
        requests: &[Request],
        arrive_at: &[u64],
    ) -> Vec<Result<Completion, Error>> {
        let mut engine = Engine::new(&self.model, drafter, opts).unwrap().with_tokenizer(&self.tok);
        generate(&mut engine, requests, arrive_at, |_, _| {})
    }

    /// Each request alone, plain decoding (no drafter, batch 1).
    fn alone(&self, requests: &[Request]) -> Vec<Completion> {
        let opts = EngineOptions { max_batch: 1, ..EngineOptions::default() };
        self.run(None, opts, requests, &[]).into_iter().map(|r| r.unwrap()).collect()
    }
}

/// Four constrained rows (schema, regex, Lark, any JSON object) and two free ones, with
/// staggered arrivals; `sampled` gives most rows a temperature and seed; `long` leaves
/// room for every constraint to complete (else some rows end at `max_tokens`).
fn workload(f: &Family, sampled: bool, long: bool) -> (Vec<Request>, Vec<u64>) {
    let rows: [(&str, Option<Constraint>); 6] = [
        ("Alice is 30 and likes tea. As JSON:", Some(Constraint::JsonSchema(schema()))),
        ("the cats", Some(Constraint::Regex(REGEX.into()))),
        ("Once upon a time", None),
        ("numbers:", Some(Constraint::Lark(LARK.into()))),
        ("The weather today", Some(Constraint::JsonObject)),
        ("She said that", None),
    ];
    let requests = rows
        .into_iter()
        .enumerate()
        .map(|(i, (prompt, constraint))| Request {
            id: format!("c{i}"),
            prompt: f.encode(prompt),
            max_tokens: if long { 80 } else { 16 + 2 * i },
            ignore_eos: i % 2 == 0,
            sampling: if sampled && i != 3 {
                SamplingParams {
                    temperature: [0.8, 1.0, 1.3][i % 3],
                    top_k: [0, 30, 0][i % 3],
                    top_p: [1.0, 1.0, 0.9][i % 3],
                    seed: 500 + i as u64,
                    ..SamplingParams::default()
                }
            } else {
                SamplingParams::default()
            },
            constraint,
            // Alternatives stay the target's unmasked ones; one row reports them.
            top_logprobs: if i == 3 { 3 } else { 0 },
            ..Request::default()
        })
        .collect();
    (requests, vec![0, 0, 1, 2, 4, 5])
}

fn opts(k: DraftLen, max_batch: usize) -> EngineOptions {
    let layout = if max_batch > 3 { WindowLayout::SharedSlots } else { WindowLayout::RowTail };
    EngineOptions { k, max_batch, prefill_chunk: 5, layout, ..EngineOptions::default() }
}

#[test]
fn outputs_match_their_constraints() {
    let f = family();
    let lark_re = regex::Regex::new(r"^x=[0-9]{1,2}(,[0-9]{1,2}){0,2};$").unwrap();
    for sampled in [false, true] {
        let (requests, _) = workload(&f, sampled, true);
        let got = f.alone(&requests);
        for (r, c) in requests.iter().zip(&got) {
            let text = f.tok.decode(&c.tokens).unwrap();
            eprintln!("{} {:?}: {text:?} ({:?})", r.id, r.constraint.as_ref().map(|c| c.kind()), c.finish);
            let Some(constraint) = &r.constraint else { continue };
            assert!(
                matches!(c.finish, FinishReason::Grammar | FinishReason::Eos),
                "{}: the constraint must complete within max_tokens, got {:?} after {text:?}",
                r.id,
                c.finish
            );
            match constraint {
                Constraint::JsonSchema(_) => {
                    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                    let name = v["name"].as_str().expect("name is a string");
                    assert!(name.chars().count() <= 6, "{text}");
                    assert!((0..=120).contains(&v["age"].as_i64().expect("age is an integer")), "{text}");
                    let tags = v["tags"].as_array().expect("tags is an array");
                    assert!(tags.len() <= 2 && tags.iter().all(|t| t.as_str().is_some_and(|t| t.len() <= 4)));
                    assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
                    assert!(!text.contains(' ') || name.contains(' '), "compact JSON: {text:?}");
                }
                Constraint::JsonObject => {
                    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                    assert!(v.is_object(), "{text}");
                }
                Constraint::Regex(rx) => {
                    let re = regex::Regex::new(&format!("^(?:{rx})$")).unwrap();
                    assert!(re.is_match(&text), "{text:?} does not match {rx}");
                }
                Constraint::Lark(_) => {
                    assert!(lark_re.is_match(&text), "{text:?} does not match the grammar");
                }
            }
        }
    }
}

/// Every constrained and free row, batched, staggered, with every drafter at fixed and
/// adaptive k, equals the request alone with plain decoding.
fn parity(sampled: bool) {
    let f = family();
    let (requests, arrive_at) = workload(&f, sampled, false);
    let reference = f.alone(&requests);
    let mut drafted = 0;
    for kind in ["ngram", "mtp", "draft-model", "oracle"] {
        for k in [DraftLen::Fixed(3), DraftLen::Adaptive(4)] {
            for max_batch in [3, 8] {
                let mut engine =
                    Engine::new(&f.model, Some(f.drafter(kind, &requests, &reference)), opts(k, max_batch))
                        .unwrap()
                        .with_tokenizer(&f.tok);
                let got = generate(&mut engine, &requests, &arrive_at, |_, _| {});
                drafted += engine.stats().drafted;
                assert_eq!(
                    first_difference(&got, &reference),
                    None,
                    "drafter {kind}, k {k:?}, max batch {max_batch}, sampled {sampled}"
                );
            }
        }
    }
    assert!(drafted > 0, "nothing was drafted");
}

#[test]
fn constrained_rows_equal_plain_decoding_alone_greedy() {
    parity(false);
}

#[test]
fn constrained_rows_equal_plain_decoding_alone_sampled() {
    parity(true);
}

/// Rejection mode masks the target's distribution (drafts stay the drafter's own): each
/// row equals itself alone, and its output still matches the grammar.
#[test]
fn rejection_mode_keeps_rows_batch_invariant() {
    let f = family();
    let (requests, arrive_at) = workload(&f, true, false);
    let rejection = |max_batch| EngineOptions {
        sampling_mode: SamplingMode::Rejection,
        ..opts(DraftLen::Fixed(3), max_batch)
    };
    let alone: Vec<Completion> = f
        .run(Some(f.drafter("mtp", &[], &[])), rejection(1), &requests, &[])
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let batched = f.run(Some(f.drafter("mtp", &[], &[])), rejection(8), &requests, &arrive_at);
    assert_eq!(first_difference(&batched, &alone), None);
    let re = regex::Regex::new(&format!("^(?:{REGEX})$")).unwrap();
    let text = f.tok.decode(&alone[1].tokens).unwrap();
    assert!(re.is_match(&text) || alone[1].finish == FinishReason::Length, "{text:?}");
}

/// The controls: masks from another row's state, and a matcher left with rejected drafts
/// consumed, each make the parity comparison fail; without them it passes.
#[test]
fn negative_controls_break_constrained_parity() {
    let f = family();
    let (requests, arrive_at) = workload(&f, false, false);
    let reference = f.alone(&requests);
    let oracle = || Some(f.drafter("oracle", &requests, &reference));
    let batched = opts(DraftLen::Fixed(3), 3);
    assert_eq!(first_difference(&f.run(oracle(), batched.clone(), &requests, &arrive_at), &reference), None);

    faults::set_foreign_masks(true);
    let foreign = first_difference(&f.run(None, batched.clone(), &requests, &arrive_at), &reference);
    faults::set_foreign_masks(false);
    assert!(foreign.is_some(), "the parity check missed masks computed from another row's state");

    faults::set_skip_rollback(true);
    let stale = first_difference(&f.run(oracle(), batched, &requests, &arrive_at), &reference);
    faults::set_skip_rollback(false);
    assert!(stale.is_some(), "the parity check missed a matcher not rolled back after a rejected draft");
    eprintln!("foreign masks: {}\nno rollback: {}", foreign.unwrap(), stale.unwrap());
}

/// A bad schema, regex or grammar is refused at submit naming what is wrong; the other
/// rows are unaffected.
#[test]
fn bad_constraints_are_request_errors() {
    let f = family();
    let (mut requests, _) = workload(&f, false, false);
    let good = f.alone(&requests);
    let bad = [
        (Constraint::Regex("(unclosed".into()), "invalid regex"),
        (Constraint::JsonSchema(json!({"type": "no-such-type"})), "invalid JSON schema"),
        (Constraint::JsonSchema(json!(17)), "invalid JSON schema"),
        (Constraint::Lark("start: missing_rule".into()), "invalid Lark grammar"),
    ];
    for (i, (c, _)) in bad.iter().enumerate() {
        requests.push(Request { id: format!("bad{i}"), constraint: Some(c.clone()), ..requests[0].clone() });
    }
    let got = f.run(Some(f.drafter("ngram", &[], &[])), opts(DraftLen::Fixed(3), 8), &requests, &[]);
    assert_eq!(first_difference(&got[..good.len()], &good), None);
    for (g, (_, want)) in got[good.len()..].iter().zip(&bad) {
        let e = g.as_ref().expect_err("a bad constraint must fail").to_string();
        assert!(e.contains(want) && e.contains("bad"), "{e}");
        eprintln!("{e}");
    }
    // Without a tokenizer there is nothing to compile against.
    let mut engine = Engine::new(&f.model, None, EngineOptions::default()).unwrap();
    let e = engine.submit(requests[0].clone()).expect_err("no tokenizer").to_string();
    assert!(e.contains("tokenizer"), "{e}");
}

/// The hf-tiny targets' tokenizers build a mask vocabulary too: a regex-constrained row
/// matches, and equals itself alone when batched with the n-gram drafter.
#[test]
fn hf_tiny_targets_decode_under_a_regex() {
    for name in ["llama-target", "qwen2-target", "qwen3-target"] {
        let dir = common::fixture(name);
        let (model, tok) = (common::load(&dir), Tokenizer::from_dir(&dir).unwrap());
        let rx = "[a-z]{2,6}( [a-z]{2,6}){1,3}";
        let requests: Vec<Request> = (0..3)
            .map(|i| Request {
                id: format!("{name}-{i}"),
                prompt: vec![5 + i, 40, 77],
                max_tokens: 40,
                constraint: (i != 1).then(|| Constraint::Regex(rx.into())),
                sampling: SamplingParams {
                    temperature: 0.9 * i as f32,
                    seed: 3,
                    ..SamplingParams::default()
                },
                ..Request::default()
            })
            .collect();
        let run = |drafter: Option<Box<dyn Drafter>>, max_batch| {
            let opts = EngineOptions { max_batch, k: DraftLen::Fixed(2), ..EngineOptions::default() };
            let mut engine = Engine::new(&model, drafter, opts).unwrap().with_tokenizer(&tok);
            generate(&mut engine, &requests, &[0, 1, 1], |_, _| {})
        };
        let alone: Vec<Completion> = run(None, 1).into_iter().map(|r| r.unwrap()).collect();
        let batched = run(Some(Box::new(NgramDrafter::new(1, 3).unwrap())), 3);
        assert_eq!(first_difference(&batched, &alone), None, "{name}");
        let re = regex::Regex::new(&format!("^(?:{rx})$")).unwrap();
        for c in [&alone[0], &alone[2]] {
            let text = tok.decode(&c.tokens).unwrap();
            assert!(
                re.is_match(&text) || c.finish == FinishReason::Length,
                "{name}: {text:?} {:?}",
                c.finish
            );
        }
    }
}
