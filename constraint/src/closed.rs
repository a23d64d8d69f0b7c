//! Closed objects: a JSON Schema rewritten so that an object admits only the properties
//! it declares unless it opens itself, as vLLM and SGLang compile tool and response
//! schemas (xgrammar's strict mode). JSON Schema's default admits any undeclared key, and
//! a small model given that freedom may add keys until `max_tokens`.
//!
//! Contract: [`closed`] adds `"additionalProperties": false` to every object schema that
//! says nothing of its other keys (neither `additionalProperties` nor
//! `unevaluatedProperties`), at every depth where a document's value is described:
//! `properties`, `patternProperties`, `items`, `prefixItems`, `additionalProperties`,
//! `$defs` and `definitions`, `anyOf` and `oneOf` branches. A schema is left as written
//! where closing it would refuse what JSON Schema admits: one that is merged with others
//! (an `allOf` member, a schema with `allOf` or `$ref`, an `anyOf`/`oneOf` branch or
//! `then`/`else` beside its parent's own properties, a definition such a merge refers
//! to), one that requires a key it does not declare, and anything under `not` or `if`.
//! Declared keys are never repeated (llguidance writes each once, in order), so a closed
//! object admits no duplicate key; an object opened explicitly admits its undeclared keys
//! as the schema says, repeats among them included.

use std::collections::HashSet;

use serde_json::{Map, Value};

/// `schema` with its objects closed (see the module's contract).
pub fn closed(schema: &Value) -> Value {
    let mut out = schema.clone();
    let mut merged = HashSet::new();
    collect_merged(&mut out, &mut merged, false);
    close(&mut out, "#", true, &merged);
    out
}

/// Keywords whose value is a map of name to schema, each describing a value of its own.
const SCHEMA_MAPS: [&str; 4] = ["properties", "patternProperties", "$defs", "definitions"];
/// Keywords whose value is one schema describing a value of its own.
const SCHEMA_ONE: [&str; 4] = ["items", "additionalProperties", "additionalItems", "unevaluatedItems"];
/// Keywords whose value is a list of schemas each describing a value of its own.
const SCHEMA_LISTS: [&str; 2] = ["prefixItems", "items"];

/// Whether `m` describes an object with properties of its own.
fn object_like(m: &Map<String, Value>) -> bool {
    let typed = match m.get("type") {
        Some(Value::String(t)) => t == "object",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
        _ => false,
    };
    typed || ["properties", "patternProperties", "required"].iter().any(|k| m.contains_key(*k))
}

/// Whether `m`'s rule is merged with other schemas' (so its own keys are not all there is).
fn merges(m: &Map<String, Value>) -> bool {
    m.contains_key("allOf") || m.contains_key("$ref")
}

/// The schemas under `m` with whether each stands alone (may be closed) given that `m`
/// describes an object of its own (`object`); pointer segments name where each lies.
fn children(m: &mut Map<String, Value>, object: bool) -> Vec<(String, &mut Value, bool)> {
    let mut out = Vec::new();
    for (key, v) in m.iter_mut() {
        let key_ptr = escape(key);
        let alone = match key.as_str() {
            "allOf" => Some(false),
            "anyOf" | "oneOf" | "then" | "else" => Some(!object),
            k if SCHEMA_ONE.contains(&k) || SCHEMA_MAPS.contains(&k) || SCHEMA_LISTS.contains(&k) => {
                Some(true)
            }
            _ => None,
        };
        let Some(alone) = alone else { continue };
        if SCHEMA_MAPS.contains(&key.as_str()) {
            for (name, s) in v.as_object_mut().into_iter().flatten() {
                out.push((format!("{key_ptr}/{}", escape(name)), s, alone));
            }
        } else if let Value::Array(list) = v {
            for (i, s) in list.iter_mut().enumerate() {
                out.push((format!("{key_ptr}/{i}"), s, alone));
            }
        } else if v.is_object() && !key.ends_with("Of") {
            out.push((key_ptr, v, alone));
        }
    }
    out
}

