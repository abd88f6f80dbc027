//! Opening a delta archive: after the shared container phases ([`Container::open`]),
//! the checks of docs/FORMAT-DELTA.md §4–5 that are the delta kind's own: BLOB_INDEX
//! entries inside DATA and in order, every base and tensor consistent with the model,
//! and every blob referenced exactly once, by what its entry says owns it, with the
//! exact size its shape needs.

use std::path::Path;
use std::sync::Mutex;

use super::format::*;
use super::reader::{BaseEntry, DeltaArchive, SharedCache, TensorEntry, TensorKind};
use crate::archive::file::ArchiveFile;
use crate::archive::{ArchiveError, ReadCounters};
use crate::codec;
use crate::model::TensorDesc;

/// Bound on a compressed blob's decoded size (no allocation beyond what the file
/// justifies).
fn blob_usize_ok(csize: u32, usize: u32) -> bool {
    (usize as u64) <= (csize as u64) * 4096 + (1 << 20)
}

impl DeltaArchive {
    pub fn open(path: &Path) -> Result<DeltaArchive, ArchiveError> {
        Self::open_file(ArchiveFile::open(path)?)
    }

    /// [`DeltaArchive::open`] of a file (or object) already opened.
    pub fn open_file(file: ArchiveFile) -> Result<DeltaArchive, ArchiveError> {
        let Opened {
            container: c,
            header,
            meta,
        } = Container::open_file::<DeltaContainer>(file)?;
        let data_rec = c.required(SEC_DATA)?;
        let index = blob_index(&c, data_rec.size)?;
        let routing = c.load_optional(SEC_ROUTING)?;
        let model = c.model(meta.model, meta.hf_files)?;
        let kind = meta.kind;

        let mut claims = Claims {
            c: &c,
            index: &index,
            used: vec![false; index.len()],
        };
        let mut bases = Vec::with_capacity(kind.bases.len());
        for (j, mb) in kind.bases.iter().enumerate() {
            bases.push(base_entry(&mut claims, j, mb, header.base_dtype)?);
        }
        if kind.tensors.len() != model.tensors.len() {
            return Err(c.invalid(format!(
                "tensor table has {} entries but the model has {} tensors",
                kind.tensors.len(),
                model.tensors.len()
            )));
        }
        let mut tensors = Vec::with_capacity(kind.tensors.len());
        for (ti, (mt, d)) in kind.tensors.iter().zip(&model.tensors).enumerate() {
            tensors.push(tensor_entry(&mut claims, ti, mt, d, &kind.bases)?);
        }
        if let Some(i) = claims.used.iter().position(|u| !u) {
            return Err(c.invalid(format!("BLOB_INDEX entry {i} belongs to no base or tensor")));
        }
        Ok(DeltaArchive {
            path: c.path,
            identity: crate::archive::container::toc_identity("delta", &c.toc),
            toc: c.toc,
            model,
            extra: meta.extra,
            base_dtype: header.base_dtype,
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
            memo_blobs: Default::default(),
            file: c.file,
        })
    }
}

/// BLOB_INDEX: entries inside DATA (`data_size` bytes), in order, not overlapping.
fn blob_index(c: &Container, data_size: u64) -> Result<Vec<BlobEntry>, ArchiveError> {
    let index_bytes = c.load_entries(SEC_BLOB_INDEX, INDEX_ENTRY)?;
    let mut index = Vec::with_capacity(index_bytes.len() / INDEX_ENTRY);
    let mut prev_end = 0u64;
    for (i, chunk) in index_bytes.chunks_exact(INDEX_ENTRY).enumerate() {
        let bad = |why: String| c.invalid(format!("BLOB_INDEX entry {i}: {why}"));
        let Some((e, reserved_zero)) = BlobEntry::parse(chunk) else {
            continue; // `chunks_exact` gives whole entries
        };
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
            Some(end) if end <= data_size && e.offset >= prev_end => prev_end = end,
            _ => {
                return Err(bad(format!(
                    "blob at {}+{} lies outside DATA ({} bytes) or overlaps the previous one",
                    e.offset, e.csize, data_size
                )))
            }
        }
        index.push(e);
    }
    Ok(index)
}

