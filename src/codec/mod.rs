//! Codecs: turn a tensor (a `rows × cols` f32 matrix, or its raw source bytes) into a
//! tensor-wide blob plus one payload per row block, and back. Codecs know nothing of
//! files, sections, compression or caches: the archive stores their bytes, compresses
//! and checksums each block, and hands them back.
//!
//! Row blocks: block `b` covers rows `b*rows_per_block .. min(rows, (b+1)*rows_per_block)`.
//! Decoding any row range needs the tensor's global blob and only the blocks that
//! overlap the range.
//!
//! STUB: to be implemented (ndsq.rs, pq.rs, passthrough.rs).

use serde::{Deserialize, Serialize};

use crate::model::SourceType;

/// How one tensor is encoded; stored in the archive's tensor table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "codec", rename_all = "lowercase")]
pub enum TensorCodec {
    /// Source bytes kept as they were (f32/f16/bf16 or ggml blocks), bit-exact.
    Passthrough { format: SourceType },
    /// W ≈ D + L + R + S (see `ndsq`).
    Ndsq {
        rank: u32,
        /// Length of each PQ sub-vector (cols / m).
        pq_dim: u32,
        pq_k: u32,
        outlier_q: f32,
    },
}

#[derive(Clone, Debug)]
pub struct NdsqOptions {
    /// Rank of L (truncated SVD); 0 disables L.
    pub rank: u32,
    /// |value| quantile of W−L above which entries become outliers (S); 1.0 disables S.
    pub outlier_q: f32,
    /// PQ sub-vector length; ignored when `pq_m` is set.
    pub pq_dim: u32,
    /// PQ sub-vectors per row (must divide cols), overriding `pq_dim`.
    pub pq_m: Option<u32>,
    /// PQ centroids (≤ 256, codes are one byte).
    pub pq_k: u32,
    pub kmeans_iters: u32,
    pub seed: u64,
}

pub struct EncodedTensor {
    pub codec: TensorCodec,
    /// Tensor-wide data (NDSQ: Σ·Vᵀ and the PQ codebook); empty for passthrough.
    pub global: Vec<u8>,
    /// Uncompressed payload of each row block.
    pub blocks: Vec<Vec<u8>>,
    /// ‖W − Ŵ‖ / ‖W‖ measured on the f32 input (0 for passthrough).
    pub rel_err: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("invalid codec parameters: {0}")]
    Params(String),
    #[error("corrupt payload: {0}")]
    Corrupt(String),
}

/// A tensor's global blob parsed once, reused for every block of that tensor.
pub struct DecodedGlobal {
    _private: (),
}

pub fn encode_ndsq(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    opts: &NdsqOptions,
) -> Result<EncodedTensor, CodecError> {
    let _ = (w, rows, cols, rows_per_block, opts);
    todo!()
}

pub fn encode_passthrough(
    raw: &[u8],
    format: SourceType,
    rows: u64,
    cols: u64,
    rows_per_block: u64,
) -> Result<EncodedTensor, CodecError> {
    let _ = (raw, format, rows, cols, rows_per_block);
    todo!()
}

pub fn decode_global(
    codec: &TensorCodec,
    global: &[u8],
    rows: u64,
    cols: u64,
) -> Result<DecodedGlobal, CodecError> {
    let _ = (codec, global, rows, cols);
    todo!()
}

/// Decode rows `r0..r1` (relative to the block's first row) of a block holding
/// `block_rows` rows into `out` (`(r1-r0)*cols` values).
#[allow(clippy::too_many_arguments)]
pub fn decode_block_rows(
    codec: &TensorCodec,
    global: &DecodedGlobal,
    payload: &[u8],
    block_first_row: u64,
    block_rows: u64,
    cols: u64,
    r0: u64,
    r1: u64,
    out: &mut [f32],
) -> Result<(), CodecError> {
    let _ = (
        codec,
        global,
        payload,
        block_first_row,
        block_rows,
        cols,
        r0,
        r1,
        out,
    );
    todo!()
}

/// y[block rows] = Ŵ[block rows] · x computed from the components without forming Ŵ.
#[allow(clippy::too_many_arguments)]
pub fn apply_block(
    codec: &TensorCodec,
    global: &DecodedGlobal,
    payload: &[u8],
    block_first_row: u64,
    block_rows: u64,
    cols: u64,
    x: &[f32],
    y: &mut [f32],
) -> Result<(), CodecError> {
    let _ = (
        codec,
        global,
        payload,
        block_first_row,
        block_rows,
        cols,
        x,
        y,
    );
    todo!()
}
