//! Streaming `.cawsf` writer. Blocks go to SHARD_BANK as tensors arrive (right after the
//! reserved header page); global blobs are spooled to a side file so they never pile up
//! in memory; `finish` appends CODEBOOKS, BLOCK_INDEX, ROUTING and META, then writes the
//! header/TOC and renames `<path>.tmp` to `<path>`.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
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
    first_block: u64,
    global: GlobalRef,
}

/// Streaming writer: tensors are added in model order as they are encoded, then
/// `finish` writes META, CODEBOOKS and ROUTING and the header/TOC.
pub struct CawsfWriter {
    path: PathBuf,
    tmp: PathBuf,
    cb_tmp: PathBuf,
    compression: Compression,
    out: Option<BufWriter<File>>,
    cb: Option<BufWriter<File>>,
    /// Bytes written to SHARD_BANK so far.
    bank_len: u64,
    bank_hash: Xxh3Default,
    cb_len: u64,
    cb_hash: Xxh3Default,
    index: Vec<u8>,
    n_entries: u64,
    tensors: Vec<PendingTensor>,
    done: bool,
}

impl CawsfWriter {
    fn io(&self, e: std::io::Error) -> ArchiveError {
        io_error(&self.path, e)
    }
    fn invalid(&self, reason: String) -> ArchiveError {
        invalid(&self.path, reason)
    }

