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

pub mod npy;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use xxhash_rust::xxh3::xxh3_64;

use crate::archive::{
    check_read, rel_err_of, Kind, ReadCounterSnapshot, ReadCounters, Store, TensorSummary,
};
use crate::archive::{ArchiveError, SectionInfo};
use crate::model::{ModelDesc, ReadError, RowSource, SourceType, TensorDesc};
use npy::Dtype;

use crate::codec::intq as quant;

pub const MANIFEST: &str = "manifest.json";
pub const SIDECAR: &str = "cawsfs.json";
pub const ROUTING_FILE: &str = "routing.bin";
pub const TENSOR_DIR: &str = "tensors";
pub const SIDECAR_FORMAT: &str = "cawsfs-npy-dir";
/// Decompressed foreign `.npy.zst` files kept in memory (NPYDIR.md §4).
const WHOLE_LRU_BYTES: usize = 256 << 20;
/// zstd cannot expand data by more than this (an RLE block: 4 bytes → 128 KiB).
const ZSTD_MAX_RATIO: u64 = 32768;
/// JSON and side files larger than this are refused.
const MAX_SMALL_FILE: u64 = 256 << 20;
const MAX_FILES: usize = 1 << 20;

/// The suffixes of the files one tensor may have (NPYDIR.md §2).
const SUFFIXES: &[&str] = &["__q4", "__s4", "__q", "__s", "__pt", "__shape"];

use crate::archive::container::{invalid, io_error as io_err};

fn read_small(path: &Path) -> Result<Vec<u8>, ArchiveError> {
    let len = std::fs::metadata(path).map_err(|e| io_err(path, e))?.len();
    if len > MAX_SMALL_FILE {
        return Err(invalid(
            path,
            format!("{len} bytes is too large for a metadata file"),
        ));
    }
    std::fs::read(path).map_err(|e| io_err(path, e))
}

pub fn hex(v: u64) -> String {
    format!("{v:016x}")
}

fn parse_hex(path: &Path, what: &str, s: &str) -> Result<u64, ArchiveError> {
    if s.len() != 16 {
        return Err(invalid(path, format!("{what}: {s:?} is not 16 hex digits")));
    }
    u64::from_str_radix(s, 16)
        .map_err(|_| invalid(path, format!("{what}: {s:?} is not 16 hex digits")))
}

/// `safe_key` as Squish computes it.
pub fn safe_key(name: &str) -> String {
    name.replace('.', "__")
}

// ---------------------------------------------------------------------------------------
// cawsfs.json

#[derive(Serialize, Deserialize)]
/// `cawsfs.json` (docs/NPYDIR.md §3), written by `convert::npydir`.
pub struct Sidecar {
    pub format: String,
    pub version: u32,
    pub model: Value,
    #[serde(default)]
    pub hf_files: BTreeMap<String, String>,
    #[serde(default)]
    pub routing_xxh3: Option<String>,
    pub tensors: Vec<SideTensor>,
    #[serde(default)]
    pub extra: Value,
}

#[derive(Serialize, Deserialize)]
pub struct SideTensor {
    pub name: String,
    pub key: String,
    pub kind: String,
    pub rows_per_block: u64,
    /// Columns per scale (int4; int8 has one scale per row).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<u64>,
    pub files: BTreeMap<String, SideFile>,
}

#[derive(Serialize, Deserialize, Default)]
pub struct SideFile {
    pub file: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_xxh3: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xxh3: Option<String>,
}

// ---------------------------------------------------------------------------------------
// Data files

enum Storage {
    /// Plain `.npy`, memory-mapped; data at `header.data_offset`.
    Plain(Mmap),
    /// cawsfs-framed `.npy.zst`: `frames[b]` = (offset, len) of row block `b`'s frame.
    Framed {
        map: Mmap,
        frames: Vec<(usize, usize)>,
    },
    /// Foreign `.npy.zst`, decompressed whole on demand; `id` keys the LRU.
    Whole { map: Mmap, id: usize },
}

struct DataFile {
    /// Path relative to the directory, for messages ("tensors/x__q.npy").
    rel: String,
    header: npy::Header,
    storage: Storage,
    file_len: u64,
    /// XXH3-64 of each row block's data bytes (cawsfs-written directories).
    sums: Option<Vec<u64>>,
}

impl DataFile {
    fn is_zst(&self) -> bool {
        !matches!(self.storage, Storage::Plain(_))
    }
}

/// How a tensor's values lie in its files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Geo {
    /// `c` values per q row, `g` scale groups per q row.
    Int8 {
        c: u64,
        g: u64,
    },
    Int4 {
        c: u64,
        g: u64,
    },
    /// Passthrough with `sz`-byte elements.
    Pt {
        sz: u64,
    },
}

#[derive(Clone, Copy, Debug)]
struct Geometry {
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    geo: Geo,
}

