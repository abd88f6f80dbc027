//! Product quantization of the NDSQ residue: one codebook of `k` centroids of length
//! `d` shared by every sub-vector position of a tensor, trained by k-means++ then
//! Lloyd iterations on a seeded subsample, and one-byte codes for all sub-vectors.
//!
//! Determinism: sampling and seeding come from a ChaCha rng seeded by the caller;
//! assignment is per point (parallel but order-free); centroid sums run in point order
//! in f64.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

mod grid;

/// Sub-vectors used to train the codebook; all sub-vectors are assigned afterwards.
pub(super) const MAX_TRAIN: usize = 32 * 1024;

/// Nearest-centroid search over a transposed (dimension-major) copy of the codebook,
/// so the inner loop runs across centroids and vectorizes.
pub(super) struct Searcher {
    k: usize,
    d: usize,
    /// `t[j * k + c]` = coordinate j of centroid c.
    t: Vec<f32>,
}

impl Searcher {
    /// `codebook` holds at most 256 centroids of length `d`.
    pub(super) fn new(codebook: &[f32], d: usize) -> Self {
        let k = (codebook.len() / d).min(256);
        let mut t = vec![0f32; k * d];
        for (c, cent) in codebook.chunks_exact(d).take(k).enumerate() {
            for (j, &x) in cent.iter().enumerate() {
                t[j * k + c] = x;
            }
        }
        Searcher { k, d, t }
    }

    /// The nearest centroid of every sub-vector of `vs`, into `out`; `vs`'s first
    /// sub-vector is sub-vector `first` of the tensor (which column weights it takes).
    /// Compiled for AVX2 too, used where the CPU has it (same results: the same
    /// separate multiplies, adds and comparisons, only wider).
    pub(super) fn nearest_all(
        &self,
        vs: &[f32],
        first: usize,
        cw: Option<ColWeights<'_>>,
        out: &mut [u32],
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2")]
            unsafe fn avx2(
                s: &Searcher,
                vs: &[f32],
                first: usize,
                cw: Option<ColWeights<'_>>,
                out: &mut [u32],
            ) {
                s.nearest_all_body(vs, first, cw, out)
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2, the one feature `avx2` is compiled for.
                return unsafe { avx2(self, vs, first, cw, out) };
            }
        }
        self.nearest_all_body(vs, first, cw, out)
    }

    #[inline(always)]
    fn nearest_all_body(
        &self,
        vs: &[f32],
        first: usize,
        cw: Option<ColWeights<'_>>,
        out: &mut [u32],
    ) {
        for (i, (o, v)) in out.iter_mut().zip(vs.chunks_exact(self.d)).enumerate() {
            let w = cw.map(|c| c.of(first + i, self.d));
            *o = self.nearest_weighted(v, w) as u32;
        }
    }

    /// Index of the centroid nearest to `v` (squared L2; ties go to the lowest index).
    fn nearest(&self, v: &[f32]) -> usize {
        self.nearest_weighted(v, None)
    }

    /// Like [`Searcher::nearest`], each coordinate's squared difference times `w`'s
    /// (the unweighted sums are unchanged: no multiply by one is added).
    #[inline(always)]
    fn nearest_weighted(&self, v: &[f32], w: Option<&[f32]>) -> usize {
        let mut dist = [0f32; 256];
        let dist = &mut dist[..self.k];
        for (j, &x) in v.iter().enumerate().take(self.d) {
            let col = &self.t[j * self.k..(j + 1) * self.k];
            match w {
                None => {
                    for (dc, &cj) in dist.iter_mut().zip(col) {
                        let t = cj - x;
                        *dc += t * t;
                    }
                }
                Some(w) => {
                    let wj = w[j];
                    for (dc, &cj) in dist.iter_mut().zip(col) {
                        let t = cj - x;
                        *dc += wj * (t * t);
                    }
                }
            }
        }
        // Eight running minima, one per lane, updated by selects rather than a branch
        // per centroid, so the compiler vectorizes the scan (the branchy scan was most
        // of a conversion's time). Indices ride as f32 (exact below 2^24) so compare
        // and select stay in one register type. Each lane keeps its first strict
        // minimum, and the lanes are merged by (distance, index): the first smallest
        // distance overall, as before; with every distance +inf, 0.
        const L: usize = 8;
        let mut mv = [f32::INFINITY; L];
        let mut mi = [0f32; L];
        let mut at = [0f32; L];
        for (l, a) in at.iter_mut().enumerate() {
            *a = l as f32;
        }
        let full = dist.len() / L * L;
        for chunk in dist[..full].chunks_exact(L) {
            for l in 0..L {
                let lt = chunk[l] < mv[l];
                mv[l] = if lt { chunk[l] } else { mv[l] };
                mi[l] = if lt { at[l] } else { mi[l] };
                at[l] += L as f32;
            }
        }
        let mut best = (f32::INFINITY, 0f32);
        for l in 0..L {
            if mv[l] < best.0 || (mv[l] == best.0 && mi[l] < best.1) {
                best = (mv[l], mi[l]);
            }
        }
        let mut best = (best.0, best.1 as usize);
        for (c, &x) in dist.iter().enumerate().skip(full) {
            if x < best.0 {
                best = (x, c);
            }
        }
        best.1
    }
}

