//! NDSQ codec: W ≈ D + L + R + S, factorized in the paper's order (seed 000 §3):
//! L = truncated SVD of W (rank r); S = entries of W − L above the |value| quantile
//! `outlier_q`; D = the diagonal of what remains; R = the rest, product-quantized
//! along rows with one k-means codebook per tensor.
//!
//! Storage (exact bytes in docs/CODECS.md): the global blob holds Σ·Vᵀ (f16, with a
//! power-of-two scale) and the PQ codebook (f32); each row block holds its rows of U
//! (f16), PQ codes (u8), its diagonal entries (f16) and its outliers (per-row counts,
//! column indices, f32 values). S and D store the correction against the *decoded*
//! L + R̂ at their positions, so those entries come back exact up to rounding and the
//! errors of earlier stages don't compound.

use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::svd::{self, ComputeSvdVectors};
use faer::{Accum, Mat, MatMut, MatRef, Par};
use half::f16;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{blocks_of, pq, CodecError, EncodedTensor, NdsqOptions, Reader, TensorCodec};

const MAGIC: &[u8; 4] = b"NDQ1";
/// Oversampling and power iterations of the randomized range finder.
const OVERSAMPLE: usize = 10;
const POWER_ITERS: usize = 2;

/// The parsed global blob.
pub(super) struct NdsqGlobal {
    rank: usize,
    cols: usize,
    d: usize,
    k: usize,
    m: usize,
    /// Σ·Vᵀ (rank × cols, row-major), scale applied.
    svt: Vec<f32>,
    /// k × d centroids.
    codebook: Vec<f32>,
}

impl NdsqGlobal {
    pub(super) fn heap_bytes(&self) -> usize {
        (self.svt.len() + self.codebook.len()) * 4
    }

    /// The caller's `cols` must be the one the global was parsed for.
    pub(super) fn check_cols(&self, cols: u64) -> Result<(), CodecError> {
        if cols != self.cols as u64 {
            return Err(CodecError::Params(format!(
                "cols {cols} differs from the {} the NDSQ global was decoded for",
                self.cols
            )));
        }
        Ok(())
    }

    pub(super) fn parse(
        bytes: &[u8],
        rows: u64,
        cols: u64,
        rank: u32,
        pq_dim: u32,
        pq_k: u32,
    ) -> Result<Self, CodecError> {
        let bad = |m: String| CodecError::Corrupt(format!("NDSQ global: {m}"));
        check_shape_params(rows, cols, rank, pq_dim, pq_k).map_err(bad)?;
        let mut r = Reader::new(bytes, "NDSQ global");
        if r.take(4)? != MAGIC {
            return Err(bad("bad magic".into()));
        }
        let fields = [r.u32()?, r.u32()?, r.u32()?, r.u32()?];
        if fields != [rank, cols as u32, pq_dim, pq_k] {
            return Err(bad(format!(
                "header (rank, cols, pq_dim, pq_k) = {fields:?}, tensor table says ({rank}, {cols}, {pq_dim}, {pq_k})"
            )));
        }
        let scale = r.f32()?;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(bad(format!("L scale {scale} is not a positive number")));
        }
        let (rank, cols, d, k) = (rank as usize, cols as usize, pq_dim as usize, pq_k as usize);
        let svt_b = r.take_n(rank.saturating_mul(cols), 2)?;
        let cb_b = r.take_n(k * d, 4)?;
        r.finish()?;
        let mut svt = vec![0f32; rank * cols];
        super::f16s_to_f32(svt_b, &mut svt);
        svt.iter_mut().for_each(|x| *x *= scale);
        let mut codebook = vec![0f32; k * d];
        super::f32s_from_le(cb_b, &mut codebook);
        Ok(NdsqGlobal {
            rank,
            cols,
            d,
            k,
            m: cols / d,
            svt,
            codebook,
        })
    }
}

