//! The GPU decoder of the two-tier code (`ddo_core::tiered`): one kernel, 8 values a thread.
//!
//! A thread loads its 8 sign+mantissa bytes (one 8-byte load) and 8 tier-1 codes (one 2-byte
//! load), counts its tier-2 codes (`__popc`), and finds where they start in its block's tier-2
//! stream by an exclusive prefix sum over the 64 threads of its 512-value block (a warp shuffle
//! scan, then one shared word per warp: a block is two whole warps, a CUDA block of 256 threads
//! four whole value blocks). Tier-2 codes are read 3 bits at a time at bit `3 q` of the stream;
//! code 7 finds its exponent in the chunk's sorted escape list by binary search, as the fixed-rate
//! kernel does. Padding values have tier-1 code 0 and take no tier-2 code.

use ddo_core::codec::{self, VALUES_PER_THREAD};
use ddo_core::tiered::{self, Counts};

use crate::driver::Stream;
use crate::error::Result;
use crate::kernel::Kernel;

/// The kernel's source (`BLOCK` is replaced by the block size).
pub const TIERED_SOURCE: &str = r#"
extern "C" __global__ void ddo_decode_tiered(const unsigned char* __restrict__ chunk,
    unsigned short* __restrict__ out, unsigned int n, unsigned int n_esc, unsigned int params,
    unsigned int signs, unsigned int tier1, unsigned int tier2, unsigned int escapes) {
  __shared__ unsigned int warp_total[32];
  unsigned int i0 = (blockIdx.x * blockDim.x + threadIdx.x) * 8u;
  bool live = i0 < n;
  uint2 sm = make_uint2(0u, 0u);
  unsigned int c1 = 0u;
  if (live) {
    sm = *reinterpret_cast<const uint2*>(chunk + signs + i0);
    c1 = *reinterpret_cast<const unsigned short*>(chunk + tier1 + i0 / 4u);
  }
  unsigned int mine = __popc(c1 & (c1 >> 1) & 0x5555u);  // codes equal to 3
  unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  unsigned int incl = mine;
#pragma unroll
  for (unsigned int d = 1u; d < 32u; d <<= 1) {
    unsigned int up = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += up;
  }
  if (lane == 31u) warp_total[warp] = incl;
  __syncthreads();
  // a value block is two warps: the odd warp starts after the even one's total
  unsigned int before = incl - mine + ((warp & 1u) ? warp_total[warp - 1u] : 0u);
  if (!live) return;
  unsigned int vb = i0 / BLOCK;
  unsigned int pos = *reinterpret_cast<const unsigned int*>(chunk + 4u * vb) * 8u + before;
  unsigned int b1 = chunk[params + 2u * vb], k = chunk[params + 2u * vb + 1u];
  const unsigned char* t2 = chunk + tier2;
  const unsigned int* esc = reinterpret_cast<const unsigned int*>(chunk + escapes);
  unsigned int v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    unsigned int s = ((j < 4 ? sm.x : sm.y) >> (8 * (j & 3))) & 0xffu;
    unsigned int c = (c1 >> (2 * j)) & 3u;
    unsigned int e = b1 + c;
    if (c == 3u) {
      unsigned int bit = 3u * pos, at = bit >> 3, sh = bit & 7u;
      unsigned int w = t2[at];
      if (sh > 5u) w |= (unsigned int)t2[at + 1u] << 8;  // the code crosses into the next byte
      unsigned int c2 = (w >> sh) & 7u;
      ++pos;
      if (c2 != 7u) {
        e = c2 < k ? b1 - k + c2 : b1 + 3u + c2 - k;
      } else {
        unsigned int i = i0 + j, lo = 0u, hi = n_esc;
        while (lo < hi) {
          unsigned int mid = (lo + hi) / 2u;
          if ((esc[mid] >> 8) < i) lo = mid + 1u; else hi = mid;
        }
        e = lo < n_esc ? (esc[lo] & 0xffu) : 0u;
      }
    }
    v[j] = ((s & 0x80u) << 8) | ((e & 0xffu) << 7) | (s & 0x7fu);
  }
  if (i0 + 8u <= n) {
    uint4 o = make_uint4(v[0] | (v[1] << 16), v[2] | (v[3] << 16), v[4] | (v[5] << 16),
                         v[6] | (v[7] << 16));
    *reinterpret_cast<uint4*>(out + i0) = o;
  } else {
    for (unsigned int j = 0; i0 + j < n; ++j) out[i0 + j] = (unsigned short)v[j];
  }
}
"#;

const _: () =
    assert!((crate::codec::THREADS as usize).is_multiple_of(codec::BLOCK / VALUES_PER_THREAD));

/// The source with the block size filled in.
pub fn source() -> String {
    TIERED_SOURCE.replace("BLOCK", &format!("{}u", codec::BLOCK))
}

/// The kernel's name in [`source`].
pub const KERNEL_NAME: &str = "ddo_decode_tiered";

