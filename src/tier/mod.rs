//! The disk tier: reconstructed bytes of virtual files kept on local disk, checked on
//! every read, published only after they are synced (docs/TIER.md). It knows extents of
//! files named by a key, not archives, caches or FUSE: `fs` decides what goes in.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::localfs::{self, Access, LocalError};

mod dir;
mod seal;
mod stamp;
mod writer;
pub use dir::{clear, gc, list, Collected, EntryInfo};
pub use seal::SealWatch;
pub use stamp::SETTLED;
pub use writer::{ExtentBytes, Writer, WriterStats};

pub const MAGIC: &[u8; 8] = b"CAWSTIER";
pub const VERSION: u32 = 1;
const FLAG_WHOLE: u32 = 1;
const HEADER: usize = 56;
/// Indexes larger than this are not read (a corrupt count must not allocate wildly).
const MAX_EXTENTS: u64 = 1 << 24;
/// What the size bound charges beyond the bytes themselves, because file systems
/// allocate whole blocks and map a sparse file's extents with blocks of their own
/// (ext4 and XFS map 250 to 340 extents per 4 KiB block): every extent is charged
/// rounded up to a block plus 64 bytes of map, every entry two blocks.
const BLOCK: u64 = 4096;
pub const ENTRY_OVERHEAD: u64 = 2 * BLOCK;
/// Address, length and offset alignment of extents written with `O_DIRECT`.
pub const DIRECT_ALIGN: usize = 4096;

/// Disk bytes the size bound charges for writing an extent of `len` bytes.
pub fn disk_charge(len: u64) -> u64 {
    len.next_multiple_of(BLOCK) + 64
}

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("tier entry {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file of the entry, as found on disk (not a regular file, too large, ...).
    #[error("tier entry {0}")]
    Local(#[from] LocalError),
    /// The tier directory itself cannot be used.
    #[error("disk tier directory {0}")]
    Dir(LocalError),
    #[error("tier entry {path}: extent {extent} is outside the file ({n} extents)")]
    NoExtent { path: PathBuf, extent: u64, n: u64 },
    #[error("tier entry {path}: extent {extent} has {got} bytes, expected {want}")]
    ExtentLen {
        path: PathBuf,
        extent: u64,
        got: usize,
        want: usize,
    },
    #[error("tier entry {path}: sealed while another mount hands it to the kernel; not written")]
    Sealed { path: PathBuf },
}

impl TierError {
    /// The file system is full (or the user's quota spent): worth trying again later.
    pub fn is_no_space(&self) -> bool {
        let errno = match self {
            TierError::Io { source, .. } => source.raw_os_error(),
            TierError::Local(LocalError::Io { source, .. }) => source.raw_os_error(),
            _ => None,
        };
        matches!(errno, Some(libc::ENOSPC | libc::EDQUOT))
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TierError + '_ {
    move |source| TierError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What one entry holds the bytes of; its key names the entry's files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntrySpec {
    /// The archive's identity, from its own checksums (docs/TIER.md).
    pub archive: u128,
    pub file: String,
    pub size: u64,
    pub extent: u64,
    /// The view options that change the file's bytes, as text.
    pub view: String,
    /// [`crate::layout::VirtualFile::fingerprint`]: what the file is made of and the
    /// version of the code that makes its bytes, so that another build, which would
    /// serve other bytes for the same archive and options, never meets this entry.
    pub layout: u64,
}

impl EntrySpec {
    pub fn key(&self) -> u128 {
        let text = format!(
            "cawsfs-tier {VERSION}\narchive {:032x}\nfile {}\nsize {}\nextent {}\nview {}\nlayout {:016x}\n",
            self.archive, self.file, self.size, self.extent, self.view, self.layout
        );
        xxh3_128(text.as_bytes())
    }

    pub fn n_extents(&self) -> u64 {
        self.size.div_ceil(self.extent)
    }
}

/// The checksum stored for an extent's bytes (0 means absent).
fn extent_sum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes).max(1)
}