/// Shape/parameter consistency shared by encode and parse (rank is the effective one).
fn check_shape_params(
    rows: u64,
    cols: u64,
    rank: u32,
    pq_dim: u32,
    pq_k: u32,
) -> Result<(), String> {
    if rows == 0 || cols == 0 || cols > u32::MAX as u64 {
        return Err(format!("shape {rows}×{cols} is not supported"));
    }
    if rank as u64 > rows.min(cols) {
        return Err(format!("rank {rank} exceeds min(rows {rows}, cols {cols})"));
    }
    if pq_dim == 0 || cols % pq_dim as u64 != 0 {
        return Err(format!("pq_dim {pq_dim} does not divide cols {cols}"));
    }
    if !(1..=256).contains(&pq_k) {
        return Err(format!("pq_k {pq_k} is not in 1..=256"));
    }
    Ok(())
}

/// Width in bytes of outlier counts and column indices.
fn idx_width(cols: usize) -> usize {
    if cols <= u16::MAX as usize {
        2
    } else {
        4
    }
}

fn read_idx(b: &[u8], i: usize, w: usize) -> usize {
    if w == 2 {
        u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as usize
    } else {
        u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]) as usize
    }
}

/// Rows of a block starting at `first` that hold a diagonal entry (row index < cols).
fn diag_rows(first: u64, n: usize, cols: usize) -> usize {
    if first >= cols as u64 {
        0
    } else {
        n.min(cols - first as usize)
    }
}

/// A validated view of one block payload.
pub(super) struct BlockView<'a> {
    n: usize,
    first: usize,
    u: &'a [u8],
    codes: &'a [u8],
    diag: &'a [u8],
    nd: usize,
    w: usize,
    s_cols: &'a [u8],
    s_vals: &'a [u8],
    /// Outlier entry range of row i: start[i]..start[i+1].
    start: Vec<usize>,
}

