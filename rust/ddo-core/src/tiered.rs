//! A lossless two-tier code for bf16 weights: about 11 bits per value (0.69 of bf16 on normal
//! weights), against the fixed-rate code's 12 ([`crate::codec`]).
//!
//! Sign and mantissa stay one byte per value, as in the fixed-rate code. The exponent of weights
//! drawn from one distribution carries about 2.55 bits of information, concentrated on three
//! neighbouring values, so each [`BLOCK`] of values gets a base `b1` and a split `k`, and each
//! exponent `e` is sent in at most three tiers:
//!
//! | tier | bits | codes                                                                    |
//! |------|------|--------------------------------------------------------------------------|
//! | 1    | 2    | `0..=2`: `e = b1 + code`; `3`: see tier 2                                |
//! | 2    | 3    | `0..k`: `e = b1 - k + code`; `k..=6`: `e = b1 + 3 + code - k`; `7`: escape |
//! | 3    | 32   | an escape: `(index << 8) | e`, sorted by index (as the fixed-rate code's)    |
//!
//! Tier 1 covers about 73 % of normal weights and tiers 1 and 2 together more than 99.5 %: about
//! `2 + 0.27 * 3 + 0.004 * 32 = 2.95` bits per exponent. Every 16-bit pattern comes back exactly
//! (Inf, NaN and subnormals are exponents like any other).
//!
//! A chunk of `n` values (at most [`CHUNK_ELEMS`]) is laid out ([`tiered_layout`]) as
//! `offsets | params | sign+mantissa bytes | tier-1 codes | tier-2 codes | escapes`, each section
//! 16-byte aligned: per block a `u32` offset of its tier-2 codes (in groups of [`GROUP`] codes, three
//! bytes each, so a block's codes start on a byte boundary) and its `(b1, k)`; tier-1 codes four per
//! byte, low bits first; tier-2 codes packed 3 bits each, low bits first, from the block's offset.
//! A GPU thread decoding 8 values reads one 8-byte and one 2-byte word, counts its tier-2 codes,
//! finds its first one by a prefix sum over its block's threads, and writes one 16-byte store.
//!
//! The sizes depend on the values (tier-2 groups and escapes per range, [`count_range`]), counted
//! once before the chunk is coded; ranges of [`SUB_ELEMS`] values are coded in parallel from their
//! counts' prefix sums. This module is the reference: the GPU kernel is checked against it bit
//! for bit.

use crate::codec::{BLOCK, CHUNK_ELEMS, SECTION_ALIGN, SUB_ELEMS, VALUES_PER_THREAD};
use crate::error::{CoreError, Result};

/// Tier-2 codes per group: three bytes.
pub const GROUP: usize = 8;
/// The tier-1 code that defers to tier 2.
pub const T1_NEXT: u16 = 3;
/// The tier-2 code that defers to the escape list.
pub const T2_ESCAPE: u16 = 7;
/// Largest base: tier 1 covers `b1..=b1 + 2`.
pub const MAX_B1: u16 = 253;

const fn align16(n: usize) -> usize {
    n.div_ceil(SECTION_ALIGN) * SECTION_ALIGN
}

/// What one range of values needs besides its fixed-size sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    /// Groups of tier-2 codes (each block's codes rounded up to [`GROUP`]).
    pub groups: usize,
    /// Escapes.
    pub escapes: usize,
}

impl std::ops::Add for Counts {
    type Output = Counts;
    fn add(self, o: Counts) -> Counts {
        Counts {
            groups: self.groups + o.groups,
            escapes: self.escapes + o.escapes,
        }
    }
}

/// Where each section of a chunk sits (byte offsets from its start) and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TieredLayout {
    /// Values.
    pub n: usize,
    /// Its counts.
    pub counts: Counts,
    /// Per block its tier-2 offset in groups (`u32`, little-endian), from offset 0.
    pub offsets: usize,
    /// Per block `b1` then `k` (two bytes).
    pub params: usize,
    /// Sign and mantissa, one byte per value.
    pub signs: usize,
    /// Tier-1 codes, four per byte.
    pub tier1: usize,
    /// Tier-2 codes, three bytes per group.
    pub tier2: usize,
    /// Escapes, one `u32` each.
    pub escapes: usize,
    /// The chunk's size (a multiple of 16).
    pub nbytes: usize,
}

