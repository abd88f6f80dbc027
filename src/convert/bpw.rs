//! `convert --bpw TARGET`: each tensor's setting (a ggml block type, or with
//! `--bpw-codec sq` NDSQ's scalar groups of 2–8 bits) or its exact source bytes, chosen
//! so that the whole archive averages `TARGET` bits per weight with the least total
//! squared error (importance-weighted when an importance matrix is given).
//! docs/CODECS.md, "Bits-per-weight target".
//!
//! Each tensor's settings are priced in archive bytes by the payload formulas of
//! docs/CODECS.md, the codes and source bytes scaled by how well the archive's block
//! compression shrinks them in an evenly spaced sample of the tensor's rows, and
//! scored by the error scalar groups leave in that sample. The choice is
//! the classic greedy over each tensor's lower convex hull of (bits, error), each
//! tensor's error taken relative to its mean square weight (ggml types) or scaled by
//! its role's sensitivity (scalar groups, [`sensitivity`]): start
//! every tensor at its cheapest setting and keep taking the step that removes the most
//! error per added bit while the budget allows. Deterministic: the sample, the fits
//! and the order of ties (tensor index) are fixed.
//!
//! The experts of a mixture-of-experts layer that llama.cpp stacks into one tensor
//! (`blk.N.ffn_up_exps` …) are planned as one: each setting priced and scored summed
//! over them, one choice for all, so the GGUF view finds one grid in the whole stack
//! and serves it as that grid's type instead of re-quantizing (docs/MOE.md).

use crate::archive::container::rows_per_block;
use crate::archive::Compression;
use crate::codec::{self, SqParams};
use crate::convert::calibrate::probe::Sensitivity;
use crate::gguf::GgmlType;
use crate::import::SourceModel;
use crate::model::{names, TensorDesc};

use super::{is_passthrough, ConvertError, ConvertOptions, Patterns};

/// Scalar-R widths tried, each in groups of 32, 64 and the largest of 256, 192 and 128
/// that divides the tensor's width ([`settings_for`]): `bits + 32/group` bits per weight
/// before the other parts, from 2.1 to 9.
const BITS: &[u32] = &[2, 3, 4, 5, 6, 8];

/// The scalar-R settings tried on a tensor of `cols` columns.
fn settings_for(cols: u64) -> Vec<SqParams> {
    let big = [256u32, 192, 128]
        .into_iter()
        .find(|g| cols % *g as u64 == 0);
    let groups: Vec<u32> = [32, 64]
        .into_iter()
        .chain(big)
        .filter(|g| cols % *g as u64 == 0)
        .collect();
    BITS.iter()
        .flat_map(|&bits| groups.iter().map(move |&group| SqParams { bits, group }))
        .collect()
}

/// The ggml types tried on every tensor whose width they divide, cheapest first
/// (IQ2_S 2.5625 bits per weight before compression ... Q8_0 8.5; the 256-value types
/// only where the width is a multiple of 256).
const GGML_TYPES: &[GgmlType] = &[
    GgmlType::IQ2_S,
    GgmlType::Q2_K,
    GgmlType::IQ3_XXS,
    GgmlType::Q3_K,
    GgmlType::IQ3_S,
    GgmlType::IQ4_XS,
    GgmlType::IQ4_NL,
    GgmlType::Q4_K,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_K,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
];

/// Types the default plan gives a layer's matrix only where it already lies on their
/// grid (then exact, served as the source's bytes), when the conversion has error
/// feedback from cawsfs's forward pass ([`plan`]): llama.cpp's CPU kernels run them
/// slower than IQ4_NL and IQ4_XS (docs/QUALITY-FLOAT.md: a float model's view with Q5_0
/// for most matrices generated at 0.92 × IQ4_XS's tokens/s, without it at 1.05 ×). The
/// embedding and the output matrix may still take them: on a 576-wide model the only
/// other steps are IQ4_NL's 4.5 bits and Q8_0's 8.5, and a tied output in IQ4_NL took
/// the Q4_1 test model's divergence from 0.015 to 0.106. `--bpw-types` overrides.
const SLOW_ON_CPU: &[GgmlType] = &[GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1];