/// Which BLOB_INDEX entries the bases and tensors have referenced so far.
struct Claims<'a> {
    c: &'a Container,
    index: &'a [BlobEntry],
    used: Vec<bool>,
}

impl Claims<'_> {
    /// `what` references blob `i` as block `block` of `kind` owned by `owner`, needing
    /// `usize` bytes (None: the count overflowed).
    fn claim(
        &mut self,
        what: &str,
        i: u64,
        (kind, owner, block): (u8, usize, usize),
        usize: Option<u64>,
    ) -> Result<(), ArchiveError> {
        let e = usize::try_from(i)
            .ok()
            .and_then(|i| self.index.get(i).map(|e| (i, e)));
        let Some((i, e)) = e else {
            return Err(self.c.invalid(format!(
                "{what}: blob {i} is past the end of BLOB_INDEX ({} entries)",
                self.index.len()
            )));
        };
        if self.used[i] {
            return Err(self
                .c
                .invalid(format!("{what}: blob {i} is referenced twice")));
        }
        self.used[i] = true;
        if e.kind != kind || e.owner as usize != owner || e.block as usize != block {
            return Err(self.c.invalid(format!(
                "{what}: blob {i} is a {} of #{} block {} in BLOB_INDEX",
                kind_name(e.kind),
                e.owner,
                e.block
            )));
        }
        if usize.is_none_or(|u| u != e.usize as u64) {
            return Err(self.c.invalid(format!(
                "{what}: blob {i} holds {} bytes, its shape needs {}",
                e.usize,
                usize.map_or_else(|| "an overflowing count".into(), |u| u.to_string())
            )));
        }
        Ok(())
    }

    /// A row-blocked matrix's shape bounded and its block count right.
    fn check_blocks(
        &self,
        what: &str,
        (rows, cols): (u64, u64),
        rpb: u64,
        n_blocks: u64,
    ) -> Result<(), ArchiveError> {
        let numel = rows.checked_mul(cols);
        if numel.is_none_or(|n| n > MAX_ELEMENTS) {
            return Err(self
                .c
                .invalid(format!("{what}: absurd shape {rows}x{cols}")));
        }
        if rpb == 0 || n_blocks != rows.div_ceil(rpb) {
            return Err(self.c.invalid(format!(
                "{what}: {n_blocks} blocks of {rpb} rows cannot cover {rows} rows"
            )));
        }
        Ok(())
    }
}

/// Rows in block `b` of a matrix of `rows` rows in blocks of `rpb`.
fn block_rows(rows: u64, rpb: u64, b: u64) -> u64 {
    rpb.min(rows - b * rpb)
}

/// Base `j`, its blocks claimed.
fn base_entry(
    claims: &mut Claims<'_>,
    j: usize,
    mb: &MetaBase,
    base_dtype: BaseDtype,
) -> Result<BaseEntry, ArchiveError> {
    let what = format!("base {}#{}", type_label(&mb.ty), mb.cluster);
    claims.check_blocks(&what, (mb.rows, mb.cols), mb.rows_per_block, mb.n_blocks)?;
    for b in 0..mb.n_blocks {
        let nr = block_rows(mb.rows, mb.rows_per_block, b);
        let want = base_dtype.block_bytes(nr, mb.cols);
        let blob = mb.first_blob.saturating_add(b);
        claims.claim(&what, blob, (KIND_BASE, j, b as usize), want)?;
    }
    Ok(BaseEntry {
        ty: mb.ty.clone(),
        cluster: mb.cluster,
        cols: mb.cols,
        first_blob: mb.first_blob as usize,
    })
}

