//! Byte layout of units inside device slabs.
//!
//! A *unit* is a list of tensors that is streamed host-to-device as one
//! contiguous copy. Each tensor starts on an [`ALIGN`]-byte boundary inside its
//! unit, and units are packed, in order, into slabs (large device
//! allocations) of bounded size.

use serde::Serialize;

use crate::error::{CoreError, Result};

/// Alignment of every tensor inside a unit and of every unit inside a slab.
pub const ALIGN: u64 = 256;

/// Rounds `x` up to a multiple of [`ALIGN`], saturating near `u64::MAX`.
pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// Where each tensor of a unit lives, relative to the unit start.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct UnitLayout {
    /// Per tensor, the offset from the unit start; always a multiple of [`ALIGN`].
    pub offsets: Vec<u64>,
    /// Unit size in bytes, rounded up to [`ALIGN`].
    pub nbytes: u64,
}

/// Lays out one unit's tensors back to back, each [`ALIGN`]-aligned.
///
/// Zero-size tensors get an aligned offset and take no space. Errors:
/// [`CoreError::InvalidArgument`] when the unit would not fit in 2^64 bytes.
pub fn layout_unit(tensor_bytes: &[u64]) -> Result<UnitLayout> {
    let mut end = 0u64;
    let mut offsets = Vec::new();
    offsets
        .try_reserve_exact(tensor_bytes.len())
        .map_err(|_| too_many(tensor_bytes.len(), "tensor"))?;
    for (i, &bytes) in tensor_bytes.iter().enumerate() {
        let offset = checked_align_up(end);
        let Some((offset, next)) = offset.and_then(|o| Some((o, o.checked_add(bytes)?))) else {
            return Err(CoreError::InvalidArgument(format!(
                "tensor {i} of {bytes} bytes does not fit in a unit that already holds {end} \
                 bytes: the unit would exceed 2^64 bytes"
            )));
        };
        offsets.push(offset);
        end = next;
    }
    let nbytes = checked_align_up(end).ok_or_else(|| {
        CoreError::InvalidArgument(format!(
            "a unit of {end} bytes, rounded up to {ALIGN}-byte alignment, exceeds 2^64 bytes"
        ))
    })?;
    Ok(UnitLayout { offsets, nbytes })
}

fn checked_align_up(x: u64) -> Option<u64> {
    x.checked_next_multiple_of(ALIGN)
}

fn too_many(n: usize, what: &str) -> CoreError {
    CoreError::InvalidArgument(format!(
        "cannot allocate the layout of {n} {what}s: out of host memory"
    ))
}

/// Where one unit lives in the slabs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct UnitPlacement {
    /// Index into [`SlabLayout::slabs`].
    pub slab: usize,
    /// Offset inside the slab; a multiple of [`ALIGN`].
    pub offset: u64,
    /// Unit size in bytes, as given.
    pub nbytes: u64,
}

/// Units packed into slabs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct SlabLayout {
    /// Byte size of each slab: the end of its last unit, exactly.
    pub slabs: Vec<u64>,
    /// Per unit, in input order.
    pub placements: Vec<UnitPlacement>,
}

impl SlabLayout {
    /// Total bytes over all slabs.
    pub fn total_bytes(&self) -> u64 {
        self.slabs.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }
}

