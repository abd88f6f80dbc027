//! Scalar group quantization, NDSQ's other R (docs/CODECS.md, "R as scalar groups"):
//! each group of `group` consecutive values of a row is an affine grid
//! `min + scale·q` with `bits`-bit codes and (scale, min) in f16. Pure functions over
//! slices: fitting a group, packing and unpacking codes, decoding rows.

use half::f16;

/// The grid's shape for a tensor of `cols` columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SqShape {
    pub bits: usize,
    pub group: usize,
    pub cols: usize,
}

impl SqShape {
    /// Checks `1 ≤ bits ≤ 8` and that `group` divides `cols`.
    pub fn new(bits: u32, group: u32, cols: u64) -> Result<Self, String> {
        if !(1..=8).contains(&bits) {
            return Err(format!("scalar R bits {bits} is not in 1..=8"));
        }
        if group == 0 || cols % group as u64 != 0 {
            return Err(format!(
                "scalar R group {group} does not divide cols {cols}"
            ));
        }
        Ok(SqShape {
            bits: bits as usize,
            group: group as usize,
            cols: cols as usize,
        })
    }
    pub fn groups(&self) -> usize {
        self.cols / self.group
    }
    /// Bytes of one row's packed codes.
    pub fn code_bytes(&self) -> usize {
        (self.cols * self.bits).div_ceil(8)
    }
    /// The largest code.
    pub fn qmax(&self) -> u32 {
        (1u32 << self.bits) - 1
    }
}

/// Quantized rows: per row, `groups` (scale, min) pairs and the packed codes.
pub(crate) struct SqRows {
    /// rows × groups × [scale, min].
    pub params: Vec<f16>,
    /// rows × code_bytes.
    pub codes: Vec<u8>,
}

/// One decoded value (the format's arithmetic: multiply, then add).
#[inline(always)]
pub(crate) fn value(scale: f32, min: f32, q: u32) -> f32 {
    value_f(scale, min, q as f32)
}

/// [`value`] with the code already an f32 (the fit's vectorized passes).
#[inline(always)]
fn value_f(scale: f32, min: f32, q: f32) -> f32 {
    min + scale * q
}

