//! NDSQ round trips, error bounds, determinism and corrupt input (errors, never panics).

use super::svd::{matmul, thin_svd, truncated_svd};
use crate::codec::*;
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

/// Rank-8 signal plus i.i.d. noise of standard deviation `noise`.
fn low_rank_plus_noise(rows: usize, cols: usize, noise: f32, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let a = normal(&mut rng, rows * 8);
    let b = normal(&mut rng, 8 * cols);
    let e = normal(&mut rng, rows * cols);
    let mut w = vec![0f32; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            let s: f32 = (0..8).map(|t| a[i * 8 + t] * b[t * cols + j]).sum();
            w[i * cols + j] = s / 8f32.sqrt() + noise * e[i * cols + j];
        }
    }
    w
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

#[test]
fn low_rank_plus_noise_reconstructs_below_noise() {
    let (rows, cols) = (200usize, 96usize);
    let w = low_rank_plus_noise(rows, cols, 0.05, 1);
    let enc = encode_ndsq(&w, rows as u64, cols as u64, 32, &opts(8, 4, 256)).unwrap();
    let noise_only: Vec<f32> = {
        let clean = low_rank_plus_noise(rows, cols, 0.0, 1);
        w.iter().zip(&clean).map(|(a, b)| a - b).collect()
    };
    let noise_rel = (noise_only.iter().map(|x| (*x as f64).powi(2)).sum::<f64>()
        / w.iter().map(|x| (*x as f64).powi(2)).sum::<f64>())
    .sqrt();
    let dec = decode_all(&enc, rows as u64, cols as u64, 32);
    let measured = rel(&w, &dec);
    assert!(
        (measured - enc.rel_err).abs() < 1e-9,
        "{measured} vs {}",
        enc.rel_err
    );
    assert!(
        enc.rel_err < noise_rel,
        "rel_err {} ≥ noise {noise_rel}",
        enc.rel_err
    );
    // Rank 0 (no L) on the same matrix is clearly worse.
    let no_l = encode_ndsq(&w, rows as u64, cols as u64, 32, &opts(0, 4, 256)).unwrap();
    assert!(no_l.rel_err > 2.0 * enc.rel_err);
}

#[test]
fn smaller_pq_dim_reduces_error() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (rows, cols) = (128usize, 192usize);
    let w = normal(&mut rng, rows * cols);
    let e4 = encode_ndsq(&w, rows as u64, cols as u64, 16, &opts(4, 4, 256)).unwrap();
    let e2 = encode_ndsq(&w, rows as u64, cols as u64, 16, &opts(4, 2, 256)).unwrap();
    assert!(e2.rel_err < e4.rel_err, "{} vs {}", e2.rel_err, e4.rel_err);
    assert!(e4.rel_err < 0.6 && e2.rel_err < 0.3);
}

#[test]
fn outliers_and_diagonal_are_exact() {
    let (rows, cols) = (64usize, 48usize);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut w = normal(&mut rng, rows * cols);
    w[5 * cols + 7] = 100.0;
    w[40 * cols + 1] = -80.0;
    for i in 0..cols {
        w[i * cols + i] += 3.0;
    }
    let mut o = opts(2, 4, 16);
    o.outlier_q = 0.99;
    // With rank 0 the spikes are outliers of W − L and come back exact (with a
    // rank > 0, L absorbs a lone spike as a singular vector instead).
    o.rank = 0;
    let enc = encode_ndsq(&w, rows as u64, cols as u64, 10, &o).unwrap();
    let dec = decode_all(&enc, rows as u64, cols as u64, 10);
    assert!(
        (dec[5 * cols + 7] - 100.0).abs() < 1e-4,
        "{}",
        dec[5 * cols + 7]
    );
    assert!((dec[40 * cols + 1] + 80.0).abs() < 1e-4);
    o.rank = 2;
    let enc = encode_ndsq(&w, rows as u64, cols as u64, 10, &o).unwrap();
    let dec = decode_all(&enc, rows as u64, cols as u64, 10);
    for i in 0..cols {
        let (a, b) = (w[i * cols + i], dec[i * cols + i]);
        assert!(
            (a - b).abs() <= 2e-3 * a.abs().max(1.0),
            "diag {i}: {a} vs {b}"
        );
    }
}

