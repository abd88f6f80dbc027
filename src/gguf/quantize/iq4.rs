//! IQ4_NL and IQ4_XS as `ggml_quantize_chunk` writes them without an importance matrix
//! (`quantize_iq4_nl` / `quantize_iq4_xs`, i.e. `quantize_row_iq4_nl_impl` with 7
//! tries and each value's square as its weight): the same float operations in the same
//! order, the same comparisons, so ties, NaNs and infinities come out the same.

use super::{fp32_to_fp16, nearest_int};
use crate::gguf::quant::IQ4_NL_GRID;

/// A sub-block whose largest |x| is below this is all zero (`GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Scales tried on each side of the first guess.
const NTRY: i32 = 7;

fn level(i: usize) -> f32 {
    IQ4_NL_GRID[i] as f32
}

/// ggml's `best_index_int8` over the IQ4_NL grid: a bisection, then the nearer of the
/// two levels around `x` (the upper one on a tie).
fn best_index(x: f32) -> u8 {
    if x <= level(0) {
        return 0;
    }
    if x >= level(15) {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < level(mav) {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - level(mu - 1) < level(mu) - x {
        (mu - 1) as u8
    } else {
        mu as u8
    }
}

/// One sub-block of 32: its scale by weighted least squares over the first guess and
/// `2·NTRY + 1` others (0 when the sub-block is all but zero).
fn sub_scale(xb: &[f32]) -> f32 {
    let weight: [f32; 32] = std::array::from_fn(|j| xb[j] * xb[j]);
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in xb {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let sums = |id: f32| {
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for (&x, &w) in xb.iter().zip(&weight) {
            let q = level(best_index(id * x) as usize);
            sumqx += w * q * x;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    };
    let d = -max / level(0);
    let (sumqx, sumq2) = sums(1.0 / d);
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -NTRY..=NTRY {
        let (sumqx, sumq2) = sums((itry + IQ4_NL_GRID[0] as i32) as f32 / max);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// 32 codes as ggml packs them: byte j holds element j low, j + 16 high.
fn pack(l: &[u8], qs: &mut [u8]) {
    for j in 0..16 {
        qs[j] = l[j] | (l[j + 16] << 4);
    }
}

/// IQ4_NL blocks (f16 d, 16 bytes of codes) of `x`.
pub(super) fn iq4_nl(x: &[f32], y: &mut [u8]) {
    for (xb, yb) in x.chunks_exact(32).zip(y.chunks_exact_mut(18)) {
        let d = sub_scale(xb);
        yb[..2].copy_from_slice(&fp32_to_fp16(d).to_le_bytes());
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let l: [u8; 32] = std::array::from_fn(|j| best_index(id * xb[j]));
        pack(&l, &mut yb[2..]);
    }
}

/// IQ4_XS blocks (f16 d, u16 scales_h, scales_l[4], 128 bytes of codes) of `x`: the
/// sub-block scales as 6-bit multiples of `d = −(the one largest in magnitude) / 32`.
pub(super) fn iq4_xs(x: &[f32], y: &mut [u8]) {
    for (xs, yb) in x.chunks_exact(256).zip(y.chunks_exact_mut(136)) {
        let scales: [f32; 8] = std::array::from_fn(|ib| sub_scale(&xs[32 * ib..32 * ib + 32]));
        let (mut max_scale, mut amax_scale) = (0f32, 0f32);
        for &d in &scales {
            if d.abs() > amax_scale {
                amax_scale = d.abs();
                max_scale = d;
            }
        }
        let d = -max_scale / 32.0;
        yb.fill(0);
        yb[..2].copy_from_slice(&fp32_to_fp16(d).to_le_bytes());
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sh = 0u16;
        for (ib, &s) in scales.iter().enumerate() {
            let l = nearest_int(id * s);
            let l = l.clamp(-32, 31);
            let dl = d * l as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            let xb = &xs[32 * ib..32 * ib + 32];
            let codes: [u8; 32] = std::array::from_fn(|j| best_index(idl * xb[j]));
            pack(&codes, &mut yb[8 + 16 * ib..24 + 16 * ib]);
            let l = (l + 32) as u8;
            yb[4 + ib / 2] |= (l & 15) << (4 * (ib % 2));
            sh |= ((l >> 4) as u16) << (2 * (ib % 8));
        }
        yb[2..4].copy_from_slice(&sh.to_le_bytes());
    }
}
