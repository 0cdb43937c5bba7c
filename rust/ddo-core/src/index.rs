//! A validated index of a safetensors file's header over a read-only memory map.
//!
//! The format: an 8-byte little-endian header length `N`, `N` bytes of JSON
//! mapping tensor names to `{"dtype", "shape", "data_offsets": [begin, end]}`
//! (offsets relative to the data section) plus an optional `__metadata__`
//! string map, then the data section.
//!
//! Everything is checked up front so later code can slice the mapping without
//! further checks: every error names the file, the tensor, and what was
//! expected versus found. What is accepted is what the reference implementation
//! (the `safetensors` crate's `SafeTensors::read_metadata`) accepts: the
//! tensors, sorted by offsets, cover the data section back to back from byte 0
//! to the end of the file, each exactly as large as its dtype and shape say.
//! A key repeated in one JSON object is refused too (the reference keeps the
//! last of two tensors of one name; here neither is trusted).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::time::SystemTime;

use memmap2::Mmap;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::dtype::{dtype_bits, KNOWN_DTYPES};
use crate::error::{CoreError, Result};

/// Largest accepted JSON header, as in the reference implementation (100 MB).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct TensorInfo {
    /// Tensor name as in the header.
    pub name: String,
    /// Dtype as spelled in the file: `"BF16"`, `"F32"`, `"I64"`, ...
    pub dtype: String,
    /// Shape; an empty shape is a scalar, a 0 dimension an empty tensor.
    pub shape: Vec<usize>,
    /// Absolute byte offset of the first byte in the file.
    pub offset: u64,
    /// Size in bytes.
    pub nbytes: u64,
}