#[test]
fn row_ranges_match_full_decode() {
    let (rows, cols, rpb) = (77u64, 40u64, 16u64);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let w = normal(&mut rng, (rows * cols) as usize);
    let mut o = opts(3, 4, 32);
    o.outlier_q = 0.98;
    let enc = encode_ndsq(&w, rows, cols, rpb, &o).unwrap();
    let full = decode_all(&enc, rows, cols, rpb);
    let g = decode_global(&enc.codec, &enc.global, rows, cols).unwrap();
    for _ in 0..200 {
        let a = rng.random_range(0..rows);
        let b = rng.random_range(a..=rows);
        // Serve a..b by visiting only the overlapping blocks.
        let mut out = vec![0f32; ((b - a) * cols) as usize];
        let mut r = a;
        while r < b {
            let blk = r / rpb;
            let (s, e) = block_row_range(rows, rpb, blk);
            let end = e.min(b);
            let o0 = ((r - a) * cols) as usize;
            let o1 = ((end - a) * cols) as usize;
            decode_block_rows(
                &enc.codec,
                &g,
                &enc.blocks[blk as usize],
                s,
                e - s,
                cols,
                r - s,
                end - s,
                &mut out[o0..o1],
            )
            .unwrap();
            r = end;
        }
        assert_eq!(
            out,
            full[(a * cols) as usize..(b * cols) as usize],
            "rows {a}..{b}"
        );
    }
}

#[test]
fn apply_matches_decode() {
    // Blocks of 300 rows use the centroid table, blocks of 7 the direct path.
    for rpb in [300u64, 7] {
        let (rows, cols) = (600u64, 64u64);
        let w = low_rank_plus_noise(rows as usize, cols as usize, 0.3, 11);
        let enc = encode_ndsq(&w, rows, cols, rpb, &opts(8, 2, 256)).unwrap();
        let full = decode_all(&enc, rows, cols, rpb);
        let g = decode_global(&enc.codec, &enc.global, rows, cols).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let x = normal(&mut rng, cols as usize);
        for (b, payload) in enc.blocks.iter().enumerate() {
            let (s, e) = block_row_range(rows, rpb, b as u64);
            let mut y = vec![0f32; (e - s) as usize];
            apply_block(&enc.codec, &g, payload, s, e - s, cols, &x, &mut y).unwrap();
            let want: Vec<f32> = (s..e)
                .map(|i| {
                    let row = &full[(i * cols) as usize..((i + 1) * cols) as usize];
                    row.iter()
                        .zip(&x)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>() as f32
                })
                .collect();
            let r = rel(&want, &y);
            assert!(r < 1e-4, "block {b}: relative difference {r}");
        }
    }
}

#[test]
fn encoding_is_deterministic() {
    let w = low_rank_plus_noise(300, 64, 0.2, 4);
    let a = encode_ndsq(&w, 300, 64, 50, &opts(16, 4, 64)).unwrap();
    let b = encode_ndsq(&w, 300, 64, 50, &opts(16, 4, 64)).unwrap();
    assert_eq!(a.global, b.global);
    assert_eq!(a.blocks, b.blocks);
    assert_eq!(a.codec, b.codec);
    assert_eq!(a.rel_err, b.rel_err);
}

#[test]
fn randomized_svd_is_close_to_exact() {
    let w = low_rank_plus_noise(400, 120, 0.1, 8);
    let a = faer::MatRef::from_row_major_slice(&w, 400, 120);
    // r = 8 takes the randomized path (2·18 ≤ 120); compare with the exact one.
    let (u, svt) = truncated_svd(a, 8, 1).unwrap();
    let (ue, se, ve) = thin_svd(a).unwrap();
    let approx = matmul(u.as_ref(), svt.as_ref());
    let mut best = 0f64;
    let mut got = 0f64;
    for i in 0..400 {
        for j in 0..120 {
            let ex: f32 = (0..8).map(|t| ue[(i, t)] * se[t] * ve[(j, t)]).sum();
            best += ((w[i * 120 + j] - ex) as f64).powi(2);
            got += ((w[i * 120 + j] - approx[(i, j)]) as f64).powi(2);
        }
    }
    assert!(
        got.sqrt() < best.sqrt() * 1.01,
        "{} vs {}",
        got.sqrt(),
        best.sqrt()
    );
}