/// Queues the decode of one two-tier chunk of `values` values with these counts, at device
/// address `chunk`, into `values` bf16 values at device address `out`, on `stream`.
///
/// # Safety
/// `chunk` holds the chunk's [`tiered::tiered_layout`] bytes and `out` `2 * values` writable
/// bytes, 16-byte aligned, both device memory of `kernel`'s device, allocated and not written by
/// anyone else until the decode completed; `stream` is a live stream of that device's primary
/// context; `kernel` was built from [`source`].
pub unsafe fn launch_decode(
    kernel: &Kernel,
    stream: Stream,
    chunk: usize,
    out: usize,
    values: usize,
    counts: Counts,
) -> Result<()> {
    let lay = tiered::tiered_layout(values, counts);
    let rest = [
        counts.escapes,
        lay.params,
        lay.signs,
        lay.tier1,
        lay.tier2,
        lay.escapes,
    ];
    // SAFETY: the caller upholds launch_chunk's contract; the kernel reads `lay.nbytes` bytes of
    // `chunk` (tier-2 bytes only where a code lies) and writes `2 * values` bytes of `out`.
    unsafe { crate::codec::launch_chunk(kernel, stream, chunk, out, values, &rest) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddo_core::tiered::{count_subs, decode_chunk, encode_chunk, tiered_layout};

    /// The kernel's arithmetic, thread by thread, on the host: the same loads (little-endian words
    /// at the same offsets), the same prefix over the 64 threads of a block, the same bit reads.
    /// What it cannot check (shuffles, barriers, the store) the GPU tests do.
    fn emulate(chunk: &[u8], n: usize, counts: Counts) -> Vec<u16> {
        let lay = tiered_layout(n, counts);
        let threads = n.div_ceil(8);
        let c1_of = |t: usize| {
            u32::from(u16::from_le_bytes([
                chunk[lay.tier1 + 2 * t],
                chunk[lay.tier1 + 2 * t + 1],
            ]))
        };
        let mine = |t: usize| (c1_of(t) & (c1_of(t) >> 1) & 0x5555).count_ones();
        let u32_at =
            |a: usize| u32::from_le_bytes([chunk[a], chunk[a + 1], chunk[a + 2], chunk[a + 3]]);
        let mut out = vec![0u16; n];
        for t in 0..threads {
            let i0 = 8 * t;
            let first_thread = t - t % (codec::BLOCK / 8);
            let before: u32 = (first_thread..t).map(mine).sum();
            let vb = i0 / codec::BLOCK;
            let mut pos = u32_at(lay.offsets + 4 * vb) * 8 + before;
            let (b1, k) = (
                u32::from(chunk[lay.params + 2 * vb]),
                u32::from(chunk[lay.params + 2 * vb + 1]),
            );
            let c1 = c1_of(t);
            for j in 0..8usize {
                if i0 + j >= n {
                    break;
                }
                let s = u32::from(chunk[lay.signs + i0 + j]);
                let c = (c1 >> (2 * j)) & 3;
                let mut e = b1 + c;
                if c == 3 {
                    let bit = 3 * pos as usize;
                    let (at, sh) = (bit >> 3, (bit & 7) as u32);
                    let mut w = u32::from(chunk[lay.tier2 + at]);
                    if sh > 5 {
                        w |= u32::from(chunk[lay.tier2 + at + 1]) << 8;
                    }
                    let c2 = (w >> sh) & 7;
                    pos += 1;
                    e = if c2 != 7 {
                        if c2 < k {
                            b1 - k + c2
                        } else {
                            b1 + 3 + c2 - k
                        }
                    } else {
                        let esc = |m: usize| u32_at(lay.escapes + 4 * m);
                        let i = (i0 + j) as u32;
                        let (mut lo, mut hi) = (0usize, counts.escapes);
                        while lo < hi {
                            let mid = (lo + hi) / 2;
                            if (esc(mid) >> 8) < i {
                                lo = mid + 1
                            } else {
                                hi = mid
                            }
                        }
                        if lo < counts.escapes {
                            esc(lo) & 0xff
                        } else {
                            0
                        }
                    };
                }
                out[i0 + j] = (((s & 0x80) << 8) | ((e & 0xff) << 7) | (s & 0x7f)) as u16;
            }
        }
        out
    }

    fn check(values: &[u16]) {
        let subs = count_subs(values);
        let counts = subs.iter().fold(Counts::default(), |a, &b| a + b);
        let mut chunk = vec![0u8; tiered_layout(values.len(), counts).nbytes];
        encode_chunk(values, &subs, &mut chunk).unwrap();
        let mut reference = vec![0u16; values.len()];
        decode_chunk(&chunk, counts, &mut reference).unwrap();
        assert_eq!(reference, values);
        assert_eq!(emulate(&chunk, values.len(), counts), values);
    }

    #[test]
    fn the_kernel_arithmetic_decodes_what_the_encoder_wrote() {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        // normal-ish weights of several scales, every bit pattern, random bits, odd lengths
        let normal: Vec<u16> = (0..200_003)
            .map(|i| {
                let z = (0..6)
                    .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32)
                    .sum::<f32>()
                    - 3.0;
                let sigma = [0.02f32, 1.0, 1e-5][(i / 4096) % 3];
                ((z * sigma).to_bits() >> 16) as u16
            })
            .collect();
        check(&normal);
        check(&(0..=u16::MAX).collect::<Vec<_>>());
        check(&(0..70_001).map(|_| next() as u16).collect::<Vec<_>>());
        for n in [1, 7, 8, 9, 511, 512, 513, 1023, 4097] {
            check(&normal[..n]);
        }
        let mut zeros_and_escapes = vec![0u16; 3 * 512];
        zeros_and_escapes[512..1024]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i as u16).wrapping_mul(977));
        check(&zeros_and_escapes);
    }
}
