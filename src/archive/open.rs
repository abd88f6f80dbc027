//! Opening a path as whichever archive kind it is.

use std::path::Path;
use std::sync::Arc;

use super::cawsf::CawsfArchive;
use super::delta::DeltaArchive;
use super::npydir::NpyDir;
use super::{ArchiveError, Store};

/// Open an archive of any kind: a directory is an npy-dir, a file is told by its magic.
/// A URL (`s3://`, `http(s)://`) names a `.cawsf` or delta object, or, ending in `/` or
/// naming no object but a prefix, an npy-dir (docs/REMOTE.md).
pub fn open(path: &Path) -> Result<Arc<dyn Store>, ArchiveError> {
    if super::remote::is_url(path) {
        let url = path.to_str().unwrap_or_default();
        if url.ends_with('/') {
            return Ok(Arc::new(NpyDir::open(path)?));
        }
        let f = match super::file::ArchiveFile::open(path) {
            Ok(f) => f,
            Err(e) => {
                // `s3://b/model` may be the folder `s3://b/model/`: an npy-dir is tried
                // only when it holds a manifest, else the object's own error stands.
                let dir = format!("{url}/");
                let npy = super::dir::ArchiveDir::open(Path::new(&dir))
                    .is_ok_and(|d| d.is_file(super::npydir::MANIFEST));
                return match npy {
                    true => Ok(Arc::new(NpyDir::open(Path::new(&dir))?)),
                    false => Err(e),
                };
            }
        };
        if f.len() >= 8 && super::delta::is_magic(&f.read_head(0, 8)?) {
            return Ok(Arc::new(DeltaArchive::open_file(f)?));
        }
        return Ok(Arc::new(CawsfArchive::open_file(f)?));
    }
    let meta = std::fs::metadata(path).map_err(|source| ArchiveError::Io {
        path: path.display().to_string(),
        source,
    })?;
    // A FIFO or device would block the magic read forever; only files and directories
    // can be archives.
    if !meta.is_dir() && !meta.is_file() {
        return Err(ArchiveError::invalid(
            path,
            "not a regular file or directory (an archive is a file, an npy-dir a directory)",
        ));
    }
    if meta.is_dir() {
        if !super::npydir::is_npy_dir(path) {
            return Err(ArchiveError::Invalid {
                path: path.display().to_string(),
                reason: "a directory without manifest.json is not an npy-dir archive".into(),
            });
        }
        return Ok(Arc::new(NpyDir::open(path)?));
    }
    if super::delta::has_magic(path) {
        return Ok(Arc::new(DeltaArchive::open(path)?));
    }
    Ok(Arc::new(CawsfArchive::open(path)?))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// A FIFO given as an archive or a source used to block the first read forever.
    #[test]
    fn a_fifo_is_refused_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("model.cawsf");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let check = |e: String| {
            assert!(
                e.contains("model.cawsf") && e.contains("not a regular file"),
                "{e}"
            );
            assert!(!e.contains('\n'), "{e}");
        };
        check(super::open(&fifo).err().unwrap().to_string());
        check(
            crate::import::open_source(Path::new(&fifo))
                .err()
                .unwrap()
                .to_string(),
        );
    }
}
