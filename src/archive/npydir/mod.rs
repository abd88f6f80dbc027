//! The npy-dir (Squish) archive kind (docs/NPYDIR.md): a directory of `.npy` /
//! `.npy.zst` files per tensor (int8 per row, int4 per group nibble-packed, f16
//! passthrough) with `manifest.json`, and in directories cawsfs wrote a `cawsfs.json`
//! with the full model description and an XXH3-64 per row block of every file.
//!
//! Every file is validated at open (npy header, dtype, shape against the manifest and the
//! scales, exact length, zstd frames walked), so reads only index into ranges known to be
//! inside the file. Rows `r0..r1` are a contiguous byte range of each file: plain `.npy`
//! files are memory-mapped, cawsfs's `.npy.zst` hold one zstd frame per row block, and a
//! foreign single-frame `.npy.zst` is decompressed whole into a small LRU.
//!
//! Files: [`sidecar`] (`cawsfs.json` and opening what cawsfs wrote), [`foreign`]
//! (directories without it), [`files`] (one data file: open checks, block reads, the
//! whole-file LRU), [`frames`] (zstd frame walking), [`geometry`] (where a row block lies
//! in each file), [`npy`] (the npy header). This file holds the directory itself and its
//! [`Store`] implementation.

mod files;
mod foreign;
mod frames;
mod geometry;
pub mod npy;
mod sidecar;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

use crate::archive::container::{invalid, BlobFault};
use crate::archive::dir::ArchiveDir;
use crate::archive::file::REFETCHES;
use crate::archive::{
    check_read, rel_err_of, BlockMemo, Kind, ReadCounterSnapshot, ReadCounters, Store,
    TensorSummary,
};
use crate::archive::{ArchiveError, SectionInfo};
use crate::codec::{le, BlockParts};
use crate::model::{ModelDesc, ReadError, RowSource, SourceType};
use crate::reconstruct::{self, IntQ, Work};
use files::{DataFile, Opener, WholeCache};
use foreign::open_foreign;
use geometry::{Geo, Geometry};
use sidecar::open_with_sidecar;

/// The writer's name for the XXH3-64 hex spelling every kind uses.
pub use crate::archive::container::hex64 as hex;
pub use sidecar::{seal_sidecar, SideFile, SideTensor, Sidecar, SIDECAR_VERSION};

pub const MANIFEST: &str = "manifest.json";
pub const SIDECAR: &str = "cawsfs.json";
pub const ROUTING_FILE: &str = "routing.bin";
pub const TENSOR_DIR: &str = "tensors";
pub const SIDECAR_FORMAT: &str = "cawsfs-npy-dir";
/// JSON and side files larger than this are refused.
const MAX_SMALL_FILE: u64 = 256 << 20;
/// Files in `tensors/` and zstd frames in one file, at most.
const MAX_FILES: usize = 1 << 20;

/// A JSON or side file of the directory, refused above [`MAX_SMALL_FILE`].
fn read_small(src: &ArchiveDir, rel: &str) -> Result<Vec<u8>, ArchiveError> {
    src.read_small(rel, MAX_SMALL_FILE)
}

/// `safe_key` as Squish computes it.
pub fn safe_key(name: &str) -> String {
    name.replace('.', "__")
}

struct Entry {
    geom: Geometry,
    /// `[q, s]` (int8, int4) or `[pt]`.
    files: Vec<DataFile>,
    /// Stored bytes of all the tensor's files (shape file included).
    stored_bytes: u64,
    /// The shape file (name in the directory, size), when there is one.
    shape_part: Option<(String, u64)>,
}

impl Entry {
    fn codec_label(&self) -> String {
        let base = match self.geom.geo {
            Geo::Int8 { g: 1, .. } => "int8".to_string(),
            Geo::Int8 { c, g } => format!("int8(g={})", c / g),
            Geo::Int4 { c, g } => format!("int4(g={})", c / g),
            Geo::Pt { format } => format!(
                "passthrough({})",
                crate::codec::format_label(format.unwrap_or(SourceType::F16))
            ),
        };
        if self.files.iter().any(|f| f.is_zst()) {
            format!("{base}+zstd")
        } else {
            base
        }
    }
}

/// Why a block could not be read, with the file it is in.
struct BlockError {
    file: String,
    err: ReadError,
}

