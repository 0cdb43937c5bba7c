//! Read plans for units streamed from files (the NVMe route).
//!
//! A unit's tensors are byte ranges of one or more safetensors files, each going to its own offset
//! in the unit's slot. Tensors of one unit are usually contiguous in the file, so the ranges are
//! coalesced into extents (gaps up to `max_gap` bytes are read through), each extent is widened to
//! `align` boundaries (so it can be read with `O_DIRECT`, which needs aligned offsets, lengths and
//! buffers) and cut into chunks of at most `max_chunk` bytes, the size of one staging buffer. Each
//! chunk lists the copies from the staging buffer into the slot. No per-tensor reads.

use serde::Serialize;

use crate::error::{CoreError, Result};

/// One tensor's bytes: `len` bytes at `offset` of file `file`, going to byte `dst` of the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReadPiece {
    /// Index of the file (the caller's numbering).
    pub file: usize,
    /// Absolute byte offset in the file.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Byte offset in the destination (the slot).
    pub dst: u64,
}

/// A copy out of a staging buffer holding one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ChunkCopy {
    /// Offset in the chunk (the staging buffer).
    pub buf_off: u64,
    /// Offset in the destination (the slot).
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// One read: `len` bytes at `offset` of `file` (both multiples of the alignment), into one staging
/// buffer, then `copies` out of it. Only the first `needed` bytes must exist in the file: the rest
/// is alignment padding that may lie past its end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReadChunk {
    /// Index of the file.
    pub file: usize,
    /// Aligned absolute offset.
    pub offset: u64,
    /// Aligned length, at most `max_chunk`.
    pub len: u64,
    /// Bytes from `offset` that the copies need.
    pub needed: u64,
    /// Copies out of the buffer, in destination order of the pieces.
    pub copies: Vec<ChunkCopy>,
}

