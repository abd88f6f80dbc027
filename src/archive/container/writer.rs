//! The writer skeleton the `.cawsf` and delta kinds share: a temporary file next to the
//! output (so the final rename is atomic and a failed or abandoned conversion leaves
//! nothing behind), a reserved header page, the data section streamed right after it
//! with 16-byte-aligned payloads, then the small sections, META, the header/TOC, a sync
//! and the rename. The kinds say what goes into the data section and which small
//! sections follow.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::Serialize;
use tempfile::NamedTempFile;
use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

use super::meta::{model_to_meta, MetaOut};
use super::open::SEC_META;
use super::*;
use crate::archive::ArchiveError;
use crate::model::ModelDesc;

/// A temporary file in `path`'s directory, named after it (`x.cawsf.AbC123.tmp`), created
/// with the permissions `File::create` would give (tempfile's default is 0600, and the
/// archive must stay readable as before once renamed).
pub fn temp_beside(path: &Path) -> io::Result<NamedTempFile> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut prefix = path.file_name().unwrap_or_default().to_owned();
    prefix.push(".");
    let mut b = tempfile::Builder::new();
    b.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    b.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    b.tempfile_in(dir)
}

/// A container being written: the data section streams to a temporary file.
pub struct ContainerWriter {
    path: PathBuf,
    out: BufWriter<NamedTempFile>,
    compression: Compression,
    /// Blocks keep their compressed form only where it saves this fraction.
    min_saving: f64,
    /// Bytes of the data section so far, and their running checksum.
    data_len: u64,
    data_hash: Xxh3Default,
}

/// The kind's header and section types.
pub struct Layout<'a> {
    pub magic: &'a [u8; 8],
    /// The kind's fields between version and section count.
    pub fields: &'a [u8],
    /// Types of the data section, its index section and ROUTING.
    pub data_ty: u32,
    pub index_ty: u32,
    pub routing_ty: u32,
    pub name_of: fn(u32) -> String,
}

/// META's parts: the kind's keys `kind` go between `hf_files` and `checksum_index`.
pub struct MetaSpec<'a, K: Serialize> {
    pub format: &'a str,
    pub model: &'a ModelDesc,
    pub kind: K,
    pub extra: &'a serde_json::Value,
}

/// The sections after the data section, each at the next 4 KiB boundary.
pub struct Sections<'a> {
    out: &'a mut BufWriter<NamedTempFile>,
    pos: u64,
    recs: Vec<TocRecord>,
}

impl ContainerWriter {
    pub fn create(path: &Path, compression: Compression) -> Result<ContainerWriter, ArchiveError> {
        // The archive is renamed over `path` when done: that must not replace a device,
        // a FIFO or a directory (`-o /dev/null` as root would replace /dev/null).
        if let Ok(m) = std::fs::metadata(path) {
            if !m.is_file() {
                return Err(invalid(
                    path,
                    String::from("exists and is not a regular file (an archive is written beside it, then renamed over it)"),
                ));
            }
        }
        let f = temp_beside(path).map_err(|e| io_error(path, e))?;
        let mut w = ContainerWriter {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(1 << 20, f),
            compression,
            min_saving: 0.0,
            data_len: 0,
            data_hash: Xxh3Default::new(),
        };
        // Reserve the header page; the data section starts at 4096.
        let r = w.out.write_all(&[0u8; ALIGN as usize]);
        r.map_err(|e| w.io(e))?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn compression(&self) -> Compression {
        self.compression
    }
    pub fn io(&self, e: io::Error) -> ArchiveError {
        io_error(&self.path, e)
    }
    pub fn invalid(&self, reason: String) -> ArchiveError {
        invalid(&self.path, reason)
    }

    /// Blocks ([`Self::compress_all`]) are stored raw unless compression saves at
    /// least `fraction` of their bytes (0: any saving; docs/FORMAT.md §5).
    pub fn set_min_saving(&mut self, fraction: f64) {
        self.min_saving = fraction;
    }

    /// Compress `blobs` in parallel with the archive's compression (raw when that does
    /// not save the minimum); the caller writes them in order, so the bytes do not
    /// depend on the thread count.
    pub fn compress_all<'b, B: AsRef<[u8]> + Sync>(
        &self,
        blobs: &'b [B],
    ) -> Vec<(u8, Cow<'b, [u8]>)> {
        let (c, m) = (self.compression, self.min_saving);
        blobs
            .par_iter()
            .map(|b| compress_saving(b.as_ref(), c, m))
            .collect()
    }

    /// Append `head` then `payload` to the data section, zero-padded before so that
    /// `payload` starts 16-byte aligned. Returns the offset of `head` in the section.
    pub fn append(&mut self, head: &[u8], payload: &[u8]) -> Result<u64, ArchiveError> {
        let r = pad16(
            &mut self.out,
            &mut self.data_hash,
            &mut self.data_len,
            head.len() as u64,
        )
        .and_then(|_| self.out.write_all(head))
        .and_then(|_| self.out.write_all(payload));
        r.map_err(|e| self.io(e))?;
        let offset = self.data_len;
        self.data_hash.update(head);
        self.data_hash.update(payload);
        self.data_len += (head.len() + payload.len()) as u64;
        Ok(offset)
    }

