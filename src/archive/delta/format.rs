//! On-disk constants and records of the delta archive (docs/FORMAT-DELTA.md): the
//! fixed header, the 40-byte BLOB_INDEX entry and META's JSON shape. TOC records,
//! compression codes and (de)compression come from the `.cawsf` container's format.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::codec::delta::BaseDtype;
use crate::model::SourceType;

pub use crate::archive::container::{
    check_checksum_index, check_magic_version, check_meta_kind, check_toc, checked_payload,
    checksum_index, compress, invalid, io_error, le_u32, le_u64, load_section, map_container,
    model_from_meta, model_to_meta, pad16, pad_to_align, parse_toc, required, section_failures,
    section_infos, with_suffix, write_header, write_section, BlobFault, TocRecord, ALIGN, COMP_LZ4,
    COMP_RAW, MAX_ELEMENTS, META_ZSTD_LEVEL, TOC_RECORD,
};

pub const MAGIC: [u8; 8] = *b"CAWSDLT\0";
pub const VERSION: u32 = 1;
/// Bytes before the TOC records.
pub const HEADER_FIXED: usize = 28;
pub const INDEX_ENTRY: usize = 40;

pub const SEC_META: u32 = 1;
pub const SEC_DATA: u32 = 3;
pub const SEC_ROUTING: u32 = 4;
pub const SEC_BLOB_INDEX: u32 = 5;

pub const KIND_BASE: u8 = 1;
pub const KIND_U: u8 = 2;
pub const KIND_VT: u8 = 3;
pub const KIND_PASS: u8 = 4;

pub const DTYPE_F16: u8 = 1;
pub const DTYPE_INT8: u8 = 2;

pub fn section_name(ty: u32) -> String {
    match ty {
        SEC_META => "META".into(),
        SEC_DATA => "DATA".into(),
        SEC_ROUTING => "ROUTING".into(),
        SEC_BLOB_INDEX => "BLOB_INDEX".into(),
        other => format!("type{other}"),
    }
}

pub fn kind_name(kind: u8) -> &'static str {
    match kind {
        KIND_BASE => "base block",
        KIND_U => "U block",
        KIND_VT => "Vt blob",
        KIND_PASS => "block",
        _ => "blob",
    }
}

/// One BLOB_INDEX entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlobEntry {
    pub offset: u64,
    pub csize: u32,
    pub usize: u32,
    pub xxh3: u64,
    pub comp: u8,
    pub kind: u8,
    pub owner: u32,
    pub block: u32,
}

impl BlobEntry {
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.csize.to_le_bytes());
        out.extend_from_slice(&self.usize.to_le_bytes());
        out.extend_from_slice(&self.xxh3.to_le_bytes());
        out.push(self.comp);
        out.push(self.kind);
        out.extend_from_slice(&[0u8; 2]);
        out.extend_from_slice(&self.owner.to_le_bytes());
        out.extend_from_slice(&self.block.to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
    }
    /// `b` must be exactly 40 bytes; also returns whether the reserved bytes are zero.
    pub fn parse(b: &[u8]) -> (BlobEntry, bool) {
        let reserved_zero = b[26..28] == [0, 0] && b[36..40] == [0, 0, 0, 0];
        (
            BlobEntry {
                offset: le_u64(&b[0..8]),
                csize: le_u32(&b[8..12]),
                usize: le_u32(&b[12..16]),
                xxh3: le_u64(&b[16..24]),
                comp: b[24],
                kind: b[25],
                owner: le_u32(&b[28..32]),
                block: le_u32(&b[32..36]),
            },
            reserved_zero,
        )
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetaBase {
    #[serde(rename = "type")]
    pub ty: String,
    pub cluster: u32,
    pub layers: Vec<u32>,
    pub rows: u64,
    pub cols: u64,
    pub rows_per_block: u64,
    pub first_blob: u64,
    pub n_blocks: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum MetaTensor {
    Passthrough {
        name: String,
        format: SourceType,
        rows_per_block: u64,
        first_blob: u64,
        n_blocks: u64,
    },
    Delta {
        name: String,
        base: u64,
        rank: u64,
        rows_per_block: u64,
        first_blob: u64,
        n_blocks: u64,
        vt_blob: u64,
    },
}

impl MetaTensor {
    pub fn name(&self) -> &str {
        match self {
            MetaTensor::Passthrough { name, .. } | MetaTensor::Delta { name, .. } => name,
        }
    }
}

/// META as written. Field order here is the JSON key order.
#[derive(Serialize)]
pub struct MetaOut<'a> {
    pub format: &'a str,
    pub version: u32,
    pub model: serde_json::Value,
    pub hf_files: BTreeMap<String, serde_json::Value>,
    pub n_layers: u32,
    pub base_dtype: BaseDtype,
    pub delta_dtype: &'a str,
    pub bases: &'a [MetaBase],
    pub tensors: &'a [MetaTensor],
    pub checksum_index: BTreeMap<String, String>,
    pub extra: &'a serde_json::Value,
}

/// META as read (unknown keys ignored).
#[derive(Deserialize)]
pub struct MetaIn {
    pub format: String,
    pub version: u32,
    pub model: serde_json::Value,
    #[serde(default)]
    pub hf_files: BTreeMap<String, serde_json::Value>,
    pub n_layers: u32,
    pub base_dtype: BaseDtype,
    pub delta_dtype: String,
    pub bases: Vec<MetaBase>,
    pub tensors: Vec<MetaTensor>,
    pub checksum_index: BTreeMap<String, String>,
    #[serde(default)]
    pub extra: serde_json::Value,
}

/// The seven per-layer projection types, in the order bases are written.
pub const WEIGHT_TYPES: [&str; 7] = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

/// (layer, type index) of a Hugging Face name that is one of the seven projections.
pub fn weight_type_of(name: &str) -> Option<(u32, usize)> {
    let layer = crate::model::names::layer_of(name)?;
    let suffix = name.strip_prefix("model.layers.")?.split_once('.')?.1;
    let ty = WEIGHT_TYPES.iter().position(|t| *t == suffix)?;
    Some((layer, ty))
}

/// Short label of a weight type ("q_proj").
pub fn type_label(ty: &str) -> &str {
    ty.split('.').nth(1).unwrap_or(ty)
}
