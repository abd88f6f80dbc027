//! The mounted filesystem as plain Rust, not tied to the FUSE bindings: a read-only
//! directory of virtual files (`model.safetensors`, `model.gguf`, the Hugging Face
//! metadata files) whose bytes come from the layouts through the chunk cache, and the
//! subdirectories some metadata files live in (sentence-transformers' `1_Pooling/`).
//! `fuse.rs` translates kernel requests into calls here and errors into errno.
//!
//! Inode numbers are stable: 1 is the root, the tensor files (`model.gguf`,
//! `model.safetensors`) follow in name order from 2, then the metadata files in name
//! order, then their subdirectories in name order; the set of files depends only on
//! the archive and the mount options.
//!
//! The metadata files are made on first use, not at mount: deriving `tokenizer.json`
//! from a GGUF vocabulary and packing it took 55 ms of a restart's 98 ms of setup
//! (docs/MOUNT.md, "Disk tier"), and llama.cpp never opens it.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime};

use crate::archive::Store;
use crate::cache::{CacheConfig, CacheError, ChunkCache};
use crate::layout::{self, GgufView, LayoutError, VirtualFile};
use crate::model::{FloatType, ReadError};
use crate::tier;

mod experts;
mod passthrough;
mod tiering;
pub use experts::ExpertOptions;
pub use passthrough::Passthrough;
use tiering::open_tier;
pub use tiering::{FsTier, MaterializeError, Materializing};

pub const ROOT_INO: u64 = 1;

#[derive(Clone, Debug)]
pub struct FsOptions {
    pub cache_bytes: u64,
    pub chunk_size: u64,
    pub gguf_type: GgufView,
    /// dtype of `model.safetensors` (None: the source's float type).
    pub safetensors_dtype: Option<FloatType>,
    /// Above this many tensor bytes the safetensors view is Hugging Face's shards.
    pub safetensors_shard_bytes: u64,
    pub readahead_chunks: u64,
    pub prefetch_threads: usize,
    /// Evict chunks a pending route names after other chunks (false: plain LRU).
    pub router_eviction: bool,
    /// Keep reconstructed bytes on disk (docs/TIER.md); None: no disk tier.
    pub tier: Option<TierOptions>,
    /// Predict and queue the next layer's experts (docs/MOE.md); None: off.
    pub experts: Option<ExpertOptions>,
}

#[derive(Clone, Debug)]
pub struct TierOptions {
    pub dir: PathBuf,
    /// Bound on the tier directory's data, all mounts' entries together.
    pub max_bytes: u64,
    /// Asked for by the user: a tier that cannot be opened fails the mount. The default
    /// tier is only logged and left out.
    pub required: bool,
}

impl Default for FsOptions {
    fn default() -> Self {
        FsOptions {
            cache_bytes: 1 << 30,
            chunk_size: crate::cache::DEFAULT_CHUNK_SIZE,
            gguf_type: GgufView::Auto,
            safetensors_dtype: None,
            safetensors_shard_bytes: layout::DEFAULT_SHARD_BYTES,
            readahead_chunks: crate::cache::DEFAULT_READAHEAD_CHUNKS,
            prefetch_threads: 2,
            router_eviction: true,
            tier: None,
            experts: Some(ExpertOptions {
                mode: crate::cache::ExpertMode::Learn,
                dir: None,
            }),
        }
    }
}

/// Why a filesystem operation failed. Mapped to errno in one place (`fuse.rs`).
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such file: {0}")]
    NotFound(String),
    #[error("inode {0} does not exist")]
    NoInode(u64),
    #[error("not a directory")]
    NotADirectory,
    #[error("is a directory")]
    IsADirectory,
    #[error("read-only file system")]
    ReadOnly,
    #[error(transparent)]
    Read(#[from] ReadError),
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("cache: {0}")]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Tier(#[from] tier::TierError),
    #[error("disk tier: cannot start its writer: {0}")]
    TierWriter(std::io::Error),
}

/// What `getattr` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub is_dir: bool,
    pub mtime: SystemTime,
}

