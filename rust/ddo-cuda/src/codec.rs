//! The coded (compressed) transfer: units held in host memory in `ddo_core::codec`'s 12-bit form,
//! sent over the link as such and decoded into their slot, on the GPU by a kernel on a decode
//! stream, on the CPU target by the reference decoder.
//!
//! On the GPU a unit's fetch is one copy job ([`crate::job`]) whose copies are its raw pieces
//! (straight into the slot) and whose post-copy stage is a [`DecodeStage`]: for each coded chunk,
//!
//! ```text
//! copy stream:   wait decoded[k] -> copy chunk into landing[k] -> record landed[k]
//! decode stream: wait landed[k]  -> decode landing[k] into the slot -> record decoded[k]
//! ```
//!
//! over a ring of landing buffers (device memory the caller allocates, through PyTorch), so the
//! copy engine moves chunk `c + 1` while the SMs decode chunk `c`; then the decode stream waits for
//! the copy stream's raw copies and the job records the slot's arrival there, so the copy engine
//! never waits for a decode except to reuse a landing buffer.
//!
//! The chunks' copies touch only the landing buffers, so they are queued *before* the copy stream
//! waits for the slot's last consumer ([`Stage::early`]): the link moves the next unit's chunks
//! while the slot's unit still computes, as far ahead as the landing ring holds. The decode stream
//! waits for that consumer itself before the unit's first decode; the raw pieces, copied straight
//! into the slot, follow the copy stream's wait as before.
//!
//! Encoding and decoding on the host run in parallel on the rayon pool, one chunk a task.

use std::sync::{Arc, Mutex, OnceLock};

use ddo_core::codec::{self, CodedUnit, PieceKind};
use ddo_core::huffman::{self, RangeCounts};
use ddo_core::landing::Batch;
use ddo_core::tiered;
use rayon::prelude::*;

use crate::deferred::ErrorSlot;
use crate::driver::Stream;
use crate::error::{CudaError, Result};
use crate::event::Event;
use crate::job::{h2d_async, Sink, Stage};
use crate::kernel::{Arg, Kernel, LaunchConfig, Module};

/// The decode kernel: 8 values a thread, one 8-byte and one 4-byte load, one 16-byte store; code
/// 15 looks its exponent up in the chunk's sorted escape list.
pub const DECODE_SOURCE: &str = r#"
extern "C" __global__ void ddo_decode12(const unsigned char* __restrict__ chunk,
    unsigned short* __restrict__ out, unsigned int n, unsigned int n_esc, unsigned int signs,
    unsigned int codes, unsigned int escapes) {
  unsigned int i0 = (blockIdx.x * blockDim.x + threadIdx.x) * 8u;
  if (i0 >= n) return;
  uint2 sm = *reinterpret_cast<const uint2*>(chunk + signs + i0);
  unsigned int cw = *reinterpret_cast<const unsigned int*>(chunk + codes + i0 / 2u);
  unsigned int base = chunk[i0 / BLOCK];
  const unsigned int* esc = reinterpret_cast<const unsigned int*>(chunk + escapes);
  unsigned int v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    unsigned int s = ((k < 4 ? sm.x : sm.y) >> (8 * (k & 3))) & 0xffu;
    unsigned int c = (cw >> (4 * k)) & 0xfu;
    unsigned int e = c == 0u ? 0u : base + c - 1u;
    if (c == 15u) {
      unsigned int i = i0 + k, lo = 0u, hi = n_esc;
      while (lo < hi) {
        unsigned int mid = (lo + hi) / 2u;
        if ((esc[mid] >> 8) < i) lo = mid + 1u; else hi = mid;
      }
      e = lo < n_esc ? (esc[lo] & 0xffu) : 0u;
    }
    v[k] = ((s & 0x80u) << 8) | (e << 7) | (s & 0x7fu);
  }
  if (i0 + 8u <= n) {
    uint4 o = make_uint4(v[0] | (v[1] << 16), v[2] | (v[3] << 16), v[4] | (v[5] << 16),
                         v[6] | (v[7] << 16));
    *reinterpret_cast<uint4*>(out + i0) = o;
  } else {
    for (unsigned int k = 0; i0 + k < n; ++k) out[i0 + k] = (unsigned short)v[k];
  }
}
"#;

/// Threads per CUDA block of the decode kernels: a multiple of the 64 threads of one 512-value
/// block (the two-tier kernel's prefix sum needs whole value blocks in a CUDA block).
pub(crate) const THREADS: u32 = 256;

/// A compiled kernel: device ordinal, kernel name, the kernel.
type CachedKernel = (usize, &'static str, Kernel);

static KERNELS: OnceLock<Mutex<Vec<CachedKernel>>> = OnceLock::new();

/// Kernel `name` of `source()` on device `ordinal`, compiled with NVRTC at its first use in the
/// process.
fn cached_kernel(
    ordinal: usize,
    name: &'static str,
    source: impl FnOnce() -> String,
) -> Result<Kernel> {
    let cache = KERNELS.get_or_init(|| Mutex::new(Vec::new()));
    let mut kernels = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, _, k)) = kernels.iter().find(|(o, n, _)| *o == ordinal && *n == name) {
        return Ok(k.clone());
    }
    let kernel = Module::compile(ordinal, &source(), &[])?.kernel(name)?;
    kernels.push((ordinal, name, kernel.clone()));
    Ok(kernel)
}

/// The fixed-rate decode kernel on device `ordinal`.
pub fn decode_kernel(ordinal: usize) -> Result<Kernel> {
    cached_kernel(ordinal, "ddo_decode12", || {
        DECODE_SOURCE.replace("BLOCK", &format!("{}u", codec::BLOCK))
    })
}

/// The two-tier decode kernel on device `ordinal` ([`crate::tiered`]).
pub fn tiered_kernel(ordinal: usize) -> Result<Kernel> {
    cached_kernel(ordinal, crate::tiered::KERNEL_NAME, crate::tiered::source)
}

/// The Huffman decode kernel on device `ordinal` ([`crate::huffman`]).
pub fn huffman_kernel(ordinal: usize) -> Result<Kernel> {
    cached_kernel(ordinal, crate::huffman::KERNEL_NAME, crate::huffman::source)
}

/// Compiles now (not in a first fetch) the kernels `unit`'s coded chunks need beyond the
/// fixed-rate one.
pub(crate) fn compile_kernels_of(ordinal: usize, unit: &CodedUnit) -> Result<()> {
    for p in &unit.pieces {
        match p.kind.code() {
            Some("tiered") => drop(tiered_kernel(ordinal)?),
            Some("huffman") => drop(huffman_kernel(ordinal)?),
            _ => {}
        }
    }
    Ok(())
}

/// Queues the decode of the coded chunk `kind` (any code; `fixed` is the fixed-rate kernel of
/// the device) at device address `chunk` into device address `out`, on `stream`.
///
/// # Safety
/// As [`launch_decode`], with `chunk` holding the chunk's bytes in its own code's layout.
pub(crate) unsafe fn launch_coded(
    ordinal: usize,
    fixed: &Kernel,
    kind: &PieceKind,
    stream: Stream,
    chunk: usize,
    out: usize,
) -> Result<()> {
    let PieceKind::Coded {
        values, escapes, ..
    } = *kind
    else {
        return Err(CudaError::InvalidArgument(
            "a raw piece is not decoded".into(),
        ));
    };
    // SAFETY (each launch): the caller's contract.
    unsafe {
        if let Some(ranges) = kind.huffman_ranges() {
            crate::huffman::launch_decode(
                &huffman_kernel(ordinal)?,
                stream,
                chunk,
                out,
                values,
                ranges,
            )
        } else if let Some(counts) = kind.tiered_counts() {
            crate::tiered::launch_decode(
                &tiered_kernel(ordinal)?,
                stream,
                chunk,
                out,
                values,
                counts,
            )
        } else {
            launch_decode(fixed, stream, chunk, out, values, escapes)
        }
    }
}

/// Queues the decode of one coded chunk of `values` values with `escapes` escapes, at device
/// address `chunk`, into `values` bf16 values at device address `out`, on `stream`.
///
/// # Safety
/// `chunk` holds the chunk's [`codec::chunk_layout`] bytes and `out` `2 * values` writable bytes,
/// 16-byte aligned, both device memory of `kernel`'s device, allocated and not written by anyone
/// else until the decode completed; `stream` is a live stream of that device's primary context.
pub unsafe fn launch_decode(
    kernel: &Kernel,
    stream: Stream,
    chunk: usize,
    out: usize,
    values: usize,
    escapes: usize,
) -> Result<()> {
    let lay = codec::chunk_layout(values, escapes);
    let rest = [escapes, lay.signs, lay.codes, lay.escapes];
    // SAFETY: the caller upholds launch_chunk's contract; the kernel reads `lay.nbytes` bytes of
    // `chunk` and writes `2 * values` bytes of `out`, no more.
    unsafe { launch_chunk(kernel, stream, chunk, out, values, &rest) }
}

