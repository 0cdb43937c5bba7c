//! A lossless fixed-rate code for bf16 weights: 12 bits per value instead of 16.
//!
//! A bf16 value is `sign(1) exponent(8) mantissa(7)`. Sign and mantissa carry close to their full
//! entropy and are kept as they are (one byte per value); the exponent of trained and
//! random-normal weights alike sits in a narrow window below the largest one nearby, so it is sent
//! as a 4-bit code relative to a per-block base:
//!
//! | code   | exponent                                   |
//! |--------|--------------------------------------------|
//! | 0      | 0 (zero and subnormals)                    |
//! | 1..=14 | `base + code - 1`                          |
//! | 15     | escape: the exponent is in the escape list |
//!
//! `base` is chosen per [`BLOCK`] values as `max(1, e_max - 13)`, `e_max` the block's largest
//! exponent below 255 (Inf and NaN always escape, with their payload in the mantissa byte). An
//! escape is one `u32`: `(index << 8) | exponent`, sorted by index, so a decoder thread that meets
//! code 15 finds its exponent by binary search. Decoding is branch-free except for escapes, and
//! every bit comes back: the code is exact for any 16-bit pattern.
//!
//! A tensor is coded in chunks of at most [`CHUNK_ELEMS`] values, each laid out on its own
//! ([`chunk_layout`]): `bases | sign+mantissa bytes | codes (two per byte, low nibble first) |
//! escapes`, every section 16-byte aligned, so a GPU thread reads 8 values with one 8-byte load,
//! one 4-byte load and writes them with one 16-byte store. A chunk whose code would not be smaller
//! than the raw bytes is left raw ([`worth_coding`]).
//!
//! This module is the reference: the CPU engine decodes with it, and the GPU kernel is checked
//! against it bit for bit.

use crate::error::{CoreError, Result};

/// Values sharing one exponent base.
pub const BLOCK: usize = 512;
/// Most values in one chunk (8 Mi values: 16 MiB of bf16); escape indices fit in 24 bits.
pub const CHUNK_ELEMS: usize = 1 << 23;
/// Values a host thread codes at once: a chunk is encoded in parallel in ranges of this many
/// values, each with its own escape count (a multiple of [`BLOCK`]).
pub const SUB_ELEMS: usize = 1 << 16;
/// The code marking an escaped exponent.
pub const ESCAPE: u8 = 15;
/// Exponents a block's window covers above code 0.
pub const WINDOW: u16 = 14;
/// Section alignment inside a chunk.
pub const SECTION_ALIGN: usize = 16;
/// Values a GPU thread decodes at once; planes are padded to this.
pub const VALUES_PER_THREAD: usize = 8;

const fn align16(n: usize) -> usize {
    n.div_ceil(SECTION_ALIGN) * SECTION_ALIGN
}

/// Where each section of a coded chunk of `n` values with `n_esc` escapes sits (byte offsets from
/// the chunk's start), and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLayout {
    /// Values in the chunk.
    pub n: usize,
    /// Escapes in the chunk.
    pub n_esc: usize,
    /// One base exponent per block, from offset 0.
    pub bases: usize,
    /// Sign and mantissa, one byte per value.
    pub signs: usize,
    /// 4-bit exponent codes, two per byte.
    pub codes: usize,
    /// Escapes, one little-endian `u32` each.
    pub escapes: usize,
    /// The chunk's size (a multiple of 16).
    pub nbytes: usize,
}

/// The layout of a chunk of `n` values with `n_esc` escapes.
pub fn chunk_layout(n: usize, n_esc: usize) -> ChunkLayout {
    let padded = n.div_ceil(VALUES_PER_THREAD) * VALUES_PER_THREAD;
    let bases = 0;
    let signs = align16(n.div_ceil(BLOCK));
    let codes = signs + align16(padded);
    let escapes = codes + align16(padded / 2);
    let nbytes = align16(escapes + 4 * n_esc);
    ChunkLayout {
        n,
        n_esc,
        bases,
        signs,
        codes,
        escapes,
        nbytes,
    }
}

/// Whether a chunk of `n` values with `n_esc` escapes is smaller coded than raw (`2 n` bytes) and
/// no larger than `max_bytes` (the landing buffer a GPU decode reads it from).
pub fn worth_coding(n: usize, n_esc: usize, max_bytes: usize) -> bool {
    let size = chunk_layout(n, n_esc).nbytes;
    n > 0 && size < 2 * n && size <= max_bytes
}

/// The chunks of a tensor of `n` values: `(first value, values)`.
pub fn chunks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n.div_ceil(CHUNK_ELEMS)).map(move |c| {
        let start = c * CHUNK_ELEMS;
        (start, CHUNK_ELEMS.min(n - start))
    })
}

/// The ranges of a chunk of `n` values that are encoded in parallel: `(first value, values)`.
pub fn subs(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n.div_ceil(SUB_ELEMS)).map(move |s| {
        let start = s * SUB_ELEMS;
        (start, SUB_ELEMS.min(n - start))
    })
}

#[inline]
fn exponent(v: u16) -> u16 {
    (v >> 7) & 0xff
}

/// The base of one block: its largest finite exponent minus 13, at least 1. Branch-free.
///
/// Works on `v & 0x7f80` (the exponent in place) as `i16`: every such value is non-negative, so
/// the signed 16-bit max and compares that SSE2 has (it lacks the unsigned ones) give the same
/// answer, and the loop runs 8 values an instruction (3x the unsigned form on the CI machine).
#[inline]
fn block_base(block: &[u16]) -> u16 {
    let top = block
        .iter()
        .map(|&v| {
            let m = (v & 0x7f80) as i16;
            if m == 0x7f80 {
                0 // Inf and NaN count as 0
            } else {
                m
            }
        })
        .fold(0i16, i16::max);
    ((top as u16) >> 7).saturating_sub(WINDOW - 1).max(1)
}

/// The 4-bit code of value `v` in a block of base `base`: 0 for a zero exponent, `exponent - base
/// + 1` inside the window, [`ESCAPE`] outside. Branch-free, in signed 16-bit lanes as
/// [`block_base`], so loops over it vectorise (`code_of_matches_its_definition` checks every value).
#[inline(always)]
fn code_of(v: u16, base: u16) -> u16 {
    let e = ((v & 0x7f80) >> 7) as i16;
    let d = e - base as i16 + 1; // 1..=14 inside the window
    let windowed = if (d >= 1) & (d <= WINDOW as i16) {
        d
    } else {
        i16::from(ESCAPE)
    };
    (if e == 0 { 0 } else { windowed }) as u16
}