/// An opened npy-dir. Implements [`Store`].
pub struct NpyDir {
    src: ArchiveDir,
    model: ModelDesc,
    entries: Vec<Entry>,
    parts: Vec<(String, u64)>,
    routing: Vec<u8>,
    extra: Value,
    checksummed: bool,
    identity: u128,
    counters: ReadCounters,
    whole: Mutex<WholeCache>,
    /// Blocks (dequantized) a read needed only in part.
    memo: BlockMemo<f32>,
}

/// The directory's identity (docs/TIER.md): XXH3-128 of its manifest, its
/// `cawsfs.json` (which checksums every file cawsfs wrote) and every part's name and
/// size; without checksums also each part's mtime and inode, the best a foreign
/// directory offers short of hashing all its bytes.
fn dir_identity(
    src: &ArchiveDir,
    parts: &[(String, u64)],
    checksummed: bool,
) -> Result<u128, ArchiveError> {
    let mut b = b"npy-dir".to_vec();
    for name in [MANIFEST, SIDECAR] {
        if src.is_file(name) {
            let bytes = read_small(src, name)?;
            b.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            b.extend_from_slice(&bytes);
        } else {
            b.push(0);
        }
    }
    for (name, size) in parts {
        b.extend_from_slice(name.as_bytes());
        b.push(0);
        b.extend_from_slice(&size.to_le_bytes());
        if !checksummed {
            // A part that cannot be stat'ed fails its reads later; here it only marks.
            if let Some(s) = src.stamp(name) {
                b.extend_from_slice(&s);
            }
        }
    }
    Ok(xxhash_rust::xxh3::xxh3_128(&b))
}

/// Is `path` a directory holding an npy-dir (by its manifest)?
pub fn is_npy_dir(path: &Path) -> bool {
    path.join(MANIFEST).is_file()
}

fn parse_manifest(src: &ArchiveDir) -> Result<Vec<(String, String)>, ArchiveError> {
    let path = src.at(MANIFEST);
    let bytes = read_small(src, MANIFEST)?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| invalid(&path, format!("not valid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| invalid(&path, "not a JSON object of tensor names"))?;
    if obj.is_empty() {
        return Err(invalid(&path, "lists no tensors"));
    }
    obj.iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) if !k.is_empty() && !s.is_empty() => Ok((k.clone(), s.to_string())),
            _ => Err(invalid(
                &path,
                format!("entry {k:?} is not a pair of non-empty strings"),
            )),
        })
        .collect()
}

fn list_tensor_files(src: &ArchiveDir) -> Result<HashSet<String>, ArchiveError> {
    let names = src.names(TENSOR_DIR)?;
    if names.len() > MAX_FILES {
        return Err(invalid(&src.at(TENSOR_DIR), "too many files"));
    }
    Ok(names.into_iter().collect())
}

impl NpyDir {
    /// Open the npy-dir at `path`: a directory, or a prefix in object storage
    /// (`s3://BUCKET/DIR/`, docs/REMOTE.md).
    pub fn open(path: &Path) -> Result<NpyDir, ArchiveError> {
        Self::open_in(ArchiveDir::open(path)?)
    }

    fn open_in(src: ArchiveDir) -> Result<NpyDir, ArchiveError> {
        if !src.is_file(MANIFEST) {
            return Err(invalid(
                src.path(),
                "holds no manifest.json, so it is not an npy-dir (a .cawsf or delta archive is named by its file or key)",
            ));
        }
        let manifest = parse_manifest(&src)?;
        let op = Opener {
            src: &src,
            dir: src.path(),
            next_whole: Default::default(),
        };
        let o = if src.is_file(SIDECAR) {
            open_with_sidecar(&op, &src.at(SIDECAR), &manifest)?
        } else {
            // Only a directory without cawsfs.json is matched against its listing.
            let files = list_tensor_files(&src)?;
            open_foreign(&op, &manifest, &files)?
        };
        let mut parts = o.parts;
        for e in &o.entries {
            for f in &e.files {
                parts.push((f.rel.clone(), f.file_len));
            }
            parts.extend(e.shape_part.clone());
        }
        parts.sort();
        let identity = dir_identity(&src, &parts, o.checksummed)?;
        Ok(NpyDir {
            src,
            model: o.model,
            entries: o.entries,
            parts,
            routing: o.routing,
            extra: o.extra,
            checksummed: o.checksummed,
            identity,
            counters: ReadCounters::default(),
            memo: BlockMemo::default(),
            whole: Mutex::new(WholeCache::new()),
        })
    }