/// How much more a unit of scalar-group error costs than a ggml type's when the
/// conversion has error feedback, which only ggml types get: the feedback cut the float
/// model's mean KLD about 4 × at 5 bits (0.261 → 0.063, docs/CODECS.md), and the plan's
/// trial fits are without it.
const UNFED: f64 = 4.0;

/// The widest scalar groups a ggml plan also tries (below every ggml type it has).
const LOW_SQ_BITS: u32 = 3;

/// Bytes of tensor `t` as `ty`'s blocks compressing by `ratio`.
fn ggml_bytes(t: &TensorDesc, ty: GgmlType, ratio: f64) -> u64 {
    let row = ty
        .row_bytes(t.cols())
        .unwrap_or(u64::MAX / 2 / t.rows().max(1));
    let blocks = t.rows().div_ceil(rows_per_block(t));
    (row as f64 * t.rows() as f64 * ratio).ceil() as u64 + blocks * BLOCK_OVERHEAD
}

/// Values of a tensor its settings are scored on (whole rows, 16 to 256 of them).
const SAMPLE_VALUES: u64 = 32 * 1024;

/// Rows sampled from tensor `t`.
fn sample_count(t: &TensorDesc) -> u64 {
    (SAMPLE_VALUES / t.cols().max(1))
        .clamp(16, 256)
        .min(t.rows())
}

/// `stored / raw` of `bytes` under the archive's block compression (1 when it is off
/// or does not pay).
fn ratio(bytes: &[u8], opts: &ConvertOptions) -> f64 {
    let (_, stored) =
        crate::archive::container::compress_saving(bytes, opts.compression, opts.min_saving);
    stored.len() as f64 / bytes.len().max(1) as f64
}

/// `stored / raw` of ggml blocks as convert stores them: in planes where the archive
/// compresses with zstd (`codec::into_planes`), else under its block compression.
fn ggml_ratio(ty: GgmlType, blocks: &[u8], opts: &ConvertOptions) -> Result<f64, ConvertError> {
    if let Compression::Zstd(_) = opts.compression {
        let planes = codec::planes_bytes(ty, blocks).map_err(|source| ConvertError::Codec {
            tensor: format!("{ty:?} trial blocks"),
            source,
        })?;
        if let Some(n) = planes {
            return Ok(n as f64 / blocks.len().max(1) as f64);
        }
    }
    Ok(ratio(blocks, opts))
}

/// Bytes an archive spends per block beyond the payload: the record header, alignment
/// padding (7.5 on average, 15 at most) and the BLOCK_INDEX entry.
const BLOCK_OVERHEAD: u64 = 20 + 15 + 32;

/// What a tensor is stored as.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Choice {
    /// The source's bytes, exact.
    Source,
    /// NDSQ with this scalar R.
    Sq(SqParams),
    /// Rounded into this ggml type's blocks.
    Ggml(GgmlType),
}

#[derive(Clone, Copy, Debug)]
struct Setting {
    choice: Choice,
    bits: f64,
    err: f64,
}

/// The plan: a choice per tensor and the archive size it was priced at.
#[derive(Clone, Debug)]
pub struct Plan {
    pub choices: Vec<Choice>,
    /// Estimated bits per weight of the whole archive.
    pub planned_bpw: f64,
    pub target_bpw: f64,
    /// The target was below the smallest archive and that was planned instead.
    pub at_floor: bool,
}

/// Bytes of tensor `t` stored as its source bytes, the rows compressing by `ratio`.
fn source_bytes(t: &TensorDesc, ratio: f64) -> Result<u64, ConvertError> {
    let row = row_bytes(t)?;
    let blocks = t.rows().div_ceil(rows_per_block(t));
    Ok((row as f64 * t.rows() as f64 * ratio).ceil() as u64 + blocks * BLOCK_OVERHEAD)
}

fn row_bytes(t: &TensorDesc) -> Result<u64, ConvertError> {
    codec::passthrough_row_bytes(t.source, t.cols()).map_err(|source| ConvertError::Codec {
        tensor: t.name.clone(),
        source,
    })
}

