//! cawsfs: mount compressed LLM weight archives as plain model files.
//!
//! The data path runs one way, and every import points down it (docs/ARCHITECTURE.md;
//! `tests/layering.rs` checks it):
//! ```text
//! error (FileError), localfs (local files as input), mem (allocation counts) ─► gguf (GGUF format, ggml quants) ─► model (ModelDesc, RowSource, names)
//!   ─► codec (NDSQ, PQ, passthrough, delta, int8/int4) ─► reconstruct (CPU | CUDA backend)
//!   ─► import (HF dir, GGUF)
//!   ─► archive: error ◄ store (the Store trait) ◄ container ◄ cawsf | delta | npydir ◄ open
//!   ─► layout (virtual safetensors / GGUF / HF metadata) ─► router ─► export
//!   ─► cache (chunk cache) ─► fs (filesystem ops) ─► fuse (thin adapter, errno table)
//! control (socket protocol) ─► convert (source → archive pipelines) ─► mount (daemon)
//! ```
//! The CLI lives in the binary (`src/main.rs`, `src/cli/`).

pub mod archive;
pub mod cache;
pub mod codec;
pub mod control;
pub mod convert;
pub mod error;
pub mod export;
pub mod fs;
pub mod fuse;
pub mod gguf;
pub mod import;
pub mod layout;
pub mod localfs;
pub mod mem;
pub mod model;
pub mod mount;
pub mod reconstruct;
pub mod router;
#[cfg(test)]
pub(crate) mod test_support;
pub mod tier;

// Counts live bytes per thread (`mem::retained`); allocation is the system's.
#[global_allocator]
static ALLOC: mem::Counting = mem::Counting;
