//! How a coded unit's chunks cross the link into the decode ring's landing buffers: consecutive
//! coded chunks, and the few raw bytes between them in the host buffer, go in one copy of up to a
//! few buffers ([`Batch`]), not one copy a chunk.
//!
//! On the H200 a 12 MiB host-to-device copy ran at 52.5 GB/s where copies of 64 MiB and more ran
//! at 55.4 GB/s (the fixed overhead of a copy, and the event wait and record between two), so a
//! unit sent chunk by chunk lost about 5 % of the link. A batch lands contiguously from the start
//! of a landing buffer; each of its chunks is decoded from its offset in the batch (the host
//! buffer's 64-byte alignment of pieces keeps them aligned), and the batch's buffers are reused
//! once its last decode ran.
//!
//! The raw bytes inside a batch (biases, norms and padding between two coded chunks of a unit, at
//! most [`MAX_GAP`] at a time) are sent twice: once in the batch, where nothing reads them, and once
//! straight into the slot as before. [`link_bytes`] counts both.

use crate::codec::{CodedUnit, PieceKind};
use crate::error::{CoreError, Result};

/// Most host bytes between two coded chunks that a batch sends along rather than starting anew.
pub const MAX_GAP: usize = 64 << 10;

/// Coded chunks of one unit copied together into consecutive landing buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Offset of the copy in the unit's host buffer (its first chunk's).
    pub src: usize,
    /// Bytes copied: from the first chunk's start to the last one's end.
    pub len: usize,
    /// Landing buffers the copy fills (`len` rounded up to whole buffers).
    pub buffers: usize,
    /// Indices into the unit's pieces of the coded chunks it carries, in order.
    pub pieces: Vec<usize>,
}

/// The batches of `unit`'s coded chunks for landing buffers of `landing_bytes`, each batch at most
/// `max_buffers` of them. Every coded chunk is in exactly one batch, in piece order.
pub fn landing_batches(
    unit: &CodedUnit,
    landing_bytes: usize,
    max_buffers: usize,
) -> Result<Vec<Batch>> {
    if landing_bytes == 0 || max_buffers == 0 {
        return Err(CoreError::InvalidArgument(format!(
            "batches need landing buffers of at least one byte and at least one a batch, got {landing_bytes} bytes \
             and {max_buffers}"
        )));
    }
    let limit = landing_bytes.saturating_mul(max_buffers);
    let mut out: Vec<Batch> = Vec::new();
    let mut last_end = 0usize;
    for (i, p) in unit.pieces.iter().enumerate() {
        if !matches!(p.kind, PieceKind::Coded { .. }) {
            continue;
        }
        if p.len > landing_bytes {
            return Err(CoreError::InvalidArgument(format!(
                "a coded chunk of {} bytes does not fit the {landing_bytes}-byte landing buffers",
                p.len
            )));
        }
        let end = p.src.checked_add(p.len).ok_or_else(|| {
            CoreError::InvalidArgument("a coded chunk runs past the address space".into())
        })?;
        if p.src < last_end {
            return Err(CoreError::InvalidArgument(
                "coded chunks out of host order (a unit's pieces follow its host buffer)".into(),
            ));
        }
        match out.last_mut() {
            Some(b) if p.src - last_end <= MAX_GAP && end - b.src <= limit => {
                b.len = end - b.src;
                b.pieces.push(i);
            }
            _ => out.push(Batch {
                src: p.src,
                len: p.len,
                buffers: 0,
                pieces: vec![i],
            }),
        }
        last_end = end;
    }
    for b in &mut out {
        b.buffers = b.len.div_ceil(landing_bytes);
    }
    Ok(out)
}

/// Bytes one fetch of `unit` sends with these batches: its raw pieces and every batch's copy.
pub fn link_bytes(unit: &CodedUnit, batches: &[Batch]) -> usize {
    let raw: usize = unit
        .pieces
        .iter()
        .filter(|p| matches!(p.kind, PieceKind::Raw(_)))
        .map(|p| p.len)
        .sum();
    raw + batches.iter().map(|b| b.len).sum::<usize>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{Piece, Segment};

    fn coded(src: usize, len: usize) -> Piece {
        Piece {
            kind: PieceKind::Coded {
                tensor: 0,
                first_value: 0,
                values: len,
                escapes: 0,
                sub_escapes: vec![],
                sub_groups: None,
            },
            src,
            len,
            dst: src,
        }
    }

    fn raw(src: usize, len: usize) -> Piece {
        Piece {
            kind: PieceKind::Raw(vec![Segment {
                tensor: 1,
                tensor_offset: 0,
                offset: 0,
                len,
            }]),
            src,
            len,
            dst: src,
        }
    }

    fn unit(pieces: Vec<Piece>) -> CodedUnit {
        let nbytes = pieces.iter().map(|p| p.src + p.len).max().unwrap_or(0);
        CodedUnit { pieces, nbytes }
    }

    #[test]
    fn consecutive_chunks_share_a_copy_up_to_the_batch_size() {
        // four chunks of 100 bytes, back to back, buffers of 128 bytes, two a batch
        let u = unit((0..4).map(|i| coded(i * 100, 100)).collect());
        let b = landing_batches(&u, 128, 2).unwrap();
        assert_eq!(
            b,
            vec![
                Batch {
                    src: 0,
                    len: 200,
                    buffers: 2,
                    pieces: vec![0, 1]
                },
                Batch {
                    src: 200,
                    len: 200,
                    buffers: 2,
                    pieces: vec![2, 3]
                },
            ]
        );
        assert_eq!(link_bytes(&u, &b), 400);
        // one buffer a batch: a copy a chunk, as before batches
        let one = landing_batches(&u, 128, 1).unwrap();
        assert_eq!(one.len(), 4);
        assert!(one.iter().all(|b| b.buffers == 1 && b.pieces.len() == 1));
    }

    #[test]
    fn small_raw_pieces_are_sent_along_and_counted_large_ones_split_the_batch() {
        let gap = MAX_GAP;
        let u = unit(vec![
            coded(0, 1000),
            raw(1024, 64), // a bias: sent along
            coded(1088, 1000),
            raw(2112, gap + 1), // a chunk left raw: too far, a new batch
            coded(2112 + gap + 1 + 63, 1000),
        ]);
        let b = landing_batches(&u, 4096, 4).unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(
            (b[0].src, b[0].len, b[0].buffers, b[0].pieces.clone()),
            (0, 2088, 1, vec![0, 2])
        );
        assert_eq!(b[1].pieces, vec![4]);
        // the bias crosses twice (in the batch and into the slot), the big raw piece once
        assert_eq!(link_bytes(&u, &b), 64 + gap + 1 + 2088 + 1000);
    }

    #[test]
    fn bad_input_is_an_error() {
        let u = unit(vec![coded(0, 200)]);
        assert!(landing_batches(&u, 100, 4).is_err()); // a chunk larger than a buffer
        assert!(landing_batches(&u, 0, 4).is_err());
        assert!(landing_batches(&u, 256, 0).is_err());
        let backwards = unit(vec![coded(500, 10), coded(0, 10)]);
        assert!(landing_batches(&backwards, 256, 4).is_err());
        assert!(landing_batches(&unit(vec![raw(0, 10)]), 256, 4)
            .unwrap()
            .is_empty());
    }
}
