//! Passthrough codec: each block payload is the source bytes of its rows, untouched
//! (f32 / f16 / bf16 little-endian, whole ggml blocks, or a plain type's elements), so
//! a round trip is bit-exact.
//! Decoding converts to f32; the global blob is empty.

use super::{blocks_of, le, CodecError, EncodedTensor, TensorCodec};
use crate::model::SourceType;

/// Bytes of one row of `cols` elements in `format`.
pub(super) fn row_bytes(format: SourceType, cols: u64) -> Result<u64, CodecError> {
    let r = match format {
        SourceType::F32 => cols.checked_mul(4),
        SourceType::F16 | SourceType::BF16 => cols.checked_mul(2),
        SourceType::Plain(p) => cols.checked_mul(p.size()),
        SourceType::Ggml(ty) => {
            return ty.row_bytes(cols).ok_or_else(|| {
                CodecError::Params(format!(
                    "{ty:?}: a row of {cols} elements is not a whole number of blocks"
                ))
            })
        }
    };
    r.ok_or_else(|| CodecError::Params(format!("{cols} cols of {format:?} overflows")))
}

pub(super) fn encode(
    raw: &[u8],
    format: SourceType,
    rows: u64,
    cols: u64,
    rows_per_block: u64,
) -> Result<EncodedTensor, CodecError> {
    if rows_per_block == 0 {
        return Err(CodecError::Params("rows_per_block must be ≥ 1".into()));
    }
    let rb = row_bytes(format, cols)?;
    let need = rb
        .checked_mul(rows)
        .ok_or_else(|| CodecError::Params(format!("{rows} rows × {rb} bytes overflows")))?;
    if need != raw.len() as u64 {
        return Err(CodecError::Params(format!(
            "{format:?} tensor of {rows}×{cols} needs {need} bytes, got {}",
            raw.len()
        )));
    }
    let rb = rb as usize;
    let blocks = blocks_of(rows, rows_per_block)
        .map(|(first, n)| raw[first as usize * rb..(first + n) as usize * rb].to_vec())
        .collect();
    Ok(EncodedTensor {
        codec: TensorCodec::Passthrough { format },
        global: Vec::new(),
        blocks,
        rel_err: 0.0,
    })
}

/// The source bytes of rows `r0..r1` of a block of `block_rows` rows (`r0 ≤ r1 ≤
/// block_rows`, checked by the caller).
pub(super) fn raw_rows(
    format: SourceType,
    payload: &[u8],
    block_rows: u64,
    cols: usize,
    r0: u64,
    r1: u64,
) -> Result<&[u8], CodecError> {
    let rb = row_bytes(format, cols as u64)?;
    let need = rb.checked_mul(block_rows);
    if need != Some(payload.len() as u64) {
        return Err(CodecError::Corrupt(format!(
            "passthrough {format:?} block of {block_rows} rows × {cols} cols has {} bytes, expected {}",
            payload.len(),
            need.map_or_else(|| "an overflowing count".to_string(), |n| n.to_string())
        )));
    }
    // r0 ≤ r1 ≤ block_rows was checked, and the payload holds block_rows rows.
    Ok(&payload[(r0 * rb) as usize..(r1 * rb) as usize])
}

pub(super) fn decode_rows(
    format: SourceType,
    payload: &[u8],
    block_rows: u64,
    cols: usize,
    r0: u64,
    r1: u64,
    out: &mut [f32],
) -> Result<(), CodecError> {
    let bytes = raw_rows(format, payload, block_rows, cols, r0, r1)?;
    if let SourceType::Ggml(ty) = format {
        if !crate::gguf::quant::is_supported(ty) {
            return Err(CodecError::Corrupt(format!(
                "passthrough {ty:?} rows cannot be dequantized"
            )));
        }
    }
    decode_checked(format, bytes, cols, out);
    Ok(())
}

/// Source bytes of whole rows (as [`raw_rows`] returns them: whole ggml blocks per row,
/// a supported type) to f32.
pub(super) fn decode_checked(format: SourceType, bytes: &[u8], cols: usize, out: &mut [f32]) {
    match format {
        SourceType::F32 => le::f32s_from_le(bytes, out),
        SourceType::F16 => le::f16s_to_f32(bytes, out),
        SourceType::BF16 => le::bf16s_to_f32(bytes, out),
        SourceType::Plain(p) => p.to_f32(bytes, out),
        SourceType::Ggml(ty) => {
            let Some(rb) = ty.row_bytes(cols as u64) else {
                unreachable!("raw_rows checked that rows are whole {ty:?} blocks")
            };
            if cols > 0 {
                for (row_out, row_in) in out
                    .chunks_exact_mut(cols)
                    .zip(bytes.chunks_exact(rb as usize))
                {
                    crate::gguf::quant::dequantize(ty, row_in, row_out)
                        .expect("raw_rows checked the row sizes and the type is supported");
                }
            }
        }
    }
}

