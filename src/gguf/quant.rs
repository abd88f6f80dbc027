//! ggml block formats: dequantization to f32 (and Q8_0 quantization). Pure functions
//! over byte slices; nothing here knows about files.
//!
//! Semantics follow ggml's reference (`dequantize_row_*` in `ggml-quants.c`) exactly,
//! including the order of float operations (e.g. Q6_K computes `(d * scale) * q`), so
//! results are bit-identical to ggml's scalar path and to the `gguf` Python package.
//! No fused multiply-add is used: ggml's reference and numpy do not fuse either.
//!
//! Every function is a pure function of its input slices, so callers parallelize by
//! splitting a tensor into rows (or any whole number of blocks) and dequantizing the
//! pieces independently.

use half::f16;

use crate::gguf::grids::{iq1s, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
use crate::gguf::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("ggml type {0:?} is not supported for dequantization")]
    Unsupported(GgmlType),
    #[error("ggml type {0:?} cannot be quantized")]
    CannotQuantize(GgmlType),
    #[error("{ty:?}: {n} elements are not a whole number of {block}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        n: usize,
        block: usize,
    },
    #[error("{ty:?}: {n} elements need {need} bytes, got {got}")]
    Size {
        ty: GgmlType,
        n: usize,
        need: usize,
        got: usize,
    },
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The ggml types [`dequantize`] handles.
pub fn is_supported(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::Q8_1 | GgmlType::Q8_K)
}

/// Dequantize `out.len()` elements of type `ty` from `bytes` (which must be exactly
/// the bytes of that many elements).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    if !is_supported(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    let n = out.len();
    let (be, bb) = ty.block();
    // A count that is not a whole number of blocks can never match any byte length;
    // report the bytes the rounded-up block count would need.
    let need = (n as u64)
        .div_ceil(be)
        .checked_mul(bb)
        .and_then(|v| usize::try_from(v).ok())
        .unwrap_or(usize::MAX);
    if n as u64 % be != 0 || bytes.len() != need {
        return Err(QuantError::Size {
            ty,
            n,
            need,
            got: bytes.len(),
        });
    }
    let be = be as usize;
    let bb = bb as usize;
    let blocks = bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be));
    match ty {
        GgmlType::F32 => {
            for (b, y) in blocks {
                y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, y) in blocks {
                y[0] = f16_at(b, 0);
            }
        }
        GgmlType::BF16 => {
            // ggml's bf16 → f32 is a plain shift (NaN payloads kept as they are), which
            // `half::bf16::to_f32` does not guarantee for NaNs; the shift is exact.
            for (b, y) in blocks {
                y[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| dq_q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| dq_q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| dq_q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| dq_q5_1(b, y)),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| dq_q8_0(b, y)),
        GgmlType::Q2_K => blocks.for_each(|(b, y)| dq_q2_k(b, y)),
        GgmlType::Q3_K => blocks.for_each(|(b, y)| dq_q3_k(b, y)),
        GgmlType::Q4_K => blocks.for_each(|(b, y)| dq_q4_k(b, y)),
        GgmlType::Q5_K => blocks.for_each(|(b, y)| dq_q5_k(b, y)),
        GgmlType::Q6_K => blocks.for_each(|(b, y)| dq_q6_k(b, y)),
        GgmlType::IQ4_NL => blocks.for_each(|(b, y)| dq_iq4_nl(b, y)),
        GgmlType::IQ4_XS => blocks.for_each(|(b, y)| dq_iq4_xs(b, y)),
        GgmlType::IQ3_XXS => blocks.for_each(|(b, y)| dq_iq3_xxs(b, y)),
        GgmlType::IQ3_S => blocks.for_each(|(b, y)| dq_iq3_s(b, y)),
        GgmlType::IQ2_S => blocks.for_each(|(b, y)| dq_iq2_s(b, y)),
        GgmlType::IQ2_XXS => blocks.for_each(|(b, y)| dq_iq2_xxs(b, y)),
        GgmlType::IQ2_XS => blocks.for_each(|(b, y)| dq_iq2_xs(b, y)),
        GgmlType::IQ1_S => blocks.for_each(|(b, y)| dq_iq1_s(b, y)),
        GgmlType::IQ1_M => blocks.for_each(|(b, y)| dq_iq1_m(b, y)),
        GgmlType::Q8_1 | GgmlType::Q8_K => unreachable!("rejected above"),
    }
    Ok(())
}

