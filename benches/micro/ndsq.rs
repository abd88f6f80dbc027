//! NDSQ encode/decode time, bits per weight and error at two PQ widths, and the
//! randomized against the exact SVD. Real matrices are read from NDSQ_REAL_DIR when set
//! (raw little-endian f32 dumps, named like `real_blk_5_ffn_down_weight.f32`).

use cawsfs::codec::{
    bench_api, block_row_range, decode_block_rows, decode_global, encode_ndsq, EncodedTensor,
    NdsqOptions,
};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn normal(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Box–Muller.
            let u1: f64 = rng.random::<f64>().max(1e-300);
            let u2: f64 = rng.random();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

fn opts(rank: u32, pq_dim: u32, k: u32) -> NdsqOptions {
    NdsqOptions {
        rank,
        outlier_q: 0.999,
        pq_dim,
        pq_m: None,
        pq_k: k,
        kmeans_iters: 15,
        sq: None,
        seed: 42,
    }
}

/// Decodes a whole tensor block by block.
fn decode_all(enc: &EncodedTensor, rows: u64, cols: u64, rpb: u64) -> Vec<f32> {
    let g = decode_global(&enc.codec, &enc.global, rows, cols).unwrap();
    let mut out = vec![0f32; (rows * cols) as usize];
    for (b, payload) in enc.blocks.iter().enumerate() {
        let (s, e) = block_row_range(rows, rpb, b as u64);
        decode_block_rows(
            &enc.codec,
            &g,
            payload,
            s,
            e - s,
            cols,
            0,
            e - s,
            &mut out[(s * cols) as usize..(e * cols) as usize],
        )
        .unwrap();
    }
    out
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn bits_per_weight(enc: &EncodedTensor, n: usize) -> f64 {
    let bytes = enc.global.len() + enc.blocks.iter().map(Vec::len).sum::<usize>();
    bytes as f64 * 8.0 / n as f64
}

fn load_f32(path: &str) -> Option<Vec<f32>> {
    let b = std::fs::read(path).ok()?;
    Some(
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

pub fn bench() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut cases: Vec<(String, usize, usize, Vec<f32>)> = vec![(
        "random normal".into(),
        576,
        1536,
        normal(&mut rng, 576 * 1536),
    )];
    if let Ok(dir) = std::env::var("NDSQ_REAL_DIR") {
        for (name, r, c) in [
            ("blk_5_ffn_down_weight", 576, 1536),
            ("blk_5_ffn_up_weight", 1536, 576),
            ("blk_5_attn_q_weight", 576, 576),
            ("blk_5_attn_k_weight", 192, 576),
            ("token_embd_weight", 49152, 576),
        ] {
            if let Some(w) = load_f32(&format!("{dir}/real_{name}.f32")) {
                cases.push((name.into(), r, c, w));
            }
        }
    }
    for (name, r, c, w) in &cases {
        for pq_dim in [4u32, 2] {
            let o = opts(16, pq_dim, 256);
            let t = std::time::Instant::now();
            let enc = encode_ndsq(w, *r as u64, *c as u64, 64, &o).unwrap();
            let te = t.elapsed();
            let t = std::time::Instant::now();
            let dec = decode_all(&enc, *r as u64, *c as u64, 64);
            let td = t.elapsed();
            assert!((rel(w, &dec) - enc.rel_err).abs() < 1e-9);
            println!(
                "{name} {r}×{c} rank 16 q .999 pq_dim {pq_dim} k 256: {:.3} bpw, rel_err {:.4}, encode {:.2?}, decode {:.2?}",
                bits_per_weight(&enc, r * c),
                enc.rel_err,
                te,
                td
            );
        }
    }
    decode_throughput(&cases);
    // SVD: randomized vs exact on the largest shapes.
    for (name, r, c, w) in &cases {
        let t = std::time::Instant::now();
        bench_api::truncated_svd(w, *r, *c, 16, 1).unwrap();
        let tr = t.elapsed();
        let t = std::time::Instant::now();
        bench_api::thin_svd(w, *r, *c).unwrap();
        println!(
            "{name}: rank-16 randomized SVD {tr:.2?}, exact thin SVD {:.2?}",
            t.elapsed()
        );
    }
}

/// Decode alone, one thread, convert's default options (rank 4, pq_dim 2, k 256, outliers
/// above the .999 quantile, blocks of the archive's size): GB of F16 output (2 bytes per weight) per
/// second, median of 15 whole-tensor decodes into one reused buffer.
fn decode_throughput(cases: &[(String, usize, usize, Vec<f32>)]) {
    for (name, r, c, w) in cases {
        let (rows, cols) = (*r as u64, *c as u64);
        let mut o = opts(4, 2, 256);
        o.kmeans_iters = 12;
        // As the archive cuts blocks (`container::rows_per_block`: ~32 Ki weights).
        let rpb = (32 * 1024 / cols).clamp(1, rows);
        let enc = encode_ndsq(w, rows, cols, rpb, &o).unwrap();
        let g = decode_global(&enc.codec, &enc.global, rows, cols).unwrap();
        let mut out = vec![0f32; r * c];
        let mut secs: Vec<f64> = (0..15)
            .map(|_| {
                let t = std::time::Instant::now();
                for (b, payload) in enc.blocks.iter().enumerate() {
                    let (s, e) = block_row_range(rows, rpb, b as u64);
                    let dst = &mut out[(s * cols) as usize..(e * cols) as usize];
                    decode_block_rows(&enc.codec, &g, payload, s, e - s, cols, 0, e - s, dst)
                        .unwrap();
                }
                t.elapsed().as_secs_f64()
            })
            .collect();
        secs.sort_by(f64::total_cmp);
        let gb = (r * c * 2) as f64 / 1e9;
        println!(
            "{name} {r}×{c} default options: decode {:.2} ms, {:.2} GB of F16 output per second (one thread)",
            secs[7] * 1e3,
            gb / secs[7]
        );
    }
}