/// Escapes of one block of base `base`: the values [`code_of`] codes [`ESCAPE`]. As the base
/// puts the window's top at or above every finite exponent, those are the nonzero exponents below
/// the base and Inf/NaN (255): two compares each on the exponent in place, signed as in
/// [`block_base`], so the loop vectorises (`block_escapes_match_codes` checks it against `code_of`).
#[inline]
fn block_escapes(block: &[u16], base: u16) -> usize {
    let below = (base << 7) as i16;
    block
        .iter()
        .map(|&v| {
            let m = (v & 0x7f80) as i16;
            i16::from((m >= 0x80) & (m < below)) + i16::from(m == 0x7f80)
        })
        .sum::<i16>() as usize
}

/// Escapes a chunk of these values will have.
pub fn count_escapes(values: &[u16]) -> usize {
    values
        .chunks(BLOCK)
        .map(|block| block_escapes(block, block_base(block)))
        .sum()
}

/// The four sections of a coded chunk's buffer, split for writing.
pub struct ChunkSections<'a> {
    /// One base per block.
    pub bases: &'a mut [u8],
    /// Sign and mantissa, one byte per value (padding included).
    pub signs: &'a mut [u8],
    /// Codes, two per byte (padding included).
    pub codes: &'a mut [u8],
    /// Escapes, 4 bytes each.
    pub escapes: &'a mut [u8],
}

impl ChunkLayout {
    /// Splits a buffer of exactly `self.nbytes` bytes into its sections.
    pub fn split<'a>(&self, out: &'a mut [u8]) -> Result<ChunkSections<'a>> {
        if out.len() != self.nbytes {
            return Err(CoreError::InvalidArgument(format!(
                "a chunk of {} values with {} escapes codes to {} bytes, the buffer has {}",
                self.n,
                self.n_esc,
                self.nbytes,
                out.len()
            )));
        }
        let (head, escapes) = out.split_at_mut(self.escapes);
        let (head, codes) = head.split_at_mut(self.codes);
        let (bases, signs) = head.split_at_mut(self.signs);
        Ok(ChunkSections {
            bases,
            signs,
            codes,
            escapes,
        })
    }
}

/// Codes the values `first..first + values.len()` of a chunk (`first` a multiple of [`BLOCK`])
/// into their parts of the chunk's sections: `bases` (one per block), `signs` (one per value),
/// `codes` (one per two values) and `escapes` (4 bytes per escape of these values, exactly as many
/// as [`count_escapes`] counts). A different number of escapes is an error (the values changed
/// since they were counted). Ranges of one chunk can be coded in parallel.
pub fn encode_range(
    values: &[u16],
    first: usize,
    bases: &mut [u8],
    signs: &mut [u8],
    codes: &mut [u8],
    escapes: &mut [u8],
) -> Result<()> {
    if !escapes.len().is_multiple_of(4) {
        return Err(CoreError::InvalidArgument(format!(
            "encode_range of {} values: escapes must be 4 bytes each",
            values.len()
        )));
    }
    let n_esc = escapes.len() / 4;
    let found = encode_range_sections(values, first, bases, signs, codes, Some(n_esc))?;
    if found.len() != n_esc {
        return Err(CoreError::InvalidArgument(format!(
            "values {first}.. have {} escapes, {n_esc} were counted: they changed while they were coded",
            found.len()
        )));
    }
    for (out, entry) in escapes.chunks_exact_mut(4).zip(&found) {
        out.copy_from_slice(entry);
    }
    Ok(())
}

/// [`encode_range`] without the escapes' place: codes the values into `bases`, `signs` and `codes`
/// and returns their escapes (little-endian entries, in order), counting and coding in one pass
/// over the values for a caller that places the escapes once every range of the chunk is coded.
/// `most`: an error past this many escapes (the count [`encode_range`] was given).
pub fn encode_range_sections(
    values: &[u16],
    first: usize,
    bases: &mut [u8],
    signs: &mut [u8],
    codes: &mut [u8],
    most: Option<usize>,
) -> Result<Vec<[u8; 4]>> {
    let n = values.len();
    let bad = |what: &str| {
        Err(CoreError::InvalidArgument(format!(
            "encode_range of {n} values: {what}"
        )))
    };
    if !first.is_multiple_of(BLOCK) {
        return bad("the first value must start a block");
    }
    if bases.len() != n.div_ceil(BLOCK) || signs.len() != n || codes.len() != n.div_ceil(2) {
        return bad("section slices of the wrong length");
    }
    if first + n > (1 << 24) {
        return bad("escape indices must be below 2^24");
    }
    let mut found: Vec<[u8; 4]> = Vec::new();
    for (b, block) in values.chunks(BLOCK).enumerate() {
        let base = block_base(block);
        bases[b] = base as u8;
        let at = b * BLOCK;
        let len = block.len();
        for (s, &v) in signs[at..at + len].iter_mut().zip(block) {
            *s = (((v >> 8) & 0x80) | (v & 0x7f)) as u8;
        }
        let pairs = block.chunks_exact(2);
        let odd = pairs.remainder().first().copied();
        let mut esc = 0u16;
        for (byte, pair) in codes[at / 2..at / 2 + len / 2].iter_mut().zip(pairs) {
            let (c0, c1) = (code_of(pair[0], base), code_of(pair[1], base));
            *byte = (c0 | (c1 << 4)) as u8;
            esc += u16::from(c0 == u16::from(ESCAPE)) + u16::from(c1 == u16::from(ESCAPE));
        }
        if let Some(v) = odd {
            let c = code_of(v, base);
            codes[(at + len) / 2] = c as u8;
            esc += u16::from(c == u16::from(ESCAPE));
        }
        if esc == 0 {
            continue;
        }
        if let Some(most) = most.filter(|&m| found.len() + usize::from(esc) > m) {
            return Err(CoreError::InvalidArgument(format!(
                "values {first}.. have more than the {most} escapes counted: they changed while they were coded"
            )));
        }
        for (k, &v) in block.iter().enumerate() {
            if code_of(v, base) == u16::from(ESCAPE) {
                let entry = (((first + at + k) as u32) << 8) | u32::from(exponent(v));
                found.push(entry.to_le_bytes());
            }
        }
    }
    Ok(found)
}

