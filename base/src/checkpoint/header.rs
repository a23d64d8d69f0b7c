//! Why a safetensors file was refused, naming the tensor: the safetensors crate says
//! "invalid shape, data type, or offset for tensor" without a name, and for two tensors
//! whose bytes overlap it names whichever comes second by offset. [`explain`] reads the
//! header again after the crate refused it and says which tensor lies and how; it is only
//! called on a refusal, so a good file is parsed once.

use safetensors::Dtype;
use serde_json::Value;

/// What is wrong with the safetensors `bytes`, or `None` when this check finds nothing
/// (the crate's own message then stands).
pub(super) fn explain(bytes: &[u8]) -> Option<String> {
    let Some(len) = bytes.get(..8) else {
        return Some(format!("the file is {} bytes, shorter than the 8-byte header length", bytes.len()));
    };
    let n = u64::from_le_bytes(len.try_into().ok()?);
    let rest = bytes.len() as u64 - 8;
    if n > rest {
        return Some(format!("the header length {n} reaches past the file's end ({rest} bytes after it)"));
    }
    let header: Value = serde_json::from_slice(&bytes[8..8 + n as usize]).ok()?;
    let data = rest - n;
    let mut spans: Vec<(u64, u64, &str)> = Vec::new();
    for (name, t) in header.as_object()?.iter().filter(|(k, _)| *k != "__metadata__") {
        let dtype: Dtype = serde_json::from_value(t.get("dtype")?.clone()).ok()?;
        let shape: Vec<u64> = serde_json::from_value(t.get("shape")?.clone()).ok()?;
        let [start, end]: [u64; 2] = serde_json::from_value(t.get("data_offsets")?.clone()).ok()?;
        if end < start {
            return Some(format!("tensor `{name}`: data_offsets [{start}, {end}] end before they start"));
        }
        if end > data {
            return Some(format!(
                "tensor `{name}`: data_offsets [{start}, {end}] reach past the {data} bytes of data"
            ));
        }
        let bits = shape.iter().try_fold(dtype.bitsize() as u64, |b, &d| b.checked_mul(d));
        let want = bits.filter(|b| b % 8 == 0).map(|b| b / 8);
        if want != Some(end - start) {
            let size = want.map_or("no whole number of".to_string(), |w| w.to_string());
            return Some(format!(
                "tensor `{name}`: shape {shape:?} of {dtype:?} is {size} bytes, but its data_offsets \
                 [{start}, {end}] hold {}",
                end - start
            ));
        }
        spans.push((start, end, name));
    }
    spans.sort_unstable();
    // The end of the bytes accounted for, and the tensor that ends there.
    let mut at: (u64, Option<&str>) = (0, None);
    let after = |t: Option<&str>| t.map_or("the start of the data".to_string(), |t| format!("tensor `{t}`"));
    for &(start, end, name) in &spans {
        if start < at.0 {
            let other = spans.iter().find(|s| s.2 != name && s.0 < end && start < s.1).map(|s| s.2);
            let other = other.or(at.1).unwrap_or("?");
            return Some(format!("tensors `{other}` and `{name}` share bytes: their data_offsets overlap"));
        }
        if start > at.0 {
            return Some(format!(
                "bytes {}..{start} of the data, between {} and tensor `{name}`, belong to no tensor",
                at.0,
                after(at.1)
            ));
        }
        at = (end, Some(name));
    }
    (at.0 < data)
        .then(|| format!("the data's last {} bytes, after {}, belong to no tensor", data - at.0, after(at.1)))
}

#[cfg(test)]
mod tests {
    use super::explain;

    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.resize(b.len() + data, 0);
        b
    }

    /// Each lie is named by the tensor that tells it; a true header says nothing.
    #[test]
    fn each_lie_names_its_tensor() {
        let two = |a: &str, b: &str| format!(r#"{{"a":{{"dtype":"F32",{a}}},"b":{{"dtype":"F32",{b}}}}}"#);
        let ok = two(r#""shape":[2],"data_offsets":[0,8]"#, r#""shape":[1],"data_offsets":[8,12]"#);
        assert_eq!(explain(&file(&ok, 12)), None);
        let shape = two(r#""shape":[2],"data_offsets":[0,8]"#, r#""shape":[3],"data_offsets":[8,12]"#);
        let e = explain(&file(&shape, 12)).unwrap();
        assert!(
            e.contains("`b`") && e.contains("[3]") && e.contains("12 bytes") && e.contains("hold 4"),
            "{e}"
        );
        // `b` overlaps `a`; the crate named `a`, second by offset.
        let overlap = two(r#""shape":[2],"data_offsets":[4,12]"#, r#""shape":[2],"data_offsets":[0,8]"#);
        let e = explain(&file(&overlap, 12)).unwrap();
        assert!(e.contains("`a` and `b`") || e.contains("`b` and `a`"), "{e}");
        let gap = two(r#""shape":[1],"data_offsets":[0,4]"#, r#""shape":[1],"data_offsets":[8,12]"#);
        assert!(explain(&file(&gap, 12)).unwrap().contains("bytes 4..8"));
        let past = two(r#""shape":[2],"data_offsets":[0,8]"#, r#""shape":[2],"data_offsets":[8,16]"#);
        assert!(explain(&file(&past, 12)).unwrap().contains("tensor `b`: data_offsets [8, 16] reach past"));
        assert!(explain(&file(&ok, 16)).unwrap().contains("last 4 bytes, after tensor `b`"));
    }
}
