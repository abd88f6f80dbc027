//! The `.cawsf` container (see docs/FORMAT.md): header + TOC of 4 KiB-aligned sections
//! (META, CODEBOOKS, SHARD_BANK, ROUTING, BLOCK_INDEX), a tensor table, row blocks
//! compressed and checksummed one by one, and an index from (tensor, row) to block.
//!
//! The reader memory-maps the file and validates every offset and length at open, so
//! later reads only index into ranges already known to be inside the file. A block's
//! XXH3-64 is checked on every read before it is decompressed or decoded.

pub mod format;
mod table;
#[cfg(test)]
mod tests;
mod writer;

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use crate::archive::container::*;
use crate::archive::file::ArchiveFile;
use crate::archive::{
    block_jobs, check_read, parse_routing, rel_err_of, ArchiveError, BlockJob, BlockMemo, Kind,
    ReadCounterSnapshot, ReadCounters, Routing, SectionInfo, Store, TensorSummary,
};
use crate::codec::{self, DecodedGlobal, TensorCodec};
use crate::model::{ModelDesc, ReadError, RowSource, SourceType};
use crate::reconstruct::{self, Work};

use format::*;
use table::tensor_table;
pub use writer::CawsfWriter;

/// What `inspect` shows about one tensor.
#[derive(Clone, Debug)]
pub struct TensorEntryInfo {
    pub codec: TensorCodec,
    pub rows_per_block: u64,
    pub n_blocks: usize,
    /// Stored (compressed) bytes of global blob + blocks.
    pub stored_bytes: u64,
}

/// A tensor's table entry, validated at open.
struct TensorEntry {
    name: String,
    codec: TensorCodec,
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    first_block: usize,
    n_blocks: usize,
    global: GlobalRef,
    global_xxh3: u64,
}

/// An opened archive (read with `pread`, see [`ArchiveFile`]). Implements [`RowSource`].
pub struct CawsfArchive {
    counters: ReadCounters,
    /// Payloads of blocks a read needed only in part.
    memo: BlockMemo,
    pub path: PathBuf,
    file: ArchiveFile,
    toc: Vec<TocRecord>,
    model: ModelDesc,
    extra: serde_json::Value,
    tensors: Vec<TensorEntry>,
    index: Vec<IndexEntry>,
    routing: Vec<u8>,
    /// Byte ranges (absolute) of SHARD_BANK and CODEBOOKS.
    bank: (u64, u64),
    codebooks: (u64, u64),
    /// Decoded global blobs, or why one cannot be used (cached, so it is reported on
    /// every read).
    globals: Vec<OnceLock<Result<DecodedGlobal, BlobFault>>>,
}

impl CawsfArchive {
    pub fn open(path: &Path) -> Result<CawsfArchive, ArchiveError> {
        Self::open_file(ArchiveFile::open(path)?)
    }

    /// [`CawsfArchive::open`] of a file (or object) already opened.
    pub fn open_file(file: ArchiveFile) -> Result<CawsfArchive, ArchiveError> {
        let Opened {
            container: c, meta, ..
        } = Container::open_file::<CawsfContainer>(file)?;
        let cb_rec = c.required(SEC_CODEBOOKS)?;
        let bank_rec = c.required(SEC_SHARD_BANK)?;

        let index_bytes = c.load_entries(SEC_BLOCK_INDEX, INDEX_ENTRY)?;
        let index: Vec<IndexEntry> = index_bytes
            .chunks_exact(INDEX_ENTRY)
            .filter_map(IndexEntry::parse)
            .map(|(e, reserved)| {
                if reserved != [0; 3] {
                    // Folded into comp so the check in `block_entries` reports it.
                    IndexEntry { comp: u8::MAX, ..e }
                } else {
                    e
                }
            })
            .collect();
        drop(index_bytes);
        let routing = c.load_optional(SEC_ROUTING)?;

        let model = c.model(meta.model, meta.hf_files)?;
        let tensors = tensor_table(&c, meta.kind.tensors, &model, &index, cb_rec, bank_rec)?;
        let globals = (0..tensors.len()).map(|_| OnceLock::new()).collect();
        Ok(CawsfArchive {
            path: c.path,
            toc: c.toc,
            model,
            extra: meta.extra,
            tensors,
            index,
            routing,
            bank: (bank_rec.offset, bank_rec.size),
            codebooks: (cb_rec.offset, cb_rec.size),
            globals,
            file: c.file,
            counters: ReadCounters::default(),
            memo: BlockMemo::default(),
        })
    }