/// The layout of a chunk of `n` values with these counts.
pub fn tiered_layout(n: usize, counts: Counts) -> TieredLayout {
    let padded = n.div_ceil(VALUES_PER_THREAD) * VALUES_PER_THREAD;
    let nb = n.div_ceil(BLOCK);
    let params = align16(4 * nb);
    let signs = params + align16(2 * nb);
    let tier1 = signs + align16(padded);
    let tier2 = tier1 + align16(padded / 4);
    let escapes = tier2 + align16(3 * counts.groups);
    let nbytes = align16(escapes + 4 * counts.escapes);
    TieredLayout {
        n,
        counts,
        offsets: 0,
        params,
        signs,
        tier1,
        tier2,
        escapes,
        nbytes,
    }
}

/// Whether a chunk of `n` values with these counts is smaller coded than raw and no larger than
/// `max_bytes` (the landing buffer a GPU decode reads it from).
pub fn worth_coding(n: usize, counts: Counts, max_bytes: usize) -> bool {
    let size = tiered_layout(n, counts).nbytes;
    n > 0 && size < 2 * n && size <= max_bytes
}

#[inline]
fn exponent(v: u16) -> u16 {
    (v >> 7) & 0xff
}

/// A block's tier parameters: tier 1 covers `b1..b1 + 3`, tier 2 the `k` exponents below it and
/// the `7 - k` above it, so together they cover the ten exponents from `lo = b1 - k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Params {
    b1: u16,
    k: u16,
}

/// Exponents tiers 1 and 2 cover together.
const COVERED: u16 = 10;

impl Params {
    /// Whether `(b1, k)` describes windows inside `0..=255`.
    fn valid(b1: u16, k: u16) -> bool {
        b1 <= MAX_B1 && k <= 7 && k <= b1 && b1 - k + COVERED <= 256
    }

    /// The tier-1 code of exponent `e` (3: not in tier 1) and its tier-2 code (7: an escape; any
    /// value when the tier-1 code is not 3). Branch-free (selects).
    #[inline(always)]
    fn codes(self, e: u16) -> (u16, u16) {
        let d = e.wrapping_sub(self.b1 - self.k); // 0..10 inside the covered window
        let r = d.wrapping_sub(self.k);
        let c1 = if r < 3 { r } else { T1_NEXT };
        let c2 = if d >= COVERED {
            T2_ESCAPE
        } else if d < self.k {
            d
        } else {
            d.wrapping_sub(3)
        };
        (c1, c2)
    }

    /// Both codes, `c1 | c2 << 2`, of exponent `lo + d` for `d` in `0..16` (`lo = b1 - k`): the
    /// ten covered exponents, then escapes (the encoder looks `min(e - lo, 15)` up, wrapping).
    fn table(self) -> [u8; 16] {
        let lo = self.b1 - self.k;
        std::array::from_fn(|d| {
            let (c1, c2) = self.codes(lo.wrapping_add(d as u16));
            let c2 = if d < usize::from(COVERED) {
                c2
            } else {
                T2_ESCAPE
            };
            (c1 | (c2 << 2)) as u8
        })
    }

    /// The exponent of tier-2 code `c` (below 7).
    #[inline(always)]
    fn tier2_exponent(self, c: u16) -> u16 {
        if c < self.k {
            self.b1 - self.k + c
        } else {
            self.b1 + 3 + c - self.k
        }
    }
}

/// A block's exponent histogram, kept as four interleaved ones so that repeated exponents (most
/// values share three or four) do not chain their increments through one memory word.
pub(crate) struct Histogram([[u16; 256]; 4]);

impl Histogram {
    pub(crate) fn new() -> Self {
        Self([[0; 256]; 4])
    }
}