struct Sums {
    /// Published: served when their bytes still match.
    listed: Vec<u64>,
    /// Written, not yet synced and published.
    pending: Vec<(u64, u64)>,
    /// A listed extent was dropped since the last publish.
    dropped: bool,
    /// Extents whose checksum this process took of the bytes it wrote, or that
    /// matched when it read them: what it can vouch for without reading them again.
    vouched: Vec<bool>,
    /// The stamp ([`Entry::stamp`]) taken when a publish left the entry whole and every
    /// extent vouched for: while the files are still exactly so, a full verification
    /// would only read back what this process wrote.
    vouched_stamp: Option<String>,
}

/// One virtual file's entry, open for reading and writing.
pub struct Entry {
    spec: EntrySpec,
    key: u128,
    data_path: PathBuf,
    idx_path: PathBuf,
    /// Locked shared for the entry's life: `gc` and `clear` in any process skip it.
    data: Flock<File>,
    /// False when the data file was opened read-only: another mount has it sealed
    /// (handed to the kernel, [`Entry::seal`]), so it is whole and nothing is written.
    writable: bool,
    /// The data file again, opened `O_DIRECT`: aligned extents are written with it so
    /// that the tier's writes neither copy into nor churn the page cache (buffered,
    /// they cost the daemon a fifth of its CPU on a first pass of the 1 B bench model;
    /// docs/TIER.md, "Writing"). `None` where the file system refuses.
    direct: Option<File>,
    /// Cleared when a direct write was refused (EINVAL): buffered from then on.
    direct_works: AtomicBool,
    /// Set once a read of the data file failed: later failures are not logged.
    read_failed: AtomicBool,
    /// The data file as this process sealed it ([`Entry::seal`]).
    sealed: Mutex<Option<FileSig>>,
    sums: Mutex<Sums>,
}