/// Quantizes `x` (rows × cols) group by group. `weight(i, row_w)` fills row i's
/// per-column weights (≥ 0) into `row_w`. Rows run in parallel; each row's result
/// depends only on its own values and weights, so the output is deterministic.
pub(crate) fn quantize(
    x: &[f32],
    s: SqShape,
    weight: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<SqRows, String> {
    use rayon::prelude::*;
    let rows = x.len() / s.cols;
    let (g, cb) = (s.groups(), s.code_bytes());
    let mut params = vec![f16::ZERO; rows * g * 2];
    let mut codes = vec![0u8; rows * cb];
    params
        .par_chunks_mut(g * 2)
        .zip(codes.par_chunks_mut(cb))
        .enumerate()
        .try_for_each(|(i, (p, c))| {
            let xr = &x[i * s.cols..(i + 1) * s.cols];
            let mut wr = vec![1f32; s.cols];
            weight(i, &mut wr);
            let mut q = vec![0u8; s.cols];
            for (k, ((xg, wg), qg)) in xr
                .chunks_exact(s.group)
                .zip(wr.chunks_exact(s.group))
                .zip(q.chunks_exact_mut(s.group))
                .enumerate()
            {
                let (sc, mn) = fit(xg, wg, s.qmax())
                    .ok_or_else(|| format!("row {i} group {k}: values out of f16 range"))?;
                p[2 * k] = sc;
                p[2 * k + 1] = mn;
                assign(xg, sc.to_f32(), mn.to_f32(), s.qmax(), qg);
            }
            pack(&q, s.bits, c);
            Ok::<(), String>(())
        })?;
    Ok(SqRows { params, codes })
}

/// `x` (rows × cols) quantized with `s`, each column weighted by `col_w` (all 1 when
/// None) in the fit, as the encoder fits R: Σ weight·(x − x̂)², and the rows' group
/// parameters (f16, little-endian) and packed codes as a block payload holds them.
pub(crate) fn trial(
    x: &[f32],
    s: SqShape,
    col_w: Option<&[f32]>,
) -> Result<(f64, Vec<u8>), String> {
    let q = quantize(x, s, |_, row| {
        if let Some(w) = col_w {
            row.copy_from_slice(w);
        }
    })?;
    let (g, cb) = (s.groups(), s.code_bytes());
    let mut e = 0f64;
    for (i, row) in x.chunks_exact(s.cols).enumerate() {
        let codes = &q.codes[i * cb..(i + 1) * cb];
        for (j, &v) in row.iter().enumerate() {
            let k = i * g + j / s.group;
            let (sc, mn) = (q.params[2 * k].to_f32(), q.params[2 * k + 1].to_f32());
            let d = (v - value(sc, mn, code(codes, s.bits, j))) as f64;
            e += col_w.map_or(1.0, |w| w[j] as f64) * d * d;
        }
    }
    let mut payload = Vec::with_capacity(q.params.len() * 2 + q.codes.len());
    for p in &q.params {
        payload.extend_from_slice(&p.to_le_bytes());
    }
    payload.extend_from_slice(&q.codes);
    Ok((e, payload))
}

/// The code of `v` on the grid (min, 1/`inv`) by rounding `(v − min)·inv` to the
/// nearest integer in [0, top], halves away from zero, as an f32. Without the libm call
/// or a float-to-int conversion, so that loops over a group vectorize: clamping first
/// gives what rounding then clamping would (NaN gives 0 either way); adding and
/// subtracting 2²³ rounds a value in [0, 2²³) to the nearest integer, ties to even, and
/// `t − r` is exact.
#[inline(always)]
fn rounded(v: f32, min: f32, inv: f32, top: f32) -> f32 {
    const SHIFT: f32 = 8_388_608.0;
    let t = ((v - min) * inv).max(0.0).min(top);
    let r = (t + SHIFT) - SHIFT;
    if t - r == 0.5 {
        r + 1.0
    } else {
        r
    }
}

/// The nearest code of `v` on the grid (scale, min), `inv` = 1/scale (0 when scale is
/// 0): [`rounded`], then its neighbours compared, since `(v − min)·inv` can land a
/// half-step off.
#[inline(always)]
fn nearest(v: f32, scale: f32, min: f32, inv: f32, top: f32) -> f32 {
    let c = rounded(v, min, inv, top);
    let e = (v - value_f(scale, min, c)).abs();
    let eu = (v - value_f(scale, min, c + 1.0)).abs();
    let ed = (v - value_f(scale, min, c - 1.0)).abs();
    let up = c < top && eu < e;
    let down = c > 0.0 && ed < e;
    c + if up {
        1.0
    } else if down {
        -1.0
    } else {
        0.0
    }
}

/// Nearest codes of `x` on the grid (scale, min).
fn assign(x: &[f32], scale: f32, min: f32, qmax: u32, q: &mut [u8]) {
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (o, &v) in q.iter_mut().zip(x) {
        let c = nearest(v, scale, min, inv, qmax as f32);
        debug_assert!((0.0..=qmax as f32).contains(&c) && c.fract() == 0.0);
        // SAFETY: `nearest` gives a whole number in [0, qmax] (the clamp in `rounded`
        // also turns NaN into 0) and qmax ≤ 255: the conversion is exact. The checked
        // `as u8` (saturating, scalar) was 40 % of quantizing.
        *o = unsafe { c.to_int_unchecked::<u8>() };
    }
}

/// Independent f32 partial sums per lane: a group's sums are not one serial chain of
/// additions, and the loops vectorize. The order is fixed, so results are too.
const LANES: usize = 8;

/// What one pass over a group on a candidate grid gives: `err`, the weighted squared
/// error at the rounded codes (a half-step rounding slip counts against the grid,
/// which only makes it look worse than it is), and the sums that price any other
/// (scale, min) on the same codes.
struct GridPass {
    err: f64,
    /// Σw, Σwq, Σwq², Σwx, Σwqx.
    sums: [f64; 5],
}

impl GridPass {
    /// The weighted least-squares (scale, min) for these codes, minimising
    /// Σ w·(x − min − scale·q)²; None when the codes are degenerate.
    fn refit(&self) -> Option<(f64, f64)> {
        let [sw, sq, sqq, sx, sqx] = self.sums;
        let det = sw * sqq - sq * sq;
        if det <= 0.0 {
            return None;
        }
        let scale = (sw * sqx - sq * sx) / det;
        let min = (sqq * sx - sq * sqx) / det;
        (scale > 0.0).then_some((scale, min))
    }

    /// Σ w·(x − min − scale·q)² on these codes, expanded; `swxx` = Σwx². An upper
    /// bound on the grid's error (nearest codes can only do better), up to rounding.
    fn err_at(&self, scale: f64, min: f64, swxx: f64) -> f64 {
        let [sw, sq, sqq, sx, sqx] = self.sums;
        swxx - 2.0 * (min * sx + scale * sqx)
            + min * min * sw
            + 2.0 * min * scale * sq
            + scale * scale * sqq
    }
}

/// One pass of `x` (weights `w`) over the grid (scale, min): see [`GridPass`]. Sums in
/// f32 lanes (a group is at most a few hundred values), each lane's then added in f64.
#[inline(always)]
fn grid_pass(x: &[f32], w: &[f32], scale: f32, min: f32, qmax: u32) -> GridPass {
    let (inv, top) = (if scale > 0.0 { 1.0 / scale } else { 0.0 }, qmax as f32);
    let mut e = [0f32; LANES];
    let mut acc = [[0f32; LANES]; 5];
    for (xs, ws) in lane_chunks(x, w) {
        for l in 0..LANES {
            let c = rounded(xs[l], min, inv, top);
            let d = xs[l] - value_f(scale, min, c);
            let wc = ws[l] * c;
            e[l] += ws[l] * d * d;
            acc[0][l] += ws[l];
            acc[1][l] += wc;
            acc[2][l] += wc * c;
            acc[3][l] += ws[l] * xs[l];
            acc[4][l] += wc * xs[l];
        }
    }
    GridPass {
        err: e.iter().map(|&v| v as f64).sum(),
        sums: acc.map(|a| a.iter().map(|&v| v as f64).sum::<f64>()),
    }
}

/// `x` and `w` a lane-chunk at a time, the tail padded with weight 0.
#[inline(always)]
fn lane_chunks<'a>(
    x: &'a [f32],
    w: &'a [f32],
) -> impl Iterator<Item = ([f32; LANES], [f32; LANES])> + 'a {
    let (xc, wc) = (x.chunks_exact(LANES), w.chunks_exact(LANES));
    let (xr, wr) = (xc.remainder(), wc.remainder());
    let tail = (!xr.is_empty()).then(|| {
        let (mut xt, mut wt) = ([xr[0]; LANES], [0f32; LANES]);
        xt[..xr.len()].copy_from_slice(xr);
        wt[..wr.len()].copy_from_slice(wr);
        (xt, wt)
    });
    xc.zip(wc)
        .map(|(xs, ws)| (xs.try_into().unwrap(), ws.try_into().unwrap()))
        .chain(tail)
}

