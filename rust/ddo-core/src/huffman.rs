//! A lossless entropy code for bf16 weights: the exponent Huffman-coded, about 10.6 bits per value
//! (0.665 of bf16 on normal weights), against the two-tier code's 11 ([`crate::tiered`]) and the
//! fixed-rate code's 12 ([`crate::codec`]).
//!
//! Sign and mantissa stay one byte per value, as in the other codes. The exponent carries about
//! 2.55 bits of information; a canonical Huffman code per [`RANGE_ELEMS`] values (lengths limited to
//! [`MAX_LEN`] bits) sends it in about 2.6. The idea is DFloat11's (Apache-2.0); the format below
//! is this project's own.
//!
//! **Segments.** A range's codes are packed, most significant bit first, into 128-bit segments
//! that no code straddles: when the next code does not fit in what is left of a segment, the rest
//! is filled with that code's first bits and the code starts the next segment. A decoder that
//! holds one segment therefore knows where each of its codes starts: at the top, then one after
//! another, stopping where the code it reads is longer than the bits left (the filler is a proper
//! prefix of a code, so by the prefix property nothing shorter can match it). The last segment of
//! a range is filled with zeros; what a decoder reads from them lies past the range's values and is
//! dropped. A GPU thread decodes one segment (16 bytes, one load); a CUDA block decodes one range,
//! its threads' value counts turned into positions by a prefix sum.
//!
//! **A chunk** of `n` values (at most [`CHUNK_ELEMS`], ranges of [`RANGE_ELEMS`] values) is laid
//! out ([`huffman_layout`]) as `records | symbols | sign+mantissa bytes | segments`, each section
//! 16-byte aligned. Per range one [`RECORD_BYTES`]-byte record: its first segment and segment
//! count, its first symbol byte and symbol count (`u32` each, little-endian), then the number of
//! codes of each length `1..=16` (`u16` each). Its symbols (exponents) follow in canonical order
//! (by length, then by value). Every 16-bit pattern comes back exactly.
//!
//! This module is the reference: the CPU engine decodes with it, and the GPU kernel is checked
//! against it bit for bit.

use crate::codec::{CHUNK_ELEMS, SECTION_ALIGN, SUB_ELEMS};
use crate::error::{CoreError, Result};

/// Values per range: one code table, one CUDA block, its exponents held in shared memory (16 KiB).
/// A [`SUB_ELEMS`] range of the parallel encoders holds whole ones.
pub const RANGE_ELEMS: usize = 1 << 14;
const _: () =
    assert!(SUB_ELEMS.is_multiple_of(RANGE_ELEMS) && CHUNK_ELEMS.is_multiple_of(RANGE_ELEMS));

/// The longest code, in bits.
pub const MAX_LEN: usize = 16;
/// Bytes per segment.
pub const SEGMENT_BYTES: usize = 16;
/// Bits per segment.
pub const SEGMENT_BITS: u32 = 128;
/// Bytes of one range's record.
pub const RECORD_BYTES: usize = 16 + 2 * MAX_LEN;

const fn align16(n: usize) -> usize {
    n.div_ceil(SECTION_ALIGN) * SECTION_ALIGN
}

/// What the layout of one range needs: its symbols and its segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RangeCounts {
    /// Distinct exponents (the code's symbols).
    pub symbols: usize,
    /// 128-bit segments.
    pub segments: usize,
}

/// Where each section of a chunk sits (byte offsets from its start) and its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HuffmanLayout {
    /// Values.
    pub n: usize,
    /// Ranges ([`RANGE_ELEMS`] values each, the last one shorter).
    pub ranges: usize,
    /// Symbols of all ranges.
    pub symbols_total: usize,
    /// Segments of all ranges.
    pub segments_total: usize,
    /// The symbols, after the records (which start at 0).
    pub symbols: usize,
    /// Sign and mantissa, one byte per value.
    pub signs: usize,
    /// The segments.
    pub segments: usize,
    /// The chunk's size (a multiple of 16).
    pub nbytes: usize,
}

