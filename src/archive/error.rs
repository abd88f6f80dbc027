//! The error of opening or reading an archive of any kind: the file and the problem
//! ([`crate::error::FileError`], named for this layer).

pub use crate::error::FileError as ArchiveError;
