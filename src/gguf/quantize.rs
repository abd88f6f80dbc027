//! ggml quantizers: f32 values into ggml blocks, byte-identical to what llama.cpp's
//! `llama-quantize` writes when it has no importance matrix (IQ4_NL and IQ4_XS: `iq4`,
//! ggml's `quantize_iq4_nl`/`quantize_iq4_xs`, which it calls for them). Pure functions over
//! slices; nothing here knows about files or caches. Block layouts, what is reproduced
//! and how it is checked: docs/GGML.md.
//!
//! Without an imatrix, `ggml_quantize_chunk` (ggml.c) sends every type handled here to
//! ggml's reference quantizer, `quantize_row_<type>_ref` in `ggml-quants.c` (for Q8_0
//! even with one), and F16/BF16 to `GGML_FP32_TO_FP16` / `ggml_compute_fp32_to_bf16`.
//! `reference` reimplements those (llama.cpp as vendored in llama-cpp-python 0.3.36)
//! operation by operation:
//! - the same float operations in the same order, never fused (ggml-base is built
//!   without `-march`, so no FMA; Rust never contracts either), every sum accumulated
//!   in the reference's order;
//! - `nearest_int` by the same add-a-magic-constant trick, kept even where it leaves
//!   its range (the assert is compiled out), so huge inputs give the same bytes;
//! - C's float-to-small-int conversions as x86-64 does them: `cvttss2si` into 32 bits
//!   (0x8000_0000 for NaN and out-of-range), then truncation to 8 bits;
//! - `MIN`/`MAX` as `a < b ? a : b`, with the reference's strict comparisons, so ties
//!   and NaNs resolve the same way.
//!
//! `fast` computes the same values arranged for SIMD (many blocks at once) and hands
//! the blocks it cannot prove it handles exactly to `reference`. The one difference C
//! itself leaves open: a NaN input in a K-quant block whose f16 scale overflowed may
//! get another level (nothing else differs; docs/GGML.md).
//!
//! tests/clients/test_quantizers.py checks the bytes against ggml's library itself.

use crate::gguf::quant::QuantError;
use crate::gguf::GgmlType;

mod fast;
mod iq4;
mod lanes;
mod reference;

/// Whether [`quantize`] handles this type.
pub fn can_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | IQ4_NL
            | IQ4_XS
    )
}