/// The layout of a chunk of `n` values whose ranges have these counts.
pub fn huffman_layout(n: usize, counts: &[RangeCounts]) -> HuffmanLayout {
    let symbols_total = counts.iter().map(|c| c.symbols).sum();
    let segments_total = counts.iter().map(|c| c.segments).sum();
    let symbols = align16(RECORD_BYTES * counts.len());
    let signs = symbols + align16(symbols_total);
    let segments = signs + align16(n);
    HuffmanLayout {
        n,
        ranges: counts.len(),
        symbols_total,
        segments_total,
        symbols,
        signs,
        segments,
        nbytes: segments + SEGMENT_BYTES * segments_total,
    }
}

/// Whether a chunk of `n` values with these counts is smaller coded than raw and no larger than
/// `max_bytes` (the landing buffer a GPU decode reads it from).
pub fn worth_coding(n: usize, counts: &[RangeCounts], max_bytes: usize) -> bool {
    let size = huffman_layout(n, counts).nbytes;
    n > 0 && size < 2 * n && size <= max_bytes
}

#[inline]
fn exponent(v: u16) -> usize {
    usize::from((v >> 7) & 0xff)
}

/// A canonical code: lengths per symbol, codes per symbol, symbols in canonical order and the
/// number of codes of each length.
#[derive(Debug, Clone)]
struct Code {
    len: [u8; 256],
    bits: [u16; 256],
    order: Vec<u8>,
    per_len: [u16; MAX_LEN],
}

/// Huffman code lengths for this histogram, at most [`MAX_LEN`] bits (counts are halved, keeping
/// every used symbol, until the tree is shallow enough: a range has at most 65536 values, so a
/// few halvings at most). A single symbol gets one bit.
fn code_lengths(hist: &[u32; 256]) -> [u8; 256] {
    let mut weights: Vec<(u64, usize)> = hist
        .iter()
        .enumerate()
        .filter(|(_, &c)| c > 0)
        .map(|(s, &c)| (u64::from(c), s))
        .collect();
    let mut len = [0u8; 256];
    if weights.len() == 1 {
        len[weights[0].1] = 1;
        return len;
    }
    loop {
        // nodes: leaves 0..k, then internal ones; parent links give each leaf its depth
        let k = weights.len();
        let mut parent = vec![usize::MAX; 2 * k];
        let mut heap = std::collections::BinaryHeap::new();
        for (i, &(w, _)) in weights.iter().enumerate() {
            heap.push(std::cmp::Reverse((w, i)));
        }
        let mut next = k;
        while heap.len() > 1 {
            let std::cmp::Reverse((wa, a)) = heap.pop().expect("two nodes");
            let std::cmp::Reverse((wb, b)) = heap.pop().expect("two nodes");
            parent[a] = next;
            parent[b] = next;
            heap.push(std::cmp::Reverse((wa + wb, next)));
            next += 1;
        }
        let mut depth = vec![0u8; next];
        for node in (0..next - 1).rev() {
            depth[node] = depth[parent[node]] + 1;
        }
        if depth[..k].iter().all(|&d| usize::from(d) <= MAX_LEN) {
            for (i, &(_, s)) in weights.iter().enumerate() {
                len[s] = depth[i];
            }
            return len;
        }
        for w in &mut weights {
            w.0 = w.0.div_ceil(2);
        }
    }
}

impl Code {
    /// The canonical code of these lengths (0: unused).
    fn canonical(len: [u8; 256]) -> Code {
        let mut order: Vec<u8> = (0..=255u8).filter(|&s| len[usize::from(s)] > 0).collect();
        order.sort_by_key(|&s| (len[usize::from(s)], s));
        let mut per_len = [0u16; MAX_LEN];
        for &s in &order {
            per_len[usize::from(len[usize::from(s)]) - 1] += 1;
        }
        let mut bits = [0u16; 256];
        let (mut code, mut prev) = (0u32, 0u8);
        for &s in &order {
            let l = len[usize::from(s)];
            if prev != 0 {
                code = (code + 1) << (l - prev);
            }
            prev = l;
            bits[usize::from(s)] = code as u16;
        }
        Code {
            len,
            bits,
            order,
            per_len,
        }
    }