    /// Whether the directory carries per-block checksums (written by cawsfs).
    pub fn checksummed(&self) -> bool {
        self.checksummed
    }

    /// Row block `b` of tensor `t`'s bytes, one part per file, checksums checked.
    fn block_bytes(&self, t: usize, b: usize) -> Result<Vec<Vec<u8>>, BlockError> {
        let e = &self.entries[t];
        let name = &self.model.tensors[t].name;
        let (ranges, _, _) = e.geom.block_ranges(b);
        let mut parts = Vec::with_capacity(e.files.len());
        for (f, &r) in e.files.iter().zip(&ranges) {
            let fail = |err| BlockError {
                file: f.rel.clone(),
                err,
            };
            let mut refetched = 0;
            let bytes = loop {
                let got = self.data_slice(f, b, r);
                let bad = match (&got, &f.sums) {
                    (Ok(bytes), Some(sums)) => xxh3_64(bytes) != sums[b],
                    (Err(BlobFault::Corrupt(_)), _) => true,
                    _ => false,
                };
                // From an object, bad bytes were damaged on the way or in the fetch
                // cache: they are dropped and fetched again, a few times.
                match f.remote_range(b, r) {
                    Some((o, off, len)) if bad && refetched < REFETCHES => {
                        o.forget(off, len);
                        refetched += 1;
                    }
                    _ => break got,
                }
            };
            let bytes = bytes.map_err(|fault| fail(fault.into_read_error(name, b, &f.rel)))?;
            if let Some(sums) = &f.sums {
                let computed = xxh3_64(&bytes);
                if computed != sums[b] {
                    return Err(fail(ReadError::Checksum {
                        tensor: name.clone(),
                        block: b,
                        stored: sums[b],
                        computed,
                    }));
                }
            }
            parts.push(bytes);
        }
        Ok(parts)
    }

    /// Block `b` of tensor `t` decoded on this thread, for `verify`.
    fn decode_block_cpu(&self, t: usize, b: usize) -> Result<(Vec<f32>, u64), BlockError> {
        let parts = self.block_bytes(t, b)?;
        let scales = self.block_scales(t, &parts);
        let work = self.block_work(t, b, &parts, &scales)?;
        let (_, el0, _) = self.entries[t].geom.block_ranges(b);
        let mut out = vec![0f32; work.values()];
        work.decode_cpu(&mut out);
        Ok((out, el0))
    }

    /// The scales of a quantized block's bytes (none for others).
    fn block_scales(&self, t: usize, parts: &[Vec<u8>]) -> Vec<f32> {
        match self.entries[t].geom.geo {
            Geo::Int8 { .. } | Geo::Int4 { .. } => {
                let mut s = vec![0f32; parts[1].len() / 4];
                le::f32s_from_le(&parts[1], &mut s);
                s
            }
            Geo::Pt { .. } => Vec::new(),
        }
    }

    /// What block `b` of tensor `t` is computed from, its sizes checked.
    fn block_work<'a>(
        &self,
        t: usize,
        b: usize,
        parts: &'a [Vec<u8>],
        scales: &'a [f32],
    ) -> Result<Work<'a>, BlockError> {
        let e = &self.entries[t];
        let name = &self.model.tensors[t].name;
        let (_, el0, el1) = e.geom.block_ranges(b);
        let n = (el1 - el0) as usize;
        let corrupt = |reason: String| BlockError {
            file: e.files[0].rel.clone(),
            err: ReadError::Corrupt {
                tensor: name.clone(),
                block: b,
                reason,
            },
        };
        match e.geom.geo {
            Geo::Int8 { c, g } | Geo::Int4 { c, g } => {
                let bits = if matches!(e.geom.geo, Geo::Int8 { .. }) {
                    8
                } else {
                    4
                };
                let (c, g) = (c as usize, g as usize);
                let rows = n / c.max(1);
                let q_need = if bits == 8 { rows * c } else { rows * (c / 2) };
                if rows * c != n || parts[0].len() != q_need || scales.len() != rows * g {
                    return Err(corrupt(format!(
                        "{n} values, {} code bytes and {} scales do not make rows of {c} in {g} groups",
                        parts[0].len(),
                        scales.len()
                    )));
                }
                Ok(Work::IntQ(IntQ {
                    bits,
                    q: &parts[0],
                    scales,
                    groups: g,
                    rows,
                    cols: c,
                }))
            }
            Geo::Pt { format: None } => Err(corrupt("passthrough file type unknown".into())),
            Geo::Pt {
                format: Some(format),
            } if parts[0].len() as u64 != n as u64 * format.served_size() => Err(corrupt(format!(
                "{} bytes for {n} values of {} bytes",
                parts[0].len(),
                format.served_size()
            ))),
            Geo::Pt {
                format: Some(format),
            } => Ok(Work::Block(BlockParts::Raw {
                format,
                bytes: &parts[0],
                rows: 1,
                cols: n,
            })),
        }
    }
}

