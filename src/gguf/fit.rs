//! Weighted rounding into ggml blocks: f32 values and a weight per value into the
//! blocks of a ggml type that minimise `Σ w·(x − x̂)²`, where `x̂` is what ggml's own
//! dequantizer makes of the blocks. Pure functions over slices, like [`super::quantize`]
//! (which reproduces llama-quantize byte for byte); this module is free to search
//! further and so rounds better. docs/CODECS.md, "ggml blocks", describes the search.
//!
//! Every block is fitted the same way: a scale (and, for the affine types, an offset)
//! tried at many candidates around the one that maps the block's largest value to the
//! grid's end, each candidate's codes rounded to the nearest level and its scale
//! refitted by weighted least squares; the best refined by re-rounding and refitting
//! again. Super-block types (k-quants, IQ4_XS) fit each sub-block's scale that way,
//! then fit the grid of the sub-block scales themselves (weighted by how much each
//! sub-block's error grows with its scale's), then round every value once more to its
//! sub-block's final scale. Deterministic: no randomness, fixed order.

use half::f16;

use super::quant::{QuantError, IQ4_NL_GRID};
use super::GgmlType;

mod iq;

/// Whether [`fit`] handles this type.
pub fn can_fit(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        Q4_0 | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | IQ4_NL
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | IQ4_XS
            | IQ3_XXS
            | IQ3_S
            | IQ2_S
    )
}

/// Rounds `x` (a whole number of `ty`'s blocks, finite) into `out` (exactly the bytes
/// of that many blocks), minimising the `w`-weighted squared error (`w.len() ==
/// x.len()`, non-negative; a block whose weights are all zero is fitted unweighted).
pub fn fit(ty: GgmlType, x: &[f32], w: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    if !can_fit(ty) {
        return Err(QuantError::CannotQuantize(ty));
    }
    let (be, bb) = ty.block();
    let (be, bb) = (be as usize, bb as usize);
    let n = x.len();
    if n % be != 0 || w.len() != n {
        return Err(QuantError::PartialBlock { ty, n, block: be });
    }
    if out.len() != n / be * bb {
        return Err(QuantError::Size {
            ty,
            n,
            need: n / be * bb,
            got: out.len(),
        });
    }
    let ones = vec![1.0f32; be];
    for ((x, w), o) in x
        .chunks_exact(be)
        .zip(w.chunks_exact(be))
        .zip(out.chunks_exact_mut(bb))
    {
        let w = if w.iter().any(|&v| v > 0.0) { w } else { &ones };
        match ty {
            GgmlType::Q4_0 => sym_32(x, w, Levels::Int(-8, 7), o),
            GgmlType::Q5_0 => sym_32(x, w, Levels::Int(-16, 15), o),
            GgmlType::Q8_0 => sym_32(x, w, Levels::Int(-128, 127), o),
            GgmlType::IQ4_NL => sym_32(x, w, Levels::Nl, o),
            GgmlType::Q4_1 => affine_32(x, w, 15, o),
            GgmlType::Q5_1 => affine_32(x, w, 31, o),
            GgmlType::Q6_K => q6_k(x, w, o),
            GgmlType::IQ4_XS => iq4_xs(x, w, o),
            GgmlType::Q4_K => qk_affine(x, w, 15, o),
            GgmlType::Q5_K => qk_affine(x, w, 31, o),
            GgmlType::Q3_K => q3_k(x, w, o),
            GgmlType::Q2_K => q2_k(x, w, o),
            GgmlType::IQ3_XXS => iq::iq3_xxs(x, w, o),
            GgmlType::IQ3_S => iq::iq3_s(x, w, o),
            GgmlType::IQ2_S => iq::iq2_s(x, w, o),
            _ => unreachable!("checked by can_fit"),
        }
    }
    Ok(())
}

/// The levels codes stand for: integers `lo..=hi` (code = level − lo), IQ4_NL's
/// grid (code = index), or the odd numbers `1, 3, …, 2n − 1` (code = (level − 1) / 2:
/// the sub-block scales of the IQ grid types).
#[derive(Clone, Copy)]
enum Levels {
    Int(i32, i32),
    Nl,
    Odd(u8),
}

