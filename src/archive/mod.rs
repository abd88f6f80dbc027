//! The archive layer: one interface over the three archive kinds, and the kinds.
//!
//! From the bottom up (a file imports only what is listed before it):
//! - [`error`]: [`ArchiveError`], the one error every kind opens and reads with.
//! - [`remote`] (with [`aws_profile`]): an archive file in object storage (`s3://`,
//!   `http(s)://`), read by byte range, pinned at open.
//! - [`file`]: [`file::ArchiveFile`], one file of an archive read with `pread` and
//!   checked to be unchanged since open (a truncated or rewritten archive gives EIO,
//!   never SIGBUS or mixed bytes).
//! - [`store`]: the [`Store`] trait everything above this layer sees, read counters,
//!   the argument checks every kind makes.
//! - [`container`]: what the `.cawsf` and delta files share (header/TOC, sections,
//!   compression, checksums, META's model part) and the ROUTING bytes all kinds store.
//! - [`cawsf`], [`delta`], [`npydir`]: the kinds side by side, each with its format,
//!   reader, writer and `impl Store`; they do not import each other.
//! - [`open()`]: tells the kind of a path and opens it.
//!
//! Turning a source model into an archive (choosing codecs, reports) is `convert`'s job;
//! this layer only reads and writes the bytes.

mod aws_profile;
pub mod cawsf;
pub mod container;
pub mod delta;
pub mod dir;
pub mod error;
pub mod file;
pub mod npydir;
mod open;
pub mod remote;
pub mod store;

pub use container::routing::{encode_routing, parse_routing, Routing, Shard, ShardKind};
pub use container::Compression;
pub use error::ArchiveError;
pub use open::open;
pub use store::{
    block_jobs, check_read, decode_failures, rel_err_of, set_block_memo_bytes, BlockJob, BlockMemo,
    Kind, ReadCounterSnapshot, ReadCounters, SectionInfo, Store, TensorSummary,
};
