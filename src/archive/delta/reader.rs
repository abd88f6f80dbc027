//! Reader of the delta archive: memory-maps the file, validates every offset, length
//! and cross-reference at open, and reconstructs rows r0..r1 of a delta matrix as
//! B̂[r0..r1] + U[r0..r1]·Vᵀ with one faer GEMM per row block. Every blob's XXH3-64 is
//! checked before it is decompressed or used. Decoded base blocks and Vᵀ blobs, shared
//! by many reads (a base by every layer of its cluster), sit in a small LRU bounded in
//! bytes so the daemon's memory stays near its budget.

use std::borrow::Cow;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use faer::{Accum, MatMut, MatRef, Par};
use memmap2::Mmap;
use rayon::prelude::*;

use super::format::*;
use crate::archive::{
    check_read, rel_err_of, Kind, ReadCounterSnapshot, ReadCounters, Store, TensorSummary,
};
use crate::archive::{ArchiveError, SectionInfo};
use crate::codec::delta::{decode_base_block, f16_to_f32};
use crate::codec::{self, TensorCodec};
use crate::model::{ModelDesc, ReadError, RowSource, SourceType};

/// Bytes of decoded (f32) base blocks and Vᵀ blobs kept between reads. A Vᵀ is needed
/// by every block of its matrix (up to rank·cols·4 = 3.5 MiB at full rank on a
/// 576×1536 matrix): the cache holds the current matrices' so a sequential read decodes
/// each once, and concurrent readers share one copy instead of decoding their own.
const SHARED_CACHE_BYTES: usize = 12 << 20;
/// Larger items are decoded per use and not kept.
const SHARED_ITEM_MAX: usize = SHARED_CACHE_BYTES / 2;

struct BaseEntry {
    ty: String,
    cluster: u32,
    cols: u64,
    first_blob: usize,
}

enum TensorKind {
    Pass {
        format: SourceType,
    },
    Delta {
        base: usize,
        rank: usize,
        vt_blob: usize,
    },
}

struct TensorEntry {
    name: String,
    kind: TensorKind,
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    first_blob: usize,
    n_blocks: usize,
}

struct SharedCache {
    lru: lru::LruCache<usize, Arc<Vec<f32>>>,
    bytes: usize,
}

/// An opened delta archive.
pub struct DeltaArchive {
    path: PathBuf,
    map: Mmap,
    toc: Vec<TocRecord>,
    model: ModelDesc,
    extra: serde_json::Value,
    base_dtype: BaseDtype,
    bases: Vec<BaseEntry>,
    tensors: Vec<TensorEntry>,
    index: Vec<BlobEntry>,
    routing: Vec<u8>,
    data_offset: u64,
    cache: Mutex<SharedCache>,
    counters: ReadCounters,
}

/// Bound on a compressed blob's decoded size (no allocation beyond what the file
/// justifies).
fn blob_usize_ok(csize: u32, usize: u32) -> bool {
    (usize as u64) <= (csize as u64) * 4096 + (1 << 20)
}

/// Does the file at `path` start with the delta archive's magic?
pub fn has_magic(path: &Path) -> bool {
    use std::io::Read;
    let mut m = [0u8; 8];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut m))
        .is_ok_and(|_| m == MAGIC)
}

