//! GGUF v3 header serialization for the virtual GGUF layout. STUB: to be implemented.

use super::{GgmlType, GgufValue};

#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorEntry {
    pub name: String,
    /// ggml order (`ne[0]` fastest).
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    /// Offset relative to the data section, a multiple of the alignment.
    pub offset: u64,
    pub n_bytes: u64,
}

/// A complete GGUF header: magic, version, counts, metadata, tensor infos, and the
/// padding up to the aligned start of the data section.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub meta: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensorEntry>,
    pub alignment: u64,
}

impl GgufHeader {
    /// Lay tensors out in the given order, each at the next multiple of `alignment`.
    /// `general.alignment` is written into the metadata (replacing any existing one).
    pub fn new(
        meta: Vec<(String, GgufValue)>,
        tensors: Vec<(String, Vec<u64>, GgmlType)>,
        alignment: u64,
    ) -> GgufHeader {
        let _ = (meta, tensors, alignment);
        todo!()
    }
    /// Serialized header including padding; the data section starts at `len()`.
    pub fn to_bytes(&self) -> Vec<u8> {
        todo!()
    }
    /// Size of the data section (last tensor end, padded to the alignment).
    pub fn data_size(&self) -> u64 {
        todo!()
    }
}