impl Geometry {
    fn n_blocks(&self) -> usize {
        self.rows.div_ceil(self.rows_per_block) as usize
    }
    /// Byte ranges (within the data region) of row block `b` in each data file
    /// (`[q, s]` or `[pt]`), and the element range the decoded values cover.
    fn block_ranges(&self, b: usize) -> (Vec<(u64, u64)>, u64, u64) {
        let r0 = b as u64 * self.rows_per_block;
        let r1 = (r0 + self.rows_per_block).min(self.rows);
        let (e0, e1) = (r0 * self.cols, r1 * self.cols);
        match self.geo {
            Geo::Int8 { c, g } | Geo::Int4 { c, g } => {
                let (qa, qb) = (e0 / c, e1.div_ceil(c));
                let qw = if matches!(self.geo, Geo::Int8 { .. }) {
                    c
                } else {
                    c / 2
                };
                (
                    vec![(qa * qw, qb * qw), (qa * g * 4, qb * g * 4)],
                    qa * c,
                    qb * c,
                )
            }
            Geo::Pt { sz } => (vec![(e0 * sz, e1 * sz)], e0, e1),
        }
    }
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
            Geo::Pt { sz: 4 } => "passthrough(f32)".to_string(),
            Geo::Pt { .. } => "passthrough(f16)".to_string(),
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
    path: PathBuf,
    model: ModelDesc,
    entries: Vec<Entry>,
    parts: Vec<(String, u64)>,
    routing: Vec<u8>,
    extra: Value,
    checksummed: bool,
    counters: ReadCounters,
    whole: Mutex<WholeCache>,
}

struct WholeCache {
    lru: lru::LruCache<usize, Arc<Vec<u8>>>,
    bytes: usize,
}

/// Is `path` a directory holding an npy-dir (by its manifest)?
pub fn is_npy_dir(path: &Path) -> bool {
    path.join(MANIFEST).is_file()
}

struct Opener<'a> {
    dir: &'a Path,
    next_whole: usize,
}

impl Opener<'_> {
    /// Open `tensors/{name}` (`.npy` or `.npy.zst`), check its dtype is one of `dtypes`
    /// and its length; `framed` = Some(block data lengths) for a cawsfs-framed zst.
    fn open(
        &mut self,
        name: &str,
        dtypes: &[Dtype],
        framed: Option<&[u64]>,
    ) -> Result<DataFile, ArchiveError> {
        let rel = format!("{TENSOR_DIR}/{name}");
        let path = self.dir.join(&rel);
        let f = File::open(&path).map_err(|e| io_err(&path, e))?;
        let file_len = f.metadata().map_err(|e| io_err(&path, e))?.len();
        if file_len == 0 {
            return Err(invalid(&path, "empty file"));
        }
        // SAFETY: the file is only read; every range is validated against its length
        // below. Another process truncating it while mounted is outside what we defend.
        let map = unsafe { Mmap::map(&f) }.map_err(|e| io_err(&path, e))?;
        let zst = name.ends_with(".zst");
        let (header, storage) = if !zst {
            let hl = npy::header_len(&map[..map.len().min(12)]).map_err(|e| invalid(&path, e))?;
            let header =
                npy::parse(&map[..map.len().min(hl as usize)]).map_err(|e| invalid(&path, e))?;
            (header, Storage::Plain(map))
        } else {
            let frames = walk_frames(&map).map_err(|e| invalid(&path, e))?;
            let header = zst_header(&map).map_err(|e| invalid(&path, e))?;
            let expect = header.data_offset + header.data_len();
            if expect
                > file_len
                    .saturating_mul(ZSTD_MAX_RATIO)
                    .saturating_add(1 << 20)
            {
                return Err(invalid(
                    &path,
                    format!("header claims {expect} bytes, more than {file_len} compressed bytes can hold"),
                ));
            }
            if frames.iter().all(|f| f.2.is_some()) {
                let total: u64 = frames.iter().map(|f| f.2.unwrap_or(0)).sum();
                if total != expect {
                    return Err(invalid(
                        &path,
                        format!("truncated or padded: decompresses to {total} bytes, the npy header says {expect}"),
                    ));
                }
            }
            let storage = match framed {
                Some(lens) => {
                    let ok = frames.len() == lens.len() + 1
                        && frames[0].2 == Some(header.data_offset)
                        && frames[1..].iter().zip(lens).all(|(f, &l)| f.2 == Some(l));
                    if !ok {
                        return Err(invalid(
                            &path,
                            format!(
                                "not framed as cawsfs.json says (one header frame and {} row-block frames)",
                                lens.len()
                            ),
                        ));
                    }
                    let frames = frames[1..].iter().map(|f| (f.0, f.1)).collect();
                    Storage::Framed { map, frames }
                }
                None => {
                    // A whole-file stream is decompressed into memory on read: its size
                    // must be known and bounded now, or one crafted file could make the
                    // daemon reserve gigabytes (and abort) on its first read.
                    if frames.iter().any(|f| f.2.is_none()) {
                        return Err(invalid(
                            &path,
                            "a zstd frame does not record its decompressed size; recompress with `zstd` (it records sizes)",
                        ));
                    }
                    if expect > WHOLE_LRU_BYTES as u64 {
                        return Err(invalid(
                            &path,
                            format!(
                                "one zstd stream of {expect} bytes decompressed is over the {} MiB that can be served by decompressing it whole; decompress it (`zstd -d`) or reconvert with `cawsfs convert --to npy-dir --zstd` (framed per row block)",
                                WHOLE_LRU_BYTES >> 20
                            ),
                        ));
                    }
                    self.next_whole += 1;
                    Storage::Whole {
                        map,
                        id: self.next_whole,
                    }
                }
            };
            (header, storage)
        };
        if !dtypes.contains(&header.dtype) {
            return Err(invalid(
                &path,
                format!(
                    "dtype {} is not allowed here (expected {})",
                    header.dtype.descr(),
                    dtypes
                        .iter()
                        .map(|d| d.descr())
                        .collect::<Vec<_>>()
                        .join(" or ")
                ),
            ));
        }
        if !zst {
            let expect = header.data_offset + header.data_len();
            if file_len < expect {
                return Err(invalid(
                    &path,
                    format!("truncated: {file_len} bytes, the npy header says {expect}"),
                ));
            }
            if file_len > expect {
                return Err(invalid(
                    &path,
                    format!("{} trailing bytes after the array", file_len - expect),
                ));
            }
        }
        Ok(DataFile {
            rel,
            header,
            storage,
            file_len,
            sums: None,
        })
    }
}

