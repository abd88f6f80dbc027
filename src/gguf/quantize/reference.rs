//! ggml's reference quantizers ported one operation at a time, block by block, with
//! nothing reordered (see the parent module for the semantics kept). The fast paths
//! (`super::fast`) use them for the blocks they do not take and share the final steps
//! of the K-quants (`*_finish`); tests use them as the oracle for the fast paths.

#[cfg(test)]
use super::c_f32_to_i32;
use super::{c_f32_to_i8, f16_at, nearest_int, put_f16, signed_absmax, GROUP_MAX_EPS};

// ---------------------------------------------------------------------------------
// 32-element types (ggml's `quantize_row_q{4,5,8}_{0,1}_ref`).

/// Q8_0: f16 d = amax/127, then 32 × i8 round(x/d) (half away from zero).
pub(super) fn q8_0(x: &[f32], y: &mut [u8]) {
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

#[cfg(test)]
/// Q4_0: d = max/-8 (max: the signed value of largest magnitude), q = min(15, x/d + 8.5)
/// truncated; low nibbles hold elements 0..16, high nibbles 16..32.
pub(super) fn q4_0(x: &[f32], y: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    let q = |v: f32| (c_f32_to_i8(v * id + 8.5) as i32).min(15) as u8;
    for j in 0..16 {
        y[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

#[cfg(test)]
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

#[cfg(test)]
/// Q4_1: d = (max-min)/15, m = min, q = min(15, (x-min)/d + 0.5) truncated.
pub(super) fn q4_1(x: &[f32], y: &mut [u8]) {
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
#[cfg(test)]
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

#[cfg(test)]
/// Q5_0: d = max/-16, q = min(31, x/d + 16.5) truncated.
pub(super) fn q5_0(x: &[f32], y: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(y, 0, d);
    let q = |v: f32| (c_f32_to_i8(v * id + 16.5) as i32).min(31) as u8;
    let qh = pack_q5(q, x, &mut y[6..22]);
    y[2..6].copy_from_slice(&qh.to_le_bytes());
}

#[cfg(test)]
/// Q5_1: d = (max-min)/31, m = min, q = (x-min)/d + 0.5 truncated (no clamp).
pub(super) fn q5_1(x: &[f32], y: &mut [u8]) {
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
pub(super) fn make_qkx2_quants(
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
pub(super) fn make_qx_quants_rmse1(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
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
pub(super) fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
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

#[cfg(test)]
/// Q4_K/Q5_K's search: per 32-element sub-block, weights `av_x + |x|` (av_x: the
/// sub-block's RMS) and an asymmetric fit.
pub(super) fn k4_search(
    nmax: i32,
    rmin: f32,
    nstep: i32,
    x: &[f32],
    scales: &mut [f32; 8],
    mins: &mut [f32; 8],
    l: &mut [u8; 256],
) {
    let mut weights = [0f32; 32];
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
        (scales[j], mins[j]) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
            false,
        );
    }
}

/// Q4_K/Q5_K after the search: scales and mins quantized to 6 bits against f16
/// super-scales `d` and `dmin` (y[0..16]), then every level recomputed against the
/// quantized scales (a sub-block whose scale rounds to 0 keeps the search's levels).
#[inline(always)]
pub(super) fn k4_finish(
    nmax: i32,
    x: &[f32; 256],
    scales: &[f32; 8],
    mins: &[f32; 8],
    l: &mut [u8; 256],
    y: &mut [u8],
) {
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for j in 0..8 {
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
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

#[cfg(test)]
/// Q4_K: f16 d, f16 dmin, scales[12], qs[128] (chunk c of 64 elements: low nibbles
/// elements 64c..64c+32, high nibbles the next 32).
pub(super) fn q4_k(x: &[f32], y: &mut [u8]) {
    let (mut scales, mut mins, mut l) = ([0f32; 8], [0f32; 8], [0u8; 256]);
    k4_search(15, -1.0, 20, x, &mut scales, &mut mins, &mut l);
    k4_finish(15, super::superblock(x), &scales, &mins, &mut l, y);
    pack_q4_k(&l, y);
}

/// Q4_K's nibbles (after y[0..16]).
#[inline(always)]
pub(super) fn pack_q4_k(l: &[u8; 256], y: &mut [u8]) {
    for c in 0..4 {
        for i in 0..32 {
            y[16 + 32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
        }
    }
}

#[cfg(test)]
/// Q5_K: f16 d, f16 dmin, scales[12], qh[32] (bit 2c / 2c+1 of qh[i]: fifth bit of
/// element 64c+i / 64c+32+i), qs[128] as Q4_K.
pub(super) fn q5_k(x: &[f32], y: &mut [u8]) {
    let (mut scales, mut mins, mut l) = ([0f32; 8], [0f32; 8], [0u8; 256]);
    k4_search(31, -0.5, 15, x, &mut scales, &mut mins, &mut l);
    k4_finish(31, super::superblock(x), &scales, &mins, &mut l, y);
    pack_q5_k(&l, y);
}

/// Q5_K's fifth bits and nibbles (after y[0..16]).
#[inline(always)]
pub(super) fn pack_q5_k(l: &[u8; 256], y: &mut [u8]) {
    y[16..48].fill(0);
    for c in 0..4 {
        for i in 0..32 {
            let (a, b) = (l[64 * c + i], l[64 * c + 32 + i]);
            y[16 + i] |= ((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1));
            y[48 + 32 * c + i] = (a & 0x0F) | ((b & 0x0F) << 4);
        }
    }
}

#[cfg(test)]
/// Q6_K: ql[128], qh[64], scales[16] (i8), f16 d. Per 16-element sub-block a symmetric
/// fit; scales quantized to i8 against d = max_scale/-128.
pub(super) fn q6_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 16];
    for (ib, s) in scales.iter_mut().enumerate() {
        let r = 16 * ib..16 * ib + 16;
        *s = make_qx_quants_rmse1(32, &x[r.clone()], &mut l[r]);
    }
    q6_k_finish(super::superblock(x), &scales, &mut l, y);
}

/// Q6_K after the search.
#[inline(always)]
pub(super) fn q6_k_finish(x: &[f32; 256], scales: &[f32; 16], l: &mut [u8; 256], y: &mut [u8]) {
    let mut max_scale = 0f32;
    let mut max_abs_scale = 0f32;
    for &s in scales {
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
#[inline(always)]
fn pack_2bit(l: &[u8; 256], qs: &mut [u8]) {
    for h in 0..2 {
        for i in 0..32 {
            let e = 128 * h + i;
            qs[32 * h + i] = l[e] | (l[e + 32] << 2) | (l[e + 64] << 4) | (l[e + 96] << 6);
        }
    }
}

#[cfg(test)]
/// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], f16 d, f16 dmin.
pub(super) fn q2_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    let mut weights = [0f32; 16];
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        (scales[j], mins[j]) = make_qkx2_quants(
            3,
            xs,
            &weights,
            &mut l[16 * j..16 * j + 16],
            -0.5,
            0.1,
            15,
            true,
        );
    }
    q2_k_finish(super::superblock(x), &scales, &mins, &mut l, y);
}

/// Q2_K after the search: 4-bit scales and mins against f16 `d` and `dmin`.
#[inline(always)]
pub(super) fn q2_k_finish(
    x: &[f32; 256],
    scales: &[f32; 16],
    mins: &[f32; 16],
    l: &mut [u8; 256],
    y: &mut [u8],
) {
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for j in 0..16 {
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
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
    pack_2bit(l, &mut y[16..80]);
}

#[cfg(test)]
/// Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales, biased by 32), f16 d.
pub(super) fn q3_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    for (j, s) in scales.iter_mut().enumerate() {
        let r = 16 * j..16 * j + 16;
        *s = make_q3_quants(4, &x[r.clone()], &mut l[r]);
    }
    q3_k_finish(super::superblock(x), &scales, &mut l, y);
}

/// Q3_K after the search.
#[inline(always)]
pub(super) fn q3_k_finish(x: &[f32; 256], scales: &[f32; 16], l: &mut [i8; 256], y: &mut [u8]) {
    let mut max_scale = 0f32;
    let mut amax = 0f32;
    for &s in scales {
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
    // High bit of element 32g + i goes to bit g of hmask[i]. Branch-free, 32 elements
    // at a time: the bit is a coin flip per element.
    let mut hm = [0u8; 32];
    let mut lu = [0u8; 256];
    for g in 0..8 {
        for i in 0..32 {
            let v = l[32 * g + i] as u8;
            let hi = (v > 3) as u8;
            hm[i] |= hi << g;
            lu[32 * g + i] = v - 4 * hi;
        }
    }
    y[..32].copy_from_slice(&hm);
    pack_2bit(&lu, &mut y[32..96]);
}

/// Q4_K/Q5_K's 12-byte field of eight 6-bit (scale, min) pairs.
#[inline(always)]
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
#[inline(always)]
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