/// Q4_0: f16 d, 16 bytes of nibbles; low nibbles are elements 0..16, high 16..32.
fn dq_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1: f16 d, f16 m, 16 bytes of nibbles; x = q*d + m.
fn dq_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// Fifth bits of Q5 element `j` (low half) and `j + 16` (high half), as 0 or 0x10.
#[inline]
fn q5_high(qh: u32, j: usize) -> (u8, u8) {
    (
        (((qh >> j) << 4) & 0x10) as u8,
        ((qh >> (j + 12)) & 0x10) as u8,
    )
}

/// Q5_0: f16 d, u32 qh (fifth bits), 16 bytes of nibbles; x = (q - 16)*d.
fn dq_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let (h0, h1) = q5_high(qh, j);
        y[j] = (((qs[j] & 0x0F) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

/// Q5_1: f16 d, f16 m, u32 qh, 16 bytes of nibbles; x = q*d + m.
fn dq_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let (h0, h1) = q5_high(qh, j);
        y[j] = ((qs[j] & 0x0F) | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) | h1) as f32 * d + m;
    }
}

/// Q8_0: f16 d, 32 signed bytes; x = q*d.
fn dq_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
        *yj = (q as i8) as f32 * d;
    }
}

/// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], f16 d, f16 dmin.
fn dq_q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let d = f16_at(b, 80);
    let min = f16_at(b, 82);
    let mut is = 0;
    let mut o = 0;
    for n in 0..2 {
        let q = &b[16 + 32 * n..16 + 32 * n + 32];
        for shift in [0u32, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0F) as f32;
                let ml = min * (sc >> 4) as f32;
                for l in 0..16 {
                    let v = (q[l + 16 * half] >> shift) & 3;
                    y[o] = dl * v as f32 - ml;
                    o += 1;
                }
            }
        }
    }
}

/// Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales), f16 d.
fn dq_q3_k(b: &[u8], y: &mut [f32]) {
    let hm = &b[0..32];
    let sc = &b[96..108];
    let d_all = f16_at(b, 108);
    // Unpack the 16 six-bit scales: low 4 bits from bytes 0..8 (nibbles), high 2 bits
    // from bytes 8..12 (crumbs), as ggml's kmask shuffle does.
    let mut scales = [0i32; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let lo = (sc[i % 8] >> (4 * (i / 8))) & 0x0F;
        let hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 0x03;
        *s = (lo | (hi << 4)) as i32 - 32;
    }
    let mut is = 0;
    let mut o = 0;
    let mut m = 1u8;
    for n in 0..2 {
        let q = &b[32 + 32 * n..32 + 32 * n + 32];
        for shift in [0u32, 2, 4, 6] {
            for half in 0..2 {
                let dl = d_all * scales[is] as f32;
                is += 1;
                for l in 0..16 {
                    let k = l + 16 * half;
                    let v = ((q[k] >> shift) & 3) as i32 - if hm[k] & m != 0 { 0 } else { 4 };
                    y[o] = dl * v as f32;
                    o += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// The (scale, min) pair `j` (0..8) of a Q4_K/Q5_K 12-byte scales field.
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

/// Q4_K: f16 d, f16 dmin, scales[12], qs[128].
fn dq_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    for c in 0..4 {
        let q = &b[16 + 32 * c..16 + 32 * c + 32];
        let (s1, m1) = scale_min_k4(2 * c, scales);
        let (s2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * s1 as f32, min * m1 as f32);
        let (d2, m2) = (d * s2 as f32, min * m2 as f32);
        let y = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// Q5_K: f16 d, f16 dmin, scales[12], qh[32], qs[128].
fn dq_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    for c in 0..4 {
        let ql = &b[48 + 32 * c..48 + 32 * c + 32];
        let (u1, u2) = (1u8 << (2 * c), 2u8 << (2 * c));
        let (s1, m1) = scale_min_k4(2 * c, scales);
        let (s2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * s1 as f32, min * m1 as f32);
        let (d2, m2) = (d * s2 as f32, min * m2 as f32);
        let y = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// Q6_K: ql[128], qh[64], scales[16] (i8), f16 d; x = (d * scale) * (q - 32).
fn dq_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * (sc[is + k] as i8) as f32;
            y[l] = s(0) * q1 as f32;
            y[l + 32] = s(2) * q2 as f32;
            y[l + 64] = s(4) * q3 as f32;
            y[l + 96] = s(6) * q4 as f32;
        }
    }
}

/// The 16 levels of IQ4_NL and IQ4_XS (`kvalues_iq4nl` in ggml-common.h).
pub const IQ4_NL_GRID: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// IQ4_NL: f16 d, 16 bytes of nibbles indexing the grid; low nibbles are elements
/// 0..16, high 16..32; x = d * grid[q].
fn dq_iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        y[j] = d * IQ4_NL_GRID[(b[2 + j] & 0x0F) as usize] as f32;
        y[j + 16] = d * IQ4_NL_GRID[(b[2 + j] >> 4) as usize] as f32;
    }
}

/// IQ4_XS: f16 d, u16 scales_h (2 high bits of each 6-bit scale), scales_l[4] (low
/// nibbles), qs[128]; sub-block `ib` of 32 is `(d * (ls - 32)) * grid[q]`, nibbles
/// ordered as IQ4_NL's.
fn dq_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let sh = u16::from_le_bytes([b[2], b[3]]);
    for ib in 0..8 {
        let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
        let ls = (lo as i32) | ((((sh >> (2 * ib)) & 3) as i32) << 4);
        let dl = d * (ls - 32) as f32;
        let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
        let y = &mut y[32 * ib..32 * ib + 32];
        for j in 0..16 {
            y[j] = dl * IQ4_NL_GRID[(qs[j] & 0x0F) as usize] as f32;
            y[j + 16] = dl * IQ4_NL_GRID[(qs[j] >> 4) as usize] as f32;
        }
    }
}

/// The sign byte of IQ3_XXS's 7-bit sign index `i` (ggml's `ksigns_iq2xs`): the eighth
/// sign makes the count of minus signs even.
pub(crate) const fn ksign(i: u8) -> u8 {
    (i & 127) | (((i & 127).count_ones() as u8 & 1) << 7)
}

/// `db · mag · (−1 if bit j of sign)` for the `mags` (little end first) of a grid entry,
/// the sign bits starting at `bit`.
#[inline]
fn grid_values(db: f32, mags: u64, sign: u8, bit: usize, y: &mut [f32]) {
    for (j, y) in y.iter_mut().enumerate() {
        let m = ((mags >> (8 * j)) & 0xFF) as f32;
        let s = if sign & (1 << (bit + j)) != 0 {
            -1.0
        } else {
            1.0
        };
        *y = db * m * s;
    }
}

/// IQ3_XXS: f16 d, qs[64] (grid indices, two per 8 values), then per sub-block of 32 a
/// u32: four 7-bit sign indices ([`ksign`]) and a 4-bit scale `s` in bits 28..32;
/// `db = d · (0.5 + s) · 0.5`.
fn dq_iq3_xxs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for ib in 0..8 {
        let aux = u32::from_le_bytes(b[66 + 4 * ib..70 + 4 * ib].try_into().expect("4 bytes"));
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for l in 0..4 {
            let sign = ksign(((aux >> (7 * l)) & 127) as u8);
            let q = &b[2 + 8 * ib + 2 * l..];
            let y = &mut y[32 * ib + 8 * l..32 * ib + 8 * l + 8];
            grid_values(db, IQ3XXS_GRID[q[0] as usize] as u64, sign, 0, &mut y[..4]);
            grid_values(db, IQ3XXS_GRID[q[1] as usize] as u64, sign, 4, &mut y[4..]);
        }
    }
}

/// IQ3_S: f16 d, qs[64] (low 8 bits of 9-bit grid indices), qh[8] (their ninth bits,
/// one byte per sub-block of 32), signs[32] (a byte per 8 values), scales[4] (a nibble
/// `s` per sub-block); `db = d · (1 + 2s)`.
fn dq_iq3_s(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for ib in 0..8 {
        let db = d * (1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 15) as i32) as f32;
        let qh = b[66 + ib] as usize;
        for l in 0..4 {
            let idx =
                |k: usize| b[2 + 8 * ib + 2 * l + k] as usize | ((qh >> (2 * l + k)) & 1) << 8;
            let sign = b[74 + 4 * ib + l];
            let y = &mut y[32 * ib + 8 * l..32 * ib + 8 * l + 8];
            grid_values(db, IQ3S_GRID[idx(0)] as u64, sign, 0, &mut y[..4]);
            grid_values(db, IQ3S_GRID[idx(1)] as u64, sign, 4, &mut y[4..]);
        }
    }
}

