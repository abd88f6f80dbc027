//! Codecs: turn a tensor (a `rows × cols` f32 matrix, or its raw source bytes) into a
//! tensor-wide blob plus one payload per row block, and back. Codecs know nothing of
//! files, sections, compression or caches: the archive stores their bytes, compresses
//! and checksums each block, and hands them back.
//!
//! Row blocks: block `b` covers rows `b*rows_per_block .. min(rows, (b+1)*rows_per_block)`.
//! Decoding any row range needs the tensor's global blob and only the blocks that
//! overlap the range.
//!
//! Byte layouts of globals and payloads: docs/CODECS.md.

#[doc(hidden)]
pub mod bench_api;
pub mod delta;
mod ggml;
pub mod intq;
pub mod le;
mod ndsq;
mod passthrough;
mod planes;
mod pq;
mod sq;

pub use le::f16s_to_f32;
/// Thin SVD (sequential, deterministic), shared with the delta kind's decomposition.
pub(crate) use ndsq::thin_svd;

use serde::{Deserialize, Serialize};

use crate::gguf::GgmlType;
use crate::model::SourceType;

/// How one tensor is encoded; stored in the archive's tensor table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "codec", rename_all = "lowercase")]
pub enum TensorCodec {
    /// Source bytes kept as they were (f32/f16/bf16 or ggml blocks), bit-exact.
    Passthrough { format: SourceType },
    /// Rounded at conversion into `ty`'s blocks, stored as those blocks (laid out as a
    /// passthrough payload of `ty`; see `ggml`).
    Ggml { ty: GgmlType },
    /// As `Ggml`, each row block's blocks stored in planes compressed apart (scale
    /// bytes, codes; see `planes`), unpacked to `Ggml`'s layout by [`unpack_block`]
    /// when read. Its own name, so that readers that know only `ggml` refuse it.
    #[serde(rename = "ggml_planes")]
    GgmlPlanes { ty: GgmlType },
    /// W ≈ D + L + R + S (see `ndsq`).
    Ndsq {
        rank: u32,
        /// Length of each PQ sub-vector (cols / m).
        pq_dim: u32,
        pq_k: u32,
        outlier_q: f32,
        /// R as scalar groups instead of PQ (then `pq_dim` and `pq_k` are 0).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sq: Option<SqParams>,
    },
}

/// NDSQ's R as scalar group quantization: `bits`-bit codes on an affine grid per
/// `group` consecutive values of a row (docs/CODECS.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SqParams {
    pub bits: u32,
    pub group: u32,
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
    /// Code R as scalar groups instead of PQ (the PQ fields are then unused).
    pub sq: Option<SqParams>,
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
    #[error("{0}")] // its callers say "is corrupt"
    Corrupt(String),
}

/// A tensor's global blob parsed once, reused for every block of that tensor.
pub struct DecodedGlobal {
    inner: GlobalInner,
    /// XXH3-128 of the blob's bytes: names its contents wherever a copy of the parsed
    /// values is kept (a GPU keeps them resident under this key).
    key: u128,
}

enum GlobalInner {
    Passthrough,
    Ndsq(ndsq::NdsqGlobal),
}

impl DecodedGlobal {
    /// Heap bytes held by the parsed global (for cache accounting).
    pub fn heap_bytes(&self) -> usize {
        match &self.inner {
            GlobalInner::Passthrough => 0,
            GlobalInner::Ndsq(g) => g.heap_bytes(),
        }
    }
}

pub fn encode_ndsq(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    opts: &NdsqOptions,
) -> Result<EncodedTensor, CodecError> {
    ndsq::encode(w, rows, cols, rows_per_block, opts, None)
}

/// [`encode_ndsq`] fitted to minimise the error weighted by each input column's
/// `importance` (`cols` non-negative values, e.g. an importance matrix's mean squared
/// activations); the decoder is the same.
pub fn encode_ndsq_weighted(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    opts: &NdsqOptions,
    importance: &[f32],
) -> Result<EncodedTensor, CodecError> {
    ndsq::encode(w, rows, cols, rows_per_block, opts, Some(importance))
}

