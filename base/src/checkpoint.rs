//! Memory-mapped safetensors checkpoints: `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Tensors stay in the map in their on-disk dtype.
//!
//! A checkpoint remembers which tensors were read ([`Checkpoint::unread`]), so a loader can
//! refuse a checkpoint holding tensors its config.json does not describe.

mod fp8;
mod header;
mod intq;

pub use fp8::e4m3;

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::config::read_json;
use crate::error::{Error, Result};
use crate::quant_config::{Declared, Scheme};
use crate::weights::{Quant, Weight, WeightDtype};

struct Entry {
    file: Arc<PathBuf>,
    map: Arc<Mmap>,
    range: Range<usize>,
    dtype: Dtype,
    shape: Vec<usize>,
}

impl Entry {
    /// The tensor's dtype as a float weight dtype (F32, BF16, F16), or an error naming it.
    fn float_dtype(&self, name: &str) -> Result<WeightDtype> {
        match self.dtype {
            Dtype::F32 => Ok(WeightDtype::F32),
            Dtype::BF16 => Ok(WeightDtype::Bf16),
            Dtype::F16 => Ok(WeightDtype::F16),
            other => Err(Error::TensorDtype {
                path: (*self.file).clone(),
                name: name.to_string(),
                dtype: format!("{other:?}"),
            }),
        }
    }
}