/// Launches a decode kernel over one chunk, 8 values a thread in blocks of [`THREADS`], with the
/// arguments `chunk, out, values` and then `rest` (each below 2^32: a chunk is at most 24 MiB).
/// Refuses chunks over [`codec::CHUNK_ELEMS`] values and unaligned addresses.
///
/// # Safety
/// As the decode it launches: `chunk` holds the chunk in the layout the kernel reads and `out`
/// `2 * values` writable bytes, 16-byte aligned device memory of `kernel`'s device, allocated and
/// not written by anyone else until the decode completed; `stream` is a live stream of that
/// device's primary context; `rest` are the kernel's remaining arguments for this chunk.
pub(crate) unsafe fn launch_chunk(
    kernel: &Kernel,
    stream: Stream,
    chunk: usize,
    out: usize,
    values: usize,
    rest: &[usize],
) -> Result<()> {
    if values == 0 {
        return Ok(());
    }
    if values > codec::CHUNK_ELEMS || !out.is_multiple_of(16) || !chunk.is_multiple_of(16) {
        return Err(CudaError::InvalidArgument(format!(
            "a decode of {values} values (at most {}) from {chunk:#x} to {out:#x} (both 16-byte \
             aligned)",
            codec::CHUNK_ELEMS
        )));
    }
    let threads = values.div_ceil(codec::VALUES_PER_THREAD) as u32;
    let config = LaunchConfig {
        grid: (threads.div_ceil(THREADS), 1, 1),
        block: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = vec![
        Arg::Ptr(chunk as u64),
        Arg::Ptr(out as u64),
        Arg::U32(values as u32),
    ];
    args.extend(rest.iter().map(|&x| Arg::U32(x as u32)));
    // SAFETY: the caller upholds the contract on `chunk`, `out`, `stream` and the arguments.
    unsafe { kernel.launch(config, stream, &args) }
}

/// `count(range)` of every [`codec::subs`] range of every chunk of every `(address, values)` bf16
/// tensor, all ranges of all tensors in parallel: per tensor, per chunk, per range.
///
/// # Safety
/// Each address holds `values` readable `u16`s (2-byte aligned), not written during the call.
unsafe fn count_many<T: Send + Clone>(
    tensors: &[(usize, usize)],
    count: impl Fn(&[u16]) -> T + Sync,
) -> Result<Vec<Vec<Vec<T>>>> {
    for &(ptr, values) in tensors {
        check_values("count source", ptr, values)?;
    }
    // every (tensor, chunk, range) as one task
    let tasks: Vec<(usize, usize, usize, usize)> = tensors
        .iter()
        .enumerate()
        .flat_map(|(t, &(_, values))| {
            codec::chunks(values)
                .enumerate()
                .flat_map(move |(c, (first, n))| {
                    codec::subs(n).map(move |(s, len)| (t, c, first + s, len))
                })
        })
        .collect();
    let counts: Vec<T> = tasks
        .par_iter()
        .map(|&(t, _, first, len)| {
            // SAFETY: the caller guarantees `values` readable u16s at the tensor's address, and
            // the range lies inside them.
            let v =
                unsafe { std::slice::from_raw_parts((tensors[t].0 as *const u16).add(first), len) };
            count(v)
        })
        .collect();
    let mut out: Vec<Vec<Vec<T>>> = tensors
        .iter()
        .map(|&(_, values)| vec![Vec::new(); codec::chunks(values).count()])
        .collect();
    for (&(t, c, _, _), n) in tasks.iter().zip(counts) {
        out[t][c].push(n);
    }
    Ok(out)
}

/// Escape counts of every `(address, values)` bf16 tensor for the fixed-rate code: per chunk, per
/// range of the chunk ([`codec::subs`]).
///
/// # Safety
/// Each address holds `values` readable `u16`s (2-byte aligned), not written during the call.
pub unsafe fn count_escapes_many(tensors: &[(usize, usize)]) -> Result<Vec<Vec<Vec<usize>>>> {
    // SAFETY: the caller's contract is count_many's.
    unsafe { count_many(tensors, codec::count_escapes) }
}

/// Escape and tier-2 group counts of every `(address, values)` bf16 tensor for the two-tier code,
/// in the shape of [`count_escapes_many`]: `(escapes, groups)`.
///
/// # Safety
/// Each address holds `values` readable `u16`s (2-byte aligned), not written during the call.
#[allow(clippy::type_complexity)]
pub unsafe fn count_tiered_many(
    tensors: &[(usize, usize)],
) -> Result<(Vec<Vec<Vec<usize>>>, Vec<Vec<Vec<usize>>>)> {
    // SAFETY: the caller's contract is count_many's.
    let counts = unsafe { count_many(tensors, ddo_core::tiered::count_range) }?;
    let pick = |f: fn(&ddo_core::tiered::Counts) -> usize| {
        counts
            .iter()
            .map(|t| t.iter().map(|c| c.iter().map(f).collect()).collect())
            .collect()
    };
    Ok((pick(|c| c.escapes), pick(|c| c.groups)))
}

/// Huffman range counts of every `(address, values)` bf16 tensor: per chunk, the counts of each of
/// its [`huffman::RANGE_ELEMS`] ranges.
///
/// # Safety
/// Each address holds `values` readable `u16`s (2-byte aligned), not written during the call.
pub unsafe fn count_huffman_many(tensors: &[(usize, usize)]) -> Result<Vec<Vec<Vec<RangeCounts>>>> {
    // SAFETY: the caller's contract is count_many's.
    let counts = unsafe { count_many(tensors, huffman::count_ranges) }?;
    Ok(counts
        .into_iter()
        .map(|t| {
            t.into_iter()
                .map(|c| c.into_iter().flatten().collect())
                .collect()
        })
        .collect())
}

fn check_values(what: &str, ptr: usize, values: usize) -> Result<()> {
    let n = values
        .checked_mul(2)
        .ok_or_else(|| CudaError::InvalidArgument(format!("{what}: {values} values")))?;
    crate::host::check_host_range(what, ptr, n)?;
    if n > 0 && !ptr.is_multiple_of(2) {
        return Err(CudaError::InvalidArgument(format!(
            "{what}: bf16 values at an odd address {ptr:#x}"
        )));
    }
    Ok(())
}

/// Every piece of `unit` lies inside its host buffer of `unit.nbytes` bytes.
pub(crate) fn check_pieces(unit: &CodedUnit) -> Result<()> {
    if unit
        .pieces
        .iter()
        .any(|p| p.src.checked_add(p.len).is_none_or(|end| end > unit.nbytes))
    {
        return Err(CudaError::InvalidArgument(
            "a piece runs past its coded unit".into(),
        ));
    }
    Ok(())
}

fn check_unit_tensors(unit: &CodedUnit, tensors: &[(usize, usize)]) -> Result<()> {
    for p in &unit.pieces {
        let (t, end) = match &p.kind {
            PieceKind::Raw(segs) => {
                for s in segs {
                    let (_, len) = tensors
                        .get(s.tensor)
                        .copied()
                        .ok_or_else(|| missing(s.tensor))?;
                    if s.tensor_offset + s.len > len || s.offset + s.len > p.len {
                        return Err(CudaError::InvalidArgument(format!(
                            "a raw segment of tensor {} runs past the tensor or its piece",
                            s.tensor
                        )));
                    }
                }
                continue;
            }
            PieceKind::Coded {
                tensor,
                first_value,
                values,
                ..
            } => (*tensor, 2 * (first_value + values)),
        };
        let (_, len) = tensors.get(t).copied().ok_or_else(|| missing(t))?;
        if end > len {
            return Err(CudaError::InvalidArgument(format!(
                "a coded chunk of tensor {t} ends at byte {end}, past its {len} bytes"
            )));
        }
    }
    for &(ptr, len) in tensors {
        crate::host::check_host_range("coded unit tensor", ptr, len)?;
    }
    Ok(())
}

fn missing(t: usize) -> CudaError {
    CudaError::InvalidArgument(format!(
        "the unit's pieces name tensor {t}, which was not given"
    ))
}

/// Writes `unit`'s host buffer at `dst` (`unit.nbytes` bytes) from its tensors `(address, bytes)`,
/// every piece in parallel; gaps between raw segments are zero.
///
/// # Safety
/// Each tensor is its given bytes of readable host memory, and `dst` `unit.nbytes` writable host
/// bytes disjoint from them, all allocated and not written by anyone else during the call.
pub unsafe fn encode_unit(unit: &CodedUnit, tensors: &[(usize, usize)], dst: usize) -> Result<()> {
    check_unit_tensors(unit, tensors)?;
    crate::host::check_host_range("coded unit buffer", dst, unit.nbytes)?;
    check_pieces(unit)?;
    // tasks: every raw piece, the padding of every coded chunk, every range of every coded chunk
    enum Task<'a> {
        Raw(&'a codec::Piece, &'a [codec::Segment]),
        /// Byte ranges `(offset, len)` of a coded chunk that no value writes.
        Padding(&'a codec::Piece, Vec<(usize, usize)>),
        /// `len` values from `first` of a fixed-rate chunk, whose `n_esc` escapes follow the
        /// chunk's first `esc`.
        Range {
            piece: &'a codec::Piece,
            tensor: usize,
            from: usize,
            lay: codec::ChunkLayout,
            first: usize,
            len: usize,
            esc: usize,
            n_esc: usize,
        },
        /// `len` values from `first` of a two-tier chunk, their counts `own` after the chunk's
        /// first `at`.
        Tiered {
            piece: &'a codec::Piece,
            tensor: usize,
            from: usize,
            lay: tiered::TieredLayout,
            first: usize,
            len: usize,
            at: tiered::Counts,
            own: tiered::Counts,
        },
        /// Range `r` of a Huffman chunk (`len` values from `first`), its symbols and segments
        /// after the chunk's first `at`.
        Huffman {
            piece: &'a codec::Piece,
            tensor: usize,
            from: usize,
            lay: std::sync::Arc<huffman::HuffmanLayout>,
            r: usize,
            first: usize,
            len: usize,
            at: (usize, usize),
            own: RangeCounts,
        },
    }
    let mismatch = || CudaError::InvalidArgument("a coded piece does not match its layout".into());
    let mut tasks = Vec::new();
    for p in &unit.pieces {
        match &p.kind {
            PieceKind::Raw(segs) => tasks.push(Task::Raw(p, segs)),
            PieceKind::Coded {
                tensor,
                first_value,
                values,
                escapes,
                sub_escapes,
                sub_groups: None,
                ranges: None,
            } => {
                let lay = codec::chunk_layout(*values, *escapes);
                if lay.nbytes != p.len || sub_escapes.iter().sum::<usize>() != *escapes {
                    return Err(mismatch());
                }
                tasks.push(Task::Padding(p, fixed_gaps(&lay)));
                let mut esc = 0;
                for ((first, len), &n) in codec::subs(*values).zip(sub_escapes) {
                    tasks.push(Task::Range {
                        piece: p,
                        tensor: *tensor,
                        from: *first_value,
                        lay,
                        first,
                        len,
                        esc,
                        n_esc: n,
                    });
                    esc += n;
                }
            }
            PieceKind::Coded {
                tensor,
                first_value,
                values,
                ranges: Some(ranges),
                ..
            } => {
                let lay = std::sync::Arc::new(huffman::huffman_layout(*values, ranges));
                if lay.nbytes != p.len || ranges.len() != values.div_ceil(huffman::RANGE_ELEMS) {
                    return Err(mismatch());
                }
                tasks.push(Task::Padding(p, huffman_gaps(&lay)));
                let mut at = (0, 0);
                for (r, &own) in ranges.iter().enumerate() {
                    let first = r * huffman::RANGE_ELEMS;
                    tasks.push(Task::Huffman {
                        piece: p,
                        tensor: *tensor,
                        from: *first_value,
                        lay: lay.clone(),
                        r,
                        first,
                        len: huffman::RANGE_ELEMS.min(values - first),
                        at,
                        own,
                    });
                    at = (at.0 + own.symbols, at.1 + own.segments);
                }
            }
            kind @ PieceKind::Coded {
                tensor,
                first_value,
                values,
                ..
            } => {
                let (Some(total), Some(subs)) = (kind.tiered_counts(), kind.tiered_sub_counts())
                else {
                    return Err(mismatch());
                };
                let lay = tiered::tiered_layout(*values, total);
                if lay.nbytes != p.len || subs.len() != codec::subs(*values).count() {
                    return Err(mismatch());
                }
                tasks.push(Task::Padding(p, tiered_gaps(&lay)));
                let mut at = tiered::Counts::default();
                for ((first, len), &own) in codec::subs(*values).zip(&subs) {
                    tasks.push(Task::Tiered {
                        piece: p,
                        tensor: *tensor,
                        from: *first_value,
                        lay,
                        first,
                        len,
                        at,
                        own,
                    });
                    at = at + own;
                }
            }
        }
    }
    tasks.par_iter().try_for_each(|task| {
        // every task writes a range of `dst` no other task writes (pieces are disjoint; inside a
        // chunk the ranges own disjoint blocks, values, code bytes and escapes; the padding task
        // owns the bytes no value writes)
        let bytes = |off: usize, len: usize| {
            // SAFETY: each range lies inside the unit's `unit.nbytes` bytes at `dst` (checked
            // above) and is written by this task only.
            unsafe { std::slice::from_raw_parts_mut((dst + off) as *mut u8, len) }
        };
        // SAFETY (both codes' ranges): the chunk lies in its tensor (checked above); bf16 data is
        // 2-aligned.
        let values = |tensor: usize, at: usize, len: usize| unsafe {
            std::slice::from_raw_parts((tensors[tensor].0 as *const u16).add(at), len)
        };
        match task {
            Task::Raw(p, segs) => {
                let out = bytes(p.src, p.len);
                out.fill(0);
                for s in segs.iter() {
                    // SAFETY: the segment lies in its tensor (checked above).
                    let src = unsafe {
                        std::slice::from_raw_parts(
                            (tensors[s.tensor].0 + s.tensor_offset) as *const u8,
                            s.len,
                        )
                    };
                    out[s.offset..s.offset + s.len].copy_from_slice(src);
                }
                Ok(())
            }
            Task::Padding(p, gaps) => {
                for &(off, len) in gaps {
                    bytes(p.src + off, len).fill(0);
                }
                Ok(())
            }
            Task::Range {
                piece,
                tensor,
                from,
                lay,
                first,
                len,
                esc,
                n_esc,
            } => {
                let base = piece.src;
                codec::encode_range(
                    values(*tensor, from + first, *len),
                    *first,
                    bytes(base + first / codec::BLOCK, len.div_ceil(codec::BLOCK)),
                    bytes(base + lay.signs + first, *len),
                    bytes(base + lay.codes + first / 2, len.div_ceil(2)),
                    bytes(base + lay.escapes + 4 * esc, 4 * *n_esc),
                )
                .map_err(|e| CudaError::InvalidArgument(format!("tensor {tensor}: {e}")))
            }
            Task::Tiered {
                piece,
                tensor,
                from,
                lay,
                first,
                len,
                at,
                own,
            } => {
                let (base, b0, nb) = (piece.src, first / codec::BLOCK, len.div_ceil(codec::BLOCK));
                tiered::encode_range(
                    values(*tensor, from + first, *len),
                    *first,
                    at.groups,
                    bytes(base + lay.offsets + 4 * b0, 4 * nb),
                    bytes(base + lay.params + 2 * b0, 2 * nb),
                    bytes(base + lay.signs + first, *len),
                    bytes(
                        base + lay.tier1 + first / 4,
                        (first + len).div_ceil(4) - first / 4,
                    ),
                    bytes(base + lay.tier2 + 3 * at.groups, 3 * own.groups),
                    bytes(base + lay.escapes + 4 * at.escapes, 4 * own.escapes),
                )
                .map_err(|e| CudaError::InvalidArgument(format!("tensor {tensor}: {e}")))
            }
            Task::Huffman {
                piece,
                tensor,
                from,
                lay,
                r,
                first,
                len,
                at,
                own,
            } => {
                let base = piece.src;
                huffman::encode_range(
                    values(*tensor, from + first, *len),
                    at.0,
                    at.1,
                    bytes(base + huffman::RECORD_BYTES * r, huffman::RECORD_BYTES),
                    bytes(base + lay.symbols + at.0, own.symbols),
                    bytes(base + lay.signs + first, *len),
                    bytes(
                        base + lay.segments + huffman::SEGMENT_BYTES * at.1,
                        huffman::SEGMENT_BYTES * own.segments,
                    ),
                )
                .map_err(|e| CudaError::InvalidArgument(format!("tensor {tensor}: {e}")))
            }
        }
    })
}

/// The bytes of a Huffman chunk no range writes: `(offset, len)` from the chunk's start.
fn huffman_gaps(lay: &huffman::HuffmanLayout) -> Vec<(usize, usize)> {
    let ends = [
        (huffman::RECORD_BYTES * lay.ranges, lay.symbols),
        (lay.symbols + lay.symbols_total, lay.signs),
        (lay.signs + lay.n, lay.segments),
    ];
    ends.iter().map(|&(from, to)| (from, to - from)).collect()
}

/// The bytes of a fixed-rate chunk no value writes: `(offset, len)` from the chunk's start.
fn fixed_gaps(lay: &codec::ChunkLayout) -> Vec<(usize, usize)> {
    let n = lay.n;
    let nb = n.div_ceil(codec::BLOCK);
    vec![
        (nb, lay.signs - nb),
        (lay.signs + n, lay.codes - lay.signs - n),
        (
            lay.codes + n.div_ceil(2),
            lay.escapes - lay.codes - n.div_ceil(2),
        ),
        (
            lay.escapes + 4 * lay.n_esc,
            lay.nbytes - lay.escapes - 4 * lay.n_esc,
        ),
    ]
}

/// The bytes of a two-tier chunk no value writes: `(offset, len)` from the chunk's start.
fn tiered_gaps(lay: &tiered::TieredLayout) -> Vec<(usize, usize)> {
    let n = lay.n;
    let nb = n.div_ceil(codec::BLOCK);
    let c = lay.counts;
    let ends = [
        (lay.offsets + 4 * nb, lay.params),
        (lay.params + 2 * nb, lay.signs),
        (lay.signs + n, lay.tier1),
        (lay.tier1 + n.div_ceil(4), lay.tier2),
        (lay.tier2 + 3 * c.groups, lay.escapes),
        (lay.escapes + 4 * c.escapes, lay.nbytes),
    ];
    ends.iter().map(|&(from, to)| (from, to - from)).collect()
}

/// Decodes one coded chunk of `values` values with `escapes` escapes (and `groups` tier-2 groups:
/// the two-tier code; `ranges`, its ranges' counts: the Huffman code; neither: the fixed-rate
/// code) from the `len` host bytes at `src` into the `values` bf16 values at `out`, on the calling
/// thread (the reference a GPU decode is checked against).
///
/// # Safety
/// `src` is `len` readable host bytes and `out` `2 * values` writable host bytes (2-byte aligned),
/// disjoint, allocated and not written by anyone else during the call.
pub unsafe fn decode_chunk_host(
    src: usize,
    len: usize,
    out: usize,
    values: usize,
    escapes: usize,
    groups: Option<usize>,
    ranges: Option<Vec<RangeCounts>>,
) -> Result<()> {
    crate::host::check_host_range("coded chunk", src, len)?;
    check_values("decoded chunk", out, values)?;
    // SAFETY: the caller's contract; both ranges checked non-null and non-wrapping.
    let (inp, out) = unsafe {
        (
            std::slice::from_raw_parts(src as *const u8, len),
            std::slice::from_raw_parts_mut(out as *mut u16, values),
        )
    };
    let kind = PieceKind::Coded {
        tensor: 0,
        first_value: 0,
        values,
        escapes,
        sub_escapes: Vec::new(),
        sub_groups: groups.map(|g| vec![g]),
        ranges,
    };
    decode_piece(&kind, inp, out)
}

/// Decodes one coded chunk (either code) from `inp` into `out` on the host.
fn decode_piece(kind: &PieceKind, inp: &[u8], out: &mut [u16]) -> Result<()> {
    if let Some(ranges) = kind.huffman_ranges() {
        return huffman::decode_chunk(inp, ranges, out)
            .map_err(|e| CudaError::InvalidArgument(e.to_string()));
    }
    let done = match kind.tiered_counts() {
        Some(counts) => tiered::decode_chunk(inp, counts, out),
        None => match kind {
            PieceKind::Coded { escapes, .. } => codec::decode_chunk(inp, *escapes, out),
            PieceKind::Raw(_) => {
                return Err(CudaError::InvalidArgument(
                    "a raw piece is not decoded".into(),
                ))
            }
        },
    };
    done.map_err(|e| CudaError::InvalidArgument(e.to_string()))
}

/// Bytes a unit of these tensors can take coded, whatever its counts: every tensor raw, and the
/// alignment of a piece per chunk and per tensor. [`encode_unit_fused`] writes into a buffer of this
/// size (pages it never reaches are never touched).
pub fn coded_capacity(specs: &[codec::TensorSpec]) -> Result<usize> {
    let overflow =
        || CudaError::InvalidArgument("a coded unit larger than the address space".into());
    specs.iter().try_fold(codec::PIECE_ALIGN, |acc, s| {
        let pieces = codec::chunks(s.nbytes / 2).count() + 1;
        pieces
            .checked_mul(codec::PIECE_ALIGN)
            .and_then(|pad| pad.checked_add(s.nbytes))
            .and_then(|n| acc.checked_add(n))
            .ok_or_else(overflow)
    })
}

/// Counts, lays out and codes one unit: each bf16 tensor, in slot order, is counted and its chunks
/// coded at once, where [`count_escapes_many`] / [`count_tiered_many`], [`codec::layout_coded_unit`]
/// and [`encode_unit`] take two passes over the whole unit. The fixed-rate code counts and codes each
/// range in one read of its values (`code_fixed_in_one_pass`: 2.2-2.5 -> 4.0-4.1 GB/s of bf16 on
/// the 2-core CI machine, `benchmarks.encode_rate`); the other codes count a tensor, then code it. The layout is [`codec::layout_coded_unit`]'s: pieces are laid out in slot order,
/// so the tensors laid out so far fix their pieces' places (a later raw tensor may only extend the
/// last raw piece, and raw pieces are written at the end). Writes into `dst`, `capacity` bytes
/// (at least what the unit takes: [`coded_capacity`] is always enough) and returns the layout.
///
/// # Safety
/// Each tensor is its given bytes of readable host memory (bf16 ones 2-byte aligned), and `dst`
/// `capacity` writable host bytes disjoint from them, all allocated and not written by anyone else
/// during the call.
pub unsafe fn encode_unit_fused(
    specs: &[codec::TensorSpec],
    tensors: &[(usize, usize)],
    code: codec::Code,
    max_chunk_bytes: usize,
    dst: usize,
    capacity: usize,
) -> Result<CodedUnit> {
    if specs.len() != tensors.len() {
        return Err(CudaError::InvalidArgument(format!(
            "{} tensor specs but {} tensors",
            specs.len(),
            tensors.len()
        )));
    }
    if let Some(t) = (0..specs.len()).find(|&t| tensors[t].1 < specs[t].nbytes) {
        return Err(CudaError::InvalidArgument(format!(
            "tensor {t} holds {} bytes, its spec {}",
            tensors[t].1, specs[t].nbytes
        )));
    }
    crate::host::check_host_range("coded unit buffer", dst, capacity)?;
    let bad = |e: ddo_core::CoreError| CudaError::InvalidArgument(e.to_string());
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by_key(|&t| specs[t].dst);
    // the tensors not laid out yet take no bytes (layout_coded_unit skips empty tensors)
    let mut seen: Vec<codec::TensorSpec> = specs
        .iter()
        .map(|s| codec::TensorSpec { nbytes: 0, ..*s })
        .collect();
    let mut escapes: Vec<Vec<Vec<usize>>> = vec![Vec::new(); specs.len()];
    let mut groups: Vec<Vec<Vec<usize>>> = vec![Vec::new(); specs.len()];
    let mut ranges: Vec<Vec<Vec<RangeCounts>>> = vec![Vec::new(); specs.len()];
    let mut unit = CodedUnit::default();
    // (tensor, first value, where) of the fixed-rate chunks coded as they were counted
    let mut single_pass: Vec<(usize, usize, usize)> = Vec::new();
    for &t in &order {
        seen[t] = specs[t];
        if specs[t].bf16 && specs[t].nbytes > 0 {
            let one = [(tensors[t].0, specs[t].nbytes / 2)];
            // SAFETY: the caller's contract: the tensor holds its spec's bytes, 2-byte aligned.
            match code {
                codec::Code::Tiered => {
                    let (e, g) = unsafe { count_tiered_many(&one) }?;
                    (escapes[t], groups[t]) = (
                        e.into_iter().next().unwrap_or_default(),
                        g.into_iter().next().unwrap_or_default(),
                    );
                }
                codec::Code::Fixed => {
                    // SAFETY: the caller's contract (the tensor's bytes; `dst`'s `capacity`).
                    let coded = unsafe {
                        code_fixed_in_one_pass(
                            &seen,
                            &mut escapes,
                            t,
                            tensors[t].0,
                            max_chunk_bytes,
                            dst,
                            capacity,
                        )
                    }?;
                    single_pass.extend(coded);
                }
                codec::Code::Huffman => {
                    ranges[t] = unsafe { count_huffman_many(&one) }?
                        .into_iter()
                        .next()
                        .unwrap_or_default();
                }
            }
        }
        unit = match code {
            codec::Code::Huffman => {
                codec::layout_coded_unit_huffman(&seen, &ranges, max_chunk_bytes)
            }
            _ => codec::layout_coded_unit(
                &seen,
                &escapes,
                (code == codec::Code::Tiered).then_some(&groups[..]),
                max_chunk_bytes,
            ),
        }
        .map_err(bad)?;
        if unit.nbytes > capacity {
            return Err(CudaError::InvalidArgument(format!(
                "a coded unit needs more than the {capacity} bytes given (coded_capacity gives enough)"
            )));
        }
        let chunks: Vec<codec::Piece> = unit
            .pieces
            .iter()
            .filter(|p| matches!(p.kind, PieceKind::Coded { tensor, .. } if tensor == t))
            .cloned()
            .collect();
        let coded_already = code == codec::Code::Fixed
            && chunks.iter().all(|p| match p.kind {
                PieceKind::Coded { first_value, .. } => {
                    single_pass.contains(&(t, first_value, p.src))
                }
                PieceKind::Raw(_) => false,
            });
        if !chunks.is_empty() && !coded_already {
            let part = CodedUnit {
                pieces: chunks,
                nbytes: unit.nbytes,
            };
            // SAFETY: the caller's contract; the pieces lie in the first `unit.nbytes <= capacity`
            // bytes of `dst` (checked by encode_unit), where no other piece is.
            unsafe { encode_unit(&part, tensors, dst) }?;
        }
    }
    let raws: Vec<codec::Piece> = unit
        .pieces
        .iter()
        .filter(|p| matches!(p.kind, PieceKind::Raw(_)))
        .cloned()
        .collect();
    if !raws.is_empty() {
        let part = CodedUnit {
            pieces: raws,
            nbytes: unit.nbytes,
        };
        // SAFETY: as above.
        unsafe { encode_unit(&part, tensors, dst) }?;
    }
    Ok(unit)
}

/// Counts and codes the fixed-rate chunks of bf16 tensor `t` (its values at `src`) in one pass over
/// its values, chunk by chunk: a chunk's place is known before its count (the unit laid out up to
/// it; its sections' offsets do not depend on its escapes), so every range of it is coded there in
/// parallel while counted, and the escapes, collected per range, are written after. Records each
/// chunk's escape counts in `escapes[t]` and returns `(t, first value, place)` of the chunks coded
/// (a chunk not worth coding is left to the raw pass: its sections are zeroed). The caller checks
/// the places against the unit's final layout and codes again any chunk placed elsewhere.
///
/// # Safety
/// `src` holds `seen[t].nbytes` readable bytes of bf16 (2-byte aligned), `dst` `capacity` writable
/// bytes disjoint from it, all allocated and not written by anyone else during the call.
unsafe fn code_fixed_in_one_pass(
    seen: &[codec::TensorSpec],
    escapes: &mut [Vec<Vec<usize>>],
    t: usize,
    src: usize,
    max_chunk_bytes: usize,
    dst: usize,
    capacity: usize,
) -> Result<Vec<(usize, usize, usize)>> {
    let bad = |e: ddo_core::CoreError| CudaError::InvalidArgument(e.to_string());
    let n = seen[t].nbytes / 2;
    let mut before = seen.to_vec();
    let mut coded = Vec::new();
    escapes[t].clear();
    for (first, values) in codec::chunks(n) {
        // the unit up to this chunk: this tensor's chunks before it, with their counts
        before[t].nbytes = 2 * first;
        let start = codec::layout_coded_unit(&before, escapes, None, max_chunk_bytes)
            .map_err(bad)?
            .nbytes
            .next_multiple_of(codec::PIECE_ALIGN);
        let lay = codec::chunk_layout(values, 0);
        if start + lay.escapes > capacity {
            return Err(CudaError::InvalidArgument(format!(
                "a coded unit needs more than the {capacity} bytes given (coded_capacity gives enough)"
            )));
        }
        // SAFETY: the sections of this chunk lie in `dst`'s first `capacity` bytes (checked
        // above); each range writes its own blocks, values and code bytes of them.
        let bytes = |off: usize, len: usize| unsafe {
            std::slice::from_raw_parts_mut((dst + start + off) as *mut u8, len)
        };
        let found: Vec<Vec<[u8; 4]>> = codec::subs(values)
            .collect::<Vec<_>>()
            .par_iter()
            .map(|&(at, len)| {
                // SAFETY: the caller's contract: the chunk's values lie in the tensor.
                let vals =
                    unsafe { std::slice::from_raw_parts((src as *const u16).add(first + at), len) };
                codec::encode_range_sections(
                    vals,
                    at,
                    bytes(at / codec::BLOCK, len.div_ceil(codec::BLOCK)),
                    bytes(lay.signs + at, len),
                    bytes(lay.codes + at / 2, len.div_ceil(2)),
                    None,
                )
                .map_err(|e| CudaError::InvalidArgument(format!("tensor {t}: {e}")))
            })
            .collect::<Result<_>>()?;
        let counts: Vec<usize> = found.iter().map(Vec::len).collect();
        let n_esc = counts.iter().sum();
        let full = codec::chunk_layout(values, n_esc);
        if codec::worth_coding(values, n_esc, max_chunk_bytes) && start + full.nbytes <= capacity {
            for &(off, len) in &fixed_gaps(&full) {
                bytes(off, len).fill(0);
            }
            let out = bytes(full.escapes, 4 * n_esc);
            for (place, entry) in out.chunks_exact_mut(4).zip(found.iter().flatten()) {
                place.copy_from_slice(entry);
            }
            coded.push((t, first, start));
        } else {
            bytes(0, lay.escapes).fill(0); // left to the raw pass, which writes the bytes it owns
        }
        escapes[t].push(counts);
    }
    Ok(coded)
}

/// Decodes `unit`'s host buffer at `src` back into its tensors `(address, bytes)` (the inverse
/// of [`encode_unit`]): every raw piece and every [`codec::SUB_ELEMS`]-value range of every coded
/// chunk in parallel (`decode_blocks` of either code), then each chunk's escapes (`apply_escapes`,
/// after the checks that tie its ranges together), chunks in parallel.
///
/// # Safety
/// `src` is `unit.nbytes` readable host bytes, each tensor its given bytes of writable host
/// memory, tensors disjoint from each other and from `src`, all allocated and not accessed by
/// anyone else during the call; `unit` is as `layout_coded_unit` laid it out (no two of its pieces
/// write the same bytes of a tensor).
pub unsafe fn decode_unit(unit: &CodedUnit, src: usize, tensors: &[(usize, usize)]) -> Result<()> {
    check_unit_tensors(unit, tensors)?;
    crate::host::check_host_range("coded unit buffer", src, unit.nbytes)?;
    check_pieces(unit)?;
    let bad = |e: ddo_core::CoreError| CudaError::InvalidArgument(e.to_string());
    // SAFETY (every slice below): a piece lies in the unit's buffer (checked above), a chunk's values
    // in its tensor (check_unit_tensors); pieces of one tensor do not overlap as `layout_coded_unit`
    // lays them out (the unit this module's callers pass), and ranges of one chunk are disjoint.
    let input =
        |p: &codec::Piece| unsafe { std::slice::from_raw_parts((src + p.src) as *const u8, p.len) };
    let output = |tensor: usize, first: usize, values: usize| unsafe {
        std::slice::from_raw_parts_mut((tensors[tensor].0 as *mut u16).add(first), values)
    };
    enum Task<'a> {
        Raw(&'a codec::Piece, &'a [codec::Segment]),
        Range {
            chunk: usize,
            first: usize,
            len: usize,
        },
    }
    // (piece, tensor, first value, values, tiered counts) of every coded chunk
    let chunks: Vec<_> = unit
        .pieces
        .iter()
        .filter_map(|p| match &p.kind {
            PieceKind::Coded {
                tensor,
                first_value,
                values,
                ..
            } => Some((p, *tensor, *first_value, *values, p.kind.tiered_counts())),
            PieceKind::Raw(_) => None,
        })
        .collect();
    let mut tasks = Vec::new();
    for p in &unit.pieces {
        if let PieceKind::Raw(segs) = &p.kind {
            tasks.push(Task::Raw(p, segs));
        }
    }
    for (c, &(_, _, _, values, _)) in chunks.iter().enumerate() {
        tasks.extend(codec::subs(values).map(|(first, len)| Task::Range {
            chunk: c,
            first,
            len,
        }));
    }
    // per task: the escape codes it counted (fixed-rate), or its tier-2 range (two-tier)
    let found: Vec<(usize, Option<tiered::BlockRange>, usize)> = tasks
        .par_iter()
        .map(|t| match *t {
            Task::Raw(p, segs) => {
                let inp = input(p);
                for s in segs {
                    // SAFETY: the segment lies in its tensor, which no other piece writes there.
                    let out = unsafe {
                        std::slice::from_raw_parts_mut(
                            (tensors[s.tensor].0 + s.tensor_offset) as *mut u8,
                            s.len,
                        )
                    };
                    out.copy_from_slice(&inp[s.offset..s.offset + s.len]);
                }
                Ok((usize::MAX, None, 0))
            }
            Task::Range { chunk, first, len } => {
                let (p, tensor, first_value, values, counts) = chunks[chunk];
                let out = output(tensor, first_value + first, len);
                if let Some(ranges) = p.kind.huffman_ranges() {
                    // this sub-range's Huffman ranges, each on its own
                    let lay = huffman::huffman_layout(values, ranges);
                    if input(p).len() < lay.nbytes
                        || ranges.len() != values.div_ceil(huffman::RANGE_ELEMS)
                    {
                        return Err(CudaError::InvalidArgument(
                            "corrupt Huffman chunk: its piece is shorter than its layout".into(),
                        ));
                    }
                    for (k, part) in out.chunks_mut(huffman::RANGE_ELEMS).enumerate() {
                        let at = first + k * huffman::RANGE_ELEMS;
                        huffman::decode_range(input(p), &lay, at / huffman::RANGE_ELEMS, at, part)
                            .map_err(bad)?;
                    }
                    return Ok((usize::MAX, None, 0));
                }
                match (counts, &p.kind) {
                    (Some(counts), _) => {
                        tiered::decode_blocks(input(p), values, counts, first, out)
                            .map(|r| (chunk, Some(r), 0))
                    }
                    (None, PieceKind::Coded { escapes, .. }) => {
                        codec::decode_blocks(input(p), values, *escapes, first, out)
                            .map(|e| (chunk, None, e))
                    }
                    (None, PieceKind::Raw(_)) => unreachable!("chunks holds coded pieces only"),
                }
                .map_err(bad)
            }
        })
        .collect::<Result<_>>()?;
    // each chunk's ranges, in order (tasks were pushed chunk by chunk, ranges in order)
    let mut per_chunk: Vec<Vec<(Option<tiered::BlockRange>, usize)>> =
        (0..chunks.len()).map(|_| Vec::new()).collect();
    for (chunk, range, escaped) in found {
        if chunk != usize::MAX {
            per_chunk[chunk].push((range, escaped));
        }
    }
    per_chunk.into_par_iter().enumerate().try_for_each(|(c, ranges)| {
        let (p, tensor, first_value, values, counts) = chunks[c];
        if p.kind.huffman_ranges().is_some() {
            return Ok(()); // no escapes: its ranges decoded it whole
        }
        let out = output(tensor, first_value, values);
        match (counts, &p.kind) {
            (Some(counts), _) => {
                let mut group = 0usize;
                let mut escaped = Vec::new();
                for (k, (range, _)) in ranges.into_iter().enumerate() {
                    let range = range.expect("a two-tier chunk's ranges carry their groups");
                    if range.start_group != group {
                        return Err(CudaError::InvalidArgument(format!(
                            "corrupt tiered chunk: range {k} starts its tier-2 codes at group {}, expected {group}",
                            range.start_group
                        )));
                    }
                    group = range.end_group;
                    escaped.extend(range.escaped);
                }
                tiered::apply_escapes(input(p), counts, group, &escaped, out).map_err(bad)
            }
            (None, PieceKind::Coded { escapes, .. }) => {
                let used: usize = ranges.iter().map(|&(_, e)| e).sum();
                if used != *escapes {
                    return Err(CudaError::InvalidArgument(format!(
                        "corrupt coded chunk: {escapes} escapes listed, {used} used"
                    )));
                }
                codec::apply_escapes(input(p), *escapes, out).map_err(bad)
            }
            (None, PieceKind::Raw(_)) => unreachable!("chunks holds coded pieces only"),
        }
    })
}

