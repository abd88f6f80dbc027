//! The one error of reading or writing a file that every layer reports the same way: the
//! file and the problem, one line. GGUF parsing, importing a source model and opening an
//! archive all fail like this, so they share this type under their own names
//! (`GgufError`, `ImportError`, `ArchiveError`) instead of three copies of one enum.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file's contents are wrong: `reason` says what, in one line.
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl FileError {
    pub fn invalid(path: &Path, reason: impl Into<String>) -> FileError {
        FileError::Invalid {
            path: path.display().to_string(),
            reason: reason.into(),
        }
    }

    pub fn io(path: &Path, source: std::io::Error) -> FileError {
        FileError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// The message a caught panic carried (`catch_unwind`'s payload), for the one line that
/// reports it.
pub fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
