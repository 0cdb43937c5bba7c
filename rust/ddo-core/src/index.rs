//! A validated index of a safetensors file's header, read with positional reads (no memory map).
//!
//! The format: an 8-byte little-endian header length `N`, `N` bytes of JSON
//! mapping tensor names to `{"dtype", "shape", "data_offsets": [begin, end]}`
//! (offsets relative to the data section) plus an optional `__metadata__`
//! string map, then the data section.
//!
//! Everything is checked up front so later code can read tensors at their
//! offsets without further checks: every error names the file, the tensor, and what was
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
    let Some(prefix) = bytes.first_chunk::<8>() else {
        return Err(err(too_short(file_len)));
    };
    let header_len = header_len(*prefix, file_len).map_err(err)?;
    // `header_len` checks that the JSON lies inside the file.
    let json = usize::try_from(8 + header_len)
        .ok()
        .and_then(|end| bytes.get(8..end))
        .ok_or_else(|| err("header range out of bounds".into()))?;
    parse_json_header(json, file_len).map_err(err)
}

/// The JSON length an 8-byte prefix declares, checked against the file size and the limit.
fn header_len(prefix: [u8; 8], file_len: u64) -> std::result::Result<u64, String> {
    let header_len = u64::from_le_bytes(prefix);
    let after = file_len.saturating_sub(8);
    if header_len > after {
        return Err(format!(
            "header length prefix says {header_len} bytes of JSON, but only {after} bytes follow \
             the 8-byte prefix (file is {file_len} bytes)"
        ));
    }
    if header_len > MAX_HEADER_BYTES {
        return Err(format!(
            "header is {header_len} bytes, larger than the {MAX_HEADER_BYTES}-byte limit"
        ));
    }
    Ok(header_len)
}

/// Validates the JSON header `json` (the bytes after the prefix) of a file of `file_len` bytes.
fn parse_json_header(json: &[u8], file_len: u64) -> std::result::Result<Header, String> {
    let text = std::str::from_utf8(json).map_err(|e| format!("header is not valid UTF-8 ({e})"))?;
    let value = parse_json(text)?;
    let Value::Object(map) = value else {
        return Err(format!(
            "header must be a JSON object mapping tensor names to {{dtype, shape, data_offsets}}, \
             found {}",
            describe(&value)
        ));
    };
    let data_start = 8 + json.len() as u64;
    let data_len = file_len.saturating_sub(data_start);
    build_header(map, data_start, data_len)
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

/// What identifies a file's contents on disk, as `fstat`/`stat` report it.
///
/// A rewrite keeps the inode but moves the status-change time (`ctime`), which no user call can
/// set back, even when the modification time is restored (`cp -p`, `rsync -a`, `tar`); a file
/// renamed over the path has another inode. The index keeps its file open, so the inode cannot be
/// freed and its number reused by a new file while the index lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// What differs from `then`, the stamp of the same inode when the file was opened.
    fn changes_since(&self, then: &Stamp) -> Option<String> {
        if self.len != then.len {
            Some(format!("size {} -> {} bytes", then.len, self.len))
        } else if self.mtime != then.mtime {
            Some(format!(
                "modification time {} -> {}",
                fmt_time(then.mtime),
                fmt_time(self.mtime)
            ))
        } else if self.ctime != then.ctime {
            Some(format!(
                "same size and modification time, but its status-change time moved {} -> {}: \
                 rewritten in place with the modification time restored (cp -p, rsync -a, tar), or \
                 its permissions or links changed",
                fmt_time(then.ctime),
                fmt_time(self.ctime)
            ))
        } else {
            None
        }
    }
}

fn fmt_time((secs, nsec): (i64, i64)) -> String {
    format!("{secs}.{nsec:09}")
}

/// A safetensors file's validated tensor index. Only the header is read (positional reads of the
/// prefix and the JSON); the file stays open, unmapped, so that reads go to the file that was
/// validated and [`check_unchanged`](Self::check_unchanged) can tell a rewrite from a replacement.
#[derive(Debug)]
pub struct SafetensorsIndex {
    path: PathBuf,
    file: File,
    header: Header,
    by_name: HashMap<String, usize>,
    stamp: Stamp,
    mtime: Option<SystemTime>,
}