/// The (scale, min) of one group, f16-rounded, with the smallest weighted error among
/// candidate grids: spans of `qmax`, `qmax − 1` … levels over the group's range (a group
/// already on a grid of fewer levels is found exactly) and fractional spans around
/// `qmax`, each refined by weighted least squares on its codes. None when the values do
/// not fit f16. Compiled for AVX2 too, used where the CPU has it (same results: the
/// same separate multiplies, adds and comparisons, only wider).
fn fit(x: &[f32], w: &[f32], qmax: u32) -> Option<(f16, f16)> {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(x: &[f32], w: &[f32], qmax: u32) -> Option<(f16, f16)> {
            fit_body(x, w, qmax)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, the one feature `avx2` is compiled for.
            return unsafe { avx2(x, w, qmax) };
        }
    }
    fit_body(x, w, qmax)
}

#[inline(always)]
fn fit_body(x: &[f32], w: &[f32], qmax: u32) -> Option<(f16, f16)> {
    // The range of the values that count (all, each weighing 1, when none has weight).
    let any = w.iter().any(|&v| v > 0.0);
    let ones;
    let w = if any {
        w
    } else {
        ones = vec![1f32; w.len()];
        &ones[..]
    };
    let (lo, hi) = x
        .iter()
        .zip(w)
        .filter(|(_, &wt)| wt > 0.0)
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), (&v, _)| {
            (a.min(v), b.max(v))
        });
    let h = |v: f32| Some(f16::from_f32(v)).filter(|h| h.is_finite());
    if hi - lo <= 0.0 || !(hi - lo).is_finite() {
        return Some((f16::ZERO, h(lo)?));
    }
    let range = hi - lo;
    let swxx: f64 = x
        .iter()
        .zip(w)
        .map(|(&v, &wt)| wt as f64 * v as f64 * v as f64)
        .sum();
    let mut best: Option<(f64, f16, f16)> = None;
    let mut keep = |e: f64, sh: f16, mh: f16| {
        if best.is_none_or(|b| e < b.0) {
            best = Some((e, sh, mh));
        }
    };
    // Integer spans first (an exact grid ends the search), then fractional ones. Each
    // grid is measured in one pass, then refitted by weighted least squares to the
    // codes it gives, the refit priced from that pass's sums.
    let lowest = (qmax as f32 * 0.6).ceil().max(1.0) as u32;
    let integer = (lowest..=qmax).rev().take(12).map(|l| l as f32);
    let fractional = [-0.75f32, -0.5, -0.25, 0.25, 0.5, 0.75].map(|t| qmax as f32 + t);
    let mh = h(lo)?;
    for span in integer.chain(fractional) {
        let sh = h(range / span)?;
        let pass = grid_pass(x, w, sh.to_f32(), mh.to_f32(), qmax);
        keep(pass.err, sh, mh);
        if pass.err == 0.0 {
            break;
        }
        if let Some((scale, min)) = pass.refit() {
            let (sr, mr) = (h(scale as f32)?, h(min as f32)?);
            keep(
                pass.err_at(sr.to_f32() as f64, mr.to_f32() as f64, swxx),
                sr,
                mr,
            );
        }
    }
    best.map(|(_, s, m)| (s, m))
}

