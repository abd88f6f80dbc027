//! The fetch cache: parts of objects kept on local disk, so that a part is fetched from
//! object storage once per machine, whatever reads it again (a part evicted from
//! memory, another view, a restarted daemon, a second mount of the same object).
//! Format and rules: docs/REMOTE.md, "Fetch cache".
//!
//! One object is two files named by a hash of its URL and pin (so a changed object is a
//! new entry): `KEY.data`, sparse, the object's bytes at their offsets, and `KEY.parts`,
//! a header then one 16-byte record (part index, XXH3-64 of its bytes) appended after
//! the part's bytes were written. A part is served from disk only when its record is
//! there and its bytes hash to it; anything else is fetched again (a crash between the
//! two writes, a torn record, a flipped byte). Records are appended with `O_APPEND`,
//! bytes written with `pwrite` of the same content, so mounts sharing an entry do not
//! need to coordinate.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::localfs::{self, Access, LocalError};

const MAGIC: &[u8; 8] = b"CAWSFC01";
const HEADER: usize = 24;
const RECORD: usize = 16;

/// Where the fetch cache is and how large it may grow (set once by the CLI).
#[derive(Clone, Debug)]
pub struct FetchCacheOptions {
    pub dir: PathBuf,
    pub max_bytes: u64,
}

static OPTIONS: OnceLock<Option<FetchCacheOptions>> = OnceLock::new();

/// Set the fetch cache for this process (None: no cache). The first call wins; archives
/// opened before any call get none.
pub fn configure(opts: Option<FetchCacheOptions>) {
    let _ = OPTIONS.set(opts);
}

fn options() -> Option<&'static FetchCacheOptions> {
    OPTIONS.get().and_then(|o| o.as_ref())
}

/// What the entries of one archive's objects share: the counters `stat` shows and the
/// room left under the bound. The first entry opened applies the bound (evicting the
/// least recently used entries) and sizes the room; the archive's other objects (the
/// files of an npy-dir) draw on it without scanning the directory again.
#[derive(Default)]
pub struct DiskGroup {
    pub hit_bytes: AtomicU64,
    pub written_bytes: AtomicU64,
    pub bad_parts: AtomicU64,
    room: AtomicU64,
    sized: Mutex<bool>,
    full_reported: AtomicBool,
}

/// One object's entry in the fetch cache.
pub struct DiskParts {
    data: File,
    records: Mutex<File>,
    data_path: PathBuf,
    /// Part index → XXH3-64 of its bytes, for the parts whose records were read.
    present: Mutex<HashMap<u64, u64>>,
    /// How much of `KEY.parts` has been read into `present`: records appended since
    /// (by this process or another mount of the object) are read when a part is missed.
    read_to: Mutex<u64>,
    bad_reported: AtomicBool,
    group: Arc<DiskGroup>,
}

