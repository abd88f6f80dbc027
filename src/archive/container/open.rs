//! Opening a container file: the phases the `.cawsf` and delta readers share (open the
//! file, magic and version, the kind's header fields, TOC and its checksum, section
//! bounds, required sections, META checked, decompressed, parsed and compared with the
//! TOC), so each kind's `open` only validates its own index and tables. A kind says
//! what differs through [`ContainerKind`].

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use xxhash_rust::xxh3::xxh3_64;

use super::meta::{model_from_meta, MetaIn};
use super::*;
use crate::archive::file::ArchiveFile;
use crate::archive::ArchiveError;
use crate::model::ModelDesc;

/// Section type of META in every kind.
pub const SEC_META: u32 = 1;

/// How messages name a kind's file (they predate this module and stay as they were).
pub struct Names {
    /// "file is N bytes, too short for a `header` header".
    pub header: &'static str,
    /// "not a `file` (bad magic)".
    pub file: &'static str,
    /// "unsupported `version` version N".
    pub version: &'static str,
}

/// What one kind of container tells [`Container::open`].
pub trait ContainerKind {
    const MAGIC: [u8; 8];
    /// Bytes before the TOC records: magic, version, the kind's fields, section count.
    const HEADER_FIXED: usize;
    const NAMES: Names;
    /// META's `format`.
    const FORMAT: &'static str;
    /// Section types that must not be compressed as a whole.
    const RAW_ONLY: &'static [u32];
    /// Section types that must be present, checked in this order.
    const REQUIRED: &'static [u32];
    /// The kind's header fields, between version and section count.
    type Header;
    /// The kind's META keys, between `hf_files` and `checksum_index`.
    type Meta: DeserializeOwned;

    fn section_name(ty: u32) -> String;
    /// Parse and check the kind's header fields (`HEADER_FIXED - 16` bytes).
    fn header(fields: &[u8]) -> Result<Self::Header, String>;
    /// Checks of META against the header, made before the checksum index is checked.
    fn agree(_header: &Self::Header, _meta: &Self::Meta) -> Result<(), String> {
        Ok(())
    }
}

/// An opened container whose header, TOC and section bounds are valid.
pub struct Container {
    pub path: PathBuf,
    pub file: ArchiveFile,
    pub toc: Vec<TocRecord>,
    by_type: [Option<TocRecord>; 6],
    name_of: fn(u32) -> String,
}

/// What [`Container::open`] returns: the container, the kind's header fields and META.
pub struct Opened<K: ContainerKind> {
    pub container: Container,
    pub header: K::Header,
    pub meta: MetaIn<K::Meta>,
}

/// The little-endian u32 at `at`, if `data` holds it.
pub fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    let b = data.get(at..at.checked_add(4)?)?;
    b.try_into().ok().map(u32::from_le_bytes)
}

/// The little-endian u64 at `at`, if `data` holds it.
pub fn u64_at(data: &[u8], at: usize) -> Option<u64> {
    let b = data.get(at..at.checked_add(8)?)?;
    b.try_into().ok().map(u64::from_le_bytes)
}

impl Container {
    /// Open `path` as a container of kind `K` and read its META.
    pub fn open<K: ContainerKind>(path: &Path) -> Result<Opened<K>, ArchiveError> {
        Self::open_file(ArchiveFile::open(path)?)
    }

    /// [`Container::open`] of a file already opened (an object whose magic was read).
    pub fn open_file<K: ContainerKind>(file: ArchiveFile) -> Result<Opened<K>, ArchiveError> {
        let path = &file.path().to_path_buf();
        let bad = |r: String| invalid(path, r);
        let len = file.len();
        let min_len = K::HEADER_FIXED + 8;
        if len < min_len as u64 {
            let what = K::NAMES.header;
            return Err(bad(format!(
                "truncated: file is {len} bytes, too short for a {what} header"
            )));
        }
        // The fixed header and the longest TOC there can be, or the whole file.
        let head_len = (K::HEADER_FIXED + TOC_RECORD * MAX_SECTIONS + 8).min(len as usize);
        let data = file.read_head(0, head_len)?;
        check_magic_version(&data, &K::MAGIC, &K::NAMES).map_err(bad)?;
        let fields = data.get(12..K::HEADER_FIXED - 4).unwrap_or_default();
        let header = K::header(fields).map_err(bad)?;
        // In `data`: files shorter than the fixed header were refused above.
        let count = u32_at(&data, K::HEADER_FIXED - 4).unwrap_or(0);
        let toc = parse_toc(&data, K::HEADER_FIXED, count, len).map_err(bad)?;

        // Section bounds, alignment, flags, no overlap, the sections the kind needs.
        let by_type = check_toc(&toc, len, K::RAW_ONLY, K::section_name).map_err(bad)?;
        let c = Container {
            path: path.to_path_buf(),
            file,
            toc,
            by_type,
            name_of: K::section_name,
        };
        for &ty in K::REQUIRED {
            c.required(ty)?;
        }

        // META: checksum against the TOC, decompress, parse, then compare.
        let meta = MetaIn::<K::Meta>::parse(&c.load(&c.required(SEC_META)?)?, |f, v| {
            check_meta_kind(f, v, K::FORMAT)
        })
        .map_err(bad)?;
        K::agree(&header, &meta.kind).map_err(bad)?;
        // The integrity index must agree with the TOC.
        check_checksum_index(&c.toc, SEC_META, &meta.checksum_index, K::section_name)
            .map_err(bad)?;
        Ok(Opened {
            container: c,
            header,
            meta,
        })
    }