#[test]
fn bad_params_are_errors() {
    let w = vec![0.5f32; 10 * 12];
    let mut o = opts(2, 5, 16);
    let e = encode_ndsq(&w, 10, 12, 4, &o).err().unwrap().to_string();
    assert!(e.contains("12") && e.contains("5"), "{e}");
    o.pq_m = Some(5);
    let e = encode_ndsq(&w, 10, 12, 4, &o).err().unwrap().to_string();
    assert!(e.contains("cols = 12") && e.contains("pq_m = 5"), "{e}");
    o.pq_m = Some(3);
    let enc = encode_ndsq(&w, 10, 12, 4, &o).unwrap();
    assert!(matches!(enc.codec, TensorCodec::Ndsq { pq_dim: 4, .. }));
    assert!(encode_ndsq(&w, 10, 11, 4, &opts(2, 1, 16)).is_err());
    let mut nan = w.clone();
    nan[3] = f32::NAN;
    assert!(encode_ndsq(&nan, 10, 12, 4, &opts(2, 2, 16)).is_err());
    assert!(encode_ndsq(&w, 10, 12, 4, &opts(2, 2, 257)).is_err());
    assert!(encode_ndsq(&w, 10, 12, 0, &opts(2, 2, 16)).is_err());
    // A constant matrix: everything is rank one, any settings reconstruct it.
    let enc = encode_ndsq(&w, 10, 12, 4, &opts(2, 2, 16)).unwrap();
    assert!(enc.rel_err < 1e-3, "{}", enc.rel_err);
}

#[test]
fn huge_and_tiny_magnitudes_survive_f16() {
    for scale in [1e6f32, 1e-6] {
        let w: Vec<f32> = low_rank_plus_noise(64, 32, 0.1, 6)
            .iter()
            .map(|x| x * scale)
            .collect();
        let mut o = opts(8, 2, 64);
        o.outlier_q = 1.0;
        let enc = encode_ndsq(&w, 64, 32, 16, &o).unwrap();
        assert!(enc.rel_err < 0.1, "scale {scale}: rel_err {}", enc.rel_err);
    }
}

#[test]
fn corrupt_inputs_are_errors_not_panics() {
    let (rows, cols, rpb) = (50u64, 24u64, 20u64);
    let w = low_rank_plus_noise(rows as usize, cols as usize, 0.3, 12);
    let mut o = opts(4, 4, 32);
    o.outlier_q = 0.97;
    let enc = encode_ndsq(&w, rows, cols, rpb, &o).unwrap();
    check_corruption(&enc, (rows, cols, rpb));
    // Mismatched table parameters.
    let TensorCodec::Ndsq {
        rank,
        pq_dim,
        pq_k,
        outlier_q,
        sq,
    } = enc.codec.clone()
    else {
        unreachable!()
    };
    for c in [
        TensorCodec::Ndsq {
            rank: rank + 1,
            pq_dim,
            pq_k,
            outlier_q,
            sq,
        },
        TensorCodec::Ndsq {
            rank,
            pq_dim: 3,
            pq_k,
            outlier_q,
            sq,
        },
        TensorCodec::Ndsq {
            rank,
            pq_dim,
            pq_k: 0,
            outlier_q,
            sq,
        },
        // A PQ global read as a scalar R's.
        TensorCodec::Ndsq {
            rank,
            pq_dim: 0,
            pq_k: 0,
            outlier_q,
            sq: Some(SqParams { bits: 4, group: 4 }),
        },
    ] {
        assert!(decode_global(&c, &enc.global, rows, cols).is_err());
    }
}

