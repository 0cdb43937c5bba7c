//! The GPU decoder of the Huffman code (`ddo_core::huffman`): one CUDA block a range.
//!
//! A block reads its range's record, builds a 1024-entry table of the codes of up to 10 bits in
//! shared memory (longer ones, rare, are found by the canonical limits), then decodes its segments
//! 256 at a time, one a thread: one pass puts the thread's exponents in its scratch (68 of them; a
//! segment of more, only with codes of one bit, is decoded again in place), a prefix sum over the
//! block turns the counts into positions, and the exponents are copied there in shared memory. Once the
//! range's exponents are all there, each thread joins 16 of them at a time with their sign+mantissa
//! bytes (one 16-byte load) and writes them with two 16-byte stores.

use ddo_core::huffman::{self, RangeCounts, RANGE_ELEMS};

use crate::driver::Stream;
use crate::error::{CudaError, Result};
use crate::kernel::{Arg, Kernel, LaunchConfig};

/// The kernel's source (`RANGE_ELEMS` is replaced by the range size).
pub const HUFFMAN_SOURCE: &str = r#"
#define MAXL 16u
#define LUTB 10u
#define THREADS 256u
#define SCRATCH 68u

// the values of one segment in order: WRITE puts each exponent at `dst[c]` while `at + c < cap`
template <bool WRITE>
__device__ __forceinline__ unsigned int ddo_segment(unsigned long long hi, unsigned long long lo,
    const unsigned short* lut, const unsigned int* first, const unsigned int* endv,
    const unsigned int* base, const unsigned char* sym, unsigned char* dst, unsigned int at,
    unsigned int cap) {
  unsigned int left = 128u, c = 0u;
  while (left > 0u) {
    unsigned int window = (unsigned int)(hi >> 48);
    unsigned int e = lut[window >> (MAXL - LUTB)];
    unsigned int len = e >> 8, s = e & 0xffu;
    if (len == 0u) {
      for (unsigned int l = LUTB + 1u; l <= MAXL; ++l) {
        unsigned int top = window >> (MAXL - l);
        if (window < endv[l] && top >= first[l]) {
          len = l;
          s = sym[(base[l] + top - first[l]) & 0xffu];
          break;
        }
      }
    }
    if (len == 0u || len > left) break;
    if (WRITE && at + c < cap) dst[at + c] = (unsigned char)s;
    ++c;
    hi = (hi << len) | (lo >> (64u - len));
    lo <<= len;
    left -= len;
  }
  return c;
}

