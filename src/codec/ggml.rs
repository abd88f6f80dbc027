//! The ggml-block codec: each row rounded at conversion into a ggml type's blocks
//! (`gguf::fit`, weighted by the importance of each column), stored as those blocks.
//! The payload is laid out as a passthrough ggml payload of that type, so reading is
//! the same (docs/CODECS.md, "ggml blocks"); a GGUF view serves the blocks as they are.

use faer::linalg::solvers::DenseSolveCore;
use faer::{Accum, Mat, MatMut, MatRef, Par, Side};
use rayon::prelude::*;

use super::{blocks_of, ndsq, CodecError, EncodedTensor, TensorCodec};
use crate::gguf::{fit, GgmlType};

/// Whether tensors of `cols` columns can be coded as `ty`.
pub fn fits(ty: GgmlType, cols: u64) -> bool {
    fit::can_fit(ty) && cols > 0 && cols % ty.block().0 == 0
}

/// Refuses a width `ty`'s blocks do not divide and values that are not finite.
fn check_values(w: &[f32], cols: u64, ty: GgmlType) -> Result<(), CodecError> {
    if !fits(ty, cols) {
        return Err(CodecError::Params(format!(
            "{ty:?} cannot code rows of {cols} values"
        )));
    }
    match w.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(CodecError::Params(format!(
            "value {} at {i} is not finite",
            w[i]
        ))),
        None => Ok(()),
    }
}