/// Truncations, extensions, random mutations and garbage of a 3-block tensor's first
/// block and global: errors or changed values, never a panic; most mutations detected;
/// a global parsed for other cols is refused.
fn check_corruption(enc: &EncodedTensor, (rows, cols, rpb): (u64, u64, u64)) {
    let g = decode_global(&enc.codec, &enc.global, rows, cols).unwrap();
    let mut out = vec![0f32; (rpb * cols) as usize];
    let mut y = vec![0f32; rpb as usize];
    let x = vec![1f32; cols as usize];
    let payload = &enc.blocks[0];
    // Truncations and extensions of the payload and the global blob.
    for cut in 0..payload.len() {
        assert!(decode_block_rows(
            &enc.codec,
            &g,
            &payload[..cut],
            0,
            rpb,
            cols,
            0,
            rpb,
            &mut out
        )
        .is_err());
    }
    let mut longer = payload.clone();
    longer.push(0);
    assert!(decode_block_rows(&enc.codec, &g, &longer, 0, rpb, cols, 0, rpb, &mut out).is_err());
    for cut in 0..enc.global.len() {
        assert!(decode_global(&enc.codec, &enc.global[..cut], rows, cols).is_err());
    }
    // Random mutations: must never panic; outcomes may be Ok (a changed value).
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    let mut errs = 0;
    for _ in 0..3000 {
        let mut p = payload.clone();
        for _ in 0..rng.random_range(1..4) {
            let i = rng.random_range(0..p.len());
            p[i] = rng.random();
        }
        if rng.random_range(0..4) == 0 {
            let n = rng.random_range(0..p.len());
            p.truncate(n);
        }
        let r1 = decode_block_rows(&enc.codec, &g, &p, 0, rpb, cols, 0, rpb, &mut out);
        let r2 = apply_block(&enc.codec, &g, &p, 0, rpb, cols, &x, &mut y);
        assert_eq!(r1.is_err(), r2.is_err());
        errs += r1.is_err() as u32;
        let mut gb = enc.global.clone();
        let i = rng.random_range(0..gb.len());
        gb[i] = rng.random();
        if let Ok(g2) = decode_global(&enc.codec, &gb, rows, cols) {
            let _ = decode_block_rows(&enc.codec, &g2, payload, 0, rpb, cols, 0, rpb, &mut out);
        }
    }
    assert!(errs > 500, "only {errs} of 3000 mutations were detected");
    // Fully random garbage of plausible lengths.
    for len in [0usize, 1, 100, payload.len(), payload.len() + 7] {
        let garbage: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        let _ = decode_block_rows(&enc.codec, &g, &garbage, 0, rpb, cols, 0, rpb, &mut out);
        let _ = decode_global(&enc.codec, &garbage, rows, cols);
    }
    assert!(decode_global(&enc.codec, &enc.global, rows, cols + 4).is_err());
    // cols other than the global's.
    let mut wide = vec![0f32; (rpb * (cols + 4)) as usize];
    assert!(
        decode_block_rows(&enc.codec, &g, payload, 0, rpb, cols + 4, 0, rpb, &mut wide).is_err()
    );
    let x4 = vec![1f32; (cols + 4) as usize];
    assert!(apply_block(&enc.codec, &g, payload, 0, rpb, cols + 4, &x4, &mut y).is_err());
}

/// The constant-length centroid adds give the bits of the generic loop (the archive's
/// decoded values must not depend on which loop ran).
#[test]
fn centroid_adds_match_the_generic_loop() {
    fn check<const D: usize>(rng: &mut ChaCha8Rng)
    where
        [f32; D]: bytemuck::Pod,
    {
        let (k, m) = (256usize, 40usize);
        let codebook = normal(rng, k * D);
        let codes: Vec<u8> = (0..m).map(|_| rng.random::<u8>()).collect();
        let start: Vec<f32> = normal(rng, m * D).iter().map(|x| x * 1e-3).collect();
        let mut want = start.clone();
        for (seg, &c) in want.chunks_exact_mut(D).zip(&codes) {
            for (o, &v) in seg.iter_mut().zip(&codebook[c as usize * D..]) {
                *o += v;
            }
        }
        let mut got = start;
        super::decode::add_centroids::<D>(&mut got, &codes, &codebook);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "D = {D}");
    }
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    check::<2>(&mut rng);
    check::<4>(&mut rng);
    check::<8>(&mut rng);
}

fn sq_opts(rank: u32, outlier_q: f32, bits: u32, group: u32) -> NdsqOptions {
    NdsqOptions {
        outlier_q,
        sq: Some(SqParams { bits, group }),
        ..opts(rank, 1, 1)
    }
}

