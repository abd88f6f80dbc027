//! The `.cawsf` container (see docs/FORMAT.md): header + TOC of 4 KiB-aligned sections
//! (META, CODEBOOKS, SHARD_BANK, ROUTING), a tensor table, row blocks compressed and
//! checksummed one by one, and an index from (tensor, row) to block.
//!
//! STUB: to be implemented.

use std::path::{Path, PathBuf};

use crate::codec::{EncodedTensor, TensorCodec};
use crate::model::{ModelDesc, ReadError, RowSource};

#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Compression applied to each block / section payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Zstd(i32),
    Lz4,
}

/// Streaming writer: tensors are added in model order as they are encoded, then
/// `finish` writes META, CODEBOOKS and ROUTING and the header/TOC.
pub struct ArchiveWriter {
    _private: (),
}

impl ArchiveWriter {
    pub fn create(path: &Path, compression: Compression) -> Result<ArchiveWriter, ArchiveError> {
        let _ = (path, compression);
        todo!()
    }
    /// Add tensor `index` (its position in `ModelDesc::tensors`); tensors must come in order.
    pub fn add_tensor(
        &mut self,
        index: usize,
        rows_per_block: u64,
        encoded: &EncodedTensor,
    ) -> Result<(), ArchiveError> {
        let _ = (index, rows_per_block, encoded);
        todo!()
    }
    /// `extra` is free-form JSON stored in META (conversion options, report).
    pub fn finish(
        self,
        model: &ModelDesc,
        extra: serde_json::Value,
        routing: &[u8],
    ) -> Result<u64, ArchiveError> {
        let _ = (model, extra, routing);
        todo!()
    }
}

/// What `inspect` shows about one tensor.
#[derive(Clone, Debug)]
pub struct TensorEntryInfo {
    pub codec: TensorCodec,
    pub rows_per_block: u64,
    pub n_blocks: usize,
    /// Stored (compressed) bytes of global blob + blocks.
    pub stored_bytes: u64,
}

#[derive(Clone, Debug)]
pub struct SectionInfo {
    pub kind: String,
    pub offset: u64,
    pub size: u64,
    pub flags: u32,
}

/// An opened archive (memory-mapped). Implements [`RowSource`].
pub struct Archive {
    pub path: PathBuf,
    _private: (),
}

impl Archive {
    pub fn open(path: &Path) -> Result<Archive, ArchiveError> {
        let _ = path;
        todo!()
    }
    pub fn model(&self) -> &ModelDesc {
        todo!()
    }
    pub fn extra(&self) -> &serde_json::Value {
        todo!()
    }
    pub fn sections(&self) -> Vec<SectionInfo> {
        todo!()
    }
    pub fn tensor_info(&self, tensor: usize) -> TensorEntryInfo {
        let _ = tensor;
        todo!()
    }
    pub fn routing(&self) -> &[u8] {
        todo!()
    }
    /// Check every checksum; Err names the first bad section or block.
    pub fn verify(&self) -> Result<(), ReadError> {
        todo!()
    }
    /// y = Ŵx for tensor `tensor`, from the components.
    pub fn apply(&self, tensor: usize, x: &[f32]) -> Result<Vec<f32>, ReadError> {
        let _ = (tensor, x);
        todo!()
    }
}

impl RowSource for Archive {
    fn read_rows(&self, tensor: usize, r0: u64, r1: u64, out: &mut [f32]) -> Result<(), ReadError> {
        let _ = (tensor, r0, r1, out);
        todo!()
    }
}

impl Archive {
    /// Absolute file offset and stored length of a block (for tools and tests).
    pub fn block_location(&self, tensor: usize, block: usize) -> (u64, u64) {
        let _ = (tensor, block);
        todo!()
    }
}