/// Scalar groups of `p.bits` bits and `p.group` values tried on `rows` (rows × `cols`,
/// e.g. a sample of a tensor's rows), each column weighted as [`encode_ndsq_weighted`]
/// weights it by `importance` (mean 1), or 1: the error they leave, Σ weight·(x − x̂)²,
/// and the R part of the block payload they make (group parameters and codes), whose
/// compressibility the caller may measure. What `convert --bpw` ranks settings by.
pub fn sq_trial(
    rows: &[f32],
    cols: u64,
    p: SqParams,
    importance: Option<&[f32]>,
) -> Result<(f64, Vec<u8>), CodecError> {
    let shape = sq::SqShape::new(p.bits, p.group, cols).map_err(CodecError::Params)?;
    let cw = match importance {
        Some(imp) => ndsq::column_weights(imp, cols as usize)?,
        None => None,
    };
    sq::trial(rows, shape, cw.as_deref()).map_err(CodecError::Params)
}

/// What turns an error weighted as [`sq_trial`] weighs it (importance over its mean)
/// into one where a column of median importance counts 1: 1 / the median column
/// weight. Errors so scaled compare across tensors; mean-1 weights do not, for a few
/// columns with massive activations (ffn_down's inputs) shrink every other column's
/// weight and make the tensor look cheap to starve (docs/CODECS.md, "Bits-per-weight
/// target", measures both).
pub fn median_column_scale(importance: &[f32], cols: u64) -> Result<f64, CodecError> {
    let Some(mut w) = ndsq::column_weights(importance, cols as usize)? else {
        return Ok(1.0);
    };
    if w.is_empty() {
        return Ok(1.0);
    }
    let mid = w.len() / 2;
    let (_, median, _) = w.select_nth_unstable_by(mid, f32::total_cmp);
    Ok(1.0 / *median as f64)
}

/// `w` (`rows × cols`) rounded into `ty`'s blocks, each column's error weighted by
/// `importance` (as [`encode_ndsq_weighted`] weighs it) when given.
pub fn encode_ggml(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    ty: GgmlType,
    importance: Option<&[f32]>,
) -> Result<EncodedTensor, CodecError> {
    ggml::encode(w, rows, cols, rows_per_block, ty, importance)
}

/// [`encode_ggml`] with error feedback across columns from `h`, the `cols × cols`
/// second moment of the layer's inputs over calibration text (GPTQ with whole blocks).
pub fn encode_ggml_feedback(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    ty: GgmlType,
    h: &[f32],
) -> Result<EncodedTensor, CodecError> {
    ggml::encode_feedback(w, rows, cols, rows_per_block, ty, h)
}

/// `enc` (a `ggml` tensor) with each row block's blocks stored in planes
/// (`ggml_planes`): scales and codes compressed apart, the archive's own block
/// compression then has nothing left to gain. Types without a plane layout stay as
/// they are.
pub fn into_planes(mut enc: EncodedTensor) -> Result<EncodedTensor, CodecError> {
    let TensorCodec::Ggml { ty } = enc.codec else {
        return Err(CodecError::Params("only ggml blocks go into planes".into()));
    };
    if !planes::has_planes(ty) {
        return Ok(enc);
    }
    enc.blocks = enc
        .blocks
        .iter()
        .map(|b| planes::pack(ty, b))
        .collect::<Result<_, _>>()?;
    enc.codec = TensorCodec::GgmlPlanes { ty };
    Ok(enc)
}

/// Bytes `blocks` (whole blocks of `ty`) take in planes, or None where `ty` has no
/// plane layout.
pub fn planes_bytes(ty: GgmlType, blocks: &[u8]) -> Result<Option<usize>, CodecError> {
    if !planes::has_planes(ty) {
        return Ok(None);
    }
    planes::pack(ty, blocks).map(|p| Some(p.len()))
}

/// A stored block's payload as every other function here takes it: unchanged, except a
/// `ggml_planes` block, whose planes are unpacked into its `block_rows × cols` values'
/// blocks (Some). Corrupt planes are an error, never other bytes.
pub fn unpack_block(
    codec: &TensorCodec,
    payload: &[u8],
    block_rows: u64,
    cols: u64,
) -> Result<Option<Vec<u8>>, CodecError> {
    let TensorCodec::GgmlPlanes { ty } = codec else {
        return Ok(None);
    };
    let per_row = ty.row_bytes(cols).ok_or_else(|| {
        CodecError::Corrupt(format!(
            "{ty:?}: rows of {cols} values are not whole blocks"
        ))
    })? / ty.block().1;
    let n = block_rows
        .checked_mul(per_row)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| CodecError::Corrupt(format!("{block_rows} rows of {cols} overflow")))?;
    planes::unpack(*ty, payload, n).map(Some)
}

