//! Seeded mutation fuzzing of the safetensors header parser, checked against the reference
//! implementation (the `safetensors` crate's `SafeTensors::read_metadata`).
//!
//! Valid files are mutated (byte flips, insertions, deletions, length-prefix changes, and edits of
//! the JSON: offsets, dtypes, shapes, repeated keys, removed or added entries, a truncated or
//! lengthened data section). For every mutant `parse_header` must not panic, and:
//! - when it accepts the file, the reference accepts it too, with the same tensors (names,
//!   dtypes, shapes, offsets) and metadata;
//! - when it refuses a file that the reference accepts, the reason is a repeated key (the only
//!   place where it is deliberately stricter: the reference keeps the last of two tensors of one
//!   name).
//!
//! A few hundred mutants run in the normal `cargo test`; `DDO_FUZZ_ITERS=100000` runs more, and
//! `DDO_FUZZ_SEED` picks another seed.

use std::collections::{BTreeMap, HashMap};

use ddo_core::{parse_header, CoreError};
use serde_json::{json, Value};

/// splitmix64: small, seeded, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// A header as an ordered list of entries, so that a key can appear twice.
#[derive(Clone, Debug)]
struct Doc {
    entries: Vec<(String, Value)>,
    data: Vec<u8>,
}

impl Doc {
    fn json(&self) -> String {
        let body: Vec<String> = self
            .entries
            .iter()
            .map(|(k, v)| format!("{}:{v}", Value::String(k.clone())))
            .collect();
        format!("{{{}}}", body.join(","))
    }

    fn bytes(&self) -> Vec<u8> {
        let json = self.json();
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json.as_bytes());
        out.extend_from_slice(&self.data);
        out
    }
}

/// Valid files: tensors of several dtypes, an empty one, a scalar, sub-byte dtypes, metadata.
fn seeds() -> Vec<Doc> {
    let specs: [&[(&str, &str, &[u64])]; 4] = [
        &[
            ("a", "F32", &[2, 3]),
            ("b", "BF16", &[5]),
            ("empty", "F16", &[0, 3]),
            ("scalar", "I64", &[]),
        ],
        &[("w", "U8", &[4]), ("q", "F4", &[6]), ("z", "BOOL", &[1])],
        &[
            ("layer.0.weight", "F16", &[3, 2]),
            ("layer.0.bias", "F64", &[2]),
        ],
        &[],
    ];
    specs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            let mut entries = Vec::new();
            if i % 2 == 0 {
                entries.push(("__metadata__".to_string(), json!({"format": "pt"})));
            }
            let mut offset = 0u64;
            for (name, dtype, shape) in spec.iter() {
                let bits = ddo_core::dtype_bits(dtype).unwrap() as u64;
                let n = shape.iter().product::<u64>() * bits / 8;
                entries.push((
                    name.to_string(),
                    json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}),
                ));
                offset += n;
            }
            let data = (0..offset).map(|b| (b * 37 % 251) as u8).collect();
            Doc { entries, data }
        })
        .collect()
}

const DTYPES: &[&str] = &[
    "U8",
    "I8",
    "F16",
    "BF16",
    "F32",
    "F64",
    "I64",
    "BOOL",
    "F4",
    "F6_E2M3",
    "C64",
    "U16",
    "F8_E4M3FNUZ",
    "u8",
    "",
    "Q4_K",
    "F32 ",
];

/// A random JSON value of some other type, for type confusion.
fn odd_value(rng: &mut Rng) -> Value {
    match rng.below(9) {
        0 => Value::Null,
        1 => json!(-1),
        2 => json!(1.5),
        3 => json!("7"),
        4 => json!([]),
        5 => json!({}),
        6 => json!(u64::MAX),
        7 => json!(true),
        _ => json!([1, 2, 3]),
    }
}

fn tensor_fields<'a>(
    doc: &'a mut Doc,
    rng: &mut Rng,
) -> Option<&'a mut serde_json::Map<String, Value>> {
    let tensors: Vec<usize> = (0..doc.entries.len())
        .filter(|&i| doc.entries[i].0 != "__metadata__" && doc.entries[i].1.is_object())
        .collect();
    if tensors.is_empty() {
        return None;
    }
    let i = *rng.pick(&tensors);
    doc.entries[i].1.as_object_mut()
}

