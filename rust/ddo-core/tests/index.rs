//! Safetensors index tests over hand-built files.

use std::path::PathBuf;

use ddo_core::{read_shard_index, CoreError, SafetensorsIndex};
use serde_json::json;

/// 8-byte little-endian header length + JSON + data.
fn build(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    build_raw(header.to_string().as_bytes(), data)
}

fn build_raw(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// Tensor `name`'s bytes, read through the index.
fn read(idx: &SafetensorsIndex, name: &str) -> Vec<u8> {
    let mut buf = vec![0u8; idx.get(name).unwrap().nbytes as usize];
    assert!(idx.read_tensor(name, &mut buf).unwrap());
    buf
}

fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Opens the bytes as a file and returns the error message.
fn open_err(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = write(&dir, "m.safetensors", bytes);
    let err = SafetensorsIndex::open(&p).unwrap_err();
    assert!(matches!(err, CoreError::Checkpoint { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.starts_with("invalid safetensors file "), "{msg}");
    assert!(msg.contains("m.safetensors"), "{msg}");
    // The in-memory parser agrees with the file-based one.
    let mem = SafetensorsIndex::from_bytes("mem", bytes)
        .unwrap_err()
        .to_string();
    assert_eq!(
        mem.split_once(": ").unwrap().1,
        msg.split_once(": ").unwrap().1
    );
    msg
}

fn good_file() -> Vec<u8> {
    let header = json!({
        "__metadata__": {"format": "pt"},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        "a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
        "empty": {"dtype": "F16", "shape": [0, 3], "data_offsets": [12, 12]},
        "scalar": {"dtype": "I64", "shape": [], "data_offsets": [12, 20]},
    });
    let data: Vec<u8> = (0u8..20).collect();
    build(&header, &data)
}

#[test]
fn opens_valid_file() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = good_file();
    let p = write(&dir, "m.safetensors", &bytes);
    let idx = SafetensorsIndex::open(&p).unwrap();
    let names: Vec<&str> = idx.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "empty", "scalar"]);
    let start = idx.data_start();
    assert_eq!(start, bytes.len() as u64 - 20);
    let a = idx.get("a").unwrap();
    assert_eq!(
        (a.dtype.as_str(), a.shape.as_slice(), a.offset, a.nbytes),
        ("BF16", &[2][..], start, 4)
    );
    let b = idx.get("b").unwrap();
    assert_eq!(b.offset, start + 4);
    assert_eq!(read(&idx, "b"), [4, 5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(read(&idx, "empty"), [] as [u8; 0]);
    assert_eq!(idx.get("empty").unwrap().shape, vec![0, 3]);
    assert_eq!(read(&idx, "scalar"), [12, 13, 14, 15, 16, 17, 18, 19]);
    assert!(idx.get("missing").is_none());
    assert!(!idx.read_tensor("missing", &mut []).unwrap());
    let err = idx.read_tensor("b", &mut [0; 3]).unwrap_err();
    assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("'b'") && err.to_string().contains("8 bytes"));
    assert_eq!(
        idx.metadata().unwrap().get("format").map(String::as_str),
        Some("pt")
    );
    assert_eq!(idx.file_len(), bytes.len() as u64);
    assert_eq!(idx.path(), p.as_path());
    assert!(idx.mtime().is_some());
    idx.check_unchanged().unwrap();
}

#[test]
fn empty_header_no_tensors() {
    let bytes = build(&json!({}), &[]);
    assert!(SafetensorsIndex::from_bytes("x", &bytes)
        .unwrap()
        .is_empty());
    let bytes = build_raw(b"{}   ", &[]); // padded header
    assert!(SafetensorsIndex::from_bytes("x", &bytes)
        .unwrap()
        .is_empty());
}

#[test]
fn no_metadata_is_none() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = build(
        &json!({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}),
        &[7],
    );
    let idx = SafetensorsIndex::open(write(&dir, "m.safetensors", &bytes)).unwrap();
    assert!(idx.metadata().is_none());
    assert_eq!(read(&idx, "a"), [7]);
}

#[test]
fn sub_byte_dtype() {
    let ok = build(
        &json!({"q": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}),
        &[0, 0],
    );
    assert_eq!(SafetensorsIndex::from_bytes("x", &ok).unwrap()[0].nbytes, 2);
    let odd = build(
        &json!({"q": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}),
        &[0, 0],
    );
    let msg = SafetensorsIndex::from_bytes("x", &odd)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("'q'") && msg.contains("not a whole number of bytes"),
        "{msg}"
    );
}

#[test]
fn too_short() {
    let msg = open_err(&[1, 2, 3]);
    assert!(
        msg.contains("file is 3 bytes, shorter than the 8-byte header length prefix"),
        "{msg}"
    );
    let msg = open_err(&[]);
    assert!(msg.contains("file is 0 bytes"), "{msg}");
}