    pub fn invalid(&self, reason: impl Into<String>) -> ArchiveError {
        invalid(&self.path, reason)
    }

    /// The record of a section the kind cannot do without.
    pub fn required(&self, ty: u32) -> Result<TocRecord, ArchiveError> {
        self.section(ty).ok_or_else(|| {
            self.invalid(format!(
                "bad TOC: section {} is missing",
                (self.name_of)(ty)
            ))
        })
    }

    pub fn section(&self, ty: u32) -> Option<TocRecord> {
        self.by_type.get(ty as usize).copied().flatten()
    }

    /// A small section's bytes, checked against its TOC checksum, then decompressed.
    pub fn load(&self, rec: &TocRecord) -> Result<Vec<u8>, ArchiveError> {
        // In the file: `check_toc` bounded every section by its length.
        let mut stored = self.file.read_head(rec.offset, rec.size as usize)?;
        if let Some(o) = self.file.remote() {
            // Damaged on the way (or in the fetch cache): fetched again, a few times.
            for _ in 0..crate::archive::file::REFETCHES {
                if xxhash_rust::xxh3::xxh3_64(&stored) == rec.xxh3 {
                    break;
                }
                o.forget(rec.offset, rec.size);
                stored = self.file.read_head(rec.offset, rec.size as usize)?;
            }
        }
        load_section(&stored, rec, &(self.name_of)(rec.ty)).map_err(|r| self.invalid(r))
    }

    /// [`Container::load`] of an optional section; empty when it is absent.
    pub fn load_optional(&self, ty: u32) -> Result<Vec<u8>, ArchiveError> {
        match self.section(ty) {
            Some(rec) => self.load(&rec),
            None => Ok(Vec::new()),
        }
    }

    /// A required section of `entry`-byte entries, loaded.
    pub fn load_entries(&self, ty: u32, entry: usize) -> Result<Vec<u8>, ArchiveError> {
        let bytes = self.load(&self.required(ty)?)?;
        if bytes.len() % entry != 0 {
            return Err(self.invalid(format!(
                "{} is {} bytes, not a multiple of {entry}",
                (self.name_of)(ty),
                bytes.len()
            )));
        }
        Ok(bytes)
    }

    /// META's model, as [`model_from_meta`] rebuilds it.
    pub fn model(
        &self,
        model: ModelDesc,
        files: std::collections::BTreeMap<String, serde_json::Value>,
    ) -> Result<ModelDesc, ArchiveError> {
        model_from_meta(model, files).map_err(|e| self.invalid(format!("META is not valid: {e}")))
    }
}

/// The first 12 bytes of a container: `magic`, then a version this reader knows.
fn check_magic_version(data: &[u8], magic: &[u8; 8], names: &Names) -> Result<(), String> {
    if data.first_chunk::<8>() != Some(magic) {
        return Err(format!("not a {} (bad magic)", names.file));
    }
    let version = u32_at(data, 8).unwrap_or(0);
    if version != VERSION {
        return Err(format!("unsupported {} version {version}", names.version));
    }
    Ok(())
}

/// The TOC of a container of `file_len` bytes whose fixed header is `header_fixed`
/// bytes and says it has `n` sections: the count bounded, the records and the header
/// checksum inside `data` (the file's first bytes), the checksum right.
fn parse_toc(
    data: &[u8],
    header_fixed: usize,
    n: u32,
    file_len: u64,
) -> Result<Vec<TocRecord>, String> {
    let n = n as usize;
    if n == 0 || n > MAX_SECTIONS {
        return Err(format!(
            "bad header: section count {n} (must be 1..={MAX_SECTIONS})"
        ));
    }
    let toc_end = header_fixed + TOC_RECORD * n;
    let (Some(stored), Some(head)) = (u64_at(data, toc_end), data.get(..toc_end)) else {
        return Err(format!(
            "truncated: TOC of {n} sections needs {} bytes but file is {file_len} bytes",
            toc_end + 8,
        ));
    };
    let computed = xxh3_64(head);
    if stored != computed {
        return Err(format!(
            "header failed its XXH3-64 check (stored {stored:016x}, computed {computed:016x})"
        ));
    }
    Ok(head[header_fixed..]
        .chunks_exact(TOC_RECORD)
        .filter_map(TocRecord::read)
        .collect())
}

/// META's `format` and `version` must be what this reader writes.
fn check_meta_kind(format: &str, version: u32, want: &str) -> Result<(), String> {
    if format != want {
        return Err(format!("META format is {format:?}, expected {want:?}"));
    }
    if version != VERSION {
        return Err(format!(
            "META version {version} disagrees with header version {VERSION}"
        ));
    }
    Ok(())
}
