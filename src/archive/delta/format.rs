//! On-disk constants and records of the delta archive (docs/FORMAT-DELTA.md): the
//! fixed header, the 40-byte BLOB_INDEX entry and META's JSON shape. TOC records,
//! compression codes and (de)compression come from [`crate::archive::container`], which
//! this module re-exports for the reader and writer.

use serde::{Deserialize, Serialize};

pub use crate::codec::delta::BaseDtype;
use crate::model::SourceType;

pub use crate::archive::container::*;

pub const MAGIC: [u8; 8] = *b"CAWSDLT\0";
/// Bytes before the TOC records.
pub const HEADER_FIXED: usize = 28;
pub const INDEX_ENTRY: usize = 40;

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
    /// The entry in the first 40 bytes of `b`, if it has them, and whether its reserved
    /// bytes are zero.
    pub fn parse(b: &[u8]) -> Option<(BlobEntry, bool)> {
        let reserved_zero = b.get(26..28)? == [0, 0] && b.get(36..40)? == [0, 0, 0, 0];
        let entry = BlobEntry {
            offset: u64_at(b, 0)?,
            csize: u32_at(b, 8)?,
            usize: u32_at(b, 12)?,
            xxh3: u64_at(b, 16)?,
            comp: *b.get(24)?,
            kind: *b.get(25)?,
            owner: u32_at(b, 28)?,
            block: u32_at(b, 32)?,
        };
        Some((entry, reserved_zero))
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

/// The delta kind's META keys as written (between `hf_files` and `checksum_index`).
#[derive(Serialize)]
pub struct MetaKindOut<'a> {
    pub n_layers: u32,
    pub base_dtype: BaseDtype,
    pub delta_dtype: &'a str,
    pub bases: &'a [MetaBase],
    pub tensors: &'a [MetaTensor],
}

/// The delta kind's META keys as read.
#[derive(Deserialize)]
pub struct MetaKindIn {
    pub n_layers: u32,
    pub base_dtype: BaseDtype,
    pub delta_dtype: String,
    pub bases: Vec<MetaBase>,
    pub tensors: Vec<MetaTensor>,
}

/// META's `format`.
pub const FORMAT: &str = "cawsf-delta";

/// The header fields of the delta kind (bytes 12..24).
pub struct DeltaHeader {
    pub n_layers: u32,
    pub n_bases: u32,
    pub base_dtype: BaseDtype,
}

/// The delta kind's container.
pub struct DeltaContainer;

impl ContainerKind for DeltaContainer {
    const MAGIC: [u8; 8] = MAGIC;
    const HEADER_FIXED: usize = HEADER_FIXED;
    const NAMES: Names = Names {
        header: "delta archive",
        file: "delta archive",
        version: "delta archive",
    };
    const FORMAT: &'static str = FORMAT;
    const RAW_ONLY: &'static [u32] = &[SEC_DATA];
    const REQUIRED: &'static [u32] = &[SEC_META, SEC_DATA, SEC_BLOB_INDEX];
    type Header = DeltaHeader;
    type Meta = MetaKindIn;

    fn section_name(ty: u32) -> String {
        section_name(ty)
    }

    fn header(fields: &[u8]) -> Result<DeltaHeader, String> {
        let &[l0, l1, l2, l3, b0, b1, b2, b3, base, delta, r0, r1] = fields else {
            return Err(format!("bad header: {} bytes of fields", fields.len()));
        };
        let base_dtype = BaseDtype::from_code(base)
            .ok_or_else(|| format!("bad header: base dtype code {base}"))?;
        if delta != DTYPE_F16 || [r0, r1] != [0, 0] {
            return Err(format!("bad header: delta dtype code {delta} (only 1 = f16 exists) or reserved bytes not zero"));
        }
        Ok(DeltaHeader {
            n_layers: u32::from_le_bytes([l0, l1, l2, l3]),
            n_bases: u32::from_le_bytes([b0, b1, b2, b3]),
            base_dtype,
        })
    }

    fn agree(h: &DeltaHeader, meta: &MetaKindIn) -> Result<(), String> {
        if meta.n_layers != h.n_layers
            || meta.bases.len() as u64 != h.n_bases as u64
            || meta.base_dtype != h.base_dtype
            || meta.delta_dtype != "f16"
        {
            return Err("META's layer count, bases or dtypes disagree with the header".into());
        }
        Ok(())
    }
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
