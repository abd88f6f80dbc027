//! Fast paths: the reference's arithmetic, reorganized so it runs on vector registers
//! without changing a single rounding.
//!
//! - K-quant searches (the costly part: 16 to 22 trial scales per sub-block) run on
//!   16 sub-blocks at once, one per lane of [`Lanes`]. Each lane performs exactly the
//!   reference's operations for its sub-block, in the same order (sums accumulate
//!   element by element), so every lane is bit-identical to the scalar code; branches
//!   become per-lane selects, and where the reference re-derives levels from the last
//!   accepted trial, the lanes keep that trial's parameters and derive them once.
//! - Within the lanes, `nearest_int(v)` is a round-to-nearest-even, which equals it
//!   for |v| < 2^22 (beyond, the reference's bit trick returns garbage). A lane is
//!   "tame" when that bound provably holds for every trial and nothing can overflow:
//!   every |x| ≤ [`TAME`], trial scales finite. Other lanes (zero or constant
//!   sub-blocks, huge or non-finite values) are redone by `reference`, so no result
//!   depends on the bound.
//! - 32-element types take 16 blocks per step: reductions per block, then every
//!   block's scale (divisions, f16 conversions) at once, then the quants; the max/min
//!   reductions run in any order with the reference's tie rules restored explicitly
//!   (first largest magnitude, sign of the first zero).
//!
//! Each entry point is compiled three times (AVX-512, AVX2, baseline) and picked at
//! run time: the instruction set changes speed only, IEEE operations round the same
//! everywhere and Rust never fuses a multiply-add.

use super::lanes::{self, Lanes};
use super::reference as r;

/// Largest |x| a lane takes: keeps every sum and product of the searches finite (the
/// largest, Q3_K's `slx²·suml2` ~ 1e6·x⁸, stays below 1e38), so no infinity, and no
/// NaN but those of masked-off branches (0/0 where the reference skips the division),
/// can reach a result. Real weights are far smaller.
const TAME: f32 = 1e4;

/// |v| below which rounding in float equals `nearest_int`, with margin (2^22 = 4194304).
const ROUND_OK: f32 = 4.0e6;

/// `nearest_int(v)` clamped to [lo, hi], as a float, for |v| < 2^22 and not NaN.
/// Clamping first rounds the same (the bounds are integers); a -0.0 it may leave
/// instead of +0.0 changes no sum or product the levels feed, nor any level.
#[inline(always)]
fn level<L: Lanes>(v: L, lo: f32, hi: f32) -> L {
    v.min(L::splat(hi)).max(L::splat(lo)).round()
}