    /// The code of this range's exponents.
    fn of(values: &[u16]) -> Code {
        let mut hist = [0u32; 256];
        for &v in values {
            hist[exponent(v)] += 1;
        }
        Code::canonical(code_lengths(&hist))
    }
}

/// Packs codes into segments: calls `flush` with each full segment.
struct Packer {
    seg: u128,
    used: u32,
}

impl Packer {
    fn new() -> Self {
        Packer { seg: 0, used: 0 }
    }

    #[inline(always)]
    fn push(&mut self, code: u16, len: u32, mut flush: impl FnMut(u128)) {
        if len > SEGMENT_BITS - self.used {
            let rest = SEGMENT_BITS - self.used;
            if rest > 0 {
                // the filler: the code's first `rest` bits
                self.seg |= u128::from(code >> (len - rest));
            }
            flush(self.seg);
            self.seg = 0;
            self.used = 0;
        }
        self.used += len;
        self.seg |= u128::from(code) << (SEGMENT_BITS - self.used);
    }

    fn finish(self, mut flush: impl FnMut(u128)) {
        if self.used > 0 {
            flush(self.seg);
        }
    }
}

/// The counts of one range of values (at most [`RANGE_ELEMS`], not empty).
pub fn count_range(values: &[u16]) -> RangeCounts {
    let code = Code::of(values);
    let mut segments = 0usize;
    let mut packer = Packer::new();
    for &v in values {
        let e = exponent(v);
        packer.push(code.bits[e], u32::from(code.len[e]), |_| segments += 1);
    }
    packer.finish(|_| segments += 1);
    RangeCounts {
        symbols: code.order.len(),
        segments,
    }
}

/// The counts of each [`RANGE_ELEMS`] range of `values` (a chunk, or a [`SUB_ELEMS`] part of one).
pub fn count_ranges(values: &[u16]) -> Vec<RangeCounts> {
    values.chunks(RANGE_ELEMS).map(count_range).collect()
}

/// A chunk's sections, split for writing.
pub struct HuffmanSections<'a> {
    /// One record per range.
    pub records: &'a mut [u8],
    /// The ranges' symbols.
    pub symbols: &'a mut [u8],
    /// Sign and mantissa bytes.
    pub signs: &'a mut [u8],
    /// The segments.
    pub segments: &'a mut [u8],
}

impl HuffmanLayout {
    /// Splits a buffer of exactly `self.nbytes` bytes into its sections, padding zeroed.
    pub fn split<'a>(&self, out: &'a mut [u8]) -> Result<HuffmanSections<'a>> {
        if out.len() != self.nbytes {
            return Err(CoreError::InvalidArgument(format!(
                "a Huffman chunk of {} values in {} ranges codes to {} bytes, the buffer has {}",
                self.n,
                self.ranges,
                self.nbytes,
                out.len()
            )));
        }
        out.fill(0);
        let (head, segments) = out.split_at_mut(self.segments);
        let (head, signs) = head.split_at_mut(self.signs);
        let (records, symbols) = head.split_at_mut(self.symbols);
        Ok(HuffmanSections {
            records,
            symbols,
            signs,
            segments,
        })
    }
}

