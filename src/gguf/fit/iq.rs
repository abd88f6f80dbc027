//! Rounding into the grid types IQ3_XXS, IQ3_S and IQ2_S. Their values are
//! `sub-block scale · magnitude · ±1`, the magnitudes of 4 (IQ3) or 8 (IQ2_S)
//! neighbouring values taken together from a fixed grid of vectors ([`super::super::grids`]),
//! so a code cannot be rounded value by value.
//!
//! The search, per sub-block: the signs are the values' own (IQ3_XXS stores 7 of each 8
//! and makes the count of minus signs even, so where it is odd the value costing least
//! when its sign is wrong takes the wrong one); the magnitudes' scale is tried at the
//! candidates [`super::fit_scale`] tries, each candidate rounding every group of 4 or 8
//! to its nearest grid vector under the weights and refitting the scale by weighted least
//! squares. A group's nearest vector is searched among the grid vectors close to the
//! lattice point its values round to level by level (the point itself when it is on the
//! grid: then it is the exact optimum; else every vector within two steps of the
//! nearest's squared distance, at most [`MAX_CANDIDATES`]). Then the super-block's f16
//! scale and the 4-bit sub-block codes are fitted as the k-quants' are
//! ([`super::fit_scales`]), and every group is searched once more at its final scale.

use std::sync::OnceLock;

use half::f16;

use super::{factor, fit_scales, Levels, TRIES};
use crate::gguf::grids::{IQ2S_GRID, IQ3S_GRID, IQ3XXS_GRID};
use crate::gguf::GgmlType;

/// Grid vectors searched from one lattice point at most.
const MAX_CANDIDATES: usize = 32;

/// A grid of magnitude vectors and, for each lattice point (a level index per
/// coordinate, the first coordinate least significant), the vectors searched from it.
struct Grid {
    dims: usize,
    levels: Vec<f32>,
    /// Midpoints between successive levels.
    mids: Vec<f32>,
    /// Each vector's magnitudes (the first `dims` used).
    values: Vec<[f32; 8]>,
    /// `(start, count)` into `candidates` per lattice point.
    spans: Vec<(u32, u8)>,
    candidates: Vec<u16>,
}

impl Grid {
    fn new(dims: usize, entries: impl Iterator<Item = u64>) -> Grid {
        let mags: Vec<[u8; 8]> = entries
            .map(|e| std::array::from_fn(|k| if k < dims { (e >> (8 * k)) as u8 } else { 0 }))
            .collect();
        let mut levels: Vec<u8> = mags.iter().flat_map(|m| m[..dims].to_vec()).collect();
        levels.sort_unstable();
        levels.dedup();
        let index = |v: u8| levels.binary_search(&v).expect("a level") as i32;
        let coords: Vec<[i32; 8]> = mags
            .iter()
            .map(|m| std::array::from_fn(|k| if k < dims { index(m[k]) } else { 0 }))
            .collect();
        let nl = levels.len();
        let points = nl.pow(dims as u32);
        let (mut spans, mut candidates) = (Vec::with_capacity(points), Vec::new());
        let mut dist: Vec<(i32, u16)> = Vec::with_capacity(coords.len());
        for p in 0..points {
            let at: [i32; 8] = std::array::from_fn(|k| {
                if k < dims {
                    (p / nl.pow(k as u32) % nl) as i32
                } else {
                    0
                }
            });
            dist.clear();
            dist.extend(coords.iter().enumerate().map(|(i, c)| {
                let d: i32 = (0..dims).map(|k| (c[k] - at[k]).pow(2)).sum();
                (d, i as u16)
            }));
            dist.sort_unstable();
            let near = dist[0].0;
            let keep = if near == 0 { near } else { near + 2 };
            let start = candidates.len() as u32;
            candidates.extend(
                dist.iter()
                    .take_while(|(d, _)| *d <= keep)
                    .take(MAX_CANDIDATES)
                    .map(|&(_, i)| i),
            );
            spans.push((start, (candidates.len() as u32 - start) as u8));
        }
        let levels: Vec<f32> = levels.iter().map(|&v| v as f32).collect();
        Grid {
            dims,
            mids: levels.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect(),
            values: mags
                .iter()
                .map(|m| std::array::from_fn(|k| m[k] as f32))
                .collect(),
            levels,
            spans,
            candidates,
        }
    }

    fn top(&self) -> f32 {
        *self.levels.last().expect("levels")
    }

