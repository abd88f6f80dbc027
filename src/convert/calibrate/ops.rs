//! The pass's arithmetic, in f32 as transformers computes it: RMS norm, linear layers,
//! rotary embedding, causal attention with grouped keys and values, and the second
//! moments of inputs. Every product is cut into fixed pieces, each computed by one
//! thread (`Par::Seq`), so results do not depend on the thread count.

use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

/// Rows per piece of the products: fixed, so results do not depend on the thread count.
const PIECE: usize = 64;

/// RMS norm of each `width`-long row of `x`, times `g` (HF's LlamaRMSNorm, in f32).
pub(super) fn rms_norm(x: &[f32], width: usize, g: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .for_each(|(o, r)| {
            let ms = r.iter().map(|v| v * v).sum::<f32>() / width as f32;
            let s = 1.0 / (ms + eps).sqrt();
            for ((o, v), g) in o.iter_mut().zip(r).zip(g) {
                *o = v * s * g;
            }
        });
    out
}

pub(super) fn add(h: &mut [f32], y: &[f32]) {
    h.par_iter_mut()
        .zip(y.par_iter())
        .for_each(|(h, y)| *h += y);
}

/// `x · wᵀ (+ b)`: x is n × d, w is m × d (a weight as stored), the result n × m.
pub(super) fn linear(
    x: &[f32],
    n: usize,
    d: usize,
    w: &[f32],
    m: usize,
    b: Option<&[f32]>,
) -> Vec<f32> {
    let mut y = vec![0f32; n * m];
    let wt = MatRef::from_row_major_slice(w, m, d).transpose();
    y.par_chunks_mut(PIECE * m)
        .zip(x.par_chunks(PIECE * d))
        .for_each(|(yc, xc)| {
            let rows = xc.len() / d;
            faer::linalg::matmul::matmul(
                MatMut::from_row_major_slice_mut(yc, rows, m),
                Accum::Replace,
                MatRef::from_row_major_slice(xc, rows, d),
                wt,
                1.0f32,
                Par::Seq,
            );
            if let Some(b) = b {
                for row in yc.chunks_exact_mut(m) {
                    row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
                }
            }
        });
    y
}

/// `xᵀ x / n` of the n × d rows of `x` (d × d, row-major), a band of rows per piece.
pub(super) fn gram(x: &[f32], n: usize, d: usize) -> Vec<f32> {
    let mut g = vec![0f32; d * d];
    let xm = MatRef::from_row_major_slice(x, n, d);
    g.par_chunks_mut(PIECE * d).enumerate().for_each(|(i, gc)| {
        let r0 = i * PIECE;
        let rows = gc.len() / d;
        faer::linalg::matmul::matmul(
            MatMut::from_row_major_slice_mut(gc, rows, d),
            Accum::Replace,
            xm.subcols(r0, rows).transpose(),
            xm,
            1.0 / n as f32,
            Par::Seq,
        );
    });
    g
}

/// Rotary position embedding as transformers applies it (`rotate_half`: dimension i
/// pairs with i + hd/2), positions counted from each window's start.
pub(super) fn rope(x: &mut [f32], heads: usize, hd: usize, ctx: usize, theta: f32) {
    let half = hd / 2;
    let inv: Vec<f64> = (0..half)
        .map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / hd as f64))
        .collect();
    x.par_chunks_mut(heads * hd)
        .enumerate()
        .for_each(|(t, row)| {
            let pos = (t % ctx) as f64;
            for head in row.chunks_exact_mut(hd) {
                for (i, f) in inv.iter().enumerate() {
                    let (s, c) = ((pos * f) as f32).sin_cos();
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c - b * s;
                    head[i + half] = b * c + a * s;
                }
            }
        });
}

/// Causal softmax attention within each window, query heads sharing key/value heads
/// in groups (GQA). q is n × heads·hd, k and v n × kv_heads·hd; the result n × heads·hd.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    ctx: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
) -> Vec<f32> {
    let (qw, kw) = (heads * hd, kv_heads * hd);
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let qm = MatRef::from_row_major_slice(q, n, qw);
    let km = MatRef::from_row_major_slice(k, n, kw);
    let vm = MatRef::from_row_major_slice(v, n, kw);
    let jobs: Vec<(usize, usize)> = (0..n / ctx)
        .flat_map(|w| (0..heads).map(move |h| (w, h)))
        .collect();
    let parts: Vec<Vec<f32>> = jobs
        .par_iter()
        .map(|&(w, h)| {
            let (r0, kv) = (w * ctx, h / group);
            let mut s = vec![0f32; ctx * ctx];
            faer::linalg::matmul::matmul(
                MatMut::from_row_major_slice_mut(&mut s, ctx, ctx),
                Accum::Replace,
                qm.submatrix(r0, h * hd, ctx, hd),
                km.submatrix(r0, kv * hd, ctx, hd).transpose(),
                scale,
                Par::Seq,
            );
            for (i, row) in s.chunks_exact_mut(ctx).enumerate() {
                let max = row[..=i].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let mut sum = 0.0;
                for v in &mut row[..=i] {
                    *v = (*v - max).exp();
                    sum += *v;
                }
                row[..=i].iter_mut().for_each(|v| *v /= sum);
                row[i + 1..].fill(0.0);
            }
            let mut o = vec![0f32; ctx * hd];
            faer::linalg::matmul::matmul(
                MatMut::from_row_major_slice_mut(&mut o, ctx, hd),
                Accum::Replace,
                MatRef::from_row_major_slice(&s, ctx, ctx),
                vm.submatrix(r0, kv * hd, ctx, hd),
                1.0f32,
                Par::Seq,
            );
            o
        })
        .collect();
    let mut out = vec![0f32; n * qw];
    for (&(w, h), o) in jobs.iter().zip(&parts) {
        for (t, src) in o.chunks_exact(hd).enumerate() {
            out[(w * ctx + t) * qw + h * hd..][..hd].copy_from_slice(src);
        }
    }
    out
}
