//! Streaming `.cawsf` writer. Blocks go to SHARD_BANK as tensors arrive (right after the
//! reserved header page); global blobs are spooled to a side file so they never pile up
//! in memory; `finish` appends CODEBOOKS, BLOCK_INDEX, ROUTING and META, then writes the
//! header/TOC and renames the temporary file to the output ([`ContainerWriter`]).

use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

use tempfile::NamedTempFile;
use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

use crate::codec::{EncodedTensor, TensorCodec};
use crate::model::ModelDesc;

use super::format::*;
use crate::archive::container::*;
use crate::archive::ArchiveError;

struct PendingTensor {
    codec: TensorCodec,
    rows_per_block: u64,
    n_blocks: u64,
    global: GlobalRef,
    /// Its BLOCK_INDEX entries: the index is in tensor order whatever the order of
    /// adding, so each tensor's are kept apart until `finish`.
    index: Vec<u8>,
}

/// Streaming writer: tensors are added in any order as they are encoded (their records
/// go to SHARD_BANK in that order, docs/FORMAT.md), then
/// `finish` writes META, CODEBOOKS and ROUTING and the header/TOC. Dropped unfinished
/// (a failed or abandoned conversion), it leaves no files behind: both temporary files
/// delete themselves.
pub struct CawsfWriter {
    w: ContainerWriter,
    /// The CODEBOOKS spool, beside the output like the archive's temporary file.
    cb: BufWriter<NamedTempFile>,
    cb_len: u64,
    cb_hash: Xxh3Default,
    /// By tensor index; None until added.
    tensors: Vec<Option<PendingTensor>>,
}

impl CawsfWriter {
    fn invalid(&self, reason: String) -> ArchiveError {
        self.w.invalid(reason)
    }

    /// Blocks are stored raw unless compression saves at least `fraction` of them.
    pub fn set_min_saving(&mut self, fraction: f64) {
        self.w.set_min_saving(fraction);
    }

    pub fn create(path: &Path, compression: Compression) -> Result<CawsfWriter, ArchiveError> {
        let w = ContainerWriter::create(path, compression)?;
        let cb = temp_beside(path).map_err(|e| w.io(e))?;
        Ok(CawsfWriter {
            w,
            cb: BufWriter::with_capacity(1 << 20, cb),
            cb_len: 0,
            cb_hash: Xxh3Default::new(),
            tensors: Vec::new(),
        })
    }

    /// Add tensor `index` (its position in `ModelDesc::tensors`), each once, in any order.
    pub fn add_tensor(
        &mut self,
        index: usize,
        rows_per_block: u64,
        encoded: &EncodedTensor,
    ) -> Result<(), ArchiveError> {
        if self.tensors.get(index).is_some_and(Option::is_some) {
            return Err(self.invalid(format!("tensor {index} added twice")));
        }
        let tensor_u32 = u32::try_from(index)
            .map_err(|_| self.invalid(format!("tensor index {index} exceeds u32")))?;
        if rows_per_block == 0 {
            return Err(self.invalid(format!("tensor {index}: rows_per_block is 0")));
        }
        if encoded.blocks.len() > u32::MAX as usize {
            return Err(self.invalid(format!("tensor {index}: too many blocks")));
        }
        for (b, blk) in encoded.blocks.iter().enumerate() {
            if blk.len() > u32::MAX as usize {
                return Err(self.invalid(format!(
                    "tensor {index} block {b}: payload of {} bytes exceeds u32",
                    blk.len()
                )));
            }
        }

        // Global blob → CODEBOOKS spool.
        let (gcomp, gstored) = compress(&encoded.global, self.w.compression());
        let global = GlobalRef {
            offset: self.cb_len,
            csize: gstored.len() as u64,
            usize: encoded.global.len() as u64,
            comp: gcomp,
            xxh3: hex64(xxh3_64(&gstored)),
        };
        self.cb_hash.update(&gstored);
        self.cb_len += gstored.len() as u64;
        if let Err(e) = self.cb.write_all(&gstored) {
            return Err(self.w.io(e));
        }

        // Blocks: compress in parallel, write in order.
        let packed = self.w.compress_all(&encoded.blocks);
        let mut index_bytes = Vec::with_capacity(encoded.blocks.len() * 32);
        for (b, ((comp, stored), raw)) in packed.iter().zip(&encoded.blocks).enumerate() {
            let hdr = RecordHeader {
                ty: REC_ROW_BLOCK,
                comp: *comp,
                reserved: 0,
                tensor: tensor_u32,
                block: b as u32,
                usize: raw.len() as u32,
                csize: stored.len() as u32,
            };
            let offset = self.w.append(&hdr.to_bytes(), stored)?;
            IndexEntry {
                offset,
                csize: stored.len() as u32,
                usize: raw.len() as u32,
                xxh3: xxh3_64(stored),
                comp: *comp,
                tensor: tensor_u32,
            }
            .write(&mut index_bytes);
        }
        if self.tensors.len() <= index {
            self.tensors.resize_with(index + 1, || None);
        }
        self.tensors[index] = Some(PendingTensor {
            codec: encoded.codec.clone(),
            rows_per_block,
            n_blocks: encoded.blocks.len() as u64,
            global,
            index: index_bytes,
        });
        Ok(())
    }

