//! The sparse parts of NDSQ: S (entries of W − L̂ above the `outlier_q` quantile of
//! |W − L̂|) and D (the diagonal of what remains), taken out of the residual before PQ,
//! then turned into corrections against the decoded L̂ + R̂ (docs/CODECS.md).

use half::f16;

/// One row's outliers: (column, value), columns strictly increasing.
pub(super) type RowOutliers = Vec<(u32, f32)>;

/// S: moves the entries of `w1` (rows × `cols`) whose |value| is strictly above the
/// `outlier_q` quantile out of it (zeroing them), per row in column order. With column
/// weights `cw` the ranking is by |value|·√weight (the entries costing the model most).
pub(super) fn split(
    w1: &mut [f32],
    cols: usize,
    outlier_q: f32,
    cw: Option<&[f32]>,
) -> Vec<RowOutliers> {
    let n = w1.len();
    let n_out = (((1.0 - outlier_q as f64) * n as f64).floor() as usize).min(n);
    let mut outliers: Vec<RowOutliers> = vec![Vec::new(); n / cols];
    if n_out == 0 {
        return outliers;
    }
    let sw: Option<Vec<f32>> = cw.map(|w| w.iter().map(|x| x.sqrt()).collect());
    let key = |j: usize, v: f32| match &sw {
        None => v.abs(),
        Some(s) => v.abs() * s[j],
    };
    let t = if n_out >= n {
        None
    } else {
        let mut abs: Vec<f32> = w1
            .iter()
            .enumerate()
            .map(|(k, &x)| key(k % cols, x))
            .collect();
        let (_, t, _) = abs.select_nth_unstable_by(n - n_out - 1, f32::total_cmp);
        Some(*t)
    };
    for (i, row) in w1.chunks_exact_mut(cols).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            if t.is_none_or(|t| key(j, *v) > t) {
                outliers[i].push((j as u32, *v));
                *v = 0.0;
            }
        }
    }
    outliers
}

/// D: takes the diagonal (i, i), i < min(rows, cols), out of `w1`; R has zeros there.
pub(super) fn take_diagonal(w1: &mut [f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..rows.min(cols))
        .map(|i| std::mem::take(&mut w1[i * cols + i]))
        .collect()
}

/// Turns S into corrections against L̂ + R̂ (`rhat(i, j)` = R̂ at (i, j)) and returns D's
/// corrections in f16. An outlier on the diagonal is fixed by S alone (D = 0 there); a
/// diagonal correction too large for f16 moves into S.
pub(super) fn correct(
    outliers: &mut [RowOutliers],
    diag_w1: &[f32],
    rhat: impl Fn(usize, usize) -> f32,
) -> Vec<f16> {
    for (i, row) in outliers.iter_mut().enumerate() {
        for (j, v) in row.iter_mut() {
            *v -= rhat(i, *j as usize);
        }
    }
    let mut diag_h = vec![f16::ZERO; diag_w1.len()];
    for (i, &dw) in diag_w1.iter().enumerate() {
        if outliers[i]
            .binary_search_by_key(&(i as u32), |e| e.0)
            .is_ok()
        {
            continue;
        }
        let corr = dw - rhat(i, i);
        let h = f16::from_f32(corr);
        if h.is_finite() {
            diag_h[i] = h;
        } else {
            let pos = outliers[i].partition_point(|e| e.0 < i as u32);
            outliers[i].insert(pos, (i as u32, corr));
        }
    }
    diag_h
}
