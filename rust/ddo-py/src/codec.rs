//! The lossless codes for bf16 weights (the 12-bit fixed-rate code, the two-tier code, the
//! Huffman code): unit layouts, host encode/decode, the GPU decode.

use ddo_core::codec::{self, PieceKind, TensorSpec};
use ddo_core::huffman::RangeCounts;
use ddo_cuda::Stream;
use pyo3::prelude::*;

use crate::errors::{cuda_err, ConfigError};

/// What a coded chunk's decode needs beyond its values and escapes: the two-tier code's tier-2
/// groups (an `int`), or the Huffman code's `(symbols, segments)` per range (a list).
#[derive(Clone, FromPyObject, IntoPyObject)]
pub(crate) enum Extra {
    Groups(usize),
    Ranges(Vec<(usize, usize)>),
}

impl Extra {
    fn of(kind: &PieceKind) -> Option<Extra> {
        if let Some(r) = kind.huffman_ranges() {
            return Some(Extra::Ranges(
                r.iter().map(|c| (c.symbols, c.segments)).collect(),
            ));
        }
        kind.tiered_counts().map(|c| Extra::Groups(c.groups))
    }

    fn ranges(r: &[(usize, usize)]) -> Vec<RangeCounts> {
        r.iter()
            .map(|&(symbols, segments)| RangeCounts { symbols, segments })
            .collect()
    }
}

/// A streamed unit laid out in coded form (`ddo_core::codec::CodedUnit`).
#[pyclass(module = "ddo_blocks._native", frozen)]
#[derive(Clone)]
pub(crate) struct CodedUnit {
    pub(crate) inner: codec::CodedUnit,
}

#[pymethods]
impl CodedUnit {
    /// Bytes of the unit's host buffer: what one fetch sends over the link.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes
    }

    /// Bytes the unit fills in its slot.
    #[getter]
    fn out_bytes(&self) -> usize {
        self.inner.out_bytes()
    }

    /// The largest coded chunk (the landing buffer it needs), 0 without one.
    #[getter]
    fn largest_coded(&self) -> usize {
        self.inner.largest_coded()
    }

    /// bf16 values sent coded.
    #[getter]
    fn coded_values(&self) -> usize {
        self.coded().map(|(_, v, _)| v).sum()
    }

    /// Escaped exponents in the coded chunks.
    #[getter]
    fn escapes(&self) -> usize {
        self.coded().map(|(_, _, e)| e).sum()
    }

    /// `(src, len, dst, values, escapes, extra)` of each coded chunk; `extra` is `None` for the
    /// fixed-rate code, the tier-2 groups (`int`) for the two-tier code, `(symbols, segments)` per
    /// range (a list) for the Huffman code: what `codec_decode_host` / `_device` take.
    #[getter]
    fn coded_pieces(&self) -> Vec<(usize, usize, usize, usize, usize, Option<Extra>)> {
        self.coded()
            .map(|(p, v, e)| (p.src, p.len, p.dst, v, e, Extra::of(&p.kind)))
            .collect()
    }

    /// The code of its coded chunks: `"fixed"`, `"tiered"` or `"huffman"` (`"fixed"` without
    /// one).
    #[getter]
    fn code(&self) -> &'static str {
        self.inner
            .pieces
            .iter()
            .find_map(|p| p.kind.code())
            .unwrap_or("fixed")
    }

    /// `(src, len, dst)` of each raw piece.
    #[getter]
    fn raw_pieces(&self) -> Vec<(usize, usize, usize)> {
        self.inner
            .pieces
            .iter()
            .filter(|p| matches!(p.kind, PieceKind::Raw(_)))
            .map(|p| (p.src, p.len, p.dst))
            .collect()
    }
}

impl CodedUnit {
    fn coded(&self) -> impl Iterator<Item = (&codec::Piece, usize, usize)> {
        self.inner.pieces.iter().filter_map(|p| match p.kind {
            PieceKind::Coded {
                values, escapes, ..
            } => Some((p, values, escapes)),
            PieceKind::Raw(_) => None,
        })
    }
}