/// `x` clamped to the integers `lo..=hi` and rounded to the nearest, half to even.
/// Clamped first, so the 1.5·2²³ trick (ggml's `nearest_int`) is exact; `f32::round`
/// is a libm call here, and was a fifth of a conversion's CPU.
#[inline(always)]
fn round_in(x: f32, lo: f32, hi: f32) -> f32 {
    (x.clamp(lo, hi) + 12_582_912.0) - 12_582_912.0
}

impl Levels {
    fn ends(self) -> (f32, f32) {
        match self {
            Levels::Int(lo, hi) => (lo as f32, hi as f32),
            Levels::Nl => (IQ4_NL_GRID[0] as f32, IQ4_NL_GRID[15] as f32),
            Levels::Odd(n) => (1.0, (2 * n - 1) as f32),
        }
    }
    /// The level of code `c`.
    fn level(self, c: u8) -> f32 {
        match self {
            Levels::Int(lo, _) => (c as i32 + lo) as f32,
            Levels::Nl => IQ4_NL_GRID[c as usize] as f32,
            Levels::Odd(_) => (2 * c as u32 + 1) as f32,
        }
    }
    /// The codes of the levels just below and just above `v` (equal at the ends).
    fn around(self, v: f32) -> (u8, u8) {
        match self {
            Levels::Odd(n) => {
                let lo = ((v - 1.0) / 2.0).floor().clamp(0.0, (n - 1) as f32) as u8;
                (lo, (lo + 1).min(n - 1))
            }
            _ => (self.nearest(v.floor()).0, self.nearest(v.ceil()).0),
        }
    }
    /// The code of the level nearest to `v`, and that level.
    #[inline]
    fn nearest(self, v: f32) -> (u8, f32) {
        match self {
            Levels::Int(lo, hi) => {
                let q = round_in(v, lo as f32, hi as f32);
                ((q as i32 - lo) as u8, q)
            }
            Levels::Nl => {
                // First level whose midpoint with its successor lies above v.
                let i = NL_MID.partition_point(|&m| m <= v);
                (i as u8, IQ4_NL_GRID[i] as f32)
            }
            Levels::Odd(n) => {
                let c = round_in((v - 1.0) / 2.0, 0.0, (n - 1) as f32);
                (c as u8, 2.0 * c + 1.0)
            }
        }
    }
}

/// Midpoints between successive IQ4_NL levels.
const NL_MID: [f32; 15] = {
    let mut m = [0f32; 15];
    let mut i = 0;
    while i < 15 {
        m[i] = (IQ4_NL_GRID[i] as f32 + IQ4_NL_GRID[i + 1] as f32) / 2.0;
        i += 1;
    }
    m
};

/// Scale candidates tried on each side of the grid: the largest |x| mapped to the
/// grid's end times a factor from 0.55 to 1.2 (beyond the end it is clipped, which
/// pays where one value is far larger than the rest).
const TRIES: i32 = 6;

fn factor(k: i32) -> f32 {
    0.875 + 0.325 * k as f32 / TRIES as f32
}

/// Weighted least-squares scale of codes' levels `lv` for values `x`: (Σwxl, Σwl²).
#[inline]
fn sums(x: &[f32], w: &[f32], s: f32, levels: Levels, codes: &mut [u8]) -> (f32, f32) {
    let inv = if s != 0.0 { 1.0 / s } else { 0.0 };
    let (mut sxl, mut sll) = (0f32, 0f32);
    for ((&x, &w), c) in x.iter().zip(w).zip(codes.iter_mut()) {
        let (code, l) = levels.nearest(x * inv);
        *c = code;
        sxl += w * x * l;
        sll += w * l * l;
    }
    (sxl, sll)
}

