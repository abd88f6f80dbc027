//! NDSQ codec: W ≈ D + L + R + S, factorized in the paper's order (seed 000 §3):
//! L = truncated SVD of W (rank r); S = entries of W − L above the |value| quantile
//! `outlier_q`; D = the diagonal of what remains; R = the rest, product-quantized
//! along rows with one k-means codebook per tensor, or (`sq`) scalar-quantized in
//! groups along rows on affine grids ([`crate::codec::sq`]).
//!
//! Storage (exact bytes in docs/CODECS.md): the global blob holds Σ·Vᵀ (f16, with a
//! power-of-two scale) and the PQ codebook (f32); each row block holds its rows of U
//! (f16), PQ codes (u8), its diagonal entries (f16) and its outliers (per-row counts,
//! column indices, f32 values). S and D store the correction against the *decoded*
//! L + R̂ at their positions, so those entries come back exact up to rounding and the
//! errors of earlier stages don't compound.
//!
//! Files: [`decode`] (global and block parsing, row decode, matrix-vector product),
//! [`encode`] (the factorization in named steps), [`outliers`] (S and D), [`svd`].

mod decode;
mod encode;
mod outliers;
mod svd;
#[cfg(test)]
mod tests;

pub use decode::NdsqParts;
pub(super) use decode::{BlockView, NdsqGlobal};
pub(super) use encode::{column_weights, encode};
pub(crate) use svd::thin_svd;
pub(super) use svd::truncated_svd;

const MAGIC: &[u8; 4] = b"NDQ1";
/// The global's magic when R is scalar groups.
const MAGIC_SQ: &[u8; 4] = b"NDQ2";

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