/// Run `$body` compiled for AVX-512, AVX2 or the baseline, whichever the CPU has (the
/// two first with the AVX2 lanes; AVX-512 adds registers and encodings).
macro_rules! multiversion {
    ($(#[$m:meta])* $v:vis fn $name:ident($($a:ident: $t:ty),*) => $body:ident) => {
        multiversion!($(#[$m])* $v fn $name($($a: $t),*) => $body::<lanes::Avx2>, $body::<lanes::Arr>);
    };
    ($(#[$m:meta])* $v:vis fn $name:ident($($a:ident: $t:ty),*) => plain $body:ident) => {
        multiversion!($(#[$m])* $v fn $name($($a: $t),*) => $body, $body);
    };
    ($(#[$m:meta])* $v:vis fn $name:ident($($a:ident: $t:ty),*) => $avx:path, $base:path) => {
        $(#[$m])*
        $v fn $name($($a: $t),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2")]
                unsafe fn avx512($($a: $t),*) {
                    $avx($($a),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($a: $t),*) {
                    $avx($($a),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    // SAFETY: the CPU has the features `avx512` is compiled for.
                    return unsafe { avx512($($a),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: as above, for AVX2.
                    return unsafe { avx2($($a),*) };
                }
            }
            $base($($a),*)
        }
    };
}

// The 32-element types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and F16/BF16.
mod block32;
pub(super) use block32::{bf16, f16, q4_0, q4_1, q5_0, q5_1, q8_0};

// ---------------------------------------------------------------------------------
// Lane kernels.

/// Parameters of `make_qkx2_quants` (`use_mad` is the kernels' `MAD`).
struct Qkx2 {
    nmax: f32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
}

/// The error of one element: absolute (`MAD`) or squared.
#[inline(always)]
fn err<L: Lanes, const MAD: bool>(d: L) -> L {
    if MAD {
        d.abs()
    } else {
        d * d
    }
}

/// Whether a trial's |iscale·(x - min)|, x within [xmin, max], stays below ROUND_OK
/// (NaN or infinity fail), so that `level` rounds as `nearest_int`.
#[inline(always)]
fn in_round_range<L: Lanes>(iscale: L, min: L, max: L, xmin: L) -> L::Mask {
    let (a, b) = ((max - min).abs(), (xmin - min).abs());
    (iscale.abs() * L::sel(a.gt(b), a, b)).lt(L::splat(ROUND_OK))
}

/// Lanes whose every |x| is at most TAME (not NaN).
#[inline(always)]
fn tame_values<L: Lanes, const N: usize>(x: &[L; N]) -> L::Mask {
    let mut ok = L::all();
    for &xi in x {
        ok = ok & xi.abs().le(L::splat(TAME));
    }
    ok
}

/// `reference::make_qkx2_quants` on W sub-blocks of N elements (`x[i]`: element i of
/// every sub-block). Levels go to `l`; returns (scale, -min) per lane and the mask of
/// lanes that are not tame (their outputs are garbage).
#[inline(always)]
fn qkx2_lanes<L: Lanes, const N: usize, const MAD: bool>(
    p: &Qkx2,
    x: &[L; N],
    w: &[L; N],
    l: &mut [L; N],
    laux: &mut [L; N],
) -> (L, L, u32) {
    let zero = L::splat(0.0);
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w[0];
    let mut sum_x = w[0] * x[0];
    for i in 1..N {
        // `if (x < min) min = x` is exactly minps(x, min), NaN and zeros included.
        min = x[i].min(min);
        max = x[i].max(max);
        sum_w = sum_w + w[i];
        sum_x = sum_x + w[i] * x[i];
    }
    let xmin = min;
    min = L::sel(min.gt(zero), zero, min);
    let nmax = p.nmax;
    let mut iscale = L::splat(nmax) / (max - min);
    let mut scale = L::splat(1.0) / iscale;
    let mut tame = tame_values(x) & max.ne(min) & in_round_range(iscale, min, max, xmin);
    let mut best = zero;
    for i in 0..N {
        let q = level(iscale * (x[i] - min), 0.0, nmax);
        best = best + w[i] * err::<L, MAD>(scale * q + min - x[i]);
    }
    // The levels are those of the last accepted trial: keep its inverse scale and the
    // min it used, and compute them once at the end.
    let mut keep_iscale = iscale;
    let mut keep_min = min;
    // x - min, the same value each trial until a lane accepts a fit (and a new min).
    let mut xm = [zero; N];
    for i in 0..N {
        xm[i] = x[i] - min;
    }
    for is in 0..=p.nstep {
        iscale = L::splat(p.rmin + p.rdelta * is as f32 + nmax) / (max - min);
        tame = tame & in_round_range(iscale, min, max, xmin);
        // iscale·(x - min) < 0 needs the lower clamp: only where an accepted min rose
        // above the smallest x, or the range is not positive (tame lanes only count).
        let low = L::any(tame & (min.gt(xmin) | iscale.le(zero)));
        let (mut sum_l, mut sum_l2, mut sum_xl) = (zero, zero, zero);
        for i in 0..N {
            let v = iscale * xm[i];
            let q = if low {
                level(v, 0.0, nmax)
            } else {
                v.min(L::splat(nmax)).round()
            };
            laux[i] = q;
            let wl = w[i] * q;
            sum_l = sum_l + wl;
            sum_l2 = sum_l2 + wl * q;
            sum_xl = sum_xl + wl * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        let s = (sum_w * sum_xl - sum_x * sum_l) / d;
        let m = (sum_l2 * sum_x - sum_l * sum_xl) / d;
        let pos = m.gt(zero);
        let this_scale = L::sel(pos, sum_xl / sum_l2, s);
        let this_min = L::sel(pos, zero, m);
        let mut cur = zero;
        for i in 0..N {
            cur = cur + w[i] * err::<L, MAD>(this_scale * laux[i] + this_min - x[i]);
        }
        let better = d.gt(zero) & cur.lt(best);
        best = L::sel(better, cur, best);
        scale = L::sel(better, this_scale, scale);
        keep_iscale = L::sel(better, iscale, keep_iscale);
        keep_min = L::sel(better, min, keep_min);
        min = L::sel(better, this_min, min);
        if L::any(better) {
            for i in 0..N {
                xm[i] = x[i] - min;
            }
        }
    }
    for i in 0..N {
        l[i] = level(keep_iscale * (x[i] - keep_min), 0.0, nmax);
    }
    (scale, -min, L::unset_bits(tame))
}

/// The signed value of largest magnitude per lane (`amax < |v|` strictly: the first
/// wins ties, NaNs never win) and that magnitude.
#[inline(always)]
fn signed_absmax_lanes<L: Lanes, const N: usize>(x: &[L; N]) -> (L, L) {
    let mut amax = L::splat(0.0);
    let mut max = L::splat(0.0);
    for &xi in x {
        let c = amax.lt(xi.abs());
        amax = L::sel(c, xi.abs(), amax);
        max = L::sel(c, xi, max);
    }
    (amax, max)
}

/// `make_qx_quants`' weighted sums Σ w·x·l and Σ w·l² (w = x²) for one trial.
#[inline(always)]
fn qx_sums<L: Lanes>(iscale: L, x: &[L; 16], wt: &[L; 16], wx: &[L; 16]) -> (L, L) {
    let (mut sumlx, mut suml2) = (L::splat(0.0), L::splat(0.0));
    for i in 0..16 {
        let q = level(iscale * x[i], -32.0, 31.0);
        sumlx = sumlx + wx[i] * q;
        suml2 = suml2 + wt[i] * q * q;
    }
    (sumlx, suml2)
}

/// `reference::make_qx_quants_rmse1(32, ..)` on W sub-blocks of 16 elements. Levels
/// (0..64) go to `l`; returns the scales and the mask of lanes that are not tame.
#[inline(always)]
fn qx32_lanes<L: Lanes>(x: &[L; 16], l: &mut [L; 16]) -> (L, u32) {
    const NMAX: f32 = 32.0;
    let zero = L::splat(0.0);
    let (amax, max) = signed_absmax_lanes(x);
    // Below GROUP_MAX_EPS the reference returns zeros; the largest trial |iscale|,
    // 32.9/amax, must be finite, and then |iscale·x| ≤ 32.9 for every trial.
    let tame =
        tame_values(x) & amax.ge(L::splat(super::GROUP_MAX_EPS)) & (L::splat(32.9) / amax).finite();
    let mut wt = [zero; 16];
    let mut wx = [zero; 16];
    for i in 0..16 {
        wt[i] = x[i] * x[i];
        wx[i] = wt[i] * x[i];
    }
    let mut best_iscale = L::splat(-NMAX) / max;
    let (sumlx, suml2) = qx_sums(best_iscale, x, &wt, &wx);
    let mut scale = L::sel(suml2.ne(zero), sumlx / suml2, zero);
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = L::splat(-(NMAX + 0.1 * is as f32)) / max;
        let (sumlx, suml2) = qx_sums(iscale, x, &wt, &wx);
        let better = suml2.gt(zero) & (sumlx * sumlx).gt(best * suml2);
        let s = sumlx / suml2;
        scale = L::sel(better, s, scale);
        best = L::sel(better, s * sumlx, best);
        best_iscale = L::sel(better, iscale, best_iscale);
    }
    // The reference keeps the levels of the last accepted trial: recompute them.
    for i in 0..16 {
        l[i] = L::splat(NMAX) + level(best_iscale * x[i], -NMAX, NMAX - 1.0);
    }
    (scale, L::unset_bits(tame))
}

/// `reference::make_q3_quants(4, .., true)` on W sub-blocks of 16 elements. Levels
/// (0..8) go to `l`; returns the scales and the mask of lanes that are not tame.
#[inline(always)]
fn q3_lanes<L: Lanes>(x: &[L; 16], l: &mut [L; 16]) -> (L, u32) {
    const NMAX: f32 = 4.0;
    let zero = L::splat(0.0);
    let (amax, max) = signed_absmax_lanes(x);
    let tame =
        tame_values(x) & amax.ge(L::splat(super::GROUP_MAX_EPS)) & (L::splat(NMAX) / amax).finite();
    let iscale = L::splat(-NMAX) / max;
    let mut wt = [zero; 16];
    let mut wx = [zero; 16];
    let (mut sumlx, mut suml2) = (zero, zero);
    for i in 0..16 {
        wt[i] = x[i] * x[i];
        wx[i] = wt[i] * x[i];
        let q = level(iscale * x[i], -NMAX, NMAX - 1.0);
        l[i] = q;
        sumlx = sumlx + wx[i] * q;
        suml2 = suml2 + wt[i] * q * q;
    }
    for _ in 0..5 {
        let mut changed = L::none();
        for i in 0..16 {
            let li = l[i];
            let slx = sumlx - wx[i] * li;
            let sl2 = suml2 - wt[i] * li * li;
            // x·sl2/slx is unbounded: the exact integer trick, not `level`.
            let nl = (x[i] * sl2 / slx).nearest_int_clamped(-4, 3);
            let slx2 = slx + wx[i] * nl;
            let sl22 = sl2 + wt[i] * nl * nl;
            let take = slx.gt(zero)
                & nl.ne(li)
                & sl22.gt(zero)
                & (slx2 * slx2 * suml2).gt(sumlx * sumlx * sl22);
            l[i] = L::sel(take, nl, li);
            sumlx = L::sel(take, slx2, sumlx);
            suml2 = L::sel(take, sl22, suml2);
            changed = changed | take;
        }
        // A pass that changes nothing leaves the state as it was, so more passes on a
        // lane that has converged change nothing either: stop once all have.
        if !L::any(changed) {
            break;
        }
    }
    for li in l.iter_mut() {
        *li = *li + L::splat(NMAX);
    }
    let scale = L::sel(suml2.gt(zero), sumlx / suml2, zero);
    (scale, L::unset_bits(tame))
}

// ---------------------------------------------------------------------------------
// K-quant rows.

/// Q4_K (`Q5` false, nmax 15) or Q5_K (31): two super-blocks (16 sub-blocks of 32) per
/// search.
#[inline(always)]
fn k4_blocks<L: Lanes, const Q5: bool>(src: &[f32], out: &mut [u8]) {
    let (nmax, bb) = if Q5 { (31, 176) } else { (15, 144) };
    let p = Qkx2 {
        nmax: nmax as f32,
        rmin: if Q5 { -0.5 } else { -1.0 },
        rdelta: 0.1,
        nstep: if Q5 { 15 } else { 20 },
    };
    let zero = L::splat(0.0);
    let mut x = [zero; 32];
    let mut w = [zero; 32];
    let mut l = [zero; 32];
    let mut laux = [zero; 32];
    let mut pad = [0f32; 512];
    for (src, out) in src.chunks(512).zip(out.chunks_mut(2 * bb)) {
        // A lone last super-block searches beside a copy of itself.
        let whole = if src.len() == 512 {
            src
        } else {
            pad[..256].copy_from_slice(src);
            pad[256..].copy_from_slice(src);
            &pad
        };
        L::from_subblocks(whole, &mut x);
        // Weights av_x + |x|, av_x the sub-block's RMS (sum in element order).
        let mut sum_x2 = zero;
        for &xi in &x {
            sum_x2 = sum_x2 + xi * xi;
        }
        let av_x = (sum_x2 / L::splat(32.0)).sqrt();
        for i in 0..32 {
            w[i] = av_x + x[i].abs();
        }
        let (scale, neg_min, wild) = qkx2_lanes::<L, 32, false>(&p, &x, &w, &mut l, &mut laux);
        let (scale, neg_min) = (scale.to_array(), neg_min.to_array());
        // Both super-blocks' levels (the second's are dropped when there is none).
        let mut lv = [[0u8; 256]; 2];
        L::to_subblocks(&l, lv.as_flattened_mut());
        for (b, (xs, y)) in src.chunks(256).zip(out.chunks_mut(bb)).enumerate() {
            let xs = super::superblock(xs);
            let mut scales = [0f32; 8];
            let mut mins = [0f32; 8];
            let lv = &mut lv[b];
            for j in 0..8 {
                let k = 8 * b + j;
                if wild & (1 << k) == 0 {
                    scales[j] = scale[k];
                    mins[j] = neg_min[k];
                } else {
                    let ws: [f32; 32] = std::array::from_fn(|i| w[i].to_array()[k]);
                    (scales[j], mins[j]) = r::make_qkx2_quants(
                        nmax,
                        &xs[32 * j..32 * j + 32],
                        &ws,
                        &mut lv[32 * j..32 * j + 32],
                        p.rmin,
                        p.rdelta,
                        p.nstep,
                        false,
                    );
                }
            }
            r::k4_finish(nmax, xs, &scales, &mins, lv, y);
            if Q5 {
                r::pack_q5_k(lv, y);
            } else {
                r::pack_q4_k(lv, y);
            }
        }
    }
}

#[inline(always)]
fn q4_k_body<L: Lanes>(src: &[f32], out: &mut [u8]) {
    k4_blocks::<L, false>(src, out)
}

#[inline(always)]
fn q5_k_body<L: Lanes>(src: &[f32], out: &mut [u8]) {
    k4_blocks::<L, true>(src, out)
}

#[inline(always)]
fn q2_k_body<L: Lanes>(src: &[f32], out: &mut [u8]) {
    let p = Qkx2 {
        nmax: 3.0,
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
    };
    let zero = L::splat(0.0);
    let mut x = [zero; 16];
    let mut w = [zero; 16];
    let mut l = [zero; 16];
    let mut laux = [zero; 16];
    for (xs, y) in src.chunks(256).zip(out.chunks_mut(84)) {
        let xs = super::superblock(xs);
        L::from_subblocks(xs, &mut x);
        for i in 0..16 {
            w[i] = x[i].abs();
        }
        let (scales, mins, wild) = qkx2_lanes::<L, 16, true>(&p, &x, &w, &mut l, &mut laux);
        let (mut scales, mut mins) = (scales.to_array(), mins.to_array());
        let mut lv = [0u8; 256];
        L::to_subblocks(&l, &mut lv);
        for k in 0..16 {
            if wild & (1 << k) != 0 {
                let xs = &xs[16 * k..16 * k + 16];
                let ws: [f32; 16] = std::array::from_fn(|i| xs[i].abs());
                let sub = &mut lv[16 * k..16 * k + 16];
                (scales[k], mins[k]) =
                    r::make_qkx2_quants(3, xs, &ws, sub, p.rmin, p.rdelta, p.nstep, true);
            }
        }
        r::q2_k_finish(xs, &scales, &mins, &mut lv, y);
    }
}

#[inline(always)]
fn q6_k_body<L: Lanes>(src: &[f32], out: &mut [u8]) {
    let mut x = [L::splat(0.0); 16];
    let mut l = [L::splat(0.0); 16];
    for (xs, y) in src.chunks(256).zip(out.chunks_mut(210)) {
        let xs = super::superblock(xs);
        L::from_subblocks(xs, &mut x);
        let (scales, wild) = qx32_lanes(&x, &mut l);
        let mut scales = scales.to_array();
        let mut lv = [0u8; 256];
        L::to_subblocks(&l, &mut lv);
        for k in 0..16 {
            if wild & (1 << k) != 0 {
                let sub = &mut lv[16 * k..16 * k + 16];
                scales[k] = r::make_qx_quants_rmse1(32, &xs[16 * k..16 * k + 16], sub);
            }
        }
        r::q6_k_finish(xs, &scales, &mut lv, y);
    }
}

#[inline(always)]
fn q3_k_body<L: Lanes>(src: &[f32], out: &mut [u8]) {
    let mut x = [L::splat(0.0); 16];
    let mut l = [L::splat(0.0); 16];
    for (xs, y) in src.chunks(256).zip(out.chunks_mut(110)) {
        let xs = super::superblock(xs);
        L::from_subblocks(xs, &mut x);
        let (scales, wild) = q3_lanes(&x, &mut l);
        let mut scales = scales.to_array();
        let mut lu = [0u8; 256];
        L::to_subblocks(&l, &mut lu);
        let mut lv = lu.map(|v| v as i8);
        for k in 0..16 {
            if wild & (1 << k) != 0 {
                let sub = &mut lv[16 * k..16 * k + 16];
                scales[k] = r::make_q3_quants(4, &xs[16 * k..16 * k + 16], sub);
            }
        }
        r::q3_k_finish(xs, &scales, &mut lv, y);
    }
}

multiversion!(
    /// Q4_K rows: `src` whole super-blocks, `out` their bytes.
    pub(super) fn q4_k(src: &[f32], out: &mut [u8]) => q4_k_body
);
multiversion!(
    /// Q5_K rows.
    pub(super) fn q5_k(src: &[f32], out: &mut [u8]) => q5_k_body
);
multiversion!(
    /// Q2_K rows.
    pub(super) fn q2_k(src: &[f32], out: &mut [u8]) => q2_k_body
);
multiversion!(
    /// Q3_K rows.
    pub(super) fn q3_k(src: &[f32], out: &mut [u8]) => q3_k_body
);
multiversion!(
    /// Q6_K rows.
    pub(super) fn q6_k(src: &[f32], out: &mut [u8]) => q6_k_body
);

/// The portable lanes (`lanes::Arr`), whatever the CPU: lets tests check the code
/// path CPUs without AVX2 take.
#[cfg(test)]
pub(super) fn portable(ty: crate::gguf::GgmlType, src: &[f32], out: &mut [u8]) {
    use crate::gguf::GgmlType::*;
    match ty {
        Q4_K => q4_k_body::<lanes::Arr>(src, out),
        Q5_K => q5_k_body::<lanes::Arr>(src, out),
        Q2_K => q2_k_body::<lanes::Arr>(src, out),
        Q3_K => q3_k_body::<lanes::Arr>(src, out),
        Q6_K => q6_k_body::<lanes::Arr>(src, out),
        Q8_0 => block32::q8_0_body::<lanes::Arr>(src, out),
        Q4_0 => block32::q4_0_body::<lanes::Arr>(src, out),
        Q4_1 => block32::q4_1_body::<lanes::Arr>(src, out),
        Q5_0 => block32::q5_0_body::<lanes::Arr>(src, out),
        Q5_1 => block32::q5_1_body::<lanes::Arr>(src, out),
        F16 => block32::f16_body(src, out),
        BF16 => block32::bf16_body(src, out),
        _ => super::quantize(ty, src, out).expect("sizes checked by the caller"),
    }
}
