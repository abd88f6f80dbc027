//! How much each matrix's error moves the model's output (docs/CODECS.md, "Measured
//! sensitivity"): for every linear layer, the output matrix and the embedding, the mean
//! KL-divergence of the next-token distributions over a calibration window when that
//! one tensor carries seeded noise of a fixed relative size, all others exact. The
//! `--bpw` planner multiplies each tensor's relative error by it, so bits go where
//! error costs the output most, as measured on this model rather than assumed per role.
//!
//! One pass over the layers, each loaded once: the clean residual stream and one stream
//! per tensor probed so far move through each layer together; a layer's own probes start
//! from the clean stream at its input. Cost: about (layers / 2 + 1) forward passes of
//! the window per probed tensor, so the window is short (64 tokens by default; about
//! as much arithmetic as the feedback's pass over 4 096 tokens on the float test model).
//! Deterministic: noise seeded from each tensor's name, products in fixed pieces.

use std::collections::{HashMap, HashSet};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::ops::{linear, rms_norm};
use super::{dims_of, pick_tokens, weight, Layer, SelfCalibration, ROLES};
use crate::convert::ConvertError;
use crate::import::SourceModel;

/// Tokens probed by default: one window. On the float test model 64 and 128 tokens
/// gave plans of the same divergence (0.057 and 0.058); 64 costs half.
pub const DEFAULT_TOKENS: usize = 64;
/// The noise's mean square over the tensor's: about a 6-bit rounding's, small enough
/// for the divergence to grow linearly with it, large enough to stand far above f32
/// round-off.
const NOISE: f64 = 4e-3;
/// Bound on the probes' residual streams and the reference distributions: the window
/// shrinks (to no fewer than the 64 tokens calibration needs) rather than exceed it.
const MEMORY: usize = 256 << 20;

/// Each probed tensor's mean KL-divergence per unit of relative squared error.
#[derive(Clone, Debug)]
pub struct Sensitivity {
    pub per_tensor: HashMap<String, f64>,
    pub tokens: usize,
}

/// Seeded noise of mean square `ms · NOISE` for `n` values, from `name`'s seed at `row`.
fn noise(name: &str, row: u64, n: usize, ms: f64) -> Vec<f32> {
    let seed = xxhash_rust::xxh3::xxh3_64(name.as_bytes()) ^ row.wrapping_mul(0x9E37_79B9);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Uniform on [-a, a] has mean square a² / 3.
    let a = (3.0 * ms * NOISE).sqrt() as f32;
    (0..n).map(|_| rng.random_range(-a..=a)).collect()
}

fn mean_square(w: &[f32]) -> f64 {
    w.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / w.len().max(1) as f64
}

/// `w` plus its noise (rows of `cols` values).
fn perturbed(name: &str, w: &[f32], cols: usize) -> Vec<f32> {
    let ms = mean_square(w);
    let mut out = w.to_vec();
    out.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        for (v, e) in row.iter_mut().zip(noise(name, r as u64, cols, ms)) {
            *v += e;
        }
    });
    out
}

/// Log-probabilities of each token's next-token distribution over the vocabulary
/// entries `head` holds (f64 from f32 logits).
fn log_probs(h: &[f32], d: usize, g: &[f32], eps: f32, head: &[f32]) -> Vec<f64> {
    let (n, vocab) = (h.len() / d, head.len() / d);
    let x = rms_norm(h, d, g, eps);
    let logits = linear(&x, n, d, head, vocab, None);
    let mut out = vec![0f64; n * vocab];
    out.par_chunks_mut(vocab)
        .zip(logits.par_chunks(vocab))
        .for_each(|(o, z)| {
            let max = z.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let sum: f64 = z.iter().map(|&v| (v - max).exp() as f64).sum();
            let log_z = max as f64 + sum.ln();
            o.iter_mut()
                .zip(z)
                .for_each(|(o, &v)| *o = v as f64 - log_z);
        });
    out
}

/// Mean over tokens of KL(reference ‖ probe), `p` the reference's probabilities.
fn kld(p: &[f64], reference: &[f64], probe: &[f64], vocab: usize) -> f64 {
    let per: Vec<f64> = p
        .par_chunks(vocab)
        .zip(reference.par_chunks(vocab).zip(probe.par_chunks(vocab)))
        .map(|(p, (a, b))| (0..p.len()).map(|j| p[j] * (a[j] - b[j])).sum())
        .collect();
    per.iter().sum::<f64>() / per.len().max(1) as f64
}