/// Whether rows of `cols` values can be coded as `ty`'s blocks.
pub fn ggml_fits(ty: GgmlType, cols: u64) -> bool {
    ggml::fits(ty, cols)
}

/// `ty` tried on `rows` as [`sq_trial`] tries scalar groups: the weighted error left
/// and the blocks made.
pub fn ggml_trial(
    rows: &[f32],
    cols: u64,
    ty: GgmlType,
    importance: Option<&[f32]>,
) -> Result<(f64, Vec<u8>), CodecError> {
    ggml::trial(rows, cols, ty, importance)
}

/// The bytes a block of this codec stores rows as, when they are ggml blocks or source
/// bytes a view can serve unchanged (passthrough, ggml blocks); None for NDSQ.
pub fn raw_format(codec: &TensorCodec) -> Option<SourceType> {
    match codec {
        TensorCodec::Passthrough { format } => Some(*format),
        TensorCodec::Ggml { ty } | TensorCodec::GgmlPlanes { ty } => Some(SourceType::Ggml(*ty)),
        TensorCodec::Ndsq { .. } => None,
    }
}

pub fn encode_passthrough(
    raw: &[u8],
    format: SourceType,
    rows: u64,
    cols: u64,
    rows_per_block: u64,
) -> Result<EncodedTensor, CodecError> {
    passthrough::encode(raw, format, rows, cols, rows_per_block)
}

/// Bytes of one row of `cols` elements stored as passthrough in `format`.
pub fn passthrough_row_bytes(format: SourceType, cols: u64) -> Result<u64, CodecError> {
    passthrough::row_bytes(format, cols)
}

pub fn decode_global(
    codec: &TensorCodec,
    global: &[u8],
    rows: u64,
    cols: u64,
) -> Result<DecodedGlobal, CodecError> {
    let inner = match codec {
        TensorCodec::Passthrough { .. }
        | TensorCodec::Ggml { .. }
        | TensorCodec::GgmlPlanes { .. } => {
            if !global.is_empty() {
                return Err(CodecError::Corrupt(format!(
                    "passthrough or ggml global blob must be empty, has {} bytes",
                    global.len()
                )));
            }
            GlobalInner::Passthrough
        }
        TensorCodec::Ndsq {
            rank,
            pq_dim,
            pq_k,
            sq,
            ..
        } => GlobalInner::Ndsq(ndsq::NdsqGlobal::parse(
            global, rows, cols, *rank, *pq_dim, *pq_k, *sq,
        )?),
    };
    Ok(DecodedGlobal {
        inner,
        key: xxhash_rust::xxh3::xxh3_128(global),
    })
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
    let parts = block_parts(
        codec,
        global,
        payload,
        block_first_row,
        block_rows,
        cols,
        r0,
        r1,
    )?;
    if parts.values() != out.len() {
        return Err(CodecError::Params(format!(
            "output has {} values, rows {r0}..{r1} × {cols} cols need {}",
            out.len(),
            parts.values()
        )));
    }
    parts.decode(out);
    Ok(())
}

/// Rows `r0..r1` of one block, checked and split into what they are computed from.
/// Every check a decode needs happens here, so decoding cannot fail: a reconstruction
/// backend (the CPU's [`BlockParts::decode`], or a GPU computing the same arithmetic
/// from the parts) gets only valid input.
pub enum BlockParts<'a> {
    /// Source bytes of the rows (f32 / f16 / bf16, or whole ggml blocks per row).
    Raw {
        format: SourceType,
        bytes: &'a [u8],
        rows: usize,
        cols: usize,
    },
    Ndsq(ndsq::NdsqParts<'a>),
}

pub use ndsq::NdsqParts;

impl BlockParts<'_> {
    pub fn rows(&self) -> usize {
        match self {
            BlockParts::Raw { rows, .. } => *rows,
            BlockParts::Ndsq(p) => p.rows(),
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            BlockParts::Raw { cols, .. } => *cols,
            BlockParts::Ndsq(p) => p.cols(),
        }
    }

    /// Values the rows hold (`rows × cols`).
    pub fn values(&self) -> usize {
        self.rows() * self.cols()
    }

    /// The rows as f32 into `out` (`values()` long), on this thread.
    pub fn decode(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.values(), "BlockParts::decode output length");
        match self {
            BlockParts::Raw {
                format,
                bytes,
                cols,
                ..
            } => passthrough::decode_checked(*format, bytes, *cols, out),
            BlockParts::Ndsq(p) => p.decode(out),
        }
    }
}

