//! NDSQ decoding: the global blob parsed once per tensor ([`NdsqGlobal`]), each block
//! payload validated whole before any row is read ([`BlockView`]), then rows decoded
//! (`U·Σ·Vᵀ + R̂ + D + S`) or multiplied by a vector without forming them.

use half::f16;

use super::{check_shape_params, diag_rows, idx_width, read_idx, MAGIC, MAGIC_SQ};
use crate::codec::sq::{self, SqShape};
use crate::codec::{le, CodecError, Reader, SqParams};

/// The parsed global blob.
pub(in crate::codec) struct NdsqGlobal {
    rank: usize,
    cols: usize,
    d: usize,
    k: usize,
    m: usize,
    /// Σ·Vᵀ (rank × cols, row-major), scale applied.
    svt: Vec<f32>,
    /// k × d centroids (empty when R is scalar).
    codebook: Vec<f32>,
    /// R as scalar groups instead of PQ (then d, k, m are 0).
    sq: Option<SqShape>,
}

impl NdsqGlobal {
    pub(in crate::codec) fn heap_bytes(&self) -> usize {
        (self.svt.len() + self.codebook.len()) * 4
    }

    /// The caller's `cols` must be the one the global was parsed for.
    pub(in crate::codec) fn check_cols(&self, cols: u64) -> Result<(), CodecError> {
        if cols != self.cols as u64 {
            return Err(CodecError::Params(format!(
                "cols {cols} differs from the {} the NDSQ global was decoded for",
                self.cols
            )));
        }
        Ok(())
    }

    pub(in crate::codec) fn parse(
        bytes: &[u8],
        rows: u64,
        cols: u64,
        rank: u32,
        pq_dim: u32,
        pq_k: u32,
        sq: Option<SqParams>,
    ) -> Result<Self, CodecError> {
        let bad = |m: String| CodecError::Corrupt(format!("NDSQ global: {m}"));
        if let Some(p) = sq {
            return Self::parse_sq(bytes, rows, cols, rank, (pq_dim, pq_k), p);
        }
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
        let (rank, cols, d, k) = (rank as usize, cols as usize, pq_dim as usize, pq_k as usize);
        let svt = read_svt(&mut r, rank, cols)?;
        let cb_b = r.take_n(k * d, 4)?;
        r.finish()?;
        let mut codebook = vec![0f32; k * d];
        le::f32s_from_le(cb_b, &mut codebook);
        Ok(NdsqGlobal {
            rank,
            cols,
            d,
            k,
            m: cols / d,
            svt,
            codebook,
            sq: None,
        })
    }

    /// The global of an NDSQ tensor whose R is scalar groups (magic `NDQ2`).
    fn parse_sq(
        bytes: &[u8],
        rows: u64,
        cols: u64,
        rank: u32,
        (pq_dim, pq_k): (u32, u32),
        p: SqParams,
    ) -> Result<Self, CodecError> {
        let bad = |m: String| CodecError::Corrupt(format!("NDSQ global: {m}"));
        // The shape checks of PQ with a group for the sub-vector and one level.
        check_shape_params(rows, cols, rank, p.group, 1).map_err(bad)?;
        let shape = SqShape::new(p.bits, p.group, cols).map_err(bad)?;
        if (pq_dim, pq_k) != (0, 0) {
            return Err(bad(format!(
                "pq_dim {pq_dim} and pq_k {pq_k} must be 0 when R is scalar"
            )));
        }
        let mut r = Reader::new(bytes, "NDSQ global");
        if r.take(4)? != MAGIC_SQ {
            return Err(bad("bad magic".into()));
        }
        let fields = [r.u32()?, r.u32()?, r.u32()?, r.u32()?];
        if fields != [rank, cols as u32, p.group, p.bits] {
            return Err(bad(format!(
                "header (rank, cols, group, bits) = {fields:?}, tensor table says ({rank}, {cols}, {}, {})",
                p.group, p.bits
            )));
        }
        let (rank, cols) = (rank as usize, cols as usize);
        let svt = read_svt(&mut r, rank, cols)?;
        r.finish()?;
        Ok(NdsqGlobal {
            rank,
            cols,
            d: 0,
            k: 0,
            m: 0,
            svt,
            codebook: Vec::new(),
            sq: Some(shape),
        })
    }
}