/// Packs `q` (each < 2^bits) into `out` as a little-endian bit stream.
pub(crate) fn pack(q: &[u8], bits: usize, out: &mut [u8]) {
    out.fill(0);
    if bits == 8 {
        out[..q.len()].copy_from_slice(q);
        return;
    }
    // A bit accumulator emptied a byte at a time.
    let (mut acc, mut n, mut o) = (0u32, 0usize, 0usize);
    for &c in q {
        acc |= (c as u32) << n;
        n += bits;
        while n >= 8 {
            out[o] = acc as u8;
            acc >>= 8;
            n -= 8;
            o += 1;
        }
    }
    if n > 0 {
        out[o] = acc as u8;
    }
}

/// Code `j` of a packed row.
#[inline(always)]
pub(crate) fn code(row: &[u8], bits: usize, j: usize) -> u32 {
    let bit = j * bits;
    let lo = row[bit / 8] as u16;
    let hi = if bit % 8 + bits > 8 {
        row[bit / 8 + 1] as u16
    } else {
        0
    };
    (((lo | (hi << 8)) >> (bit % 8)) & ((1u16 << bits) - 1)) as u32
}

/// `out[j] += r̂(j)` for one row: `params` its groups' [scale, min] f16 pairs
/// (little-endian bytes), `codes` its packed codes.
pub(crate) fn add_row(out: &mut [f32], params: &[u8], codes: &[u8], s: SqShape) {
    let pair = |k: usize| {
        let b = &params[4 * k..4 * k + 4];
        (
            f16::from_le_bytes([b[0], b[1]]).to_f32(),
            f16::from_le_bytes([b[2], b[3]]).to_f32(),
        )
    };
    match s.bits {
        // The common widths read whole bytes.
        4 if s.group % 2 == 0 => {
            for (k, (og, cg)) in out
                .chunks_exact_mut(s.group)
                .zip(codes.chunks_exact(s.group / 2))
                .enumerate()
            {
                let (sc, mn) = pair(k);
                for (o, &b) in og.chunks_exact_mut(2).zip(cg) {
                    o[0] += value(sc, mn, (b & 0x0F) as u32);
                    o[1] += value(sc, mn, (b >> 4) as u32);
                }
            }
        }
        8 => {
            for (k, (og, cg)) in out
                .chunks_exact_mut(s.group)
                .zip(codes.chunks_exact(s.group))
                .enumerate()
            {
                let (sc, mn) = pair(k);
                for (o, &b) in og.iter_mut().zip(cg) {
                    *o += value(sc, mn, b as u32);
                }
            }
        }
        // Eight codes of b bits fill b whole bytes: read them as one word. A group of a
        // multiple of 8 values starts on a byte.
        1 if s.group % 8 == 0 => add_words::<1>(out, codes, s.group, pair),
        2 if s.group % 8 == 0 => add_words::<2>(out, codes, s.group, pair),
        3 if s.group % 8 == 0 => add_words::<3>(out, codes, s.group, pair),
        5 if s.group % 8 == 0 => add_words::<5>(out, codes, s.group, pair),
        6 if s.group % 8 == 0 => add_words::<6>(out, codes, s.group, pair),
        7 if s.group % 8 == 0 => add_words::<7>(out, codes, s.group, pair),
        _ => {
            for (k, og) in out.chunks_exact_mut(s.group).enumerate() {
                let (sc, mn) = pair(k);
                for (t, o) in og.iter_mut().enumerate() {
                    *o += value(sc, mn, code(codes, s.bits, k * s.group + t));
                }
            }
        }
    }
}