/// A ring of landing buffers on the device, its events and the decode stream: shared by every
/// coded fetch of one transport.
pub(crate) struct DecodeRing {
    ordinal: usize,
    decode_stream: Stream,
    kernel: Kernel,
    landing: Vec<usize>,
    landing_bytes: usize,
    /// Most landing buffers one batch of chunks fills (`ddo_core::landing`): half the ring where
    /// its buffers are consecutive in memory (at least two batches in flight), else one.
    batch_buffers: usize,
    landed: Vec<Event>,
    decoded: Vec<Event>,
    /// One event: the copy stream after a job's copies, which the decode stream waits for.
    done: Vec<Event>,
    next: Mutex<usize>,
    errors: ErrorSlot,
}

impl std::fmt::Debug for DecodeRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeRing")
            .field("ordinal", &self.ordinal)
            .field("landing", &self.landing.len())
            .field("landing_bytes", &self.landing_bytes)
            .finish()
    }
}

impl DecodeRing {
    /// A ring over `landing` device buffers of `landing_bytes` each, decoding on `decode_stream`;
    /// events are created in the current context (the primary context of `ordinal`).
    ///
    /// # Safety
    /// Each landing address is `landing_bytes` of device memory of device `ordinal`, 16-byte
    /// aligned, used by nothing else and allocated until the ring is dropped; `decode_stream` is a
    /// live stream of that device, alive until then.
    pub unsafe fn new(
        ordinal: usize,
        decode_stream: Stream,
        landing: Vec<usize>,
        landing_bytes: usize,
        errors: &ErrorSlot,
    ) -> Result<Self> {
        if landing.is_empty()
            || landing.iter().any(|&a| a == 0 || !a.is_multiple_of(16))
            || landing_bytes == 0
        {
            return Err(CudaError::InvalidArgument(
                "a decode ring needs at least one non-empty, 16-byte aligned landing buffer".into(),
            ));
        }
        let kernel = decode_kernel(ordinal)?;
        let consecutive = landing
            .windows(2)
            .all(|w| w[0].checked_add(landing_bytes) == Some(w[1]));
        let batch_buffers = if consecutive {
            (landing.len() / 2).max(1)
        } else {
            1
        };
        let mk = |n: usize| Event::many(n, errors);
        Ok(Self {
            ordinal,
            decode_stream,
            kernel,
            landed: mk(landing.len())?,
            decoded: mk(landing.len())?,
            done: mk(1)?,
            landing,
            landing_bytes,
            batch_buffers,
            next: Mutex::new(0),
            errors: errors.clone(),
        })
    }

