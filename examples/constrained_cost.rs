//! What grammar masks cost on the trained family: ms per emitted token with and without a
//! constraint on the same prompts (plain decoding and the MTP head, batch 1 and 4), and
//! the mask alone (µs per token, replaying the constrained outputs through a fresh guide).
//!
//! `cargo run --release --example constrained_cost` (numbers in docs/benchmarks.md).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use mtp::base::Tokenizer;
use mtp::drafter::{Drafter, MtpDrafter};
use mtp::engine::{generate, Completion, Constraint, DraftLen, Engine, EngineOptions, Grammars, Request};
use mtp::model::Model;
use serde_json::json;

fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trained/target");
    let model = Arc::new(Model::load(&dir)?);
    let tok = Tokenizer::from_dir(&dir)?;
    // Constraints that do not complete within 128 tokens, so every row runs as long
    // constrained as free (the batch stays as full).
    let numbers = json!({
        "type": "object",
        "properties": {"values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 100}},
        "required": ["values"],
        "additionalProperties": false
    });
    let words = json!({"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 60});
    let constraints = [
        Constraint::JsonSchema(numbers),
        Constraint::Regex(r"[a-z][a-z ,.]{0,600}\.".into()),
        Constraint::JsonSchema(words),
        Constraint::Lark(
            r#"start: item+
item: /[a-z]{1,8}/ "(" /[0-9]{1,3}/ ");\n""#
                .into(),
        ),
    ];
    let prompts = ["The numbers as JSON:", "The story begins", "A list of words:", "calls:"];
    let requests = |constrained: bool| -> Vec<Request> {
        prompts
            .iter()
            .zip(&constraints)
            .enumerate()
            .map(|(i, (p, c))| Request {
                id: format!("r{i}"),
                prompt: tok.encode(p).unwrap(),
                max_tokens: 128,
                ignore_eos: true,
                constraint: constrained.then(|| c.clone()),
                ..Request::default()
            })
            .collect()
    };
    println!(
        "| drafter | batch | unconstrained ms/token | constrained ms/token | tokens (free, constrained) |"
    );
    println!("|---|---|---|---|---|");
    let mut outputs: Vec<Completion> = Vec::new();
    for drafter in ["none", "mtp"] {
        for batch in [1, 4] {
            let mut row = Vec::new();
            for constrained in [false, true] {
                // Best of 3 runs: the machine is shared.
                let mut best = f64::INFINITY;
                let mut tokens = 0;
                for _ in 0..3 {
                    let d: Option<Box<dyn Drafter>> = match drafter {
                        "mtp" => Some(Box::new(MtpDrafter::load(&dir, model.clone())?)),
                        _ => None,
                    };
                    let opts = EngineOptions {
                        max_batch: batch,
                        k: DraftLen::Adaptive(8),
                        ..EngineOptions::default()
                    };
                    let mut engine = Engine::new(&model, d, opts)?.with_tokenizer(&tok);
                    let t = Instant::now();
                    let got = generate(&mut engine, &requests(constrained), &[], |_, _| {});
                    let secs = t.elapsed().as_secs_f64();
                    let done: Vec<Completion> = got.into_iter().collect::<Result<_, _>>()?;
                    tokens = done.iter().map(|c| c.tokens.len()).sum::<usize>();
                    best = best.min(secs * 1e3 / tokens as f64);
                    if constrained {
                        outputs = done;
                    }
                }
                row.push((best, tokens));
            }
            println!(
                "| {drafter} | {batch} | {:.2} | {:.2} | {}, {} |",
                row[0].0, row[1].0, row[0].1, row[1].1
            );
        }
    }
    let grammars = Grammars::new(&tok, model.config.vocab_size, &model.config.eos_token_ids)?;
    for (c, out) in constraints.iter().zip(&outputs) {
        let mut guide = grammars.compile(c).map_err(anyhow::Error::msg)?;
        let t = Instant::now();
        for &token in &out.tokens {
            guide.walk(&[]).map_err(anyhow::Error::msg)?;
            if guide.settle(0, token).map_err(anyhow::Error::msg)?.is_some() {
                break;
            }
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / out.tokens.len() as f64;
        println!("{}: {us:.0} µs per token (mask + consume), {} tokens", c.kind(), out.tokens.len());
    }
    Ok(())
}
