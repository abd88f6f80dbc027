//! The 32-element types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and F16/BF16, 16 blocks per
//! step: reductions per block, then every block's scale (divisions, f16 conversions)
//! at once, then the quants; the max/min reductions run in any order with the
//! reference's tie rules restored explicitly (first largest magnitude, sign of the
//! first zero). Bit-identical to `reference`, like the rest of `fast`.

use super::super::lanes::{self, Lanes};
use super::super::reference as r;
use super::super::{fp32_to_bf16, fp32_to_fp16};

#[inline(always)]
fn sel(c: bool, a: f32, b: f32) -> f32 {
    if c {
        a
    } else {
        b
    }
}

/// A 32-element block as two 16-lane vectors.
#[inline(always)]
fn halves<L: Lanes>(x: &[f32; 32]) -> [L; 2] {
    let (a, b) = x.split_at(16);
    [
        L::load(a.try_into().expect("16")),
        L::load(b.try_into().expect("16")),
    ]
}

/// Largest |v| with `a < |v|` (NaNs never win): a maximum of non-NaN values, in any
/// order.
#[inline(always)]
fn absmax32<L: Lanes>(x: &[f32; 32]) -> f32 {
    let [a, b] = halves::<L>(x);
    // maxps(|v|, m) keeps m when |v| is NaN (and m starts at 0, not at a NaN).
    let m = b.abs().max(a.abs().max(L::splat(0.0))).to_array();
    m.iter().fold(0f32, |a, &v| sel(a < v, v, a))
}

/// The first value of largest magnitude, as `signed_absmax` (0 when all are zero).
#[inline(always)]
fn signed_absmax32<L: Lanes>(x: &[f32; 32]) -> f32 {
    let amax = absmax32::<L>(x);
    if amax > 0.0 {
        // amax is one of the |v|: the first such v is the reference's pick.
        let at = first_set(x, |v| v.abs() == amax);
        x.get(at).copied().unwrap_or(0.0)
    } else {
        0.0
    }
}

/// Index of the first element with `f` true (32 when none), branch-free.
#[inline(always)]
fn first_set(x: &[f32; 32], f: impl Fn(f32) -> bool) -> usize {
    let mut bits = 0u32;
    for (j, &v) in x.iter().enumerate() {
        bits |= (f(v) as u32) << j;
    }
    bits.trailing_zeros() as usize
}

/// Minimum and maximum as `min_max` (FLT_MAX / -FLT_MAX when all are NaN). Partial
/// results can only disagree with the sequential scan on which zero wins a tie: the
/// scan keeps the first zero it meets, so restore that one's sign.
#[inline(always)]
fn min_max32<L: Lanes>(x: &[f32; 32]) -> (f32, f32) {
    let [a, b] = halves::<L>(x);
    // minps(v, m) = v < m ? v : m, the reference's own update; NaNs never win.
    let lo = b.min(a.min(L::splat(f32::MAX))).to_array();
    let hi = b.max(a.max(L::splat(-f32::MAX))).to_array();
    let mut min = lo.iter().fold(f32::MAX, |a, &v| sel(v < a, v, a));
    let mut max = hi.iter().fold(-f32::MAX, |a, &v| sel(v > a, v, a));
    if min == 0.0 || max == 0.0 {
        let first_zero = x.get(first_set(x, |v| v == 0.0)).copied().unwrap_or(0.0);
        if min == 0.0 {
            min = first_zero;
        }
        if max == 0.0 {
            max = first_zero;
        }
    }
    (min, max)
}

#[inline(always)]
fn block32(x: &[f32]) -> &[f32; 32] {
    x.try_into().expect("32-element block")
}

/// Blocks handled per step by the 32-element types: each step first reduces every
/// block (max, min), then computes all the scales together (divisions and f16
/// conversions, vectorized across blocks), then quantizes, so no block's chain of
/// dependent operations stalls the next.
const BATCH: usize = 16;

/// `1/d` (0 for d = 0) and d as f16, for a batch of scales.
#[inline(always)]
fn inverse_and_f16(d: &[f32; BATCH]) -> ([f32; BATCH], [u16; BATCH]) {
    let mut id = [0f32; BATCH];
    let mut h = [0u16; BATCH];
    for b in 0..BATCH {
        id[b] = if d[b] != 0.0 { 1.0 / d[b] } else { 0.0 };
        h[b] = fp32_to_fp16(d[b]);
    }
    (id, h)
}