/// Bytes of tensor `t` as NDSQ with scalar R `p`, rank `rank` and outliers above the
/// `outlier_q` quantile (docs/CODECS.md: global `24 + 2·r·cols`, block payload
/// `2nr + 4nG + nc + 2nd + wn + wT + 4T`), R's part compressing by `ratio`.
fn sq_bytes(t: &TensorDesc, p: SqParams, rank: u64, outlier_q: f32, ratio: f64) -> u64 {
    let (rows, cols) = (t.rows(), t.cols());
    let r = rank.min(rows).min(cols);
    let groups = cols / p.group as u64;
    let code = (cols * p.bits as u64).div_ceil(8);
    let w = if cols <= u16::MAX as u64 { 2 } else { 4 };
    let outliers = ((1.0 - outlier_q as f64) * (rows * cols) as f64).floor() as u64;
    let blocks = rows.div_ceil(rows_per_block(t));
    let r_part = (rows * (4 * groups + code)) as f64 * ratio;
    24 + 2 * r * cols
        + r_part.ceil() as u64
        + rows * (2 * r + w)
        + 2 * rows.min(cols)
        + (w + 4) * outliers
        + blocks * BLOCK_OVERHEAD
}

/// Indices of the rows sampled from `t`: `0, rows/S, 2·rows/S, …`.
fn sample_indices(t: &TensorDesc) -> impl Iterator<Item = usize> {
    let (rows, s) = (t.rows(), sample_count(t));
    (0..s).map(move |k| (k * rows / s) as usize)
}

/// How much a unit of squared weight error in tensor `name` costs the model, relative
/// to most tensors, for NDSQ's scalar groups (`--bpw-codec sq`). A heuristic per role,
/// not a measurement of this model: llama.cpp's k-quant mixes spend about two more bits
/// per weight on the output projection (which the embedding is when the model ties
/// them: `tied`) and about one more on attn_v and ffn_down; with error falling 4× per
/// bit, factors of 16 and 4 make the greedy do the same. ggml types are scored by
/// relative error instead ([`options_of`]).
fn sensitivity(name: &str, tied: bool) -> f64 {
    let output = name == "lm_head.weight" || (tied && name == "model.embed_tokens.weight");
    let ends = |s: &str| name.ends_with(s);
    if output {
        16.0
    } else if ends(".v_proj.weight") || ends(".down_proj.weight") {
        4.0
    } else {
        1.0
    }
}