/// Rows of 4-bit groups of 32 on f16 grids, as a dequantized Q4_1 tensor holds.
fn q4_1_like(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut w = Vec::with_capacity(rows * cols);
    for _ in 0..rows * cols / 32 {
        let d = half::f16::from_f32(rng.random_range(0.001f32..0.02)).to_f32();
        let m = half::f16::from_f32(rng.random_range(-0.2f32..0.0)).to_f32();
        for t in 0..32 {
            // Every group spans all 16 levels or (one in four) only 12 of them.
            let q = match t {
                0 => 0,
                1 => 15,
                _ => rng.random_range(0..16u32),
            };
            let q = if rng.random_range(0..4) == 0 {
                q * 11 / 15
            } else {
                q
            };
            w.push(m + d * q as f32);
        }
    }
    w
}

#[test]
fn scalar_r_gives_back_grid_values_exactly() {
    let (rows, cols, rpb) = (48u64, 96u64, 20u64);
    let w = q4_1_like(rows as usize, cols as usize, 5);
    let enc = encode_ndsq(&w, rows, cols, rpb, &sq_opts(0, 1.0, 4, 32)).unwrap();
    assert_eq!(decode_all(&enc, rows, cols, rpb), w);
    assert_eq!(enc.rel_err, 0.0);
    assert!(matches!(
        enc.codec,
        TensorCodec::Ndsq {
            pq_dim: 0,
            pq_k: 0,
            sq: Some(SqParams { bits: 4, group: 32 }),
            ..
        }
    ));
    // 4-bit codes and two f16 per 32 values, plus U (none), D and S counts.
    let payload: usize = enc.blocks.iter().map(|b| b.len()).sum();
    let r_bytes = (rows * cols / 2 + rows * cols / 32 * 4) as usize;
    assert!(payload > r_bytes && payload < r_bytes + (rows * 6) as usize);
}

#[test]
fn scalar_r_with_low_rank_and_outliers() {
    let (rows, cols, rpb) = (70u64, 64u64, 16u64);
    let mut w = low_rank_plus_noise(rows as usize, cols as usize, 0.2, 8);
    // Spikes the rank-4 L does not take (a larger one becomes L's first component).
    w[5 * 64 + 9] = 6.0;
    w[33 * 64 + 33] = -5.0; // on the diagonal
    let err = |rank, q, bits| {
        let enc = encode_ndsq(&w, rows, cols, rpb, &sq_opts(rank, q, bits, 16)).unwrap();
        let back = decode_all(&enc, rows, cols, rpb);
        assert!((rel(&w, &back) - enc.rel_err).abs() < 1e-6);
        if q < 1.0 {
            // Outliers (S) exact; the diagonal (D) up to f16 rounding of its correction.
            assert!(
                (back[5 * 64 + 9] - 6.0).abs() < 1e-6,
                "rank {rank} bits {bits}"
            );
            assert!(
                (back[33 * 64 + 33] + 5.0).abs() < 1e-5,
                "rank {rank} bits {bits}"
            );
        }
        enc.rel_err
    };
    let (e3, e4, e4r, e8) = (
        err(0, 0.999, 3),
        err(0, 0.999, 4),
        err(4, 0.995, 4),
        err(0, 1.0, 8),
    );
    assert!(e4 < e3 * 0.6 && e8 < e4 / 8.0, "{e3} {e4} {e8}");
    assert!(e4r < e4, "{e4r} {e4}");
    assert!(e4 < 0.08, "{e4}");
    // Deterministic, whatever the thread count.
    let a = encode_ndsq(&w, rows, cols, rpb, &sq_opts(4, 0.995, 4, 16)).unwrap();
    let b = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(|| encode_ndsq(&w, rows, cols, rpb, &sq_opts(4, 0.995, 4, 16)).unwrap());
    assert_eq!((a.global, a.blocks), (b.global, b.blocks));
}