/// One edit of the JSON or of the data section.
fn edit_doc(doc: &mut Doc, rng: &mut Rng) {
    match rng.below(14) {
        // move one offset a little, or anywhere
        0 | 1 => {
            if let Some(t) = tensor_fields(doc, rng) {
                if let Some(Value::Array(o)) = t.get_mut("data_offsets") {
                    if o.len() == 2 {
                        let k = rng.below(2);
                        let old = o[k].as_u64().unwrap_or(0);
                        let new = match rng.below(3) {
                            0 => old.wrapping_add(1 + rng.below(8) as u64),
                            1 => old.saturating_sub(1 + rng.below(8) as u64),
                            _ => rng.next() % 64,
                        };
                        o[k] = json!(new);
                    }
                }
            }
        }
        // shift a whole tensor (both offsets)
        2 => {
            if let Some(t) = tensor_fields(doc, rng) {
                if let Some(Value::Array(o)) = t.get_mut("data_offsets") {
                    let d = 1 + rng.below(6) as u64;
                    for v in o.iter_mut() {
                        *v = json!(v.as_u64().unwrap_or(0) + d);
                    }
                }
            }
        }
        3 => {
            let dtype = *rng.pick(DTYPES);
            if let Some(t) = tensor_fields(doc, rng) {
                t.insert("dtype".into(), json!(dtype));
            }
        }
        4 => {
            let choice = rng.below(4);
            let dim = rng.below(5) as u64;
            if let Some(t) = tensor_fields(doc, rng) {
                if let Some(Value::Array(s)) = t.get_mut("shape") {
                    match choice {
                        0 => s.push(json!(dim)),
                        1 => {
                            s.pop();
                        }
                        2 if !s.is_empty() => s[0] = json!(dim),
                        _ => s.reverse(),
                    }
                }
            }
        }
        // a field of another type, or removed, or an unknown one added
        5 => {
            let field = *rng.pick(&["dtype", "shape", "data_offsets", "extra"]);
            let value = odd_value(rng);
            let remove = rng.below(2) == 0;
            if let Some(t) = tensor_fields(doc, rng) {
                if remove {
                    t.remove(field);
                } else {
                    t.insert(field.into(), value);
                }
            }
        }
        // a key repeated: the same entry, or another tensor's entry under this name
        6 | 7 => {
            if !doc.entries.is_empty() {
                let i = rng.below(doc.entries.len());
                let j = rng.below(doc.entries.len());
                let dup = (doc.entries[i].0.clone(), doc.entries[j].1.clone());
                let at = rng.below(doc.entries.len() + 1);
                doc.entries.insert(at, dup);
            }
        }
        8 => {
            if !doc.entries.is_empty() {
                let i = rng.below(doc.entries.len());
                doc.entries.remove(i);
            }
        }
        9 => {
            let n = doc.data.len() as u64;
            doc.entries.push((
                format!("new{}", rng.below(3)),
                json!({"dtype": "U8", "shape": [2], "data_offsets": [n, n + 2]}),
            ));
            if rng.below(2) == 0 {
                doc.data.extend_from_slice(&[1, 2]);
            }
        }
        10 => {
            let cut = rng.below(doc.data.len() + 1);
            doc.data.truncate(cut);
        }
        11 => {
            let n = 1 + rng.below(8);
            doc.data.extend(std::iter::repeat_n(0xAB, n));
        }
        12 => {
            let value = match rng.below(4) {
                0 => Value::Null,
                1 => json!({"k": 1}),
                2 => json!("pt"),
                _ => json!({"k": "v", "format": "pt"}),
            };
            doc.entries.retain(|(k, _)| k != "__metadata__");
            doc.entries.insert(0, ("__metadata__".into(), value));
        }
        _ => {
            // swap two tensors' offsets (keeps a tiling, may break sizes)
            let tensors: Vec<usize> = (0..doc.entries.len())
                .filter(|&i| doc.entries[i].0 != "__metadata__")
                .collect();
            if tensors.len() >= 2 {
                let (a, b) = (*rng.pick(&tensors), *rng.pick(&tensors));
                let oa = doc.entries[a].1.get("data_offsets").cloned();
                let ob = doc.entries[b].1.get("data_offsets").cloned();
                if let (Some(oa), Some(ob)) = (oa, ob) {
                    if let Some(t) = doc.entries[a].1.as_object_mut() {
                        t.insert("data_offsets".into(), ob);
                    }
                    if let Some(t) = doc.entries[b].1.as_object_mut() {
                        t.insert("data_offsets".into(), oa);
                    }
                }
            }
        }
    }
}