/// Refuses a value count other than `rows × cols` and empty row blocks.
fn check_shape(w: &[f32], rows: u64, cols: u64, rows_per_block: u64) -> Result<(), CodecError> {
    if rows_per_block == 0 {
        return Err(CodecError::Params("rows_per_block must be ≥ 1".into()));
    }
    if rows.checked_mul(cols) != Some(w.len() as u64) {
        return Err(CodecError::Params(format!(
            "{rows}×{cols} tensor given {} values",
            w.len()
        )));
    }
    Ok(())
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
    check_values(w, cols, ty)?;
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

/// Damping added to H's diagonal before inverting it, as a fraction of its mean
/// (GPTQ's 1 %): keeps the inverse well-conditioned where inputs are nearly collinear.
const DAMP: f64 = 0.01;

/// Rows rounded into `ty`'s blocks with error feedback across columns (GPTQ/OPTQ with
/// whole blocks): `h` is the `cols × cols` second moment of the layer's inputs. Blocks
/// are fitted in column order, each row's block by [`fit::fit`] weighted by H's
/// diagonal; then the columns not yet rounded are corrected for the block's error,
/// `W[:, rest] −= E · U[block, rest]` with `E = (W − Ŵ)[:, block] · U[block, block]⁻¹`
/// and `U` the upper Cholesky factor of H⁻¹, which is the least-squares compensation
/// of that error for the layer's outputs over the calibration inputs.
fn round_rows_feedback(
    w: &[f32],
    cols: u64,
    ty: GgmlType,
    h: &[f32],
) -> Result<Vec<u8>, CodecError> {
    check_values(w, cols, ty)?;
    let n = cols as usize;
    if h.len() != n * n {
        return Err(CodecError::Params(format!(
            "{} calibration values for {n} columns",
            h.len()
        )));
    }
    let rows = w.len() / n;
    let u = upper_of_inverse(h, n)?;
    let diag: Vec<f32> = (0..n).map(|i| h[i * n + i].max(0.0)).collect();
    let weights = ndsq::column_weights(&diag, n)?.unwrap_or_else(|| vec![1.0; n]);
    let (be, bb) = ty.block();
    let (be, bb) = (be as usize, bb as usize);
    let rb = n / be * bb;
    let mut wk = w.to_vec();
    let mut out = vec![0u8; rows * rb];
    let mut e = vec![0f32; rows * be];
    for (b, j0) in (0..n).step_by(be).enumerate() {
        let j1 = j0 + be;
        out.par_chunks_mut(rb)
            .zip(wk.par_chunks(n))
            .try_for_each(|(o, x)| {
                fit::fit(
                    ty,
                    &x[j0..j1],
                    &weights[j0..j1],
                    &mut o[b * bb..(b + 1) * bb],
                )
            })
            .map_err(|e| CodecError::Params(e.to_string()))?;
        if j1 == n {
            break;
        }
        e.par_chunks_mut(be)
            .zip(wk.par_chunks(n))
            .zip(out.par_chunks(rb))
            .for_each(|((e, x), o)| {
                let mut q = vec![0f32; be];
                crate::gguf::quant::dequantize(ty, &o[b * bb..(b + 1) * bb], &mut q)
                    .expect("whole blocks");
                for j in 0..be {
                    let mut v = x[j0 + j] - q[j];
                    for i in 0..j {
                        v -= e[i] * u[(j0 + i, j0 + j)];
                    }
                    e[j] = v / u[(j0 + j, j0 + j)];
                }
            });
        let dst = MatMut::from_row_major_slice_mut(&mut wk, rows, n);
        faer::linalg::matmul::matmul(
            dst.subcols_mut(j1, n - j1),
            Accum::Add,
            MatRef::from_row_major_slice(&e, rows, be),
            u.as_ref().submatrix(j0, j1, be, n - j1),
            -1.0f32,
            Par::rayon(0),
        );
    }
    Ok(out)
}

/// The upper Cholesky factor U of (H + damping)⁻¹ (H⁻¹ = UᵀU), in f32. Columns no input
/// ever reached (zero diagonal) are given a unit diagonal, as GPTQ does.
fn upper_of_inverse(h: &[f32], n: usize) -> Result<Mat<f32>, CodecError> {
    let mut hm = Mat::<f64>::from_fn(n, n, |i, j| h[i * n + j] as f64);
    let mean = (0..n).map(|i| hm[(i, i)]).sum::<f64>() / n.max(1) as f64;
    if !(mean > 0.0 && mean.is_finite()) {
        return Err(CodecError::Params(
            "calibration matrix has no positive diagonal".into(),
        ));
    }
    for i in 0..n {
        if hm[(i, i)] <= 0.0 {
            hm[(i, i)] = mean;
        }
        hm[(i, i)] += DAMP * mean;
    }
    let not_pd = |_| CodecError::Params("calibration matrix is not positive definite".into());
    let hinv = hm.llt(Side::Lower).map_err(not_pd)?.inverse();
    let l = hinv.llt(Side::Lower).map_err(not_pd)?;
    let l = l.L();
    Ok(Mat::<f32>::from_fn(n, n, |i, j| {
        if j >= i {
            l[(j, i)] as f32
        } else {
            0.0
        }
    }))
}

/// [`encode`] with error feedback from the calibration inputs' second moment `h`
/// ([`round_rows_feedback`]).
pub(super) fn encode_feedback(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    ty: GgmlType,
    h: &[f32],
) -> Result<EncodedTensor, CodecError> {
    check_shape(w, rows, cols, rows_per_block)?;
    let bytes = round_rows_feedback(w, cols, ty, h)?;
    finish(w, rows, rows_per_block, ty, bytes)
}

pub(super) fn encode(
    w: &[f32],
    rows: u64,
    cols: u64,
    rows_per_block: u64,
    ty: GgmlType,
    importance: Option<&[f32]>,
) -> Result<EncodedTensor, CodecError> {
    check_shape(w, rows, cols, rows_per_block)?;
    let bytes = round_rows(w, cols, ty, importance)?;
    finish(w, rows, rows_per_block, ty, bytes)
}

/// The encoded tensor of rows rounded into `bytes`.
fn finish(
    w: &[f32],
    rows: u64,
    rows_per_block: u64,
    ty: GgmlType,
    bytes: Vec<u8>,
) -> Result<EncodedTensor, CodecError> {
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

#[cfg(test)]
mod feedback_tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// `tr(ΔW H ΔWᵀ)`: the layer's output error over the calibration inputs.
    fn output_err(w: &[f32], bytes: &[u8], ty: GgmlType, h: &[f32], n: usize) -> f64 {
        let mut y = vec![0f32; w.len()];
        crate::gguf::quant::dequantize(ty, bytes, &mut y).unwrap();
        let d: Vec<f64> = w.iter().zip(&y).map(|(a, b)| (a - b) as f64).collect();
        d.chunks(n)
            .map(|r| {
                (0..n)
                    .map(|i| {
                        (0..n)
                            .map(|j| r[i] * h[i * n + j] as f64 * r[j])
                            .sum::<f64>()
                    })
                    .sum::<f64>()
            })
            .sum()
    }

    /// With correlated inputs, feeding each block's error forward leaves the layer's
    /// outputs closer than rounding every block on its own (weighted by the same
    /// diagonal), for one-scale, affine and super-block types alike.
    #[test]
    fn feedback_lowers_the_output_error() {
        let (rows, n, samples) = (32usize, 512usize, 1024usize);
        let mut seed = 7u64;
        let w: Vec<f32> = (0..rows * n).map(|_| lcg(&mut seed)).collect();
        // Inputs with a shared component: neighbouring columns correlate.
        let x: Vec<f32> = (0..samples)
            .flat_map(|_| {
                let common = lcg(&mut seed);
                (0..n)
                    .map(|j| common * (1.0 + (j % 7) as f32) + 0.3 * lcg(&mut seed))
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut h = vec![0f32; n * n];
        for s in x.chunks(n) {
            for i in 0..n {
                for j in 0..n {
                    h[i * n + j] += s[i] * s[j] / samples as f32;
                }
            }
        }
        let diag: Vec<f32> = (0..n).map(|i| h[i * n + i]).collect();
        for ty in [
            GgmlType::Q4_0,
            GgmlType::IQ4_NL,
            GgmlType::Q4_1,
            GgmlType::Q4_K,
        ] {
            let fb = round_rows_feedback(&w, n as u64, ty, &h).unwrap();
            let plain = round_rows(&w, n as u64, ty, Some(&diag)).unwrap();
            let (a, b) = (
                output_err(&w, &fb, ty, &h, n),
                output_err(&w, &plain, ty, &h, n),
            );
            assert!(a < 0.8 * b, "{ty:?}: feedback {a} vs plain {b}");
        }
        // A matrix of the wrong size, or not positive definite, is refused.
        assert!(round_rows_feedback(&w, n as u64, GgmlType::Q4_0, &h[1..]).is_err());
        let zero = vec![0f32; n * n];
        assert!(round_rows_feedback(&w, n as u64, GgmlType::Q4_0, &zero).is_err());
    }
}
