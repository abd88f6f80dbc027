//! Virtual layouts: a virtual file is header bytes plus tensor data; a layout maps any
//! byte range of it to header bytes and (tensor, row span) reads through a
//! [`RowSource`]. The mount serves these and `cawsfs export` streams the same code
//! into a real file, so the two are byte-identical by construction.
//!
//! A [`VirtualFile`] is a sorted list of pieces covering `[0, size)`: literal bytes
//! (headers, small metadata files), zero padding, and tensor data in a float dtype
//! (optionally with llama.cpp's rotary row permutation). `read_at` asks the row source
//! only for the rows overlapping the requested range.

use std::sync::Arc;

use crate::gguf::quantize::can_quantize;
use crate::gguf::GgmlType;
use crate::model::{FloatType, ModelDesc, PlainType, ReadError, RowSource};

mod experts;
mod gguf;
mod hfmeta;
mod packed;
mod preset;
mod read;
mod safetensors;
mod tokenizer;
mod tokjson;
mod view;

#[cfg(test)]
mod tests;

pub use self::experts::{expert_extents, ExpertExtents, ExpertTensors};
pub use self::gguf::gguf_pre_tokenizer_name;
pub use self::preset::{fallback, preset_types, Preset, PresetModel, PresetTensor};
use self::read::read_tensor;
pub use self::read::{keep_scratch_buffers, SCRATCH_BUFFER_BYTES};
pub use self::view::{
    bits, held_of, notes as gguf_notes, plan as gguf_plan, summary as gguf_summary, type_name,
    GgufPlan, GgufView, Held, TensorView,
};

#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Metadata(String),
    /// The model's architecture has no GGUF view; the other views are served.
    #[error("{0}")]
    NoGguf(String),
}

/// At most this many bytes of f32 rows are decoded at once by one `read_at` step, so a
/// large read (an 8 MiB export chunk) is a few row runs and memory stays bounded.
const SCRATCH_F32_BYTES: u64 = 1 << 20;

/// The version of the code that turns a layout into bytes: codecs' decoders, the
/// quantizers, the rotary permutation, f16/bf16 conversion. Bump it with any change
/// that makes a view serve other bytes for the same archive and options; it is part of
/// every file's [`VirtualFile::fingerprint`], so disk tiers made by older builds are
/// not served by newer ones (docs/TIER.md, "Identity").
pub const BYTES_VERSION: u32 = 1;

/// A single row larger than this is refused when a layout is built: one row is the
/// smallest unit a read decodes, so it bounds the memory of any read.
const MAX_ROW_F32_BYTES: u64 = 256 << 20;

/// A transposed tensor larger than this (as f32) is refused: every read of one
/// decodes the whole tensor, so it is the smallest unit such a read decodes and is
/// bounded as a row is (GPT-2 XL's largest is 41 MB).
const MAX_TRANSPOSED_F32_BYTES: u64 = MAX_ROW_F32_BYTES;

/// How a tensor piece's bytes are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fill {
    /// Encoded from f32 rows into a float type or ggml blocks.
    Encode(GgmlType),
    /// The archive's stored source bytes (ggml blocks or floats of this type), copied
    /// as they are (`RowSource::read_raw_rows`).
    Copy(GgmlType),
    /// A plain type's stored bytes (integers, booleans ...), copied as they are.
    CopyPlain(PlainType),
}

impl Fill {
    fn is_copy(self) -> bool {
        !matches!(self, Fill::Encode(_))
    }
    fn type_id(self) -> u32 {
        match self {
            Fill::Encode(t) | Fill::Copy(t) => t.id(),
            Fill::CopyPlain(p) => p.id(),
        }
    }
    fn row_bytes(self, cols: u64) -> Option<u64> {
        match self {
            Fill::Encode(t) | Fill::Copy(t) => t.row_bytes(cols),
            Fill::CopyPlain(p) => cols.checked_mul(p.size()),
        }
    }
}