/// Tensor `i`'s settings: its source bytes, then each scalar-R fit.
fn options_of(
    src: &dyn SourceModel,
    i: usize,
    opts: &ConvertOptions,
    type_rules: &[(Patterns, GgmlType)],
) -> Result<Vec<Setting>, ConvertError> {
    let t = &src.desc().tensors[i];
    let forced = type_rules
        .iter()
        .find(|(p, _)| p.is_match(&t.name))
        .map(|r| r.1);
    if let Some(ty) = forced {
        if !codec::ggml_fits(ty, t.cols()) {
            return Err(ConvertError::Options(format!(
                "--type-for: {} cannot be {}: its rows of {} values are not whole blocks",
                t.name,
                codec::format_label(crate::model::SourceType::Ggml(ty)),
                t.cols()
            )));
        }
    }
    let raw = src.raw(i)?;
    let rb = row_bytes(t)? as usize;
    let raw_sample: Vec<u8> = sample_indices(t)
        .flat_map(|r| raw[r * rb..(r + 1) * rb].iter().copied())
        .collect();
    drop(raw);
    let mut all = Vec::new();
    if forced.is_none() {
        all.push(Setting {
            choice: Choice::Source,
            bits: source_bytes(t, ratio(&raw_sample, opts))? as f64 * 8.0,
            err: 0.0,
        });
    }
    // Below the cheapest ggml type of a tensor (IQ4_NL's 4.5 bits where the width is
    // not a multiple of 256), only scalar groups of 2 and 3 bits reach low targets.
    let fits: Vec<SqParams> = match forced {
        Some(_) => Vec::new(),
        None => settings_for(t.cols())
            .into_iter()
            .filter(|p| opts.bpw_sq || p.bits <= LOW_SQ_BITS)
            .collect(),
    };
    let types: Vec<GgmlType> = GGML_TYPES
        .iter()
        .copied()
        .filter(|&ty| match forced {
            Some(f) => ty == f,
            None => {
                !opts.bpw_sq
                    && codec::ggml_fits(ty, t.cols())
                    && opts.bpw_types.as_ref().is_none_or(|l| l.contains(&ty))
            }
        })
        .collect();
    if (fits.is_empty() && types.is_empty()) || t.rows() == 0 {
        return Ok(all);
    }
    let w = src.f32(i)?;
    if !w.iter().all(|x| x.is_finite()) {
        // Neither codes it (the encoder would keep it exact too).
        return Ok(vec![Setting {
            choice: Choice::Source,
            bits: source_bytes(t, ratio(&raw_sample, opts))? as f64 * 8.0,
            err: 0.0,
        }]);
    }
    let cols = t.cols() as usize;
    let sample: Vec<f32> = sample_indices(t)
        .flat_map(|r| w[r * cols..(r + 1) * cols].iter().copied())
        .collect();
    drop(w);
    let imp = match &opts.imatrix {
        Some(m) => m.for_tensor(&t.name, t.cols())?,
        None => None,
    };
    // ggml types: each tensor's error relative to its mean square weight, every tensor
    // alike. On the rotated float SmolLM2 with error feedback (docs/CODECS.md) this
    // halved the KLD at 5.5 and 6.5 bits against absolute error with role factors,
    // which spent Q8_0 on queries and keys and IQ4_NL on the MLP.
    let role = if opts.bpw_sq {
        let tied = src.desc().tensor_index("lm_head.weight").is_none();
        sensitivity(&t.name, tied)
    } else {
        let ms =
            sample.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / sample.len().max(1) as f64;
        1.0 / ms.max(f64::MIN_POSITIVE)
    };
    let scale = role * t.rows() as f64 / sample_count(t) as f64
        * imp
            .map_or(Ok(1.0), |v| codec::median_column_scale(v, t.cols()))
            .map_err(|source| ConvertError::Codec {
                tensor: t.name.clone(),
                source,
            })?;
    let (rank, q) = (opts.ndsq.rank as u64, opts.ndsq.outlier_q);
    // A ggml plan's GGUF view rounds scalar groups of 2 or 3 bits again, into Q4_1
    // (layout's `grid_type`): the errors add, and the view's is what llama.cpp runs.
    let again = if !opts.bpw_sq && !fits.is_empty() && codec::ggml_fits(GgmlType::Q4_1, t.cols()) {
        codec::ggml_trial(&sample, t.cols(), GgmlType::Q4_1, imp)
            .map_err(|source| ConvertError::Codec {
                tensor: t.name.clone(),
                source,
            })?
            .0
    } else {
        0.0
    };
    let fed = opts.calibration.is_some() || opts.self_calibration.is_some();
    let unfed = if !opts.bpw_sq && fed { UNFED } else { 1.0 };
    for p in fits {
        let (err, payload) =
            codec::sq_trial(&sample, t.cols(), p, imp).map_err(|source| ConvertError::Codec {
                tensor: t.name.clone(),
                source,
            })?;
        all.push(Setting {
            choice: Choice::Sq(p),
            bits: sq_bytes(t, p, rank, q, ratio(&payload, opts)) as f64 * 8.0,
            err: (err + again) * scale * unfed,
        });
    }
    for ty in types {
        let (err, blocks) = codec::ggml_trial(&sample, t.cols(), ty, imp).map_err(|source| {
            ConvertError::Codec {
                tensor: t.name.clone(),
                source,
            }
        })?;
        all.push(Setting {
            choice: Choice::Ggml(ty),
            bits: ggml_bytes(t, ty, ggml_ratio(ty, &blocks, opts)?) as f64 * 8.0,
            err: err * scale,
        });
    }
    Ok(all)
}