/// Codes one chunk of `values` (at most [`CHUNK_ELEMS`]) with `n_esc` escapes (from
/// [`count_escapes`]) into `out`, which must be exactly [`chunk_layout`]`(values.len(), n_esc).nbytes`
/// bytes, on the calling thread.
pub fn encode_chunk(values: &[u16], n_esc: usize, out: &mut [u8]) -> Result<()> {
    let n = values.len();
    if n > CHUNK_ELEMS {
        return Err(CoreError::InvalidArgument(format!(
            "a coded chunk holds at most {CHUNK_ELEMS} values, got {n}"
        )));
    }
    let lay = chunk_layout(n, n_esc);
    let sec = lay.split(out)?;
    zero_padding(&lay, sec.bases, sec.signs, sec.codes, sec.escapes);
    let nb = n.div_ceil(BLOCK);
    encode_range(
        values,
        0,
        &mut sec.bases[..nb],
        &mut sec.signs[..n],
        &mut sec.codes[..n.div_ceil(2)],
        &mut sec.escapes[..4 * n_esc],
    )
}

/// Zeroes the bytes of a chunk's sections that no value writes (alignment padding).
pub fn zero_padding(
    lay: &ChunkLayout,
    bases: &mut [u8],
    signs: &mut [u8],
    codes: &mut [u8],
    escapes: &mut [u8],
) {
    bases[lay.n.div_ceil(BLOCK)..].fill(0);
    signs[lay.n..].fill(0);
    codes[lay.n.div_ceil(2)..].fill(0);
    escapes[4 * lay.n_esc..].fill(0);
}

fn corrupt(msg: String) -> CoreError {
    CoreError::InvalidArgument(format!("corrupt coded chunk: {msg}"))
}

/// Decodes one chunk of `out.len()` values with `n_esc` escapes from `coded` (at least
/// [`chunk_layout`]`(out.len(), n_esc).nbytes` bytes). A chunk that is not what [`encode_chunk`]
/// writes (a base out of range, escapes out of order or not matching the codes) is an error.
/// [`decode_blocks`] and [`apply_escapes`] are its two halves, for decoding ranges in parallel.
pub fn decode_chunk(coded: &[u8], n_esc: usize, out: &mut [u16]) -> Result<()> {
    let n = out.len();
    let escaped = decode_blocks(coded, n, n_esc, 0, out)?;
    if escaped != n_esc {
        return Err(corrupt(format!("{n_esc} escapes listed, {escaped} used")));
    }
    apply_escapes(coded, n_esc, out)
}

/// The sections of a chunk of `n` values and `n_esc` escapes in `coded`, checked to fit.
fn sections(coded: &[u8], n: usize, n_esc: usize) -> Result<ChunkLayout> {
    let lay = chunk_layout(n, n_esc);
    if coded.len() < lay.nbytes {
        return Err(corrupt(format!(
            "{n} values with {n_esc} escapes need {} bytes, got {}",
            lay.nbytes,
            coded.len()
        )));
    }
    Ok(lay)
}

/// Checks that values `first..first + len` of a chunk of `n` are whole blocks (the last may end at
/// `n`): what a range decode takes, in either code.
pub(crate) fn whole_blocks(first: usize, len: usize, n: usize) -> Result<()> {
    let end = first.checked_add(len);
    if !first.is_multiple_of(BLOCK)
        || end.is_none_or(|e| e > n)
        || (end != Some(n) && !len.is_multiple_of(BLOCK))
    {
        return Err(CoreError::InvalidArgument(format!(
            "decode_blocks of {len} values from {first} of {n}: not whole blocks"
        )));
    }
    Ok(())
}

/// Decodes values `first..first + out.len()` of a chunk of `n` values with `n_esc` escapes (`first`
/// starts a block; the range ends at a block's end or at `n`), each escaped value's exponent left 0
/// for [`apply_escapes`]. Returns how many of its codes say [`ESCAPE`]: the ranges' sum must be
/// `n_esc`. Ranges decode independently (in parallel).
pub fn decode_blocks(
    coded: &[u8],
    n: usize,
    n_esc: usize,
    first: usize,
    out: &mut [u16],
) -> Result<usize> {
    let lay = sections(coded, n, n_esc)?;
    let len = out.len();
    whole_blocks(first, len, n)?;
    // the range's sections as slices of exactly their length, so the loop below indexes without checks
    let b0 = first / BLOCK;
    let bases = &coded[lay.bases + b0..lay.bases + b0 + len.div_ceil(BLOCK)];
    let signs = &coded[lay.signs + first..lay.signs + first + len];
    let codes = &coded[lay.codes + first / 2..lay.codes + first / 2 + len.div_ceil(2)];
    let mut escaped = 0usize; // codes that say ESCAPE: the escape list fills them in
    for (b, ((block, base), (s, c))) in out
        .chunks_mut(BLOCK)
        .zip(bases)
        .zip(signs.chunks(BLOCK).zip(codes.chunks(BLOCK / 2)))
        .enumerate()
    {
        let base = u16::from(*base);
        if !(1..=255 - WINDOW).contains(&base) {
            return Err(corrupt(format!(
                "block {} has base exponent {base}",
                b0 + b
            )));
        }
        // exponent of each 4-bit code, shifted into place: 0 zero/subnormal, 1..=14 the window,
        // ESCAPE a placeholder (0) the escape list overwrites
        let mut lut = [0u16; 16];
        for (code, e) in lut.iter_mut().enumerate().take(usize::from(ESCAPE)).skip(1) {
            *e = (base + code as u16 - 1) << 7;
        }
        for ((pair, sm), &byte) in block.chunks_mut(2).zip(s.chunks(2)).zip(c) {
            let lo = usize::from(byte & 0xf);
            let hi = usize::from(byte >> 4);
            escaped += usize::from(lo == usize::from(ESCAPE));
            let v0 = u16::from(sm[0]);
            pair[0] = ((v0 & 0x80) << 8) | lut[lo] | (v0 & 0x7f);
            if let (Some(out1), Some(&s1)) = (pair.get_mut(1), sm.get(1)) {
                escaped += usize::from(hi == usize::from(ESCAPE));
                let v1 = u16::from(s1);
                *out1 = ((v1 & 0x80) << 8) | lut[hi] | (v1 & 0x7f);
            }
        }
    }
    Ok(escaped)
}

/// Writes the escape list's exponents into a chunk's values `out` (all of them) decoded by
/// [`decode_blocks`], whose ranges counted `n_esc` escape codes in all: each entry must be for the
/// next value whose code says [`ESCAPE`], in order.
pub fn apply_escapes(coded: &[u8], n_esc: usize, out: &mut [u16]) -> Result<()> {
    let n = out.len();
    let lay = sections(coded, n, n_esc)?;
    let codes = &coded[lay.codes..lay.codes + n.div_ceil(2)];
    // the escapes, in value order, each at a value whose code says ESCAPE: with the counts equal,
    // the list and the escape codes match one to one
    let mut last = None;
    for (k, entry) in coded[lay.escapes..lay.escapes + 4 * n_esc]
        .chunks_exact(4)
        .enumerate()
    {
        let entry = u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]);
        let i = (entry >> 8) as usize;
        let code = codes.get(i / 2).map(|b| (b >> (4 * (i % 2))) & 0xf);
        if i >= n || code != Some(ESCAPE) || last.is_some_and(|l| i <= l) {
            return Err(corrupt(format!(
                "escape {k} is for value {i}, which is not the next escaped value"
            )));
        }
        last = Some(i);
        out[i] = (out[i] & 0x807f) | (((entry & 0xff) as u16) << 7);
    }
    Ok(())
}