/// The L part of a global after its header: the f32 scale, then Σ·Vᵀ / scale in f16;
/// returns Σ·Vᵀ with the scale applied.
fn read_svt(r: &mut Reader<'_>, rank: usize, cols: usize) -> Result<Vec<f32>, CodecError> {
    let scale = r.f32()?;
    if !(scale.is_finite() && scale > 0.0) {
        return Err(CodecError::Corrupt(format!(
            "NDSQ global: L scale {scale} is not a positive number"
        )));
    }
    let svt_b = r.take_n(rank.saturating_mul(cols), 2)?;
    let mut svt = vec![0f32; rank * cols];
    le::f16s_to_f32(svt_b, &mut svt);
    svt.iter_mut().for_each(|x| *x *= scale);
    Ok(svt)
}

/// A validated view of one block payload.
pub(in crate::codec) struct BlockView<'a> {
    n: usize,
    first: usize,
    u: &'a [u8],
    /// PQ codes (n × m), or scalar R's packed codes (n × code_bytes).
    codes: &'a [u8],
    /// Scalar R's [scale, min] f16 pairs (n × groups × 4 bytes); empty for PQ.
    params: &'a [u8],
    diag: &'a [u8],
    nd: usize,
    w: usize,
    s_cols: &'a [u8],
    s_vals: &'a [u8],
    /// Outlier entry range of row i: start[i]..start[i+1].
    start: Vec<usize>,
}