pub struct Entry {
    pub name: String,
    pub ino: u64,
    pub file: VirtualFile,
    /// Small files made only of header bytes are served without the cache.
    pub cached: bool,
    /// This file's disk tier entry (cached files, when the tier is on).
    pub tier: Option<Arc<tier::Entry>>,
    /// The tier entry was verified whole in this mount (before passthrough).
    verified: std::sync::atomic::AtomicBool,
    /// Opened with FUSE passthrough at least once in this mount.
    passthrough: std::sync::atomic::AtomicBool,
}

/// The metadata files (named by their path: `1_Pooling/config.json`) and the
/// subdirectories they are in, by name; directory `k` has inode `first_dir + k`.
struct Metadata {
    files: Vec<Entry>,
    dirs: Vec<String>,
    first_dir: u64,
}

pub struct MountFs {
    archive: Arc<dyn Store>,
    /// The tensor files, made before the mount is up.
    entries: Vec<Entry>,
    /// The metadata files and their subdirectories, made on first use
    /// ([`MountFs::metadata`]).
    metadata: OnceLock<Metadata>,
    cache: Arc<ChunkCache>,
    tier: Option<Arc<FsTier>>,
    experts: Vec<experts::Learned>,
    /// The kernel read-ahead for this mount's files, KiB.
    readahead_kb: u32,
    mtime: SystemTime,
    started: Instant,
}