impl<'a> BlockView<'a> {
    pub(super) fn parse(
        g: &NdsqGlobal,
        payload: &'a [u8],
        first_row: u64,
        block_rows: u64,
    ) -> Result<Self, CodecError> {
        let bad = |m: String| CodecError::Corrupt(format!("NDSQ block at row {first_row}: {m}"));
        let n = usize::try_from(block_rows)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| CodecError::Params(format!("block of {block_rows} rows")))?;
        let first = usize::try_from(first_row)
            .map_err(|_| CodecError::Params(format!("first row {first_row} too large")))?;
        let w = idx_width(g.cols);
        let mut r = Reader::new(payload, "NDSQ block");
        let u = r.take_n(n, g.rank * 2)?;
        let codes = r.take_n(n, g.m)?;
        if let Some(&c) = codes.iter().find(|&&c| c as usize >= g.k) {
            return Err(bad(format!("PQ code {c} ≥ k = {}", g.k)));
        }
        let nd = diag_rows(first_row, n, g.cols);
        let diag = r.take_n(nd, 2)?;
        let counts = r.take_n(n, w)?;
        let mut start = Vec::with_capacity(n + 1);
        start.push(0usize);
        let mut total = 0usize;
        for i in 0..n {
            let c = read_idx(counts, i, w);
            if c > g.cols {
                return Err(bad(format!("row {i} has {c} outliers, cols is {}", g.cols)));
            }
            total += c; // ≤ n × cols, and n × m bytes were present: no overflow
            start.push(total);
        }
        let s_cols = r.take_n(total, w)?;
        let s_vals = r.take_n(total, 4)?;
        r.finish()?;
        for i in 0..n {
            let mut prev: Option<usize> = None;
            for e in start[i]..start[i + 1] {
                let c = read_idx(s_cols, e, w);
                if c >= g.cols || prev.is_some_and(|p| c <= p) {
                    return Err(bad(format!(
                        "row {i}: outlier column {c} out of range or out of order"
                    )));
                }
                prev = Some(c);
            }
        }
        Ok(BlockView {
            n,
            first,
            u,
            codes,
            diag,
            nd,
            w,
            s_cols,
            s_vals,
            start,
        })
    }

    fn s_val(&self, e: usize) -> f32 {
        let b = &self.s_vals[4 * e..4 * e + 4];
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    fn diag_val(&self, i: usize) -> f32 {
        f16::from_le_bytes([self.diag[2 * i], self.diag[2 * i + 1]]).to_f32()
    }

    /// Rows `r0..r1` of the block into `out` ((r1-r0) × cols), already range-checked.
    pub(super) fn decode_rows(&self, g: &NdsqGlobal, r0: usize, r1: usize, out: &mut [f32]) {
        let (cols, d, m) = (g.cols, g.d, g.m);
        let nr = r1 - r0;
        if nr == 0 {
            return;
        }
        debug_assert!(r1 <= self.n && out.len() == nr * cols);
        if g.rank > 0 {
            let mut u = vec![0f32; nr * g.rank];
            super::f16s_to_f32(&self.u[r0 * g.rank * 2..r1 * g.rank * 2], &mut u);
            let um = MatRef::from_row_major_slice(&u, nr, g.rank);
            let svt = MatRef::from_row_major_slice(&g.svt, g.rank, cols);
            let dst = MatMut::from_row_major_slice_mut(out, nr, cols);
            faer::linalg::matmul::matmul(dst, Accum::Replace, um, svt, 1.0f32, Par::Seq);
        } else {
            out.fill(0.0);
        }
        for (li, row) in out.chunks_exact_mut(cols).enumerate() {
            let i = r0 + li;
            let codes = &self.codes[i * m..(i + 1) * m];
            for (seg, &c) in row.chunks_exact_mut(d).zip(codes) {
                let cent = &g.codebook[c as usize * d..(c as usize + 1) * d];
                for (o, &v) in seg.iter_mut().zip(cent) {
                    *o += v;
                }
            }
            if i < self.nd {
                row[self.first + i] += self.diag_val(i);
            }
            for e in self.start[i]..self.start[i + 1] {
                row[read_idx(self.s_cols, e, self.w)] += self.s_val(e);
            }
        }
    }

    /// y = Ŵ_block · x.
    pub(super) fn apply(&self, g: &NdsqGlobal, x: &[f32], y: &mut [f32]) {
        let (cols, d, m, k) = (g.cols, g.d, g.m, g.k);
        // t = Σ·Vᵀ·x once, then y_i = U_i · t.
        let t: Vec<f32> = g
            .svt
            .chunks_exact(cols.max(1))
            .take(g.rank)
            .map(|row| dot(row, x))
            .collect();
        // With many rows a table of centroid·x-slice products beats direct dots.
        let table: Option<Vec<f32>> = (self.n >= k).then(|| {
            let mut tab = vec![0f32; m * k];
            for (j, xs) in x.chunks_exact(d).enumerate() {
                for (c, cent) in g.codebook.chunks_exact(d).enumerate() {
                    tab[j * k + c] = dot(cent, xs);
                }
            }
            tab
        });
        for (i, yi) in y.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (r, &tr) in t.iter().enumerate() {
                let o = (i * g.rank + r) * 2;
                acc += f16::from_le_bytes([self.u[o], self.u[o + 1]]).to_f32() * tr;
            }
            let codes = &self.codes[i * m..(i + 1) * m];
            match &table {
                Some(tab) => {
                    for (j, &c) in codes.iter().enumerate() {
                        acc += tab[j * k + c as usize];
                    }
                }
                None => {
                    for (xs, &c) in x.chunks_exact(d).zip(codes) {
                        acc += dot(&g.codebook[c as usize * d..(c as usize + 1) * d], xs);
                    }
                }
            }
            if i < self.nd {
                acc += self.diag_val(i) * x[self.first + i];
            }
            for e in self.start[i]..self.start[i + 1] {
                acc += self.s_val(e) * x[read_idx(self.s_cols, e, self.w)];
            }
            *yi = acc;
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Thin SVD with sequential faer (deterministic): (U m×s, σ (descending), V n×s).
/// U, σ, V of a thin SVD.
type Svd3 = (Mat<f32>, Vec<f32>, Mat<f32>);

pub(crate) fn thin_svd(a: MatRef<'_, f32>) -> Result<Svd3, CodecError> {
    let (m, n) = a.shape();
    let s = m.min(n);
    let mut u = Mat::<f32>::zeros(m, s);
    let mut v = Mat::<f32>::zeros(n, s);
    let mut sig = Diag::<f32>::zeros(s);
    let req = svd::svd_scratch::<f32>(
        m,
        n,
        ComputeSvdVectors::Thin,
        ComputeSvdVectors::Thin,
        Par::Seq,
        Default::default(),
    );
    let mut mem = MemBuffer::new(req);
    svd::svd(
        a,
        sig.as_mut(),
        Some(u.as_mut()),
        Some(v.as_mut()),
        Par::Seq,
        MemStack::new(&mut mem),
        Default::default(),
    )
    .map_err(|e| CodecError::Params(format!("SVD of a {m}×{n} matrix failed: {e:?}")))?;
    let sig: Vec<f32> = (0..s).map(|i| sig[i]).collect();
    Ok((u, sig, v))
}

fn matmul(a: MatRef<'_, f32>, b: MatRef<'_, f32>) -> Mat<f32> {
    let mut c = Mat::<f32>::zeros(a.nrows(), b.ncols());
    faer::linalg::matmul::matmul(c.as_mut(), Accum::Replace, a, b, 1.0f32, Par::Seq);
    c
}

/// An orthonormal basis of the columns of `y` (via its thin SVD).
fn orth(y: MatRef<'_, f32>) -> Result<Mat<f32>, CodecError> {
    Ok(thin_svd(y)?.0)
}

/// Rank-`r` truncated SVD of `a`: (U m×r, Σ·Vᵀ r×n). Randomized range finder
/// (Halko et al., with power iterations) when r is small against the matrix, exact
/// thin SVD otherwise.
pub(super) fn truncated_svd(
    a: MatRef<'_, f32>,
    r: usize,
    seed: u64,
) -> Result<(Mat<f32>, Mat<f32>), CodecError> {
    let (m, n) = a.shape();
    let l = r + OVERSAMPLE.max(r / 2);
    let (u, sig, v) = if 2 * l <= m.min(n) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5356_445f_5241_4e44);
        let omega = Mat::<f32>::from_fn(n, l, |_, _| rng.random_range(-1.0f32..1.0));
        let mut y = matmul(a, omega.as_ref());
        for _ in 0..POWER_ITERS {
            let q = orth(y.as_ref())?;
            let z = orth(matmul(a.transpose(), q.as_ref()).as_ref())?;
            y = matmul(a, z.as_ref());
        }
        let q = orth(y.as_ref())?;
        let b = matmul(q.transpose(), a); // l × n
        let (ub, sig, vb) = thin_svd(b.as_ref())?;
        (matmul(q.as_ref(), ub.as_ref()), sig, vb)
    } else {
        thin_svd(a)?
    };
    let uf = Mat::<f32>::from_fn(m, r, |i, j| u[(i, j)]);
    let svt = Mat::<f32>::from_fn(r, n, |i, j| sig[i] * v[(j, i)]);
    Ok((uf, svt))
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

pub(super) fn encode(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    opts: &NdsqOptions,
) -> Result<EncodedTensor, CodecError> {
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
    let (rows_us, cols_us) = (rows as usize, cols as usize);
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
    let rank = (opts.rank as usize).min(rows_us).min(cols_us);

    // L: f16-rounded factors; everything after works against the stored L.
    let wm = MatRef::from_row_major_slice(w, rows_us, cols_us);
    let (u_h, svt_h, scale) = if rank > 0 {
        let (u, svt) = truncated_svd(wm, rank, opts.seed)?;
        let max_abs = (0..rank)
            .flat_map(|i| (0..cols_us).map(move |j| (i, j)))
            .fold(0f32, |a, (i, j)| a.max(svt[(i, j)].abs()));
        let scale = l_scale(max_abs);
        let u_h: Vec<f16> = (0..rows_us)
            .flat_map(|i| (0..rank).map(move |j| (i, j)))
            .map(|(i, j)| f16::from_f32(u[(i, j)]))
            .collect();
        let svt_h: Vec<f16> = (0..rank)
            .flat_map(|i| (0..cols_us).map(move |j| (i, j)))
            .map(|(i, j)| f16::from_f32(svt[(i, j)] / scale))
            .collect();
        (u_h, svt_h, scale)
    } else {
        (Vec::new(), Vec::new(), 1.0)
    };
    // w1 = W − L̂, computed exactly as decode computes L̂.
    let mut w1 = vec![0f32; w.len()];
    if rank > 0 {
        let u: Vec<f32> = u_h.iter().map(|x| x.to_f32()).collect();
        let svt: Vec<f32> = svt_h.iter().map(|x| x.to_f32() * scale).collect();
        faer::linalg::matmul::matmul(
            MatMut::from_row_major_slice_mut(&mut w1, rows_us, cols_us),
            Accum::Replace,
            MatRef::from_row_major_slice(&u, rows_us, rank),
            MatRef::from_row_major_slice(&svt, rank, cols_us),
            1.0f32,
            Par::Seq,
        );
    }
    w1.iter_mut().zip(w).for_each(|(l, &x)| *l = x - *l);

    // S: entries of W − L̂ with |value| above the outlier_q quantile, per row, sorted.
    let n = w.len();
    let n_out = (((1.0 - opts.outlier_q as f64) * n as f64).floor() as usize).min(n);
    let mut outliers: Vec<Vec<(u32, f32)>> = vec![Vec::new(); rows_us];
    if n_out > 0 {
        let is_out: Box<dyn Fn(f32) -> bool> = if n_out >= n {
            Box::new(|_| true)
        } else {
            let mut abs: Vec<f32> = w1.iter().map(|x| x.abs()).collect();
            let (_, t, _) = abs.select_nth_unstable_by(n - n_out - 1, f32::total_cmp);
            let t = *t;
            Box::new(move |v: f32| v.abs() > t)
        };
        for (i, row) in w1.chunks_exact_mut(cols_us).enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                if is_out(*v) {
                    outliers[i].push((j as u32, *v));
                    *v = 0.0;
                }
            }
        }
    }
    // D: the diagonal of the rest (kept aside; R has zeros there).
    let nd = rows_us.min(cols_us);
    let mut diag_w1 = vec![0f32; nd];
    for (i, dv) in diag_w1.iter_mut().enumerate() {
        *dv = std::mem::take(&mut w1[i * cols_us + i]);
    }
    // R: product quantization of the rest.
    let codebook = pq::train(&w1, d, opts.pq_k as usize, opts.kmeans_iters, opts.seed);
    let k = codebook.len() / d;
    let codes = pq::assign(&codebook, d, &w1);
    // Corrections against L̂ + R̂: S = (W − L̂) − R̂ at outliers, D likewise on the
    // diagonal (an outlier on the diagonal is fixed by S alone).
    let rhat = |i: usize, j: usize| codebook[codes[i * m + j / d] as usize * d + j % d];
    for (i, row) in outliers.iter_mut().enumerate() {
        for (j, v) in row.iter_mut() {
            *v -= rhat(i, *j as usize);
        }
    }
    let mut diag_h = vec![f16::ZERO; nd];
    for i in 0..nd {
        if outliers[i]
            .binary_search_by_key(&(i as u32), |e| e.0)
            .is_ok()
        {
            continue;
        }
        let corr = diag_w1[i] - rhat(i, i);
        let h = f16::from_f32(corr);
        if h.is_finite() {
            diag_h[i] = h;
        } else {
            // Too large for f16: store it as an outlier instead.
            let pos = outliers[i].partition_point(|e| e.0 < i as u32);
            outliers[i].insert(pos, (i as u32, corr));
        }
    }
    drop(w1);

    // Global blob.
    let mut global = Vec::with_capacity(24 + svt_h.len() * 2 + codebook.len() * 4);
    global.extend_from_slice(MAGIC);
    for f in [rank as u32, cols as u32, d as u32, k as u32] {
        global.extend_from_slice(&f.to_le_bytes());
    }
    global.extend_from_slice(&scale.to_le_bytes());
    svt_h
        .iter()
        .for_each(|x| global.extend_from_slice(&x.to_le_bytes()));
    codebook
        .iter()
        .for_each(|x| global.extend_from_slice(&x.to_le_bytes()));

    // Block payloads.
    let wd = idx_width(cols_us);
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
        u_h[a * rank..b * rank]
            .iter()
            .for_each(|x| buf.extend_from_slice(&x.to_le_bytes()));
        buf.extend_from_slice(&codes[a * m..b * m]);
        for dh in &diag_h[a.min(nd)..b.min(nd)] {
            buf.extend_from_slice(&dh.to_le_bytes());
        }
        for row in &outliers[a..b] {
            put_idx(&mut buf, row.len());
        }
        for row in &outliers[a..b] {
            row.iter().for_each(|e| put_idx(&mut buf, e.0 as usize));
        }
        for row in &outliers[a..b] {
            row.iter()
                .for_each(|e| buf.extend_from_slice(&e.1.to_le_bytes()));
        }
        blocks.push(buf);
    }

    let codec = TensorCodec::Ndsq {
        rank: rank as u32,
        pq_dim: d as u32,
        pq_k: k as u32,
        outlier_q: opts.outlier_q,
    };
    // rel_err from the real decode path.
    let g = NdsqGlobal::parse(&global, rows, cols, rank as u32, d as u32, k as u32)?;
    let (mut num, mut den) = (0f64, 0f64);
    let mut out = Vec::new();
    for ((first, nrows), payload) in blocks_of(rows, rows_per_block).zip(&blocks) {
        let view = BlockView::parse(&g, payload, first, nrows)?;
        out.resize(nrows as usize * cols_us, 0.0);
        view.decode_rows(&g, 0, nrows as usize, &mut out);
        let src = &w[first as usize * cols_us..(first + nrows) as usize * cols_us];
        for (&a, &b) in src.iter().zip(&out) {
            num += ((a - b) as f64).powi(2);
            den += (a as f64).powi(2);
        }
    }
    let rel_err = if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    Ok(EncodedTensor {
        codec,
        global,
        blocks,
        rel_err,
    })
}