/// The scale `s` minimising `Σ w (x − s·level)²` over the codes found ([`Levels`]),
/// searched as the module describes; `codes` gets the codes for `s` itself.
/// Returns `s` (0 for an all-zero block).
fn fit_scale(x: &[f32], w: &[f32], levels: Levels, codes: &mut [u8]) -> f32 {
    let xm = x
        .iter()
        .copied()
        .fold(0f32, |a, v| if v.abs() > a.abs() { v } else { a });
    let mut best = (0f32, 0f32); // (gain Σwxl²/Σwl², scale)
    if xm != 0.0 {
        let (lo, hi) = levels.ends();
        for e in [lo, hi] {
            if e == 0.0 {
                continue;
            }
            for k in -TRIES..=TRIES {
                let (sxl, sll) = sums(x, w, xm / (e * factor(k)), levels, codes);
                if sll > 0.0 && sxl * sxl / sll > best.0 {
                    best = (sxl * sxl / sll, sxl / sll);
                }
            }
        }
        // Re-round to the refitted scale while that removes error.
        for _ in 0..3 {
            let (sxl, sll) = sums(x, w, best.1, levels, codes);
            if sll > 0.0 && sxl * sxl / sll > best.0 * (1.0 + 1e-6) {
                best = (sxl * sxl / sll, sxl / sll);
            } else {
                break;
            }
        }
    }
    sums(x, w, best.1, levels, codes);
    best.1
}

/// `s` as the f16 a block stores it.
fn h(s: f32) -> f16 {
    f16::from_f32(s)
}

/// Codes of `x` at the stored scale `s`.
fn round_to(x: &[f32], s: f32, levels: Levels, codes: &mut [u8]) {
    let inv = if s != 0.0 { 1.0 / s } else { 0.0 };
    for (&x, c) in x.iter().zip(codes.iter_mut()) {
        *c = levels.nearest(x * inv).0;
    }
}

/// Q4_0, Q5_0, Q8_0, IQ4_NL: f16 scale, then 32 codes (nibbles: elements 0..16 low,
/// 16..32 high; Q5_0's fifth bits in a u32; Q8_0's as i8).
fn sym_32(x: &[f32], w: &[f32], levels: Levels, o: &mut [u8]) {
    let mut c = [0u8; 32];
    let d = h(fit_scale(x, w, levels, &mut c));
    round_to(x, d.to_f32(), levels, &mut c);
    o[..2].copy_from_slice(&d.to_le_bytes());
    match levels {
        Levels::Int(-128, 127) => {
            for (o, &c) in o[2..].iter_mut().zip(&c) {
                *o = (c as i32 - 128) as i8 as u8;
            }
        }
        Levels::Int(-16, 15) => {
            let qh = c
                .iter()
                .enumerate()
                .fold(0u32, |a, (j, &c)| a | (((c >> 4) as u32 & 1) << j));
            o[2..6].copy_from_slice(&qh.to_le_bytes());
            nibbles(&c, &mut o[6..22]);
        }
        _ => nibbles(&c, &mut o[2..18]),
    }
}

/// 32 codes' low four bits as ggml packs them: byte j holds element j low, j+16 high.
fn nibbles(c: &[u8], o: &mut [u8]) {
    for j in 0..16 {
        o[j] = (c[j] & 15) | ((c[j + 16] & 15) << 4);
    }
}