/// Plans the reads of one unit. `align` must be a power of two and `max_chunk` at least `align`
/// (it is rounded down to a multiple of `align`). Empty pieces are ignored.
pub fn plan_reads(
    pieces: &[ReadPiece],
    align: u64,
    max_chunk: u64,
    max_gap: u64,
) -> Result<Vec<ReadChunk>> {
    if align == 0 || !align.is_power_of_two() {
        return Err(CoreError::InvalidPlanRequest(format!(
            "read alignment must be a power of two, got {align}"
        )));
    }
    let max_chunk = max_chunk / align * align;
    if max_chunk == 0 {
        return Err(CoreError::InvalidPlanRequest(format!(
            "a staging buffer must hold at least one aligned block of {align} bytes"
        )));
    }
    let mut sorted: Vec<ReadPiece> = pieces.iter().copied().filter(|p| p.len > 0).collect();
    for p in &sorted {
        // the aligned end must exist too
        let end = p.offset.checked_add(p.len);
        if end
            .and_then(|e| e.checked_next_multiple_of(align))
            .is_none()
        {
            return Err(CoreError::InvalidPlanRequest(format!(
                "read range at offset {} of {} bytes overflows",
                p.offset, p.len
            )));
        }
        if p.dst.checked_add(p.len).is_none() {
            return Err(CoreError::InvalidArgument(format!(
                "a piece of {} bytes going to byte {} of the slot ends past 2^64",
                p.len, p.dst
            )));
        }
    }
    sorted.sort_by_key(|p| (p.file, p.offset, p.dst));

    // Extents: runs of pieces of one file whose aligned blocks are at most `max_gap` apart (pieces
    // sharing a block always merge, so no block is read twice).
    let mut extents: Vec<(usize, u64, u64, Vec<ReadPiece>)> = Vec::new();
    for p in sorted {
        match extents.last_mut() {
            Some((file, _, hi, members))
                if *file == p.file
                    && p.offset / align * align
                        <= (hi.div_ceil(align) * align).saturating_add(max_gap) =>
            {
                *hi = (*hi).max(p.offset + p.len);
                members.push(p);
            }
            _ => extents.push((p.file, p.offset, p.offset + p.len, vec![p])),
        }
    }

    let mut chunks = Vec::new();
    for (file, lo, hi, members) in extents {
        let a_lo = lo / align * align;
        let a_hi = hi.div_ceil(align) * align;
        let mut c_lo = a_lo;
        while c_lo < a_hi {
            let c_hi = c_lo.saturating_add(max_chunk).min(a_hi);
            let mut copies = Vec::new();
            let mut needed = 0;
            for p in &members {
                let ov_lo = p.offset.max(c_lo);
                let ov_hi = (p.offset + p.len).min(c_hi);
                if ov_lo < ov_hi {
                    copies.push(ChunkCopy {
                        buf_off: ov_lo - c_lo,
                        dst: p.dst + (ov_lo - p.offset),
                        len: ov_hi - ov_lo,
                    });
                    needed = needed.max(ov_hi - c_lo);
                }
            }
            if !copies.is_empty() {
                chunks.push(ReadChunk {
                    file,
                    offset: c_lo,
                    len: c_hi - c_lo,
                    needed,
                    copies,
                });
            }
            c_lo = c_hi;
        }
    }
    Ok(chunks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(file: usize, offset: u64, len: u64, dst: u64) -> ReadPiece {
        ReadPiece {
            file,
            offset,
            len,
            dst,
        }
    }

    /// Every destination byte is written exactly once, from the right file byte.
    fn check_cover(pieces: &[ReadPiece], chunks: &[ReadChunk], align: u64, max_chunk: u64) {
        let mut written = std::collections::HashMap::new();
        for c in chunks {
            assert_eq!(c.offset % align, 0, "{c:?}");
            assert_eq!(c.len % align, 0, "{c:?}");
            assert!(c.len <= max_chunk, "{c:?}");
            assert!(c.needed <= c.len);
            for cp in &c.copies {
                assert!(cp.buf_off + cp.len <= c.needed);
                for i in 0..cp.len {
                    let prev = written.insert(cp.dst + i, (c.file, c.offset + cp.buf_off + i));
                    assert!(prev.is_none(), "byte {} written twice", cp.dst + i);
                }
            }
        }
        let total: u64 = pieces.iter().map(|p| p.len).sum();
        assert_eq!(written.len() as u64, total);
        for p in pieces {
            for i in 0..p.len {
                assert_eq!(written[&(p.dst + i)], (p.file, p.offset + i));
            }
        }
    }

    #[test]
    fn contiguous_tensors_become_one_aligned_read() {
        // three tensors back to back in the file, 256-aligned in the slot
        let pieces = [
            piece(0, 1000, 300, 0),
            piece(0, 1300, 50, 512),
            piece(0, 1350, 1000, 768),
        ];
        let chunks = plan_reads(&pieces, 4096, 1 << 20, 0).unwrap();
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0].offset, 0);
        assert_eq!(chunks[0].len, 4096);
        assert_eq!(chunks[0].needed, 2350);
        assert_eq!(chunks[0].copies.len(), 3);
        check_cover(&pieces, &chunks, 4096, 1 << 20);
    }

    #[test]
    fn large_extents_are_cut_into_buffer_sized_chunks() {
        let pieces = [piece(0, 10, 100_000, 0), piece(0, 100_010, 5000, 100_096)];
        let chunks = plan_reads(&pieces, 4096, 3 * 4096 + 100, 0).unwrap();
        assert!(chunks.iter().all(|c| c.len <= 3 * 4096));
        assert_eq!(chunks.len(), 105_010usize.div_ceil(3 * 4096));
        check_cover(&pieces, &chunks, 4096, 3 * 4096);
    }

    #[test]
    fn gaps_and_files_split_extents() {
        let pieces = [
            piece(1, 0, 10, 0),
            piece(0, 0, 10, 256),
            piece(0, 1 << 20, 10, 512),
            piece(0, 100, 10, 768),
        ];
        let chunks = plan_reads(&pieces, 4096, 1 << 20, 4096).unwrap();
        // file 0: [0, 110) one extent (gap 90 <= 4096), [1 MiB, +10) another; file 1 one
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks.iter().filter(|c| c.file == 0).count(), 2);
        check_cover(&pieces, &chunks, 4096, 1 << 20);
        // without a gap allowance [0, 10) and [100, 110) still share their block: one read
        let none = plan_reads(&pieces, 4096, 1 << 20, 0).unwrap();
        assert_eq!(none.len(), 3);
        check_cover(&pieces, &none, 4096, 1 << 20);
    }

    #[test]
    fn no_block_is_read_twice_and_gaps_count_in_blocks() {
        // [0, 5000) and [5001, 5011) share block 1: one read of two blocks
        let shared = [piece(0, 0, 5000, 0), piece(0, 5001, 10, 5120)];
        let chunks = plan_reads(&shared, 4096, 1 << 20, 0).unwrap();
        assert_eq!(
            (chunks.len(), chunks[0].offset, chunks[0].len),
            (1, 0, 8192)
        );
        check_cover(&shared, &chunks, 4096, 1 << 20);
        // blocks 0 and 2: one block apart, merged only when the allowance covers that block
        let apart = [piece(0, 10, 10, 0), piece(0, 8192 + 10, 10, 256)];
        assert_eq!(plan_reads(&apart, 4096, 1 << 20, 0).unwrap().len(), 2);
        assert_eq!(plan_reads(&apart, 4096, 1 << 20, 4095).unwrap().len(), 2);
        let merged = plan_reads(&apart, 4096, 1 << 20, 4096).unwrap();
        assert_eq!((merged.len(), merged[0].len), (1, 3 * 4096));
        check_cover(&apart, &merged, 4096, 1 << 20);
    }

    #[test]
    fn bad_parameters_are_errors() {
        assert!(plan_reads(&[], 3000, 1 << 20, 0).is_err());
        assert!(plan_reads(&[], 4096, 100, 0).is_err());
        assert!(plan_reads(&[piece(0, u64::MAX, 2, 0)], 4096, 1 << 20, 0).is_err());
        // the range fits but its aligned end does not
        assert!(plan_reads(&[piece(0, u64::MAX - 10, 5, 0)], 4096, 1 << 20, 0).is_err());
        assert!(plan_reads(&[piece(0, 5, 0, 0)], 4096, 1 << 20, 0)
            .unwrap()
            .is_empty());
    }
}