impl DiskParts {
    /// The entry of the object `identity` names (its URL and pin) of `len` bytes, made
    /// if new; None without a fetch cache, or when the directory cannot be used (logged
    /// once: the mount works without it).
    pub fn open(identity: &str, len: u64, group: &Arc<DiskGroup>) -> Option<DiskParts> {
        let opts = options()?;
        match Self::open_in(&opts.dir, opts.max_bytes, identity, len, group) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(
                    "fetch cache {}: {e}; fetching without it",
                    opts.dir.display()
                );
                None
            }
        }
    }

    fn open_in(
        dir: &Path,
        max_bytes: u64,
        identity: &str,
        len: u64,
        group: &Arc<DiskGroup>,
    ) -> std::io::Result<Self> {
        localfs::private_dir(dir).map_err(std::io::Error::other)?;
        let key = format!("{:032x}", xxh3_128(identity.as_bytes()));
        let data_path = dir.join(format!("{key}.data"));
        let parts_path = dir.join(format!("{key}.parts"));
        let (data, data_replaced) = open_entry_file(&data_path, Access::ReadWriteCreate)?;
        if data.metadata()?.len() != len {
            data.set_len(len)?;
        }
        let (mut records, _) = open_entry_file(&parts_path, Access::AppendCreate)?;
        // Records of every part twice over (two mounts may append the same one), and
        // never less than 1 MiB: more is not a record list, and is started over.
        let max = (HEADER as u64 + RECORD as u64 * 2 * len.div_ceil(4096)).max(1 << 20);
        let text = match localfs::read_file_bounded(&parts_path, &records, max) {
            // Records of a data file that was not there describe nothing.
            Ok(_) if data_replaced => Vec::new(),
            Ok(t) => t,
            Err(LocalError::TooLarge { .. }) => Vec::new(),
            Err(e) => return Err(std::io::Error::other(e)),
        };
        let mut present = HashMap::new();
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(MAGIC);
        header[8..16].copy_from_slice(&len.to_le_bytes());
        header[16..24].copy_from_slice(&xxh3_64(identity.as_bytes()).to_le_bytes());
        if text.len() < HEADER || text[..HEADER] != header {
            // New, or not this object's: start the records over.
            records.set_len(0)?;
            data.set_len(0)?;
            data.set_len(len)?;
            records.write_all(&header)?;
        } else {
            // A torn last record (a crash mid-append) is ignored, and later ones too.
            for r in text[HEADER..].chunks_exact(RECORD) {
                let part = u64::from_le_bytes(r[..8].try_into().unwrap());
                let hash = u64::from_le_bytes(r[8..].try_into().unwrap());
                present.insert(part, hash);
            }
            let torn = (text.len() - HEADER) % RECORD;
            if torn != 0 {
                records.set_len((text.len() - torn) as u64)?;
            }
        }
        let read_to = records.metadata()?.len();
        // Keep the directory within its bound: the least recently opened entries go.
        let mut sized = group.sized.lock().unwrap();
        if !*sized {
            let used = evict_to(dir, max_bytes, &key)?;
            let mine = data.metadata()?.blocks() * 512;
            let room = max_bytes.saturating_sub(used.saturating_add(mine));
            group.room.store(room, Ordering::Relaxed);
            *sized = true;
        }
        drop(sized);
        // Opening counts as use for the eviction order.
        let _ = records.set_modified(std::time::SystemTime::now());
        Ok(DiskParts {
            data,
            records: Mutex::new(records),
            data_path,
            present: Mutex::new(present),
            read_to: Mutex::new(read_to),
            bad_reported: AtomicBool::new(false),
            group: group.clone(),
        })
    }

    /// Whether the part is recorded as present (its bytes are checked when read).
    pub fn has(&self, part: u64) -> bool {
        if self.present.lock().unwrap().contains_key(&part) {
            return true;
        }
        self.read_new_records();
        self.present.lock().unwrap().contains_key(&part)
    }

    /// Read the records appended since the last look (another mount sharing the entry
    /// keeps parts this one can use). Costs an `fstat` when there are none.
    fn read_new_records(&self) {
        let mut at = self.read_to.lock().unwrap();
        let records = self.records.lock().unwrap();
        let Ok(len) = records.metadata().map(|m| m.len()) else {
            return;
        };
        let whole = (len.saturating_sub(*at) / RECORD as u64) * RECORD as u64;
        if whole == 0 {
            return;
        }
        let mut buf = vec![0u8; whole as usize];
        if records.read_exact_at(&mut buf, *at).is_err() {
            return;
        }
        drop(records);
        let mut present = self.present.lock().unwrap();
        for r in buf.chunks_exact(RECORD) {
            let part = u64::from_le_bytes(r[..8].try_into().unwrap());
            let hash = u64::from_le_bytes(r[8..].try_into().unwrap());
            present.insert(part, hash);
        }
        *at += whole;
    }

    /// Forget a part (its bytes are not to be served again).
    pub fn forget(&self, part: u64) {
        self.present.lock().unwrap().remove(&part);
    }

    /// The part's `len` bytes at `offset`, if present and intact.
    pub fn read(&self, part: u64, offset: u64, len: usize) -> Option<Vec<u8>> {
        let want = *self.present.lock().unwrap().get(&part)?;
        let mut buf = vec![0u8; len];
        let ok = self.data.read_exact_at(&mut buf, offset).is_ok() && xxh3_64(&buf) == want;
        if !ok {
            self.present.lock().unwrap().remove(&part);
            self.group.bad_parts.fetch_add(1, Ordering::Relaxed);
            if !self.bad_reported.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "fetch cache {}: part {part} failed its checksum; fetched again",
                    self.data_path.display()
                );
            }
            return None;
        }
        self.group
            .hit_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        Some(buf)
    }

    /// Keep a fetched part: its bytes, then its record. Skipped once the bound is
    /// reached (logged once); a failed write only costs a later fetch.
    pub fn write(&self, part: u64, offset: u64, bytes: &[u8]) {
        if self.present.lock().unwrap().contains_key(&part) {
            return;
        }
        let n = bytes.len() as u64;
        let g = &self.group;
        if g.room
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(n))
            .is_err()
        {
            if !g.full_reported.swap(true, Ordering::Relaxed) {
                tracing::info!(
                    "fetch cache {}: at its size bound; further parts are not kept",
                    self.data_path.display()
                );
            }
            return;
        }
        let hash = xxh3_64(bytes);
        let mut rec = [0u8; RECORD];
        rec[..8].copy_from_slice(&part.to_le_bytes());
        rec[8..].copy_from_slice(&hash.to_le_bytes());
        let written = self.data.write_all_at(bytes, offset).and_then(|_| {
            let mut r = self.records.lock().unwrap();
            r.write_all(&rec)
        });
        if written.is_ok() {
            self.present.lock().unwrap().insert(part, hash);
            g.written_bytes.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// Open a file of an entry (docs/REMOTE.md, "Fetch cache"): never through a link, never
/// blocking; a name that holds something other than a regular file is removed (not
/// followed) and the file made afresh (then `true`).
fn open_entry_file(path: &Path, access: Access) -> std::io::Result<(File, bool)> {
    match localfs::open_regular(path, access) {
        Err(e) if e.is_misplaced() => {
            tracing::warn!("fetch cache {e}; removed, the entry starts again");
            localfs::remove_name(path).map_err(std::io::Error::other)?;
            let f = localfs::open_regular(path, access).map_err(std::io::Error::other)?;
            Ok((f, true))
        }
        r => r.map(|f| (f, false)).map_err(std::io::Error::other),
    }
}

/// Delete the least recently opened entries (by their `.parts` mtime) other than
/// `keep` until the directory's allocated bytes are within `max_bytes`; returns the
/// bytes the other entries still use.
fn evict_to(dir: &Path, max_bytes: u64, keep: &str) -> std::io::Result<u64> {
    let mut entries: Vec<(std::time::SystemTime, String, u64)> = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(key) = name.strip_suffix(".parts") else {
            continue;
        };
        if key == keep {
            continue;
        }
        let m = e.metadata()?;
        let data = std::fs::symlink_metadata(dir.join(format!("{key}.data")))
            .map(|d| d.blocks() * 512)
            .unwrap_or(0);
        entries.push((m.modified()?, key.to_string(), data + m.len()));
    }
    entries.sort();
    let mut used: u64 = entries.iter().map(|e| e.2).sum();
    for (_, key, bytes) in &entries {
        if used <= max_bytes / 2 {
            break;
        }
        // Leave at least half the bound to the entry being opened.
        let _ = std::fs::remove_file(dir.join(format!("{key}.parts")));
        let _ = std::fs::remove_file(dir.join(format!("{key}.data")));
        used -= bytes;
    }
    Ok(used)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;

    fn open(dir: &Path, max: u64, id: &str, len: u64) -> DiskParts {
        DiskParts::open_in(dir, max, id, len, &Arc::default()).unwrap()
    }

    #[test]
    fn parts_survive_reopen_and_bad_bytes_are_not_served() {
        let tmp = tempfile::tempdir().unwrap();
        let d = open(tmp.path(), 1 << 30, "s3://b/k etag 1", 1000);
        assert!(!d.has(0));
        d.write(0, 0, &[7u8; 600]);
        d.write(1, 600, &[9u8; 400]);
        assert_eq!(d.read(1, 600, 400).unwrap(), vec![9u8; 400]);
        drop(d);
        let d = open(tmp.path(), 1 << 30, "s3://b/k etag 1", 1000);
        assert_eq!(d.read(0, 0, 600).unwrap(), vec![7u8; 600]);
        // A flipped byte: not served, forgotten (the caller fetches again).
        let data = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == "data"))
            .unwrap();
        let f = OpenOptions::new().write(true).open(&data).unwrap();
        f.write_all_at(&[8], 650).unwrap();
        assert!(d.read(1, 600, 400).is_none());
        assert!(!d.has(1));
        assert_eq!(d.group.bad_parts.load(Ordering::Relaxed), 1);
        // Another pin of the same URL is another entry; a torn record is ignored.
        let e = open(tmp.path(), 1 << 30, "s3://b/k etag 2", 1000);
        assert!(!e.has(0));
        drop(d);
        let parts = data.with_extension("parts");
        let mut r = OpenOptions::new().append(true).open(&parts).unwrap();
        r.write_all(&[1, 2, 3]).unwrap();
        let d = open(tmp.path(), 1 << 30, "s3://b/k etag 1", 1000);
        assert!(d.has(0));
        assert_eq!(
            std::fs::metadata(&parts).unwrap().len() as usize,
            HEADER + 2 * RECORD
        );
    }

    #[test]
    fn two_openers_share_what_each_keeps() {
        let tmp = tempfile::tempdir().unwrap();
        let a = open(tmp.path(), 1 << 30, "x", 1 << 20);
        let b = open(tmp.path(), 1 << 30, "x", 1 << 20);
        a.write(2, 2 * 1000, &[5u8; 1000]);
        assert!(b.has(2));
        assert_eq!(b.read(2, 2 * 1000, 1000).unwrap(), vec![5u8; 1000]);
        assert!(!b.has(3));
    }

    #[test]
    fn the_bound_holds() {
        let tmp = tempfile::tempdir().unwrap();
        let len = 64 << 20;
        let d = open(tmp.path(), 8 << 20, "a", len);
        for p in 0..64u64 {
            d.write(p, p << 20, &vec![1u8; 1 << 20]);
        }
        let written = d.group.written_bytes.load(Ordering::Relaxed);
        assert!(written <= 8 << 20 && written > 0, "{written}");
        drop(d);
        // A second object: the first one's entry is evicted to make room.
        let e = open(tmp.path(), 8 << 20, "b", len);
        e.write(0, 0, &vec![2u8; 1 << 20]);
        let total: u64 = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|x| x.unwrap().metadata().unwrap().blocks() * 512)
            .sum();
        assert!(total <= 8 << 20, "{total}");
    }
    /// What lies under an entry's names is input (issue 58): a FIFO, a link to a victim
    /// file or to /dev/zero, a directory: opening never blocks, writes nothing outside
    /// the directory, and the entry starts over; a directory others can write is refused.
    #[test]
    fn names_that_are_not_files_are_replaced_never_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("fetch");
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"not yours").unwrap();
        type Plant = fn(&Path, &Path);
        let plants: [(&str, Plant); 4] = [
            ("fifo", |p, _| {
                nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap()
            }),
            ("link", |p, v| std::os::unix::fs::symlink(v, p).unwrap()),
            ("zero", |p, _| {
                std::os::unix::fs::symlink("/dev/zero", p).unwrap()
            }),
            ("dir", |p, _| std::fs::create_dir(p).unwrap()),
        ];
        for ext in ["data", "parts"] {
            for (what, plant) in plants {
                {
                    let d = open(&dir, 1 << 30, "obj", 4096);
                    d.write(0, 0, &[3u8; 4096]);
                }
                let key = format!("{:032x}", xxh3_128(b"obj"));
                let p = dir.join(format!("{key}.{ext}"));
                std::fs::remove_file(&p).unwrap();
                plant(&p, &victim);
                let (tx, rx) = std::sync::mpsc::channel();
                let d2 = dir.clone();
                std::thread::spawn(move || {
                    let _ = tx.send(open(&d2, 1 << 30, "obj", 4096));
                });
                let d = rx
                    .recv_timeout(std::time::Duration::from_secs(10))
                    .unwrap_or_else(|_| panic!("{ext} {what}: open blocked"));
                assert!(!d.has(0), "{ext} {what}");
                d.write(0, 0, &[4u8; 4096]);
                assert_eq!(d.read(0, 0, 4096).unwrap(), vec![4u8; 4096], "{ext} {what}");
                assert_eq!(
                    std::fs::read(&victim).unwrap(),
                    b"not yours",
                    "{ext} {what}"
                );
                drop(d);
                std::fs::remove_dir_all(&dir).unwrap();
            }
        }
        localfs::private_dir(&dir).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = DiskParts::open_in(&dir, 1 << 30, "obj", 4096, &Arc::default())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("writable by others"), "{e}");
    }
}
