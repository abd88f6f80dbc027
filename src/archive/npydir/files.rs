//! One data file of a tensor ([`DataFile`]): opened and validated whole at open (npy
//! header, dtype, exact length, zstd frames), then read by row block with `pread`
//! ([`ArchiveFile`]: a file truncated or rewritten under a mount fails reads, never
//! faults). Plain `.npy` files are read by row range, cawsfs-framed `.npy.zst`
//! decompress one frame per block, and a foreign `.npy.zst` is decompressed whole into
//! a small LRU shared by the directory.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64;

use super::frames::{walk_frames, zst_header, Frame};
use super::npy::{self, Dtype};
use super::{NpyDir, TENSOR_DIR};
use crate::archive::container::{invalid, zstd_decompress, BlobFault};
use crate::archive::dir::ArchiveDir;
use crate::archive::file::{ArchiveFile, ONCE};
use crate::archive::remote::RemoteObject;
use crate::archive::ArchiveError;

/// Decompressed foreign `.npy.zst` files kept in memory (NPYDIR.md §4).
const WHOLE_LRU_BYTES: usize = 256 << 20;
/// zstd cannot expand data by more than this (an RLE block: 4 bytes → 128 KiB).
const ZSTD_MAX_RATIO: u64 = 32768;

pub(super) enum Storage {
    /// Plain `.npy`; data at `header.data_offset`.
    Plain(ArchiveFile),
    /// cawsfs-framed `.npy.zst`: `frames[b]` = (offset, len) of row block `b`'s frame.
    Framed {
        file: ArchiveFile,
        frames: Vec<(u64, usize)>,
    },
    /// Foreign `.npy.zst`, decompressed whole on demand; `id` keys the LRU.
    Whole { file: ArchiveFile, id: usize },
}

pub(super) struct DataFile {
    /// Path relative to the directory, for messages ("tensors/x__q.npy").
    pub rel: String,
    pub header: npy::Header,
    pub storage: Storage,
    pub file_len: u64,
    /// XXH3-64 of each row block's data bytes (cawsfs-written directories).
    pub sums: Option<Vec<u64>>,
}

impl DataFile {
    pub(super) fn is_zst(&self) -> bool {
        !matches!(self.storage, Storage::Plain(_))
    }

    /// Where row block `b` (data bytes `lo..hi`) lies in the object, when the file is
    /// one and the block is read by range: (the object, offset, length).
    pub(super) fn remote_range(
        &self,
        b: usize,
        (lo, hi): (u64, u64),
    ) -> Option<(&RemoteObject, u64, u64)> {
        match &self.storage {
            Storage::Plain(file) => Some((file.remote()?, self.header.data_offset + lo, hi - lo)),
            Storage::Framed { file, frames } => {
                let (o, n) = frames[b];
                Some((file.remote()?, o, n as u64))
            }
            Storage::Whole { .. } => None,
        }
    }
}

/// Decompressed foreign files, least recently used first out.
pub(super) struct WholeCache {
    lru: lru::LruCache<usize, Arc<Vec<u8>>>,
    bytes: usize,
}

impl WholeCache {
    pub(super) fn new() -> Self {
        WholeCache {
            lru: lru::LruCache::unbounded(),
            bytes: 0,
        }
    }
}

/// Opens the data files of one directory; numbers the foreign zst files for the LRU.
pub(super) struct Opener<'a> {
    pub src: &'a ArchiveDir,
    /// `src`'s path, for messages.
    pub dir: &'a Path,
    pub next_whole: AtomicUsize,
}

/// Threads opening the files of a directory in object storage: each open waits on a
/// request, so they overlap requests rather than share cores.
const REMOTE_OPENERS: usize = 16;

