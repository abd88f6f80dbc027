//! Reader of the delta archive: an archive opened and validated (in `open`) reconstructs
//! rows r0..r1 of a delta matrix as B̂[r0..r1] + U[r0..r1]·Vᵀ with one faer GEMM per row
//! block. Every blob's XXH3-64 is
//! checked before it is decompressed or used. Decoded base blocks and Vᵀ blobs, shared
//! by many reads (a base by every layer of its cluster), sit in a small LRU bounded in
//! bytes so the daemon's memory stays near its budget.

use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use super::format::*;
use crate::archive::file::ArchiveFile;
use crate::archive::SectionInfo;
use crate::archive::{
    block_jobs, check_read, rel_err_of, BlockJob, BlockMemo, Kind, ReadCounterSnapshot,
    ReadCounters, Store, TensorSummary,
};
use crate::codec::delta::{decode_base_block, f16_to_f32};
use crate::codec::{self, TensorCodec};
use crate::model::{ModelDesc, ReadError, RowSource, SourceType};
use crate::reconstruct::{self, LowRank, Work};

/// Bytes of decoded (f32) base blocks and Vᵀ blobs kept between reads. A Vᵀ is needed
/// by every block of its matrix (up to rank·cols·4 = 3.5 MiB at full rank on a
/// 576×1536 matrix): the cache holds the current matrices' so a sequential read decodes
/// each once, and concurrent readers share one copy instead of decoding their own.
const SHARED_CACHE_BYTES: usize = 12 << 20;
/// Larger items are decoded per use and not kept.
const SHARED_ITEM_MAX: usize = SHARED_CACHE_BYTES / 2;

pub(super) struct BaseEntry {
    pub(super) ty: String,
    pub(super) cluster: u32,
    pub(super) cols: u64,
    pub(super) first_blob: usize,
}

pub(super) enum TensorKind {
    Pass {
        format: SourceType,
    },
    Delta {
        base: usize,
        rank: usize,
        vt_blob: usize,
    },
}

pub(super) struct TensorEntry {
    pub(super) name: String,
    pub(super) kind: TensorKind,
    pub(super) rows: u64,
    pub(super) cols: u64,
    pub(super) rows_per_block: u64,
    pub(super) first_blob: usize,
    pub(super) n_blocks: usize,
}

pub(super) struct SharedCache {
    pub(super) lru: lru::LruCache<usize, Arc<Vec<f32>>>,
    pub(super) bytes: usize,
}

/// An opened delta archive.
pub struct DeltaArchive {
    pub(super) path: PathBuf,
    pub(super) file: ArchiveFile,
    pub(super) toc: Vec<TocRecord>,
    /// Hash of the TOC (checksums included), set at open: names resident GPU data and
    /// the disk tier's entries.
    pub(super) identity: u128,
    pub(super) model: ModelDesc,
    pub(super) extra: serde_json::Value,
    pub(super) base_dtype: BaseDtype,
    pub(super) bases: Vec<BaseEntry>,
    pub(super) tensors: Vec<TensorEntry>,
    pub(super) index: Vec<BlobEntry>,
    pub(super) routing: Vec<u8>,
    pub(super) data_offset: u64,
    pub(super) cache: Mutex<SharedCache>,
    pub(super) counters: ReadCounters,
    /// Blobs of passthrough blocks, and delta blocks decoded (Base + U·Vᵀ, the whole
    /// block's product), that a read needed only in part.
    pub(super) memo_blobs: BlockMemo<u8>,
}

/// Does the file at `path` start with the delta archive's magic?
pub fn has_magic(path: &Path) -> bool {
    use std::io::Read;
    let mut m = [0u8; 8];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut m))
        .is_ok_and(|_| is_magic(&m))
}

/// Whether a file's first bytes are a delta archive's magic.
pub fn is_magic(head: &[u8]) -> bool {
    head.starts_with(&MAGIC)
}

impl DeltaArchive {
    /// Checksum, then decompression of one blob (index valid, checked at open).
    fn blob(&self, blob: usize) -> Result<Vec<u8>, BlobFault> {
        let e = &self.index[blob];
        let stored =
            self.file
                .read_verified(self.data_offset + e.offset, e.csize as usize, |s| {
                    xxhash_rust::xxh3::xxh3_64(s) == e.xxh3
                })?;
        self.counters.record(e.csize as u64, e.usize as u64);
        Ok(
            match checked_payload(&stored, e.xxh3, e.comp, e.usize as usize)? {
                Cow::Owned(v) => v,
                Cow::Borrowed(_) => stored,
            },
        )
    }