/// Scales each tensor's errors (relative error times its weights) to the output
/// divergence they cost: by its measured sensitivity over its weight count. A tensor
/// the probe did not reach takes the median measured factor.
fn weigh(src: &dyn SourceModel, s: &Sensitivity, options: &mut [Vec<Setting>]) {
    let tensors = &src.desc().tensors;
    let factor = |i: usize| {
        let t = &tensors[i];
        s.per_tensor
            .get(&t.name)
            .map(|c| c / t.numel().max(1) as f64)
    };
    let mut known: Vec<f64> = (0..tensors.len()).filter_map(factor).collect();
    known.sort_by(f64::total_cmp);
    let median = known.get(known.len() / 2).copied().unwrap_or(1.0);
    for (i, o) in options.iter_mut().enumerate() {
        let f = factor(i).unwrap_or(median);
        o.iter_mut().for_each(|s| s.err *= f);
    }
}

/// The tensors planned as one: each alone, but a stack of experts together when all
/// of them were priced for the same settings (same shape; none kept exact for
/// non-finite values). In tensor order of each unit's first member.
fn units(src: &dyn SourceModel, options: &[Vec<Setting>]) -> Vec<Vec<usize>> {
    let desc = src.desc();
    let arch = desc.arch.gguf_arch.as_deref().unwrap_or_default();
    let mut stacks: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, t) in desc.tensors.iter().enumerate() {
        match names::hf_expert_to_gguf_in(arch, &t.name) {
            Some((stack, _)) => stacks.entry(stack).or_default().push(i),
            None => out.push(vec![i]),
        }
    }
    let same = |a: &[Setting], b: &[Setting]| {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.choice == y.choice)
    };
    for members in stacks.into_values() {
        let first = &options[members[0]];
        if members.iter().all(|&i| same(&options[i], first)) {
            out.push(members);
        } else {
            out.extend(members.into_iter().map(|i| vec![i]));
        }
    }
    out.sort_by_key(|u| u[0]);
    out
}

/// The options on the lower convex hull of (bits, error), cheapest first: each step
/// to the next costs more bits and removes less error per bit than the step before.
fn lower_hull(mut all: Vec<Setting>) -> Vec<Setting> {
    // By bits, then error; a dearer option with no less error is never worth it.
    all.sort_by(|a, b| a.bits.total_cmp(&b.bits).then(a.err.total_cmp(&b.err)));
    let mut hull: Vec<Setting> = Vec::new();
    for o in all {
        if hull.last().is_some_and(|l| o.err >= l.err) {
            continue;
        }
        // Drop the last point while it lies on or above the line from the one before
        // it to `o` (its step is worth less per bit than the step after it).
        while hull.len() >= 2 {
            let (a, b) = (hull[hull.len() - 2], hull[hull.len() - 1]);
            let cross = (b.bits - a.bits) * (o.err - a.err) - (b.err - a.err) * (o.bits - a.bits);
            if cross <= 0.0 {
                hull.pop();
            } else {
                break;
            }
        }
        hull.push(o);
    }
    hull
}

