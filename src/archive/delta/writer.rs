//! Streaming writer of the delta archive (docs/FORMAT-DELTA.md): blobs go to DATA as
//! they are added (bases first, then tensors in model order); `finish` appends
//! BLOB_INDEX, ROUTING and META, writes the header/TOC and renames `<path>.tmp`.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

use super::format::*;
use crate::archive::{ArchiveError, Compression};
use crate::model::{ModelDesc, SourceType};

pub struct DeltaWriter {
    path: PathBuf,
    tmp: PathBuf,
    compression: Compression,
    out: Option<BufWriter<File>>,
    data_len: u64,
    data_hash: Xxh3Default,
    index: Vec<u8>,
    n_entries: u64,
    bases: Vec<MetaBase>,
    tensors: Vec<MetaTensor>,
    done: bool,
}

impl DeltaWriter {
    fn io(&self, e: std::io::Error) -> ArchiveError {
        io_error(&self.path, e)
    }
    fn invalid(&self, reason: String) -> ArchiveError {
        invalid(&self.path, reason)
    }

    pub fn create(path: &Path, compression: Compression) -> Result<DeltaWriter, ArchiveError> {
        let tmp = with_suffix(path, ".tmp");
        let f = File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
        let mut w = DeltaWriter {
            path: path.to_path_buf(),
            tmp,
            compression,
            out: Some(BufWriter::with_capacity(1 << 20, f)),
            data_len: 0,
            data_hash: Xxh3Default::new(),
            index: Vec::new(),
            n_entries: 0,
            bases: Vec::new(),
            tensors: Vec::new(),
            done: false,
        };
        // The header page; DATA starts at 4096.
        let zeros = [0u8; ALIGN as usize];
        let r = w.out.as_mut().expect("open").write_all(&zeros);
        r.map_err(|e| w.io(e))?;
        Ok(w)
    }

    /// Compress `blobs` in parallel and append them in order; returns the index of the
    /// first entry and the stored bytes in total.
    fn put_blobs(
        &mut self,
        kind: u8,
        owner: u32,
        first_block: u32,
        blobs: &[&[u8]],
    ) -> Result<(u64, u64), ArchiveError> {
        for b in blobs {
            if b.len() > u32::MAX as usize {
                return Err(self.invalid(format!(
                    "{} of {} bytes exceeds the 4 GiB blob limit",
                    kind_name(kind),
                    b.len()
                )));
            }
        }
        let c = self.compression;
        let packed: Vec<(u8, std::borrow::Cow<'_, [u8]>)> =
            blobs.par_iter().map(|b| compress(b, c)).collect();
        let first = self.n_entries;
        let mut stored_total = 0;
        for (i, ((comp, stored), raw)) in packed.iter().zip(blobs).enumerate() {
            let out = self.out.as_mut().expect("open");
            let r = pad16(out, &mut self.data_hash, &mut self.data_len, 0)
                .and_then(|_| out.write_all(stored));
            r.map_err(|e| self.io(e))?;
            self.data_hash.update(stored);
            BlobEntry {
                offset: self.data_len,
                csize: stored.len() as u32,
                usize: raw.len() as u32,
                xxh3: xxh3_64(stored),
                comp: *comp,
                kind,
                owner,
                block: first_block + i as u32,
            }
            .write(&mut self.index);
            self.data_len += stored.len() as u64;
            self.n_entries += 1;
            stored_total += stored.len() as u64;
        }
        Ok((first, stored_total))
    }

    /// Add a base; returns (base index, stored bytes).
    #[allow(clippy::too_many_arguments)]
    pub fn add_base(
        &mut self,
        ty: &str,
        cluster: u32,
        layers: Vec<u32>,
        rows: u64,
        cols: u64,
        rows_per_block: u64,
        blocks: &[Vec<u8>],
    ) -> Result<(u32, u64), ArchiveError> {
        if !self.tensors.is_empty() {
            return Err(self.invalid("bases must be added before tensors".into()));
        }
        let idx = self.bases.len() as u32;
        let refs: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
        let (first, stored) = self.put_blobs(KIND_BASE, idx, 0, &refs)?;
        self.bases.push(MetaBase {
            ty: ty.to_string(),
            cluster,
            layers,
            rows,
            cols,
            rows_per_block,
            first_blob: first,
            n_blocks: blocks.len() as u64,
        });
        Ok((idx, stored))
    }

    fn check_order(&self, tensor: usize) -> Result<u32, ArchiveError> {
        if tensor != self.tensors.len() {
            return Err(self.invalid(format!(
                "tensor {tensor} added out of order (expected tensor {})",
                self.tensors.len()
            )));
        }
        u32::try_from(tensor)
            .map_err(|_| self.invalid(format!("tensor index {tensor} exceeds u32")))
    }

    /// Add a passthrough tensor; returns its stored bytes.
    pub fn add_passthrough(
        &mut self,
        tensor: usize,
        name: &str,
        format: SourceType,
        rows_per_block: u64,
        blocks: &[Vec<u8>],
    ) -> Result<u64, ArchiveError> {
        let t = self.check_order(tensor)?;
        let refs: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
        let (first, stored) = self.put_blobs(KIND_PASS, t, 0, &refs)?;
        self.tensors.push(MetaTensor::Passthrough {
            name: name.to_string(),
            format,
            rows_per_block,
            first_blob: first,
            n_blocks: blocks.len() as u64,
        });
        Ok(stored)
    }

    /// Add a delta matrix (U blocks, then its Vᵀ blob); returns its stored bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn add_delta(
        &mut self,
        tensor: usize,
        name: &str,
        base: u32,
        rank: u64,
        rows_per_block: u64,
        u_blocks: &[Vec<u8>],
        vt: &[u8],
    ) -> Result<u64, ArchiveError> {
        let t = self.check_order(tensor)?;
        let refs: Vec<&[u8]> = u_blocks.iter().map(Vec::as_slice).collect();
        let (first, su) = self.put_blobs(KIND_U, t, 0, &refs)?;
        let (vt_blob, sv) = self.put_blobs(KIND_VT, t, 0, &[vt])?;
        self.tensors.push(MetaTensor::Delta {
            name: name.to_string(),
            base: base as u64,
            rank,
            rows_per_block,
            first_blob: first,
            n_blocks: u_blocks.len() as u64,
            vt_blob,
        });
        Ok(su + sv)
    }