/// IQ2_S's and IQ2_XS's two sub-block scales in one byte, low nibble first:
/// `d · (0.5 + s) · 0.25`.
#[inline]
fn nibble_scales(d: f32, sc: u8) -> [f32; 2] {
    [
        d * (0.5 + (sc & 15) as f32) * 0.25,
        d * (0.5 + (sc >> 4) as f32) * 0.25,
    ]
}

/// IQ2_S: f16 d, qs[32] (low 8 bits of 10-bit grid indices, one per 8 values),
/// signs[32], qh[8] (the indices' two high bits, a byte per 32 values), scales[8] (a
/// nibble `s` per 16 values, low first); `db = d · (0.5 + s) · 0.25`.
fn dq_iq2_s(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for ib in 0..8 {
        let db = nibble_scales(d, b[74 + ib]);
        for l in 0..4 {
            let idx = b[2 + 4 * ib + l] as usize | ((b[66 + ib] as usize >> (2 * l)) & 3) << 8;
            let y = &mut y[32 * ib + 8 * l..32 * ib + 8 * l + 8];
            grid_values(db[l / 2], IQ2S_GRID[idx], b[34 + 4 * ib + l], 0, y);
        }
    }
}

/// IQ2_XXS: f16 d, then per sub-block of 32 two u32: four grid indices (a byte each,
/// one per 8 values), and four 7-bit sign indices ([`ksign`]) with a 4-bit scale `s` in
/// bits 28..32; `db = d · (0.5 + s) · 0.25`.
fn dq_iq2_xxs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for ib in 0..8 {
        let q = &b[2 + 8 * ib..10 + 8 * ib];
        let aux = u32::from_le_bytes(q[4..8].try_into().expect("4 bytes"));
        let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
        for l in 0..4 {
            let sign = ksign(((aux >> (7 * l)) & 127) as u8);
            let y = &mut y[32 * ib + 8 * l..32 * ib + 8 * l + 8];
            grid_values(db, IQ2XXS_GRID[q[l] as usize], sign, 0, y);
        }
    }
}

/// IQ2_XS: f16 d, qs[32] u16 (a 9-bit grid index and a 7-bit sign index per 8 values),
/// scales[8] (a nibble `s` per 16 values, low first); `db = d · (0.5 + s) · 0.25`.
fn dq_iq2_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for ib in 0..8 {
        let db = nibble_scales(d, b[66 + ib]);
        for l in 0..4 {
            let at = 2 + 2 * (4 * ib + l);
            let q = u16::from_le_bytes([b[at], b[at + 1]]);
            let y = &mut y[32 * ib + 8 * l..32 * ib + 8 * l + 8];
            let sign = ksign((q >> 9) as u8);
            grid_values(db[l / 2], IQ2XS_GRID[(q & 511) as usize], sign, 0, y);
        }
    }
}

/// IQ1's shift of every value of a group of 8 (`IQ1S_DELTA`, `IQ1M_DELTA`).
const IQ1_DELTA: f32 = 0.125;

/// `dl · (grid value + delta)` for the 8 values of `iq1s_grid` entry `idx`.
#[inline]
fn iq1_values(dl: f32, idx: usize, delta: f32, y: &mut [f32]) {
    for (y, g) in y.iter_mut().zip(iq1s(idx)) {
        *y = dl * (g as f32 + delta);
    }
}

/// IQ1_S: f16 d, qs[32] (low 8 bits of 11-bit grid indices), qh[8] u16 per sub-block of
/// 32: the indices' high 3 bits (3 per group), a 3-bit scale `s` in bits 12..15 and the
/// shift's sign in bit 15; `dl = d · (2s + 1)`.
fn dq_iq1_s(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for ib in 0..8 {
        let qh = u16::from_le_bytes([b[34 + 2 * ib], b[35 + 2 * ib]]) as usize;
        let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
        let delta = if qh & 0x8000 != 0 {
            -IQ1_DELTA
        } else {
            IQ1_DELTA
        };
        for l in 0..4 {
            let idx = b[2 + 4 * ib + l] as usize | ((qh >> (3 * l)) & 7) << 8;
            iq1_values(dl, idx, delta, &mut y[32 * ib + 8 * l..32 * ib + 8 * l + 8]);
        }
    }
}

