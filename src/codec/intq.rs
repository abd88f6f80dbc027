//! Squish's int8 (per row or per group) and int4 (per group, nibble-packed) codes:
//! quantizers used by the writer and dequantizers used by the reader
//! (docs/NPYDIR.md §2 and §6). Pure functions over slices.

/// Scale of a run of values for a symmetric code with levels `-qmax..=qmax`.
fn scale_of(w: &[f32], qmax: f32) -> f32 {
    let m = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    if m == 0.0 {
        1.0
    } else {
        m / qmax
    }
}

/// Per-row int8: `rows × cols` values → (`q`, one scale per row).
pub fn quantize_int8(w: &[f32], cols: usize, q: &mut Vec<i8>, s: &mut Vec<f32>) {
    for row in w.chunks_exact(cols) {
        let sc = scale_of(row, 127.0);
        s.push(sc);
        q.extend(
            row.iter()
                .map(|&x| (x / sc).round_ties_even().clamp(-127.0, 127.0) as i8),
        );
    }
}

/// Per-group int4 nibble-packed: `cols` even and a multiple of `group`.
pub fn quantize_int4(w: &[f32], cols: usize, group: usize, p: &mut Vec<u8>, s: &mut Vec<f32>) {
    for row in w.chunks_exact(cols) {
        let base = s.len();
        s.extend(row.chunks_exact(group).map(|g| scale_of(g, 7.0)));
        let nib = |j: usize| {
            let q = (row[j] / s[base + j / group])
                .round_ties_even()
                .clamp(-7.0, 7.0) as i8;
            (q + 7) as u8
        };
        p.extend((0..cols / 2).map(|k| nib(2 * k) | (nib(2 * k + 1) << 4)));
    }
}

/// int8 rows: `q` is `n × c`, `s` has `n·g` scales (g groups of `c/g` columns).
pub fn dequantize_int8(q: &[u8], s: &[f32], c: usize, g: usize, out: &mut [f32]) {
    let gs = c / g;
    for (i, (qr, or)) in q.chunks_exact(c).zip(out.chunks_exact_mut(c)).enumerate() {
        let sr = &s[i * g..(i + 1) * g];
        for (j, (o, &b)) in or.iter_mut().zip(qr).enumerate() {
            *o = (b as i8) as f32 * sr[j / gs];
        }
    }
}

/// int4 rows: `p` is `n × c/2` bytes, `s` has `n·g` scales.
pub fn dequantize_int4(p: &[u8], s: &[f32], c: usize, g: usize, out: &mut [f32]) {
    let gs = c / g;
    for (i, (pr, or)) in p
        .chunks_exact(c / 2)
        .zip(out.chunks_exact_mut(c))
        .enumerate()
    {
        let sr = &s[i * g..(i + 1) * g];
        for (k, &b) in pr.iter().enumerate() {
            let j = 2 * k;
            or[j] = ((b & 0x0F) as i32 - 7) as f32 * sr[j / gs];
            or[j + 1] = ((b >> 4) as i32 - 7) as f32 * sr[(j + 1) / gs];
        }
    }
}

/// ‖a−b‖/‖a‖ in f64 (0 when a is all zero and b equals it).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = x as f64 - y as f64;
        num += d * d;
        den += x as f64 * x as f64;
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32 - 0.5) * 0.2
            })
            .collect()
    }

    #[test]
    fn int8_roundtrip_error_is_half_a_step() {
        let (rows, cols) = (7, 96);
        let mut w = data(rows * cols, 3);
        w[5 * cols..6 * cols].fill(0.0); // an all-zero row has scale 1 and decodes to 0
        let (mut q, mut s) = (Vec::new(), Vec::new());
        quantize_int8(&w, cols, &mut q, &mut s);
        assert_eq!((q.len(), s.len()), (rows * cols, rows));
        assert_eq!(s[5], 1.0);
        let qb: Vec<u8> = q.iter().map(|&v| v as u8).collect();
        let mut out = vec![0f32; rows * cols];
        dequantize_int8(&qb, &s, cols, 1, &mut out);
        for (i, (a, b)) in w.iter().zip(&out).enumerate() {
            assert!((a - b).abs() <= s[i / cols] * 0.5 + 1e-7, "{i}: {a} {b}");
        }
        assert!(q.iter().all(|&v| v >= -127));
        assert!(rel_err(&w, &out) < 0.01);
    }

    #[test]
    fn int4_nibble_order_and_values() {
        // One group of 4: max 0.7 → scale 0.1; values -0.7, 0.3, 0.0, 0.7 → q -7, 3, 0, 7.
        let w = [-0.7f32, 0.3, 0.0, 0.7];
        let (mut p, mut s) = (Vec::new(), Vec::new());
        quantize_int4(&w, 4, 4, &mut p, &mut s);
        assert_eq!(s, vec![0.7f32 / 7.0]);
        // low nibble = even column: (−7+7) | (3+7)<<4, (0+7) | (7+7)<<4
        assert_eq!(p, vec![0xA0, 0xE7]);
        let mut out = [0f32; 4];
        dequantize_int4(&p, &s, 4, 1, &mut out);
        for (a, b) in w.iter().zip(&out) {
            assert!((a - b).abs() < 1e-6);
        }
        // Nibble 15 reads as 8 (as Squish's decoder does).
        dequantize_int4(&[0xF0], &[1.0], 2, 1, &mut out[..2]);
        assert_eq!(&out[..2], &[-7.0, 8.0]);
    }

    #[test]
    fn int4_roundtrip_grouped() {
        let (rows, cols, group) = (5, 256, 64);
        let w = data(rows * cols, 9);
        let (mut p, mut s) = (Vec::new(), Vec::new());
        quantize_int4(&w, cols, group, &mut p, &mut s);
        assert_eq!((p.len(), s.len()), (rows * cols / 2, rows * cols / group));
        let mut out = vec![0f32; rows * cols];
        dequantize_int4(&p, &s, cols, cols / group, &mut out);
        for (i, (a, b)) in w.iter().zip(&out).enumerate() {
            let sc = s[i / group];
            assert!((a - b).abs() <= sc * 0.5 + 1e-6, "{i}");
        }
        let e = rel_err(&w, &out);
        assert!(0.03 < e && e < 0.2, "{e}");
    }

    #[test]
    fn int8_grouped_scales() {
        let q = [1u8, 2, 0xFF, 4];
        let mut out = [0f32; 4];
        dequantize_int8(&q, &[1.0, 10.0], 4, 2, &mut out);
        assert_eq!(out, [1.0, 2.0, -10.0, 40.0]);
    }
}
