//! ggml quantizers: f32 values into ggml blocks, byte-identical to what llama.cpp's
//! `llama-quantize` writes when it has no importance matrix. Pure functions over
//! slices; nothing here knows about files or caches.
//!
//! Without an imatrix, `ggml_quantize_chunk` (ggml.c) sends every type handled here to
//! ggml's reference quantizer, `quantize_row_<type>_ref` in `ggml-quants.c` (for Q8_0
//! even with one), and F16/BF16 to `GGML_FP32_TO_FP16` / `ggml_compute_fp32_to_bf16`.
//! This module reimplements those, following the reference (llama.cpp as vendored in
//! llama-cpp-python 0.3.36) operation by operation:
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
//! tests/clients/test_quantizers.py checks the bytes against the library itself.

use crate::gguf::quant::QuantError;
use crate::gguf::GgmlType;

/// Whether [`quantize`] handles this type.
pub fn can_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K
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
    let blocks = src.chunks_exact(be).zip(out.chunks_exact_mut(bb));
    match ty {
        GgmlType::F32 => {
            for (x, y) in src.iter().zip(out.chunks_exact_mut(4)) {
                y.copy_from_slice(&x.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (x, y) in src.iter().zip(out.chunks_exact_mut(2)) {
                y.copy_from_slice(&fp32_to_fp16(*x).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (x, y) in src.iter().zip(out.chunks_exact_mut(2)) {
                y.copy_from_slice(&fp32_to_bf16(*x).to_le_bytes());
            }
        }
        GgmlType::Q4_0 => blocks.for_each(|(x, y)| q4_0(x, y)),
        GgmlType::Q4_1 => blocks.for_each(|(x, y)| q4_1(x, y)),
        GgmlType::Q5_0 => blocks.for_each(|(x, y)| q5_0(x, y)),
        GgmlType::Q5_1 => blocks.for_each(|(x, y)| q5_1(x, y)),
        GgmlType::Q8_0 => blocks.for_each(|(x, y)| q8_0(x, y)),
        GgmlType::Q2_K => blocks.for_each(|(x, y)| q2_k(x, y)),
        GgmlType::Q3_K => blocks.for_each(|(x, y)| q3_k(x, y)),
        GgmlType::Q4_K => blocks.for_each(|(x, y)| q4_k(x, y)),
        GgmlType::Q5_K => blocks.for_each(|(x, y)| q5_k(x, y)),
        GgmlType::Q6_K => blocks.for_each(|(x, y)| q6_k(x, y)),
        GgmlType::Q8_1 | GgmlType::Q8_K => unreachable!("rejected by can_quantize"),
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

/// Minimum and maximum as the reference's `if (v < min) min = v; if (v > max) max = v;`
/// from (FLT_MAX, -FLT_MAX).
#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

// ---------------------------------------------------------------------------------
// 32-element types (ggml's `quantize_row_q{4,5,8}_{0,1}_ref`).

/// Q8_0: f16 d = amax/127, then 32 × i8 round(x/d) (half away from zero).
fn q8_0(x: &[f32], y: &mut [u8]) {
    // MAX(a, b) is `a > b ? a : b`.
    let amax = x
        .iter()
        .fold(0f32, |a, v| if a > v.abs() { a } else { v.abs() });
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    for (q, &v) in y[2..34].iter_mut().zip(x) {
        *q = c_f32_to_i8((v * id).round()) as u8;
    }
}

/// Q4_0: d = max/-8 (max: the signed value of largest magnitude), q = min(15, x/d + 8.5)
/// truncated; low nibbles hold elements 0..16, high nibbles 16..32.
fn q4_0(x: &[f32], y: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    let q = |v: f32| (c_f32_to_i8(v * id + 8.5) as i32).min(15) as u8;
    for j in 0..16 {
        y[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

/// Q4_1: d = (max-min)/15, m = min, q = min(15, (x-min)/d + 0.5) truncated.
fn q4_1(x: &[f32], y: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    put_f16(y, 2, min);
    let q = |v: f32| (c_f32_to_i8((v - min) * id + 0.5) as i32).min(15) as u8;
    for j in 0..16 {
        y[4 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

/// Q5 nibbles and fifth bits: element j's bit 4 goes to bit j of `qh`.
#[inline]
fn pack_q5(q: impl Fn(f32) -> u8, x: &[f32], qs: &mut [u8]) -> u32 {
    let mut qh = 0u32;
    for j in 0..16 {
        let (a, b) = (q(x[j]), q(x[j + 16]));
        qs[j] = (a & 0x0F) | ((b & 0x0F) << 4);
        qh |= (((a & 0x10) >> 4) as u32) << j;
        qh |= (((b & 0x10) >> 4) as u32) << (j + 16);
    }
    qh
}

/// Q5_0: d = max/-16, q = min(31, x/d + 16.5) truncated.
fn q5_0(x: &[f32], y: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    let q = |v: f32| (c_f32_to_i8(v * id + 16.5) as i32).min(31) as u8;
    let qh = pack_q5(q, x, &mut y[6..22]);
    y[2..6].copy_from_slice(&qh.to_le_bytes());
}

/// Q5_1: d = (max-min)/31, m = min, q = (x-min)/d + 0.5 truncated (no clamp).
fn q5_1(x: &[f32], y: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    put_f16(y, 2, min);
    let q = |v: f32| c_f32_to_i32((v - min) * id + 0.5) as u8;
    let qh = pack_q5(q, x, &mut y[8..24]);
    y[4..8].copy_from_slice(&qh.to_le_bytes());
}

// ---------------------------------------------------------------------------------
// K-quants: 256-element super-blocks of 16- or 32-element sub-blocks.

/// ggml's `make_qkx2_quants`: an asymmetric fit `x ≈ scale·L + min` (L in 0..=nmax,
/// min ≤ 0) by a grid search over `nstep + 1` trial inverse scales around
/// `nmax/(max-min)`, each refined by weighted least squares and kept when its
/// weighted error (squared, or absolute with `use_mad`) is strictly smaller.
/// Returns (scale, -min) and leaves the chosen levels in `l`.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    w: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        best_error += w[i] * err(scale * q as f32 + min - x[i]);
    }
    let mut laux = [0u8; 32];
    let laux = &mut laux[..n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let q = q as f32;
            sum_l += w[i] * q;
            sum_l2 += w[i] * q * q;
            sum_xl += w[i] * q * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                cur_error += w[i] * err(this_scale * laux[i] as f32 + this_min - x[i]);
            }
            if cur_error < best_error {
                l.copy_from_slice(laux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with `rmse_type` 1 and no weights (so w = x²): a symmetric
/// fit `x ≈ scale·(L - nmax)` searched over 19 inverse scales around `-nmax/max`.
/// Levels (0..2·nmax) go to `l`.
fn make_qx_quants_rmse1(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let (amax, max) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let mut iscale = -(nmax as f32) / max;
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for (li, &v) in l.iter_mut().zip(x) {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *li = (q + nmax) as u8;
        let w = v * v;
        let q = q as f32;
        sumlx += w * v * q;
        suml2 += w * q * q;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (li, &v) in l.iter_mut().zip(x) {
                *li = (nmax + nearest_int(iscale * v).clamp(-nmax, nmax - 1)) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with `do_rmse`: a symmetric fit refined by up to five
/// passes of single-level moves. Levels (0..2·nmax) go to `l`.
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (amax, max) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for (li, &v) in l.iter_mut().zip(x) {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *li = q as i8;
        let w = v * v;
        let q = q as f32;
        sumlx += w * v * q;
        suml2 += w * q * q;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (li, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let old = *li as f32;
            let mut slx = sumlx - w * v * old;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * old * old;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *li as i32 {
                    let nl = new_l as f32;
                    slx += w * v * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *li = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for li in l.iter_mut() {
        *li += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Q4_K/Q5_K's 12-byte field of eight 6-bit (scale, min) pairs.
fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8], sc: &mut [u8]) {
    for j in 0..8 {
        if j < 4 {
            sc[j] = ls[j];
            sc[j + 4] = lm[j];
        } else {
            sc[j + 4] = (ls[j] & 0x0F) | ((lm[j] & 0x0F) << 4);
            sc[j - 4] |= (ls[j] >> 4) << 6;
            sc[j] |= (lm[j] >> 4) << 6;
        }
    }
}

/// The (scale, min) pair `j` of that field (ggml's `get_scale_min_k4`).
#[inline]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The shared part of Q4_K and Q5_K: per 32-element sub-block an asymmetric fit,
/// scales and mins quantized to 6 bits against f16 super-scales `d` and `dmin`
/// (written to y[0..16]), then every level recomputed against the quantized scales.
fn k4_levels(nmax: i32, rmin: f32, nstep: i32, x: &[f32], y: &mut [u8], l: &mut [u8; 256]) {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut weights = [0f32; 32];
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
            false,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    pack_scale_min_k4(&ls, &lm, &mut y[4..16]);
    put_f16(y, 0, max_scale / 63.0);
    put_f16(y, 2, max_min / 63.0);
    let (d_all, dmin_all) = (f16_at(y, 0), f16_at(y, 2));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &y[4..16]);
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * m as f32;
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
}

/// Q4_K: f16 d, f16 dmin, scales[12], qs[128] (chunk c of 64 elements: low nibbles
/// elements 64c..64c+32, high nibbles the next 32).
fn q4_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; 256];
    k4_levels(15, -1.0, 20, x, y, &mut l);
    for c in 0..4 {
        for i in 0..32 {
            y[16 + 32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
        }
    }
}

/// Q5_K: f16 d, f16 dmin, scales[12], qh[32] (bit 2c / 2c+1 of qh[i]: fifth bit of
/// element 64c+i / 64c+32+i), qs[128] as Q4_K.
fn q5_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; 256];
    k4_levels(31, -0.5, 15, x, y, &mut l);
    y[16..48].fill(0);
    for c in 0..4 {
        for i in 0..32 {
            let (a, b) = (l[64 * c + i], l[64 * c + 32 + i]);
            y[16 + i] |= ((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1));
            y[48 + 32 * c + i] = (a & 0x0F) | ((b & 0x0F) << 4);
        }
    }
}

/// Q6_K: ql[128], qh[64], scales[16] (i8), f16 d. Per 16-element sub-block a symmetric
/// fit; scales quantized to i8 against d = max_scale/-128.
fn q6_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 16];
    let mut max_scale = 0f32;
    let mut max_abs_scale = 0f32;
    for ib in 0..16 {
        let s = make_qx_quants_rmse1(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        scales[ib] = s;
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        y.fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    put_f16(y, 208, 1.0 / iscale);
    for ib in 0..16 {
        y[192 + ib] = nearest_int(iscale * scales[ib]).min(127) as u8;
    }
    let d_all = f16_at(y, 208);
    for j in 0..16 {
        let d = d_all * (y[192 + j] as i8) as f32;
        if d == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            l[i] = (nearest_int(x[i] / d).clamp(-32, 31) + 32) as u8;
        }
    }
    for h in 0..2 {
        let l = &l[128 * h..128 * h + 128];
        let (ql, qh) = y.split_at_mut(128);
        let ql = &mut ql[64 * h..64 * h + 64];
        let qh = &mut qh[32 * h..32 * h + 32];
        for i in 0..32 {
            ql[i] = (l[i] & 0x0F) | ((l[i + 64] & 0x0F) << 4);
            ql[i + 32] = (l[i + 32] & 0x0F) | ((l[i + 96] & 0x0F) << 4);
            qh[i] = (l[i] >> 4)
                | ((l[i + 32] >> 4) << 2)
                | ((l[i + 64] >> 4) << 4)
                | ((l[i + 96] >> 4) << 6);
        }
    }
}

/// Q2_K/Q3_K's 2-bit field: byte 32h+i holds elements 128h+i+32k in bits 2k..2k+2.
fn pack_2bit(l: &[u8; 256], qs: &mut [u8]) {
    for h in 0..2 {
        for i in 0..32 {
            let e = 128 * h + i;
            qs[32 * h + i] = l[e] | (l[e + 32] << 2) | (l[e + 64] << 4) | (l[e + 96] << 6);
        }
    }
}

/// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], f16 d, f16 dmin.
fn q2_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    let mut weights = [0f32; 16];
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        let (s, m) = make_qkx2_quants(
            3,
            xs,
            &weights,
            &mut l[16 * j..16 * j + 16],
            -0.5,
            0.1,
            15,
            true,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for j in 0..16 {
            y[j] = nearest_int(iscale * scales[j]) as u8;
        }
        put_f16(y, 80, max_scale / 15.0);
    } else {
        y[..16].fill(0);
        put_f16(y, 80, 0.0);
    }
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for j in 0..16 {
            y[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        put_f16(y, 82, max_min / 15.0);
    } else {
        put_f16(y, 82, 0.0);
    }
    let (d_all, dmin_all) = (f16_at(y, 80), f16_at(y, 82));
    for (j, &s) in y[..16].iter().enumerate() {
        let d = d_all * (s & 0x0F) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * (s >> 4) as f32;
        for i in 16 * j..16 * j + 16 {
            l[i] = nearest_int((x[i] + dm) / d).clamp(0, 3) as u8;
        }
    }
    pack_2bit(&l, &mut y[16..80]);
}

/// Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales, biased by 32), f16 d.
fn q3_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    let mut max_scale = 0f32;
    let mut amax = 0f32;
    for j in 0..16 {
        let s = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
        scales[j] = s;
        if s.abs() > amax {
            amax = s.abs();
            max_scale = s;
        }
    }
    let sc = &mut y[96..108];
    sc.fill(0);
    // `if (max_scale)`: true for NaN too.
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (j, &s) in scales.iter().enumerate() {
            let q = ((nearest_int(iscale * s) as i8) as i32).clamp(-32, 31) + 32;
            if j < 8 {
                sc[j] = (q & 0x0F) as u8;
            } else {
                sc[j - 8] |= ((q & 0x0F) << 4) as u8;
            }
            sc[j % 4 + 8] |= ((q >> 4) << (2 * (j / 4))) as u8;
        }
        put_f16(y, 108, 1.0 / iscale);
    } else {
        put_f16(y, 108, 0.0);
    }
    let d_all = f16_at(y, 108);
    for j in 0..16 {
        let sc = &y[96..108];
        let lo = if j < 8 { sc[j] & 0x0F } else { sc[j - 8] >> 4 };
        let s = (lo | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) as i32 - 32;
        let d = d_all * s as f32;
        if d == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            l[i] = (nearest_int(x[i] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    // High bit of element j goes to bit j/32 of hmask[j%32].
    y[..32].fill(0);
    let mut lu = [0u8; 256];
    for (j, (&v, u)) in l.iter().zip(lu.iter_mut()).enumerate() {
        let mut v = v as u8;
        if v > 3 {
            y[j % 32] |= 1 << (j / 32);
            v -= 4;
        }
        *u = v;
    }
    pack_2bit(&lu, &mut y[32..96]);
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