pub(super) fn apply(
    format: SourceType,
    payload: &[u8],
    block_rows: u64,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<(), CodecError> {
    let mut row = vec![0f32; cols];
    for (i, yi) in y.iter_mut().enumerate() {
        let i = i as u64;
        decode_rows(format, payload, block_rows, cols, i, i + 1, &mut row)?;
        *yi = row.iter().zip(x).map(|(a, b)| a * b).sum();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use crate::gguf::GgmlType;
    use crate::model::SourceType;

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32) * 0.731).sin() * 3.0 + i as f32 * 1e-3)
            .collect()
    }

    fn roundtrip(format: SourceType, raw: &[u8], want: &[f32], rows: u64, cols: u64) {
        for rpb in [1u64, 3, 4, 100] {
            let enc = encode_passthrough(raw, format, rows, cols, rpb).unwrap();
            assert_eq!(enc.rel_err, 0.0);
            assert!(enc.global.is_empty());
            assert_eq!(enc.blocks.concat(), raw, "blocks are the source bytes");
            let g = decode_global(&enc.codec, &enc.global, rows, cols).unwrap();
            let x: Vec<f32> = (0..cols).map(|j| j as f32 - 2.0).collect();
            for (b, p) in enc.blocks.iter().enumerate() {
                let (s, e) = block_row_range(rows, rpb, b as u64);
                // Every sub-range of the block, bit-exact.
                for r0 in 0..e - s {
                    for r1 in r0..=e - s {
                        let mut out = vec![f32::NAN; ((r1 - r0) * cols) as usize];
                        decode_block_rows(&enc.codec, &g, p, s, e - s, cols, r0, r1, &mut out)
                            .unwrap();
                        let w = &want[((s + r0) * cols) as usize..((s + r1) * cols) as usize];
                        assert!(out.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()));
                    }
                }
                let mut y = vec![0f32; (e - s) as usize];
                apply_block(&enc.codec, &g, p, s, e - s, cols, &x, &mut y).unwrap();
                for (i, yi) in y.iter().enumerate() {
                    let row = &want[((s + i as u64) * cols) as usize..][..cols as usize];
                    let d: f32 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
                    assert_eq!(*yi, d);
                }
                // Truncated or extended payloads are errors.
                let mut out = vec![0f32; cols as usize];
                assert!(decode_block_rows(
                    &enc.codec,
                    &g,
                    &p[..p.len() - 1],
                    s,
                    e - s,
                    cols,
                    0,
                    1,
                    &mut out
                )
                .is_err());
                let mut longer = p.clone();
                longer.push(0);
                assert!(
                    decode_block_rows(&enc.codec, &g, &longer, s, e - s, cols, 0, 1, &mut out)
                        .is_err()
                );
            }
        }
    }

    #[test]
    fn f32_f16_bf16_are_bit_exact() {
        let (rows, cols) = (7u64, 5u64);
        let v = values((rows * cols) as usize);
        let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        roundtrip(SourceType::F32, &raw, &v, rows, cols);

        let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
        let raw: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
        let want: Vec<f32> = h.iter().map(|x| x.to_f32()).collect();
        roundtrip(SourceType::F16, &raw, &want, rows, cols);

        let b: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let raw: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
        let want: Vec<f32> = b.iter().map(|x| x.to_f32()).collect();
        roundtrip(SourceType::BF16, &raw, &want, rows, cols);
    }

    #[test]
    fn bad_arguments_are_errors() {
        let raw = vec![0u8; 4 * 6];
        assert!(encode_passthrough(&raw, SourceType::F32, 2, 4, 1).is_err());
        assert!(encode_passthrough(&raw, SourceType::F32, 2, 3, 0).is_err());
        // Q8_0 rows must be whole 32-element blocks.
        assert!(encode_passthrough(&raw, SourceType::Ggml(GgmlType::Q8_0), 1, 12, 1).is_err());
        let enc = encode_passthrough(&raw, SourceType::F32, 2, 3, 1).unwrap();
        let g = decode_global(&enc.codec, &enc.global, 2, 3).unwrap();
        assert!(decode_global(&enc.codec, &[1], 2, 3).is_err());
        let mut out = vec![0f32; 3];
        // Row range past the block, wrong output size.
        assert!(
            decode_block_rows(&enc.codec, &g, &enc.blocks[0], 0, 1, 3, 1, 2, &mut out).is_err()
        );
        assert!(
            decode_block_rows(&enc.codec, &g, &enc.blocks[0], 0, 1, 3, 0, 1, &mut out[..2])
                .is_err()
        );
        // A global decoded for the other codec.
        let ndsq = TensorCodec::Ndsq {
            rank: 0,
            pq_dim: 1,
            pq_k: 1,
            outlier_q: 1.0,
            sq: None,
        };
        assert!(decode_block_rows(&ndsq, &g, &enc.blocks[0], 0, 1, 3, 0, 1, &mut out).is_err());
    }
}