/// Checks rows `r0..r1` of a block of `block_rows` rows and returns its parts.
#[allow(clippy::too_many_arguments)]
pub fn block_parts<'a>(
    codec: &TensorCodec,
    global: &'a DecodedGlobal,
    payload: &'a [u8],
    block_first_row: u64,
    block_rows: u64,
    cols: u64,
    r0: u64,
    r1: u64,
) -> Result<BlockParts<'a>, CodecError> {
    let (rows, cols_us) = check_rows(block_rows, cols, r0, r1)?;
    match (raw_format(codec), &global.inner) {
        (Some(format), GlobalInner::Passthrough) => {
            let bytes = passthrough::raw_rows(format, payload, block_rows, cols_us, r0, r1)?;
            if let SourceType::Ggml(ty) = format {
                if !crate::gguf::quant::is_supported(ty) {
                    return Err(CodecError::Corrupt(format!(
                        "passthrough {ty:?} rows cannot be dequantized"
                    )));
                }
            }
            Ok(BlockParts::Raw {
                format,
                bytes,
                rows,
                cols: cols_us,
            })
        }
        (None, GlobalInner::Ndsq(g)) => {
            g.check_cols(cols)?;
            let view = ndsq::BlockView::parse(g, payload, block_first_row, block_rows)?;
            Ok(BlockParts::Ndsq(NdsqParts::new(
                g,
                global.key,
                view,
                r0 as usize,
                r1 as usize,
            )))
        }
        _ => Err(CodecError::Params(
            "decoded global belongs to a different codec".into(),
        )),
    }
}

/// `out[i, :] += Σ_k u[i, k] · vt[k, :]` for every row i, k ascending: one rounded
/// multiply and one rounded add per term, never fused, so any implementation that
/// keeps this order (a GPU's included) gets the same bits. NDSQ's L and the delta
/// kind's U·Vᵀ both use it.
pub fn add_low_rank(out: &mut [f32], u: &[f32], vt: &[f32], rank: usize, cols: usize) {
    if rank == 0 || cols == 0 {
        return;
    }
    debug_assert!(u.len() * cols == out.len() * rank && vt.len() == rank * cols);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { add_low_rank_avx2(out, u, vt, rank, cols) };
        return;
    }
    add_low_rank_generic(out, u, vt, rank, cols)
}

/// The same loop compiled with AVX2: wider vectors across columns, the same operations
/// per element in the same order (Rust never contracts a multiply and an add).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_low_rank_avx2(out: &mut [f32], u: &[f32], vt: &[f32], rank: usize, cols: usize) {
    add_low_rank_generic(out, u, vt, rank, cols)
}

#[inline(always)]
fn add_low_rank_generic(out: &mut [f32], u: &[f32], vt: &[f32], rank: usize, cols: usize) {
    for (row, ui) in out.chunks_exact_mut(cols).zip(u.chunks_exact(rank)) {
        for (&uk, vk) in ui.iter().zip(vt.chunks_exact(cols)) {
            for (o, &v) in row.iter_mut().zip(vk) {
                *o += uk * v;
            }
        }
    }
}

/// Rows `r0..r1` (relative to the block) of a passthrough block as the source's own
/// bytes, for views that serve them unchanged. Any other codec is refused.
pub fn raw_block_rows<'a>(
    codec: &TensorCodec,
    payload: &'a [u8],
    block_rows: u64,
    cols: u64,
    r0: u64,
    r1: u64,
) -> Result<&'a [u8], CodecError> {
    let Some(format) = raw_format(codec) else {
        return Err(CodecError::Params(
            "only passthrough and ggml blocks hold servable bytes".into(),
        ));
    };
    if r0 > r1 || r1 > block_rows {
        return Err(CodecError::Params(format!(
            "rows {r0}..{r1} out of range for a block of {block_rows} rows"
        )));
    }
    let cols =
        usize::try_from(cols).map_err(|_| CodecError::Params(format!("cols {cols} too large")))?;
    passthrough::raw_rows(format, payload, block_rows, cols, r0, r1)
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
    let cols_us =
        usize::try_from(cols).map_err(|_| CodecError::Params(format!("cols {cols} too large")))?;
    if x.len() != cols_us {
        return Err(CodecError::Params(format!(
            "x has {} values, cols is {cols}",
            x.len()
        )));
    }
    if y.len() as u64 != block_rows {
        return Err(CodecError::Params(format!(
            "y has {} values, block has {block_rows} rows",
            y.len()
        )));
    }
    match (raw_format(codec), &global.inner) {
        (Some(format), GlobalInner::Passthrough) => {
            passthrough::apply(format, payload, block_rows, cols_us, x, y)
        }
        (None, GlobalInner::Ndsq(g)) => {
            g.check_cols(cols)?;
            let view = ndsq::BlockView::parse(g, payload, block_first_row, block_rows)?;
            view.apply(g, x, y);
            Ok(())
        }
        _ => Err(CodecError::Params(
            "decoded global belongs to a different codec".into(),
        )),
    }
}