/// C's `(int8_t)f` for each value of the block, `f` being `map` of the value: the
/// x86 conversion to 32 bits, then the low byte, sign-extended.
#[inline(always)]
fn c_i8s<L: Lanes>(x: &[f32; 32], map: impl Fn(L) -> L) -> [i32; 32] {
    let [a, b] = halves::<L>(x);
    let (a, b) = (map(a).cvtt(), map(b).cvtt());
    std::array::from_fn(|j| if j < 16 { a[j] } else { b[j - 16] } as i8 as i32)
}

#[inline(always)]
pub(super) fn q8_0_body<L: Lanes>(src: &[f32], out: &mut [u8]) {
    for (xs, ys) in src.chunks(32 * BATCH).zip(out.chunks_mut(34 * BATCH)) {
        let mut d = [0f32; BATCH];
        let mut nan = 0u32;
        for (b, x) in xs.chunks_exact(32).enumerate() {
            let x = block32(x);
            d[b] = absmax32::<L>(x) / 127.0;
            nan |= (x.iter().fold(false, |a, v| a | v.is_nan()) as u32) << b;
        }
        let (id, dh) = inverse_and_f16(&d);
        for (b, (x, y)) in xs.chunks_exact(32).zip(ys.chunks_exact_mut(34)).enumerate() {
            // MAX(amax, |v|) lets a NaN reset the running maximum: order matters then.
            if nan & (1 << b) != 0 {
                r::q8_0(x, y);
                continue;
            }
            y[..2].copy_from_slice(&dh[b].to_le_bytes());
            let id = L::splat(id[b]);
            let q = c_i8s::<L>(block32(x), |v| (v * id).round_away());
            for (y, q) in y[2..34].iter_mut().zip(q) {
                *y = q as u8;
            }
        }
    }
}

#[inline(always)]
pub(super) fn q4_0_body<L: Lanes>(src: &[f32], out: &mut [u8]) {
    for (xs, ys) in src.chunks(32 * BATCH).zip(out.chunks_mut(18 * BATCH)) {
        let mut d = [0f32; BATCH];
        for (b, x) in xs.chunks_exact(32).enumerate() {
            d[b] = signed_absmax32::<L>(block32(x)) / -8.0;
        }
        let (id, dh) = inverse_and_f16(&d);
        for (b, (x, y)) in xs.chunks_exact(32).zip(ys.chunks_exact_mut(18)).enumerate() {
            y[..2].copy_from_slice(&dh[b].to_le_bytes());
            let id = L::splat(id[b]);
            let q = c_i8s::<L>(block32(x), |v| v * id + L::splat(8.5)).map(|q| q.min(15) as u8);
            for j in 0..16 {
                y[2 + j] = q[j] | (q[j + 16] << 4);
            }
        }
    }
}

#[inline(always)]
pub(super) fn q4_1_body<L: Lanes>(src: &[f32], out: &mut [u8]) {
    for (xs, ys) in src.chunks(32 * BATCH).zip(out.chunks_mut(20 * BATCH)) {
        let mut d = [0f32; BATCH];
        let mut mins = [0f32; BATCH];
        for (b, x) in xs.chunks_exact(32).enumerate() {
            let (min, max) = min_max32::<L>(block32(x));
            d[b] = (max - min) / 15.0;
            mins[b] = min;
        }
        let (id, dh) = inverse_and_f16(&d);
        let (_, mh) = inverse_and_f16(&mins);
        for (b, (x, y)) in xs.chunks_exact(32).zip(ys.chunks_exact_mut(20)).enumerate() {
            y[..2].copy_from_slice(&dh[b].to_le_bytes());
            y[2..4].copy_from_slice(&mh[b].to_le_bytes());
            let (min, id) = (L::splat(mins[b]), L::splat(id[b]));
            let q =
                c_i8s::<L>(block32(x), |v| (v - min) * id + L::splat(0.5)).map(|q| q.min(15) as u8);
            for j in 0..16 {
                y[4 + j] = q[j] | (q[j + 16] << 4);
            }
        }
    }
}

/// Q5 nibbles into `qs`; returns the fifth bits (element j's in bit j).
#[inline(always)]
fn pack_q5(q: &[u8; 32], qs: &mut [u8]) -> u32 {
    let mut qh = 0u32;
    for j in 0..16 {
        qs[j] = (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4);
    }
    for (j, &v) in q.iter().enumerate() {
        qh |= (((v & 0x10) >> 4) as u32) << j;
    }
    qh
}

