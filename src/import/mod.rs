//! Importers: read a source model (a Hugging Face directory or a GGUF file) into a
//! [`ModelDesc`] plus access to each tensor's data in canonical (HF) row order.

use std::path::Path;

use crate::model::ModelDesc;

pub mod calibration;
pub mod gguf;
pub mod hf;
pub mod imatrix;

/// Why a source model cannot be imported: the file and the problem.
pub use crate::error::FileError as ImportError;

/// A source model opened for conversion.
pub trait SourceModel: Send + Sync {
    fn desc(&self) -> &ModelDesc;
    /// The tensor's bytes as stored in the source (`desc().tensors[i].source`), rows in
    /// canonical (HF) order.
    fn raw(&self, i: usize) -> Result<Vec<u8>, ImportError>;
    /// The tensor dequantized to f32, canonical row order.
    fn f32(&self, i: usize) -> Result<Vec<f32>, ImportError>;
}

/// Open a HF directory (config.json + *.safetensors) or a `.gguf` file.
pub fn open_source(path: &Path) -> Result<Box<dyn SourceModel>, ImportError> {
    let meta = std::fs::metadata(path).map_err(|e| ImportError::io(path, e))?;
    // A FIFO or device would block the first read forever.
    if !meta.is_dir() && !meta.is_file() {
        return Err(ImportError::invalid(
            path,
            "not a regular file or directory (a source is a .gguf file or a Hugging Face directory)",
        ));
    }
    if meta.is_dir() {
        Ok(Box::new(hf::HfSource::open(path)?))
    } else {
        Ok(Box::new(gguf::GgufSource::open(path)?))
    }
}