/// Tensor data of one piece: `rows × cols` values of `tensor`, served as `fill` says
/// (a row is always a whole number of blocks).
#[derive(Clone, Debug)]
struct TensorPiece {
    tensor: usize,
    fill: Fill,
    rows: u64,
    cols: u64,
    row_bytes: u64,
    /// llama.cpp rotary permutation with this many heads: output row `g` is source
    /// row `names::gguf_row_to_hf(g, rows, heads)` (elements for a 1-D tensor).
    permute: Option<u32>,
    /// Added to every value before it is encoded (Gemma's norms: llama.cpp's converter
    /// stores `1 + w` for the `w` transformers multiplies by `1 + w`); 0 for none.
    add: f32,
    /// Served transposed: output row `r` is column `r` of the stored `cols × rows`
    /// tensor (GPT-2's `Conv1D` weights in llama.cpp's orientation).
    transpose: bool,
}

#[derive(Clone, Debug)]
enum PieceKind {
    Bytes(packed::Packed),
    Zeros,
    Tensor(TensorPiece),
}

#[derive(Clone, Debug)]
struct Piece {
    start: u64,
    len: u64,
    kind: PieceKind,
}

/// Builds the piece list in file order; zero-length pieces are dropped so every piece
/// covers at least one byte (binary search relies on strictly increasing starts).
struct Builder {
    pieces: Vec<Piece>,
    pos: u64,
    ranges: Vec<(usize, u64, u64)>,
    /// Over every piece as it is pushed: literal bytes, zero runs, and each tensor's
    /// index, type, shape, permutation and source (see [`VirtualFile::fingerprint`]).
    fingerprint: xxhash_rust::xxh3::Xxh3,
}

impl Default for Builder {
    fn default() -> Self {
        let mut fingerprint = xxhash_rust::xxh3::Xxh3::new();
        fingerprint.update(&BYTES_VERSION.to_le_bytes());
        Builder {
            pieces: Vec::new(),
            pos: 0,
            ranges: Vec::new(),
            fingerprint,
        }
    }
}

impl Builder {
    fn push(&mut self, len: u64, kind: PieceKind) -> Result<(), LayoutError> {
        let (tag, what): (u8, Vec<u64>) = match &kind {
            PieceKind::Bytes(_) => (0, vec![]),
            PieceKind::Zeros => (1, vec![]),
            PieceKind::Tensor(t) => {
                let mut v = vec![
                    t.tensor as u64,
                    t.fill.type_id() as u64,
                    t.fill.is_copy() as u64,
                    t.rows,
                    t.cols,
                    t.permute.map_or(0, |h| h as u64 + 1),
                ];
                // Only when set, so files without them keep their fingerprints.
                if t.add != 0.0 {
                    v.push(t.add.to_bits() as u64);
                }
                if t.transpose {
                    v.push(u64::MAX);
                }
                (2, v)
            }
        };
        self.fingerprint.update(&[tag]);
        for x in std::iter::once(len).chain(what) {
            self.fingerprint.update(&x.to_le_bytes());
        }
        let start = self.pos;
        self.pos = start
            .checked_add(len)
            .ok_or_else(|| LayoutError::Metadata("virtual file size overflows u64".into()))?;
        if len > 0 {
            self.pieces.push(Piece { start, len, kind });
        }
        Ok(())
    }
    fn bytes(&mut self, b: Vec<u8>) -> Result<(), LayoutError> {
        self.fingerprint.update(&b);
        let b = packed::Packed::raw(b);
        self.push(b.len() as u64, PieceKind::Bytes(b))
    }
    fn zeros(&mut self, len: u64) -> Result<(), LayoutError> {
        self.push(len, PieceKind::Zeros)
    }
    /// Append a tensor's data as `ty`, encoded from f32 rows or (`raw`) copied from
    /// the archive's stored bytes; `name` is for error messages.
    fn tensor(
        &mut self,
        name: &str,
        tensor: usize,
        rows: u64,
        cols: u64,
        (ty, raw): (GgmlType, bool),
        permute: Option<u32>,
    ) -> Result<u64, LayoutError> {
        if !raw {
            encodable(name, ty)?;
        }
        let fill = if raw {
            Fill::Copy(ty)
        } else {
            Fill::Encode(ty)
        };
        self.piece(name, tensor, (rows, cols), fill, (permute, 0.0, false))
    }

