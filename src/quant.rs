//! ggml block formats: dequantization to f32 (and Q8_0 quantization). Pure functions
//! over byte slices; nothing here knows about files. STUB: to be implemented.

use crate::gguf::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("ggml type {0:?} is not supported for dequantization")]
    Unsupported(GgmlType),
    #[error("{ty:?}: {n} elements need {need} bytes, got {got}")]
    Size {
        ty: GgmlType,
        n: usize,
        need: usize,
        got: usize,
    },
}

/// Dequantize `out.len()` elements of type `ty` from `bytes` (which must be exactly
/// the bytes of that many elements).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let _ = (ty, bytes, out);
    todo!()
}

/// Quantize `src` (a multiple of 32 values) to Q8_0 blocks appended to `out`.
pub fn quantize_q8_0(src: &[f32], out: &mut Vec<u8>) {
    let _ = (src, out);
    todo!()
}