/// A tensor a loader of another format built (a GGUF's, [`crate::gguf`]): its bytes in
/// `map`, described as a safetensors file would describe them.
pub(crate) struct Built {
    pub name: String,
    pub map: Arc<Mmap>,
    pub range: Range<usize>,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

/// The tensors of one checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    tensors: HashMap<String, Entry>,
    /// Names read (or accounted for with [`Checkpoint::mark_read`]) so far.
    read: Mutex<HashSet<String>>,
    /// config.json (when the directory has one) and its `quantization` object.
    declared: Option<(PathBuf, serde_json::Value)>,
    /// config.json's `quantization_config` (AWQ, GPTQ, compressed-tensors, FP8), and how
    /// many weights were read in its layout.
    scheme: Option<Declared>,
    imported: AtomicUsize,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        if crate::gguf::is_gguf(dir) {
            return crate::gguf::checkpoint(dir);
        }
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        // The index's shard for each tensor it lists (none for a single file).
        let mut listed: HashMap<String, String> = HashMap::new();
        let files: Vec<PathBuf> = if crate::files::present(&index) {
            let v = read_json(&index)?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::config(&index, "weight_map", "missing or not an object"))?;
            let mut names: Vec<String> = Vec::new();
            for (tensor, file) in map {
                let f = file.as_str().ok_or_else(|| {
                    Error::config(&index, &format!("weight_map.{tensor}"), "not a file name")
                })?;
                // A shard is a file of this directory: `../../etc/passwd` was opened.
                let mut parts = Path::new(f).components();
                if !matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(_)), None)) {
                    return Err(Error::config(
                        &index,
                        &format!("weight_map.{tensor}"),
                        format!("`{f}` is not the name of a file in the checkpoint's directory"),
                    ));
                }
                if !names.iter().any(|n| n == f) {
                    names.push(f.to_string());
                }
                listed.insert(tensor.clone(), f.to_string());
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if crate::files::present(&single) {
            vec![single]
        } else {
            return Err(Error::io(
                &single,
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors or model.safetensors.index.json in this directory",
                ),
            ));
        };
        let mut tensors: HashMap<String, Entry> = HashMap::new();
        for path in files {
            let file = crate::files::open_regular(&path)?;
            // SAFETY: the file is opened read-only; like every mmap loader we assume it is
            // not truncated by another process while mapped.
            let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?);
            let st = SafeTensors::deserialize(&map).map_err(|e| Error::Safetensors {
                path: path.clone(),
                msg: header::explain(&map).unwrap_or_else(|| e.to_string()),
            })?;
            let base = map.as_ptr() as usize;
            let path = Arc::new(path);
            let shard = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            for (name, view) in st.tensors() {
                // A tensor in two shards, or not where the index says: which copy the
                // model reads would be the loader's choice, not the checkpoint's.
                if let Some(other) = tensors.get(&name) {
                    let first =
                        other.file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    return Err(Error::config(
                        &index,
                        &format!("weight_map.{name}"),
                        format!("tensor `{name}` is stored in both {first} and {shard}"),
                    ));
                }
                if let Some(f) = listed.get(&name).filter(|f| **f != shard) {
                    return Err(Error::config(
                        &index,
                        &format!("weight_map.{name}"),
                        format!("names `{f}`, but the tensor is stored in {shard}"),
                    ));
                }
                let start = view.data().as_ptr() as usize - base;
                tensors.insert(
                    name,
                    Entry {
                        file: path.clone(),
                        map: map.clone(),
                        range: start..start + view.data().len(),
                        dtype: view.dtype(),
                        shape: view.shape().to_vec(),
                    },
                );
            }
        }
        let config = dir.join("config.json");
        let (declared, scheme) = match crate::files::present(&config) {
            true => {
                let v = read_json(&config)?;
                let scheme = crate::quant_config::parse(&config, &v)?;
                (v.get("quantization").filter(|q| q.is_object()).cloned().map(|q| (config, q)), scheme)
            }
            false => (None, None),
        };
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            tensors,
            read: Mutex::default(),
            declared,
            scheme,
            imported: AtomicUsize::new(0),
        })
    }

    /// The tensors `built` of the file `file` (not a directory: a GGUF).
    pub(crate) fn from_built(file: &Path, built: Vec<Built>) -> Checkpoint {
        let path = Arc::new(file.to_path_buf());
        let tensors = built
            .into_iter()
            .map(|b| {
                let e =
                    Entry { file: path.clone(), map: b.map, range: b.range, dtype: b.dtype, shape: b.shape };
                (b.name, e)
            })
            .collect();
        // A GGUF's quantization is its tensors' own types: no config declares a scheme.
        Checkpoint {
            dir: file.to_path_buf(),
            tensors,
            read: Mutex::default(),
            declared: None,
            scheme: None,
            imported: AtomicUsize::new(0),
        }
    }

    /// The entry of `name`, recorded as read; an error naming it when absent.
    fn entry(&self, name: &str) -> Result<&Entry> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor { dir: self.dir.clone(), name: name.to_string() })?;
        self.mark_read(name);
        Ok(e)
    }

    /// Records `name` as accounted for without reading it (e.g. a module checked to mirror
    /// one that was read).
    pub fn mark_read(&self, name: &str) {
        self.read.lock().unwrap_or_else(PoisonError::into_inner).insert(name.to_string());
    }

    /// Names of the tensors nothing has read yet, sorted.
    pub fn unread(&self) -> Vec<&str> {
        let read = self.read.lock().unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<&str> =
            self.tensors.keys().map(|k| k.as_str()).filter(|k| !read.contains(*k)).collect();
        names.sort_unstable();
        names
    }

    /// Names read so far that start with `prefix`, sorted.
    pub fn read_with_prefix(&self, prefix: &str) -> Vec<String> {
        let read = self.read.lock().unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<String> = read.iter().filter(|k| k.starts_with(prefix)).cloned().collect();
        names.sort_unstable();
        names
    }

    /// The shape of tensor `name`, if the checkpoint holds it (not recorded as a read).
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    /// The file holding tensor `name`.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.tensors.get(name).map(|e| e.file.as_path())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Tensor `name`, which must have exactly `shape` (1-D or 2-D). A 2-D `*.weight`
    /// stored MLX-quantized (with `*.scales` and `*.biases` beside it) comes back as a
    /// quantized weight of that logical shape.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        if let (Some(stem), [rows, cols]) = (name.strip_suffix(".weight"), shape) {
            if self.contains(&format!("{stem}.scales")) && self.scheme.is_none() {
                return self.get_quantized(stem, &[*rows], *cols);
            }
            if let Some(w) = self.get_declared(stem, *rows, *cols)? {
                return Ok(w);
            }
        }
        let (rows, cols) = match shape {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => unreachable!("weights are 1-D or 2-D"),
        };
        self.get_as(name, shape, rows, cols)
    }

    /// `{stem}`'s `rows x cols` weight in the layout config.json's `quantization_config`
    /// declares, when it is stored so (`None`: stored as a plain tensor, e.g. a module the
    /// quantizer left out).
    fn get_declared(&self, stem: &str, rows: usize, cols: usize) -> Result<Option<Weight>> {
        let Some(d) = &self.scheme else { return Ok(None) };
        let has = |suffix: &str| self.contains(&format!("{stem}.{suffix}"));
        let w = match d.scheme {
            Scheme::Awq { group } if has("qweight") => self.awq(d, stem, rows, cols, group)?,
            Scheme::Gptq { bits, group, zero_offset } if has("qweight") => {
                self.gptq(d, stem, (rows, cols), bits, group, zero_offset)?
            }
            Scheme::CtInt { bits, group, symmetric } if has("weight_packed") => {
                self.ct_int(d, stem, (rows, cols), bits, group, symmetric)?
            }
            Scheme::Fp8Block { block } if has("weight_scale_inv") => {
                self.fp8_block(d, stem, (rows, cols), block)?
            }
            Scheme::CtFp8 { strategy } if has("weight_scale") => {
                self.ct_fp8(d, stem, (rows, cols), strategy)?
            }
            _ => return Ok(None),
        };
        self.imported.fetch_add(1, Ordering::Relaxed);
        Ok(Some(w))
    }

    /// Refuses a checkpoint whose `quantization_config` declares a scheme none of its
    /// weights is stored in (a 16-bit checkpoint with a stale `fp8` or `awq` config was
    /// loaded as if the config were not there). Called once a load is done.
    pub fn check_declared_used(&self) -> Result<()> {
        match &self.scheme {
            Some(d) if self.imported.load(Ordering::Relaxed) == 0 => Err(Error::config(
                &d.path,
                "quantization_config.quant_method",
                format!(
                    "declares {}, but no weight of {} is stored in that layout (its tensors: {})",
                    d.scheme.name(),
                    self.dir.display(),
                    match d.scheme {
                        Scheme::Awq { .. } | Scheme::Gptq { .. } => "`*.qweight`, `*.qzeros`, `*.scales`",
                        Scheme::CtInt { .. } => "`*.weight_packed`, `*.weight_scale`",
                        Scheme::Fp8Block { .. } => "F8_E4M3 `*.weight` with `*.weight_scale_inv`",
                        Scheme::CtFp8 { .. } => "F8_E4M3 `*.weight` with `*.weight_scale`",
                    }
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The quantization scheme config.json declares, if any.
    pub fn scheme(&self) -> Option<&Scheme> {
        self.scheme.as_ref().map(|d| &d.scheme)
    }

    /// `{stem}.weight` (packed u32), `{stem}.scales` and `{stem}.biases` as one quantized
    /// `rows x cols` weight, where the stored tensors have leading dims `lead` (`[rows]`, or
    /// `[experts, n]` for stacked experts, then `rows = experts * n`); bits and group size
    /// follow from the shapes.
    fn get_quantized(&self, stem: &str, lead: &[usize], cols: usize) -> Result<Weight> {
        let rows: usize = lead.iter().product();
        let name = format!("{stem}.weight");
        let e = self.entry(&name)?;
        let bad =
            |msg: String| Error::Safetensors { path: (*e.file).clone(), msg: format!("`{name}`: {msg}") };
        if e.dtype != Dtype::U32 {
            return Err(bad(format!("quantized weights are packed as U32, this one is {:?}", e.dtype)));
        }
        let words = match e.shape.split_last() {
            Some((&w, l)) if l == lead => w,
            _ => {
                return Err(Error::TensorShape {
                    path: (*e.file).clone(),
                    name,
                    got: e.shape.clone(),
                    expected: [lead, &[cols]].concat(),
                })
            }
        };
        let bits = words * 32 / cols;
        if ![2, 4, 8].contains(&bits) || words * 32 != cols * bits {
            return Err(bad(format!(
                "{words} packed words per row for {cols} values is not 2, 4 or 8 bits per value (supported)"
            )));
        }
        let scales_name = format!("{stem}.scales");
        let scales_entry = self.entry(&scales_name)?;
        let groups = match scales_entry.shape.split_last() {
            Some((&g, l))
                if l == lead && g > 0 && cols.is_multiple_of(g) && (cols / g).is_multiple_of(32 / bits) =>
            {
                g
            }
            _ => {
                return Err(bad(format!(
                    "`{scales_name}` has shape {:?}: expected {lead:?} then G, with G dividing {cols} into whole words",
                    scales_entry.shape
                )))
            }
        };
        let packed = Weight::mapped(e.map.clone(), e.range.clone(), WeightDtype::F32, rows, words);
        let biases_name = format!("{stem}.biases");
        let quant = if self.contains(&biases_name) {
            let side = |n: &str| self.get_as(n, &[lead, &[groups]].concat(), rows, groups);
            Quant {
                bits,
                group: cols / groups,
                scales: side(&scales_name)?,
                biases: Some(side(&biases_name)?),
            }
        } else if scales_entry.dtype == Dtype::U8 && bits == 4 && cols / groups == 32 {
            // mxfp4: E8M0 scales, 2^(e - 127), exact in f32 (255 is NaN).
            let exps = &scales_entry.map[scales_entry.range.clone()];
            let values: Vec<f32> =
                exps.iter().map(|&e| if e == 255 { f32::NAN } else { 2f32.powi(e as i32 - 127) }).collect();
            Quant { bits, group: 32, scales: Weight::from_f32(values, rows, groups), biases: None }
        } else {
            return Err(bad(format!(
                "no `{biases_name}` (affine) and `{scales_name}` is not mxfp4's U8 exponents for groups of 32 4-bit values"
            )));
        };
        let mode = if quant.biases.is_some() { "affine" } else { "mxfp4" };
        self.check_declared(
            stem,
            [("bits", bits.into()), ("group_size", quant.group.into()), ("mode", mode.into())],
        )?;
        Ok(Weight::quantized(packed, rows, cols, quant))
    }

    /// Refuses quantized `{stem}.weight` when the layout its shapes imply (`found`: bits,
    /// group_size, mode) contradicts config.json's `quantization`, as mlx-lm reads it: the
    /// module's own entry (named by its path, the tensor's stem) over the top-level values,
    /// mode `affine` when neither names one. A key neither names is not checked.
    fn check_declared(&self, stem: &str, found: [(&str, serde_json::Value); 3]) -> Result<()> {
        let Some((path, q)) = &self.declared else { return Ok(()) };
        // `true` is mlx-lm's "quantized with the top-level values".
        let own = q.get(stem).filter(|o| !o.is_null() && **o != serde_json::Value::Bool(true));
        if own.is_some_and(|o| !o.is_object()) {
            let got = own.map_or(String::new(), |o| o.to_string());
            return Err(Error::config(
                path,
                &format!("quantization.{stem}"),
                format!("is {got}, but `{stem}.weight` is stored quantized (expected an object of its bits and group_size)"),
            ));
        }
        let affine = serde_json::Value::from("affine");
        for (key, found) in found {
            let want = match (own.and_then(|o| o.get(key)), q.get(key)) {
                (Some(w), _) => (format!("quantization.{stem}.{key}"), w),
                (None, Some(w)) => (format!("quantization.{key}"), w),
                (None, None) if key == "mode" => ("quantization.mode".to_string(), &affine),
                (None, None) => continue,
            };
            if *want.1 != found {
                return Err(Error::config(
                    path,
                    &want.0,
                    format!(
                        "{}, but tensor `{stem}.weight` is stored with {key} {found} (what its packed words and \
                         `{stem}.scales` imply)",
                        want.1
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Float tensor `name`, which must have exactly `shape`, viewed as `rows x cols`.
    fn get_as(&self, name: &str, shape: &[usize], rows: usize, cols: usize) -> Result<Weight> {
        let e = self.entry(name)?;
        if e.shape != shape {
            return Err(Error::TensorShape {
                path: (*e.file).clone(),
                name: name.to_string(),
                got: e.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        Ok(Weight::mapped(e.map.clone(), e.range.clone(), e.float_dtype(name)?, rows, cols))
    }

    /// A 3-D `[experts, n, cols]` tensor (stacked MoE experts) as one `experts * n x cols`
    /// weight, mapped in place: expert `e`'s rows are `e * n..(e + 1) * n`
    /// ([`Weight::slice_rows`]). A `*.weight` stored MLX-quantized (3-D `.scales` and
    /// `.biases` beside it, as mlx-lm's `switch_glu` writes experts) comes back quantized.
    pub fn get_stacked(&self, name: &str, shape: [usize; 3]) -> Result<Weight> {
        let [experts, n, cols] = shape;
        if let Some(stem) = name.strip_suffix(".weight") {
            if self.contains(&format!("{stem}.scales")) && self.scheme.is_none() {
                return self.get_quantized(stem, &[experts, n], cols);
            }
        }
        self.get_as(name, &shape, experts * n, cols)
    }

    /// A 1-D integer tensor (I64 or I32) of `len` values, e.g. a token permutation.
    pub fn get_ids(&self, name: &str, len: usize) -> Result<Vec<i64>> {
        let e = self.entry(name)?;
        if e.shape != [len] {
            return Err(Error::TensorShape {
                path: (*e.file).clone(),
                name: name.to_string(),
                got: e.shape.clone(),
                expected: vec![len],
            });
        }
        let b = &e.map[e.range.clone()];
        match e.dtype {
            Dtype::I64 => {
                Ok(b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
            }
            Dtype::I32 => Ok(b
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
                .collect()),
            other => Err(Error::TensorDtype {
                path: (*e.file).clone(),
                name: name.to_string(),
                dtype: format!("{other:?}"),
            }),
        }
    }

    /// Names of the tensors that start with `prefix`.
    pub fn names_with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.tensors.keys().map(|k| k.as_str()).filter(move |k| k.starts_with(prefix))
    }

    /// A small tensor widened to f32 (norm weights, biases).
    pub fn get_f32(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self.get(name, &[len])?.to_f32())
    }
}