/// IQ1_M: qs[32] (low 8 bits of 11-bit grid indices), qh[16] (per 8 values: the high 3
/// bits, then the shift's sign at bit 3 of the nibble), scales[8] as four u16: 3-bit
/// scales `s` per 16 values (four per u16, 6 bits apart for each pair) and, in their top
/// nibbles, the f16 d; `dl = d · (2s + 1)`.
fn dq_iq1_m(b: &[u8], y: &mut [f32]) {
    let sc: [u16; 4] = std::array::from_fn(|i| u16::from_le_bytes([b[48 + 2 * i], b[49 + 2 * i]]));
    let d16 = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
    let d = f16::from_bits(d16).to_f32();
    for ib in 0..8 {
        let s = sc[ib / 2] >> (6 * (ib % 2));
        let dl = [
            d * (2 * (s & 7) + 1) as f32,
            d * (2 * ((s >> 3) & 7) + 1) as f32,
        ];
        for l in 0..4 {
            let h = b[32 + 2 * ib + l / 2] >> (4 * (l % 2));
            let idx = b[4 * ib + l] as usize | ((h & 7) as usize) << 8;
            let delta = if h & 8 != 0 { -IQ1_DELTA } else { IQ1_DELTA };
            iq1_values(
                dl[l / 2],
                idx,
                delta,
                &mut y[32 * ib + 8 * l..32 * ib + 8 * l + 8],
            );
        }
    }
}