/// (offset, compressed length, content size) of each zstd frame of `data`.
fn walk_frames(data: &[u8]) -> Result<Vec<(usize, usize, Option<u64>)>, String> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < data.len() {
        let rest = &data[off..];
        let n = zstd::zstd_safe::find_frame_compressed_size(rest)
            .map_err(|_| format!("truncated or corrupt zstd stream at byte {off}"))?;
        if n == 0 || n > rest.len() {
            return Err(format!("truncated or corrupt zstd stream at byte {off}"));
        }
        let content = zstd::zstd_safe::get_frame_content_size(rest).ok().flatten();
        out.push((off, n, content));
        off += n;
        if out.len() > MAX_FILES {
            return Err("too many zstd frames".into());
        }
    }
    Ok(out)
}

/// The npy header at the start of a zstd stream (decompressing only its first bytes).
fn zst_header(data: &[u8]) -> Result<npy::Header, String> {
    use std::io::Read;
    let bad = |e: std::io::Error| format!("zstd: {e}");
    let mut dec = zstd::stream::read::Decoder::with_buffer(data).map_err(bad)?;
    let mut prefix = Vec::new();
    (&mut dec).take(12).read_to_end(&mut prefix).map_err(bad)?;
    let hl = npy::header_len(&prefix)?;
    if (prefix.len() as u64) < hl.min(12) {
        return Err("truncated npy header".into());
    }
    let need = hl.saturating_sub(prefix.len() as u64);
    (&mut dec)
        .take(need)
        .read_to_end(&mut prefix)
        .map_err(bad)?;
    npy::parse(&prefix)
}

fn read_shape_file(op: &mut Opener, name: &str) -> Result<(Vec<u64>, u64, u64), ArchiveError> {
    let f = op.open(name, &[Dtype::I64, Dtype::I32], None)?;
    let path = op.dir.join(&f.rel);
    if f.header.shape.len() != 1 || f.header.shape[0] > 32 {
        return Err(invalid(
            &path,
            format!(
                "shape file has shape {:?}, expected [ndim ≤ 32]",
                f.header.shape
            ),
        ));
    }
    let bytes = whole_bytes(&f).map_err(|e| invalid(&path, e))?;
    let data = &bytes[f.header.data_offset as usize..];
    let size = f.header.dtype.size() as usize;
    let mut shape = Vec::new();
    for c in data.chunks_exact(size) {
        let v = if size == 8 {
            i64::from_le_bytes(c.try_into().expect("8 bytes"))
        } else {
            i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64
        };
        if v < 0 {
            return Err(invalid(&path, format!("negative dimension {v}")));
        }
        shape.push(v as u64);
    }
    let mut n: u64 = 1;
    for &d in &shape {
        n = n
            .checked_mul(d)
            .filter(|&n| n <= npy::MAX_ELEMS)
            .ok_or_else(|| invalid(&path, format!("shape {shape:?} has too many elements")))?;
    }
    Ok((shape, f.file_len, xxh3_64(&bytes)))
}

