//! What the `.cawsf` and delta kinds share of their container (docs/FORMAT.md §2): the
//! header and TOC of 4 KiB-aligned sections, section and block compression, checksums.
//! Opening a file up to its parsed META is [`Container::open`] (in `open`), writing one
//! [`ContainerWriter`] (in `writer`), META's shared keys `meta`. The ROUTING section's
//! bytes, which every kind stores, are in [`routing`].

mod meta;
mod open;
pub mod routing;
mod writer;

pub use meta::{model_from_meta, model_to_meta, MetaIn, MetaOut};
pub use open::{u32_at, u64_at, Container, ContainerKind, Names, Opened, SEC_META};
pub use writer::{temp_beside, ContainerWriter, Layout, MetaSpec, Sections};

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use xxhash_rust::xxh3::{xxh3_64, Xxh3Default};

use crate::model::{ReadError, TensorDesc};

use crate::archive::file::ArchiveFile;
use crate::archive::{ArchiveError, SectionInfo};

/// Compression applied to each block / section payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Zstd(i32),
    Lz4,
}

/// Decoded elements a row block aims for: 32 Ki f32 = 128 KiB, small enough that a
/// 4 KiB read decodes little, large enough that a 1 MiB read touches few blocks.
pub const BLOCK_TARGET_ELEMS: u64 = 32 * 1024;

/// Rows per row block of a tensor, as every kind's writer blocks it (and npy-dir's
/// reader blocks a foreign directory).
pub fn rows_per_block(t: &TensorDesc) -> u64 {
    (BLOCK_TARGET_ELEMS / t.cols().max(1)).clamp(1, t.rows().max(1))
}

/// Container version both kinds write and read.
pub const VERSION: u32 = 1;
pub const ALIGN: u64 = 4096;
pub const TOC_RECORD: usize = 40;
pub const MAX_SECTIONS: usize = 100;

pub const FLAG_ZSTD: u32 = 1 << 0;
pub const FLAG_LZ4: u32 = 1 << 1;

pub const COMP_RAW: u8 = 0;
pub const COMP_ZSTD: u8 = 1;
pub const COMP_LZ4: u8 = 2;

/// Largest tensor (elements) a reader accepts: 2^40, far above any real model tensor,
/// small enough that element and byte counts never overflow.
pub const MAX_ELEMENTS: u64 = 1 << 40;

/// zstd level for META and BLOCK_INDEX (small, read once at open).
pub const META_ZSTD_LEVEL: i32 = 9;

pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

pub fn hex64(x: u64) -> String {
    format!("{x:016x}")
}

pub fn parse_hex64(s: &str) -> Option<u64> {
    if s.len() != 16 {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

/// An archive's identity (docs/TIER.md): XXH3-128 of its kind and TOC. Every section's
/// XXH3-64 is in the TOC, so this changes with any byte of the file that is read.
pub fn toc_identity(kind: &str, toc: &[TocRecord]) -> u128 {
    let mut b = kind.as_bytes().to_vec();
    for r in toc {
        r.write(&mut b);
    }
    xxhash_rust::xxh3::xxh3_128(&b)
}

/// One TOC record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TocRecord {
    pub ty: u32,
    pub flags: u32,
    pub offset: u64,
    pub size: u64,
    pub usize: u64,
    pub xxh3: u64,
}

impl TocRecord {
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.ty.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.usize.to_le_bytes());
        out.extend_from_slice(&self.xxh3.to_le_bytes());
    }
    /// The record in the first 40 bytes of `b`, if it has them.
    pub fn read(b: &[u8]) -> Option<TocRecord> {
        Some(TocRecord {
            ty: u32_at(b, 0)?,
            flags: u32_at(b, 4)?,
            offset: u64_at(b, 8)?,
            size: u64_at(b, 16)?,
            usize: u64_at(b, 24)?,
            xxh3: u64_at(b, 32)?,
        })
    }
}