extern "C" __global__ void __launch_bounds__(256) ddo_decode_huffman(
    const unsigned char* __restrict__ chunk, unsigned short* __restrict__ out, unsigned int n,
    unsigned int symbols, unsigned int signs, unsigned int segments, unsigned int total_segments,
    unsigned int total_symbols) {
  __shared__ __align__(16) unsigned char exps[RANGE_ELEMS];
  __shared__ unsigned short lut[1u << LUTB];
  __shared__ unsigned int first[MAXL + 1u], endv[MAXL + 1u], base[MAXL + 1u];
  __shared__ unsigned char sym[256];
  __shared__ unsigned int warp_total[THREADS / 32u];
  // a thread's exponents as its one decoding pass finds them (68 bytes apart: 17 words, so a warp's
  // byte accesses at one offset fall in 32 different banks)
  __shared__ __align__(16) unsigned char scratch[THREADS * SCRATCH];
  const unsigned int r = blockIdx.x, tid = threadIdx.x;
  const unsigned char* rec = chunk + 48u * r;
  unsigned int seg0 = *reinterpret_cast<const unsigned int*>(rec);
  unsigned int nseg = *reinterpret_cast<const unsigned int*>(rec + 4);
  unsigned int sym0 = *reinterpret_cast<const unsigned int*>(rec + 8);
  unsigned int nsym = *reinterpret_cast<const unsigned int*>(rec + 12);
  // a corrupt record decodes garbage, never out of bounds
  nsym = min(nsym, 256u);
  sym0 = min(sym0, total_symbols - min(nsym, total_symbols));
  seg0 = min(seg0, total_segments);
  nseg = min(nseg, total_segments - seg0);
  if (tid < nsym) sym[tid] = chunk[symbols + sym0 + tid];
  if (tid == 0u) {
    unsigned int code = 0u, index = 0u;
    first[0] = endv[0] = base[0] = 0u;
    for (unsigned int l = 1u; l <= MAXL; ++l) {
      unsigned int c = *reinterpret_cast<const unsigned short*>(rec + 16u + 2u * (l - 1u));
      first[l] = code;
      base[l] = index;
      endv[l] = (code + c) << (MAXL - l);
      code = (code + c) << 1;
      index += c;
    }
  }
  __syncthreads();
  for (unsigned int w = tid; w < (1u << LUTB); w += THREADS) {
    unsigned int window = w << (MAXL - LUTB);
    unsigned short e = 0;
    for (unsigned int l = 1u; l <= LUTB; ++l) {
      unsigned int top = window >> (MAXL - l);
      if (window < endv[l] && top >= first[l]) {
        e = (unsigned short)((l << 8) | sym[(base[l] + top - first[l]) & 0xffu]);
        break;
      }
    }
    lut[w] = e;
  }
  __syncthreads();
  const unsigned int first_value = r * RANGE_ELEMS;
  const unsigned int rn = min(RANGE_ELEMS, n - first_value);
  const unsigned int lane = tid & 31u, warp = tid >> 5;
  unsigned int done = 0u;
  for (unsigned int s0 = 0u; s0 < nseg; s0 += THREADS) {
    unsigned int k = s0 + tid;
    ulonglong2 seg = make_ulonglong2(0ull, 0ull);
    if (k < nseg) seg = *reinterpret_cast<const ulonglong2*>(chunk + segments + 16u * (seg0 + k));
    unsigned char* mine_at = scratch + SCRATCH * tid;
    unsigned int mine = k < nseg ? ddo_segment<true>(seg.y, seg.x, lut, first, endv, base, sym, mine_at, 0u, SCRATCH) : 0u;
    unsigned int incl = mine;
#pragma unroll
    for (unsigned int d = 1u; d < 32u; d <<= 1) {
      unsigned int up = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += up;
    }
    if (lane == 31u) warp_total[warp] = incl;
    __syncthreads();
    unsigned int before = done + incl - mine, round = 0u;
    for (unsigned int w = 0u; w < THREADS / 32u; ++w) {
      if (w < warp) before += warp_total[w];
      round += warp_total[w];
    }
    if (mine <= SCRATCH) {
      for (unsigned int j = 0u; j < mine && before + j < rn; ++j) exps[before + j] = mine_at[j];
    } else {  // more values than the scratch holds (codes of one bit): decode again, in place
      ddo_segment<true>(seg.y, seg.x, lut, first, endv, base, sym, exps, before, rn);
    }
    done += round;
    __syncthreads();  // warp_total is rewritten by the next round
  }
  // join: 16 values a step, signs 16-byte aligned (a range starts at a multiple of RANGE_ELEMS)
  for (unsigned int g = 16u * tid; g < rn; g += 16u * THREADS) {
    uint4 sv = *reinterpret_cast<const uint4*>(chunk + signs + first_value + g);
    uint4 ev = *reinterpret_cast<const uint4*>(exps + g);
    unsigned int sw[4] = {sv.x, sv.y, sv.z, sv.w}, ew[4] = {ev.x, ev.y, ev.z, ev.w}, v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      unsigned int s0 = (sw[j / 2] >> (16 * (j & 1))) & 0xffu, s1 = (sw[j / 2] >> (16 * (j & 1) + 8)) & 0xffu;
      unsigned int e0 = (ew[j / 2] >> (16 * (j & 1))) & 0xffu, e1 = (ew[j / 2] >> (16 * (j & 1) + 8)) & 0xffu;
      unsigned int v0 = ((s0 & 0x80u) << 8) | (e0 << 7) | (s0 & 0x7fu);
      unsigned int v1 = ((s1 & 0x80u) << 8) | (e1 << 7) | (s1 & 0x7fu);
      v[j] = v0 | (v1 << 16);
    }
    unsigned short* o = out + first_value + g;
    if (g + 16u <= rn) {
      reinterpret_cast<uint4*>(o)[0] = make_uint4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<uint4*>(o)[1] = make_uint4(v[4], v[5], v[6], v[7]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // the range's last values, with constant indices into v
        if (g + 2u * j < rn) o[2 * j] = (unsigned short)v[j];
        if (g + 2u * j + 1u < rn) o[2 * j + 1] = (unsigned short)(v[j] >> 16);
      }
    }
  }
}
"#;

/// The source with the range size filled in.
pub fn source() -> String {
    HUFFMAN_SOURCE.replace("RANGE_ELEMS", &format!("{RANGE_ELEMS}u"))
}

/// The kernel's name in [`source`].
pub const KERNEL_NAME: &str = "ddo_decode_huffman";

