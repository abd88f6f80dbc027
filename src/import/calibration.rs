//! Calibration statistics (`scripts/calibrate.py`, docs/CODECS.md "Error feedback"): per
//! input of the model's linear layers, the second-moment matrix H = Σ x xᵀ / n of the
//! activations over a calibration text. A safetensors file: one `cols × cols` f32
//! tensor per distinct input, named after the first weight reading it, and metadata
//! `readers` (JSON: weight name → tensor name) and `tokens`. The file is mapped, not
//! read: a matrix is copied out when a tensor asks for it. Hostile input: names,
//! shapes and values are checked, and every error names the file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use super::ImportError;

pub struct Calibration {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Weight name → name of the tensor holding its input's H.
    readers: HashMap<String, String>,
    /// Tensor name → its width (checked square at open).
    widths: HashMap<String, u64>,
    /// Tokens the statistics were gathered over.
    pub tokens: u64,
}

impl std::fmt::Debug for Calibration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Calibration")
            .field("path", &self.path)
            .field("readers", &self.readers.len())
            .finish()
    }
}

impl Calibration {
    pub fn open(path: &Path) -> Result<Calibration, ImportError> {
        let file = std::fs::File::open(path).map_err(|e| ImportError::io(path, e))?;
        let meta = file.metadata().map_err(|e| ImportError::io(path, e))?;
        if !meta.is_file() {
            return Err(ImportError::invalid(
                path,
                "not a regular file (calibration statistics are a file scripts/calibrate.py writes)",
            ));
        }
        // SAFETY: read-only map of a regular file; a file changed under it gives wrong
        // statistics, never unsafety, since every value is copied out and checked.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ImportError::io(path, e))?;
        let bad = |why: String| ImportError::invalid(path, why);
        let (_, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
            bad(format!(
                "not a safetensors file of calibration statistics ({e})"
            ))
        })?;
        let extra = meta.metadata().as_ref();
        let get = |k: &str| extra.and_then(|m| m.get(k)).cloned();
        let readers: HashMap<String, String> = get("readers")
            .and_then(|s| serde_json::from_str(&s).ok())
            .ok_or_else(|| {
                bad("has no \"readers\" metadata (not written by scripts/calibrate.py)".into())
            })?;
        let tokens = get("tokens").and_then(|s| s.parse().ok()).unwrap_or(0);
        let st = SafeTensors::deserialize(&map).map_err(|e| bad(e.to_string()))?;
        let mut widths = HashMap::new();
        for (w, t) in &readers {
            let view = st
                .tensor(t)
                .map_err(|_| bad(format!("{w} reads tensor {t}, which the file lacks")))?;
            let s = view.shape();
            if view.dtype() != Dtype::F32 || s.len() != 2 || s[0] != s[1] {
                return Err(bad(format!(
                    "{t} is {:?} {s:?}, not a square f32 matrix",
                    view.dtype()
                )));
            }
            widths.insert(t.clone(), s[0] as u64);
        }
        drop(st);
        Ok(Calibration {
            path: path.to_path_buf(),
            map,
            readers,
            widths,
            tokens,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Weights the file has statistics for.
    pub fn len(&self) -> usize {
        self.readers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.readers.is_empty()
    }

    /// Whether the file has statistics for weight `name` of `cols` columns; statistics
    /// of another width are an error naming the file (another model's).
    pub fn covers(&self, name: &str, cols: u64) -> Result<bool, ImportError> {
        let Some(n) = self.readers.get(name).and_then(|t| self.widths.get(t)) else {
            return Ok(false);
        };
        if *n != cols {
            return Err(ImportError::invalid(
                &self.path,
                format!("{name}: statistics of {n} columns, the tensor has {cols} (calibration of another model?)"),
            ));
        }
        Ok(true)
    }

    /// H of the input of weight `name` (HF name), `cols × cols` row-major; None when the
    /// file has none for it. A width other than `cols`, or a value that is not finite,
    /// is an error naming the file (statistics of another model, or a damaged file).
    pub fn for_tensor(&self, name: &str, cols: u64) -> Result<Option<Vec<f32>>, ImportError> {
        let Some(t) = self.readers.get(name) else {
            return Ok(None);
        };
        self.covers(name, cols)?;
        let bad = |why: String| ImportError::invalid(&self.path, why);
        let st = SafeTensors::deserialize(&self.map).map_err(|e| bad(e.to_string()))?;
        let view = st.tensor(t).map_err(|e| bad(e.to_string()))?;
        let h: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if let Some(i) = h.iter().position(|v| !v.is_finite()) {
            return Err(bad(format!("{t}: value {} at {i} is not finite", h[i])));
        }
        Ok(Some(h))
    }
}