    pub fn landing_bytes(&self) -> usize {
        self.landing_bytes
    }

    /// The batches of `unit`'s coded chunks for this ring.
    pub fn batches(&self, unit: &CodedUnit) -> Result<Vec<Batch>> {
        ddo_core::landing::landing_batches(unit, self.landing_bytes, self.batch_buffers)
            .map_err(|e| CudaError::InvalidArgument(e.to_string()))
    }

    /// Blocks the host until every decode queued so far has completed.
    pub fn synchronize(&self) -> Result<()> {
        crate::driver::synchronize_stream(self.decode_stream, "draining decodes")
    }
}

impl Drop for DecodeRing {
    fn drop(&mut self) {
        crate::event::destroy_bound(
            self.ordinal,
            &self.errors,
            &mut [&mut self.landed, &mut self.decoded, &mut self.done],
        );
    }
}

/// A coded unit registered with a transport: its layout, its host buffer, and on the GPU how its
/// chunks cross into the landing ring (`ddo_core::landing`).
#[derive(Debug)]
pub(crate) struct HostCodedUnit {
    pub unit: CodedUnit,
    pub host: usize,
    /// The batches of its pieces for the transport's ring (empty on the CPU target).
    pub batches: Vec<Batch>,
    /// Indices of its pieces that no batch carries, copied straight into the slot on the copy
    /// stream (`ddo_core::landing::direct_pieces`: every raw piece on the CPU target).
    pub direct: Vec<usize>,
    /// Bytes one fetch sends: on the GPU its batches and direct pieces (`ddo_core::landing`), on
    /// the CPU target its host buffer.
    pub link_bytes: usize,
}

