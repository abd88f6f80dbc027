//! The error of opening or reading an archive of any kind: the file and the problem.

#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}