/// Sub-vectors labelled per parallel task.
const CHUNK: usize = 4096;

/// Per-column weights of a tensor's sub-vectors (from an importance matrix): the
/// tensor's sub-vector i, row-major over rows × m, is weighted by
/// `w[(i % m)·d..][..d]`.
#[derive(Clone, Copy)]
pub(super) struct ColWeights<'a> {
    /// One weight per column (m·d of them).
    pub w: &'a [f32],
    pub m: usize,
}

impl<'a> ColWeights<'a> {
    #[inline(always)]
    fn of(self, i: usize, d: usize) -> &'a [f32] {
        let p = i % self.m;
        &self.w[p * d..(p + 1) * d]
    }
}

/// Nearest centroid of every sub-vector of `data`, in parallel: through `grid` where
/// one is given (2-D, unweighted), by full scans otherwise; the same labels either way.
fn labels(
    search: &Searcher,
    grid: Option<&grid::Grid2>,
    d: usize,
    data: &[f32],
    cw: Option<ColWeights<'_>>,
) -> Vec<u32> {
    let mut out = vec![0u32; data.len() / d];
    out.par_chunks_mut(CHUNK)
        .zip(data.par_chunks(CHUNK * d))
        .enumerate()
        .for_each(|(c, (o, vs))| match grid {
            Some(g) => {
                for (o, v) in o.iter_mut().zip(vs.chunks_exact(2)) {
                    *o = g.nearest(v).unwrap_or_else(|| search.nearest(v)) as u32;
                }
            }
            None => search.nearest_all(vs, c * CHUNK, cw, o),
        });
    out
}

/// The grid's box for `data` when a grid serves its searches: 2-D sub-vectors, no
/// weights, and enough of them to repay building one per codebook.
fn grid_box(d: usize, data: &[f32], cw: Option<ColWeights<'_>>) -> Option<([f64; 2], [f64; 2])> {
    (d == 2 && cw.is_none() && data.len() / d >= GRID_MIN_POINTS)
        .then(|| grid::Grid2::bounds(data))
        .flatten()
}

/// Sub-vectors from which a grid is built (2-D, unweighted): below it, building costs
/// more than the full scans it saves.
const GRID_MIN_POINTS: usize = 4 * 1024;
/// Cells per axis for `n` sub-vectors: fine enough that a cell lists a few centroids of
/// a 256-centroid book where there are points enough to repay building it.
fn grid_cells(n: usize) -> usize {
    if n >= 1 << 20 {
        128
    } else if n >= 1 << 18 {
        64
    } else {
        32
    }
}

/// Codes for all sub-vectors (`data.len() / d` of them), nearest by the weighted
/// distance when `cw` is given.
pub(super) fn assign(
    codebook: &[f32],
    d: usize,
    data: &[f32],
    cw: Option<ColWeights<'_>>,
) -> Vec<u8> {
    let search = Searcher::new(codebook, d);
    let grid =
        grid_box(d, data, cw).map(|b| grid::Grid2::new(codebook, b, grid_cells(data.len() / d)));
    // Labels are below k ≤ 256.
    labels(&search, grid.as_ref(), d, data, cw)
        .into_iter()
        .map(|l| l as u8)
        .collect()
}

