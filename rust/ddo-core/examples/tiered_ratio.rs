//! The tiered and fixed-rate codes' sizes on normal weights, and one thread's speeds:
//! `cargo run --release -p ddo-core --example tiered_ratio`.
use ddo_core::{codec, tiered};
use std::time::Instant;

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

fn main() {
    let n = codec::CHUNK_ELEMS;
    for sigma in [0.02f32, 1.0] {
        let v = normal(n, sigma, 1);
        let t = Instant::now();
        let subs = tiered::count_subs(&v);
        let count_s = t.elapsed().as_secs_f64();
        let total = subs.iter().fold(tiered::Counts::default(), |a, &b| a + b);
        let lay = tiered::tiered_layout(n, total);
        let mut out = vec![0u8; lay.nbytes];
        let t = Instant::now();
        tiered::encode_chunk(&v, &subs, &mut out).unwrap();
        let enc_s = t.elapsed().as_secs_f64();
        let mut back = vec![0u16; n];
        let t = Instant::now();
        tiered::decode_chunk(&out, total, &mut back).unwrap();
        let dec_s = t.elapsed().as_secs_f64();
        assert_eq!(back, v);
        let t = Instant::now();
        let n_esc = codec::count_escapes(&v);
        let fixed_count_s = t.elapsed().as_secs_f64();
        let fixed = codec::chunk_layout(n, n_esc).nbytes;
        let mut fixed_out = vec![0u8; fixed];
        let t = Instant::now();
        codec::encode_chunk(&v, n_esc, &mut fixed_out).unwrap();
        let fixed_enc_s = t.elapsed().as_secs_f64();
        let gb = (2 * n) as f64 / 1e9;
        println!(
            "normal(0, {sigma}), {n} values: tiered {:.4} of bf16 ({} tier-2 groups, {} escapes), fixed {:.4}; \
             one thread: count {:.2} GB/s, encode {:.2} GB/s, decode {:.2} GB/s of bf16 \
             (fixed: count {:.2} GB/s, encode {:.2} GB/s)",
            lay.nbytes as f64 / (2 * n) as f64,
            total.groups,
            total.escapes,
            fixed as f64 / (2 * n) as f64,
            gb / count_s,
            gb / enc_s,
            gb / dec_s,
            gb / fixed_count_s,
            gb / fixed_enc_s
        );
    }
}