    /// A decoded shared blob (base block or Vᵀ) through the bounded cache.
    fn shared(
        &self,
        blob: usize,
        decode: impl FnOnce(&[u8]) -> Vec<f32>,
    ) -> Result<Arc<Vec<f32>>, BlobFault> {
        if let Some(v) = self.cache.lock().expect("cache lock").lru.get(&blob) {
            return Ok(v.clone());
        }
        let v = Arc::new(decode(&self.blob(blob)?));
        let size = v.len() * 4;
        if size <= SHARED_ITEM_MAX {
            let mut c = self.cache.lock().expect("cache lock");
            if c.lru.put(blob, v.clone()).is_none() {
                c.bytes += size;
            }
            while c.bytes > SHARED_CACHE_BYTES {
                match c.lru.pop_lru() {
                    Some((_, old)) => c.bytes -= old.len() * 4,
                    None => break,
                }
            }
        }
        Ok(v)
    }

    fn base_label(&self, base: usize) -> String {
        let b = &self.bases[base];
        format!("base {}#{}", type_label(&b.ty), b.cluster)
    }

    fn fault(&self, tensor: usize, block: usize, part: Option<String>, f: BlobFault) -> ReadError {
        let t = &self.tensors[tensor];
        match (part, f) {
            (None, BlobFault::Checksum { stored, computed }) => ReadError::Checksum {
                tensor: t.name.clone(),
                block,
                stored,
                computed,
            },
            (None, BlobFault::Corrupt(reason)) => ReadError::Corrupt {
                tensor: t.name.clone(),
                block,
                reason,
            },
            (None, f) => f.into_read_error(&t.name, block, "the block"),
            (Some(part), f) => f.into_read_error(&t.name, block, &format!("its {part}")),
        }
    }

    /// What rows of block `b` of tensor `ti` are computed from, checked; `rows` is
    /// (rows the read takes, rows the block has).
    fn block_input(&self, ti: usize, b: usize, rows: (u64, u64)) -> Result<BlockInput, ReadError> {
        let t = &self.tensors[ti];
        let cols = t.cols as usize;
        let n = rows.1 as usize;
        match t.kind {
            TensorKind::Pass { .. } => Ok(BlockInput::Pass(self.memo_blob(ti, b, rows)?)),
            TensorKind::Delta {
                base,
                rank,
                vt_blob,
            } => {
                // The block's own U first, then the shared parts it needs.
                let u = self
                    .blob(t.first_blob + b)
                    .map_err(|f| self.fault(ti, b, None, f))?;
                if u.len() != n * rank * 2 {
                    return Err(ReadError::Corrupt {
                        tensor: t.name.clone(),
                        block: b,
                        reason: format!(
                            "U holds {} bytes, {n} rows of rank {rank} need {}",
                            u.len(),
                            n * rank * 2
                        ),
                    });
                }
                let dtype = self.base_dtype;
                let base_blob = self.bases[base].first_blob + b;
                let bb = self
                    .shared(base_blob, |p| {
                        let mut v = vec![0f32; n * cols];
                        decode_base_block(dtype, p, n, cols, &mut v);
                        v
                    })
                    .map_err(|f| {
                        self.fault(
                            ti,
                            b,
                            Some(format!("{} block {b}", self.base_label(base))),
                            f,
                        )
                    })?;
                let vt = if rank == 0 {
                    Arc::new(Vec::new())
                } else {
                    self.shared(vt_blob, |p| {
                        let mut v = vec![0f32; rank * cols];
                        f16_to_f32(p, &mut v);
                        v
                    })
                    .map_err(|f| self.fault(ti, b, Some("Vt blob".into()), f))?
                };
                Ok(BlockInput::Delta {
                    u,
                    base: bb,
                    base_blob,
                    vt,
                    vt_blob,
                    rank,
                })
            }
        }
    }

    /// Blob of passthrough block `b` of tensor `ti` through the memo, for a read of
    /// `rows` (rows it takes, rows the block has).
    fn memo_blob(&self, ti: usize, b: usize, rows: (u64, u64)) -> Result<Arc<Vec<u8>>, ReadError> {
        let blob = self.tensors[ti].first_blob + b;
        self.memo_blobs
            .get_or_load((ti, b), rows, || self.blob(blob))
            .map_err(|f| self.fault(ti, b, None, f))
    }

