//! A directory of an archive (the npy-dir kind): a local directory, or a prefix in
//! object storage ([`RemotePrefix`]). Names are relative to it (`manifest.json`,
//! `tensors/x__q.npy`); what it serves are [`ArchiveFile`]s, read and checked the same
//! way wherever they are.

use std::path::{Path, PathBuf};

use super::file::ArchiveFile;
use super::remote::{self, FetchSnapshot, RemotePrefix};
use crate::archive::ArchiveError;
use crate::error::FileError;

pub enum ArchiveDir {
    Local(PathBuf),
    Remote(Box<RemotePrefix>),
}

impl ArchiveDir {
    /// A local directory (checked by its first read), or the prefix a URL names (listed).
    pub fn open(path: &Path) -> Result<ArchiveDir, ArchiveError> {
        if remote::is_url(path) {
            return Ok(ArchiveDir::Remote(Box::new(RemotePrefix::open(path)?)));
        }
        Ok(ArchiveDir::Local(path.to_path_buf()))
    }

    /// Whether the directory is in object storage.
    pub fn is_remote(&self) -> bool {
        matches!(self, ArchiveDir::Remote(_))
    }

    /// The directory, or the prefix's URL, for messages.
    pub fn path(&self) -> &Path {
        match self {
            ArchiveDir::Local(p) => p,
            ArchiveDir::Remote(r) => Path::new(r.display()),
        }
    }

    /// `rel` inside the directory, for messages.
    pub fn at(&self, rel: &str) -> PathBuf {
        self.path().join(rel)
    }

    /// Whether `rel` is a regular file (a symbolic link to one counts) or an object.
    pub fn is_file(&self, rel: &str) -> bool {
        match self {
            ArchiveDir::Local(d) => std::fs::metadata(d.join(rel)).is_ok_and(|m| m.is_file()),
            ArchiveDir::Remote(r) => r.meta(rel).is_some(),
        }
    }

    /// Whether `rel` is a folder holding something.
    pub fn is_dir(&self, rel: &str) -> bool {
        match self {
            ArchiveDir::Local(d) => std::fs::metadata(d.join(rel)).is_ok_and(|m| m.is_dir()),
            ArchiveDir::Remote(r) => r.names(rel).is_ok_and(|n| !n.is_empty()),
        }
    }

    /// The size of `rel` (0 when it cannot be found: its open fails later, by name).
    pub fn len(&self, rel: &str) -> u64 {
        match self {
            ArchiveDir::Local(d) => std::fs::metadata(d.join(rel)).map_or(0, |m| m.len()),
            ArchiveDir::Remote(r) => r.meta(rel).map_or(0, |m| m.size),
        }
    }

    /// The whole of a small file; refused above `max` bytes or when not a regular file
    /// (a FIFO would block the read forever).
    pub fn read_small(&self, rel: &str, max: u64) -> Result<Vec<u8>, ArchiveError> {
        let path = self.at(rel);
        let f = self.open_file(rel)?;
        let len = f.len();
        if len > max {
            return Err(FileError::invalid(
                &path,
                format!("{len} bytes is too large for a metadata file"),
            ));
        }
        f.read_head(0, len as usize)
    }

    /// The names of the regular files directly in folder `sub` ("" for the directory).
    pub fn names(&self, sub: &str) -> Result<Vec<String>, ArchiveError> {
        match self {
            ArchiveDir::Local(d) => {
                let dir = d.join(sub);
                let io = |e| FileError::io(&dir, e);
                let mut out = Vec::new();
                for e in std::fs::read_dir(&dir).map_err(io)? {
                    let e = e.map_err(io)?;
                    if let Some(n) = e.file_name().to_str() {
                        out.push(n.to_string());
                    }
                }
                out.sort();
                Ok(out)
            }
            ArchiveDir::Remote(r) => r.names(sub),
        }
    }

    /// Open `rel` for reading by range.
    pub fn open_file(&self, rel: &str) -> Result<ArchiveFile, ArchiveError> {
        match self {
            ArchiveDir::Local(d) => {
                let path = d.join(rel);
                // Opening a FIFO would block until a writer comes: look before opening.
                let meta = std::fs::metadata(&path).map_err(|e| FileError::io(&path, e))?;
                if !meta.is_file() {
                    return Err(FileError::invalid(&path, "not a regular file"));
                }
                ArchiveFile::open(&path)
            }
            ArchiveDir::Remote(r) => Ok(ArchiveFile::from_remote(r.open_object(rel)?)),
        }
    }

    /// What tells this version of `rel` from another short of its bytes: mtime and
    /// inode of a file, ETag, version and modification time of an object.
    pub fn stamp(&self, rel: &str) -> Option<Vec<u8>> {
        match self {
            ArchiveDir::Local(d) => {
                use std::os::unix::fs::MetadataExt;
                let m = std::fs::metadata(d.join(rel)).ok()?;
                let mut b = m.mtime().to_le_bytes().to_vec();
                b.extend_from_slice(&m.mtime_nsec().to_le_bytes());
                b.extend_from_slice(&m.ino().to_le_bytes());
                Some(b)
            }
            ArchiveDir::Remote(r) => {
                let m = r.meta(rel)?;
                let s = format!("{:?}{:?}{}", m.e_tag, m.version, m.last_modified);
                Some(s.into_bytes())
            }
        }
    }

    /// The requests made for the directory's objects, when it is in object storage.
    pub fn fetch_stats(&self) -> Option<FetchSnapshot> {
        match self {
            ArchiveDir::Local(_) => None,
            ArchiveDir::Remote(r) => Some(r.snapshot()),
        }
    }
}