#[test]
fn scalar_r_apply_matches_decode_and_every_width_round_trips() {
    let (rows, cols, rpb) = (30u64, 40u64, 8u64);
    let w = low_rank_plus_noise(rows as usize, cols as usize, 0.5, 3);
    let x: Vec<f32> = (0..cols).map(|j| (j as f32 * 0.37).sin()).collect();
    for bits in 1..=8 {
        let enc = encode_ndsq(&w, rows, cols, rpb, &sq_opts(2, 0.99, bits, 8)).unwrap();
        let full = decode_all(&enc, rows, cols, rpb);
        let g = decode_global(&enc.codec, &enc.global, rows, cols).unwrap();
        for (b, payload) in enc.blocks.iter().enumerate() {
            let (s, e) = block_row_range(rows, rpb, b as u64);
            let mut y = vec![0f32; (e - s) as usize];
            apply_block(&enc.codec, &g, payload, s, e - s, cols, &x, &mut y).unwrap();
            for (i, yi) in y.iter().enumerate() {
                let r = &full[(s as usize + i) * cols as usize..][..cols as usize];
                let want: f32 = r.iter().zip(&x).map(|(a, b)| a * b).sum();
                assert!((yi - want).abs() < 1e-4 * (1.0 + want.abs()), "bits {bits}");
            }
        }
    }
}

#[test]
fn scalar_r_corrupt_inputs_are_errors_not_panics() {
    let (rows, cols, rpb) = (50u64, 24u64, 20u64);
    let w = low_rank_plus_noise(rows as usize, cols as usize, 0.3, 12);
    for bits in [3, 4] {
        let enc = encode_ndsq(&w, rows, cols, rpb, &sq_opts(2, 0.97, bits, 8)).unwrap();
        check_corruption(&enc, (rows, cols, rpb));
        let g = decode_global(&enc.codec, &enc.global, rows, cols).unwrap();
        let mut out = vec![0f32; (rpb * cols) as usize];
        // A negative or infinite scale, an infinite min (group params follow U: 2·n·r bytes).
        let params_at = (rpb * 2 * 2) as usize;
        for (off, bytes) in [
            (0usize, [0x00u8, 0xBC]),
            (0, [0x00, 0x7C]),
            (2, [0x00, 0xFC]),
        ] {
            let mut p = enc.blocks[0].clone();
            p[params_at + off..params_at + off + 2].copy_from_slice(&bytes);
            let e = decode_block_rows(&enc.codec, &g, &p, 0, rpb, cols, 0, rpb, &mut out);
            assert!(e.unwrap_err().to_string().contains("scalar R"));
        }
        let Some(sq) = (match &enc.codec {
            TensorCodec::Ndsq { sq, .. } => *sq,
            _ => None,
        }) else {
            unreachable!()
        };
        for bad in [
            TensorCodec::Ndsq {
                rank: 2,
                pq_dim: 0,
                pq_k: 0,
                outlier_q: 0.97,
                sq: Some(SqParams {
                    bits: sq.bits + 1,
                    ..sq
                }),
            },
            TensorCodec::Ndsq {
                rank: 2,
                pq_dim: 0,
                pq_k: 0,
                outlier_q: 0.97,
                sq: Some(SqParams { group: 12, ..sq }),
            },
            TensorCodec::Ndsq {
                rank: 2,
                pq_dim: 8,
                pq_k: 16,
                outlier_q: 0.97,
                sq: Some(sq),
            },
            TensorCodec::Ndsq {
                rank: 2,
                pq_dim: 8,
                pq_k: 16,
                outlier_q: 0.97,
                sq: None,
            },
        ] {
            assert!(decode_global(&bad, &enc.global, rows, cols).is_err());
        }
    }
}

