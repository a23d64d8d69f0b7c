//! Whether every key of a JSON Schema is a JSON Schema keyword. A validator ignores a key it
//! does not know, and so does llguidance (it refuses keywords it knows but does not
//! implement, not unknown ones): a misspelt `proprties` or `requred` would leave a
//! constraint that admits any document while the client believes it is bound.
//!
//! Contract: [`check_keywords`] walks every place a schema sits (`properties` and the
//! other maps of name to schema, the applicators' lists, the single subschemas) and
//! refuses the first key that is neither a keyword of some JSON Schema draft (4 to
//! 2020-12: core, applicator, validation, meta-data, format, content and unevaluated
//! vocabularies), nor one of OpenAPI's annotations (`discriminator`, `example`,
//! `externalDocs`, `xml`: pydantic writes `discriminator`), nor an extension starting
//! `x-` (llguidance's own `x-guidance` among them). Values that are data (`enum`,
//! `const`, `default`, `examples`) and the names under `properties` are not keys of a
//! schema and are not looked at. Only keys are judged; their values are llguidance's.

use serde_json::Value;

/// The keywords of JSON Schema drafts 4 to 2020-12 and OpenAPI's annotations.
const KEYWORDS: &[&str] = &[
    // Core.
    "$schema",
    "$id",
    "id",
    "$ref",
    "$defs",
    "definitions",
    "$anchor",
    "$dynamicRef",
    "$dynamicAnchor",
    "$recursiveRef",
    "$recursiveAnchor",
    "$vocabulary",
    "$comment",
    // Applicators.
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependencies",
    "prefixItems",
    "items",
    "additionalItems",
    "contains",
    "properties",
    "patternProperties",
    "additionalProperties",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    // Validation.
    "type",
    "enum",
    "const",
    "multipleOf",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "maxItems",
    "minItems",
    "uniqueItems",
    "maxContains",
    "minContains",
    "maxProperties",
    "minProperties",
    "required",
    "dependentRequired",
    // Meta-data, format and content.
    "title",
    "description",
    "default",
    "deprecated",
    "readOnly",
    "writeOnly",
    "examples",
    "format",
    "contentEncoding",
    "contentMediaType",
    "contentSchema",
    // OpenAPI's annotations.
    "discriminator",
    "example",
    "externalDocs",
    "xml",
];

/// Keywords whose value is one schema.
const ONE: &[&str] = &[
    "not",
    "if",
    "then",
    "else",
    "items",
    "additionalItems",
    "contains",
    "additionalProperties",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
];
/// Keywords whose value is a list of schemas (`items` in drafts before 2020-12).
const LISTS: &[&str] = &["allOf", "anyOf", "oneOf", "prefixItems", "items"];
/// Keywords whose value maps names to schemas (`dependencies` also to lists of names).
const MAPS: &[&str] =
    &["properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"];

/// `Err((path, message))` for the first key of `schema` that is no keyword: `path` is its
/// place below the schema in the server's dotted form (`properties.city.maxLenght`,
/// `anyOf[1].tpye`), `message` says what is wrong.
pub fn check_keywords(schema: &Value) -> Result<(), (String, String)> {
    walk(schema, "")
}

fn join(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_string()
    } else {
        format!("{at}.{key}")
    }
}

fn walk(schema: &Value, at: &str) -> Result<(), (String, String)> {
    let Value::Object(m) = schema else { return Ok(()) };
    for (key, v) in m {
        let here = join(at, key);
        if !KEYWORDS.contains(&key.as_str()) && !key.starts_with("x-") {
            return Err((here, unknown(key)));
        }
        if ONE.contains(&key.as_str()) {
            walk(v, &here)?;
        }
        if let (true, Value::Array(list)) = (LISTS.contains(&key.as_str()), v) {
            for (i, s) in list.iter().enumerate() {
                walk(s, &format!("{here}[{i}]"))?;
            }
        }
        if let (true, Value::Object(named)) = (MAPS.contains(&key.as_str()), v) {
            for (name, s) in named {
                walk(s, &join(&here, name))?;
            }
        }
    }
    Ok(())
}

