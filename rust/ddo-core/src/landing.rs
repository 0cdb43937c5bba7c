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
//! A unit with coded chunks sends its raw pieces (biases, norms, chunks left raw) through the
//! landing ring too, as members of the batches: the decode stream copies them from the landing
//! buffer into the slot (device to device) after its wait for the slot's release. The link then
//! never waits for a slot, only for landing buffers to be decoded out of, so it moves the next
//! units while the slots are still in use (on the H200 the copy stream's wait for each slot, which
//! the raw pieces needed when they went straight into the slot, held the link back behind the
//! compute at 8 GiB). Only a raw piece larger than a batch goes straight into the slot
//! ([`direct_pieces`]). The padding between pieces in a batch (at most [`MAX_GAP`] at a time)
//! crosses the link with it; [`link_bytes`] counts it.

use crate::codec::{CodedUnit, PieceKind};
use crate::error::{CoreError, Result};

/// Most host bytes between two pieces of a batch (alignment padding) that it sends along rather
/// than starting anew.
pub const MAX_GAP: usize = 64 << 10;

/// Pieces of one unit (its coded chunks and the raw pieces between them) copied together into
/// consecutive landing buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Offset of the copy in the unit's host buffer (its first piece's).
    pub src: usize,
    /// Bytes copied: from the first piece's start to the last one's end.
    pub len: usize,
    /// Landing buffers the copy fills (`len` rounded up to whole buffers).
    pub buffers: usize,
    /// Indices into the unit's pieces of the pieces it carries (coded and raw), in order.
    pub pieces: Vec<usize>,
}