#[test]
fn header_longer_than_file() {
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    let msg = open_err(&bytes);
    assert!(
        msg.contains("header length prefix says 1000 bytes"),
        "{msg}"
    );
    assert!(msg.contains("only 2 bytes follow"), "{msg}");
    let bytes = u64::MAX.to_le_bytes();
    let msg = open_err(&bytes);
    assert!(msg.contains("only 0 bytes follow"), "{msg}");
}

#[test]
fn header_not_utf8_or_json() {
    let msg = open_err(&build_raw(&[0xff, 0xfe, b'{', b'}'], &[]));
    assert!(msg.contains("header is not valid UTF-8"), "{msg}");
    let msg = open_err(&build_raw(b"{\"a\": ", &[]));
    assert!(msg.contains("header is not valid JSON"), "{msg}");
    let msg = open_err(&build_raw(b"[1, 2]", &[]));
    assert!(
        msg.contains("header must be a JSON object") && msg.contains("[1,2]"),
        "{msg}"
    );
}

#[test]
fn unknown_dtype() {
    let msg = open_err(&build(
        &json!({"w": {"dtype": "Q4_K", "shape": [1], "data_offsets": [0, 1]}}),
        &[0],
    ));
    assert!(msg.contains("tensor 'w': unknown dtype \"Q4_K\""), "{msg}");
    assert!(msg.contains("BF16"), "{msg}");
}

#[test]
fn malformed_entries() {
    let cases = [
        (json!({"w": 3}), "tensor 'w': entry must be an object"),
        (
            json!({"w": {"shape": [1], "data_offsets": [0, 1]}}),
            "tensor 'w': missing field \"dtype\"",
        ),
        (
            json!({"w": {"dtype": 5, "shape": [1], "data_offsets": [0, 1]}}),
            "tensor 'w': dtype must be a string",
        ),
        (
            json!({"w": {"dtype": "U8", "data_offsets": [0, 1]}}),
            "tensor 'w': missing field \"shape\"",
        ),
        (
            json!({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}),
            "shape must be an array of non-negative integers, found [-1]",
        ),
        (
            json!({"w": {"dtype": "U8", "shape": [1]}}),
            "tensor 'w': missing field \"data_offsets\"",
        ),
        (
            json!({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0]}}),
            "data_offsets must be [begin, end]",
        ),
        (
            json!({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1.5]}}),
            "data_offsets must be [begin, end]",
        ),
        (
            json!({"__metadata__": {"k": 1}}),
            "__metadata__ must map strings to strings; key 'k' holds 1",
        ),
        (
            json!({"__metadata__": [1]}),
            "__metadata__ must be an object",
        ),
    ];
    for (header, want) in cases {
        let msg = open_err(&build(&header, &[0]));
        assert!(msg.contains(want), "want {want:?} in {msg}");
    }
}

#[test]
fn end_before_begin() {
    let msg = open_err(&build(
        &json!({"w": {"dtype": "U8", "shape": [1], "data_offsets": [5, 4]}}),
        &[0; 5],
    ));
    assert!(
        msg.contains("tensor 'w': data_offsets [5, 4] end before they begin"),
        "{msg}"
    );
}