/// Gaps between two raw tensors in a slot up to this many bytes are sent along (one copy, not two).
pub const RAW_MERGE_GAP: usize = 4096;
/// Alignment of each piece in a coded unit's host buffer.
pub const PIECE_ALIGN: usize = 64;

/// One tensor of a unit to be coded: where it sits in the slot, its bytes (the storage it spans),
/// and whether it is bf16 (only bf16 is coded; the rest is sent as it is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorSpec {
    /// Offset in the slot.
    pub dst: usize,
    /// Bytes.
    pub nbytes: usize,
    /// bf16 values to code (`nbytes` must then be even).
    pub bf16: bool,
}

/// Bytes of tensor `tensor` from byte `tensor_offset`, at `offset` bytes into a raw piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Index into the unit's tensors.
    pub tensor: usize,
    /// First byte of the tensor.
    pub tensor_offset: usize,
    /// Offset in the piece.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

/// The lossless codes: this module's fixed-rate one, [`crate::tiered`] and [`crate::huffman`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// 12 bits a value ([`chunk_layout`]).
    Fixed,
    /// About 11 bits a value ([`crate::tiered`]).
    Tiered,
    /// About 10.6 bits a value ([`crate::huffman`]).
    Huffman,
}

impl Code {
    /// The code called `name` (`"fixed"`, `"tiered"` or `"huffman"`).
    pub fn from_name(name: &str) -> Result<Code> {
        match name {
            "fixed" => Ok(Code::Fixed),
            "tiered" => Ok(Code::Tiered),
            "huffman" => Ok(Code::Huffman),
            other => Err(CoreError::InvalidArgument(format!(
                "unknown code {other:?}: use \"fixed\", \"tiered\" or \"huffman\""
            ))),
        }
    }
}

/// What a piece holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PieceKind {
    /// Bytes copied as they are: segments of tensors, the gaps between them zero.
    Raw(Vec<Segment>),
    /// One coded chunk of `values` bf16 values of `tensor` from value `first_value`.
    Coded {
        /// Index into the unit's tensors.
        tensor: usize,
        /// The chunk's first value in the tensor.
        first_value: usize,
        /// Values in the chunk.
        values: usize,
        /// Escapes in the chunk.
        escapes: usize,
        /// Escapes of each of its [`subs`] (they add up to `escapes`).
        sub_escapes: Vec<usize>,
        /// `None`: the fixed-rate code (this module). `Some`: the two-tier code
        /// ([`crate::tiered`]), with the tier-2 groups of each of its [`subs`].
        sub_groups: Option<Vec<usize>>,
        /// `Some`: the Huffman code ([`crate::huffman`]), with the counts of each of its
        /// [`crate::huffman::RANGE_ELEMS`] ranges (`escapes` 0, `sub_groups` `None`).
        ranges: Option<Vec<crate::huffman::RangeCounts>>,
    },
}

impl PieceKind {
    /// The code of a coded chunk: `"fixed"`, `"tiered"` or `"huffman"`; `None` for a raw piece.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            PieceKind::Raw(_) => None,
            PieceKind::Coded {
                ranges: Some(_), ..
            } => Some("huffman"),
            PieceKind::Coded {
                sub_groups: Some(_),
                ..
            } => Some("tiered"),
            PieceKind::Coded { .. } => Some("fixed"),
        }
    }

    /// A coded chunk's Huffman range counts, `None` for the other codes and raw pieces.
    pub fn huffman_ranges(&self) -> Option<&[crate::huffman::RangeCounts]> {
        match self {
            PieceKind::Coded {
                ranges: Some(r), ..
            } => Some(r),
            _ => None,
        }
    }

    /// A coded chunk's tiered counts (all of them), `None` for a fixed-rate chunk or a raw piece.
    pub fn tiered_counts(&self) -> Option<crate::tiered::Counts> {
        match self {
            PieceKind::Coded {
                escapes,
                sub_groups: Some(groups),
                ..
            } => Some(crate::tiered::Counts {
                groups: groups.iter().sum(),
                escapes: *escapes,
            }),
            _ => None,
        }
    }

    /// A coded chunk's tiered counts for each of its [`subs`], `None` otherwise.
    pub fn tiered_sub_counts(&self) -> Option<Vec<crate::tiered::Counts>> {
        match self {
            PieceKind::Coded {
                sub_escapes,
                sub_groups: Some(groups),
                ..
            } => Some(
                groups
                    .iter()
                    .zip(sub_escapes)
                    .map(|(&groups, &escapes)| crate::tiered::Counts { groups, escapes })
                    .collect(),
            ),
            _ => None,
        }
    }
}

/// One piece of a coded unit: `len` bytes at `src` in the unit's host buffer that fill the slot
/// from `dst` (raw) or decode into it (coded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// What it holds.
    pub kind: PieceKind,
    /// Offset in the unit's host buffer.
    pub src: usize,
    /// Bytes in the host buffer (what crosses the link).
    pub len: usize,
    /// Offset in the slot.
    pub dst: usize,
}

impl Piece {
    /// Bytes the piece fills in the slot.
    pub fn out_bytes(&self) -> usize {
        match &self.kind {
            PieceKind::Raw(_) => self.len,
            PieceKind::Coded { values, .. } => 2 * values,
        }
    }
}

/// A unit in coded form: its pieces, in slot order, and the size of its host buffer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CodedUnit {
    /// Raw and coded pieces.
    pub pieces: Vec<Piece>,
    /// Bytes of the host buffer (what one fetch sends over the link).
    pub nbytes: usize,
}

impl CodedUnit {
    /// Bytes the unit fills in the slot.
    pub fn out_bytes(&self) -> usize {
        self.pieces.iter().map(Piece::out_bytes).sum()
    }