    /// The vector nearest to `t / s` under the weights `w` and `Σ w (t − s·v)²` for it.
    #[inline]
    fn nearest(&self, t: &[f32], w: &[f32], s: f32) -> (u16, f32) {
        let inv = if s != 0.0 { 1.0 / s } else { 0.0 };
        let (mut p, mut mul) = (0usize, 1usize);
        for &t in &t[..self.dims] {
            p += self.mids.partition_point(|&m| m <= t * inv) * mul;
            mul *= self.levels.len();
        }
        let (start, n) = self.spans[p];
        let mut best = (0u16, f32::INFINITY);
        for &i in &self.candidates[start as usize..start as usize + n as usize] {
            let v = &self.values[i as usize];
            let mut e = 0f32;
            for k in 0..self.dims {
                let d = t[k] - s * v[k];
                e += w[k] * d * d;
            }
            if e < best.1 {
                best = (i, e);
            }
        }
        best
    }

    /// Codes of each group of `t` at scale `s`, and (Σ w·t·v, Σ w·v²) over them.
    fn assign(&self, t: &[f32], w: &[f32], s: f32, codes: &mut [u16]) -> (f32, f32) {
        let (mut tv, mut vv) = (0f32, 0f32);
        for ((t, w), c) in t
            .chunks_exact(self.dims)
            .zip(w.chunks_exact(self.dims))
            .zip(codes.iter_mut())
        {
            *c = self.nearest(t, w, s).0;
            let v = &self.values[*c as usize];
            for k in 0..self.dims {
                tv += w[k] * t[k] * v[k];
                vv += w[k] * v[k] * v[k];
            }
        }
        (tv, vv)
    }

    /// `Σ w (t − s·v)²` with every group at its nearest vector.
    fn err(&self, t: &[f32], w: &[f32], s: f32) -> f32 {
        t.chunks_exact(self.dims)
            .zip(w.chunks_exact(self.dims))
            .map(|(t, w)| self.nearest(t, w, s).1)
            .sum()
    }

    /// The scale of sub-block `t` (magnitudes after signs) searched as the module says;
    /// `codes` gets its groups' vectors. 0 for a block with nothing positive.
    fn scale(&self, t: &[f32], w: &[f32], codes: &mut [u16]) -> f32 {
        let tm = t.iter().copied().fold(0f32, f32::max);
        let mut best = (0f32, 0f32); // (gain (Σwtv)²/Σwv², scale)
        if tm > 0.0 {
            let mut consider = |s: f32, best: &mut (f32, f32)| {
                let (tv, vv) = self.assign(t, w, s, codes);
                let better = tv > 0.0 && vv > 0.0 && tv * tv / vv > best.0 * (1.0 + 1e-6);
                if better {
                    *best = (tv * tv / vv, tv / vv);
                }
                better
            };
            for k in -TRIES..=TRIES {
                consider(tm / (self.top() * factor(k)), &mut best);
            }
            for _ in 0..3 {
                if !consider(best.1, &mut best) {
                    break;
                }
            }
        }
        self.assign(t, w, best.1, codes);
        best.1
    }
}

fn grid(ty: GgmlType) -> &'static Grid {
    static IQ3XXS: OnceLock<Grid> = OnceLock::new();
    static IQ3S: OnceLock<Grid> = OnceLock::new();
    static IQ2S: OnceLock<Grid> = OnceLock::new();
    match ty {
        GgmlType::IQ3_XXS => {
            IQ3XXS.get_or_init(|| Grid::new(4, IQ3XXS_GRID.iter().map(|&e| e as u64)))
        }
        GgmlType::IQ3_S => IQ3S.get_or_init(|| Grid::new(4, IQ3S_GRID.iter().map(|&e| e as u64))),
        GgmlType::IQ2_S => IQ2S.get_or_init(|| Grid::new(8, IQ2S_GRID.iter().copied())),
        _ => unreachable!("not a grid type"),
    }
}

/// A block of 256 values of a grid type: its f16 scale, each sub-block's 4-bit scale
/// code, each group's vector and each 8 values' sign byte.
struct Fitted<const N: usize> {
    d: f16,
    scales: [u8; N],
    codes: [u16; 64],
    signs: [u8; 32],
}

