//! Codec internals timed by `benches/micro` (a bench target sees only public items).
//! Not part of the API: hidden from the docs, and may change with the codecs.

use faer::MatRef;

use super::CodecError;

/// k-means training of a PQ codebook (`k` centroids of `d`-wide sub-vectors).
pub fn pq_train(data: &[f32], d: usize, k: usize, iters: u32, seed: u64) -> Vec<f32> {
    super::pq::train(data, d, k, iters, seed, None)
}

/// Rank-`r` truncated SVD of the row-major `rows × cols` matrix `w` (result dropped).
pub fn truncated_svd(
    w: &[f32],
    rows: usize,
    cols: usize,
    r: usize,
    seed: u64,
) -> Result<(), CodecError> {
    let a = MatRef::from_row_major_slice(w, rows, cols);
    super::ndsq::truncated_svd(a, r, seed).map(drop)
}

/// Exact thin SVD of the row-major `rows × cols` matrix `w` (result dropped).
pub fn thin_svd(w: &[f32], rows: usize, cols: usize) -> Result<(), CodecError> {
    let a = MatRef::from_row_major_slice(w, rows, cols);
    super::ndsq::thin_svd(a).map(drop)
}