/// Trains a codebook of at most `k` centroids (fewer when there are fewer training
/// sub-vectors) for the sub-vectors `data.chunks_exact(d)`, minimising the weighted
/// squared error when `cw` is given (seeding, assignment and each centroid coordinate's
/// weighted mean). Returns `k_eff × d` values.
pub(super) fn train(
    data: &[f32],
    d: usize,
    k: usize,
    iters: u32,
    seed: u64,
    cw: Option<ColWeights<'_>>,
) -> Vec<f32> {
    let n = data.len() / d;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5051_5f4b_4d45_414e);
    // The training sub-vectors and, with weights, each one's weights.
    let idx: Vec<usize> = if n <= MAX_TRAIN {
        (0..n).collect()
    } else {
        let mut idx = rand::seq::index::sample(&mut rng, n, MAX_TRAIN).into_vec();
        idx.sort_unstable();
        idx
    };
    let train: Vec<f32> = idx
        .iter()
        .flat_map(|&i| data[i * d..(i + 1) * d].iter().copied())
        .collect();
    let tw: Option<Vec<f32>> = cw.map(|c| {
        idx.iter()
            .flat_map(|&i| c.of(i, d).iter().copied())
            .collect()
    });
    let s = train.len() / d;
    let k = k.min(s).max(1);
    if s == 0 {
        return vec![0.0; k * d];
    }
    let weights_of = |i: usize| tw.as_ref().map(|w| &w[i * d..(i + 1) * d]);

    let mut cb = seed_plus_plus(&train, d, k, &mut rng, tw.as_deref());

    // Lloyd iterations; an empty cluster (or coordinate without weight) keeps its value.
    // The training set's weights are laid out per training sub-vector: m = s, d = d.
    let tcw = tw.as_ref().map(|w| ColWeights { w, m: s });
    let mut labels = vec![u32::MAX; s];
    let mut sums = vec![0f64; k * d];
    let mut mass = vec![0f64; k * d];
    let gbox = grid_box(d, &train, tcw);
    for _ in 0..iters {
        let search = Searcher::new(&cb, d);
        let grid = gbox.map(|b| grid::Grid2::new(&cb, b, grid_cells(s)));
        let new = self::labels(&search, grid.as_ref(), d, &train, tcw);
        if new == labels {
            break;
        }
        labels = new;
        sums.iter_mut().for_each(|x| *x = 0.0);
        mass.iter_mut().for_each(|x| *x = 0.0);
        for (i, (&l, v)) in labels.iter().zip(train.chunks_exact(d)).enumerate() {
            let l = l as usize;
            let (s, m) = (&mut sums[l * d..(l + 1) * d], &mut mass[l * d..(l + 1) * d]);
            match weights_of(i) {
                None => {
                    for ((s, m), &x) in s.iter_mut().zip(m.iter_mut()).zip(v) {
                        *s += x as f64;
                        *m += 1.0;
                    }
                }
                Some(w) => {
                    for (((s, m), &x), &w) in s.iter_mut().zip(m.iter_mut()).zip(v).zip(w) {
                        *s += w as f64 * x as f64;
                        *m += w as f64;
                    }
                }
            }
        }
        for (c, (s, m)) in cb.iter_mut().zip(sums.iter().zip(&mass)) {
            if *m > 0.0 {
                *c = (s / m) as f32;
            }
        }
    }
    cb
}

/// Points per block of [`seed_plus_plus`]'s running sums.
const SEED_BLOCK: usize = 256;