    pub fn create(path: &Path, compression: Compression) -> Result<CawsfWriter, ArchiveError> {
        let tmp = with_suffix(path, ".tmp");
        let cb_tmp = with_suffix(path, ".cbtmp");
        let f = File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
        let cb = match File::create(&cb_tmp) {
            Ok(f) => f,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(io_error(&cb_tmp, e));
            }
        };
        let mut w = CawsfWriter {
            path: path.to_path_buf(),
            tmp,
            cb_tmp,
            compression,
            out: Some(BufWriter::with_capacity(1 << 20, f)),
            cb: Some(BufWriter::with_capacity(1 << 20, cb)),
            bank_len: 0,
            bank_hash: Xxh3Default::new(),
            cb_len: 0,
            cb_hash: Xxh3Default::new(),
            index: Vec::new(),
            n_entries: 0,
            tensors: Vec::new(),
            done: false,
        };
        // Reserve the header page; SHARD_BANK starts at 4096.
        let zeros = [0u8; ALIGN as usize];
        w.out
            .as_mut()
            .expect("open")
            .write_all(&zeros)
            .map_err(|e| w.io(e))?;
        Ok(w)
    }

    /// Add tensor `index` (its position in `ModelDesc::tensors`); tensors must come in order.
    pub fn add_tensor(
        &mut self,
        index: usize,
        rows_per_block: u64,
        encoded: &EncodedTensor,
    ) -> Result<(), ArchiveError> {
        if index != self.tensors.len() {
            return Err(self.invalid(format!(
                "tensor {index} added out of order (expected tensor {})",
                self.tensors.len()
            )));
        }
        if rows_per_block == 0 {
            return Err(self.invalid(format!("tensor {index}: rows_per_block is 0")));
        }
        let tensor_u32 = u32::try_from(index)
            .map_err(|_| self.invalid(format!("tensor index {index} exceeds u32")))?;
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
        let (gcomp, gstored) = compress(&encoded.global, self.compression);
        let global = GlobalRef {
            offset: self.cb_len,
            csize: gstored.len() as u64,
            usize: encoded.global.len() as u64,
            comp: gcomp,
            xxh3: hex64(xxh3_64(&gstored)),
        };
        self.cb_hash.update(&gstored);
        self.cb_len += gstored.len() as u64;
        let cb = self.cb.as_mut().expect("open");
        if let Err(e) = cb.write_all(&gstored) {
            return Err(self.io(e));
        }

        // Blocks: compress in parallel, write in order.
        let c = self.compression;
        let packed: Vec<(u8, std::borrow::Cow<'_, [u8]>)> =
            encoded.blocks.par_iter().map(|b| compress(b, c)).collect();
        let first_block = self.n_entries;
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
            let out = self.out.as_mut().expect("open");
            let r = pad16(
                out,
                &mut self.bank_hash,
                &mut self.bank_len,
                REC_HEADER as u64,
            );
            r.map_err(|e| self.io(e))?;
            let entry = IndexEntry {
                offset: self.bank_len,
                csize: stored.len() as u32,
                usize: raw.len() as u32,
                xxh3: xxh3_64(stored),
                comp: *comp,
                tensor: tensor_u32,
            };
            let hb = hdr.to_bytes();
            let out = self.out.as_mut().expect("open");
            let res = out.write_all(&hb).and_then(|_| out.write_all(stored));
            if let Err(e) = res {
                return Err(self.io(e));
            }
            self.bank_hash.update(&hb);
            self.bank_hash.update(stored);
            self.bank_len += (REC_HEADER + stored.len()) as u64;
            entry.write(&mut self.index);
            self.n_entries += 1;
        }
        self.tensors.push(PendingTensor {
            codec: encoded.codec.clone(),
            rows_per_block,
            n_blocks: encoded.blocks.len() as u64,
            first_block,
            global,
        });
        Ok(())
    }

    /// `extra` is free-form JSON stored in META (conversion options, report).
    /// Returns the archive's size in bytes.
    pub fn finish(
        mut self,
        model: &ModelDesc,
        extra: serde_json::Value,
        routing: &[u8],
    ) -> Result<u64, ArchiveError> {
        // Every tensor present, block counts consistent with the shapes.
        if self.tensors.len() != model.tensors.len() {
            return Err(self.invalid(format!(
                "{} tensors added but the model has {}",
                self.tensors.len(),
                model.tensors.len()
            )));
        }
        let mut meta_tensors = Vec::with_capacity(self.tensors.len());
        for (t, d) in self.tensors.iter().zip(&model.tensors) {
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
                first_block: t.first_block,
                n_blocks: t.n_blocks,
                global: t.global.clone(),
            });
        }

        let bank = TocRecord {
            ty: SEC_SHARD_BANK,
            flags: 0,
            offset: ALIGN,
            size: self.bank_len,
            usize: self.bank_len,
            xxh3: self.bank_hash.digest(),
        };
        let mut out = self.out.take().expect("open");
        let mut pos = ALIGN + self.bank_len;

        let r = (|| -> std::io::Result<u64> {
            // CODEBOOKS: copy the spool.
            pad_to_align(&mut out, &mut pos)?;
            let mut cbw = self.cb.take().expect("open");
            cbw.flush()?;
            drop(cbw);
            let mut cbf = File::open(&self.cb_tmp)?;
            let copied = std::io::copy(&mut cbf, &mut out)?;
            if copied != self.cb_len {
                return Err(std::io::Error::other(format!(
                    "codebook spool has {copied} bytes, expected {}",
                    self.cb_len
                )));
            }
            let codebooks = TocRecord {
                ty: SEC_CODEBOOKS,
                flags: 0,
                offset: pos,
                size: self.cb_len,
                usize: self.cb_len,
                xxh3: self.cb_hash.digest(),
            };
            pos += self.cb_len;

            let meta_c = Compression::Zstd(META_ZSTD_LEVEL);
            let index = write_section(&mut out, &mut pos, SEC_BLOCK_INDEX, &self.index, meta_c)?;
            let routing =
                write_section(&mut out, &mut pos, SEC_ROUTING, routing, self.compression)?;
            let checksum_index =
                checksum_index(&[&codebooks, &bank, &index, &routing], section_name);
            let (model_v, hf_files) = model_to_meta(model).map_err(std::io::Error::other)?;
            let meta = MetaOut {
                format: "cawsf",
                version: VERSION,
                model: model_v,
                hf_files,
                tensors: &meta_tensors,
                checksum_index,
                extra: &extra,
            };
            let json = serde_json::to_vec(&meta).map_err(std::io::Error::other)?;
            let meta = write_section(&mut out, &mut pos, SEC_META, &json, meta_c)?;
            pad_to_align(&mut out, &mut pos)?;

            let toc = [meta, codebooks, bank, routing, index];
            let mut header = Vec::with_capacity(HEADER_FIXED + TOC_RECORD * toc.len() + 8);
            header.extend_from_slice(&MAGIC);
            header.extend_from_slice(&VERSION.to_le_bytes());
            header.extend_from_slice(&(toc.len() as u32).to_le_bytes());
            write_header(out, header, &toc)?;
            Ok(pos)
        })();
        let total = r.map_err(|e| self.io(e))?;
        fs::rename(&self.tmp, &self.path).map_err(|e| self.io(e))?;
        let _ = fs::remove_file(&self.cb_tmp);
        self.done = true;
        Ok(total)
    }
}

impl Drop for CawsfWriter {
    /// An unfinished (failed or abandoned) conversion leaves no files behind.
    fn drop(&mut self) {
        if !self.done {
            self.out = None;
            self.cb = None;
            let _ = fs::remove_file(&self.tmp);
            let _ = fs::remove_file(&self.cb_tmp);
        }
    }
}