impl DeltaArchive {
    pub fn open(path: &Path) -> Result<DeltaArchive, ArchiveError> {
        let map = map_container(path, HEADER_FIXED + 8, "delta archive")?;
        let data: &[u8] = &map;
        let len = data.len() as u64;
        check_magic_version(data, &MAGIC, ("delta archive", "delta archive"))
            .map_err(|r| invalid(path, r))?;
        let n_layers = le_u32(&data[12..16]);
        let n_bases = le_u32(&data[16..20]);
        let base_dtype = BaseDtype::from_code(data[20])
            .ok_or_else(|| invalid(path, format!("bad header: base dtype code {}", data[20])))?;
        if data[21] != DTYPE_F16 || data[22..24] != [0, 0] {
            return Err(invalid(
                path,
                format!("bad header: delta dtype code {} (only 1 = f16 exists) or reserved bytes not zero", data[21]),
            ));
        }
        let toc =
            parse_toc(data, HEADER_FIXED, le_u32(&data[24..28])).map_err(|r| invalid(path, r))?;

        // Sections: bounds, alignment, flags, no overlap (the .cawsf TOC rules).
        let by_type =
            check_toc(&toc, len, &[SEC_DATA], section_name).map_err(|r| invalid(path, r))?;
        let need = |ty: u32| required(&by_type, ty, section_name).map_err(|r| invalid(path, r));
        let meta_rec = need(SEC_META)?;
        let data_rec = need(SEC_DATA)?;
        let index_rec = need(SEC_BLOB_INDEX)?;
        let routing_rec = by_type[SEC_ROUTING as usize];
        let load = |rec: &TocRecord| {
            load_section(data, rec, &section_name(rec.ty)).map_err(|r| invalid(path, r))
        };

        // META.
        let meta: MetaIn = serde_json::from_slice(&load(&meta_rec)?)
            .map_err(|e| invalid(path, format!("META is not valid: {e}")))?;
        check_meta_kind(&meta.format, meta.version, "cawsf-delta").map_err(|r| invalid(path, r))?;
        if meta.n_layers != n_layers
            || meta.bases.len() as u64 != n_bases as u64
            || meta.base_dtype != base_dtype
            || meta.delta_dtype != "f16"
        {
            return Err(invalid(
                path,
                "META's layer count, bases or dtypes disagree with the header",
            ));
        }
        check_checksum_index(&toc, SEC_META, &meta.checksum_index, section_name)
            .map_err(|r| invalid(path, r))?;

        // BLOB_INDEX: entries inside DATA, in order, not overlapping.
        let index_bytes = load(&index_rec)?;
        if index_bytes.len() % INDEX_ENTRY != 0 {
            return Err(invalid(
                path,
                format!(
                    "BLOB_INDEX is {} bytes, not a multiple of {INDEX_ENTRY}",
                    index_bytes.len()
                ),
            ));
        }
        let mut index = Vec::with_capacity(index_bytes.len() / INDEX_ENTRY);
        let mut prev_end = 0u64;
        for (i, c) in index_bytes.chunks_exact(INDEX_ENTRY).enumerate() {
            let (e, reserved_zero) = BlobEntry::parse(c);
            let bad = |why: String| invalid(path, format!("BLOB_INDEX entry {i}: {why}"));
            if !reserved_zero {
                return Err(bad("reserved bytes are not zero".into()));
            }
            if e.comp > COMP_LZ4 || (e.comp == COMP_RAW && e.usize != e.csize) {
                return Err(bad(format!(
                    "comp {} with csize {} usize {}",
                    e.comp, e.csize, e.usize
                )));
            }
            if e.comp != COMP_RAW && !blob_usize_ok(e.csize, e.usize) {
                return Err(bad(format!(
                    "claims {} bytes decompressed from {}",
                    e.usize, e.csize
                )));
            }
            match e.offset.checked_add(e.csize as u64) {
                Some(end) if end <= data_rec.size && e.offset >= prev_end => prev_end = end,
                _ => {
                    return Err(bad(format!(
                        "blob at {}+{} lies outside DATA ({} bytes) or overlaps the previous one",
                        e.offset, e.csize, data_rec.size
                    )))
                }
            }
            index.push(e);
        }
        drop(index_bytes);
        let routing = match &routing_rec {
            Some(r) => load(r)?,
            None => Vec::new(),
        };
        let model = model_from_meta(meta.model, meta.hf_files)
            .map_err(|e| invalid(path, format!("META is not valid: {e}")))?;

        // Every blob is referenced exactly once, by what its entry says owns it.
        let mut used = vec![false; index.len()];
        let mut claim =
            |what: &str, i: u64, kind: u8, owner: usize, block: usize, usize: Option<u64>| {
                let e = usize::try_from(i)
                    .ok()
                    .and_then(|i| index.get(i).map(|e| (i, e)));
                let Some((i, e)) = e else {
                    return Err(invalid(
                        path,
                        format!(
                            "{what}: blob {i} is past the end of BLOB_INDEX ({} entries)",
                            index.len()
                        ),
                    ));
                };
                if used[i] {
                    return Err(invalid(
                        path,
                        format!("{what}: blob {i} is referenced twice"),
                    ));
                }
                used[i] = true;
                if e.kind != kind || e.owner as usize != owner || e.block as usize != block {
                    return Err(invalid(
                        path,
                        format!(
                            "{what}: blob {i} is a {} of #{} block {} in BLOB_INDEX",
                            kind_name(e.kind),
                            e.owner,
                            e.block
                        ),
                    ));
                }
                if usize.is_none_or(|u| u != e.usize as u64) {
                    return Err(invalid(
                        path,
                        format!(
                            "{what}: blob {i} holds {} bytes, its shape needs {}",
                            e.usize,
                            usize.map_or_else(|| "an overflowing count".into(), |u| u.to_string())
                        ),
                    ));
                }
                Ok(())
            };
        let check_blocks = |what: &str, rows: u64, cols: u64, rpb: u64, n_blocks: u64| {
            let numel = rows.checked_mul(cols);
            if numel.is_none_or(|n| n > MAX_ELEMENTS) {
                return Err(invalid(path, format!("{what}: absurd shape {rows}x{cols}")));
            }
            if rpb == 0 || n_blocks != rows.div_ceil(rpb) {
                return Err(invalid(
                    path,
                    format!("{what}: {n_blocks} blocks of {rpb} rows cannot cover {rows} rows"),
                ));
            }
            Ok(())
        };
        let block_rows = |rows: u64, rpb: u64, b: u64| rpb.min(rows - b * rpb);

        let mut bases = Vec::with_capacity(meta.bases.len());
        for (j, mb) in meta.bases.iter().enumerate() {
            let what = format!("base {}#{}", type_label(&mb.ty), mb.cluster);
            check_blocks(&what, mb.rows, mb.cols, mb.rows_per_block, mb.n_blocks)?;
            for b in 0..mb.n_blocks {
                let nr = block_rows(mb.rows, mb.rows_per_block, b);
                let want = base_dtype.block_bytes(nr, mb.cols);
                claim(
                    &what,
                    mb.first_blob.saturating_add(b),
                    KIND_BASE,
                    j,
                    b as usize,
                    want,
                )?;
            }
            bases.push((
                mb,
                BaseEntry {
                    ty: mb.ty.clone(),
                    cluster: mb.cluster,
                    cols: mb.cols,
                    first_blob: mb.first_blob as usize,
                },
            ));
        }

        if meta.tensors.len() != model.tensors.len() {
            return Err(invalid(
                path,
                format!(
                    "tensor table has {} entries but the model has {} tensors",
                    meta.tensors.len(),
                    model.tensors.len()
                ),
            ));
        }
        let mut tensors = Vec::with_capacity(meta.tensors.len());
        for (ti, (mt, d)) in meta.tensors.iter().zip(&model.tensors).enumerate() {
            let what = format!("tensor {}", d.name);
            if mt.name() != d.name {
                return Err(invalid(
                    path,
                    format!(
                        "{what}: table name {:?} disagrees with the model",
                        mt.name()
                    ),
                ));
            }
            let numel = d.shape.iter().try_fold(1u64, |a, &x| a.checked_mul(x));
            if numel.is_none_or(|n| n > MAX_ELEMENTS) {
                return Err(invalid(path, format!("{what}: absurd shape {:?}", d.shape)));
            }
            let (rows, cols) = (d.rows(), d.cols());
            let entry = match mt {
                MetaTensor::Passthrough {
                    format,
                    rows_per_block,
                    first_blob,
                    n_blocks,
                    ..
                } => {
                    check_blocks(&what, rows, cols, *rows_per_block, *n_blocks)?;
                    if *format != d.source {
                        return Err(invalid(
                            path,
                            format!(
                                "{what}: stored as {format:?} but the model says {:?}",
                                d.source
                            ),
                        ));
                    }
                    let rb = codec::passthrough_row_bytes(*format, cols)
                        .map_err(|e| invalid(path, format!("{what}: {e}")))?;
                    for b in 0..*n_blocks {
                        let want = rb.checked_mul(block_rows(rows, *rows_per_block, b));
                        claim(
                            &what,
                            first_blob.saturating_add(b),
                            KIND_PASS,
                            ti,
                            b as usize,
                            want,
                        )?;
                    }
                    TensorEntry {
                        name: d.name.clone(),
                        kind: TensorKind::Pass { format: *format },
                        rows,
                        cols,
                        rows_per_block: *rows_per_block,
                        first_blob: *first_blob as usize,
                        n_blocks: *n_blocks as usize,
                    }
                }
                MetaTensor::Delta {
                    base,
                    rank,
                    rows_per_block,
                    first_blob,
                    n_blocks,
                    vt_blob,
                    ..
                } => {
                    check_blocks(&what, rows, cols, *rows_per_block, *n_blocks)?;
                    let Some((mb, _)) = usize::try_from(*base).ok().and_then(|b| bases.get(b))
                    else {
                        return Err(invalid(
                            path,
                            format!("{what}: base {base} does not exist ({} bases)", bases.len()),
                        ));
                    };
                    if mb.rows != rows || mb.cols != cols || mb.rows_per_block != *rows_per_block {
                        return Err(invalid(
                            path,
                            format!("{what}: its base is {}x{} in blocks of {} rows, the tensor {rows}x{cols} in blocks of {rows_per_block}",
                                mb.rows, mb.cols, mb.rows_per_block),
                        ));
                    }
                    let layer = crate::model::names::layer_of(&d.name);
                    if !d.name.ends_with(&mb.ty) || layer.is_none_or(|l| !mb.layers.contains(&l)) {
                        return Err(invalid(
                            path,
                            format!(
                                "{what}: base {base} is for {} layers {:?}",
                                mb.ty, mb.layers
                            ),
                        ));
                    }
                    if *rank > rows.min(cols) {
                        return Err(invalid(
                            path,
                            format!("{what}: rank {rank} exceeds min({rows}, {cols})"),
                        ));
                    }
                    for b in 0..*n_blocks {
                        let want = block_rows(rows, *rows_per_block, b)
                            .checked_mul(*rank)
                            .and_then(|x| x.checked_mul(2));
                        claim(
                            &what,
                            first_blob.saturating_add(b),
                            KIND_U,
                            ti,
                            b as usize,
                            want,
                        )?;
                    }
                    claim(
                        &what,
                        *vt_blob,
                        KIND_VT,
                        ti,
                        0,
                        rank.checked_mul(cols).and_then(|x| x.checked_mul(2)),
                    )?;
                    TensorEntry {
                        name: d.name.clone(),
                        kind: TensorKind::Delta {
                            base: *base as usize,
                            rank: *rank as usize,
                            vt_blob: *vt_blob as usize,
                        },
                        rows,
                        cols,
                        rows_per_block: *rows_per_block,
                        first_blob: *first_blob as usize,
                        n_blocks: *n_blocks as usize,
                    }
                }
            };
            tensors.push(entry);
        }
        if let Some(i) = used.iter().position(|u| !u) {
            return Err(invalid(
                path,
                format!("BLOB_INDEX entry {i} belongs to no base or tensor"),
            ));
        }
        let bases = bases.into_iter().map(|(_, b)| b).collect();
        Ok(DeltaArchive {
            path: path.to_path_buf(),
            toc,
            model,
            extra: meta.extra,
            base_dtype,
            bases,
            tensors,
            index,
            routing,
            data_offset: data_rec.offset,
            cache: Mutex::new(SharedCache {
                lru: lru::LruCache::unbounded(),
                bytes: 0,
            }),
            counters: ReadCounters::default(),
            map,
        })
    }