/// What identifies a file's contents short of reading them: any write, truncation,
/// flag or mode change moves its change time, which only the kernel sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileSig {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileSig {
    fn of(f: &File) -> std::io::Result<FileSig> {
        let m = f.metadata()?;
        Ok(FileSig {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// What opening an entry found.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    New,
    /// An index was read; this many extents are listed.
    Existing(u64),
    /// An index was there but unusable, or a file of the entry was not a regular file;
    /// it was removed and the entry starts empty (the reason).
    Dropped(String),
}

impl Entry {
    /// Open (or create) the entry for `spec` in `dir` (checked by [`open_dir`]). A name
    /// of the entry that is not a regular file (a FIFO, a device, a directory, a
    /// symbolic link) is removed, never followed, and the entry starts again.
    pub fn open(dir: &Path, spec: EntrySpec) -> Result<(Entry, Found), TierError> {
        assert!(spec.extent > 0, "extent size 0");
        let key = spec.key();
        let data_path = dir.join(format!("{key:032x}.data"));
        let idx_path = dir.join(format!("{key:032x}.idx"));
        let n = spec.n_extents();
        // Locked before the index is read: a remover holds its lock while it unlinks.
        let (data, writable, misplaced) = open_locked(&data_path)?;
        let mut found = Found::New;
        let mut listed = vec![0u64; n as usize];
        let idx_max = HEADER as u64 + 8 * n + 8;
        match localfs::read_bounded(&idx_path, idx_max) {
            Err(e) if e.is_not_found() => {}
            Ok(bytes) if misplaced.is_none() => match parse_index(&bytes, key, &spec) {
                // The whole flag is checked against the sums; they alone decide.
                Ok((sums, _whole)) => {
                    found = Found::Existing(sums.iter().filter(|&&s| s != 0).count() as u64);
                    listed = sums;
                }
                Err(why) => found = Found::Dropped(why),
            },
            Ok(_) => {}
            Err(e) if e.is_misplaced() => found = Found::Dropped(e.to_string()),
            Err(e) => return Err(e.into()),
        }
        if let Some(why) = misplaced {
            found = Found::Dropped(why);
        }
        if let Found::Dropped(_) = found {
            localfs::remove_name(&idx_path)?;
            if writable {
                // Emptied in place (the file is ours, locked): nothing old is kept.
                data.set_len(0).map_err(io(&data_path))?;
            }
        }
        let len = data.metadata().map_err(io(&data_path))?.len();
        if len != spec.size {
            if len > 0 && found != Found::New {
                // A data file of the wrong size cannot hold what the index lists.
                listed.iter_mut().for_each(|s| *s = 0);
                found = Found::Dropped(format!("data file has {len} bytes, not {}", spec.size));
            }
            if writable {
                data.set_len(spec.size).map_err(io(&data_path))?;
            }
        }
        let direct = writable.then(|| open_direct(&data)).flatten();
        Ok((
            Entry {
                spec,
                key,
                data_path,
                idx_path,
                direct_works: AtomicBool::new(direct.is_some()),
                direct,
                data,
                writable,
                read_failed: AtomicBool::new(false),
                sealed: Mutex::new(None),
                sums: Mutex::new(Sums {
                    vouched: vec![false; listed.len()],
                    listed,
                    pending: Vec::new(),
                    dropped: false,
                    vouched_stamp: None,
                }),
            },
            found,
        ))
    }

    pub fn spec(&self) -> &EntrySpec {
        &self.spec
    }

    pub fn key(&self) -> u128 {
        self.key
    }

    pub fn data_path(&self) -> &Path {
        &self.data_path
    }

    /// The open data file (for handing to the kernel, reopened read-only through
    /// /proc so that its name is not looked up again).
    pub fn data_file(&self) -> &File {
        &self.data
    }

    pub fn extent_len(&self, i: u64) -> Result<usize, TierError> {
        let n = self.spec.n_extents();
        if i >= n {
            return Err(TierError::NoExtent {
                path: self.data_path.clone(),
                extent: i,
                n,
            });
        }
        Ok((self.spec.extent).min(self.spec.size - i * self.spec.extent) as usize)
    }

    fn check_len(&self, i: u64, got: usize) -> Result<(), TierError> {
        let want = self.extent_len(i)?;
        if got != want {
            return Err(TierError::ExtentLen {
                path: self.data_path.clone(),
                extent: i,
                got,
                want,
            });
        }
        Ok(())
    }

    /// Whether extent `i` is listed (published).
    pub fn has(&self, i: u64) -> bool {
        let s = self.sums.lock().unwrap();
        s.listed.get(i as usize).is_some_and(|&x| x != 0)
    }

    /// Every extent listed.
    pub fn is_whole(&self) -> bool {
        self.sums.lock().unwrap().listed.iter().all(|&s| s != 0)
    }

    /// Bytes of the listed extents.
    pub fn present_bytes(&self) -> u64 {
        let s = self.sums.lock().unwrap();
        (0..s.listed.len() as u64)
            .filter(|&i| s.listed[i as usize] != 0)
            .map(|i| self.extent_len(i).unwrap_or(0) as u64)
            .sum()
    }

    /// Fill `buf` with extent `i` if it is listed and its bytes match their checksum:
    /// `Ok(true)`. `Ok(false)`: absent, or found changed and dropped from the listing
    /// (the caller reconstructs; `publish` writes the drop down).
    pub fn read(&self, i: u64, buf: &mut [u8]) -> Result<bool, TierError> {
        self.check_len(i, buf.len())?;
        let want = {
            let s = self.sums.lock().unwrap();
            s.listed[i as usize]
        };
        if want == 0 {
            return Ok(false);
        }
        let why = match self.data.read_exact_at(buf, i * self.spec.extent) {
            Ok(()) if extent_sum(buf) == want => {
                self.sums.lock().unwrap().vouched[i as usize] = true;
                return Ok(true);
            }
            Ok(()) => "does not match its checksum".to_string(),
            // Cut short or unreadable: dropped like a changed extent.
            Err(e) => format!("cannot be read ({e})"),
        };
        // One line per entry: a file truncated or overwritten whole would otherwise
        // log every extent (`stat` counts them all).
        if !self.read_failed.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "tier entry {}: extent {i} {why}; dropped, reconstructed instead \
                 (further bad extents of this entry are only counted)",
                self.data_path.display()
            );
        }
        let mut s = self.sums.lock().unwrap();
        s.listed[i as usize] = 0;
        s.vouched[i as usize] = false;
        s.pending.retain(|&(e, _)| e != i);
        s.dropped = true;
        Ok(false)
    }

    /// Write extent `i`; it is listed by the next [`Entry::publish`].
    pub fn write(&self, i: u64, bytes: &[u8]) -> Result<(), TierError> {
        self.write_run(i, &[bytes])
    }

    /// Write extents `first`, `first + 1`, ... from `bufs` (one each); they are listed
    /// by the next [`Entry::publish`]. When every buffer is [`DIRECT_ALIGN`]ed in
    /// address and length, the run goes past the page cache in one `pwritev`.
    pub fn write_run(&self, first: u64, bufs: &[&[u8]]) -> Result<(), TierError> {
        let sums: Vec<u64> = bufs.iter().map(|b| extent_sum(b)).collect();
        self.write_run_summed(first, bufs, &sums)
    }

    /// [`Entry::write_run`] of extents whose checksums (`extent_sum`) the caller took.
    fn write_run_summed(&self, first: u64, bufs: &[&[u8]], sums: &[u64]) -> Result<(), TierError> {
        debug_assert_eq!(bufs.len(), sums.len());
        if !self.writable {
            return Err(TierError::Sealed {
                path: self.data_path.clone(),
            });
        }
        for (i, b) in (first..).zip(bufs) {
            self.check_len(i, b.len())?;
        }
        let off = first * self.spec.extent;
        if !self.write_direct(off, bufs)? {
            let mut at = off;
            for b in bufs {
                self.data.write_all_at(b, at).map_err(io(&self.data_path))?;
                at += b.len() as u64;
            }
            start_writeback(&self.data, off, at - off);
        }
        let mut s = self.sums.lock().unwrap();
        s.pending.extend((first..).zip(sums.iter().copied()));
        for i in first..first + bufs.len() as u64 {
            s.vouched[i as usize] = true;
        }
        Ok(())
    }

    /// Write `bufs` back to back at `off` with `O_DIRECT` when all are aligned and the
    /// file system takes it: `Ok(false)` when the caller must write them buffered.
    fn write_direct(&self, off: u64, bufs: &[&[u8]]) -> Result<bool, TierError> {
        let aligned = off % DIRECT_ALIGN as u64 == 0
            && bufs
                .iter()
                .all(|b| (b.as_ptr() as usize | b.len()) % DIRECT_ALIGN == 0);
        let Some(d) = self.direct.as_ref() else {
            return Ok(false);
        };
        if !aligned || !self.direct_works.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let iov: Vec<std::io::IoSlice> = bufs.iter().map(|b| std::io::IoSlice::new(b)).collect();
        match nix::sys::uio::pwritev(d, &iov, off as libc::off_t) {
            Ok(n) if n == total => Ok(true),
            // A short write (rare: a full disk, a signal) is finished buffered.
            Ok(mut done) => {
                let mut at = off;
                for b in bufs {
                    let skip = done.min(b.len());
                    done -= skip;
                    self.data
                        .write_all_at(&b[skip..], at + skip as u64)
                        .map_err(io(&self.data_path))?;
                    at += b.len() as u64;
                }
                Ok(true)
            }
            Err(Errno::EINVAL) => {
                self.direct_works.store(false, Ordering::Relaxed);
                tracing::debug!(
                    "tier entry {}: O_DIRECT write refused; writing through the page cache",
                    self.data_path.display()
                );
                Ok(false)
            }
            Err(e) => Err(io(&self.data_path)(std::io::Error::from(e))),
        }
    }

    /// Whether anything written or dropped is not yet in the index on disk.
    pub fn is_dirty(&self) -> bool {
        let s = self.sums.lock().unwrap();
        !s.pending.is_empty() || s.dropped
    }

    /// Sync the data written so far, then atomically replace the index listing it.
    pub fn publish(&self) -> Result<(), TierError> {
        // Only extents written before the sync are listed; later ones wait their turn.
        let synced = std::mem::take(&mut self.sums.lock().unwrap().pending);
        if let Err(e) = self.data.sync_data() {
            self.sums.lock().unwrap().pending.extend(synced);
            return Err(io(&self.data_path)(e));
        }
        let (bytes, whole, vouched) = {
            let mut s = self.sums.lock().unwrap();
            for (i, sum) in synced {
                s.listed[i as usize] = sum;
            }
            let whole = s.listed.iter().all(|&x| x != 0);
            s.dropped = false;
            let vouched = whole && s.vouched.iter().all(|&v| v);
            (
                encode_index(self.key, &self.spec, &s.listed, whole),
                whole,
                vouched,
            )
        };
        if let Err(e) = localfs::replace(&self.idx_path, &bytes, true) {
            // Written down by the next publish (when space returns, say).
            self.sums.lock().unwrap().dropped = true;
            return Err(e.into());
        }
        let stamp = if vouched { self.stamp() } else { None };
        self.sums.lock().unwrap().vouched_stamp = stamp;
        tracing::debug!(
            "tier entry {}: index published (whole: {whole})",
            self.idx_path.display()
        );
        Ok(())
    }

    /// Hash every listed extent; drop (and return) those that no longer match.
    pub fn verify_all(&self) -> Result<Vec<u64>, TierError> {
        let n = self.spec.n_extents();
        let mut buf = vec![0u8; self.spec.extent as usize];
        let mut bad = Vec::new();
        for i in 0..n {
            let len = self.extent_len(i)?;
            if self.has(i) && !self.read(i, &mut buf[..len])? {
                bad.push(i);
            }
        }
        Ok(bad)
    }
}