    /// `added` tensors must be all of the model's.
    pub fn check_count(&self, added: usize, model: &ModelDesc) -> Result<(), ArchiveError> {
        if added != model.tensors.len() {
            return Err(self.invalid(format!(
                "{added} tensors added but the model has {}",
                model.tensors.len()
            )));
        }
        Ok(())
    }

    /// Tensor `index` must come next (`expected`) and fit the u32 fields that name it.
    pub fn tensor_index(&self, index: usize, expected: usize) -> Result<u32, ArchiveError> {
        if index != expected {
            return Err(self.invalid(format!(
                "tensor {index} added out of order (expected tensor {expected})"
            )));
        }
        u32::try_from(index).map_err(|_| self.invalid(format!("tensor index {index} exceeds u32")))
    }

    /// Close the data section, let `sections` append the kind's own sections, then
    /// write the index section `index` and `routing` (both small), META, the header
    /// and TOC (records in type order), sync and rename the temporary file to the
    /// output. Returns the archive's size in bytes.
    pub fn finish<K: Serialize>(
        mut self,
        header: Layout<'_>,
        sections: impl FnOnce(&mut Sections<'_>) -> io::Result<()>,
        (index, routing): (&[u8], &[u8]),
        meta: MetaSpec<'_, K>,
    ) -> Result<u64, ArchiveError> {
        let compression = self.compression;
        let data = TocRecord {
            ty: header.data_ty,
            flags: 0,
            offset: ALIGN,
            size: self.data_len,
            usize: self.data_len,
            xxh3: self.data_hash.digest(),
        };
        let mut s = Sections {
            out: &mut self.out,
            pos: ALIGN + self.data_len,
            recs: vec![data],
        };
        let r = (|| -> io::Result<(Vec<TocRecord>, u64)> {
            sections(&mut s)?;
            s.write(header.index_ty, index, Compression::Zstd(META_ZSTD_LEVEL))?;
            s.write(header.routing_ty, routing, compression)?;
            let checksum_index = s
                .recs
                .iter()
                .map(|r| ((header.name_of)(r.ty), hex64(r.xxh3)))
                .collect::<BTreeMap<_, _>>();
            let (model, hf_files) = model_to_meta(meta.model).map_err(io::Error::other)?;
            let json = serde_json::to_vec(&MetaOut {
                format: meta.format,
                version: VERSION,
                model,
                hf_files,
                kind: meta.kind,
                checksum_index,
                extra: meta.extra,
            })
            .map_err(io::Error::other)?;
            s.write(SEC_META, &json, Compression::Zstd(META_ZSTD_LEVEL))?;
            pad_to_align(s.out, &mut s.pos)?;
            let mut toc = s.recs;
            toc.sort_by_key(|r| r.ty);
            Ok((toc, s.pos))
        })();
        let (toc, total) = r.map_err(|e| self.io(e))?;

        let mut head = Vec::with_capacity(16 + header.fields.len() + TOC_RECORD * toc.len() + 8);
        head.extend_from_slice(header.magic);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(header.fields);
        head.extend_from_slice(&(toc.len() as u32).to_le_bytes());
        for rec in &toc {
            rec.write(&mut head);
        }
        let h = xxh3_64(&head);
        head.extend_from_slice(&h.to_le_bytes());
        let path = self.path;
        let io = |e| io_error(&path, e);
        self.out.seek(SeekFrom::Start(0)).map_err(io)?;
        self.out.write_all(&head).map_err(io)?;
        let f = self.out.into_inner().map_err(|e| io(e.into_error()))?;
        f.as_file().sync_all().map_err(io)?;
        f.persist(&path).map_err(|e| io(e.error))?;
        Ok(total)
    }
}

impl Sections<'_> {
    /// Write `data` as section `ty`, compressed with `c` when that is smaller.
    pub fn write(&mut self, ty: u32, data: &[u8], c: Compression) -> io::Result<()> {
        let rec = write_section(self.out, &mut self.pos, ty, data, c)?;
        self.recs.push(rec);
        Ok(())
    }

    /// Copy `src` as section `ty` as it is: `len` bytes whose XXH3-64 is `xxh3`
    /// (accumulated while the caller spooled them). Returns the bytes copied.
    pub fn copy(&mut self, ty: u32, src: &mut impl Read, len: u64, xxh3: u64) -> io::Result<u64> {
        pad_to_align(self.out, &mut self.pos)?;
        let copied = io::copy(src, self.out)?;
        self.recs.push(TocRecord {
            ty,
            flags: 0,
            offset: self.pos,
            size: len,
            usize: len,
            xxh3,
        });
        self.pos += len;
        Ok(copied)
    }
}