#[inline(always)]
pub(super) fn q5_0_body<L: Lanes>(src: &[f32], out: &mut [u8]) {
    for (xs, ys) in src.chunks(32 * BATCH).zip(out.chunks_mut(22 * BATCH)) {
        let mut d = [0f32; BATCH];
        for (b, x) in xs.chunks_exact(32).enumerate() {
            d[b] = signed_absmax32::<L>(block32(x)) / -16.0;
        }
        let (id, dh) = inverse_and_f16(&d);
        for (b, (x, y)) in xs.chunks_exact(32).zip(ys.chunks_exact_mut(22)).enumerate() {
            y[..2].copy_from_slice(&dh[b].to_le_bytes());
            let id = L::splat(id[b]);
            let q = c_i8s::<L>(block32(x), |v| v * id + L::splat(16.5)).map(|q| q.min(31) as u8);
            let qh = pack_q5(&q, &mut y[6..22]);
            y[2..6].copy_from_slice(&qh.to_le_bytes());
        }
    }
}

#[inline(always)]
pub(super) fn q5_1_body<L: Lanes>(src: &[f32], out: &mut [u8]) {
    for (xs, ys) in src.chunks(32 * BATCH).zip(out.chunks_mut(24 * BATCH)) {
        let mut d = [0f32; BATCH];
        let mut mins = [0f32; BATCH];
        for (b, x) in xs.chunks_exact(32).enumerate() {
            let (min, max) = min_max32::<L>(block32(x));
            d[b] = (max - min) / 31.0;
            mins[b] = min;
        }
        let (id, dh) = inverse_and_f16(&d);
        let (_, mh) = inverse_and_f16(&mins);
        for (b, (x, y)) in xs.chunks_exact(32).zip(ys.chunks_exact_mut(24)).enumerate() {
            y[..2].copy_from_slice(&dh[b].to_le_bytes());
            y[2..4].copy_from_slice(&mh[b].to_le_bytes());
            let (min, id) = (L::splat(mins[b]), L::splat(id[b]));
            // `(uint8_t)f`: the low byte of the 32-bit conversion.
            let q = c_i8s::<L>(block32(x), |v| (v - min) * id + L::splat(0.5)).map(|q| q as u8);
            let qh = pack_q5(&q, &mut y[8..24]);
            y[4..8].copy_from_slice(&qh.to_le_bytes());
        }
    }
}

#[inline(always)]
pub(super) fn f16_body(src: &[f32], out: &mut [u8]) {
    for (x, y) in src.iter().zip(out.chunks_exact_mut(2)) {
        y.copy_from_slice(&fp32_to_fp16(*x).to_le_bytes());
    }
}

#[inline(always)]
pub(super) fn bf16_body(src: &[f32], out: &mut [u8]) {
    for (x, y) in src.iter().zip(out.chunks_exact_mut(2)) {
        y.copy_from_slice(&fp32_to_bf16(*x).to_le_bytes());
    }
}

multiversion!(
    /// Q8_0 rows.
    pub(in crate::gguf::quantize) fn q8_0(src: &[f32], out: &mut [u8]) => q8_0_body
);
multiversion!(
    /// Q4_0 rows.
    pub(in crate::gguf::quantize) fn q4_0(src: &[f32], out: &mut [u8]) => q4_0_body
);
multiversion!(
    /// Q4_1 rows.
    pub(in crate::gguf::quantize) fn q4_1(src: &[f32], out: &mut [u8]) => q4_1_body
);
multiversion!(
    /// Q5_0 rows.
    pub(in crate::gguf::quantize) fn q5_0(src: &[f32], out: &mut [u8]) => q5_0_body
);
multiversion!(
    /// Q5_1 rows.
    pub(in crate::gguf::quantize) fn q5_1(src: &[f32], out: &mut [u8]) => q5_1_body
);
multiversion!(
    /// F16 values.
    pub(in crate::gguf::quantize) fn f16(src: &[f32], out: &mut [u8]) => plain f16_body
);
multiversion!(
    /// BF16 values.
    pub(in crate::gguf::quantize) fn bf16(src: &[f32], out: &mut [u8]) => plain bf16_body
);