    fn stored(&self, blob: usize) -> &[u8] {
        let e = &self.index[blob];
        let start = (self.data_offset + e.offset) as usize;
        &self.map[start..start + e.csize as usize]
    }

    /// Checksum, then decompression of one blob (index valid, checked at open).
    fn blob(&self, blob: usize) -> Result<Cow<'_, [u8]>, BlobFault> {
        let e = &self.index[blob];
        self.counters.record(e.csize as u64, e.usize as u64);
        checked_payload(self.stored(blob), e.xxh3, e.comp, e.usize as usize)
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
            (Some(part), f) => ReadError::Corrupt {
                tensor: t.name.clone(),
                block,
                reason: f.describe(&format!("its {part}")),
            },
        }
    }

    /// Rows lo..hi (relative to the block) of block `b` of tensor `ti` into `dst`.
    fn decode_block(
        &self,
        ti: usize,
        b: usize,
        lo: usize,
        hi: usize,
        dst: &mut [f32],
    ) -> Result<(), ReadError> {
        let t = &self.tensors[ti];
        let cols = t.cols as usize;
        let first = b as u64 * t.rows_per_block;
        let n = (t.rows_per_block.min(t.rows - first)) as usize;
        match t.kind {
            TensorKind::Pass { format } => {
                let payload = self
                    .blob(t.first_blob + b)
                    .map_err(|f| self.fault(ti, b, None, f))?;
                let codec = TensorCodec::Passthrough { format };
                let g = codec::decode_global(&codec, &[], t.rows, t.cols).map_err(|e| {
                    ReadError::Corrupt {
                        tensor: t.name.clone(),
                        block: b,
                        reason: e.to_string(),
                    }
                })?;
                codec::decode_block_rows(
                    &codec, &g, &payload, first, n as u64, t.cols, lo as u64, hi as u64, dst,
                )
                .map_err(|e| ReadError::Corrupt {
                    tensor: t.name.clone(),
                    block: b,
                    reason: e.to_string(),
                })
            }
            TensorKind::Delta {
                base,
                rank,
                vt_blob,
            } => {
                // The block's own U first, then the shared parts it needs.
                let u = self
                    .blob(t.first_blob + b)
                    .map_err(|f| self.fault(ti, b, None, f))?;
                let dtype = self.base_dtype;
                let bb = self
                    .shared(self.bases[base].first_blob + b, |p| {
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
                if rank == 0 || hi == lo {
                    dst.copy_from_slice(&bb[lo * cols..hi * cols]);
                    return Ok(());
                }
                let vt = self
                    .shared(vt_blob, |p| {
                        let mut v = vec![0f32; rank * cols];
                        f16_to_f32(p, &mut v);
                        v
                    })
                    .map_err(|f| self.fault(ti, b, Some("Vt blob".into()), f))?;
                // Always the whole block's product: the GEMM's summation order depends on
                // its shape, and a row must come out bit-identical whatever range asked
                // for it (mounted files equal `export`).
                let mut uf = vec![0f32; n * rank];
                f16_to_f32(&u, &mut uf);
                let mut full = bb.as_slice().to_vec();
                faer::linalg::matmul::matmul(
                    MatMut::from_row_major_slice_mut(&mut full, n, cols),
                    Accum::Add,
                    MatRef::from_row_major_slice(&uf, n, rank),
                    MatRef::from_row_major_slice(&vt, rank, cols),
                    1.0f32,
                    Par::Seq,
                );
                dst.copy_from_slice(&full[lo * cols..hi * cols]);
                Ok(())
            }
        }
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
        fails.extend(section_failures(&self.map, &self.toc, section_name));
        fails
    }
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
        let cols = t.cols as usize;
        if r0 == r1 {
            return Ok(());
        }
        let rpb = t.rows_per_block;
        let mut jobs = Vec::new();
        let mut rest = out;
        for b in (r0 / rpb)..=((r1 - 1) / rpb) {
            let first = b * rpb;
            let lo = r0.max(first) - first;
            let hi = r1.min(first + rpb) - first;
            let (mine, tail) = rest.split_at_mut((hi - lo) as usize * cols);
            rest = tail;
            jobs.push((b as usize, lo as usize, hi as usize, mine));
        }
        let run = |(b, lo, hi, dst): (usize, usize, usize, &mut [f32])| {
            self.decode_block(tensor, b, lo, hi, dst)
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
        }
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
