//! The model description: what every archive kind knows about the model it holds,
//! independent of how the weights are compressed.
//!
//! Conventions (everything downstream relies on them):
//! - Tensor names are the Hugging Face names (`model.layers.0.self_attn.q_proj.weight`).
//! - Shapes are in Hugging Face (PyTorch, row-major) order: `[rows, cols]` for 2-D
//!   weights, `[n]` for 1-D tensors. A tensor is always seen as a `rows × cols` matrix:
//!   `rows = shape[0]`, `cols = product(shape[1..])`; a 1-D tensor is `1 × n`.
//! - Q and K projections are stored in Hugging Face row order (the llama.cpp rotary
//!   permutation undone); the GGUF layout re-applies it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::gguf::{GgmlType, GgufValue};

pub mod names;

/// How a tensor's elements were stored in the source the archive was made from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceType {
    F32,
    F16,
    BF16,
    /// A ggml block-quantized type (Q8_0, Q4_1, Q4_K ...) from a GGUF source.
    Ggml(GgmlType),
}

/// A float dtype a virtual file can present.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FloatType {
    F32,
    F16,
    BF16,
}

impl FloatType {
    pub fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::F16 | FloatType::BF16 => 2,
        }
    }
    /// The same type as a ggml type.
    pub fn ggml(self) -> GgmlType {
        match self {
            FloatType::F32 => GgmlType::F32,
            FloatType::F16 => GgmlType::F16,
            FloatType::BF16 => GgmlType::BF16,
        }
    }
}

impl SourceType {
    /// The float dtype a safetensors view presents by default: the source's own float
    /// type, and F16 for quantized sources (dequantized values of 4/8-bit blocks are
    /// represented closely enough by f16; f32 on request).
    pub fn default_float(self) -> FloatType {
        match self {
            SourceType::F32 => FloatType::F32,
            SourceType::F16 => FloatType::F16,
            SourceType::BF16 => FloatType::BF16,
            SourceType::Ggml(_) => FloatType::F16,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorDesc {
    /// Canonical (Hugging Face) name.
    pub name: String,
    /// Hugging Face order, row-major.
    pub shape: Vec<u64>,
    pub source: SourceType,
}

impl TensorDesc {
    pub fn rows(&self) -> u64 {
        if self.shape.len() <= 1 {
            1
        } else {
            self.shape[0]
        }
    }
    pub fn cols(&self) -> u64 {
        if self.shape.len() <= 1 {
            self.shape.first().copied().unwrap_or(1)
        } else {
            self.shape[1..].iter().product()
        }
    }
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Architecture hyper-parameters of a llama-family model, in one place for both
/// conventions (GGUF `llama.*` keys and Hugging Face `config.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArchConfig {
    /// Hugging Face `model_type` ("llama", "mistral", "qwen2").
    pub model_type: String,
    /// GGUF `general.architecture` ("llama", "qwen2").
    pub gguf_arch: String,
    pub n_layers: u32,
    pub hidden_size: u32,
    pub intermediate_size: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub vocab_size: u32,
    pub context_length: u32,
    pub rope_theta: f32,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
}

/// Most side files a model may carry: real models have fewer than 20 (config, tokenizer,
/// generation config, chat template ...); the bound keeps a listing of the mount small.
pub const MAX_HF_FILES: usize = 256;
/// Longest side-file name, in bytes (what Linux file systems allow).
pub const MAX_HF_FILE_NAME: usize = 255;

/// Whether `name` can be a side file served in the mount's one flat directory: one
/// path component, not `.` or `..`, no NUL, not empty, at most [`MAX_HF_FILE_NAME`]
/// bytes. Names come from archive metadata, so they are checked where they are read.
pub fn check_hf_file_name(name: &str) -> Result<(), String> {
    let why = if name.is_empty() {
        "is empty"
    } else if name == "." || name == ".." {
        "is not a file name"
    } else if name.contains('/') {
        "has more than one path component"
    } else if name.contains('\0') {
        "contains NUL"
    } else if name.len() > MAX_HF_FILE_NAME {
        "is longer than 255 bytes"
    } else {
        return Ok(());
    };
    let shown: String = name.chars().take(64).collect();
    Err(format!("side file name {shown:?} {why}"))
}

/// Everything about a model except its weights' values.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelDesc {
    pub arch: ArchConfig,
    pub tensors: Vec<TensorDesc>,
    /// Hugging Face side files kept verbatim (`config.json`, `tokenizer.json`,
    /// `tokenizer_config.json`, `generation_config.json`, ...). Empty for a GGUF source.
    pub hf_files: BTreeMap<String, Vec<u8>>,
    /// GGUF metadata kept verbatim (in file order). Empty for a Hugging Face source.
    pub gguf_meta: Vec<(String, GgufValue)>,
}

impl ModelDesc {
    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.tensors.iter().position(|t| t.name == name)
    }
}

/// The one primitive every consumer reads weights through: rows `r0..r1` of tensor
/// `tensor` (index into [`ModelDesc::tensors`]), as f32, row-major, `(r1-r0)*cols`
/// values written into `out`. Every value of `out` must be written: callers pass
/// reused buffers holding an earlier read's values, not zeros.
pub trait RowSource: Send + Sync {
    fn read_rows(&self, tensor: usize, r0: u64, r1: u64, out: &mut [f32]) -> Result<(), ReadError>;

