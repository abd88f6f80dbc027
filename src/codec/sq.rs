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
    min + scale * q as f32
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

/// Nearest codes of `x` on the grid (scale, min).
fn assign(x: &[f32], scale: f32, min: f32, qmax: u32, q: &mut [u8]) {
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    let top = qmax as f32;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = ((v - min) * inv).round().clamp(0.0, top) as u8;
    }
    // `(v − min)·inv` can land a half-step off by rounding: take the nearer neighbour.
    for (o, &v) in q.iter_mut().zip(x) {
        let c = *o as u32;
        let e = (v - value(scale, min, c)).abs();
        if c < qmax && (v - value(scale, min, c + 1)).abs() < e {
            *o = (c + 1) as u8;
        } else if c > 0 && (v - value(scale, min, c - 1)).abs() < e {
            *o = (c - 1) as u8;
        }
    }
}

/// Weighted squared error of `x` against the grid (scale, min) at its nearest codes.
fn grid_err(x: &[f32], w: &[f32], scale: f32, min: f32, qmax: u32, q: &mut [u8]) -> f64 {
    assign(x, scale, min, qmax, q);
    x.iter()
        .zip(w)
        .zip(q.iter())
        .map(|((&v, &wt), &c)| {
            let d = (v - value(scale, min, c as u32)) as f64;
            wt as f64 * d * d
        })
        .sum()
}

/// The (scale, min) of one group, f16-rounded, with the smallest weighted error among
/// candidate grids: spans of `qmax`, `qmax − 1` … levels over the group's range (a group
/// already on a grid of fewer levels is found exactly) and fractional spans around
/// `qmax`, each refined by weighted least squares on its codes. None when the values do
/// not fit f16.
fn fit(x: &[f32], w: &[f32], qmax: u32) -> Option<(f16, f16)> {
    let mut q = vec![0u8; x.len()];
    let mut qe = vec![0u8; x.len()];
    // The range of the values that count (all when none has weight).
    let any = w.iter().any(|&v| v > 0.0);
    let (lo, hi) = x
        .iter()
        .zip(w)
        .filter(|(_, &wt)| !any || wt > 0.0)
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), (&v, _)| {
            (a.min(v), b.max(v))
        });
    let w_eff: Vec<f32> = if any { w.to_vec() } else { vec![1.0; w.len()] };
    let h = |v: f32| Some(f16::from_f32(v)).filter(|h| h.is_finite());
    if hi - lo <= 0.0 || !(hi - lo).is_finite() {
        return Some((f16::ZERO, h(lo)?));
    }
    let range = hi - lo;
    let mut best: Option<(f64, f16, f16)> = None;
    let mut consider = |scale: f32, min: f32| -> Option<bool> {
        let (sh, mh) = (h(scale.max(0.0))?, h(min)?);
        let e = grid_err(x, &w_eff, sh.to_f32(), mh.to_f32(), qmax, &mut qe);
        if best.is_none_or(|b| e < b.0) {
            best = Some((e, sh, mh));
        }
        Some(e == 0.0)
    };
    // Integer spans first (exact grids end the search), then fractional ones.
    let lowest = (qmax as f32 * 0.6).ceil().max(1.0) as u32;
    let mut spans: Vec<f32> = (lowest..=qmax).rev().take(12).map(|l| l as f32).collect();
    spans.extend([-0.75f32, -0.5, -0.25, 0.25, 0.5, 0.75].map(|t| qmax as f32 + t));
    for span in spans {
        let step = range / span;
        if consider(step, lo)? {
            break;
        }
        // Refit (min, scale) to the codes this grid gives: weighted least squares.
        assign(x, step, lo, qmax, &mut q);
        let (mut sw, mut sq, mut sqq, mut sx, mut sqx) = (0f64, 0f64, 0f64, 0f64, 0f64);
        for ((&v, &wt), &c) in x.iter().zip(&w_eff).zip(q.iter()) {
            let (wt, c, v) = (wt as f64, c as f64, v as f64);
            sw += wt;
            sq += wt * c;
            sqq += wt * c * c;
            sx += wt * v;
            sqx += wt * c * v;
        }
        let det = sw * sqq - sq * sq;
        if det > 0.0 {
            let scale = (sw * sqx - sq * sx) / det;
            let min = (sqq * sx - sq * sqx) / det;
            if scale > 0.0 && consider(scale as f32, min as f32)? {
                break;
            }
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
    for (j, &c) in q.iter().enumerate() {
        let bit = j * bits;
        let v = (c as u16) << (bit % 8);
        out[bit / 8] |= v as u8;
        if bit % 8 + bits > 8 {
            out[bit / 8 + 1] |= (v >> 8) as u8;
        }
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