impl Opener<'_> {
    /// `f` over `items`, in order; a directory in object storage opens them side by
    /// side (a local one in order, so the first bad file is the one named).
    pub(super) fn each<T: Sync, R: Send>(
        &self,
        items: &[T],
        f: impl Fn(&Self, &T) -> Result<R, ArchiveError> + Sync,
    ) -> Result<Vec<R>, ArchiveError> {
        use rayon::prelude::*;
        if !self.src.is_remote() {
            return items.iter().map(|t| f(self, t)).collect();
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(REMOTE_OPENERS)
            .thread_name(|i| format!("cawsfs-open-{i}"))
            .build()
            .map_err(|e| invalid(self.dir, format!("starting threads to open it: {e}")))?;
        pool.install(|| items.par_iter().map(|t| f(self, t)).collect())
    }

    /// Open `tensors/{name}` (`.npy` or `.npy.zst`), check its dtype is one of `dtypes`
    /// and its length; `framed` = Some(block data lengths) for a cawsfs-framed zst.
    pub(super) fn open(
        &self,
        name: &str,
        dtypes: &[Dtype],
        framed: Option<&[u64]>,
    ) -> Result<DataFile, ArchiveError> {
        let rel = format!("{TENSOR_DIR}/{name}");
        let path = self.dir.join(&rel);
        let file = self.src.open_file(&rel)?;
        let file_len = file.len();
        if file_len == 0 {
            return Err(invalid(&path, "empty file"));
        }
        let zst = name.ends_with(".zst");
        let (header, storage) = if !zst {
            // Headers are short (numpy pads them to 64 or 128 bytes): one read, usually.
            let mut head = file.read_head(0, file_len.min(ONCE as u64) as usize)?;
            let hl = npy::header_len(&head).map_err(|e| invalid(&path, e))?;
            if hl > head.len() as u64 {
                head = file.read_head(0, file_len.min(hl) as usize)?;
            }
            head.truncate(hl as usize);
            let header = npy::parse(&head).map_err(|e| invalid(&path, e))?;
            (header, Storage::Plain(file))
        } else {
            self.open_zst(&path, file, framed)?
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

    /// The header and storage of a `.npy.zst`: its frames walked, its decompressed size
    /// checked against the npy header, and its framing as `framed` says.
    fn open_zst(
        &self,
        path: &Path,
        file: ArchiveFile,
        framed: Option<&[u64]>,
    ) -> Result<(npy::Header, Storage), ArchiveError> {
        let file_len = file.len();
        let frames = walk_frames(&file)?;
        // The header frame, or the first MiB of a foreign single-frame stream.
        let first = frames.first().map_or(0, |f| f.len).min(1 << 20);
        let header = zst_header(&file.read_head(0, first)?).map_err(|e| invalid(path, e))?;
        let expect = header.data_offset + header.data_len();
        if expect
            > file_len
                .saturating_mul(ZSTD_MAX_RATIO)
                .saturating_add(1 << 20)
        {
            return Err(invalid(
                path,
                format!(
                    "header claims {expect} bytes, more than {file_len} compressed bytes can hold"
                ),
            ));
        }
        if frames.iter().all(|f| f.content.is_some()) {
            let total: u64 = frames.iter().map(|f| f.content.unwrap_or(0)).sum();
            if total != expect {
                return Err(invalid(
                    path,
                    format!("truncated or padded: decompresses to {total} bytes, the npy header says {expect}"),
                ));
            }
        }
        let storage = match framed {
            Some(lens) => framed_storage(path, file, &frames, &header, lens)?,
            None => {
                check_whole(path, &frames, expect)?;
                Storage::Whole {
                    file,
                    id: self.next_whole.fetch_add(1, Ordering::Relaxed) + 1,
                }
            }
        };
        Ok((header, storage))
    }
}

/// A cawsfs-framed file: one header frame, then one frame per row block of `lens` bytes.
fn framed_storage(
    path: &Path,
    file: ArchiveFile,
    frames: &[Frame],
    header: &npy::Header,
    lens: &[u64],
) -> Result<Storage, ArchiveError> {
    let ok = frames.len() == lens.len() + 1
        && frames[0].content == Some(header.data_offset)
        && frames[1..]
            .iter()
            .zip(lens)
            .all(|(f, &l)| f.content == Some(l));
    if !ok {
        return Err(invalid(
            path,
            format!(
                "not framed as cawsfs.json says (one header frame and {} row-block frames)",
                lens.len()
            ),
        ));
    }
    let frames = frames[1..].iter().map(|f| (f.offset, f.len)).collect();
    Ok(Storage::Framed { file, frames })
}

/// A foreign stream is decompressed into memory on read: its size must be known and
/// bounded now, or one crafted file could make the daemon reserve gigabytes (and abort)
/// on its first read.
fn check_whole(path: &Path, frames: &[Frame], expect: u64) -> Result<(), ArchiveError> {
    if frames.iter().any(|f| f.content.is_none()) {
        return Err(invalid(
            path,
            "a zstd frame does not record its decompressed size; recompress with `zstd` (it records sizes)",
        ));
    }
    if expect > WHOLE_LRU_BYTES as u64 {
        return Err(invalid(
            path,
            format!(
                "one zstd stream of {expect} bytes decompressed is over the {} MiB that can be served by decompressing it whole; decompress it (`zstd -d`) or reconvert with `cawsfs convert --to npy-dir --zstd` (framed per row block)",
                WHOLE_LRU_BYTES >> 20
            ),
        ));
    }
    Ok(())
}

/// `tensors/{name}` as a shape file: (shape, file length, XXH3-64 of the whole file).
pub(super) fn read_shape_file(
    op: &Opener,
    name: &str,
) -> Result<(Vec<u64>, u64, u64), ArchiveError> {
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
    let bytes = whole_bytes(&f).map_err(|e| invalid(&path, e.describe("the file")))?;
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
fn whole_bytes(f: &DataFile) -> Result<Vec<u8>, BlobFault> {
    match &f.storage {
        Storage::Plain(file) => Ok(file.read_at(0, f.file_len as usize)?),
        Storage::Framed { file, .. } | Storage::Whole { file, .. } => {
            let n = (f.header.data_offset + f.header.data_len()) as usize;
            let stored = file.read_at(0, f.file_len as usize)?;
            let v = zstd_decompress(&stored, n)
                .map_err(|e| BlobFault::Corrupt(format!("zstd: {e}")))?;
            if v.len() != n {
                let got = v.len();
                return Err(BlobFault::Corrupt(format!(
                    "decompresses to {got} bytes, expected {n}"
                )));
            }
            Ok(v)
        }
    }
}

/// The npy header bytes of a data file (decompressing frame 0 of a framed file).
pub(super) fn header_bytes(f: &DataFile) -> Result<Vec<u8>, String> {
    let n = f.header.data_offset as usize;
    let read = |file: &ArchiveFile, len: u64| {
        file.read_at(0, len as usize)
            .map_err(|e| BlobFault::from(e).describe("the header"))
    };
    match &f.storage {
        Storage::Plain(file) => read(file, n as u64),
        Storage::Framed { file, frames } => {
            let end = frames.first().map_or(f.file_len, |f| f.0);
            let v = zstd_decompress(&read(file, end)?, n).map_err(|e| format!("zstd: {e}"))?;
            if v.len() != n {
                return Err("zstd header frame has the wrong length".into());
            }
            Ok(v)
        }
        Storage::Whole { .. } => Err("not a framed file".into()),
    }
}

impl NpyDir {
    /// The data bytes `lo..hi` of file `f`, which lie in row block `b`.
    pub(super) fn data_slice(
        &self,
        f: &DataFile,
        b: usize,
        (lo, hi): (u64, u64),
    ) -> Result<Vec<u8>, BlobFault> {
        let off = f.header.data_offset;
        let (stored, bytes) = match &f.storage {
            Storage::Plain(file) => (hi - lo, file.read_at(off + lo, (hi - lo) as usize)?),
            Storage::Framed { file, frames } => {
                let (o, n) = frames[b];
                let want = (hi - lo) as usize;
                let v = zstd_decompress(&file.read_at(o, n)?, want)
                    .map_err(|e| BlobFault::Corrupt(format!("zstd frame of row block {b}: {e}")))?;
                if v.len() != want {
                    return Err(BlobFault::Corrupt(format!(
                        "zstd frame of row block {b} decompresses to {} bytes, expected {want}",
                        v.len()
                    )));
                }
                (n as u64, v)
            }
            Storage::Whole { id, .. } => {
                let all = self.whole_file(f, *id)?;
                (
                    hi - lo,
                    all[(off + lo) as usize..(off + hi) as usize].to_vec(),
                )
            }
        };
        self.counters.record(stored, hi - lo);
        Ok(bytes)
    }

    /// A foreign `.npy.zst`, decompressed whole (through the LRU).
    fn whole_file(&self, f: &DataFile, id: usize) -> Result<Arc<Vec<u8>>, BlobFault> {
        let poisoned = |_| BlobFault::Corrupt("cache lock poisoned".to_string());
        if let Some(v) = self.whole.lock().map_err(poisoned)?.lru.get(&id) {
            return Ok(v.clone());
        }
        // Decompressed outside the lock; two readers of one cold file may both do it.
        let v = Arc::new(whole_bytes(f)?);
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
}
