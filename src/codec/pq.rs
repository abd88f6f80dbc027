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
    #[cfg(test)]
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

/// Nearest centroid of every sub-vector of `data`, in parallel.
fn labels(search: &Searcher, d: usize, data: &[f32], cw: Option<ColWeights<'_>>) -> Vec<u32> {
    let mut out = vec![0u32; data.len() / d];
    out.par_chunks_mut(CHUNK)
        .zip(data.par_chunks(CHUNK * d))
        .enumerate()
        .for_each(|(c, (o, vs))| search.nearest_all(vs, c * CHUNK, cw, o));
    out
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
    // Labels are below k ≤ 256.
    labels(&search, d, data, cw)
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

    // k-means++ seeding.
    let mut cb = Vec::with_capacity(k * d);
    let first = rng.random_range(0..s);
    cb.extend_from_slice(&train[first * d..(first + 1) * d]);
    let dist2 = |a: &[f32], b: &[f32], w: Option<&[f32]>| -> f64 {
        let sq = a.iter().zip(b).map(|(x, y)| {
            let t = (x - y) as f64;
            t * t
        });
        match w {
            None => sq.sum(),
            Some(w) => sq.zip(w).map(|(t, &w)| w as f64 * t).sum(),
        }
    };
    let mut best: Vec<f64> = train
        .chunks_exact(d)
        .enumerate()
        .map(|(i, v)| dist2(v, &cb[..d], weights_of(i)))
        .collect();
    while cb.len() < k * d {
        let total: f64 = best.iter().sum();
        let pick = if total > 0.0 {
            let mut target = rng.random::<f64>() * total;
            let mut pick = s - 1;
            for (i, &b) in best.iter().enumerate() {
                if target < b {
                    pick = i;
                    break;
                }
                target -= b;
            }
            pick
        } else {
            rng.random_range(0..s)
        };
        let c0 = cb.len();
        cb.extend_from_slice(&train[pick * d..(pick + 1) * d]);
        for (i, (b, v)) in best.iter_mut().zip(train.chunks_exact(d)).enumerate() {
            let nd = dist2(v, &cb[c0..c0 + d], weights_of(i));
            if nd < *b {
                *b = nd;
            }
        }
    }

    // Lloyd iterations; an empty cluster (or coordinate without weight) keeps its value.
    // The training set's weights are laid out per training sub-vector: m = s, d = d.
    let tcw = tw.as_ref().map(|w| ColWeights { w, m: s });
    let mut labels = vec![u32::MAX; s];
    let mut sums = vec![0f64; k * d];
    let mut mass = vec![0f64; k * d];
    for _ in 0..iters {
        let search = Searcher::new(&cb, d);
        let new = self::labels(&search, d, &train, tcw);
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