    /// What reads have cost so far: blocks fetched and their stored (compressed) and
    /// decompressed bytes. The mount reports these as "archive bytes read".
    pub fn read_counters(&self) -> ReadCounterSnapshot {
        self.counters.snapshot()
    }

    pub fn model(&self) -> &ModelDesc {
        &self.model
    }
    pub fn extra(&self) -> &serde_json::Value {
        &self.extra
    }
    pub fn sections(&self) -> Vec<SectionInfo> {
        section_infos(&self.toc, section_name)
    }
    /// Panics if `tensor` is not a tensor index (a caller bug).
    pub fn tensor_info(&self, tensor: usize) -> TensorEntryInfo {
        let t = &self.tensors[tensor];
        let blocks: u64 = self.index[t.first_block..t.first_block + t.n_blocks]
            .iter()
            .map(|e| e.csize as u64)
            .sum();
        TensorEntryInfo {
            codec: t.codec.clone(),
            rows_per_block: t.rows_per_block,
            n_blocks: t.n_blocks,
            stored_bytes: t.global.csize + blocks,
        }
    }
    /// Decompressed ROUTING bytes (empty when the archive has no routes).
    pub fn routing(&self) -> &[u8] {
        &self.routing
    }
    /// ROUTING parsed.
    pub fn routes(&self) -> Result<Routing, ArchiveError> {
        parse_routing(&self.routing).map_err(|e| match e {
            ArchiveError::Invalid { reason, .. } => {
                invalid(&self.path, format!("ROUTING: {reason}"))
            }
            other => other,
        })
    }

    /// Absolute file offset and length of the stored (compressed) bytes of a block.
    /// Panics if `tensor`/`block` are out of range (a caller bug).
    pub fn block_location(&self, tensor: usize, block: usize) -> (u64, u64) {
        let t = &self.tensors[tensor];
        assert!(block < t.n_blocks, "block {block} out of range");
        let e = &self.index[t.first_block + block];
        (self.bank.0 + e.offset + REC_HEADER as u64, e.csize as u64)
    }

    /// The checked, decompressed payload of one block (codec-independent).
    pub fn block_payload(&self, tensor: usize, block: usize) -> Result<Vec<u8>, ReadError> {
        let t = self.tensor(tensor)?;
        if block >= t.n_blocks {
            return Err(ReadError::OutOfRange {
                tensor: t.name.clone(),
                r0: block as u64 * t.rows_per_block,
                r1: (block as u64 + 1) * t.rows_per_block,
            });
        }
        self.payload(tensor, block)
    }

    fn tensor(&self, tensor: usize) -> Result<&TensorEntry, ReadError> {
        self.tensors
            .get(tensor)
            .ok_or_else(|| ReadError::OutOfRange {
                tensor: format!("#{tensor}"),
                r0: 0,
                r1: 0,
            })
    }

    /// [`Self::payload`] through the memo of partly read blocks, for a read of `rows`
    /// (rows it takes, rows the block has): one that takes only some keeps the payload
    /// for the read of the rest.
    fn read_payload(
        &self,
        tensor: usize,
        block: usize,
        rows: (u64, u64),
    ) -> Result<Arc<Vec<u8>>, ReadError> {
        self.memo
            .get_or_load((tensor, block), rows, || self.payload(tensor, block))
    }