// The tests build and edit headers by hand with these.
#[cfg(test)]
impl TocRecord {
    pub fn parse(b: &[u8]) -> TocRecord {
        TocRecord::read(b).expect("a 40-byte TOC record")
    }
}
#[cfg(test)]
pub fn le_u32(b: &[u8]) -> u32 {
    u32_at(b, 0).expect("4 bytes")
}

/// Compress `data`; returns (comp code, stored bytes). Falls back to raw when the
/// compressed form is not smaller (or compression fails).
pub fn compress(data: &[u8], c: Compression) -> (u8, Cow<'_, [u8]>) {
    compress_saving(data, c, 0.0)
}

/// [`compress`], keeping the compressed form only where it saves at least `min_saving`
/// of the bytes (a fraction): decompressing costs read time, and a block whose
/// compression saves little (PQ codes) is cheaper to serve raw.
pub fn compress_saving(data: &[u8], c: Compression, min_saving: f64) -> (u8, Cow<'_, [u8]>) {
    let packed = match c {
        Compression::None => None,
        Compression::Zstd(level) => zstd::bulk::compress(data, level)
            .ok()
            .map(|v| (COMP_ZSTD, v)),
        Compression::Lz4 => Some((COMP_LZ4, lz4_flex::block::compress(data))),
    };
    match packed {
        Some((code, v))
            if v.len() < data.len()
                && (data.len() - v.len()) as f64 >= min_saving * data.len() as f64 =>
        {
            (code, Cow::Owned(v))
        }
        _ => (COMP_RAW, Cow::Borrowed(data)),
    }
}

/// Decompress the zstd frames `stored` into at most `cap` bytes (less when the frames
/// record a smaller size), with this thread's context: creating one per block cost 4 %
/// of a cold read, and 6 % of an npy-dir fuzz execution.
pub fn zstd_decompress(stored: &[u8], cap: usize) -> std::io::Result<Vec<u8>> {
    thread_local! {
        static DCTX: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    DCTX.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = Some(zstd::bulk::Decompressor::new()?);
        }
        d.as_mut().expect("just set").decompress(stored, cap)
    })
}

