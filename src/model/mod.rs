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
    /// Integers, booleans, f64 and fp8 (`position_ids`, masks, scales): stored and
    /// served only as their own bytes, never converted by a view.
    Plain(PlainType),
}

/// A safetensors dtype of whole bytes that is none of the float types a view converts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlainType {
    Bool,
    U8,
    I8,
    F8E4M3,
    F8E5M2,
    I16,
    U16,
    I32,
    U32,
    F64,
    I64,
    U64,
}

impl PlainType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        use PlainType::*;
        match self {
            Bool | U8 | I8 | F8E4M3 | F8E5M2 => 1,
            I16 | U16 => 2,
            I32 | U32 => 4,
            F64 | I64 | U64 => 8,
        }
    }

    /// A small number naming the type in layout fingerprints (distinct from ggml ids).
    pub fn id(self) -> u32 {
        0x100 + self as u32
    }

    /// Elements as f32 (the nearest value; booleans 0 or 1), for consumers that only
    /// read values (statistics, a float view of a whole model). `bytes` holds
    /// `out.len()` little-endian elements.
    pub fn to_f32(self, bytes: &[u8], out: &mut [f32]) {
        use PlainType::*;
        let n = self.size() as usize;
        debug_assert_eq!(bytes.len(), out.len() * n);
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(n)) {
            let mut w = [0u8; 8];
            w[..n].copy_from_slice(b);
            let u = u64::from_le_bytes(w);
            *o = match self {
                Bool => (u != 0) as u8 as f32,
                U8 | U16 | U32 | U64 => u as f32,
                I8 => b[0] as i8 as f32,
                I16 => u as u16 as i16 as f32,
                I32 => u as u32 as i32 as f32,
                I64 => u as i64 as f32,
                F64 => f64::from_bits(u) as f32,
                // E5M2 is the top byte of an f16.
                F8E5M2 => half::f16::from_bits((u as u16) << 8).to_f32(),
                F8E4M3 => f8e4m3_to_f32(u as u8),
            };
        }
    }
}

/// Each plain type and the safetensors dtype of the same name, for both directions.
const SAFETENSORS_DTYPES: [(PlainType, safetensors::Dtype); 12] = {
    use safetensors::Dtype as D;
    use PlainType as P;
    [
        (P::Bool, D::BOOL),
        (P::U8, D::U8),
        (P::I8, D::I8),
        (P::F8E4M3, D::F8_E4M3),
        (P::F8E5M2, D::F8_E5M2),
        (P::I16, D::I16),
        (P::U16, D::U16),
        (P::I32, D::I32),
        (P::U32, D::U32),
        (P::F64, D::F64),
        (P::I64, D::I64),
        (P::U64, D::U64),
    ]
};

impl PlainType {
    /// The safetensors dtype of this type.
    pub fn safetensors(self) -> safetensors::Dtype {
        SAFETENSORS_DTYPES
            .iter()
            .find(|(p, _)| *p == self)
            .map(|(_, d)| *d)
            .expect("every plain type has a safetensors dtype")
    }

    /// The plain type of a safetensors dtype; None for float weights (F32, F16, BF16)
    /// and the sub-byte types the archive cannot hold.
    pub fn of_safetensors(d: safetensors::Dtype) -> Option<PlainType> {
        SAFETENSORS_DTYPES
            .iter()
            .find(|(_, s)| *s == d)
            .map(|(p, _)| *p)
    }
}