/// Codes one range (`values`, at most [`RANGE_ELEMS`]) into its parts of the sections: `record`
/// ([`RECORD_BYTES`]), `symbols` (exactly its symbol count), `signs` (one per value) and
/// `segments` (exactly its segment count), the range's first symbol and segment in the chunk being
/// `first_symbol` and `first_segment`. Counts that do not match are an error (the values changed
/// since they were counted).
pub fn encode_range(
    values: &[u16],
    first_symbol: usize,
    first_segment: usize,
    record: &mut [u8],
    symbols: &mut [u8],
    signs: &mut [u8],
    segments: &mut [u8],
) -> Result<()> {
    let code = Code::of(values);
    let n_seg = segments.len() / SEGMENT_BYTES;
    if code.order.len() != symbols.len()
        || record.len() != RECORD_BYTES
        || signs.len() != values.len()
        || !segments.len().is_multiple_of(SEGMENT_BYTES)
    {
        return Err(CoreError::InvalidArgument(format!(
            "a Huffman range of {} values with {} symbols was given {} symbol bytes, {} sign bytes, \
             {} record bytes and {} segment bytes: the values changed since they were counted",
            values.len(),
            code.order.len(),
            symbols.len(),
            signs.len(),
            record.len(),
            segments.len()
        )));
    }
    let as_u32 = |n: usize| {
        u32::try_from(n).map_err(|_| {
            CoreError::InvalidArgument(format!("a Huffman chunk offset {n} over 32 bits"))
        })
    };
    record[0..4].copy_from_slice(&as_u32(first_segment)?.to_le_bytes());
    record[4..8].copy_from_slice(&as_u32(n_seg)?.to_le_bytes());
    record[8..12].copy_from_slice(&as_u32(first_symbol)?.to_le_bytes());
    record[12..16].copy_from_slice(&as_u32(code.order.len())?.to_le_bytes());
    for (l, &c) in code.per_len.iter().enumerate() {
        record[16 + 2 * l..18 + 2 * l].copy_from_slice(&c.to_le_bytes());
    }
    symbols.copy_from_slice(&code.order);
    let mut packer = Packer::new();
    let mut k = 0usize;
    let mut overflow = false;
    let mut write = |seg: u128| {
        if k < n_seg {
            segments[k * SEGMENT_BYTES..(k + 1) * SEGMENT_BYTES]
                .copy_from_slice(&seg.to_le_bytes());
        } else {
            overflow = true;
        }
        k += 1;
    };
    for (s, &v) in signs.iter_mut().zip(values) {
        *s = (((v >> 8) & 0x80) | (v & 0x7f)) as u8;
        let e = exponent(v);
        packer.push(code.bits[e], u32::from(code.len[e]), &mut write);
    }
    packer.finish(&mut write);
    if overflow || k != n_seg {
        return Err(CoreError::InvalidArgument(format!(
            "a Huffman range of {} values packs into {k} segments, {n_seg} were counted: the values \
             changed since they were counted",
            values.len()
        )));
    }
    Ok(())
}

/// Codes a whole chunk (ranges in turn; the parallel encoders call [`encode_range`] per range).
pub fn encode_chunk(values: &[u16], counts: &[RangeCounts], out: &mut [u8]) -> Result<()> {
    if values.len() > CHUNK_ELEMS || counts.len() != values.len().div_ceil(RANGE_ELEMS) {
        return Err(CoreError::InvalidArgument(format!(
            "a Huffman chunk of {} values (at most {CHUNK_ELEMS}) with {} range counts",
            values.len(),
            counts.len()
        )));
    }
    let lay = huffman_layout(values.len(), counts);
    let sec = lay.split(out)?;
    let (mut sym, mut seg) = (0usize, 0usize);
    for (r, (range, c)) in values.chunks(RANGE_ELEMS).zip(counts).enumerate() {
        let first = r * RANGE_ELEMS;
        encode_range(
            range,
            sym,
            seg,
            &mut sec.records[r * RECORD_BYTES..(r + 1) * RECORD_BYTES],
            &mut sec.symbols[sym..sym + c.symbols],
            &mut sec.signs[first..first + range.len()],
            &mut sec.segments[seg * SEGMENT_BYTES..(seg + c.segments) * SEGMENT_BYTES],
        )?;
        sym += c.symbols;
        seg += c.segments;
    }
    Ok(())
}

fn corrupt(msg: String) -> CoreError {
    CoreError::InvalidArgument(format!("corrupt Huffman chunk: {msg}"))
}

/// A range's decoding tables, read from its record and symbols and checked.
pub struct RangeCode {
    /// First segment, segment count.
    pub segments: (usize, usize),
    /// First symbol, symbol count.
    pub symbols: (usize, usize),
    /// Codes of each length `1..=16`.
    pub per_len: [u16; MAX_LEN],
}