/// Tensor `ti` (model tensor `d`), its blobs claimed; `bases` as META lists them.
fn tensor_entry(
    claims: &mut Claims<'_>,
    ti: usize,
    mt: &MetaTensor,
    d: &TensorDesc,
    bases: &[MetaBase],
) -> Result<TensorEntry, ArchiveError> {
    let c = claims.c;
    let what = format!("tensor {}", d.name);
    if mt.name() != d.name {
        return Err(c.invalid(format!(
            "{what}: table name {:?} disagrees with the model",
            mt.name()
        )));
    }
    let numel = d.shape.iter().try_fold(1u64, |a, &x| a.checked_mul(x));
    if numel.is_none_or(|n| n > MAX_ELEMENTS) {
        return Err(c.invalid(format!("{what}: absurd shape {:?}", d.shape)));
    }
    let (rows, cols) = (d.rows(), d.cols());
    let (kind, rows_per_block, first_blob, n_blocks) = match mt {
        MetaTensor::Passthrough {
            format,
            rows_per_block,
            first_blob,
            n_blocks,
            ..
        } => {
            claims.check_blocks(&what, (rows, cols), *rows_per_block, *n_blocks)?;
            if *format != d.source {
                return Err(c.invalid(format!(
                    "{what}: stored as {format:?} but the model says {:?}",
                    d.source
                )));
            }
            let rb = codec::passthrough_row_bytes(*format, cols)
                .map_err(|e| c.invalid(format!("{what}: {e}")))?;
            for b in 0..*n_blocks {
                let want = rb.checked_mul(block_rows(rows, *rows_per_block, b));
                let blob = first_blob.saturating_add(b);
                claims.claim(&what, blob, (KIND_PASS, ti, b as usize), want)?;
            }
            let kind = TensorKind::Pass { format: *format };
            (kind, *rows_per_block, *first_blob, *n_blocks)
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
            let rpb = *rows_per_block;
            claims.check_blocks(&what, (rows, cols), rpb, *n_blocks)?;
            let Some(mb) = usize::try_from(*base).ok().and_then(|b| bases.get(b)) else {
                return Err(c.invalid(format!(
                    "{what}: base {base} does not exist ({} bases)",
                    bases.len()
                )));
            };
            if mb.rows != rows || mb.cols != cols || mb.rows_per_block != rpb {
                return Err(c.invalid(format!(
                    "{what}: its base is {}x{} in blocks of {} rows, the tensor {rows}x{cols} in blocks of {rpb}",
                    mb.rows, mb.cols, mb.rows_per_block
                )));
            }
            let layer = crate::model::names::layer_of(&d.name);
            if !d.name.ends_with(&mb.ty) || layer.is_none_or(|l| !mb.layers.contains(&l)) {
                return Err(c.invalid(format!(
                    "{what}: base {base} is for {} layers {:?}",
                    mb.ty, mb.layers
                )));
            }
            if *rank > rows.min(cols) {
                return Err(c.invalid(format!("{what}: rank {rank} exceeds min({rows}, {cols})")));
            }
            for b in 0..*n_blocks {
                let want = block_rows(rows, rpb, b)
                    .checked_mul(*rank)
                    .and_then(|x| x.checked_mul(2));
                let blob = first_blob.saturating_add(b);
                claims.claim(&what, blob, (KIND_U, ti, b as usize), want)?;
            }
            let want = rank.checked_mul(cols).and_then(|x| x.checked_mul(2));
            claims.claim(&what, *vt_blob, (KIND_VT, ti, 0), want)?;
            let kind = TensorKind::Delta {
                base: *base as usize,
                rank: *rank as usize,
                vt_blob: *vt_blob as usize,
            };
            (kind, rpb, *first_blob, *n_blocks)
        }
    };
    Ok(TensorEntry {
        name: d.name.clone(),
        kind,
        rows,
        cols,
        rows_per_block,
        first_blob: first_blob as usize,
        n_blocks: n_blocks as usize,
    })
}