impl<'a> BlockView<'a> {
    pub(in crate::codec) fn parse(
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
        let (params, codes) = match g.sq {
            None => {
                let codes = r.take_n(n, g.m)?;
                if let Some(&c) = codes.iter().find(|&&c| c as usize >= g.k) {
                    return Err(bad(format!("PQ code {c} ≥ k = {}", g.k)));
                }
                (&[][..], codes)
            }
            Some(s) => {
                let params = r.take_n(n, s.groups() * 4)?;
                for (e, b) in params.chunks_exact(2).enumerate() {
                    let v = f16::from_le_bytes([b[0], b[1]]);
                    // Even entries are scales (≥ 0), odd ones minimums.
                    if !v.is_finite() || (e % 2 == 0 && v.is_sign_negative() && v != f16::ZERO) {
                        return Err(bad(format!(
                            "scalar R {} {v} of row {} group {} is not allowed",
                            if e % 2 == 0 { "scale" } else { "min" },
                            e / 2 / s.groups(),
                            e / 2 % s.groups()
                        )));
                    }
                }
                (params, r.take_n(n, s.code_bytes())?)
            }
        };
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
            params,
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
    pub(in crate::codec) fn decode_rows(
        &self,
        g: &NdsqGlobal,
        r0: usize,
        r1: usize,
        out: &mut [f32],
    ) {
        let (cols, d, m) = (g.cols, g.d, g.m);
        let nr = r1 - r0;
        if nr == 0 {
            return;
        }
        debug_assert!(r1 <= self.n && out.len() == nr * cols);
        // U·(ΣVᵀ) as rank axpys per row (in the fixed order of `add_low_rank`, which a
        // GPU reproduces bit for bit): the rank is small (a handful to a few dozen),
        // where a plain loop vectorizes as well as a GEMM and, unlike faer's, keeps no
        // per-thread packing buffer (tens of MiB of virtual memory per decoding thread,
        // partly resident for the thread's life).
        out.fill(0.0);
        if g.rank > 0 {
            let mut u = vec![0f32; nr * g.rank];
            le::f16s_to_f32(&self.u[r0 * g.rank * 2..r1 * g.rank * 2], &mut u);
            crate::codec::add_low_rank(out, &u, &g.svt, g.rank, cols);
        }
        for (li, row) in out.chunks_exact_mut(cols).enumerate() {
            let i = r0 + li;
            if let Some(s) = g.sq {
                let gb = s.groups() * 4;
                let cb = s.code_bytes();
                let params = &self.params[i * gb..(i + 1) * gb];
                sq::add_row(row, params, &self.codes[i * cb..(i + 1) * cb], s);
                self.add_sparse(i, row);
                continue;
            }
            let codes = &self.codes[i * m..(i + 1) * m];
            // The common sub-vector lengths get their own loop: with `d` a constant the
            // centroid adds compile to vector ops instead of a scalar loop per code
            // (which was most of a decode). Same adds in the same order: same bits.
            match d {
                2 => add_centroids::<2>(row, codes, &g.codebook),
                4 => add_centroids::<4>(row, codes, &g.codebook),
                8 => add_centroids::<8>(row, codes, &g.codebook),
                _ => {
                    for (seg, &c) in row.chunks_exact_mut(d).zip(codes) {
                        let cent = &g.codebook[c as usize * d..(c as usize + 1) * d];
                        for (o, &v) in seg.iter_mut().zip(cent) {
                            *o += v;
                        }
                    }
                }
            }
            self.add_sparse(i, row);
        }
    }

    /// D, then S, of block row `i`.
    fn add_sparse(&self, i: usize, row: &mut [f32]) {
        if i < self.nd {
            row[self.first + i] += self.diag_val(i);
        }
        for e in self.start[i]..self.start[i + 1] {
            row[read_idx(self.s_cols, e, self.w)] += self.s_val(e);
        }
    }

    /// y = Ŵ_block · x.
    pub(in crate::codec) fn apply(&self, g: &NdsqGlobal, x: &[f32], y: &mut [f32]) {
        let (cols, d, m, k) = (g.cols, g.d, g.m, g.k);
        // t = Σ·Vᵀ·x once, then y_i = U_i · t.
        let t: Vec<f32> = g
            .svt
            .chunks_exact(cols.max(1))
            .take(g.rank)
            .map(|row| dot(row, x))
            .collect();
        // With many rows a table of centroid·x-slice products beats direct dots.
        let table: Option<Vec<f32>> = (g.sq.is_none() && self.n >= k).then(|| {
            let mut tab = vec![0f32; m * k];
            for (j, xs) in x.chunks_exact(d).enumerate() {
                for (c, cent) in g.codebook.chunks_exact(d).enumerate() {
                    tab[j * k + c] = dot(cent, xs);
                }
            }
            tab
        });
        let mut u = vec![0f32; g.rank];
        let mut rhat = vec![0f32; if g.sq.is_some() { cols } else { 0 }];
        for (i, yi) in y.iter_mut().enumerate() {
            le::f16s_to_f32(&self.u[i * g.rank * 2..(i + 1) * g.rank * 2], &mut u);
            let mut acc = 0f32;
            for (&ur, &tr) in u.iter().zip(&t) {
                acc += ur * tr;
            }
            if let Some(s) = g.sq {
                let (gb, cb) = (s.groups() * 4, s.code_bytes());
                rhat.fill(0.0);
                let params = &self.params[i * gb..(i + 1) * gb];
                sq::add_row(&mut rhat, params, &self.codes[i * cb..(i + 1) * cb], s);
                acc += dot(&rhat, x);
            }
            let codes = &self.codes[i * m..(i + 1) * m];
            match &table {
                _ if g.sq.is_some() => {}
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

/// `row[j*D..(j+1)*D] += codebook[codes[j]]` for every sub-vector j, with the length a
/// constant. Codes were checked below k at parse, so the lookups stay in bounds; `row`
/// is `cols` long and D divides `cols` (checked at parse).
pub(super) fn add_centroids<const D: usize>(row: &mut [f32], codes: &[u8], codebook: &[f32])
where
    [f32; D]: bytemuck::Pod,
{
    let cents: &[[f32; D]] = bytemuck::cast_slice(codebook);
    let segs: &mut [[f32; D]] = bytemuck::cast_slice_mut(row);
    for (seg, &c) in segs.iter_mut().zip(codes) {
        let cent = &cents[c as usize];
        for t in 0..D {
            seg[t] += cent[t];
        }
    }
}

/// Rows `r0..r1` of a checked NDSQ block with its tensor's global: what decoding them
/// reads, for a backend that computes [`BlockView::decode_rows`]'s arithmetic itself.
pub struct NdsqParts<'a> {
    g: &'a NdsqGlobal,
    key: u128,
    view: BlockView<'a>,
    r0: usize,
    r1: usize,
}

impl<'a> NdsqParts<'a> {
    pub(in crate::codec) fn new(
        g: &'a NdsqGlobal,
        key: u128,
        view: BlockView<'a>,
        r0: usize,
        r1: usize,
    ) -> Self {
        NdsqParts {
            g,
            key,
            view,
            r0,
            r1,
        }
    }
    pub fn rows(&self) -> usize {
        self.r1 - self.r0
    }
    pub fn cols(&self) -> usize {
        self.g.cols
    }
    pub fn rank(&self) -> usize {
        self.g.rank
    }
    /// PQ sub-vector length.
    pub fn sub_dim(&self) -> usize {
        self.g.d
    }
    /// PQ sub-vectors per row.
    pub fn sub_vectors(&self) -> usize {
        self.g.m
    }
    /// Σ·Vᵀ, `rank × cols`, scale applied.
    pub fn svt(&self) -> &'a [f32] {
        &self.g.svt
    }
    /// `k × sub_dim` centroids.
    pub fn codebook(&self) -> &'a [f32] {
        &self.g.codebook
    }
    /// Names the global's contents (the same key means the same Σ·Vᵀ and codebook).
    pub fn global_key(&self) -> u128 {
        self.key
    }
    /// U of the rows, f16 little-endian, `rows × rank`.
    pub fn u_f16(&self) -> &'a [u8] {
        &self.view.u[self.r0 * self.g.rank * 2..self.r1 * self.g.rank * 2]
    }
    /// R's scalar grid, `(bits, group)`, where R is scalar groups (docs/CODECS.md); the
    /// PQ accessors are then empty.
    pub fn scalar_shape(&self) -> Option<(usize, usize)> {
        self.g.sq.map(|s| (s.bits, s.group))
    }
    /// Bytes of one row's codes: `sub_vectors` PQ codes, or the packed scalar codes.
    pub fn code_stride(&self) -> usize {
        self.g.sq.map_or(self.g.m, |s| s.code_bytes())
    }
    /// Codes of the rows, `rows × code_stride`.
    pub fn codes(&self) -> &'a [u8] {
        let c = self.code_stride();
        &self.view.codes[self.r0 * c..self.r1 * c]
    }
    /// Scalar R's [scale, min] f16 pairs (little-endian) of the rows, `rows × groups × 4`
    /// bytes; empty for PQ.
    pub fn scalar_params(&self) -> &'a [u8] {
        let p = self.g.sq.map_or(0, |s| s.groups() * 4);
        &self.view.params[self.r0 * p..self.r1 * p]
    }
    /// Row `i`'s (relative to `r0`) diagonal entry: (column, value), added after R.
    pub fn diagonal(&self, i: usize) -> Option<(usize, f32)> {
        let bi = self.r0 + i;
        (bi < self.view.nd).then(|| (self.view.first + bi, self.view.diag_val(bi)))
    }
    /// Row `i`'s outliers, (column, value) with columns ascending, added last.
    pub fn outliers(&self, i: usize) -> impl Iterator<Item = (usize, f32)> + '_ {
        let bi = self.r0 + i;
        (self.view.start[bi]..self.view.start[bi + 1]).map(|e| {
            (
                read_idx(self.view.s_cols, e, self.view.w),
                self.view.s_val(e),
            )
        })
    }
    pub fn decode(&self, out: &mut [f32]) {
        self.view.decode_rows(self.g, self.r0, self.r1, out)
    }
}