/// Plans every tensor of `src` for `target` bits per weight of the whole archive.
/// Tensors `pass` forces (1-D ones, `--passthrough` patterns) keep their source bytes
/// and count against the budget; `reserved` bytes (META, ROUTING, the header) too.
pub fn plan(
    src: &dyn SourceModel,
    opts: &ConvertOptions,
    pass: &Patterns,
    target: f64,
    reserved: u64,
    sensitivity: &mut dyn FnMut() -> Result<Option<Sensitivity>, ConvertError>,
    progress: &(dyn Fn(usize, usize, &str) + Sync),
) -> Result<Plan, ConvertError> {
    let desc = src.desc();
    let n = desc.tensors.len();
    let total_weights: u64 = desc.tensors.iter().map(|t| t.numel()).sum();
    let type_rules = opts.type_rules()?;
    let mut options: Vec<Vec<Setting>> = Vec::with_capacity(n);
    super::in_windows(
        n,
        opts.window,
        |i| {
            let t = &desc.tensors[i];
            if is_passthrough(t, pass) {
                // Small (norms) or the user's: priced uncompressed.
                Ok(vec![Setting {
                    choice: Choice::Source,
                    bits: source_bytes(t, 1.0)? as f64 * 8.0,
                    err: 0.0,
                }])
            } else {
                options_of(src, i, opts, &type_rules)
            }
        },
        |i, h| {
            options.push(h);
            progress(i + 1, n, &desc.tensors[i].name);
            Ok(())
        },
    )?;
    // With error feedback from the pass, leave out of layer matrices the types llama.cpp
    // runs slower on the CPU, unless a matrix lies on their grid. Without feedback they
    // stay: IQ4_NL's plain rounding is then too coarse to stand in for them (MiniLM's
    // sentence embeddings fell below the 0.98 cosine they keep with Q5_0).
    let fed = opts.calibration.is_some() || opts.self_calibration.is_some();
    if opts.bpw_types.is_none() && fed && super::calibrate::runs(src) {
        for (o, t) in options.iter_mut().zip(&desc.tensors) {
            if names::layer_of(&t.name).is_some() {
                o.retain(|s| match s.choice {
                    Choice::Ggml(ty) => !SLOW_ON_CPU.contains(&ty) || s.err == 0.0,
                    _ => true,
                });
            }
        }
    }
    let units = units(src, &options);
    let budget0 = target * total_weights as f64 - reserved as f64 * 8.0;
    // Measured only when the plan must trade error for bits: not when every tensor
    // fits exact (a source already on a ggml grid, a generous target).
    let exact: f64 = units
        .iter()
        .map(|members| {
            let zero = |m: usize| {
                options[m]
                    .iter()
                    .filter(|o| o.err == 0.0)
                    .map(|o| o.bits)
                    .fold(f64::INFINITY, f64::min)
            };
            members.iter().map(|&m| zero(m)).sum::<f64>()
        })
        .sum();
    if exact > budget0 && options.iter().any(|o| o.len() > 1) {
        if let Some(s) = sensitivity()? {
            weigh(src, &s, &mut options);
        }
    }
    let hulls_of = |low_sq: bool| -> Vec<Vec<Setting>> {
        units
            .iter()
            .map(|members| {
                let mut sum = options[members[0]].clone();
                for &m in &members[1..] {
                    for (s, o) in sum.iter_mut().zip(&options[m]) {
                        s.bits += o.bits;
                        s.err += o.err;
                    }
                }
                // A ggml plan takes scalar groups only where its types cannot meet
                // the target: the GGUF view would round them again.
                if !low_sq && sum.iter().any(|o| !matches!(o.choice, Choice::Sq(_))) {
                    sum.retain(|o| !matches!(o.choice, Choice::Sq(_)));
                }
                lower_hull(sum)
            })
            .collect()
    };
    let mut hulls = hulls_of(opts.bpw_sq);
    if hulls.iter().map(|h| h[0].bits).sum::<f64>() > budget0 {
        hulls = hulls_of(true);
    }
    let n = units.len();
    let mut budget = budget0;
    let mut at = vec![0usize; n];
    let mut used: f64 = hulls.iter().map(|h| h[0].bits).sum();
    let at_floor = used > budget && opts.bpw_at_least_floor;
    if at_floor {
        budget = used;
    } else if used > budget {
        return Err(ConvertError::Options(format!(
            "--bpw {target} is below the smallest archive this model allows ({:.3} bits per weight)",
            (used + reserved as f64 * 8.0) / total_weights.max(1) as f64
        )));
    }
    // Greedy: the step removing the most error per bit that still fits. Every tensor's
    // steps come in falling order of worth (convex hull), so a heap of each tensor's
    // next step gives the global order.
    let worth = |h: &[Setting], k: usize| (h[k].err - h[k + 1].err) / (h[k + 1].bits - h[k].bits);
    let mut heap: std::collections::BinaryHeap<(Worth, std::cmp::Reverse<usize>)> = hulls
        .iter()
        .enumerate()
        .filter(|(_, h)| h.len() > 1)
        .map(|(i, h)| (Worth(worth(h, 0)), std::cmp::Reverse(i)))
        .collect();
    while let Some((_, std::cmp::Reverse(i))) = heap.pop() {
        let h = &hulls[i];
        let k = at[i];
        let more = h[k + 1].bits - h[k].bits;
        if used + more > budget {
            // This tensor's later steps cost more still: it stays where it is.
            continue;
        }
        used += more;
        at[i] = k + 1;
        if k + 2 < h.len() {
            heap.push((Worth(worth(h, k + 1)), std::cmp::Reverse(i)));
        }
    }
    let mut choices = vec![Choice::Source; desc.tensors.len()];
    for ((members, h), &k) in units.iter().zip(&hulls).zip(&at) {
        for &m in members {
            choices[m] = h[k].choice;
        }
    }
    Ok(Plan {
        choices,
        planned_bpw: (used + reserved as f64 * 8.0) / total_weights.max(1) as f64,
        target_bpw: target,
        at_floor,
    })
}

