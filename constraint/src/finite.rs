//! Whether a JSON Schema admits a finite document. llguidance finds an endless schema only
//! when a generation gets stuck (no token allowed: "NoExtensionBias"), so one whose
//! required properties or items lead back through `$ref` to themselves is refused when the
//! request comes, naming the reference.
//!
//! Contract: conservative. A schema is refused only where every instance would have to hold
//! an instance of itself: a local `$ref` reached through `required` properties, `minItems`
//! items, `allOf` members and every branch of an `anyOf`/`oneOf`, or a required `false`.
//! Anything the check does not model (no `type`, primitive types, `enum`, `const`, remote
//! references) counts as finite; llguidance still judges the rest.

use std::collections::BTreeSet;

use serde_json::Value;

/// `Err` with what makes every document under `schema` endless, or `Ok`.
pub fn check_finite(schema: &Value) -> Result<(), String> {
    let mut targets = BTreeSet::new();
    collect_refs(schema, &mut targets);
    // Least fixpoint: a reference is finite once its target is, given those known so far.
    let mut finite: BTreeSet<&str> = BTreeSet::new();
    loop {
        let before = finite.len();
        for t in &targets {
            if !finite.contains(t.as_str())
                && resolve(schema, t).is_some_and(|s| finite_under(schema, s, &finite).is_ok())
            {
                finite.insert(t);
            }
        }
        if finite.len() == before {
            break;
        }
    }
    finite_under(schema, schema, &finite)
}

/// Every `$ref` string anywhere in `v`.
fn collect_refs(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(r)) = m.get("$ref") {
                out.insert(r.clone());
            }
            m.values().for_each(|x| collect_refs(x, out));
        }
        Value::Array(a) => a.iter().for_each(|x| collect_refs(x, out)),
        _ => {}
    }
}

/// The schema a local reference (`#`, `#/$defs/x`, ...) names; `None` for others.
fn resolve<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    root.pointer(pointer)
}

/// Whether `node` has a finite instance when the references in `finite` do (and no others).
fn finite_under(root: &Value, node: &Value, finite: &BTreeSet<&str>) -> Result<(), String> {
    let m = match node {
        Value::Bool(false) => return Err("a required part of it is `false`, which matches nothing".into()),
        Value::Object(m) => m,
        _ => return Ok(()),
    };
    if let Some(Value::String(r)) = m.get("$ref") {
        if resolve(root, r).is_some() && !finite.contains(r.as_str()) {
            return Err(format!(
                "no finite document matches it: `$ref` `{r}` is required inside itself (through required \
                 properties, items or every branch)"
            ));
        }
    }
    if m.contains_key("enum") || m.contains_key("const") {
        return Ok(());
    }
    if let Some(Value::Array(all)) = m.get("allOf") {
        for s in all {
            finite_under(root, s, finite)?;
        }
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(branches)) =
            m.get(key).filter(|b| b.as_array().is_some_and(|b| !b.is_empty()))
        {
            let errors: Vec<String> =
                branches.iter().filter_map(|s| finite_under(root, s, finite).err()).collect();
            if errors.len() == branches.len() {
                return Err(errors.into_iter().next().unwrap_or_default());
            }
        }
    }
    let types: Vec<&str> = match m.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => return Ok(()),
    };
    if types.iter().any(|t| !matches!(*t, "object" | "array")) {
        return Ok(());
    }
    let object = || -> Result<(), String> {
        let props = m.get("properties").and_then(Value::as_object);
        for name in
            m.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str)
        {
            let extra = || m.get("additionalProperties").filter(|a| a.is_object());
            if let Some(s) = props.and_then(|p| p.get(name)).or_else(extra) {
                finite_under(root, s, finite)?;
            }
        }
        Ok(())
    };
    let array = || -> Result<(), String> {
        let least = m.get("minItems").and_then(Value::as_u64).unwrap_or(0);
        let prefix = m.get("prefixItems").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
        for s in prefix.iter().take(usize::try_from(least).unwrap_or(usize::MAX)) {
            finite_under(root, s, finite)?;
        }
        match m.get("items") {
            Some(items) if least > prefix.len() as u64 => finite_under(root, items, finite),
            _ => Ok(()),
        }
    };
    let mut first = None;
    for t in types {
        match if t == "object" { object() } else { array() } {
            Ok(()) => return Ok(()),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    first.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::check_finite;
    use serde_json::json;

    #[test]
    fn schemas_that_must_hold_themselves_are_endless() {
        for endless in [
            json!({"$ref": "#"}),
            json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            json!({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
            json!({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
                   "$ref": "#/$defs/n"}),
            json!({"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#"}, false]}}, "required": ["x"]}),
            json!({"type": "object", "properties": {"x": false}, "required": ["x"]}),
        ] {
            assert!(check_finite(&endless).is_err(), "{endless}");
        }
        let e =
            check_finite(&json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}));
        assert!(e.unwrap_err().contains("`$ref` `#`"), "the error names the reference");
    }

    /// Controls: the same shapes with a way out are finite.
    #[test]
    fn recursion_with_a_way_out_is_finite() {
        for finite in [
            json!({"type": "object", "properties": {"a": {"$ref": "#"}}}),
            json!({"type": "array", "items": {"$ref": "#"}}),
            json!({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            json!({"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#"}, {"type": "string"}]}}, "required": ["x"]}),
            json!({"$defs": {"t": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                                   "required": ["kids"]}}, "$ref": "#/$defs/t"}),
            json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
            json!(true),
            json!({"$ref": "https://example.com/remote"}),
        ] {
            assert_eq!(check_finite(&finite), Ok(()), "{finite}");
        }
    }
}