    /// One unit from coded tensors laid out on their own (each a unit of one tensor): part `k`'s
    /// pieces moved to `src` in the new buffer and `dst` in the slot, its tensor numbered `k`. The
    /// parts' buffers must not overlap, nor their slot ranges (the NVMe route's side file codes
    /// tensors, and a unit of any budget or granularity is composed of them). Errors on overlaps
    /// and on offsets that wrap.
    pub fn compose(parts: &[(&CodedUnit, usize, usize)]) -> Result<CodedUnit> {
        let wrap =
            || CoreError::InvalidArgument("a composed unit larger than the address space".into());
        let mut pieces = Vec::new();
        let mut nbytes = 0usize;
        let mut spans: Vec<(usize, usize, usize, usize)> = Vec::new(); // src, src end, dst, dst end
        for (k, &(part, src, dst)) in parts.iter().enumerate() {
            let end = src.checked_add(part.nbytes).ok_or_else(wrap)?;
            let out = dst.checked_add(part.out_bytes()).ok_or_else(wrap)?;
            spans.push((src, end, dst, out));
            nbytes = nbytes.max(end);
            for p in &part.pieces {
                let kind = match &p.kind {
                    PieceKind::Raw(segs) => {
                        PieceKind::Raw(segs.iter().map(|s| Segment { tensor: k, ..*s }).collect())
                    }
                    PieceKind::Coded {
                        first_value,
                        values,
                        escapes,
                        sub_escapes,
                        sub_groups,
                        ranges,
                        ..
                    } => PieceKind::Coded {
                        tensor: k,
                        first_value: *first_value,
                        values: *values,
                        escapes: *escapes,
                        sub_escapes: sub_escapes.clone(),
                        sub_groups: sub_groups.clone(),
                        ranges: ranges.clone(),
                    },
                };
                pieces.push(Piece {
                    kind,
                    src: p.src.checked_add(src).ok_or_else(wrap)?,
                    len: p.len,
                    dst: p.dst.checked_add(dst).ok_or_else(wrap)?,
                });
            }
        }
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[1].0 < w[0].1) {
            return Err(CoreError::InvalidArgument(
                "the composed parts' buffers overlap".into(),
            ));
        }
        spans.sort_unstable_by_key(|s| s.2);
        if spans.windows(2).any(|w| w[1].2 < w[0].3 && w[0].3 > w[0].2) {
            return Err(CoreError::InvalidArgument(
                "the composed parts' slot ranges overlap".into(),
            ));
        }
        pieces.sort_by_key(|p| p.dst);
        Ok(CodedUnit { pieces, nbytes })
    }

    /// The largest coded piece (what one landing buffer must hold), 0 without one.
    pub fn largest_coded(&self) -> usize {
        self.pieces
            .iter()
            .filter(|p| matches!(p.kind, PieceKind::Coded { .. }))
            .map(|p| p.len)
            .max()
            .unwrap_or(0)
    }
}

/// Lays out a unit in coded form. `escapes[t]` lists, for bf16 tensor `t`, for each of its
/// [`chunks`], the escapes of each of the chunk's [`subs`] (from [`count_escapes`], or
/// [`crate::tiered::count_subs`]); it is ignored for the others. `groups`, in the same shape, gives
/// the tier-2 groups of the two-tier code ([`crate::tiered`]); `None` lays the fixed-rate code
/// out. A chunk is coded when it is worth coding with `max_chunk_bytes` (the landing buffer),
/// raw otherwise. Raw bytes of neighbouring tensors less than [`RAW_MERGE_GAP`] apart in the slot
/// share one piece.
pub fn layout_coded_unit(
    tensors: &[TensorSpec],
    escapes: &[Vec<Vec<usize>>],
    groups: Option<&[Vec<Vec<usize>>]>,
    max_chunk_bytes: usize,
) -> Result<CodedUnit> {
    layout_any(tensors, escapes, groups, None, max_chunk_bytes)
}

/// Lays out a unit in the Huffman code ([`crate::huffman`]): `ranges[t]` lists, for bf16 tensor
/// `t`, for each of its [`chunks`], the counts of each of the chunk's
/// [`crate::huffman::RANGE_ELEMS`] ranges (from [`crate::huffman::count_ranges`]); otherwise as
/// [`layout_coded_unit`].
pub fn layout_coded_unit_huffman(
    tensors: &[TensorSpec],
    ranges: &[Vec<Vec<crate::huffman::RangeCounts>>],
    max_chunk_bytes: usize,
) -> Result<CodedUnit> {
    // the fixed-rate escape counts' shape, all zero: what the shared checks expect
    let escapes: Vec<Vec<Vec<usize>>> = tensors
        .iter()
        .map(|s| {
            if s.bf16 {
                chunks(s.nbytes / 2)
                    .map(|(_, v)| vec![0; subs(v).count()])
                    .collect()
            } else {
                Vec::new()
            }
        })
        .collect();
    layout_any(tensors, &escapes, None, Some(ranges), max_chunk_bytes)
}