/// Quantize `src` (a whole number of `ty`'s blocks: `src.len() % block_elems == 0`)
/// into `out` (exactly `src.len() / block_elems * block_bytes` bytes), byte-identical
/// to ggml's reference quantizer for `ty`.
pub fn quantize(ty: GgmlType, src: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    if !can_quantize(ty) {
        return Err(QuantError::CannotQuantize(ty));
    }
    let (be, bb) = ty.block();
    let (be, bb) = (be as usize, bb as usize);
    let n = src.len();
    if n % be != 0 {
        return Err(QuantError::PartialBlock { ty, n, block: be });
    }
    let need = (n / be).saturating_mul(bb);
    if out.len() != need {
        return Err(QuantError::Size {
            ty,
            n,
            need,
            got: out.len(),
        });
    }
    match ty {
        GgmlType::F32 => {
            for (x, y) in src.iter().zip(out.chunks_exact_mut(4)) {
                y.copy_from_slice(&x.to_le_bytes());
            }
        }
        GgmlType::F16 => fast::f16(src, out),
        GgmlType::BF16 => fast::bf16(src, out),
        GgmlType::Q4_0 => fast::q4_0(src, out),
        GgmlType::Q4_1 => fast::q4_1(src, out),
        GgmlType::Q5_0 => fast::q5_0(src, out),
        GgmlType::Q5_1 => fast::q5_1(src, out),
        GgmlType::Q8_0 => fast::q8_0(src, out),
        GgmlType::Q2_K => fast::q2_k(src, out),
        GgmlType::Q3_K => fast::q3_k(src, out),
        GgmlType::Q4_K => fast::q4_k(src, out),
        GgmlType::Q5_K => fast::q5_k(src, out),
        GgmlType::Q6_K => fast::q6_k(src, out),
        GgmlType::IQ4_NL => iq4::iq4_nl(src, out),
        GgmlType::IQ4_XS => iq4::iq4_xs(src, out),
        GgmlType::Q8_1
        | GgmlType::Q8_K
        | GgmlType::IQ3_XXS
        | GgmlType::IQ3_S
        | GgmlType::IQ2_S
        | GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ1_S
        | GgmlType::IQ1_M => {
            unreachable!("rejected by can_quantize")
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// Scalar helpers with ggml's exact semantics.

/// ggml's `GGML_FP32_TO_FP16` (Maratyszcza's FP16 algorithm): round to nearest even,
/// overflow to infinity, every NaN to 0x7E00 with its sign.
#[inline]
pub(crate) fn fp32_to_fp16(f: f32) -> u16 {
    let scale_to_inf = f32::from_bits(0x7780_0000); // 2^112
    let scale_to_zero = f32::from_bits(0x0880_0000); // 2^-110
    let base = (f.abs() * scale_to_inf) * scale_to_zero;
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let bias = (shl1_w & 0xFF00_0000).max(0x7100_0000);
    let base = f32::from_bits((bias >> 1) + 0x0780_0000) + base;
    let bits = base.to_bits();
    let nonsign = ((bits >> 13) & 0x7C00) + (bits & 0x0FFF);
    ((sign >> 16)
        | if shl1_w > 0xFF00_0000 {
            0x7E00
        } else {
            nonsign
        }) as u16
}

/// ggml's `GGML_FP16_TO_FP32`: exact, NaN payloads kept.
#[inline]
pub(crate) fn fp16_to_fp32(h: u16) -> f32 {
    let w = (h as u32) << 16;
    let sign = w & 0x8000_0000;
    let two_w = w.wrapping_add(w);
    let normalized = f32::from_bits((two_w >> 4) + (0xE0 << 23)) * f32::from_bits(0x0780_0000);
    let denormalized = f32::from_bits((two_w >> 17) | (126 << 23)) - 0.5;
    let v = if two_w < (1 << 27) {
        denormalized
    } else {
        normalized
    };
    f32::from_bits(sign | v.to_bits())
}

/// ggml's `ggml_compute_fp32_to_bf16`: round to nearest even; a NaN keeps its top 16
/// bits and is forced quiet (bit 6 of the bf16).
#[inline]
pub(crate) fn fp32_to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// ggml's `nearest_int`: round half to even by adding 1.5·2^23 and reading the low
/// mantissa bits. Outside ±2^22 (NaN, infinities) it returns what those bits say, as
/// the reference does once its assert is compiled out.
#[inline(always)]
fn nearest_int(f: f32) -> i32 {
    ((f + 12_582_912.0).to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// C's float-to-integer conversion as x86-64 compiles it (`cvttss2si` to 32 bits):
/// truncation, and 0x8000_0000 for NaN or out of range. Rust's `as` saturates
/// instead, which would differ when a block's scale overflows to infinity.
#[inline(always)]
fn c_f32_to_i32(f: f32) -> i32 {
    if (-2_147_483_648.0..2_147_483_648.0).contains(&f) {
        f as i32
    } else {
        i32::MIN
    }
}

/// `(int8_t)f` in C: convert to 32 bits, keep the low byte.
#[inline(always)]
fn c_f32_to_i8(f: f32) -> i8 {
    c_f32_to_i32(f) as i8
}

/// A K-quant super-block (callers slice whole ones).
#[inline(always)]
fn superblock(x: &[f32]) -> &[f32; 256] {
    x.try_into().expect("256-element super-block")
}

/// Groups this small are treated as all zero (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

#[inline]
fn put_f16(y: &mut [u8], at: usize, v: f32) {
    y[at..at + 2].copy_from_slice(&fp32_to_fp16(v).to_le_bytes());
}

#[inline]
fn f16_at(y: &[u8], at: usize) -> f32 {
    fp16_to_fp32(u16::from_le_bytes([y[at], y[at + 1]]))
}

/// The first value of largest magnitude (`amax < |v|` strictly, so the first wins a
/// tie and NaNs never do), and that magnitude.
#[inline]
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::quant::dequantize;
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const TYPES: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    fn out_len(ty: GgmlType, n: usize) -> usize {
        let (be, bb) = ty.block();
        n / be as usize * bb as usize
    }

    fn q(ty: GgmlType, x: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; out_len(ty, x.len())];
        quantize(ty, x, &mut out).unwrap();
        out
    }

    fn gaussian(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
        // Box-Muller; the distribution only needs to look like weights.
        (0..n)
            .map(|_| {
                let (u, v): (f32, f32) = (rng.random(), rng.random());
                (-2.0 * (1.0 - u).ln()).sqrt() * (std::f32::consts::TAU * v).cos() * scale
            })
            .collect()
    }

    #[test]
    fn sizes_and_unsupported_types_are_errors() {
        for ty in [GgmlType::Q8_1, GgmlType::Q8_K] {
            assert!(!can_quantize(ty));
            assert!(matches!(
                quantize(ty, &[0.0; 256], &mut [0u8; 1024]),
                Err(QuantError::CannotQuantize(_))
            ));
        }
        for ty in TYPES {
            assert!(can_quantize(ty));
            let be = ty.block().0 as usize;
            // Every input length up to two blocks and a bit, against exact, short and
            // long outputs: an error or success, never a panic.
            for n in 0..=2 * be + 1 {
                let x = vec![0.5f32; n];
                let exact = n / be * ty.block().1 as usize;
                for len in [exact, exact.saturating_sub(1), exact + 1] {
                    let mut out = vec![0u8; len];
                    let r = quantize(ty, &x, &mut out);
                    match (n % be == 0, len == exact) {
                        (true, true) => assert!(r.is_ok(), "{ty:?} {n} {len}"),
                        (false, _) => {
                            assert!(matches!(r, Err(QuantError::PartialBlock { .. })))
                        }
                        (true, false) => assert!(matches!(r, Err(QuantError::Size { .. }))),
                    }
                }
            }
        }
    }

    #[test]
    fn zeros_give_zero_blocks() {
        for ty in TYPES {
            let n = 512;
            let b = q(ty, &vec![0.0; n]);
            let mut want = vec![0u8; b.len()];
            // Q4_0/Q5_0 take d = max / -nmax with max = +0.0: d is -0.0 (f16 0x8000) and
            // every quant the offset (8, or 16 = a fifth bit alone).
            for blk in want.chunks_mut(ty.block().1 as usize) {
                match ty {
                    GgmlType::Q4_0 => {
                        blk[1] = 0x80;
                        blk[2..].fill(0x88);
                    }
                    GgmlType::Q5_0 => {
                        blk[1] = 0x80;
                        blk[2..6].fill(0xFF);
                    }
                    _ => {}
                }
            }
            assert_eq!(b, want, "{ty:?}");
            let mut y = vec![1f32; n];
            dequantize(ty, &b, &mut y).unwrap();
            assert!(y.iter().all(|&v| v == 0.0), "{ty:?}");
        }
    }

    /// Relative RMS error of a quantize → dequantize round trip on gaussian rows stays
    /// where each format's bit budget puts it (measured, with margin).
    #[test]
    fn round_trip_error() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let x = gaussian(&mut rng, 256 * 64, 0.02);
        let bounds = [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 5e-4),
            (GgmlType::BF16, 4e-3),
            (GgmlType::Q8_0, 0.01),
            (GgmlType::Q6_K, 0.03),
            (GgmlType::Q5_0, 0.06),
            (GgmlType::Q5_1, 0.05),
            (GgmlType::Q5_K, 0.05),
            (GgmlType::Q4_0, 0.12),
            (GgmlType::Q4_1, 0.1),
            (GgmlType::Q4_K, 0.1),
            (GgmlType::Q3_K, 0.25),
            (GgmlType::Q2_K, 0.45),
        ];
        let norm = x.iter().map(|v| v * v).sum::<f32>();
        for (ty, bound) in bounds {
            let b = q(ty, &x);
            let mut y = vec![0f32; x.len()];
            dequantize(ty, &b, &mut y).unwrap();
            let err = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>();
            let rel = (err / norm).sqrt();
            assert!(rel <= bound, "{ty:?}: relative error {rel} > {bound}");
        }
        // Q8_0 per element: within half a step of the block's scale.
        let b = q(GgmlType::Q8_0, &x);
        let mut y = vec![0f32; x.len()];
        dequantize(GgmlType::Q8_0, &b, &mut y).unwrap();
        for (k, blk) in b.chunks(34).enumerate() {
            let d = fp16_to_fp32(u16::from_le_bytes([blk[0], blk[1]]));
            for i in 32 * k..32 * k + 32 {
                assert!((x[i] - y[i]).abs() <= d * 0.5 + x[i].abs() * 1e-3);
            }
        }
    }

    #[test]
    fn f16_and_bf16_conversions() {
        // Round to nearest even (as `half`) for every non-NaN value on a stride that
        // visits every exponent and both ends of each mantissa; NaNs as ggml.
        let mut bits = 0u64;
        while bits <= u32::MAX as u64 {
            let f = f32::from_bits(bits as u32);
            let (h, b) = (fp32_to_fp16(f), fp32_to_bf16(f));
            if f.is_nan() {
                assert_eq!(h, 0x7E00 | ((bits >> 16) as u16 & 0x8000));
                assert_eq!(b, (bits >> 16) as u16 | 64);
            } else {
                assert_eq!(h, half::f16::from_f32(f).to_bits(), "{bits:#x}");
                assert_eq!(b, half::bf16::from_f32(f).to_bits(), "{bits:#x}");
            }
            bits += 0x1003;
        }
        for h in 0..=u16::MAX {
            let f = fp16_to_fp32(h);
            let want = half::f16::from_bits(h).to_f32();
            assert!(f.to_bits() == want.to_bits() || (f.is_nan() && want.is_nan()));
        }
    }

    /// The reference port block by block (the fast paths' oracle).
    fn reference_bytes(ty: GgmlType, x: &[f32]) -> Vec<u8> {
        let (be, bb) = ty.block();
        let mut out = vec![0u8; out_len(ty, x.len())];
        let f: fn(&[f32], &mut [u8]) = match ty {
            GgmlType::Q8_0 => reference::q8_0,
            GgmlType::Q4_0 => reference::q4_0,
            GgmlType::Q4_1 => reference::q4_1,
            GgmlType::Q5_0 => reference::q5_0,
            GgmlType::Q5_1 => reference::q5_1,
            GgmlType::Q2_K => reference::q2_k,
            GgmlType::Q3_K => reference::q3_k,
            GgmlType::Q4_K => reference::q4_k,
            GgmlType::Q5_K => reference::q5_k,
            GgmlType::Q6_K => reference::q6_k,
            GgmlType::F16 => |x, y| y.copy_from_slice(&fp32_to_fp16(x[0]).to_le_bytes()),
            GgmlType::BF16 => |x, y| y.copy_from_slice(&fp32_to_bf16(x[0]).to_le_bytes()),
            _ => |x, y| y.copy_from_slice(&x[0].to_le_bytes()),
        };
        for (x, y) in x
            .chunks_exact(be as usize)
            .zip(out.chunks_exact_mut(bb as usize))
        {
            f(x, y);
        }
        out
    }

    /// Rows of 512 values of many kinds: each kind fills whole super-blocks, and a
    /// few rows mix kinds per sub-block so lanes of one search differ.
    fn adversarial(rng: &mut ChaCha8Rng) -> Vec<f32> {
        let mut v = Vec::new();
        for scale in [1e-38, 1e-30, 1e-7, 0.02, 1.0, 300.0, 9e3, 2e4, 1e8, 1e30] {
            v.extend(gaussian(rng, 512, scale));
        }
        v.extend([0.0f32; 512]);
        v.extend((0..512).map(|i| if i % 3 == 0 { -0.0 } else { 0.0 }));
        v.extend([0.75f32; 512]);
        v.extend([-1e-20f32; 512]);
        // Outliers, one per 32 and one per 256.
        let mut o = gaussian(rng, 512, 0.02);
        for b in 0..16 {
            o[32 * b + rng.random_range(0..32)] *= 1e4;
        }
        v.extend(o);
        let mut o = gaussian(rng, 512, 0.02);
        o[rng.random_range(0..256)] = 50.0;
        o[256 + rng.random_range(0..256)] = -50.0;
        v.extend(o);
        // Ties on half-integer and small grids, all-positive, all-negative, sparse.
        v.extend((0..512).map(|_| rng.random_range(-40i32..=40) as f32 * 0.5));
        v.extend((0..512).map(|_| rng.random_range(-20i32..=20) as f32 * 0.25 + 0.5));
        v.extend(gaussian(rng, 512, 1.0).iter().map(|x| x.abs() + 0.1));
        v.extend(gaussian(rng, 512, 1.0).iter().map(|x| -x.abs()));
        v.extend((0..512).map(|i| if i % 7 == 0 { 1.0 } else { 0.0 }));
        // Any bit pattern, then specials scattered into ordinary values.
        v.extend((0..512).map(|_| f32::from_bits(rng.random::<u32>())));
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
        ];
        let mut s = gaussian(rng, 1024, 1.0);
        for _ in 0..12 {
            s[rng.random_range(0..1024)] = specials[rng.random_range(0..specials.len())];
        }
        v.extend(s);
        // One special value at every position of a block (first, middle, last, in
        // either half of the vectors the fast paths split a block into).
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.0] {
            for at in 0..256 {
                let mut b = gaussian(rng, 256, 1.0);
                b[at] = special;
                v.extend(b);
            }
        }
        // Sub-blocks of different kinds side by side.
        for _ in 0..8 {
            for _ in 0..32 {
                let scale = [0.0, 1e-30, 0.02, 1.0, 5e3, 3e4][rng.random_range(0..6)];
                v.extend(gaussian(rng, 16, scale));
            }
        }
        v
    }

    #[test]
    fn fast_paths_match_the_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let mut x = adversarial(&mut rng);
        for _ in 0..4 {
            x.extend(gaussian(&mut rng, 4096, 0.03));
        }
        // A trailing odd super-block (Q4_K/Q5_K search two at a time).
        x.extend(gaussian(&mut rng, 256, 0.5));
        for ty in TYPES {
            let want = reference_bytes(ty, &x);
            let mut portable = vec![0u8; want.len()];
            fast::portable(ty, &x, &mut portable);
            for (path, got) in [("dispatched", q(ty, &x)), ("portable", portable)] {
                let (be, bb) = (ty.block().0 as usize, ty.block().1 as usize);
                let blocks = want.chunks(bb).zip(got.chunks(bb)).zip(x.chunks(be));
                for (i, ((a, b), x)) in blocks.enumerate() {
                    if a != b && nan_meets_nan(ty, x, a) {
                        assert_same_except_nan_inputs(ty, x, a, b);
                        continue;
                    }
                    assert_eq!(a, b, "{ty:?} {path} block {i}");
                }
            }
        }
    }

    /// Where an input NaN meets a NaN the arithmetic made (a K-quant block whose f16
    /// super-scale overflowed), which one an instruction passes on depends on the
    /// order the compiler put the operands in, so the levels of NaN inputs are not
    /// determined (ggml's own build differs between elements of one unrolled loop).
    fn nan_meets_nan(ty: GgmlType, x: &[f32], block: &[u8]) -> bool {
        let scales: &[usize] = match ty {
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            GgmlType::Q6_K => &[208],
            _ => &[],
        };
        x.iter().any(|v| v.is_nan())
            && scales
                .iter()
                .any(|&o| !fp16_to_fp32(u16::from_le_bytes([block[o], block[o + 1]])).is_finite())
    }

    /// Same scales, and the same decoded value for every element whose input is not
    /// NaN (NaN equal to NaN).
    fn assert_same_except_nan_inputs(ty: GgmlType, x: &[f32], a: &[u8], b: &[u8]) {
        let (mut da, mut db) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        dequantize(ty, a, &mut da).unwrap();
        dequantize(ty, b, &mut db).unwrap();
        for i in 0..x.len() {
            let same = da[i].to_bits() == db[i].to_bits() || (da[i].is_nan() && db[i].is_nan());
            assert!(
                same || x[i].is_nan(),
                "{ty:?} element {i}: {} vs {}",
                da[i],
                db[i]
            );
        }
    }

    #[test]
    fn ggml_integer_semantics() {
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(3.5), 4);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-0.49), 0);
        assert_eq!(c_f32_to_i8(f32::INFINITY), 0);
        assert_eq!(c_f32_to_i8(f32::NAN), 0);
        assert_eq!(c_f32_to_i8(200.7), -56);
        assert_eq!(c_f32_to_i8(-3.9), -3);
    }
}