/// [`add_row`] for `B`-bit codes in groups of a multiple of 8 values: eight codes are
/// `B` whole bytes, read as one word and split by constant shifts.
#[inline(always)]
fn add_words<const B: usize>(
    out: &mut [f32],
    codes: &[u8],
    group: usize,
    pair: impl Fn(usize) -> (f32, f32),
) {
    let mask = (1u64 << B) - 1;
    for (k, (og, gc)) in out
        .chunks_exact_mut(group)
        .zip(codes.chunks_exact(group * B / 8))
        .enumerate()
    {
        let (sc, mn) = pair(k);
        for (o8, c8) in og.chunks_exact_mut(8).zip(gc.chunks_exact(B)) {
            let mut word = [0u8; 8];
            word[..B].copy_from_slice(c8);
            let v = u64::from_le_bytes(word);
            for (i, o) in o8.iter_mut().enumerate() {
                *o += value(sc, mn, ((v >> (i * B)) & mask) as u32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(r: &SqRows, s: SqShape, rows: usize) -> Vec<f32> {
        let mut out = vec![0f32; rows * s.cols];
        let pb: Vec<u8> = r.params.iter().flat_map(|h| h.to_le_bytes()).collect();
        for i in 0..rows {
            add_row(
                &mut out[i * s.cols..(i + 1) * s.cols],
                &pb[i * s.groups() * 4..(i + 1) * s.groups() * 4],
                &r.codes[i * s.code_bytes()..(i + 1) * s.code_bytes()],
                s,
            );
        }
        out
    }

    #[test]
    fn every_decoding_path_reads_every_code() {
        // Widths and groups through each path of `add_row` (whole bytes, 8-code words,
        // codes one by one), against decoding code by code.
        for bits in 1..=8u32 {
            for group in [8u32, 12, 24, 32, 64] {
                let cols = 192u64;
                let s = SqShape::new(bits, group, cols).unwrap();
                let q: Vec<u8> = (0..cols as usize)
                    .map(|j| ((j * 7 + 3) % (1 << bits)) as u8)
                    .collect();
                let mut codes = vec![0u8; s.code_bytes()];
                pack(&q, s.bits, &mut codes);
                let params: Vec<u8> = (0..s.groups())
                    .flat_map(|k| [f16::from_f32(0.25 + k as f32), f16::from_f32(-1.5)])
                    .flat_map(|h| h.to_le_bytes())
                    .collect();
                let mut got = vec![0.5f32; cols as usize];
                add_row(&mut got, &params, &codes, s);
                let want: Vec<f32> = (0..cols as usize)
                    .map(|j| {
                        let k = j / s.group;
                        let sc = f16::from_f32(0.25 + k as f32).to_f32();
                        0.5 + value(sc, -1.5, code(&codes, s.bits, j))
                    })
                    .collect();
                assert_eq!(got, want, "bits {bits} group {group}");
            }
        }
    }

    #[test]
    fn packing_round_trips_every_width() {
        for bits in 1..=8usize {
            let q: Vec<u8> = (0..37).map(|j| ((j * 7 + 3) % (1 << bits)) as u8).collect();
            let mut buf = vec![0u8; (37 * bits).div_ceil(8)];
            pack(&q, bits, &mut buf);
            let back: Vec<u8> = (0..37).map(|j| code(&buf, bits, j) as u8).collect();
            assert_eq!(back, q, "bits {bits}");
        }
        // b = 4: code 2k in the low nibble of byte k (docs/CODECS.md).
        let mut buf = [0u8; 1];
        pack(&[0x3, 0xA], 4, &mut buf);
        assert_eq!(buf[0], 0xA3);
    }

    #[test]
    fn rounding_is_round_then_clamp() {
        // Halves, values a rounding step either side of them, out-of-range and
        // non-finite ones, on grids of every width.
        let mut ts: Vec<f32> = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 1e30];
        for k in -3..300 {
            let h = k as f32 + 0.5;
            let (up, down) = (h.to_bits() + 1, h.to_bits() - 1);
            ts.extend([h, f32::from_bits(up), f32::from_bits(down), k as f32]);
            ts.push(k as f32 + 0.49999997);
        }
        for top in [1.0f32, 3.0, 15.0, 31.0, 63.0, 255.0] {
            for &t in &ts {
                let want = if t.is_nan() {
                    0.0
                } else {
                    t.round().clamp(0.0, top)
                };
                assert_eq!(rounded(t, 0.0, 1.0, top), want, "t {t} top {top}");
            }
        }
    }

    #[test]
    fn values_on_a_grid_come_back_exactly() {
        // Groups of 32 on 16-level grids with f16 step and offset, some spanning fewer
        // levels (as dequantized Q4_1 groups do).
        let s = SqShape::new(4, 32, 64).unwrap();
        let mut x = Vec::new();
        for (gi, (d, m, span)) in [
            (0.013f32, -0.1f32, 15u32),
            (0.002, 0.03, 11),
            (0.5, -3.0, 7),
        ]
        .iter()
        .cycle()
        .take(6)
        .enumerate()
        {
            let (d, m) = (f16::from_f32(*d).to_f32(), f16::from_f32(*m).to_f32());
            for t in 0..32u32 {
                let c = (t * 5 + gi as u32) % (span + 1);
                let c = if t == 0 {
                    0
                } else if t == 1 {
                    *span
                } else {
                    c
                };
                x.push(value(d, m, c));
            }
        }
        let r = quantize(&x, s, |_, _| {}).unwrap();
        assert_eq!(decode(&r, s, 3), x);
    }

    #[test]
    fn more_bits_less_error_and_weights_steer_the_fit() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0).powi(3))
            .collect();
        let err = |bits: u32, w: &(dyn Fn(usize, &mut [f32]) + Sync)| {
            let s = SqShape::new(bits, 32, 256).unwrap();
            let r = quantize(&x, s, |i, row| w(i, row)).unwrap();
            let y = decode(&r, s, 1);
            (
                x.iter()
                    .zip(&y)
                    .map(|(a, b)| (a - b).powi(2))
                    .collect::<Vec<_>>(),
                y,
            )
        };
        let total = |e: &[f32]| e.iter().sum::<f32>();
        let (e2, _) = err(2, &|_, _| {});
        let (e4, _) = err(4, &|_, _| {});
        let (e8, _) = err(8, &|_, _| {});
        assert!(total(&e4) < total(&e2) / 4.0 && total(&e8) < total(&e4) / 20.0);
        // Heavy weight on the first 8 columns of every group: their error drops.
        let heavy = |_: usize, row: &mut [f32]| {
            for (j, w) in row.iter_mut().enumerate() {
                *w = if j % 32 < 8 { 100.0 } else { 1.0 };
            }
        };
        let (ew, _) = err(3, &heavy);
        let (eu, _) = err(3, &|_, _| {});
        let part = |e: &[f32]| {
            e.iter()
                .enumerate()
                .filter(|(j, _)| j % 32 < 8)
                .map(|(_, v)| v)
                .sum::<f32>()
        };
        assert!(
            part(&ew) < part(&eu) * 0.8,
            "{} vs {}",
            part(&ew),
            part(&eu)
        );
    }

    #[test]
    fn constant_and_huge_groups() {
        let s = SqShape::new(4, 4, 8).unwrap();
        let r = quantize(&[0.5; 8], s, |_, _| {}).unwrap();
        assert_eq!(decode(&r, s, 1), vec![0.5; 8]);
        assert!(quantize(&[1e6, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0], s, |_, _| {}).is_err());
        assert!(SqShape::new(0, 4, 8).is_err() && SqShape::new(9, 4, 8).is_err());
        assert!(SqShape::new(4, 3, 8).is_err());
    }
}