/// Checks a row request against the block; returns (rows, cols).
fn check_rows(block_rows: u64, cols: u64, r0: u64, r1: u64) -> Result<(usize, usize), CodecError> {
    if r0 > r1 || r1 > block_rows {
        return Err(CodecError::Params(format!(
            "rows {r0}..{r1} out of range for a block of {block_rows} rows"
        )));
    }
    let rows = usize::try_from(r1 - r0)
        .map_err(|_| CodecError::Params(format!("{} rows too many", r1 - r0)))?;
    let cols_us =
        usize::try_from(cols).map_err(|_| CodecError::Params(format!("cols {cols} too large")))?;
    rows.checked_mul(cols_us)
        .ok_or_else(|| CodecError::Params(format!("{rows} rows × {cols} cols overflows")))?;
    Ok((rows, cols_us))
}

/// Rows `start..end` of block `b` of a `rows`-row tensor cut into `rows_per_block`-row blocks.
pub fn block_row_range(rows: u64, rows_per_block: u64, b: u64) -> (u64, u64) {
    let start = b.saturating_mul(rows_per_block).min(rows);
    let end = start.saturating_add(rows_per_block).min(rows);
    (start, end)
}

/// Number of row blocks of a `rows`-row tensor (`rows_per_block` ≥ 1).
pub fn block_count(rows: u64, rows_per_block: u64) -> u64 {
    rows.div_ceil(rows_per_block.max(1))
}

/// A little-endian cursor over untrusted bytes: every read is bounds-checked.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, pos: 0, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(CodecError::Corrupt(format!(
                "{}: needs {n} bytes at offset {}, only {} in total",
                self.what,
                self.pos,
                self.buf.len()
            ))),
        }
    }
    /// `count` items of `size` bytes each.
    fn take_n(&mut self, count: usize, size: usize) -> Result<&'a [u8], CodecError> {
        let n = count.checked_mul(size).ok_or_else(|| {
            CodecError::Corrupt(format!("{}: {count} × {size} bytes overflows", self.what))
        })?;
        self.take(n)
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn f32(&mut self) -> Result<f32, CodecError> {
        Ok(f32::from_bits(self.u32()?))
    }
    fn finish(&self) -> Result<(), CodecError> {
        if self.pos != self.buf.len() {
            return Err(CodecError::Corrupt(format!(
                "{}: {} trailing bytes after offset {}",
                self.what,
                self.buf.len() - self.pos,
                self.pos
            )));
        }
        Ok(())
    }
}

/// Blocks of a tensor as (first row, rows) pairs.
fn blocks_of(rows: u64, rows_per_block: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..block_count(rows, rows_per_block)).map(move |b| {
        let (s, e) = block_row_range(rows, rows_per_block, b);
        (s, e - s)
    })
}

/// Short human label of how a tensor is coded, as reports and `inspect` print it.
pub fn codec_label(c: &TensorCodec) -> String {
    match c {
        TensorCodec::Passthrough { format } => format!("passthrough({})", format_label(*format)),
        TensorCodec::Ggml { ty } | TensorCodec::GgmlPlanes { ty } => {
            format!("ggml({})", format_label(SourceType::Ggml(*ty)))
        }
        TensorCodec::Ndsq {
            rank, sq: Some(s), ..
        } => format!("ndsq(r={rank},sq={}b/{})", s.bits, s.group),
        TensorCodec::Ndsq {
            rank, pq_dim, pq_k, ..
        } => format!("ndsq(r={rank},d={pq_dim},k={pq_k})"),
    }
}

/// A source type's short name ("f16", "q4_1", "i64").
pub fn format_label(s: SourceType) -> String {
    match s {
        SourceType::F32 => "f32".into(),
        SourceType::F16 => "f16".into(),
        SourceType::BF16 => "bf16".into(),
        SourceType::Ggml(t) => format!("{t:?}").to_lowercase(),
        SourceType::Plain(p) => format!("{p:?}").to_lowercase(),
    }
}
