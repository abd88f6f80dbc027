//! The `.cawsf` kind's own on-disk records (docs/FORMAT.md): magic and section types,
//! the 20-byte block record header, the 32-byte BLOCK_INDEX entry and META's JSON
//! shape. The container pieces it shares with the delta kind live in
//! [`crate::archive::container`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::archive::container::{le_u32, le_u64};
use crate::codec::TensorCodec;

pub const MAGIC: [u8; 8] = *b"CAWSF\0\0\0";
pub const HEADER_FIXED: usize = 16;
pub const SEC_META: u32 = 1;
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
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.csize.to_le_bytes());
        out.extend_from_slice(&self.usize.to_le_bytes());
        out.extend_from_slice(&self.xxh3.to_le_bytes());
        out.push(self.comp);
        out.extend_from_slice(&[0u8; 3]);
        out.extend_from_slice(&self.tensor.to_le_bytes());
    }
    /// `b` must be exactly 32 bytes.
    pub fn parse(b: &[u8]) -> (IndexEntry, [u8; 3]) {
        (
            IndexEntry {
                offset: le_u64(&b[0..8]),
                csize: le_u32(&b[8..12]),
                usize: le_u32(&b[12..16]),
                xxh3: le_u64(&b[16..24]),
                comp: b[24],
                tensor: le_u32(&b[28..32]),
            },
            [b[25], b[26], b[27]],
        )
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
    /// `b` must be exactly 20 bytes.
    pub fn parse(b: &[u8]) -> RecordHeader {
        RecordHeader {
            ty: b[0],
            comp: b[1],
            reserved: u16::from_le_bytes([b[2], b[3]]),
            tensor: le_u32(&b[4..8]),
            block: le_u32(&b[8..12]),
            usize: le_u32(&b[12..16]),
            csize: le_u32(&b[16..20]),
        }
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

/// META as written. Field order here is the JSON key order.
#[derive(Serialize)]
pub struct MetaOut<'a> {
    pub format: &'a str,
    pub version: u32,
    /// `ModelDesc` with `hf_files` emptied (they go to the `hf_files` key below).
    pub model: serde_json::Value,
    pub hf_files: BTreeMap<String, serde_json::Value>,
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
    pub tensors: Vec<MetaTensor>,
    pub checksum_index: BTreeMap<String, String>,
    #[serde(default)]
    pub extra: serde_json::Value,
}