/// The parameters that code one block in the fewest bits (`b1` at or just below its most frequent
/// exponent, `k` the split that leaves the fewest escapes), with the block's tier-2 codes and
/// escapes under them. `hist` must be all zero; it is left so.
fn block_params(block: &[u16], hist: &mut Histogram) -> (Params, usize, usize) {
    let parts = &mut hist.0;
    let quads = block.chunks_exact(4);
    let tail = quads.remainder();
    for q in quads {
        for (part, &v) in parts.iter_mut().zip(q) {
            part[usize::from(exponent(v))] += 1;
        }
    }
    for &v in tail {
        parts[0][usize::from(exponent(v))] += 1;
    }
    let mut total = [0u16; 256];
    for (e, t) in total.iter_mut().enumerate() {
        *t = parts[0][e] + parts[1][e] + parts[2][e] + parts[3][e];
    }
    for part in parts.iter_mut() {
        part.fill(0);
    }
    let mut mode = 0usize;
    for e in 1..256 {
        if total[e] > total[mode] {
            mode = e;
        }
    }
    let n = block.len();
    let h = |e: usize| usize::from(total[e]);
    let mut best = (usize::MAX, Params { b1: 0, k: 0 }, 0usize, 0usize);
    for b1 in mode.saturating_sub(2)..=mode.min(usize::from(MAX_B1)) {
        let tier1 = h(b1) + h(b1 + 1) + h(b1 + 2);
        for k in 0..=7usize {
            if !Params::valid(b1 as u16, k as u16) {
                continue;
            }
            let tier2: usize =
                (b1 - k..b1).map(h).sum::<usize>() + (b1 + 3..b1 - k + 10).map(h).sum::<usize>();
            let (t2, esc) = (n - tier1, n - tier1 - tier2);
            let bits = 3 * t2 + 32 * esc;
            if bits < best.0 {
                best = (
                    bits,
                    Params {
                        b1: b1 as u16,
                        k: k as u16,
                    },
                    t2,
                    esc,
                );
            }
        }
    }
    (best.1, best.2, best.3)
}

/// The counts of a range of values (the first value starts a block).
pub fn count_range(values: &[u16]) -> Counts {
    let mut hist = Histogram::new();
    values
        .chunks(BLOCK)
        .map(|block| {
            let (_, t2, esc) = block_params(block, &mut hist);
            Counts {
                groups: t2.div_ceil(GROUP),
                escapes: esc,
            }
        })
        .fold(Counts::default(), |a, b| a + b)
}

/// The counts of each [`SUB_ELEMS`] range of a chunk (what [`encode_chunk`] and the parallel
/// encoders take).
pub fn count_subs(values: &[u16]) -> Vec<Counts> {
    values.chunks(SUB_ELEMS).map(count_range).collect()
}

/// A chunk's sections, split for writing.
pub struct TieredSections<'a> {
    /// Per block, its tier-2 offset (4 bytes).
    pub offsets: &'a mut [u8],
    /// Per block, `b1` and `k`.
    pub params: &'a mut [u8],
    /// Sign and mantissa bytes.
    pub signs: &'a mut [u8],
    /// Tier-1 codes.
    pub tier1: &'a mut [u8],
    /// Tier-2 codes.
    pub tier2: &'a mut [u8],
    /// Escapes.
    pub escapes: &'a mut [u8],
}

impl TieredLayout {
    /// Splits a buffer of exactly `self.nbytes` bytes into its sections, padding zeroed.
    pub fn split<'a>(&self, out: &'a mut [u8]) -> Result<TieredSections<'a>> {
        if out.len() != self.nbytes {
            return Err(CoreError::InvalidArgument(format!(
                "a tiered chunk of {} values with {:?} codes to {} bytes, the buffer has {}",
                self.n,
                self.counts,
                self.nbytes,
                out.len()
            )));
        }
        out.fill(0);
        let (head, escapes) = out.split_at_mut(self.escapes);
        let (head, tier2) = head.split_at_mut(self.tier2);
        let (head, tier1) = head.split_at_mut(self.tier1);
        let (head, signs) = head.split_at_mut(self.signs);
        let (offsets, params) = head.split_at_mut(self.params);
        Ok(TieredSections {
            offsets,
            params,
            signs,
            tier1,
            tier2,
            escapes,
        })
    }
}

