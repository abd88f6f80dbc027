//! GGUF v3: value types, a bounds-checked reader, and header serialization for the
//! virtual GGUF layout. Reading treats the file as hostile: every count and offset is
//! checked against the file size before anything is allocated.

use serde::{Deserialize, Serialize};

pub mod fit;
pub mod grids;
pub mod quant;
pub mod quantize;
pub mod reader;
mod strlist;
pub mod writer;

pub use reader::{GgufError, GgufFile, GgufTensorInfo};
pub use strlist::StrList;
pub use writer::{GgufHeader, GgufTensorEntry};

/// ggml tensor types, with the numeric ids GGUF stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    /// 4-bit codes on a fixed non-uniform grid (`IQ4_NL_GRID`), one f16 scale per 32.
    IQ4_NL,
    /// IQ4_NL's grid with a 6-bit scale per 32 under one f16 scale per 256.
    IQ4_XS,
    /// Sign-coded magnitudes from a 256-entry grid of 4, a 4-bit scale per 32 under one
    /// f16 scale per 256 (3.06 bits per weight).
    IQ3_XXS,
    /// A 512-entry grid of 4 magnitudes, free signs, 4-bit scales per 32 (3.44 bits).
    IQ3_S,
    /// A 1024-entry grid of 8 magnitudes, free signs, 4-bit scales per 16 (2.56 bits).
    IQ2_S,
    /// A 256-entry grid of 8 magnitudes, 7-bit sign indices, a 4-bit scale per 32.
    IQ2_XXS,
    /// A 512-entry grid of 8 magnitudes, 7-bit sign indices, 4-bit scales per 16.
    IQ2_XS,
    /// A 2048-entry grid of 8 values in −1..=1 plus a ±1/8 shift, 3-bit scales per 32.
    IQ1_S,
    /// IQ1_S's grid, a shift per 8, 3-bit scales per 16, the f16 scale spread over them.
    IQ1_M,
    BF16,
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2_K,
            11 => Q3_K,
            12 => Q4_K,
            13 => Q5_K,
            14 => Q6_K,
            15 => Q8_K,
            16 => IQ2_XXS,
            17 => IQ2_XS,
            18 => IQ3_XXS,
            19 => IQ1_S,
            20 => IQ4_NL,
            21 => IQ3_S,
            22 => IQ2_S,
            23 => IQ4_XS,
            29 => IQ1_M,
            30 => BF16,
            _ => return None,
        })
    }
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            IQ1_M => 29,
            BF16 => 30,
        }
    }
    /// (elements per block, bytes per block)
    pub fn block(self) -> (u64, u64) {
        use GgmlType::*;
        match self {
            F32 => (1, 4),
            F16 | BF16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2_K => (256, 84),
            Q3_K => (256, 110),
            Q4_K => (256, 144),
            Q5_K => (256, 176),
            Q6_K => (256, 210),
            Q8_K => (256, 292),
            IQ4_NL => (32, 18),
            IQ4_XS => (256, 136),
            IQ3_XXS => (256, 98),
            IQ3_S => (256, 110),
            IQ2_S => (256, 82),
            IQ2_XXS => (256, 66),
            IQ2_XS => (256, 74),
            IQ1_S => (256, 50),
            IQ1_M => (256, 56),
        }
    }
    /// Whether values are coded through a table of vectors (IQ4_NL's and IQ4_XS's levels
    /// included): CUDA reconstruction has no such tables.
    pub fn has_table(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            IQ4_NL | IQ4_XS | IQ3_XXS | IQ3_S | IQ2_S | IQ2_XXS | IQ2_XS | IQ1_S | IQ1_M
        )
    }
    /// The type named `name` as ggml spells it, in any case (`q4_k`, `IQ4_NL`).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        (0..=40)
            .filter_map(GgmlType::from_id)
            .find(|t| format!("{t:?}").eq_ignore_ascii_case(name))
    }
    /// Bytes of a row of `n` elements, or None when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let (be, bb) = self.block();
        if n % be != 0 {
            return None;
        }
        (n / be).checked_mul(bb)
    }
}

/// A GGUF metadata value. Serialized into META as externally tagged JSON so GGUF
/// metadata survives a round trip through an archive verbatim.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Arrays are homogeneous; element type kept so an empty array round-trips.
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(StrList),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) if v >= 0 => Some(v as u64),
            GgufValue::I16(v) if v >= 0 => Some(v as u64),
            GgufValue::I32(v) if v >= 0 => Some(v as u64),
            GgufValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }
}

/// Look a key up in GGUF metadata kept as an ordered list.
pub fn meta_get<'a>(meta: &'a [(String, GgufValue)], key: &str) -> Option<&'a GgufValue> {
    meta.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}
