//! One row's grammar state: the constraint kinds, the compiled matcher, the masks along a
//! draft and the rollback after verification.
//!
//! Contract: a [`Guide`] has consumed exactly the row's emitted tokens (between rounds), so
//! every mask is a function of that row's own tokens. In a round, [`Guide::walk`] consumes
//! the drafts the grammar allows and returns one mask per window position; after
//! verification [`Guide::settle`] rolls back to the accepted drafts and consumes the bonus
//! token. Plain decoding is the same with empty drafts.

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use llguidance::{JsonCompileOptions, Matcher};
use serde_json::{json, Value};

use crate::negative_control::skip_rollback;
use crate::panics::guarded;
use crate::Grammars;

/// What a row's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// A JSON document valid under this JSON Schema.
    JsonSchema(Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// The whole output matches this regular expression (Rust `regex` syntax).
    Regex(String),
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
}

impl Constraint {
    /// The kind's name, as errors report it.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "JSON schema",
            Constraint::JsonObject => "json_object",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "Lark grammar",
        }
    }

    fn grammar(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)?),
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(compact(&json!({"type": "object"}))?),
            Constraint::Regex(rx) => guarded(|| Ok::<_, String>(TopLevelGrammar::from_regex(rx)))?,
            Constraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        })
    }
}

/// The schema with llguidance's compact JSON (no whitespace between tokens) unless it
/// chose its own options: flexible whitespace lets a model pad forever, so an output whose
/// strings are bounded could still miss `max_tokens`.
fn compact(schema: &Value) -> Result<Value, String> {
    let mut schema = match schema {
        Value::Object(_) => schema.clone(),
        Value::Bool(true) => json!({}),
        Value::Bool(false) => return Err("the schema `false` matches nothing".into()),
        other => return Err(format!("a schema must be a JSON object or boolean, got `{other}`")),
    };
    crate::check_finite(&schema)?;
    if schema.get("x-guidance").is_none() {
        let opts = JsonCompileOptions { whitespace_flexible: false, ..JsonCompileOptions::default() };
        opts.apply_to(&mut schema);
    }
    Ok(schema)
}

/// `schema` as a Lark rule body (`%json {...}`) with the same compact JSON as
/// [`Constraint::JsonSchema`], for grammars that embed JSON documents (tool calls).
pub fn lark_json(schema: &Value) -> Result<String, String> {
    Ok(format!("%json {}", compact(schema)?))
}

/// Which tokens may come next: bit `t` (word `t / 32`, bit `t % 32`) allows model token `t`.
#[derive(Clone, Debug)]
pub struct TokenMask(SimpleVob);

impl TokenMask {
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// Sets every forbidden logit to -inf (ids past the mask are forbidden), so argmax and
    /// the keyed pick see the masked distribution.
    pub fn apply(&self, logits: &mut [f32]) {
        for (t, l) in logits.iter_mut().enumerate() {
            if !self.allows(t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Allowed tokens.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }
}

/// A row's compiled constraint and its matcher state.
#[derive(Clone)]
pub struct Guide {
    matcher: Matcher,
    /// Drafts the last [`Guide::walk`] consumed (rolled back by [`Guide::settle`]).
    walked: usize,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Guide {{ walked: {}, stopped: {} }}", self.walked, self.matcher.is_stopped())
    }
}

impl Grammars {
    /// Compiles `c` for one row. The error names the constraint's kind and what is wrong;
    /// a grammar that allows no first token is refused here too.
    pub fn compile(&self, c: &Constraint) -> Result<Guide, String> {
        let named = |e: String| format!("invalid {}: {e}", c.kind());
        let grammar = c.grammar().map_err(named)?;
        let parser = guarded(|| self.factory().create_parser(grammar)).map_err(named)?;
        let mut guide = Guide { matcher: Matcher::new(Ok(parser)), walked: 0 };
        if let Some(e) = guide.matcher.get_error() {
            return Err(named(e));
        }
        guide.mask().map_err(named)?;
        Ok(guide)
    }
}

impl Guide {
    /// The tokens allowed after the consumed ones (only EOS once the grammar is complete).
    pub fn mask(&mut self) -> Result<TokenMask, String> {
        let m = self.matcher.compute_mask_or_eos().map_err(|e| match e.to_string() {
            // llguidance's name for a parse that cannot go on.
            s if s.contains("NoExtensionBias") => {
                "the grammar allows no token here: no complete value can follow".into()
            }
            s => s,
        })?;
        if m.is_zero() {
            return Err("the grammar allows no token here".into());
        }
        Ok(TokenMask(m))
    }

