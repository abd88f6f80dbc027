//! The ggml-block codec: each row rounded at conversion into a ggml type's blocks
//! (`gguf::fit`, weighted by the importance of each column), stored as those blocks.
//! The payload is laid out as a passthrough ggml payload of that type, so reading is
//! the same (docs/CODECS.md, "ggml blocks"); a GGUF view serves the blocks as they are.

use rayon::prelude::*;

use super::{blocks_of, ndsq, CodecError, EncodedTensor, TensorCodec};
use crate::gguf::{fit, GgmlType};

/// Whether tensors of `cols` columns can be coded as `ty`.
pub fn fits(ty: GgmlType, cols: u64) -> bool {
    fit::can_fit(ty) && cols > 0 && cols % ty.block().0 == 0
}

/// Rows (`rows × cols` values) rounded into `ty`'s blocks, each column weighted by
/// `importance` over its mean (floored as NDSQ floors it) or all alike: the blocks,
/// row after row.
fn round_rows(
    w: &[f32],
    cols: u64,
    ty: GgmlType,
    importance: Option<&[f32]>,
) -> Result<Vec<u8>, CodecError> {
    if !fits(ty, cols) {
        return Err(CodecError::Params(format!(
            "{ty:?} cannot code rows of {cols} values"
        )));
    }
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        return Err(CodecError::Params(format!(
            "value {} at {i} is not finite",
            w[i]
        )));
    }
    let cols = cols as usize;
    let weights = match importance {
        Some(imp) => ndsq::column_weights(imp, cols)?,
        None => None,
    }
    .unwrap_or_else(|| vec![1.0; cols]);
    let rb = ty.row_bytes(cols as u64).expect("checked by fits") as usize;
    let mut out = vec![0u8; w.len() / cols * rb];
    out.par_chunks_mut(rb)
        .zip(w.par_chunks(cols))
        .try_for_each(|(o, x)| fit::fit(ty, x, &weights, o))
        .map_err(|e| CodecError::Params(e.to_string()))?;
    Ok(out)
}

pub(super) fn encode(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    ty: GgmlType,
    importance: Option<&[f32]>,
) -> Result<EncodedTensor, CodecError> {
    if rows_per_block == 0 {
        return Err(CodecError::Params("rows_per_block must be ≥ 1".into()));
    }
    if rows.checked_mul(cols) != Some(w.len() as u64) {
        return Err(CodecError::Params(format!(
            "{rows}×{cols} tensor given {} values",
            w.len()
        )));
    }
    let bytes = round_rows(w, cols, ty, importance)?;
    let rel_err = rel_err(w, &bytes, ty)?;
    let rb = bytes.len() / rows.max(1) as usize;
    let blocks = blocks_of(rows, rows_per_block)
        .map(|(first, n)| bytes[first as usize * rb..(first + n) as usize * rb].to_vec())
        .collect();
    Ok(EncodedTensor {
        codec: TensorCodec::Ggml { ty },
        global: Vec::new(),
        blocks,
        rel_err,
    })
}

/// ‖W − Ŵ‖ / ‖W‖ of the blocks `bytes` against `w`.
fn rel_err(w: &[f32], bytes: &[u8], ty: GgmlType) -> Result<f64, CodecError> {
    let mut y = vec![0f32; w.len()];
    crate::gguf::quant::dequantize(ty, bytes, &mut y)
        .map_err(|e| CodecError::Params(e.to_string()))?;
    let (num, den) = w.iter().zip(&y).fold((0f64, 0f64), |(n, d), (&a, &b)| {
        let e = (a - b) as f64;
        (n + e * e, d + a as f64 * a as f64)
    });
    Ok(if den > 0.0 { (num / den).sqrt() } else { 0.0 })
}

/// `ty` tried on `rows` (rows × `cols`, e.g. a sample of a tensor's rows), weighted as
/// [`super::sq_trial`] weighs (importance over its mean, or 1): the error left,
/// Σ weight·(x − x̂)², and the blocks made, whose compressibility the caller may
/// measure.
pub(super) fn trial(
    rows: &[f32],
    cols: u64,
    ty: GgmlType,
    importance: Option<&[f32]>,
) -> Result<(f64, Vec<u8>), CodecError> {
    let bytes = round_rows(rows, cols, ty, importance)?;
    let mut y = vec![0f32; rows.len()];
    crate::gguf::quant::dequantize(ty, &bytes, &mut y)
        .map_err(|e| CodecError::Params(e.to_string()))?;
    let cw = match importance {
        Some(imp) => ndsq::column_weights(imp, cols as usize)?,
        None => None,
    };
    let err = rows
        .chunks_exact(cols as usize)
        .zip(y.chunks_exact(cols as usize))
        .map(|(x, y)| {
            x.iter()
                .zip(y)
                .enumerate()
                .map(|(j, (&a, &b))| {
                    let e = (a - b) as f64;
                    cw.as_ref().map_or(1.0, |c| c[j] as f64) * e * e
                })
                .sum::<f64>()
        })
        .sum();
    Ok((err, bytes))
}

#[cfg(test)]
mod tests {
    use super::super::{decode_block_rows, decode_global, raw_block_rows, raw_format};
    use super::*;
    use crate::model::SourceType;

    /// Blocks come back as stored (raw rows) and decode to ggml's dequantization of
    /// them, rows of any block range alike; the error is what a 4.5-bit grid leaves.
    #[test]
    fn stored_blocks_are_served_and_decoded_as_ggml_blocks() {
        let (rows, cols, rpb) = (10u64, 64u64, 4u64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
            .collect();
        let enc = encode(&w, rows, cols, rpb, GgmlType::IQ4_NL, None).unwrap();
        assert_eq!(
            enc.codec,
            TensorCodec::Ggml {
                ty: GgmlType::IQ4_NL
            }
        );
        assert_eq!(
            raw_format(&enc.codec),
            Some(SourceType::Ggml(GgmlType::IQ4_NL))
        );
        assert!(enc.rel_err > 0.01 && enc.rel_err < 0.15, "{}", enc.rel_err);
        let all: Vec<u8> = enc.blocks.concat();
        assert_eq!(all.len() as u64, rows * 2 * 18);
        let mut want = vec![0f32; w.len()];
        crate::gguf::quant::dequantize(GgmlType::IQ4_NL, &all, &mut want).unwrap();
        let g = decode_global(&enc.codec, &enc.global, rows, cols).unwrap();
        for (b, payload) in enc.blocks.iter().enumerate() {
            let (first, n) = (b as u64 * rpb, (rows - b as u64 * rpb).min(rpb));
            let mut got = vec![0f32; ((n - 1) * cols) as usize];
            decode_block_rows(&enc.codec, &g, payload, first, n, cols, 1, n, &mut got).unwrap();
            let at = ((first + 1) * cols) as usize;
            assert_eq!(got, want[at..at + got.len()]);
            let raw = raw_block_rows(&enc.codec, payload, n, cols, 0, n).unwrap();
            assert_eq!(
                raw,
                &all[(first * 36) as usize..((first + n) * 36) as usize]
            );
        }
        // A width the blocks do not divide, or a non-finite value, is refused.
        assert!(encode(&w[..300], 10, 30, rpb, GgmlType::Q4_0, None).is_err());
        let mut bad = w.clone();
        bad[5] = f32::NAN;
        assert!(encode(&bad, rows, cols, rpb, GgmlType::Q4_0, None).is_err());
    }
}