#[test]
fn size_mismatch_names_tensor_expected_and_found() {
    let msg = open_err(&build(
        &json!({"layer.0.w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}}),
        &[0; 10],
    ));
    assert!(
        msg.contains("tensor 'layer.0.w': data_offsets [0, 10] span 10 bytes, expected 12 bytes (BF16 x shape [2, 3])"),
        "{msg}"
    );
}

#[test]
fn shape_overflow() {
    let big = u64::MAX / 2;
    let msg = open_err(&build(
        &json!({"w": {"dtype": "F32", "shape": [big, 4], "data_offsets": [0, 1]}}),
        &[0],
    ));
    assert!(
        msg.contains("tensor 'w'") && msg.contains("too large"),
        "{msg}"
    );
}

#[test]
fn truncated_file() {
    let header = json!({
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
    });
    let msg = open_err(&build(&header, &[0; 20]));
    assert!(
        msg.contains("file is truncated: header promises 32 bytes of tensor data (tensor 'b' ends at byte 32 of the data section), file holds 20"),
        "{msg}"
    );
}

#[test]
fn trailing_bytes() {
    let header = json!({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}});
    let msg = open_err(&build(&header, &[0; 5]));
    assert!(
        msg.contains("data section holds 5 bytes but the last tensor ('a') ends at byte 2: 3 unexpected trailing bytes"),
        "{msg}"
    );
    let msg = open_err(&build(&json!({}), &[0; 3]));
    assert!(
        msg.contains("declares no tensors but the data section holds 3 bytes"),
        "{msg}"
    );
}

#[test]
fn overlapping_tensors() {
    let header = json!({
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
    });
    let msg = open_err(&build(&header, &[0; 6]));
    assert!(
        msg.contains("tensors 'a' (data_offsets [0, 4]) and 'b' (data_offsets [2, 6]) overlap"),
        "{msg}"
    );
    // A zero-size tensor inside another one's range is refused, as by the reference.
    let header = json!({
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "z": {"dtype": "U8", "shape": [0], "data_offsets": [2, 2]},
    });
    let msg = open_err(&build(&header, &[0; 4]));
    assert!(
        msg.contains("tensors 'a' (data_offsets [0, 4]) and 'z' (data_offsets [2, 2]) overlap"),
        "{msg}"
    );
    // Where the previous tensor ends, it is fine.
    let header = json!({
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "z": {"dtype": "U8", "shape": [0], "data_offsets": [4, 4]},
    });
    assert_eq!(
        SafetensorsIndex::from_bytes("x", &build(&header, &[0; 4]))
            .unwrap()
            .len(),
        2
    );
}

#[test]
fn gap_between_tensors_is_refused() {
    let header = json!({
        "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
        "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]},
    });
    let msg = open_err(&build(&header, &[0; 6]));
    assert!(
        msg.contains(
            "tensor 'b' (data_offsets [4, 6]) starts at byte 4 of the data section but the tensor \
             before it, 'a', ends at byte 2: bytes 2..4 belong to no tensor"
        ),
        "{msg}"
    );
    let header = json!({"b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}});
    let msg = open_err(&build(&header, &[0; 5]));
    assert!(
        msg.contains("the first tensor, 'b' (data_offsets [3, 5]), starts at byte 3")
            && msg.contains("bytes 0..3 belong to no tensor"),
        "{msg}"
    );
}

#[test]
fn repeated_keys_are_refused_and_named() {
    let t = r#"{"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}"#;
    let cases = [
        (
            format!(r#"{{"a": {t}, "a": {t}}}"#),
            "tensor 'a' is listed twice in the header",
        ),
        // the same name, spelled with an escape
        (
            format!(r#"{{"a": {t}, "\u0061": {t}}}"#),
            "tensor 'a' is listed twice in the header",
        ),
        (
            format!(r#"{{"__metadata__": {{}}, "__metadata__": {{}}, "a": {t}}}"#),
            "the header has two \"__metadata__\" entries",
        ),
        (
            format!(r#"{{"__metadata__": {{"k": "1", "k": "2"}}, "a": {t}}}"#),
            "__metadata__: key 'k' appears twice",
        ),
        (
            r#"{"a": {"dtype": "U8", "dtype": "I8", "shape": [2], "data_offsets": [0, 2]}}"#
                .to_string(),
            "tensor 'a': field \"dtype\" appears twice",
        ),
        (
            r#"{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2], "x": {"y": 1, "y": 2}}}"#
                .to_string(),
            "tensor 'a': key \"y\" appears twice in its entry",
        ),
    ];
    for (header, want) in cases {
        let msg = open_err(&build_raw(header.as_bytes(), &[0; 2]));
        assert!(msg.contains(want), "want {want:?} in {msg}");
        assert!(msg.contains("header is malformed"), "{msg}");
    }
}

#[test]
fn null_metadata_is_none_as_in_the_reference() {
    let bytes = build(
        &json!({"__metadata__": null, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}),
        &[7],
    );
    let dir = tempfile::tempdir().unwrap();
    let idx = SafetensorsIndex::open(write(&dir, "m.safetensors", &bytes)).unwrap();
    assert!(idx.metadata().is_none());
}

#[test]
fn missing_file_is_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = SafetensorsIndex::open(dir.path().join("nope.safetensors")).unwrap_err();
    assert!(matches!(err, CoreError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("nope.safetensors"));
    let fifo = dir.path().join("pipe.safetensors");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let err = SafetensorsIndex::open(&fifo).unwrap_err(); // would block forever if opened
    assert!(err.to_string().contains("not a regular file"), "{err}");
    let err = SafetensorsIndex::open(dir.path()).unwrap_err();
    assert!(
        err.to_string().contains("not a regular file") || matches!(err, CoreError::Io { .. }),
        "{err}"
    );
}

#[test]
fn detects_change_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = good_file();
    let p = write(&dir, "m.safetensors", &bytes);
    let idx = SafetensorsIndex::open(&p).unwrap();
    let mut longer = bytes.clone();
    longer.push(0);
    std::fs::write(&p, &longer).unwrap();
    let msg = idx.check_unchanged().unwrap_err().to_string();
    assert!(
        msg.contains("changed on disk") && msg.contains("size"),
        "{msg}"
    );
}

/// Sets the modification time of `p` back to `mtime` until the status-change time differs from
/// `ctime` (timestamps have the kernel's coarse clock granularity).
fn restore_mtime_until_ctime_moves(p: &std::path::Path, mtime: std::time::SystemTime, ctime: i128) {
    use std::os::unix::fs::MetadataExt;
    for _ in 0..200 {
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(mtime).unwrap();
        let m = std::fs::metadata(p).unwrap();
        if m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128 != ctime {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("the status-change time of {} never moved", p.display());
}

fn ctime_ns(p: &std::path::Path) -> i128 {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).unwrap();
    m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128
}

#[test]
fn detects_a_same_size_rewrite_with_the_mtime_restored() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = good_file();
    let p = write(&dir, "m.safetensors", &bytes);
    let idx = SafetensorsIndex::open(&p).unwrap();
    let (mtime, ctime) = (
        std::fs::metadata(&p).unwrap().modified().unwrap(),
        ctime_ns(&p),
    );
    let mut other = bytes.clone();
    *other.last_mut().unwrap() ^= 0xFF;
    std::fs::write(&p, &other).unwrap(); // same inode, same size
    restore_mtime_until_ctime_moves(&p, mtime, ctime);
    assert_eq!(std::fs::metadata(&p).unwrap().modified().unwrap(), mtime);
    let msg = idx.check_unchanged().unwrap_err().to_string();
    assert!(
        msg.contains("changed on disk") && msg.contains("status-change time"),
        "{msg}"
    );
}

#[test]
fn detects_a_same_size_file_renamed_over_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = good_file();
    let p = write(&dir, "m.safetensors", &bytes);
    let idx = SafetensorsIndex::open(&p).unwrap();
    let meta = std::fs::metadata(&p).unwrap();
    let mut other = bytes.clone();
    *other.last_mut().unwrap() ^= 0xFF;
    let tmp = write(&dir, "new.tmp", &other);
    std::fs::File::options()
        .write(true)
        .open(&tmp)
        .unwrap()
        .set_modified(meta.modified().unwrap())
        .unwrap();
    std::fs::rename(&tmp, &p).unwrap();
    let msg = idx.check_unchanged().unwrap_err().to_string();
    assert!(
        msg.contains("changed on disk") && msg.contains("the path now names another file"),
        "{msg}"
    );
    // the index still reads the file it validated
    assert_eq!(read(&idx, "scalar"), [12, 13, 14, 15, 16, 17, 18, 19]);
}

#[test]
fn shard_index() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        &dir,
        "model.safetensors.index.json",
        json!({
            "metadata": {"total_size": 123},
            "weight_map": {
                "a.weight": "model-00001-of-00002.safetensors",
                "b.weight": "model-00002-of-00002.safetensors"
            }
        })
        .to_string()
        .as_bytes(),
    );
    let map = read_shard_index(&p).unwrap();
    assert_eq!(map.len(), 2);
    assert_eq!(map["a.weight"], "model-00001-of-00002.safetensors");
    assert_eq!(map["b.weight"], "model-00002-of-00002.safetensors");
}

#[test]
fn shard_index_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&[u8], &str); 6] = [
        (b"{", "not valid JSON"),
        (b"[]", "expected a JSON object with a \"weight_map\" field"),
        (b"{\"metadata\": {}}", "missing field \"weight_map\""),
        (b"{\"weight_map\": []}", "\"weight_map\" must be an object"),
        (
            b"{\"weight_map\": {\"a\": 1}}",
            "weight_map entry for tensor 'a' must be a file name string",
        ),
        (
            b"{\"weight_map\": {\"a\": \"../x.safetensors\"}}",
            "names \"../x.safetensors\"",
        ),
    ];
    for (text, want) in cases {
        let p = write(&dir, "i.json", text);
        let err = read_shard_index(&p).unwrap_err();
        assert!(matches!(err, CoreError::ShardIndex { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.starts_with("invalid sharded checkpoint index "),
            "{msg}"
        );
        assert!(msg.contains(want), "want {want:?} in {msg}");
    }
    let err = read_shard_index(dir.path().join("missing.json")).unwrap_err();
    assert!(matches!(err, CoreError::Io { .. }));
}

#[test]
fn random_garbage_never_panics() {
    // Deterministic xorshift garbage, plus corrupted variants of a good file.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let good = good_file();
    for _ in 0..2000 {
        let mut bytes = good.clone();
        let flips = (next() % 4 + 1) as usize;
        for _ in 0..flips {
            let i = (next() % bytes.len() as u64) as usize;
            bytes[i] = next() as u8;
        }
        let cut = (next() % (bytes.len() as u64 + 1)) as usize;
        let _ = SafetensorsIndex::from_bytes("fuzz", &bytes);
        let _ = SafetensorsIndex::from_bytes("fuzz", &bytes[..cut]);
    }
}