/// `x ≈ d·q + m` with codes `q` in `0..=nmax`, `(d, m)` by weighted least squares over
/// candidate roundings (llama.cpp's `make_qkx` family searches the same space more
/// coarsely). With `m_le_0` the offset may not be positive (k-quants store −m ≥ 0).
/// Returns `(d, m)`; `codes` gets the codes for them.
fn fit_affine(x: &[f32], w: &[f32], nmax: u8, m_le_0: bool, codes: &mut [u8]) -> (f32, f32) {
    let mut lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m_le_0 {
        lo = lo.min(0.0);
    }
    if hi <= lo {
        codes.iter_mut().for_each(|c| *c = 0);
        return (0.0, lo);
    }
    let nm = nmax as f32;
    let round = |d: f32, m: f32, codes: &mut [u8]| {
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (&x, c) in x.iter().zip(codes.iter_mut()) {
            *c = round_in((x - m) * inv, 0.0, nm) as u8;
        }
    };
    let refit = |codes: &[u8]| -> (f32, f32, f32) {
        let (mut sw, mut sq, mut sqq, mut sx, mut sxq) = (0f32, 0f32, 0f32, 0f32, 0f32);
        for ((&x, &w), &c) in x.iter().zip(w).zip(codes) {
            let q = c as f32;
            sw += w;
            sq += w * q;
            sqq += w * q * q;
            sx += w * x;
            sxq += w * x * q;
        }
        let det = sw * sqq - sq * sq;
        let (mut d, mut m) = if det > 0.0 {
            ((sw * sxq - sq * sx) / det, (sqq * sx - sq * sxq) / det)
        } else {
            (0.0, sx / sw.max(f32::MIN_POSITIVE))
        };
        if m_le_0 && m > 0.0 {
            m = 0.0;
            d = if sqq > 0.0 { sxq / sqq } else { 0.0 };
        }
        let err: f32 = x
            .iter()
            .zip(w)
            .zip(codes)
            .map(|((&x, &w), &c)| {
                let e = x - (d * c as f32 + m);
                w * e * e
            })
            .sum();
        (d, m, err)
    };
    let mut best = (f32::INFINITY, 0f32, lo);
    for k in -TRIES..=TRIES {
        let d = (hi - lo) / (nm + k as f32 / TRIES as f32);
        round(d, lo, codes);
        let (d, m, err) = refit(codes);
        if err < best.0 {
            best = (err, d, m);
        }
    }
    for _ in 0..3 {
        round(best.1, best.2, codes);
        let (d, m, err) = refit(codes);
        if err < best.0 * (1.0 - 1e-6) {
            best = (err, d, m);
        } else {
            break;
        }
    }
    round(best.1, best.2, codes);
    (best.1, best.2)
}

/// Q4_1, Q5_1: f16 d, f16 m, (Q5_1: u32 of fifth bits), nibbles.
fn affine_32(x: &[f32], w: &[f32], nmax: u8, o: &mut [u8]) {
    let mut c = [0u8; 32];
    let (d, m) = fit_affine(x, w, nmax, false, &mut c);
    let (d, m) = (h(d), h(m));
    let (df, mf) = (d.to_f32(), m.to_f32());
    let inv = if df > 0.0 { 1.0 / df } else { 0.0 };
    for (&x, c) in x.iter().zip(c.iter_mut()) {
        *c = round_in((x - mf) * inv, 0.0, nmax as f32) as u8;
    }
    o[..2].copy_from_slice(&d.to_le_bytes());
    o[2..4].copy_from_slice(&m.to_le_bytes());
    if nmax == 31 {
        let qh = c
            .iter()
            .enumerate()
            .fold(0u32, |a, (j, &c)| a | (((c >> 4) as u32 & 1) << j));
        o[4..8].copy_from_slice(&qh.to_le_bytes());
        nibbles(&c, &mut o[8..24]);
    } else {
        nibbles(&c, &mut o[4..20]);
    }
}

/// The f16 scale `d` and each sub-block's code (a level of `levels`) for sub-block
/// scales whose best float values are `s`, judged by the error each sub-block really
/// has when its values are rounded again to `d · level` (`err(j, scale)`): a scale
/// slightly off costs little once the codes follow it, which a fixed-code model of the
/// error would overstate. Candidates for `d` map the largest `|s|` near either end of
/// `levels`; each sub-block takes the better of the two levels around `s / d`. A block
/// stores `d / unit` (a power of two: IQ types scale their sub-block codes so).
fn fit_scales<const N: usize>(
    s: &[f32; N],
    levels: Levels,
    unit: f32,
    err: impl Fn(usize, f32) -> f32,
) -> (f16, [u8; N]) {
    let sm = s
        .iter()
        .copied()
        .fold(0f32, |a, v| if v.abs() > a.abs() { v } else { a });
    let mut best = (f32::INFINITY, f16::ZERO, [0u8; N]);
    if sm == 0.0 {
        return (f16::ZERO, std::array::from_fn(|_| levels.nearest(0.0).0));
    }
    let (lo, hi) = levels.ends();
    for e in [lo, hi] {
        if e == 0.0 {
            continue;
        }
        for k in 0..=8 {
            let d = h(sm / (e * (0.8 + 0.03 * k as f32)) / unit);
            let df = d.to_f32() * unit;
            if df == 0.0 || !df.is_finite() {
                continue;
            }
            let mut codes = [0u8; N];
            let mut total = 0f32;
            for j in 0..N {
                let v = s[j] / df;
                let (a, b) = levels.around(v);
                let (ea, eb) = (err(j, df * levels.level(a)), err(j, df * levels.level(b)));
                let (c, e) = if eb < ea { (b, eb) } else { (a, ea) };
                codes[j] = c;
                total += e;
            }
            if total < best.0 {
                best = (total, d, codes);
            }
        }
    }
    (best.1, best.2)
}