/// Queues the decode of one Huffman chunk of `values` values whose ranges have these counts, at
/// device address `chunk`, into `values` bf16 values at device address `out`, on `stream`.
///
/// # Safety
/// `chunk` holds the chunk's [`huffman::huffman_layout`] bytes and `out` `2 * values` writable
/// bytes, 16-byte aligned, both device memory of `kernel`'s device, allocated and not written by
/// anyone else until the decode completed; `stream` is a live stream of that device's primary
/// context; `kernel` was built from [`source`].
pub unsafe fn launch_decode(
    kernel: &Kernel,
    stream: Stream,
    chunk: usize,
    out: usize,
    values: usize,
    counts: &[RangeCounts],
) -> Result<()> {
    if values == 0 {
        return Ok(());
    }
    if values > ddo_core::codec::CHUNK_ELEMS
        || counts.len() != values.div_ceil(RANGE_ELEMS)
        || !out.is_multiple_of(16)
        || !chunk.is_multiple_of(16)
    {
        return Err(CudaError::InvalidArgument(format!(
            "a Huffman decode of {values} values (at most {}) in {} ranges from {chunk:#x} to \
             {out:#x} (both 16-byte aligned)",
            ddo_core::codec::CHUNK_ELEMS,
            counts.len()
        )));
    }
    let lay = huffman::huffman_layout(values, counts);
    let config = LaunchConfig {
        grid: (counts.len() as u32, 1, 1),
        block: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        Arg::Ptr(chunk as u64),
        Arg::Ptr(out as u64),
        Arg::U32(values as u32),
        Arg::U32(lay.symbols as u32),
        Arg::U32(lay.signs as u32),
        Arg::U32(lay.segments as u32),
        Arg::U32(lay.segments_total as u32),
        Arg::U32(lay.symbols_total as u32),
    ];
    // SAFETY: the caller upholds the contract on `chunk`, `out` and `stream`; the kernel reads the
    // layout's `nbytes` bytes of `chunk` (its indices clamped to the sections) and writes `2 *
    // values` bytes of `out`.
    unsafe { kernel.launch(config, stream, &args) }
}

#[cfg(test)]
mod tests {
    use ddo_core::huffman::{count_ranges, encode_chunk, huffman_layout, MAX_LEN, RECORD_BYTES};

    use super::*;

