//! NDSQ encoding in the order of docs/CODECS.md: check the parameters, L (f16-rounded
//! truncated SVD), S and D (see [`super::outliers`]), R (product quantization), then
//! serialize the global blob and the block payloads and measure the error through the
//! real decoder.

use faer::{Accum, MatMut, MatRef, Par};
use half::f16;
use half::slice::HalfFloatSliceExt;

use super::decode::{BlockView, NdsqGlobal};
use super::outliers::{self, RowOutliers};
use super::svd::truncated_svd;
use super::{idx_width, MAGIC, MAGIC_SQ};
use crate::codec::sq::{self, SqShape};
use crate::codec::{
    blocks_of, le, pq, CodecError, EncodedTensor, NdsqOptions, SqParams, TensorCodec,
};

/// The L factor as stored: U (rows × rank) and Σ·Vᵀ / scale (rank × cols), row-major f16.
struct LowRank {
    rank: usize,
    u_h: Vec<f16>,
    svt_h: Vec<f16>,
    scale: f32,
}

/// R as stored.
enum RCodes {
    Pq {
        /// Sub-vectors per row and their length.
        m: usize,
        d: usize,
        /// k × d centroids.
        codebook: Vec<f32>,
        /// rows × m codes.
        codes: Vec<u8>,
    },
    Sq {
        p: SqParams,
        shape: SqShape,
        rows: sq::SqRows,
    },
}

impl RCodes {
    /// R̂ at (i, j), as the decoder computes it.
    fn value(&self, i: usize, j: usize) -> f32 {
        match self {
            RCodes::Pq {
                m,
                d,
                codebook,
                codes,
            } => codebook[codes[i * m + j / d] as usize * d + j % d],
            RCodes::Sq { shape, rows, .. } => {
                let k = i * shape.groups() + j / shape.group;
                let cb = shape.code_bytes();
                let q = sq::code(&rows.codes[i * cb..(i + 1) * cb], shape.bits, j);
                sq::value(
                    rows.params[2 * k].to_f32(),
                    rows.params[2 * k + 1].to_f32(),
                    q,
                )
            }
        }
    }
    fn pq_k(&self) -> usize {
        match self {
            RCodes::Pq { d, codebook, .. } => codebook.len() / d,
            RCodes::Sq { .. } => 0,
        }
    }
    fn pq_dim(&self) -> usize {
        match self {
            RCodes::Pq { d, .. } => *d,
            RCodes::Sq { .. } => 0,
        }
    }
    fn sq(&self) -> Option<SqParams> {
        match self {
            RCodes::Pq { .. } => None,
            RCodes::Sq { p, .. } => Some(*p),
        }
    }
}

/// Everything the global blob and the block payloads are written from.
struct Factors {
    l: LowRank,
    r: RCodes,
    /// D correction of row i (i < min(rows, cols)).
    diag_h: Vec<f16>,
    outliers: Vec<RowOutliers>,
}

/// Column weights from per-column importances (an importance matrix's mean squared
/// activations): scaled to mean 1 and floored at [`MIN_WEIGHT`], so a column the
/// calibration text never exercised still counts a little. None when every importance
/// is zero (nothing to weight by).
pub(in crate::codec) fn column_weights(
    importance: &[f32],
    cols: usize,
) -> Result<Option<Vec<f32>>, CodecError> {
    if importance.len() != cols {
        return Err(CodecError::Params(format!(
            "{} importances for {cols} columns",
            importance.len()
        )));
    }
    if let Some(j) = importance
        .iter()
        .position(|x| !(x.is_finite() && *x >= 0.0))
    {
        return Err(CodecError::Params(format!(
            "importance {} of column {j} is not a finite non-negative number",
            importance[j]
        )));
    }
    let mean = importance.iter().map(|&x| x as f64).sum::<f64>() / cols.max(1) as f64;
    if !(mean > 0.0 && mean.is_finite()) {
        return Ok(None);
    }
    Ok(Some(
        importance
            .iter()
            .map(|&x| ((x as f64 / mean) as f32).max(MIN_WEIGHT))
            .collect(),
    ))
}

/// The smallest column weight (relative to the mean of 1).
const MIN_WEIGHT: f32 = 0.01;