/// The measured sensitivities `--bpw` planned with ([`super::calibrate::probe`]).
#[derive(Clone, Debug, serde::Serialize)]
pub struct SensitivityUse {
    pub tokens: u64,
    pub seconds: f64,
    /// Tensors measured.
    pub tensors: usize,
    /// Why none could be (then the plan weighs every tensor's relative error alike).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// The sensitivities a ggml `--bpw` plan weighs each tensor's relative error by: of
/// every 2-D tensor it may round, over `self_calibration`'s text. None without a text,
/// with `sensitivity_tokens` 0 or for a scalar-group plan (whose role factors scale
/// absolute error).
pub(super) fn measure_sensitivity(
    src: &dyn SourceModel,
    opts: &ConvertOptions,
    pass: &Patterns,
) -> Result<(Option<SensitivityUse>, Option<Sensitivity>), ConvertError> {
    let Some(cal) = &opts.self_calibration else {
        return Ok((None, None));
    };
    if opts.sensitivity_tokens == 0 || opts.bpw_sq {
        return Ok((None, None));
    }
    let wanted: std::collections::HashSet<String> = src
        .desc()
        .tensors
        .iter()
        .filter(|t| t.shape.len() == 2 && !is_passthrough(t, pass))
        .map(|t| t.name.clone())
        .collect();
    if wanted.is_empty() {
        return Ok((None, None));
    }
    let t0 = std::time::Instant::now();
    let s = crate::convert::calibrate::probe::probe(src, cal, &wanted, opts.sensitivity_tokens)?;
    let used = SensitivityUse {
        tokens: s.as_ref().map_or(0, |s| s.tokens as u64),
        seconds: t0.elapsed().as_secs_f64(),
        tensors: s.as_ref().map_or(0, |s| s.per_tensor.len()),
        skipped: s.as_ref().err().cloned(),
    };
    Ok((Some(used), s.ok()))
}

/// An f64 ordered by `total_cmp`, for the heap.
#[derive(Clone, Copy, PartialEq)]
struct Worth(f64);
impl Eq for Worth {}
impl PartialOrd for Worth {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Worth {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(bits: f64, err: f64) -> Setting {
        Setting {
            choice: Choice::Source,
            bits,
            err,
        }
    }

    #[test]
    fn settings_divide_the_width() {
        let of = |cols| -> Vec<(u32, u32)> {
            settings_for(cols)
                .iter()
                .map(|p| (p.bits, p.group))
                .collect()
        };
        assert_eq!(of(576).len(), 18);
        assert!(of(576).contains(&(5, 192)) && !of(576).iter().any(|p| p.1 == 256));
        assert!(of(2048).contains(&(4, 256)));
        assert!(of(160).iter().all(|p| p.1 == 32));
        assert!(of(100).is_empty());
    }

    #[test]
    fn hull_drops_dominated_and_concave_points() {
        let h = lower_hull(vec![
            o(10.0, 0.0),
            o(2.0, 100.0),
            o(3.0, 60.0),
            o(4.0, 50.0), // above the line from 3 to 5
            o(5.0, 20.0),
            o(6.0, 30.0), // dominated by 5
            o(12.0, 0.0), // dominated by 10
        ]);
        let pts: Vec<(f64, f64)> = h.iter().map(|x| (x.bits, x.err)).collect();
        assert_eq!(
            pts,
            vec![(2.0, 100.0), (3.0, 60.0), (5.0, 20.0), (10.0, 0.0)]
        );
    }
}