/// One edit of the raw bytes.
fn edit_bytes(bytes: &mut Vec<u8>, rng: &mut Rng) {
    match rng.below(6) {
        0 if !bytes.is_empty() => {
            let i = rng.below(bytes.len());
            bytes[i] ^= 1 << rng.below(8);
        }
        1 if !bytes.is_empty() => {
            let i = rng.below(bytes.len());
            bytes[i] = *rng.pick(b"{}[],:\"0123456789-.e \x00\xff");
        }
        2 => {
            let i = rng.below(bytes.len() + 1);
            let n = 1 + rng.below(4);
            for _ in 0..n {
                bytes.insert(i, rng.next() as u8);
            }
        }
        3 if !bytes.is_empty() => {
            let i = rng.below(bytes.len());
            let n = (1 + rng.below(8)).min(bytes.len() - i);
            bytes.drain(i..i + n);
        }
        4 if bytes.len() >= 8 => {
            let mut prefix = [0u8; 8];
            prefix.copy_from_slice(&bytes[..8]);
            let n = u64::from_le_bytes(prefix);
            let new = match rng.below(5) {
                0 => n.wrapping_add(1),
                1 => n.wrapping_sub(1),
                2 => n.wrapping_add(rng.below(64) as u64),
                3 => u64::MAX - rng.below(4) as u64,
                _ => rng.next() % (bytes.len() as u64 + 8),
            };
            bytes[..8].copy_from_slice(&new.to_le_bytes());
        }
        _ => {
            let cut = rng.below(bytes.len() + 1);
            bytes.truncate(cut);
        }
    }
}

fn mutant(seeds: &[Doc], rng: &mut Rng) -> Vec<u8> {
    let mut doc = rng.pick(seeds).clone();
    let doc_edits = rng.below(3);
    for _ in 0..doc_edits {
        edit_doc(&mut doc, rng);
    }
    let mut bytes = doc.bytes();
    // mostly JSON-level mutants (which reach the validation), some byte-level ones
    let byte_edits = if doc_edits == 0 {
        1 + rng.below(3)
    } else {
        rng.below(4) / 3
    };
    for _ in 0..byte_edits {
        edit_bytes(&mut bytes, rng);
    }
    bytes
}

type Tensors = BTreeMap<String, (String, Vec<usize>, (usize, usize))>;

fn reference(bytes: &[u8]) -> Result<(Tensors, Option<HashMap<String, String>>), String> {
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
    let tensors = meta
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let dtype = format!("{:?}", info.dtype);
            (name, (dtype, info.shape.clone(), info.data_offsets))
        })
        .collect();
    Ok((tensors, meta.metadata().clone()))
}

#[test]
fn mutated_headers_never_panic_and_agree_with_the_reference() {
    let iters: usize = std::env::var("DDO_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let seed: u64 = std::env::var("DDO_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5AFE_7E45);
    let seeds = seeds();
    for doc in &seeds {
        parse_header("seed", &doc.bytes()).expect("seed files are valid");
        reference(&doc.bytes()).expect("the reference accepts the seed files");
    }
    let mut rng = Rng(seed);
    let (mut accepted, mut refused, mut stricter) = (0usize, 0usize, 0usize);
    for i in 0..iters {
        let bytes = mutant(&seeds, &mut rng);
        let shown = || String::from_utf8_lossy(&bytes).into_owned();
        let ours = std::panic::catch_unwind(|| parse_header("fuzz.safetensors", &bytes))
            .unwrap_or_else(|_| panic!("parse_header panicked on mutant {i}: {}", shown()));
        let theirs = reference(&bytes);
        match (ours, theirs) {
            (Ok(header), Ok((tensors, metadata))) => {
                accepted += 1;
                let data_start = header.data_start;
                let ours: Tensors = header
                    .tensors
                    .iter()
                    .map(|t| {
                        let begin = (t.offset - data_start) as usize;
                        let end = begin + t.nbytes as usize;
                        (
                            t.name.clone(),
                            (t.dtype.clone(), t.shape.clone(), (begin, end)),
                        )
                    })
                    .collect();
                assert_eq!(ours, tensors, "mutant {i} read differently: {}", shown());
                assert_eq!(header.metadata, metadata, "mutant {i}: {}", shown());
                assert_eq!(data_start as usize + end_of(&tensors), bytes.len());
            }
            (Ok(_), Err(e)) => {
                panic!(
                    "mutant {i} accepted but the reference refuses it ({e}): {}",
                    shown()
                )
            }
            (Err(e), theirs) => {
                assert!(
                    matches!(e, CoreError::Checkpoint { .. }),
                    "mutant {i}: {e:?}"
                );
                let msg = e.to_string();
                assert!(msg.contains("fuzz.safetensors"), "{msg}");
                if theirs.is_ok() {
                    stricter += 1;
                    assert!(
                        msg.contains("listed twice") || msg.contains("appears twice"),
                        "mutant {i} refused ({msg}) but the reference accepts it: {}",
                        shown()
                    );
                } else {
                    refused += 1;
                }
            }
        }
    }
    // the mutants reach every outcome
    assert!(iters < 300 || (accepted > 10 && refused > iters / 4 && stricter > 0));
    eprintln!("{iters} mutants: {accepted} accepted, {refused} refused by both, {stricter} refused for a repeated key");
}

fn end_of(tensors: &Tensors) -> usize {
    tensors.values().map(|t| t.2 .1).max().unwrap_or(0)
}