/// The batches of `unit`'s pieces for landing buffers of `landing_bytes`, each batch at most
/// `max_buffers` of them. Every coded chunk is in exactly one batch, and so is every raw piece that
/// fits a batch, in piece order; a unit without coded chunks has no batch (it is sent raw).
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
    if unit.largest_coded() == 0 {
        return Ok(out);
    }
    let mut last_end = 0usize;
    for (i, p) in unit.pieces.iter().enumerate() {
        let coded = matches!(p.kind, PieceKind::Coded { .. });
        if !coded && p.len > limit {
            continue; // straight into the slot
        }
        if coded && p.len > landing_bytes {
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
                "pieces out of host order (a unit's pieces follow its host buffer)".into(),
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

/// Indices into `unit`'s pieces of those no batch carries: raw pieces copied straight into the
/// slot (all of them for a unit without batches), in order.
pub fn direct_pieces(unit: &CodedUnit, batches: &[Batch]) -> Vec<usize> {
    let mut carried = vec![false; unit.pieces.len()];
    for &i in batches.iter().flat_map(|b| &b.pieces) {
        carried[i] = true;
    }
    (0..unit.pieces.len()).filter(|&i| !carried[i]).collect()
}

/// Bytes one fetch of `unit` sends with these batches: every batch's copy and the pieces sent
/// straight into the slot.
pub fn link_bytes(unit: &CodedUnit, batches: &[Batch]) -> usize {
    let direct: usize = direct_pieces(unit, batches)
        .into_iter()
        .map(|i| unit.pieces[i].len)
        .sum();
    direct + batches.iter().map(|b| b.len).sum::<usize>()
}

/// Where in a ring of `ring` landing buffers the next batch of `buffers` buffers lands, the ring
/// turning from `next` (where the previous batch ended): `next` when the batch fits before the
/// ring's end, else its start (the buffers skipped at the end wait for the next turn). Returns
/// `(first buffer, next)`, or `None` for an empty batch or one larger than the ring.
///
/// Batches take only the buffers they fill, so a ring holds as many batches in flight as fit in
/// it: a copy waits only for the decodes of the buffers it overwrites. (Until 2026-12-03 each batch
/// took a half of the ring, so two batches were in flight whatever their sizes: at 8 GiB Flux's
/// streamed child units, 4-9 buffers each, had two units of a 35-buffer ring in flight, and a
/// 64-buffer ring ran no faster than 35.)
pub fn ring_place(next: usize, buffers: usize, ring: usize) -> Option<(usize, usize)> {
    if buffers == 0 || buffers > ring {
        return None;
    }
    let first = if next.checked_add(buffers)? <= ring {
        next
    } else {
        0
    };
    Some((first, (first + buffers) % ring))
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
                ranges: None,
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
    fn raw_pieces_that_fit_a_batch_travel_in_it_larger_ones_go_straight_to_the_slot() {
        let big = 4 * 4096 + 1; // larger than a batch of four 4096-byte buffers
        let u = unit(vec![
            raw(0, 100), // a norm before the first chunk: carried
            coded(128, 1000),
            raw(1152, 64), // a bias between two chunks: carried
            coded(1216, 1000),
            raw(2240, big), // larger than a batch: straight into the slot, and a new batch after it
            coded(2240 + big + 63, 1000),
        ]);
        let b = landing_batches(&u, 4096, 4).unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(
            (b[0].src, b[0].len, b[0].buffers, b[0].pieces.clone()),
            (0, 2216, 1, vec![0, 1, 2, 3])
        );
        assert_eq!(b[1].pieces, vec![5]);
        assert_eq!(direct_pieces(&u, &b), vec![4]);
        // every byte crosses once: the batches and the one raw piece that no batch carries
        assert_eq!(link_bytes(&u, &b), 2216 + big + 1000);
        // a unit with no coded chunk has no batch: all of it goes straight into the slot
        let plain = unit(vec![raw(0, 10), raw(64, 10)]);
        let none = landing_batches(&plain, 4096, 4).unwrap();
        assert!(none.is_empty());
        assert_eq!(direct_pieces(&plain, &none), vec![0, 1]);
        assert_eq!(link_bytes(&plain, &none), 20);
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

    #[test]
    fn the_ring_holds_as_many_batches_as_fit_each_in_buffers_of_its_own() {
        // a 35-buffer ring, units of 6 buffers: five in flight before a buffer is reused
        let (mut next, mut placed) = (0, vec![]);
        for _ in 0..7 {
            let (first, n) = ring_place(next, 6, 35).unwrap();
            placed.push(first);
            next = n;
        }
        // 30..35 skipped: a batch is contiguous
        assert_eq!(placed, vec![0, 6, 12, 18, 24, 0, 6]);
        // every placement lies inside the ring, for any size and start
        for ring in 1..40 {
            for buffers in 1..=ring {
                for next in 0..ring {
                    let (first, n) = ring_place(next, buffers, ring).unwrap();
                    assert!(first + buffers <= ring && n < ring);
                    assert!(first == next || first == 0);
                }
            }
        }
        // a batch that fills the ring, and the cases it refuses
        assert_eq!(ring_place(3, 35, 35), Some((0, 0)));
        assert_eq!(ring_place(0, 36, 35), None);
        assert_eq!(ring_place(0, 0, 35), None);
        assert_eq!(ring_place(usize::MAX, 1, 35), None);
    }

    #[test]
    fn a_batch_overwrites_no_buffer_of_the_batches_placed_since_the_ring_last_came_round() {
        // mixed sizes: each batch is disjoint from every batch placed since the ring's last turn
        // began, so a copy waits (per buffer) only for decodes a whole turn of the ring back
        let sizes = [4, 9, 17, 6, 6, 1, 17, 9, 4, 35, 2, 8, 30, 5];
        let ring = 35;
        let (mut next, mut turn): (usize, Vec<(usize, usize)>) = (0, vec![]);
        for &b in &sizes {
            let (first, n) = ring_place(next, b, ring).unwrap();
            if first == 0 {
                turn.clear(); // a new turn: the earlier batches' buffers are reused in order
            }
            for &(f, l) in &turn {
                assert!(
                    first + b <= f || f + l <= first,
                    "[{first}, +{b}) overlaps [{f}, +{l})"
                );
            }
            turn.push((first, b));
            next = n;
        }
    }
}