/// Codes values `first..first + values.len()` of a chunk (`first` a multiple of [`BLOCK`]; a range
/// shorter than [`SUB_ELEMS`] only at the chunk's end) into their parts of the sections: `offsets`
/// (4 bytes per block), `params` (2 per block), `signs` (1 per value), `tier1` (1 per 4 values,
/// `first` a multiple of 4), `tier2` (3 bytes per group, exactly [`count_range`]'s groups, the first
/// at group `first_group` of the chunk) and `escapes` (4 bytes per escape, exactly as many as
/// counted). Counts that do not match are an error (the values changed since they were counted).
#[allow(clippy::too_many_arguments)]
pub fn encode_range(
    values: &[u16],
    first: usize,
    first_group: usize,
    offsets: &mut [u8],
    params: &mut [u8],
    signs: &mut [u8],
    tier1: &mut [u8],
    tier2: &mut [u8],
    escapes: &mut [u8],
) -> Result<()> {
    let n = values.len();
    let nb = n.div_ceil(BLOCK);
    let bad = |what: &str| {
        Err(CoreError::InvalidArgument(format!(
            "tiered encode_range of {n} values: {what}"
        )))
    };
    if !first.is_multiple_of(BLOCK) || first + n > (1 << 24) {
        return bad("the first value must start a block and indices stay below 2^24");
    }
    if offsets.len() != 4 * nb
        || params.len() != 2 * nb
        || signs.len() != n
        || tier1.len() != n.div_ceil(4)
        || !tier2.len().is_multiple_of(3)
        || !escapes.len().is_multiple_of(4)
    {
        return bad("section slices of the wrong length");
    }
    let (n_groups, n_esc) = (tier2.len() / 3, escapes.len() / 4);
    let changed = || {
        Err(CoreError::InvalidArgument(format!(
            "values {first}.. do not have the tier-2 groups and escapes counted: they changed while they were coded"
        )))
    };
    let mut hist = Histogram::new();
    let mut t2buf = [0u8; BLOCK + GROUP];
    let mut codebuf = [0u8; BLOCK];
    let (mut group, mut esc) = (0usize, 0usize);
    for (b, block) in values.chunks(BLOCK).enumerate() {
        let (p, t2_count, esc_count) = block_params(block, &mut hist);
        let groups = t2_count.div_ceil(GROUP);
        if group + groups > n_groups || esc + esc_count > n_esc {
            return changed();
        }
        let at = b * BLOCK;
        offsets[4 * b..4 * b + 4].copy_from_slice(&((first_group + group) as u32).to_le_bytes());
        params[2 * b] = p.b1 as u8;
        params[2 * b + 1] = p.k as u8;
        // per value one table lookup (both codes of the ten covered exponents, escapes beyond),
        // tier-2 codes and their positions appended without branches, then the block's few escapes
        let lut = p.table();
        let lo = p.b1 - p.k;
        let len = block.len();
        for (s, &v) in signs[at..at + len].iter_mut().zip(block) {
            *s = (((v >> 8) & 0x80) | (v & 0x7f)) as u8;
        }
        let codes = &mut codebuf[..len];
        for (c, &v) in codes.iter_mut().zip(block) {
            *c = lut[usize::from(exponent(v).wrapping_sub(lo).min(15))];
        }
        let t1 = &mut tier1[at / 4..(at + len).div_ceil(4)];
        for (byte, quad) in t1.iter_mut().zip(codes.chunks(4)) {
            *byte = quad
                .iter()
                .enumerate()
                .fold(0u8, |b, (j, &c)| b | ((c & 3) << (2 * j)));
        }
        let mut pos = 0usize;
        for &code in codes.iter() {
            t2buf[pos & (BLOCK - 1)] = code >> 2;
            pos += usize::from(code & 3 == T1_NEXT as u8);
        }
        if esc_count > 0 {
            const ESCAPED: u8 = (T1_NEXT | (T2_ESCAPE << 2)) as u8;
            for (j, &code) in codes.iter().enumerate() {
                if code == ESCAPED {
                    if esc >= n_esc {
                        return changed();
                    }
                    let entry = (((first + at + j) as u32) << 8) | u32::from(exponent(block[j]));
                    escapes[4 * esc..4 * esc + 4].copy_from_slice(&entry.to_le_bytes());
                    esc += 1;
                }
            }
        }
        if pos != t2_count {
            return changed();
        }
        t2buf[pos..pos + GROUP].fill(0);
        for (g, codes) in t2buf[..groups * GROUP].chunks_exact(GROUP).enumerate() {
            let word = codes
                .iter()
                .enumerate()
                .fold(0u32, |w, (j, &c)| w | (u32::from(c) << (3 * j)));
            let o = 3 * (group + g);
            tier2[o..o + 3].copy_from_slice(&word.to_le_bytes()[..3]);
        }
        group += groups;
    }
    if group != n_groups || esc != n_esc {
        return changed();
    }
    Ok(())
}