impl MountFs {
    pub fn new(archive: Arc<dyn Store>, opts: &FsOptions) -> Result<MountFs, SetupError> {
        let t0 = Instant::now();
        let model = archive.model();
        let (mut files, index) =
            layout::safetensors_view(model, opts.safetensors_dtype, opts.safetensors_shard_bytes)?;
        if let Some(index) = index {
            files.push(VirtualFile::from_bytes(layout::SAFETENSORS_INDEX, index));
        }
        let gguf = layout::gguf_plan(model, opts.gguf_type, &layout::held_of(&*archive)).and_then(
            |plan| {
                for note in layout::gguf_notes(model, &plan) {
                    tracing::info!("{note}");
                }
                layout::gguf_file(model, &plan)
            },
        );
        match gguf {
            Ok(file) => files.push(file),
            // The other views are served; the log says once why this one is not.
            Err(layout::LayoutError::NoGguf(why)) => tracing::warn!("{why}"),
            Err(e) => return Err(e.into()),
        }
        files.sort_by(|a, b| a.name.cmp(&b.name));
        // What a restart spends before serving (docs/MOUNT.md, "Disk tier").
        tracing::debug!("setup: GGUF and safetensors layouts {:?}", t0.elapsed());
        // Decode buffers kept between reads live outside the cache budget: a
        // sixty-fourth of it at most (none under 64 MiB).
        let kept = opts.cache_bytes / 64 / layout::SCRATCH_BUFFER_BYTES;
        layout::keep_scratch_buffers(kept.min(16) as usize);
        // So are blocks kept for the rest of their rows: a sixteenth of it at most.
        crate::archive::set_block_memo_bytes(
            (opts.cache_bytes / 16).min(crate::archive::store::BLOCK_MEMO_BYTES as u64) as usize,
        );
        let mut cfg = CacheConfig::new(opts.cache_bytes, opts.chunk_size);
        cfg.readahead_chunks = opts.readahead_chunks;
        cfg.router_eviction = opts.router_eviction;
        cfg.load_work_factor = files
            .iter()
            .map(|f| f.load_work_factor())
            .max()
            .unwrap_or(1);
        let cache = Arc::new(ChunkCache::with_config(cfg)?);
        let mut entries: Vec<Entry> = files
            .into_iter()
            .enumerate()
            .map(|(i, file)| Entry {
                name: file.name.clone(),
                ino: ROOT_INO + 1 + i as u64,
                cached: !file.tensor_ranges().is_empty(),
                file,
                tier: None,
                verified: Default::default(),
                passthrough: Default::default(),
            })
            .collect();
        let tier = match &opts.tier {
            Some(t) => match open_tier(&*archive, &mut entries, t, opts) {
                Ok(tier) => Some(tier),
                Err(e) if !t.required => {
                    tracing::warn!("{e}; mounting without a disk tier");
                    entries.iter_mut().for_each(|e| e.tier = None);
                    None
                }
                Err(e) => return Err(e),
            },
            None => None,
        };
        for e in entries.iter().filter(|e| e.cached) {
            let l = Loader {
                archive: archive.clone(),
                file: e.file.clone(),
                chunk_size: opts.chunk_size,
                tier: tier.clone().zip(e.tier.clone()),
            };
            cache.register_file(file_id(e.ino), Arc::new(move |idx, buf| l.load(idx, buf)));
            // What is loaded goes to the tier as it is, without a copy.
            if let (Some(t), Some(te)) = (&tier, &e.tier) {
                let (t, te) = (t.clone(), te.clone());
                cache.set_keeper(
                    file_id(e.ino),
                    Box::new(move |idx, chunk| t.keep(&te, idx, chunk)),
                );
            }
        }
        let experts = match &opts.experts {
            Some(x) => experts::start(&*archive, &entries, &cache, x),
            None => Vec::new(),
        };
        let readahead_kb = experts::kernel_readahead_kb(archive.model(), &entries);
        pack_in_background(&entries);
        if opts.prefetch_threads > 0 {
            cache.start_prefetcher(opts.prefetch_threads);
        }
        let mtime = std::fs::metadata(archive.path())
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH);
        Ok(MountFs {
            archive,
            entries,
            metadata: OnceLock::new(),
            cache,
            tier,
            experts,
            readahead_kb,
            mtime,
            started: Instant::now(),
        })
    }

    /// Every file: the tensor files, then the metadata files (made now if not yet).
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter().chain(self.metadata_files())
    }

    /// The files served through the chunk cache (`model.gguf`, `model.safetensors`).
    pub fn tensor_files(&self) -> &[Entry] {
        &self.entries
    }

    /// Whether the metadata files have been made (or their making has started).
    pub fn metadata_made(&self) -> bool {
        self.metadata.get().is_some()
    }

    /// The small metadata files (config.json, tokenizer.json ...), made on the first
    /// call; a caller arriving meanwhile waits for them. A model they cannot be made
    /// for is logged once and served without them: its tensor files stay readable.
    fn metadata_files(&self) -> &[Entry] {
        &self.metadata().files
    }

    fn metadata(&self) -> &Metadata {
        self.metadata.get_or_init(|| {
            let files = self.make_metadata_files();
            let mut dirs: Vec<String> = files
                .iter()
                .filter_map(|e| Some(e.name.split_once('/')?.0.to_string()))
                .collect();
            dirs.sort();
            dirs.dedup();
            let first_dir = ROOT_INO + 1 + (self.entries.len() + files.len()) as u64;
            Metadata {
                files,
                dirs,
                first_dir,
            }
        })
    }

    fn make_metadata_files(&self) -> Vec<Entry> {
        let t0 = Instant::now();
        let made = layout::hf_metadata_files(self.archive.model());
        let t_made = t0.elapsed();
        let files = match made {
            Ok(files) => files,
            Err(e) => {
                tracing::error!(
                    "{}: serving no metadata files (config.json, tokenizer.json ...): {e}",
                    self.archive.path().display()
                );
                return Vec::new();
            }
        };
        let first = ROOT_INO + 1 + self.entries.len() as u64;
        let entries: Vec<Entry> = files
            .into_iter()
            .filter(|(name, _)| self.entries.iter().all(|e| e.name != *name))
            .enumerate()
            .map(|(i, (name, bytes))| Entry {
                ino: first + i as u64,
                file: VirtualFile::from_bytes(&name, bytes),
                name,
                cached: false,
                tier: None,
                verified: Default::default(),
                passthrough: Default::default(),
            })
            .collect();
        tracing::debug!(
            "metadata files made in {t_made:?} and packed in {:?}",
            t0.elapsed() - t_made
        );
        entries
    }

    pub fn cache(&self) -> &Arc<ChunkCache> {
        &self.cache
    }

    pub fn archive(&self) -> &Arc<dyn Store> {
        &self.archive
    }

    pub fn tier(&self) -> Option<&FsTier> {
        self.tier.as_deref()
    }

    /// The tensor files are looked at first: finding `model.gguf` makes no metadata file.
    pub fn entry_by_name(&self, name: &str) -> Option<&Entry> {
        let named = |e: &&Entry| e.name == name;
        (self.entries.iter().find(named)).or_else(|| self.metadata_files().iter().find(named))
    }

    fn entry(&self, ino: u64) -> Result<&Entry, FsError> {
        if ino == ROOT_INO || self.dir_name(ino).is_some() {
            return Err(FsError::IsADirectory);
        }
        let i = ino.checked_sub(ROOT_INO + 1).ok_or(FsError::NoInode(ino))? as usize;
        let n = self.entries.len();
        if i < n {
            return Ok(&self.entries[i]);
        }
        self.metadata_files()
            .get(i - n)
            .ok_or(FsError::NoInode(ino))
    }

    /// The name of subdirectory `ino`, if it is one.
    fn dir_name(&self, ino: u64) -> Option<&str> {
        if ino <= ROOT_INO + self.entries.len() as u64 {
            return None;
        }
        let m = self.metadata();
        let k = ino.checked_sub(m.first_dir)?;
        m.dirs.get(k as usize).map(String::as_str)
    }

    fn dir_attr(&self, ino: u64) -> Attr {
        Attr {
            ino,
            size: 0,
            is_dir: true,
            mtime: self.mtime,
        }
    }

    fn root_attr(&self) -> Attr {
        Attr {
            ino: ROOT_INO,
            size: 0,
            is_dir: true,
            mtime: self.mtime,
        }
    }

    fn file_attr(&self, e: &Entry) -> Attr {
        Attr {
            ino: e.ino,
            size: e.file.size,
            is_dir: false,
            mtime: self.mtime,
        }
    }

    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, FsError> {
        let name_str = name.to_string_lossy();
        let not_found = || FsError::NotFound(name_str.to_string());
        // A '/' is never part of a name the kernel asks for.
        let path = match parent {
            // A file first (finding `model.gguf` makes no metadata file), then a
            // subdirectory.
            ROOT_INO if self.entry_by_name(&name_str).is_none() => {
                let m = self.metadata();
                return match m.dirs.iter().position(|d| OsStr::new(d) == name) {
                    Some(k) => Ok(self.dir_attr(m.first_dir + k as u64)),
                    None => Err(not_found()),
                };
            }
            ROOT_INO => name_str.to_string(),
            p => match self.dir_name(p) {
                Some(d) => format!("{d}/{name_str}"),
                None => {
                    self.entry(p)?;
                    return Err(FsError::NotADirectory);
                }
            },
        };
        // Compared as bytes: `path` was made from a lossy conversion of `name`.
        self.entry_by_name(&path)
            .filter(|e| e.name.rsplit('/').next().map(OsStr::new) == Some(name))
            .map(|e| self.file_attr(e))
            .ok_or_else(not_found)
    }

    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        if ino == ROOT_INO {
            return Ok(self.root_attr());
        }
        if self.dir_name(ino).is_some() {
            return Ok(self.dir_attr(ino));
        }
        self.entry(ino).map(|e| self.file_attr(e))
    }

    /// `(ino, is_dir, name)` for `.`, `..` and every file and subdirectory in `ino`.
    pub fn readdir(&self, ino: u64) -> Result<Vec<(u64, bool, String)>, FsError> {
        let prefix = match ino {
            ROOT_INO => String::new(),
            _ => match self.dir_name(ino) {
                Some(d) => format!("{d}/"),
                None => {
                    self.entry(ino)?;
                    return Err(FsError::NotADirectory);
                }
            },
        };
        let mut out = vec![
            (ino, true, ".".to_string()),
            (ROOT_INO, true, "..".to_string()),
        ];
        let mut files: Vec<(u64, bool, String)> = self
            .entries()
            .filter_map(|e| {
                let rest = e.name.strip_prefix(&prefix)?;
                (!rest.contains('/')).then(|| (e.ino, false, rest.to_string()))
            })
            .collect();
        if ino == ROOT_INO {
            let m = self.metadata();
            files.extend(
                (m.dirs.iter().enumerate()).map(|(k, d)| (m.first_dir + k as u64, true, d.clone())),
            );
        }
        files.sort_by(|a, b| a.2.cmp(&b.2));
        out.extend(files);
        Ok(out)
    }

    pub fn open(&self, ino: u64, write: bool) -> Result<(), FsError> {
        self.entry(ino)?;
        if write {
            return Err(FsError::ReadOnly);
        }
        Ok(())
    }

    /// Up to `size` bytes at `offset` (short only at end of file).
    pub fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Vec<u8>, FsError> {
        self.read_with(ino, offset, size, |b| b.to_vec())
    }

    /// Like [`MountFs::read`], handing the bytes to `reply` from a per-thread buffer:
    /// a fresh 1 MiB allocation per request, where the allocator maps buffers that
    /// size (a low mmap threshold, see `mount::run`'s allocator tuning), page-faulted
    /// on every request and halved warm-read throughput.
    pub fn read_with<R>(
        &self,
        ino: u64,
        offset: u64,
        size: u32,
        reply: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, FsError> {
        thread_local! {
            static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        if ino == ROOT_INO {
            return Err(FsError::IsADirectory);
        }
        let e = self.entry(ino)?;
        let len = (size as u64).min(e.file.size.saturating_sub(offset)) as usize;
        if e.cached && len > 0 {
            let tier = self.tier.as_deref().zip(e.tier.as_ref());
            let cs = self.cache.chunk_size();
            let load =
                |idx, chunk: &mut [u8]| load_chunk(&*self.archive, &e.file, cs, tier, idx, chunk);
            return Ok(self.cache.read_with(
                file_id(e.ino),
                e.file.size,
                offset,
                len,
                &load,
                |parts| match parts {
                    // Inside one chunk (most reads): straight from the cache.
                    [one] => reply(one),
                    _ => BUF.with(|cell| {
                        let mut buf = cell.borrow_mut();
                        buf.clear();
                        parts.iter().for_each(|p| buf.extend_from_slice(p));
                        reply(&buf)
                    }),
                },
            )?);
        }
        BUF.with(|cell| {
            let mut buf = cell.borrow_mut();
            buf.resize(len, 0);
            let got = if len == 0 {
                0
            } else {
                e.file.read_at(&*self.archive, offset, &mut buf[..len])?
            };
            Ok(reply(&buf[..got]))
        })
    }

    /// Time since the filesystem was built (the mount's uptime).
    pub fn uptime(&self) -> std::time::Duration {
        self.started.elapsed()
    }
}

/// Compress the tensor files' headers in memory (see `layout::VirtualFile::pack`) on a
/// thread of their own, so that the mount comes up without waiting for it.
fn pack_in_background(entries: &[Entry]) {
    let files: Vec<VirtualFile> = entries.iter().map(|e| e.file.clone()).collect();
    let pack = move || files.iter().for_each(VirtualFile::pack);
    let spawned = std::thread::Builder::new()
        .name("pack".into())
        .spawn(pack.clone());
    if spawned.is_err() {
        pack();
    }
}

/// Cache file ids are inode numbers (stable, small).
pub fn file_id(ino: u64) -> u32 {
    ino as u32
}

/// What background loads (prefetch, read-ahead) of one file need.
struct Loader {
    archive: Arc<dyn Store>,
    file: VirtualFile,
    chunk_size: u64,
    tier: Option<(Arc<FsTier>, Arc<tier::Entry>)>,
}

impl Loader {
    fn load(&self, idx: u64, buf: &mut [u8]) -> Result<usize, ReadError> {
        let tier = self.tier.as_ref().map(|(t, e)| (&**t, e));
        load_chunk(&*self.archive, &self.file, self.chunk_size, tier, idx, buf)
    }
}

/// Chunk `idx` of `vf`: from the disk tier when it holds it intact, else reconstructed
/// (the cache then hands the chunk to the tier's writer: `FsTier::keep`).
fn load_chunk(
    archive: &dyn Store,
    vf: &VirtualFile,
    chunk_size: u64,
    tier: Option<(&FsTier, &Arc<tier::Entry>)>,
    idx: u64,
    buf: &mut [u8],
) -> Result<usize, ReadError> {
    if let Some((t, entry)) = tier {
        if entry.has(idx) {
            match entry.read(idx, buf) {
                Ok(true) => {
                    t.hit_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
                    return Ok(buf.len());
                }
                Ok(false) => {
                    t.bad_extents.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => tracing::warn!("{e}; reconstructing instead"),
            }
        }
    }
    vf.read_at(archive, idx * chunk_size, buf)
}