    /// Write the index, ROUTING, META and the header. Returns the archive's size.
    pub fn finish(
        mut self,
        model: &ModelDesc,
        base_dtype: BaseDtype,
        extra: serde_json::Value,
        routing: &[u8],
    ) -> Result<u64, ArchiveError> {
        if self.tensors.len() != model.tensors.len() {
            return Err(self.invalid(format!(
                "{} tensors added but the model has {}",
                self.tensors.len(),
                model.tensors.len()
            )));
        }
        let n_layers = model.arch.n_layers;
        let n_bases = self.bases.len() as u32;
        let data = TocRecord {
            ty: SEC_DATA,
            flags: 0,
            offset: ALIGN,
            size: self.data_len,
            usize: self.data_len,
            xxh3: self.data_hash.digest(),
        };
        let mut out = self.out.take().expect("open");
        let mut pos = ALIGN + self.data_len;
        let r = (|| -> std::io::Result<u64> {
            let meta_c = Compression::Zstd(META_ZSTD_LEVEL);
            let index = write_section(&mut out, &mut pos, SEC_BLOB_INDEX, &self.index, meta_c)?;
            let routing =
                write_section(&mut out, &mut pos, SEC_ROUTING, routing, self.compression)?;
            let checksum_index = checksum_index(&[&data, &index, &routing], section_name);
            let (model_v, hf_files) = model_to_meta(model).map_err(std::io::Error::other)?;
            let meta = MetaOut {
                format: "cawsf-delta",
                version: VERSION,
                model: model_v,
                hf_files,
                n_layers,
                base_dtype,
                delta_dtype: "f16",
                bases: &self.bases,
                tensors: &self.tensors,
                checksum_index,
                extra: &extra,
            };
            let json = serde_json::to_vec(&meta).map_err(std::io::Error::other)?;
            let meta = write_section(&mut out, &mut pos, SEC_META, &json, meta_c)?;
            pad_to_align(&mut out, &mut pos)?;

            let toc = [meta, data, routing, index];
            let mut header = Vec::with_capacity(HEADER_FIXED + TOC_RECORD * toc.len() + 8);
            header.extend_from_slice(&MAGIC);
            header.extend_from_slice(&VERSION.to_le_bytes());
            header.extend_from_slice(&n_layers.to_le_bytes());
            header.extend_from_slice(&n_bases.to_le_bytes());
            header.push(base_dtype.code());
            header.push(DTYPE_F16);
            header.extend_from_slice(&[0u8; 2]);
            header.extend_from_slice(&(toc.len() as u32).to_le_bytes());
            write_header(out, header, &toc)?;
            Ok(pos)
        })();
        let total = r.map_err(|e| self.io(e))?;
        fs::rename(&self.tmp, &self.path).map_err(|e| self.io(e))?;
        self.done = true;
        Ok(total)
    }
}

impl Drop for DeltaWriter {
    /// A failed or abandoned conversion leaves no file behind.
    fn drop(&mut self) {
        if !self.done {
            self.out = None;
            let _ = fs::remove_file(&self.tmp);
        }
    }
}