pub(in crate::codec) fn encode(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    opts: &NdsqOptions,
    importance: Option<&[f32]>,
) -> Result<EncodedTensor, CodecError> {
    let (m, d) = check_params(w, rows, cols, rows_per_block, opts)?;
    let (rows_us, cols_us) = (rows as usize, cols as usize);
    let rank = (opts.rank as usize).min(rows_us).min(cols_us);
    // With an importance matrix every fit minimises Σ weight_j·(W − Ŵ)²_ij instead of
    // the plain squared error (docs/CODECS.md, "Importance").
    let cw = match importance {
        Some(imp) => column_weights(imp, cols_us)?,
        None => None,
    };
    let cw = cw.as_deref();

    // L: f16-rounded factors; everything after works against the stored L̂.
    let l = low_rank(w, rows_us, cols_us, rank, opts.seed, cw)?;
    let mut w1 = residual(w, &l, rows_us, cols_us);
    // S, then D; both are zeroed in w1, which leaves R.
    let mut outliers = outliers::split(&mut w1, cols_us, opts.outlier_q, cw);
    let diag_w1 = outliers::take_diagonal(&mut w1, rows_us, cols_us);
    // R: product quantization or scalar groups of the rest.
    let r = match opts.sq {
        None => {
            let pw = cw.map(|w| pq::ColWeights { w, m });
            let k = opts.pq_k as usize;
            let codebook = pq::train(&w1, d, k, opts.kmeans_iters, opts.seed, pw);
            let codes = pq::assign(&codebook, d, &w1, pw);
            RCodes::Pq {
                m,
                d,
                codebook,
                codes,
            }
        }
        Some(p) => {
            let shape = SqShape::new(p.bits, p.group, cols).map_err(CodecError::Params)?;
            // The entries S and D correct do not count in the fit, but their codes are
            // the nearest to their values (a value already on the grid needs no
            // correction).
            for (i, &v) in diag_w1.iter().enumerate() {
                w1[i * cols_us + i] = v;
            }
            for (i, row) in outliers.iter().enumerate() {
                for &(j, v) in row {
                    w1[i * cols_us + j as usize] = v;
                }
            }
            let weight = |i: usize, row: &mut [f32]| {
                if let Some(cw) = cw {
                    row.copy_from_slice(cw);
                }
                if i < cols_us {
                    row[i] = 0.0;
                }
                for &(j, _) in &outliers[i] {
                    row[j as usize] = 0.0;
                }
            };
            let rows = sq::quantize(&w1, shape, weight).map_err(CodecError::Params)?;
            RCodes::Sq { p, shape, rows }
        }
    };
    drop(w1);
    // Corrections against L̂ + R̂ at the outliers and on the diagonal.
    let diag_h = outliers::correct(&mut outliers, &diag_w1, |i, j| r.value(i, j));
    let f = Factors {
        l,
        r,
        diag_h,
        outliers,
    };

    let global = global_blob(&f, cols);
    let blocks = block_payloads(&f, rows, cols_us, rows_per_block);
    let codec = TensorCodec::Ndsq {
        rank: rank as u32,
        pq_dim: f.r.pq_dim() as u32,
        pq_k: f.r.pq_k() as u32,
        outlier_q: opts.outlier_q,
        sq: f.r.sq(),
    };
    let rel_err = measured_rel_err(w, &global, &blocks, (rows, cols, rows_per_block), &f)?;
    Ok(EncodedTensor {
        codec,
        global,
        blocks,
        rel_err,
    })
}

/// Checks the input and options; returns (m, d): sub-vectors per row and their length.
fn check_params(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    opts: &NdsqOptions,
) -> Result<(usize, usize), CodecError> {
    let p = |m: String| CodecError::Params(m);
    if rows_per_block == 0 {
        return Err(p("rows_per_block must be ≥ 1".into()));
    }
    if rows == 0 || cols == 0 || cols > u32::MAX as u64 {
        return Err(p(format!("shape {rows}×{cols} is not supported by NDSQ")));
    }
    if rows.checked_mul(cols) != Some(w.len() as u64) {
        return Err(p(format!("{rows}×{cols} tensor given {} values", w.len())));
    }
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        return Err(p(format!("value {} at index {i} is not finite", w[i])));
    }
    if !(0.0..=1.0).contains(&opts.outlier_q) {
        return Err(p(format!("outlier_q {} is not in [0, 1]", opts.outlier_q)));
    }
    let cols_us = cols as usize;
    if opts.sq.is_some() {
        // R's own shape checks come with its fit; PQ's fields are unused.
        return Ok((0, 0));
    }
    let (m, d) = match opts.pq_m {
        Some(m) => {
            if m == 0 || cols % m as u64 != 0 {
                return Err(p(format!("pq_m = {m} does not divide cols = {cols}")));
            }
            (m as usize, cols_us / m as usize)
        }
        None => {
            let d = opts.pq_dim;
            if d == 0 || cols % d as u64 != 0 {
                return Err(p(format!(
                    "pq_dim = {d} does not divide cols = {cols} (m would not be whole)"
                )));
            }
            (cols_us / d as usize, d as usize)
        }
    };
    if !(1..=256).contains(&opts.pq_k) {
        return Err(p(format!("pq_k = {} is not in 1..=256", opts.pq_k)));
    }
    Ok((m, d))
}

