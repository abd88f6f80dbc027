//! The numerics of the delta kind: bases (mean of a cluster of layers, k-means over
//! layers), base quantization (f16 / int8 with per-row scales), and per matrix the
//! truncated SVD of W − B̂ with the rank chosen fixed or as the smallest meeting an
//! error bound. Errors are measured on what is stored (B̂ dequantized, U and Vᵀ rounded
//! to f16), not on the SVD tail alone.

use faer::{Accum, MatMut, MatRef, Par};
use half::f16;
use rayon::prelude::*;

use serde::{Deserialize, Serialize};

use crate::codec::{le, thin_svd, CodecError};

/// How a base is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BaseDtype {
    F16,
    Int8,
}

impl BaseDtype {
    /// The byte the delta file stores (docs/FORMAT-DELTA.md: 1 = f16, 2 = int8).
    pub fn code(self) -> u8 {
        match self {
            BaseDtype::F16 => 1,
            BaseDtype::Int8 => 2,
        }
    }
    pub fn from_code(c: u8) -> Option<BaseDtype> {
        match c {
            1 => Some(BaseDtype::F16),
            2 => Some(BaseDtype::Int8),
            _ => None,
        }
    }
    /// Payload bytes of `n` rows of `cols` values (None on overflow).
    pub fn block_bytes(self, n: u64, cols: u64) -> Option<u64> {
        let vals = n.checked_mul(cols)?;
        match self {
            BaseDtype::F16 => vals.checked_mul(2),
            BaseDtype::Int8 => vals.checked_add(n.checked_mul(4)?),
        }
    }
}

/// Error thresholds whose SVD-tail rank the report lists for every matrix.
pub const TAIL_THRESHOLDS: [f64; 4] = [0.05, 0.1, 0.2, 0.3];

/// How the rank of each delta is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RankChoice {
    /// The same rank for every matrix (capped at min(rows, cols)).
    Fixed(usize),
    /// Per matrix the smallest rank whose stored reconstruction has ‖W−Ŵ‖/‖W‖ ≤ E.
    MaxRelErr(f64),
}

/// One matrix's delta, ready to store.
#[derive(Clone, Debug)]
pub struct EncodedDelta {
    pub rank: usize,
    /// Per row block: rows × rank f16 (U·√σ).
    pub u_blocks: Vec<Vec<u8>>,
    /// rank × cols f16 (√σ·Vᵀ).
    pub vt: Vec<u8>,
    /// ‖W−Ŵ‖/‖W‖ of the stored reconstruction.
    pub rel_err: f64,
    /// ‖W−B̂‖/‖W‖: the error at rank 0.
    pub base_rel_err: f64,
    /// For each of [`TAIL_THRESHOLDS`], the smallest rank whose SVD tail of W−B̂ is
    /// within it (before f16 rounding).
    pub tail_ranks: Vec<usize>,
    /// Set when --max-rel-err could not be met even at full rank.
    pub unreachable: bool,
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    le::le_bytes(&le::to_f16s(v))
}

/// Little-endian f16 bytes → f32 (`out.len()` values).
pub use crate::codec::f16s_to_f32 as f16_to_f32;

fn sq_norm(a: &[f32]) -> f64 {
    a.iter().map(|&x| x as f64 * x as f64).sum()
}

/// Cosine similarity of two equally long vectors (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        ab / (aa.sqrt() * bb.sqrt())
    }
}

fn mean_of(ws: &[&[f32]]) -> Vec<f32> {
    let n = ws.first().map_or(0, |w| w.len());
    let k = ws.len().max(1) as f64;
    (0..n)
        .into_par_iter()
        .with_min_len(4096)
        .map(|j| (ws.iter().map(|w| w[j] as f64).sum::<f64>() / k) as f32)
        .collect()
}

fn sq_dist(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            let d = x as f64 - y as f64;
            d * d
        })
        .sum()
}