/// The post-copy stage of a coded fetch: decode every coded chunk into the slot. On the GPU the
/// slot is ready once the decode stream has run the unit's last decode and caught up with the copy
/// stream's raw copies: arrival is recorded on the decode stream, so the copy stream never waits
/// for a decode except to reuse a landing buffer.
#[derive(Debug)]
pub(crate) struct DecodeStage {
    pub unit: Arc<HostCodedUnit>,
    /// `None` on the CPU target.
    pub ring: Option<Arc<DecodeRing>>,
    /// Whether [`Stage::early`] queued the chunks (then `run` only joins the raw copies).
    pub queued: std::sync::atomic::AtomicBool,
}

impl DecodeStage {
    pub fn new(unit: Arc<HostCodedUnit>, ring: Option<Arc<DecodeRing>>) -> Self {
        Self {
            unit,
            ring,
            queued: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn has_coded(&self) -> bool {
        self.unit.unit.largest_coded() > 0
    }

    /// Queues every coded chunk's copy into the landing ring (copy stream) and its decode into the
    /// slot at `base` (decode stream); `wait_slot`, if given, orders the decode stream after the
    /// slot's last consumer before the first decode. Returns whether there was a chunk.
    fn queue_chunks(
        &self,
        stream: Stream,
        ring: &DecodeRing,
        base: usize,
        wait_slot: Option<&dyn Fn(Stream) -> Result<()>>,
    ) -> Result<bool> {
        let host = self.unit.host;
        let n = ring.landing.len();
        let mut next = ring.next.lock().unwrap_or_else(|e| e.into_inner());
        for (i, batch) in self.unit.batches.iter().enumerate() {
            if i == 0 {
                if let Some(wait) = wait_slot {
                    wait(ring.decode_stream)?; // no decode writes the slot before its release
                }
            }
            // A batch takes the buffers it fills, the ring turning (`ddo_core::landing::ring_place`):
            // as many batches in flight as fit, each copy waiting only for the decodes of the buffers
            // it overwrites. Made for this ring at registration (batches of at most half of it);
            // checked anyway, as the copy below writes device memory.
            let placed = ddo_core::landing::ring_place(*next, batch.buffers, n);
            let Some((k, after)) =
                placed.filter(|_| batch.len <= batch.buffers * ring.landing_bytes)
            else {
                return Err(CudaError::InvalidArgument(format!(
                    "a batch of {} bytes in {} landing buffers does not fit the ring of {n} of {} bytes",
                    batch.len, batch.buffers, ring.landing_bytes
                )));
            };
            *next = after;
            let used = k..k + batch.buffers;
            for b in used.clone() {
                ring.decoded[b].wait_on(stream)?;
            }
            // SAFETY: the fetch's contract makes the host range live and unmodified until the copy
            // completed (the batch lies inside the unit's host buffer: `add_coded_unit` checked
            // its pieces); the landing buffers k.. are the ring's, consecutive in its one
            // allocation, and free once their decoded events completed.
            unsafe { h2d_async(ring.landing[k], host + batch.src, batch.len, stream)? };
            ring.landed[k].record(stream)?;
            ring.landed[k].wait_on(ring.decode_stream)?;
            let decoded = self.decode_batch(ring, batch, k, base);
            // recorded even after a failed launch: the next copy into these buffers waits for the
            // decodes that were queued
            for b in used {
                ring.decoded[b].record(ring.decode_stream)?;
            }
            decoded?;
        }
        Ok(!self.unit.batches.is_empty())
    }

    /// Queues the decodes of `batch`'s chunks (landed at buffer `k`) into the slot at `base`, and
    /// the device-to-device copies of its raw pieces.
    fn decode_batch(&self, ring: &DecodeRing, batch: &Batch, k: usize, base: usize) -> Result<()> {
        let pieces = &self.unit.unit.pieces;
        for &j in &batch.pieces {
            let p = &pieces[j];
            let src = ring.landing[k] + (p.src - batch.src);
            let PieceKind::Coded { .. } = p.kind else {
                // SAFETY: the batch holds the piece at its offset once landed[k] completed (the
                // batch's buffers are consecutive in the ring's one allocation); its bytes go to
                // its range of the slot, free since the decode stream's wait for the slot's last
                // consumer, and no other piece writes there.
                unsafe { crate::job::d2d_async(base + p.dst, src, p.len, ring.decode_stream)? };
                continue;
            };
            // SAFETY: the landing buffers hold the batch once landed[k] completed, the chunk at
            // its offset in it (16-byte aligned: pieces are 64-byte aligned in the host buffer);
            // the output is the chunk's range of the slot, 16-byte aligned (the unit layout
            // aligns tensors to 256 bytes and chunks to 16 MiB), free since the decode
            // stream's (early) or the copy stream's (through landed[k]) wait for the slot's
            // last consumer.
            unsafe {
                launch_coded(
                    ring.ordinal,
                    &ring.kernel,
                    &p.kind,
                    ring.decode_stream,
                    src,
                    base + p.dst,
                )?
            };
        }
        Ok(())
    }
}

impl Stage for DecodeStage {
    fn arrival_stream(&self) -> Option<Stream> {
        match &self.ring {
            Some(ring) if self.has_coded() => Some(ring.decode_stream),
            _ => None,
        }
    }

    fn early(
        &self,
        copy_stream: Option<Stream>,
        sink: &Sink,
        wait_slot: &dyn Fn(Stream) -> Result<()>,
    ) -> Result<bool> {
        let (Some(stream), Some(ring)) = (copy_stream, self.ring.as_ref()) else {
            return Ok(false); // the CPU target decodes in `run`, after the raw copies
        };
        // `run` then queues only the join with the raw copies
        self.queued
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.queue_chunks(stream, ring, sink.addr(), Some(wait_slot))?;
        Ok(true)
    }

    fn run(&self, copy_stream: Option<Stream>, sink: &Sink) -> Result<()> {
        let base = sink.addr();
        let host = self.unit.host;
        let (Some(stream), Some(ring)) = (copy_stream, self.ring.as_ref()) else {
            // the CPU target: decode from the host buffer straight into the slot
            let chunks: Vec<_> = self
                .unit
                .unit
                .pieces
                .iter()
                .filter_map(|p| match p.kind {
                    PieceKind::Coded { values, .. } => Some((p, values)),
                    PieceKind::Raw(_) => None,
                })
                .collect();
            if copy_stream.is_some() && !chunks.is_empty() {
                return Err(CudaError::InvalidArgument(
                    "a coded unit on the GPU needs the transport's decode ring".into(),
                ));
            }
            return chunks.par_iter().try_for_each(|&(p, values)| {
                // SAFETY: the fetch's contract: the buffer holds the unit and the slot its span.
                let (inp, out) = unsafe {
                    (
                        std::slice::from_raw_parts((host + p.src) as *const u8, p.len),
                        std::slice::from_raw_parts_mut((base + p.dst) as *mut u16, values),
                    )
                };
                decode_piece(&p.kind, inp, out)
            });
        };
        let any = if self.queued.load(std::sync::atomic::Ordering::Relaxed) {
            self.has_coded()
        } else {
            self.queue_chunks(stream, ring, base, None)?
        };
        if any {
            // the raw copies, queued on the copy stream before this stage, come before arrival
            ring.done[0].record(stream)?;
            ring.done[0].wait_on(ring.decode_stream)?;
        }
        Ok(())
    }
}

/// The post-copy stage of a coded unit read from a file (the NVMe route's side file): the job's
/// copies put the unit's coded bytes, as laid out in its host buffer, at `staged` (device memory on
/// the GPU, host memory on the CPU target); this stage then writes every piece into the slot at
/// `out`, raw pieces copied and coded chunks decoded. On the GPU it queues all of it on the copy
/// stream, after the copies and before arrival: the next job's copies into `staged` come after
/// the decodes in that stream's order, so one staging buffer serves every fetch of a transport.
/// A disk-bound route loses nothing to it: the decode of a unit takes a fraction of a millisecond
/// beside the disk's many.
#[derive(Debug)]
pub(crate) struct StagedDecode {
    pub unit: Arc<CodedUnit>,
    pub staged: usize,
    pub out: usize,
    /// The device whose kernels decode (`None` on the CPU target).
    pub ordinal: Option<usize>,
}

impl Stage for StagedDecode {
    fn run(&self, copy_stream: Option<Stream>, _sink: &Sink) -> Result<()> {
        let (staged, out) = (self.staged, self.out);
        let pieces = &self.unit.pieces;
        let (Some(stream), Some(ordinal)) = (copy_stream, self.ordinal) else {
            if copy_stream.is_some() {
                return Err(CudaError::InvalidArgument(
                    "a staged coded unit on the GPU needs its device's kernels".into(),
                ));
            }
            // the CPU target: every piece from the staged bytes into the slot, in parallel
            return pieces.par_iter().try_for_each(|p| {
                // SAFETY: `fetch_file_coded`'s contract: `staged` holds the unit's bytes (its
                // pieces lie in them: `check_pieces` at registration) and the slot its span;
                // pieces write disjoint ranges of the slot.
                let inp =
                    unsafe { std::slice::from_raw_parts((staged + p.src) as *const u8, p.len) };
                match p.kind {
                    PieceKind::Raw(_) => {
                        // SAFETY: as above.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut((out + p.dst) as *mut u8, p.len)
                        };
                        dst.copy_from_slice(inp);
                        Ok(())
                    }
                    PieceKind::Coded { values, .. } => {
                        // SAFETY: as above.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut((out + p.dst) as *mut u16, values)
                        };
                        decode_piece(&p.kind, inp, dst)
                    }
                }
            });
        };
        let fixed = decode_kernel(ordinal)?;
        for p in pieces {
            // SAFETY (each launch and copy): the copies before this stage on the same stream put
            // the unit's bytes at `staged` (device memory, pieces 64-byte aligned in it); the
            // slot at `out` holds the unit's span, free since the copy stream's wait for the
            // slot's last consumer; pieces write disjoint ranges of it (16-byte aligned: the
            // unit layout aligns tensors to 256 bytes and chunks to 16 MiB).
            unsafe {
                match p.kind {
                    PieceKind::Raw(_) => {
                        crate::job::d2d_async(out + p.dst, staged + p.src, p.len, stream)?
                    }
                    PieceKind::Coded { .. } => launch_coded(
                        ordinal,
                        &fixed,
                        &p.kind,
                        stream,
                        staged + p.src,
                        out + p.dst,
                    )?,
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Target, Transport};
    use ddo_core::codec::{layout_coded_unit, TensorSpec};

    fn weights(n: usize, seed: u32) -> Vec<u16> {
        // bf16 of a smooth spread of magnitudes, some zeros, an Inf and a NaN
        (0..n)
            .map(|i| {
                let x = ((i as f32 * 0.618 + seed as f32).sin() * 0.05)
                    * if i % 97 == 0 { 1e-12 } else { 1.0 };
                match i % 1009 {
                    5 => 0x7f80,
                    6 => 0x7fc3,
                    7 => 0,
                    _ => (x.to_bits() >> 16) as u16,
                }
            })
            .collect()
    }

    #[test]
    fn a_coded_unit_round_trips_through_the_host_buffer_and_a_cpu_fetch() {
        round_trip_unit(false);
    }

    #[test]
    fn a_tiered_unit_round_trips_through_the_host_buffer_and_a_cpu_fetch() {
        round_trip_unit(true);
    }

    #[test]
    fn a_corrupt_unit_decodes_to_an_error_or_values_never_a_panic() {
        // two ranges per chunk, so the checks that tie ranges together run too
        for tiered in [false, true] {
            let a = weights(66_000, 3);
            let specs = [TensorSpec {
                dst: 0,
                nbytes: 2 * a.len(),
                bf16: true,
            }];
            let tensors = [(a.as_ptr() as usize, 2 * a.len())];
            let bf16 = [(tensors[0].0, a.len())];
            let unit = if tiered {
                // SAFETY: a live vector of that many u16s.
                let (escapes, groups) = unsafe { count_tiered_many(&bf16) }.unwrap();
                layout_coded_unit(&specs, &escapes, Some(&groups), usize::MAX).unwrap()
            } else {
                // SAFETY: as above.
                let counts = unsafe { count_escapes_many(&bf16) }.unwrap();
                layout_coded_unit(&specs, &counts, None, usize::MAX).unwrap()
            };
            let mut host = vec![0u8; unit.nbytes];
            // SAFETY: `host` has `unit.nbytes` bytes, the tensor its length, both live.
            unsafe { encode_unit(&unit, &tensors, host.as_mut_ptr() as usize) }.unwrap();
            let mut back = vec![0u16; a.len()];
            let outs = [(back.as_mut_ptr() as usize, 2 * a.len())];
            let (mut failed, mut wrong) = (0, 0);
            for at in (0..host.len()).step_by(251) {
                for flip in [0x00u8, 0xff, host[at] ^ 0x5a] {
                    let mut bad = host.clone();
                    bad[at] = flip;
                    // SAFETY: `bad` has the unit's bytes, `back` the tensor's; both live.
                    match unsafe { decode_unit(&unit, bad.as_ptr() as usize, &outs) } {
                        Err(_) => failed += 1,
                        Ok(()) => wrong += usize::from(back != a),
                    }
                }
            }
            assert!(
                failed > 0 && wrong > 0,
                "tiered {tiered}: {failed} errors, {wrong} other values"
            );
            // SAFETY: as above, the intact buffer.
            unsafe { decode_unit(&unit, host.as_ptr() as usize, &outs) }.unwrap();
            assert_eq!(back, a);
        }
    }

    fn round_trip_unit(tiered: bool) {
        let a = weights(70_000, 1);
        let b: Vec<u8> = (0..999).map(|i| (i * 7) as u8).collect(); // fp32 or int: sent raw
        let c = weights(9, 2);
        let specs = [
            TensorSpec {
                dst: 0,
                nbytes: 2 * a.len(),
                bf16: true,
            },
            TensorSpec {
                dst: 140_032,
                nbytes: b.len(),
                bf16: false,
            },
            TensorSpec {
                dst: 141_056,
                nbytes: 2 * c.len(),
                bf16: true,
            },
        ];
        let tensors = [
            (a.as_ptr() as usize, 2 * a.len()),
            (b.as_ptr() as usize, b.len()),
            (c.as_ptr() as usize, 2 * c.len()),
        ];
        let bf16 = [(tensors[0].0, a.len()), (tensors[2].0, c.len())];
        let shape = |c: &[Vec<Vec<usize>>]| vec![c[0].clone(), vec![], c[1].clone()];
        let unit = if tiered {
            // SAFETY: both tensors are live vectors of that many u16s.
            let (escapes, groups) = unsafe { count_tiered_many(&bf16) }.unwrap();
            let groups = shape(&groups);
            layout_coded_unit(&specs, &shape(&escapes), Some(&groups), usize::MAX).unwrap()
        } else {
            // SAFETY: as above.
            let counts = unsafe { count_escapes_many(&bf16) }.unwrap();
            layout_coded_unit(&specs, &shape(&counts), None, usize::MAX).unwrap()
        };
        assert_eq!(unit.pieces[0].kind.tiered_counts().is_some(), tiered);
        let limit = if tiered { 75 } else { 80 }; // percent of the bf16 bytes
        assert!(unit.nbytes < (2 * a.len()) * limit / 100, "{}", unit.nbytes);
        let mut host = vec![0xffu8; unit.nbytes];
        // SAFETY: `host` has `unit.nbytes` bytes, the tensors their lengths, all live.
        unsafe { encode_unit(&unit, &tensors, host.as_mut_ptr() as usize) }.unwrap();
        // back into fresh tensors
        let (mut a2, mut b2, mut c2) =
            (vec![0u16; a.len()], vec![0u8; b.len()], vec![0u16; c.len()]);
        let outs = [
            (a2.as_mut_ptr() as usize, 2 * a.len()),
            (b2.as_mut_ptr() as usize, b.len()),
            (c2.as_mut_ptr() as usize, 2 * c.len()),
        ];
        // SAFETY: as above; the outputs are disjoint live vectors.
        unsafe { decode_unit(&unit, host.as_ptr() as usize, &outs) }.unwrap();
        assert!(a2 == a && b2 == b && c2 == c);
        // through the transport into a slot
        let mut t = Transport::new(Target::Cpu, 1, None).unwrap();
        let id = t
            .add_coded_unit(unit.clone(), host.as_ptr() as usize)
            .unwrap();
        let mut slot = vec![0u8; 141_056 + 2 * c.len()];
        // SAFETY: the slot holds the unit's span; the host buffer is live and unmodified.
        unsafe { t.fetch_coded(0, slot.as_mut_ptr() as usize, id) }.unwrap();
        let words = |bytes: &[u8]| -> Vec<u16> {
            bytes
                .chunks_exact(2)
                .map(|w| u16::from_le_bytes([w[0], w[1]]))
                .collect()
        };
        assert_eq!(words(&slot[..2 * a.len()]), a);
        assert_eq!(&slot[140_032..140_032 + b.len()], &b[..]);
        assert_eq!(words(&slot[141_056..]), c);
        assert_eq!(t.stats().bytes, host.len() as u64);
        // SAFETY: refused before anything is touched: unit 5 was never registered.
        assert!(unsafe { t.fetch_coded(0, slot.as_mut_ptr() as usize, 5) }.is_err());
        t.close().unwrap();

        // the same bytes in a side file, read through a staging ring and decoded from there
        let dir = std::env::temp_dir().join(format!("ddo-staged-{}-{tiered}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("units.bin");
        let mut file = vec![0x5au8; 4096];
        file.extend_from_slice(&host);
        std::fs::write(&path, &file).unwrap();
        let staging = crate::Staging {
            buffers: 2,
            buffer_bytes: 3 * 4096 + 1, // smaller than the unit: several chunks
            threads: 2,
            pinned: false,
            stage_host: false,
            piece_bytes: 0,
        };
        let mut t = Transport::new(Target::Cpu, 2, Some(staging)).unwrap();
        let f = t.open_file(&path, false).unwrap();
        let piece = ddo_core::ReadPiece {
            file: f,
            offset: 4096,
            len: host.len() as u64,
            dst: 0,
        };
        let fu = t.add_file_unit(&[piece], 0).unwrap();
        let su = t.add_staged_unit(unit).unwrap();
        let mut staged = vec![0u8; host.len()];
        for round in 0..2 {
            let mut slot = vec![0u8; 141_056 + 2 * c.len()];
            // SAFETY: `staged` holds the file unit's span, the slot the unit's; both live past
            // the drain below.
            unsafe {
                t.fetch_file_coded(
                    round,
                    slot.as_mut_ptr() as usize,
                    fu,
                    su,
                    staged.as_mut_ptr() as usize,
                )
            }
            .unwrap();
            t.acquire(round, Stream::DEFAULT).unwrap();
            assert_eq!(words(&slot[..2 * a.len()]), a);
            assert_eq!(&slot[140_032..140_032 + b.len()], &b[..]);
            assert_eq!(words(&slot[141_056..]), c);
            t.release(round, Stream::DEFAULT).unwrap();
        }
        // a staging buffer or a file unit too small for the coded unit is refused before any read
        let short = t
            .add_file_unit(
                &[ddo_core::ReadPiece {
                    file: f,
                    offset: 4096,
                    len: 100,
                    dst: 0,
                }],
                0,
            )
            .unwrap();
        // SAFETY: refused before anything is touched.
        assert!(unsafe {
            t.fetch_file_coded(
                0,
                slot.as_mut_ptr() as usize,
                short,
                su,
                staged.as_mut_ptr() as usize,
            )
        }
        .is_err());
        // SAFETY: as above: staged unit 9 was never registered.
        assert!(unsafe {
            t.fetch_file_coded(
                0,
                slot.as_mut_ptr() as usize,
                fu,
                9,
                staged.as_mut_ptr() as usize,
            )
        }
        .is_err());
        // the same unit from host memory (a RAM cache of coded units), in order with the file jobs
        let mut slot2 = vec![0u8; 141_056 + 2 * c.len()];
        // SAFETY: `host` holds the unit's bytes, `staged` and the slot their spans; all live past
        // the close below.
        unsafe {
            t.fetch_host_coded(
                1,
                slot2.as_mut_ptr() as usize,
                su,
                host.as_ptr() as usize,
                staged.as_mut_ptr() as usize,
            )
        }
        .unwrap();
        t.acquire(1, Stream::DEFAULT).unwrap();
        assert_eq!(words(&slot2[..2 * a.len()]), a);
        assert_eq!(&slot2[140_032..140_032 + b.len()], &b[..]);
        assert_eq!(words(&slot2[141_056..]), c);
        t.release(1, Stream::DEFAULT).unwrap();
        t.close().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `unit`'s bytes from the two-pass encoder, and the fused encoder's unit and buffer (of
    /// `coded_capacity` bytes), both buffers filled with 0xa5 first.
    fn encode_both(
        unit: &CodedUnit,
        specs: &[TensorSpec],
        tensors: &[(usize, usize)],
        code: codec::Code,
        limit: usize,
    ) -> (Vec<u8>, CodedUnit, Vec<u8>) {
        let mut want = vec![0xa5u8; unit.nbytes];
        // SAFETY: the buffer holds the unit, the tensors their bytes; all live.
        unsafe { encode_unit(unit, tensors, want.as_mut_ptr() as usize) }.unwrap();
        let cap = coded_capacity(specs).unwrap();
        let mut got = vec![0xa5u8; cap];
        // SAFETY: `got` has `cap` bytes, the tensors their bytes; all live.
        let fused = unsafe {
            encode_unit_fused(specs, tensors, code, limit, got.as_mut_ptr() as usize, cap)
        }
        .unwrap();
        (want, fused, got)
    }

    #[test]
    fn the_fused_fixed_code_leaves_chunks_not_worth_coding_to_the_raw_pass() {
        // the one-pass code places a chunk before counting it: a chunk over the landing limit, an
        // all-escape tensor and a raw tensor after them must come out as the two passes lay them out
        let a = weights(codec::CHUNK_ELEMS + 70_000, 6);
        let e: Vec<u16> = (0..50_000u32)
            .map(|i| (i.wrapping_mul(40_503) >> 3) as u16 | 0x0080)
            .collect();
        let f: Vec<u8> = (0..333).map(|i| (i * 13) as u8).collect();
        let specs = [
            TensorSpec {
                dst: 0,
                nbytes: 2 * a.len(),
                bf16: true,
            },
            TensorSpec {
                dst: 2 * a.len() + 512,
                nbytes: 2 * e.len(),
                bf16: true,
            },
            TensorSpec {
                dst: 2 * a.len() + 512 + 2 * e.len(),
                nbytes: f.len(),
                bf16: false,
            },
        ];
        let tensors = [
            (a.as_ptr() as usize, 2 * a.len()),
            (e.as_ptr() as usize, 2 * e.len()),
            (f.as_ptr() as usize, f.len()),
        ];
        let bf16 = [(tensors[0].0, a.len()), (tensors[1].0, e.len())];
        // SAFETY: live vectors of that many u16s.
        let counts = unsafe { count_escapes_many(&bf16) }.unwrap();
        let counts = vec![counts[0].clone(), counts[1].clone(), vec![]];
        for limit in [usize::MAX, 1 << 20] {
            let two_pass = layout_coded_unit(&specs, &counts, None, limit).unwrap();
            // bf16 chunks left raw (the all-escape tensor; with the limit, the large chunk too)
            let left_raw: usize = two_pass
                .pieces
                .iter()
                .map(|p| match &p.kind {
                    PieceKind::Raw(segs) => segs.iter().filter(|s| s.tensor != 2).count(),
                    PieceKind::Coded { .. } => 0,
                })
                .sum();
            assert_eq!(
                left_raw,
                if limit == usize::MAX { 1 } else { 2 },
                "{two_pass:?}"
            );
            assert!(two_pass
                .pieces
                .iter()
                .any(|p| p.kind.code() == Some("fixed")));
            let (want, fused, got) =
                encode_both(&two_pass, &specs, &tensors, codec::Code::Fixed, limit);
            assert_eq!(fused, two_pass, "limit {limit}");
            assert_eq!(&got[..fused.nbytes], &want[..], "limit {limit}");
        }
    }

    #[test]
    fn the_fused_encoder_writes_the_two_pass_bytes_and_layout() {
        for code in [
            codec::Code::Fixed,
            codec::Code::Tiered,
            codec::Code::Huffman,
        ] {
            // tensors out of slot order, a raw one between coded ones, one chunk boundary crossed
            let a = weights(codec::CHUNK_ELEMS + 70_000, 4);
            let b: Vec<u8> = (0..999).map(|i| (i * 7) as u8).collect();
            let c = weights(5000, 5);
            let specs = [
                TensorSpec {
                    dst: 1 << 20,
                    nbytes: 2 * a.len(),
                    bf16: true,
                },
                TensorSpec {
                    dst: 4096,
                    nbytes: b.len(),
                    bf16: false,
                },
                TensorSpec {
                    dst: 0,
                    nbytes: 2 * c.len(),
                    bf16: true,
                },
            ];
            let tensors = [
                (a.as_ptr() as usize, 2 * a.len()),
                (b.as_ptr() as usize, b.len()),
                (c.as_ptr() as usize, 2 * c.len()),
            ];
            let bf16 = [(tensors[0].0, a.len()), (tensors[2].0, c.len())];
            let shape = |v: &[Vec<Vec<usize>>]| vec![v[0].clone(), vec![], v[1].clone()];
            let two_pass = match code {
                codec::Code::Tiered => {
                    // SAFETY: live vectors of that many u16s.
                    let (e, g) = unsafe { count_tiered_many(&bf16) }.unwrap();
                    layout_coded_unit(&specs, &shape(&e), Some(&shape(&g)), usize::MAX).unwrap()
                }
                codec::Code::Fixed => {
                    // SAFETY: as above.
                    let e = unsafe { count_escapes_many(&bf16) }.unwrap();
                    layout_coded_unit(&specs, &shape(&e), None, usize::MAX).unwrap()
                }
                codec::Code::Huffman => {
                    // SAFETY: as above.
                    let r = unsafe { count_huffman_many(&bf16) }.unwrap();
                    let r = vec![r[0].clone(), vec![], r[1].clone()];
                    codec::layout_coded_unit_huffman(&specs, &r, usize::MAX).unwrap()
                }
            };
            assert!(two_pass.pieces.iter().any(|p| p.kind.code()
                == Some(match code {
                    codec::Code::Fixed => "fixed",
                    codec::Code::Tiered => "tiered",
                    codec::Code::Huffman => "huffman",
                })));
            // the host decoder gives the tensors back
            let mut back = (a.clone(), vec![0u8; b.len()], c.clone());
            back.0.fill(0);
            back.2.fill(0);
            let (want, fused, mut got) = encode_both(&two_pass, &specs, &tensors, code, usize::MAX);
            assert_eq!(fused, two_pass);
            assert_eq!(&got[..fused.nbytes], &want[..]);
            let outs = [
                (back.0.as_mut_ptr() as usize, 2 * a.len()),
                (back.1.as_mut_ptr() as usize, b.len()),
                (back.2.as_mut_ptr() as usize, 2 * c.len()),
            ];
            // SAFETY: `want` holds the unit, `outs` the tensors' bytes, all live and disjoint.
            unsafe { decode_unit(&fused, want.as_ptr() as usize, &outs) }.unwrap();
            assert_eq!((&back.0, &back.1, &back.2), (&a, &b, &c), "{code:?}");
            assert!(
                got[fused.nbytes..].iter().all(|&x| x == 0xa5),
                "nothing written past the unit"
            );
            // too small a buffer is an error, not a write past it
            // SAFETY: as above; refused before writing past `nbytes - 1`.
            assert!(unsafe {
                encode_unit_fused(
                    &specs,
                    &tensors,
                    code,
                    usize::MAX,
                    got.as_mut_ptr() as usize,
                    fused.nbytes - 1,
                )
            }
            .is_err());
        }
    }

    #[test]
    fn encode_checks_its_inputs() {
        let a = weights(100, 1);
        let specs = [TensorSpec {
            dst: 0,
            nbytes: 200,
            bf16: true,
        }];
        let unit = layout_coded_unit(&specs, &[vec![vec![0]]], None, usize::MAX).unwrap();
        let mut host = vec![0u8; unit.nbytes];
        // a tensor shorter than its pieces, or missing: refused before any write
        let short = [(a.as_ptr() as usize, 100)];
        // SAFETY: nothing is read or written: the checks fail first.
        assert!(unsafe { encode_unit(&unit, &short, host.as_mut_ptr() as usize) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { encode_unit(&unit, &[], host.as_mut_ptr() as usize) }.is_err());
        // SAFETY: a null source is refused by the range check.
        assert!(unsafe { count_escapes_many(&[(0, 4)]) }.is_err());
        let mut t = Transport::new(Target::Cpu, 1, None).unwrap();
        let mut bad = unit.clone();
        bad.nbytes = 0;
        assert!(t.add_coded_unit(bad, host.as_ptr() as usize).is_err());
        // SAFETY: refused on the CPU target before anything is touched.
        assert!(unsafe { t.set_decoder(Stream::DEFAULT, vec![16], 16) }.is_err());
    }
}