/// Power of two that brings the largest |Σ·Vᵀ| into (2^14, 2^15]: no f16 overflow or
/// needless subnormals, whatever the tensor's magnitude.
fn l_scale(max_abs: f32) -> f32 {
    if !(max_abs > 0.0 && max_abs.is_finite()) {
        return 1.0;
    }
    let e = max_abs.log2().ceil() as i32 - 15;
    2f32.powi(e.clamp(-120, 120))
}

/// The rank-`rank` L factor of W, rounded to f16 as it is stored (empty for rank 0).
/// With column weights it is the best rank-`rank` fit in the weighted norm: the SVD of
/// W·diag(√weight), whose Σ·Vᵀ is then divided by √weight column by column.
fn low_rank(
    w: &[f32],
    rows: usize,
    cols: usize,
    rank: usize,
    seed: u64,
    cw: Option<&[f32]>,
) -> Result<LowRank, CodecError> {
    if rank == 0 {
        return Ok(LowRank {
            rank,
            u_h: Vec::new(),
            svt_h: Vec::new(),
            scale: 1.0,
        });
    }
    let sw: Option<Vec<f32>> = cw.map(|w| w.iter().map(|x| x.sqrt()).collect());
    let scaled: Vec<f32>;
    let src = match &sw {
        None => w,
        Some(s) => {
            scaled = w
                .chunks_exact(cols)
                .flat_map(|row| row.iter().zip(s).map(|(x, s)| x * s))
                .collect();
            &scaled
        }
    };
    let wm = MatRef::from_row_major_slice(src, rows, cols);
    let (u, svt) = truncated_svd(wm, rank, seed)?;
    let (u, svt) = (u.as_ref(), svt.as_ref());
    // faer's matrices are column-major: gather row-major f32, then round as a slice.
    let u_rows: Vec<f32> = (0..rows)
        .flat_map(|i| (0..rank).map(move |j| u[(i, j)]))
        .collect();
    let mut svt_rows: Vec<f32> = (0..rank)
        .flat_map(|i| (0..cols).map(move |j| svt[(i, j)]))
        .collect();
    if let Some(s) = &sw {
        for row in svt_rows.chunks_exact_mut(cols) {
            row.iter_mut().zip(s).for_each(|(x, s)| *x /= s);
        }
    }
    let max_abs = svt_rows.iter().fold(0f32, |a, x| a.max(x.abs()));
    let scale = l_scale(max_abs);
    svt_rows.iter_mut().for_each(|x| *x /= scale);
    Ok(LowRank {
        rank,
        u_h: le::to_f16s(&u_rows),
        svt_h: le::to_f16s(&svt_rows),
        scale,
    })
}

/// W − L̂, with L̂ computed exactly as the decoder computes it.
fn residual(w: &[f32], l: &LowRank, rows: usize, cols: usize) -> Vec<f32> {
    if l.rank == 0 {
        // Not a zeroed buffer read then written: each page of it would fault twice,
        // the second time flushing every thread's TLB (16 % of a `--bpw` convert).
        return w.to_vec();
    }
    let mut w1 = vec![0f32; w.len()];
    {
        let u = l.u_h.to_f32_vec();
        let mut svt = l.svt_h.to_f32_vec();
        svt.iter_mut().for_each(|x| *x *= l.scale);
        faer::linalg::matmul::matmul(
            MatMut::from_row_major_slice_mut(&mut w1, rows, cols),
            Accum::Replace,
            MatRef::from_row_major_slice(&u, rows, l.rank),
            MatRef::from_row_major_slice(&svt, l.rank, cols),
            1.0f32,
            Par::Seq,
        );
    }
    w1.iter_mut().zip(w).for_each(|(l, &x)| *l = x - *l);
    w1
}

