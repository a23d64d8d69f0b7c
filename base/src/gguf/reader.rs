//! The GGUF container (versions 2 and 3): header, metadata key/values of every value type,
//! tensor infos, and the aligned data section, read from a memory map.
//!
//! Contract: [`GgufFile::open`] never panics on any input; every count, length, size and
//! offset read from the file is checked (checked arithmetic, bounded by the file's length)
//! before it is used, and a truncated or corrupt file is an [`Error::Gguf`] naming the file
//! and the key or tensor at fault. Tensor data is not read here, only located: each tensor's
//! byte range is checked to lie inside the file.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::types::GgmlType;
use crate::error::{Error, Result};

/// `GGUF` as a little-endian u32.
const MAGIC: &[u8; 4] = b"GGUF";
/// How deep arrays of arrays may nest (real files nest at most once).
const MAX_DEPTH: usize = 4;
/// The most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// A non-negative integer of any integer type.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A float (either width) or an integer, as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The type's name, for errors.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// Where one tensor lies, as the file describes it.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml's order: `dims[0]` is the innermost (contiguous) dimension, the columns.
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    /// The tensor's bytes in the file (absolute, inside the map).
    pub range: Range<usize>,
}

impl TensorInfo {
    /// Values in the tensor.
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A parsed GGUF file: its metadata and tensor table over the memory map.
pub struct GgufFile {
    pub path: PathBuf,
    pub map: Arc<Mmap>,
    pub version: u32,
    pub meta: BTreeMap<String, Value>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
}

/// A bounds-checked little-endian cursor over the map.
struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Cursor<'_> {
    fn err(&self, msg: String) -> Error {
        Error::Gguf { path: self.path.to_path_buf(), msg }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| {
            self.err(format!(
                "truncated: {what} needs {n} bytes at offset {}, the file has {}",
                self.pos,
                self.b.len()
            ))
        })?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        self.arr::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        self.arr::<8>(what).map(u64::from_le_bytes)
    }

    /// A u64 count or length that must fit in the rest of the file at `min_each` bytes each.
    fn count(&mut self, what: &str, min_each: usize) -> Result<usize> {
        let n = self.u64(what)?;
        let left = self.b.len() - self.pos;
        match usize::try_from(n) {
            Ok(n) if n.checked_mul(min_each).is_some_and(|b| b <= left) => Ok(n),
            _ => {
                Err(self.err(format!("{what} is {n}, more than the {left} bytes left in the file can hold")))
            }
        }
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.count(what, 1)?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| self.err(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.arr::<1>(what)?[0]),
            1 => Value::I8(self.arr::<1>(what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.arr(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.arr(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.arr(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.arr(what)?)),
            7 => match self.arr::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("{what}: bool byte {b} is neither 0 nor 1"))),
            },
            8 => Value::Str(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.err(format!("{what}: arrays nested over {MAX_DEPTH} deep")));
                }
                let elem = self.u32(what)?;
                // Every element takes at least one byte (an array 12, a string 8).
                let min_each = match elem {
                    8 => 8,
                    9 => 12,
                    _ => 1,
                };
                let n = self.count(&format!("{what}: array length"), min_each)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, what, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.arr(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.arr(what)?)),
            t => return Err(self.err(format!("{what}: unknown value type {t}"))),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = crate::files::open_regular(path)?;
        // SAFETY: opened read-only; like every mmap loader we assume no other process
        // truncates the file while it is mapped.
        let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?);
        GgufFile::parse(path, map)
    }

    pub fn parse(path: &Path, map: Arc<Mmap>) -> Result<GgufFile> {
        let mut c = Cursor { b: &map[..], pos: 0, path };
        if c.take(4, "the magic")? != MAGIC {
            return Err(c.err("not a GGUF file (the first 4 bytes are not `GGUF`)".into()));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(c.err(format!("version {version} is not supported (2 and 3 are)")));
        }
        // A tensor info takes at least 28 bytes, a key/value 13.
        let n_tensors = c.count("the tensor count", 28)?;
        let n_kv = c.count("the metadata count", 13)?;
        let mut meta = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key {i}"))?;
            let ty = c.u32(&format!("the type of `{key}`"))?;
            let v = c.value(ty, &format!("metadata `{key}`"), 0)?;
            if meta.insert(key.clone(), v).is_some() {
                return Err(c.err(format!("metadata key `{key}` appears twice")));
            }
        }
        let alignment = match meta.get("general.alignment") {
            None => 32,
            Some(Value::U32(a)) if a.is_power_of_two() => *a as usize,
            Some(v) => {
                return Err(
                    c.err(format!("metadata `general.alignment` is {v:?}: expected a u32 power of two"))
                )
            }
        };
        let mut raw = Vec::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor {i}'s name"))?;
            let what = |s: &str| format!("tensor `{name}`: {s}");
            let n_dims = c.u32(&what("dimension count"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(c.err(what(&format!("{n_dims} dimensions (1 to {MAX_DIMS} supported)"))));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = c.u64(&what("dimension"))?;
                dims.push(usize::try_from(d).map_err(|_| c.err(what(&format!("dimension {d} too large"))))?);
            }
            let ty_id = c.u32(&what("type"))?;
            let ty =
                GgmlType::from_id(ty_id).ok_or_else(|| c.err(what(&format!("unknown ggml type {ty_id}"))))?;
            let offset = c.u64(&what("data offset"))?;
            raw.push((name, dims, ty, offset));
        }
        let data_start = c
            .pos
            .checked_next_multiple_of(alignment)
            .ok_or_else(|| c.err("the data section's start overflows".into()))?;
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut seen = std::collections::HashSet::new();
        for (name, dims, ty, offset) in raw {
            let bad = |msg: String| Error::Gguf {
                path: path.to_path_buf(),
                msg: format!("tensor `{name}`: {msg}"),
            };
            if !seen.insert(name.clone()) {
                return Err(bad("appears twice".into()));
            }
            let values = dims
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .filter(|&n| n <= crate::config::MAX_TENSOR)
                .ok_or_else(|| bad(format!("dimensions {dims:?} are over 2^40 values")))?;
            let bytes = ty.bytes_for(dims[0], values).map_err(bad)?;
            let start = usize::try_from(offset)
                .ok()
                .filter(|o| o.is_multiple_of(alignment))
                .and_then(|o| data_start.checked_add(o))
                .ok_or_else(|| {
                    bad(format!(
                        "data offset {offset} is not a multiple of the alignment {alignment}, or overflows"
                    ))
                })?;
            let end = start.checked_add(bytes).filter(|&e| e <= map.len()).ok_or_else(|| {
                bad(format!(
                    "its {bytes} bytes at offset {start} run past the end of the file ({} bytes): truncated",
                    map.len()
                ))
            })?;
            tensors.push(TensorInfo { name, dims, ty, range: start..end });
        }
        Ok(GgufFile { path: path.to_path_buf(), map, version, meta, tensors })
    }

    pub fn err(&self, msg: impl Into<String>) -> Error {
        Error::Gguf { path: self.path.clone(), msg: msg.into() }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }

    /// Metadata `key` as a string; an error naming it when absent or of another type.
    pub fn str(&self, key: &str) -> Result<&str> {
        match self.meta.get(key) {
            Some(Value::Str(s)) => Ok(s),
            Some(v) => Err(self.err(format!("metadata `{key}` is a {}, expected a string", v.type_name()))),
            None => Err(self.err(format!("metadata `{key}` is missing"))),
        }
    }

    /// Metadata `key` as a non-negative integer, if present; an error when of another type.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.meta
            .get(key)
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    self.err(format!("metadata `{key}` is {v:?}, expected a non-negative integer"))
                })
            })
            .transpose()
    }

    /// Metadata `key` as a number, if present; an error when of another type.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.meta
            .get(key)
            .map(|v| {
                v.as_f64().ok_or_else(|| self.err(format!("metadata `{key}` is {v:?}, expected a number")))
            })
            .transpose()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.range.clone()]
    }
}