    /// The source format of `tensor` when the archive holds the source's own bytes for it,
    /// bit-exact (a passthrough); then [`RowSource::read_raw_rows`] serves them.
    fn raw_format(&self, _tensor: usize) -> Option<SourceType> {
        None
    }

    /// Rows `r0..r1` of `tensor` as the source's own bytes (`raw_format`'s row size
    /// each), checksummed like any read. Only for tensors whose `raw_format` is `Some`.
    fn read_raw_rows(
        &self,
        tensor: usize,
        _r0: u64,
        _r1: u64,
        _out: &mut [u8],
    ) -> Result<(), ReadError> {
        Err(ReadError::NotRaw(format!("#{tensor}")))
    }
}

/// Why rows could not be produced. The FUSE adapter maps these to errno (EIO for
/// all but `OutOfRange`, which is EINVAL); nothing ever returns wrong bytes instead.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("block {block} of tensor {tensor} failed its XXH3-64 check (stored {stored:016x}, computed {computed:016x})")]
    Checksum {
        tensor: String,
        block: usize,
        stored: u64,
        computed: u64,
    },
    #[error("block {block} of tensor {tensor} is corrupt: {reason}")]
    Corrupt {
        tensor: String,
        block: usize,
        reason: String,
    },
    #[error("rows {r0}..{r1} out of range for tensor {tensor}")]
    OutOfRange { tensor: String, r0: u64, r1: u64 },
    /// The archive file changed (truncated, rewritten) since it was opened: nothing is
    /// read from it any more. The message names the file; it has been logged once.
    #[error("{0}")]
    Changed(String),
    /// A raw read of a tensor the archive does not hold as source bytes (a caller bug:
    /// layouts ask only for tensors whose `raw_format` is `Some`).
    #[error("tensor {0} is not stored as its source's bytes")]
    NotRaw(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::check_hf_file_name;

    #[test]
    fn side_file_names_are_one_plain_component() {
        for ok in [
            "config.json",
            "tokenizer.json",
            "a..b",
            ".hidden",
            "chat_template.jinja",
        ] {
            assert!(check_hf_file_name(ok).is_ok(), "{ok}");
        }
        let long = "x".repeat(256);
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "../../escape",
            "/abs",
            "nul\0x",
            long.as_str(),
        ] {
            let e = check_hf_file_name(bad).unwrap_err();
            assert!(e.starts_with("side file name ") && !e.contains('\n'), "{e}");
        }
    }
}