impl RangeCode {
    /// Reads and checks range `r`'s record of a chunk with this layout.
    pub fn read(coded: &[u8], lay: &HuffmanLayout, r: usize) -> Result<RangeCode> {
        let rec = coded
            .get(r * RECORD_BYTES..(r + 1) * RECORD_BYTES)
            .ok_or_else(|| corrupt(format!("no record for range {r}")))?;
        let u =
            |i: usize| u32::from_le_bytes([rec[i], rec[i + 1], rec[i + 2], rec[i + 3]]) as usize;
        let per_len: [u16; MAX_LEN] =
            std::array::from_fn(|l| u16::from_le_bytes([rec[16 + 2 * l], rec[17 + 2 * l]]));
        let code = RangeCode {
            segments: (u(0), u(4)),
            symbols: (u(8), u(12)),
            per_len,
        };
        let n_sym: usize = per_len.iter().map(|&c| usize::from(c)).sum();
        // Kraft: at most 2^16 sixteen-bit leaves
        let kraft: u64 = per_len
            .iter()
            .enumerate()
            .map(|(l, &c)| u64::from(c) << (MAX_LEN - 1 - l))
            .sum();
        if code.symbols.1 != n_sym
            || !(1..=256).contains(&n_sym)
            || kraft > 1 << MAX_LEN
            || code
                .symbols
                .0
                .checked_add(n_sym)
                .is_none_or(|e| e > lay.symbols_total)
            || code.segments.1 == 0
            || code
                .segments
                .0
                .checked_add(code.segments.1)
                .is_none_or(|e| e > lay.segments_total)
        {
            return Err(corrupt(format!(
                "range {r}'s record (segments {:?}, symbols {:?}, lengths {per_len:?}) does not fit \
                 a chunk of {} segments and {} symbols",
                code.segments, code.symbols, lay.segments_total, lay.symbols_total
            )));
        }
        Ok(code)
    }
}

/// Canonical decoding by limits: for each length, the first code and one past the last
/// (left-aligned to 16 bits), and the index of its first symbol.
struct Limits {
    first: [u32; MAX_LEN + 1],
    end: [u32; MAX_LEN + 1],
    base: [u32; MAX_LEN + 1],
    /// Per [`TABLE_BITS`]-bit window, `(length << 16) | symbol index` of the code of at most that
    /// many bits it starts with, 0 where the code is longer (or none matches).
    table: Vec<u32>,
}

/// Windows the host decoder looks codes up in at once (the GPU kernel's table is as wide).
const TABLE_BITS: usize = 10;

impl Limits {
    fn new(per_len: &[u16; MAX_LEN]) -> Limits {
        let (mut first, mut end, mut base) = (
            [0u32; MAX_LEN + 1],
            [0u32; MAX_LEN + 1],
            [0u32; MAX_LEN + 1],
        );
        let (mut code, mut index) = (0u32, 0u32);
        for l in 1..=MAX_LEN {
            let c = u32::from(per_len[l - 1]);
            first[l] = code;
            base[l] = index;
            end[l] = (code + c) << (MAX_LEN - l);
            code = (code + c) << 1;
            index += c;
        }
        let mut limits = Limits {
            first,
            end,
            base,
            table: Vec::new(),
        };
        limits.table = (0..1u32 << TABLE_BITS)
            .map(
                |w| match limits.search(w << (MAX_LEN - TABLE_BITS), TABLE_BITS) {
                    Some((sym, len)) => (len << 16) | sym,
                    None => 0,
                },
            )
            .collect();
        limits
    }

    /// The code of at most `longest` bits at the top of `window`, by the limits.
    fn search(&self, window: u32, longest: usize) -> Option<(u32, u32)> {
        (1..=longest).find_map(|l| {
            (window < self.end[l] && self.end[l] != 0 && (window >> (MAX_LEN - l)) >= self.first[l])
                .then(|| {
                    (
                        self.base[l] + (window >> (MAX_LEN - l)) - self.first[l],
                        l as u32,
                    )
                })
        })
    }

    /// The symbol index and length of the code at the top of `window` (16 bits), `None` when no
    /// code matches (only an incomplete code: a range of one exponent).
    #[inline]
    fn decode(&self, window: u32) -> Option<(u32, u32)> {
        match self.table[(window >> (MAX_LEN - TABLE_BITS)) as usize] {
            0 => self.search(window, MAX_LEN),
            e => Some((e & 0xffff, e >> 16)),
        }
    }
}

