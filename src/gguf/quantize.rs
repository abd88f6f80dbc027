//! TEMPORARY stand-in until the quantizers land (branch `quantizers`).
use half::{bf16, f16};

use super::quant::QuantError;
use super::GgmlType;

pub fn can_quantize(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
    )
}

pub fn quantize(ty: GgmlType, src: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    match ty {
        GgmlType::F32 => {
            for (b, v) in out.chunks_exact_mut(4).zip(src) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (b, v) in out.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (b, v) in out.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            let mut v = Vec::new();
            super::quant::quantize_q8_0(src, &mut v);
            out.copy_from_slice(&v);
        }
        _ => return Err(QuantError::Unsupported(ty)),
    }
    Ok(())
}