/// Packs units, in order, into slabs of at most `max_slab_bytes` each.
///
/// Units are never split and never reordered. A unit larger than
/// `max_slab_bytes` gets a slab of its own. Slabs are sized exactly (no
/// power-of-two rounding). Zero-size units are placed at offset 0 of the
/// current slab and take no space. Errors: [`CoreError::InvalidArgument`] when
/// a slab would exceed 2^64 bytes.
pub fn layout_slabs(unit_bytes: &[u64], max_slab_bytes: u64) -> Result<SlabLayout> {
    let mut slabs: Vec<u64> = Vec::new();
    let mut placements = Vec::new();
    placements
        .try_reserve_exact(unit_bytes.len())
        .map_err(|_| too_many(unit_bytes.len(), "unit"))?;
    for (i, &nbytes) in unit_bytes.iter().enumerate() {
        let overflow = || {
            CoreError::InvalidArgument(format!(
                "unit {i} of {nbytes} bytes overflows its slab: a slab would exceed 2^64 bytes"
            ))
        };
        let fits = match slabs.last() {
            Some(&used) => {
                let end = checked_align_up(used).and_then(|o| o.checked_add(nbytes));
                nbytes == 0 || used == 0 || end.is_some_and(|end| end <= max_slab_bytes)
            }
            None => false,
        };
        if !fits {
            slabs.push(0);
        }
        let slab = slabs.len() - 1;
        let used = &mut slabs[slab];
        // Zero-size units sit at offset 0 so their (empty) range is always
        // inside the slab.
        let offset = if *used == 0 || nbytes == 0 {
            0
        } else {
            checked_align_up(*used).ok_or_else(overflow)?
        };
        if nbytes > 0 {
            *used = offset.checked_add(nbytes).ok_or_else(overflow)?;
        }
        placements.push(UnitPlacement {
            slab,
            offset,
            nbytes,
        });
    }
    Ok(SlabLayout { slabs, placements })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_alignment() {
        let l = layout_unit(&[10, 256, 0, 1, 300]).unwrap();
        assert_eq!(l.offsets, vec![0, 256, 512, 512, 768]);
        assert_eq!(l.nbytes, 1280);
        assert!(l.offsets.iter().all(|o| o % ALIGN == 0));
    }

    #[test]
    fn unit_empty_and_zero() {
        assert_eq!(layout_unit(&[]).unwrap(), UnitLayout::default());
        let l = layout_unit(&[0, 0]).unwrap();
        assert_eq!(l.offsets, vec![0, 0]);
        assert_eq!(l.nbytes, 0);
        let l = layout_unit(&[512]).unwrap();
        assert_eq!(l.nbytes, 512);
    }

    #[test]
    fn unit_no_overflow_panic() {
        let err = layout_unit(&[u64::MAX, 5]).unwrap_err();
        assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("tensor 1 of 5 bytes"), "{err}");
        let err = layout_unit(&[u64::MAX - 3]).unwrap_err();
        assert!(err.to_string().contains("exceeds 2^64 bytes"), "{err}");
        // units whose end would pass 2^64 start a new slab instead of saturating
        let l = layout_slabs(&[u64::MAX - 3, 1 << 20, u64::MAX], u64::MAX).unwrap();
        assert_eq!(l.slabs, vec![u64::MAX - 3, 1 << 20, u64::MAX]);
        assert_eq!(layout_slabs(&[u64::MAX], 0).unwrap().slabs, vec![u64::MAX]);
    }

    #[test]
    fn slabs_pack_in_order_exact_size() {
        let l = layout_slabs(&[100, 100, 100, 100], 600).unwrap();
        // 0..100, 256..356 (end 356); next at 512 would end 612 > 600 -> new slab
        assert_eq!(l.slabs, vec![356, 356]);
        assert_eq!(
            l.placements
                .iter()
                .map(|p| (p.slab, p.offset))
                .collect::<Vec<_>>(),
            vec![(0, 0), (0, 256), (1, 0), (1, 256)]
        );
        assert!(l.placements.iter().all(|p| p.offset % ALIGN == 0));
        assert_eq!(l.total_bytes(), 712);
    }

    #[test]
    fn slabs_exact_fit() {
        let l = layout_slabs(&[256, 256, 256], 768).unwrap();
        assert_eq!(l.slabs, vec![768]);
    }

    #[test]
    fn big_unit_gets_own_slab() {
        let l = layout_slabs(&[100, 5000, 100, 100], 1000).unwrap();
        assert_eq!(l.slabs, vec![100, 5000, 356]);
        assert_eq!(
            l.placements[1],
            UnitPlacement {
                slab: 1,
                offset: 0,
                nbytes: 5000
            }
        );
        assert_eq!(l.placements[2].slab, 2);
        let l = layout_slabs(&[5000], 1000).unwrap();
        assert_eq!(l.slabs, vec![5000]);
    }

    #[test]
    fn empty_and_zero_units() {
        assert_eq!(layout_slabs(&[], 1024).unwrap(), SlabLayout::default());
        let l = layout_slabs(&[0, 100, 0], 1024).unwrap();
        assert_eq!(l.slabs, vec![100]);
        assert_eq!(l.placements[0].offset, 0);
        assert_eq!(l.placements[2].offset, 0);
        assert_eq!(l.placements[2].slab, 0);
        let l = layout_slabs(&[0], 0).unwrap();
        assert_eq!(l.slabs, vec![0]);
    }

    #[test]
    fn zero_max_gives_one_slab_per_unit() {
        let l = layout_slabs(&[10, 20, 30], 0).unwrap();
        assert_eq!(l.slabs, vec![10, 20, 30]);
    }
}