/// Run `f` with this thread's streaming zstd context (its session reset by the
/// decoder that borrows it), for reads of a stream's first bytes.
pub fn with_zstd_stream<R>(f: impl FnOnce(&mut zstd::zstd_safe::DCtx<'static>) -> R) -> R {
    thread_local! {
        static DCTX: std::cell::RefCell<Option<zstd::zstd_safe::DCtx<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    DCTX.with(|d| {
        let mut d = d.borrow_mut();
        f(d.get_or_insert_with(zstd::zstd_safe::DCtx::create))
    })
}

/// Decompress `stored` (comp code) into exactly `usize` bytes; never allocates more
/// than `usize`. Raw data is borrowed.
pub fn decompress(stored: &[u8], comp: u8, usize: usize) -> Result<Cow<'_, [u8]>, String> {
    match comp {
        COMP_RAW => {
            if stored.len() != usize {
                return Err(format!(
                    "raw payload is {} bytes, expected {usize}",
                    stored.len()
                ));
            }
            Ok(Cow::Borrowed(stored))
        }
        COMP_ZSTD => {
            let v = zstd_decompress(stored, usize)
                .map_err(|e| format!("zstd decompression failed: {e}"))?;
            if v.len() != usize {
                return Err(format!(
                    "zstd payload decompressed to {} bytes, expected {usize}",
                    v.len()
                ));
            }
            Ok(Cow::Owned(v))
        }
        COMP_LZ4 => {
            let mut v = vec![0u8; usize];
            let n = lz4_flex::block::decompress_into(stored, &mut v)
                .map_err(|e| format!("lz4 decompression failed: {e}"))?;
            if n != usize {
                return Err(format!(
                    "lz4 payload decompressed to {n} bytes, expected {usize}"
                ));
            }
            Ok(Cow::Owned(v))
        }
        other => Err(format!("unknown compression code {other}")),
    }
}

pub fn flags_to_comp(flags: u32) -> Option<u8> {
    match flags {
        0 => Some(COMP_RAW),
        FLAG_ZSTD => Some(COMP_ZSTD),
        FLAG_LZ4 => Some(COMP_LZ4),
        _ => None,
    }
}

pub fn comp_to_flags(comp: u8) -> u32 {
    match comp {
        COMP_ZSTD => FLAG_ZSTD,
        COMP_LZ4 => FLAG_LZ4,
        _ => 0,
    }
}

/// Validate a TOC against a file of `len` bytes (FORMAT.md §2 reader rules): bounds,
/// 4 KiB alignment past the header, flags, `usize` consistent and bounded, no type
/// twice, no overlap. `raw_only` lists the types that must not be compressed. Returns
/// the records by type (types ≥ 6 are checked but not returned). Shared by every
/// container kind that uses this TOC (`.cawsf`, delta).
pub fn check_toc(
    toc: &[TocRecord],
    len: u64,
    raw_only: &[u32],
    name_of: fn(u32) -> String,
) -> Result<[Option<TocRecord>; 6], String> {
    let mut by_type: [Option<TocRecord>; 6] = [None; 6];
    for rec in toc {
        let name = name_of(rec.ty);
        let end = rec.offset.checked_add(rec.size).ok_or_else(|| {
            format!(
                "bad TOC: section {name} offset {} + size {} overflows",
                rec.offset, rec.size
            )
        })?;
        if end > len {
            return Err(format!(
                "truncated: TOC says section {name} ends at {end} but file is {len} bytes"
            ));
        }
        if rec.offset % ALIGN != 0 || rec.offset < ALIGN {
            return Err(format!(
                "bad TOC: section {name} offset {} is not a 4 KiB-aligned offset past the header",
                rec.offset
            ));
        }
        let comp = flags_to_comp(rec.flags)
            .ok_or_else(|| format!("bad TOC: section {name} has invalid flags {:#x}", rec.flags))?;
        if raw_only.contains(&rec.ty) && comp != COMP_RAW {
            return Err(format!("bad TOC: section {name} must not be compressed"));
        }
        if comp == COMP_RAW && rec.usize != rec.size {
            return Err(format!(
                "bad TOC: uncompressed section {name} has size {} but usize {}",
                rec.size, rec.usize
            ));
        }
        // A corrupt header must not make a reader allocate more than the file justifies.
        let usize_ok = rec.usize <= (4u64 << 30)
            && rec.usize <= rec.size.saturating_mul(4096).saturating_add(16 << 20);
        if comp != COMP_RAW && !usize_ok {
            return Err(format!(
                "bad TOC: section {name} claims {} bytes decompressed from {}",
                rec.usize, rec.size
            ));
        }
        if let Some(slot) = by_type.get_mut(rec.ty as usize).filter(|_| rec.ty >= 1) {
            if slot.is_some() {
                return Err(format!("bad TOC: section {name} appears twice"));
            }
            *slot = Some(*rec);
        }
    }
    let mut sorted = toc.to_vec();
    sorted.sort_by_key(|r| (r.offset, r.size));
    for w in sorted.windows(2) {
        if w[0].size > 0 && w[1].size > 0 && w[0].offset + w[0].size > w[1].offset {
            return Err(format!(
                "bad TOC: sections {} and {} overlap",
                name_of(w[0].ty),
                name_of(w[1].ty)
            ));
        }
    }
    Ok(by_type)
}

/// A small section's bytes, checked against its TOC checksum, then decompressed.
/// `rec` lies inside `data` (checked by [`check_toc`]).
pub fn load_section(stored: &[u8], rec: &TocRecord, name: &str) -> Result<Vec<u8>, String> {
    let computed = xxh3_64(stored);
    if computed != rec.xxh3 {
        return Err(format!(
            "section {name} failed its XXH3-64 check (stored {:016x}, computed {computed:016x})",
            rec.xxh3
        ));
    }
    let comp = flags_to_comp(rec.flags).unwrap_or(COMP_RAW);
    decompress(stored, comp, rec.usize as usize)
        .map(Cow::into_owned)
        .map_err(|e| format!("section {name} is corrupt: {e}"))
}

/// META's `checksum_index` must name every section but META with its TOC checksum.
pub fn check_checksum_index(
    toc: &[TocRecord],
    meta_ty: u32,
    index: &BTreeMap<String, String>,
    name_of: fn(u32) -> String,
) -> Result<(), String> {
    for rec in toc.iter().filter(|r| r.ty != meta_ty) {
        let name = name_of(rec.ty);
        match index.get(&name).map(|s| parse_hex64(s)) {
            Some(Some(x)) if x == rec.xxh3 => {}
            Some(_) => {
                return Err(format!(
                    "META checksum_index entry for {name} disagrees with the TOC"
                ))
            }
            None => return Err(format!("META checksum_index has no entry for {name}")),
        }
    }
    Ok(())
}

/// `ArchiveError::Invalid` for `path`.
pub fn invalid(path: &Path, reason: impl Into<String>) -> ArchiveError {
    ArchiveError::invalid(path, reason)
}

/// `ArchiveError::Io` for `path`.
pub fn io_error(path: &Path, source: std::io::Error) -> ArchiveError {
    ArchiveError::io(path, source)
}

/// The TOC as `inspect` lists it.
pub fn section_infos(toc: &[TocRecord], name_of: fn(u32) -> String) -> Vec<SectionInfo> {
    toc.iter()
        .map(|r| SectionInfo {
            kind: name_of(r.ty),
            offset: r.offset,
            size: r.size,
            flags: r.flags,
        })
        .collect()
}

/// One line per section whose bytes fail their TOC checksum (`toc` checked at open).
pub fn section_failures(
    file: &ArchiveFile,
    toc: &[TocRecord],
    name_of: fn(u32) -> String,
) -> Vec<String> {
    toc.iter()
        .filter_map(|r| {
            let name = name_of(r.ty);
            let computed = match hash_range(file, r.offset, r.size) {
                Ok(h) => h,
                Err(e) => return Some(format!("section {name} could not be read: {e}")),
            };
            (computed != r.xxh3).then(|| {
                format!(
                    "section {name} failed its XXH3-64 check (stored {:016x}, computed {computed:016x})",
                    r.xxh3
                )
            })
        })
        .collect()
}

/// XXH3-64 of `size` bytes at `offset`, read a piece at a time (sections can be most
/// of a large archive).
fn hash_range(file: &ArchiveFile, offset: u64, size: u64) -> Result<u64, ReadError> {
    const PIECE: u64 = 8 << 20;
    let mut h = Xxh3Default::new();
    let mut buf = vec![0u8; PIECE.min(size) as usize];
    let mut at = 0;
    while at < size {
        let n = PIECE.min(size - at) as usize;
        file.read_into(offset + at, &mut buf[..n])?;
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(h.digest())
}

/// Why a stored blob or block could not be used.
#[derive(Clone, Debug)]
pub enum BlobFault {
    Checksum {
        stored: u64,
        computed: u64,
    },
    Corrupt(String),
    /// The bytes could not be read: the file changed since open (`changed`) or an I/O
    /// error. `msg` names the file.
    Unread {
        changed: bool,
        msg: String,
    },
}

impl From<ReadError> for BlobFault {
    fn from(e: ReadError) -> BlobFault {
        BlobFault::Unread {
            changed: matches!(e, ReadError::Changed(_)),
            msg: match e {
                ReadError::Changed(m) => m,
                e => e.to_string(),
            },
        }
    }
}

impl BlobFault {
    /// The error a read of `tensor` block `block` reports when `what` has this fault.
    pub fn into_read_error(self, tensor: &str, block: usize, what: &str) -> ReadError {
        match self {
            BlobFault::Unread { changed: true, msg } => ReadError::Changed(msg),
            BlobFault::Unread { msg, .. } => ReadError::Io(std::io::Error::other(msg)),
            f => ReadError::Corrupt {
                tensor: tensor.to_string(),
                block,
                reason: f.describe(what),
            },
        }
    }

    /// One line naming `what` failed and how.
    pub fn describe(&self, what: &str) -> String {
        match self {
            BlobFault::Checksum { stored, computed } => format!(
                "{what} failed its XXH3-64 check (stored {stored:016x}, computed {computed:016x})"
            ),
            BlobFault::Corrupt(r) => format!("{what} is corrupt: {r}"),
            BlobFault::Unread { msg, .. } => format!("{what} could not be read: {msg}"),
        }
    }
}

/// A blob's stored bytes checked against `xxh3`, then decompressed to `usize` bytes.
pub fn checked_payload(
    stored: &[u8],
    xxh3: u64,
    comp: u8,
    usize: usize,
) -> Result<Cow<'_, [u8]>, BlobFault> {
    let computed = xxh3_64(stored);
    if computed != xxh3 {
        return Err(BlobFault::Checksum {
            stored: xxh3,
            computed,
        });
    }
    decompress(stored, comp, usize).map_err(BlobFault::Corrupt)
}

/// Zero padding so that `*len + ahead` becomes a multiple of 16: payloads start
/// 16-byte aligned in the file (the data section starts page-aligned), letting codecs
/// read raw payloads in place cheaply. `ahead` is what is written before the payload.
pub fn pad16(
    out: &mut impl Write,
    hash: &mut Xxh3Default,
    len: &mut u64,
    ahead: u64,
) -> std::io::Result<()> {
    let pad = ((16 - (*len + ahead) % 16) % 16) as usize;
    if pad > 0 {
        out.write_all(&[0u8; 16][..pad])?;
        hash.update(&[0u8; 16][..pad]);
        *len += pad as u64;
    }
    Ok(())
}

/// Zeros from `*pos` up to the next 4 KiB boundary.
pub fn pad_to_align(out: &mut impl Write, pos: &mut u64) -> std::io::Result<()> {
    let target = align_up(*pos);
    out.write_all(&[0u8; ALIGN as usize][..(target - *pos) as usize])?;
    *pos = target;
    Ok(())
}

/// Write one section at the next 4 KiB boundary, compressed with `c` when that is
/// smaller, and return its TOC record.
pub fn write_section(
    out: &mut impl Write,
    pos: &mut u64,
    ty: u32,
    data: &[u8],
    c: Compression,
) -> std::io::Result<TocRecord> {
    pad_to_align(out, pos)?;
    let (comp, stored) = compress(data, c);
    out.write_all(&stored)?;
    let rec = TocRecord {
        ty,
        flags: comp_to_flags(comp),
        offset: *pos,
        size: stored.len() as u64,
        usize: data.len() as u64,
        xxh3: xxh3_64(&stored),
    };
    *pos += stored.len() as u64;
    Ok(rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compressed_only_where_it_saves_the_minimum() {
        // 4096 bytes of 16 symbols: zstd saves about half.
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 16) as u8).collect();
        let (code, any) = compress(&data, Compression::Zstd(3));
        assert_eq!(code, COMP_ZSTD);
        let saved = 1.0 - any.len() as f64 / data.len() as f64;
        let (code, kept) = compress_saving(&data, Compression::Zstd(3), saved - 0.01);
        assert_eq!((code, kept.len()), (COMP_ZSTD, any.len()));
        let (code, raw) = compress_saving(&data, Compression::Zstd(3), saved + 0.01);
        assert_eq!((code, &raw[..]), (COMP_RAW, &data[..]));
        assert_eq!(decompress(&kept, COMP_ZSTD, data.len()).unwrap(), data);
    }
}