fn unknown(key: &str) -> String {
    let hint = match key {
        "nullable" => " (OpenAPI 3.0's; in JSON Schema write `\"type\": [..., \"null\"]`)".to_string(),
        _ => match KEYWORDS.iter().find(|k| close(k, key)) {
            Some(k) => format!(" (did you mean `{k}`?)"),
            None => String::new(),
        },
    };
    let shown: String = key.chars().take(80).collect();
    format!(
        "`{shown}` is not a JSON Schema keyword{hint}; a validator ignores it, and the constraint with \
         it (extensions start with `x-`)"
    )
}

/// Whether `a` and `b` are one edit apart (a letter left out, added, changed or two swapped),
/// or the same but for case.
fn close(a: &str, b: &str) -> bool {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    if a.len().abs_diff(b.len()) > 1 || b.len() > 64 {
        return false;
    }
    if a.len() == b.len() {
        let lower = |c: &char| c.to_ascii_lowercase();
        if a.iter().map(lower).eq(b.iter().map(lower)) {
            return true;
        }
        let diff: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
        return diff.len() == 1
            || (diff.len() == 2
                && diff[1] == diff[0] + 1
                && a[diff[0]] == b[diff[1]]
                && a[diff[1]] == b[diff[0]]);
    }
    let (long, short) = if a.len() > b.len() { (&a, &b) } else { (&b, &a) };
    let i = (0..short.len()).find(|&i| short[i] != long[i]).unwrap_or(short.len());
    short[i..] == long[i + 1..]
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn misspelt_keywords_are_refused_by_path_and_standard_ones_pass() {
        let ok = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "x", "title": "T",
            "description": "d", "$comment": "c", "type": "object", "x-order": 1, "examples": [{"proprties": 1}],
            "default": {"requred": true}, "deprecated": false, "readOnly": true,
            "properties": {
                "proprties": {"type": "string", "minLength": 1, "format": "date"},
                "e": {"enum": [{"tpye": 1}]}, "c": {"const": {"x": 1}},
                "u": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]},
                "l": {"type": "array", "items": {"type": "integer"}, "prefixItems": [{}], "uniqueItems": true}
            },
            "required": ["proprties"], "additionalProperties": false,
            "$defs": {"n": {"type": "number", "multipleOf": 2}},
            "definitions": {"old": {"items": [{"type": "string"}]}},
            "discriminator": {"propertyName": "kind"}
        });
        assert_eq!(check_keywords(&ok), Ok(()));
        assert_eq!(check_keywords(&json!(true)), Ok(()));
        for (bad, at, hint) in [
            (json!({"type": "object", "proprties": {}}), "proprties", "did you mean `properties`"),
            (json!({"type": "object", "requred": ["a"]}), "requred", "did you mean `required`"),
            (
                json!({"properties": {"city": {"type": "string", "maxLenght": 8}}}),
                "properties.city.maxLenght",
                "maxLength",
            ),
            (json!({"anyOf": [{}, {"tpye": "string"}]}), "anyOf[1].tpye", "type"),
            (json!({"items": {"Type": "string"}}), "items.Type", "type"),
            (
                json!({"$defs": {"a": {"additionalProperties": {"minimun": 1}}}}),
                "$defs.a.additionalProperties.minimun",
                "minimum",
            ),
            (json!({"nullable": true}), "nullable", "OpenAPI"),
            (json!({"name": "n", "strict": true, "schema": {}}), "name", "keyword"),
        ] {
            let (path, message) = check_keywords(&bad).unwrap_err();
            assert_eq!(path, at, "{bad}");
            assert!(message.contains(hint), "{bad}: {message}");
        }
    }
}