/// Open (creating) a data file and lock it shared, retrying when a remover unlinked
/// it between our open and our lock (the name then points elsewhere, or nowhere).
/// Returns the file, whether it is writable (not while another mount has it sealed,
/// [`Entry::seal`]), and why a name that was not a regular file was removed.
fn open_locked(path: &Path) -> Result<(Flock<File>, bool, Option<String>), TierError> {
    let mut misplaced = None;
    for _ in 0..16 {
        let (f, writable) = match localfs::open_regular(path, Access::ReadWriteCreate) {
            Ok(f) => (f, true),
            Err(e) if e.is_misplaced() && misplaced.is_none() => {
                localfs::remove_name(path)?;
                misplaced = Some(e.to_string());
                continue;
            }
            Err(e) if e.is_permission() => {
                // Sealed: by a mount that has it now, or one that died with it sealed.
                let f = localfs::open_regular(path, Access::Read)?;
                match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
                    // No mount has it: the seal is stale; lifted, then opened again.
                    Ok(l) => match localfs::set_immutable(&l, false) {
                        Ok(true) => continue,
                        Ok(false) => (l.unlock().map_err(|(_, e)| io(path)(e.into()))?, false),
                        Err(e) => return Err(io(path)(e)),
                    },
                    Err((f, Errno::EWOULDBLOCK)) => (f, false),
                    Err((_, e)) => return Err(io(path)(e.into())),
                }
            }
            Err(e) => return Err(e.into()),
        };
        let f = Flock::lock(f, FlockArg::LockShared)
            .map_err(|(_, e)| io(path)(std::io::Error::from(e)))?;
        let ours = f.metadata().map_err(io(path))?;
        match std::fs::symlink_metadata(path) {
            Ok(now) if now.ino() == ours.ino() && now.dev() == ours.dev() => {
                return Ok((f, writable, misplaced))
            }
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(io(path)(e)),
        }
    }
    Err(io(path)(std::io::Error::other(
        "removed again and again while being opened",
    )))
}

