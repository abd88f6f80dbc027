//! Exact nearest-centroid search for 2-D sub-vectors (the default `--pq-dim`) through a
//! uniform grid over the points' bounding box. Each cell lists the centroids that can
//! be nearest to some point in it; a point is compared with its cell's list only, in
//! index order and with the full scan's arithmetic, so the labels are the full scan's.
//!
//! Why a cell's list is enough: for a point x in cell B, let U be the least, over the
//! centroids, of the largest squared distance from a centroid to B. The scan's winner
//! c* has the smallest f32 distance, which is within a relative 4·2⁻²⁴ (plus an
//! underflow term) of the exact distance, so dist(c*, B) ≤ dist(c*, x) ≤ U·(1 + δ) + A.
//! A centroid whose distance to B exceeds that bound can never win in B. Bounds are
//! computed in f64 over boxes widened by a margin, so rounding in the (f32) cell index
//! of a point cannot put it outside its cell's box.

/// Relative and absolute slack of the candidate test: far above f32 rounding (≈2.4e-7
/// relative) and subnormal error (≈1e-45), so nothing that could win is dropped.
const REL: f64 = 1e-4;
const ABS: f64 = 1e-35;

pub(super) struct Grid2 {
    g: usize,
    /// The box, exactly (its corners are points' coordinates).
    lo: [f32; 2],
    hi: [f32; 2],
    /// Cells per unit along each axis, for the (f32) cell index.
    inv_h: [f32; 2],
    /// Cell `c`'s candidates are `cand[start[c]..start[c + 1]]`, increasing, each
    /// with its coordinates (so the search reads one array).
    start: Vec<u32>,
    cand: Vec<u8>,
    cand_xy: Vec<[f32; 2]>,
}

impl Grid2 {
    /// The bounding box ([x_lo, y_lo], [x_hi, y_hi]) of the finite points of `data`
    /// (pairs); None when no point is finite.
    pub(super) fn bounds(data: &[f32]) -> Option<([f64; 2], [f64; 2])> {
        let mut lo = [f32::INFINITY; 2];
        let mut hi = [f32::NEG_INFINITY; 2];
        for p in data.chunks_exact(2) {
            if p[0].is_finite() && p[1].is_finite() {
                for j in 0..2 {
                    lo[j] = lo[j].min(p[j]);
                    hi[j] = hi[j].max(p[j]);
                }
            }
        }
        (lo[0] <= hi[0]).then(|| (lo.map(f64::from), hi.map(f64::from)))
    }