/// Codes one chunk (at most [`CHUNK_ELEMS`] values) with the counts of its [`SUB_ELEMS`] ranges
/// (from [`count_subs`]) into `out`, exactly [`tiered_layout`]`(n, total).nbytes` bytes, on the
/// calling thread.
pub fn encode_chunk(values: &[u16], subs: &[Counts], out: &mut [u8]) -> Result<()> {
    let n = values.len();
    if n > CHUNK_ELEMS || subs.len() != n.div_ceil(SUB_ELEMS) {
        return Err(CoreError::InvalidArgument(format!(
            "a tiered chunk holds at most {CHUNK_ELEMS} values with one count per {SUB_ELEMS}, got {n} values and {} counts",
            subs.len()
        )));
    }
    let total = subs.iter().fold(Counts::default(), |a, &b| a + b);
    let lay = tiered_layout(n, total);
    let sec = lay.split(out)?;
    let mut at = Counts::default();
    for (s, (range, &c)) in values.chunks(SUB_ELEMS).zip(subs).enumerate() {
        let first = s * SUB_ELEMS;
        let (b0, nb) = (first / BLOCK, range.len().div_ceil(BLOCK));
        encode_range(
            range,
            first,
            at.groups,
            &mut sec.offsets[4 * b0..4 * (b0 + nb)],
            &mut sec.params[2 * b0..2 * (b0 + nb)],
            &mut sec.signs[first..first + range.len()],
            &mut sec.tier1[first / 4..(first + range.len()).div_ceil(4)],
            &mut sec.tier2[3 * at.groups..3 * (at.groups + c.groups)],
            &mut sec.escapes[4 * at.escapes..4 * (at.escapes + c.escapes)],
        )?;
        at = at + c;
    }
    Ok(())
}

fn corrupt(msg: String) -> CoreError {
    CoreError::InvalidArgument(format!("corrupt tiered chunk: {msg}"))
}

/// Decodes one chunk of `out.len()` values with these counts from `coded` (at least
/// [`tiered_layout`]`(n, counts).nbytes` bytes). A chunk that is not what [`encode_chunk`] writes
/// (parameters out of range, offsets or escapes that do not match the codes) is an error.
/// [`decode_blocks`] and [`apply_escapes`] are its two halves, for decoding ranges in parallel.
pub fn decode_chunk(coded: &[u8], counts: Counts, out: &mut [u16]) -> Result<()> {
    let n = out.len();
    let range = decode_blocks(coded, n, counts, 0, out)?;
    if range.start_group != 0 {
        return Err(corrupt(format!(
            "block 0 starts its tier-2 codes at group {}, expected 0",
            range.start_group
        )));
    }
    apply_escapes(coded, counts, range.end_group, &range.escaped, out)
}

/// The layout of a chunk of `n` values with these counts, checked to fit in `coded`.
fn sections(coded: &[u8], n: usize, counts: Counts) -> Result<TieredLayout> {
    let lay = tiered_layout(n, counts);
    if coded.len() < lay.nbytes {
        return Err(corrupt(format!(
            "{n} values with {counts:?} need {} bytes, got {}",
            lay.nbytes,
            coded.len()
        )));
    }
    Ok(lay)
}

/// What [`decode_blocks`] found in its range: the tier-2 groups it read (from its first block's
/// offset to the next range's), and its values whose tier-2 code is an escape, in order.
#[derive(Debug, Default)]
pub struct BlockRange {
    /// The tier-2 group its first block starts at (its offset as stored).
    pub start_group: usize,
    /// The group after its last block's codes.
    pub end_group: usize,
    /// Chunk indices of the values the escape list fills in.
    pub escaped: Vec<usize>,
}