/// A parsed and validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Header {
    /// Tensors sorted by offset (ties by name).
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` map, if present.
    pub metadata: Option<HashMap<String, String>>,
    /// Absolute offset of the data section (`8 + header length`).
    pub data_start: u64,
}

/// Parses and validates the header of a complete safetensors file held in `bytes`.
///
/// `path` is only used in error messages. Never panics.
pub fn parse_header(path: &str, bytes: &[u8]) -> Result<Header> {
    let err = |reason: String| CoreError::Checkpoint {
        path: path.to_string(),
        reason,
    };
    let file_len = bytes.len() as u64;
    let Some(prefix) = bytes.get(..8) else {
        return Err(err(too_short(file_len)));
    };
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(prefix);
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > file_len - 8 {
        return Err(err(format!(
            "header length prefix says {header_len} bytes of JSON, but only {} bytes follow the \
             8-byte prefix (file is {file_len} bytes)",
            file_len - 8
        )));
    }
    if header_len > MAX_HEADER_BYTES {
        return Err(err(format!(
            "header is {header_len} bytes, larger than the {MAX_HEADER_BYTES}-byte limit"
        )));
    }
    let data_start = 8 + header_len;
    // Both bounds are <= bytes.len(), checked above.
    let json = bytes
        .get(8..data_start as usize)
        .ok_or_else(|| err("header range out of bounds".into()))?;
    let text =
        std::str::from_utf8(json).map_err(|e| err(format!("header is not valid UTF-8 ({e})")))?;
    let value = parse_json(text).map_err(err)?;
    let Value::Object(map) = value else {
        return Err(err(format!(
            "header must be a JSON object mapping tensor names to {{dtype, shape, data_offsets}}, \
             found {}",
            describe(&value)
        )));
    };
    let data_len = file_len - data_start;
    build_header(map, data_start, data_len).map_err(err)
}

fn too_short(file_len: u64) -> String {
    format!("file is {file_len} bytes, shorter than the 8-byte header length prefix")
}

/// Parses the header's JSON, refusing a key that appears twice in one object.
///
/// `serde_json` would keep the last of two entries of the same name, so a file whose header lists
/// a tensor twice would be read as whatever its second entry says while another reader may take
/// the first. The reference implementation refuses a repeated `__metadata__` or entry field and
/// keeps the last repeated tensor; here every repeated key is an error naming it.
fn parse_json(text: &str) -> std::result::Result<Value, String> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(text);
    let value = Strict { ctx: Ctx::Top }
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v));
    value.map_err(|e| match e.classify() {
        serde_json::error::Category::Data => format!("header is malformed: {e}"),
        _ => format!("header is not valid JSON ({e})"),
    })
}

/// Where an object sits in the header, for naming a repeated key.
#[derive(Clone, Copy)]
enum Ctx<'a> {
    /// The header itself: keys are tensor names (and `__metadata__`).
    Top,
    /// The entry of tensor (or `__metadata__`) `.0`: keys are its fields.
    Entry(&'a str),
    /// Deeper inside the entry of `.0`.
    Inner(&'a str),
}

impl Ctx<'_> {
    fn repeated(self, key: &str) -> String {
        match self {
            Ctx::Top if key == "__metadata__" => {
                "the header has two \"__metadata__\" entries".to_string()
            }
            Ctx::Top => format!(
                "tensor '{key}' is listed twice in the header (a JSON parser would silently keep \
                 one of the entries)"
            ),
            Ctx::Entry("__metadata__") => format!("__metadata__: key '{key}' appears twice"),
            Ctx::Entry(name) => format!("tensor '{name}': field \"{key}\" appears twice"),
            Ctx::Inner(name) => {
                format!("tensor '{name}': key \"{key}\" appears twice in its entry")
            }
        }
    }
}

/// A `serde_json::Value` whose objects have no repeated keys.
struct Strict<'a> {
    ctx: Ctx<'a>,
}

impl<'de> serde::de::DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> std::result::Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Strict<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> std::result::Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<Value, A::Error> {
        let inner = match self.ctx {
            Ctx::Top => Ctx::Inner(""),
            Ctx::Entry(name) | Ctx::Inner(name) => Ctx::Inner(name),
        };
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Strict { ctx: inner })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(serde::de::Error::custom(self.ctx.repeated(&key)));
            }
            let ctx = match self.ctx {
                Ctx::Top => Ctx::Entry(&key),
                Ctx::Entry(name) | Ctx::Inner(name) => Ctx::Inner(name),
            };
            let value = map.next_value_seed(Strict { ctx })?;
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}

/// A tensor entry with offsets still relative to the data section.
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<usize>,
    begin: u64,
    end: u64,
}

fn build_header(
    map: Map<String, Value>,
    data_start: u64,
    data_len: u64,
) -> std::result::Result<Header, String> {
    let mut metadata = None;
    let mut entries = Vec::with_capacity(map.len());
    for (name, value) in map {
        if name == "__metadata__" {
            // `null` is no metadata, as in the reference implementation.
            metadata = (!value.is_null())
                .then(|| parse_metadata(&value))
                .transpose()?;
        } else {
            entries.push(parse_entry(name, &value)?);
        }
    }

    // As the reference implementation: sorted by offsets, the tensors tile the data section from
    // byte 0 without holes or overlaps (an empty tensor sits where the previous one ends), and the
    // last one ends where the file ends.
    entries.sort_by(|a, b| (a.begin, a.end, &a.name).cmp(&(b.begin, b.end, &b.name)));
    let mut end = 0u64;
    let mut prev: Option<&Entry> = None;
    for e in &entries {
        if e.begin != end {
            return Err(match prev {
                Some(p) if e.begin < end => format!(
                    "tensors '{}' (data_offsets [{}, {}]) and '{}' (data_offsets [{}, {}]) overlap",
                    p.name, p.begin, p.end, e.name, e.begin, e.end
                ),
                Some(p) => format!(
                    "tensor '{}' (data_offsets [{}, {}]) starts at byte {} of the data section but \
                     the tensor before it, '{}', ends at byte {end}: bytes {end}..{} belong to no \
                     tensor (safetensors files hold their tensors back to back)",
                    e.name, e.begin, e.end, e.begin, p.name, e.begin
                ),
                None => format!(
                    "the first tensor, '{}' (data_offsets [{}, {}]), starts at byte {} of the data \
                     section: bytes 0..{} belong to no tensor (safetensors files hold their tensors \
                     back to back from byte 0)",
                    e.name, e.begin, e.end, e.begin, e.begin
                ),
            });
        }
        end = e.end;
        prev = Some(e);
    }
    if end > data_len {
        let name = prev.map_or("", |e| e.name.as_str());
        return Err(format!(
            "file is truncated: header promises {end} bytes of tensor data (tensor '{name}' ends \
             at byte {end} of the data section), file holds {data_len}"
        ));
    }
    if end < data_len {
        return Err(match prev {
            Some(e) => format!(
                "data section holds {data_len} bytes but the last tensor ('{}') ends at byte \
                 {end}: {} unexpected trailing bytes",
                e.name,
                data_len - end
            ),
            None => {
                format!("header declares no tensors but the data section holds {data_len} bytes")
            }
        });
    }

    let tensors = entries
        .into_iter()
        .map(|e| TensorInfo {
            offset: data_start + e.begin,
            nbytes: e.end - e.begin,
            name: e.name,
            dtype: e.dtype,
            shape: e.shape,
        })
        .collect();
    Ok(Header {
        tensors,
        metadata,
        data_start,
    })
}

fn parse_metadata(value: &Value) -> std::result::Result<HashMap<String, String>, String> {
    let Value::Object(obj) = value else {
        return Err(format!(
            "__metadata__ must be an object of string values, found {}",
            describe(value)
        ));
    };
    obj.iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k.clone(), s.clone())),
            other => Err(format!(
                "__metadata__ must map strings to strings; key '{k}' holds {}",
                describe(other)
            )),
        })
        .collect()
}

fn parse_entry(name: String, value: &Value) -> std::result::Result<Entry, String> {
    let Value::Object(obj) = value else {
        return Err(format!(
            "tensor '{name}': entry must be an object with dtype, shape and data_offsets, found {}",
            describe(value)
        ));
    };
    let dtype = match obj.get("dtype") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(format!(
                "tensor '{name}': dtype must be a string, found {}",
                describe(other)
            ))
        }
        None => return Err(format!("tensor '{name}': missing field \"dtype\"")),
    };
    let Some(bits) = dtype_bits(&dtype) else {
        return Err(format!(
            "tensor '{name}': unknown dtype \"{dtype}\" (expected one of {})",
            KNOWN_DTYPES.join(", ")
        ));
    };
    let shape = match obj.get("shape") {
        Some(Value::Array(dims)) => dims
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<Vec<usize>>>(),
        Some(_) => None,
        None => return Err(format!("tensor '{name}': missing field \"shape\"")),
    };
    let Some(shape) = shape else {
        return Err(format!(
            "tensor '{name}': shape must be an array of non-negative integers, found {}",
            obj.get("shape").map_or_else(String::new, describe)
        ));
    };
    let offsets = match obj.get("data_offsets") {
        Some(Value::Array(o)) if o.len() == 2 => o[0].as_u64().zip(o[1].as_u64()),
        Some(_) => None,
        None => return Err(format!("tensor '{name}': missing field \"data_offsets\"")),
    };
    let Some((begin, end)) = offsets else {
        return Err(format!(
            "tensor '{name}': data_offsets must be [begin, end] with non-negative integers, found {}",
            obj.get("data_offsets").map_or_else(String::new, describe)
        ));
    };
    if end < begin {
        return Err(format!(
            "tensor '{name}': data_offsets [{begin}, {end}] end before they begin"
        ));
    }
    let elements = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
    let total_bits = elements.and_then(|n| n.checked_mul(bits as u64));
    let Some(total_bits) = total_bits else {
        return Err(format!(
            "tensor '{name}': shape {shape:?} of {dtype} is too large (byte size overflows)"
        ));
    };
    if total_bits % 8 != 0 {
        return Err(format!(
            "tensor '{name}': shape {shape:?} of {dtype} ({bits}-bit elements) is {total_bits} \
             bits, not a whole number of bytes"
        ));
    }
    let expected = total_bits / 8;
    let found = end - begin;
    if found != expected {
        return Err(format!(
            "tensor '{name}': data_offsets [{begin}, {end}] span {found} bytes, expected \
             {expected} bytes ({dtype} x shape {shape:?})"
        ));
    }
    Ok(Entry {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

/// A short description of a JSON value for error messages.
fn describe(value: &Value) -> String {
    const MAX: usize = 60;
    let text = value.to_string();
    if text.chars().count() <= MAX {
        text
    } else {
        let cut: String = text.chars().take(MAX).collect();
        format!("{cut}...")
    }
}

/// A safetensors file mapped read-only, with a validated tensor index.
#[derive(Debug)]
pub struct SafetensorsIndex {
    path: PathBuf,
    mmap: Mmap,
    header: Header,
    by_name: HashMap<String, usize>,
    file_len: u64,
    mtime: Option<SystemTime>,
}

impl SafetensorsIndex {
    /// Opens, maps and validates a safetensors file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let io = |source| CoreError::Io {
            path: shown.clone(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(CoreError::Checkpoint {
                path: shown,
                reason: "not a regular file".into(),
            });
        }
        let file_len = meta.len();
        if file_len < 8 {
            return Err(CoreError::Checkpoint {
                path: shown,
                reason: too_short(file_len),
            });
        }
        let mtime = meta.modified().ok();
        // SAFETY: the file is opened read-only and the mapping is never
        // written through. Another process could still modify or truncate the
        // file while it is mapped; callers detect that with the size/mtime
        // check in `check_unchanged` before trusting the bytes again.
        #[allow(unsafe_code)]
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        if mmap.len() as u64 != file_len {
            return Err(CoreError::Checkpoint {
                path: shown,
                reason: format!(
                    "file changed while opening it (size {file_len} bytes, mapped {} bytes)",
                    mmap.len()
                ),
            });
        }
        let header = parse_header(&shown, &mmap)?;
        Ok(Self::assemble(
            path.to_path_buf(),
            mmap,
            header,
            file_len,
            mtime,
        ))
    }

    fn assemble(
        path: PathBuf,
        mmap: Mmap,
        header: Header,
        file_len: u64,
        mtime: Option<SystemTime>,
    ) -> Self {
        let by_name = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Self {
            path,
            mmap,
            header,
            by_name,
            file_len,
            mtime,
        }
    }

    /// Parses the complete file held in `bytes` and returns its tensors,
    /// sorted by offset. `name` is only used in error messages.
    pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<Vec<TensorInfo>> {
        parse_header(name, bytes).map(|h| h.tensors)
    }

    /// All tensors, sorted by offset.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name
            .get(name)
            .and_then(|&i| self.header.tensors.get(i))
    }

    /// The `__metadata__` map, if the file has one.
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.header.metadata.as_ref()
    }

    /// The bytes of tensor `name` inside the mapping.
    pub fn data(&self, name: &str) -> Option<&[u8]> {
        let t = self.get(name)?;
        let start = usize::try_from(t.offset).ok()?;
        let end = start.checked_add(usize::try_from(t.nbytes).ok()?)?;
        self.mmap.get(start..end)
    }

    /// The path the file was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File size in bytes when opened.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Modification time when opened, where the platform reports one.
    pub fn mtime(&self) -> Option<SystemTime> {
        self.mtime
    }

    /// Absolute offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.header.data_start
    }

    /// The whole mapped file.
    pub fn mmap_bytes(&self) -> &[u8] {
        &self.mmap
    }

    /// The address range of the mapping (for registering it as pinned memory).
    pub fn as_ptr_range(&self) -> std::ops::Range<*const u8> {
        self.mmap.as_ptr_range()
    }

    /// Checks that the file on disk still has the size and modification time
    /// it had when opened; an error means the mapped bytes can no longer be
    /// trusted and the file must be reopened.
    pub fn check_unchanged(&self) -> Result<()> {
        let shown = self.path.display().to_string();
        let meta = std::fs::metadata(&self.path).map_err(|source| CoreError::Io {
            path: shown.clone(),
            source,
        })?;
        let changed = |reason: String| CoreError::Checkpoint {
            path: shown.clone(),
            reason,
        };
        if meta.len() != self.file_len {
            return Err(changed(format!(
                "file changed on disk since it was opened (size {} -> {} bytes); reopen it",
                self.file_len,
                meta.len()
            )));
        }
        if meta.modified().ok() != self.mtime {
            return Err(changed(
                "file changed on disk since it was opened (modification time differs); reopen it"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Reads a sharded-checkpoint index (`model.safetensors.index.json`) and
/// returns its `weight_map`: tensor name to shard file name.
///
/// Shard names must be relative paths without `..` components.
pub fn read_shard_index(path: impl AsRef<Path>) -> Result<BTreeMap<String, String>> {
    let path = path.as_ref();
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| CoreError::Io {
        path: shown.clone(),
        source,
    })?;
    parse_shard_index(&text).map_err(|reason| CoreError::ShardIndex {
        path: shown,
        reason,
    })
}

fn parse_shard_index(text: &str) -> std::result::Result<BTreeMap<String, String>, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON ({e})"))?;
    let Value::Object(obj) = value else {
        return Err(format!(
            "expected a JSON object with a \"weight_map\" field, found {}",
            describe(&value)
        ));
    };
    let map = match obj.get("weight_map") {
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(format!(
                "\"weight_map\" must be an object of tensor name -> file name, found {}",
                describe(other)
            ))
        }
        None => return Err("missing field \"weight_map\"".into()),
    };
    map.iter()
        .map(|(tensor, file)| {
            let Value::String(file) = file else {
                return Err(format!(
                    "weight_map entry for tensor '{tensor}' must be a file name string, found {}",
                    describe(file)
                ));
            };
            let p = Path::new(file);
            let bad = file.is_empty()
                || p.is_absolute()
                || p.components()
                    .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir));
            if bad {
                return Err(format!(
                    "weight_map entry for tensor '{tensor}' names \"{file}\", expected a relative \
                     file name without '..'"
                ));
            }
            Ok((tensor.clone(), file.clone()))
        })
        .collect()
}