    /// A grid of `g`×`g` cells over the box `(lo, hi)` ([`Grid2::bounds`]) for the
    /// centroids `codebook` (pairs, at most 256 used). Points outside the box are the
    /// caller's to scan ([`Grid2::nearest`] says None).
    pub(super) fn new(codebook: &[f32], (lo, hi): ([f64; 2], [f64; 2]), g: usize) -> Grid2 {
        let cb: Vec<[f32; 2]> = codebook
            .chunks_exact(2)
            .take(256)
            .map(|c| [c[0], c[1]])
            .collect();
        let g = g.max(1);
        let mut h = [1.0f64; 2];
        for j in 0..2 {
            // A range too small for an f32 cell index (or none) keeps one cell of
            // width 1 holding every point.
            let range = hi[j] - lo[j];
            if range > 0.0 && ((g as f64 / range) as f32).is_finite() {
                h[j] = range / g as f64;
            }
        }
        // The bounds separate by axis: per column of cells, each centroid's nearest and
        // farthest squared distance along x; per row, along y. A cell's bounds are then
        // one add per centroid (vectorized).
        let axis = |j: usize| -> (Vec<f64>, Vec<f64>) {
            let (mut near, mut far) = (vec![0f64; g * cb.len()], vec![0f64; g * cb.len()]);
            for i in 0..g {
                let (a, z) = cell_range(lo[j], h[j], i);
                for (c, cent) in cb.iter().enumerate() {
                    let v = cent[j] as f64;
                    let n = (a - v).max(v - z).max(0.0);
                    let f = (v - a).abs().max((v - z).abs());
                    near[i * cb.len() + c] = n * n;
                    far[i * cb.len() + c] = f * f;
                }
            }
            (near, far)
        };
        let k = cb.len();
        let ((nx, fx), (ny, fy)) = (axis(0), axis(1));
        let mut start = Vec::with_capacity(g * g + 1);
        let mut cand = Vec::new();
        let mut lb = vec![0f64; k];
        start.push(0u32);
        for iy in 0..g {
            let (ny, fy) = (&ny[iy * k..][..k], &fy[iy * k..][..k]);
            for ix in 0..g {
                let (nx, fx) = (&nx[ix * k..][..k], &fx[ix * k..][..k]);
                let mut u = f64::INFINITY;
                for c in 0..k {
                    lb[c] = nx[c] + ny[c];
                    let f = fx[c] + fy[c];
                    u = if f < u { f } else { u };
                }
                let bound = u * (1.0 + REL) + ABS;
                for (c, &l) in lb.iter().enumerate() {
                    if l * (1.0 - REL) <= bound {
                        cand.push(c as u8);
                    }
                }
                start.push(cand.len() as u32);
            }
        }
        let cand_xy = cand.iter().map(|&c| cb[c as usize]).collect();
        Grid2 {
            cand_xy,
            g,
            lo: lo.map(|x| x as f32),
            hi: hi.map(|x| x as f32),
            inv_h: [(1.0 / h[0]) as f32, (1.0 / h[1]) as f32],
            start,
            cand,
        }
    }

    /// Mean candidates per cell (for tests and tuning).
    #[cfg(test)]
    pub(super) fn mean_candidates(&self) -> f64 {
        self.cand.len() as f64 / (self.g * self.g) as f64
    }

    /// The cell of coordinate `v` along axis `j`, which lies in the box. f32 rounding
    /// may put it a cell off near a boundary; the widened boxes cover that.
    #[inline(always)]
    fn cell(&self, j: usize, v: f32) -> usize {
        // `as` saturates: below the box's low edge by rounding is cell 0.
        (((v - self.lo[j]) * self.inv_h[j]) as usize).min(self.g - 1)
    }

    /// The nearest centroid of `v` as the full scan finds it (squared L2, the first
    /// centroid at the smallest distance), or None where the grid cannot tell (a
    /// point outside the box or not finite, or an overflowing distance): then the
    /// caller scans.
    #[inline(always)]
    pub(super) fn nearest(&self, v: &[f32]) -> Option<usize> {
        let (x, y) = (v[0], v[1]);
        let inside = |j: usize, v: f32| self.lo[j] <= v && v <= self.hi[j];
        if !(inside(0, x) && inside(1, y)) {
            return None;
        }
        let c = self.cell(1, y) * self.g + self.cell(0, x);
        let (a, z) = (self.start[c] as usize, self.start[c + 1] as usize);
        let mut best = (f32::INFINITY, 0);
        for (p, cent) in self.cand_xy[a..z].iter().enumerate() {
            // The scan's arithmetic: 0 + t₀², then + t₁², t = centroid − point.
            let t0 = cent[0] - x;
            let t1 = cent[1] - y;
            let d = t0 * t0 + t1 * t1;
            if d < best.0 {
                best = (d, p);
            }
        }
        best.0.is_finite().then(|| self.cand[a + best.1] as usize)
    }
}

/// Cell `i`'s range along one axis, widened by a margin far above the rounding of a
/// point's (f32) cell index: a few ulps of at most `g`, against 1/1000 of a cell.
fn cell_range(lo: f64, h: f64, i: usize) -> (f64, f64) {
    let m = h * 1e-3;
    (lo + i as f64 * h - m, lo + (i + 1) as f64 * h + m)
}
