//! cawsfs: mount compressed LLM weight archives as plain model files.
//!
//! The data path runs one way:
//! ```text
//! archive bytes (mmap) ─► archive reader ─► codec: reconstruct rows r0..r1 of tensor T
//!   .cawsf (archive) | delta | npy-dir (npydir), behind one trait (store)
//!                                  │
//! model description (model): tensors, architecture config, tokenizer
//!                                  │
//! virtual layouts (layout): safetensors / GGUF / config.json / tokenizer.json
//!                                  │
//! export · chunk cache (cache) ─► filesystem (fs) ─► FUSE adapter (fuse)
//! control socket (control) · router (router: ROUTING keys, prompt keys, ranking)
//! daemon (mount) · CLI (main.rs)
//! ```
//! Importers (`import`) feed `convert`, which encodes tensors with a codec and writes an
//! archive. Each module knows only the ones below it.

pub mod archive;
pub mod cache;
pub mod codec;
pub mod control;
pub mod convert;
pub mod export;
pub mod fs;
pub mod fuse;
pub mod gguf;
pub mod import;
pub mod layout;
pub mod model;
pub mod mount;
pub mod router;
#[cfg(test)]
pub(crate) mod test_support;