/// k-means over layers (each layer's flattened matrix one point). Starts from `k`
/// evenly spaced layers (deterministic, no seed), at most `iters` Lloyd steps.
/// Returns each layer's cluster and the clusters' means; clusters left empty are
/// dropped and the rest renumbered in order of their first layer.
pub fn cluster_layers(ws: &[&[f32]], k: usize, iters: u32) -> (Vec<usize>, Vec<Vec<f32>>) {
    let n = ws.len();
    let k = k.clamp(1, n.max(1));
    if k == 1 || n <= 1 {
        return (vec![0; n], vec![mean_of(ws)]);
    }
    let mut centroids: Vec<Vec<f32>> = (0..k)
        .map(|j| ws[(j * (n - 1) + (k - 1) / 2) / (k - 1)].to_vec())
        .collect();
    let mut assign: Vec<usize> = vec![usize::MAX; n];
    for _ in 0..iters.max(1) {
        let next: Vec<usize> = ws
            .par_iter()
            .map(|w| {
                let mut best = (f64::INFINITY, 0);
                for (j, c) in centroids.iter().enumerate() {
                    let d = sq_dist(w, c);
                    if d < best.0 {
                        best = (d, j);
                    }
                }
                best.1
            })
            .collect();
        if next == assign {
            break;
        }
        assign = next;
        for (j, c) in centroids.iter_mut().enumerate() {
            let members: Vec<&[f32]> = (0..n).filter(|&i| assign[i] == j).map(|i| ws[i]).collect();
            if !members.is_empty() {
                *c = mean_of(&members);
            }
        }
    }
    // Renumber non-empty clusters by first member; recompute means of the final sets.
    let mut order: Vec<usize> = Vec::new();
    for &a in &assign {
        if !order.contains(&a) {
            order.push(a);
        }
    }
    let assign: Vec<usize> = assign
        .iter()
        .map(|a| order.iter().position(|o| o == a).expect("present"))
        .collect();
    let means = (0..order.len())
        .map(|j| {
            let members: Vec<&[f32]> = (0..n).filter(|&i| assign[i] == j).map(|i| ws[i]).collect();
            mean_of(&members)
        })
        .collect();
    (assign, means)
}

/// Quantize a base: (dequantized values B̂, one payload per row block).
pub fn encode_base(
    base: &[f32],
    rows: usize,
    cols: usize,
    rows_per_block: usize,
    dtype: BaseDtype,
) -> (Vec<f32>, Vec<Vec<u8>>) {
    let mut deq = vec![0f32; rows * cols];
    let mut blocks = Vec::with_capacity(rows.div_ceil(rows_per_block.max(1)));
    for r0 in (0..rows).step_by(rows_per_block.max(1)) {
        let r1 = (r0 + rows_per_block).min(rows);
        let src = &base[r0 * cols..r1 * cols];
        let dst = &mut deq[r0 * cols..r1 * cols];
        let payload = match dtype {
            BaseDtype::F16 => {
                let p = f16_bytes(src);
                f16_to_f32(&p, dst);
                p
            }
            BaseDtype::Int8 => {
                let n = r1 - r0;
                let mut scales = Vec::with_capacity(n * 4);
                let mut q = Vec::with_capacity(n * cols);
                for (row, out) in src.chunks_exact(cols).zip(dst.chunks_exact_mut(cols)) {
                    let amax = row.iter().fold(0f32, |m, &x| m.max(x.abs()));
                    let scale = amax / 127.0;
                    scales.extend_from_slice(&scale.to_le_bytes());
                    for (&x, o) in row.iter().zip(out) {
                        let v = if scale > 0.0 {
                            (x / scale).round().clamp(-127.0, 127.0) as i8
                        } else {
                            0
                        };
                        q.push(v as u8);
                        *o = v as f32 * scale;
                    }
                }
                scales.extend_from_slice(&q);
                scales
            }
        };
        blocks.push(payload);
    }
    (deq, blocks)
}

/// Decode one base block payload of `n` rows into `out` (n·cols values). The payload
/// size was checked at open.
pub fn decode_base_block(dtype: BaseDtype, payload: &[u8], n: usize, cols: usize, out: &mut [f32]) {
    match dtype {
        BaseDtype::F16 => f16_to_f32(payload, out),
        BaseDtype::Int8 => {
            let (scales, q) = payload.split_at(n * 4);
            for ((s, row), out) in scales
                .chunks_exact(4)
                .zip(q.chunks_exact(cols.max(1)))
                .zip(out.chunks_exact_mut(cols.max(1)))
            {
                let s = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                for (&b, o) in row.iter().zip(out) {
                    *o = b as i8 as f32 * s;
                }
            }
        }
    }
}