    /// Checksum, header check and decompression of one block (indices already valid).
    fn payload(&self, tensor: usize, block: usize) -> Result<Vec<u8>, ReadError> {
        let t = &self.tensors[tensor];
        let e = &self.index[t.first_block + block];
        // In the file: validated at open. Record header and payload in one read.
        let mut rec = self.file.read_verified(
            self.bank.0 + e.offset,
            REC_HEADER + e.csize as usize,
            |r| xxh3_64(&r[REC_HEADER..]) == e.xxh3,
        )?;
        let stored = &rec[REC_HEADER..];
        self.counters.record(e.csize as u64, e.usize as u64);
        let computed = xxh3_64(stored);
        if computed != e.xxh3 {
            return Err(ReadError::Checksum {
                tensor: t.name.clone(),
                block,
                stored: e.xxh3,
                computed,
            });
        }
        let corrupt = |reason: String| ReadError::Corrupt {
            tensor: t.name.clone(),
            block,
            reason,
        };
        let hdr = RecordHeader::parse(&rec[..REC_HEADER]);
        let want = RecordHeader {
            ty: REC_ROW_BLOCK,
            comp: e.comp,
            reserved: 0,
            tensor: e.tensor,
            block: block as u32,
            usize: e.usize,
            csize: e.csize,
        };
        if hdr != Some(want) {
            // Only a range validated at open is parsed, so `hdr` is always Some.
            let hdr = hdr.map_or_else(|| "(truncated)".into(), |h| format!("{h:?}"));
            return Err(corrupt(format!(
                "record header {hdr} disagrees with the block index {want:?}"
            )));
        }
        let payload = match decompress(stored, e.comp, e.usize as usize).map_err(corrupt)? {
            Cow::Owned(v) => v,
            Cow::Borrowed(_) => {
                // Stored raw: the payload is the read buffer past the record header.
                rec.drain(..REC_HEADER);
                rec
            }
        };
        let rows = (t.rows - block as u64 * t.rows_per_block).min(t.rows_per_block);
        match codec::unpack_block(&t.codec, &payload, rows, t.cols) {
            Ok(Some(blocks)) => Ok(blocks),
            Ok(None) => Ok(payload),
            Err(e) => Err(corrupt(e.to_string())),
        }
    }

    /// Check and decode a tensor's global blob (once; the result is cached, except a
    /// failure to read, which may pass).
    fn global(&self, tensor: usize) -> Result<&DecodedGlobal, BlobFault> {
        let cell = &self.globals[tensor];
        if let Some(g) = cell.get() {
            return g.as_ref().map_err(Clone::clone);
        }
        let t = &self.tensors[tensor];
        let decoded = self.global_stored(t).and_then(|stored| {
            let raw = checked_payload(
                &stored,
                t.global_xxh3,
                t.global.comp,
                t.global.usize as usize,
            )?;
            codec::decode_global(&t.codec, &raw, t.rows, t.cols)
                .map_err(|e| BlobFault::Corrupt(e.to_string()))
        });
        if let Err(f @ BlobFault::Unread { .. }) = decoded {
            return Err(f);
        }
        // Another thread may have set it meanwhile; both decoded the same bytes.
        let _ = cell.set(decoded);
        cell.get()
            .expect("set above")
            .as_ref()
            .map_err(Clone::clone)
    }

    fn global_stored(&self, t: &TensorEntry) -> Result<Vec<u8>, BlobFault> {
        let start = self.codebooks.0 + t.global.offset;
        Ok(self.file.read_at(start, t.global.csize as usize)?)
    }

    fn global_error(&self, tensor: usize, block: usize, f: BlobFault) -> ReadError {
        f.into_read_error(
            &self.tensors[tensor].name,
            block,
            "its tensor's global blob",
        )
    }