    /// Every integrity failure, one line each.
    pub fn verify_all(&self) -> Vec<String> {
        let describe = |i: usize| -> String {
            let e = &self.index[i];
            match e.kind {
                KIND_BASE => format!("{} block {}", self.base_label(e.owner as usize), e.block),
                KIND_VT => format!("tensor {} Vt blob", self.tensors[e.owner as usize].name),
                _ => format!(
                    "block {} of tensor {}",
                    e.block, self.tensors[e.owner as usize].name
                ),
            }
        };
        let mut fails: Vec<String> = (0..self.index.len())
            .into_par_iter()
            .filter_map(|i| self.blob(i).err().map(|f| f.describe(&describe(i))))
            .collect();
        fails.extend(section_failures(&self.file, &self.toc, section_name));
        fails
    }
}

/// One block's checked inputs for a read.
enum BlockInput {
    Pass(Arc<Vec<u8>>),
    Delta {
        u: Vec<u8>,
        /// The whole block's rows of its base, decoded.
        base: Arc<Vec<f32>>,
        base_blob: usize,
        vt: Arc<Vec<f32>>,
        vt_blob: usize,
        rank: usize,
    },
}

impl RowSource for DeltaArchive {
    fn read_rows(&self, tensor: usize, r0: u64, r1: u64, out: &mut [f32]) -> Result<(), ReadError> {
        let t = self
            .tensors
            .get(tensor)
            .ok_or_else(|| ReadError::OutOfRange {
                tensor: format!("#{tensor}"),
                r0,
                r1,
            })?;
        check_read(&t.name, (t.rows, t.cols), (r0, r1), out.len())?;
        if r0 == r1 {
            return Ok(());
        }
        let cols = t.cols as usize;
        let jobs = block_jobs((t.rows, t.rows_per_block), (r0, r1), cols, out);
        // Every block's checked inputs (in parallel), then one call to the backend: a
        // row's value depends on nothing but its own inputs (codec::add_low_rank's
        // fixed order), so a read computes only the rows it asks for.
        let load = |j: &BlockJob<'_, f32>| self.block_input(tensor, j.0, (j.4 - j.3, j.2));
        let inputs: Vec<BlockInput> = if jobs.len() == 1 {
            vec![load(&jobs[0])?]
        } else {
            jobs.par_iter().map(load).collect::<Result<_, _>>()?
        };
        let id = self.identity;
        // A passthrough tensor's (empty) global blob, parsed once for the read.
        let pass = match t.kind {
            TensorKind::Pass { format } => {
                let codec = TensorCodec::Passthrough { format };
                let g = codec::decode_global(&codec, &[], t.rows, t.cols).map_err(|e| {
                    ReadError::Corrupt {
                        tensor: t.name.clone(),
                        block: jobs[0].0,
                        reason: e.to_string(),
                    }
                })?;
                Some((codec, g))
            }
            TensorKind::Delta { .. } => None,
        };
        let mut works = Vec::with_capacity(jobs.len());
        for ((b, first, n, lo, hi, dst), input) in jobs.into_iter().zip(&inputs) {
            let (lo, hi) = (lo as usize, hi as usize);
            let work = match (input, &pass) {
                (BlockInput::Pass(payload), Some((codec, g))) => {
                    let parts = codec::block_parts(
                        codec, g, payload, first, n, t.cols, lo as u64, hi as u64,
                    )
                    .map_err(|e| ReadError::Corrupt {
                        tensor: t.name.clone(),
                        block: b,
                        reason: e.to_string(),
                    })?;
                    Work::Block(parts)
                }
                (
                    BlockInput::Delta {
                        u,
                        base,
                        base_blob,
                        vt,
                        vt_blob,
                        rank,
                    },
                    _,
                ) => Work::LowRank(LowRank {
                    base,
                    base_row0: lo,
                    // Shared parts are named by (archive, blob): a GPU keeps them resident.
                    base_key: reconstruct::item_key(id, *base_blob as u64),
                    u_f16: &u[lo * rank * 2..hi * rank * 2],
                    vt,
                    vt_key: reconstruct::item_key(id, *vt_blob as u64),
                    rank: *rank,
                    rows: hi - lo,
                    cols,
                }),
                (BlockInput::Pass(_), None) => {
                    unreachable!("block_input follows the tensor's kind")
                }
            };
            works.push((work, dst));
        }
        reconstruct::decode(works);
        Ok(())
    }

    fn raw_format(&self, tensor: usize) -> Option<SourceType> {
        match self.tensors.get(tensor)?.kind {
            TensorKind::Pass { format } => Some(format),
            TensorKind::Delta { .. } => None,
        }
    }