/// k-means++ seeding of `k` centroids from the sub-vectors `train.chunks_exact(d)`
/// (weighted distances with `tw`, one weight per coordinate of each sub-vector). Each
/// pick draws a point with probability proportional to its squared distance to the
/// nearest centroid so far; the distances are summed per block of [`SEED_BLOCK`] points
/// in four lanes (vectorized), and a draw walks the block sums, then one block.
fn seed_plus_plus(
    train: &[f32],
    d: usize,
    k: usize,
    rng: &mut ChaCha8Rng,
    tw: Option<&[f32]>,
) -> Vec<f32> {
    let s = train.len() / d;
    let mut cb = Vec::with_capacity(k * d);
    let first = rng.random_range(0..s);
    cb.extend_from_slice(&train[first * d..(first + 1) * d]);
    let mut best = vec![f64::INFINITY; s];
    let mut bsum = vec![0f64; s.div_ceil(SEED_BLOCK)];
    let mut c0 = 0;
    loop {
        // Distances to the newest centroid, then the block sums.
        let c = &cb[c0..c0 + d];
        match (d, tw) {
            (2, None) => {
                for (b, v) in best.iter_mut().zip(train.chunks_exact(2)) {
                    let t0 = (v[0] - c[0]) as f64;
                    let t1 = (v[1] - c[1]) as f64;
                    let nd = t0 * t0 + t1 * t1;
                    *b = if nd < *b { nd } else { *b };
                }
            }
            _ => {
                for (i, (b, v)) in best.iter_mut().zip(train.chunks_exact(d)).enumerate() {
                    let mut nd = 0f64;
                    for j in 0..d {
                        let t = (v[j] - c[j]) as f64;
                        nd += match tw {
                            None => t * t,
                            Some(w) => w[i * d + j] as f64 * (t * t),
                        };
                    }
                    *b = if nd < *b { nd } else { *b };
                }
            }
        }
        for (bs, blk) in bsum.iter_mut().zip(best.chunks(SEED_BLOCK)) {
            let mut acc = [0f64; 4];
            let lanes = blk.chunks_exact(4);
            let rest = lanes.remainder();
            for q in lanes {
                for l in 0..4 {
                    acc[l] += q[l];
                }
            }
            *bs = (acc[0] + acc[1]) + (acc[2] + acc[3]) + rest.iter().sum::<f64>();
        }
        if cb.len() >= k * d {
            return cb;
        }
        let total: f64 = bsum.iter().sum();
        let pick = if total > 0.0 {
            let mut target = rng.random::<f64>() * total;
            // Rounding can leave the target past every block: the last point then.
            let mut pick = s - 1;
            'walk: for (bi, &bs) in bsum.iter().enumerate() {
                if target < bs {
                    let lo = bi * SEED_BLOCK;
                    for (i, &b) in best[lo..(lo + SEED_BLOCK).min(s)].iter().enumerate() {
                        if target < b {
                            pick = lo + i;
                            break 'walk;
                        }
                        target -= b;
                    }
                    // The block's points summed (sequentially) to less than its lane
                    // sum: go on with the next block.
                    target = 0.0;
                } else {
                    target -= bs;
                }
            }
            pick
        } else {
            rng.random_range(0..s)
        };
        c0 = cb.len();
        cb.extend_from_slice(&train[pick * d..(pick + 1) * d]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kmeans_finds_separated_clusters() {
        // Four tight clusters in 2-D: k = 4 must find them all.
        let centers = [[0.0f32, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]];
        let mut data = Vec::new();
        for i in 0..400 {
            let c = centers[i % 4];
            let jitter = (i as f32 * 0.37).sin() * 0.1;
            data.extend_from_slice(&[c[0] + jitter, c[1] - jitter]);
        }
        let cb = train(&data, 2, 4, 20, 7, None);
        assert_eq!(cb.len(), 8);
        let codes = assign(&cb, 2, &data, None);
        for (i, v) in data.chunks_exact(2).enumerate() {
            let c = &cb[codes[i] as usize * 2..codes[i] as usize * 2 + 2];
            assert!((c[0] - v[0]).abs() < 0.3 && (c[1] - v[1]).abs() < 0.3);
        }
        assert_eq!(
            train(&data, 2, 4, 20, 7, None),
            cb,
            "deterministic for a seed"
        );
    }

    #[test]
    fn fewer_points_than_centroids() {
        let data = [1.0f32, 2.0, 3.0, 4.0];
        let cb = train(&data, 2, 256, 5, 1, None);
        assert_eq!(cb.len(), 4);
        assert_eq!(assign(&cb, 2, &data, None).len(), 2);
    }

    /// The first centroid at the smallest squared distance, by a plain scan.
    fn reference(cb: &[f32], d: usize, v: &[f32]) -> u32 {
        let mut best = (f32::INFINITY, 0u32);
        for (c, cent) in cb.chunks_exact(d).enumerate() {
            let mut dist = 0f32;
            for (&a, &b) in cent.iter().zip(v) {
                dist += (a - b) * (a - b);
            }
            if dist < best.0 {
                best = (dist, c as u32);
            }
        }
        best.1
    }

    #[test]
    fn grid_assignment_matches_a_plain_scan() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let n = GRID_MIN_POINTS + 1000;
        // Bell-shaped values (sum of uniforms) like a residue, a codebook trained on
        // them; coarse values (ties everywhere); one axis constant; a few points far
        // outside, non-finite, and at the extremes of f32.
        let bell: Vec<f32> = (0..2 * n)
            .map(|_| (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 0.01)
            .collect();
        let coarse: Vec<f32> = (0..2 * n)
            .map(|_| (rng.random_range(0..9) as f32 - 4.0) * 0.25)
            .collect();
        let flat: Vec<f32> = (0..2 * n)
            .map(|i| {
                if i % 2 == 0 {
                    0.5
                } else {
                    rng.random_range(-1.0f32..1.0)
                }
            })
            .collect();
        let mut wild = bell.clone();
        for (i, v) in [f32::NAN, f32::INFINITY, 3.0e38, -3.0e38, 1e-40, 7.0]
            .iter()
            .enumerate()
        {
            wild[100 * i] = *v;
        }
        // A range too small for an f32 cell index along x.
        let tiny: Vec<f32> = (0..2 * n)
            .map(|i| {
                if i % 2 == 0 {
                    (i % 7) as f32 * 1e-44
                } else {
                    rng.random_range(-1.0f32..1.0)
                }
            })
            .collect();
        for (name, data) in [
            ("bell", &bell),
            ("coarse", &coarse),
            ("flat", &flat),
            ("wild", &wild),
            ("tiny", &tiny),
        ] {
            for k in [256, 13] {
                let cb = train(data, 2, k, 6, 5, None);
                let got = assign(&cb, 2, data, None);
                for (i, v) in data.chunks_exact(2).enumerate() {
                    assert_eq!(
                        got[i] as u32,
                        reference(&cb, 2, v),
                        "{name} k {k} point {i}"
                    );
                }
            }
        }
        // Coarse codebook over bell data: many centroids coincide.
        let cb: Vec<f32> = (0..512)
            .map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.01)
            .collect();
        let got = assign(&cb, 2, &bell, None);
        for (i, v) in bell.chunks_exact(2).enumerate() {
            assert_eq!(got[i] as u32, reference(&cb, 2, v), "duplicates point {i}");
        }
        let trained = train(&bell, 2, 256, 6, 5, None);
        // The point of the grid: a cell lists a few of the 256 centroids (1.8 measured).
        let g = grid::Grid2::new(&trained, grid::Grid2::bounds(&bell).unwrap(), 64);
        assert!(g.mean_candidates() < 4.0, "{}", g.mean_candidates());
    }

    #[test]
    fn nearest_all_matches_a_plain_scan() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for (k, d) in [(256, 2), (13, 2), (100, 4), (7, 1), (256, 8)] {
            // Coarse values: many equal distances, so tie-breaking is exercised.
            let mut val = || (rng.random_range(0..9) as f32 - 4.0) * 0.25;
            let cb: Vec<f32> = (0..k * d).map(|_| val()).collect();
            let data: Vec<f32> = (0..5000 * d).map(|_| val()).collect();
            let search = Searcher::new(&cb, d);
            let mut got = vec![0u32; 5000];
            search.nearest_all(&data, 0, None, &mut got);
            for (i, v) in data.chunks_exact(d).enumerate() {
                assert_eq!(got[i], reference(&cb, d, v), "k {k} d {d} point {i}");
            }
        }
        // Every distance +inf (overflow): the first centroid.
        let search = Searcher::new(&[f32::MAX, f32::MAX, -f32::MAX, f32::MAX], 2);
        assert_eq!(search.nearest(&[-f32::MAX, -f32::MAX]), 0);
    }
}