/// `Σ w (x − scale·level)²` of values `x` rounded to the nearest level at `scale`.
fn sub_err(x: &[f32], w: &[f32], scale: f32, levels: Levels) -> f32 {
    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    x.iter()
        .zip(w)
        .map(|(&x, &w)| {
            let e = x - scale * levels.nearest(x * inv).1;
            w * e * e
        })
        .sum()
}

/// Q6_K: 16 sub-blocks of 16, codes −32..31, i8 scales under an f16 d. Layout
/// (ggml's `block_q6_K`): ql[128] low nibbles, qh[64] two high bits, scales[16], d.
fn q6_k(x: &[f32], w: &[f32], o: &mut [u8]) {
    let lv = Levels::Int(-32, 31);
    let mut c = [0u8; 256];
    let s: [f32; 16] = std::array::from_fn(|j| {
        let r = 16 * j..16 * j + 16;
        fit_scale(&x[r.clone()], &w[r.clone()], lv, &mut c[r])
    });
    let (d, sc) = fit_scales(&s, Levels::Int(-128, 127), 1.0, |j, e| {
        sub_err(&x[16 * j..16 * j + 16], &w[16 * j..16 * j + 16], e, lv)
    });
    for (j, &code) in sc.iter().enumerate() {
        let r = 16 * j..16 * j + 16;
        let e = d.to_f32() * (code as i32 - 128) as f32;
        round_to(&x[r.clone()], e, lv, &mut c[r]);
    }
    o.fill(0);
    for (i, &q) in c.iter().enumerate() {
        let (n, k) = (i / 128, i % 128);
        let (quarter, l) = (k / 32, k % 32);
        o[n * 64 + l + (quarter & 1) * 32] |= (q & 15) << ((quarter >> 1) * 4);
        o[128 + n * 32 + l] |= (q >> 4) << (2 * quarter);
    }
    for (o, &sc) in o[192..208].iter_mut().zip(&sc) {
        *o = (sc as i32 - 128) as i8 as u8;
    }
    o[208..210].copy_from_slice(&d.to_le_bytes());
}

/// IQ4_XS: 8 sub-blocks of 32 on IQ4_NL's grid, 6-bit scales (stored + 32) under an
/// f16 d. Layout: d, scales_h (u16, two high bits each), scales_l[4] (nibbles), qs.
fn iq4_xs(x: &[f32], w: &[f32], o: &mut [u8]) {
    let mut c = [0u8; 256];
    let s: [f32; 8] = std::array::from_fn(|j| {
        let r = 32 * j..32 * j + 32;
        fit_scale(&x[r.clone()], &w[r.clone()], Levels::Nl, &mut c[r])
    });
    let (d, ls) = fit_scales(&s, Levels::Int(-32, 31), 1.0, |j, e| {
        sub_err(
            &x[32 * j..32 * j + 32],
            &w[32 * j..32 * j + 32],
            e,
            Levels::Nl,
        )
    });
    o.fill(0);
    o[..2].copy_from_slice(&d.to_le_bytes());
    let mut sh = 0u16;
    for j in 0..8 {
        let r = 32 * j..32 * j + 32;
        let e = d.to_f32() * (ls[j] as i32 - 32) as f32;
        round_to(&x[r.clone()], e, Levels::Nl, &mut c[r.clone()]);
        o[4 + j / 2] |= (ls[j] & 15) << (4 * (j % 2));
        sh |= ((ls[j] >> 4) as u16 & 3) << (2 * j);
        nibbles(&c[r], &mut o[8 + 16 * j..24 + 16 * j]);
    }
    o[2..4].copy_from_slice(&sh.to_le_bytes());
}