/// The whole decompressed npy file (header + data) of a small file.
fn whole_bytes(f: &DataFile) -> Result<Cow<'_, [u8]>, String> {
    match &f.storage {
        Storage::Plain(m) => Ok(Cow::Borrowed(&m[..])),
        Storage::Framed { map, .. } | Storage::Whole { map, .. } => {
            let n = (f.header.data_offset + f.header.data_len()) as usize;
            let v = zstd::bulk::decompress(map, n).map_err(|e| format!("zstd: {e}"))?;
            if v.len() != n {
                return Err(format!("decompresses to {} bytes, expected {n}", v.len()));
            }
            Ok(Cow::Owned(v))
        }
    }
}

/// Check a quantized tensor's files against its element count; returns its [`Geo`].
fn check_quant(
    dir: &Path,
    numel: u64,
    q: &DataFile,
    s: &DataFile,
    int4: bool,
) -> Result<Geo, ArchiveError> {
    let qp = dir.join(&q.rel);
    let [n, w] = q.header.shape[..] else {
        return Err(invalid(
            &qp,
            format!("shape {:?} is not 2-D", q.header.shape),
        ));
    };
    let c = if int4 { w * 2 } else { w };
    if c == 0 || n.checked_mul(c) != Some(numel) {
        return Err(invalid(
            &qp,
            format!(
                "shape {:?} does not hold the {numel} elements of the tensor's shape",
                q.header.shape
            ),
        ));
    }
    let g = match s.header.shape[..] {
        [sn] if !int4 && sn == n => 1,
        [sn, g] if sn == n && g >= 1 && c % g == 0 => g,
        _ => {
            return Err(invalid(
                &dir.join(&s.rel),
                format!(
                    "scale shape {:?} does not fit values of shape {:?} (expected {}[{n}, groups dividing {c}])",
                    s.header.shape,
                    q.header.shape,
                    if int4 { String::new() } else { format!("[{n}] or ") }
                ),
            ))
        }
    };
    Ok(if int4 {
        Geo::Int4 { c, g }
    } else {
        Geo::Int8 { c, g }
    })
}