/// Escape counts of each `(address, values)` bf16 tensor, per chunk, per range of the chunk
/// (`CODEC_SUB_ELEMS` values), in parallel, GIL released.
#[pyfunction]
fn codec_count_escapes(
    py: Python<'_>,
    tensors: Vec<(usize, usize)>,
) -> PyResult<Vec<Vec<Vec<usize>>>> {
    // SAFETY: the caller (streaming/coded.py) passes data pointers and element counts of
    // contiguous bf16 CPU storage it holds during the call; null and wrapping ranges are refused.
    py.detach(|| unsafe { ddo_cuda::codec::count_escapes_many(&tensors) })
        .map_err(cuda_err)
}

/// The two-tier code's counts of each `(address, values)` bf16 tensor, in the shape of
/// `codec_count_escapes`: `(escapes, tier-2 groups)`, in parallel, GIL released.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn codec_count_tiered(
    py: Python<'_>,
    tensors: Vec<(usize, usize)>,
) -> PyResult<(Vec<Vec<Vec<usize>>>, Vec<Vec<Vec<usize>>>)> {
    // SAFETY: as codec_count_escapes.
    py.detach(|| unsafe { ddo_cuda::codec::count_tiered_many(&tensors) })
        .map_err(cuda_err)
}

/// Per tensor, per chunk, per range: `(symbols, segments)`.
type HuffmanCounts = Vec<Vec<Vec<(usize, usize)>>>;

/// Huffman range counts of each `(address, values)` bf16 tensor: per chunk, `(symbols, segments)`
/// of each of its ranges, in parallel, GIL released.
#[pyfunction]
fn codec_count_huffman(py: Python<'_>, tensors: Vec<(usize, usize)>) -> PyResult<HuffmanCounts> {
    // SAFETY: as codec_count_escapes.
    let counts = py
        .detach(|| unsafe { ddo_cuda::codec::count_huffman_many(&tensors) })
        .map_err(cuda_err)?;
    Ok(counts
        .into_iter()
        .map(|t| {
            t.into_iter()
                .map(|c| c.into_iter().map(|r| (r.symbols, r.segments)).collect())
                .collect()
        })
        .collect())
}

/// Lays out a unit in the Huffman code: `tensors` as `layout_coded_unit`, `ranges` the counts from
/// `codec_count_huffman` per bf16 tensor (`[]` for the others).
#[pyfunction]
fn layout_coded_unit_huffman(
    tensors: Vec<(usize, usize, bool)>,
    ranges: HuffmanCounts,
    max_chunk_bytes: usize,
) -> PyResult<CodedUnit> {
    let specs = specs_of(tensors);
    let ranges: Vec<Vec<Vec<RangeCounts>>> = ranges
        .iter()
        .map(|t| t.iter().map(|c| Extra::ranges(c)).collect())
        .collect();
    codec::layout_coded_unit_huffman(&specs, &ranges, max_chunk_bytes)
        .map(|inner| CodedUnit { inner })
        .map_err(|e| ConfigError::new_err(e.to_string()))
}

/// Lays out a unit: `tensors` are `(slot_offset, nbytes, is_bf16)`, `escapes` the counts from
/// `codec_count_escapes` (or `codec_count_tiered`) per bf16 tensor (`[]` for the others);
/// `groups`, the tier-2 groups from `codec_count_tiered`, selects the two-tier code.
#[pyfunction]
#[pyo3(signature = (tensors, escapes, max_chunk_bytes, groups=None))]
fn layout_coded_unit(
    tensors: Vec<(usize, usize, bool)>,
    escapes: Vec<Vec<Vec<usize>>>,
    max_chunk_bytes: usize,
    groups: Option<Vec<Vec<Vec<usize>>>>,
) -> PyResult<CodedUnit> {
    let specs = specs_of(tensors);
    codec::layout_coded_unit(&specs, &escapes, groups.as_deref(), max_chunk_bytes)
        .map(|inner| CodedUnit { inner })
        .map_err(|e| ConfigError::new_err(e.to_string()))
}

