//! The host codecs' hot loops compiled a second time for AVX2 and chosen at run time.
//!
//! The wheel targets baseline x86-64 (SSE2), where the fixed-rate code's loops run 8 values an
//! instruction; on a CPU with AVX2 the same source runs 16. `ddo-core` keeps no `unsafe` code, so the
//! second compilation lives here: each wrapper calls the `ddo-core` function (marked `#[inline]` so it
//! is compiled into the wrapper) from a function compiled with AVX2 enabled when the CPU has it.

use ddo_core::codec;

/// `pub fn name(args) -> ret` calling `target(args)`, compiled for AVX2 where the CPU has it.
macro_rules! avx2_dispatch {
    ($(#[$m:meta])* pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty => $target:path;) => {
        $(#[$m])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $target($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2, the only feature `avx2` was compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $target($($arg),*)
        }
    };
}

avx2_dispatch! {
    /// [`codec::count_escapes`].
    pub fn count_escapes(values: &[u16]) -> usize => codec::count_escapes;
}

avx2_dispatch! {
    /// [`codec::encode_range`].
    pub fn encode_range(
        values: &[u16],
        first: usize,
        bases: &mut [u8],
        signs: &mut [u8],
        codes: &mut [u8],
        escapes: &mut [u8],
    ) -> ddo_core::Result<()> => codec::encode_range;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dispatched_code_is_the_reference_code() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut values: Vec<u16> = (0..3 * codec::BLOCK + 77)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 20) as u16
            })
            .collect();
        values[5] = 0x7f80; // Inf
        values[6] = 0x0001; // a denormal
        let n = values.len();
        let n_esc = count_escapes(&values);
        assert_eq!(n_esc, codec::count_escapes(&values));
        let sections = |n: usize| {
            (
                vec![0u8; n.div_ceil(codec::BLOCK)],
                vec![0u8; n],
                vec![0u8; n.div_ceil(2)],
                vec![0u8; 4 * n_esc],
            )
        };
        let (mut b0, mut s0, mut c0, mut e0) = sections(n);
        let (mut b1, mut s1, mut c1, mut e1) = sections(n);
        encode_range(&values, 0, &mut b0, &mut s0, &mut c0, &mut e0).unwrap();
        codec::encode_range(&values, 0, &mut b1, &mut s1, &mut c1, &mut e1).unwrap();
        assert_eq!((b0, s0, c0, e0), (b1, s1, c1, e1));
    }
}