/// The global blob (docs/CODECS.md): header, Σ·Vᵀ / scale in f16, the codebook (PQ).
fn global_blob(f: &Factors, cols: u64) -> Vec<u8> {
    let mut global = Vec::with_capacity(24 + f.l.svt_h.len() * 2);
    let (magic, a, b) = match &f.r {
        RCodes::Pq { d, .. } => (MAGIC, *d as u32, f.r.pq_k() as u32),
        RCodes::Sq { p, .. } => (MAGIC_SQ, p.group, p.bits),
    };
    global.extend_from_slice(magic);
    for v in [f.l.rank as u32, cols as u32, a, b] {
        global.extend_from_slice(&v.to_le_bytes());
    }
    global.extend_from_slice(&f.l.scale.to_le_bytes());
    le::push_le(&f.l.svt_h, &mut global);
    if let RCodes::Pq { codebook, .. } = &f.r {
        le::push_le(codebook, &mut global);
    }
    global
}

/// One payload per row block: U rows, codes, diagonal, outlier counts, columns, values.
fn block_payloads(f: &Factors, rows: u64, cols: usize, rows_per_block: u64) -> Vec<Vec<u8>> {
    let rank = f.l.rank;
    let nd = f.diag_h.len();
    let wd = idx_width(cols);
    let put_idx = |buf: &mut Vec<u8>, v: usize| {
        if wd == 2 {
            buf.extend_from_slice(&(v as u16).to_le_bytes());
        } else {
            buf.extend_from_slice(&(v as u32).to_le_bytes());
        }
    };
    let mut blocks = Vec::new();
    for (first, nrows) in blocks_of(rows, rows_per_block) {
        let (a, b) = (first as usize, (first + nrows) as usize);
        let mut buf = Vec::new();
        le::push_le(&f.l.u_h[a * rank..b * rank], &mut buf);
        match &f.r {
            RCodes::Pq { m, codes, .. } => buf.extend_from_slice(&codes[a * m..b * m]),
            RCodes::Sq { shape, rows, .. } => {
                let (g2, cb) = (shape.groups() * 2, shape.code_bytes());
                le::push_le(&rows.params[a * g2..b * g2], &mut buf);
                buf.extend_from_slice(&rows.codes[a * cb..b * cb]);
            }
        }
        le::push_le(&f.diag_h[a.min(nd)..b.min(nd)], &mut buf);
        let rows_out = &f.outliers[a..b];
        for row in rows_out {
            put_idx(&mut buf, row.len());
        }
        for row in rows_out {
            row.iter().for_each(|e| put_idx(&mut buf, e.0 as usize));
        }
        for row in rows_out {
            row.iter()
                .for_each(|e| buf.extend_from_slice(&e.1.to_le_bytes()));
        }
        blocks.push(buf);
    }
    blocks
}

/// ‖W − Ŵ‖/‖W‖ with Ŵ from the real decode path.
fn measured_rel_err(
    w: &[f32],
    global: &[u8],
    blocks: &[Vec<u8>],
    (rows, cols, rows_per_block): (u64, u64, u64),
    f: &Factors,
) -> Result<f64, CodecError> {
    let cols_us = cols as usize;
    let (rank, d, k) = (f.l.rank as u32, f.r.pq_dim() as u32, f.r.pq_k() as u32);
    let g = NdsqGlobal::parse(global, rows, cols, rank, d, k, f.r.sq())?;
    let (mut num, mut den) = (0f64, 0f64);
    let mut out = Vec::new();
    for ((first, nrows), payload) in blocks_of(rows, rows_per_block).zip(blocks) {
        let view = BlockView::parse(&g, payload, first, nrows)?;
        out.resize(nrows as usize * cols_us, 0.0);
        view.decode_rows(&g, 0, nrows as usize, &mut out);
        let src = &w[first as usize * cols_us..(first + nrows) as usize * cols_us];
        for (&a, &b) in src.iter().zip(&out) {
            num += ((a - b) as f64).powi(2);
            den += (a as f64).powi(2);
        }
    }
    Ok(if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    })
}