/// Writes the unit's host buffer at `dst` from its tensors `(address, nbytes)`, GIL released.
#[pyfunction]
fn codec_encode_unit(
    py: Python<'_>,
    unit: &CodedUnit,
    tensors: Vec<(usize, usize)>,
    dst: usize,
) -> PyResult<()> {
    // SAFETY: the caller passes the CPU tensors the unit was laid out from (alive during the call)
    // and a fresh host buffer of `unit.nbytes` bytes disjoint from them; every piece is checked
    // against the given sizes before anything is written.
    py.detach(|| unsafe { ddo_cuda::codec::encode_unit(&unit.inner, &tensors, dst) })
        .map_err(cuda_err)
}

/// One unit from units of one tensor each: `(unit, offset in the new buffer, offset in the slot)`
/// (the NVMe route's side file codes tensors; a unit of any plan is composed of them).
#[pyfunction]
fn codec_compose(parts: Vec<(PyRef<'_, CodedUnit>, usize, usize)>) -> PyResult<CodedUnit> {
    let refs: Vec<(&codec::CodedUnit, usize, usize)> = parts
        .iter()
        .map(|(u, src, dst)| (&u.inner, *src, *dst))
        .collect();
    codec::CodedUnit::compose(&refs)
        .map(|inner| CodedUnit { inner })
        .map_err(|e| ConfigError::new_err(e.to_string()))
}

/// Bytes a unit of these `(slot_offset, nbytes, is_bf16)` tensors can take coded (a buffer for
/// `codec_encode_unit_fused`).
#[pyfunction]
fn codec_capacity(tensors: Vec<(usize, usize, bool)>) -> PyResult<usize> {
    ddo_cuda::codec::coded_capacity(&specs_of(tensors)).map_err(cuda_err)
}

/// Counts, lays out and codes a unit in one pass over its weights in `code` (`"fixed"`, `"tiered"`
/// or `"huffman"`) into `capacity` bytes at `dst`, GIL released; returns its layout.
#[pyfunction]
fn codec_encode_unit_fused(
    py: Python<'_>,
    tensors: Vec<(usize, usize, bool)>,
    sources: Vec<(usize, usize)>,
    code: &str,
    max_chunk_bytes: usize,
    dst: usize,
    capacity: usize,
) -> PyResult<CodedUnit> {
    let code = codec::Code::from_name(code).map_err(|e| ConfigError::new_err(e.to_string()))?;
    let specs = specs_of(tensors);
    // SAFETY: the caller (streaming/coded.py) passes the data pointers and byte sizes of contiguous
    // CPU storage it holds during the call, and a fresh host buffer of `capacity` bytes disjoint
    // from them; sizes are checked against the specs before anything is read or written.
    py.detach(|| unsafe {
        ddo_cuda::codec::encode_unit_fused(&specs, &sources, code, max_chunk_bytes, dst, capacity)
    })
    .map(|inner| CodedUnit { inner })
    .map_err(cuda_err)
}

fn specs_of(tensors: Vec<(usize, usize, bool)>) -> Vec<TensorSpec> {
    tensors
        .into_iter()
        .map(|(dst, nbytes, bf16)| TensorSpec { dst, nbytes, bf16 })
        .collect()
}

/// Decodes the unit's host buffer at `src` into its tensors `(address, nbytes)`, GIL released.
#[pyfunction]
fn codec_decode_unit(
    py: Python<'_>,
    unit: &CodedUnit,
    src: usize,
    tensors: Vec<(usize, usize)>,
) -> PyResult<()> {
    // SAFETY: the caller passes the unit's live host buffer and fresh, disjoint CPU tensors of
    // the sizes the unit was laid out with; pieces are checked against those sizes first.
    py.detach(|| unsafe { ddo_cuda::codec::decode_unit(&unit.inner, src, &tensors) })
        .map_err(cuda_err)
}

/// Decodes one chunk on the host with the reference decoder: `length` bytes at host address
/// `src` into `values` bf16 values at host address `out` (`extra`: as `codec_decode_device`), GIL
/// released.
#[pyfunction]
#[pyo3(signature = (src, length, out, values, escapes, extra=None))]
fn codec_decode_host(
    py: Python<'_>,
    src: usize,
    length: usize,
    out: usize,
    values: usize,
    escapes: usize,
    extra: Option<Extra>,
) -> PyResult<()> {
    let (groups, ranges) = match extra {
        None => (None, None),
        Some(Extra::Groups(g)) => (Some(g), None),
        Some(Extra::Ranges(r)) => (None, Some(Extra::ranges(&r))),
    };
    // SAFETY: the caller (streaming/coded.py's decoder check, the GPU tests) passes a live host
    // buffer holding the chunk and a fresh CPU tensor of `values` bf16 values, disjoint.
    py.detach(|| unsafe {
        ddo_cuda::codec::decode_chunk_host(src, length, out, values, escapes, groups, ranges)
    })
    .map_err(cuda_err)
}

/// Queues the GPU decode of one chunk of `values` values with `escapes` escapes (and `extra`: the
/// two-tier code's tier-2 groups, the Huffman code's `(symbols, segments)` per range, `None` for
/// the fixed-rate code), at device address `chunk`, into device address `out`, on `stream` of
/// device `device`.
#[pyfunction]
#[pyo3(signature = (device, stream, chunk, out, values, escapes, extra=None))]
#[allow(clippy::too_many_arguments)]
fn codec_decode_device(
    py: Python<'_>,
    device: usize,
    stream: u64,
    chunk: usize,
    out: usize,
    values: usize,
    escapes: usize,
    extra: Option<Extra>,
) -> PyResult<()> {
    // SAFETY (this and both launches): the callers (tests/test_gpu_codec.py, streaming/coded.py's
    // decode-rate probe and check) pass data pointers of CUDA tensors on `device` holding the chunk
    // and `2 * values` output bytes, alive until the stream ran the kernel, and
    // `torch.cuda.Stream.cuda_stream` of that device.
    let stream = unsafe { Stream::from_raw(stream) };
    match extra {
        None => {
            let kernel = py
                .detach(|| ddo_cuda::codec::decode_kernel(device))
                .map_err(cuda_err)?;
            unsafe { ddo_cuda::codec::launch_decode(&kernel, stream, chunk, out, values, escapes) }
        }
        Some(Extra::Groups(groups)) => {
            let kernel = py
                .detach(|| ddo_cuda::codec::tiered_kernel(device))
                .map_err(cuda_err)?;
            let counts = ddo_core::tiered::Counts { groups, escapes };
            unsafe { ddo_cuda::tiered::launch_decode(&kernel, stream, chunk, out, values, counts) }
        }
        Some(Extra::Ranges(r)) => {
            let kernel = py
                .detach(|| ddo_cuda::codec::huffman_kernel(device))
                .map_err(cuda_err)?;
            let ranges = Extra::ranges(&r);
            unsafe {
                ddo_cuda::huffman::launch_decode(&kernel, stream, chunk, out, values, &ranges)
            }
        }
    }
    .map_err(cuda_err)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("CODEC_CHUNK_ELEMS", codec::CHUNK_ELEMS)?;
    m.add("CODEC_BLOCK", codec::BLOCK)?;
    m.add("CODEC_SUB_ELEMS", codec::SUB_ELEMS)?;
    m.add("HUFFMAN_RANGE_ELEMS", ddo_core::huffman::RANGE_ELEMS)?;
    m.add_class::<CodedUnit>()?;
    m.add_function(wrap_pyfunction!(codec_count_escapes, m)?)?;
    m.add_function(wrap_pyfunction!(codec_count_tiered, m)?)?;
    m.add_function(wrap_pyfunction!(codec_count_huffman, m)?)?;
    m.add_function(wrap_pyfunction!(layout_coded_unit_huffman, m)?)?;
    m.add_function(wrap_pyfunction!(layout_coded_unit, m)?)?;
    m.add_function(wrap_pyfunction!(codec_encode_unit, m)?)?;
    m.add_function(wrap_pyfunction!(codec_encode_unit_fused, m)?)?;
    m.add_function(wrap_pyfunction!(codec_capacity, m)?)?;
    m.add_function(wrap_pyfunction!(codec_compose, m)?)?;
    m.add_function(wrap_pyfunction!(codec_decode_unit, m)?)?;
    m.add_function(wrap_pyfunction!(codec_decode_device, m)?)?;
    m.add_function(wrap_pyfunction!(codec_decode_host, m)?)?;
    Ok(())
}