struct Opened {
    model: ModelDesc,
    entries: Vec<Entry>,
    routing: Vec<u8>,
    extra: Value,
    checksummed: bool,
    /// Files other than the tensors' data files: (name, size).
    parts: Vec<(String, u64)>,
}

impl RowSource for NpyDir {
    fn read_rows(&self, tensor: usize, r0: u64, r1: u64, out: &mut [f32]) -> Result<(), ReadError> {
        let (Some(e), Some(t)) = (self.entries.get(tensor), self.model.tensors.get(tensor)) else {
            return Err(ReadError::OutOfRange {
                tensor: format!("#{tensor}"),
                r0,
                r1,
            });
        };
        let g = &e.geom;
        check_read(&t.name, (g.rows, g.cols), (r0, r1), out.len())?;
        if r0 == r1 {
            return Ok(());
        }
        let (e0, e1) = (r0 * g.cols, r1 * g.cols);
        let blocks: Vec<usize> = (r0 / g.rows_per_block..=(r1 - 1) / g.rows_per_block)
            .map(|b| b as usize)
            .collect();
        let rows_of = |b: usize| {
            let first = b as u64 * g.rows_per_block;
            let last = (first + g.rows_per_block).min(g.rows);
            (r1.min(last) - r0.max(first), last - first)
        };
        // A changed file has logged itself once; a line per read would bury it.
        let fail = |be: BlockError| {
            if !matches!(be.err, ReadError::Changed(_)) {
                tracing::error!("{}: {}: {}", self.src.path().display(), be.file, be.err);
            }
            be.err
        };
        // Blocks kept from an earlier read, then the others read (in parallel),
        // computed in one call to the backend, and kept where this read takes part.
        let mut vals: Vec<Option<Arc<Vec<f32>>>> = blocks
            .iter()
            .map(|&b| self.memo.get((tensor, b), rows_of(b).0))
            .collect();
        let missing: Vec<usize> = (0..blocks.len()).filter(|&i| vals[i].is_none()).collect();
        let read = |&i: &usize| self.block_bytes(tensor, blocks[i]);
        let raws: Vec<Vec<Vec<u8>>> = if missing.len() > 1 {
            missing.par_iter().map(read).collect::<Result<_, _>>()
        } else {
            missing.iter().map(read).collect::<Result<_, _>>()
        }
        .map_err(fail)?;
        let scales: Vec<Vec<f32>> = raws.iter().map(|p| self.block_scales(tensor, p)).collect();
        let mut outs: Vec<Vec<f32>> = missing
            .iter()
            .map(|&i| {
                let (_, el0, el1) = g.block_ranges(blocks[i]);
                vec![0f32; (el1 - el0) as usize]
            })
            .collect();
        let mut works = Vec::with_capacity(missing.len());
        for (((&i, parts), sc), o) in missing.iter().zip(&raws).zip(&scales).zip(&mut outs) {
            let w = self
                .block_work(tensor, blocks[i], parts, sc)
                .map_err(fail)?;
            works.push((w, &mut o[..]));
        }
        reconstruct::decode(works);
        for (&i, o) in missing.iter().zip(outs) {
            vals[i] = Some(self.memo.keep((tensor, blocks[i]), rows_of(blocks[i]), o));
        }
        for (&b, v) in blocks.iter().zip(&vals) {
            let vals = v.as_ref().expect("every block kept or computed");
            let start = g.block_ranges(b).1;
            let lo = e0.max(start);
            let hi = e1.min(start + vals.len() as u64);
            if lo < hi {
                out[(lo - e0) as usize..(hi - e0) as usize]
                    .copy_from_slice(&vals[(lo - start) as usize..(hi - start) as usize]);
            }
        }
        Ok(())
    }