#[cfg(test)]
mod tests {
    use super::super::*;
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
        let (u, svt) = super::truncated_svd(a, 8, 1).unwrap();
        let (ue, se, ve) = super::thin_svd(a).unwrap();
        let approx = super::matmul(u.as_ref(), svt.as_ref());
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
        assert!(
            decode_block_rows(&enc.codec, &g, &longer, 0, rpb, cols, 0, rpb, &mut out).is_err()
        );
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
        // Mismatched table parameters.
        let TensorCodec::Ndsq {
            rank,
            pq_dim,
            pq_k,
            outlier_q,
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
            },
            TensorCodec::Ndsq {
                rank,
                pq_dim: 3,
                pq_k,
                outlier_q,
            },
            TensorCodec::Ndsq {
                rank,
                pq_dim,
                pq_k: 0,
                outlier_q,
            },
        ] {
            assert!(decode_global(&c, &enc.global, rows, cols).is_err());
        }
        assert!(decode_global(&enc.codec, &enc.global, rows, cols + 4).is_err());
        // cols other than the global's.
        let mut wide = vec![0f32; (rpb * (cols + 4)) as usize];
        assert!(
            decode_block_rows(&enc.codec, &g, payload, 0, rpb, cols + 4, 0, rpb, &mut wide)
                .is_err()
        );
        let x4 = vec![1f32; (cols + 4) as usize];
        assert!(apply_block(&enc.codec, &g, payload, 0, rpb, cols + 4, &x4, &mut y).is_err());
    }
}