/// `Σ w (x − (d·q − m))²` with each code `q` in `0..=nmax` nearest for `(d, m)`.
fn aff_err(x: &[f32], w: &[f32], d: f32, m: f32, nmax: u8) -> f32 {
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    x.iter()
        .zip(w)
        .map(|(&x, &w)| {
            let q = round_in((x + m) * inv, 0.0, nmax as f32);
            let e = x - (d * q - m);
            w * e * e
        })
        .sum()
}

/// Q4_K, Q5_K: 8 sub-blocks of 32, `x ≈ d·sc·q − dmin·mn` with 6-bit sc and mn
/// under f16 d and dmin. Layout: d, dmin, scales[12] (ggml's `get_scale_min_k4`
/// packing), (Q5_K: qh[32]), qs[128].
fn qk_affine(x: &[f32], w: &[f32], nmax: u8, o: &mut [u8]) {
    let (mut s, mut mn) = ([0f32; 8], [0f32; 8]);
    let mut c = [0u8; 256];
    for j in 0..8 {
        let r = 32 * j..32 * j + 32;
        let (d, m) = fit_affine(&x[r.clone()], &w[r.clone()], nmax, true, &mut c[r]);
        s[j] = d.max(0.0);
        mn[j] = -m;
    }
    let sub = |j: usize| (&x[32 * j..32 * j + 32], &w[32 * j..32 * j + 32]);
    // The offsets first (at the sub-blocks' own scales), then the scales under the
    // offsets as stored.
    let (dmin, mc) = fit_scales(&mn, Levels::Int(0, 63), 1.0, |j, m| {
        let (x, w) = sub(j);
        aff_err(x, w, s[j], m, nmax)
    });
    let (d, sc) = fit_scales(&s, Levels::Int(0, 63), 1.0, |j, e| {
        let (x, w) = sub(j);
        aff_err(x, w, e, dmin.to_f32() * mc[j] as f32, nmax)
    });
    o.fill(0);
    o[..2].copy_from_slice(&d.to_le_bytes());
    o[2..4].copy_from_slice(&dmin.to_le_bytes());
    for j in 0..8 {
        let (a, b) = (sc[j], mc[j]);
        if j < 4 {
            o[4 + j] = a;
            o[8 + j] = b;
        } else {
            o[12 + j - 4] = (a & 15) | ((b & 15) << 4);
            o[4 + j - 4] |= (a >> 4) << 6;
            o[8 + j - 4] |= (b >> 4) << 6;
        }
        let r = 32 * j..32 * j + 32;
        let (e, m) = (d.to_f32() * a as f32, dmin.to_f32() * b as f32);
        let inv = if e > 0.0 { 1.0 / e } else { 0.0 };
        for (&x, c) in x[r.clone()].iter().zip(c[r].iter_mut()) {
            *c = round_in((x + m) * inv, 0.0, nmax as f32) as u8;
        }
    }
    let qs = if nmax == 31 { 48 } else { 16 };
    for ch in 0..4 {
        for l in 0..32 {
            let (lo, hi) = (c[64 * ch + l], c[64 * ch + 32 + l]);
            o[qs + 32 * ch + l] = (lo & 15) | ((hi & 15) << 4);
            if nmax == 31 {
                o[16 + l] |= ((lo >> 4) << (2 * ch)) | ((hi >> 4) << (2 * ch + 1));
            }
        }
    }
}

/// The 2-bit crumbs of 256 codes as Q2_K and Q3_K place them: code i in byte
/// `32·(i / 128) + i % 32` of `q`, at bit `2·((i % 128) / 32)`.
fn crumbs(c: &[u8; 256], q: &mut [u8]) {
    for (i, &v) in c.iter().enumerate() {
        q[32 * (i / 128) + i % 32] |= (v & 3) << (2 * ((i % 128) / 32));
    }
}