/// Vocabulary entries scored: each position's most likely next tokens under the
/// reference, united. The divergence of the distributions renormalized over them
/// measures a probe as well as the whole vocabulary's (the mass elsewhere is small)
/// at a tenth of the output matrix's arithmetic.
const TOP: usize = 64;

fn top_entries(lp: &[f64], vocab: usize) -> Vec<usize> {
    let mut keep = vec![false; vocab];
    for row in lp.chunks_exact(vocab) {
        let mut idx: Vec<usize> = (0..vocab).collect();
        let k = TOP.min(vocab);
        idx.select_nth_unstable_by(k - 1, |&a, &b| row[b].total_cmp(&row[a]));
        idx[..k].iter().for_each(|&j| keep[j] = true);
    }
    (0..vocab).filter(|&j| keep[j]).collect()
}

/// Rows `rows` of `w` (rows of `d` values).
fn rows_of(w: &[f32], rows: &[usize], d: usize) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| w[r * d..(r + 1) * d].iter().copied())
        .collect()
}

/// Rows of the matrix at `r` in [`ROLES`] order.
fn layer_rows(dims: &super::Dims, r: usize) -> usize {
    let (q, kv) = (dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim);
    [q, kv, kv, dims.d, dims.ff, dims.ff, dims.d][r]
}