#[test]
fn tables_without_sq_read_as_pq() {
    let old = r#"{"codec":"ndsq","rank":4,"pq_dim":2,"pq_k":256,"outlier_q":0.999}"#;
    let c: TensorCodec = serde_json::from_str(old).unwrap();
    assert!(matches!(c, TensorCodec::Ndsq { sq: None, .. }));
    assert_eq!(serde_json::to_string(&c).unwrap(), old);
    let new = TensorCodec::Ndsq {
        rank: 0,
        pq_dim: 0,
        pq_k: 0,
        outlier_q: 1.0,
        sq: Some(SqParams { bits: 4, group: 32 }),
    };
    let s = serde_json::to_string(&new).unwrap();
    assert!(s.contains(r#""sq":{"bits":4,"group":32}"#), "{s}");
    assert_eq!(serde_json::from_str::<TensorCodec>(&s).unwrap(), new);
}

/// Σ importance_j·(a − b)²_ij / Σ importance_j·a²_ij.
fn weighted_rel(a: &[f32], b: &[f32], imp: &[f32]) -> f64 {
    let cols = imp.len();
    let (mut num, mut den) = (0f64, 0f64);
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        let w = imp[k % cols] as f64;
        num += w * ((x - y) as f64).powi(2);
        den += w * (*x as f64).powi(2);
    }
    (num / den).sqrt()
}

#[test]
fn importance_lowers_the_weighted_error_in_every_stage_setting() {
    // Activations' mean squares span orders of magnitude across input columns, as in
    // LLMs: a few columns dominate the output error.
    let (rows, cols) = (256usize, 128usize);
    let w = low_rank_plus_noise(rows, cols, 0.3, 9);
    let imp: Vec<f32> = (0..cols)
        .map(|j| {
            if j % 16 == 3 {
                50.0
            } else {
                0.2 + (j % 7) as f32 * 0.1
            }
        })
        .collect();
    let mut sq = opts(4, 2, 256);
    sq.sq = Some(SqParams { bits: 3, group: 32 });
    // (L + S + PQ), (PQ alone), (L + S + scalar R).
    for o in [opts(8, 2, 64), opts(0, 2, 64), sq] {
        let plain = encode_ndsq(&w, rows as u64, cols as u64, 64, &o).unwrap();
        let weighted = encode_ndsq_weighted(&w, rows as u64, cols as u64, 64, &o, &imp).unwrap();
        let (p, q) = (
            decode_all(&plain, rows as u64, cols as u64, 64),
            decode_all(&weighted, rows as u64, cols as u64, 64),
        );
        let (ep, eq) = (weighted_rel(&w, &p, &imp), weighted_rel(&w, &q, &imp));
        assert!(
            eq < 0.8 * ep,
            "{:?}: weighted error {eq} with importance, {ep} without",
            o.sq
        );
        // Deterministic with weights too.
        let again = encode_ndsq_weighted(&w, rows as u64, cols as u64, 64, &o, &imp).unwrap();
        assert_eq!(
            (again.global, again.blocks),
            (weighted.global, weighted.blocks)
        );
    }
    // Equal importances are the unweighted fit, bit for bit.
    let o = opts(8, 2, 64);
    let a = encode_ndsq(&w, rows as u64, cols as u64, 64, &o).unwrap();
    let b = encode_ndsq_weighted(&w, rows as u64, cols as u64, 64, &o, &vec![3.0; cols]).unwrap();
    assert_eq!((a.global, a.blocks), (b.global, b.blocks));
    // Wrong length or a negative importance: a parameter error, not a panic.
    assert!(encode_ndsq_weighted(&w, rows as u64, cols as u64, 64, &o, &imp[1..]).is_err());
    let mut neg = imp.clone();
    neg[5] = -1.0;
    assert!(encode_ndsq_weighted(&w, rows as u64, cols as u64, 64, &o, &neg).is_err());
}

#[test]
fn median_column_scale_counts_a_typical_column_as_one() {
    // Uniform importance: weights are all 1 already.
    assert_eq!(
        crate::codec::median_column_scale(&[3.0; 8], 8).unwrap(),
        1.0
    );
    // One massive column: mean-1 weights shrink the other seven to 8/107 each; the
    // scale brings the median column back to 1.
    let mut imp = [1.0f32; 8];
    imp[5] = 100.0;
    let s = crate::codec::median_column_scale(&imp, 8).unwrap();
    assert!((s - 107.0 / 8.0).abs() < 1e-3, "{s}");
    // All zero (a column never reached by calibration): no weighting, scale 1.
    assert_eq!(
        crate::codec::median_column_scale(&[0.0; 4], 4).unwrap(),
        1.0
    );
    // Mostly zero: weights floor at 0.01 of the mean, so the scale stays bounded.
    let mut z = [0.0f32; 8];
    z[0] = 1.0;
    assert!((crate::codec::median_column_scale(&z, 8).unwrap() - 100.0).abs() < 1e-3);
    assert!(crate::codec::median_column_scale(&[1.0; 3], 4).is_err());
}