    /// Check every checksum; Err names the first bad section or block.
    pub fn verify(&self) -> Result<(), ReadError> {
        match self.verify_all().into_iter().next() {
            None => Ok(()),
            Some(msg) => Err(ReadError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                msg,
            ))),
        }
    }

    /// Every failure, one line each: whole-section checksums, every global blob, every
    /// block (checksum, header, decompression to its usize). Empty = archive intact.
    pub fn verify_all(&self) -> Vec<String> {
        let mut fails = Vec::new();
        for (ti, t) in self.tensors.iter().enumerate() {
            let (xxh3, comp, usize) = (t.global_xxh3, t.global.comp, t.global.usize as usize);
            let checked = self
                .global_stored(t)
                .and_then(|stored| checked_payload(&stored, xxh3, comp, usize).map(drop));
            if let Err(f) = checked {
                fails.push(f.describe(&format!("tensor {} global blob", t.name)));
            }
            let bad: Vec<String> = (0..t.n_blocks)
                .into_par_iter()
                .filter_map(|b| self.payload(ti, b).err().map(|e| e.to_string()))
                .collect();
            fails.extend(bad);
        }
        // Whole sections last: a block failure also fails SHARD_BANK, and the block is
        // the more useful thing to name first.
        fails.extend(section_failures(&self.file, &self.toc, section_name));
        fails
    }

    /// y = Ŵx for tensor `tensor`, from the components.
    pub fn apply(&self, tensor: usize, x: &[f32]) -> Result<Vec<f32>, ReadError> {
        let t = self.tensor(tensor)?;
        if x.len() as u64 != t.cols {
            return Err(ReadError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "apply: x has {} values but tensor {} has {} columns",
                    x.len(),
                    t.name,
                    t.cols
                ),
            )));
        }
        let mut y = vec![0f32; t.rows as usize];
        if t.rows == 0 {
            return Ok(y);
        }
        y.par_chunks_mut(t.rows_per_block as usize)
            .enumerate()
            .try_for_each(|(b, ys)| {
                let payload = self.payload(tensor, b)?;
                let g = self
                    .global(tensor)
                    .map_err(|f| self.global_error(tensor, b, f))?;
                let first = b as u64 * t.rows_per_block;
                codec::apply_block(&t.codec, g, &payload, first, ys.len() as u64, t.cols, x, ys)
                    .map_err(|e| ReadError::Corrupt {
                        tensor: t.name.clone(),
                        block: b,
                        reason: e.to_string(),
                    })
            })?;
        Ok(y)
    }
}