    /// The kernel's arithmetic on the host, block by block and thread by thread: the same table
    /// built the same way, the same two passes over each segment's two 64-bit words, the same
    /// prefix sums and the same 16-value joins. What it cannot check (shuffles, barriers, the
    /// stores) the GPU tests do.
    fn emulate(chunk: &[u8], n: usize, counts: &[RangeCounts]) -> Vec<u16> {
        const LUTB: u32 = 10;
        let lay = huffman_layout(n, counts);
        let u32_at = |a: usize| u32::from_le_bytes(chunk[a..a + 4].try_into().unwrap());
        let mut out = vec![0u16; n];
        for r in 0..counts.len() {
            let rec = RECORD_BYTES * r;
            let nsym = (u32_at(rec + 12) as usize).min(256);
            let sym0 =
                (u32_at(rec + 8) as usize).min(lay.symbols_total - nsym.min(lay.symbols_total));
            let seg0 = (u32_at(rec) as usize).min(lay.segments_total);
            let nseg = (u32_at(rec + 4) as usize).min(lay.segments_total - seg0);
            let mut sym = [0u8; 256];
            sym[..nsym].copy_from_slice(&chunk[lay.symbols + sym0..lay.symbols + sym0 + nsym]);
            let (mut first, mut endv, mut base) = ([0u32; 17], [0u32; 17], [0u32; 17]);
            let (mut code, mut index) = (0u32, 0u32);
            for l in 1..=MAX_LEN {
                let c = u32::from(u16::from_le_bytes([
                    chunk[rec + 16 + 2 * (l - 1)],
                    chunk[rec + 17 + 2 * (l - 1)],
                ]));
                first[l] = code;
                base[l] = index;
                endv[l] = (code + c) << (MAX_LEN - l);
                code = (code + c) << 1;
                index += c;
            }
            let find = |window: u32, lo: usize, hi: usize| {
                (lo..=hi).find_map(|l| {
                    let top = window >> (MAX_LEN - l);
                    (window < endv[l] && top >= first[l])
                        .then(|| (l as u32, sym[((base[l] + top - first[l]) & 0xff) as usize]))
                })
            };
            let lut: Vec<Option<(u32, u8)>> = (0..1u32 << LUTB)
                .map(|w| find(w << (MAX_LEN as u32 - LUTB), 1, LUTB as usize))
                .collect();
            let segment = |hi: u64, lo: u64, mut put: Option<&mut dyn FnMut(u32, u8)>| {
                let (mut hi, mut lo, mut left, mut c) = (hi, lo, 128u32, 0u32);
                while left > 0 {
                    let window = (hi >> 48) as u32;
                    let Some((len, s)) = lut[(window >> (MAX_LEN as u32 - LUTB)) as usize]
                        .or_else(|| find(window, LUTB as usize + 1, MAX_LEN))
                    else {
                        break;
                    };
                    if len > left {
                        break;
                    }
                    if let Some(p) = put.as_mut() {
                        p(c, s);
                    }
                    c += 1;
                    hi = (hi << len) | (lo >> (64 - len));
                    lo <<= len;
                    left -= len;
                }
                c
            };
            let first_value = r * RANGE_ELEMS;
            let rn = RANGE_ELEMS.min(n - first_value);
            let mut exps = vec![0u8; RANGE_ELEMS];
            let mut done = 0u32;
            for s0 in (0..nseg).step_by(256) {
                let words: Vec<(u64, u64)> = (s0..(s0 + 256).min(nseg))
                    .map(|k| {
                        let at = lay.segments + 16 * (seg0 + k);
                        (
                            u64::from_le_bytes(chunk[at + 8..at + 16].try_into().unwrap()),
                            u64::from_le_bytes(chunk[at..at + 8].try_into().unwrap()),
                        )
                    })
                    .collect();
                // one pass into each thread's scratch (68 values), then copied to its place; a segment
                // of more values is decoded again in place
                const SCRATCH: usize = 68;
                let mut scratch = vec![[0u8; SCRATCH]; words.len()];
                let mine: Vec<u32> = words
                    .iter()
                    .zip(scratch.iter_mut())
                    .map(|(&(hi, lo), own)| {
                        segment(
                            hi,
                            lo,
                            Some(&mut |c, s| {
                                if (c as usize) < SCRATCH {
                                    own[c as usize] = s;
                                }
                            }),
                        )
                    })
                    .collect();
                let mut before = done;
                for ((&(hi, lo), &m), own) in words.iter().zip(&mine).zip(&scratch) {
                    let at = before;
                    if m as usize <= SCRATCH {
                        for j in 0..m {
                            if ((at + j) as usize) < rn {
                                exps[(at + j) as usize] = own[j as usize];
                            }
                        }
                    } else {
                        segment(
                            hi,
                            lo,
                            Some(&mut |c, s| {
                                if ((at + c) as usize) < rn {
                                    exps[(at + c) as usize] = s;
                                }
                            }),
                        );
                    }
                    before += m;
                }
                done += mine.iter().sum::<u32>();
            }
            let signs = &chunk[lay.signs + first_value..];
            for i in 0..rn {
                let (s, e) = (u16::from(signs[i]), u16::from(exps[i]));
                out[first_value + i] = ((s & 0x80) << 8) | (e << 7) | (s & 0x7f);
            }
        }
        out
    }

    #[test]
    fn the_kernels_arithmetic_decodes_what_the_reference_codes() {
        let mut s = 0x2545f4914f6cdd1du64;
        let mut values: Vec<u16> = (0..3 * RANGE_ELEMS + 777)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                // a narrow exponent window, like weights, with every 16th value anything at all
                if s.is_multiple_of(16) {
                    (s >> 20) as u16
                } else {
                    (((120 + (s >> 40) % 5 - ((s >> 50) % 3)) as u16) << 7)
                        | ((s >> 8) as u16 & 0x807f)
                }
            })
            .collect();
        values[5] = 0x7fc1; // NaN with a payload
        values[6] = 0x8000;
        // one exponent in nine: codes of one bit, up to 128 values a segment (past the scratch)
        let skewed: Vec<u16> = (0..RANGE_ELEMS as u32 + 999)
            .map(|i| {
                if i % 9 == 0 {
                    0x4000 | (i as u16 & 0x7f)
                } else {
                    0x3f80 | (i as u16 & 0x807f)
                }
            })
            .collect();
        for v in [&skewed[..], &skewed[..300]] {
            let counts = count_ranges(v);
            let lay = huffman_layout(v.len(), &counts);
            let mut chunk = vec![0u8; lay.nbytes];
            encode_chunk(v, &counts, &mut chunk).unwrap();
            assert_eq!(
                emulate(&chunk, v.len(), &counts),
                v,
                "skewed, {} values",
                v.len()
            );
        }
        for n in [values.len(), RANGE_ELEMS, 1, 17] {
            let v = &values[..n];
            let counts = count_ranges(v);
            let lay = huffman_layout(n, &counts);
            let mut chunk = vec![0u8; lay.nbytes];
            encode_chunk(v, &counts, &mut chunk).unwrap();
            assert_eq!(emulate(&chunk, n, &counts), v, "{n} values");
        }
    }
}