/// OCP FP8 E4M3 ("fn": no infinities; S.1111.111 is NaN): bias 7, subnormals below.
fn f8e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = (b >> 3) & 0xf;
    let m = (b & 7) as f32;
    if e == 0xf && b & 7 == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e as i32 - 7)
    };
    sign * mag
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
    /// represented closely enough by f16; f32 on request). None for a plain type,
    /// which is served only as its own bytes.
    pub fn float_view(self) -> Option<FloatType> {
        match self {
            SourceType::F32 => Some(FloatType::F32),
            SourceType::F16 => Some(FloatType::F16),
            SourceType::BF16 => Some(FloatType::BF16),
            SourceType::Ggml(_) => Some(FloatType::F16),
            SourceType::Plain(_) => None,
        }
    }

    /// Bytes per element a mount presents by default: [`SourceType::float_view`]'s, or
    /// the plain type's own.
    pub fn served_size(self) -> u64 {
        match self {
            SourceType::Plain(p) => p.size(),
            SourceType::F32 => 4,
            SourceType::F16 | SourceType::BF16 | SourceType::Ggml(_) => 2,
        }
    }

    /// Whether a codec may code this tensor's values: float types only.
    pub fn is_float(self) -> bool {
        !matches!(self, SourceType::Plain(_))
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

/// Architecture hyper-parameters, in one place for both conventions (GGUF `llama.*`
/// keys and Hugging Face `config.json`). The numbers are those of a llama-family
/// model; for a model without a GGUF mapping they are what its config gives under
/// those names, 0 where it gives nothing, and nothing but reports uses them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArchConfig {
    /// Hugging Face `model_type` ("llama", "qwen2", "bert", any).
    pub model_type: String,
    /// GGUF `general.architecture` ("llama", "qwen2"); None when llama.cpp's names for
    /// this architecture are not known here, so no GGUF view is served.
    pub gguf_arch: Option<String>,
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

/// Whether `name` can be a side file served in the mount: a file of the mount's
/// directory or of one subdirectory of it (`1_Pooling/config.json`, what
/// sentence-transformers keeps beside the model), so one or two path components, each
/// not empty, not `.` or `..`, without NUL, of at most [`MAX_HF_FILE_NAME`] bytes.
/// Names come from archive metadata, so they are checked where they are read.
pub fn check_hf_file_name(name: &str) -> Result<(), String> {
    let parts: Vec<&str> = name.split('/').collect();
    let why = if name.is_empty() {
        "is empty"
    } else if parts.len() > 2 {
        "has more than two path components"
    } else if parts
        .iter()
        .any(|p| p.is_empty() || *p == "." || *p == "..")
    {
        "is not a file name"
    } else if name.contains('\0') {
        "contains NUL"
    } else if parts.iter().any(|p| p.len() > MAX_HF_FILE_NAME) {
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
    fn side_file_names_are_one_or_two_plain_components() {
        for ok in [
            "config.json",
            "tokenizer.json",
            "a..b",
            ".hidden",
            "chat_template.jinja",
            "1_Pooling/config.json",
        ] {
            assert!(check_hf_file_name(ok).is_ok(), "{ok}");
        }
        let long = "x".repeat(256);
        for bad in [
            "",
            ".",
            "..",
            "a/b/c",
            "a/",
            "a//b",
            "./b",
            "../escape",
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

#[cfg(test)]
mod plain_tests {
    use super::PlainType;

    fn f32s(p: PlainType, bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; bytes.len() / p.size() as usize];
        p.to_f32(bytes, &mut out);
        out
    }

    #[test]
    fn plain_types_read_as_their_values() {
        let i64s: Vec<u8> = [-3i64, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(f32s(PlainType::I64, &i64s), [-3.0, 7.0]);
        assert_eq!(f32s(PlainType::I8, &[0xff, 5]), [-1.0, 5.0]);
        assert_eq!(f32s(PlainType::U8, &[0xff, 5]), [255.0, 5.0]);
        assert_eq!(f32s(PlainType::Bool, &[0, 1, 2]), [0.0, 1.0, 1.0]);
        assert_eq!(f32s(PlainType::I16, &(-300i16).to_le_bytes()), [-300.0]);
        assert_eq!(
            f32s(PlainType::U32, &u32::MAX.to_le_bytes()),
            [u32::MAX as f32]
        );
        assert_eq!(f32s(PlainType::F64, &1.5f64.to_le_bytes()), [1.5]);
        // E4M3: 0x38 = 1.0, 0xC0 = -2.0, 0x7E = 448 (largest), 0x01 = 2^-9, 0x7F = NaN.
        let e4 = f32s(PlainType::F8E4M3, &[0x38, 0xC0, 0x7E, 0x01, 0x7F]);
        assert_eq!(&e4[..4], &[1.0, -2.0, 448.0, 2f32.powi(-9)]);
        assert!(e4[4].is_nan());
        // E5M2: 0x3C = 1.0, 0x7C = +inf, 0xC0 = -2.0.
        assert_eq!(
            f32s(PlainType::F8E5M2, &[0x3C, 0x7C, 0xC0]),
            [1.0, f32::INFINITY, -2.0]
        );
    }

    #[test]
    fn plain_types_have_distinct_ids_outside_ggml() {
        use PlainType::*;
        let all = [
            Bool, U8, I8, F8E4M3, F8E5M2, I16, U16, I32, U32, F64, I64, U64,
        ];
        let ids: std::collections::BTreeSet<u32> = all.iter().map(|p| p.id()).collect();
        assert_eq!(ids.len(), all.len());
        assert!(ids.iter().all(|&i| i >= 0x100));
        for p in all {
            let d = p.safetensors();
            assert_eq!(PlainType::of_safetensors(d), Some(p));
            assert_eq!(d.bitsize() as u64, 8 * p.size(), "{p:?}");
        }
        for float in [
            safetensors::Dtype::F32,
            safetensors::Dtype::F16,
            safetensors::Dtype::BF16,
            safetensors::Dtype::F4,
        ] {
            assert_eq!(PlainType::of_safetensors(float), None);
        }
    }
}