/// Decompose W (rows × cols, row-major) against the stored base B̂.
pub fn decompose(
    w: &[f32],
    base: &[f32],
    rows: usize,
    cols: usize,
    rows_per_block: usize,
    choice: RankChoice,
) -> Result<EncodedDelta, CodecError> {
    if w.len() != rows * cols || base.len() != rows * cols || rows_per_block == 0 {
        return Err(CodecError::Params(format!(
            "decompose: {} values and a base of {} for {rows}×{cols}, {rows_per_block} rows per block",
            w.len(),
            base.len()
        )));
    }
    if !w.iter().all(|x| x.is_finite()) {
        return Err(CodecError::Params("weights hold non-finite values".into()));
    }
    let norm_w = sq_norm(w).sqrt();
    let resid: Vec<f32> = w.iter().zip(base).map(|(a, b)| a - b).collect();
    let rel = |sq: f64| {
        if norm_w > 0.0 {
            sq.sqrt() / norm_w
        } else if sq > 0.0 {
            f64::INFINITY
        } else {
            0.0
        }
    };
    let base_rel_err = rel(sq_norm(&resid));
    let s = rows.min(cols);

    let (u, sig, v) = if s == 0 {
        (
            faer::Mat::zeros(rows, 0),
            Vec::new(),
            faer::Mat::zeros(cols, 0),
        )
    } else {
        thin_svd(MatRef::from_row_major_slice(&resid, rows, cols))?
    };
    // tail[r] = Σ_{i ≥ r} σ_i²
    let mut tail = vec![0f64; s + 1];
    for i in (0..s).rev() {
        tail[i] = tail[i + 1] + sig[i] as f64 * sig[i] as f64;
    }
    let tail_rank = |t: f64| (0..=s).find(|&r| rel(tail[r]) <= t).unwrap_or(s);
    let tail_ranks = TAIL_THRESHOLDS.iter().map(|&t| tail_rank(t)).collect();

    // U·√σ and √σ·Vᵀ rounded to f16 at full rank; a rank-r delta is their first r
    // columns / rows, so every candidate rank is evaluated on the stored values.
    let sq: Vec<f32> = sig.iter().map(|&x| x.max(0.0).sqrt()).collect();
    let round = |x: f32| f16::from_f32(x).to_f32();
    let uh = faer::Mat::<f32>::from_fn(rows, s, |i, j| round(u[(i, j)] * sq[j]));
    let vth = faer::Mat::<f32>::from_fn(s, cols, |i, j| round(sq[i] * v[(j, i)]));
    if !(0..s).all(|j| (0..rows).all(|i| uh[(i, j)].is_finite()))
        || !(0..s).all(|i| (0..cols).all(|j| vth[(i, j)].is_finite()))
    {
        return Err(CodecError::Params(
            "delta factors overflow f16 (weights too large for an f16 delta)".into(),
        ));
    }
    let err_at = |r: usize| -> f64 {
        let mut recon = base.to_vec();
        if r > 0 {
            let dst = MatMut::from_row_major_slice_mut(&mut recon, rows, cols);
            faer::linalg::matmul::matmul(
                dst,
                Accum::Add,
                uh.as_ref().subcols(0, r),
                vth.as_ref().subrows(0, r),
                1.0f32,
                Par::Seq,
            );
        }
        let d: f64 = w
            .iter()
            .zip(&recon)
            .map(|(&a, &b)| {
                let d = a as f64 - b as f64;
                d * d
            })
            .sum();
        rel(d)
    };

    let (rank, rel_err, unreachable) = choose_rank(choice, s, tail_rank, err_at);

    // The stored factors are the first `rank` columns of U·√σ and rows of √σ·Vᵀ; their
    // values are already f16, so rounding them again is exact.
    let u_blocks = (0..rows)
        .step_by(rows_per_block)
        .map(|r0| {
            let r1 = (r0 + rows_per_block).min(rows);
            let vals: Vec<f32> = (r0..r1)
                .flat_map(|i| (0..rank).map(move |j| (i, j)))
                .map(|(i, j)| uh[(i, j)])
                .collect();
            f16_bytes(&vals)
        })
        .collect();
    let vt_vals: Vec<f32> = (0..rank)
        .flat_map(|i| (0..cols).map(move |j| (i, j)))
        .map(|(i, j)| vth[(i, j)])
        .collect();
    let vt = f16_bytes(&vt_vals);
    Ok(EncodedDelta {
        rank,
        u_blocks,
        vt,
        rel_err,
        base_rel_err,
        tail_ranks,
        unreachable,
    })
}

/// (rank, its error, unreachable) for `choice`, among ranks 0..=`s`. `tail_rank(e)` is
/// the smallest rank whose SVD tail alone is within `e`; `err_at(r)` the error of the
/// stored rank-`r` reconstruction (which only falls as r grows, up to rounding).
fn choose_rank(
    choice: RankChoice,
    s: usize,
    tail_rank: impl Fn(f64) -> usize,
    err_at: impl Fn(usize) -> f64,
) -> (usize, f64, bool) {
    match choice {
        RankChoice::Fixed(r) => {
            let r = r.min(s);
            (r, err_at(r), false)
        }
        RankChoice::MaxRelErr(e) => {
            // Below the tail rank the truncation alone exceeds E; start there, step up
            // doubling until the stored reconstruction meets E, then bisect.
            let r0 = tail_rank(e);
            let e0 = err_at(r0);
            if e0 <= e {
                return (r0, e0, false);
            }
            let (mut lo, mut step) = (r0, 1usize);
            let mut hi = None;
            while lo < s {
                let cand = (lo + step).min(s);
                let ec = err_at(cand);
                if ec <= e {
                    hi = Some((cand, ec));
                    break;
                }
                lo = cand;
                step *= 2;
            }
            let Some((mut h, mut eh)) = hi else {
                return (s, err_at(s), true);
            };
            while h - lo > 1 {
                let mid = lo + (h - lo) / 2;
                let em = err_at(mid);
                if em <= e {
                    (h, eh) = (mid, em);
                } else {
                    lo = mid;
                }
            }
            (h, eh, false)
        }
    }
}