    /// Plain tensors (integers ...) only: float passthrough files are served through
    /// f32 as before, whatever their source was.
    fn raw_format(&self, tensor: usize) -> Option<SourceType> {
        match self.entries.get(tensor)?.geom.geo {
            Geo::Pt {
                format: Some(f @ SourceType::Plain(_)),
            } => Some(f),
            _ => None,
        }
    }

    fn read_raw_rows(
        &self,
        tensor: usize,
        r0: u64,
        r1: u64,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        let (Some(e), Some(t)) = (self.entries.get(tensor), self.model.tensors.get(tensor)) else {
            return Err(ReadError::OutOfRange {
                tensor: format!("#{tensor}"),
                r0,
                r1,
            });
        };
        let format = self
            .raw_format(tensor)
            .ok_or_else(|| ReadError::NotRaw(t.name.clone()))?;
        let g = &e.geom;
        let rb = g.cols * format.served_size();
        check_read(&t.name, (g.rows, rb), (r0, r1), out.len())?;
        if r0 == r1 {
            return Ok(());
        }
        for b in r0 / g.rows_per_block..=(r1 - 1) / g.rows_per_block {
            let first = b * g.rows_per_block;
            let last = (first + g.rows_per_block).min(g.rows);
            let parts = self.block_bytes(tensor, b as usize).map_err(|be| {
                if !matches!(be.err, ReadError::Changed(_)) {
                    tracing::error!("{}: {}: {}", self.src.path().display(), be.file, be.err);
                }
                be.err
            })?;
            if parts[0].len() as u64 != (last - first) * rb {
                return Err(ReadError::Corrupt {
                    tensor: t.name.clone(),
                    block: b as usize,
                    reason: format!("{} bytes for {} rows of {rb}", parts[0].len(), last - first),
                });
            }
            let (lo, hi) = (r0.max(first), r1.min(last));
            out[((lo - r0) * rb) as usize..((hi - r0) * rb) as usize].copy_from_slice(
                &parts[0][((lo - first) * rb) as usize..((hi - first) * rb) as usize],
            );
        }
        Ok(())
    }
}

impl Store for NpyDir {
    fn kind(&self) -> Kind {
        Kind::NpyDir
    }
    fn path(&self) -> &Path {
        self.src.path()
    }
    fn fetch_stats(&self) -> Option<crate::archive::remote::FetchSnapshot> {
        self.src.fetch_stats()
    }
    fn model(&self) -> &ModelDesc {
        &self.model
    }
    fn tensor_summary(&self, tensor: usize) -> TensorSummary {
        let e = &self.entries[tensor];
        TensorSummary {
            codec: e.codec_label(),
            rows_per_block: e.geom.rows_per_block,
            n_blocks: e.geom.n_blocks(),
            stored_bytes: e.stored_bytes,
            rel_err: rel_err_of(&self.extra, &self.model.tensors[tensor].name),
            grid: None,
        }
    }
    fn identity(&self) -> u128 {
        self.identity
    }
    fn parts(&self) -> Vec<SectionInfo> {
        self.parts
            .iter()
            .map(|(name, size)| SectionInfo {
                kind: name.clone(),
                offset: 0,
                size: *size,
                flags: 0,
            })
            .collect()
    }
    fn verify_all(&self) -> Vec<String> {
        use rayon::prelude::*;
        let jobs: Vec<(usize, usize)> = self
            .entries
            .iter()
            .enumerate()
            .flat_map(|(t, e)| (0..e.geom.n_blocks()).map(move |b| (t, b)))
            .collect();
        jobs.par_iter()
            .filter_map(|&(t, b)| match self.decode_block_cpu(t, b) {
                Err(be) => Some(format!("{}: {}", be.file, be.err)),
                // Without checksums, at least no value may be NaN or infinite.
                Ok((v, _)) if !self.checksummed && v.iter().any(|x| !x.is_finite()) => {
                    Some(format!(
                        "tensor {} block {b}: non-finite values (corrupt scales or data)",
                        self.model.tensors[t].name
                    ))
                }
                Ok(_) => None,
            })
            .collect()
    }
    fn verify_decodes(&self) -> bool {
        true
    }
    fn read_counters(&self) -> ReadCounterSnapshot {
        self.counters.snapshot()
    }
    fn extra(&self) -> Value {
        self.extra.clone()
    }
    fn routing_bytes(&self) -> &[u8] {
        &self.routing
    }
}
