//! One file of an archive, read with `pread` rather than a shared mapping.
//!
//! A mapping of a file that another process truncates faults with SIGBUS, which kills
//! the daemon and leaves its mount dead; a rewrite in place (`cp new old`) would let a
//! mapping serve bytes of two archives. So every read copies the bytes out with `pread`,
//! then checks the file is still the one that was opened (size and mtime as `fstat`
//! reports them; not ctime, which a `chmod` or a rename over the file also moves). A short read or a changed file fails that read with
//! [`ReadError::Changed`] (EIO at the mount) and logs one line per file, never a wrong
//! byte. The copy costs little beside checksumming and decoding the block (docs/
//! RELIABILITY.md has the measurement). A file replaced by rename keeps being read
//! through the opened descriptor: the old archive, whole and consistent.
//!
//! A path that is a URL (`s3://`, `http(s)://`) opens the object instead
//! ([`super::remote`]): the same reads, by byte range, with the object pinned the same way.

use std::fs::{File, Metadata};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use super::remote::{self, RemoteObject};
use crate::archive::ArchiveError;
use crate::error::FileError;
use crate::model::ReadError;

/// How many times bytes of an object that fail their checksum are fetched again before
/// the read fails (a flaky link or proxy may damage more than one answer).
pub const REFETCHES: usize = 3;

/// Reads at open up to this many bytes are fetched by themselves from an object.
pub const ONCE: usize = 4096;

/// What identifies the contents of a file at open: a rewrite moves mtime, a truncation
/// the size. (A writer that puts mtime back is still caught by the block checksums.)
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Stamp {
    len: u64,
    mtime: (i64, i64),
}

impl Stamp {
    fn of(m: &Metadata) -> Stamp {
        Stamp {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
        }
    }
}

/// Where an archive file's bytes come from.
enum Source {
    Local { file: File, stamp: Stamp },
    Remote(RemoteObject),
}

/// An opened regular file (or object) of an archive.
pub struct ArchiveFile {
    source: Source,
    path: PathBuf,
    /// Set once the change has been logged, so a dead archive logs one line.
    reported: AtomicBool,
}

