//! Truncated SVD for the L factor: exact thin SVD, or a randomized range finder when the
//! rank is small against the matrix. Sequential faer with a seeded rng, so encoding is
//! deterministic.

use faer::diag::Diag;
use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::svd::{self, ComputeSvdVectors};
use faer::{Accum, Mat, MatRef, Par};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::codec::CodecError;

/// Oversampling and power iterations of the randomized range finder.
const OVERSAMPLE: usize = 10;
const POWER_ITERS: usize = 2;

/// U, σ, V of a thin SVD.
type Svd3 = (Mat<f32>, Vec<f32>, Mat<f32>);

/// Thin SVD with sequential faer (deterministic): (U m×s, σ (descending), V n×s).
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

pub(super) fn matmul(a: MatRef<'_, f32>, b: MatRef<'_, f32>) -> Mat<f32> {
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
pub(in crate::codec) fn truncated_svd(
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