/// Decodes values `first..first + out.len()` of a chunk of `n` values with these counts (`first`
/// starts a block; the range ends at a block's end or at `n`), escaped exponents left for
/// [`apply_escapes`]. Each block's tier-2 offset must follow from the one before inside the range;
/// between ranges the caller checks that one's `end_group` is the next one's `start_group` (the
/// first's 0). Ranges decode independently (in parallel).
pub fn decode_blocks(
    coded: &[u8],
    n: usize,
    counts: Counts,
    first: usize,
    out: &mut [u16],
) -> Result<BlockRange> {
    let lay = sections(coded, n, counts)?;
    let len = out.len();
    crate::codec::whole_blocks(first, len, n)?;
    let nb = n.div_ceil(BLOCK);
    let b0 = first / BLOCK;
    // the sections as slices of exactly their length: the loops below index without checks
    let offsets = &coded[lay.offsets..lay.offsets + 4 * nb];
    let params = &coded[lay.params..lay.params + 2 * nb];
    let signs = &coded[lay.signs + first..lay.signs + first + len];
    let tier1 = &coded[lay.tier1 + first / 4..lay.tier1 + (first + len).div_ceil(4)];
    let tier2 = &coded[lay.tier2..lay.tier2 + 3 * counts.groups];
    let offset_of = |b: usize| {
        let o = &offsets[4 * b..4 * b + 4];
        u32::from_le_bytes([o[0], o[1], o[2], o[3]]) as usize
    };
    let mut at = [0u16; BLOCK]; // a block's values that read tier 2, in order
    let mut range = BlockRange {
        start_group: if len == 0 { 0 } else { offset_of(b0) },
        ..BlockRange::default()
    };
    let mut group = range.start_group;
    for (bi, (block, (s, t1))) in out
        .chunks_mut(BLOCK)
        .zip(signs.chunks(BLOCK).zip(tier1.chunks(BLOCK / 4)))
        .enumerate()
    {
        let b = b0 + bi;
        let offset = offset_of(b);
        if offset != group {
            return Err(corrupt(format!(
                "block {b} starts its tier-2 codes at group {offset}, expected {group}"
            )));
        }
        let p = Params {
            b1: u16::from(params[2 * b]),
            k: u16::from(params[2 * b + 1]),
        };
        if !Params::valid(p.b1, p.k) {
            return Err(corrupt(format!("block {b} has b1 = {}, k = {}", p.b1, p.k)));
        }
        // pass 1: sign, mantissa and the tier-1 exponent of every value (0 where tier 2 decides),
        // and which values read tier 2
        let lut1 = [p.b1 << 7, (p.b1 + 1) << 7, (p.b1 + 2) << 7, 0];
        let mut t2 = 0usize;
        for (j, (v, &sm)) in block.iter_mut().zip(s).enumerate() {
            let c1 = usize::from((t1[j / 4] >> (2 * (j % 4))) & 3);
            let sm = u16::from(sm);
            *v = ((sm & 0x80) << 8) | lut1[c1] | (sm & 0x7f);
            at[t2] = j as u16;
            t2 += usize::from(c1 == usize::from(T1_NEXT));
        }
        // pass 2: their tier-2 codes, GROUP to a 24-bit word
        let groups = t2.div_ceil(GROUP);
        if group + groups > counts.groups {
            return Err(corrupt(format!(
                "block {b} reads tier-2 groups up to {} of {}",
                group + groups,
                counts.groups
            )));
        }
        let mut lut2 = [0u16; 8];
        for (c, e) in lut2.iter_mut().enumerate().take(usize::from(T2_ESCAPE)) {
            *e = p.tier2_exponent(c as u16) << 7;
        }
        for (g, idx) in at[..t2].chunks(GROUP).enumerate() {
            let w = &tier2[3 * (group + g)..3 * (group + g) + 3];
            let word = u32::from(w[0]) | (u32::from(w[1]) << 8) | (u32::from(w[2]) << 16);
            for (q, &j) in idx.iter().enumerate() {
                let c2 = ((word >> (3 * q)) & 7) as usize;
                block[usize::from(j)] |= lut2[c2];
                if c2 == usize::from(T2_ESCAPE) {
                    range.escaped.push(b * BLOCK + usize::from(j));
                }
            }
        }
        group += groups;
    }
    range.end_group = group;
    Ok(range)
}