    /// Append a tensor's values plus `add`, encoded as `ty`.
    fn tensor_plus(
        &mut self,
        name: &str,
        tensor: usize,
        (rows, cols): (u64, u64),
        ty: GgmlType,
        add: f32,
    ) -> Result<u64, LayoutError> {
        encodable(name, ty)?;
        self.piece(
            name,
            tensor,
            (rows, cols),
            Fill::Encode(ty),
            (None, add, false),
        )
    }

    /// Append the transpose of a stored `cols × rows` tensor as `rows × cols`,
    /// encoded as `ty`.
    fn tensor_transposed(
        &mut self,
        name: &str,
        tensor: usize,
        (rows, cols): (u64, u64),
        ty: GgmlType,
    ) -> Result<u64, LayoutError> {
        encodable(name, ty)?;
        if rows.saturating_mul(cols).saturating_mul(4) > MAX_TRANSPOSED_F32_BYTES {
            return Err(LayoutError::Unsupported(format!(
                "tensor {name}: {rows}x{cols} is too large to serve transposed (at most {} MiB as f32)",
                MAX_TRANSPOSED_F32_BYTES >> 20
            )));
        }
        self.piece(
            name,
            tensor,
            (rows, cols),
            Fill::Encode(ty),
            (None, 0.0, true),
        )
    }

    /// Append a plain-typed tensor's stored bytes.
    fn plain_tensor(
        &mut self,
        name: &str,
        tensor: usize,
        (rows, cols): (u64, u64),
        ty: PlainType,
    ) -> Result<u64, LayoutError> {
        self.piece(
            name,
            tensor,
            (rows, cols),
            Fill::CopyPlain(ty),
            (None, 0.0, false),
        )
    }

    fn piece(
        &mut self,
        name: &str,
        tensor: usize,
        (rows, cols): (u64, u64),
        fill: Fill,
        (permute, add, transpose): (Option<u32>, f32, bool),
    ) -> Result<u64, LayoutError> {
        let raw = fill.is_copy();
        let (row_bytes, len) = tensor_bytes(name, rows, cols, fill)?;
        if raw && rows == 1 && permute.is_some() {
            return Err(LayoutError::Unsupported(format!(
                "tensor {name}: a permuted 1-D tensor cannot be served as stored bytes"
            )));
        }
        if let Some(h) = permute {
            // A 1-D tensor (a bias) is permuted element-wise.
            let n = if rows == 1 { cols } else { rows };
            if h == 0 || n % h as u64 != 0 || (n / h as u64) % 2 != 0 {
                return Err(LayoutError::Metadata(format!(
                    "tensor {name}: {n} rows cannot be split into {h} rotary heads of even size"
                )));
            }
        }
        let start = self.pos;
        self.push(
            len,
            PieceKind::Tensor(TensorPiece {
                tensor,
                fill,
                rows,
                cols,
                row_bytes,
                permute,
                add,
                transpose,
            }),
        )?;
        self.ranges.push((tensor, start, start + len));
        Ok(len)
    }
    fn finish(self, name: &str) -> VirtualFile {
        VirtualFile {
            name: name.to_string(),
            size: self.pos,
            inner: Arc::new(Inner {
                pieces: self.pieces,
                ranges: self.ranges,
                fingerprint: self.fingerprint.digest(),
            }),
        }
    }
}

