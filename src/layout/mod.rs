//! Virtual layouts: a virtual file is header bytes plus tensor data; a layout maps any
//! byte range of it to header bytes and (tensor, row span) reads through a
//! [`RowSource`]. The mount serves these and `cawsfs export` streams the same code
//! into a real file, so the two are byte-identical by construction.
//!
//! STUB: to be implemented (safetensors.rs, gguf.rs, hfmeta.rs).

use crate::model::{FloatType, ModelDesc, ReadError, RowSource};

#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Metadata(String),
}

/// Tensor data type of the virtual GGUF file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufOutType {
    F16,
    F32,
    BF16,
}

/// One virtual file: its name, its exact size, and how to produce any byte range.
pub struct VirtualFile {
    pub name: String,
    pub size: u64,
    _private: (),
}

impl VirtualFile {
    /// Fill `buf` with the bytes at `offset` (short only at end of file); returns the
    /// number of bytes written. Decodes only the rows overlapping the range.
    pub fn read_at(
        &self,
        src: &dyn RowSource,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize, ReadError> {
        let _ = (src, offset, buf);
        todo!()
    }
}

/// `model.safetensors`: HF names, `dtype` per tensor (None: the source's float type).
pub fn safetensors_file(
    model: &ModelDesc,
    dtype: Option<FloatType>,
) -> Result<VirtualFile, LayoutError> {
    let _ = (model, dtype);
    todo!()
}

/// `model.gguf`: GGUF v3, llama.cpp names and metadata, data aligned to `general.alignment`.
pub fn gguf_file(model: &ModelDesc, ty: GgufOutType) -> Result<VirtualFile, LayoutError> {
    let _ = (model, ty);
    todo!()
}

/// Small metadata files (config.json, tokenizer.json, tokenizer_config.json,
/// generation_config.json ...): verbatim from a HF source, derived from GGUF metadata otherwise.
pub fn hf_metadata_files(model: &ModelDesc) -> Result<Vec<(String, Vec<u8>)>, LayoutError> {
    let _ = model;
    todo!()
}