/// Decodes one segment: calls `value` with each symbol index, in order, until the segment ends.
#[inline]
fn decode_segment(seg: u128, limits: &Limits, mut value: impl FnMut(u32) -> bool) {
    let (mut s, mut left) = (seg, SEGMENT_BITS);
    while left > 0 {
        let window = (s >> (SEGMENT_BITS - MAX_LEN as u32)) as u32;
        match limits.decode(window) {
            Some((sym, len)) if len <= left => {
                if !value(sym) {
                    return;
                }
                s <<= len;
                left -= len;
            }
            _ => return,
        }
    }
}

/// Decodes a chunk of `out.len()` values whose ranges have these counts. Bad input is an error
/// (never a panic); the values decoded are then unspecified.
pub fn decode_chunk(coded: &[u8], counts: &[RangeCounts], out: &mut [u16]) -> Result<()> {
    let n = out.len();
    if counts.len() != n.div_ceil(RANGE_ELEMS) {
        return Err(corrupt(format!(
            "{} range counts for {n} values",
            counts.len()
        )));
    }
    let lay = huffman_layout(n, counts);
    if coded.len() < lay.nbytes {
        return Err(corrupt(format!(
            "{} bytes, its layout needs {}",
            coded.len(),
            lay.nbytes
        )));
    }
    for (r, range) in out.chunks_mut(RANGE_ELEMS).enumerate() {
        decode_range(coded, &lay, r, r * RANGE_ELEMS, range)?;
    }
    Ok(())
}