/// Refuses a type the layout cannot encode f32 rows into.
fn encodable(name: &str, ty: GgmlType) -> Result<(), LayoutError> {
    match can_quantize(ty) {
        true => Ok(()),
        false => Err(LayoutError::Unsupported(format!(
            "tensor {name}: cannot serve type {ty:?}"
        ))),
    }
}

/// Bytes of one row and of the whole `rows × cols` tensor as `fill` serves it,
/// refusing absurd shapes and rows that are not a whole number of blocks.
fn tensor_bytes(name: &str, rows: u64, cols: u64, fill: Fill) -> Result<(u64, u64), LayoutError> {
    let bad = || LayoutError::Metadata(format!("tensor {name}: shape {rows}x{cols} too large"));
    let row_f32 = cols.checked_mul(4).ok_or_else(bad)?;
    if row_f32 > MAX_ROW_F32_BYTES {
        return Err(bad());
    }
    let row = fill.row_bytes(cols).ok_or_else(|| {
        LayoutError::Unsupported(format!(
            "tensor {name}: rows of {cols} values are not a whole number of {fill:?} blocks"
        ))
    })?;
    Ok((row, rows.checked_mul(row).ok_or_else(bad)?))
}

#[derive(Debug)]
struct Inner {
    pieces: Vec<Piece>,
    ranges: Vec<(usize, u64, u64)>,
    fingerprint: u64,
}

/// One virtual file: its name, its exact size, and how to produce any byte range.
/// Cheap to clone (the layout is shared).
#[derive(Clone, Debug)]
pub struct VirtualFile {
    pub name: String,
    pub size: u64,
    inner: Arc<Inner>,
}

impl VirtualFile {
    /// A file whose content is these bytes (config.json and friends), so every virtual
    /// file reads the same way.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> VirtualFile {
        let mut b = Builder::default();
        // A Vec's length always fits u64; push cannot overflow from 0.
        let _ = b.bytes(bytes);
        let f = b.finish(name);
        // Made when first asked for (the metadata files), so off a restart's path.
        f.pack();
        f
    }

    /// Compress the file's literal bytes (its header) in memory, if that has not been
    /// done: a layout holds them raw when built, so that a mount is up without waiting
    /// for the compression; the mount packs them in the background.
    pub fn pack(&self) {
        for p in &self.inner.pieces {
            if let PieceKind::Bytes(b) = &p.kind {
                b.pack();
            }
        }
    }

    /// XXH3-64 over [`BYTES_VERSION`] and what the file is made of: its literal bytes
    /// (headers), zero runs, and for each tensor its index in the archive, type, shape,
    /// rotary permutation and whether its stored bytes are copied. With the archive's
    /// identity it determines the file's bytes; it keys the disk tier.
    pub fn fingerprint(&self) -> u64 {
        self.inner.fingerprint
    }

    /// (tensor index, start byte, end byte) of each tensor's data in this file, in
    /// file order.
    pub fn tensor_ranges(&self) -> Vec<(usize, u64, u64)> {
        self.inner.ranges.clone()
    }

    /// Memory a read of this file may hold while it decodes, per byte read: the output
    /// plus the f32 rows it is encoded from (`read_at` decodes whole rows into f32
    /// before converting them), so 3 for a 16-bit view, 2 for f32, 9 for 4-bit blocks,
    /// and 2 for stored bytes copied as they are. The mount's cache counts this against
    /// its budget for every load in flight.
    pub fn load_work_factor(&self) -> u64 {
        let widest = self.inner.pieces.iter().filter_map(|p| match &p.kind {
            PieceKind::Tensor(t) => match t.fill {
                Fill::Encode(ty) => {
                    let (e, b) = ty.block();
                    Some((4 * e).div_ceil(b))
                }
                Fill::Copy(_) | Fill::CopyPlain(_) => Some(1),
            },
            _ => None,
        });
        1 + widest.max().unwrap_or(0)
    }

    /// Fill `buf` with the bytes at `offset` (short only at end of file); returns the
    /// number of bytes written. Decodes only the rows overlapping the range.
    pub fn read_at(
        &self,
        src: &dyn RowSource,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize, ReadError> {
        if offset >= self.size || buf.is_empty() {
            return Ok(0);
        }
        let n = (buf.len() as u64).min(self.size - offset) as usize;
        let pieces = &self.inner.pieces;
        // pieces[0].start == 0 and pieces cover [0, size), so this is >= 1.
        let mut i = pieces.partition_point(|p| p.start <= offset) - 1;
        let mut done = 0usize;
        while done < n {
            let pos = offset + done as u64;
            let p = &pieces[i];
            let rel = pos - p.start;
            let take = (p.len - rel).min((n - done) as u64) as usize;
            let out = &mut buf[done..done + take];
            match &p.kind {
                PieceKind::Bytes(b) => b.read(rel as usize, out),
                PieceKind::Zeros => out.fill(0),
                PieceKind::Tensor(t) => read_tensor(src, t, rel, out)?,
            }
            done += take;
            i += 1;
        }
        Ok(n)
    }
}