/// Q3_K: 16 sub-blocks of 16, codes −4..3, 6-bit scales (stored + 32) under an f16 d.
/// Layout (ggml's `block_q3_K`): hmask[32] (each code's third bit), qs[64] (its low two
/// bits, [`crumbs`]), scales[12] (low nibbles in bytes 0..8, scale j ≥ 8 in the high
/// nibble of byte j − 8; the two high bits of scale j in byte 8 + j % 4 at bit 2·(j / 4)),
/// d.
fn q3_k(x: &[f32], w: &[f32], o: &mut [u8]) {
    let lv = Levels::Int(-4, 3);
    let mut c = [0u8; 256];
    let s: [f32; 16] = std::array::from_fn(|j| {
        let r = 16 * j..16 * j + 16;
        fit_scale(&x[r.clone()], &w[r.clone()], lv, &mut c[r])
    });
    let (d, sc) = fit_scales(&s, Levels::Int(-32, 31), 1.0, |j, e| {
        sub_err(&x[16 * j..16 * j + 16], &w[16 * j..16 * j + 16], e, lv)
    });
    o.fill(0);
    for (j, &l) in sc.iter().enumerate() {
        let r = 16 * j..16 * j + 16;
        round_to(
            &x[r.clone()],
            d.to_f32() * (l as i32 - 32) as f32,
            lv,
            &mut c[r],
        );
        o[96 + j % 8] |= (l & 15) << (4 * (j / 8));
        o[104 + j % 4] |= (l >> 4) << (2 * (j / 4));
    }
    for (i, &v) in c.iter().enumerate() {
        o[i % 32] |= (v >> 2) << (4 * (i / 128) + (i % 128) / 32);
    }
    crumbs(&c, &mut o[32..96]);
    o[108..110].copy_from_slice(&d.to_le_bytes());
}