impl ArchiveFile {
    /// Opens `path`, which must be a regular file (a FIFO would block every read), or
    /// the object a URL names.
    pub fn open(path: &Path) -> Result<ArchiveFile, ArchiveError> {
        if remote::is_url(path) {
            return Ok(ArchiveFile::from_remote(RemoteObject::open(path)?));
        }
        let io = |e| FileError::io(path, e);
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(FileError::invalid(path, "not a regular file"));
        }
        Ok(ArchiveFile {
            source: Source::Local {
                file,
                stamp: Stamp::of(&meta),
            },
            path: path.to_path_buf(),
            reported: AtomicBool::new(false),
        })
    }

    /// An object already opened (a file of an npy-dir in object storage).
    pub fn from_remote(obj: RemoteObject) -> ArchiveFile {
        ArchiveFile {
            path: PathBuf::from(obj.display()),
            source: Source::Remote(obj),
            reported: AtomicBool::new(false),
        }
    }

    /// The file's length when it was opened.
    pub fn len(&self) -> u64 {
        match &self.source {
            Source::Local { stamp, .. } => stamp.len,
            Source::Remote(o) => o.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The object, when the archive is in object storage (for its fetch counters).
    pub fn remote(&self) -> Option<&RemoteObject> {
        match &self.source {
            Source::Remote(o) => Some(o),
            Source::Local { .. } => None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `len` bytes at `offset`, read now and checked to come from the file as opened.
    pub fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>, ReadError> {
        let mut buf = vec![0u8; len];
        self.read_into(offset, &mut buf)?;
        Ok(buf)
    }

    /// [`ArchiveFile::read_at`] into a caller's buffer.
    pub fn read_into(&self, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        self.read_raw(offset, buf).map_err(|f| match f {
            Fault::Changed(msg) => ReadError::Changed(format!("{}: {msg}", self.path.display())),
            Fault::Io(e) => ReadError::Io(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", self.path.display()),
            )),
        })
    }

    /// [`ArchiveFile::read_at`] of bytes whose checksum the caller knows: from an object,
    /// bytes that fail `good` are dropped from the fetch caches and fetched again, up to
    /// [`REFETCHES`] times (they were damaged on the way or on the local disk, not in
    /// the object). The caller checks what comes back as it checks any read.
    pub fn read_verified(
        &self,
        offset: u64,
        len: usize,
        good: impl Fn(&[u8]) -> bool,
    ) -> Result<Vec<u8>, ReadError> {
        let mut bytes = self.read_at(offset, len)?;
        if let Source::Remote(o) = &self.source {
            for _ in 0..REFETCHES {
                if good(&bytes) {
                    break;
                }
                o.forget(offset, len as u64);
                bytes = self.read_at(offset, len)?;
            }
        }
        Ok(bytes)
    }

    /// [`ArchiveFile::read_at`] while opening: failures are the archive's open error.
    /// From an object, a read of at most [`ONCE`] bytes is fetched by itself and kept
    /// nowhere (a header read once), unless its part is at hand.
    pub fn read_head(&self, offset: u64, len: usize) -> Result<Vec<u8>, ArchiveError> {
        let mut buf = vec![0u8; len];
        let read = match &self.source {
            Source::Remote(o) if len <= ONCE => o.read_once(offset, &mut buf).map_err(remote_fault),
            _ => self.read_raw(offset, &mut buf),
        };
        read.map_err(|f| match f {
            Fault::Changed(msg) => FileError::invalid(&self.path, msg),
            Fault::Io(e) => FileError::io(&self.path, e),
        })?;
        Ok(buf)
    }

    fn read_raw(&self, offset: u64, buf: &mut [u8]) -> Result<(), Fault> {
        let file = match &self.source {
            Source::Local { file, .. } => file,
            Source::Remote(o) => return o.read_into(offset, buf).map_err(remote_fault),
        };
        let read = file.read_exact_at(buf, offset);
        // Checked after the read: bytes read before an unchanged stamp are the opened
        // file's (any write since open would have moved mtime).
        self.check().map_err(Fault::Changed)?;
        read.map_err(|e| {
            let n = buf.len();
            Fault::Io(std::io::Error::new(
                e.kind(),
                format!("reading {n} bytes at {offset}: {e}"),
            ))
        })
    }

    /// Err(why, without the path) if the file is no longer what was opened (logged,
    /// with the path, the first time).
    /// (An object is checked by every request instead: see [`super::remote`].)
    pub fn check(&self) -> Result<(), String> {
        let Source::Local { file, stamp } = &self.source else {
            return Ok(());
        };
        let now = file.metadata().map(|m| Stamp::of(&m));
        let what = match now {
            Ok(s) if s == *stamp => return Ok(()),
            Ok(s) if s.len != stamp.len => {
                format!("its size went from {} to {} bytes", stamp.len, s.len)
            }
            Ok(_) => "it was modified in place".to_string(),
            Err(e) => format!("fstat failed: {e}"),
        };
        let msg = format!(
            "changed since it was opened ({what}); reads that need it fail until it is opened again"
        );
        if !self.reported.swap(true, Ordering::Relaxed) {
            tracing::error!("{}: {msg}", self.path.display());
        }
        Err(msg)
    }
}

enum Fault {
    Changed(String),
    Io(std::io::Error),
}

fn remote_fault(f: remote::Failure) -> Fault {
    match f {
        remote::Failure::Changed(m) => Fault::Changed(m),
        remote::Failure::Fetch(m) => Fault::Io(std::io::Error::other(m)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_and_rewrite_fail_reads_instead_of_serving() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("a");
        std::fs::write(&p, vec![7u8; 1 << 16]).unwrap();
        let f = ArchiveFile::open(&p).unwrap();
        assert_eq!(f.read_at(100, 4).unwrap(), [7; 4]);
        // Truncated under us: the read fails, naming the file and the sizes.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(1000)
            .unwrap();
        let e = f.read_at(100, 4).unwrap_err();
        assert!(matches!(e, ReadError::Changed(_)), "{e}");
        assert!(e.to_string().contains("from 65536 to 1000 bytes"), "{e}");
        // Rewritten in place at the same size (as `cp` over it does).
        std::fs::write(&p, vec![7u8; 1 << 16]).unwrap();
        let g = ArchiveFile::open(&p).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&p, vec![8u8; 1 << 16]).unwrap();
        let e = g.read_at(0, 4).unwrap_err();
        assert!(e.to_string().contains("modified in place"), "{e}");
        // Replaced by rename, or its mode changed: the opened file is still read, whole.
        std::fs::write(&p, vec![9u8; 1 << 16]).unwrap();
        let h = ArchiveFile::open(&p).unwrap();
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o600);
        std::fs::set_permissions(&p, mode).unwrap();
        let q = tmp.path().join("b");
        std::fs::write(&q, vec![1u8; 10]).unwrap();
        std::fs::rename(&q, &p).unwrap();
        assert_eq!(h.read_at(65532, 4).unwrap(), [9; 4]);
        // Reading past the end of an unchanged file is an I/O error, not a change.
        let e = h.read_at(65535, 4).unwrap_err();
        assert!(matches!(e, ReadError::Io(_)), "{e}");
    }

    #[test]
    fn non_regular_files_are_refused() {
        let e = ArchiveFile::open(Path::new("/dev/null")).err().unwrap();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
}
