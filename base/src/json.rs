//! JSON parsed with every object's keys distinct (the server's request bodies, the CLI's
//! prompts lines): a key given twice is refused naming its path, where a plain parse keeps
//! the last value and a proxy or validator in front of the server may have read the first.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// `body` as a JSON value; `Err` with serde's message, or naming a repeated key's path.
pub fn parse(body: &[u8]) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let v = At(String::new()).deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// A value at JSON path `.0` (`""` for the body, then `messages[0].content` style).
struct At(String);

impl<'de> DeserializeSeed<'de> for At {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl At {
    fn child(&self, key: &str) -> At {
        At(if self.0.is_empty() { key.to_string() } else { format!("{}.{key}", self.0) })
    }
}

impl<'de> Visitor<'de> for At {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(At(format!("{}[{}]", self.0, out.len())))? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let at = self.child(&key);
            if out.contains_key(&key) {
                return Err(A::Error::custom(format!("the key `{}` is given twice", at.0)));
            }
            let v = map.next_value_seed(At(at.0))?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn a_repeated_key_is_refused_by_path_and_the_rest_parses_as_serde_json_does() {
        for (body, path) in [
            (r#"{"model": "a", "model": "b"}"#, "`model`"),
            (r#"{"messages": [{"role": "user", "content": "x", "role": "system"}]}"#, "`messages[0].role`"),
            (r#"{"a": {"b": {"c": 1, "c": 2}}}"#, "`a.b.c`"),
        ] {
            let e = parse(body.as_bytes()).unwrap_err().to_string();
            assert!(e.contains(path) && e.contains("twice"), "{body}: {e}");
        }
        // Control: distinct keys (the same name at different paths too) parse as serde_json.
        for body in [
            r#"{"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}], "c": 1.5e3, "d": null, "e": -7, "f": "\u00e9"}"#,
            "[]",
            "3",
        ] {
            let want: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(parse(body.as_bytes()).unwrap(), want, "{body}");
        }
        assert!(parse(b"{} x").is_err(), "trailing characters");
    }
}
