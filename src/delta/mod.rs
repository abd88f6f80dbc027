//! The delta archive kind (seed 001): per weight type (q, k, v, o, gate, up, down) one
//! or more shared bases, and per layer a low-rank delta, so that
//! `Ŵ = B̂ + U·Vᵀ`; every other tensor is stored as compressed passthrough. Exact
//! bytes: docs/FORMAT-DELTA.md. What the decomposition achieves on a real model, and
//! how similar adjacent layers' weights really are: docs/DELTA.md.
//!
//! - `format`: constants, the blob index entry, META's JSON.
//! - `decompose`: bases, k-means over layers, base quantization, SVD and rank choice.
//! - `writer` / `reader`: the file; the reader implements [`crate::store::Store`].
//! - `convert`: source model → archive, with the per-matrix report.

mod convert;
mod decompose;
mod format;
mod reader;
#[cfg(test)]
mod tests;
mod writer;

pub use convert::{convert, BaseReport, DeltaOptions, DeltaReport, MatrixReport, PassReport};
pub use decompose::{RankChoice, TAIL_THRESHOLDS};
pub use format::BaseDtype;
pub use reader::{has_magic, DeltaArchive};