/// Measures the tensors of `wanted` (those of them the pass can run: the layers' linear
/// layers, `lm_head.weight`, `model.embed_tokens.weight`) over `tokens` tokens of
/// `cal`'s text. `Ok(Err(why))` when the model is not one the pass runs.
pub fn probe(
    src: &dyn SourceModel,
    cal: &SelfCalibration,
    wanted: &HashSet<String>,
    tokens: usize,
) -> Result<Result<Sensitivity, String>, ConvertError> {
    let dims = match dims_of(src) {
        Ok(d) => d,
        Err(why) => return Ok(Err(why)),
    };
    let desc = src.desc();
    let d = dims.d;
    let emb_name = "model.embed_tokens.weight";
    let head_name = match desc.tensor_index("lm_head.weight") {
        Some(_) => "lm_head.weight",
        // Tied: the embedding is also the output matrix.
        None => emb_name,
    };
    let vocab = match desc.tensor_index(head_name) {
        Some(i) => desc.tensors[i].rows() as usize,
        None => return Ok(Err("the model has no embedding".into())),
    };
    let layer_probes: Vec<(u32, usize)> = (0..dims.layers)
        .flat_map(|l| (0..ROLES.len()).map(move |r| (l, r)))
        .filter(|&(l, r)| wanted.contains(&format!("model.layers.{l}.{}.weight", ROLES[r])))
        .collect();
    let streams = layer_probes.len() + 2;
    let fit = MEMORY / (streams * d * 4 + vocab * 12).max(1);
    let tokens = tokens.min(fit).max(super::MIN_TOKENS);
    let (ids, ctx, e) = match pick_tokens(src, cal, tokens, tokens)? {
        Ok(p) => p,
        Err(why) => return Ok(Err(why)),
    };
    let emb = src.f32(e)?;
    let ms_emb = mean_square(&emb);
    let mut clean = vec![0f32; ids.len() * d];
    let mut noisy = clean.clone();
    for ((row, nrow), &id) in clean
        .chunks_exact_mut(d)
        .zip(noisy.chunks_exact_mut(d))
        .zip(&ids)
    {
        let v = &emb[id as usize * d..][..d];
        row.copy_from_slice(v);
        for ((o, v), e) in nrow
            .iter_mut()
            .zip(v)
            .zip(noise(emb_name, id as u64, d, ms_emb))
        {
            *o = v + e;
        }
    }
    // (tensor, residual stream) of each probe begun so far.
    let mut probes: Vec<(String, Vec<f32>)> = Vec::new();
    if wanted.contains(emb_name) {
        probes.push((emb_name.to_string(), noisy));
    }
    // Kept through the layers only when it is also the output matrix.
    let tied_head = (head_name == emb_name).then_some(emb);
    for l in 0..dims.layers {
        let layer = Layer::load(src, &dims, l)?;
        let input = clean.clone();
        let run = |h: &mut Vec<f32>, over: Option<(usize, &[f32])>| {
            layer.run(
                &dims,
                h,
                ctx,
                &mut |_: &[&str], _: &[f32], _: usize| {},
                over,
            )
        };
        // Streams in parallel: each one's arithmetic is its own, so the figures do not
        // depend on the thread count, and a window of few tokens still fills the cores.
        run(&mut clean, None);
        probes.par_iter_mut().for_each(|(_, h)| run(h, None));
        let started: Vec<(String, Vec<f32>)> = layer_probes
            .par_iter()
            .filter(|p| p.0 == l)
            .map(|&(_, r)| {
                let name = format!("model.layers.{l}.{}.weight", ROLES[r]);
                let cols = layer.m[r].len() / layer_rows(&dims, r);
                let w = perturbed(&name, &layer.m[r], cols);
                let mut h = input.clone();
                run(&mut h, Some((r, &w)));
                (name, h)
            })
            .collect();
        probes.extend(started);
    }
    let g = weight(src, "model.norm.weight", d, 1)?;
    let head = match tied_head {
        Some(emb) => emb,
        None => weight(src, head_name, vocab, d)?,
    };
    // The clean distribution over the whole vocabulary picks the entries scored.
    let entries = top_entries(&log_probs(&clean, d, &g, dims.eps, &head), vocab);
    let exact_head = rows_of(&head, &entries, d);
    // The output matrix's noise (the embedding's too when tied) acts on the last step:
    // the same rows' noise as the whole matrix's would have.
    let noisy_head = wanted.contains(head_name).then(|| {
        let ms = mean_square(&head);
        let mut w = exact_head.clone();
        for (row, &r) in w.chunks_exact_mut(d).zip(&entries) {
            for (v, e) in row.iter_mut().zip(noise(head_name, r as u64, d, ms)) {
                *v += e;
            }
        }
        w
    });
    drop(head);
    let k = entries.len();
    let reference = log_probs(&clean, d, &g, dims.eps, &exact_head);
    let p: Vec<f64> = reference.iter().map(|v| v.exp()).collect();
    let mut per_tensor = HashMap::new();
    if head_name != emb_name {
        if let Some(w) = &noisy_head {
            let lp = log_probs(&clean, d, &g, dims.eps, w);
            per_tensor.insert(head_name.to_string(), kld(&p, &reference, &lp, k) / NOISE);
        }
    }
    let measured: Vec<(String, f64)> = probes
        .into_par_iter()
        .map(|(name, h)| {
            let w = match (&noisy_head, name == emb_name && head_name == emb_name) {
                (Some(w), true) => w,
                _ => &exact_head,
            };
            let lp = log_probs(&h, d, &g, dims.eps, w);
            let c = kld(&p, &reference, &lp, k) / NOISE;
            (name, c)
        })
        .collect();
    per_tensor.extend(measured);
    Ok(Ok(Sensitivity {
        per_tensor,
        tokens: ids.len(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_has_the_relative_size_and_is_seeded_by_name_and_row() {
        let a = noise("w", 3, 20_000, 2.0);
        let got = mean_square(&a);
        assert!((got / (2.0 * NOISE) - 1.0).abs() < 0.03, "{got}");
        assert_eq!(a, noise("w", 3, 20_000, 2.0));
        assert_ne!(a, noise("w", 4, 20_000, 2.0));
        assert_ne!(a, noise("v", 3, 20_000, 2.0));
    }

    #[test]
    fn divergence_is_zero_for_the_same_distribution_and_positive_otherwise() {
        let lp = |z: &[f64]| {
            let s = z.iter().map(|v| v.exp()).sum::<f64>().ln();
            z.iter().map(|v| v - s).collect::<Vec<f64>>()
        };
        let a = lp(&[0.0, 1.0, 2.0, -1.0]);
        let b = lp(&[0.1, 0.9, 2.0, -1.0]);
        let p: Vec<f64> = a.iter().map(|v| v.exp()).collect();
        assert!(kld(&p, &a, &a, 4).abs() < 1e-15);
        assert!(kld(&p, &a, &b, 4) > 1e-4);
    }

    #[test]
    fn scored_entries_unite_each_positions_most_likely() {
        let vocab = TOP + 10;
        let mut lp = vec![-10.0; 2 * vocab];
        // Position 0 favours the last TOP entries, position 1 entry 0 most of all.
        lp[10..vocab].fill(-1.0);
        lp[vocab] = 0.0;
        lp[vocab + 1..vocab + TOP].fill(-2.0);
        let e = top_entries(&lp, vocab);
        assert_eq!(e, (0..vocab).collect::<Vec<_>>());
        assert_eq!(
            top_entries(&lp[..vocab], vocab),
            (10..vocab).collect::<Vec<_>>()
        );
    }
}