/// Q2_K: 16 sub-blocks of 16, `x ≈ d·sc·q − dmin·mn` with 4-bit sc and mn under f16 d
/// and dmin, codes 0..3. Layout (ggml's `block_q2_K`): scales[16] (sc in the low nibble,
/// mn in the high), qs[64] ([`crumbs`]), d, dmin.
fn q2_k(x: &[f32], w: &[f32], o: &mut [u8]) {
    let (mut s, mut mn) = ([0f32; 16], [0f32; 16]);
    let mut c = [0u8; 256];
    for j in 0..16 {
        let r = 16 * j..16 * j + 16;
        let (d, m) = fit_affine(&x[r.clone()], &w[r.clone()], 3, true, &mut c[r]);
        s[j] = d.max(0.0);
        mn[j] = -m;
    }
    let sub = |j: usize| (&x[16 * j..16 * j + 16], &w[16 * j..16 * j + 16]);
    let (dmin, mc) = fit_scales(&mn, Levels::Int(0, 15), 1.0, |j, m| {
        let (x, w) = sub(j);
        aff_err(x, w, s[j], m, 3)
    });
    let (d, sc) = fit_scales(&s, Levels::Int(0, 15), 1.0, |j, e| {
        let (x, w) = sub(j);
        aff_err(x, w, e, dmin.to_f32() * mc[j] as f32, 3)
    });
    o.fill(0);
    for j in 0..16 {
        o[j] = sc[j] | (mc[j] << 4);
        let (e, m) = (d.to_f32() * sc[j] as f32, dmin.to_f32() * mc[j] as f32);
        let inv = if e > 0.0 { 1.0 / e } else { 0.0 };
        for (&x, c) in x[16 * j..16 * j + 16]
            .iter()
            .zip(&mut c[16 * j..16 * j + 16])
        {
            *c = round_in((x + m) * inv, 0.0, 3.0) as u8;
        }
    }
    crumbs(&c, &mut o[16..80]);
    o[80..82].copy_from_slice(&d.to_le_bytes());
    o[82..84].copy_from_slice(&dmin.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::quant::dequantize;

    /// Deterministic pseudo-Gaussian values (sum of uniforms), every 97th four times
    /// as large.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut u = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f32 / (1u64 << 53) as f32
        };
        (0..n)
            .map(|i| {
                let g = (0..4).map(|_| u()).sum::<f32>() - 2.0;
                if i % 97 == 0 {
                    g * 0.08
                } else {
                    g * 0.02
                }
            })
            .collect()
    }

    /// The `w`-weighted squared error of `x` rounded into `ty`: by [`fit`] with weights
    /// `fit_w`, or (None) by llama-quantize's reference rounding.
    fn err_of(ty: GgmlType, x: &[f32], w: &[f32], fit_w: Option<&[f32]>) -> f64 {
        let (be, bb) = ty.block();
        let mut b = vec![0u8; x.len() / be as usize * bb as usize];
        match fit_w {
            Some(fw) => fit(ty, x, fw, &mut b).unwrap(),
            None => super::super::quantize::quantize(ty, x, &mut b).unwrap(),
        }
        let mut y = vec![0f32; x.len()];
        dequantize(ty, &b, &mut y).unwrap();
        x.iter()
            .zip(&y)
            .zip(w)
            .map(|((&a, &b), &w)| w as f64 * (a - b) as f64 * (a - b) as f64)
            .sum()
    }

    fn err(ty: GgmlType, x: &[f32], w: &[f32], fit_it: bool) -> f64 {
        err_of(ty, x, w, fit_it.then_some(w))
    }

    /// The fit's blocks decode (ggml's own layout) to values at least as close as
    /// llama-quantize's reference rounding gets, for every type both handle; IQ
    /// types, which the reference cannot write, against the Q4_0 error they undercut.
    #[test]
    fn fits_beat_the_reference_rounding() {
        let x = values(256 * 16, 7);
        let w = vec![1f32; x.len()];
        use GgmlType::*;
        for ty in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K] {
            let (f, r) = (err(ty, &x, &w, true), err(ty, &x, &w, false));
            println!("{ty:?}: fit / reference error {:.3}", f / r);
            assert!(f <= r * 1.0001, "{ty:?}: fit {f} > reference {r}");
            assert!(f > 0.0);
        }
        let q4 = err(Q4_0, &x, &w, false);
        for ty in [IQ4_NL, IQ4_XS] {
            let f = err(ty, &x, &w, true);
            assert!(f < q4, "{ty:?}: {f} ≥ Q4_0's {q4}");
        }
        // The grid types below the reference's k-quants of as many bits or more
        // (measured: IQ3_S 0.71 × Q3_K's error, IQ3_XXS 0.34 × Q2_K's, IQ2_S 0.67 × Q2_K's).
        for (ty, than) in [(IQ3_S, Q3_K), (IQ3_XXS, Q2_K), (IQ2_S, Q2_K)] {
            let (f, r) = (err(ty, &x, &w, true), err(than, &x, &w, false));
            println!("{ty:?}: fit / reference {than:?} error {:.3}", f / r);
            assert!(f < r * 0.85, "{ty:?}: {f} vs {than:?}'s {r}");
        }
    }

    /// Weights move the error where they are small: every fourth value, weighted
    /// 100×, comes out closer than unweighted fitting leaves it.
    #[test]
    fn weights_steer_the_error() {
        let x = values(256 * 8, 3);
        let w: Vec<f32> = (0..x.len())
            .map(|i| if i % 4 == 0 { 100.0 } else { 1.0 })
            .collect();
        for ty in [
            GgmlType::IQ4_NL,
            GgmlType::Q4_1,
            GgmlType::Q6_K,
            GgmlType::Q4_K,
            GgmlType::Q3_K,
            GgmlType::Q2_K,
            GgmlType::IQ3_XXS,
            GgmlType::IQ3_S,
            GgmlType::IQ2_S,
        ] {
            let ones = vec![1f32; x.len()];
            let (weighted, plain) = (err(ty, &x, &w, true), err_of(ty, &x, &w, Some(&ones)));
            assert!(weighted < plain * 0.9, "{ty:?}: {weighted} vs {plain}");
        }
    }

    #[test]
    fn zero_blocks_and_bad_sizes() {
        use GgmlType::*;
        for ty in [
            Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS,
            IQ3_S, IQ2_S,
        ] {
            let (be, bb) = ty.block();
            let x = vec![0f32; be as usize];
            let mut b = vec![0xAAu8; bb as usize];
            fit(ty, &x, &x, &mut b).unwrap();
            let mut y = vec![1f32; be as usize];
            dequantize(ty, &b, &mut y).unwrap();
            assert!(y.iter().all(|&v| v == 0.0), "{ty:?}");
            assert!(fit(ty, &x[1..], &x[1..], &mut b).is_err());
            assert!(fit(ty, &x, &x, &mut b[1..]).is_err());
        }
        assert!(fit(Q8_K, &[0.0; 256], &[1.0; 256], &mut [0; 292]).is_err());
    }
}