fn parse_manifest(dir: &Path) -> Result<Vec<(String, String)>, ArchiveError> {
    let path = dir.join(MANIFEST);
    let bytes = read_small(&path)?;
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

/// The name in `tensors/` of `{key}{suffix}`: `.npy` if present, else `.npy.zst`.
fn pick(files: &HashSet<String>, key: &str, suffix: &str) -> Option<String> {
    let plain = format!("{key}{suffix}.npy");
    if files.contains(&plain) {
        return Some(plain);
    }
    let z = format!("{plain}.zst");
    files.contains(&z).then_some(z)
}

fn has_any(files: &HashSet<String>, key: &str) -> bool {
    SUFFIXES.iter().any(|s| pick(files, key, s).is_some())
}

fn list_tensor_files(dir: &Path) -> Result<HashSet<String>, ArchiveError> {
    let tdir = dir.join(TENSOR_DIR);
    let rd = std::fs::read_dir(&tdir).map_err(|e| io_err(&tdir, e))?;
    let mut out = HashSet::new();
    for e in rd {
        let e = e.map_err(|e| io_err(&tdir, e))?;
        if let Some(n) = e.file_name().to_str() {
            out.insert(n.to_string());
        }
        if out.len() > MAX_FILES {
            return Err(invalid(&tdir, "too many files"));
        }
    }
    Ok(out)
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

impl NpyDir {
    pub fn open(dir: &Path) -> Result<NpyDir, ArchiveError> {
        let manifest = parse_manifest(dir)?;
        let files = list_tensor_files(dir)?;
        let mut op = Opener { dir, next_whole: 0 };
        let side = dir.join(SIDECAR);
        let o = if side.is_file() {
            open_with_sidecar(&mut op, &side, &manifest)?
        } else {
            open_foreign(&mut op, &manifest, &files)?
        };
        let mut parts = o.parts;
        for e in &o.entries {
            for f in &e.files {
                parts.push((f.rel.clone(), f.file_len));
            }
            parts.extend(e.shape_part.clone());
        }
        parts.sort();
        Ok(NpyDir {
            path: dir.to_path_buf(),
            model: o.model,
            entries: o.entries,
            parts,
            routing: o.routing,
            extra: o.extra,
            checksummed: o.checksummed,
            counters: ReadCounters::default(),
            whole: Mutex::new(WholeCache {
                lru: lru::LruCache::unbounded(),
                bytes: 0,
            }),
        })
    }

    /// Whether the directory carries per-block checksums (written by cawsfs).
    pub fn checksummed(&self) -> bool {
        self.checksummed
    }

    /// The data bytes `lo..hi` of file `f`, which lie in row block `b`.
    fn data_slice<'a>(
        &'a self,
        f: &'a DataFile,
        b: usize,
        (lo, hi): (u64, u64),
    ) -> Result<Cow<'a, [u8]>, String> {
        let (stored, bytes): (u64, Cow<[u8]>) = match &f.storage {
            Storage::Plain(m) => {
                let off = f.header.data_offset;
                (
                    hi - lo,
                    Cow::Borrowed(&m[(off + lo) as usize..(off + hi) as usize]),
                )
            }
            Storage::Framed { map, frames } => {
                let (o, n) = frames[b];
                let want = (hi - lo) as usize;
                let v = zstd::bulk::decompress(&map[o..o + n], want)
                    .map_err(|e| format!("zstd frame of row block {b}: {e}"))?;
                if v.len() != want {
                    return Err(format!(
                        "zstd frame of row block {b} decompresses to {} bytes, expected {want}",
                        v.len()
                    ));
                }
                (n as u64, Cow::Owned(v))
            }
            Storage::Whole { id, .. } => {
                let all = self.whole_file(f, *id)?;
                let off = f.header.data_offset;
                (
                    hi - lo,
                    Cow::Owned(all[(off + lo) as usize..(off + hi) as usize].to_vec()),
                )
            }
        };
        self.counters.record(stored, hi - lo);
        Ok(bytes)
    }

    /// A foreign `.npy.zst`, decompressed whole (through the LRU).
    fn whole_file(&self, f: &DataFile, id: usize) -> Result<Arc<Vec<u8>>, String> {
        let poisoned = |_| "cache lock poisoned".to_string();
        if let Some(v) = self.whole.lock().map_err(poisoned)?.lru.get(&id) {
            return Ok(v.clone());
        }
        // Decompressed outside the lock; two readers of one cold file may both do it.
        let v = Arc::new(whole_bytes(f)?.into_owned());
        let mut c = self.whole.lock().map_err(poisoned)?;
        if v.len() <= WHOLE_LRU_BYTES {
            while c.bytes + v.len() > WHOLE_LRU_BYTES {
                match c.lru.pop_lru() {
                    Some((_, old)) => c.bytes -= old.len(),
                    None => break,
                }
            }
            if c.lru.put(id, v.clone()).is_none() {
                c.bytes += v.len();
            }
        }
        Ok(v)
    }

    /// Decode row block `b` of tensor `t`: its values and the element index of the first.
    fn decode_block(&self, t: usize, b: usize) -> Result<(Vec<f32>, u64), BlockError> {
        let e = &self.entries[t];
        let name = &self.model.tensors[t].name;
        let (ranges, el0, el1) = e.geom.block_ranges(b);
        let mut parts = Vec::with_capacity(e.files.len());
        for (f, &r) in e.files.iter().zip(&ranges) {
            let fail = |err| BlockError {
                file: f.rel.clone(),
                err,
            };
            let bytes = self.data_slice(f, b, r).map_err(|reason| {
                fail(ReadError::Corrupt {
                    tensor: name.clone(),
                    block: b,
                    reason: format!("{}: {reason}", f.rel),
                })
            })?;
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
        let mut out = vec![0f32; (el1 - el0) as usize];
        let f32s = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        match e.geom.geo {
            Geo::Int8 { c, g } | Geo::Int4 { c, g } => {
                let dequantize = match e.geom.geo {
                    Geo::Int8 { .. } => quant::dequantize_int8,
                    _ => quant::dequantize_int4,
                };
                dequantize(
                    &parts[0],
                    &f32s(&parts[1]),
                    c as usize,
                    g as usize,
                    &mut out,
                )
            }
            Geo::Pt { sz: 4 } => out.copy_from_slice(&f32s(&parts[0])),
            Geo::Pt { .. } => {
                for (o, c) in out.iter_mut().zip(parts[0].chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
        }
        Ok((out, el0))
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

fn check_sum(
    path: &Path,
    side: &Path,
    what: &str,
    bytes: &[u8],
    want: Option<&str>,
) -> Result<(), ArchiveError> {
    let want = parse_hex(side, what, want.unwrap_or(""))?;
    if xxh3_64(bytes) != want {
        return Err(invalid(
            path,
            format!("{what} XXH3-64 differs from cawsfs.json (file changed or corrupt)"),
        ));
    }
    Ok(())
}

fn open_with_sidecar(
    op: &mut Opener,
    side: &Path,
    manifest: &[(String, String)],
) -> Result<Opened, ArchiveError> {
    let dir = op.dir;
    let sc: Sidecar = serde_json::from_slice(&read_small(side)?)
        .map_err(|e| invalid(side, format!("not a valid cawsfs.json: {e}")))?;
    if sc.format != SIDECAR_FORMAT || sc.version != 1 {
        return Err(invalid(
            side,
            format!(
                "format {:?} version {} is not {SIDECAR_FORMAT:?} version 1",
                sc.format, sc.version
            ),
        ));
    }
    let mut model = crate::archive::container::model_from_meta(sc.model, BTreeMap::new())
        .map_err(|e| invalid(side, e))?;
    let mut parts = vec![
        (MANIFEST.to_string(), file_len(&dir.join(MANIFEST))),
        (SIDECAR.to_string(), file_len(side)),
    ];
    for (name, sum) in &sc.hf_files {
        if name.is_empty() || name.contains('/') || name.contains("..") {
            return Err(invalid(
                side,
                format!("hf file name {name:?} is not a file in the directory"),
            ));
        }
        let p = dir.join(name);
        let bytes = read_small(&p)?;
        check_sum(&p, side, "file", &bytes, Some(sum))?;
        parts.push((name.clone(), bytes.len() as u64));
        model.hf_files.insert(name.clone(), bytes);
    }
    let routing = match &sc.routing_xxh3 {
        None => Vec::new(),
        Some(sum) => {
            let p = dir.join(ROUTING_FILE);
            let bytes = read_small(&p)?;
            check_sum(&p, side, "file", &bytes, Some(sum))?;
            parts.push((ROUTING_FILE.to_string(), bytes.len() as u64));
            bytes
        }
    };
    if sc.tensors.len() != model.tensors.len() {
        return Err(invalid(
            side,
            format!(
                "{} tensor entries for {} model tensors",
                sc.tensors.len(),
                model.tensors.len()
            ),
        ));
    }
    let listed: HashSet<(&str, &str)> = manifest
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let mut entries = Vec::with_capacity(sc.tensors.len());
    for (st, t) in sc.tensors.iter().zip(&model.tensors) {
        entries.push(open_side_tensor(op, side, &listed, st, t)?);
    }
    Ok(Opened {
        model,
        entries,
        routing,
        extra: sc.extra,
        checksummed: true,
        parts,
    })
}

fn open_side_tensor(
    op: &mut Opener,
    side: &Path,
    listed: &HashSet<(&str, &str)>,
    st: &SideTensor,
    t: &TensorDesc,
) -> Result<Entry, ArchiveError> {
    let dir = op.dir;
    let ctx = |m: String| invalid(side, format!("tensor {}: {m}", st.name));
    if st.name != t.name {
        return Err(ctx(format!("listed where the model has {}", t.name)));
    }
    if !listed.contains(&(st.name.as_str(), st.key.as_str()))
        && !listed.contains(&(st.key.as_str(), st.name.as_str()))
    {
        return Err(invalid(
            &dir.join(MANIFEST),
            format!("does not map tensor {} to {}", st.name, st.key),
        ));
    }
    if st.rows_per_block == 0 {
        return Err(ctx("rows_per_block is 0".into()));
    }
    let file = |role: &str| -> Result<&SideFile, ArchiveError> {
        let f = st
            .files
            .get(role)
            .ok_or_else(|| ctx(format!("no {role:?} file")))?;
        let ok_name = f.file.starts_with(&st.key)
            && !f.file.contains('/')
            && (f.file.ends_with(".npy") || f.file.ends_with(".npy.zst"));
        if !ok_name {
            return Err(ctx(format!(
                "file name {:?} is not a tensor file of key {}",
                f.file, st.key
            )));
        }
        Ok(f)
    };
    let sf = file("shape")?;
    let (shape, shape_len, shape_sum) = read_shape_file(op, &sf.file)?;
    let shape_path = dir.join(TENSOR_DIR).join(&sf.file);
    if Some(hex(shape_sum).as_str()) != sf.xxh3.as_deref() {
        return Err(invalid(
            &shape_path,
            "XXH3-64 differs from cawsfs.json (file changed or corrupt)",
        ));
    }
    if shape != t.shape {
        return Err(ctx(format!(
            "shape file says {shape:?}, the model {:?}",
            t.shape
        )));
    }
    let (rows, cols) = (t.rows(), t.cols());
    let (roles, geo, dtypes): (&[&str], Geo, [&[Dtype]; 2]) = match (st.kind.as_str(), st.group) {
        ("int8", None) => (
            &["q", "s"],
            Geo::Int8 { c: cols, g: 1 },
            [&[Dtype::I8], &[Dtype::F32]],
        ),
        ("int4", Some(gs)) if gs >= 2 && gs % 2 == 0 && cols % gs == 0 => (
            &["q4", "s4"],
            Geo::Int4 {
                c: cols,
                g: cols / gs,
            },
            [&[Dtype::U8], &[Dtype::F32]],
        ),
        ("passthrough", None) => (
            &["pt"],
            // The element size is learnt from the header below.
            Geo::Pt { sz: 0 },
            [&[Dtype::F16, Dtype::F32], &[]],
        ),
        (k, g) => {
            return Err(ctx(format!(
                "kind {k:?} with group {g:?} is not valid for width {cols}"
            )))
        }
    };
    let mut geom = Geometry {
        rows,
        cols,
        rows_per_block: st.rows_per_block,
        geo,
    };
    let n_blocks = geom.n_blocks();
    let mut files = Vec::new();
    let mut stored = shape_len;
    for (idx, role) in roles.iter().enumerate() {
        let f = file(role)?;
        if let Geo::Pt { sz: 0 } = geom.geo {
            // Learn the passthrough element size from the header before framing.
            let h = op.open(&f.file, dtypes[idx], None)?.header;
            geom.geo = Geo::Pt { sz: h.dtype.size() };
        }
        // The block count comes from the shape and rows_per_block: it is bounded by the
        // checksums cawsfs.json lists before anything is sized by it.
        let sums = f
            .blocks
            .as_ref()
            .ok_or_else(|| ctx(format!("{role}: no block checksums")))?;
        if sums.len() != n_blocks {
            return Err(ctx(format!(
                "{role}: {} block checksums for {n_blocks} blocks",
                sums.len()
            )));
        }
        let sums = sums
            .iter()
            .map(|h| parse_hex(side, "blocks", h))
            .collect::<Result<Vec<_>, _>>()?;
        let lens: Vec<u64> = (0..n_blocks)
            .map(|b| {
                let r = geom.block_ranges(b).0[idx];
                r.1 - r.0
            })
            .collect();
        let mut df = op.open(&f.file, dtypes[idx], Some(&lens))?;
        let path = dir.join(&df.rel);
        let hb = header_bytes(&df).map_err(|e| invalid(&path, e))?;
        check_sum(&path, side, "npy header", &hb, f.header_xxh3.as_deref())?;
        df.sums = Some(sums);
        stored += df.file_len;
        files.push(df);
    }
    match geom.geo {
        Geo::Int8 { .. } | Geo::Int4 { .. } => {
            let int4 = matches!(geom.geo, Geo::Int4 { .. });
            if check_quant(dir, t.numel(), &files[0], &files[1], int4)? != geom.geo {
                return Err(ctx(
                    "file shapes do not match the group size in cawsfs.json".into(),
                ));
            }
        }
        Geo::Pt { .. } => {
            if files[0].header.numel() != t.numel() {
                return Err(invalid(
                    &dir.join(&files[0].rel),
                    format!(
                        "holds {} elements, the tensor {}",
                        files[0].header.numel(),
                        t.numel()
                    ),
                ));
            }
        }
    }
    Ok(Entry {
        geom,
        files,
        stored_bytes: stored,
        shape_part: Some((format!("{TENSOR_DIR}/{}", sf.file), shape_len)),
    })
}

/// The npy header bytes of a data file (decompressing frame 0 of a framed file).
fn header_bytes(f: &DataFile) -> Result<Vec<u8>, String> {
    let n = f.header.data_offset as usize;
    match &f.storage {
        Storage::Plain(m) => Ok(m[..n].to_vec()),
        Storage::Framed { map, frames } => {
            let end = frames.first().map_or(map.len(), |f| f.0);
            let v = zstd::bulk::decompress(&map[..end], n).map_err(|e| format!("zstd: {e}"))?;
            if v.len() != n {
                return Err("zstd header frame has the wrong length".into());
            }
            Ok(v)
        }
        Storage::Whole { .. } => Err("not a framed file".into()),
    }
}

fn open_foreign(
    op: &mut Opener,
    manifest: &[(String, String)],
    files: &HashSet<String>,
) -> Result<Opened, ArchiveError> {
    let dir = op.dir;
    let mpath = dir.join(MANIFEST);
    let cfg = dir.join("config.json");
    if !cfg.is_file() {
        return Err(invalid(
            dir,
            "config.json is missing: an npy-dir needs the model's config.json and tokenizer files beside manifest.json",
        ));
    }
    let mut hf_files = BTreeMap::new();
    let mut parts = vec![(MANIFEST.to_string(), file_len(&mpath))];
    for name in crate::import::hf::KEPT_FILES {
        let p = dir.join(name);
        if p.is_file() {
            let b = read_small(&p)?;
            parts.push((name.to_string(), b.len() as u64));
            hf_files.insert(name.to_string(), b);
        }
    }
    let config: Value = serde_json::from_slice(&hf_files["config.json"])
        .map_err(|e| invalid(&cfg, format!("not valid JSON: {e}")))?;
    let mut items = Vec::new();
    let mut seen = HashSet::new();
    for (a, b) in manifest {
        let (name, key) = match (has_any(files, a), has_any(files, b)) {
            (false, true) => (a, b),
            (true, false) => (b, a),
            (false, false) => {
                return Err(invalid(
                    &mpath,
                    format!("entry {a:?}: no files tensors/{b}__*.npy[.zst] (nor tensors/{a}__*)"),
                ))
            }
            (true, true) => {
                return Err(invalid(
                    &mpath,
                    format!("entry {a:?}: both sides name tensor files"),
                ))
            }
        };
        if !seen.insert(name.clone()) {
            return Err(invalid(&mpath, format!("tensor {name} is listed twice")));
        }
        items.push(open_foreign_tensor(op, name, key, files)?);
    }
    items.sort_by_key(|(t, _)| crate::import::hf::sort_key(&t.name));
    let (tensors, entries): (Vec<TensorDesc>, Vec<Entry>) = items.into_iter().unzip();
    let arch = crate::import::hf::arch_from_config(&cfg, &config, &tensors)
        .map_err(|e| invalid(&cfg, e.to_string()))?;
    Ok(Opened {
        model: ModelDesc {
            arch,
            tensors,
            hf_files,
            gguf_meta: Vec::new(),
        },
        entries,
        routing: Vec::new(),
        extra: serde_json::json!({
            "checksums": false,
            "note": "no cawsfs.json: Squish files carry no checksums; structural checks only",
        }),
        checksummed: false,
        parts,
    })
}

fn open_foreign_tensor(
    op: &mut Opener,
    name: &str,
    key: &str,
    files: &HashSet<String>,
) -> Result<(TensorDesc, Entry), ArchiveError> {
    let dir = op.dir;
    let get = |s: &str| pick(files, key, s);
    let shape_file = get("__shape");
    let shape_of = |op: &mut Opener| -> Result<(Vec<u64>, u64), ArchiveError> {
        let f = shape_file.as_ref().ok_or_else(|| {
            invalid(
                &dir.join(TENSOR_DIR),
                format!("tensor {name}: {key}__shape.npy is missing"),
            )
        })?;
        let (s, len, _) = read_shape_file(op, f)?;
        Ok((s, len))
    };
    // Priority of seed 002 §15.5: int4, then int8, then passthrough.
    let quant = match (get("__q4"), get("__s4"), get("__q"), get("__s")) {
        (Some(q), Some(s), _, _) => Some((q, s, true)),
        (_, _, Some(q), Some(s)) => Some((q, s, false)),
        _ => None,
    };
    let (shape, geo, files, stored, source) = if let Some((qn, sn, int4)) = quant {
        let (shape, slen) = shape_of(op)?;
        let q = op.open(&qn, &[if int4 { Dtype::U8 } else { Dtype::I8 }], None)?;
        let s = op.open(&sn, &[Dtype::F32], None)?;
        let geo = check_quant(dir, shape.iter().product(), &q, &s, int4)?;
        let stored = slen + q.file_len + s.file_len;
        (shape, geo, vec![q, s], stored, SourceType::F16)
    } else if let Some(ptn) = get("__pt") {
        let pt = op.open(&ptn, &[Dtype::F16, Dtype::F32], None)?;
        let (shape, slen) = if shape_file.is_some() {
            shape_of(op)?
        } else {
            (pt.header.shape.clone(), 0)
        };
        if pt.header.numel() != shape.iter().product::<u64>() {
            return Err(invalid(
                &dir.join(&pt.rel),
                format!(
                    "holds {} elements, the shape file says {shape:?}",
                    pt.header.numel()
                ),
            ));
        }
        let sz = pt.header.dtype.size();
        let source = if sz == 4 {
            SourceType::F32
        } else {
            SourceType::F16
        };
        let stored = slen + pt.file_len;
        (shape, Geo::Pt { sz }, vec![pt], stored, source)
    } else {
        return Err(invalid(
            &dir.join(TENSOR_DIR),
            format!("tensor {name}: none of {key}__q4+__s4, __q+__s or __pt is present"),
        ));
    };
    let t = TensorDesc {
        name: name.to_string(),
        shape,
        source,
    };
    let geom = Geometry {
        rows: t.rows(),
        cols: t.cols(),
        rows_per_block: crate::archive::container::rows_per_block(&t),
        geo,
    };
    Ok((
        t,
        Entry {
            geom,
            files,
            stored_bytes: stored,
            shape_part: shape_file.map(|f| {
                let len = file_len(&dir.join(TENSOR_DIR).join(&f));
                (format!("{TENSOR_DIR}/{f}"), len)
            }),
        },
    ))
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
        for b in r0 / g.rows_per_block..=(r1 - 1) / g.rows_per_block {
            let (vals, start) = self.decode_block(tensor, b as usize).map_err(|be| {
                tracing::error!("{}: {}: {}", self.path.display(), be.file, be.err);
                be.err
            })?;
            let lo = e0.max(start);
            let hi = e1.min(start + vals.len() as u64);
            if lo < hi {
                out[(lo - e0) as usize..(hi - e0) as usize]
                    .copy_from_slice(&vals[(lo - start) as usize..(hi - start) as usize]);
            }
        }
        Ok(())
    }
}

impl Store for NpyDir {
    fn kind(&self) -> Kind {
        Kind::NpyDir
    }
    fn path(&self) -> &Path {
        &self.path
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
        }
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
            .filter_map(|&(t, b)| match self.decode_block(t, b) {
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