/// Quantize `src` to Q8_0 blocks appended to `out`, as ggml's `quantize_row_q8_0_ref`
/// ([`crate::gguf::quantize`]). A trailing partial block is padded with zeros (ggml
/// asserts instead; padding keeps this total).
pub fn quantize_q8_0(src: &[f32], out: &mut Vec<u8>) {
    let whole = src.len() / 32 * 32;
    let at = out.len();
    out.resize(at + src.len().div_ceil(32) * 34, 0);
    let (body, tail) = out[at..].split_at_mut(whole / 32 * 34);
    let q8 = |x: &[f32], y: &mut [u8]| {
        crate::gguf::quantize::quantize(GgmlType::Q8_0, x, y).expect("whole Q8_0 blocks")
    };
    q8(&src[..whole], body);
    if !tail.is_empty() {
        let mut x = [0f32; 32];
        x[..src.len() - whole].copy_from_slice(&src[whole..]);
        q8(&x, tail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    fn dq(ty: GgmlType, b: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        dequantize(ty, b, &mut out).unwrap();
        out
    }

    #[test]
    fn floats() {
        let mut b = Vec::new();
        b.extend_from_slice(&1.5f32.to_le_bytes());
        b.extend_from_slice(&(-2.25f32).to_le_bytes());
        assert_eq!(dq(GgmlType::F32, &b, 2), vec![1.5, -2.25]);
        let b = [h(0.5), h(-3.0)].concat();
        assert_eq!(dq(GgmlType::F16, &b, 2), vec![0.5, -3.0]);
        let b = [
            half::bf16::from_f32(0.75).to_le_bytes(),
            half::bf16::from_f32(-8.0).to_le_bytes(),
        ]
        .concat();
        assert_eq!(dq(GgmlType::BF16, &b, 2), vec![0.75, -8.0]);
    }

    #[test]
    fn q4_0_and_q4_1() {
        let mut b = h(2.0).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dq(GgmlType::Q4_0, &b, 32);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 2.0);
            assert_eq!(y[j + 16], (7.0 - j as f32) * 2.0);
        }
        let mut b = [h(0.5), h(-1.0)].concat();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dq(GgmlType::Q4_1, &b, 32);
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 0.5 - 1.0);
            assert_eq!(y[j + 16], (15 - j) as f32 * 0.5 - 1.0);
        }
    }

    #[test]
    fn q5_0_and_q5_1() {
        // Fifth bit set for elements 1 (low half) and 16+2 (high half).
        let qh: u32 = (1 << 1) | (1 << (16 + 2));
        let mut b = h(1.0).to_vec();
        b.extend_from_slice(&qh.to_le_bytes());
        b.extend((0..16u8).map(|j| (j & 0xF) | (3 << 4)));
        let y = dq(GgmlType::Q5_0, &b, 32);
        assert_eq!(y[0], -16.0);
        assert_eq!(y[1], (1 + 16 - 16) as f32);
        assert_eq!(y[5], (5 - 16) as f32);
        assert_eq!(y[16], (3 - 16) as f32);
        assert_eq!(y[18], (3 + 16 - 16) as f32);
        let mut b = [h(2.0), h(0.5)].concat();
        b.extend_from_slice(&qh.to_le_bytes());
        b.extend((0..16u8).map(|j| (j & 0xF) | (3 << 4)));
        let y = dq(GgmlType::Q5_1, &b, 32);
        assert_eq!(y[1], 17.0 * 2.0 + 0.5);
        assert_eq!(y[18], 19.0 * 2.0 + 0.5);
        assert_eq!(y[17], 3.0 * 2.0 + 0.5);
    }

    #[test]
    fn q8_0() {
        let mut b = h(0.25).to_vec();
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let y = dq(GgmlType::Q8_0, &b, 32);
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, (j as f32 - 16.0) * 0.25);
        }
    }

    #[test]
    fn q8_0_round_trip() {
        let src: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut q = Vec::new();
        quantize_q8_0(&src, &mut q);
        assert_eq!(q.len(), 3 * 34);
        let y = dq(GgmlType::Q8_0, &q, 96);
        for (blk, (s, r)) in src.chunks(32).zip(y.chunks(32)).enumerate() {
            let amax = s.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = f16_at(&q, blk * 34);
            for (a, b) in s.iter().zip(r) {
                assert!((a - b).abs() <= d * 0.5 + amax * 1e-3, "{a} vs {b}");
            }
            // The largest magnitude maps to ±127.
            assert!(q[blk * 34 + 2..blk * 34 + 34]
                .iter()
                .any(|&v| (v as i8).unsigned_abs() == 127));
        }
        // Quantizing the dequantized values again gives the same bytes.
        let mut q2 = Vec::new();
        quantize_q8_0(&y, &mut q2);
        assert_eq!(q, q2);
        // All-zero block: d = 0, all quants 0.
        let mut z = Vec::new();
        quantize_q8_0(&[0.0; 32], &mut z);
        assert!(z.iter().all(|&v| v == 0));
    }

    #[test]
    fn q2_k() {
        let mut b = vec![0u8; 84];
        // scale 3, min 1 for sub-block 0; scale 2, min 0 for sub-block 1.
        b[0] = 3 | (1 << 4);
        b[1] = 2;
        b[16] = 0b11; // element 0 -> q=3
        b[32] = 0b10; // element 16 -> q=2
        b[16 + 1] = 0b0100; // element 1 of the shift-2 group (sub-block 2, scale 0)
        b[80..82].copy_from_slice(&h(0.5));
        b[82..84].copy_from_slice(&h(0.25));
        let y = dq(GgmlType::Q2_K, &b, 256);
        assert_eq!(y[0], 0.5 * 3.0 * 3.0 - 0.25);
        assert_eq!(y[1], -0.25);
        assert_eq!(y[16], 0.5 * 2.0 * 2.0);
        assert_eq!(y[33], 0.0);
    }

    #[test]
    fn q3_k() {
        let mut b = vec![0u8; 110];
        // scale 0: lo nibble 5 (byte 0 low), hi crumb 2 (byte 8 bits 0..2) -> 37 - 32 = 5
        b[96] = 5;
        b[104] = 2;
        // scale 8: byte 0 high nibble = 1, byte 8 bits 4..6 (i/4 = 2) = 3 -> 49 - 32 = 17
        b[96] |= 1 << 4;
        b[104] |= 3 << 4;
        b[108..110].copy_from_slice(&h(0.5));
        b[32] = 0b10; // element 0: q = 2, hmask bit 0 clear -> 2 - 4 = -2
        b[0] = 0b10; // element 0's hmask bit for shift group 1 (m = 2): irrelevant to el 0
        b[1] = 1; // element 1: hmask bit set -> q = 0
        let y = dq(GgmlType::Q3_K, &b, 256);
        assert_eq!(y[0], 0.5 * 5.0 * -2.0);
        assert_eq!(y[1], 0.0);
        assert_eq!(y[2], 0.5 * 5.0 * -4.0);
        // Sub-block 8 = n=1 first group (elements 128..144), hmask m = 0x10.
        assert_eq!(y[128], 0.5 * 17.0 * -4.0);
        // Element 32 (shift 2, m=2): hmask[0] has bit 1 -> q = 0.
        assert_eq!(y[32], 0.0);
    }

    #[test]
    fn q4_k_and_q5_k() {
        let mut b = vec![0u8; 144];
        b[0..2].copy_from_slice(&h(0.5));
        b[2..4].copy_from_slice(&h(0.25));
        let sc = &mut b[4..16];
        sc[0] = 10; // scale 0
        sc[4] = 3; // min 0
        sc[1] = 4 | (1 << 6); // scale 1 = 4; bits 6..8 feed scale 5's high bits
        sc[9] = 0x2 | (0x7 << 4); // scale 5 low = 2, min 5 low = 7
        b[16] = 0x97; // element 0 nibble 7, element 32 nibble 9
        let y = dq(GgmlType::Q4_K, &b, 256);
        assert_eq!(y[0], 0.5 * 10.0 * 7.0 - 0.25 * 3.0);
        assert_eq!(y[32], 0.5 * 4.0 * 9.0);
        assert_eq!(y[1], -0.25 * 3.0);
        // scale 5 = 2 | (1 << 4) = 18, min 5 = 7 (high bits from sc[5] >> 6 = 0).
        assert_eq!(y[5 * 32], -0.25 * 7.0);
        assert_eq!(scale_min_k4(5, &b[4..16]), (18, 7));

        let mut b = vec![0u8; 176];
        b[0..2].copy_from_slice(&h(1.0));
        b[2..4].copy_from_slice(&h(0.5));
        b[4] = 2; // scale 0
        b[5] = 3; // scale 1
        b[8] = 1; // min 0
        b[16] = 0b11; // qh[0]: fifth bit for element 0 and 32
        b[16 + 1] = 0b100; // qh[1]: fifth bit for element 64 + 1 (u1 = 4)
        b[48] = 0x21; // element 0 low 1, element 32 high 2
        let y = dq(GgmlType::Q5_K, &b, 256);
        assert_eq!(y[0], 2.0 * 17.0 - 0.5);
        assert_eq!(y[32], 3.0 * 18.0);
        assert_eq!(y[65], 0.0); // scale 2 is 0
        assert_eq!(y[1], -0.5);
    }

    #[test]
    fn q6_k() {
        let mut b = vec![0u8; 210];
        b[208..210].copy_from_slice(&h(0.5));
        b[192] = 3; // scale for elements 0..16
        b[194] = (-2i8) as u8; // scale for 32..48
        b[0] = 0x05 | (0x01 << 4); // el 0 low = 5, el 64 low = 1
        b[128] = 0b10_00_01_10; // qh[0]: el0 hi=2, el32 hi=1, el64 hi=0, el96 hi=2
        let y = dq(GgmlType::Q6_K, &b, 256);
        assert_eq!(y[0], 0.5 * 3.0 * ((5 | (2 << 4)) - 32) as f32);
        assert_eq!(y[32], 0.5 * -2.0 * ((1 << 4) - 32) as f32);
        assert_eq!(y[64], 0.0); // scale 4 is 0
        assert_eq!(y[1], 0.5 * 3.0 * -32.0);
    }

    #[test]
    fn size_errors() {
        let mut out = vec![0f32; 32];
        assert!(matches!(
            dequantize(GgmlType::Q8_0, &[0u8; 33], &mut out),
            Err(QuantError::Size { need: 34, .. })
        ));
        let mut out = vec![0f32; 31];
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], &mut out).is_err());
        assert!(matches!(
            dequantize(GgmlType::Q8_K, &[], &mut []),
            Err(QuantError::Unsupported(_))
        ));
        // Empty input is fine.
        assert!(dequantize(GgmlType::Q4_K, &[], &mut []).is_ok());
    }
}