impl SafetensorsIndex {
    /// Opens a safetensors file and reads and validates its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        use std::os::unix::fs::FileExt;
        let path = path.as_ref();
        let shown = path.display().to_string();
        let io = |source| CoreError::Io {
            path: shown.clone(),
            source,
        };
        let bad = |reason: String| CoreError::Checkpoint {
            path: shown.clone(),
            reason,
        };
        // A FIFO or a device would block the open or the reads forever: refuse it before opening.
        if !std::fs::metadata(path).map_err(io)?.is_file() {
            return Err(bad("not a regular file".into()));
        }
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(bad("not a regular file".into()));
        }
        let stamp = Stamp::of(&meta);
        let file_len = stamp.len;
        if file_len < 8 {
            return Err(bad(too_short(file_len)));
        }
        let mut prefix = [0u8; 8];
        file.read_exact_at(&mut prefix, 0).map_err(io)?;
        let json_len = header_len(prefix, file_len).map_err(bad)?;
        // At most MAX_HEADER_BYTES (checked by `header_len`); reserved fallibly all the same.
        let json_len = usize::try_from(json_len).map_err(|_| bad("header too large".into()))?;
        let mut json = Vec::new();
        json.try_reserve_exact(json_len).map_err(|_| {
            bad(format!(
                "cannot allocate {json_len} bytes of host memory for the header"
            ))
        })?;
        json.resize(json_len, 0);
        file.read_exact_at(&mut json, 8).map_err(io)?;
        let header = parse_json_header(&json, file_len).map_err(bad)?;
        let after = file.metadata().map_err(io)?;
        if let Some(change) = Stamp::of(&after).changes_since(&stamp) {
            return Err(bad(format!(
                "file changed while its header was read ({change}); open it again once it is \
                 completely written"
            )));
        }
        let by_name = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            file,
            header,
            by_name,
            stamp,
            mtime: meta.modified().ok(),
        })
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

    /// Reads tensor `name`'s bytes into `buf` (exactly its size) with a positional read of the
    /// file that was validated. `Ok(false)` when there is no such tensor.
    pub fn read_tensor(&self, name: &str, buf: &mut [u8]) -> Result<bool> {
        use std::os::unix::fs::FileExt;
        let Some(t) = self.get(name) else {
            return Ok(false);
        };
        if buf.len() as u64 != t.nbytes {
            return Err(CoreError::InvalidArgument(format!(
                "tensor '{name}' of {} is {} bytes, but the buffer holds {}",
                self.path.display(),
                t.nbytes,
                buf.len()
            )));
        }
        self.file
            .read_exact_at(buf, t.offset)
            .map_err(|source| CoreError::Io {
                path: self.path.display().to_string(),
                source,
            })?;
        Ok(true)
    }

    /// The open file the header was read from (for positional reads of its tensors).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The path the file was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File size in bytes when opened.
    pub fn file_len(&self) -> u64 {
        self.stamp.len
    }

    /// Modification time when opened, where the platform reports one.
    pub fn mtime(&self) -> Option<SystemTime> {
        self.mtime
    }

    /// Absolute offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.header.data_start
    }

    /// Checks that the path still names the file that was opened and that this file was not
    /// modified since: same device and inode (`stat` of the path against `fstat` of the open
    /// descriptor: a file renamed over the path is another inode), same size, modification time
    /// and status-change time (a rewrite that restores the modification time still moves the
    /// latter). An error means the index no longer describes the file: reopen it.
    pub fn check_unchanged(&self) -> Result<()> {
        use std::os::unix::fs::MetadataExt;
        let shown = self.path.display().to_string();
        let io = |source| CoreError::Io {
            path: shown.clone(),
            source,
        };
        let changed = |what: String| CoreError::Checkpoint {
            path: shown.clone(),
            reason: format!("file changed on disk since it was opened ({what}); reopen it"),
        };
        let on_path = std::fs::metadata(&self.path).map_err(io)?;
        let open = self.file.metadata().map_err(io)?;
        if (on_path.dev(), on_path.ino()) != (open.dev(), open.ino()) {
            return Err(changed(format!(
                "the path now names another file, inode {} on device {:#x} instead of inode {} \
                 on device {:#x}: it was replaced, e.g. by a rename over it or a new download",
                on_path.ino(),
                on_path.dev(),
                open.ino(),
                open.dev()
            )));
        }
        match Stamp::of(&open).changes_since(&self.stamp) {
            Some(what) => Err(changed(what)),
            None => Ok(()),
        }
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