    fn read_raw_rows(
        &self,
        tensor: usize,
        r0: u64,
        r1: u64,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        let t = self
            .tensors
            .get(tensor)
            .ok_or_else(|| ReadError::NotRaw(format!("#{tensor}")))?;
        let TensorKind::Pass { format } = t.kind else {
            return Err(ReadError::NotRaw(t.name.clone()));
        };
        let codec = TensorCodec::Passthrough { format };
        let corrupt = |block: usize, e: codec::CodecError| ReadError::Corrupt {
            tensor: t.name.clone(),
            block,
            reason: e.to_string(),
        };
        let rb = codec::passthrough_row_bytes(format, t.cols).map_err(|e| corrupt(0, e))?;
        check_read(&t.name, (t.rows, rb), (r0, r1), out.len())?;
        if r0 == r1 {
            return Ok(());
        }
        let jobs = block_jobs((t.rows, t.rows_per_block), (r0, r1), rb as usize, out);
        let run = |(b, _first, n, lo, hi, dst): BlockJob<'_, u8>| {
            let payload = self.memo_blob(tensor, b, (hi - lo, n))?;
            let raw = codec::raw_block_rows(&codec, &payload, n, t.cols, lo, hi)
                .map_err(|e| corrupt(b, e))?;
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

impl Store for DeltaArchive {
    fn kind(&self) -> Kind {
        Kind::Delta
    }
    fn path(&self) -> &Path {
        &self.path
    }
    fn model(&self) -> &ModelDesc {
        &self.model
    }
    fn tensor_summary(&self, tensor: usize) -> TensorSummary {
        let t = &self.tensors[tensor];
        let mut stored: u64 = (t.first_blob..t.first_blob + t.n_blocks)
            .map(|i| self.index[i].csize as u64)
            .sum();
        let codec = match t.kind {
            TensorKind::Pass { format } => {
                crate::codec::codec_label(&TensorCodec::Passthrough { format })
            }
            TensorKind::Delta {
                base,
                rank,
                vt_blob,
            } => {
                stored += self.index[vt_blob].csize as u64;
                let dt = match self.base_dtype {
                    BaseDtype::F16 => "f16",
                    BaseDtype::Int8 => "int8",
                };
                let b = &self.bases[base];
                format!("delta(r={rank},{}#{} {dt})", type_label(&b.ty), b.cluster)
            }
        };
        TensorSummary {
            codec,
            rows_per_block: t.rows_per_block,
            n_blocks: t.n_blocks,
            stored_bytes: stored,
            rel_err: rel_err_of(&self.extra, &t.name),
            grid: None,
        }
    }
    fn identity(&self) -> u128 {
        self.identity
    }
    fn parts(&self) -> Vec<SectionInfo> {
        section_infos(&self.toc, section_name)
    }
    fn verify_all(&self) -> Vec<String> {
        DeltaArchive::verify_all(self)
    }
    fn read_counters(&self) -> ReadCounterSnapshot {
        self.counters.snapshot()
    }
    fn fetch_stats(&self) -> Option<crate::archive::remote::FetchSnapshot> {
        self.file.remote().map(|o| o.snapshot())
    }
    fn extra(&self) -> serde_json::Value {
        self.extra.clone()
    }
    fn block_locations(&self, tensor: usize) -> Vec<(u64, u64)> {
        let t = &self.tensors[tensor];
        (t.first_blob..t.first_blob + t.n_blocks)
            .map(|i| {
                (
                    self.data_offset + self.index[i].offset,
                    self.index[i].csize as u64,
                )
            })
            .collect()
    }
    fn routing_bytes(&self) -> &[u8] {
        &self.routing
    }
}

impl DeltaArchive {
    /// (file offset, stored length) of every block of base `base` (for tests and
    /// `inspect`), and the number of bases.
    pub fn base_block_locations(&self, base: usize) -> Vec<(u64, u64)> {
        let first = self.bases[base].first_blob;
        let n = self
            .index
            .iter()
            .filter(|e| e.kind == KIND_BASE && e.owner as usize == base)
            .count();
        (first..first + n)
            .map(|i| {
                (
                    self.data_offset + self.index[i].offset,
                    self.index[i].csize as u64,
                )
            })
            .collect()
    }
    pub fn n_bases(&self) -> usize {
        self.bases.len()
    }
    /// The tensor's Vᵀ blob location, for delta tensors.
    pub fn vt_location(&self, tensor: usize) -> Option<(u64, u64)> {
        match self.tensors.get(tensor)?.kind {
            TensorKind::Delta { vt_blob, .. } => Some((
                self.data_offset + self.index[vt_blob].offset,
                self.index[vt_blob].csize as u64,
            )),
            TensorKind::Pass { .. } => None,
        }
    }
    /// Columns of base `base` (for consistency checks in tests).
    pub fn base_cols(&self, base: usize) -> u64 {
        self.bases[base].cols
    }
}
