//! Opening a path as whichever archive kind it is.

use std::path::Path;
use std::sync::Arc;

use super::cawsf::CawsfArchive;
use super::delta::DeltaArchive;
use super::npydir::NpyDir;
use super::{ArchiveError, Store};

/// Open an archive of any kind: a directory is an npy-dir, a file is told by its magic.
pub fn open(path: &Path) -> Result<Arc<dyn Store>, ArchiveError> {
    let meta = std::fs::metadata(path).map_err(|source| ArchiveError::Io {
        path: path.display().to_string(),
        source,
    })?;
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