/// Decodes range `r` of a chunk (values `first..first + out.len()`).
pub fn decode_range(
    coded: &[u8],
    lay: &HuffmanLayout,
    r: usize,
    first: usize,
    out: &mut [u16],
) -> Result<()> {
    if coded.len() < lay.nbytes || first + out.len() > lay.n {
        return Err(corrupt(format!(
            "{} bytes for a layout of {}, or values {first}..{} past its {}",
            coded.len(),
            lay.nbytes,
            first + out.len(),
            lay.n
        )));
    }
    let code = RangeCode::read(coded, lay, r)?;
    let syms = &coded[lay.symbols + code.symbols.0..lay.symbols + code.symbols.0 + code.symbols.1];
    let signs = &coded[lay.signs + first..lay.signs + first + out.len()];
    let limits = Limits::new(&code.per_len);
    let mut i = 0usize;
    let mut bad = false;
    for k in 0..code.segments.1 {
        let at = lay.segments + (code.segments.0 + k) * SEGMENT_BYTES;
        let seg = u128::from_le_bytes(coded[at..at + SEGMENT_BYTES].try_into().expect("16 bytes"));
        decode_segment(seg, &limits, |sym| {
            if i >= out.len() {
                // only the last segment's zero filler may decode past the range's values
                bad |= k + 1 < code.segments.1;
                return false;
            }
            let e = u16::from(syms[sym as usize]);
            let s = u16::from(signs[i]);
            out[i] = ((s & 0x80) << 8) | (e << 7) | (s & 0x7f);
            i += 1;
            true
        });
    }
    if bad || i != out.len() {
        return Err(corrupt(format!(
            "range {r} decodes to {i} values{}, it has {}",
            if bad { " before its last segment" } else { "" },
            out.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(values: &[u16]) -> HuffmanLayout {
        let counts = count_ranges(values);
        let lay = huffman_layout(values.len(), &counts);
        let mut coded = vec![0xAAu8; lay.nbytes];
        encode_chunk(values, &counts, &mut coded).unwrap();
        let mut back = vec![0u16; values.len()];
        decode_chunk(&coded, &counts, &mut back).unwrap();
        assert_eq!(back, values);
        lay
    }

    /// A fixed-seed generator (xorshift) and normal(0, sigma) bf16 values by Box-Muller.
    fn normal_bf16(n: usize, sigma: f32, seed: u64) -> Vec<u16> {
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64).max(1e-300)
        };
        (0..n)
            .map(|_| {
                let (u, v) = (next(), next());
                let x = ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32 * sigma;
                (x.to_bits() >> 16) as u16
            })
            .collect()
    }

    #[test]
    fn normal_weights_code_to_about_two_thirds() {
        let v = normal_bf16(3 * SUB_ELEMS + 1234, 0.02, 7);
        let lay = round_trip(&v);
        let ratio = lay.nbytes as f64 / (2 * v.len()) as f64;
        eprintln!("huffman ratio {ratio}");
        assert!((0.655..0.672).contains(&ratio), "ratio {ratio}");
    }

    #[test]
    fn every_pattern_and_edge_comes_back() {
        // all 65536 patterns (+-0, subnormals, Inf, NaN payloads), one range of a single exponent,
        // odd lengths, two exponents only
        let all: Vec<u16> = (0..=u16::MAX).collect();
        round_trip(&all);
        round_trip(&vec![0x3f80; 1000]);
        round_trip(&[0x8000; 17]);
        round_trip(&[0x0001]);
        let two: Vec<u16> = (0..5000u16)
            .map(|i| if i % 3 == 0 { 0x7f80 } else { 0x0001 })
            .collect();
        round_trip(&two);
        let mut heavy = normal_bf16(SUB_ELEMS + 3, 0.02, 3);
        for (i, v) in heavy.iter_mut().enumerate().step_by(97) {
            *v = (i as u16).wrapping_mul(40503); // a heavy tail of any exponent
        }
        round_trip(&heavy);
    }

    #[test]
    fn skewed_histograms_stay_within_sixteen_bits() {
        // Fibonacci-like counts force a deep Huffman tree; the limit must hold and the code stay exact
        let mut v = Vec::new();
        let (mut a, mut b) = (1usize, 1usize);
        for e in 1..25u16 {
            v.extend(std::iter::repeat_n(e << 7, a));
            (a, b) = (b, a + b);
            if v.len() > RANGE_ELEMS {
                break;
            }
        }
        v.truncate(RANGE_ELEMS);
        let code = Code::of(&v);
        assert!(code.len.iter().all(|&l| usize::from(l) <= MAX_LEN));
        assert!(code.len.iter().any(|&l| l > 8));
        round_trip(&v);
    }

    #[test]
    fn no_code_straddles_a_segment_and_fillers_stop_the_decoder() {
        // geometric exponents: codes of 1 to 16 bits, meeting segment ends in every phase
        let mut s = 0x9e3779b97f4a7c15u64;
        let v: Vec<u16> = (0..3 * RANGE_ELEMS)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let e = (s.trailing_zeros() as u16).min(30) + 100;
                (e << 7) | ((s >> 40) as u16 & 0x807f)
            })
            .collect();
        let code = Code::of(&v[..RANGE_ELEMS]);
        let longest = code.len.iter().copied().max().unwrap();
        assert!(code.len.contains(&1) && longest >= 11, "{longest}");
        round_trip(&v);
    }

    #[test]
    fn corrupt_chunks_are_errors_not_panics() {
        let v = normal_bf16(RANGE_ELEMS + 100, 0.02, 11);
        let counts = count_ranges(&v);
        let lay = huffman_layout(v.len(), &counts);
        let mut coded = vec![0u8; lay.nbytes];
        encode_chunk(&v, &counts, &mut coded).unwrap();
        let mut out = vec![0u16; v.len()];
        let mut errors = 0;
        // every byte of the records and symbols, every 13th of the rest
        let spots = (0..lay.signs).chain((lay.signs..lay.nbytes).step_by(13));
        for at in spots {
            for x in [0u8, 0xff, 0x55] {
                let mut bad = coded.clone();
                bad[at] = x;
                errors += usize::from(decode_chunk(&bad, &counts, &mut out).is_err());
            }
        }
        assert!(errors > 0);
        assert!(decode_chunk(&coded[..lay.nbytes - 1], &counts, &mut out).is_err());
        assert!(decode_chunk(&coded, &counts[..1], &mut out).is_err());
        let mut wrong = counts.clone();
        wrong[0].segments += 1;
        let mut buf = vec![0u8; huffman_layout(v.len(), &wrong).nbytes];
        assert!(encode_chunk(&v, &wrong, &mut buf).is_err());
    }
}