    /// Masks along `draft`: entry `j` is the mask of window position `j` (after drafts
    /// `0..j`). Consumes drafts while the grammar allows them and is not complete, so the
    /// result has `walked + 1` entries; drafts past `walked` are forbidden (or follow a
    /// complete grammar) and are rejected without being verified.
    pub fn walk(&mut self, draft: &[u32]) -> Result<Vec<TokenMask>, String> {
        debug_assert_eq!(self.walked, 0, "walk before settling the last one");
        let mut masks = vec![self.mask()?];
        for &d in draft {
            if self.matcher.is_stopped() || !masks.last().expect("one mask at least").allows(d) {
                break;
            }
            self.matcher.consume_token(d).map_err(|e| e.to_string())?;
            self.walked += 1;
            masks.push(self.mask()?);
        }
        Ok(masks)
    }

    /// Drafts consumed by the last walk.
    pub fn walked(&self) -> usize {
        self.walked
    }

    /// After verification: keeps the first `accepted` walked drafts, then consumes `bonus`
    /// (the target's token after them). Returns how many of the round's emitted tokens
    /// (`accepted + 1`) the output keeps when the grammar completed within them, else None.
    pub fn settle(&mut self, accepted: usize, bonus: u32) -> Result<Option<usize>, String> {
        if accepted > self.walked {
            return Err(format!("{accepted} drafts accepted, only {} walked", self.walked));
        }
        let extra = std::mem::take(&mut self.walked) - accepted;
        if extra > 0 && !skip_rollback() {
            self.matcher.rollback(extra).map_err(|e| e.to_string())?;
        }
        if self.matcher.is_stopped() {
            // Complete after the accepted drafts: the bonus (EOS, forced) is not emitted,
            // as plain decoding would have stopped there; at the row's start it is.
            return Ok(Some(accepted.max(1)));
        }
        self.matcher.consume_token(bonus).map_err(|e| e.to_string())?;
        Ok(self.matcher.is_stopped().then_some(accepted + 1))
    }

    /// Whether the grammar is complete (nothing but EOS may follow).
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use mtp_base::Tokenizer;

    use super::*;

    fn grammars() -> (Grammars, Tokenizer) {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/trained/target");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        (Grammars::new(&tok, 8192, &[0]).unwrap(), tok)
    }

    fn bits(m: &TokenMask) -> Vec<u32> {
        m.0.as_slice().to_vec()
    }

    /// A walk stops at the first forbidden draft; settling keeps the accepted drafts and
    /// the bonus, and leaves the same state (same next mask) as consuming those tokens
    /// one by one. Without the rollback the state differs (the negative control's fault).
    #[test]
    fn walk_then_settle_equals_plain_consumption() {
        let (g, tok) = grammars();
        let c = Constraint::Regex("(cat|dog)s [0-9]{2}".into());
        let ids = tok.encode_plain("dogs 42").unwrap();
        assert!(ids.len() >= 3, "{ids:?}");
        let forbidden = tok.encode_plain("x").unwrap()[0];
        for accepted in 0..ids.len() - 1 {
            let mut plain = g.compile(&c).unwrap();
            for &t in &ids[..=accepted] {
                plain.settle(0, t).unwrap();
            }
            for skip in [false, true] {
                let mut spec = g.compile(&c).unwrap();
                // Draft: the real continuation, then a forbidden token, then more.
                let draft: Vec<u32> = ids.iter().copied().chain([forbidden, ids[0]]).collect();
                let masks = spec.walk(&draft).unwrap();
                assert_eq!(masks.len(), ids.len() + 1, "the walk stops at the forbidden draft");
                assert!(!masks[ids.len()].allows(forbidden) || spec.is_complete());
                crate::negative_control::set_skip_rollback(skip);
                let end = spec.settle(accepted, ids[accepted]);
                crate::negative_control::set_skip_rollback(false);
                let same =
                    end.is_ok() && spec.mask().map(|m| bits(&m)).ok() == plain.mask().map(|m| bits(&m)).ok();
                assert_eq!(same, !skip, "accepted {accepted}, skip rollback {skip}");
            }
        }
    }

    #[test]
    fn compact_json_and_named_errors() {
        let (g, tok) = grammars();
        let mut guide = g.compile(&Constraint::JsonObject).unwrap();
        let brace = tok.encode_plain("{").unwrap()[0];
        guide.settle(0, brace).unwrap();
        let space = tok.encode_plain(" ").unwrap()[0];
        assert!(!guide.mask().unwrap().allows(space), "no whitespace between JSON tokens");
        for (c, want) in [
            (Constraint::Regex("[".into()), "invalid regex"),
            (Constraint::JsonSchema(serde_json::json!(false)), "invalid JSON schema"),
            (Constraint::Lark("start: \"a\" (".into()), "invalid Lark grammar"),
        ] {
            let e = g.compile(&c).unwrap_err();
            assert!(e.starts_with(want), "{e}");
        }
    }
}
