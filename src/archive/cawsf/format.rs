//! The `.cawsf` kind's own on-disk records (docs/FORMAT.md): magic and section types,
//! the 20-byte block record header, the 32-byte BLOCK_INDEX entry and META's JSON
//! shape. The container pieces it shares with the delta kind live in
//! [`crate::archive::container`].

use serde::{Deserialize, Serialize};

pub use crate::archive::container::SEC_META;
use crate::archive::container::{u32_at, u64_at, ContainerKind, Names};
use crate::codec::TensorCodec;

pub const MAGIC: [u8; 8] = *b"CAWSF\0\0\0";
pub const HEADER_FIXED: usize = 16;
pub const SEC_CODEBOOKS: u32 = 2;
pub const SEC_SHARD_BANK: u32 = 3;
pub const SEC_ROUTING: u32 = 4;
pub const SEC_BLOCK_INDEX: u32 = 5;

pub const REC_ROW_BLOCK: u8 = 4;
pub const REC_HEADER: usize = 20;
pub const INDEX_ENTRY: usize = 32;

pub fn section_name(ty: u32) -> String {
    match ty {
        SEC_META => "META".into(),
        SEC_CODEBOOKS => "CODEBOOKS".into(),
        SEC_SHARD_BANK => "SHARD_BANK".into(),
        SEC_ROUTING => "ROUTING".into(),
        SEC_BLOCK_INDEX => "BLOCK_INDEX".into(),
        other => format!("type{other}"),
    }
}

/// One BLOCK_INDEX entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    /// Offset of the record header, relative to SHARD_BANK.
    pub offset: u64,
    pub csize: u32,
    pub usize: u32,
    pub xxh3: u64,
    pub comp: u8,
    pub tensor: u32,
}

impl IndexEntry {
    /// Bytes of one entry.
    pub const SIZE: usize = 32;

    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.csize.to_le_bytes());
        out.extend_from_slice(&self.usize.to_le_bytes());
        out.extend_from_slice(&self.xxh3.to_le_bytes());
        out.push(self.comp);
        out.extend_from_slice(&[0u8; 3]);
        out.extend_from_slice(&self.tensor.to_le_bytes());
    }
    /// The entry in the first 32 bytes of `b`, if it has them, and its reserved bytes.
    pub fn parse(b: &[u8]) -> Option<(IndexEntry, [u8; 3])> {
        let entry = IndexEntry {
            offset: u64_at(b, 0)?,
            csize: u32_at(b, 8)?,
            usize: u32_at(b, 12)?,
            xxh3: u64_at(b, 16)?,
            comp: *b.get(24)?,
            tensor: u32_at(b, 28)?,
        };
        Some((entry, b.get(25..28)?.try_into().ok()?))
    }
}

/// The 20-byte header in front of each block payload in SHARD_BANK.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub ty: u8,
    pub comp: u8,
    pub reserved: u16,
    pub tensor: u32,
    pub block: u32,
    pub usize: u32,
    pub csize: u32,
}

impl RecordHeader {
    pub fn to_bytes(self) -> [u8; REC_HEADER] {
        let mut b = [0u8; REC_HEADER];
        b[0] = self.ty;
        b[1] = self.comp;
        b[2..4].copy_from_slice(&self.reserved.to_le_bytes());
        b[4..8].copy_from_slice(&self.tensor.to_le_bytes());
        b[8..12].copy_from_slice(&self.block.to_le_bytes());
        b[12..16].copy_from_slice(&self.usize.to_le_bytes());
        b[16..20].copy_from_slice(&self.csize.to_le_bytes());
        b
    }
    /// The header in the first 20 bytes of `b`, if it has them.
    pub fn parse(b: &[u8]) -> Option<RecordHeader> {
        let &[ty, comp, r0, r1, ..] = b else {
            return None;
        };
        Some(RecordHeader {
            ty,
            comp,
            reserved: u16::from_le_bytes([r0, r1]),
            tensor: u32_at(b, 4)?,
            block: u32_at(b, 8)?,
            usize: u32_at(b, 12)?,
            csize: u32_at(b, 16)?,
        })
    }
}

/// Where a tensor's global blob lies in CODEBOOKS.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GlobalRef {
    pub offset: u64,
    pub csize: u64,
    pub usize: u64,
    pub comp: u8,
    pub xxh3: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetaTensor {
    pub name: String,
    pub codec: TensorCodec,
    pub rows: u64,
    pub cols: u64,
    pub rows_per_block: u64,
    pub first_block: u64,
    pub n_blocks: u64,
    pub global: GlobalRef,
}

/// The `.cawsf` kind's META keys as written (between `hf_files` and `checksum_index`).
#[derive(Serialize)]
pub struct MetaKindOut<'a> {
    pub tensors: &'a [MetaTensor],
}

/// The `.cawsf` kind's META keys as read.
#[derive(Deserialize)]
pub struct MetaKindIn {
    pub tensors: Vec<MetaTensor>,
}

/// META's `format`.
pub const FORMAT: &str = "cawsf";

/// The `.cawsf` kind's container: no header fields of its own beyond the section count.
pub struct CawsfContainer;

impl ContainerKind for CawsfContainer {
    const MAGIC: [u8; 8] = MAGIC;
    const HEADER_FIXED: usize = HEADER_FIXED;
    const NAMES: Names = Names {
        header: "cawsf",
        file: "cawsf archive",
        version: "cawsf",
    };
    const FORMAT: &'static str = FORMAT;
    const RAW_ONLY: &'static [u32] = &[SEC_CODEBOOKS, SEC_SHARD_BANK];
    const REQUIRED: &'static [u32] = &[SEC_META, SEC_CODEBOOKS, SEC_SHARD_BANK, SEC_BLOCK_INDEX];
    type Header = ();
    type Meta = MetaKindIn;

    fn section_name(ty: u32) -> String {
        section_name(ty)
    }
    fn header(_fields: &[u8]) -> Result<(), String> {
        Ok(())
    }
}