fn layout_any(
    tensors: &[TensorSpec],
    escapes: &[Vec<Vec<usize>>],
    groups: Option<&[Vec<Vec<usize>>]>,
    huffman: Option<&[Vec<Vec<crate::huffman::RangeCounts>>]>,
    max_chunk_bytes: usize,
) -> Result<CodedUnit> {
    if escapes.len() != tensors.len()
        || groups.is_some_and(|g| g.len() != tensors.len())
        || huffman.is_some_and(|h| h.len() != tensors.len())
    {
        return Err(CoreError::InvalidArgument(format!(
            "{} tensors but escape counts for {} (tier-2 groups for {:?})",
            tensors.len(),
            escapes.len(),
            groups.map(<[_]>::len)
        )));
    }
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&t| tensors[t].dst);
    let mut pieces: Vec<Piece> = Vec::new();
    let mut end = 0usize; // host bytes used
    let overflow =
        || CoreError::InvalidArgument("a coded unit larger than the address space".into());
    let raw = |pieces: &mut Vec<Piece>, end: &mut usize, seg: Segment, dst: usize| -> Result<()> {
        if let Some(Piece {
            kind: PieceKind::Raw(segs),
            len,
            dst: pdst,
            ..
        }) = pieces.last_mut()
        {
            let slot_end = *pdst + *len;
            if dst >= slot_end && dst - slot_end <= RAW_MERGE_GAP {
                let offset = dst - *pdst;
                segs.push(Segment { offset, ..seg });
                *len = offset + seg.len;
                *end = pieces.last().map_or(0, |p| p.src + p.len);
                return Ok(());
            }
        }
        let src = end
            .checked_next_multiple_of(PIECE_ALIGN)
            .ok_or_else(overflow)?;
        pieces.push(Piece {
            kind: PieceKind::Raw(vec![Segment { offset: 0, ..seg }]),
            src,
            len: seg.len,
            dst,
        });
        *end = src.checked_add(seg.len).ok_or_else(overflow)?;
        Ok(())
    };
    for &t in &order {
        let spec = tensors[t];
        if spec.nbytes == 0 {
            continue;
        }
        let whole = Segment {
            tensor: t,
            tensor_offset: 0,
            offset: 0,
            len: spec.nbytes,
        };
        if !spec.bf16 {
            raw(&mut pieces, &mut end, whole, spec.dst)?;
            continue;
        }
        if !spec.nbytes.is_multiple_of(2) {
            return Err(CoreError::InvalidArgument(format!(
                "tensor {t} is bf16 but spans an odd number of bytes ({})",
                spec.nbytes
            )));
        }
        let counts = &escapes[t];
        let n_chunks = chunks(spec.nbytes / 2).count();
        if counts.len() != n_chunks {
            return Err(CoreError::InvalidArgument(format!(
                "tensor {t} has {n_chunks} chunks but {} escape counts",
                counts.len()
            )));
        }
        let tensor_groups = match groups {
            Some(g) if g[t].len() != n_chunks => {
                return Err(CoreError::InvalidArgument(format!(
                    "tensor {t} has {n_chunks} chunks but {} tier-2 group counts",
                    g[t].len()
                )))
            }
            Some(g) => Some(&g[t]),
            None => None,
        };
        let tensor_ranges = match huffman {
            Some(h) if h[t].len() != n_chunks => {
                return Err(CoreError::InvalidArgument(format!(
                    "tensor {t} has {n_chunks} chunks but {} Huffman range counts",
                    h[t].len()
                )))
            }
            Some(h) => Some(&h[t]),
            None => None,
        };
        for (c, ((first, values), sub_escapes)) in chunks(spec.nbytes / 2).zip(counts).enumerate() {
            let dst = spec.dst + 2 * first;
            let sub_groups = tensor_groups.map(|g| g[c].clone());
            let ranges = tensor_ranges.map(|h| h[c].clone());
            if ranges
                .as_ref()
                .is_some_and(|r| r.len() != values.div_ceil(crate::huffman::RANGE_ELEMS))
            {
                return Err(CoreError::InvalidArgument(format!(
                    "a chunk of {values} values of tensor {t} has {:?} Huffman range counts",
                    ranges.as_ref().map(Vec::len)
                )));
            }
            if sub_groups
                .as_ref()
                .is_some_and(|g| g.len() != sub_escapes.len())
            {
                return Err(CoreError::InvalidArgument(format!(
                    "a chunk of tensor {t} has {} escape counts but {:?} tier-2 group counts",
                    sub_escapes.len(),
                    sub_groups.as_ref().map(Vec::len)
                )));
            }
            if sub_escapes.len() != subs(values).count() {
                return Err(CoreError::InvalidArgument(format!(
                    "a chunk of {values} values of tensor {t} has {} ranges but {} escape counts",
                    subs(values).count(),
                    sub_escapes.len()
                )));
            }
            let n_esc = sub_escapes.iter().sum();
            let (worth, len) = match (&sub_groups, &ranges) {
                (_, Some(r)) => (
                    crate::huffman::worth_coding(values, r, max_chunk_bytes),
                    crate::huffman::huffman_layout(values, r).nbytes,
                ),
                (None, None) => (
                    worth_coding(values, n_esc, max_chunk_bytes),
                    chunk_layout(values, n_esc).nbytes,
                ),
                (Some(g), None) => {
                    let counts = crate::tiered::Counts {
                        groups: g.iter().sum(),
                        escapes: n_esc,
                    };
                    (
                        crate::tiered::worth_coding(values, counts, max_chunk_bytes),
                        crate::tiered::tiered_layout(values, counts).nbytes,
                    )
                }
            };
            if worth {
                let src = end
                    .checked_next_multiple_of(PIECE_ALIGN)
                    .ok_or_else(overflow)?;
                pieces.push(Piece {
                    kind: PieceKind::Coded {
                        tensor: t,
                        first_value: first,
                        values,
                        escapes: n_esc,
                        sub_escapes: sub_escapes.clone(),
                        sub_groups,
                        ranges,
                    },
                    src,
                    len,
                    dst,
                });
                end = src.checked_add(len).ok_or_else(overflow)?;
            } else {
                let seg = Segment {
                    tensor: t,
                    tensor_offset: 2 * first,
                    offset: 0,
                    len: 2 * values,
                };
                raw(&mut pieces, &mut end, seg, dst)?;
            }
        }
    }
    Ok(CodedUnit {
        pieces,
        nbytes: end.next_multiple_of(PIECE_ALIGN),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(values: &[u16]) -> ChunkLayout {
        let n_esc = count_escapes(values);
        let lay = chunk_layout(values.len(), n_esc);
        let mut coded = vec![0xAAu8; lay.nbytes];
        encode_chunk(values, n_esc, &mut coded).unwrap();
        let mut back = vec![0u16; values.len()];
        decode_chunk(&coded, n_esc, &mut back).unwrap();
        assert_eq!(back, values);
        lay
    }

    #[test]
    fn composed_units_move_their_pieces_and_refuse_overlaps() {
        let one = |bf16: bool, n: usize| {
            let spec = [TensorSpec {
                dst: 0,
                nbytes: 2 * n,
                bf16,
            }];
            let counts = if bf16 {
                vec![chunks(n).map(|(_, v)| vec![0; subs(v).count()]).collect()]
            } else {
                vec![vec![]]
            };
            layout_coded_unit(&spec, &counts, None, usize::MAX).unwrap()
        };
        let (a, b) = (one(true, CHUNK_ELEMS + 5000), one(false, 100));
        let u = CodedUnit::compose(&[(&b, 0, 1 << 30), (&a, 256, 0)]).unwrap();
        assert_eq!(u.nbytes, 256 + a.nbytes);
        assert_eq!(u.pieces.len(), a.pieces.len() + b.pieces.len());
        assert_eq!(u.out_bytes(), a.out_bytes() + b.out_bytes());
        // slot order; each piece moved by its part's offsets, its tensor the part's index
        assert!(u.pieces.windows(2).all(|w| w[0].dst < w[1].dst));
        for (p, q) in u.pieces.iter().zip(&a.pieces) {
            assert_eq!((p.src, p.dst, p.len), (q.src + 256, q.dst, q.len));
            assert!(matches!(p.kind, PieceKind::Coded { tensor: 1, .. }));
        }
        let last = u.pieces.last().unwrap();
        assert_eq!((last.src, last.dst), (b.pieces[0].src, 1 << 30));
        assert!(matches!(&last.kind, PieceKind::Raw(segs) if segs[0].tensor == 0));
        // buffers or slot ranges that overlap, offsets that wrap
        assert!(CodedUnit::compose(&[(&a, 0, 0), (&b, 64, 1 << 30)]).is_err());
        assert!(CodedUnit::compose(&[(&a, 0, 0), (&b, a.nbytes, 2)]).is_err());
        assert!(CodedUnit::compose(&[(&a, usize::MAX - 10, 0)]).is_err());
    }

    #[test]
    fn code_of_matches_its_definition() {
        for base in 1..=242u16 {
            for v in 0..=u16::MAX {
                let e = (v >> 7) & 0xff;
                let want = if e == 0 {
                    0
                } else if (base..base + WINDOW).contains(&e) {
                    e - base + 1
                } else {
                    u16::from(ESCAPE)
                };
                assert_eq!(code_of(v, base), want, "value {v:#06x} base {base}");
            }
        }
    }

    #[test]
    fn block_escapes_match_codes() {
        // blocks of every largest finite exponent, exponents spread below it (zeros, denormals,
        // Inf and NaN among them), both signs: the count equals code_of's escapes at the block's base
        let mut next = bits(7);
        for top in 0..=254u16 {
            for spread in [1u16, 8, 20, 64, 255] {
                let mut block: Vec<u16> = (0..BLOCK)
                    .map(|_| {
                        let r = next();
                        let e = match r % 50 {
                            0 => 255,
                            1 => 0,
                            _ => top.saturating_sub((r >> 8) as u16 % spread),
                        };
                        ((r >> 20) as u16 & 0x807f) | (e << 7)
                    })
                    .collect();
                block[3] = top << 7; // the top is there
                let base = block_base(&block);
                assert_eq!(base, top.saturating_sub(WINDOW - 1).max(1), "top {top}");
                let want = block
                    .iter()
                    .filter(|&&v| code_of(v, base) == u16::from(ESCAPE))
                    .count();
                assert_eq!(
                    block_escapes(&block, base),
                    want,
                    "top {top} spread {spread}"
                );
            }
        }
    }

    /// A deterministic stream of pseudo-random bits (xorshift).
    fn bits(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed.max(1);
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    fn bf16(x: f32) -> u16 {
        (x.to_bits() >> 16) as u16
    }

    /// Normal(0, sigma) values as bf16 (Box-Muller).
    fn normal_bf16(n: usize, sigma: f32, seed: u64) -> Vec<u16> {
        let mut r = bits(seed);
        (0..n)
            .map(|_| {
                let u1 = ((r() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                let u2 = (r() >> 11) as f64 / (1u64 << 53) as f64;
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                bf16(z as f32 * sigma)
            })
            .collect()
    }

    #[test]
    fn normal_weights_code_to_three_quarters() {
        let v = normal_bf16(1 << 20, 0.02, 7);
        let lay = round_trip(&v);
        let ratio = lay.nbytes as f64 / (2 * v.len()) as f64;
        assert!(ratio < 0.752, "ratio {ratio}");
        assert!(lay.n_esc < v.len() / 1000, "{} escapes", lay.n_esc);
    }

    #[test]
    fn heavy_tails_and_mixed_scales_round_trip() {
        let mut r = bits(3);
        // Cauchy-like: a ratio of normals spans many exponents
        let a = normal_bf16(70_001, 1.0, 11);
        let b = normal_bf16(70_001, 1.0, 12);
        let v: Vec<u16> = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| {
                let (x, y) = (
                    f32::from_bits(u32::from(x) << 16),
                    f32::from_bits(u32::from(y) << 16),
                );
                let scale = [1e-30f32, 1e-3, 1.0, 1e20][(r() % 4) as usize];
                bf16(x / y.max(1e-3) * scale)
            })
            .collect();
        round_trip(&v);
    }

    #[test]
    fn edge_values_round_trip() {
        let specials: Vec<u16> = vec![
            0x0000, 0x8000, // +0, -0
            0x0001, 0x807f, 0x0040, // subnormals
            0x7f80, 0xff80, // +-Inf
            0x7fc0, 0x7fc1, 0xffff, 0x7f81, // NaNs with payloads
            0x0080, 0x7f7f, 0xff7f, // smallest normal, largest finite
        ];
        for len in [0, 1, 2, 7, 8, 9, 15, 16, 17, 511, 512, 513, 1023, 1025] {
            let v: Vec<u16> = (0..len).map(|i| specials[i % specials.len()]).collect();
            round_trip(&v);
        }
    }

    #[test]
    fn every_bit_pattern_round_trips() {
        let v: Vec<u16> = (0..=u16::MAX).collect();
        round_trip(&v);
        let mut r = bits(99);
        let v: Vec<u16> = (0..100_003).map(|_| r() as u16).collect();
        round_trip(&v);
    }

    #[test]
    fn all_escape_blocks_round_trip_and_are_not_worth_coding() {
        // every block: one huge value and the rest tiny, so all but one escape
        let v: Vec<u16> = (0..4 * BLOCK)
            .map(|i| {
                if i % BLOCK == 0 {
                    bf16(1e30)
                } else {
                    bf16(1e-30)
                }
            })
            .collect();
        let lay = round_trip(&v);
        assert_eq!(lay.n_esc, v.len() - 4);
        assert!(!worth_coding(v.len(), lay.n_esc, usize::MAX));
        assert!(worth_coding(v.len(), 0, usize::MAX));
        assert!(!worth_coding(v.len(), 0, 16));
        assert!(!worth_coding(0, 0, usize::MAX));
    }

    #[test]
    fn zeros_code_without_escapes() {
        let v = vec![0u16; 3000];
        assert_eq!(round_trip(&v).n_esc, 0);
    }

    #[test]
    fn layout_sections_are_aligned_and_padded_for_eight_values_a_thread() {
        for n in [1, 8, 9, 511, 512, 100_001, CHUNK_ELEMS] {
            let l = chunk_layout(n, 3);
            for off in [l.signs, l.codes, l.escapes, l.nbytes] {
                assert_eq!(off % SECTION_ALIGN, 0, "{l:?}");
            }
            let padded = n.div_ceil(8) * 8;
            assert!(l.codes - l.signs >= padded && l.escapes - l.codes >= padded / 2);
            assert!(l.signs >= n.div_ceil(BLOCK));
        }
        let parts: Vec<_> = chunks(2 * CHUNK_ELEMS + 5).collect();
        assert_eq!(
            parts,
            [
                (0, CHUNK_ELEMS),
                (CHUNK_ELEMS, CHUNK_ELEMS),
                (2 * CHUNK_ELEMS, 5)
            ]
        );
        assert_eq!(chunks(0).count(), 0);
    }

    #[test]
    fn bad_buffers_and_corrupt_chunks_are_errors() {
        let v = normal_bf16(2000, 1.0, 5);
        let n_esc = count_escapes(&v);
        let lay = chunk_layout(v.len(), n_esc);
        let mut small = vec![0u8; lay.nbytes - 16];
        assert!(encode_chunk(&v, n_esc, &mut small).is_err());
        let mut right = vec![0u8; lay.nbytes];
        assert!(encode_chunk(&v, n_esc + 1, &mut right).is_err()); // a wrong count: refused
        let mut coded = vec![0u8; lay.nbytes];
        encode_chunk(&v, n_esc, &mut coded).unwrap();
        let mut out = vec![0u16; v.len()];
        assert!(decode_chunk(&coded[..lay.nbytes - 16], n_esc, &mut out).is_err());
        // a wrong escape count, a base out of range, an escape for the wrong value
        assert!(decode_chunk(&coded, n_esc + 1, &mut out).is_err());
        let mut bad = coded.clone();
        bad[0] = 0;
        assert!(decode_chunk(&bad, n_esc, &mut out).is_err());
        let mut bad = coded.clone();
        bad[lay.codes] = (bad[lay.codes] & 0xf0) | ESCAPE;
        assert!(decode_chunk(&bad, n_esc, &mut out).is_err());
        let too_many = vec![0u16; CHUNK_ELEMS + 1];
        assert!(encode_chunk(&too_many, 0, &mut []).is_err());
    }

    #[test]
    fn any_corrupt_byte_decodes_to_an_error_or_a_value_never_a_panic() {
        // every byte of a chunk with escapes, each set to a few values: the decoder either refuses
        // the chunk or returns values, never panics; a block's base set out of range is refused
        let mut v = normal_bf16(1500, 1.0, 7);
        v[3] = 0x7f80; // an escaped exponent
        v[1001] = 0x0080; // the smallest normal: far below the window
        let n_esc = count_escapes(&v);
        assert!(n_esc >= 2);
        let lay = chunk_layout(v.len(), n_esc);
        let mut coded = vec![0u8; lay.nbytes];
        encode_chunk(&v, n_esc, &mut coded).unwrap();
        let mut out = vec![0u16; v.len()];
        for at in 0..coded.len() {
            for x in [0u8, 0x0f, 0xf0, 0xff, coded[at] ^ 0x10] {
                let mut bad = coded.clone();
                bad[at] = x;
                let ok = decode_chunk(&bad, n_esc, &mut out).is_ok();
                if ok && bad[at] != coded[at] && at < v.len().div_ceil(BLOCK) {
                    assert!(
                        (1..=255 - WINDOW).contains(&u16::from(x)),
                        "base byte {at} = {x}"
                    );
                }
            }
        }
    }

    #[test]
    fn units_code_bf16_chunks_and_merge_close_raw_tensors() {
        let t = |dst, nbytes, bf16| TensorSpec { dst, nbytes, bf16 };
        // a bf16 weight, two small fp32 tensors 256 bytes apart, a bf16 chunk not worth coding
        let tensors = [
            t(0, 20_000, true),
            t(20_224, 100, false),
            t(20_480, 64, false),
            t(20_736, 40, true),
        ];
        let escapes = vec![vec![vec![3]], vec![], vec![], vec![vec![40]]];
        let unit = layout_coded_unit(&tensors, &escapes, None, usize::MAX).unwrap();
        assert_eq!(unit.pieces.len(), 2, "{:?}", unit.pieces);
        let coded = &unit.pieces[0];
        assert_eq!(
            coded.kind,
            PieceKind::Coded {
                tensor: 0,
                first_value: 0,
                values: 10_000,
                escapes: 3,
                sub_escapes: vec![3],
                sub_groups: None,
                ranges: None,
            }
        );
        assert_eq!(coded.len, chunk_layout(10_000, 3).nbytes);
        // the two-tier code: the chunk's size from its groups and escapes
        let groups = vec![vec![vec![700]], vec![], vec![], vec![vec![5]]];
        let tiered = layout_coded_unit(&tensors, &escapes, Some(&groups), usize::MAX).unwrap();
        let counts = crate::tiered::Counts {
            groups: 700,
            escapes: 3,
        };
        assert_eq!(
            tiered.pieces[0].len,
            crate::tiered::tiered_layout(10_000, counts).nbytes
        );
        assert_eq!(tiered.pieces[0].kind.tiered_counts(), Some(counts));
        assert_eq!(
            tiered.pieces[0].kind.tiered_sub_counts(),
            Some(vec![counts])
        );
        assert_eq!(tiered.pieces[1].kind, unit.pieces[1].kind);
        let bad = vec![vec![vec![700, 1]], vec![], vec![], vec![vec![5]]];
        assert!(layout_coded_unit(&tensors, &escapes, Some(&bad), usize::MAX).is_err());
        assert!(layout_coded_unit(&tensors, &escapes, Some(&groups[..1]), usize::MAX).is_err());
        let raw = &unit.pieces[1];
        assert_eq!(
            (raw.dst, raw.len, raw.src % PIECE_ALIGN),
            (20_224, 20_736 + 40 - 20_224, 0)
        );
        let PieceKind::Raw(segs) = &raw.kind else {
            panic!()
        };
        let offs: Vec<_> = segs.iter().map(|s| (s.tensor, s.offset, s.len)).collect();
        assert_eq!(offs, [(1, 0, 100), (2, 256, 64), (3, 512, 40)]);
        assert_eq!(unit.out_bytes(), 20_000 + raw.len);
        assert!(unit.nbytes >= raw.src + raw.len && unit.nbytes.is_multiple_of(PIECE_ALIGN));
        assert_eq!(unit.largest_coded(), coded.len);
        // a landing buffer too small for the chunk: sent raw
        let small = layout_coded_unit(&tensors[..1], &escapes[..1], None, 1024).unwrap();
        assert!(matches!(small.pieces[0].kind, PieceKind::Raw(_)));
        assert_eq!(small.nbytes, 20_032);
    }

    #[test]
    fn bad_unit_specs_are_errors() {
        let t = TensorSpec {
            dst: 0,
            nbytes: 11,
            bf16: true,
        };
        assert!(layout_coded_unit(&[t], &[vec![vec![0]]], None, usize::MAX).is_err());
        let t = TensorSpec {
            dst: 0,
            nbytes: 10,
            bf16: true,
        };
        assert!(layout_coded_unit(&[t], &[vec![]], None, usize::MAX).is_err());
        // one range, two counts
        assert!(layout_coded_unit(&[t], &[vec![vec![0, 0]]], None, usize::MAX).is_err());
        assert!(layout_coded_unit(&[t], &[], None, usize::MAX).is_err());
        assert_eq!(
            layout_coded_unit(&[], &[], None, usize::MAX).unwrap(),
            CodedUnit::default()
        );
    }
}
