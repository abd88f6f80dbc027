//! The delta archive kind (seed 001): per weight type (q, k, v, o, gate, up, down) one
//! or more shared bases, and per layer a low-rank delta, so that
//! `Ŵ = B̂ + U·Vᵀ`; every other tensor is stored as compressed passthrough. Exact
//! bytes: docs/FORMAT-DELTA.md. What the decomposition achieves on a real model, and
//! how similar adjacent layers' weights really are: docs/DELTA.md.
//!
//! - `format`: constants, the blob index entry, META's JSON.
//! - `decompose`: bases, k-means over layers, base quantization, SVD and rank choice.

pub mod format;
mod open;
mod reader;
#[cfg(test)]
mod tests;
mod writer;

pub use reader::{has_magic, is_magic, DeltaArchive};
pub use writer::DeltaWriter;