/// Writes the escape list's exponents into a chunk's values `out` (all of them) decoded by
/// [`decode_blocks`]: the ranges' tier-2 groups must end at `end_group == counts.groups`, and
/// `escaped` (their escaped values, in order) must be the list's entries one to one.
pub fn apply_escapes(
    coded: &[u8],
    counts: Counts,
    end_group: usize,
    escaped: &[usize],
    out: &mut [u16],
) -> Result<()> {
    let n = out.len();
    let lay = sections(coded, n, counts)?;
    if end_group != counts.groups || escaped.len() != counts.escapes {
        return Err(corrupt(format!(
            "{counts:?} listed, {end_group} groups and {} escapes used",
            escaped.len()
        )));
    }
    let list = &coded[lay.escapes..lay.escapes + 4 * counts.escapes];
    for (k, (entry, &i)) in list.chunks_exact(4).zip(escaped).enumerate() {
        let entry = u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]);
        if (entry >> 8) as usize != i || i >= n {
            return Err(corrupt(format!(
                "escape {k} is for value {}, expected {i}",
                entry >> 8
            )));
        }
        out[i] |= ((entry & 0xff) as u16) << 7;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-normal bf16 values (sum of uniforms), scale `sigma`.
    fn normal(n: usize, sigma: f32, seed: u64) -> Vec<u16> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut uni = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f32 / (1u64 << 53) as f32
        };
        (0..n)
            .map(|_| {
                let z: f32 = (0..12).map(|_| uni()).sum::<f32>() - 6.0;
                ((z * sigma).to_bits() >> 16) as u16
            })
            .collect()
    }

    fn roundtrip(values: &[u16]) -> usize {
        let subs = count_subs(values);
        let total = subs.iter().fold(Counts::default(), |a, &b| a + b);
        assert_eq!(total, count_range(values));
        let lay = tiered_layout(values.len(), total);
        let mut coded = vec![0xAAu8; lay.nbytes];
        encode_chunk(values, &subs, &mut coded).unwrap();
        let mut back = vec![0u16; values.len()];
        decode_chunk(&coded, total, &mut back).unwrap();
        assert_eq!(back, values);
        lay.nbytes
    }

    #[test]
    fn normal_weights_take_about_eleven_bits() {
        for sigma in [0.02f32, 1.0, 3e-4] {
            let v = normal(1 << 20, sigma, 7);
            let ratio = roundtrip(&v) as f64 / (2 * v.len()) as f64;
            assert!(ratio < 0.695, "sigma {sigma}: ratio {ratio}");
            let fixed = crate::codec::chunk_layout(v.len(), crate::codec::count_escapes(&v)).nbytes;
            assert!((roundtrip(&v) as f64) < 0.93 * fixed as f64);
        }
    }

    #[test]
    fn every_bit_pattern_and_edge_value_comes_back() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        roundtrip(&all);
        let edges = [
            0u16, 0x8000, 0x0001, 0x807f, 0x7f80, 0xff80, 0x7fc1, 0xffff, 0x3f80, 0x0080,
        ];
        for n in 0..1100 {
            let v: Vec<u16> = (0..n)
                .map(|i| edges[i % edges.len()] ^ (i as u16 & 0x7f))
                .collect();
            roundtrip(&v);
        }
        let mut random = normal(70_000, 1.0, 3);
        for (i, x) in random.iter_mut().enumerate() {
            *x = (i as u16).wrapping_mul(40_503) ^ (*x).rotate_left(5);
        }
        roundtrip(&random);
    }

    #[test]
    fn mixed_scales_and_all_escape_blocks() {
        let mut v = normal(3 * SUB_ELEMS + 777, 0.02, 1);
        for (i, x) in v.iter_mut().enumerate() {
            if (i / BLOCK) % 5 == 2 {
                *x = ((i as u32).wrapping_mul(2_654_435_761) >> 16) as u16; // every exponent: mostly escapes
            } else if (i / BLOCK) % 5 == 3 {
                *x = 0; // zeros: one exponent
            }
        }
        roundtrip(&v);
    }

    #[test]
    fn counts_that_do_not_match_and_corrupt_chunks_are_errors() {
        let v = normal(5000, 0.02, 9);
        let subs = count_subs(&v);
        let total = subs[0];
        let lay = tiered_layout(v.len(), total);
        let mut coded = vec![0u8; lay.nbytes];
        encode_chunk(&v, &subs, &mut coded).unwrap();
        let wrong = [Counts {
            groups: total.groups + 1,
            ..total
        }];
        let mut other = vec![0u8; tiered_layout(v.len(), wrong[0]).nbytes];
        assert!(encode_chunk(&v, &wrong, &mut other).is_err());
        assert!(encode_chunk(&v, &subs, &mut other).is_err()); // buffer of the wrong size
        let mut back = vec![0u16; v.len()];
        assert!(decode_chunk(&coded[..lay.nbytes - 16], total, &mut back).is_err());
        let mut bad = coded.clone();
        bad[lay.params] = 255; // b1 out of range
        assert!(decode_chunk(&bad, total, &mut back).is_err());
        let mut bad = coded.clone();
        bad[lay.offsets + 4] ^= 1; // block 1's offset
        assert!(decode_chunk(&bad, total, &mut back).is_err());
        if total.escapes > 0 {
            let mut bad = coded.clone();
            bad[lay.escapes + 1] ^= 1; // escape 0's index
            assert!(decode_chunk(&bad, total, &mut back).is_err());
        }
        assert!(decode_chunk(
            &coded,
            Counts {
                escapes: total.escapes + 1,
                ..total
            },
            &mut back
        )
        .is_err());
    }

    #[test]
    fn any_corrupt_byte_decodes_to_an_error_or_a_value_never_a_panic() {
        let mut v = normal(1300, 1.0, 4);
        v[5] = 0x7f80; // escapes
        v[700] = 0x0001;
        let subs = count_subs(&v);
        let total = subs.iter().fold(Counts::default(), |a, &b| a + b);
        assert!(total.escapes >= 2 && total.groups > 0);
        let lay = tiered_layout(v.len(), total);
        let mut coded = vec![0u8; lay.nbytes];
        encode_chunk(&v, &subs, &mut coded).unwrap();
        let mut back = vec![0u16; v.len()];
        decode_chunk(&coded, total, &mut back).unwrap();
        assert_eq!(back, v);
        for at in 0..coded.len() {
            for x in [0u8, 0x03, 0x30, 0xff, coded[at] ^ 0x04] {
                let mut bad = coded.clone();
                bad[at] = x;
                let _ = decode_chunk(&bad, total, &mut back); // Ok or Err, never a panic
            }
        }
    }

    #[test]
    fn layout_sections_are_aligned_and_worth_coding_says_when_to_send_raw() {
        let lay = tiered_layout(
            1001,
            Counts {
                groups: 33,
                escapes: 5,
            },
        );
        for at in [
            lay.params,
            lay.signs,
            lay.tier1,
            lay.tier2,
            lay.escapes,
            lay.nbytes,
        ] {
            assert_eq!(at % SECTION_ALIGN, 0);
        }
        assert!(worth_coding(
            1 << 20,
            Counts {
                groups: 40_000,
                escapes: 100
            },
            usize::MAX
        ));
        assert!(!worth_coding(
            1000,
            Counts {
                groups: 125,
                escapes: 900
            },
            usize::MAX
        ));
        assert!(!worth_coding(0, Counts::default(), usize::MAX));
        assert!(!worth_coding(1 << 20, Counts::default(), 1 << 10));
    }

    /// The two-tier and fixed-rate codes' sizes on normal weights, and one thread's speeds: a
    /// measurement, not a check (`cargo test --release -p ddo-core tiered_speed -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn tiered_speed() {
        use crate::codec;
        use std::time::Instant;

        let n = codec::CHUNK_ELEMS;
        // each step the fastest of three, into touched memory (the first write of fresh memory
        // adds its page faults, which an attach or a remove() pays once)
        let best = |f: &mut dyn FnMut()| {
            (0..3)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        for sigma in [0.02f32, 1.0] {
            let v = normal(n, sigma, 1);
            let mut subs = Vec::new();
            let count_s = best(&mut || {
                subs = std::hint::black_box(super::count_subs(std::hint::black_box(&v)))
            });
            let total = subs.iter().fold(Counts::default(), |a, &b| a + b);
            let lay = super::tiered_layout(n, total);
            let mut out = vec![0u8; lay.nbytes];
            let enc_s = best(&mut || super::encode_chunk(&v, &subs, &mut out).unwrap());
            let mut back = vec![0u16; n];
            let dec_s = best(&mut || super::decode_chunk(&out, total, &mut back).unwrap());
            assert_eq!(back, v);
            let mut n_esc = 0;
            let fixed_count_s = best(&mut || {
                n_esc = std::hint::black_box(codec::count_escapes(std::hint::black_box(&v)))
            });
            let fixed = codec::chunk_layout(n, n_esc).nbytes;
            let mut fixed_out = vec![0u8; fixed];
            let fixed_enc_s = best(&mut || codec::encode_chunk(&v, n_esc, &mut fixed_out).unwrap());
            let mut fixed_back = vec![0u16; n];
            let fixed_dec_s =
                best(&mut || codec::decode_chunk(&fixed_out, n_esc, &mut fixed_back).unwrap());
            assert_eq!(fixed_back, v);
            let gb = (2 * n) as f64 / 1e9;
            println!(
                "normal(0, {sigma}), {n} values: tiered {:.4} of bf16 ({} tier-2 groups, {} escapes), fixed {:.4}; \
                 one thread: count {:.2} GB/s, encode {:.2} GB/s, decode {:.2} GB/s of bf16 \
                 (fixed: count {:.2} GB/s, encode {:.2} GB/s, decode {:.2} GB/s)",
                lay.nbytes as f64 / (2 * n) as f64,
                total.groups,
                total.escapes,
                fixed as f64 / (2 * n) as f64,
                gb / count_s,
                gb / enc_s,
                gb / dec_s,
                gb / fixed_count_s,
                gb / fixed_enc_s,
                gb / fixed_dec_s
            );
        }
    }
}