/// Fits one block of `ty` (N sub-blocks; `unit`: sub-block `j`'s scale is
/// `d · unit · (2·scales[j] + 1)`; `parity`: IQ3_XXS's even count of minus signs).
fn fit_block<const N: usize>(
    ty: GgmlType,
    x: &[f32],
    w: &[f32],
    unit: f32,
    parity: bool,
) -> Fitted<N> {
    let g = grid(ty);
    let mut t: [f32; 256] = std::array::from_fn(|i| x[i].abs());
    let mut signs = [0u8; 32];
    for (i, s) in signs.iter_mut().enumerate() {
        let r = 8 * i..8 * i + 8;
        *s = x[r.clone()]
            .iter()
            .enumerate()
            .fold(0u8, |a, (k, &v)| a | ((v < 0.0) as u8) << k);
        if parity && s.count_ones() % 2 == 1 {
            let k = r
                .clone()
                .min_by(|&a, &b| (w[a] * x[a] * x[a]).total_cmp(&(w[b] * x[b] * x[b])))
                .expect("8 values")
                - r.start;
            *s ^= 1 << k;
            t[r.start + k] = -t[r.start + k];
        }
    }
    let sub = 256 / N;
    let per = sub / g.dims;
    let mut codes = [0u16; 64];
    let s: [f32; N] = std::array::from_fn(|j| {
        let r = sub * j..sub * j + sub;
        g.scale(&t[r.clone()], &w[r], &mut codes[per * j..per * j + per])
    });
    let (d, scales) = fit_scales(&s, Levels::Odd(16), unit, |j, e| {
        let r = sub * j..sub * j + sub;
        g.err(&t[r.clone()], &w[r], e)
    });
    for (j, &c) in scales.iter().enumerate() {
        let r = sub * j..sub * j + sub;
        let e = d.to_f32() * unit * Levels::Odd(16).level(c);
        g.assign(&t[r.clone()], &w[r], e, &mut codes[per * j..per * j + per]);
    }
    Fitted {
        d,
        scales,
        codes,
        signs,
    }
}

/// IQ3_XXS (layout in [`crate::gguf::quant`]'s dequantizer): `db = d · 0.25 · (2s + 1)`.
pub(super) fn iq3_xxs(x: &[f32], w: &[f32], o: &mut [u8]) {
    let f = fit_block::<8>(GgmlType::IQ3_XXS, x, w, 0.25, true);
    o[..2].copy_from_slice(&f.d.to_le_bytes());
    for (o, &c) in o[2..66].iter_mut().zip(&f.codes) {
        *o = c as u8;
    }
    for ib in 0..8 {
        let aux = (0..4).fold((f.scales[ib] as u32) << 28, |a, l| {
            a | ((f.signs[4 * ib + l] & 127) as u32) << (7 * l)
        });
        o[66 + 4 * ib..70 + 4 * ib].copy_from_slice(&aux.to_le_bytes());
    }
}

/// IQ3_S: `db = d · (2s + 1)`.
pub(super) fn iq3_s(x: &[f32], w: &[f32], o: &mut [u8]) {
    let f = fit_block::<8>(GgmlType::IQ3_S, x, w, 1.0, false);
    o.fill(0);
    o[..2].copy_from_slice(&f.d.to_le_bytes());
    for (g, &c) in f.codes.iter().enumerate() {
        o[2 + g] = c as u8;
        o[66 + g / 8] |= ((c >> 8) as u8 & 1) << (g % 8);
    }
    o[74..106].copy_from_slice(&f.signs);
    for (j, &s) in f.scales.iter().enumerate() {
        o[106 + j / 2] |= s << (4 * (j % 2));
    }
}

/// IQ2_S: `db = d · 0.125 · (2s + 1)` per 16 values.
pub(super) fn iq2_s(x: &[f32], w: &[f32], o: &mut [u8]) {
    let f = fit_block::<16>(GgmlType::IQ2_S, x, w, 0.125, false);
    o.fill(0);
    o[..2].copy_from_slice(&f.d.to_le_bytes());
    for (g, &c) in f.codes[..32].iter().enumerate() {
        o[2 + g] = c as u8;
        o[66 + g / 4] |= ((c >> 8) as u8 & 3) << (2 * (g % 4));
    }
    o[34..66].copy_from_slice(&f.signs);
    for (j, &s) in f.scales.iter().enumerate() {
        o[74 + j / 2] |= s << (4 * (j % 2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every lattice point has a vector to search, and a point on the grid only itself.
    #[test]
    fn every_lattice_point_has_candidates() {
        for ty in [GgmlType::IQ3_XXS, GgmlType::IQ3_S, GgmlType::IQ2_S] {
            let g = grid(ty);
            assert_eq!(g.spans.len(), g.levels.len().pow(g.dims as u32));
            assert!(g.spans.iter().all(|&(_, n)| n >= 1), "{ty:?}");
            let on_grid = g.spans.iter().filter(|&&(_, n)| n == 1).count();
            assert!(on_grid >= g.values.len(), "{ty:?}: {on_grid}");
        }
    }

    /// A group whose magnitudes are a grid vector times the scale comes back as it.
    #[test]
    fn grid_vectors_are_found() {
        for ty in [GgmlType::IQ3_XXS, GgmlType::IQ3_S, GgmlType::IQ2_S] {
            let g = grid(ty);
            let w = [1f32; 8];
            for (i, v) in g.values.iter().enumerate().step_by(7) {
                let t: Vec<f32> = v.iter().map(|m| m * 0.01).collect();
                assert_eq!(g.nearest(&t, &w, 0.01).0 as usize, i, "{ty:?}");
            }
        }
    }
}