    /// `extra` is free-form JSON stored in META (conversion options, report).
    /// Returns the archive's size in bytes.
    pub fn finish(
        self,
        model: &ModelDesc,
        extra: serde_json::Value,
        routing: &[u8],
    ) -> Result<u64, ArchiveError> {
        // Every tensor present, block counts consistent with the shapes.
        self.w.check_count(self.tensors.len(), model)?;
        let mut meta_tensors = Vec::with_capacity(self.tensors.len());
        let mut index = Vec::new();
        for (i, (t, d)) in self.tensors.iter().zip(&model.tensors).enumerate() {
            let Some(t) = t else {
                return Err(self.invalid(format!("tensor {i} ({}) was never added", d.name)));
            };
            let rows = d.rows();
            let want = rows.div_ceil(t.rows_per_block);
            if t.n_blocks != want {
                return Err(self.invalid(format!(
                    "tensor {}: {} blocks given, {} rows at {} rows per block need {want}",
                    d.name, t.n_blocks, rows, t.rows_per_block
                )));
            }
            meta_tensors.push(MetaTensor {
                name: d.name.clone(),
                codec: t.codec.clone(),
                rows,
                cols: d.cols(),
                rows_per_block: t.rows_per_block,
                first_block: (index.len() / IndexEntry::SIZE) as u64,
                n_blocks: t.n_blocks,
                global: t.global.clone(),
            });
            index.extend_from_slice(&t.index);
        }

        let (cb_len, cb_hash) = (self.cb_len, self.cb_hash.digest());
        let mut spool = self
            .cb
            .into_inner()
            .map_err(|e| self.w.io(e.into_error()))?;
        let layout = Layout {
            magic: &MAGIC,
            fields: &[],
            data_ty: SEC_SHARD_BANK,
            index_ty: SEC_BLOCK_INDEX,
            routing_ty: SEC_ROUTING,
            name_of: section_name,
        };
        let sections = |s: &mut Sections<'_>| {
            // CODEBOOKS: copy the spool.
            spool.seek(SeekFrom::Start(0))?;
            let copied = s.copy(SEC_CODEBOOKS, &mut spool, cb_len, cb_hash)?;
            if copied != cb_len {
                return Err(std::io::Error::other(format!(
                    "codebook spool has {copied} bytes, expected {cb_len}"
                )));
            }
            Ok(())
        };
        let meta = MetaSpec {
            format: FORMAT,
            model,
            kind: MetaKindOut {
                tensors: &meta_tensors,
            },
            extra: &extra,
        };
        self.w.finish(layout, sections, (&index, routing), meta)
    }
}