/// A JSON Pointer segment for `key`.
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// Closes `schema` (at pointer `at`) when it stands `alone`, and its children.
fn close(schema: &mut Value, at: &str, alone: bool, merged: &HashSet<String>) {
    let Value::Object(m) = schema else { return };
    let object = object_like(m);
    let declared = |m: &Map<String, Value>| {
        let props = m.get("properties").and_then(Value::as_object);
        let required = m.get("required").and_then(Value::as_array).into_iter().flatten();
        required.into_iter().all(|r| r.as_str().is_some_and(|r| props.is_some_and(|p| p.contains_key(r))))
    };
    let silent = !m.contains_key("additionalProperties") && !m.contains_key("unevaluatedProperties");
    if alone && object && silent && !merges(m) && !merged.contains(at) && declared(m) {
        m.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (ptr, child, alone) in children(m, object) {
        close(child, &format!("{at}/{ptr}"), alone, merged);
    }
}

/// The `$ref`s that a merge points at: those of schemas that do not stand alone, or that
/// sit beside object keywords of their own.
fn collect_merged(schema: &mut Value, merged: &mut HashSet<String>, in_merge: bool) {
    let Value::Object(m) = schema else { return };
    let object = object_like(m);
    if let Some(Value::String(r)) = m.get("$ref") {
        if in_merge || object || m.contains_key("allOf") {
            merged.insert(r.clone());
        }
    }
    for (_, child, alone) in children(m, object) {
        collect_merged(child, merged, !alone);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn silent_objects_close_and_open_or_merged_ones_stay() {
        let schema = json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                "b": {"type": "object", "additionalProperties": true},
                "c": {"type": "array", "items": {"properties": {"y": {}}}},
                "d": {"anyOf": [{"type": "object"}, {"type": "string"}]},
                "e": {"allOf": [{"properties": {"p": {}}}, {"$ref": "#/$defs/base"}]},
                "f": {"$ref": "#/$defs/leaf"},
                "g": {"type": "object", "required": ["z"]}
            },
            "$defs": {"base": {"properties": {"q": {}}}, "leaf": {"type": "object"}}
        });
        let c = closed(&schema);
        let no = json!(false);
        assert_eq!(c["additionalProperties"], no);
        assert_eq!(c["properties"]["a"]["additionalProperties"], no);
        assert_eq!(c["properties"]["b"]["additionalProperties"], true);
        assert_eq!(c["properties"]["c"]["items"]["additionalProperties"], no);
        assert_eq!(c["properties"]["d"]["anyOf"][0]["additionalProperties"], no);
        assert_eq!(c["properties"]["d"]["anyOf"][1].get("additionalProperties"), None);
        assert_eq!(c["properties"]["e"]["allOf"][0].get("additionalProperties"), None);
        assert_eq!(c["$defs"]["base"].get("additionalProperties"), None, "a merged definition stays open");
        assert_eq!(c["$defs"]["leaf"]["additionalProperties"], no);
        assert_eq!(c["properties"]["g"].get("additionalProperties"), None, "requires an undeclared key");
        // Nothing else changes.
        let mut back = c.clone();
        strip(&mut back, &schema);
        assert_eq!(back, schema);
    }

    /// Against llguidance: the closed schema refuses an undeclared key and a repeated
    /// declared one; the same schema opened explicitly admits the undeclared key.
    #[test]
    fn the_closed_grammar_refuses_undeclared_and_repeated_keys() {
        let dir =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/trained/target");
        let tok = mtp_base::Tokenizer::from_dir(&dir).unwrap();
        let g = crate::Grammars::new(&tok, tok.vocab_size(), &[0]).unwrap();
        let admits = |schema: &Value, text: &str| {
            let mut guide = g.compile(&crate::Constraint::JsonSchema(schema.clone())).unwrap();
            let ids = tok.encode_plain(text).unwrap();
            ids.iter().all(|&t| guide.mask().unwrap().allows(t) && guide.settle(0, t).is_ok())
                && guide.mask().unwrap().allows(0)
        };
        let schema = json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city"]});
        let mut open = schema.clone();
        open["additionalProperties"] = json!(true);
        let strict = closed(&schema);
        assert!(admits(&strict, r#"{"city":"Oslo","days":2}"#));
        assert!(!admits(&strict, r#"{"city":"Oslo","zip":1}"#), "an undeclared key");
        assert!(!admits(&strict, r#"{"city":"Oslo","city":"Rome"}"#), "a repeated key");
        assert!(admits(&closed(&open), r#"{"city":"Oslo","zip":1}"#), "opened explicitly");
        assert!(!admits(&closed(&open), r#"{"city":"Oslo","city":"Rome"}"#), "declared keys stay single");
        // The negative control: as written (JSON Schema's default), the key gets in.
        assert!(admits(&schema, r#"{"city":"Oslo","zip":1}"#));
    }

    /// `got` without the `additionalProperties: false` that `want` lacks.
    fn strip(got: &mut Value, want: &Value) {
        match (got, want) {
            (Value::Object(g), Value::Object(w)) => {
                if !w.contains_key("additionalProperties") {
                    g.remove("additionalProperties");
                }
                for (k, v) in g.iter_mut() {
                    if let Some(wv) = w.get(k) {
                        strip(v, wv);
                    }
                }
            }
            (Value::Array(g), Value::Array(w)) => g.iter_mut().zip(w).for_each(|(g, w)| strip(g, w)),
            _ => {}
        }
    }
}