/// Make the tier directory if absent (mode 0700) and check that it is one this user
/// alone can write (docs/TIER.md, "Where"); clear the temporary files that processes
/// which died mid-publish left.
pub fn open_dir(dir: &Path) -> Result<(), TierError> {
    localfs::private_dir(dir).map_err(TierError::Dir)?;
    localfs::sweep_stale_tmp(dir);
    Ok(())
}

/// `file` opened again for writing with `O_DIRECT` (through /proc, so it is surely the
/// same inode); `None` where that is not possible.
fn open_direct(file: &File) -> Option<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .ok()
}

fn encode_index(key: u128, spec: &EntrySpec, sums: &[u64], whole: bool) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER + 8 * sums.len() + 8);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&(if whole { FLAG_WHOLE } else { 0 }).to_le_bytes());
    b.extend_from_slice(&key.to_le_bytes());
    b.extend_from_slice(&spec.size.to_le_bytes());
    b.extend_from_slice(&spec.extent.to_le_bytes());
    b.extend_from_slice(&(sums.len() as u64).to_le_bytes());
    for s in sums {
        b.extend_from_slice(&s.to_le_bytes());
    }
    let check = xxh3_64(&b);
    b.extend_from_slice(&check.to_le_bytes());
    b
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// The listed sums and the whole flag, or why the index cannot be used.
fn parse_index(b: &[u8], key: u128, spec: &EntrySpec) -> Result<(Vec<u64>, bool), String> {
    if b.len() < HEADER + 8 || &b[..8] != MAGIC {
        return Err("not a tier index (bad magic or too short)".into());
    }
    let version = u32::from_le_bytes(b[8..12].try_into().unwrap());
    if version != VERSION {
        return Err(format!("index version {version}, expected {VERSION}"));
    }
    let n = u64_at(b, 48);
    if n > MAX_EXTENTS || b.len() as u64 != HEADER as u64 + 8 * n + 8 {
        return Err(format!("index of {} bytes for {n} extents", b.len()));
    }
    let body = b.len() - 8;
    if xxh3_64(&b[..body]) != u64_at(b, body) {
        return Err("index checksum mismatch".into());
    }
    let got_key = u128::from_le_bytes(b[16..32].try_into().unwrap());
    if got_key != key
        || u64_at(b, 32) != spec.size
        || u64_at(b, 40) != spec.extent
        || n != spec.n_extents()
    {
        return Err("index belongs to another file (key, size or extent size differ)".into());
    }
    let flags = u32::from_le_bytes(b[12..16].try_into().unwrap());
    let sums: Vec<u64> = (0..n as usize).map(|i| u64_at(b, HEADER + 8 * i)).collect();
    let whole = flags & FLAG_WHOLE != 0;
    if whole && sums.contains(&0) {
        return Err("index says whole but lists absent extents".into());
    }
    Ok((sums, whole))
}

/// What an entry holds, for people (`cawsfs tier ls`): `KEY.json`, written when the
/// entry is made. Never used to serve: the key alone decides what an entry is.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Label {
    pub file: String,
    pub view: String,
    /// The archive's path when the entry was made.
    pub archive: String,
}

/// Write `entry`'s label (best effort: a label is only a help).
pub fn write_label(entry: &Entry, label: &Label) {
    let path = entry.idx_path.with_extension("json");
    if let Ok(text) = serde_json::to_vec(label) {
        let _ = localfs::replace(&path, &text, false);
    }
}

/// Start writing `len` bytes at `off` of `file` back to disk without waiting, so that
/// the next publish's `fdatasync` finds little left to write: a sync of hundreds of
/// megabytes stalled the writer long enough for its queue to fill and drop copies.
fn start_writeback(file: &File, off: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: sync_file_range only reads its integer arguments; the descriptor is open
    // for as long as `file` is borrowed. Failure only means the sync does the work.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            off as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

#[cfg(test)]
mod tests;
