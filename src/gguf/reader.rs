//! Bounds-checked GGUF v3 reader (memory-mapped). STUB: to be implemented.

use std::path::{Path, PathBuf};

use super::{GgmlType, GgufValue};

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `ne[0]` is the fastest-varying (column) dimension.
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    /// Offset relative to the start of the data section.
    pub offset: u64,
    /// Bytes of this tensor's data.
    pub n_bytes: u64,
}

pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub meta: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    map: memmap2::Mmap,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let _ = path;
        todo!()
    }
    /// The raw bytes of tensor `i`.
    pub fn tensor_data(&self, i: usize) -> &[u8] {
        let t = &self.tensors[i];
        let s = (self.data_offset + t.offset) as usize;
        &self.map[s..s + t.n_bytes as usize]
    }
}