impl RowSource for CawsfArchive {
    fn read_rows(&self, tensor: usize, r0: u64, r1: u64, out: &mut [f32]) -> Result<(), ReadError> {
        let t = self.tensor(tensor)?;
        check_read(&t.name, (t.rows, t.cols), (r0, r1), out.len())?;
        if r0 == r1 {
            return Ok(());
        }
        let jobs = block_jobs((t.rows, t.rows_per_block), (r0, r1), t.cols as usize, out);
        // The blocks' own checksummed, decompressed payloads first (in parallel), then
        // the (cached) global blob, then the reconstruction backend.
        let load =
            |job: &BlockJob<'_, f32>| self.read_payload(tensor, job.0, (job.4 - job.3, job.2));
        let payloads: Vec<Arc<Vec<u8>>> = if jobs.len() == 1 {
            vec![load(&jobs[0])?]
        } else {
            jobs.par_iter().map(load).collect::<Result<_, _>>()?
        };
        let g = self
            .global(tensor)
            .map_err(|f| self.global_error(tensor, jobs[0].0, f))?;
        // Checking a block scans its codes and outlier lists: in parallel too.
        fn check<'a>(
            t: &TensorEntry,
            g: &'a DecodedGlobal,
            (b, first, n, lo, hi, dst): BlockJob<'a, f32>,
            payload: &'a [u8],
        ) -> Result<(Work<'a>, &'a mut [f32]), ReadError> {
            codec::block_parts(&t.codec, g, payload, first, n, t.cols, lo, hi)
                .map(|parts| (Work::Block(parts), dst))
                .map_err(|e| ReadError::Corrupt {
                    tensor: t.name.clone(),
                    block: b,
                    reason: e.to_string(),
                })
        }
        let works: Vec<_> = if jobs.len() == 1 {
            jobs.into_iter()
                .zip(&payloads)
                .map(|(j, p)| check(t, g, j, p))
                .collect::<Result<_, _>>()?
        } else {
            jobs.into_par_iter()
                .zip(&payloads)
                .map(|(j, p)| check(t, g, j, p))
                .collect::<Result<_, _>>()?
        };
        reconstruct::decode(works);
        Ok(())
    }

    fn raw_format(&self, tensor: usize) -> Option<SourceType> {
        codec::raw_format(&self.tensors.get(tensor)?.codec)
    }

    fn read_raw_rows(
        &self,
        tensor: usize,
        r0: u64,
        r1: u64,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        let t = self.tensor(tensor)?;
        let format = self
            .raw_format(tensor)
            .ok_or_else(|| ReadError::NotRaw(t.name.clone()))?;
        let rb = codec::passthrough_row_bytes(format, t.cols).map_err(|e| ReadError::Corrupt {
            tensor: t.name.clone(),
            block: 0,
            reason: e.to_string(),
        })?;
        check_read(&t.name, (t.rows, rb), (r0, r1), out.len())?;
        if r0 == r1 {
            return Ok(());
        }
        let jobs = block_jobs((t.rows, t.rows_per_block), (r0, r1), rb as usize, out);
        let run = |(b, _first, n, lo, hi, dst): BlockJob<'_, u8>| {
            let payload = self.read_payload(tensor, b, (hi - lo, n))?;
            let raw =
                codec::raw_block_rows(&t.codec, &payload, n, t.cols, lo, hi).map_err(|e| {
                    ReadError::Corrupt {
                        tensor: t.name.clone(),
                        block: b,
                        reason: e.to_string(),
                    }
                })?;
            dst.copy_from_slice(raw);
            Ok(())
        };
        if jobs.len() == 1 {
            jobs.into_iter().try_for_each(run)
        } else {
            jobs.into_par_iter().try_for_each(run)
        }
    }
}

impl Store for CawsfArchive {
    fn kind(&self) -> Kind {
        Kind::Cawsf
    }
    fn path(&self) -> &Path {
        &self.path
    }
    fn model(&self) -> &ModelDesc {
        CawsfArchive::model(self)
    }
    fn tensor_summary(&self, tensor: usize) -> TensorSummary {
        let info = self.tensor_info(tensor);
        let name = &CawsfArchive::model(self).tensors[tensor].name;
        TensorSummary {
            codec: crate::codec::codec_label(&info.codec),
            rows_per_block: info.rows_per_block,
            n_blocks: info.n_blocks,
            stored_bytes: info.stored_bytes,
            rel_err: rel_err_of(CawsfArchive::extra(self), name),
            grid: match info.codec {
                TensorCodec::Ndsq {
                    rank: 0,
                    outlier_q,
                    sq,
                    ..
                } if outlier_q >= 1.0 => sq,
                _ => None,
            },
        }
    }
    fn parts(&self) -> Vec<SectionInfo> {
        self.sections()
    }
    fn identity(&self) -> u128 {
        crate::archive::container::toc_identity("cawsf", &self.toc)
    }
    fn verify_all(&self) -> Vec<String> {
        CawsfArchive::verify_all(self)
    }
    fn read_counters(&self) -> ReadCounterSnapshot {
        CawsfArchive::read_counters(self)
    }
    fn fetch_stats(&self) -> Option<crate::archive::remote::FetchSnapshot> {
        self.file.remote().map(|o| o.snapshot())
    }
    fn extra(&self) -> serde_json::Value {
        CawsfArchive::extra(self).clone()
    }
    fn block_locations(&self, tensor: usize) -> Vec<(u64, u64)> {
        (0..self.tensor_info(tensor).n_blocks)
            .map(|b| self.block_location(tensor, b))
            .collect()
    }
    fn routing_bytes(&self) -> &[u8] {
        self.routing()
    }
}