/// `model.safetensors`: HF names, `dtype` per float tensor (None: the source's float
/// type), plain tensors as their own type. One file whatever its size.
pub fn safetensors_file(
    model: &ModelDesc,
    dtype: Option<FloatType>,
) -> Result<VirtualFile, LayoutError> {
    let (mut files, _) = safetensors::build_view(model, dtype, u64::MAX)?;
    Ok(files.remove(0))
}

pub use self::safetensors::DEFAULT_SHARD_BYTES;

/// The safetensors view as a mount and an `hf-dir` export serve it: `model.safetensors`
/// while its tensors take at most `max_shard` bytes, else Hugging Face's shards
/// `model-0000i-of-0000N.safetensors` and the bytes of `model.safetensors.index.json`.
pub fn safetensors_view(
    model: &ModelDesc,
    dtype: Option<FloatType>,
    max_shard: u64,
) -> Result<(Vec<VirtualFile>, Option<Vec<u8>>), LayoutError> {
    safetensors::build_view(model, dtype, max_shard)
}

/// The name of the sharded view's index.
pub const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

/// llama.cpp's architecture name for `model`, or why it has no GGUF view (one line).
pub fn gguf_arch(model: &ModelDesc) -> Result<&str, LayoutError> {
    model.arch.gguf_arch.as_deref().ok_or_else(|| {
        LayoutError::NoGguf(format!(
            "no model.gguf for model type {:?}: llama.cpp's tensor names for it are not known to cawsfs (they are for {})",
            model.arch.model_type,
            crate::model::names::GGUF_ARCHS.map(|(m, _)| m).join(", ")
        ))
    })
}

/// `model.gguf`: GGUF v3, llama.cpp names and metadata, data aligned to
/// `general.alignment`, each tensor as `plan` (from [`gguf_plan`]) says.
pub fn gguf_file(model: &ModelDesc, plan: &GgufPlan) -> Result<VirtualFile, LayoutError> {
    gguf::build(model, plan, &gguf::header_with_writer)
}

/// About how many bytes the tokenizer.json of [`hf_metadata_files`] has, without making
/// it: its length from a HF source, an estimate from the vocabulary and merges of a GGUF
/// one (0 without either).
pub fn tokenizer_json_len_estimate(model: &ModelDesc) -> u64 {
    match model.hf_files.get("tokenizer.json") {
        Some(b) => b.len() as u64,
        None if model.hf_files.is_empty() => tokenizer::json_len_estimate(&model.gguf_meta),
        None => 0,
    }
}

/// Small metadata files (config.json, tokenizer.json, tokenizer_config.json,
/// generation_config.json ...): verbatim from a HF source, derived from GGUF metadata otherwise.
pub fn hf_metadata_files(model: &ModelDesc) -> Result<Vec<(String, Vec<u8>)>, LayoutError> {
    hfmeta::build(model)
}
